"""A job's progress sums, folded from its markers once and checkpointed for the next reader.

Samples, tokens and bytes written and uploaded, and the deliveries each batch and file needed,
are the markers' own numbers added up in stream order, each marker once (`ProgressFold`, a pure
fold). A reader that folds them saves what it reached as a `ProgressCheckpoint` on
`hsx.events.<job>.checkpoint` (`save_checkpoint`), and the next reader starts from there
(`load_checkpoint`), so the markers are read once between readers, not at every reading.
"""

import time
from dataclasses import dataclass, field

import msgspec
import nats.js.errors
from nats.js import JetStreamContext

from hsx.logs import get_logger
from hsx.wire import schemas, topology
from hsx.wire.events import HEARTBEAT_ROLLUP
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
    """(the job's saved checkpoint if it is of `plan`, the stream sequence of the message holding
    any checkpoint, 0 when there is none)."""
    try:
        msg = await js.get_last_msg(topology.EVENTS_STREAM, topology.checkpoint_subject(job))
    except nats.js.errors.NotFoundError:
        return None, 0
    return checkpoint_of(msg.data, seq=msg.seq, job=job, plan=plan), msg.seq


def checkpoint_of(data: bytes, *, seq: int, job: str, plan: str) -> schemas.ProgressCheckpoint | None:
    """The checkpoint stored at stream sequence `seq` on `job`'s checkpoint subject, if it is one
    of `job` and `plan` that a reader could have saved there: its sums reach markers stored
    before it (both sequences below its own), in the same stream. None otherwise (one warning
    line when it is not a checkpoint hsx wrote): the sums are folded from the markers again."""
    try:
        checkpoint = schemas.checkpoint_decoder.decode(data)
    except msgspec.DecodeError:
        log.warning("undecodable_checkpoint", job=job)
        return None
    if checkpoint.job != job or not checkpoint.written_seq < seq or not checkpoint.uploaded_seq < seq:
        log.warning(
            "checkpoint_refused",
            job=job,
            seq=seq,
            reason=f"names job {checkpoint.job!r} and sums to sequences {checkpoint.written_seq} and "
            f"{checkpoint.uploaded_seq}; a checkpoint is its own job's and sums markers stored before it",
        )
        return None
    return checkpoint if checkpoint.plan == plan else None


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
        headers = {
            **message_headers(checkpoint.job),
            **HEARTBEAT_ROLLUP,
            "Nats-Expected-Last-Subject-Sequence": str(last_seq),
        }
        try:
            await js.publish(subject, schemas.encode(merged), headers=headers)
            return
        except nats.js.errors.APIError as exc:
            if exc.err_code != topology.WRONG_LAST_SEQUENCE:
                raise
    log.warning("checkpoint_not_saved", job=checkpoint.job, reason="another reader kept saving first")
