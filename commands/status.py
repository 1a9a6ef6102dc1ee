"""`hsx status`: one reading of a job's progress, as JSON or a short human summary."""

import asyncio
import json
import time

import msgspec
import nats.errors
import structlog

from hsx.commands.configs import DEFAULT_SUMS_BUDGET_S, DEFAULT_TIMEOUT_S
from hsx.errors import HsxError
from hsx.wire import topology
from hsx.wire.jobs import require_job_spec
from hsx.wire.natsconn import NatsSettings, close_connection, connect
from hsx.wire.statusview import StatusView, status_view
from hsx.wire.tracker import ProgressTracker

log = structlog.get_logger("hsx.status")


async def read_status(
    settings: NatsSettings,
    job: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    sums_budget_s: float = DEFAULT_SUMS_BUDGET_S,
) -> StatusView:
    """Count the job's markers and read its queues, fold the markers since the checkpoint for up
    to `sums_budget_s` and save how far it got; everything within `timeout_s`."""
    nc = await connect(settings, name=f"hsx-status-{job}")
    try:
        js = nc.jetstream()
        kv = await topology.ensure_topology(js)
        spec = await require_job_spec(kv, job)
        # Heartbeats too: an uploader's says when the destination refuses it (the job's failure reason).
        tracker = ProgressTracker(js, job, plan=spec.plan_tag, heartbeats=True)
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        try:
            try:
                # Dead letters and heartbeats are read whole: a reading without them could miss a failure.
                await asyncio.wait_for(tracker.start(), left())
                await tracker.wait_caught_up(left(), sums=False)
                sums_started = time.monotonic()
                try:
                    await tracker.wait_caught_up(min(sums_budget_s, left()))
                except TimeoutError:
                    log.info(
                        "status_sums_short",
                        job=job,
                        budget_s=sums_budget_s,
                        waited_s=round(time.monotonic() - sums_started, 3),
                    )
                complete = tracker.sums_caught_up
                await tracker.stop()  # the sums stay as they are now, what `sums_complete` describes
                await asyncio.wait_for(tracker.refresh_counts(), left())
                await asyncio.wait_for(tracker.refresh_queues(), left())
            except TimeoutError:
                raise HsxError(
                    f"status of job {job}: NATS did not answer within {timeout_s:g} s (slow or unreachable); "
                    "pass --timeout with more seconds"
                ) from None
        finally:
            await tracker.stop()
        try:
            await asyncio.wait_for(tracker.save_checkpoint(), max(1.0, left()))
        except (TimeoutError, nats.errors.Error) as exc:  # the next reading folds again: nothing lost
            log.warning("checkpoint_not_saved", job=job, error=str(exc) or type(exc).__name__)
        return status_view(spec, tracker.fold, tracker.queues, tracker.counts, job=job, sums_complete=complete)
    finally:
        await close_connection(nc)


def format_status(view: StatusView, *, as_json: bool) -> str:
    if as_json:
        return json.dumps(msgspec.to_builtins(view), sort_keys=True)
    state = "done" if view.done else ("FAILED" if view.failed else "running")
    lines = [
        f"job {view.job}: {state}",
        f"  samples  uploaded {view.samples_uploaded}/{view.total_samples}, written {view.samples_written}",
        f"  tokens   written {view.tokens_written}/{view.total_tokens}"
        + ("" if view.sums_complete else " (so far read; run hsx status again, or keep hsx monitor running)"),
        f"  batches  done {view.batches_done}/{view.batches_total}, queued {view.batches_queued}",
        f"  spool    {view.files_waiting_upload} files waiting for upload",
        f"  redeliveries {view.batch_redeliveries + view.file_redeliveries}, dead letters {view.dead_letters}",
        f"  dest     {view.dest}",
    ]
    if view.samples_truncated or view.samples_skipped:
        lines.append(
            f"  inputs   {view.samples_truncated} truncated, {view.samples_skipped} skipped "
            f"(longer than max_seq_len; report: object store {view.input_report})"
        )
    if view.rows_bad:
        lines.append(
            f"  bad rows {view.rows_bad} set aside (--on-bad-row skip; report: object store {view.input_report})"
        )
    if view.samples_outside_plan or view.events_other_plan:
        lines.append(
            f"  ignored  {view.samples_outside_plan} samples outside the plan, "
            f"{view.events_other_plan} events of another plan under this job name"
        )
    if view.failure_reason:
        lines.append(f"  failure  {view.failure_reason}")
    if view.dead_samples:
        lines.append(f"  dead samples {view.dead_samples[:20]}{' ...' if len(view.dead_samples) > 20 else ''}")
    return "\n".join(lines)
