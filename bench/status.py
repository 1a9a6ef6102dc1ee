"""Benchmark: how long `hsx status` takes as a job's progress grows (issue 11, "progress in
constant time").

For each size N it starts a fresh nats-server (temp store), records a job spec of N samples in
`hsx_jobs`, publishes the markers a finished job of N samples leaves behind (one `written` marker
per batch of --batch-size samples, one `uploaded` marker per sample, on their own subjects and
stored once, as real workers publish them), then times `hsx.commands.status.read_status` (what `hsx
status` runs, default sums budget):
- `cold`: the first reading, with no checkpoint (no monitor ever ran): exact counts and `done`,
  sums short if they do not fit the budget;
- `warm`: --repeats readings after a monitor-like reader folded every marker and saved its
  checkpoint (what a running monitor keeps current);
- `monitor_first_reading_s`: a tracker's start from that checkpoint plus its counts (what `hsx
  monitor` does before its first line).
Prints one JSON object: per size, the readings, the events published and the seconds spent
publishing them, and the server's store size. On commits before markers (0ee1e2a and earlier)
run the earlier version of this file: there every reading replays every event.

Run: python bench/status.py [--sizes 1000,100000,1000000] [--repeats 3] [--batch-size 32]
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nats  # noqa: E402

from hsx.commands.embedded import start_nats_server  # noqa: E402
from hsx.commands.status import read_status  # noqa: E402
from hsx.job import JobSpec
from hsx.wire import schemas, topology  # noqa: E402
from hsx.wire.headers import message_headers  # noqa: E402
from hsx.wire.natsconn import NatsSettings  # noqa: E402
from hsx.wire.tracker import ProgressTracker  # noqa: E402

JOB = "benchstatus"
TOKENS_PER_SAMPLE = 500
BYTES_PER_SAMPLE = TOKENS_PER_SAMPLE * 3 * 1024 * 2
WINDOW = 2000  # publishes in flight at once


def _spec(samples: int, batch_size: int) -> JobSpec:
    return JobSpec(
        job=JOB,
        model="bench",
        model_revision="local",
        layers=[1, 2, 3],
        dtype="bfloat16",
        dest="file:///nowhere",
        token_budget=batch_size * TOKENS_PER_SAMPLE,
        max_seq_len=TOKENS_PER_SAMPLE,
        dataset="bench",
        plan_fingerprint="b" * 64,
        total_samples=samples,
        total_tokens=samples * TOKENS_PER_SAMPLE,
        total_batches=-(-samples // batch_size),
        created_at=time.time(),
        published=True,
    )


def _events(spec: JobSpec, batch_size: int):
    plan = spec.plan_tag
    for batch, start in enumerate(range(0, spec.total_samples, batch_size)):
        indices = list(range(start, min(start + batch_size, spec.total_samples)))
        batch_id = f"{JOB}-{plan}-{batch:06d}"
        yield (
            topology.written_subject(JOB, plan, batch_id),
            schemas.BatchWritten(
                job=JOB,
                batch_id=batch_id,
                consumer="c",
                node="n",
                sample_indices=indices,
                tokens=len(indices) * TOKENS_PER_SAMPLE,
                bytes=len(indices) * BYTES_PER_SAMPLE,
                seconds=1.0,
                plan=plan,
            ),
            batch_id,
            None,
        )
        for index in indices:
            yield (
                topology.uploaded_subject(JOB, plan, index),
                schemas.FileUploaded(
                    job=JOB,
                    node="n",
                    uploader="u",
                    sample_index=index,
                    key=f"{JOB}/{index // 1000:05d}/{index}.safetensors",
                    size=BYTES_PER_SAMPLE,
                    tokens=TOKENS_PER_SAMPLE,
                    plan=plan,
                ),
                batch_id,
                index,
            )


async def _fill(url: str, samples: int, batch_size: int) -> tuple[int, float]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        kv = await topology.ensure_topology(js)
        spec = _spec(samples, batch_size)
        await kv.put(JOB, schemas.encode(spec))
        started, count, pending = time.perf_counter(), 0, []
        for subject, event, batch_id, sample in _events(spec, batch_size):
            headers = {**message_headers(JOB, batch=batch_id, sample=sample), **topology.ONCE_HEADERS}
            pending.append(js.publish(subject, schemas.encode(event), headers=headers))
            if len(pending) >= WINDOW:
                await asyncio.gather(*pending)
                count, pending = count + len(pending), []
        await asyncio.gather(*pending)
        return count + len(pending), time.perf_counter() - started
    finally:
        await nc.close()


def _store_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file())


async def _fold_and_save(url: str) -> float:
    """What a running monitor does: fold every marker and save the checkpoint; then how long a
    fresh tracker takes to start from it and read its counts (the monitor's restart)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        plan = _spec(1, 1).plan_tag
        tracker = ProgressTracker(js, JOB, plan=plan, heartbeats=True)
        await tracker.start()
        await tracker.wait_caught_up(3600)
        await tracker.stop()
        await tracker.save_checkpoint()
        started = time.perf_counter()
        restarted = ProgressTracker(js, JOB, plan=plan, heartbeats=True)
        await restarted.start()
        await restarted.wait_caught_up(3600)
        await restarted.refresh_counts()
        await restarted.refresh_queues()
        seconds = time.perf_counter() - started
        await restarted.stop()
        return seconds
    finally:
        await nc.close()


def _reading(url: str, samples: int) -> tuple[float, bool]:
    started = time.perf_counter()
    view = asyncio.run(read_status(NatsSettings(url=url), JOB, timeout_s=3600))
    seconds = round(time.perf_counter() - started, 3)
    assert view.done and view.samples_uploaded == samples, view
    return seconds, view.sums_complete


def measure(samples: int, *, repeats: int, batch_size: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        server = start_nats_server(Path(tmp))
        try:
            events, publish_s = asyncio.run(_fill(server.url, samples, batch_size))
            cold_s, cold_complete = _reading(server.url, samples)
            monitor_s = asyncio.run(_fold_and_save(server.url))
            warm = [_reading(server.url, samples) for _ in range(repeats)]
            assert all(complete for _, complete in warm), warm
            readings = [seconds for seconds, _ in warm]
            return {
                "samples": samples,
                "events": events,
                "publish_s": round(publish_s, 1),
                "cold_s": cold_s,
                "cold_sums_complete": cold_complete,
                "status_s_median": round(statistics.median(readings), 3),
                "status_s": readings,
                "monitor_first_reading_s": round(monitor_s, 3),
                "store_bytes": _store_bytes(Path(tmp)),
            }
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,100000,1000000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    results = [measure(int(size), repeats=args.repeats, batch_size=args.batch_size) for size in args.sizes.split(",")]
    print(json.dumps({"bench": "status", "batch_size": args.batch_size, "results": results}, indent=1))


if __name__ == "__main__":
    main()
