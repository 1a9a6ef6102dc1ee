"""The GPU consumer's batch worker (`BatchWorker`): one batch from its descriptor to its ack.

`compute`: decode (poison -> dead letter), set aside another plan's batch, run the forward on the
device thread (gpu_consumer/device_thread.py) into host buffers leased to the batch
(gpu_consumer/staging.py). `finish`: write each sample file atomically into the spool on the
writer threads, fsync the folders once, announce the files (`publish_all`), store the batch's
`written` marker, and only then `ack_sync()`. Each stage is watched for a stall
(gpu_consumer/stall.py). What is fetched and which batch runs when is the scheduler's
(gpu_consumer/scheduler.py).
"""

import asyncio
import errno
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
import nats.js.errors
import structlog
import torch
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from hsx.gpu_consumer import compiling
from hsx.gpu_consumer.config import ConsumerConfig
from hsx.gpu_consumer.device_thread import DeviceThread
from hsx.gpu_consumer.extract import (
    DeviceFailed,
    InFlight,
    NonFiniteStates,
    device_failed,
    extract_isolating,
    launch_samples,
)
from hsx.gpu_consumer.gpuuse import GpuReader
from hsx.gpu_consumer.model import LoadedModel
from hsx.gpu_consumer.plansamples import PlanSamples, PlanSamplesUnavailable, batch_placed
from hsx.gpu_consumer.staging import StagingLease
from hsx.gpu_consumer.stall import STAGES, ForwardPace, ReleasedBatch, Stall
from hsx.gpu_consumer.writer import write_sample_file
from hsx.job import JobSpec
from hsx.storage.fsutil import fsync_dir
from hsx.storage.layout import SampleFiles
from hsx.storage.spool import SpoolMeter, plan_folder, spool_file
from hsx.wire import schemas, topology
from hsx.wire.events import EventPublisher, WorkerState
from hsx.wire.headers import message_headers
from hsx.wire.jetstream import give_back, publish_all
from hsx.wire.load import BusyMeter, RecentRate, spool_free
from hsx.wire.natsconn import through_outage
from hsx.wire.pull import Taken
from hsx.wire.worker import JobWatch

log = structlog.get_logger("hsx.gpu_consumer")

SERVICE = topology.CONSUMER_SERVICE
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# How long a batch of a round whose spec is not recorded yet waits before it is looked at again.
_ROUND_WAIT_S = 10.0
T = TypeVar("T")

# Seams for tests (devkit/faults.py installs faults here, e.g. a crash at the worst moment):
# called when a batch is taken up, and after its files are written and announced, before its ack.
on_batch: Callable[[schemas.BatchDescriptor], None] | None = None
before_ack: Callable[[], None] | None = None


@dataclass
class Computed:
    """A batch whose forward is done and whose files are still to be written and announced."""

    taken: Taken
    batch: schemas.BatchDescriptor
    attempt: int
    started: float
    extracted: list[tuple[schemas.Sample, torch.Tensor]]
    failed: list[tuple[schemas.Sample, str]] = field(default_factory=list)
    # The host buffers `extracted` are views into (None without staging): released by finish().
    lease: StagingLease | None = None

    @property
    def msg(self) -> Msg:
        return self.taken.msg


@dataclass
class Running:
    """A batch taken up (`BatchWorker.start`): `launched` is set once its forward is queued on the
    device (or its first stage ended without one); `task` is its first stage, which ends when its
    states are on the host (`Computed`) or it was settled (None)."""

    taken: Taken
    launched: asyncio.Event
    task: "asyncio.Task[Computed | None]"


class BatchWorker:
    def __init__(
        self,
        cfg: ConsumerConfig,
        js: JetStreamContext,
        events: EventPublisher,
        spec: JobSpec,
        loaded: LoadedModel,
        stopping: asyncio.Event,
        *,
        watch: JobWatch | None = None,
        forwards: DeviceThread | None = None,
    ) -> None:
        self.cfg = cfg
        self.js = js
        self.events = events
        self.spec = spec
        self.loaded = loaded
        # The files the spec makes, in the encoding the model was loaded for: the spec's
        # (gpu_consumer/main.py loads the model for the spec it serves).
        self.files = SampleFiles(spec, loaded.encoding)
        self.stopping = stopping
        # Whether the job is still the one this worker started for (None: not watched, in tests).
        self.watch = watch
        # The samples the plan names, as its producer recorded them: what a descriptor may carry.
        self.plan_samples = PlanSamples(js, lambda: self.spec if watch is None else watch.current)
        self.state = "idle"
        self.last_batch = ""
        self.detail = ""  # why the worker is not working, when it is paused or waiting
        self.pace = ForwardPace(stall_after_s=cfg.stall_after_s, stall_factor=cfg.stall_factor)
        self.stall: Stall | None = None  # the stage past its bound, while it runs
        # What the heartbeat's `load` says (hsx/wire/load.py): samples written over the last
        # minute, the share of time in the forward, the device's utilization and memory.
        self.rate = RecentRate()
        self.busy = BusyMeter()
        self.gpu = GpuReader(loaded.device)
        self.batch_bytes = _full_batch_bytes(spec, loaded)
        # The batches taken up and not yet settled, by their Taken: what a stop is finishing.
        self._in_hand: dict[int, str] = {}
        self._writers = ThreadPoolExecutor(max_workers=cfg.writer_threads, thread_name_prefix="hsx-writer")
        # The plan's spool usage as a running count, read before every fetch and in every beat
        # (no walk of the folder on the way: hsx/storage/spool.py).
        self.spool_meter = SpoolMeter(plan_folder(cfg.spool, spec.job, spec.plan_tag)).start()
        # Where the forwards run: the consumer's device thread, which loaded and warmed up the
        # model (gpu_consumer/main.py); one of this worker's own when not given (benches, tests).
        self._owns_forwards = forwards is None
        self.forwards = forwards if forwards is not None else DeviceThread(loaded.device)
        # Where each batch's copy to the host is waited for, while the forwards thread queues the
        # next batch's forward.
        self.landing = DeviceThread(loaded.device, name="hsx-land")
        # When the device last finished a forward (monotonic): a batch queued behind another
        # starts computing then, not when it was queued (its pace, gpu_consumer/stall.py).
        self._device_free_at = 0.0
        # Stalled stages left running at a stop, "<stage> of <batch>": their threads cannot be
        # joined, so the consumer's process ends without waiting for them (gpu_consumer/main.py).
        self.abandoned: list[str] = []

    @property
    def job_lost(self) -> bool:
        return self.watch is not None and bool(self.watch.lost)

    def _write_one(self, batch_id: str, sample: schemas.Sample, hidden: torch.Tensor) -> schemas.FileReady:
        """Its folder is fsynced by the caller (`_sync_folders`), once for the batch's files."""
        try:  # a redelivered batch rewrites its files in place: counted once
            replaced = os.stat(spool_file(self.cfg.spool, self.spec.job, self.spec.plan_tag, sample.index)).st_size
        except FileNotFoundError:
            replaced = None
        ready = write_sample_file(
            spool=self.cfg.spool,
            files=self.files,
            node=self.cfg.node,
            batch_id=batch_id,
            sample=sample,
            hidden_states=hidden,
            sync_dir=False,
        )
        self.spool_meter.add(0 if replaced is not None else 1, ready.size - (replaced or 0))
        return ready

    def _write_some(self, batch_id: str, part: list[tuple[schemas.Sample, torch.Tensor]]) -> list[schemas.FileReady]:
        """One writer thread's share of a batch's files, in order."""
        return [self._write_one(batch_id, sample, hidden) for sample, hidden in part]

    def _sync_folders(self, files: list[schemas.FileReady]) -> None:
        """fsync each folder the batch's files were renamed into: after this their names are as
        durable as their bytes (each file was fsynced before its rename), so they may be announced."""
        for folder in {(self.cfg.spool / f.spool_path).parent for f in files}:
            fsync_dir(folder)

    async def _write_files(self, computed: Computed) -> list[schemas.FileReady]:
        """One attempt at writing the batch's files. One job per writer thread, each a contiguous
        share of the batch (not one job per file: a future and two thread hand-offs per small file
        cost more than its write)."""
        loop = asyncio.get_running_loop()
        extracted = computed.extracted
        share = -(-len(extracted) // max(1, self.cfg.writer_threads))
        parts = await asyncio.gather(
            *(
                loop.run_in_executor(
                    self._writers, self._write_some, computed.batch.batch_id, extracted[start : start + share]
                )
                for start in range(0, len(extracted), share)
            ),
            return_exceptions=True,
        )
        # Every write has ended before a failure is acted on: the others still read the batch's
        # leased host buffers, which must not be released (and reused) under them.
        errors = [outcome for outcome in parts if isinstance(outcome, BaseException)]
        if errors:
            raise errors[0]
        files = [ready for part in parts for ready in part]
        await loop.run_in_executor(self._writers, self._sync_folders, files)
        return files

    async def _write_until_written(
        self, computed: Computed, on_stall: Callable[[], Awaitable[None]] | None
    ) -> list[schemas.FileReady] | None:
        """Write the batch's files; while the spool disk is full, keep the computed states and the
        message (in_progress continues) and retry with a growing delay. Each attempt is watched: a
        write that hangs (a dead disk) stalls the batch. None if asked to stop first."""
        delay = 2.0
        while True:
            try:
                files = await self._watched(
                    self._write_files(computed),
                    stage="write",
                    batch=computed.batch,
                    taken=computed.taken,
                    bound_s=self.cfg.stall_after_s,
                    on_stall=on_stall,
                )
                self.state, self.detail = "working", ""
                return files
            except OSError as exc:
                if exc.errno not in _DISK_FULL:
                    raise
                self.state = "disk_full"
                self.detail = f"spool disk full ({self.cfg.spool}), retrying in {delay:.0f} s"
                log.warning(
                    "spool_disk_full", spool=str(self.cfg.spool), error=os.strerror(exc.errno), retry_in_s=delay
                )
                try:
                    await asyncio.wait_for(self.stopping.wait(), timeout=delay)
                    return None
                except TimeoutError:
                    delay = min(delay * 2, 60.0)

    async def _watched(
        self,
        work: Awaitable[T],
        *,
        stage: str,
        batch: schemas.BatchDescriptor,
        taken: Taken,
        bound_s: float,
        on_stall: Callable[[], Awaitable[None]] | None,
    ) -> T:
        """`work` (one stage of the batch: its forward, a write attempt, the announcing), watched.
        Past `bound_s` the stage is stalled: in_progress stops, so JetStream hands the batch to
        another consumer after the ack wait, `on_stall` hands back what the pull loop holds, and
        the heartbeat says `stalled`. A thread cannot be interrupted, so the stage is still
        awaited. If it ends after all, its result is used only while the batch is still in the
        queue (a redelivery in another consumer's hands: finishing it too is harmless, same
        files, file events carry their delivery in their msg ids, progress counts each batch and
        sample once); a batch settled elsewhere meanwhile (done by another consumer, or
        dead-lettered) is left alone (`ReleasedBatch`), so that it is never both written and
        dead-lettered. Nor is a failure settled from here: a nak would hand out the copy another
        consumer is working on."""
        began = time.monotonic()
        running = asyncio.ensure_future(work)
        if await _ends_within(running, bound_s):
            try:
                result = running.result()
            finally:
                # A failed stage's exception holds this frame, which held the task, which holds
                # the exception: a cycle that kept every frame of a failed forward (and its
                # tensors on the device) alive until the cycle collector ran.
                running = None
            if stage == "forward":
                # Only forwards within their bound: a stalled one would raise every later bound
                # by the time the device spent hung. A forward queued behind another one computes
                # from when that one landed.
                now = time.monotonic()
                self.pace.add(batch, now - max(began, self._device_free_at))
                self._device_free_at = now
            return result
        stalled_event, finished_event = STAGES[stage].stalled, STAGES[stage].finished
        taken.release()
        self.stall = Stall(batch_id=batch.batch_id, began=began, bound_s=bound_s, stage=stage)
        log.warning(
            stalled_event,
            batch=batch.batch_id,
            running_s=round(bound_s, 1),
            bound_s=round(bound_s, 1),
            padded_tokens=self.pace.padded_tokens(batch),
            released_after_s=self.cfg.ack_wait_s,
        )
        try:
            if on_stall is not None:
                await on_stall()
            try:
                if not await self._ends_unless_stopped(running):
                    # Its batch is released already (redelivered after the ack wait): a stop does
                    # not wait out a stage past its bound, so it takes at most the stages' bounds.
                    self.abandoned.append(f"{stage} of {batch.batch_id}")
                    log.warning(
                        "stalled_stage_abandoned",
                        stage=stage,
                        batch=batch.batch_id,
                        reason="stopping",
                        seconds=round(time.monotonic() - began, 1),
                    )
                    raise ReleasedBatch(batch.batch_id)
                result = running.result()
            except ReleasedBatch:
                raise
            except Exception as exc:
                if device_failed(exc):
                    raise  # not the batch's failure: the consumer must end (_compute_batch)
                log.warning(
                    "stalled_stage_failed",
                    stage=stage,
                    batch=batch.batch_id,
                    error=f"{type(exc).__name__}: {exc}",
                    seconds=round(time.monotonic() - began, 1),
                )
                raise ReleasedBatch(batch.batch_id) from exc
        finally:
            self.stall = None
            running = None  # the same cycle as above
        log.warning(finished_event, batch=batch.batch_id, seconds=round(time.monotonic() - began, 1))
        if not await self._still_queued(taken.msg):
            log.warning("released_batch_settled_elsewhere", batch=batch.batch_id, stage=stage)
            raise ReleasedBatch(batch.batch_id)
        # Kept alive again for the rest of its way (a stalled stage may have taken its ack wait).
        taken.renew(interval_s=self.cfg.in_progress_s)
        return result

    async def _ends_unless_stopped(self, running: asyncio.Future) -> bool:
        """Wait for a stalled stage to end; False if the worker is stopping first (or already)."""
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({running, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if running.done():
            return True
        running.add_done_callback(lambda task: task.cancelled() or task.exception())  # read, never awaited
        return False

    async def _still_queued(self, msg: Msg) -> bool:
        """Whether the message is still in the work queue: not acked by another consumer, not
        dead-lettered and removed. When NATS cannot say, it is taken as queued (going on is harmless)."""
        try:
            await self.js.get_msg(topology.BATCHES_STREAM, msg.metadata.sequence.stream)
        except nats.js.errors.NotFoundError:
            return False
        except Exception as exc:
            log.warning("batch_state_unknown", error=str(exc) or type(exc).__name__)
        return True

    def start(self, taken: Taken, *, on_stall: Callable[[], Awaitable[None]] | None = None) -> Running:
        """Stage 1 (`compute`) as a task of its own, so that the caller can take the next batch
        once this one's forward is queued (`Running.launched`), before its states land."""
        launched = asyncio.Event()
        task = asyncio.create_task(self.compute(taken, on_stall=on_stall, launched=launched))
        task.add_done_callback(lambda _: launched.set())
        return Running(taken, launched, task)

    async def compute(
        self,
        taken: Taken,
        *,
        on_stall: Callable[[], Awaitable[None]] | None = None,
        launched: asyncio.Event | None = None,
    ) -> Computed | None:
        """Stage 1: decode and run the forward. Returns None when the message was settled here
        (poison dead-lettered, a failure nak'ed for a later retry, another plan's batch set
        aside or handed back), or was released by a stalled forward that then failed or whose
        batch was settled elsewhere.

        The batch's states are copied into host buffers leased to this batch alone
        (gpu_consumer/staging.py), and its files are written straight from them while the next
        batch computes: the lease goes with the returned batch and `finish` releases it once the
        files are written; a batch that comes to nothing releases it here."""
        lease = self.loaded.staging.lease() if self.loaded.staging is not None else None
        try:
            computed = await self._compute_batch(taken, lease, on_stall, launched)
        except asyncio.CancelledError:
            # The forward's thread may still be copying into the lease: its buffers stay leased
            # (the consumer is going down).
            raise
        except BaseException:
            self._in_hand.pop(id(taken), None)
            if lease is not None:
                lease.release()
            taken.release()
            raise
        if computed is None:
            self._in_hand.pop(id(taken), None)
            if lease is not None:
                lease.release()
            taken.release()
            return None
        computed.lease = lease
        return computed

    async def _not_this_plan(self, msg: Msg, batch: schemas.BatchDescriptor) -> None:
        """A descriptor of another plan than this worker's. If this worker's job is still current,
        the descriptor is a stray of an earlier job of the name: removed from the queue, with a
        warning, never extracted (nor dead-lettered, which would count against this job). If the
        job moved on, this worker is the stray: it hands the batch back and stops."""
        if self.watch is not None and await self.watch.check():
            await give_back(self.js, msg)
            return
        log.warning(
            "stale_batch_dropped",
            batch=batch.batch_id,
            batch_plan=batch.plan,
            plan=self.spec.plan_tag,
            samples=[s.index for s in batch.samples[:20]],
        )
        await through_outage(msg.term, what="drop_stale_batch", stopping=self.stopping)

    async def _in_plan(self, msg: Msg, batch: schemas.BatchDescriptor) -> bool:
        """Whether the batch is the plan's: of this job, every sample (and a batch id of the plan's
        form) inside the plan as its spec is now, and every sample the one its producer recorded
        (gpu_consumer/plansamples.py). A batch of a round not yet recorded waits (handed back with
        a delay: a plan published in rounds records each round, and its samples' digests, before
        its batches go out); anything else is removed, never extracted (`_refuse`)."""
        if batch.job != self.spec.job:
            return await self._refuse(msg, batch, f"it names job {batch.job!r}")
        placed = (
            batch_placed(self.spec, batch)
            if self.watch is None
            else await self.watch.placed(lambda spec: batch_placed(spec, batch))
        )
        if placed is None:
            return await self._wait_for_round(msg, batch, "its round is not recorded in the job's spec yet")
        if not placed:
            return await self._refuse(msg, batch, "its samples or batch id are outside the job's plan")
        try:
            refused = await self.plan_samples.refused(batch)
        except PlanSamplesUnavailable as exc:
            return await self._wait_for_round(msg, batch, str(exc))
        if refused:
            index, why = refused[0]
            return await self._refuse(
                msg, batch, f"{len(refused)} of its samples are not the plan's (sample {index}: {why})"
            )
        return True

    async def _wait_for_round(self, msg: Msg, batch: schemas.BatchDescriptor, why: str) -> bool:
        log.info("batch_waits_for_its_round", batch=batch.batch_id, reason=why, retry_in_s=_ROUND_WAIT_S)
        await through_outage(lambda: msg.nak(delay=_ROUND_WAIT_S), what="nak_batch", stopping=self.stopping)
        return False

    async def _refuse(self, msg: Msg, batch: schemas.BatchDescriptor, why: str) -> bool:
        """A descriptor that is not of the job's plan (published by hand, or crafted): removed from
        the queue, never extracted, said in one line. Not a dead letter: it is none of the job's
        work, and retrying it could only be refused again."""
        log.warning(
            "batch_refused",
            batch=batch.batch_id,
            plan=self.spec.plan_tag,
            samples=[s.index for s in batch.samples[:20]],
            reason=why,
        )
        await through_outage(msg.term, what="drop_refused_batch", stopping=self.stopping)
        return False

    async def _launch_and_land(
        self, samples: list[schemas.Sample], lease: StagingLease | None, launched: asyncio.Event | None
    ) -> list:
        """The batch's forward queued on the forwards thread, then its copy to the host waited for
        on the landing thread (not at all when it is there already: off CUDA)."""

        def launch() -> InFlight:
            return launch_samples(self.loaded, samples, lease=lease)

        with self.busy.running():
            inflight: InFlight = await self.forwards.run(compiling.eager_on_failure, self.loaded.model, launch)
            if launched is not None:
                launched.set()
            if inflight.landed():
                return inflight.wait()
            return await self.landing.run(inflight.wait)

    async def _compute_batch(
        self,
        taken: Taken,
        lease: StagingLease | None,
        on_stall: Callable[[], Awaitable[None]] | None,
        launched: asyncio.Event | None = None,
    ) -> Computed | None:
        msg = taken.msg
        attempt = msg.metadata.num_delivered
        try:
            batch = schemas.batch_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            await self.events.dead_letter(msg, what="batch", error=f"descriptor does not decode: {exc}")
            return None
        if not self.spec.owns(batch.plan):
            await self._not_this_plan(msg, batch)
            return None
        if not await self._in_plan(msg, batch):
            return None
        if on_batch is not None:
            on_batch(batch)
        self.state, self.last_batch = "working", batch.batch_id
        self._in_hand[id(taken)] = batch.batch_id
        log_ = log.bind(batch=batch.batch_id, attempt=attempt)
        started = time.perf_counter()

        def forward(work: Awaitable) -> Awaitable:
            return self._watched(
                work,
                stage="forward",
                batch=batch,
                taken=taken,
                bound_s=self.pace.bound_s(batch),
                on_stall=on_stall,
            )

        try:
            outputs = await forward(self._launch_and_land(batch.samples, lease, launched))
            return Computed(taken, batch, attempt, started, list(zip(batch.samples, outputs)))
        except ReleasedBatch:
            return None
        except NonFiniteStates as exc:
            # Those samples' own states (this model, this dtype): a retry computes them again, so
            # they are given up now and the rest run without them, on this delivery.
            log_.warning("non_finite_states", samples=[s.index for s, _ in exc.failed], error=str(exc))
        except Exception as exc:
            if device_failed(exc):
                raise self._device_failed(exc, batch, attempt) from None
            if attempt < topology.BATCH_MAX_DELIVER:
                delay = self.cfg.retry_delay_s * attempt
                log_.warning("batch_failed", error=f"{type(exc).__name__}: {exc}", retry_in_s=delay, exc_info=True)
                await msg.nak(delay=delay)
                return None
        # Last delivery (or samples found non-finite): give up only the samples that fail on their own.
        try:
            with self.busy.running():
                extracted, failed = await forward(
                    self.forwards.run(extract_isolating, self.loaded, batch.samples, lease=lease)
                )
        except ReleasedBatch:
            return None
        except Exception as exc:
            if device_failed(exc):
                raise self._device_failed(exc, batch, attempt) from None
            raise
        if not extracted:
            await self.events.dead_letter(
                msg,
                what="batch",
                error="; ".join(f"sample {s.index}: {e}" for s, e in failed),
                batch_id=batch.batch_id,
                sample_indices=[s.index for s, _ in failed],
            )
            return None
        return Computed(taken, batch, attempt, started, extracted, failed)

    def _device_failed(self, exc: Exception, batch: schemas.BatchDescriptor, attempt: int) -> DeviceFailed:
        """The device failed under `batch` (extract.device_failed): the batch is left unacked, for
        another consumer after the ack wait (no nak: should the batch itself kill every device it
        runs on, the ack wait paces it to its last delivery and the exhausted-batch reaper's dead
        letter), and this consumer must end, to be restarted on a live context."""
        error = f"{type(exc).__name__}: {exc}"
        log.error(
            "device_failed",
            device=str(self.loaded.device),
            batch=batch.batch_id,
            attempt=attempt,
            samples=[s.index for s in batch.samples[:20]],
            error=error,
            redelivered_after_s=self.cfg.ack_wait_s,
            exc_info=exc,
        )
        return DeviceFailed(
            f"device {self.loaded.device} failed on batch {batch.batch_id} ({error}); the batch is left for "
            f"another consumer; restart this one"
        )

    async def finish(self, computed: Computed, *, on_stall: Callable[[], Awaitable[None]] | None = None) -> None:
        """Stage 2: write the files, announce them, report progress, and only then ack. A worker
        whose job was lost meanwhile (deleted, or its name given to another plan) writes and
        announces nothing more."""
        msg, batch, attempt = computed.msg, computed.batch, computed.attempt
        log_ = log.bind(batch=batch.batch_id, attempt=attempt)
        try:
            if self.job_lost:
                log_.warning("batch_abandoned", reason="the job was lost")
                return
            try:
                files = await self._write_until_written(computed, on_stall)
            except ReleasedBatch:
                return
            except Exception as exc:
                error = f"writing to the spool {self.cfg.spool} failed: {type(exc).__name__}: {exc}"
                if attempt >= topology.BATCH_MAX_DELIVER:
                    # A nak now would strand the batch in the work queue for good.
                    await self.events.dead_letter(msg, what="batch", error=error, batch_id=batch.batch_id)
                    return
                delay = self.cfg.retry_delay_s * attempt
                log_.warning("batch_write_failed", error=error, retry_in_s=delay, exc_info=True)
                await msg.nak(delay=delay)
                return
            if files is None:
                await give_back(self.js, msg)
                return
            if self.job_lost:
                log_.warning("batch_abandoned", reason="the job was lost")
                return
            try:
                await self._watched(
                    self._announce(computed, files, log_),
                    stage="announce",
                    batch=batch,
                    taken=computed.taken,
                    bound_s=self.cfg.stall_after_s,
                    on_stall=on_stall,
                )
            except ReleasedBatch:
                return
        finally:
            self._in_hand.pop(id(computed.taken), None)
            computed.taken.release()
            if computed.lease is not None:
                # Every write has ended (_write_until_written waits for all of them), written or
                # not: the buffers may go to the next batch.
                computed.lease.release()

    async def _announce(self, computed: Computed, files: list[schemas.FileReady], log_) -> None:
        """Dead-letter what failed on its own, announce the files, report the batch, ack."""
        msg, batch, attempt = computed.msg, computed.batch, computed.attempt
        if computed.failed:
            poisoned = [s for s, _ in computed.failed]
            await self.events.store_dead_letter(
                what="batch",
                error="; ".join(f"sample {s.index}: {e}" for s, e in computed.failed),
                subject=msg.subject,
                payload=schemas.encode(
                    msgspec.structs.replace(
                        batch,
                        batch_id=f"{batch.batch_id}-poison",
                        padded_len=max(len(s.input_ids) for s in poisoned),
                        samples=poisoned,
                    )
                ),
                deliveries=attempt,
                batch_id=batch.batch_id,
                sample_indices=[s.index for s in poisoned],
                source_seq=msg.metadata.sequence.stream,
                part=":poison",
            )
        # From here on a NATS outage is waited out, not left to a redelivery that would redo
        # the batch after the ack wait: each step is idempotent (file events carry a
        # Nats-Msg-Id; progress is folded per batch and sample).
        subject = topology.file_subject(self.spec.job, self.cfg.node)
        await publish_all(
            self.js,
            [
                (
                    subject,
                    schemas.encode(ready),
                    message_headers(
                        self.spec.job,
                        batch=batch.batch_id,
                        sample=ready.sample_index,
                        msg_id=f"{batch.batch_id}:{ready.sample_index}:{attempt}",
                    ),
                )
                for ready in files
            ],
            what="announce_file",
            stopping=self.stopping,
        )
        seconds = time.perf_counter() - computed.started
        tokens = sum(f.num_tokens for f in files)
        written = sum(f.size for f in files)
        written_event = schemas.BatchWritten(
            job=self.spec.job,
            batch_id=batch.batch_id,
            consumer=self.cfg.instance,
            node=self.cfg.node,
            sample_indices=[f.sample_index for f in files],
            tokens=tokens,
            bytes=written,
            seconds=round(seconds, 4),
            attempt=attempt,
            redo=bool(batch.redo_reason),
            plan=self.spec.plan_tag,
        )

        # Only the plan's own batches count toward it; a re-queued sample's batch, a poisoned
        # batch's retry, a dead letter's half, or one with samples outside the plan (a descriptor
        # published by hand) is set aside, so batches_done never passes batches_total.
        def in_plan(spec: JobSpec) -> bool:
            return spec.is_plan_batch(batch.batch_id) and all(0 <= f.sample_index < spec.total_samples for f in files)

        # The spec as it is now: a plan published in rounds grows (its next round is recorded
        # before its batches go out).
        spec = self.spec if self.watch is None else await self.watch.current_for(in_plan)
        planned = not batch.redo_reason and in_plan(spec)
        marker = topology.written_subject(self.spec.job, self.spec.plan_tag, batch.batch_id, planned=planned)
        await through_outage(
            lambda: self.events.mark(written_event, subject=marker), what="report_written", stopping=self.stopping
        )
        if before_ack is not None:
            before_ack()
        await through_outage(msg.ack_sync, what="ack_batch", stopping=self.stopping)
        self.rate.add(len(files))
        log_.info(
            "batch_done",
            samples=len(files),
            tokens=tokens,
            bytes=written,
            seconds=round(seconds, 3),
            tokens_per_s=round(tokens / seconds, 1),
        )

    def heartbeat_state(self) -> WorkerState:
        files, used, measured_at = self.spool_meter.measured()
        stall = self.stall
        if stall is not None:  # whatever the other stage says: this worker's batch is hung
            running = stall.running_s()
            return WorkerState(
                state="stalled",
                last_batch=stall.batch_id,
                spool_files=files,
                spool_bytes=used,
                spool_measured_at=measured_at,
                stalled_s=round(running, 1),
                detail=f"{STAGES[stall.stage].name} of batch {stall.batch_id} running {running:.0f} s, bound "
                f"{stall.bound_s:.0f} s; batch released to other consumers",
                load=self.load(),
            )
        return WorkerState(
            state=self.state,
            detail=self.detail,
            last_batch=self.last_batch,
            spool_files=files,
            spool_bytes=used,
            spool_measured_at=measured_at,
            load=self.load(),
        )

    def load(self) -> schemas.WorkerLoad:
        """The heartbeat's `load`: read on the heartbeat's thread (the device's figures through
        NVML and the CUDA runtime, the spool's file system)."""
        utilization, used, total = self.gpu.read() or (-1.0, -1, -1)
        return schemas.WorkerLoad(
            device=str(self.loaded.device),
            samples_per_s=round(self.rate.per_second(), 3),
            in_hand=len(self._in_hand),
            busy=round(self.busy.share(), 3),
            gpu_utilization=utilization,
            gpu_memory_used=used,
            gpu_memory_total=total,
            spool_free=spool_free(self.cfg.spool),
            spool_high_water=self.cfg.spool_high_water_bytes,
        )

    def batches_in_hand(self) -> list[str]:
        """The batches taken up and not yet settled (computing, or being written and announced)."""
        return list(self._in_hand.values())

    def settled(self) -> bool:
        """Nothing in hand: no batch taken up, none of its stages still running after a stall."""
        return not self._in_hand and self.stall is None

    def spool_full(self) -> tuple[bool, int]:
        _, used = self.spool_meter.usage()
        return used >= self.cfg.spool_high_water_bytes, used

    def room_for(self, used: int, batches: int) -> bool:
        """Whether `batches` more full batches fit in the spool below the high-water mark."""
        return used + batches * self.batch_bytes < self.cfg.spool_high_water_bytes

    def close(self) -> None:
        # A write left hung at a stop (`abandoned`) is not waited for: the process is going down.
        self._writers.shutdown(wait=not self.abandoned)
        self.spool_meter.close()
        self.landing.close()
        if self._owns_forwards:
            self.forwards.close()


async def _ends_within(running: asyncio.Future, seconds: float) -> bool:
    """Whether `running` ends within `seconds` (the sets asyncio.wait returns would hold it)."""
    done, _ = await asyncio.wait({running}, timeout=seconds)
    return bool(done)


def _full_batch_bytes(spec: JobSpec, loaded: LoadedModel) -> int:
    """About the most a batch adds to the spool: the token budget's states at the compute dtype
    (float8 files are smaller). 0 when the model does not say its hidden size."""
    try:
        hidden = int(loaded.model.config.get_text_config().hidden_size)
    except (AttributeError, TypeError, ValueError):
        return 0
    return spec.token_budget * len(spec.layers) * hidden * torch.empty((), dtype=loaded.dtype).element_size()
