"""`hsx dead list` and `hsx dead retry`: the job's dead letters in HSX_DEAD, and sending them back.

A dead letter holds the original payload (hsx/wire/deadletter.py), its subject, the error and how often
it was delivered.
Retrying publishes the payload again to its original subject under a new message id (the batch id
alone would be dropped as a duplicate inside the stream's duplicate window), then deletes the
dead letter. A crash between the two retries it twice at worst: extraction and upload are
idempotent and progress counts distinct samples.
"""

import asyncio
import json

import msgspec
import structlog

from hsx.errors import HsxError
from hsx.wire import schemas, topology
from hsx.wire.deadletter import resendable
from hsx.wire.headers import message_headers
from hsx.wire.natsconn import NatsSettings, connect

log = structlog.get_logger("hsx.dead")


async def _read_letters(js, job: str) -> list[tuple[int, schemas.DeadLetter]]:
    subject = topology.dead_subject_all(job)
    info = await js.stream_info(topology.DEAD_STREAM, subjects_filter=subject)
    count = sum((info.state.subjects or {}).values())
    letters: list[tuple[int, schemas.DeadLetter]] = []
    if not count:
        return letters
    sub = await js.subscribe(subject, stream=topology.DEAD_STREAM, ordered_consumer=True)
    try:
        while True:
            msg = await sub.next_msg(timeout=10)
            try:
                letters.append((msg.metadata.sequence.stream, schemas.dead_decoder.decode(msg.data)))
            except msgspec.DecodeError:
                log.warning("undecodable_dead_letter", seq=msg.metadata.sequence.stream)
            if msg.metadata.num_pending == 0:
                return letters
    finally:
        await sub.unsubscribe()


def _payload_batch_id(letter: schemas.DeadLetter) -> str:
    """The batch id of the payload sent back: a poisoned batch's remaining samples travel as
    `<batch>-poison`, so the payload, not the letter, names the batch that will run."""
    if letter.batch is not None:
        return letter.batch.batch_id
    if letter.file is not None:
        return letter.file.batch_id
    decoder = schemas.batch_decoder if letter.what == "batch" else schemas.file_decoder
    try:
        return decoder.decode(letter.original).batch_id
    except msgspec.DecodeError:
        return letter.batch_id


def _describe(seq: int, letter: schemas.DeadLetter) -> dict:
    return {
        "seq": seq,
        "what": letter.what,
        "batch_id": letter.batch_id,
        "samples": letter.sample_indices,
        "deliveries": letter.deliveries,
        "subject": letter.original_subject,
        "error": letter.error,
    }


async def list_dead(settings: NatsSettings, job: str) -> list[dict]:
    nc = await connect(settings, name=f"hsx-dead-{job}")
    try:
        js = nc.jetstream()
        await topology.ensure_topology(js)
        return [_describe(seq, letter) for seq, letter in await _read_letters(js, job)]
    finally:
        await nc.drain()


async def retry_dead(settings: NatsSettings, job: str, seqs: list[int] | None) -> list[dict]:
    """Send back the chosen dead letters (all when seqs is None); returns what was sent."""
    nc = await connect(settings, name=f"hsx-dead-retry-{job}")
    try:
        js = nc.jetstream()
        await topology.ensure_topology(js)
        letters = await _read_letters(js, job)
        if seqs is not None:
            unknown = sorted(set(seqs) - {seq for seq, _ in letters})
            if unknown:
                raise HsxError(f"--seq {unknown}: no such dead letter for job {job} (see hsx dead list --job {job})")
            letters = [(seq, letter) for seq, letter in letters if seq in set(seqs)]
        retried = []
        for seq, letter in letters:
            payload = resendable(letter)
            if payload is None:
                log.error(
                    "dead_letter_not_resendable",
                    seq=seq,
                    samples=letter.sample_indices,
                    reason="the letter could not keep its payload (larger than the server's max_payload)",
                )
                continue
            message_id = f"{letter.batch_id or letter.what}:retry:{seq}"
            single = letter.sample_indices[0] if len(letter.sample_indices) == 1 else None
            await js.publish(
                letter.original_subject,
                payload,
                headers=message_headers(
                    job,
                    batch=_payload_batch_id(letter),
                    sample=single,
                    msg_id=message_id,
                    retry_of=seq,
                ),
            )
            await js.delete_msg(topology.DEAD_STREAM, seq)
            log.info(
                "dead_letter_retried", seq=seq, what=letter.what, batch=letter.batch_id, samples=letter.sample_indices
            )
            retried.append(_describe(seq, letter))
        return retried
    finally:
        await nc.drain()


def format_letters(letters: list[dict], *, as_json: bool) -> str:
    if as_json:
        return json.dumps(letters)
    if not letters:
        return "no dead letters"
    lines = []
    for letter in letters:
        samples = letter["samples"][:10]
        more = " ..." if len(letter["samples"]) > 10 else ""
        lines.append(
            f"seq {letter['seq']}: {letter['what']} {letter['batch_id'] or '-'} samples {samples}{more} "
            f"after {letter['deliveries']} deliveries: {letter['error']}"
        )
    return "\n".join(lines)


def run_list(settings: NatsSettings, job: str, *, as_json: bool) -> int:
    print(format_letters(asyncio.run(list_dead(settings, job)), as_json=as_json))
    return 0


def run_retry(settings: NatsSettings, job: str, *, seqs: list[int] | None, as_json: bool) -> int:
    retried = asyncio.run(retry_dead(settings, job, seqs))
    print(format_letters(retried, as_json=as_json) if retried else "nothing to retry")
    return 0
