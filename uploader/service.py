"""Moving one announced file from the spool to the destination (`FileMover.handle`), and the
uploader's policy in the workers' shared pull loop (`FilePuller`).

Per event: decode (poison -> dead letter); another plan's event is not handled; if the destination
already holds exactly this object, delete the local copy and ack; else check the local file (its
data against its header's checksum, its digest against the event's), upload, verify, delete the
local file, store the sample's `uploaded` marker, and only then ack. A lost or corrupted spool
file is sent back for extraction; a failing upload is retried while the event is kept alive; a
refusing destination is probed, not retried (docs/architecture/consumer.md.
"""

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import structlog
from nats.aio.msg import Msg

from hsx.job import JobSpec
from hsx.storage.destinations import Destination
from hsx.storage.layout import sample_key
from hsx.storage.samplefile import SampleFileCorrupt, checked_digest
from hsx.storage.spool import spool_file, spool_usage
from hsx.uploader.config import UploaderConfig
from hsx.uploader.samples import SampleNotFound, StoredSamples
from hsx.wire import schemas, topology
from hsx.wire.backoff import jittered, retry_delay
from hsx.wire.counts import has_uploaded_marker
from hsx.wire.events import EventPublisher, WorkerState
from hsx.wire.headers import message_headers
from hsx.wire.health import Health
from hsx.wire.load import RecentRate, spool_free
from hsx.wire.natsconn import NATS_OUTAGE_ERRORS, through_outage
from hsx.wire.pull import PullLoop, Taken
from hsx.wire.worker import JobWatch

log = structlog.get_logger("hsx.uploader")

SERVICE = topology.UPLOADER_SERVICE
# How long a lost file's event waits before it asks again for the job's stored samples, while its
# plan is still being published in rounds.
_STORED_SAMPLES_WAIT_S = 10.0
# While uploads keep failing, how often one line says so (the first failure is said at once).
UNREACHABLE_REPORT_S = 60.0
# At most this often, a heartbeat as the uploads in hand run out (its spool measured then).
DRAINED_BEAT_EVERY_S = 1.0


class _PermanentFailure(Exception):
    """Retrying cannot help (the event is wrong); dead-letter it."""


class _SpoolFileLost(Exception):
    """The spool file is gone or corrupted and the destination does not have it: extract again."""


class _OutdatedEvent(Exception):
    """The spool file is sound but not the one the event announced: a later write of the sample
    replaced it, whose own event uploads it."""


def _checked_spool_file(path: Path) -> tuple[str, os.stat_result]:
    """A spool file's digest, after checking its data against the checksum in its header (one
    read), and its fstat taken while it was read: which inode the checked bytes are."""
    with open(path, "rb") as source:
        checked = os.fstat(source.fileno())
        return checked_digest(iter(lambda: source.read(8 << 20), b"")), checked


class FileMover:
    def __init__(
        self,
        cfg: UploaderConfig,
        dest: Destination,
        events: EventPublisher,
        spec: JobSpec,
        *,
        watch: JobWatch | None = None,
    ) -> None:
        self.cfg = cfg
        self.dest = dest
        self.events = events
        self.spec = spec
        # Whether the job is still the one this uploader started for (None: not watched, in tests).
        self.watch = watch
        # The job's plan and size: where its files lie in the spool, which `uploaded` markers
        # count toward it (`_marker`).
        self.plan = spec.plan_tag
        self.total_samples = spec.total_samples
        self.inflight = 0
        self.rate = RecentRate()  # samples stored over the last minute, for the heartbeat's `load`
        # Uploads in hand whose last attempt failed (waiting to retry or trying again): the
        # heartbeat says `retrying` with the error until each succeeds, not only between attempts.
        self.retrying = 0
        self._unreachable_since: float | None = None  # the first failed upload of the current run of them
        self._unreachable_said = 0.0
        self.last_error = ""
        self.refused = ""  # why the destination refuses writes, while it does
        self._refused_since = 0.0
        self._drained_beat_at = -DRAINED_BEAT_EVERY_S  # monotonic: the last beat sent on going idle
        self._accepting = asyncio.Event()  # set unless refused: what the held uploads wait for
        self._accepting.set()
        self._probing = False  # one held upload is trying the destination again
        self.spool_root = cfg.spool.resolve()
        self.samples = StoredSamples(cfg.job)
        # Against S3 it is the latency of many concurrent requests that sets the throughput: one
        # thread per upload in flight (asyncio's default pool, at most 32 threads, would cap it).
        # A local destination is bound by the CPU and the disk, where more threads than cores
        # only add switching (bench/pipeline.py: 217 files/s with 100 threads, 332 with 8).
        threads = cfg.max_inflight if dest.latency_bound else min(cfg.max_inflight, 4 * (os.cpu_count() or 1))
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hsx-upload")

    def _check_key(self, ready: schemas.FileReady) -> None:
        """The destination key is derived, never taken on trust: an event cannot place an object
        outside the job's prefix."""
        if ready.job != self.cfg.job or ready.key != sample_key(ready.job, ready.sample_index):
            raise _PermanentFailure(
                f"event for job {ready.job!r} sample {ready.sample_index} names key {ready.key!r}; "
                f"expected {sample_key(self.cfg.job, ready.sample_index)!r}"
            )

    def _local_path(self, ready: schemas.FileReady) -> Path:
        """Derived from the sample (the event's `spool_path` is not read): a link planted there
        must not lead the uploader out of its spool either."""
        path = spool_file(self.spool_root, self.cfg.job, self.plan, ready.sample_index)
        if not path.resolve().is_relative_to(self.spool_root):
            raise _PermanentFailure(f"{path} points outside the spool {self.spool_root}")
        return path

    def _move(self, ready: schemas.FileReady) -> bool:
        """Blocking: returns True if the object was already in the destination."""
        self._check_key(ready)
        local = self._local_path(ready)
        if self.dest.has_verified(ready.key, size=ready.size, digest=ready.digest):
            local.unlink(missing_ok=True)
            return True
        try:
            local_digest, checked = _checked_spool_file(local)
        except FileNotFoundError:
            # Another uploader may have finished the same sample (announced twice after a
            # redelivered batch) between the check above and now: look again before calling it lost.
            if self.dest.has_verified(ready.key, size=ready.size, digest=ready.digest):
                return True
            raise _SpoolFileLost(f"{local}: missing from the spool and not in the destination") from None
        except SampleFileCorrupt as exc:
            local.unlink(missing_ok=True)
            raise _SpoolFileLost(f"{local}: spool file is corrupt: {exc}") from None
        if local_digest != ready.digest:
            raise _OutdatedEvent(
                f"{local}: the spool file's digest is {local_digest[:12]}, the event announced {ready.digest[:12]}"
            )
        if checked.st_size != ready.size:
            # The digest (of the header, which sizes the data) is the file's: the event's size is
            # wrong, not the file; stored, it would fail its check as a destination's error.
            raise _PermanentFailure(
                f"{local}: the event announces {ready.size} bytes, the file it names by its digest has {checked.st_size}"
            )
        try:
            # A file:// destination on the spool's file system takes the checked file by a rename.
            if self.dest.move_verified(local, ready.key, size=ready.size, checked=checked):
                return False
        except FileNotFoundError:  # taken by a concurrent uploader of the same sample meanwhile
            if self.dest.has_verified(ready.key, size=ready.size, digest=ready.digest):
                return True
            raise
        self.dest.put_verified(local, ready.key, size=ready.size, digest=ready.digest)
        local.unlink(missing_ok=True)  # a concurrent uploader of the same sample may have removed it
        return False

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        self.samples.close()

    @property
    def job_lost(self) -> bool:
        return self.watch is not None and bool(self.watch.lost)

    def heartbeat_state(self) -> WorkerState:
        measured_at = time.time()
        files, used = spool_usage(self.cfg.spool, self.cfg.job, self.plan)
        if self.refused:
            state, detail = "refused", self.refused
        elif self.retrying:
            state, detail = "retrying", f"{self.retrying} uploads waiting to retry: {self.last_error[:200]}"
        else:
            state, detail = ("working" if self.inflight else "idle"), f"inflight={self.inflight}"
        load = schemas.WorkerLoad(
            samples_per_s=round(self.rate.per_second(), 3), in_hand=self.inflight, spool_free=spool_free(self.cfg.spool)
        )
        return WorkerState(
            state=state, detail=detail, spool_files=files, spool_bytes=used, spool_measured_at=measured_at, load=load
        )

    async def handle(self, msg: Msg, stopping: asyncio.Event) -> None:
        try:
            await self._handle(msg, stopping)
        except NATS_OUTAGE_ERRORS as exc:
            # NATS away while reporting, acking or handing back (past the outage budget, or
            # stopping): the event stays unacked and comes back after the ack wait; the
            # destination then already holds the object and it is acked at once.
            log.warning(
                "file_left_unacked",
                error=f"{type(exc).__name__}: {exc}",
                redelivered_after_s=self.cfg.ack_wait_s,
                reason="NATS did not answer",
            )
        except Exception as exc:  # a bug: its traceback
            log.warning("file_interrupted", error=f"{type(exc).__name__}: {exc}", exc_info=True)

    async def _handle(self, msg: Msg, stopping: asyncio.Event) -> None:
        self.inflight += 1
        taken = Taken.of(msg, interval_s=self.cfg.in_progress_s)
        failing = False
        try:
            try:
                ready = schemas.file_decoder.decode(msg.data)
            except msgspec.DecodeError as exc:
                await self.events.dead_letter(msg, what="file", error=f"file-ready event does not decode: {exc}")
                return
            if not self.spec.owns(ready.plan):
                await self._not_this_plan(msg, ready, stopping)
                return
            if not await self._in_plan(msg, ready, stopping):
                return
            attempt, stored = 0, False
            while True:
                if self.job_lost:
                    log.warning("upload_abandoned", key=ready.key, reason="the job was lost")
                    return
                probe = False
                if self.refused:
                    probe = await self._wait_for_turn(stopping)
                    if stopping.is_set():
                        await msg.nak()
                        return
                try:
                    already = await self._try_move(ready, probe=probe)
                    stored = True
                    break
                except _SpoolFileLost as exc:
                    if await self._uploaded_already(ready):
                        await self._ack_outdated(msg, ready, f"{exc}; the sample is uploaded already", stopping)
                    else:
                        await self._requeue(msg, ready, str(exc), stopping)
                    return
                except _OutdatedEvent as exc:
                    await self._ack_outdated(msg, ready, str(exc), stopping)
                    return
                except _PermanentFailure as exc:
                    await self.events.dead_letter(
                        msg, what="file", error=str(exc), batch_id=ready.batch_id, sample_indices=[ready.sample_index]
                    )
                    return
                except Exception as exc:
                    if stopping.is_set():
                        await msg.nak()
                        return
                    reason = self.dest.refusal(exc)
                    if reason is not None:
                        await self._refused_by_destination(reason, key=ready.key, probe=probe)
                        continue
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    delay = retry_delay(attempt, base_s=self.cfg.retry_base_s, cap_s=self.cfg.retry_max_s)
                    attempt += 1
                    if not failing:
                        failing = True
                        self.retrying += 1
                    log.debug("upload_retry", key=ready.key, error=self.last_error, retry_in_s=round(delay, 2))
                    self._say_unreachable()
                    await asyncio.sleep(delay)
            if self.refused:
                await self._destination_accepts()
            if self.job_lost:
                return
            await self._report_and_ack(msg, ready, already=already, stopping=stopping)
        finally:
            if failing:
                self.retrying -= 1
                if not self.retrying and self._unreachable_since is not None:
                    if stored:  # not when the last one was given up (job lost, stopping)
                        log.info(
                            "destination_reachable",
                            dest=self.dest.url,
                            unreachable_s=round(time.monotonic() - self._unreachable_since, 1),
                        )
                    self._unreachable_since = None
            taken.release()
            self.inflight -= 1
        if not self.inflight and not stopping.is_set():
            await self._beat_when_drained()

    async def _beat_when_drained(self) -> None:
        """A heartbeat as the last upload in hand is stored (at most every DRAINED_BEAT_EVERY_S):
        the node's spool figure is then the drained spool at once, not up to a heartbeat later, as
        at a job's end."""
        if time.monotonic() - self._drained_beat_at >= DRAINED_BEAT_EVERY_S:
            self._drained_beat_at = time.monotonic()
            await self._beat()

    async def _report_and_ack(
        self, msg: Msg, ready: schemas.FileReady, *, already: bool, stopping: asyncio.Event
    ) -> None:
        """The object is stored and verified: its `uploaded` marker, then the ack. A NATS outage
        from here on is waited out rather than left to the ack wait (reporting twice is harmless:
        progress counts samples)."""
        uploaded = schemas.FileUploaded(
            job=ready.job,
            node=ready.node,
            uploader=self.cfg.instance,
            sample_index=ready.sample_index,
            key=ready.key,
            size=ready.size,
            tokens=ready.num_tokens,
            already_present=already,
            attempt=msg.metadata.num_delivered,
            plan=ready.plan,
            digest=ready.digest,
            sample_digest=ready.sample_digest,
        )
        # The sample's marker (stored once): what `hsx status` counts and the index is built from.
        await through_outage(lambda: self._report_uploaded(uploaded, ready), what="report_uploaded", stopping=stopping)
        await through_outage(msg.ack_sync, what="ack_file", stopping=stopping)
        self.rate.add(1)
        log.debug("file_uploaded", key=ready.key, bytes=ready.size, already_present=already)

    async def _not_this_plan(self, msg: Msg, ready: schemas.FileReady, stopping: asyncio.Event) -> None:
        """An event of another plan than this uploader's. While this uploader's job is current, it
        is a stray of an earlier job of the name (its consumer wrote on after the job was
        deleted): dropped with a warning, its file left alone (never this plan's to delete). If
        the job moved on, this uploader is the stray: it hands the event back and stops."""
        if self.watch is not None and await self.watch.check():
            await msg.nak()
            return
        log.warning(
            "stale_file_event_dropped",
            sample=ready.sample_index,
            event_plan=ready.plan,
            plan=self.plan,
            batch=ready.batch_id,
        )
        await through_outage(msg.term, what="drop_stale_file_event", stopping=stopping)

    async def _in_plan(self, msg: Msg, ready: schemas.FileReady, stopping: asyncio.Event) -> bool:
        """Whether the event's sample is one of the plan's, as its spec is now. One of a round not
        yet recorded waits (the event goes back with a delay: a plan published in rounds records
        each round before its batches go out); one outside the whole plan is removed unhandled."""
        index = ready.sample_index

        def covers(spec: JobSpec) -> bool:
            return 0 <= index < spec.total_samples

        placed = covers(self.spec) if self.watch is None else await self.watch.placed(covers)
        if placed:
            return True
        if placed is None:
            log.info("file_waits_for_its_round", sample=index, retry_in_s=_STORED_SAMPLES_WAIT_S)
            await through_outage(lambda: msg.nak(delay=_STORED_SAMPLES_WAIT_S), what="nak_file", stopping=stopping)
            return False
        log.warning("file_event_outside_plan", sample=index, batch=ready.batch_id, plan=self.plan, node=ready.node)
        await through_outage(msg.term, what="drop_file_outside_plan", stopping=stopping)
        return False

    async def _uploaded_already(self, ready: schemas.FileReady) -> bool:
        try:
            return await has_uploaded_marker(self.events.js, ready.job, self.plan, ready.sample_index)
        except Exception as exc:  # NATS away: the sample is sent back, which is harmless
            log.warning("uploaded_marker_unknown", sample=ready.sample_index, error=str(exc) or type(exc).__name__)
            return False

    async def _ack_outdated(self, msg: Msg, ready: schemas.FileReady, reason: str, stopping: asyncio.Event) -> None:
        """An event whose file another event of the sample covers: acked, nothing touched or redone."""
        log.warning("file_event_outdated", sample=ready.sample_index, batch=ready.batch_id, reason=reason)
        await through_outage(msg.ack_sync, what="ack_file", stopping=stopping)

    async def _report_uploaded(self, uploaded: schemas.FileUploaded, ready: schemas.FileReady) -> None:
        if await self.events.mark(uploaded, subject=await self._marker(ready), batch_id=ready.batch_id):
            return
        if not uploaded.already_present:
            # The sample was reported before, and this upload stored its object again (a batch
            # redelivered after its files were announced): not a second marker, but said, so the
            # index takes this object's digest and uploads done twice can be seen.
            await self.events.emit(
                msgspec.structs.replace(uploaded, replaces=True),
                batch_id=ready.batch_id,
                subject=topology.replaced_subject(ready.job, ready.plan or self.plan, ready.sample_index),
            )

    async def _marker(self, ready: schemas.FileReady) -> str:
        """Where the sample's `uploaded` marker goes: under the plan that wrote the file (an event
        without a plan, from a consumer before events carried one, is taken as this job's), and
        set aside when its index is outside that plan (as its spec is now: a plan published in
        rounds grows)."""
        plan = ready.plan or self.plan
        index = ready.sample_index
        total = self.total_samples
        if plan == self.plan and self.watch is not None:
            total = (await self.watch.current_for(lambda spec: 0 <= index < spec.total_samples)).total_samples
        planned = plan != self.plan or 0 <= index < total
        return topology.uploaded_subject(ready.job, plan, ready.sample_index, planned=planned)

    async def _try_move(self, ready: schemas.FileReady, *, probe: bool) -> bool:
        """One attempt; a probe first opens a fresh client (credentials fixed in the credentials
        file count from the next probe on), then hands the probing turn on, whatever happened."""
        loop = asyncio.get_running_loop()
        try:
            if probe:
                await loop.run_in_executor(self._threads, self.dest.reconnect)
            return await loop.run_in_executor(self._threads, self._move, ready)
        finally:
            if probe:
                self._probing = False

    async def _wait_for_turn(self, stopping: asyncio.Event) -> bool:
        """While the destination refuses, one upload in hand is the probe: it tries again every
        `probe_every_s` (jittered); the others wait until it gets through, so a refusing
        destination sees one request per interval, not one per upload held. True: this upload
        is the probe and tries once now."""
        while self.refused and not stopping.is_set():
            if not self._probing:
                self._probing = True
                keep_turn = False
                try:
                    try:
                        await asyncio.wait_for(stopping.wait(), timeout=jittered(self.cfg.probe_every_s))
                    except TimeoutError:
                        pass
                    keep_turn = bool(self.refused) and not stopping.is_set()
                    if keep_turn:
                        return True
                finally:
                    if not keep_turn:
                        self._probing = False
                continue
            try:
                await asyncio.wait_for(self._accepting.wait(), timeout=1.0)
            except TimeoutError:
                pass
        return False

    def _say_unreachable(self) -> None:
        """One line when uploads start failing and one every UNREACHABLE_REPORT_S while they do
        (each file's retry is a debug line): how long, how many files wait, the last error."""
        now = time.monotonic()
        if self._unreachable_since is not None and now - self._unreachable_said < UNREACHABLE_REPORT_S:
            return
        if self._unreachable_since is None:
            self._unreachable_since = now
        self._unreachable_said = now
        log.warning(
            "destination_unreachable",
            dest=self.dest.url,
            error=self.last_error[:300],
            files_waiting=self.retrying,
            retry_every_s=f"at most {self.cfg.retry_max_s:g}",
            unreachable_s=round(now - self._unreachable_since, 1),
        )

    async def _refused_by_destination(self, reason: str, *, key: str, probe: bool) -> None:
        if reason != self.refused:
            if not self.refused:
                self._refused_since = time.monotonic()
            self.refused = reason
            self._accepting.clear()
            log.error(
                "destination_refused", dest=self.dest.url, reason=reason, key=key, probe_every_s=self.cfg.probe_every_s
            )
            await self._beat()
        elif probe:
            log.warning(
                "destination_still_refused",
                dest=self.dest.url,
                reason=reason,
                key=key,
                refused_s=round(time.monotonic() - self._refused_since, 1),
            )

    async def _destination_accepts(self) -> None:
        log.info("destination_accepts", dest=self.dest.url, refused_s=round(time.monotonic() - self._refused_since, 1))
        self.refused = ""
        self._accepting.set()
        await self._beat()

    async def _beat(self) -> None:
        """A heartbeat now rather than at the next tick: a refusal is the job's failure reason in
        `hsx status`, and its end clears it."""
        try:
            report = await asyncio.to_thread(self.heartbeat_state)
            await self.events.heartbeat(
                service=SERVICE,
                instance=self.cfg.instance,
                node=self.cfg.node,
                state=report.state,
                detail=report.detail,
                spool_files=report.spool_files,
                spool_bytes=report.spool_bytes,
                spool_measured_at=report.spool_measured_at,
                spool=str(self.cfg.spool),
                load=report.load,
            )
        except Exception as exc:  # the heartbeat loop says it again within its interval
            log.warning("heartbeat_failed", error=str(exc))

    async def _requeue(self, msg: Msg, ready: schemas.FileReady, reason: str, stopping: asyncio.Event) -> None:
        """Publish the sample as a one-sample batch, then ack the event: its file will be announced
        again once extracted. The batch id derives from this event, so a retry publishes it once.
        A sample that cannot be found again dead-letters the event instead."""
        try:
            sample = await self.samples.sample_for(self.events.js, ready)
        except SampleNotFound as exc:
            if self.watch is not None and await self.watch.check():
                await msg.nak()  # the job is gone: its letter would count against the next one of its name
                return
            if exc.later:  # the plan is still being published in rounds: its samples are stored after
                log.info("requeue_waits_for_stored_samples", sample=ready.sample_index, reason=str(exc))
                await msg.nak(delay=_STORED_SAMPLES_WAIT_S)
                return
            await self.events.dead_letter(
                msg,
                what="file",
                error=f"{reason}; not sent back for extraction: {exc}",
                batch_id=ready.batch_id,
                sample_indices=[ready.sample_index],
            )
            return
        batch_id = f"{ready.job}-redo-{ready.sample_index}-{msg.metadata.sequence.stream}"
        descriptor = schemas.BatchDescriptor(
            job=ready.job,
            batch_id=batch_id,
            padded_len=len(sample.input_ids),
            samples=[sample],
            redo_reason=reason,
            plan=ready.plan or self.plan,
        )
        await through_outage(
            lambda: self.events.js.publish(
                topology.batch_subject(ready.job),
                schemas.encode(descriptor),
                headers=message_headers(ready.job, batch=batch_id, sample=ready.sample_index, msg_id=batch_id),
            ),
            what="requeue_sample",
            stopping=stopping,
        )
        requeued = schemas.SampleRequeued(
            job=ready.job, node=ready.node, sample_index=ready.sample_index, reason=reason
        )
        await through_outage(
            lambda: self.events.emit(requeued, batch_id=batch_id), what="report_requeued", stopping=stopping
        )
        await through_outage(msg.ack_sync, what="ack_file", stopping=stopping)
        log.warning("sample_requeued", sample=ready.sample_index, reason=reason, batch=batch_id)


class FilePuller(PullLoop[list[Msg]]):
    """The uploader's policy in the shared pull loop: up to `max_inflight` uploads at once, each
    event handled on a task of its own; while the destination refuses, only one event is fetched,
    to probe it; stopping, the uploads in hand get `stop_deadline_s` to finish."""

    def __init__(
        self, mover: FileMover, sub, cfg: UploaderConfig, stopping: asyncio.Event, health: Health | None = None
    ) -> None:
        super().__init__(
            sub, stopping=stopping, watch=mover.watch, fetch_timeout_s=cfg.idle_fetch_timeout_s, health=health
        )
        self.mover = mover
        self.cfg = cfg
        self.tasks: set[asyncio.Task] = set()

    async def room(self) -> int:
        free = self.cfg.max_inflight - len(self.tasks)
        # While the destination refuses, the uploads in hand wait for it (one of them probing):
        # events fetched now would only be held as well. With none in hand, one is fetched to probe.
        if free <= 0 or (self.mover.refused and self.tasks):
            await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED, timeout=1.0)
            return 0
        return 1 if self.mover.refused else min(free, 256)

    async def take(self, got: list[Msg]) -> None:
        for msg in got:
            task = asyncio.create_task(self.mover.handle(msg, self.stopping))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def wind_down(self) -> None:
        tasks = self.tasks
        if tasks:
            started = time.monotonic()
            log.info("finishing_inflight_uploads", inflight=len(tasks), deadline_s=self.cfg.stop_deadline_s)
            await asyncio.wait(tasks, timeout=self.cfg.stop_deadline_s)
            if tasks:
                log.warning("uploads_left_unacked", count=len(tasks), waited_s=round(time.monotonic() - started, 1))


async def pull_loop(
    mover: FileMover, sub, cfg: UploaderConfig, stopping: asyncio.Event, health: Health | None = None
) -> None:
    await FilePuller(mover, sub, cfg, stopping, health).run()
