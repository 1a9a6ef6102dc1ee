"""The GPU consumer's pull loop and per-batch ack discipline.

Per batch: decode (poison -> dead letter) -> forward on a worker thread while the loop sends
`in_progress()` -> write each sample file atomically (fsynced, renamed; a pool of writer threads,
each writing a share of the batch), then fsync each folder once -> publish one file-ready event
per file, their acks awaited together (`publish_all`) -> publish the batch's progress event ->
`ack_sync()`.
A crash anywhere before the ack leaves the batch in the work queue; the redelivery rewrites the
same files (same content, same names) and announces them again, and the uploader acks an
already-uploaded file without re-uploading. Nothing is skipped because a file exists.

Two stages overlap: while batch N is written, announced and acked, batch N+1's forward runs.
Batch N+2's forward starts only once batch N is finished. Files are written straight from the
host buffers the forward copied into, leased to that batch until its files are written
(gpu_consumer/staging.py), so at most two batches' states are leased at once. The next
descriptor is fetched while the current one computes, unless the spool is near its high-water
mark or the current batch is a redelivery (it runs alone: it may be what killed its last
consumer): a consumer paused there, or stuck in a stalled forward (gpu_consumer/stall.py), holds
no batch it has not started.

Stopping: the stop event ends fetching; batches in hand are finished (not abandoned) first, and a
descriptor fetched ahead but not started is handed back (`give_back`: a nak, or on its last
delivery a fresh copy, so a stop never strands it). A batch that fails on its last delivery is
dead-lettered, never nak'ed; one whose deliveries are used up by crashes is dead-lettered by the
exhausted-batch reaper (hsx/wire/exhausted.py) that runs beside this loop.
"""

import asyncio
import errno
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import msgspec
import nats.errors
import structlog
import torch
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from gpu_consumer.config import ConsumerConfig
from gpu_consumer.extract import extract_isolating, extract_samples
from gpu_consumer.model import LoadedModel
from gpu_consumer.staging import StagingLease
from gpu_consumer.stall import ForwardPace, ReleasedBatch, Stall
from gpu_consumer.writer import write_sample_file
from hsx.storage.fsutil import fsync_dir
from hsx.storage.spool import spool_usage
from hsx.wire import schemas, topology
from hsx.wire.events import EventPublisher, WorkerState, keep_in_progress
from hsx.wire.headers import message_headers
from hsx.wire.natsconn import through_outage

log = structlog.get_logger("hsx.gpu_consumer")

SERVICE = "gpu_consumer"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

# Seams for tests (devkit/faults.py installs faults here, e.g. a crash at the worst moment):
# called when a batch is taken up, and after its files are written and announced, before its ack.
on_batch: Callable[[schemas.BatchDescriptor], None] | None = None
before_ack: Callable[[], None] | None = None


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
    # The host buffers `extracted` are views into (None without staging): released by finish().
    lease: StagingLease | None = None


class BatchWorker:
    def __init__(
        self,
        cfg: ConsumerConfig,
        js: JetStreamContext,
        events: EventPublisher,
        spec: schemas.JobSpec,
        loaded: LoadedModel,
        stopping: asyncio.Event,
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
        self.pace = ForwardPace(stall_after_s=cfg.stall_after_s, stall_factor=cfg.stall_factor)
        self.stall: Stall | None = None  # the forward past its bound, while it runs
        self.batch_bytes = _full_batch_bytes(spec, loaded)
        self._writers = ThreadPoolExecutor(max_workers=cfg.writer_threads, thread_name_prefix="hsx-writer")

    def _write_one(self, batch_id: str, sample: schemas.Sample, hidden: torch.Tensor) -> schemas.FileReady:
        """Its folder is fsynced by the caller (`_sync_folders`), once for the batch's files."""
        return write_sample_file(
            spool=self.cfg.spool,
            spec=self.spec,
            node=self.cfg.node,
            batch_id=batch_id,
            sample=sample,
            hidden_states=hidden,
            sync_dir=False,
        )

    def _write_some(self, batch_id: str, part: list[tuple[schemas.Sample, torch.Tensor]]) -> list[schemas.FileReady]:
        """One writer thread's share of a batch's files, in order."""
        return [self._write_one(batch_id, sample, hidden) for sample, hidden in part]

    def _sync_folders(self, files: list[schemas.FileReady]) -> None:
        """fsync each folder the batch's files were renamed into: after this their names are as
        durable as their bytes (each file was fsynced before its rename), so they may be announced."""
        for folder in {(self.cfg.spool / f.spool_path).parent for f in files}:
            fsync_dir(folder)

    async def _write_until_written(self, computed: _Computed) -> list[schemas.FileReady] | None:
        """Write the batch's files; while the spool disk is full, keep the computed states and the
        message (in_progress continues) and retry with a growing delay. None if asked to stop first."""
        loop = asyncio.get_running_loop()
        delay = 2.0
        while True:
            try:
                # One job per writer thread, each a contiguous share of the batch (not one job per
                # file: a future and two thread hand-offs per small file cost more than its write).
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
                # Every write has ended before a failure is acted on: the others still read the
                # batch's leased host buffers, which must not be released (and reused) under them.
                errors = [outcome for outcome in parts if isinstance(outcome, BaseException)]
                if errors:
                    raise errors[0]
                files = [ready for part in parts for ready in part]
                await loop.run_in_executor(self._writers, self._sync_folders, files)
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
        run: Callable,
        batch: schemas.BatchDescriptor,
        keep_alive: asyncio.Task,
        on_stall: Callable[[], Awaitable[None]] | None,
    ):
        """`run(loaded, samples)` on a thread, watched. Past the batch's stall bound the forward is
        stalled: in_progress stops, so JetStream hands the batch to another consumer after the ack
        wait, `on_stall` hands back what the pull loop holds, and the heartbeat says `stalled`. A
        thread cannot be interrupted, so the forward is still awaited; if it ends after all, its
        result is used (a late ack of a redelivered batch is harmless: same files, file events
        carry their delivery in their msg ids, progress counts each batch and sample once), but
        a failure is not settled from here (`ReleasedBatch`): a nak would hand out the copy
        another consumer is working on."""
        bound = self.pace.bound_s(batch)
        began = time.monotonic()
        forward = asyncio.ensure_future(asyncio.to_thread(run, self.loaded, batch.samples))
        done, _ = await asyncio.wait({forward}, timeout=bound)
        if done:
            result = forward.result()
            self.pace.add(batch, time.monotonic() - began)
            return result
        keep_alive.cancel()
        self.stall = Stall(batch_id=batch.batch_id, began=began, bound_s=bound)
        log.warning(
            "forward_stalled",
            batch=batch.batch_id,
            running_s=round(bound, 1),
            bound_s=round(bound, 1),
            padded_tokens=self.pace.padded_tokens(batch),
            released_after_s=self.cfg.ack_wait_s,
        )
        try:
            if on_stall is not None:
                await on_stall()
            try:
                result = await forward
            except Exception as exc:
                log.warning(
                    "stalled_forward_failed",
                    batch=batch.batch_id,
                    error=f"{type(exc).__name__}: {exc}",
                    seconds=round(time.monotonic() - began, 1),
                )
                raise ReleasedBatch(batch.batch_id) from exc
        finally:
            self.stall = None
        log.warning("stalled_forward_finished", batch=batch.batch_id, seconds=round(time.monotonic() - began, 1))
        return result

    async def compute(self, msg: Msg, *, on_stall: Callable[[], Awaitable[None]] | None = None) -> _Computed | None:
        """Stage 1: decode and run the forward. Returns None when the message was settled here
        (poison dead-lettered, or a failure nak'ed for a later retry), or was released by a
        stalled forward that then failed.

        The batch's states are copied into host buffers leased to this batch alone
        (gpu_consumer/staging.py), and its files are written straight from them while the next
        batch computes: the lease goes with the returned batch and `finish` releases it once the
        files are written; a batch that comes to nothing releases it here."""
        lease = self.loaded.staging.lease() if self.loaded.staging is not None else None
        try:
            computed = await self._compute_batch(msg, lease, on_stall)
        except asyncio.CancelledError:
            # The forward's thread may still be copying into the lease: its buffers stay leased
            # (the consumer is going down).
            raise
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        if computed is None:
            if lease is not None:
                lease.release()
            return None
        computed.lease = lease
        return computed

    async def _compute_batch(
        self, msg: Msg, lease: StagingLease | None, on_stall: Callable[[], Awaitable[None]] | None
    ) -> _Computed | None:
        attempt = msg.metadata.num_delivered
        try:
            batch = schemas.batch_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            await self.events.dead_letter(msg, what="batch", error=f"descriptor does not decode: {exc}")
            return None
        if on_batch is not None:
            on_batch(batch)
        self.state, self.last_batch = "working", batch.batch_id
        log_ = log.bind(batch=batch.batch_id, attempt=attempt)
        keep_alive = asyncio.create_task(keep_in_progress(msg, interval_s=self.cfg.in_progress_s))
        started = time.perf_counter()
        try:
            try:
                outputs = await self._watched(partial(extract_samples, lease=lease), batch, keep_alive, on_stall)
                return _Computed(msg, batch, attempt, started, keep_alive, list(zip(batch.samples, outputs)))
            except ReleasedBatch:
                return None
            except Exception as exc:
                if attempt < topology.BATCH_MAX_DELIVER:
                    delay = self.cfg.retry_delay_s * attempt
                    log_.warning("batch_failed", error=f"{type(exc).__name__}: {exc}", retry_in_s=delay, exc_info=True)
                    await msg.nak(delay=delay)
                    keep_alive.cancel()
                    return None
            # Last delivery: give up only the samples that fail on their own.
            try:
                extracted, failed = await self._watched(
                    partial(extract_isolating, lease=lease), batch, keep_alive, on_stall
                )
            except ReleasedBatch:
                return None
            if not extracted:
                keep_alive.cancel()
                await self.events.dead_letter(
                    msg,
                    what="batch",
                    error=failed[0][1],
                    batch_id=batch.batch_id,
                    sample_indices=[s.index for s, _ in failed],
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
            # A planned batch's marker counts toward the plan; a re-queued sample's batch, or one
            # with samples outside the plan (a descriptor published by hand), is set aside.
            planned = not batch.redo_reason and all(0 <= f.sample_index < self.spec.total_samples for f in files)
            marker = topology.written_subject(self.spec.job, self.spec.plan_tag, batch.batch_id, planned=planned)
            await through_outage(
                lambda: self.events.mark(written_event, subject=marker), what="report_written", stopping=self.stopping
            )
            if before_ack is not None:
                before_ack()
            await through_outage(msg.ack_sync, what="ack_batch", stopping=self.stopping)
            log_.info(
                "batch_done",
                samples=len(files),
                tokens=tokens,
                bytes=written,
                seconds=round(seconds, 3),
                tokens_per_s=round(tokens / seconds, 1),
            )
        finally:
            computed.keep_alive.cancel()
            if computed.lease is not None:
                # Every write has ended (_write_until_written waits for all of them), written or
                # not: the buffers may go to the next batch.
                computed.lease.release()

    def heartbeat_state(self) -> WorkerState:
        files, used = spool_usage(self.cfg.spool, self.spec.job)
        stall = self.stall
        if stall is not None:  # whatever the other stage says: this worker's forward is hung
            running = stall.running_s()
            return WorkerState(
                state="stalled",
                last_batch=stall.batch_id,
                spool_files=files,
                spool_bytes=used,
                stalled_s=round(running, 1),
                detail=f"forward of batch {stall.batch_id} running {running:.0f} s, bound {stall.bound_s:.0f} s; "
                f"batch released to other consumers",
            )
        return WorkerState(
            state=self.state, detail=self.detail, last_batch=self.last_batch, spool_files=files, spool_bytes=used
        )

    def spool_full(self) -> tuple[bool, int]:
        _, used = spool_usage(self.cfg.spool, self.spec.job)
        return used >= self.cfg.spool_high_water_bytes, used

    def room_for(self, used: int, batches: int) -> bool:
        """Whether `batches` more full batches fit in the spool below the high-water mark."""
        return used + batches * self.batch_bytes < self.cfg.spool_high_water_bytes

    def close(self) -> None:
        self._writers.shutdown(wait=True)


def _full_batch_bytes(spec: schemas.JobSpec, loaded: LoadedModel) -> int:
    """About the most a batch adds to the spool: the token budget's states at the compute dtype
    (float8 files are smaller). 0 when the model does not say its hidden size."""
    try:
        hidden = int(loaded.model.config.get_text_config().hidden_size)
    except (AttributeError, TypeError, ValueError):
        return 0
    return spec.token_budget * len(spec.layers) * hidden * torch.empty((), dtype=loaded.dtype).element_size()


# How long the acks of a batch's announcements are awaited together before the missing ones are
# published again one by one (their msg ids make a repeat harmless).
_PUBLISH_ACK_WAIT_S = 10.0


async def publish_all(
    js: JetStreamContext,
    messages: list[tuple[str, bytes, dict[str, str]]],
    *,
    what: str,
    stopping: asyncio.Event | None = None,
) -> None:
    """Publish every (subject, payload, headers) to JetStream, each stored before this returns.

    The publishes go out back to back and their acks are awaited together (`publish_async`): one
    round trip for a batch's files instead of one each. Any that failed or had no ack within
    _PUBLISH_ACK_WAIT_S (a NATS outage) is published again on its own through the outage, as
    before; every message must carry a Nats-Msg-Id, so one stored twice is kept once."""
    futures: list[asyncio.Future] = []
    try:
        for subject, payload, headers in messages:
            futures.append(await js.publish_async(subject, payload, headers=headers))
    except (TimeoutError, nats.errors.Error) as exc:  # disconnected: the rest go one by one below
        log.warning("publish_async_failed", what=what, error=str(exc) or type(exc).__name__)
    if futures:
        _, late = await asyncio.wait(futures, timeout=_PUBLISH_ACK_WAIT_S)
        for future in late:
            future.cancel()  # frees its slot in the client's pending-publish window
    again = [
        message
        for i, message in enumerate(messages)
        if i >= len(futures) or futures[i].cancelled() or futures[i].exception() is not None
    ]
    for subject, payload, headers in again:
        await through_outage(
            lambda subject=subject, payload=payload, headers=headers: js.publish(subject, payload, headers=headers),
            what=what,
            stopping=stopping,
        )


async def give_back(js: JetStreamContext, msg: Msg) -> None:
    """Hand back a batch this consumer will not finish (it is stopping). A nak sends it to another
    consumer at once; on its last delivery a nak would strand it (JetStream never delivers it
    again), so a fresh copy is published first and the spent one removed. A crash between the two
    leaves both: the batch runs twice, which is harmless (same files, progress counts samples)."""
    if msg.metadata.num_delivered < topology.BATCH_MAX_DELIVER:
        await msg.nak()
        return
    seq = msg.metadata.sequence.stream
    headers = {**(msg.headers or {}), "Nats-Msg-Id": f"requeue:{seq}"}
    await through_outage(lambda: js.publish(msg.subject, msg.data, headers=headers), what="requeue_batch")
    await through_outage(msg.term, what="remove_requeued_batch")
    log.info("batch_requeued_fresh", seq=seq, deliveries=msg.metadata.num_delivered)


async def _finish_guarded(worker: BatchWorker, computed: _Computed) -> None:
    try:
        await worker.finish(computed)
    except Exception as exc:
        # A NATS outage while announcing or acking: the batch stays unacked and is redelivered
        # after the ack wait (its files are rewritten identically).
        log.warning(
            "batch_interrupted", batch=computed.batch.batch_id, error=f"{type(exc).__name__}: {exc}", exc_info=True
        )


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


async def _return_unstarted(prefetch: asyncio.Task | None, js: JetStreamContext) -> None:
    """Hand back a descriptor fetched ahead but never started (we are stopping, paused at the
    high-water mark, or stuck in a stalled forward): it goes to another consumer at once instead
    of waiting here, kept alive, for as long as that lasts (`give_back`). Its next delivery
    counts as one: JetStream has no way to return a message uncounted."""
    if prefetch is None:
        return
    try:
        fetched = await prefetch
    except Exception:
        return
    fetched.started()
    for msg in fetched.msgs:
        try:
            await give_back(js, msg)
        except Exception as exc:  # NATS gone: the ack wait hands it back instead
            log.warning("prefetched_batch_not_returned", error=str(exc) or type(exc).__name__)


async def pull_loop(worker: BatchWorker, sub, cfg: ConsumerConfig, stopping: asyncio.Event) -> None:
    finishing: asyncio.Task | None = None
    # The next descriptor is fetched while the current batch computes, so the GPU does not wait
    # for a round trip to NATS between batches.
    prefetch: asyncio.Task | None = None
    paused = False

    async def release_ahead() -> None:
        nonlocal prefetch
        held, prefetch = prefetch, None
        await _return_unstarted(held, worker.js)

    try:
        while not stopping.is_set():
            full, used = worker.spool_full()
            if not full and finishing is not None and not finishing.done() and not worker.room_for(used, 1):
                # The batch being written may take the spool past the mark: let it land before
                # fetching one that could then not be started.
                await _settle(finishing)
                finishing = None
                full, used = worker.spool_full()
            if full:
                if prefetch is not None:
                    # Kept, it would wait here with in_progress for as long as the pause lasts.
                    await release_ahead()
                if not paused:
                    log.warning("spool_high_water_paused", spool_bytes=used, high_water=cfg.spool_high_water_bytes)
                    paused = True
                worker.state = "paused"
                worker.detail = f"spool holds {used} bytes, high-water mark {cfg.spool_high_water_bytes}"
                try:
                    await asyncio.wait_for(stopping.wait(), timeout=2.0)
                except TimeoutError:
                    pass
                continue
            if paused:
                log.info("spool_resumed", spool_bytes=used)
                paused = False
                worker.state, worker.detail = "idle", ""
            fetching, prefetch = prefetch or asyncio.create_task(_fetch_one(sub, cfg, ahead=False)), None
            try:
                fetched = await fetching
            except TimeoutError:
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
                # A redelivered batch may be what killed its last consumer: it runs alone (the
                # batch before it finished first, nothing fetched ahead), so that dying on it
                # again costs no other batch one of its deliveries.
                if msg.metadata.num_delivered > 1:
                    await _settle(finishing)
                    finishing = None
                elif not stopping.is_set() and worker.room_for(used, 2):
                    # Only what can be started: near the high-water mark (this batch and the one
                    # being written still to land), a descriptor fetched ahead would be held
                    # through the pause that follows.
                    prefetch = asyncio.create_task(_fetch_one(sub, cfg, ahead=True))
                try:
                    computed = await worker.compute(msg, on_stall=release_ahead)
                except Exception as exc:
                    log.warning("batch_interrupted", error=f"{type(exc).__name__}: {exc}", exc_info=True)
                    continue
                # Batch N must be finished before batch N+1's finish starts (and before batch N+2's
                # forward leases staging buffers: two batches leased at most); batch N+1's forward
                # has just run alongside it.
                await _settle(finishing)
                finishing = asyncio.create_task(_finish_guarded(worker, computed)) if computed else None
    finally:
        await _return_unstarted(prefetch, worker.js)
        await _settle(finishing)
