"""Following a job's samples as they land in its destination, for a trainer (`LandingFeed`, read
by hsx/storage/reader.py's `JobStream`): each planned sample's `uploaded` marker, in the order
the events stream holds them, then the end of the job's first epoch (`EpochEnd`).

The markers are pulled from the stream's first message by an ephemeral consumer of the feed's
own (`_MarkerReader`): nothing acked, no durable left behind, so any number of trainers follow a
job without touching its queues or each other. Each marker is stored once (topology.ONCE_HEADERS), so the order is the
same on every reading: a rank, or a trainer restarted on another machine, sees the samples in the
same order, which is what lets it skip what it already took without reading a file.

The epoch ends when the job is over as `hsx monitor --until-done` reads it (hsx/wire/worker.py
`JobVerdict`): done, every planned sample landed; or failed, its missing samples named. Its end
is the stream sequence of the last marker there was then (`EpochEnd.end_seq`), agreed among the
stream's ranks (hsx/wire/epochend.py), so every rank, and a replay, stops where the first reading
stopped, even when a retried sample lands later.

The NATS client runs on its own thread with its own event loop; the trainer's thread takes from
a bounded queue, and markers are pulled only while it has room: a slow trainer leaves them on the
server, not in memory. (A push consumer would not do: nats-py answers JetStream's flow control as
messages arrive, not as they are handled, so a stalled trainer let it buffer some 770 MB of a
914k-sample job and then drop markers unnoticed; docs/bench-results/2026-12-03-jobstream.md, "At 914k samples".)
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, Header, StatusCode

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.logs import get_logger
from hsx.wire import denials, schemas, topology
from hsx.wire.epochend import EpochEnd, EpochEndAgreement, LandedAt
from hsx.wire.events import read_marker
from hsx.wire.jobs import read_job_spec, wait_for_job
from hsx.wire.natsconn import NatsSettings, close_connection, connect, redact_url
from hsx.wire.statusview import StatusView
from hsx.wire.worker import JobVerdict, JobWatch

log = get_logger("hsx.stream")

# How often the feed reads whether the job is over (and still the job it follows).
CHECK_S = 2.0
# Markers handed over but not yet taken by the trainer: a bound on memory, not on speed. They go
# over in lists of up to _CHUNK (one queue operation per burst, not per marker).
QUEUE_MARKERS = 65536
_CHUNK = 1024
# How long one fetch waits for markers that have not landed yet.
FETCH_WAIT_S = 1.0
# An idle trainer's consumer is removed by the server after this; the reader makes a new one
# from where it stood when it fetches again.
INACTIVE_S = 60.0


@dataclass(frozen=True, slots=True)
class Landed:
    """A sample stored in the destination, as its marker says: its index in the job, its token
    count, and what the sample is (hsx/storage/sampledigest.py; "" when the marker does not say)."""

    index: int
    tokens: int
    sample_digest: str = ""


@dataclass(frozen=True)
class _Failed:
    error: BaseException


_CLOSED = object()


class LandingFeed:
    """The landed samples of `job`, then its `EpochEnd`; iterate it on the trainer's thread.

    `plan` and `created_at`: the job a saved state was of (its plan, and when it was produced);
    then the job must exist and be that one (one-line HsxError otherwise), where without them the
    feed waits for the producer to record the job. A job deleted and produced again with the same
    plan is another: its markers land anew, in another order.
    `end`: the epoch's end when already known (a replay): the feed stops there and does not
    ask whether the job is over. `spec` is the job's spec once read."""

    def __init__(
        self,
        settings: NatsSettings,
        job: str,
        *,
        name: str,
        plan: str | None = None,
        created_at: float | None = None,
        end: EpochEnd | None = None,
        check_s: float = CHECK_S,
        queue_markers: int = QUEUE_MARKERS,
    ) -> None:
        self.settings, self.job, self.name, self.plan, self.end = settings, job, name, plan, end
        self.created_at = created_at
        self.check_s = check_s
        self.spec: JobSpec | None = None
        self.spec_ready = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_markers // _CHUNK))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._closed = threading.Event()
        self._markers: _MarkerReader | None = None
        self._thread = threading.Thread(target=self._run, name=f"hsx-stream-{name}", daemon=True)

    def start(self) -> LandingFeed:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop following (the trainer left the epoch early, or it ended)."""
        self._closed.set()
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None:
            try:
                loop.call_soon_threadsafe(stopping.set)
            except RuntimeError:  # the loop already ended
                pass
        self._thread.join(timeout=30)

    @property
    def fetched(self) -> int:
        """Markers fetched from the server so far (at most a queue and a fetch ahead of the trainer)."""
        return 0 if self._markers is None else self._markers.fetched

    def wait_for_spec(self) -> JobSpec:
        """The job's spec, once the feed has read it (it waits for the producer to record it)."""
        while not self.spec_ready.wait(timeout=0.5):
            if not self._thread.is_alive():
                next(iter(self), None)  # raises the thread's error
                raise HsxError(f"job {self.job}: the stream stopped before the job's spec was read")
        assert self.spec is not None
        return self.spec

    def __iter__(self) -> Iterator[Landed | EpochEnd]:
        while True:
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    return
                continue
            if item is _CLOSED:
                return
            if isinstance(item, _Failed):
                raise item.error
            if isinstance(item, list):
                yield from item
                continue
            yield item
            if isinstance(item, EpochEnd):
                return

    # The feed's own thread.

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # handed to the trainer's thread, which raises it
            self._put_blocking(_Failed(exc))
        else:
            self._put_blocking(_CLOSED)

    def _put_blocking(self, item: object) -> None:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    async def _put(self, item: object) -> None:
        while True:
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                if self._stopping is not None and self._stopping.is_set():
                    return
                await asyncio.sleep(0.01)

    async def _main(self) -> None:
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        if self._closed.is_set():
            return
        started = time.monotonic()
        nc = await connect(self.settings, name=f"hsx-stream-{self.name}")
        try:
            await self._follow(nc.jetstream())
        except Exception:
            # A request this user may not make times out: the refusal is the trainer's error.
            denials.raise_if_denied(started, what=f"stream {self.name} of job {self.job}")
            raise
        finally:
            await close_connection(nc)

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)
        except TimeoutError:
            pass

    async def _follow(self, js) -> None:
        kv = await topology.wait_for_jobs_bucket(js, self.job, self._stopping, poll_s=self.check_s)
        if kv is None:
            return
        if self.plan is not None:
            spec = await read_job_spec(kv, self.job)
            if spec is None:
                raise HsxError(
                    f"job {self.job} is not in KV bucket {topology.JOBS_BUCKET} at "
                    f"{redact_url(self.settings.url)}: it was deleted since this stream's state was saved "
                    f"(plan {self.plan})"
                )
        else:
            # It says every 30 s that it waits, with the jobs there are: a mistyped name shows.
            spec = await wait_for_job(kv, self.job, self._stopping)
            if spec is None:
                return
        if self.plan is not None and (spec.plan_tag, spec.created_at) != (self.plan, self.created_at):
            now = f"plan {spec.plan_tag}" if spec.plan_tag != self.plan else "the same plan, produced anew"
            raise HsxError(
                f"job {self.job} is now {now}, and this stream's state is of plan {self.plan}: the job was "
                "deleted and produced again since the state was saved; start the stream without the old state"
            )
        self.spec = spec
        self.spec_ready.set()
        subject = topology.marker_filter(self.job, "uploaded", spec.plan_tag or "none")
        watch = JobWatch(kv, spec, asyncio.Event())
        verdict = JobVerdict(js, watch) if self.end is None else None
        agreement = None if self.end is not None else EpochEndAgreement(js, spec, stream=self.name, markers=subject)
        markers = self._markers = _MarkerReader(
            js, subject, name=self.name, job=self.job, landed=None if agreement is None else agreement.landed
        )
        end = self.end
        try:
            checked = 0.0
            while not self._stopping.is_set():
                if time.monotonic() - checked >= self.check_s:
                    checked = time.monotonic()
                    await self._still_the_job(watch)
                    if end is None:
                        end = await self._agreed_end(js, verdict, agreement, markers.delivered)
                if end is not None and markers.delivered >= end.end_seq:
                    await self._put(end)
                    return
                up_to = end.end_seq if end is not None else agreement.holding_at()
                if up_to is not None and markers.delivered >= up_to:
                    # At a record's end: nothing past it is read until the record is judged.
                    await self._sleep(max(0.0, self.check_s - (time.monotonic() - checked)))
                    continue
                if self._queue.full():  # the trainer has not taken what it has: nothing is fetched
                    await self._sleep(0.05)
                    continue
                landed = await markers.next_chunk(up_to=up_to)
                if landed:
                    await self._put(landed)
        finally:
            await markers.close()
            if verdict is not None:
                await verdict.stop()

    async def _still_the_job(self, watch: JobWatch) -> None:
        """HsxError if the job was deleted, or deleted and produced again, while the feed follows
        it (its markers are purged with it: a replay would wait for them forever)."""
        lost = await watch.check()
        if lost:
            raise HsxError(f"stream {self.name}: {lost.removesuffix('; stopped')}")

    async def _agreed_end(
        self, js, verdict: JobVerdict, agreement: EpochEndAgreement, delivered: int
    ) -> EpochEnd | None:
        """The epoch's end every rank of the stream takes (hsx/wire/epochend.py): the first valid
        record on its subject, once this rank finds the job over; None until then. A rank that
        finds the job over and no record left to judge records its own reading, then reads again:
        the first valid record wins, whoever wrote it."""
        view = await self._over(verdict)
        if view is not None:
            agreement.over = True
        started = time.monotonic()
        try:
            await agreement.read_records()
            end = agreement.settle(delivered)
            if end is None and view is not None and await agreement.record(view, delivered):
                await agreement.read_records()
                end = agreement.settle(delivered)
        except HsxError:
            raise
        except Exception as exc:  # NATS reconnecting: read again at the next check
            # A record this user may not publish (another stream's trainer user) times out.
            denials.raise_if_denied(started, what=f"stream {self.name}: recording its epoch's end")
            log.warning("epoch_end_unavailable", job=self.job, error=str(exc) or type(exc).__name__)
            return None
        return end

    async def _over(self, verdict: JobVerdict) -> StatusView | None:
        """The job's reading once it is over; None while it runs."""
        started = time.monotonic()
        try:
            return await verdict.read()
        except Exception as exc:  # NATS reconnecting: read again at the next check
            denials.raise_if_denied(started, what=f"stream {self.name}: whether job {self.job} is over")
            log.warning("job_state_unavailable", job=self.job, error=str(exc) or type(exc).__name__)
            return None


def read_job_spec_waiting(settings: NatsSettings, job: str, *, name: str, poll_s: float = CHECK_S) -> JobSpec:
    """The job's spec, once the producer has recorded it (waiting for it as the feed does)."""

    async def read() -> JobSpec:
        nc = await connect(settings, name=f"hsx-stream-{name}")
        try:
            never = asyncio.Event()
            kv = await topology.wait_for_jobs_bucket(nc.jetstream(), job, never, poll_s=poll_s)
            spec = await wait_for_job(kv, job, never)
            assert spec is not None  # only a set stop event ends the wait without one
            return spec
        finally:
            await close_connection(nc)

    return asyncio.run(read())


class _MarkerReader:
    """The markers of `subject` in stream order, pulled `_CHUNK` at a time only when asked for
    (so nothing is buffered that the trainer has no room for), from an ephemeral consumer that
    acks nothing. The pull requests are made here, not with nats-py's `fetch`, whose wait per
    message (a timer each) read a third as fast. A consumer the server lost (a restart, or removed
    after `INACTIVE_S` unused), a request nothing answered or a gap in the consumer's delivery
    count is replaced by a new consumer starting after the last marker handed over: none is
    skipped and none handed over twice."""

    def __init__(self, js, subject: str, *, name: str, job: str, landed: LandedAt | None = None) -> None:
        self.js, self.nc, self.subject, self.name, self.job = js, js._nc, subject, name, job
        self.landed = landed  # where each sample's marker was read, for the epoch's end (epochend.py)
        self.delivered = 0  # the stream sequence of the last marker handed over
        self.fetched = 0  # markers received, in all
        self._consumer: str | None = None
        self._sub = None
        self._consumer_seq = 0
        self._received: list = []
        self._asked = 0
        self._answered = asyncio.Event()
        self._status: str | None = None

    async def _start(self) -> None:
        name = self.nc._nuid.next().decode()
        config = ConsumerConfig(
            name=name,
            description=f"hsx stream {self.name}: reads the markers, acks nothing",
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.delivered + 1,
            ack_policy=AckPolicy.NONE,
            filter_subject=self.subject,
            inactive_threshold=INACTIVE_S,
            mem_storage=True,
            num_replicas=1,
        )
        await self.js.add_consumer(topology.EVENTS_STREAM, config=config)
        self._consumer, self._consumer_seq = name, 0
        self._sub = await self.nc.subscribe(self.nc.new_inbox(), cb=self._on_msg)

    async def _on_msg(self, msg) -> None:
        status = msg.headers.get(Header.STATUS) if msg.headers else None
        if status is None:
            self._received.append(msg)
            if len(self._received) >= self._asked:
                self._answered.set()
        elif status != StatusCode.CONTROL_MESSAGE:  # no more for now (404, 408), or an error
            self._status = status
            self._answered.set()

    async def next_chunk(self, *, up_to: int | None) -> list[Landed]:
        """The next markers (at most `_CHUNK`; none if none landed within FETCH_WAIT_S), and none
        past stream sequence `up_to`."""
        self._received, self._asked, self._status = [], _CHUNK, None
        self._answered.clear()
        asked = time.monotonic()
        try:
            if self._consumer is None:
                await self._start()
            request = {"batch": _CHUNK, "expires": int(FETCH_WAIT_S * 1e9)}
            await self.nc.publish(
                f"$JS.API.CONSUMER.MSG.NEXT.{topology.EVENTS_STREAM}.{self._consumer}",
                json.dumps(request).encode(),
                reply=self._sub.subject,
            )
            # Answered by the server within its expiry, unless the consumer or connection is gone.
            await asyncio.wait_for(self._answered.wait(), FETCH_WAIT_S + 1.0)
        except Exception as exc:  # no answer, the consumer or the connection gone: a new one
            denials.raise_if_denied(asked, what=f"stream {self.name}: reading the markers of {self.subject}")
            log.warning("stream_markers_retry", error=str(exc) or type(exc).__name__, after_seq=self.delivered)
            await self._drop()
            await asyncio.sleep(0.5)
        if self._status not in (None, StatusCode.NO_MESSAGES, StatusCode.REQUEST_TIMEOUT):
            log.warning("stream_markers_retry", status=self._status, after_seq=self.delivered)
            await self._drop()
        msgs, self._received = self._received, []
        self.fetched += len(msgs)
        landed: list[Landed] = []
        for msg in msgs:
            meta = msg.metadata
            if meta.sequence.consumer != self._consumer_seq + 1 or meta.sequence.stream <= self.delivered:
                # A delivery lost on the way: start again after the last marker handed over.
                log.warning("stream_markers_gap", after_seq=self.delivered, consumer_seq=meta.sequence.consumer)
                await self._drop()
                break
            if up_to is not None and meta.sequence.stream > up_to:
                # Not handed over: read again after `up_to` if the reading goes on (a record
                # refused at its end), by a new consumer from the last marker handed over.
                await self._drop()
                break
            self._consumer_seq = meta.sequence.consumer
            event = read_marker(msg.data, subject=msg.subject, job=self.job)
            if event is None:
                log.warning("marker_refused", subject=msg.subject, reason="not what its subject names")
            if isinstance(event, schemas.FileUploaded):
                landed.append(Landed(index=event.sample_index, tokens=event.tokens, sample_digest=event.sample_digest))
                if self.landed is not None:
                    self.landed.mark(event.sample_index, meta.sequence.stream)
            self.delivered = meta.sequence.stream
        return landed

    async def _drop(self) -> None:
        consumer, sub = self._consumer, self._sub
        self._consumer = self._sub = None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        if consumer is not None:
            try:
                await self.js.delete_consumer(topology.EVENTS_STREAM, consumer)
            except Exception:  # gone already, or NATS away: the server removes it once inactive
                pass

    async def close(self) -> None:
        await self._drop()
