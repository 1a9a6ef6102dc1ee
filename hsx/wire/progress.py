"""A job's progress: exact counts read from JetStream in constant time, and sums folded from the
job's markers once, checkpointed for the next reader.

Counts (`read_counts`). Every planned batch written and every planned sample uploaded leaves a
marker on a subject of its own (`topology.written_subject`, `topology.uploaded_subject`), stored
at most once (`EventPublisher.mark`). JetStream counts the messages under a filter without
delivering any: a durable that is never fetched from (`topology.PROGRESS_COUNTERS`) has them all
pending, so `samples_uploaded` and `batches_done` are exact, whatever the job's size, and read
with one consumer-info request each. Markers of another plan under
the same job name sit under their own plan, and a sample index outside the plan under
`<plan>.extra.`: neither is in the plan's count, so neither can stand in for a missing sample.
`done` is read from the counts: every planned sample of this plan has its marker, and nothing is
queued.

Sums (`ProgressFold`). Samples, tokens and bytes written and uploaded, and the deliveries each
batch and file needed, are the markers' own numbers added up in stream order, each marker once.
A reader that folds them (the monitor, continuously; `hsx status`, for up to its budget) saves
what it reached as a `ProgressCheckpoint` on `hsx.events.<job>.checkpoint`, and the next reader
starts from there, so the markers are read once between readers, not at every reading. Sums that
did not catch up within a budget are reported as such (`sums_complete`), never as the whole.

Dead letters and heartbeats are replayed (a few per failure and per worker); queue depths are
JetStream's own state. Nothing here infers progress from processes.
"""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import msgspec
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from hsx.wire import schemas, topology
from hsx.wire.events import HEARTBEAT_ROLLUP
from hsx.wire.headers import message_headers

log = structlog.get_logger("hsx.progress")

# How long a tracker's start waits for the dead letters and heartbeats before the sums' replays.
_OTHERS_FIRST_S = 10.0
# Dead samples whose `uploaded` marker is looked up at once (`ProgressTracker.refresh_counts`).
_LOOKUPS_IN_FLIGHT = 64


@dataclass
class QueueState:
    batches_queued: int = 0
    files_queued: int = 0
    dead_letters: int = 0
    batch_redeliveries: int = 0
    file_redeliveries: int = 0


@dataclass(frozen=True)
class ProgressCounts:
    """Distinct markers, counted by JetStream (see the module docstring)."""

    samples_uploaded: int = 0  # this plan's samples with an `uploaded` marker
    batches_done: int = 0  # this plan's batches with a `written` marker
    samples_outside_plan: int = 0  # `uploaded` markers of this plan set aside: indices outside range(total)
    events_other_plan: int = 0  # markers of another plan under this job name
    samples_requeued: int = 0  # `requeued` events: a spool file lost or corrupted, sent back for extraction
    # Of the dead-lettered samples, those with no `uploaded` marker: what a dead letter still holds back.
    dead_unfinished: frozenset[int] = frozenset()


async def count_stored(js: JetStreamContext, stream: str, subject_filter: str) -> int:
    """Messages in `stream` under `subject_filter`, counted by the server: an ephemeral consumer is
    created, read for its pending count and deleted; no message is delivered. For one-off counts
    (a producer re-run, tests); a reading counts through the durables (`read_counts`), since a
    cluster pays every consumer created as a meta-layer proposal."""
    config = ConsumerConfig(
        filter_subject=subject_filter,
        ack_policy=AckPolicy.NONE,
        mem_storage=True,
        inactive_threshold=30.0,
        deliver_policy=DeliverPolicy.ALL,
    )
    info = await js.add_consumer(stream, config)
    try:
        return info.num_pending or 0
    finally:
        try:
            await js.delete_consumer(stream, info.name)
        except nats.js.errors.NotFoundError:
            pass


async def read_counts(js: JetStreamContext, job: str, plan: str) -> ProgressCounts:
    """The job's counts: one consumer-info request per counting durable (topology.PROGRESS_COUNTERS,
    created on first use), all at once, whatever the job's size."""

    async def count(counter: str) -> int:
        try:
            info = await js.consumer_info(topology.EVENTS_STREAM, topology.progress_durable(job, counter))
        except nats.js.errors.NotFoundError:
            info = None
        if info is None or info.config.filter_subject != topology.progress_counter_filter(job, plan, counter):
            info = await topology.ensure_progress_counter(js, job, plan, counter)
        return info.num_pending or 0

    found = dict(zip(topology.PROGRESS_COUNTERS, await asyncio.gather(*map(count, topology.PROGRESS_COUNTERS))))
    return ProgressCounts(
        samples_uploaded=found["uploaded"],
        batches_done=found["written"],
        samples_outside_plan=found["uploaded-extra"],
        events_other_plan=(found["uploaded-any"] - found["uploaded"]) + (found["written-any"] - found["written"]),
        samples_requeued=found["requeued"],
    )


async def last_sequence(js: JetStreamContext, stream: str, subject_filter: str) -> int:
    """The stream sequence of the newest message under `subject_filter` (0: none); one direct read."""
    try:
        return (await js.get_last_msg(stream, subject_filter)).seq
    except nats.js.errors.NotFoundError:
        return 0


@dataclass
class ProgressFold:
    """The sums of a job's markers, its dead letters and its workers' last heartbeats; a pure fold
    that knows nothing about NATS (`ProgressTracker` feeds it). Markers of `plan` only: the
    replays it is fed from are filtered to it. A marker counts once: the server stores each
    subject's first (topology.ONCE_HEADERS), and a `replaces` report is not a marker."""

    job: str = ""
    plan: str = ""
    written_seq: int = 0  # the stream sequence the written sums reach (every marker at or below it is in them)
    samples_written: int = 0
    tokens_written: int = 0
    bytes_written: int = 0
    batch_redeliveries: int = 0
    uploaded_seq: int = 0
    tokens_uploaded: int = 0
    bytes_uploaded: int = 0
    file_redeliveries: int = 0
    dead_samples: set[int] = field(default_factory=set)
    dead_batches: set[str] = field(default_factory=set)
    heartbeats: dict[str, schemas.Heartbeat] = field(default_factory=dict)

    @classmethod
    def from_checkpoint(cls, checkpoint: schemas.ProgressCheckpoint) -> "ProgressFold":
        return cls(
            job=checkpoint.job,
            plan=checkpoint.plan,
            written_seq=checkpoint.written_seq,
            samples_written=checkpoint.samples_written,
            tokens_written=checkpoint.tokens_written,
            bytes_written=checkpoint.bytes_written,
            batch_redeliveries=checkpoint.batch_redeliveries,
            uploaded_seq=checkpoint.uploaded_seq,
            tokens_uploaded=checkpoint.tokens_uploaded,
            bytes_uploaded=checkpoint.bytes_uploaded,
            file_redeliveries=checkpoint.file_redeliveries,
        )

    def checkpoint(self) -> schemas.ProgressCheckpoint:
        return schemas.ProgressCheckpoint(
            job=self.job,
            plan=self.plan,
            written_seq=self.written_seq,
            samples_written=self.samples_written,
            tokens_written=self.tokens_written,
            bytes_written=self.bytes_written,
            batch_redeliveries=self.batch_redeliveries,
            uploaded_seq=self.uploaded_seq,
            tokens_uploaded=self.tokens_uploaded,
            bytes_uploaded=self.bytes_uploaded,
            file_redeliveries=self.file_redeliveries,
            saved_at=time.time(),
        )

    def apply_marker(self, event: schemas.Event, *, seq: int, planned: bool) -> None:
        """A marker at stream sequence `seq`; `planned`: it counts toward the plan (not `extra`)."""
        if isinstance(event, schemas.BatchWritten):
            if seq <= self.written_seq:
                return
            self.written_seq = seq
            if planned:
                self.samples_written += len(event.sample_indices)
                self.tokens_written += event.tokens
                self.bytes_written += event.bytes
                self.batch_redeliveries += max(0, event.attempt - 1)
        elif isinstance(event, schemas.FileUploaded):
            if seq <= self.uploaded_seq:
                return
            self.uploaded_seq = seq
            if planned and not event.replaces:
                self.tokens_uploaded += event.tokens
                self.bytes_uploaded += event.size
                self.file_redeliveries += max(0, event.attempt - 1)

    def apply(self, event: schemas.Event) -> None:
        """Dead letters and heartbeats (the events that are replayed whole)."""
        if isinstance(event, schemas.Heartbeat):
            self.heartbeats[event.instance] = event
        elif isinstance(event, schemas.DeadLetter):
            if self.plan and not _letter_of_plan(event, self.plan):
                return  # stored by a worker of an earlier job of this name: not this job's samples
            self.dead_samples.update(event.sample_indices)
            if event.batch_id:
                self.dead_batches.add(event.batch_id)


def _letter_of_plan(letter: schemas.DeadLetter, plan: str) -> bool:
    """Whether a dead letter is of `plan`: the plan its payload names (letters of payloads from
    before payloads named one, or of payloads that did not decode, are taken as the job's)."""
    payload = letter.batch or letter.file
    return payload is None or payload.plan in ("", plan)


class _Replay:
    """An ordered consumer over one subject filter from a stream sequence on, handing each
    message to `apply(msg)`; `caught_up` is set once it has read what was there when it started."""

    def __init__(
        self, js: JetStreamContext, stream: str, subject: str, apply, deliver: DeliverPolicy, after_seq: int = 0
    ) -> None:
        self.js, self.stream, self.subject, self.apply, self.deliver = js, stream, subject, apply, deliver
        self.after_seq = after_seq
        self.until_seq = 0  # the newest message there was at the start: caught up once it is read
        self.caught_up = asyncio.Event()
        self.sub = None

    async def start(self) -> None:
        deliver, config = self.deliver, None
        if self.after_seq:
            deliver, config = DeliverPolicy.BY_START_SEQUENCE, ConsumerConfig(opt_start_seq=self.after_seq + 1)
        self.until_seq = await last_sequence(self.js, self.stream, self.subject)
        if self.until_seq <= self.after_seq:
            self.caught_up.set()
        self.sub = await self.js.subscribe(
            self.subject,
            stream=self.stream,
            cb=self._on_msg,
            ordered_consumer=True,
            deliver_policy=deliver,
            config=config,
        )

    async def _on_msg(self, msg) -> None:
        try:
            self.apply(msg)
        except msgspec.DecodeError:
            log.warning("undecodable_event", subject=msg.subject)
        if msg.metadata.num_pending == 0 or msg.metadata.sequence.stream >= self.until_seq:
            self.caught_up.set()

    async def stop(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()
            self.sub = None


async def load_checkpoint(js: JetStreamContext, job: str, plan: str) -> tuple[schemas.ProgressCheckpoint | None, int]:
    """(the job's saved checkpoint if it is of `plan`, the stream sequence of the message holding
    any checkpoint, 0 when there is none)."""
    try:
        msg = await js.get_last_msg(topology.EVENTS_STREAM, topology.checkpoint_subject(job))
    except nats.js.errors.NotFoundError:
        return None, 0
    try:
        checkpoint = schemas.checkpoint_decoder.decode(msg.data)
    except msgspec.DecodeError:
        log.warning("undecodable_checkpoint", job=job)
        return None, msg.seq
    return (checkpoint if checkpoint.plan == plan else None), msg.seq


def _merged(mine: schemas.ProgressCheckpoint, theirs: schemas.ProgressCheckpoint | None) -> schemas.ProgressCheckpoint:
    """Per kind, the sums that reach further: both are sums over a prefix of the same stream."""
    if theirs is None:
        return mine
    written = mine if mine.written_seq >= theirs.written_seq else theirs
    uploaded = mine if mine.uploaded_seq >= theirs.uploaded_seq else theirs
    return msgspec.structs.replace(
        written,
        uploaded_seq=uploaded.uploaded_seq,
        tokens_uploaded=uploaded.tokens_uploaded,
        bytes_uploaded=uploaded.bytes_uploaded,
        file_redeliveries=uploaded.file_redeliveries,
        saved_at=time.time(),
    )


async def save_checkpoint(js: JetStreamContext, checkpoint: schemas.ProgressCheckpoint) -> None:
    """Save `checkpoint` unless a saved one already reaches as far. Concurrent savers (a monitor
    and `hsx status`) are serialized by the subject's last sequence; the loser merges and retries."""
    subject = topology.checkpoint_subject(checkpoint.job)
    for _ in range(5):
        theirs, last_seq = await load_checkpoint(js, checkpoint.job, checkpoint.plan)
        merged = _merged(checkpoint, theirs)
        if theirs is not None and (merged.written_seq, merged.uploaded_seq) == (
            theirs.written_seq,
            theirs.uploaded_seq,
        ):
            return
        headers = {
            **message_headers(checkpoint.job),
            **HEARTBEAT_ROLLUP,
            "Nats-Expected-Last-Subject-Sequence": str(last_seq),
        }
        try:
            await js.publish(subject, schemas.encode(merged), headers=headers)
            return
        except nats.js.errors.APIError as exc:
            if exc.err_code != topology.WRONG_LAST_SEQUENCE:
                raise
    log.warning("checkpoint_not_saved", job=checkpoint.job, reason="another reader kept saving first")


async def find_marker(js: JetStreamContext, subject: Callable[..., str], job: str, plan: str, name: int | str):
    """The marker of batch or sample `name` of `plan` (`subject`: topology.written_subject or
    uploaded_subject), planned or (outside the plan) set aside; None when there is none."""
    for planned in (True, False):
        try:
            return await js.get_last_msg(topology.EVENTS_STREAM, subject(job, plan or "none", name, planned=planned))
        except nats.js.errors.NotFoundError:
            pass
    return None


async def has_uploaded_marker(js: JetStreamContext, job: str, plan: str, index: int) -> bool:
    """Whether sample `index` has an `uploaded` marker of `plan`: whether it is in the
    destination, as the job's journal says."""
    return await find_marker(js, topology.uploaded_subject, job, plan, index) is not None


class ProgressTracker:
    """Follows a job: its sums from the checkpoint on, its dead letters, optionally its heartbeats;
    `refresh_counts` and `refresh_queues` read JetStream's counts and queue state."""

    def __init__(self, js: JetStreamContext, job: str, *, plan: str = "", heartbeats: bool = False) -> None:
        self.js = js
        self.job = job
        self.plan = plan
        self.fold = ProgressFold(job=job, plan=plan)
        self.queues = QueueState()
        self.counts = ProgressCounts()
        self.heartbeats = heartbeats
        self._sums: list[_Replay] = []
        self._others: list[_Replay] = []
        self._uploaded_known: set[int] = set()  # dead samples whose marker was found: it stays

    async def start(self) -> None:
        checkpoint, _ = await load_checkpoint(self.js, self.job, self.plan)
        if checkpoint is not None:
            self.fold = ProgressFold.from_checkpoint(checkpoint)
        events, plan = topology.EVENTS_STREAM, self.plan or "none"
        self._sums = [
            _Replay(
                self.js,
                events,
                topology.markers_all(self.job, "written", plan),
                self._apply_marker,
                DeliverPolicy.ALL,
                after_seq=self.fold.written_seq,
            ),
            _Replay(
                self.js,
                events,
                topology.markers_all(self.job, "uploaded", plan),
                self._apply_marker,
                DeliverPolicy.ALL,
                after_seq=self.fold.uploaded_seq,
            ),
        ]
        self._others = [
            _Replay(
                self.js,
                topology.DEAD_STREAM,
                topology.dead_subject_all(self.job),
                self._apply_whole(schemas.dead_decoder),
                DeliverPolicy.ALL,
            )
        ]
        if self.heartbeats:
            self._others.append(
                _Replay(
                    self.js,
                    events,
                    topology.heartbeats_subject_all(self.job),
                    self._apply_whole(schemas.event_decoder),
                    DeliverPolicy.LAST_PER_SUBJECT,
                )
            )
        # Dead letters and heartbeats first: once the sums' replays run, their markers (a whole
        # job's, on a first reading) would queue ahead of them on the connection.
        for replay in self._others:
            await replay.start()
        try:
            await self._all_caught_up_within(self._others, _OTHERS_FIRST_S)
        except TimeoutError:
            pass  # `wait_caught_up` reports it; the sums need not wait any longer
        for replay in self._sums:
            await replay.start()

    def _apply_marker(self, msg) -> None:
        # hsx.events.<job>.<kind>.<plan>.<batch or sample>, or ...<plan>.extra.<batch or sample>
        planned = msg.subject.split(".")[5] != topology.EXTRA
        self.fold.apply_marker(
            schemas.event_decoder.decode(msg.data), seq=msg.metadata.sequence.stream, planned=planned
        )

    def _apply_whole(self, decoder):
        return lambda msg: self.fold.apply(decoder.decode(msg.data))

    @property
    def sums_caught_up(self) -> bool:
        return all(replay.caught_up.is_set() for replay in self._sums)

    async def wait_caught_up(self, timeout: float | None = 120.0, *, sums: bool = True) -> None:
        """Until the replays have read what was there when they started (the sums too, unless not
        `sums`): asyncio.TimeoutError after `timeout`."""
        await asyncio.wait_for(self._all_caught_up(self._others + (self._sums if sums else [])), timeout)

    async def _all_caught_up_within(self, replays: list[_Replay], timeout: float) -> None:
        await asyncio.wait_for(self._all_caught_up(replays), timeout)

    @staticmethod
    async def _all_caught_up(replays: list[_Replay]) -> None:
        # One after the other, not gather(): a gather cancelled by the timeout leaves a future whose
        # CancelledError asyncio then logs as "never retrieved".
        for replay in replays:
            await replay.caught_up.wait()

    async def wait_sums_current(self, *, timeout: float) -> bool:
        """Until the sums hold every marker stored so far (False if that takes over `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            newest = await asyncio.gather(
                *(
                    last_sequence(
                        self.js, topology.EVENTS_STREAM, topology.markers_all(self.job, kind, self.plan or "none")
                    )
                    for kind in ("written", "uploaded")
                )
            )
            if newest[0] <= self.fold.written_seq and newest[1] <= self.fold.uploaded_seq:
                return True
            if time.monotonic() > deadline:
                log.warning(
                    "sums_behind",
                    written_seq=self.fold.written_seq,
                    uploaded_seq=self.fold.uploaded_seq,
                    newest=newest,
                    waited_s=timeout,
                )
                return False
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        for replay in self._others + self._sums:
            await replay.stop()

    async def save_checkpoint(self) -> None:
        if self.fold.written_seq or self.fold.uploaded_seq:
            await save_checkpoint(self.js, self.fold.checkpoint())

    async def refresh_counts(self) -> ProgressCounts:
        counts = await read_counts(self.js, self.job, self.plan or "none")
        dead = sorted(self.fold.dead_samples - self._uploaded_known)
        unfinished: set[int] = set()
        for start in range(0, len(dead), _LOOKUPS_IN_FLIGHT):
            chunk = dead[start : start + _LOOKUPS_IN_FLIGHT]
            found = await asyncio.gather(*(self._has_uploaded_marker(i) for i in chunk))
            for index, has in zip(chunk, found):
                (self._uploaded_known.add if has else unfinished.add)(index)
        self.counts = replace(counts, dead_unfinished=frozenset(unfinished))
        return self.counts

    async def _has_uploaded_marker(self, index: int) -> bool:
        return await has_uploaded_marker(self.js, self.job, self.plan, index)

    async def refresh_queues(self) -> QueueState:
        job = self.job

        async def count(stream: str, subject: str) -> int:
            # Stream info, not `count_stored`: a work-queue stream refuses a second consumer whose
            # filter overlaps its durable's. These filters match a few subjects each. Unlike
            # hsx.wire.jobs.count_messages, a missing stream is an error here, not 0 queued.
            info = await self.js.stream_info(stream, subjects_filter=subject)
            return sum((info.state.subjects or {}).values())

        async def redelivered(stream: str, durable: str) -> int:
            try:
                return (await self.js.consumer_info(stream, durable)).num_redelivered or 0
            except nats.js.errors.NotFoundError:
                return 0

        # One upload durable per node, each filtered to hsx.files.<job>.<node>.
        file_redeliveries = sum(
            info.num_redelivered or 0
            for info in await self.js.consumers_info(topology.FILES_STREAM)
            if (info.config.filter_subject or "").split(".")[2:3] == [job]
        )
        self.queues = QueueState(
            batches_queued=await count(topology.BATCHES_STREAM, topology.batch_subject(job)),
            files_queued=await count(topology.FILES_STREAM, topology.files_subject_all(job)),
            dead_letters=await count(topology.DEAD_STREAM, topology.dead_subject_all(job)),
            batch_redeliveries=await redelivered(topology.BATCHES_STREAM, topology.gpu_durable(job)),
            file_redeliveries=file_redeliveries,
        )
        return self.queues


class DestinationRefusal(msgspec.Struct, frozen=True, kw_only=True):
    """A live uploader's word that the destination refuses its writes."""

    uploader: str
    node: str
    reason: str | None


class StatusView(msgspec.Struct, frozen=True, kw_only=True):
    """One reading of a job: what `hsx status --json` prints (docs/OPERATIONS.md, "hsx status"),
    field for field, and what the monitor reports from."""

    job: str
    exists: bool
    total_samples: int
    total_tokens: int
    # --on-long: rows truncated to --max-seq-len or skipped; listed in the job's input report.
    samples_truncated: int
    samples_skipped: int
    input_report: str | None
    samples_written: int
    samples_uploaded: int
    tokens_written: int
    tokens_uploaded: int
    bytes_written: int
    bytes_uploaded: int
    # The sums above (samples_written, tokens_*, bytes_*, redeliveries after the fact) cover every
    # marker when true; false: the reading stopped at its budget, and they are short.
    sums_complete: bool
    # Set aside, not counted: `uploaded` markers of sample indices outside range(total_samples),
    # and markers of another plan under this job name.
    samples_outside_plan: int
    events_other_plan: int
    batches_total: int
    batches_done: int
    batches_queued: int
    files_waiting_upload: int
    dead_letters: int
    dead_samples: list[int]
    samples_requeued: int
    # Written after a redelivery (from the markers) + redelivered and not acked yet (from JetStream).
    batch_redeliveries: int
    file_redeliveries: int
    dest: str | None
    done: bool
    failed: bool
    failure_reason: str | None  # one line; None unless failed
    destination_error: str | None
    destination_refusals: list[DestinationRefusal]  # of live uploaders refused, newest first
    as_of: float


def destination_refusals(
    heartbeats: dict[str, schemas.Heartbeat], *, now: float, live_s: float
) -> list[DestinationRefusal]:
    """Uploaders that say, in a heartbeat younger than `live_s`, that the destination refuses
    their writes; newest first. Told by live heartbeats, so a refusal ends with the uploader that
    saw it: a stopped or killed one leaves no stale failure behind for the next run."""
    refused = sorted(
        (
            beat
            for beat in heartbeats.values()
            if beat.service == "uploader" and beat.state == "refused" and now - beat.sent_at <= live_s
        ),
        key=lambda beat: beat.sent_at,
        reverse=True,
    )
    return [DestinationRefusal(uploader=beat.instance, node=beat.node, reason=beat.detail) for beat in refused]


def status_view(
    spec: schemas.JobSpec | None,
    fold: ProgressFold,
    queues: QueueState,
    counts: ProgressCounts,
    *,
    job: str,
    now: float | None = None,
    live_s: float = 30.0,
    sums_complete: bool = True,
) -> StatusView:
    """The reading of the job from what was counted and folded. Heartbeats older than `live_s` at `now` (default: the time now) are not taken as the word of a
    live worker. `sums_complete`: the fold has read every marker there was when it started."""
    total = spec.total_samples if spec else 0
    uploaded = counts.samples_uploaded
    # Done: every planned sample of this plan has its `uploaded` marker, and nothing is left in
    # flight (a batch redelivered after a crash may still be queued although its samples were
    # already uploaded).
    drained = queues.batches_queued == 0 and queues.files_queued == 0
    done = spec is not None and spec.published and uploaded == total and drained
    dead_samples = set(counts.dead_unfinished)
    # Nothing is queued anywhere and every missing sample is dead: the job cannot finish by itself.
    failed = (
        spec is not None
        and spec.published
        and not done
        and drained
        and 0 < total - uploaded == sum(1 for i in dead_samples if 0 <= i < total)
    )
    failure_reason = (
        f"{len(dead_samples)} samples dead-lettered and nothing else left to run (hsx dead list --job {job})"
        if failed
        else None
    )
    # A refusing destination (a missing bucket, bad credentials, a denied permission) is a failure
    # for as long as it lasts: nothing is uploaded until someone fixes it, then it clears by itself.
    refusals = (
        [] if done else destination_refusals(fold.heartbeats, now=time.time() if now is None else now, live_s=live_s)
    )
    if refusals:
        failed = True
        failure_reason = f"the destination refuses uploads: {refusals[0].reason}"
    return StatusView(
        job=job,
        exists=spec is not None,
        total_samples=total,
        total_tokens=spec.total_tokens if spec else 0,
        samples_truncated=spec.samples_truncated if spec else 0,
        samples_skipped=spec.samples_skipped if spec else 0,
        input_report=f"{topology.DATASETS_BUCKET}/{spec.report_object}" if spec and spec.report_object else None,
        samples_written=fold.samples_written,
        samples_uploaded=uploaded,
        tokens_written=fold.tokens_written,
        tokens_uploaded=fold.tokens_uploaded,
        bytes_written=fold.bytes_written,
        bytes_uploaded=fold.bytes_uploaded,
        sums_complete=sums_complete,
        samples_outside_plan=counts.samples_outside_plan,
        events_other_plan=counts.events_other_plan,
        batches_total=spec.total_batches if spec else 0,
        batches_done=counts.batches_done,
        batches_queued=queues.batches_queued,
        files_waiting_upload=queues.files_queued,
        dead_letters=queues.dead_letters,
        dead_samples=sorted(dead_samples),
        samples_requeued=counts.samples_requeued,
        batch_redeliveries=fold.batch_redeliveries + queues.batch_redeliveries,
        file_redeliveries=fold.file_redeliveries + queues.file_redeliveries,
        dest=spec.dest if spec else None,
        done=done,
        failed=failed,
        failure_reason=failure_reason,
        destination_error=refusals[0].reason if refusals else None,
        destination_refusals=refusals,
        as_of=time.time(),
    )
