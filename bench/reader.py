"""Reader benchmark: HiddenStateDataset over S3 (moto) against plain boto3 `get_object` of the
same keys with the same concurrency.

The S3 server is moto's, in its own process (bench/upload.py starts it). The files are real hsx
sample files (bench/upload.py's: `gpu_consumer.writer.write_sample_file`, bf16, --layers x
--hidden per token, lognormal lengths), uploaded once under `<prefix>/<job>/` with the job's index
(`_hsx/index.arrow`), so the dataset opens through the index as a trainer's does.

Steady state, as a training run spends its hours: every client, worker process and connection is
made before the clock starts (the DataLoaders keep their workers, `persistent_workers=True`, and
run one untimed epoch first; how long that first epoch took is reported on its own). Per repeat,
interleaved, each over every sample, `--concurrency` GETs in flight:
- `boto3`: that many threads, each a `get_object(...)["Body"].read()` of one key, one shared
  client with that many connections: bytes only, no decoding. The baseline.
- `dataloader`: what docs/training.md recommends: `DataLoader(dataset,
  batch_sampler=TokenBudgetSampler(dataset, token_budget=--token-budget),
  collate_fn=pack_collate, num_workers=--workers)`; each worker reads its batch's files on
  concurrency / workers threads (`HiddenStateDataset.__getitems__`) and packs them in shared memory.
- `dataloader_items`: `DataLoader(dataset, batch_size=None, num_workers=--concurrency)`, one item
  at a time, a worker process per connection: the plain way, for comparison.
- `dataloader_threads`: the batched DataLoader with `num_workers=0`: each batch's files read on
  --concurrency threads of the training process, one batch after the other.
- `prefetched_batches`: `DataLoader(PrefetchedBatches(dataset, sampler, in_flight=--concurrency),
  batch_size=None)`: the same batches, read ahead on threads across batch boundaries, in one
  process.
Samples/s and MB/s (file bytes) are medians of --repeats; the ratios are the medians of each
repeat's against boto3 of the same repeat. Goal (issue 13): dataloader / boto3 >= 0.9.

Run: .venv/bin/python bench/reader.py [--samples 200] [--concurrency 8] [--workers 4] [--repeats 5]
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

from bench.upload import JOB, _start_moto, _write_pristine, isolate_aws  # noqa: E402
from hsx.storage.index import make_index, write_index  # noqa: E402
from hsx.storage.location import Location, open_destination  # noqa: E402
from hsx.storage.reader import HiddenStateDataset, PrefetchedBatches, TokenBudgetSampler, pack_collate  # noqa: E402
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
    write_index(open_destination(Location.parse(f"s3://{bucket}/{PREFIX}/{JOB}")), index)
    return total


def _boto3_pass(bucket: str, keys: list[str], concurrency: int) -> float:
    client = boto3.client("s3", config=Config(max_pool_connections=concurrency))
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        sizes = list(pool.map(lambda key: len(client.get_object(Bucket=bucket, Key=key)["Body"].read()), keys))
    assert len(sizes) == len(keys)
    return time.perf_counter() - started


def _samples_in(batch: dict) -> int:
    """A packed batch holds several samples, an item one."""
    return len(batch["cu_seqlens"]) - 1 if "cu_seqlens" in batch else 1


def _timed_epoch(batches, count: int) -> float:
    started = time.perf_counter()
    seen = sum(_samples_in(batch) for batch in batches)
    assert seen == count, (seen, count)
    return time.perf_counter() - started


def _batched_loader(url: str, args) -> torch.utils.data.DataLoader:
    dataset = HiddenStateDataset(url, max_connections=max(1, args.concurrency // args.workers))
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=TokenBudgetSampler(dataset, token_budget=args.token_budget, seed=0),
        collate_fn=pack_collate,
        num_workers=args.workers,
        persistent_workers=True,
    )


def _item_loader(url: str, args) -> torch.utils.data.DataLoader:
    dataset = HiddenStateDataset(url, max_connections=1)
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=args.concurrency, persistent_workers=True)


def _in_process_loaders(url: str, args) -> dict[str, torch.utils.data.DataLoader]:
    dataset = HiddenStateDataset(url, max_connections=args.concurrency)
    sampler = TokenBudgetSampler(dataset, token_budget=args.token_budget, seed=0)
    ahead = PrefetchedBatches(dataset, sampler, collate_fn=pack_collate, in_flight=args.concurrency)
    return {
        "dataloader_threads": torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=pack_collate),
        "prefetched_batches": torch.utils.data.DataLoader(ahead, batch_size=None),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--workers", type=int, default=4, help="DataLoader worker processes (batched)")
    parser.add_argument("--token-budget", type=int, default=4096, help="the sampler's tokens per batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--median-len", type=int, default=300)
    parser.add_argument("--max-len", type=int, default=2048)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hsx-bench-reader-"))
    isolate_aws(work)
    moto, endpoint = _start_moto(work / "moto.log")
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
    try:
        files = _write_pristine(args, work / "files")  # bench/upload.py's files: real, bf16
        bucket = "bench-reader"
        total_bytes = _upload(work / "files", files, bucket, args.concurrency)
        keys = [f"{PREFIX}/{f.spool_path}" for f in sorted(files, key=lambda f: f.sample_index)]
        url = f"s3://{bucket}/{PREFIX}/{JOB}"
        assert HiddenStateDataset(url).sample_tokens is not None, "the dataset did not open through the index"
        loaders = {
            "dataloader": _batched_loader(url, args),
            "dataloader_items": _item_loader(url, args),
            **_in_process_loaders(url, args),
        }
        first_epoch = {name: _timed_epoch(loader, len(keys)) for name, loader in loaders.items()}
        passes: dict[str, list[float]] = {"boto3": [], **{name: [] for name in loaders}}
        for _ in range(args.repeats):
            passes["boto3"].append(_boto3_pass(bucket, keys, args.concurrency))
            for name, loader in loaders.items():
                passes[name].append(_timed_epoch(loader, len(keys)))
        result = {
            "samples": len(keys),
            "bytes": total_bytes,
            "concurrency": args.concurrency,
            "workers": args.workers,
            "token_budget": args.token_budget,
            "repeats": args.repeats,
            "cpus": os.cpu_count(),
        }
        for name, seconds in passes.items():
            result[f"{name}_samples_per_s"] = round(len(keys) / statistics.median(seconds), 1)
            result[f"{name}_mb_per_s"] = round(total_bytes / 1e6 / statistics.median(seconds), 1)
        for name, seconds in first_epoch.items():
            result[f"{name}_first_epoch_s"] = round(seconds, 3)  # worker start-up and connections included
        for name in loaders:
            ratios = [b / s for b, s in zip(passes["boto3"], passes[name])]
            result[f"{name}_vs_boto3"] = round(statistics.median(ratios), 3)
        print(json.dumps(result, indent=2))
        return 0
    finally:
        moto.terminate()
        moto.wait(10)


if __name__ == "__main__":
    sys.exit(main())
