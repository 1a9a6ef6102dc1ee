"""The consumer's pipeline, two batches deep (gpu_consumer/scheduler.py): batch N+1's forward is
queued while N's states land and its files are written, N+2's too; and still every batch is acked
only after its files are written, fsynced and announced and its `written` marker stored, in the
order the batches were taken, with at most DEPTH batches' host buffers leased at once.

The real BatchScheduler (`pull_loop`) and BatchWorker against the session's nats-server, a tiny
qwen3 on the CPU with the real staging pool; the steps are recorded where they happen (the
forward's seam, the worker's own write, fsync, announce and mark steps, the ack's seam), and batch
N's file writes are held until batch N+2's forward has begun, so the overlap is not left to the
timing of a 2-core machine. Each file is then compared with its sample run alone.
"""

import asyncio
import dataclasses
import threading
import time

from safetensors.torch import load_file
from test_fidelity import _spec
from test_staging import _samples
from tolerance import assert_within, float32_states_bound

import hsx.gpu_consumer.extract as extract
import hsx.gpu_consumer.service as service
from hsx.gpu_consumer.config import ConsumerConfig
from hsx.gpu_consumer.model import load_model
from hsx.gpu_consumer.scheduler import DEPTH, pull_loop
from hsx.gpu_consumer.service import BatchWorker
from hsx.gpu_consumer.staging import HostStaging, StagingLease
from hsx.storage import encodings
from hsx.storage.spool import spool_file
from hsx.wire import schemas, topology
from hsx.wire.events import EventPublisher
from hsx.wire.natsconn import NatsSettings, connect

LAYERS = [1, 3]
BATCHES = 6
LENGTHS = [[20, 9], [14, 30, 5], [11], [25, 7], [16, 16], [8, 3, 12]]


def _batches(lengths: list[list[int]]) -> list[list[schemas.Sample]]:
    """The batches' samples, indexed 0.. in order (every index inside the plan)."""
    starts = [sum(len(batch) for batch in lengths[:k]) for k in range(len(lengths))]
    return [_samples(start, batch, seed=k) for k, (start, batch) in enumerate(zip(starts, lengths))]


class CountingStaging(HostStaging):
    """The real pool, counting the leases held at once."""

    def __init__(self) -> None:
        super().__init__()  # pinned where CUDA is
        self.live = self.most = 0
        self.count_lock = threading.Lock()

    def lease(self) -> StagingLease:
        pool, lease = self, StagingLease(self)
        release = lease.release

        def counted_release() -> None:
            if not lease._released:
                with pool.count_lock:
                    pool.live -= 1
            release()

        lease.release = counted_release
        with self.count_lock:
            self.live += 1
            self.most = max(self.most, self.live)
        return lease


def test_the_pipeline_overlaps_batches_and_acks_each_only_after_its_files(
    nats_server, tiny_model, job_name, tmp_path, monkeypatch
):
    check_pipeline(nats_server, tiny_model, job_name, tmp_path, monkeypatch, device="cpu")


def check_pipeline(nats_server, tiny_model, job_name, tmp_path, monkeypatch, *, device: str) -> None:
    """The run and its checks, on `device` (tests/test_gpu.py runs it on CUDA: pinned buffers,
    the copy stream)."""
    path = tiny_model("qwen3")
    batches = _batches(LENGTHS)
    spec = _spec(job_name, path, LAYERS, "float32", [s for batch in batches for s in batch])
    batch_of = {sample.index: k for k, batch in enumerate(batches) for sample in batch}
    steps: list[tuple[str, int]] = []
    lock = threading.Lock()
    began = {k: threading.Event() for k in range(BATCHES)}

    def record(step: str, k: int) -> None:
        with lock:
            steps.append((step, k))

    def before_forward(samples, _tokens):
        k = batch_of[samples[0].index]
        record("forward", k)
        began[k].set()

    monkeypatch.setattr(extract, "before_forward", before_forward)
    last_marked: list[int] = []
    monkeypatch.setattr(service, "before_ack", lambda: record("ack", last_marked[-1]))
    real_publish_all = service.publish_all

    async def announcing(js, messages, **kwargs):
        record("announce", batch_of[schemas.file_decoder.decode(messages[0][1]).sample_index])
        return await real_publish_all(js, messages, **kwargs)

    monkeypatch.setattr(service, "publish_all", announcing)

    async def run() -> tuple[BatchWorker, object]:
        loaded = load_model(str(path), layers=LAYERS, encoding=encodings.of_spec("float32"), device=device)
        staging = CountingStaging()
        loaded = dataclasses.replace(loaded, staging=staging)
        nc = await connect(NatsSettings(url=nats_server.url), name="test-pipeline")
        js = nc.jetstream()
        await topology.ensure_topology(js)
        for k, samples in enumerate(batches):
            descriptor = schemas.BatchDescriptor(
                job=job_name,
                batch_id=f"{job_name}-{k}",
                padded_len=max(len(s.input_ids) for s in samples),
                samples=samples,
            )
            await js.publish(topology.batch_subject(job_name), schemas.encode(descriptor))
        durable = await topology.ensure_gpu_consumer(js, job_name)
        sub = await js.pull_subscribe_bind(durable=durable, stream=topology.BATCHES_STREAM)
        cfg = ConsumerConfig(
            nats=NatsSettings(url=nats_server.url),
            job=job_name,
            device=device,
            spool=tmp_path / "spool",
            node="node-a",
            instance="pipeline-1",
            spool_high_water_bytes=1 << 60,
            idle_fetch_timeout_s=0.5,
        )
        stopping = asyncio.Event()
        worker = BatchWorker(cfg, js, EventPublisher(nc, js, job_name), spec, loaded, stopping)
        write_one, sync_folders, mark = worker._write_one, worker._sync_folders, worker.events.mark

        def held_write(batch_id, sample, hidden):
            k = batch_of[sample.index]
            # Batch k's files wait for batch k+2's forward: two batches queued behind it.
            if k + 2 < BATCHES:
                assert began[k + 2].wait(timeout=60), f"batch {k + 2} never began while batch {k} was written"
            record("write", k)
            return write_one(batch_id, sample, hidden)

        def recorded_sync(files):
            sync_folders(files)
            record("fsync", batch_of[files[0].sample_index])

        async def recorded_mark(event, *, subject):
            await mark(event, subject=subject)
            k = int(event.batch_id.rsplit("-", 1)[1])
            last_marked.append(k)
            record("marked", k)

        worker._write_one, worker._sync_folders, worker.events.mark = held_write, recorded_sync, recorded_mark
        loop = asyncio.create_task(pull_loop(worker, sub, cfg, stopping))
        deadline = time.monotonic() + 120
        while sum(step == "ack" for step, _ in steps) < BATCHES:
            assert time.monotonic() < deadline and not loop.done(), steps
            await asyncio.sleep(0.05)
        stopping.set()
        await loop
        info = await js.consumer_info(topology.BATCHES_STREAM, durable)
        worker.close()
        await sub.unsubscribe()
        await nc.drain()
        return worker, info

    worker, info = asyncio.run(run())
    assert (info.num_ack_pending, info.num_pending, info.num_redelivered) == (0, 0, 0), info
    at = {step: steps.index(step) for step in steps}  # first occurrence of each (step, batch)
    last = {}
    for position, step in enumerate(steps):
        last[step] = position
    acks = [k for step, k in steps if step == "ack"]
    assert acks == list(range(BATCHES)), steps  # each once, in the order taken
    for k in range(BATCHES):
        # Its forward, every write, the fsync, the announcement, the marker, then the ack.
        chain = [at[("forward", k)], last[("write", k)], at[("fsync", k)], at[("announce", k)], at[("marked", k)]]
        assert chain == sorted(chain) and chain[-1] < at[("ack", k)], (k, steps)
        assert sum(step == ("write", k) for step in steps) == len(batches[k])
        if k + 2 < BATCHES:  # two batches queued behind the one being written...
            assert at[("forward", k + 2)] < at[("write", k)], (k, steps)
        if k + DEPTH < BATCHES:  # ...and never a third: at most DEPTH batches in hand
            assert at[("forward", k + DEPTH)] > at[("ack", k)], (k, steps)
    staging = worker.loaded.staging
    assert staging.most == DEPTH and staging.live == 0 and staging.leased_bytes == 0, (staging.most, staging.live)
    eager = load_model(str(path), layers=LAYERS, encoding=encodings.of_spec("float32"), device=device)
    for sample in (s for batch in batches for s in batch):
        stored = load_file(spool_file(tmp_path / "spool", job_name, spec.plan_tag, sample.index))["hidden_states"]
        alone = extract.extract_samples(eager, [sample])[0]
        bound = float32_states_bound(eager.model.config, LAYERS, len(sample.input_ids))
        assert_within(stored, alone, bound, f"sample {sample.index} against itself alone")


def test_a_redelivered_batch_runs_alone(nats_server, tiny_model, job_name, tmp_path, monkeypatch):
    """A redelivery (it may be what killed its last consumer) is taken with nothing in hand, and
    nothing is fetched while its forward runs; the batches after it overlap again."""
    path = tiny_model("qwen3")
    batches = _batches(LENGTHS[:4])
    spec = _spec(job_name, path, LAYERS, "float32", [s for batch in batches for s in batch])
    batch_of = {sample.index: k for k, batch in enumerate(batches) for sample in batch}
    steps: list[tuple[str, int]] = []
    monkeypatch.setattr(
        extract, "before_forward", lambda samples, _: steps.append(("forward", batch_of[samples[0].index]))
    )

    async def run() -> int:
        loaded = load_model(str(path), layers=LAYERS, encoding=encodings.of_spec("float32"), device="cpu")
        nc = await connect(NatsSettings(url=nats_server.url), name="test-pipeline-alone")
        js = nc.jetstream()
        await topology.ensure_topology(js)
        for k, samples in enumerate(batches):
            descriptor = schemas.BatchDescriptor(
                job=job_name,
                batch_id=f"{job_name}-{k}",
                padded_len=max(len(s.input_ids) for s in samples),
                samples=samples,
            )
            await js.publish(topology.batch_subject(job_name), schemas.encode(descriptor))
        durable = await topology.ensure_gpu_consumer(js, job_name)
        sub = await js.pull_subscribe_bind(durable=durable, stream=topology.BATCHES_STREAM)
        [first] = await sub.fetch(1, timeout=5)
        # A consumer gave it back: its next delivery is the second. Sent as a request, which the
        # server answers once the nak is processed (as ack_sync does for an ack): the worker's
        # first pull may not overtake it.
        await nc.request(first.reply, b"-NAK", timeout=5)
        cfg = ConsumerConfig(
            nats=NatsSettings(url=nats_server.url),
            job=job_name,
            device="cpu",
            spool=tmp_path / "spool",
            node="node-a",
            instance="pipeline-2",
            spool_high_water_bytes=1 << 60,
            idle_fetch_timeout_s=0.5,
        )
        stopping = asyncio.Event()
        worker = BatchWorker(cfg, js, EventPublisher(nc, js, job_name), spec, loaded, stopping)
        fetch, compute = sub.fetch, worker.compute

        async def recorded_fetch(*args, **kwargs):
            steps.append(("fetch", -1))
            return await fetch(*args, **kwargs)

        async def recorded_compute(taken, **kwargs):
            computed = await compute(taken, **kwargs)
            k = int(schemas.batch_decoder.decode(taken.msg.data).batch_id.rsplit("-", 1)[1])
            steps.append(("computed", k) if taken.msg.metadata.num_delivered == 1 else ("computed again", k))
            return computed

        sub.fetch, worker.compute = recorded_fetch, recorded_compute
        loop = asyncio.create_task(pull_loop(worker, sub, cfg, stopping))
        deadline = time.monotonic() + 60
        while sum(step[0].startswith("computed") for step in steps) < len(batches):
            assert time.monotonic() < deadline and not loop.done(), steps
            await asyncio.sleep(0.05)
        stopping.set()
        await loop
        info = await js.consumer_info(topology.BATCHES_STREAM, durable)
        worker.close()
        await sub.unsubscribe()
        await nc.drain()
        return info.num_ack_pending + info.num_pending

    assert asyncio.run(run()) == 0
    redone = steps.index(("computed again", 0))
    # Fetched (the first fetch), computed with no other fetch meanwhile, and only then the next.
    assert steps[:3] == [("fetch", -1), ("forward", 0), ("computed again", 0)], steps
    assert ("fetch", -1) in steps[redone + 1 :], steps
    # The batches after it overlap again: batch 1's fetch, then the next one fetched ahead
    # while batch 1 computes.
    later = steps[redone + 1 :]
    fetches = [i for i, step in enumerate(later) if step == ("fetch", -1)]
    assert len(fetches) >= 2 and fetches[1] < later.index(("computed", 1)), steps
