"""Where a trainer stream's first epoch ends, agreed among the stream's own ranks
(`EpochEndAgreement`, used by hsx/wire/landed.py's `LandingFeed`): the rule of
docs/reliability/index.md, "A trainer stream's epoch end".

Every rank of a stream (the `JobStream`s of one name over one job) must end its first epoch at the
same stream sequence, or samples would reach one rank and miss another. A rank that finds the job
over appends an `EpochEndRecord` to the stream's subject (`topology.epoch_end_subject`); nothing is
first-writer-wins, so a record published there first by anyone else shadows nothing. Every rank
takes the first *valid* record in stream order, and valid is a function of the record and of the
events stream before it, which no later message changes: every rank judges every record alike,
whenever it reads it.

A record is valid when (identity) it is of this job, plan, stream and production, with the plan's
sample count; (written after its end) its end is 0 or a marker of the plan, before the record, and
no marker of the plan lies between its end and the record (a real record ends where the markers
ended when it was written); (counts) the distinct planned samples whose markers precede its end,
as every rank reads them, and its missing count make the plan, `done` exactly when none is
missing, the missing samples named inside the plan, each once, no more of them than the count, and
none of them landed before its end. A refused record is one warning line (`epoch_end_refused`,
its sequence and the check it failed), and the next is considered. A valid record is believed
only once this rank's own reading has found the job over, as `hsx monitor --until-done` reads it;
until then the rank reads no marker past its end.

What this does not stop: a record written while the job runs that is consistent with the stream
then (its end at the last marker, the samples not yet landed counted missing) passes every check,
and ends the epoch there once the job is over. Only who may publish on the subject stops that
(`hsx nats-config --trainer-stream`: each stream's own trainer user).

This module knows the records, the markers' stream sequences and this rank's reading of whether
the job is over; not files, batches or the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import nats.js.errors
import numpy as np

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.logs import get_logger
from hsx.wire import schemas, topology
from hsx.wire.counts import last_sequence
from hsx.wire.statusview import StatusView

log = get_logger("hsx.stream")

# hsx never sends a record with it, and HSX_EVENTS refuses it; one stored while the stream still
# allowed rollups (made by an older hsx) may have erased the records before it.
_ROLLUP = "Nats-Rollup"


@dataclass(frozen=True)
class EpochEnd:
    """The end of the job's first epoch: the stream sequence of its last marker, and whether the
    job was done (every planned sample landed) or failed (`reason`, the dead-lettered samples
    that never landed in `missing`, and how many planned samples did not land in all)."""

    end_seq: int
    done: bool
    total_samples: int
    reason: str | None = None
    missing: tuple[int, ...] = ()
    missing_count: int = 0


class LandedAt:
    """The stream sequence at which each planned sample's first accepted marker was read (0: none
    yet), as this rank reads the markers in order: 8 bytes a sample. What every rank reads alike,
    so counts taken from it up to a sequence are the same on every rank."""

    def __init__(self, total_samples: int) -> None:
        self._seq = np.zeros(total_samples, dtype=np.int64)

    def mark(self, index: int, seq: int) -> None:
        if 0 <= index < len(self._seq) and not self._seq[index]:
            self._seq[index] = seq

    def count_upto(self, seq: int) -> int:
        """Distinct planned samples landed at or before stream sequence `seq`."""
        return int(np.count_nonzero((self._seq > 0) & (self._seq <= seq)))

    def landed_upto(self, indices: list[int], seq: int) -> list[int]:
        """Those of `indices` (inside the plan) landed at or before `seq`."""
        return [i for i in indices if 0 < self._seq[i] <= seq]


def _epoch_end(record: schemas.EpochEndRecord) -> EpochEnd:
    return EpochEnd(
        end_seq=record.end_seq,
        done=record.done,
        total_samples=record.total_samples,
        reason=record.reason,
        missing=tuple(record.missing),
        missing_count=record.missing_count,
    )


class EpochEndAgreement:
    """The records on one stream's subject, judged by the rule (module docstring), and this rank's
    own. `read_records()` reads the records not read yet (each checked against the stream once);
    `settle(delivered)` is the agreed end once the rank's reading (the stream sequence of the
    last marker it handed over) reaches a valid record's end and the job is `over`, else None;
    `holding_at()` is how far the reading may go meanwhile; `record(view, delivered)` appends this
    rank's own reading of the end. NATS errors propagate (the caller reads again later)."""

    def __init__(self, js, spec: JobSpec, *, stream: str, markers: str) -> None:
        self.js, self.spec, self.stream, self.markers = js, spec, stream, markers
        self.subject = topology.epoch_end_subject(spec.job, spec.plan_tag, stream)
        self.landed = LandedAt(spec.total_samples)
        self.over = False  # this rank's reading has found the job over
        self._cursor = 0  # the stream sequence of the last record read
        self._valid: list[tuple[int, schemas.EpochEndRecord]] = []  # passed what the stream says; in order

    def holding_at(self) -> int | None:
        """The end of the first record not refused yet: the reading stops there until it is judged."""
        return self._valid[0][1].end_seq if self._valid else None

    async def read_records(self) -> None:
        while True:
            try:
                msg = await self.js.get_msg(
                    topology.EVENTS_STREAM, seq=self._cursor + 1, subject=self.subject, next=True
                )
            except nats.js.errors.NotFoundError:
                return
            self._cursor = msg.seq
            record, refusal = await self._against_stream(msg)
            if record is None:
                self._refuse(msg.seq, refusal)
            else:
                self._valid.append((msg.seq, record))

    def settle(self, delivered: int) -> EpochEnd | None:
        while self._valid:
            seq, record = self._valid[0]
            if delivered < record.end_seq:
                return None  # judged once the reading has every marker up to its end
            refusal = self._against_reading(record)
            if refusal:
                self._refuse(seq, refusal)
                self._valid.pop(0)
                continue
            if not self.over:
                return None  # not believed before this rank finds the job over
            if delivered > record.end_seq:
                raise HsxError(
                    f"stream {self.stream}: this rank read past the epoch's end another rank recorded "
                    f"(stream sequence {record.end_seq}); restart every rank of the stream"
                )
            return _epoch_end(record)
        return None

    async def record(self, view: StatusView, delivered: int) -> bool:
        """Append this rank's reading of the end (the job is over, as `view` says), once no record
        is left to judge; False while the reading has not caught up with the last marker."""
        if self._valid:
            return False
        end_seq = await last_sequence(self.js, topology.EVENTS_STREAM, self.markers)
        if delivered < end_seq:
            return False
        spec, total = self.spec, self.spec.total_samples
        missing_count = total - self.landed.count_upto(end_seq)
        dead = sorted({i for i in view.dead_samples if 0 <= i < total})
        landed = set(self.landed.landed_upto(dead, end_seq))
        done = missing_count == 0
        record = schemas.EpochEndRecord(
            job=spec.job,
            plan=spec.plan_tag,
            stream=self.stream,
            created_at=spec.created_at,
            end_seq=end_seq,
            done=done,
            total_samples=total,
            reason=None if done else view.failure_reason or f"{missing_count} planned samples did not land",
            missing=[i for i in dead if i not in landed][:missing_count],
            missing_count=missing_count,
        )
        await self.js.publish(self.subject, schemas.encode(record))
        return True

    async def _against_stream(self, msg) -> tuple[schemas.EpochEndRecord | None, str]:
        """The record, or None and the check it failed: what the stream says, checked once."""
        if msg.headers and _ROLLUP in msg.headers:
            return None, "a rollup, which erased the records before it"
        try:
            record = schemas.epoch_end_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return None, "not an epoch end hsx writes"
        spec, total = self.spec, self.spec.total_samples
        if (record.job, record.plan, record.stream) != (spec.job, spec.plan_tag, self.stream):
            return None, "of another job, plan or stream"
        if record.created_at != spec.created_at:
            return None, "of another production of the job"
        if record.total_samples != total:
            return None, f"of {record.total_samples} samples, not the plan's {total}"
        if record.done != (record.missing_count == 0) or record.missing_count > total:
            return None, f"done {record.done} with {record.missing_count} of {total} samples missing"
        if len(set(record.missing)) != len(record.missing) or len(record.missing) > record.missing_count:
            return None, f"{len(record.missing)} samples named missing, not each once within its count"
        if any(i >= total for i in record.missing):
            return None, "a sample named missing outside the plan"
        if record.end_seq >= msg.seq:
            return None, f"written before its end (stream sequence {record.end_seq})"
        if record.end_seq:
            at = await self._marker_from(record.end_seq)
            if at != record.end_seq:
                return None, f"its end (stream sequence {record.end_seq}) is not a marker of the plan"
        after = await self._marker_from(record.end_seq + 1)
        if after is not None and after < msg.seq:
            return None, f"written after a marker its end leaves out (stream sequence {after})"
        return record, ""

    def _against_reading(self, record: schemas.EpochEndRecord) -> str:
        """The check a record fails against the markers this rank read up to its end; "" if none."""
        total = self.spec.total_samples
        landed = self.landed.count_upto(record.end_seq)
        if landed + record.missing_count != total:
            return f"{landed} samples landed by its end and {record.missing_count} missing, not the plan's {total}"
        named = self.landed.landed_upto(record.missing, record.end_seq)
        if named:
            return f"it names sample {named[0]} missing, which landed before its end"
        return ""

    async def _marker_from(self, seq: int) -> int | None:
        """The stream sequence of the first marker of the plan at or after `seq`; None if none."""
        try:
            return (await self.js.get_msg(topology.EVENTS_STREAM, seq=seq, subject=self.markers, next=True)).seq
        except nats.js.errors.NotFoundError:
            return None

    def _refuse(self, seq: int, check: str) -> None:
        log.warning("epoch_end_refused", job=self.spec.job, stream=self.stream, seq=seq, check=check)
