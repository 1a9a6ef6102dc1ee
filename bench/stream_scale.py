"""JobStream's parts at a real job's size (914,000 samples): what following a finished job costs
before the first file is read, and in what memory.

A nats-server started here (temp store) holds a fake job: its JobSpec in `hsx_jobs` and one
`uploaded` marker per sample (16 to 4,096 tokens, log-uniform, seeded), with the headers and
payload `EventPublisher.mark` gives one, sent by core NATS publishes (no per-message ack), a flush
every CHUNK; the publish rate counts until JetStream holds them all. Then, each --repeats times,
the median reported:

- `replay`: `LandingFeed` over the job (its `EpochEnd` known) iterated to the end, what a
  restarted trainer or a later epoch reads before its first batch; seconds, markers/s, and the
  seconds to the first sample;
- `batcher`: `LandingBatcher(token_budget=65536)` over the replayed samples, for each shuffle
  pool (0, 1024, 16384): seconds, samples/s, batches, padding efficiency (real tokens / padded
  tokens), and `deal` of its batches to rank 0 of 4; the markers land in the plan's order (as a
  job's do: rounds of 100,000 rows, each planned longest first), and the padding efficiency is
  given for a random landing order too (the worst case);
- `shuffled`: `shuffled_batches` of epoch 1 from the landing order's arrays, iterated to the end.

Peak RSS (ru_maxrss) after each phase. And in a fresh process, what one replay adds to the RSS
(the peak, VmHWM, over VmRSS before; ru_maxrss would carry this process's peak over fork and
exec): with the trainer taking nothing for --stall-s (as while it loads and compiles its model),
then everything (closed if not over GIVE_UP_S later); the samples it was handed (`lost`, and
whether the `EpochEnd` came) and the NATS client's slow-consumer warnings (one a marker dropped).

    .venv/bin/python bench/stream_scale.py --samples 914000 [--repeats 3]

Prints one JSON object.
"""

import argparse
import asyncio
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nats  # noqa: E402
import numpy as np  # noqa: E402

from hsx.commands.embedded import start_nats_server  # noqa: E402
from hsx.job import JobSpec
from hsx.packing import plan_batches, plan_in_rounds  # noqa: E402
from hsx.storage.streambatches import Batch, LandingBatcher, deal, shuffled_batches  # noqa: E402
from hsx.wire import schemas, topology  # noqa: E402
from hsx.wire.counts import count_stored, last_sequence  # noqa: E402
from hsx.wire.headers import message_headers  # noqa: E402
from hsx.wire.landed import EpochEnd, Landed, LandingFeed  # noqa: E402
from hsx.wire.natsconn import NatsSettings  # noqa: E402

JOB = "bench-stream"
BUDGET = 65536
POOLS = (0, 1024, 16384)
REPLICAS = 4
CHUNK = 10_000  # markers published between flushes
ROUND_ROWS = 100_000  # hsx produce's --round-rows default
EXTRACT_BUDGET = 16_384  # the extraction's --token-budget
GIVE_UP_S = 120.0  # the fresh process's replay, after its stall


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def job_spec(lengths: np.ndarray) -> JobSpec:
    return JobSpec(
        job=JOB,
        model="Qwen/Qwen3-8B",
        model_revision="b968826d9c46dd6066d109eabc6255188de91218",
        layers=[2, 18, 33, "final"],
        dtype="bfloat16",
        dest="s3://bench-bucket/hsx",
        token_budget=BUDGET,
        max_seq_len=4096,
        dataset="bench.parquet",
        plan_fingerprint=hashlib.sha256(b"bench-stream-plan").hexdigest(),
        total_samples=len(lengths),
        total_tokens=int(lengths.sum()),
        total_batches=len(plan_batches(lengths, token_budget=BUDGET)),
        created_at=time.time(),
        published=True,
    )


def landing_order(lengths: np.ndarray) -> np.ndarray:
    """The samples in the order of the producer's plan (rounds of ROUND_ROWS rows, each planned
    longest first at EXTRACT_BUDGET tokens a batch): the order their uploads land in."""
    starts = list(range(0, len(lengths), ROUND_ROWS))
    batches = plan_in_rounds(lengths, starts, token_budget=EXTRACT_BUDGET)
    return np.fromiter((i for batch in batches for i in batch.sample_indices), dtype=np.int64, count=len(lengths))


async def publish(url: str, spec: JobSpec, lengths: np.ndarray) -> dict:
    """Record the job and publish its markers; the rate counts until JetStream holds them all.
    `end_seq`: the stream sequence of the last marker."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        kv = await topology.ensure_topology(js)
        await kv.put(JOB, schemas.encode(spec))
        plan, digest, total = spec.plan_tag, hashlib.sha256(b"sample").hexdigest(), len(lengths)
        started = time.monotonic()
        # In the order a job lands them: its plan's batches, longest first within each round.
        for n, i in enumerate(landing_order(lengths).tolist()):
            tokens = int(lengths[i])
            event = schemas.FileUploaded(
                job=JOB,
                node="node-0",
                uploader="node-0-up-0",
                sample_index=i,
                key=f"{JOB}/{plan}/{i:08d}.safetensors",
                size=tokens * 4 * 4096 * 2,
                tokens=tokens,
                plan=plan,
                digest=digest,
            )
            headers = {**message_headers(JOB, sample=i), **topology.ONCE_HEADERS}  # as EventPublisher.mark's
            await nc.publish(topology.uploaded_subject(JOB, plan, i), schemas.encode(event), headers=headers)
            if (n + 1) % CHUNK == 0:
                await nc.flush()
        await nc.flush()
        flushed = time.monotonic() - started
        markers = topology.marker_filter(JOB, "uploaded", plan)
        deadline = time.monotonic() + 60  # JetStream stores what core NATS delivered a little later
        while (
            stored := await count_stored(js, topology.EVENTS_STREAM, markers)
        ) < total and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if stored != total:
            raise SystemExit(f"JetStream holds {stored} of {total} markers under {markers}")
        seconds = time.monotonic() - started
        end_seq = await last_sequence(js, topology.EVENTS_STREAM, markers)
    finally:
        await nc.close()
    rate = round(total / seconds)
    return {"seconds": round(seconds, 2), "flushed_s": round(flushed, 2), "markers_per_s": rate, "end_seq": end_seq}


def feed_of(config: dict) -> LandingFeed:
    end = EpochEnd(end_seq=config["end_seq"], done=True, total_samples=config["samples"])
    settings = NatsSettings(url=config["url"])
    return LandingFeed(settings, JOB, name="bench", plan=config["plan"], created_at=config["created_at"], end=end)


def replay(config: dict) -> tuple[float, float, list[Landed]]:
    """(seconds to the end, seconds to the first sample, the samples in landing order)."""
    started, first, landed = time.monotonic(), None, []
    feed = feed_of(config).start()
    try:
        for item in feed:
            if isinstance(item, Landed):
                first = first or time.monotonic() - started
                landed.append(item)
    finally:
        feed.close()
    if len(landed) != config["samples"]:
        raise SystemExit(f"the replay handed over {len(landed)} samples of {config['samples']}")
    return time.monotonic() - started, first, landed


def vm_mb(field: str) -> float:
    """This process's VmRSS (now) or VmHWM (peak) in MB; VmHWM starts anew at exec."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return round(int(status[field].split()[0]) / 1024, 1)


def replay_rss(config: dict, stall_s: float) -> dict:
    """In a fresh process: how much one replay adds to the RSS, stalled and at its end; whether
    its epoch ended (a replay not over GIVE_UP_S after the stall is closed)."""
    before = vm_mb("VmRSS")
    feed = feed_of(config).start()
    give_up = threading.Timer(stall_s + GIVE_UP_S, feed.close)
    give_up.start()
    try:
        time.sleep(stall_s)
        stalled = vm_mb("VmHWM")
        taken = Counter(type(item).__name__ for item in feed)
    finally:
        give_up.cancel()
        feed.close()
    grown = {"stalled": round(stalled - before, 1), "end": round(vm_mb("VmHWM") - before, 1)}
    lost = config["samples"] - taken["Landed"]
    return {
        "before_mb": before,
        "growth_mb": grown,
        "samples": taken["Landed"],
        "lost": lost,
        "epoch_end": taken["EpochEnd"] == 1,
    }


def padding_efficiency(batches) -> float:
    """Real tokens / padded tokens (each batch's size x its longest sample) of `batches`."""
    tokens = padded = 0
    for batch in batches:
        if batch:
            lengths = [s.tokens for s in batch]
            tokens, padded = tokens + sum(lengths), padded + len(lengths) * max(lengths)
    return round(tokens / padded, 4)


def timed(call, *args) -> tuple[float, Any]:
    started = time.monotonic()
    out = call(*args)
    return time.monotonic() - started, out


def count(items: Iterable) -> int:
    return sum(1 for _ in items)


def cut(landed: list[Landed], pool: int) -> list[Batch]:
    cutter, batches = LandingBatcher(token_budget=BUDGET, shuffle_pool=pool, seed=0), []
    for sample in landed:
        batches += cutter.push(sample)
    return batches + cutter.finish()


def epoch_one(indices: np.ndarray, tokens: np.ndarray) -> Iterator[Batch]:
    return shuffled_batches(indices, tokens, token_budget=BUDGET, max_batch_size=None, seed=0, epoch=1)


def median_rate(runs: list[float], samples: int) -> dict:
    seconds = round(statistics.median(runs), 3)
    return {"seconds": seconds, "samples_per_s": round(samples / seconds)}


def measure(args, config: dict, rss: dict) -> dict:
    """The phases' figures; each phase's peak RSS into `rss`."""
    runs = []
    for _ in range(args.repeats):
        landed = None  # the previous run's samples, freed before the next run
        seconds, first, landed = replay(config)
        runs.append((seconds, first))
    result = {"replay": median_rate([s for s, _ in runs], args.samples)}
    result["replay"] |= {
        "runs_s": [round(s, 2) for s, _ in runs],
        "first_sample_s": round(statistics.median(f for _, f in runs), 3),
    }
    rss["replay"] = peak_rss_mb()
    for pool in POOLS:
        cuts = [timed(cut, landed, pool) for _ in range(args.repeats)]
        batches = cuts[-1][1]
        deals = [timed(count, deal(batches, num_replicas=REPLICAS, rank=0)) for _ in range(args.repeats)]
        shuffled_landing = [landed[i] for i in np.random.default_rng(0).permutation(len(landed))]
        result[f"batcher_pool_{pool}"] = median_rate([s for s, _ in cuts], args.samples) | {
            "batches": len(batches),
            "padding_efficiency": padding_efficiency(batches),
            "padding_efficiency_random_landing": padding_efficiency(cut(shuffled_landing, pool)),
            "deal_s": round(statistics.median(s for s, _ in deals), 3),
            "rank0_batches": deals[-1][1],
        }
        del cuts, batches, shuffled_landing
        rss[f"batcher_pool_{pool}"] = peak_rss_mb()
    indices = np.fromiter((s.index for s in landed), dtype=np.int64, count=len(landed))
    tokens = np.fromiter((s.tokens for s in landed), dtype=np.int64, count=len(landed))
    del landed
    epochs = [timed(count, epoch_one(indices, tokens)) for _ in range(args.repeats)]
    result["shuffled"] = median_rate([s for s, _ in epochs], args.samples) | {
        "batches": epochs[-1][1],
        "padding_efficiency": padding_efficiency(epoch_one(indices, tokens)),
    }
    rss["shuffled"] = peak_rss_mb()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=914_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stall-s", type=float, default=30.0, help="the stalled trainer of the RSS check")
    parser.add_argument("--replay-rss", help=argparse.SUPPRESS)  # the fresh process's replay (JSON config)
    args = parser.parse_args()
    if args.replay_rss:
        print(json.dumps(replay_rss(json.loads(args.replay_rss), args.stall_s)))
        return

    rng = np.random.default_rng(args.seed)
    lengths = np.rint(np.exp(rng.uniform(np.log(16), np.log(4096), args.samples))).astype(np.int64)
    spec = job_spec(lengths)
    result = {"cores": os.cpu_count(), "samples": args.samples, "tokens": spec.total_tokens, "repeats": args.repeats}
    with tempfile.TemporaryDirectory(prefix="hsx-stream-scale-") as tmp:
        server = start_nats_server(Path(tmp) / "nats", log_file=Path(tmp) / "nats-server.log")
        try:
            result["publish"] = asyncio.run(publish(server.url, spec, lengths))
            print(json.dumps({"publish": result["publish"]}), file=sys.stderr)
            config = {
                "url": server.url,
                "plan": spec.plan_tag,
                "created_at": spec.created_at,
                "end_seq": result["publish"]["end_seq"],
                "samples": args.samples,
            }
            result["rss_mb"] = {"publish": peak_rss_mb()}
            result |= measure(args, config, result["rss_mb"])
            isolated = subprocess.run(
                [sys.executable, __file__, "--replay-rss", json.dumps(config), "--stall-s", str(args.stall_s)],
                check=True,
                capture_output=True,
                text=True,
            )
            fresh = json.loads(isolated.stdout.splitlines()[-1])
            result["replay_fresh_process"] = fresh | {"slow_consumer_warnings": isolated.stdout.count("slow consumer")}
        finally:
            server.stop()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
