"""`hsx status`: one reading of a job's progress, as JSON or a short human summary."""

import asyncio
import json

from hsx import topology
from hsx.errors import HsxError
from hsx.jobs import require_job_spec
from hsx.natsconn import NatsSettings, close_connection, connect
from hsx.progress import ProgressTracker, status_view

DEFAULT_TIMEOUT_S = 120.0


async def read_status(settings: NatsSettings, job: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Read the job's events up to the newest one (at most `timeout_s`), then its queues."""
    nc = await connect(settings, name=f"hsx-status-{job}")
    try:
        js = nc.jetstream()
        kv = await topology.ensure_topology(js)
        spec = await require_job_spec(kv, job)
        # Heartbeats too: an uploader's says when the destination refuses it (the job's failure reason).
        tracker = ProgressTracker(js, job, plan=spec.plan_tag, heartbeats=True)

        async def catch_up() -> None:
            # Events arrive as soon as the first reader is subscribed, so the reading happens as
            # much during start() as after it: the timeout covers both.
            await tracker.start()
            await tracker.wait_caught_up(None)

        try:
            try:
                await asyncio.wait_for(catch_up(), timeout_s)
            except asyncio.TimeoutError:
                # A partial reading would under-count: say so instead of printing it.
                raise HsxError(
                    f"status of job {job}: its events were not all read within {timeout_s:g} s "
                    f"({len(tracker.fold.uploaded)} samples seen so far); NATS may be slow or "
                    "unreachable, or the job has many events: pass --timeout with more seconds"
                ) from None
            await tracker.refresh_queues()
        finally:
            await tracker.stop()
        return status_view(spec, tracker.fold, tracker.queues, job=job)
    finally:
        await close_connection(nc)


def format_status(view: dict, *, as_json: bool) -> str:
    if as_json:
        return json.dumps(view, sort_keys=True)
    state = "done" if view["done"] else ("FAILED" if view["failed"] else "running")
    lines = [
        f"job {view['job']}: {state}",
        f"  samples  uploaded {view['samples_uploaded']}/{view['total_samples']}, written {view['samples_written']}",
        f"  tokens   written {view['tokens_written']}/{view['total_tokens']}",
        f"  batches  done {view['batches_done']}/{view['batches_total']}, queued {view['batches_queued']}",
        f"  spool    {view['files_waiting_upload']} files waiting for upload",
        f"  redeliveries {view['batch_redeliveries'] + view['file_redeliveries']}, dead letters {view['dead_letters']}",
        f"  dest     {view['dest']}",
    ]
    if view.get("samples_truncated") or view.get("samples_skipped"):
        lines.append(f"  inputs   {view['samples_truncated']} truncated, {view['samples_skipped']} skipped "
                     f"(longer than max_seq_len; report: object store {view['input_report']})")
    if view.get("samples_outside_plan") or view.get("events_other_plan"):
        lines.append(f"  ignored  {view['samples_outside_plan']} samples outside the plan, "
                     f"{view['events_other_plan']} events of another plan under this job name")
    if view.get("failure_reason"):
        lines.append(f"  failure  {view['failure_reason']}")
    if view["dead_samples"]:
        lines.append(f"  dead samples {view['dead_samples'][:20]}{' ...' if len(view['dead_samples']) > 20 else ''}")
    return "\n".join(lines)
