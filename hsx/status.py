"""`hsx status`: one reading of a job's progress, as JSON or a short human summary."""

import json

from hsx import topology
from hsx.jobs import require_job_spec
from hsx.natsconn import NatsSettings, connect
from hsx.progress import ProgressTracker, status_view


async def read_status(settings: NatsSettings, job: str) -> dict:
    nc = await connect(settings, name=f"hsx-status-{job}")
    try:
        js = nc.jetstream()
        kv = await topology.ensure_topology(js)
        spec = await require_job_spec(kv, job)
        tracker = ProgressTracker(js, job)
        await tracker.start()
        try:
            await tracker.wait_caught_up()
            await tracker.refresh_queues()
        finally:
            await tracker.stop()
        return status_view(spec, tracker.fold, tracker.queues, job=job)
    finally:
        await nc.drain()


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
    if view["dead_samples"]:
        lines.append(f"  dead samples {view['dead_samples'][:20]}{' ...' if len(view['dead_samples']) > 20 else ''}")
    return "\n".join(lines)
