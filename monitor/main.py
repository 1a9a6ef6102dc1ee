"""`hsx monitor`: one `progress` line per interval, `consumer_silent` for a worker whose
heartbeat stopped, and a `job_summary` when every sample is in the destination.

With --until-done it exits 0 once the job is done, and 1 once it cannot finish (everything left
is dead-lettered), naming the dead samples.
"""

import asyncio
import time

import nats.errors
import structlog

from hsx import topology
from hsx.jobs import wait_for_job_spec
from hsx.lifecycle import stop_event_on_signals
from hsx.natsconn import connect
from hsx.progress import ProgressTracker, status_view
from monitor.config import MonitorConfig
from monitor.rates import RateWindow, eta_seconds

log = structlog.get_logger("hsx.monitor")


def _silent_workers(tracker: ProgressTracker, silent_after_s: float) -> list[dict]:
    now = time.time()
    return [
        {"instance": beat.instance, "service": beat.service, "node": beat.node, "last_batch": beat.detail,
         "silent_s": round(now - beat.sent_at, 1)}
        for beat in tracker.fold.heartbeats.values()
        if beat.state != "stopping" and now - beat.sent_at > silent_after_s
    ]


_DEGRADED_STATES = ("paused", "retrying", "disk_full")


def _degraded_workers(tracker: ProgressTracker, silent_after_s: float) -> list[dict]:
    """Live workers that say they cannot make progress: a consumer paused at the spool's high-water
    mark or waiting for disk space, an uploader retrying a failing destination."""
    now = time.time()
    return [
        {"instance": beat.instance, "service": beat.service, "node": beat.node, "state": beat.state, "detail": beat.detail}
        for beat in tracker.fold.heartbeats.values()
        if beat.state in _DEGRADED_STATES and now - beat.sent_at <= silent_after_s
    ]


def _live_workers(tracker: ProgressTracker, silent_after_s: float) -> int:
    now = time.time()
    return sum(1 for beat in tracker.fold.heartbeats.values()
               if beat.state != "stopping" and now - beat.sent_at <= silent_after_s)


async def run(cfg: MonitorConfig) -> int:
    stopping = stop_event_on_signals()
    structlog.contextvars.bind_contextvars(job=cfg.job)
    nc = await connect(cfg.nats, name=f"hsx-monitor-{cfg.job}")
    try:
        js = nc.jetstream()
        kv = await topology.ensure_topology(js)
        spec = await wait_for_job_spec(kv, cfg.job, stopping)
        if spec is None:
            return 0
        tracker = ProgressTracker(js, cfg.job, heartbeats=True)
        await tracker.start()
        started = time.monotonic()
        token_rate, sample_rate = RateWindow(), RateWindow()
        summarised = False
        reported_silent: set[str] = set()
        try:
            while not stopping.is_set():
                try:
                    spec = await wait_for_job_spec(kv, cfg.job, stopping)
                except (nats.errors.Error, asyncio.TimeoutError) as exc:  # NATS reconnecting: keep the last spec
                    log.warning("job_spec_unavailable", error=str(exc) or type(exc).__name__)
                if spec is None:
                    break
                try:
                    await tracker.refresh_queues()
                except Exception as exc:  # NATS reconnecting: report on the next tick
                    log.warning("queue_state_unavailable", error=str(exc) or type(exc).__name__)
                view = status_view(spec, tracker.fold, tracker.queues, job=cfg.job)
                token_rate.add(view["tokens_written"])
                sample_rate.add(view["samples_uploaded"])
                tokens_per_s = token_rate.per_second()
                eta = eta_seconds(view["total_tokens"] - view["tokens_written"], tokens_per_s)
                log.info(
                    "progress",
                    samples_uploaded=view["samples_uploaded"], samples_written=view["samples_written"],
                    samples_total=view["total_samples"], tokens_done=view["tokens_written"],
                    tokens_total=view["total_tokens"], samples_per_s=round(sample_rate.per_second(), 2),
                    tokens_per_s=round(tokens_per_s, 1), eta_s=None if eta is None else round(eta, 1),
                    batches_done=view["batches_done"], batches_total=view["batches_total"],
                    batches_queued=view["batches_queued"], spool_backlog_files=view["files_waiting_upload"],
                    redeliveries=view["batch_redeliveries"] + view["file_redeliveries"],
                    dead_letters=view["dead_letters"],
                    workers=_live_workers(tracker, cfg.silent_after_s),
                )
                for degraded in _degraded_workers(tracker, cfg.silent_after_s):
                    log.warning("worker_degraded", **degraded)
                for silent in _silent_workers(tracker, cfg.silent_after_s):
                    if silent["instance"] not in reported_silent:
                        log.warning("consumer_silent", **silent)
                        reported_silent.add(silent["instance"])
                reported_silent &= {s["instance"] for s in _silent_workers(tracker, cfg.silent_after_s)}
                if view["done"] and not summarised:
                    log.info(
                        "job_summary", samples=view["samples_uploaded"], tokens=view["tokens_uploaded"],
                        bytes=view["bytes_uploaded"], batches=view["batches_done"], dest=view["dest"],
                        redeliveries=view["batch_redeliveries"] + view["file_redeliveries"],
                        dead_letters=view["dead_letters"], monitored_s=round(time.monotonic() - started, 1),
                    )
                    summarised = True
                    if cfg.until_done:
                        return 0
                if view["failed"] and cfg.until_done:
                    log.error("job_failed", dead_samples=view["dead_samples"], dead_letters=view["dead_letters"],
                              samples_uploaded=view["samples_uploaded"], samples_total=view["total_samples"])
                    return 1
                try:
                    await asyncio.wait_for(stopping.wait(), timeout=cfg.interval_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            await tracker.stop()
        return 0
    finally:
        await nc.drain()
