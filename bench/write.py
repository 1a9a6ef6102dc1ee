"""Write-path benchmark: the GPU consumer's sample-file writes vs a raw sequential write of the
same bytes to the same disk.

hsx path: `gpu_consumer.writer.write_sample_file` for every sample, on a pool of
`ConsumerConfig.writer_threads` threads as the consumer runs it: safetensors layout, checksum of
the data and digest (hsx.storage.samplefile, one pass), atomic temp file + fsync + rename + directory
fsync, 0600 files in 0700 shard directories.

Baselines, same bytes, same directory's disk, measured in the same run:
- raw_one_file: one thread writes all the hidden-state bytes to one file, then one fsync (the
  disk's sequential write speed as a plain program sees it);
- raw_per_file: one thread writes each sample's bytes to its own file with an fsync each (what
  the durability of one file per sample costs by itself).

The target (issue 5) is hsx / raw_one_file >= 0.8. Samples are Qwen3-8B-shaped by default
(hidden 4096, 5 layers, bf16: 40 KiB per token) with lognormal lengths (median 500, max 4096).

Run: python bench/write.py [--samples 64] [--repeats 5] [--dir /path/on/the/disk]
Prints one JSON object; figures are medians over --repeats; files are deleted between passes.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hsx.commands.embedded import synthetic_lengths  # noqa: E402
from hsx.gpu_consumer.config import ConsumerConfig  # noqa: E402
from hsx.gpu_consumer.writer import write_sample_file  # noqa: E402
from hsx.job import JobSpec  # noqa: E402
from hsx.storage.layout import SampleFiles
from hsx.wire.schemas import Sample


def _spec(layers: int, samples: int) -> JobSpec:
    return JobSpec(
        job="bench",
        model="bench",
        model_revision="none",
        layers=list(range(layers)),
        dtype="bfloat16",
        dest="file:///dev/null",
        token_budget=0,
        max_seq_len=0,
        dataset="synthetic",
        plan_fingerprint="x",
        total_samples=samples,
        total_tokens=0,
        total_batches=0,
        created_at=0.0,
    )


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="writer threads (default: the consumer's)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    threads = args.threads or ConsumerConfig.__dataclass_fields__["writer_threads"].default

    lengths = synthetic_lengths(args.samples, median=500, max_len=args.max_len, seed=0).tolist()
    rng = np.random.default_rng(0)
    samples = [
        Sample(index=i, source_id=str(i), input_ids=rng.integers(0, 32000, size=n).tolist())
        for i, n in enumerate(lengths)
    ]
    hidden = [torch.randn(n, args.layers, args.hidden).to(torch.bfloat16) for n in lengths]
    raw = [memoryview(h.view(torch.uint8).numpy()).cast("B") for h in hidden]
    spec = _spec(args.layers, len(samples))
    root = Path(tempfile.mkdtemp(prefix="hsx-bench-write-", dir=args.dir))

    def hsx_pass() -> int:
        spool = root / "spool"
        with ThreadPoolExecutor(max_workers=threads) as pool:
            files = list(
                pool.map(
                    lambda i: write_sample_file(
                        spool=spool,
                        files=SampleFiles.of(spec),
                        node="n",
                        batch_id="b",
                        sample=samples[i],
                        hidden_states=hidden[i],
                    ),
                    range(len(samples)),
                )
            )
        return sum(f.size for f in files)

    def raw_one_file() -> int:
        fd = os.open(root / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for data in raw:
                _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return sum(d.nbytes for d in raw)

    def raw_per_file() -> int:
        (root / "raw").mkdir(exist_ok=True)
        for i, data in enumerate(raw):
            fd = os.open(root / "raw" / f"{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        return sum(d.nbytes for d in raw)

    def clean() -> None:
        for name in ("spool", "raw", "raw.bin"):
            path = root / name
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        os.sync()

    rates: dict[str, list[float]] = {"hsx": [], "raw_one_file": [], "raw_per_file": []}
    paths = {"hsx": hsx_pass, "raw_one_file": raw_one_file, "raw_per_file": raw_per_file}
    try:
        for _ in range(args.repeats):
            for name, run in paths.items():  # interleaved, so drift in the disk hits all alike
                clean()
                start = time.perf_counter()
                written = run()
                rates[name].append(written / (time.perf_counter() - start))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = {name: statistics.median(values) for name, values in rates.items()}
    print(
        json.dumps(
            {
                "samples": len(samples),
                "tokens": sum(lengths),
                "hidden_state_bytes": sum(d.nbytes for d in raw),
                "shape_per_token": [args.layers, args.hidden],
                "writer_threads": threads,
                "cpus": os.cpu_count(),
                "gb_per_s": {name: round(value / 1e9, 3) for name, value in median.items()},
                "hsx_vs_raw_one_file": round(median["hsx"] / median["raw_one_file"], 3),
                "hsx_vs_raw_per_file": round(median["hsx"] / median["raw_per_file"], 3),
                "repeats": args.repeats,
                "raw_gb_per_s": {name: [round(v / 1e9, 3) for v in values] for name, values in rates.items()},
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
