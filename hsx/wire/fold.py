"""A job's progress sums, folded from its markers once and checkpointed for the next reader.

Samples, tokens and bytes written and uploaded, and the deliveries each batch and file needed,
are the markers' own numbers added up in stream order, each marker once (`ProgressFold`, a pure
fold). A reader that folds them saves what it reached as a `ProgressCheckpoint` on
`hsx.state.<job>.checkpoint` (`save_checkpoint`; HSX_STATE keeps the last save), and the next
reader starts from there (`load_checkpoint`), so the markers are read once between readers, not
at every reading. A checkpoint whose markers are no longer in HSX_EVENTS is not used: the sums
are folded again from the first marker.
"""

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec
import nats.js.errors
from nats.js import JetStreamContext

from hsx.logs import get_logger
from hsx.wire import schemas, topology
from hsx.wire.headers import message_headers

log = get_logger("hsx.progress")

DEAD_ERRORS = 20
DEAD_ERROR_CHARS = 300


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
    # The dead letters' errors (first line, cut to DEAD_ERROR_CHARS), how many letters say each;
    # at most DEAD_ERRORS of them, the rest under "other errors".
    dead_errors: dict[str, int] = field(default_factory=dict)
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
            error = (event.error.splitlines() or [""])[0][:DEAD_ERROR_CHARS]
            if error not in self.dead_errors and len(self.dead_errors) >= DEAD_ERRORS:
                error = "other errors"
            self.dead_errors[error] = self.dead_errors.get(error, 0) + 1


def _letter_of_plan(letter: schemas.DeadLetter, plan: str) -> bool:
    """Whether a dead letter is of `plan`: the plan its payload names (letters of payloads from
    before payloads named one, or of payloads that did not decode, are taken as the job's)."""
    payload = letter.batch or letter.file
    return payload is None or payload.plan in ("", plan)


async def load_checkpoint(js: JetStreamContext, job: str, plan: str) -> tuple[schemas.ProgressCheckpoint | None, int]:
    """(the job's saved checkpoint if it is of `plan` and its sums end at markers HSX_EVENTS
    holds, the HSX_STATE sequence of the message holding any checkpoint, 0 when there is none)."""
    try:
        msg = await js.get_last_msg(topology.STATE_STREAM, topology.checkpoint_subject(job))
    except nats.js.errors.NotFoundError:  # none saved, or no HSX_STATE yet (streams of an older hsx)
        return None, 0
    checkpoint = checkpoint_of(msg.data, job=job, plan=plan)
    if checkpoint is None:
        return None, msg.seq
    subjects = {}
    for seq in {checkpoint.written_seq, checkpoint.uploaded_seq} - {0}:
        try:
            subjects[seq] = (await js.get_msg(topology.EVENTS_STREAM, seq=seq)).subject
        except nats.js.errors.NotFoundError:
            pass
    if not ends_at_markers(checkpoint, subjects):
        log.warning(
            "checkpoint_refused",
            job=job,
            seq=msg.seq,
            reason=f"sums to sequences {checkpoint.written_seq} and {checkpoint.uploaded_seq} of "
            f"{topology.EVENTS_STREAM}, which hold no marker of its kind, job and plan",
        )
        return None, msg.seq
    return checkpoint, msg.seq


def checkpoint_of(data: bytes, *, job: str, plan: str) -> schemas.ProgressCheckpoint | None:
    """The checkpoint in `data` (the last message on `job`'s checkpoint subject) if it is one of
    `job` and `plan`; None otherwise (one warning line when it is not a checkpoint of `job`): the
    sums are folded from the markers again. Where its sums end is checked by `ends_at_markers`."""
    try:
        checkpoint = schemas.checkpoint_decoder.decode(data)
    except msgspec.DecodeError:
        log.warning("undecodable_checkpoint", job=job)
        return None
    if checkpoint.job != job:
        log.warning(
            "checkpoint_refused",
            job=job,
            reason=f"names job {checkpoint.job!r}; a checkpoint is its own job's",
        )
        return None
    return checkpoint if checkpoint.plan == plan else None


def ends_at_markers(checkpoint: schemas.ProgressCheckpoint, subjects: Mapping[int, str]) -> bool:
    """Whether each of a checkpoint's sums ends at a marker of its kind, job and plan in
    HSX_EVENTS; `subjects` maps a sequence of HSX_EVENTS to the subject of the message there (a
    sequence missing: no message). The checkpoint lives in HSX_STATE, apart from the markers: one
    whose sums reach past them (crafted; or the job's markers purged on their own, as an older
    hsx's `jobs delete` did, or HSX_EVENTS made anew) would have every later marker at or below
    its sequences skipped. A marker is removed only with its job's, so one is there at each sum's
    end exactly while the sums hold."""
    for kind, seq in (("written", checkpoint.written_seq), ("uploaded", checkpoint.uploaded_seq)):
        prefix = topology.markers_all(checkpoint.job, kind, checkpoint.plan or "none")[: -len(">")]
        if seq and not subjects.get(seq, "").startswith(prefix):
            return False
    return True


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
        # HSX_STATE keeps the subject's last message; the expected sequence serializes savers.
        headers = {**message_headers(checkpoint.job), "Nats-Expected-Last-Subject-Sequence": str(last_seq)}
        try:
            await js.publish(subject, schemas.encode(merged), headers=headers)
            return
        except nats.js.errors.APIError as exc:
            if exc.err_code != topology.WRONG_LAST_SEQUENCE:
                raise
    log.warning("checkpoint_not_saved", job=checkpoint.job, reason="another reader kept saving first")
