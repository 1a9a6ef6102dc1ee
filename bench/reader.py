"""Reader benchmark: HiddenStateDataset over S3 (moto) against plain boto3 `get_object` of the
same keys with the same concurrency.

The S3 server is moto's, in its own process (bench/upload.py starts it). The files are real hsx
sample files (bench/upload.py's: `gpu_consumer.writer.write_sample_file`, bf16, --layers x
--hidden per token, lognormal lengths), uploaded once under `<prefix>/<job>/` with the job's index
(`_hsx/index.arrow`), so the dataset opens through the index as a trainer's does.

Per repeat, interleaved, each over every sample:
- `boto3`: `--concurrency` threads, each a `get_object(...)["Body"].read()` of one key, one shared
  client with that many connections: bytes only, no decoding. The baseline.
- `dataloader`: `DataLoader(dataset, batch_size=None, num_workers=--concurrency)` (a worker
  process per connection), every item decoded to tensors.
- `prefetched`: `hsx.storage.reader.prefetched(dataset, ..., in_flight=--concurrency)` in one
  process, every item decoded.
Samples/s and MB/s (file bytes) are medians of --repeats; the ratios are against boto3 of the same
repeat. Goal (issue 13): dataloader / boto3 >= 0.9.

Run: .venv/bin/python bench/reader.py [--samples 200] [--concurrency 8] [--repeats 3]
Prints one JSON object.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import torch
from botocore.config import Config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.upload import JOB, _start_moto, _write_pristine  # noqa: E402
from hsx.storage.destinations import open_destination  # noqa: E402
from hsx.storage.index import make_index, write_index  # noqa: E402
from hsx.storage.reader import HiddenStateDataset, prefetched  # noqa: E402
from hsx.wire import schemas  # noqa: E402

PREFIX = "hs"


def _upload(root: Path, files: list[schemas.FileReady], bucket: str, concurrency: int) -> int:
    client = boto3.client("s3", config=Config(max_pool_connections=concurrency))
    client.create_bucket(Bucket=bucket)

    def put(event: schemas.FileReady) -> int:
        body = (root / event.spool_path).read_bytes()
        client.put_object(Bucket=bucket, Key=f"{PREFIX}/{event.spool_path}", Body=body)
        return len(body)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        total = sum(pool.map(put, files))
    # No bundle here, so the index is taken at its word (hsx/storage/index.py, read_index).
    index = make_index(
        job=JOB,
        plan="bench",
        total_samples=len(files),
        source="events",
        sample_index=[f.sample_index for f in files],
        size=[f.size for f in files],
        tokens=[f.num_tokens for f in files],
        digest=[f.digest for f in files],
    )
    write_index(open_destination(f"s3://{bucket}/{PREFIX}/{JOB}"), index)
    return total


def _boto3_pass(bucket: str, keys: list[str], concurrency: int) -> float:
    client = boto3.client("s3", config=Config(max_pool_connections=concurrency))
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        sizes = list(pool.map(lambda key: len(client.get_object(Bucket=bucket, Key=key)["Body"].read()), keys))
    assert len(sizes) == len(keys)
    return time.perf_counter() - started


def _dataloader_pass(url: str, concurrency: int, count: int) -> float:
    dataset = HiddenStateDataset(url, max_connections=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=concurrency, prefetch_factor=2)
    started = time.perf_counter()
    seen = sum(1 for _ in loader)
    assert seen == count
    return time.perf_counter() - started


def _prefetched_pass(url: str, concurrency: int, count: int) -> float:
    dataset = HiddenStateDataset(url, max_connections=concurrency)
    started = time.perf_counter()
    seen = sum(1 for _ in prefetched(dataset, range(len(dataset)), in_flight=concurrency))
    assert seen == count
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--median-len", type=int, default=300)
    parser.add_argument("--max-len", type=int, default=2048)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hsx-bench-reader-"))
    moto, endpoint = _start_moto(work / "moto.log")
    os.environ.update(
        {
            "AWS_ENDPOINT_URL_S3": endpoint,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": str(work / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(work / "aws-creds"),
        }
    )
    try:
        files = _write_pristine(args, work / "files")  # bench/upload.py's files: real, bf16
        bucket = "bench-reader"
        total_bytes = _upload(work / "files", files, bucket, args.concurrency)
        keys = [f"{PREFIX}/{f.spool_path}" for f in sorted(files, key=lambda f: f.sample_index)]
        url = f"s3://{bucket}/{PREFIX}/{JOB}"
        assert HiddenStateDataset(url).sample_tokens is not None, "the dataset did not open through the index"
        passes: dict[str, list[float]] = {"boto3": [], "dataloader": [], "prefetched": []}
        for _ in range(args.repeats):
            passes["boto3"].append(_boto3_pass(bucket, keys, args.concurrency))
            passes["dataloader"].append(_dataloader_pass(url, args.concurrency, len(keys)))
            passes["prefetched"].append(_prefetched_pass(url, args.concurrency, len(keys)))
        result = {
            "samples": len(keys),
            "bytes": total_bytes,
            "concurrency": args.concurrency,
            "repeats": args.repeats,
            "cpus": os.cpu_count(),
        }
        for name, seconds in passes.items():
            result[f"{name}_samples_per_s"] = round(len(keys) / statistics.median(seconds), 1)
            result[f"{name}_mb_per_s"] = round(total_bytes / 1e6 / statistics.median(seconds), 1)
        for name in ("dataloader", "prefetched"):
            ratios = [b / s for b, s in zip(passes["boto3"], passes[name])]
            result[f"{name}_vs_boto3"] = round(statistics.median(ratios), 3)
        print(json.dumps(result, indent=2))
        return 0
    finally:
        moto.terminate()
        moto.wait(10)


if __name__ == "__main__":
    sys.exit(main())
