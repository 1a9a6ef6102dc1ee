"""The consumer's spool usage is a running count (hsx/storage/spool.py SpoolMeter): no walk of
the plan's folder on the hot path (`spool_full` before every fetch, the heartbeat), exact for the
files the consumer writes, and brought down by its next walk when uploaders (other processes)
delete what they uploaded; it never drifts from a directory walk.

Everything real: a job produced by `hsx produce`, a real BatchWorker writing its batches on a
tiny qwen3 (CPU), a real `hsx upload` process deleting the uploaded files.
"""

import asyncio
import time

from test_e2e_s3 import logs_of, produce, write_dataset

from hsx.gpu_consumer.config import ConsumerConfig
from hsx.gpu_consumer.model import load_model
from hsx.gpu_consumer.service import BatchWorker
from hsx.storage import encodings
from hsx.storage.spool import SpoolMeter, spool_usage
from hsx.wire import topology
from hsx.wire.events import EventPublisher
from hsx.wire.jobs import read_job_spec
from hsx.wire.natsconn import NatsSettings, connect
from hsx.wire.pull import Taken


async def _wait_for_walk(meter, *, timeout: float = 30) -> None:
    """Until the meter's own thread has walked the folder again, starting from now."""
    walks, deadline = meter.walks, time.monotonic() + timeout
    while meter.walks < walks + 2:  # one may have been under way already
        assert time.monotonic() < deadline, "the meter did not walk again"
        await asyncio.sleep(0.1)


def test_the_spool_count_matches_a_directory_walk_after_uploads(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name
):
    job, spool = job_name, tmp_path / "spool"
    write_dataset(tmp_path / "data.jsonl", 24, min_len=8, max_len=40, seed=17)
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(tmp_path / "out"),
        token_budget=128,
        max_seq_len=64,
        env=None,
    )

    async def run() -> dict:
        nc = await connect(NatsSettings(url=nats_server.url), name="test-spool-meter")
        js = nc.jetstream()
        spec = await read_job_spec(await topology.ensure_topology(js), job)
        loaded = load_model(spec.model, layers=spec.layers, encoding=encodings.of_spec(spec.dtype), device="cpu")
        cfg = ConsumerConfig(
            nats=NatsSettings(url=nats_server.url),
            job=job,
            device="cpu",
            spool=spool,
            node="testnode",  # the uploader's (tests/conftest.py)
            instance="meter-1",
            spool_high_water_bytes=1 << 60,
        )
        worker = BatchWorker(cfg, js, EventPublisher(nc, js, job), spec, loaded, asyncio.Event())
        meter = worker.spool_meter
        sub = await js.pull_subscribe_bind(
            durable=await topology.ensure_gpu_consumer(js, job), stream=topology.BATCHES_STREAM
        )

        def walked() -> tuple[int, int]:
            return spool_usage(spool, job, spec.plan_tag)

        async def write(batches: int) -> None:
            for _ in range(batches):
                [msg] = await sub.fetch(1, timeout=5)
                computed = await worker.compute(Taken.of(msg, interval_s=cfg.in_progress_s))
                await worker.finish(computed)

        try:
            # 1. Written by this worker, counted exactly, with no walk since the first one.
            walks = meter.walks
            await write(spec.total_batches // 2)
            for _ in range(200):  # the hot path: before every fetch, in every beat
                full, used = worker.spool_full()
                assert not full and used == worker.heartbeat_state().spool_bytes
            written = walked()
            assert written[0] > 0 and meter.usage() == written, (meter.usage(), written)
            assert meter.walks - walks <= 1, "spool_full walked the folder"  # the thread's own, at most
            # 2. A real uploader deletes what it uploads: the count comes down at the next walk.
            uploader = hsx_service("upload", "--job", job, "--spool", str(spool), "--until-done", name="upload")
            deadline = time.monotonic() + 60
            while walked() != (0, 0):
                assert time.monotonic() < deadline and uploader.poll() is None, logs_of(uploader)
                await asyncio.sleep(0.1)
            stale = meter.usage()
            await _wait_for_walk(meter)
            after_uploads = meter.usage()
            assert after_uploads == walked() == (0, 0), (stale, after_uploads)
            # 3. The rest written while the uploader drains them: it ends with the job, nothing is
            # left, and the count says so after its next walk.
            await write(spec.total_batches - spec.total_batches // 2)
            assert await asyncio.to_thread(uploader.wait, 90) == 0, logs_of(uploader)
            await _wait_for_walk(meter)
            return dict(written=written, stale=stale, after=after_uploads, end=meter.usage(), walked=walked())
        finally:
            worker.close()
            await sub.unsubscribe()
            await nc.drain()

    result = asyncio.run(run())
    assert result["end"] == result["walked"] == (0, 0), result
    print(f"\nSPOOL_METER {result}")


def test_the_meter_says_when_its_count_of_other_processes_files_was_taken(tmp_path):
    # The heartbeat's spool_measured_at: a node's figure is its newest measurement, so the meter's
    # must be when its walk began, not when a beat read it.
    folder = tmp_path / "plan"
    (folder / "00000").mkdir(parents=True)
    (folder / "00000" / "1.safetensors").write_bytes(b"x" * 10)
    meter = SpoolMeter(folder)
    before = time.time()
    meter.walk()
    after = time.time()
    files, used, walked_at = meter.measured()
    assert before <= walked_at <= after and (files, used) == meter.usage() == (1, 10)
    meter.add(1, 5)  # its own write: counted at once, the walk's time unchanged
    assert meter.measured() == (2, 15, walked_at)
