"""Which of a plan's batches are already accounted for (`accounted_batch_ids`): queued in
HSX_BATCHES (`queued_batch_ids`) or finished, written or dead-lettered (`finished_batch_ids`), so
that the re-run of a producer stopped mid-publish publishes only the others, also after the
stream's 24 h duplicate window. Queued is read before finished: a batch acked in between is then
seen in one or the other, never in neither. This module reads; the producer decides what to
publish.

How each is read: docs/architecture/producer.md.
"""

import msgspec
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from hsx.wire import headers, schemas, topology

log = structlog.get_logger("hsx.producer")

_READ_TIMEOUT_S = 10.0


async def queued_batch_ids(js: JetStreamContext, job: str) -> set[str]:
    subject = topology.batch_subject(job)
    info = await js.stream_info(topology.BATCHES_STREAM, subjects_filter=subject)
    ids: set[str] = set()
    if not sum((info.state.subjects or {}).values()):
        return ids
    seq = info.state.first_seq
    while True:
        try:
            msg = await js.get_msg(topology.BATCHES_STREAM, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return ids
        batch_id = (msg.headers or {}).get(headers.BATCH)
        if not batch_id:  # the header repeats the payload; the payload is the authority
            try:
                batch_id = schemas.batch_decoder.decode(msg.data or b"").batch_id
            except msgspec.DecodeError:
                batch_id = ""
        if batch_id:
            ids.add(batch_id)
        seq = msg.seq + 1


async def _replay(js: JetStreamContext, stream: str, subject: str, decoder) -> list:
    """Every message on `subject` decoded (those that do not decode are skipped), read with an
    ordered consumer that is gone afterwards."""
    info = await js.stream_info(stream, subjects_filter=subject)
    if not sum((info.state.subjects or {}).values()):
        return []
    decoded = []
    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    try:
        while True:
            msg = await sub.next_msg(timeout=_READ_TIMEOUT_S)
            try:
                decoded.append(decoder.decode(msg.data))
            except msgspec.DecodeError:
                log.warning("undecodable_message", stream=stream, seq=msg.metadata.sequence.stream)
            if msg.metadata.num_pending == 0:
                return decoded
    finally:
        await sub.unsubscribe()


async def finished_batch_ids(js: JetStreamContext, job: str) -> set[str]:
    written = await _replay(
        js, topology.EVENTS_STREAM, topology.markers_all(job, "written", "*"), schemas.event_decoder
    )
    finished = {event.batch_id for event in written if isinstance(event, schemas.BatchWritten)}
    finished |= {
        letter.batch_id
        for letter in await _replay(js, topology.DEAD_STREAM, topology.dead_subject_all(job), schemas.dead_decoder)
        if letter.what == "batch" and letter.batch_id
    }
    return finished


async def accounted_batch_ids(js: JetStreamContext, job: str) -> set[str]:
    """Batch ids queued or finished, read in that order (see the module docstring)."""
    queued = await queued_batch_ids(js, job)
    return queued | await finished_batch_ids(js, job)
