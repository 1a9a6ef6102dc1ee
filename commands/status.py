"""`hsx status`: one reading of a job's progress, as JSON or a short human summary: its state
(waiting for workers, running, stalled, failed, done), the workers alive, the rate over the last
minutes and the ETA, and, once done, how long it took. When NATS is not there, or holds no such
job, and the job looks like one `hsx up` ran here with its embedded NATS (which runs only while
`hsx up` does), the error says so and where the output is.
"""

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import msgspec
import nats.errors
import structlog

from hsx.commands.configs import DEFAULT_SUMS_BUDGET_S, DEFAULT_TIMEOUT_S
from hsx.errors import HsxError
from hsx.wire import topology
from hsx.wire.counts import marker_times, recent_upload_rate
from hsx.wire.jobs import require_job_spec
from hsx.wire.natsconn import NatsSettings, close_connection, connect, redact_url
from hsx.wire.statusview import STALLED, StatusView, human_duration, status_view
from hsx.wire.tracker import ProgressTracker

log = structlog.get_logger("hsx.status")

# The rate `hsx status` reports: samples uploaded over this many recent seconds.
RATE_WINDOW_S = 120.0
# Where `hsx up` keeps its embedded NATS and its output when run without --workdir
# (commands/up.py): read, never written, to tell a user why its job cannot be found.
UP_WORKDIR = Path("hsx-demo")


def _up_hint(job: str, workdir: Path = UP_WORKDIR) -> str | None:
    """Why the job is not found, when it is one `hsx up` ran in this directory: its NATS was the
    embedded one, gone with `hsx up`. None when nothing of `hsx up` is here."""
    store = workdir / "nats"
    if not store.is_dir():
        return None
    bundle = workdir / "out" / job / "_hsx" / "job.json"
    dest = None
    try:
        dest = json.loads(bundle.read_text()).get("dest")
    except (OSError, ValueError, AttributeError):
        pass
    where = f"{dest.rstrip('/')}/{job}" if dest else f"{workdir / 'out' / job} (if that job wrote there)"
    return (
        f"the embedded NATS of hsx up (store {store}) is not running: it runs only while hsx up does. "
        f"The job's output is at {where}; hsx export reads it from there. To see its status or run "
        f"hsx verify --job {job}, run hsx up again (with the same --workdir): it starts that NATS, "
        "finds the job where it was and finishes at once if it is done"
    )


async def read_status(
    settings: NatsSettings,
    job: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    sums_budget_s: float = DEFAULT_SUMS_BUDGET_S,
) -> StatusView:
    """`_read_status`, with the hint of `_up_hint` when NATS or the job is not there."""
    try:
        return await _read_status(settings, job, timeout_s=timeout_s, sums_budget_s=sums_budget_s)
    except HsxError as exc:
        text = str(exc)
        missing = text.startswith("cannot connect to NATS") or text.startswith(f"job {job} not found")
        hint = _up_hint(job) if missing else None
        if hint is None:
            raise
        raise HsxError(f"job {job}: not at NATS {redact_url(settings.url)}; {hint}") from None


async def _read_status(
    settings: NatsSettings,
    job: str,
    *,
    timeout_s: float,
    sums_budget_s: float,
) -> StatusView:
    """Count the job's markers and read its queues, fold the markers since the checkpoint for up
    to `sums_budget_s` and save how far it got; everything within `timeout_s`."""
    nc = await connect(settings, name=f"hsx-status-{job}")
    try:
        js = nc.jetstream()
        kv = await topology.require_jobs_bucket(js, job)
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
                started_at, last_uploaded_at = await asyncio.wait_for(marker_times(js, job, spec.plan_tag), left())
                rate = await asyncio.wait_for(
                    recent_upload_rate(js, job, spec.plan_tag, window_s=RATE_WINDOW_S, started_at=started_at), left()
                )
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
        return status_view(
            spec,
            tracker.fold,
            tracker.queues,
            tracker.counts,
            job=job,
            sums_complete=complete,
            samples_per_s=rate,
            started_at=started_at,
            last_uploaded_at=last_uploaded_at,
        )
    finally:
        await close_connection(nc)


def _still_publishing(view: StatusView) -> str:
    if view.plan_complete or not view.exists:
        return ""
    if view.rounds_published:
        return f" (of the {view.rounds_published} rounds the producer has published so far)"
    return " (the producer is still publishing the plan)"


def format_status(view: StatusView, *, as_json: bool) -> str:
    if as_json:
        return json.dumps(msgspec.to_builtins(view), sort_keys=True)
    state = view.state.upper() if view.state == "failed" else view.state
    if view.state == STALLED:
        state += ": no worker alive" + (
            f" for {view.no_worker_alive_s:.0f} s" if view.no_worker_alive_s is not None else ""
        )
    if view.done and view.elapsed_s is not None:
        state += f", {human_duration(view.elapsed_s)} from the first sample written to the last stored"
        if view.average_samples_per_s:
            state += f" ({view.average_samples_per_s:.2f} samples/s)"
    workers = ", ".join(
        f"{count} {_SERVICE_WORDS.get(service, service)}" for service, count in view.workers_alive.items()
    )
    lines = [
        f"job {view.job}: {state}",
        f"  model    {view.model}, layers {','.join(map(str, view.layers))}",
        f"  workers  alive: {workers or 'none'}",
        *_kernel_lines(view),
        f"  samples  uploaded {view.samples_uploaded}/{view.total_samples}, written {view.samples_written}"
        + _still_publishing(view),
        f"  tokens   written {view.tokens_written}/{view.total_tokens}"
        + ("" if view.sums_complete else " (so far read; run hsx status again, or keep hsx monitor running)"),
        f"  batches  done {view.batches_done}/{view.batches_total}, queued {view.batches_queued}",
    ]
    if not view.done:
        rate = "?" if view.samples_per_s is None else f"{view.samples_per_s:.2f}"
        lines.append(
            f"  rate     {rate} samples/s over the last {RATE_WINDOW_S / 60:.0f} min, ETA {human_duration(view.eta_s)}"
        )
    lines += [
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
    elif view.destination_error:
        lines.append(f"  dest error {view.destination_error}")
    if view.dead_samples:
        lines.append(f"  dead samples {view.dead_samples[:20]}{' ...' if len(view.dead_samples) > 20 else ''}")
    return "\n".join(lines)


def _kernel_lines(view: StatusView) -> list[str]:
    """One line per distinct set of kernels the live consumers run (most consumers first)."""
    counts = Counter(consumer.kernels for consumer in view.consumers if consumer.kernels is not None)
    lines = []
    for kernels, count in counts.most_common():
        parts = [f"attention {kernels.attention}"]
        if kernels.linear_attention is not None:
            parts.append(f"linear attention {kernels.linear_attention}")
        if kernels.conv1d is not None:
            parts.append(f"conv1d {kernels.conv1d}")
        if kernels.compiled:
            parts.append("compiled")
        elif kernels.compile_error:
            parts.append(f"eager (compile failed: {kernels.compile_error})")
        lines.append(f"  kernels  {', '.join(parts)} ({count} consumer{'s' if count > 1 else ''})")
    return lines


_SERVICE_WORDS = {"gpu_consumer": "consumers", "uploader": "uploaders", "producer": "producers"}
