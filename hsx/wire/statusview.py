"""One reading of a job, as `hsx status` prints it and the monitor reports from (`StatusView`),
made from what was counted (hsx/wire/counts.py) and folded (hsx/wire/fold.py): `done`, `failed`
and its reason, and the uploaders' word that the destination refuses their writes.
"""

import time

import msgspec

from hsx.wire import schemas, topology
from hsx.wire.counts import ProgressCounts, QueueState
from hsx.wire.fold import ProgressFold


class DestinationRefusal(msgspec.Struct, frozen=True, kw_only=True):
    """A live uploader's word that the destination refuses its writes."""

    uploader: str
    node: str
    reason: str | None


class StatusView(msgspec.Struct, frozen=True, kw_only=True):
    """One reading of a job: what `hsx status --json` prints (docs/OPERATIONS.md, "hsx status"),
    field for field, and what the monitor reports from."""

    job: str
    exists: bool
    total_samples: int
    total_tokens: int
    # --on-long: rows truncated to --max-seq-len or skipped; listed in the job's input report.
    samples_truncated: int
    samples_skipped: int
    rows_bad: int  # --on-bad-row skip: rows set aside; listed in the job's input report
    input_report: str | None
    samples_written: int
    samples_uploaded: int
    tokens_written: int
    tokens_uploaded: int
    bytes_written: int
    bytes_uploaded: int
    # The sums above (samples_written, tokens_*, bytes_*, redeliveries after the fact) cover every
    # marker when true; false: the reading stopped at its budget, and they are short.
    sums_complete: bool
    # Set aside, not counted: `uploaded` markers of sample indices outside range(total_samples),
    # and markers of another plan under this job name.
    samples_outside_plan: int
    events_other_plan: int
    batches_total: int
    batches_done: int
    batches_queued: int
    files_waiting_upload: int
    dead_letters: int
    dead_samples: list[int]
    samples_requeued: int
    # Written after a redelivery (from the markers) + redelivered and not acked yet (from JetStream).
    batch_redeliveries: int
    file_redeliveries: int
    dest: str | None
    done: bool
    failed: bool
    failure_reason: str | None  # one line; None unless failed
    destination_error: str | None
    destination_refusals: list[DestinationRefusal]  # of live uploaders refused, newest first
    as_of: float


def destination_refusals(
    heartbeats: dict[str, schemas.Heartbeat], *, now: float, live_s: float
) -> list[DestinationRefusal]:
    """Uploaders that say, in a heartbeat younger than `live_s`, that the destination refuses
    their writes; newest first. Told by live heartbeats, so a refusal ends with the uploader that
    saw it: a stopped or killed one leaves no stale failure behind for the next run."""
    refused = sorted(
        (
            beat
            for beat in heartbeats.values()
            if beat.service == "uploader" and beat.state == "refused" and now - beat.sent_at <= live_s
        ),
        key=lambda beat: beat.sent_at,
        reverse=True,
    )
    return [DestinationRefusal(uploader=beat.instance, node=beat.node, reason=beat.detail) for beat in refused]


def status_view(
    spec: schemas.JobSpec | None,
    fold: ProgressFold,
    queues: QueueState,
    counts: ProgressCounts,
    *,
    job: str,
    now: float | None = None,
    live_s: float = 30.0,
    sums_complete: bool = True,
) -> StatusView:
    """The reading of the job from what was counted and folded. Heartbeats older than `live_s` at `now` (default: the time now) are not taken as the word of a
    live worker. `sums_complete`: the fold has read every marker there was when it started."""
    total = spec.total_samples if spec else 0
    uploaded = counts.samples_uploaded
    # Done: every planned sample of this plan has its `uploaded` marker, and nothing is left in
    # flight (a batch redelivered after a crash may still be queued although its samples were
    # already uploaded).
    drained = queues.batches_queued == 0 and queues.files_queued == 0
    done = spec is not None and spec.published and uploaded == total and drained
    dead_samples = set(counts.dead_unfinished)
    # Nothing is queued anywhere and every missing sample is dead: the job cannot finish by itself.
    failed = (
        spec is not None
        and spec.published
        and not done
        and drained
        and 0 < total - uploaded == sum(1 for i in dead_samples if 0 <= i < total)
    )
    failure_reason = (
        f"{len(dead_samples)} samples dead-lettered and nothing else left to run (hsx dead list --job {job})"
        if failed
        else None
    )
    # A refusing destination (a missing bucket, bad credentials, a denied permission) is a failure
    # for as long as it lasts: nothing is uploaded until someone fixes it, then it clears by itself.
    refusals = (
        [] if done else destination_refusals(fold.heartbeats, now=time.time() if now is None else now, live_s=live_s)
    )
    if refusals:
        failed = True
        failure_reason = f"the destination refuses uploads: {refusals[0].reason}"
    return StatusView(
        job=job,
        exists=spec is not None,
        total_samples=total,
        total_tokens=spec.total_tokens if spec else 0,
        samples_truncated=spec.samples_truncated if spec else 0,
        samples_skipped=spec.samples_skipped if spec else 0,
        rows_bad=spec.rows_bad if spec else 0,
        input_report=f"{topology.DATASETS_BUCKET}/{spec.report_object}" if spec and spec.report_object else None,
        samples_written=fold.samples_written,
        samples_uploaded=uploaded,
        tokens_written=fold.tokens_written,
        tokens_uploaded=fold.tokens_uploaded,
        bytes_written=fold.bytes_written,
        bytes_uploaded=fold.bytes_uploaded,
        sums_complete=sums_complete,
        samples_outside_plan=counts.samples_outside_plan,
        events_other_plan=counts.events_other_plan,
        batches_total=spec.total_batches if spec else 0,
        batches_done=counts.batches_done,
        batches_queued=queues.batches_queued,
        files_waiting_upload=queues.files_queued,
        dead_letters=queues.dead_letters,
        dead_samples=sorted(dead_samples),
        samples_requeued=counts.samples_requeued,
        batch_redeliveries=fold.batch_redeliveries + queues.batch_redeliveries,
        file_redeliveries=fold.file_redeliveries + queues.file_redeliveries,
        dest=spec.dest if spec else None,
        done=done,
        failed=failed,
        failure_reason=failure_reason,
        destination_error=refusals[0].reason if refusals else None,
        destination_refusals=refusals,
        as_of=time.time(),
    )
