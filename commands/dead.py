"""`hsx dead list` and `hsx dead retry`: the job's dead letters in HSX_DEAD, and sending them back.

A dead letter holds the original payload (hsx/wire/deadletter.py), its subject, the error and how often
it was delivered.
Retrying publishes the payload again to its original subject under a new message id (the batch id
alone would be dropped as a duplicate inside the stream's duplicate window), then deletes the
dead letter. A crash between the two retries it twice at worst: extraction and upload are
idempotent and progress counts distinct samples.

A letter is sent back only to this job's own batch subject (a batch) or its node's file subject
(a file event), and only with a payload that decodes as that kind, of this job and its plan: the
target is derived from the payload, and a letter whose own `original_subject` names anything else
(a crafted one: the jobs bucket, a stream's purge) is listed as *refused* with why, never sent.

A letter is *resolved* when its samples were written after all: each has its `uploaded` marker,
or, for a batch letter, the `written` marker of its batch names them (a stalled forward that
finished after the reaper dead-lettered its batch, a consumer that handed a spent batch back as
a fresh copy and died before removing the spent one). A file letter is resolved by `uploaded`
markers alone: its batch was written before its event existed. Listing shows it so; retrying
skips it.
"""

import asyncio
import json

import msgspec
import structlog

from hsx.errors import HsxError
from hsx.exitcodes import DONE, JOB_FAILED
from hsx.job import JobSpec
from hsx.wire import schemas, topology
from hsx.wire.counts import find_marker, has_uploaded_marker
from hsx.wire.deadletter import resendable
from hsx.wire.headers import message_headers
from hsx.wire.jobs import read_job_spec
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


def _target(letter: schemas.DeadLetter, job: str, spec: JobSpec | None) -> tuple[str, bytes, str]:
    """(the subject the letter's payload would go back to, the payload, "") or ("", b"", why it
    is refused). The subject is derived from the payload, never taken from the letter."""
    if letter.job != job:
        return "", b"", f"the letter names job {letter.job!r}"
    payload = resendable(letter)
    if payload is None:
        return "", b"", "the letter could not keep its payload (larger than the server's max_payload)"
    decoder = schemas.batch_decoder if letter.what == "batch" else schemas.file_decoder
    try:
        message = decoder.decode(payload)
    except msgspec.DecodeError as exc:
        return "", b"", f"its payload does not decode as a {letter.what} ({exc})"
    if message.job != job:
        return "", b"", f"its payload is of job {message.job!r}"
    if spec is None:
        return "", b"", f"job {job} has no spec (deleted): nothing would take the payload"
    if not spec.owns(message.plan):
        return "", b"", f"its payload is of plan {message.plan}, not the job's {spec.plan_tag}"
    if isinstance(message, schemas.BatchDescriptor):
        target = topology.batch_subject(job)
    else:
        target = topology.file_subject(job, message.node)
    if letter.original_subject != target:
        return "", b"", f"it names subject {letter.original_subject!r}, not its payload's {target!r}"
    return target, payload, ""


def _describe(seq: int, letter: schemas.DeadLetter, resolved: str, refused: str = "") -> dict:
    return {
        "seq": seq,
        "what": letter.what,
        "batch_id": letter.batch_id,
        "samples": letter.sample_indices,
        "deliveries": letter.deliveries,
        "subject": letter.original_subject,
        "error": letter.error,
        "resolved": bool(resolved),
        "resolved_by": resolved,  # "" | "uploaded" | "written"
        "refused": refused,  # why `hsx dead retry` will not send it back; "" when it would
    }


async def _written_with(js, job: str, plan: str, batch_id: str) -> set[int]:
    """The samples the `written` marker of `batch_id` names (planned or set aside); none without one."""
    msg = await find_marker(js, topology.written_subject, job, plan, batch_id)
    try:
        event = schemas.event_decoder.decode(msg.data) if msg is not None else None
    except msgspec.DecodeError:
        event = None
    return set(event.sample_indices) if isinstance(event, schemas.BatchWritten) else set()


async def _resolution(js, job: str, plan: str, letter: schemas.DeadLetter) -> str:
    """How the letter's samples were written after all ("" when they were not): "written" (its
    batch's marker names them) or "uploaded" (each has its marker)."""
    samples = letter.sample_indices
    if not samples or not plan:
        return ""
    # A batch's `written` marker resolves a batch letter only: a file event exists because its
    # batch was written, so that marker names every file letter's sample, uploaded or not.
    if (
        letter.what == "batch"
        and letter.batch_id
        and set(samples) <= await _written_with(js, job, plan, letter.batch_id)
    ):
        return "written"
    for start in range(0, len(samples), 64):
        chunk = samples[start : start + 64]
        if not all(await asyncio.gather(*(has_uploaded_marker(js, job, plan, i) for i in chunk))):
            return ""
    return "uploaded"


async def _letters_and_resolutions(
    js, kv, job: str
) -> tuple[JobSpec | None, list[tuple[int, schemas.DeadLetter, str]]]:
    spec = await read_job_spec(kv, job)
    plan = spec.plan_tag if spec else ""
    letters = await _read_letters(js, job)
    if spec is None and not letters:
        # A typo must not read as a clean job; letters whose job was since deleted are still shown.
        raise HsxError(
            f"job {job} not found: no job spec in KV bucket {topology.JOBS_BUCKET} and no dead letters "
            "(hsx jobs list shows the jobs)"
        )
    return spec, [(seq, letter, await _resolution(js, job, plan, letter)) for seq, letter in letters]


async def list_dead(settings: NatsSettings, job: str) -> list[dict]:
    nc = await connect(settings, name=f"hsx-dead-{job}")
    try:
        js = nc.jetstream()
        kv = await topology.require_jobs_bucket(js, job)
        spec, letters = await _letters_and_resolutions(js, kv, job)
        return [_describe(seq, letter, resolved, _target(letter, job, spec)[2]) for seq, letter, resolved in letters]
    finally:
        await nc.drain()


async def retry_dead(
    settings: NatsSettings, job: str, seqs: list[int] | None
) -> tuple[list[dict], list[dict], list[dict]]:
    """Send back the chosen dead letters (all when seqs is None) that are neither resolved nor
    refused; returns (what was sent, the resolved letters skipped, the refused ones: each with
    `refused` saying why; they stay in HSX_DEAD)."""
    nc = await connect(settings, name=f"hsx-dead-retry-{job}")
    try:
        js = nc.jetstream()
        kv = await topology.require_jobs_bucket(js, job)
        spec, letters = await _letters_and_resolutions(js, kv, job)
        if seqs is not None:
            unknown = sorted(set(seqs) - {seq for seq, _, _ in letters})
            if unknown:
                raise HsxError(f"--seq {unknown}: no such dead letter for job {job} (see hsx dead list --job {job})")
            letters = [entry for entry in letters if entry[0] in set(seqs)]
        skipped = [_describe(seq, letter, resolved) for seq, letter, resolved in letters if resolved]
        for entry in skipped:
            log.info(
                "dead_letter_resolved_skipped", seq=entry["seq"], samples=entry["samples"], by=entry["resolved_by"]
            )
        retried, refused = [], []
        for seq, letter, resolved in letters:
            if resolved:
                continue
            target, payload, refusal = _target(letter, job, spec)
            if refusal:
                log.error("dead_letter_refused", seq=seq, samples=letter.sample_indices[:20], reason=refusal)
                refused.append(_describe(seq, letter, resolved, refusal))
                continue
            message_id = f"{letter.batch_id or letter.what}:retry:{seq}"
            single = letter.sample_indices[0] if len(letter.sample_indices) == 1 else None
            await js.publish(
                target,
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
            retried.append(_describe(seq, letter, resolved))
        return retried, skipped, refused
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
        resolved = f" (resolved: its samples were {letter['resolved_by']} since)" if letter["resolved"] else ""
        refused = f" (refused by hsx dead retry: {letter['refused']})" if letter.get("refused") else ""
        lines.append(
            f"seq {letter['seq']}: {letter['what']} {letter['batch_id'] or '-'} samples {samples}{more} "
            f"to {letter['subject']} after {letter['deliveries']} deliveries: {letter['error']}{resolved}{refused}"
        )
    return "\n".join(lines)


def run_list(settings: NatsSettings, job: str, *, as_json: bool) -> int:
    print(format_letters(asyncio.run(list_dead(settings, job)), as_json=as_json))
    return DONE


def run_retry(settings: NatsSettings, job: str, *, seqs: list[int] | None, as_json: bool) -> int:
    """Exit 0 when every chosen letter was sent back or skipped as resolved; JOB_FAILED (65) when
    some were refused (they are listed, and stay in HSX_DEAD)."""
    retried, skipped, refused = asyncio.run(retry_dead(settings, job, seqs))
    if as_json:  # the letters sent back and those refused; the resolved ones skipped are in the log
        print(format_letters(retried + refused, as_json=True))
        return JOB_FAILED if refused else DONE
    print(format_letters(retried, as_json=False) if retried else "nothing to retry")
    if skipped:
        print(
            f"skipped {len(skipped)} resolved letters (their samples were written since): "
            f"seq {', '.join(str(entry['seq']) for entry in skipped)}"
        )
    if refused:
        print(f"refused {len(refused)} letters (left in {topology.DEAD_STREAM}):")
        print(format_letters(refused, as_json=False))
    return JOB_FAILED if refused else DONE
