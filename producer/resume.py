"""Which of a plan's batches are already accounted for: queued in HSX_BATCHES, or finished.

A producer that stopped mid-publish leaves a job spec with `published` false. Its re-run must
publish only the batches that are neither queued nor finished: `Nats-Msg-Id` de-duplication
covers that only inside the stream's duplicate window (24 h), and after it a blind re-publish
would queue, and extract, the whole job again.

- queued: the batch ids of the messages on `hsx.batches.<job>`, read by sequence number (a work
  queue takes no second consumer on the job's subject, and reading by sequence takes nothing off
  the queue); a message is queued until its consumer acks it, so a batch being extracted counts.
- finished: the batch ids of the job's `written` markers (a consumer publishes one before it acks
  its batch) and of its batch dead letters (stored before the batch leaves the queue; `hsx dead
  retry` sends those back itself).

Queued is read before finished: a batch acked in between is then seen in one or the other,
never in neither. This module reads; the producer decides what to publish.
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
