"""CPU benchmark: the speculators export's token table (`hsx export --to speculators`, the datasets
folder beside `hidden_states/`) for a 1M-sample job, in bounded memory against the whole table
in memory.

A synthetic job of --samples samples (lognormal lengths around --median-tokens, 16 to 4,096; 9 of
10 rows with a loss mask) is built as the export builds it from the bundle's tokens.arrow: a
`SampleTable`, whose tokens are spilled to disk. Then, each in its own process (so that peak RSS
is the writer's alone), the table is written:
- `streamed`: `hsx.storage.trainers.speculators.write_speculators_table`, run by run into one
  Arrow file that datasets maps from disk and cuts into 500 MB shards;
- `in_memory`: the writer as it was before (kept here as the baseline): every token and mask in
  two int64 NumPy arrays, one `pa.table`, `datasets.Dataset(table).save_to_disk`.
Each child reports seconds, its peak RSS above what it held before writing (the table's own
arrays, ~60 bytes a sample, are in both) and its peak anonymous RSS above the same (sampled: the
file pages of the streamed writer's mapped rows file count in RSS but are dropped under memory
pressure, so the anonymous peak is what must fit); the parent checks both folders with datasets'
`load_from_disk`: the same rows, and sample rows equal to the table's.

Run: python bench/export_table.py [--samples 1000000] [--median-tokens 100]
Prints one JSON object.
"""

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hsx.storage.tokens import SampleTable, SampleTableBuilder, TokenChunk  # noqa: E402
from hsx.storage.trainers.speculators import write_speculators_table  # noqa: E402

CHUNK = 65_536


def synthetic_table(samples: int, median_tokens: int, seed: int = 0) -> SampleTable:
    rng = np.random.default_rng(seed)
    builder = SampleTableBuilder()
    for first in range(0, samples, CHUNK):
        rows = min(CHUNK, samples - first)
        lengths = np.clip(rng.lognormal(np.log(median_tokens), 0.9, rows).astype(np.int64), 16, 4096)
        offsets = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        has_mask = rng.random(rows) < 0.9
        masks = (rng.random(int(offsets[-1])) < 0.7).astype(np.uint8)
        masks[~np.repeat(has_mask, lengths)] = 0
        names = pa.array([f"row-{first + k}" for k in range(rows)], pa.string())
        builder.add(
            TokenChunk(
                values=rng.integers(0, 150_000, int(offsets[-1])),
                offsets=offsets,
                masks=masks,
                has_mask=has_mask,
                source_ids=names,
                wheres=names,
            )
        )
    return builder.finish()


def in_memory_table(out: Path, table: SampleTable) -> None:
    """The writer before the streamed one (hsx/storage/trainers.py at a5bc313): the baseline."""
    import datasets

    lengths = np.asarray(table.lengths, dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.empty(int(offsets[-1]), dtype=np.int64)
    masks = np.ones(int(offsets[-1]), dtype=np.int64)
    for i in range(len(lengths)):
        start, end = offsets[i], offsets[i + 1]
        ids[start:end] = table.input_ids(i)
        mask = table.loss_mask(i)
        if mask is not None:
            masks[start:end] = mask
    arrow = pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
            "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(masks)),
            "seq_len": pa.array(lengths),
        }
    )
    dataset = datasets.Dataset(arrow)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(out), max_shard_size="500MB")


def current_rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1e3  # kB
    raise AssertionError(field)


class AnonPeak(threading.Thread):
    """Peak anonymous RSS (RssAnon: what cannot be dropped under memory pressure), sampled every
    20 ms; the kernel keeps a peak only of the whole RSS, which also counts the file pages of a
    mapped file that is read through."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = 0.0, True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, current_rss_mb("RssAnon"))
            time.sleep(0.02)


def child(args) -> int:
    table = synthetic_table(args.samples, args.median_tokens)
    before, anon_before = current_rss_mb(), current_rss_mb("RssAnon")
    out = Path(args.out)
    out.mkdir(parents=True)
    sampler = AnonPeak()
    sampler.start()
    started = time.perf_counter()
    (write_speculators_table if args.child == "streamed" else in_memory_table)(out, table)
    seconds = time.perf_counter() - started
    sampler.running = False
    sampler.join()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # KiB on Linux
    result = {
        "seconds": round(seconds, 2),
        "rss_before_mb": round(before),
        "peak_above_mb": round(peak - before),
        "anon_peak_above_mb": round(sampler.peak - anon_before),
    }
    print(json.dumps(result))
    return 0


def check(out: Path, table: SampleTable) -> None:
    import datasets

    loaded = datasets.load_from_disk(str(out))
    assert len(loaded) == len(table), (len(loaded), len(table))
    for row in np.random.default_rng(1).integers(0, len(table), 200).tolist() + [0, len(table) - 1]:
        got = loaded[row]
        assert got["input_ids"].tolist() == table.input_ids(row).tolist(), row
        mask = table.loss_mask(row)
        expected = [1] * int(table.lengths[row]) if mask is None else mask.tolist()
        assert got["loss_mask"].tolist() == expected, row
        assert int(got["seq_len"]) == table.lengths[row], row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--median-tokens", type=int, default=100)
    parser.add_argument("--child", choices=["streamed", "in_memory"])
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        return child(args)
    work = Path(tempfile.mkdtemp(prefix="hsx-bench-export-table-"))
    try:
        result: dict = {"samples": args.samples}
        for name in ("streamed", "in_memory"):
            command = [sys.executable, __file__, "--child", name, "--out", str(work / name)]
            command += ["--samples", str(args.samples), "--median-tokens", str(args.median_tokens)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            result[name] = json.loads(done.stdout.strip().splitlines()[-1])
        table = synthetic_table(args.samples, args.median_tokens)
        result["tokens"] = table.total_tokens
        for name in ("streamed", "in_memory"):
            check(work / name, table)
            result[name]["folder_mb"] = round(sum(p.stat().st_size for p in (work / name).iterdir()) / 1e6)
        result["anon_peak_ratio_in_memory_over_streamed"] = round(
            result["in_memory"]["anon_peak_above_mb"] / max(result["streamed"]["anon_peak_above_mb"], 1), 1
        )
        result["time_ratio_streamed_over_in_memory"] = round(
            result["streamed"]["seconds"] / result["in_memory"]["seconds"], 3
        )
        print(json.dumps(result, indent=2))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
