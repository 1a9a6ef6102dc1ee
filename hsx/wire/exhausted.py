"""Batches that used up their deliveries: dead-lettered with their samples, then removed from the
queue (`reap_exhausted`, which every GPU consumer of a job runs beside its pull loop; it finds
them by JetStream's max-deliveries advisories and by a `sweep`, and stores each with
`dead_letter_exhausted`).

Why and how: docs/operations/nats.md, "Streams, subjects, consumers and buckets", and
docs/architecture/wire.md.
"""

import asyncio
import json
import time

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from hsx.logs import get_logger
from hsx.wire import topology
from hsx.wire.events import EventPublisher

log = get_logger("hsx.exhausted")

SWEEP_INTERVAL_S = 30.0


def _error(deliveries: int) -> str:
    return (
        f"delivered {deliveries} times and never finished: each consumer that took it died, was killed or "
        "stopped, or its result could not be reported (check the consumers' logs and the host's OOM killer "
        "for this batch); hsx dead retry sends it back"
    )


async def dead_letter_exhausted(js: JetStreamContext, events: EventPublisher, *, seq: int, deliveries: int) -> bool:
    """Dead-letter the batch at stream sequence `seq` and delete it from the work queue. False if
    it is no longer there (acked, or another finder was first)."""
    try:
        raw = await js.get_msg(topology.BATCHES_STREAM, seq)
    except nats.js.errors.NotFoundError:
        return False
    if raw.subject != topology.batch_subject(events.job):
        return False
    await events.store_dead_letter(
        what="batch",
        error=_error(deliveries),
        subject=raw.subject,
        payload=raw.data or b"",
        deliveries=deliveries,
        source_seq=seq,
    )
    try:
        await js.delete_msg(topology.BATCHES_STREAM, seq)
    except nats.js.errors.NotFoundError:
        pass
    return True


async def sweep(js: JetStreamContext, events: EventPublisher) -> int:
    """Dead-letter every batch of the job that has used up its deliveries although no advisory
    said so; returns how many."""
    job = events.job
    info = await js.consumer_info(topology.BATCHES_STREAM, topology.gpu_durable(job))
    # Something pending or in flight may still be finished; only a durable with neither proves
    # that what is left below its delivered sequence will never be delivered again.
    if info.num_pending or info.num_ack_pending:
        return 0
    delivered_up_to = info.delivered.stream_seq if info.delivered else 0
    found, seq = 0, 0
    while True:
        try:
            raw = await js.get_msg(topology.BATCHES_STREAM, seq + 1, subject=topology.batch_subject(job), next=True)
        except nats.js.errors.NotFoundError:
            return found
        if raw.seq > delivered_up_to:
            return found
        log.warning("exhausted_batch_swept", seq=raw.seq)
        found += await dead_letter_exhausted(js, events, seq=raw.seq, deliveries=topology.BATCH_MAX_DELIVER)
        seq = raw.seq


def advisory_of(data: bytes) -> tuple[int, int] | None:
    """(stream sequence, deliveries) of a MAX_DELIVERIES advisory's JSON; None when it is not
    one (a sequence is a positive integer, deliveries a count)."""
    try:
        advisory = json.loads(data)
        seq, deliveries = advisory["stream_seq"], advisory.get("deliveries", topology.BATCH_MAX_DELIVER)
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        return None  # json's errors (RecursionError: nested too deep), or not an object with a stream_seq
    if type(seq) is not int or type(deliveries) is not int or seq < 1 or deliveries < 0:
        return None
    return seq, deliveries


async def _on_advisory(js: JetStreamContext, events: EventPublisher, msg) -> None:
    read = advisory_of(msg.data)
    if read is None:
        log.warning("advisory_unreadable", subject=msg.subject)
        await msg.term()
        return
    seq, deliveries = read
    if await dead_letter_exhausted(js, events, seq=seq, deliveries=deliveries):
        log.warning("exhausted_batch_dead_lettered", seq=seq, deliveries=deliveries)
    await msg.ack_sync()


async def reap_exhausted(js: JetStreamContext, events: EventPublisher, stopping: asyncio.Event) -> None:
    """Until stopping: dead-letter the job's batches that used up their deliveries."""
    sub = None
    while sub is None:
        try:
            durable = await topology.ensure_exhausted_consumer(js, events.job)
            sub = await js.pull_subscribe_bind(durable=durable, stream=topology.ADVISORIES_STREAM)
        except Exception:
            log.warning("exhausted_reaper_not_started", retry_in_s=5.0, exc_info=True)
            try:
                await asyncio.wait_for(stopping.wait(), timeout=5.0)
                return
            except TimeoutError:
                pass
    next_sweep = time.monotonic()
    try:
        while not stopping.is_set():
            try:
                msgs = await sub.fetch(16, timeout=2.0)
            except (TimeoutError, nats.errors.TimeoutError):
                msgs = []
            except Exception as exc:  # NATS reconnecting: the advisories wait in their stream
                log.warning("advisory_fetch_failed", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(1.0)
                continue
            for msg in msgs:
                try:
                    await _on_advisory(js, events, msg)
                except Exception:  # left unacked: the advisory comes back after its ack wait
                    log.warning("exhausted_batch_not_dead_lettered", subject=msg.subject, exc_info=True)
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + SWEEP_INTERVAL_S
                try:
                    await sweep(js, events)
                except Exception:
                    log.warning("exhausted_sweep_failed", exc_info=True)
    finally:
        try:
            await sub.unsubscribe()
        except Exception:
            pass
