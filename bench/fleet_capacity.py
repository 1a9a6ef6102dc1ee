"""Fleet capacity of the shared control plane: how many GPUs one nats-server and one monitor serve.

No model runs. For each step of offered load (samples/s fleet-wide) the bench produces a job of
short samples with the real producer (`hsx produce`: descriptors, job spec, stored samples and
their digests), starts the real monitor (`hsx monitor --job J`) and simulated nodes, each of
`--gpus-per-node` consumers and `--uploaders-per-node` uploaders, spread over `--sim-procs`
processes, one NATS connection per simulated worker as a fleet has. `--workers real` (default):
- a simulated consumer is the real one less its model: `hsx.gpu_consumer.service.BatchWorker`
  in the real scheduler (`gpu_consumer/scheduler.py`, bound to the job's durable, prefetch, three
  batches deep), its heartbeats, job watch and exhausted-batch reaper, with the forward replaced
  by a wait of `1 / --gpu-rate` seconds per sample on a simulated device (one forward at a time)
  and the file writes by the `FileReady` each file would get (its real fields, a stand-in digest).
  So per batch and per sample it decodes, checks the plan and the samples' digests, announces the
  files (`publish_all`), stores the `written` marker and acks, as a real consumer does. It reads
  the job's sample digests before the release (a real one does at its first batch): that read,
  by every consumer at once, is the fleet's start (`startup`), kept out of the window;
- a simulated uploader is the real `FileMover` in the real pull loop (`FilePuller`) with the
  upload itself left out: per file event it decodes, checks the plan and the key, stores the
  sample's `uploaded` marker and acks, as a real one does after a verified upload.
`--workers wire`: the same messages (subjects, headers, payloads from the real structs and
encoders, requests and acks) from a lean loop (`WireConsumer`, `WireUploader`) that costs the
load generator far less per sample, so that NATS is driven further on the same cores.

The gpu durable is paused until every simulated worker is ready; the fleet is measured idle for
`--idle` seconds (`idle_fleet`: what NATS spends on the workers whatever the rate), then
released; after `--warmup` seconds a window of `--window` seconds is measured:
- achieved samples/s: `uploaded` markers stored in the window (the job's counter durable, as the
  monitor reads it), against the offered rate (GPUs x --gpu-rate);
- CPU (`/proc/<pid>/stat`): nats-server (cores, and ms per 1,000 samples), the monitor, the
  simulated workers' processes (the load generator, which shares the cores), this bench, and
  the rest of the machine (`machine_saturated` when every core was busy); the load average;
- NATS traffic from `/varz` deltas: messages and bytes in and out per sample;
- latency, median and p99, measured in the simulated workers: a batch's file announcements
  (`publish_all`, all acks), the `written` and `uploaded` markers (publish to stored), the batch
  and file acks (`ack_sync`), a file's time from its announcement stored to its event acked
  (queueing included), and the simulated workers' event-loop lag (saturation of the generator);
- backlog, sampled every second: batches in hand, file events queued; its growth over the window;
- the monitor: its readings' `samples_uploaded` (counted by the server) against the samples its
  fold holds (`tokens_uploaded` / tokens per sample: every sample has the same length), i.e. how
  many samples its fold is behind, the samples it folds per second, and its CPU per sample.
The capacity is the highest step whose achieved rate is within 5% of the offered one with flat
backlog; since the generator shares the cores, NATS is also judged by its CPU per sample:
`nats_cores_at_5000` projects its cores at 5,000 samples/s from that.

Run: .venv/bin/python bench/fleet_capacity.py [--rates 500,1000,2000,4000] [--workers real|wire]
     [--gpu-rate 40] [--gpus-per-node 8] [--uploaders-per-node 2] [--sample-tokens 64]
     [--batch-samples 32] [--idle 5] [--warmup 10] [--window 20] [--sim-procs 2]
     [--quiet-cores C [--quiet-wait S]] [--hsx-root DIR] [--keep]
`--quiet-cores`: on a shared machine, each step is released once the other processes keep at
most C cores busy (waiting up to S seconds, the fleet idle meanwhile).
`--hsx-root`: run the producer, the monitor and the simulated workers on the hsx of another
checkout (a git worktree of an older commit), for a before/after. Linux only (reads /proc).
Prints one JSON object (and a line per step on stderr).
"""

import argparse
import asyncio
import datetime
import hashlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_TICKS = os.sysconf("SC_CLK_TCK")
_RELEASE_S = 0.5
# Bytes per token of a sample file of an 8B target (hidden 4096, 5 layers, bf16): only the
# `size` the file events and markers carry; no bytes are written.
_FILE_BYTES_PER_TOKEN = 4096 * 5 * 2


# ---------------------------------------------------------------------------------------------
# The simulated workers (run as `fleet_capacity.py --sim CONFIG.json`, one process per share).


class Recorder:
    """Latencies (seconds) and counts, each stamped with the wall-clock time it ended at."""

    def __init__(self) -> None:
        self.values: dict[str, list[tuple[float, float]]] = {}
        self.counts: dict[str, list[tuple[float, int]]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.values.setdefault(name, []).append((time.time(), seconds))

    def count(self, name: str, n: int = 1) -> None:
        self.counts.setdefault(name, []).append((time.time(), n))

    def window(self, t0: float, t1: float) -> dict:
        out: dict = {"latency_ms": {}, "counts": {}}
        for name, entries in self.values.items():
            values = sorted(v for t, v in entries if t0 <= t < t1)
            if values:
                out["latency_ms"][name] = {
                    "n": len(values),
                    "median": round(1000 * statistics.median(values), 2),
                    "p99": round(1000 * values[min(len(values) - 1, int(0.99 * len(values)))], 2),
                    "max": round(1000 * values[-1], 2),
                    "values": values,  # merged with the other processes' by the driver
                }
        for name, entries in self.counts.items():
            out["counts"][name] = sum(n for t, n in entries if t0 <= t < t1)
        return out


def _install_timers(rec: Recorder) -> None:
    """Time the real publish and ack helpers where the real services call them (names looked up
    at call time: the module attributes and methods are replaced, not the code)."""
    from nats.aio.msg import Msg

    import hsx.gpu_consumer.service as consumer_service
    from hsx.wire import schemas
    from hsx.wire.events import EventPublisher

    publish_all = consumer_service.publish_all

    async def timed_publish_all(js, messages, **kwargs):
        began = time.perf_counter()
        acks = await publish_all(js, messages, **kwargs)
        rec.add("announce_batch", time.perf_counter() - began)
        rec.count("files_announced", len(messages))
        return acks

    consumer_service.publish_all = timed_publish_all

    mark = EventPublisher.mark

    async def timed_mark(self, event, *, subject, batch_id=""):
        began = time.perf_counter()
        stored = await mark(self, event, subject=subject, batch_id=batch_id)
        kind = "written_marker" if isinstance(event, schemas.BatchWritten) else "uploaded_marker"
        rec.add(kind, time.perf_counter() - began)
        if stored and kind == "uploaded_marker":
            rec.count("samples_uploaded")
        return stored

    EventPublisher.mark = timed_mark

    ack_sync = Msg.ack_sync

    async def timed_ack_sync(self, timeout: float = 1.0):
        began = time.perf_counter()
        result = await ack_sync(self, timeout=timeout)
        ended = time.time()
        if self.subject.startswith("hsx.files."):
            rec.add("file_ack", time.perf_counter() - began)
            rec.add("file_announced_to_acked", ended - self.metadata.timestamp.timestamp())
        elif self.subject.startswith("hsx.batches."):
            rec.add("batch_ack", time.perf_counter() - began)
            rec.count("batches_acked")
        return result

    Msg.ack_sync = timed_ack_sync


def _sim_classes(per_sample_s: float):
    """BatchWorker and FileMover less the model and the files (imported here: the driver never
    imports torch)."""
    import torch

    from hsx.gpu_consumer.service import BatchWorker
    from hsx.storage.layout import sample_key
    from hsx.storage.sampledigest import sample_digest
    from hsx.storage.spool import spool_file
    from hsx.uploader.service import FileMover
    from hsx.wire import schemas

    class SimLoaded:
        """What BatchWorker reads of a LoadedModel: no model (the spool's batch size is then 0),
        the CPU as its device threads' device, no staging."""

        model = None
        device = torch.device("cpu")
        dtype = torch.bfloat16
        staging = None

    class SimWorker(BatchWorker):
        """The forward is a wait on a simulated device that runs one forward at a time; the files
        are not written, only described."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._device_free = 0.0

        async def _launch_and_land(self, samples, lease, float8, launched):
            loop = asyncio.get_running_loop()
            now = loop.time()
            self._device_free = max(now, self._device_free) + len(samples) * per_sample_s
            if launched is not None:
                launched.set()  # queued on the device behind the forward computing
            await asyncio.sleep(self._device_free - now)
            return [None] * len(samples)

        def _described(self, batch_id: str, sample: schemas.Sample) -> schemas.FileReady:
            spec, spool = self.spec, self.cfg.spool
            tokens = len(sample.input_ids)
            return schemas.FileReady(
                job=spec.job,
                node=self.cfg.node,
                batch_id=batch_id,
                sample_index=sample.index,
                num_tokens=tokens,
                spool_path=str(spool_file(spool, spec.job, spec.plan_tag, sample.index).relative_to(spool)),
                key=sample_key(spec.job, sample.index),
                size=tokens * _FILE_BYTES_PER_TOKEN + 1024,
                digest=hashlib.sha256(f"{spec.job}:{sample.index}".encode()).hexdigest(),
                plan=spec.plan_tag,
                sample_digest=sample_digest(sample).hex(),
            )

        async def _write_files(self, computed):
            return [self._described(computed.batch.batch_id, sample) for sample, _ in computed.extracted]

    class SimMover(FileMover):
        """The upload left out (and the spool path it would resolve, a local cost): the key is
        checked as before a real one."""

        async def _try_move(self, ready, *, probe: bool) -> bool:
            self._check_key(ready)
            return False

    return SimLoaded, SimWorker, SimMover


async def _sim_consumer(cfg: dict, node: str, index: int, stopping: asyncio.Event, ready: asyncio.Event, classes):
    """gpu_consumer/main.py's `run` with the simulated worker for the loaded model."""
    from hsx.gpu_consumer.config import ConsumerConfig
    from hsx.gpu_consumer.scheduler import pull_loop
    from hsx.gpu_consumer.service import SERVICE
    from hsx.wire import topology
    from hsx.wire.events import EventPublisher, WorkerState
    from hsx.wire.exhausted import reap_exhausted
    from hsx.wire.jobs import wait_for_job
    from hsx.wire.natsconn import NatsSettings, close_connection, connect
    from hsx.wire.worker import JobWatch, heartbeats, watching

    sim_loaded, sim_worker, _ = classes
    job = cfg["job"]
    instance = f"{node}-gpu{index}-{os.getpid()}"
    ccfg = ConsumerConfig(
        nats=NatsSettings(url=cfg["url"]),
        instance=instance,
        job=job,
        spool=Path(cfg["spool"]) / node,
        node=node,
        device="cpu",
        spool_high_water_bytes=1 << 60,
    )
    nc = await connect(ccfg.nats, name=f"hsx-consume-{job}-{instance}")
    try:
        js = nc.jetstream()
        kv = await topology.wait_for_jobs_bucket(js, job, stopping, wait_s=60)
        spec = await wait_for_job(kv, job, stopping, wait_s=60, given_wait_s=60)
        events = EventPublisher(nc, js, job)
        watch = JobWatch(kv, spec, stopping)
        worker = None

        def state():
            return WorkerState(state="starting") if worker is None else worker.heartbeat_state()

        async with watching(watch), heartbeats(events, ccfg, service=SERVICE, stopping=stopping, state=state):
            durable = await topology.ensure_gpu_consumer(js, job, ack_wait_s=ccfg.ack_wait_s)
            sub = await js.pull_subscribe_bind(durable=durable, stream=topology.BATCHES_STREAM)
            worker = sim_worker(ccfg, js, events, spec, sim_loaded(), stopping, watch=watch)
            # A consumer reads the job's sample digests (16 bytes a sample) at its first batch:
            # read here, before the release, so that the fleet's start is not in the window.
            if spec.sample_digests:
                worker.plan_samples._digests = await worker.plan_samples._read(spec)
            reaper = asyncio.create_task(reap_exhausted(js, events, stopping))
            ready.set()
            try:
                await pull_loop(worker, sub, ccfg, stopping)
            finally:
                await asyncio.wait({reaper}, timeout=5.0)
                reaper.cancel()
                await asyncio.gather(reaper, return_exceptions=True)
                await sub.unsubscribe()
                worker.close()
    finally:
        await close_connection(nc)


async def _sim_uploader(cfg: dict, node: str, index: int, stopping: asyncio.Event, ready: asyncio.Event, classes):
    """uploader/main.py's `run` with the simulated mover."""
    from hsx.storage.location import spec_location

    try:
        from hsx.storage.location import open_destination
    except ImportError:  # an hsx from before it moved there (--hsx-root)
        from hsx.storage.destinations import open_destination
    from hsx.uploader.config import UploaderConfig
    from hsx.uploader.service import SERVICE, pull_loop
    from hsx.wire import topology
    from hsx.wire.events import EventPublisher
    from hsx.wire.jobs import wait_for_job
    from hsx.wire.natsconn import NatsSettings, close_connection, connect
    from hsx.wire.worker import JobWatch, heartbeats, watching

    _, _, sim_mover = classes
    job = cfg["job"]
    instance = f"{node}-up{index}-{os.getpid()}"
    spool = Path(cfg["spool"]) / node
    spool.mkdir(parents=True, exist_ok=True)
    ucfg = UploaderConfig(nats=NatsSettings(url=cfg["url"]), instance=instance, job=job, spool=spool, node=node)
    nc = await connect(ucfg.nats, name=f"hsx-upload-{job}-{instance}")
    try:
        js = nc.jetstream()
        kv = await topology.wait_for_jobs_bucket(js, job, stopping, wait_s=60)
        spec = await wait_for_job(kv, job, stopping, wait_s=60, given_wait_s=60)
        dest = open_destination(spec_location(spec.dest), max_connections=ucfg.max_inflight)
        events = EventPublisher(nc, js, job)
        watch = JobWatch(kv, spec, stopping)
        durable = await topology.ensure_upload_consumer(js, job, node, ack_wait_s=ucfg.ack_wait_s)
        sub = await js.pull_subscribe_bind(durable=durable, stream=topology.FILES_STREAM)
        mover = sim_mover(ucfg, dest, events, spec, watch=watch)
        async with watching(watch):
            try:
                async with heartbeats(events, ucfg, service=SERVICE, stopping=stopping, state=mover.heartbeat_state):
                    ready.set()
                    await pull_loop(mover, sub, ucfg, stopping)
            finally:
                mover.close()
                await sub.unsubscribe()
    finally:
        await close_connection(nc)


# In wire mode (`--workers wire`) the per-sample work is the same messages with a lean client
# loop: the load generator then costs a fraction of the real workers' Python, so NATS can be
# driven further on the same cores. Per batch the consumer uses the real helpers; per file the
# uploader publishes the real `uploaded` marker (real struct, encoder, subject, headers) as a
# request and, on its PubAck, the ack as a request (what `ack_sync` sends), on callbacks instead
# of a task, a keep-alive and two awaited futures per file.

_PULL_EXPIRES_NS = 1_000_000_000  # a pull waits up to 1 s, as the workers' idle fetch timeout
# Batches a consumer holds at once (gpu_consumer/scheduler.py DEPTH).
_DEPTH = 3


class _WireWorker:
    def __init__(self, nc, durable: str, stream: str, stopping: asyncio.Event) -> None:
        self.nc, self.stopping = nc, stopping
        self.pull_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.prefix = nc.new_inbox()
        self.deliver = f"{self.prefix}.d"
        self.pull_open = 0  # messages the open pull request may still deliver
        self.wake = asyncio.Event()

    def room(self) -> int:
        raise NotImplementedError

    async def pull_loop(self) -> None:
        while not self.stopping.is_set():
            free = self.room()
            if not self.pull_open and free > 0:
                batch = min(free, 256)
                self.pull_open = batch
                await self.nc.publish(
                    self.pull_subject,
                    json.dumps({"batch": batch, "expires": _PULL_EXPIRES_NS}).encode(),
                    reply=self.deliver,
                )
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=1.5)
            except TimeoutError:
                self.pull_open = 0  # its expiry's status was missed: pull again

    def delivered(self, msg) -> bool:
        """False for a status message (the pull request expired or was refused): it is over."""
        if msg.headers and msg.headers.get("Status"):
            self.pull_open = 0
            self.wake.set()
            return False
        self.pull_open = max(0, self.pull_open - 1)
        if not self.pull_open:
            self.wake.set()
        return True


class WireConsumer(_WireWorker):
    """A GPU consumer's messages: one descriptor pulled at a time, at most _DEPTH in hand; each
    batch, after its forward on the simulated device, announced (`publish_all`), its `written`
    marker stored (`EventPublisher.mark`), then acked (`ack_sync`)."""

    def __init__(self, nc, js, events, spec, node: str, instance: str, per_sample_s: float, rec, stopping) -> None:
        from hsx.wire import topology

        super().__init__(nc, topology.gpu_durable(spec.job), topology.BATCHES_STREAM, stopping)
        self.js, self.events, self.spec, self.node, self.instance = js, events, spec, node, instance
        self.per_sample_s, self.rec = per_sample_s, rec
        self.in_hand = 0
        self.device_free = 0.0
        self.tasks: set[asyncio.Task] = set()

    def room(self) -> int:
        return 1 if self.in_hand < _DEPTH else 0

    async def start(self) -> None:
        await self.nc.subscribe(self.deliver, cb=self.on_descriptor)

    async def on_descriptor(self, msg) -> None:
        if not self.delivered(msg):
            return
        self.in_hand += 1
        task = asyncio.create_task(self.finish(msg))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def finish(self, msg) -> None:
        from hsx.storage.layout import sample_key
        from hsx.wire import schemas, topology
        from hsx.wire.headers import message_headers
        from hsx.wire.jetstream import publish_all

        try:
            batch = schemas.batch_decoder.decode(msg.data)
            loop = asyncio.get_running_loop()
            now = loop.time()
            self.device_free = max(now, self.device_free) + len(batch.samples) * self.per_sample_s
            await asyncio.sleep(self.device_free - now)
            spec, job, attempt = self.spec, self.spec.job, msg.metadata.num_delivered
            files = [
                schemas.FileReady(
                    job=job,
                    node=self.node,
                    batch_id=batch.batch_id,
                    sample_index=sample.index,
                    num_tokens=len(sample.input_ids),
                    spool_path=f"{job}/{spec.plan_tag}/{sample.index // 1000:06d}/{sample.index}.safetensors",
                    key=sample_key(job, sample.index),
                    size=len(sample.input_ids) * _FILE_BYTES_PER_TOKEN + 1024,
                    digest=hashlib.sha256(f"{job}:{sample.index}".encode()).hexdigest(),
                    plan=spec.plan_tag,
                    # A stand-in of the same length: hashing the tokens is the consumer's cost.
                    sample_digest=hashlib.md5(f"{job}:{sample.index}".encode()).hexdigest(),
                )
                for sample in batch.samples
            ]
            subject = topology.file_subject(job, self.node)
            began = time.perf_counter()
            await publish_all(
                self.js,
                [
                    (
                        subject,
                        schemas.encode(ready),
                        message_headers(
                            job,
                            batch=batch.batch_id,
                            sample=ready.sample_index,
                            msg_id=f"{batch.batch_id}:{ready.sample_index}:{attempt}",
                        ),
                    )
                    for ready in files
                ],
                what="announce_file",
            )
            self.rec.add("announce_batch", time.perf_counter() - began)
            self.rec.count("files_announced", len(files))
            written = schemas.BatchWritten(
                job=job,
                batch_id=batch.batch_id,
                consumer=self.instance,
                node=self.node,
                sample_indices=[f.sample_index for f in files],
                tokens=sum(f.num_tokens for f in files),
                bytes=sum(f.size for f in files),
                seconds=round(len(files) * self.per_sample_s, 4),
                attempt=attempt,
                plan=spec.plan_tag,
            )
            planned = spec.is_plan_batch(batch.batch_id)
            began = time.perf_counter()
            await self.events.mark(
                written, subject=topology.written_subject(job, spec.plan_tag, batch.batch_id, planned=planned)
            )
            self.rec.add("written_marker", time.perf_counter() - began)
            began = time.perf_counter()
            await msg.ack_sync()
            self.rec.add("batch_ack", time.perf_counter() - began)
            self.rec.count("batches_acked")
        finally:
            self.in_hand -= 1
            self.wake.set()


class WireUploader(_WireWorker):
    """An uploader's messages: file events pulled up to `max_inflight` in hand; per event, its
    sample's `uploaded` marker stored (a request with the marker's once-only headers), then, on
    the PubAck, the event acked (a request, as `ack_sync`)."""

    def __init__(self, nc, spec, node: str, instance: str, max_inflight: int, rec, stopping) -> None:
        from hsx.wire import topology

        super().__init__(nc, topology.upload_durable(spec.job, node), topology.FILES_STREAM, stopping)
        self.spec, self.node, self.instance, self.max_inflight, self.rec = spec, node, instance, max_inflight, rec
        self.inflight = 0
        self.marking: dict[str, tuple] = {}
        self.acking: dict[str, tuple] = {}
        self.tokens = 0
        self.acked = 0

    def room(self) -> int:
        return self.max_inflight - self.inflight

    async def start(self) -> None:
        await self.nc.subscribe(self.deliver, cb=self.on_file)
        await self.nc.subscribe(f"{self.prefix}.m.*", cb=self.on_marker_stored)
        await self.nc.subscribe(f"{self.prefix}.a.*", cb=self.on_acked)

    def _token(self) -> str:
        self.tokens += 1
        return str(self.tokens)

    async def on_file(self, msg) -> None:
        from hsx.wire import schemas, topology
        from hsx.wire.headers import message_headers

        if not self.delivered(msg):
            return
        self.inflight += 1
        ready = schemas.file_decoder.decode(msg.data)
        uploaded = schemas.FileUploaded(
            job=ready.job,
            node=ready.node,
            uploader=self.instance,
            sample_index=ready.sample_index,
            key=ready.key,
            size=ready.size,
            tokens=ready.num_tokens,
            attempt=msg.metadata.num_delivered,
            plan=ready.plan,
            digest=ready.digest,
            sample_digest=ready.sample_digest,
        )
        headers = {
            **message_headers(ready.job, batch=ready.batch_id, sample=ready.sample_index),
            **topology.ONCE_HEADERS,
        }
        token = self._token()
        self.marking[token] = (msg, time.perf_counter())
        await self.nc.publish(
            topology.uploaded_subject(ready.job, ready.plan, ready.sample_index),
            schemas.encode(uploaded),
            reply=f"{self.prefix}.m.{token}",
            headers=headers,
        )

    async def on_marker_stored(self, reply) -> None:
        msg, began = self.marking.pop(reply.subject.rsplit(".", 1)[1])
        self.rec.add("uploaded_marker", time.perf_counter() - began)
        if b'"error"' not in reply.data:
            self.rec.count("samples_uploaded")
        elif b"10071" not in reply.data:  # anything but "stored before": left unacked
            self.rec.count("marker_errors")
            self.inflight -= 1
            self.wake.set()
            return
        token = self._token()
        self.acking[token] = (msg, time.perf_counter())
        await self.nc.publish(msg.reply, b"+ACK", reply=f"{self.prefix}.a.{token}")

    async def on_acked(self, reply) -> None:
        msg, began = self.acking.pop(reply.subject.rsplit(".", 1)[1])
        self.rec.add("file_ack", time.perf_counter() - began)
        self.acked += 1
        if self.acked % 4 == 0:  # one file in four: reading the stored time parses the ack subject
            self.rec.add("file_announced_to_acked", time.time() - msg.metadata.timestamp.timestamp())
        self.inflight -= 1
        if self.room() >= min(32, self.max_inflight):
            self.wake.set()


async def _wire_consumer(cfg, node, index, stopping, ready, rec):
    from hsx.gpu_consumer.config import ConsumerConfig
    from hsx.gpu_consumer.service import SERVICE
    from hsx.wire import topology
    from hsx.wire.events import EventPublisher, WorkerState
    from hsx.wire.exhausted import reap_exhausted
    from hsx.wire.jobs import wait_for_job
    from hsx.wire.natsconn import NatsSettings, close_connection, connect
    from hsx.wire.worker import JobWatch, heartbeats, watching

    job = cfg["job"]
    instance = f"{node}-gpu{index}-{os.getpid()}"
    ccfg = ConsumerConfig(nats=NatsSettings(url=cfg["url"]), instance=instance, job=job, node=node, device="cpu")
    nc = await connect(ccfg.nats, name=f"hsx-consume-{job}-{instance}")
    try:
        js = nc.jetstream()
        kv = await topology.wait_for_jobs_bucket(js, job, stopping, wait_s=60)
        spec = await wait_for_job(kv, job, stopping, wait_s=60, given_wait_s=60)
        events = EventPublisher(nc, js, job)
        watch = JobWatch(kv, spec, stopping)
        worker = WireConsumer(nc, js, events, spec, node, instance, 1.0 / cfg["gpu_rate"], rec, stopping)

        def state():
            return WorkerState(state="working" if worker.in_hand else "idle", spool_files=0, spool_bytes=0)

        async with watching(watch), heartbeats(events, ccfg, service=SERVICE, stopping=stopping, state=state):
            await topology.ensure_gpu_consumer(js, job, ack_wait_s=ccfg.ack_wait_s)
            await worker.start()
            reaper = asyncio.create_task(reap_exhausted(js, events, stopping))
            ready.set()
            try:
                await worker.pull_loop()
            finally:
                await asyncio.wait(worker.tasks or {reaper}, timeout=30)
                await asyncio.wait({reaper}, timeout=5.0)
                reaper.cancel()
                await asyncio.gather(reaper, return_exceptions=True)
    finally:
        await close_connection(nc)


async def _wire_uploader(cfg, node, index, stopping, ready, rec):
    from hsx.uploader.config import UploaderConfig
    from hsx.uploader.service import SERVICE
    from hsx.wire import topology
    from hsx.wire.events import EventPublisher, WorkerState
    from hsx.wire.jobs import wait_for_job
    from hsx.wire.natsconn import NatsSettings, close_connection, connect
    from hsx.wire.worker import JobWatch, heartbeats, watching

    job = cfg["job"]
    instance = f"{node}-up{index}-{os.getpid()}"
    ucfg = UploaderConfig(nats=NatsSettings(url=cfg["url"]), instance=instance, job=job, node=node)
    nc = await connect(ucfg.nats, name=f"hsx-upload-{job}-{instance}")
    try:
        js = nc.jetstream()
        kv = await topology.wait_for_jobs_bucket(js, job, stopping, wait_s=60)
        spec = await wait_for_job(kv, job, stopping, wait_s=60, given_wait_s=60)
        events = EventPublisher(nc, js, job)
        watch = JobWatch(kv, spec, stopping)
        await topology.ensure_upload_consumer(js, job, node, ack_wait_s=ucfg.ack_wait_s)
        worker = WireUploader(nc, spec, node, instance, ucfg.max_inflight, rec, stopping)

        def state():
            return WorkerState(state="working" if worker.inflight else "idle", detail=f"inflight={worker.inflight}")

        async with watching(watch), heartbeats(events, ucfg, service=SERVICE, stopping=stopping, state=state):
            await worker.start()
            ready.set()
            await worker.pull_loop()
            deadline = time.monotonic() + 30
            while worker.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
    finally:
        await close_connection(nc)


async def _loop_lag(rec: Recorder, stopping: asyncio.Event, every_s: float = 0.05) -> None:
    """How late the event loop wakes a sleeper: the generator's saturation."""
    loop = asyncio.get_running_loop()
    while not stopping.is_set():
        began = loop.time()
        await asyncio.sleep(every_s)
        rec.add("sim_loop_lag", max(0.0, loop.time() - began - every_s))


async def _sim_main(cfg: dict) -> int:
    from hsx.logs import configure_logging

    log_file = open(cfg["log"], "a")
    configure_logging(json=True, level="warning", file=log_file)
    rec = Recorder()
    if cfg["workers"] == "real":
        _install_timers(rec)
        classes = _sim_classes(1.0 / cfg["gpu_rate"])

        def consumer(node, i, stopping, ready):
            return _sim_consumer(cfg, node, i, stopping, ready, classes)

        def uploader(node, i, stopping, ready):
            return _sim_uploader(cfg, node, i, stopping, ready, classes)
    else:

        def consumer(node, i, stopping, ready):
            return _wire_consumer(cfg, node, i, stopping, ready, rec)

        def uploader(node, i, stopping, ready):
            return _wire_uploader(cfg, node, i, stopping, ready, rec)

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    readies, tasks = [], []
    for node in cfg["nodes"]:
        for i in range(cfg["gpus_per_node"]):
            readies.append(asyncio.Event())
            tasks.append(asyncio.create_task(consumer(node, i, stopping, readies[-1])))
        for i in range(cfg["uploaders_per_node"]):
            readies.append(asyncio.Event())
            tasks.append(asyncio.create_task(uploader(node, i, stopping, readies[-1])))
    lag = asyncio.create_task(_loop_lag(rec, stopping))
    all_ready = asyncio.create_task(asyncio.wait([asyncio.create_task(r.wait()) for r in readies]))
    await asyncio.wait({all_ready, *tasks}, return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        if task.done():  # a worker ended before the job ran: its error ends the process
            task.result()
            raise RuntimeError("a simulated worker ended before the window")
    Path(cfg["ready_file"]).write_text("ready")
    window_file = Path(cfg["window_file"])
    while not window_file.exists() and not stopping.is_set():
        await asyncio.sleep(0.2)
    if window_file.exists():
        window = json.loads(window_file.read_text())
        await asyncio.sleep(max(0.0, window["t1"] + 0.5 - time.time()))
        result = rec.window(window["t0"], window["t1"])
        import hsx.wire.schemas

        result["hsx"] = str(Path(hsx.wire.schemas.__file__).resolve().parent.parent)  # which checkout ran
        tmp = Path(cfg["result_file"] + ".partial")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, cfg["result_file"])
    await stopping.wait()
    await asyncio.wait(tasks, timeout=60)
    lag.cancel()
    return 0


def sim(config_path: Path) -> int:
    cfg = json.loads(config_path.read_text())
    return asyncio.run(_sim_main(cfg))


# ---------------------------------------------------------------------------------------------
# The driver.


def _cpu_s(pid: int) -> float | None:
    """utime + stime (+ waited-for children) of a live process, in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return sum(int(x) for x in fields[11:15]) / _TICKS


def _machine_busy_s() -> float:
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / _TICKS


def _http_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


def _hsx_env(hsx_root: Path | None, farm: Path) -> dict:
    """The environment a child runs hsx in: this checkout's, or `hsx_root`'s through `farm`, a
    folder of links named as the installed packages (found on PYTHONPATH before the editable
    install)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if hsx_root is None:
        return env
    (farm / "hsx").mkdir(parents=True)
    for entry in (hsx_root / "hsx").iterdir():
        (farm / "hsx" / entry.name).symlink_to(entry)
    for package in ("producer", "gpu_consumer", "uploader", "monitor", "commands"):
        (farm / "hsx" / package).symlink_to(hsx_root / package)
    env["PYTHONPATH"] = os.pathsep.join([str(farm), str(hsx_root)])
    return env


def write_dataset(path: Path, *, count: int, tokens: int, vocab_size: int, seed: int) -> None:
    """Pre-tokenized JSONL, every sample `tokens` long (so the monitor's folded tokens say its
    samples), a loss mask over the second half."""
    import numpy as np

    rng = np.random.default_rng(seed)
    half = tokens // 2
    mask = [0] * half + [1] * (tokens - half)
    with open(path, "w") as out:
        for start in range(0, count, 10_000):
            n = min(10_000, count - start)
            ids = rng.integers(0, vocab_size, size=(n, tokens)).tolist()
            out.write(
                "".join(
                    json.dumps({"id": f"s{start + i}", "input_ids": row, "loss_mask": mask}) + "\n"
                    for i, row in enumerate(ids)
                )
            )


class MonitorReader(threading.Thread):
    """The monitor's stdout, each `progress` line with the time it arrived."""

    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.proc = proc
        self.readings: list[tuple[float, dict]] = []
        self.other: list[str] = []

    def run(self) -> None:
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                self.other.append(line[:300])
                continue
            if event.get("event") == "progress":
                self.readings.append((time.time(), event))
            elif event.get("level") in ("warning", "error"):
                self.other.append(line[:300])


async def _nats_probe(url: str):
    from hsx.wire.natsconn import NatsSettings, connect

    return await connect(NatsSettings(url=url), name="hsx-bench-fleet-capacity")


class Probe:
    """The bench's own NATS connection on a loop of its own: pauses, counts, backlog."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.nc = self.call(_nats_probe(url))
        self.js = self.nc.jetstream()

    def call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.nc.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


async def _pause(js, nc, job: str, delay_s: float) -> float:
    """Create the job's gpu durable (as consumers do) and pause it until `delay_s` from now
    (JetStream consumer pause; bench/pipeline.py's `_pause_until`): the pull requests waiting
    then are served the moment it runs out. Returns that wall-clock time."""
    from hsx.wire import topology

    durable = await topology.ensure_gpu_consumer(js, job)
    until = time.time() + delay_s
    stamp = datetime.datetime.fromtimestamp(until, datetime.UTC).isoformat().replace("+00:00", "Z")
    reply = json.loads(
        (
            await nc.request(
                f"$JS.API.CONSUMER.PAUSE.{topology.BATCHES_STREAM}.{durable}",
                json.dumps({"pause_until": stamp}).encode(),
            )
        ).data
    )
    if "error" in reply or not reply.get("paused"):
        raise SystemExit(f"cannot pause {durable}: {reply}")
    return until


async def _uploaded(js, job: str, plan: str) -> int:
    from hsx.wire.counts import read_counts

    return (await read_counts(js, job, plan)).samples_uploaded


async def _backlog(js, job: str) -> dict:
    from hsx.wire import topology

    info = await js.consumer_info(topology.BATCHES_STREAM, topology.gpu_durable(job))
    files = await js.stream_info(topology.FILES_STREAM, subjects_filter=topology.files_subject_all(job))
    return {
        "batches_in_hand": info.num_ack_pending or 0,
        "files_queued": sum((files.state.subjects or {}).values()),
    }


async def _plan_of(js, job: str) -> str:
    from hsx.wire import topology
    from hsx.wire.jobs import read_job_spec

    kv = await topology.jobs_bucket(js)
    return (await read_job_spec(kv, job)).plan_tag


class BacklogSampler(threading.Thread):
    def __init__(self, probe: Probe, job: str, every_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.probe, self.job, self.every_s = probe, job, every_s
        self.samples: list[tuple[float, dict]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            try:
                self.samples.append((time.time(), self.probe.call(_backlog(self.probe.js, self.job), timeout=10)))
            except Exception:  # noqa: BLE001 - a missed sample
                pass

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def _slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares growth per second."""
    if len(points) < 3:
        return None
    mt = statistics.fmean(t for t, _ in points)
    mv = statistics.fmean(v for _, v in points)
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / den if den else None


def _merge_latencies(results: list[dict]) -> dict:
    merged: dict[str, list[float]] = {}
    for result in results:
        for name, stats in result["latency_ms"].items():
            merged.setdefault(name, []).extend(stats["values"])
    out = {}
    for name, values in sorted(merged.items()):
        values.sort()
        out[name] = {
            "n": len(values),
            "median": round(1000 * statistics.median(values), 2),
            "p99": round(1000 * values[min(len(values) - 1, int(0.99 * len(values)))], 2),
        }
    return out


def _stop(proc: subprocess.Popen, wait_s: float = 90.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _others_cores(pids: list[int], seconds: float) -> float:
    """Cores the rest of the machine kept busy over `seconds` (everything but `pids`)."""
    before = sum(_cpu_s(pid) or 0.0 for pid in pids), _machine_busy_s()
    time.sleep(seconds)
    after = sum(_cpu_s(pid) or 0.0 for pid in pids), _machine_busy_s()
    return ((after[1] - before[1]) - (after[0] - before[0])) / seconds


def _wait_for_quiet(args, pids: list[int]) -> float | None:
    """On a shared machine, hold the release (the fleet waiting, idle) until the other processes
    keep at most --quiet-cores busy, for at most --quiet-wait seconds; how long it waited (None:
    not asked, or it never got quiet)."""
    if args.quiet_cores is None:
        return None
    began = time.monotonic()
    while time.monotonic() - began < args.quiet_wait:
        if _others_cores(pids, 3.0) <= args.quiet_cores:
            return round(time.monotonic() - began, 1)
    return None


def _start_monitor(args, server, job: str, env: dict, err: Path, *extra: str):
    """`hsx monitor --format json` of `job` as a child, and the thread reading its lines."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsx.cli", "monitor", "--nats", server.url, "--job", job, "--format", "json", *extra],
        cwd=args.child_cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=open(err, "w"),
        text=True,
    )
    reader = MonitorReader(proc)
    reader.start()
    return proc, reader


def run_step(args, rate: int, *, server, probe: Probe, model: Path, workdir: Path, env: dict, step: int) -> dict:
    job = f"cap{step}-{rate}"
    gpus = max(1, math.ceil(rate / args.gpu_rate))
    nodes = [f"node{i:03d}" for i in range(math.ceil(gpus / args.gpus_per_node))]
    gpus = len(nodes) * args.gpus_per_node
    offered = gpus * args.gpu_rate
    samples = int(offered * (args.warmup + args.window + 10) * 1.1)
    stepdir = workdir / job
    stepdir.mkdir(parents=True)
    dataset = stepdir / "dataset.jsonl"
    write_dataset(dataset, count=samples, tokens=args.sample_tokens, vocab_size=2048, seed=step)
    produced = time.monotonic()
    produce = subprocess.run(
        [
            sys.executable,
            "-m",
            "hsx.cli",
            "produce",
            "--nats",
            server.url,
            "--job",
            job,
            "--model",
            str(model),
            "--dataset",
            str(dataset),
            "--layers",
            "1",
            "--dest",
            (workdir / "out").as_uri(),
            "--token-budget",
            str(args.sample_tokens * args.batch_samples),
            "--max-seq-len",
            str(args.sample_tokens),
            "--ignore-free-space",
        ],
        cwd=args.child_cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    if produce.returncode != 0:
        raise SystemExit(f"hsx produce exited {produce.returncode}: {produce.stderr.strip()[-2000:]}")
    produce_s = time.monotonic() - produced
    dataset.unlink()
    plan = probe.call(_plan_of(probe.js, job))
    probe.call(_pause(probe.js, probe.nc, job, 86400.0))

    monitor, reader = _start_monitor(args, server, job, env, stepdir / "monitor.err")
    sims = []
    for k in range(args.sim_procs):
        share = nodes[k :: args.sim_procs]
        if not share:
            continue
        cfg = {
            "url": server.url,
            "job": job,
            "nodes": share,
            "gpus_per_node": args.gpus_per_node,
            "uploaders_per_node": args.uploaders_per_node,
            "gpu_rate": args.gpu_rate,
            "workers": args.workers,
            "spool": str(stepdir / "spool"),
            "log": str(stepdir / f"sim{k}.log"),
            "ready_file": str(stepdir / f"sim{k}.ready"),
            "window_file": str(stepdir / "window.json"),
            "result_file": str(stepdir / f"sim{k}.result.json"),
        }
        (stepdir / f"sim{k}.json").write_text(json.dumps(cfg))
        sims.append(
            (
                k,
                subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--sim", str(stepdir / f"sim{k}.json")],
                    cwd=args.child_cwd,
                    env=env,
                    stdout=open(stepdir / f"sim{k}.out", "w"),
                    stderr=subprocess.STDOUT,
                ),
            )
        )
    try:
        started = time.monotonic()
        nats_cpu_started = _cpu_s(server.process.pid)
        varz_started = _http_json(f"{server.monitoring_url}/varz")
        while not all((stepdir / f"sim{k}.ready").exists() for k, _ in sims):
            for k, proc in sims:
                if proc.poll() is not None:
                    raise SystemExit(f"simulated workers {k} exited {proc.returncode}; see {stepdir}/sim{k}.out")
            if time.monotonic() - started > 600:
                raise SystemExit("simulated workers not ready after 600 s")
            time.sleep(0.2)
        startup_s = time.monotonic() - started
        varz_ready = _http_json(f"{server.monitoring_url}/varz")
        # The fleet connected and waiting (the durable still paused): what NATS spends on the
        # workers themselves, whatever the rate (pulls expiring, heartbeats, job watches, reapers).
        idle_cpu, idle_varz, idle_at = _cpu_s(server.process.pid), varz_ready, time.monotonic()
        time.sleep(args.idle)
        idle_s = time.monotonic() - idle_at
        idle_varz_end = _http_json(f"{server.monitoring_url}/varz")
        idle = {
            "seconds": round(idle_s, 1),
            "nats_cores": round((_cpu_s(server.process.pid) - idle_cpu) / idle_s, 3),
            "in_msgs_per_s": round((idle_varz_end["in_msgs"] - idle_varz["in_msgs"]) / idle_s),
            "out_msgs_per_s": round((idle_varz_end["out_msgs"] - idle_varz["out_msgs"]) / idle_s),
        }
        startup = {
            "seconds": round(startup_s, 1),
            "nats_cpu_s": round(_cpu_s(server.process.pid) - nats_cpu_started, 2),
            "nats_out_mb": round((varz_ready["out_bytes"] - varz_started["out_bytes"]) / 1e6, 1),
            "nats_in_msgs": varz_ready["in_msgs"] - varz_started["in_msgs"],
        }
        pids = {"nats_server": server.process.pid, "monitor": monitor.pid, "bench": os.getpid()}
        pids.update({f"sim{k}": proc.pid for k, proc in sims})
        waited_for_quiet = _wait_for_quiet(args, list(pids.values()))
        released = probe.call(_pause(probe.js, probe.nc, job, _RELEASE_S))
        t0 = released + args.warmup
        t1 = t0 + args.window
        (stepdir / "window.json").write_text(json.dumps({"t0": t0, "t1": t1}))
        backlog = BacklogSampler(probe, job)
        backlog.start()

        def reading() -> dict:
            return {
                "time": time.time(),
                "cpu": {name: _cpu_s(pid) for name, pid in pids.items()},
                "busy": _machine_busy_s(),
                "varz": _http_json(f"{server.monitoring_url}/varz"),
                "uploaded": probe.call(_uploaded(probe.js, job, plan)),
            }

        time.sleep(max(0.0, t0 - time.time()))
        first = reading()
        load_start = os.getloadavg()
        time.sleep(max(0.0, t1 - time.time()))
        last = reading()
        load_end = os.getloadavg()
        backlog.stop()
        results = []
        for k, proc in sims:
            path = stepdir / f"sim{k}.result.json"
            deadline = time.monotonic() + 60
            while not path.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"simulated workers {k} gave no result; see {stepdir}/sim{k}.out")
                time.sleep(0.2)
            results.append(json.loads(path.read_text()))
        # The monitor's fold at the window's end: how long until it holds what was stored by then.
        caught_up_after = None
        deadline = time.time() + 30
        while time.time() < deadline:
            done = [(t, e) for t, e in reader.readings if t >= t1]
            hit = next((t for t, e in done if e["tokens_uploaded"] >= last["uploaded"] * args.sample_tokens), None)
            if hit is not None:
                caught_up_after = round(hit - t1, 2)
                break
            time.sleep(0.5)
    finally:
        for _, proc in sims:
            proc.send_signal(signal.SIGTERM)
        for _, proc in sims:
            _stop(proc)
        _stop(monitor, 30)
        reader.join(5)
    cold = cold_fold(args, server, probe, job, env, stepdir) if args.cold_fold else None

    seconds = last["time"] - first["time"]
    uploaded = last["uploaded"] - first["uploaded"]
    cpu = {
        name: round(last["cpu"][name] - first["cpu"][name], 2)
        for name in pids
        if last["cpu"][name] is not None and first["cpu"][name] is not None
    }
    sims_cpu = sum(v for k, v in cpu.items() if k.startswith("sim"))
    busy = last["busy"] - first["busy"]
    varz = {key: last["varz"][key] - first["varz"][key] for key in ("in_msgs", "in_bytes", "out_msgs", "out_bytes")}
    counts: dict[str, int] = {}
    for result in results:
        for name, n in result["counts"].items():
            counts[name] = counts.get(name, 0) + n
    window_readings = [(t, e) for t, e in reader.readings if t0 <= t <= t1 + 0.5]
    behind = [(t, e["samples_uploaded"] - e["tokens_uploaded"] / args.sample_tokens) for t, e in window_readings]
    folded = [(t, e["tokens_uploaded"] / args.sample_tokens) for t, e in window_readings]
    fold_rate = (folded[-1][1] - folded[0][1]) / (folded[-1][0] - folded[0][0]) if len(folded) >= 2 else None
    per_sample = max(uploaded, 1)
    nats_ms_per_1000 = 1e6 * cpu["nats_server"] / per_sample
    backlog_points = [(t, b) for t, b in backlog.samples if t0 <= t <= t1]
    return {
        "offered_samples_per_s": offered,
        "achieved_samples_per_s": round(uploaded / seconds, 1),
        "achieved_fraction": round(uploaded / seconds / offered, 3),
        "gpus": gpus,
        "nodes": len(nodes),
        "uploaders": len(nodes) * args.uploaders_per_node,
        "connections": gpus + len(nodes) * args.uploaders_per_node,
        "job": job,
        "samples_in_job": samples,
        "produce_s": round(produce_s, 1),
        "startup": startup,
        "idle_fleet": idle,
        "waited_for_quiet_s": waited_for_quiet,
        "window_s": round(seconds, 2),
        "samples_in_window": uploaded,
        "sim_counts": counts,
        "sim_hsx": sorted({result["hsx"] for result in results}),
        "cpu_s": cpu,
        "cores": {name: round(value / seconds, 2) for name, value in cpu.items()},
        "cores_sims": round(sims_cpu / seconds, 2),
        "cores_machine": round(busy / seconds, 2),
        "cores_others": round((busy - sum(cpu.values())) / seconds, 2),
        # Every core busy: the step's rate says what the machine gave the load generator, not
        # what NATS can carry (its CPU per sample still does).
        "machine_saturated": busy / seconds >= 0.95 * (os.cpu_count() or 1),
        "nats_cpu_ms_per_1000_samples": round(nats_ms_per_1000, 1),
        "nats_cores_at_5000": round(5 * nats_ms_per_1000 / 1000, 2),
        "monitor_cpu_ms_per_1000_samples": round(1e6 * cpu.get("monitor", 0) / per_sample, 1),
        # What one core of the monitor folds at that cost (it is one Python thread).
        "monitor_samples_per_s_on_1_core": round(per_sample / cpu["monitor"]) if cpu.get("monitor") else None,
        "sims_cpu_ms_per_1000_samples": round(1e6 * sims_cpu / per_sample, 1),
        "nats": {
            **{f"{key}_per_sample": round(value / per_sample, 2) for key, value in varz.items()},
            "in_msgs_per_s": round(varz["in_msgs"] / seconds),
            "out_msgs_per_s": round(varz["out_msgs"] / seconds),
        },
        "latency_ms": _merge_latencies(results),
        "backlog": {
            "batches_in_hand_median": statistics.median([b["batches_in_hand"] for _, b in backlog_points])
            if backlog_points
            else None,
            "files_queued_median": statistics.median([b["files_queued"] for _, b in backlog_points])
            if backlog_points
            else None,
            "files_queued_max": max((b["files_queued"] for _, b in backlog_points), default=None),
            "files_queued_growth_per_s": None
            if _slope([(t, b["files_queued"]) for t, b in backlog_points]) is None
            else round(_slope([(t, b["files_queued"]) for t, b in backlog_points]), 1),
        },
        "monitor": {
            "readings_in_window": len(window_readings),
            "samples_behind_max": round(max((b for _, b in behind), default=0)),
            "samples_behind_last": round(behind[-1][1]) if behind else None,
            "fold_samples_per_s": None if fold_rate is None else round(fold_rate, 1),
            "caught_up_s_after_window": caught_up_after,
            "cold_start": cold,
            "warnings": reader.other[:5],
        },
        "load_average": [round(x, 2) for x in (*load_start[:1], *load_end[:1])],
    }


async def _drop_checkpoint(js, job: str) -> None:
    from hsx.wire import topology

    await js.purge_stream(topology.EVENTS_STREAM, subject=topology.checkpoint_subject(job))


def cold_fold(args, server, probe: Probe, job: str, env: dict, stepdir: Path) -> dict:
    """A monitor started on the step's job with no checkpoint folds every marker from the first:
    how fast it catches up is the most it folds (one process, one core at most)."""
    probe.call(_drop_checkpoint(probe.js, job))
    began = time.time()
    proc, reader = _start_monitor(args, server, job, env, stepdir / "cold-monitor.err", "--interval", "0.5")
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            readings = list(reader.readings)
            if (
                readings
                and readings[-1][1]["tokens_uploaded"] >= readings[-1][1]["samples_uploaded"] * args.sample_tokens
            ):
                break
            time.sleep(0.2)
        cpu = _cpu_s(proc.pid)
    finally:
        _stop(proc, 30)
        reader.join(5)
    readings = reader.readings
    if not readings:
        return {"error": "no reading"}
    total = readings[-1][1]["samples_uploaded"]
    moving = [(t, e["tokens_uploaded"] / args.sample_tokens) for t, e in readings]
    first = next(((t, v) for t, v in moving if v > 0), None)
    last = next(((t, v) for t, v in moving if v >= total), None)
    rate = None
    if first is not None and last is not None and last[0] > first[0]:
        rate = round((last[1] - first[1]) / (last[0] - first[0]))
    return {
        "samples": total,
        "caught_up_s_from_start": None if last is None else round(last[0] - began, 1),
        "fold_samples_per_s": rate,  # between its first reading with sums and the one that held them all
        # From the process's start (imports, connection and first reading included): a floor.
        "fold_samples_per_s_at_least": None if last is None else round(total / (last[0] - began)),
        "cpu_s": None if cpu is None else round(cpu, 2),
    }


def _delete_job(server_url: str, job: str, env: dict, cwd: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "hsx.cli", "jobs", "delete", job, "--force", "--nats", server_url],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sim", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rates", default="500,1000,2000,4000", help="offered samples/s fleet-wide, one step each")
    parser.add_argument("--gpu-rate", type=float, default=40.0, help="samples/s per simulated GPU")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--uploaders-per-node", type=int, default=2)
    parser.add_argument("--sample-tokens", type=int, default=64, help="every sample's length")
    parser.add_argument("--batch-samples", type=int, default=32, help="samples per batch (token budget / length)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds from the release to the window")
    parser.add_argument("--window", type=float, default=20.0, help="seconds measured")
    parser.add_argument(
        "--idle", type=float, default=5.0, help="seconds the fleet is measured idle, before the release"
    )
    parser.add_argument(
        "--no-cold-fold",
        dest="cold_fold",
        action="store_false",
        help="skip the monitor started cold on each step's job (its fold rate from the first marker)",
    )
    parser.add_argument(
        "--quiet-cores",
        type=float,
        default=None,
        help="release each step only once the machine's other processes keep at most this many cores busy",
    )
    parser.add_argument("--quiet-wait", type=float, default=600.0, help="seconds --quiet-cores waits at most")
    parser.add_argument("--sim-procs", type=int, default=2, help="processes the simulated workers run in")
    parser.add_argument(
        "--workers",
        choices=("real", "wire"),
        default="real",
        help="real: the workers' own code less model and files; wire: their messages from a lean loop",
    )
    parser.add_argument("--hsx-root", type=Path, default=None, help="run hsx from this checkout (a before)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    if args.sim is not None:
        return sim(args.sim)

    sys.path.insert(0, str(REPO))
    from hsx.commands.embedded import build_tiny_model, start_nats_server

    rates = [int(r) for r in args.rates.split(",") if r.strip()]
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="hsx-bench-capacity-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    env = _hsx_env(args.hsx_root.resolve() if args.hsx_root else None, workdir / "hsx-root")
    # A child started in a checkout imports that checkout's hsx first (its folder is on sys.path).
    args.child_cwd = workdir if args.hsx_root else REPO
    server = start_nats_server(workdir / "nats", log_file=workdir / "nats-server.log")
    probe = None
    steps = []
    wall = time.monotonic()
    try:
        model = build_tiny_model(
            workdir / "model",
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
        )
        probe = Probe(server.url)
        for step, rate in enumerate(rates):
            result = run_step(args, rate, server=server, probe=probe, model=model, workdir=workdir, env=env, step=step)
            steps.append(result)
            print(
                json.dumps(
                    {
                        "step": rate,
                        **{
                            k: result[k]
                            for k in ("achieved_samples_per_s", "nats_cpu_ms_per_1000_samples", "cores", "load_average")
                        },
                    }
                ),
                file=sys.stderr,
                flush=True,
            )
            _delete_job(server.url, result["job"], env, args.child_cwd)
    finally:
        if probe is not None:
            probe.close()
        server.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    capacity = max(
        (
            s["offered_samples_per_s"]
            for s in steps
            if s["achieved_fraction"] >= 0.95
            and (s["backlog"]["files_queued_growth_per_s"] or 0) < 0.05 * s["offered_samples_per_s"]
        ),
        default=None,
    )
    nats_ms = [s["nats_cpu_ms_per_1000_samples"] for s in steps]
    print(
        json.dumps(
            {
                "bench": "fleet_capacity",
                "config": {
                    "rates": rates,
                    "gpu_rate": args.gpu_rate,
                    "gpus_per_node": args.gpus_per_node,
                    "uploaders_per_node": args.uploaders_per_node,
                    "sample_tokens": args.sample_tokens,
                    "batch_samples": args.batch_samples,
                    "warmup_s": args.warmup,
                    "window_s": args.window,
                    "sim_procs": args.sim_procs,
                    "workers": args.workers,
                    "hsx_root": str(args.hsx_root) if args.hsx_root else None,
                    "cpu_count": os.cpu_count(),
                },
                "capacity_samples_per_s": capacity,
                "nats_cpu_ms_per_1000_samples": nats_ms,
                "nats_samples_per_s_on_2_cores": [round(2e6 / ms) if ms else None for ms in nats_ms],
                "steps": steps,
                "wall_s": round(time.monotonic() - wall, 1),
                **({"workdir": str(workdir)} if args.keep else {}),
            },
            indent=1,
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
