"""Building dead letters that always fit the server's max_payload.

A letter carries its payload as itself (the batch descriptor or file-ready event, plain JSON), so
it is the payload plus a bounded envelope (`schemas.dead_letter_headroom`), and the producer
refuses a descriptor that would not leave that room. Should a letter still not fit (the server's
limit lowered after the job was published), a batch's samples are spread over several letters,
each sent back on its own by `hsx dead retry`; one sample that still cannot fit is stored
without its payload, naming the sample. A payload that does not decode is kept as bytes, cut
to fit. Nothing here publishes: `hsx.wire.events.EventPublisher` stores what this builds.

Each letter's message id derives from the payload's stream sequence (`dead:<what>:<seq>`), so
storing the same letter twice (the consumer on the last delivery and the reaper of exhausted
messages, or a publish retried through a NATS outage) keeps one.
"""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from hsx.wire import schemas

# A seam for tests (devkit/faults.py): awaited before a dead letter is stored, so that a test can
# take NATS away at exactly that moment.
before_store: Callable[[], Awaitable[None]] | None = None

# Headers (job, batch, sample, message id) travel in the same message and count towards max_payload.
HEADER_ALLOWANCE = 1024


@dataclass(frozen=True, kw_only=True)
class LetterToStore:
    letter: schemas.DeadLetter
    payload: bytes  # the encoded letter
    msg_id: str  # "" when the payload came from no stream


def _msg_id(what: str, source_seq: int, part: str) -> str:
    return f"dead:{what}:{source_seq}{part}" if source_seq else ""


def _fits(payload: bytes, max_payload: int) -> bool:
    return len(payload) + HEADER_ALLOWANCE <= max_payload


def build_letters(
    *,
    job: str,
    what: str,
    error: str,
    subject: str,
    payload: bytes,
    deliveries: int,
    max_payload: int,
    source_seq: int = 0,
    part: str = "",
    batch_id: str = "",
    sample_indices: list[int] | None = None,
) -> list[LetterToStore]:
    """The letters that store `payload` (as it arrived on `subject`) with its error, each within
    max_payload. `part` tells apart letters made from one message (e.g. ":poison")."""
    envelope = schemas.DeadLetter(
        job=job,
        what=what,
        error=error[: schemas.DEAD_LETTER_ERROR_CHARS],
        deliveries=deliveries,
        original_subject=subject,
        batch_id=batch_id,
        sample_indices=list(sample_indices or []),
        source_seq=source_seq,
    )
    decoder = schemas.batch_decoder if what == "batch" else schemas.file_decoder
    try:
        decoded = decoder.decode(payload)
    except msgspec.DecodeError:
        return [_undecodable(envelope, payload, max_payload, _msg_id(what, source_seq, part))]
    if isinstance(decoded, schemas.BatchDescriptor):
        return _batch_letters(envelope, decoded, max_payload, part)
    letter = msgspec.structs.replace(
        envelope,
        file=decoded,
        batch_id=envelope.batch_id or decoded.batch_id,
        sample_indices=envelope.sample_indices or [decoded.sample_index],
    )
    return [_fitted(letter, max_payload, _msg_id(what, source_seq, part))]


def _batch_letters(
    envelope: schemas.DeadLetter, batch: schemas.BatchDescriptor, max_payload: int, part: str
) -> list[LetterToStore]:
    letter = msgspec.structs.replace(
        envelope,
        batch=batch,
        batch_id=envelope.batch_id or batch.batch_id,
        sample_indices=[sample.index for sample in batch.samples],
    )
    encoded = schemas.encode(letter)
    msg_id = _msg_id(envelope.what, envelope.source_seq, part)
    if _fits(encoded, max_payload) or len(batch.samples) == 1:
        return [_fitted(letter, max_payload, msg_id)]
    # Too big as one letter: each half of the samples goes in a letter of its own, as a batch of
    # its own (a distinct id, so that sending both back publishes both).
    half = len(batch.samples) // 2
    letters = []
    for name, samples in (("a", batch.samples[:half]), ("b", batch.samples[half:])):
        piece = msgspec.structs.replace(
            batch,
            batch_id=f"{batch.batch_id}{name}",
            samples=samples,
            padded_len=max(len(sample.input_ids) for sample in samples),
        )
        letters += _batch_letters(
            msgspec.structs.replace(envelope, batch_id=letter.batch_id), piece, max_payload, f"{part}:{name}"
        )
    return letters


def _fitted(letter: schemas.DeadLetter, max_payload: int, msg_id: str) -> LetterToStore:
    """The letter as it is if it fits; else without its payload, still naming its samples."""
    encoded = schemas.encode(letter)
    if not _fits(encoded, max_payload):
        letter = msgspec.structs.replace(letter, batch=None, file=None, original_truncated=True)
        encoded = schemas.encode(letter)
    return LetterToStore(letter=letter, payload=encoded, msg_id=msg_id)


def _undecodable(envelope: schemas.DeadLetter, payload: bytes, max_payload: int, msg_id: str) -> LetterToStore:
    room = max_payload - HEADER_ALLOWANCE - len(schemas.encode(envelope)) - 16
    keep = max(0, room * 3 // 4)  # bytes travel as base64
    letter = msgspec.structs.replace(envelope, original=payload[:keep], original_truncated=len(payload) > keep)
    return LetterToStore(letter=letter, payload=schemas.encode(letter), msg_id=msg_id)


def resendable(letter: schemas.DeadLetter) -> bytes | None:
    """The payload `hsx dead retry` publishes again; None when the letter could not keep it."""
    if letter.batch is not None:
        return schemas.encode(letter.batch)
    if letter.file is not None:
        return schemas.encode(letter.file)
    if letter.original and not letter.original_truncated:
        return letter.original
    return None
