"""Following a job's progress (`ProgressTracker`): its sums replayed into a `ProgressFold` from the
last checkpoint on, its dead letters and heartbeats replayed whole, and JetStream's counts and
queue state read on demand. Sums that did not catch up within a budget are reported as such
(`sums_complete`), never as the whole. Nothing here infers progress from processes.
"""

import asyncio
import time
from dataclasses import replace

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from hsx.logs import get_logger
from hsx.wire import schemas, topology
from hsx.wire.counts import ProgressCounts, QueueState, has_uploaded_marker, last_sequence, read_counts
from hsx.wire.events import heard_heartbeat, read_marker
from hsx.wire.fold import ProgressFold, load_checkpoint, save_checkpoint

log = get_logger("hsx.progress")

# How long a tracker's start waits for the dead letters and heartbeats before the sums' replays.
_OTHERS_FIRST_S = 10.0
# Dead samples whose `uploaded` marker is looked up at once (`ProgressTracker.refresh_counts`).
_LOOKUPS_IN_FLIGHT = 64


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


async def _stream_exists(js: JetStreamContext, stream: str) -> bool:
    try:
        await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        return False
    return True


# How long a reading waits for the sums to fold the markers stored before it began: they arrive
# in well under a second on a live monitor; a monitor further behind keeps its older time.
READING_WAIT_S = 1.0


class ProgressTracker:
    """Follows a job: its sums from the checkpoint on, its dead letters, optionally its heartbeats;
    `refresh_counts` and `refresh_queues` read JetStream's counts and queue state."""

    def __init__(
        self, js: JetStreamContext, job: str, *, plan: str = "", heartbeats: bool = False, sums: bool = True
    ) -> None:
        self.js = js
        self.job = job
        self.plan = plan
        self.fold = ProgressFold(job=job, plan=plan)
        self.queues = QueueState()
        self.counts = ProgressCounts()
        # The moment (time.time()) before which the newest complete reading holds every marker
        # (`refresh`); None before the first.
        self.as_of: float | None = None
        self.heartbeats = heartbeats
        # Without `sums` only the dead letters (and heartbeats) are replayed: enough for whether
        # a job is over, which the counts and queues say, without replaying every marker.
        self.sums = sums
        self._sums: list[_Replay] = []
        self._others: list[_Replay] = []
        self._uploaded_known: set[int] = set()  # dead samples whose marker was found: it stays

    async def start(self) -> None:
        if self.sums:  # without them the checkpoint is of no use: not read
            checkpoint, _ = await load_checkpoint(self.js, self.job, self.plan)
            if checkpoint is not None:
                self.fold = ProgressFold.from_checkpoint(checkpoint)
        events, plan = topology.EVENTS_STREAM, self.plan or "none"
        replayed = (("written", self.fold.written_seq), ("uploaded", self.fold.uploaded_seq)) if self.sums else ()
        self._sums = [
            _Replay(
                self.js,
                events,
                topology.markers_all(self.job, kind, plan),
                self._apply_marker,
                DeliverPolicy.ALL,
                after_seq=after_seq,
            )
            for kind, after_seq in replayed
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
                    topology.STATE_STREAM,
                    topology.heartbeats_subject_all(self.job),
                    self._apply_heartbeat,
                    DeliverPolicy.LAST_PER_SUBJECT,
                )
            )
        # Dead letters and heartbeats first: once the sums' replays run, their markers (a whole
        # job's, on a first reading) would queue ahead of them on the connection.
        for replay in list(self._others):
            try:
                await self._start(replay)
            except nats.js.errors.NotFoundError:
                if replay.stream != topology.STATE_STREAM:
                    raise
                # Streams of an older hsx, which had no HSX_STATE (the lookup said so,
                # `stream_missing`): no heartbeat is stored until a producer of this version adds it.
                self._others.remove(replay)
        try:
            await self._all_caught_up_within(self._others, _OTHERS_FIRST_S)
        except TimeoutError:
            pass  # `wait_caught_up` reports it; the sums need not wait any longer
        for replay in self._sums:
            await self._start(replay)

    @staticmethod
    async def _start(replay: _Replay) -> None:
        """A replay's consumer made while a cluster elects a leader waits for it (a monitor started
        then died with a timeout's traceback). A start that timed out subscribed nothing here
        (nats-py makes the consumer first), and each try makes its consumer anew."""
        await topology.while_unavailable(replay.start, what=f"a reading of {replay.subject}")

    def _apply_marker(self, msg) -> None:
        # hsx.events.<job>.<kind>.<plan>.<batch or sample>, or ...<plan>.extra.<batch or sample>
        planned = msg.subject.split(".")[5] != topology.EXTRA
        event = read_marker(msg.data, subject=msg.subject, job=self.job)
        if event is None:
            log.warning("marker_refused", subject=msg.subject, reason="not what its subject names")
            return
        self.fold.apply_marker(event, seq=msg.metadata.sequence.stream, planned=planned)

    def _apply_heartbeat(self, msg) -> None:
        beat = heard_heartbeat(
            msg.data, subject=msg.subject, stored_at=msg.metadata.timestamp.timestamp(), job=self.job
        )
        if beat is not None:
            self.fold.apply(beat)

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

    async def refresh(self, *, wait_s: float) -> float | None:
        """The queues and counts read again, and the sums given up to `wait_s` to hold every marker
        stored before the call; returns `as_of`: that moment once they do (a reading stamped later
        than what it holds would put `hsx status` ahead of it), the last complete reading's when
        the sums are further behind."""
        moment = time.time()
        newest = await self._newest_markers()
        await self.refresh_queues()
        await self.refresh_counts()
        deadline = time.monotonic() + wait_s
        while not self._sums_hold(newest):
            if time.monotonic() > deadline:
                return self.as_of
            await asyncio.sleep(0.05)
        self.as_of = moment
        return moment

    def _sums_hold(self, newest: list[int]) -> bool:
        """Whether the sums have folded the `written` and `uploaded` markers up to `newest`."""
        return newest[0] <= self.fold.written_seq and newest[1] <= self.fold.uploaded_seq

    async def _newest_markers(self) -> list[int]:
        """The stream sequences of the newest `written` and `uploaded` markers stored now."""
        return await asyncio.gather(
            *(
                last_sequence(
                    self.js, topology.EVENTS_STREAM, topology.markers_all(self.job, kind, self.plan or "none")
                )
                for kind in ("written", "uploaded")
            )
        )

    async def wait_sums_current(self, *, timeout: float) -> bool:
        """Until the sums hold every marker stored so far (False if that takes over `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            newest = await self._newest_markers()
            if self._sums_hold(newest):
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
        if not (self.fold.written_seq or self.fold.uploaded_seq):
            return
        try:
            await save_checkpoint(self.js, self.fold.checkpoint())
        except nats.js.errors.NoStreamResponseError:
            if await _stream_exists(self.js, topology.STATE_STREAM):
                raise
            # Streams of an older hsx, without HSX_STATE (the lookup said so, `stream_missing`):
            # nothing is saved, and the next reader folds from the markers, as this one did.

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

        async def delivered(stream: str, durable: str) -> tuple[int, int]:
            """(deliveries beyond the first, messages delivered and not yet acked)."""
            try:
                info = await self.js.consumer_info(stream, durable)
            except nats.js.errors.NotFoundError:
                return 0, 0
            return info.num_redelivered or 0, info.num_ack_pending or 0

        # One upload durable per node, each filtered to hsx.files.<job>.<node>.
        uploads = [
            info
            for info in await self.js.consumers_info(topology.FILES_STREAM)
            if (info.config.filter_subject or "").split(".")[2:3] == [job]
        ]
        file_redeliveries = sum(info.num_redelivered or 0 for info in uploads)
        batch_redeliveries, batches_in_hand = await delivered(topology.BATCHES_STREAM, topology.gpu_durable(job))
        self.queues = QueueState(
            batches_queued=await count(topology.BATCHES_STREAM, topology.batch_subject(job)),
            files_queued=await count(topology.FILES_STREAM, topology.files_subject_all(job)),
            dead_letters=await count(topology.DEAD_STREAM, topology.dead_subject_all(job)),
            batch_redeliveries=batch_redeliveries,
            file_redeliveries=file_redeliveries,
            files_in_hand=sum(info.num_ack_pending or 0 for info in uploads),
            batches_in_hand=batches_in_hand,
        )
        return self.queues
