"""The GPU consumer's pull loop and per-batch ack discipline.

Per batch: decode (poison -> dead letter) -> forward on a worker thread while the loop sends
`in_progress()` -> write each sample file atomically (on a pool of writer threads) -> publish one
file-ready event per file, each awaited -> publish the batch's progress event -> `ack_sync()`.
A crash anywhere before the ack leaves the batch in the work queue; the redelivery rewrites the
same files (same content, same names) and announces them again, and the uploader acks an
already-uploaded file without re-uploading. Nothing is skipped because a file exists.

Two stages overlap: while batch N is written, announced and acked, batch N+1's forward runs.
Batch N+2's forward starts only once batch N is finished, which is also what lets the host
staging ring (two pinned buffers) hand out views without copying. The next descriptor is fetched
while the current one computes.

Stopping: the stop event ends fetching; batches in hand are finished (not abandoned) first, and a
descriptor fetched ahead but not started is nak'ed back to the stream.
"""

import asyncio
import errno
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog
import torch
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from gpu_consumer.config import ConsumerConfig
from gpu_consumer.extract import extract_isolating, extract_samples
from gpu_consumer.model import LoadedModel
from gpu_consumer.writer import write_sample_file
from hsx import schemas, topology
from hsx.events import EventPublisher, WorkerState, keep_in_progress
from hsx.headers import message_headers
from hsx.natsconn import through_outage
from hsx.spool import spool_usage

log = structlog.get_logger("hsx.gpu_consumer")

SERVICE = "gpu_consumer"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

# Test-only switch: a marker file path. The first consumer to finish writing and announcing a
# batch creates the marker and kills itself with SIGKILL before acking (a crash at the worst
# moment); later consumers see the marker and run normally.
_CRASH_BEFORE_ACK_MARKER = os.environ.get("HSX_TEST_CRASH_BEFORE_ACK")


def _maybe_crash_before_ack() -> None:
    if _CRASH_BEFORE_ACK_MARKER:
        try:
            Path(_CRASH_BEFORE_ACK_MARKER).touch(exist_ok=False)
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class _Computed:
    """A batch whose forward is done and whose files are still to be written and announced."""

    msg: Msg
    batch: schemas.BatchDescriptor
    attempt: int
    started: float
    keep_alive: asyncio.Task
    extracted: list[tuple[schemas.Sample, torch.Tensor]]
    failed: list[tuple[schemas.Sample, str]] = field(default_factory=list)


class BatchWorker:
    def __init__(
        self, cfg: ConsumerConfig, js: JetStreamContext, events: EventPublisher, spec: schemas.JobSpec,
        loaded: LoadedModel, stopping: asyncio.Event,
    ) -> None:
        self.cfg = cfg
        self.js = js
        self.events = events
        self.spec = spec
        self.loaded = loaded
        self.stopping = stopping
        self.state = "idle"
        self.last_batch = ""
        self.detail = ""  # why the worker is not working, when it is paused or waiting
        self._writers = ThreadPoolExecutor(max_workers=cfg.writer_threads, thread_name_prefix="hsx-writer")

    def _write_one(self, batch_id: str, sample: schemas.Sample, hidden: torch.Tensor) -> schemas.FileReady:
        return write_sample_file(
            spool=self.cfg.spool, spec=self.spec, node=self.cfg.node, batch_id=batch_id, sample=sample,
            hidden_states=hidden,
        )

    async def _write_until_written(self, computed: _Computed) -> list[schemas.FileReady] | None:
        """Write the batch's files; while the spool disk is full, keep the computed states and the
        message (in_progress continues) and retry with a growing delay. None if asked to stop first."""
        loop = asyncio.get_running_loop()
        delay = 2.0
        while True:
            try:
                files = await asyncio.gather(*(
                    loop.run_in_executor(self._writers, self._write_one, computed.batch.batch_id, sample, hidden)
                    for sample, hidden in computed.extracted
                ))
                self.state, self.detail = "working", ""
                return list(files)
            except OSError as exc:
                if exc.errno not in _DISK_FULL:
                    raise
                self.state = "disk_full"
                self.detail = f"spool disk full ({self.cfg.spool}), retrying in {delay:.0f} s"
                log.warning("spool_disk_full", spool=str(self.cfg.spool), error=os.strerror(exc.errno), retry_in_s=delay)
                try:
                    await asyncio.wait_for(self.stopping.wait(), timeout=delay)
                    return None
                except asyncio.TimeoutError:
                    delay = min(delay * 2, 60.0)

    async def compute(self, msg: Msg) -> _Computed | None:
        """Stage 1: decode and run the forward. Returns None when the message was settled here
        (poison dead-lettered, or a failure nak'ed for a later retry)."""
        attempt = msg.metadata.num_delivered
        try:
            batch = schemas.batch_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            await self.events.dead_letter(msg, what="batch", error=f"descriptor does not decode: {exc}")
            return None
        self.state, self.last_batch = "working", batch.batch_id
        log_ = log.bind(batch=batch.batch_id, attempt=attempt)
        keep_alive = asyncio.create_task(keep_in_progress(msg, interval_s=self.cfg.in_progress_s))
        started = time.perf_counter()
        try:
            try:
                outputs = await asyncio.to_thread(extract_samples, self.loaded, batch.samples)
                return _Computed(msg, batch, attempt, started, keep_alive, list(zip(batch.samples, outputs)))
            except Exception as exc:
                if attempt < topology.BATCH_MAX_DELIVER:
                    delay = self.cfg.retry_delay_s * attempt
                    log_.warning("batch_failed", error=f"{type(exc).__name__}: {exc}", retry_in_s=delay)
                    await msg.nak(delay=delay)
                    keep_alive.cancel()
                    return None
            # Last delivery: give up only the samples that fail on their own.
            extracted, failed = await asyncio.to_thread(extract_isolating, self.loaded, batch.samples)
            if not extracted:
                keep_alive.cancel()
                await self.events.dead_letter(
                    msg, what="batch", error=failed[0][1], batch_id=batch.batch_id, sample_indices=[s.index for s, _ in failed]
                )
                return None
            return _Computed(msg, batch, attempt, started, keep_alive, extracted, failed)
        except BaseException:
            keep_alive.cancel()
            raise

    async def finish(self, computed: _Computed) -> None:
        """Stage 2: write the files, announce them, report progress, and only then ack."""
        msg, batch, attempt = computed.msg, computed.batch, computed.attempt
        log_ = log.bind(batch=batch.batch_id, attempt=attempt)
        try:
            try:
                files = await self._write_until_written(computed)
            except Exception as exc:
                delay = self.cfg.retry_delay_s * attempt
                log_.warning("batch_write_failed", error=f"{type(exc).__name__}: {exc}", retry_in_s=delay)
                await msg.nak(delay=delay)
                return
            if files is None:
                await msg.nak()
                return
            if computed.failed:
                poisoned = [s for s, _ in computed.failed]
                await self.events.store_dead_letter(
                    what="batch", error="; ".join(f"sample {s.index}: {e}" for s, e in computed.failed),
                    subject=msg.subject,
                    payload=schemas.encode(msgspec.structs.replace(
                        batch, batch_id=f"{batch.batch_id}-poison", padded_len=max(len(s.input_ids) for s in poisoned),
                        samples=poisoned,
                    )),
                    deliveries=attempt, batch_id=batch.batch_id, sample_indices=[s.index for s in poisoned],
                )
            # From here on a NATS outage is waited out, not left to a redelivery that would redo
            # the batch after the ack wait: each step is idempotent (file events carry a
            # Nats-Msg-Id; progress is folded per batch and sample).
            subject = topology.file_subject(self.spec.job, self.cfg.node)
            for ready in files:
                headers = message_headers(
                    self.spec.job, batch=batch.batch_id, sample=ready.sample_index,
                    msg_id=f"{batch.batch_id}:{ready.sample_index}:{attempt}",
                )
                await through_outage(
                    lambda ready=ready, headers=headers: self.js.publish(subject, schemas.encode(ready), headers=headers),
                    what="announce_file", stopping=self.stopping,
                )
            seconds = time.perf_counter() - computed.started
            tokens = sum(f.num_tokens for f in files)
            written = sum(f.size for f in files)
            written_event = schemas.BatchWritten(
                job=self.spec.job, batch_id=batch.batch_id, consumer=self.cfg.instance, node=self.cfg.node,
                sample_indices=[f.sample_index for f in files], tokens=tokens, bytes=written,
                seconds=round(seconds, 4), attempt=attempt, redo=bool(batch.redo_reason),
            )
            await through_outage(lambda: self.events.emit(written_event), what="report_written", stopping=self.stopping)
            _maybe_crash_before_ack()
            await through_outage(msg.ack_sync, what="ack_batch", stopping=self.stopping)
            log_.info("batch_done", samples=len(files), tokens=tokens, bytes=written, seconds=round(seconds, 3),
                      tokens_per_s=round(tokens / seconds, 1))
        finally:
            computed.keep_alive.cancel()

    def heartbeat_state(self) -> WorkerState:
        files, used = spool_usage(self.cfg.spool, self.spec.job)
        return WorkerState(state=self.state, detail=self.detail, last_batch=self.last_batch, spool_files=files, spool_bytes=used)

    def spool_full(self) -> tuple[bool, int]:
        _, used = spool_usage(self.cfg.spool, self.spec.job)
        return used >= self.cfg.spool_high_water_bytes, used

    def close(self) -> None:
        self._writers.shutdown(wait=True)




async def _finish_guarded(worker: BatchWorker, computed: _Computed) -> None:
    try:
        await worker.finish(computed)
    except Exception as exc:
        # A NATS outage while announcing or acking: the batch stays unacked and is redelivered
        # after the ack wait (its files are rewritten identically).
        log.warning("batch_interrupted", batch=computed.batch.batch_id, error=f"{type(exc).__name__}: {exc}")


async def _settle(task: asyncio.Task | None) -> None:
    if task is not None:
        await task


@dataclass
class _Fetched:
    msgs: list[Msg]
    # A descriptor fetched ahead waits for the batch before it, possibly longer than the ack wait
    # on a slow device: it is kept alive until its own forward starts.
    keep_alive: asyncio.Task | None = None

    def started(self) -> None:
        if self.keep_alive is not None:
            self.keep_alive.cancel()


async def _fetch_one(sub, cfg: ConsumerConfig, *, ahead: bool) -> _Fetched:
    msgs = await sub.fetch(1, timeout=cfg.idle_fetch_timeout_s)
    if ahead and msgs:
        return _Fetched(msgs, asyncio.create_task(keep_in_progress(msgs[0], interval_s=cfg.in_progress_s)))
    return _Fetched(msgs)


async def _return_unstarted(prefetch: asyncio.Task | None) -> None:
    """Hand back a descriptor fetched ahead but never started (we are stopping): nak'ed, it goes to
    another consumer at once instead of after the ack wait."""
    if prefetch is None:
        return
    try:
        fetched = await prefetch
    except Exception:
        return
    fetched.started()
    for msg in fetched.msgs:
        try:
            await msg.nak()
        except Exception as exc:  # NATS gone: the ack wait hands it back instead
            log.warning("prefetched_batch_not_returned", error=str(exc) or type(exc).__name__)


async def pull_loop(worker: BatchWorker, sub, cfg: ConsumerConfig, stopping: asyncio.Event) -> None:
    finishing: asyncio.Task | None = None
    # The next descriptor is fetched while the current batch computes, so the GPU does not wait
    # for a round trip to NATS between batches.
    prefetch: asyncio.Task | None = None
    paused = False
    try:
        while not stopping.is_set():
            full, used = worker.spool_full()
            if full:
                if not paused:
                    log.warning("spool_high_water_paused", spool_bytes=used, high_water=cfg.spool_high_water_bytes)
                    paused = True
                worker.state = "paused"
                worker.detail = f"spool holds {used} bytes, high-water mark {cfg.spool_high_water_bytes}"
                try:
                    await asyncio.wait_for(stopping.wait(), timeout=2.0)
                except asyncio.TimeoutError:
                    pass
                continue
            if paused:
                log.info("spool_resumed", spool_bytes=used)
                paused = False
                worker.state, worker.detail = "idle", ""
            fetching, prefetch = prefetch or asyncio.create_task(_fetch_one(sub, cfg, ahead=False)), None
            try:
                fetched = await fetching
            except asyncio.TimeoutError:
                await _settle(finishing)  # idle: nothing to overlap with
                finishing = None
                if worker.state == "working":
                    worker.state = "idle"
                continue
            except Exception as exc:  # NATS reconnecting: wait and fetch again
                log.warning("fetch_failed", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(1.0)
                continue
            fetched.started()
            for msg in fetched.msgs:
                if not stopping.is_set():
                    prefetch = asyncio.create_task(_fetch_one(sub, cfg, ahead=True))
                try:
                    computed = await worker.compute(msg)
                except Exception as exc:
                    log.warning("batch_interrupted", error=f"{type(exc).__name__}: {exc}")
                    continue
                # Batch N must be finished before batch N+1's finish starts (and before batch N+2's
                # forward reuses its staging buffer); batch N+1's forward has just run alongside it.
                await _settle(finishing)
                finishing = asyncio.create_task(_finish_guarded(worker, computed)) if computed else None
    finally:
        await _return_unstarted(prefetch)
        await _settle(finishing)
