"""The GPU consumer's pull loop and per-batch ack discipline.

Per batch: decode (poison -> dead letter) -> forward on a worker thread while the loop sends
`in_progress()` -> write each sample file atomically -> publish one file-ready event per file,
each awaited -> publish the batch's progress event -> `ack_sync()`. A crash anywhere before the
ack leaves the batch in the work queue; the redelivery rewrites the same files (same content,
same names) and announces them again, and the uploader acks an already-uploaded file without
re-uploading. Nothing is skipped because a file exists.

Stopping: the stop event ends fetching; the batch in hand is finished (not abandoned) first.
"""

import asyncio
import errno
import os
import signal
import time
from pathlib import Path

import msgspec
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from gpu_consumer.config import ConsumerConfig
from gpu_consumer.extract import extract_isolating, extract_samples
from gpu_consumer.model import LoadedModel
from gpu_consumer.writer import write_sample_file
from hsx import schemas, topology
from hsx.events import EventPublisher
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

    async def _keep_alive(self, msg: Msg) -> None:
        while True:
            await asyncio.sleep(self.cfg.in_progress_s)
            try:
                await msg.in_progress()
            except Exception as exc:  # a reconnect in progress; the next tick tries again
                log.warning("in_progress_failed", error=str(exc))

    def _write_files(self, batch: schemas.BatchDescriptor, extracted: list) -> list[schemas.FileReady]:
        return [
            write_sample_file(
                spool=self.cfg.spool, spec=self.spec, node=self.cfg.node, batch_id=batch.batch_id,
                sample=sample, hidden_states=hidden,
            )
            for sample, hidden in extracted
        ]

    async def _write_until_written(self, batch: schemas.BatchDescriptor, extracted: list) -> list[schemas.FileReady] | None:
        """Write the batch's files; while the spool disk is full, keep the computed states and the
        message (in_progress continues) and retry with a growing delay. None if asked to stop first."""
        delay = 2.0
        while True:
            try:
                files = await asyncio.to_thread(self._write_files, batch, extracted)
                self.state, self.detail = "working", ""
                return files
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

    async def handle(self, msg: Msg) -> None:
        attempt = msg.metadata.num_delivered
        try:
            batch = schemas.batch_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            await self.events.dead_letter(msg, what="batch", error=f"descriptor does not decode: {exc}")
            return
        structlog.contextvars.bind_contextvars(batch=batch.batch_id, attempt=attempt)
        self.state, self.last_batch = "working", batch.batch_id
        keep_alive = asyncio.create_task(self._keep_alive(msg))
        started = time.perf_counter()
        try:
            failed: list[tuple[schemas.Sample, str]] = []
            try:
                extracted = list(zip(batch.samples, await asyncio.to_thread(extract_samples, self.loaded, batch.samples)))
            except Exception as exc:
                if attempt < topology.BATCH_MAX_DELIVER:
                    delay = self.cfg.retry_delay_s * attempt
                    log.warning("batch_failed", error=f"{type(exc).__name__}: {exc}", retry_in_s=delay)
                    await msg.nak(delay=delay)
                    return
                # Last delivery: give up only the samples that fail on their own.
                extracted, failed = await asyncio.to_thread(extract_isolating, self.loaded, batch.samples)
                if not extracted:
                    await self.events.dead_letter(
                        msg, what="batch", error=failed[0][1], batch_id=batch.batch_id,
                        sample_indices=[s.index for s, _ in failed],
                    )
                    return
            try:
                files = await self._write_until_written(batch, extracted)
            except Exception as exc:
                delay = self.cfg.retry_delay_s * attempt
                log.warning("batch_write_failed", error=f"{type(exc).__name__}: {exc}", retry_in_s=delay)
                await msg.nak(delay=delay)
                return
            if files is None:
                await msg.nak()
                return
            written = sum(f.size for f in files)
            if failed:
                poisoned = [s for s, _ in failed]
                await self.events.store_dead_letter(
                    what="batch", error="; ".join(f"sample {s.index}: {e}" for s, e in failed), subject=msg.subject,
                    payload=schemas.encode(msgspec.structs.replace(
                        batch, batch_id=f"{batch.batch_id}-poison", padded_len=max(len(s.input_ids) for s in poisoned),
                        samples=poisoned,
                    )),
                    deliveries=attempt, batch_id=batch.batch_id, sample_indices=[s.index for s in poisoned],
                )
            subject = topology.file_subject(self.spec.job, self.cfg.node)
            for ready in files:
                await self.js.publish(
                    subject, schemas.encode(ready),
                    headers={"Nats-Msg-Id": f"{batch.batch_id}:{ready.sample_index}:{attempt}", "Hsx-Job": self.spec.job},
                )
            seconds = time.perf_counter() - started
            tokens = sum(f.num_tokens for f in files)
            await self.events.emit(
                schemas.BatchWritten(
                    job=self.spec.job, batch_id=batch.batch_id, consumer=self.cfg.instance, node=self.cfg.node,
                    sample_indices=[f.sample_index for f in files], tokens=tokens, bytes=written,
                    seconds=round(seconds, 4), attempt=attempt, redo=bool(batch.redo_reason),
                )
            )
            _maybe_crash_before_ack()
            await msg.ack_sync()
            log.info("batch_done", samples=len(files), tokens=tokens, bytes=written, seconds=round(seconds, 3),
                     tokens_per_s=round(tokens / seconds, 1))
        finally:
            keep_alive.cancel()
            self.state = "idle"
            structlog.contextvars.unbind_contextvars("batch", "attempt")

    def spool_full(self) -> tuple[bool, int]:
        _, used = spool_usage(self.cfg.spool, self.spec.job)
        return used >= self.cfg.spool_high_water_bytes, used


async def heartbeat_loop(worker: BatchWorker, events: EventPublisher, cfg: ConsumerConfig, stopping: asyncio.Event) -> None:
    while not stopping.is_set():
        try:
            await events.heartbeat(service=SERVICE, instance=cfg.instance, node=cfg.node, state=worker.state,
                                   detail=worker.detail or worker.last_batch)
        except Exception as exc:
            log.warning("heartbeat_failed", error=str(exc))
        try:
            await asyncio.wait_for(stopping.wait(), timeout=cfg.heartbeat_s)
        except asyncio.TimeoutError:
            pass


async def pull_loop(worker: BatchWorker, sub, cfg: ConsumerConfig, stopping: asyncio.Event) -> None:
    paused = False
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
        try:
            msgs = await sub.fetch(1, timeout=cfg.idle_fetch_timeout_s)
        except asyncio.TimeoutError:
            continue
        except Exception as exc:  # NATS reconnecting: wait and fetch again
            log.warning("fetch_failed", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(1.0)
            continue
        for msg in msgs:
            try:
                await worker.handle(msg)
            except Exception as exc:
                # A NATS outage while announcing or acking: the batch stays unacked and is
                # redelivered after the ack wait (its files are rewritten identically).
                log.warning("batch_interrupted", error=f"{type(exc).__name__}: {exc}")
