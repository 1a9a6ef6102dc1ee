"""Publishing progress events, heartbeats and dead letters.

Progress events (`written`, `uploaded`) are published through JetStream and awaited: `hsx status`
is computed from them. Heartbeats are fire-and-forget (losing one is harmless), on HSX_STATE,
which keeps each worker's last one. Dead letters keep the original payload and the error, and
leave the work queue only after they are stored.
"""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from hsx.logs import get_logger
from hsx.wire import deadletter, schemas, topology
from hsx.wire.deadletter import build_letters
from hsx.wire.headers import message_headers
from hsx.wire.natsconn import through_outage

log = get_logger("hsx.events")


class EventPublisher:
    def __init__(self, nc: NATS, js: JetStreamContext, job: str) -> None:
        self.nc = nc
        self.js = js
        self.job = job

    async def emit(self, event: schemas.Event, *, batch_id: str = "", subject: str = "") -> None:
        """Publish a progress event (on `hsx.events.<job>.<kind>` unless `subject` is given);
        `batch_id` names its batch in the headers when the event itself carries none (an `uploaded`
        event knows its sample, not the batch that wrote it)."""
        subject = subject or topology.event_subject(self.job, schemas.EVENT_KINDS[type(event)])
        headers = message_headers(
            self.job,
            batch=batch_id or getattr(event, "batch_id", ""),
            sample=getattr(event, "sample_index", None),
        )
        await self.js.publish(subject, schemas.encode(event), headers=headers)

    async def mark(
        self, event: schemas.BatchWritten | schemas.FileUploaded, *, subject: str, batch_id: str = ""
    ) -> bool:
        """Publish a progress marker (topology.written_subject / uploaded_subject) unless its
        subject already holds one; True if this call stored it. A repeat (a redelivered batch, a
        re-upload, a retry after a lost ack) is refused by the server and changes nothing."""
        headers = {
            **message_headers(
                self.job, batch=batch_id or getattr(event, "batch_id", ""), sample=getattr(event, "sample_index", None)
            ),
            **topology.ONCE_HEADERS,
        }
        try:
            await self.js.publish(subject, schemas.encode(event), headers=headers)
        except nats.js.errors.APIError as exc:
            if exc.err_code != topology.WRONG_LAST_SEQUENCE:
                raise
            return False
        return True

    async def heartbeat(
        self,
        *,
        service: str,
        instance: str,
        node: str,
        state: str,
        detail: str = "",
        last_batch: str = "",
        spool_files: int = -1,
        spool_bytes: int = -1,
        spool_measured_at: float = 0.0,
        stalled_s: float = 0.0,
        spool: str = "",
        kernels: schemas.Kernels | None = None,
        load: schemas.WorkerLoad | None = None,
    ) -> None:
        beat = schemas.Heartbeat(
            job=self.job,
            service=service,
            instance=instance,
            node=node,
            state=state,
            detail=detail,
            last_batch=last_batch,
            spool_files=spool_files,
            spool_bytes=spool_bytes,
            spool_measured_at=spool_measured_at,
            sent_at=time.time(),
            stalled_s=stalled_s,
            spool=spool,
            kernels=kernels,
            load=load,
        )
        if self.nc.is_connected:
            # HSX_STATE keeps only this instance's last beat (a long job sends millions); the
            # monitor reads only the last one anyway.
            await self.nc.publish(
                topology.heartbeat_subject(self.job, service, instance),
                schemas.encode(beat),
                headers=message_headers(self.job),
            )

    async def store_dead_letter(
        self,
        *,
        what: str,
        error: str,
        subject: str,
        payload: bytes,
        deliveries: int,
        batch_id: str = "",
        sample_indices: list[int] | None = None,
        source_seq: int = 0,
        part: str = "",
    ) -> None:
        """Store a payload that cannot be processed, with its error, in HSX_DEAD (as one letter, or
        several when one would not fit: hsx/wire/deadletter.py). Waits out a NATS outage: a letter that
        is not stored must not let its message leave the work queue."""
        letters = build_letters(
            job=self.job,
            what=what,
            error=error,
            subject=subject,
            payload=payload,
            deliveries=deliveries,
            max_payload=self.nc.max_payload,
            source_seq=source_seq,
            part=part,
            batch_id=batch_id,
            sample_indices=sample_indices,
        )
        if deadletter.before_store is not None:
            await deadletter.before_store()
        for stored in letters:
            letter = stored.letter
            single = letter.sample_indices[0] if len(letter.sample_indices) == 1 else None
            headers = message_headers(self.job, batch=letter.batch_id, sample=single, msg_id=stored.msg_id)
            await through_outage(
                lambda stored=stored, headers=headers: self.js.publish(
                    topology.dead_subject(self.job, what), stored.payload, headers=headers
                ),
                what="store_dead_letter",
            )
            log.error(
                "dead_lettered",
                what=what,
                batch=letter.batch_id,
                samples=letter.sample_indices[:20],
                deliveries=deliveries,
                error=letter.error,
                payload_kept=not letter.original_truncated,
            )

    async def dead_letter(
        self, msg: Msg, *, what: str, error: str, batch_id: str = "", sample_indices: list[int] | None = None
    ) -> None:
        """Store the message with its error in HSX_DEAD, then remove it from its work queue."""
        await self.store_dead_letter(
            what=what,
            error=error,
            subject=msg.subject,
            payload=msg.data,
            deliveries=msg.metadata.num_delivered,
            batch_id=batch_id,
            sample_indices=sample_indices,
            source_seq=msg.metadata.sequence.stream,
        )
        await through_outage(msg.term, what="remove_dead_lettered")


@dataclass(frozen=True, kw_only=True)
class WorkerState:
    """What a worker says about itself in its heartbeat (who it is is added by the loop)."""

    state: str
    detail: str = ""
    last_batch: str = ""
    spool_files: int = -1
    spool_bytes: int = -1
    spool_measured_at: float = 0.0  # when the spool figures were measured (time.time()); 0: not said
    stalled_s: float = 0.0  # state "stalled": how long the forward of last_batch has run
    kernels: schemas.Kernels | None = None  # a GPU consumer's, once its model is loaded
    load: schemas.WorkerLoad | None = None  # how busy it is, what its node has left


async def heartbeat_loop(
    events: EventPublisher,
    *,
    service: str,
    instance: str,
    node: str,
    interval_s: float,
    stopping: asyncio.Event,
    state: Callable[[], WorkerState],
    spool: str = "",
    wake: asyncio.Event | None = None,
) -> None:
    """Send `state()` as a heartbeat every `interval_s` until stopping, and at once when `wake` is
    set (a worker whose state changed: its model loaded). `state()` runs on a thread: it measures
    the spool, a directory walk that must not hold up the event loop."""
    wake = wake or asyncio.Event()
    while not stopping.is_set():
        wake.clear()  # before the state is read: a change from here on gets a beat of its own
        try:
            report = await asyncio.to_thread(state)
            await events.heartbeat(
                service=service,
                instance=instance,
                node=node,
                state=report.state,
                detail=report.detail,
                last_batch=report.last_batch,
                spool_files=report.spool_files,
                spool_bytes=report.spool_bytes,
                spool_measured_at=report.spool_measured_at,
                stalled_s=report.stalled_s,
                spool=spool,
                kernels=report.kernels,
                load=report.load,
            )
        except Exception as exc:
            log.warning("heartbeat_failed", error=str(exc))
        waits = [asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(wake.wait())]
        try:
            await asyncio.wait(waits, timeout=interval_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()


async def goodbye_heartbeat(
    events: EventPublisher,
    *,
    service: str,
    instance: str,
    node: str,
    state: Callable[[], WorkerState],
    spool: str = "",
) -> None:
    """The last heartbeat of a worker that stops cleanly: `stopping` tells the monitor it is gone,
    not silent; the spool is measured once more, so the node's backlog stays right after it left."""
    try:
        last = await asyncio.to_thread(state)
        await events.heartbeat(
            service=service,
            instance=instance,
            node=node,
            state="stopping",
            last_batch=last.last_batch,
            spool_files=last.spool_files,
            spool_bytes=last.spool_bytes,
            spool_measured_at=last.spool_measured_at,
            spool=spool,
            kernels=last.kernels,
            load=last.load,
        )
    except Exception as exc:  # stopping must go on; the monitor then calls the worker silent
        log.warning("heartbeat_failed", error=str(exc))


async def keep_in_progress(msg: Msg, *, interval_s: float) -> None:
    """Tell JetStream every `interval_s` that `msg` is still being worked on (run as a task and
    cancel it when the message is settled), so only a dead worker's message is redelivered."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await msg.in_progress()
        except Exception as exc:  # a reconnect in progress; the next tick tries again
            log.warning("in_progress_failed", error=str(exc))


# A heartbeat's own clock is believed within this much of the time the server stored it.
HEARTBEAT_CLOCK_SKEW_S = 30.0


def heard_heartbeat(data: bytes, *, subject: str, stored_at: float | None, job: str) -> schemas.Heartbeat | None:
    """A heartbeat as read from HSX_STATE, or None when it is not one of `job`'s own: it must
    decode as a heartbeat, name the job, and the service and instance of its subject. Its `sent_at` is the
    sender's clock, which anyone who can publish may set: more than HEARTBEAT_CLOCK_SKEW_S from
    `stored_at` (when the server stored it) it is taken as `stored_at`, so that no beat, crafted or
    from a machine with a wrong clock, keeps a worker alive past its time or reads as newer."""
    try:
        beat = schemas.event_decoder.decode(data)
    except Exception:  # noqa: BLE001 - msgspec's errors: a stray payload, not a worker's word
        return None
    if not isinstance(beat, schemas.Heartbeat) or beat.job != job:
        return None
    if subject != topology.heartbeat_subject(job, beat.service, beat.instance):
        return None
    if stored_at is not None and abs(beat.sent_at - stored_at) > HEARTBEAT_CLOCK_SKEW_S:
        beat = msgspec.structs.replace(beat, sent_at=stored_at)
    return beat


def read_marker(data: bytes, *, subject: str, job: str) -> schemas.BatchWritten | schemas.FileUploaded | None:
    """A progress marker (or a `replaced` event) as read from the events stream, or None when it
    is not what its subject says: it must decode as a `written` or `uploaded` event of `job`, of
    the plan its subject names, for the batch or sample its subject names
    (`hsx.events.<job>.<kind>.<plan>.[extra.]<batch or sample>`). Counts come from subjects alone
    (hsx/wire/counts.py); what a marker carries is summed, indexed or streamed only when it
    agrees with them."""
    try:
        event = schemas.event_decoder.decode(data)
    except Exception:  # noqa: BLE001 - msgspec's errors: a stray payload
        return None
    tokens = subject.split(".")
    if len(tokens) < 6 or tokens[2] != job or event.__class__ not in (schemas.BatchWritten, schemas.FileUploaded):
        return None
    if event.job != job or (event.plan and event.plan != tokens[4]):
        return None
    named = event.batch_id if isinstance(event, schemas.BatchWritten) else str(event.sample_index)
    return event if tokens[-1] == named else None
