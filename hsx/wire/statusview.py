"""One reading of a job, as `hsx status` prints it and the monitor reports from (`StatusView`),
made from what was counted (hsx/wire/counts.py) and folded (hsx/wire/fold.py): `done`, `failed`
and its reason, the job's `state` (waiting for workers, running, stalled, failed, done), the
workers alive by service, and the uploaders' word that the destination refuses or fails their
writes, all from the workers' last heartbeats. A worker that said goodbye (`stopping`) is gone,
not alive and not silent.
"""

import time
from dataclasses import dataclass

import msgspec

from hsx.job import JobSpec, Layer
from hsx.wire import schemas, topology
from hsx.wire.counts import ProgressCounts, QueueState
from hsx.wire.fold import ProgressFold

# The job's states (`StatusView.state`).
WAITING = "waiting for workers"  # published, nothing done yet, no worker alive
RUNNING = "running"
STALLED = "stalled"  # work left, something done, no worker alive (for `no_worker_alive_s`)
FAILED = "failed"
DONE = "done"
GONE = "stopping"  # the last heartbeat of a worker that stopped cleanly
WORKER_SERVICES = ("gpu_consumer", "uploader")  # always in `workers_alive`, 0 when none


class DestinationRefusal(msgspec.Struct, frozen=True, kw_only=True):
    """A live uploader's word that the destination refuses its writes."""

    uploader: str
    node: str
    reason: str | None


class ConsumerView(msgspec.Struct, frozen=True, kw_only=True):
    """A live GPU consumer, as its last heartbeat tells it."""

    instance: str
    node: str
    state: str
    # What its forward runs (gpu_consumer/kernels.py); None while it loads its model.
    kernels: schemas.Kernels | None


class StatusView(msgspec.Struct, frozen=True, kw_only=True):
    """One reading of a job: what `hsx status --json` prints (docs/reference/progress.md, "hsx status"),
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
    # Added fields (defaults keep older readers of the JSON and constructors working):
    state: str = RUNNING  # WAITING, RUNNING, STALLED, FAILED or DONE
    no_worker_alive_s: float | None = None  # with STALLED: seconds since the last live heartbeat
    workers_alive: dict[str, int] = {}  # service -> workers whose heartbeat is live (not stopping)
    samples_per_s: float | None = None  # samples uploaded per second, over a recent window
    eta_s: float | None = None  # seconds to done at samples_per_s; None while no rate is known
    model: str = ""
    layers: list[Layer] = []
    started_at: float | None = None  # the job's first `written` marker (server time)
    finished_at: float | None = None  # once done: its last `uploaded` marker
    elapsed_s: float | None = None  # from started_at to finished_at (done) or to now
    average_samples_per_s: float | None = None  # samples uploaded / elapsed_s
    consumers: list[ConsumerView] = []  # the live GPU consumers, by instance
    # The whole plan is in the queue. False while the producer still publishes it (in rounds:
    # the totals above are those of the rounds published so far, `rounds_published`) or if it
    # stopped before the end (`failure_reason` says why once what it published has run).
    plan_complete: bool = True
    rounds_published: int = 0


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


def live_heartbeats(heartbeats: dict[str, schemas.Heartbeat], *, now: float, live_s: float) -> list[schemas.Heartbeat]:
    """The heartbeats of workers alive at `now`: younger than `live_s` and not a goodbye."""
    return [beat for beat in heartbeats.values() if beat.state != GONE and now - beat.sent_at <= live_s]


def workers_alive(heartbeats: dict[str, schemas.Heartbeat], *, now: float, live_s: float) -> dict[str, int]:
    alive = dict.fromkeys(WORKER_SERVICES, 0)
    for beat in live_heartbeats(heartbeats, now=now, live_s=live_s):
        alive[beat.service] = alive.get(beat.service, 0) + 1
    return alive


def live_consumers(heartbeats: dict[str, schemas.Heartbeat], *, now: float, live_s: float) -> list[ConsumerView]:
    return [
        ConsumerView(instance=beat.instance, node=beat.node, state=beat.state, kernels=beat.kernels)
        for beat in sorted(live_heartbeats(heartbeats, now=now, live_s=live_s), key=lambda beat: beat.instance)
        if beat.service == "gpu_consumer"
    ]


def destination_trouble(heartbeats: dict[str, schemas.Heartbeat], *, now: float, live_s: float) -> str | None:
    """What a live uploader last said about the destination while retrying its uploads (an
    endpoint it cannot reach, a timeout): not a refusal, and not a failure, but the reason nothing
    is uploaded. The newest such word."""
    retrying = sorted(
        (
            beat
            for beat in live_heartbeats(heartbeats, now=now, live_s=live_s)
            if beat.service == "uploader" and beat.state == "retrying" and beat.detail
        ),
        key=lambda beat: beat.sent_at,
        reverse=True,
    )
    return retrying[0].detail if retrying else None


def job_state(
    *,
    done: bool,
    failed: bool,
    alive: dict[str, int],
    anything_done: bool,
    heartbeats: dict[str, schemas.Heartbeat],
    now: float,
) -> tuple[str, float | None]:
    """(the job's state, with STALLED the seconds since the newest heartbeat of any worker)."""
    if done:
        return DONE, None
    if failed:
        return FAILED, None
    if any(alive.values()):
        return RUNNING, None
    if not anything_done:
        return WAITING, None
    newest = max((beat.sent_at for beat in heartbeats.values() if beat.service in WORKER_SERVICES), default=None)
    return STALLED, None if newest is None else round(max(0.0, now - newest), 1)


def human_duration(seconds: float | None) -> str:
    """A duration as `hsx status` and the monitor's bar show it: 1h05m, 3m07s, 42s; "?" unknown."""
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


@dataclass(frozen=True)
class _Verdict:
    done: bool
    failed: bool
    reason: str | None  # why it failed
    refusals: list  # the destination's refusals the live uploaders report


def _verdict(
    spec: JobSpec | None,
    fold: ProgressFold,
    queues: QueueState,
    counts: ProgressCounts,
    *,
    job: str,
    now: float,
    live_s: float,
) -> _Verdict:
    """Whether the job is done, or failed and why: done once every planned sample of this plan
    has its `uploaded` marker and nothing is left in flight (a batch redelivered after a crash
    may still be queued although its samples were already uploaded); failed when it cannot finish
    by itself (every missing sample dead, the producer stopped, the destination refusing)."""
    total = spec.total_samples if spec else 0
    uploaded = counts.samples_uploaded
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
    reason = (
        f"{len(dead_samples)} samples dead-lettered and nothing else left to run (hsx dead list --job {job})"
        if failed
        else None
    )
    if spec is not None and spec.stopped and not spec.published and drained:
        # The producer stopped before publishing the whole plan (a refusal in a later round,
        # producer/publishing.py) and what it published has run: the job cannot finish by itself.
        failed = True
        reason = f"the producer stopped before publishing the whole plan: {spec.stopped}"
    # A refusing destination (a missing bucket, bad credentials, a denied permission) is a failure
    # for as long as it lasts: nothing is uploaded until someone fixes it, then it clears by itself.
    refusals = [] if done else destination_refusals(fold.heartbeats, now=now, live_s=live_s)
    # One worker's word alone does not fail a job while other workers make progress (a heartbeat
    # may come from anyone who can publish on the job's subjects): a refusal is the job's failure
    # once the job's uploaders hold files they have not stored (JetStream's count, not a
    # heartbeat's), every live uploader says the destination refuses and no live consumer is
    # working; until then it is shown.
    live = live_heartbeats(fold.heartbeats, now=now, live_s=live_s)
    outvoted = any(
        (beat.service == "uploader" and beat.state != "refused")
        or (beat.service == "gpu_consumer" and beat.state == "working")
        for beat in live
    )
    if refusals and queues.files_in_hand and not outvoted:
        failed = True
        reason = f"the destination refuses uploads: {refusals[0].reason}"
    return _Verdict(done=done, failed=failed, reason=reason, refusals=refusals)


def status_view(
    spec: JobSpec | None,
    fold: ProgressFold,
    queues: QueueState,
    counts: ProgressCounts,
    *,
    job: str,
    now: float | None = None,
    live_s: float = 30.0,
    sums_complete: bool = True,
    samples_per_s: float | None = None,
    started_at: float | None = None,
    last_uploaded_at: float | None = None,
    as_of: float | None = None,
) -> StatusView:
    """The reading of the job from what was counted and folded. Heartbeats older than `live_s` at `now` (default: the time now) are not taken as the word of a
    live worker. `sums_complete`: the fold has read every marker there was when it started.
    `samples_per_s`: the upload rate the caller measured over a recent window (the ETA's);
    `started_at`, `last_uploaded_at`: the times of the job's first `written` and last `uploaded`
    markers, when known (the elapsed time and the average rate). `as_of`: the moment the reading
    holds everything stored before (default: the time now)."""
    now = time.time() if now is None else now
    total = spec.total_samples if spec else 0
    uploaded = counts.samples_uploaded
    verdict = _verdict(spec, fold, queues, counts, job=job, now=now, live_s=live_s)
    done, failed, failure_reason, refusals = verdict.done, verdict.failed, verdict.reason, verdict.refusals
    dead_samples = set(counts.dead_unfinished)
    destination_error = refusals[0].reason if refusals else None
    if destination_error is None and not done:
        destination_error = destination_trouble(fold.heartbeats, now=now, live_s=live_s)
    alive = workers_alive(fold.heartbeats, now=now, live_s=live_s)
    anything_done = uploaded > 0 or counts.batches_done > 0 or fold.samples_written > 0
    state, no_worker_alive_s = job_state(
        done=done, failed=failed, alive=alive, anything_done=anything_done, heartbeats=fold.heartbeats, now=now
    )
    if done:
        eta_s: float | None = 0.0
    elif failed or not samples_per_s:
        eta_s = None
    else:
        eta_s = round(max(0, total - uploaded) / samples_per_s, 1)
    finished_at = last_uploaded_at if done else None
    elapsed_s = None
    if started_at is not None:
        elapsed_s = round(max(0.0, (finished_at if finished_at is not None else now) - started_at), 1)
    average = round(uploaded / elapsed_s, 3) if elapsed_s else None
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
        destination_error=destination_error,
        destination_refusals=refusals,
        as_of=time.time() if as_of is None else as_of,
        state=state,
        no_worker_alive_s=no_worker_alive_s,
        workers_alive=alive,
        samples_per_s=None if samples_per_s is None else round(samples_per_s, 3),
        eta_s=eta_s,
        model=spec.model if spec else "",
        layers=list(spec.layers) if spec else [],
        started_at=started_at,
        finished_at=finished_at,
        elapsed_s=elapsed_s,
        average_samples_per_s=average,
        consumers=live_consumers(fold.heartbeats, now=now, live_s=live_s),
        plan_complete=spec.published if spec else False,
        rounds_published=len(spec.round_starts) if spec else 0,
    )
