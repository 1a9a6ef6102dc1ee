"""`hsx monitor`: one reading of the job per interval, shown as a `progress` JSON line (stdout not a
terminal) or a progress bar redrawn in place (a terminal), and served as Prometheus metrics with
--metrics-port; `consumer_silent` for a worker whose heartbeat stopped, `consumer_stalled` for a
GPU consumer whose forward ran past its bound, `worker_degraded` for one that cannot make
progress, `destination_failed` (and `destination_recovered`) when uploaders say the destination
refuses them, and a `job_summary` when every sample is in the destination. Then it writes the
job's index (`<job>/_hsx/index.arrow`, hsx/storage/index.py) from the `uploaded` events, so that readers
open the job without listing it.

Its log is its product, so it goes to stdout (`hsx: error:` lines stay on stderr). With
--http it serves the job's live page (monitor/web.py) from the same readings. With
--until-done it exits 0 (DONE) once the job is done, and 65 (JOB_FAILED) once it cannot finish
(everything left is dead-lettered, or the destination refuses uploads), naming why. Stopped by a
signal before the job was done, it exits 75 (STOPPED); after (without --until-done), 0.
hsx/exitcodes.py has the contract.
"""

import asyncio
import shutil
import sys
import time
from typing import TYPE_CHECKING

import structlog

from hsx.exitcodes import DONE, JOB_FAILED, STOPPED
from hsx.job import JobSpec
from hsx.logs import configure_logging
from hsx.monitor.bar import TerminalBar, render_bar
from hsx.monitor.config import MonitorConfig
from hsx.monitor.metrics import JobCollector, serve_metrics
from hsx.monitor.pagefeed import PageMaker
from hsx.monitor.rates import RateWindow
from hsx.monitor.report import (
    degraded_workers,
    progress_line,
    silent_workers,
    stalled_workers,
    summary_line,
    take_reading,
)
from hsx.storage.index import build_job_index
from hsx.wire.counts import marker_times
from hsx.wire.statusview import status_view
from hsx.wire.tracker import READING_WAIT_S, ProgressTracker
from hsx.wire.worker import JobWatch, job_session

if TYPE_CHECKING:
    from hsx.monitor.web import WebServer

log = structlog.get_logger("hsx.monitor")

# How often the monitor saves its sums for the next reader (hsx/wire/fold.py).
CHECKPOINT_EVERY_S = 15.0
# At the job's end, how long the summary waits for the last markers to reach the sums.
SUMS_AT_END_WAIT_S = 30.0


def _open_output(cfg: MonitorConfig) -> TerminalBar | None:
    """Point the process's log at stdout: as JSON lines, or above a bar that holds the last line."""
    if cfg.output == "bar":
        bar = TerminalBar(sys.stdout)
        configure_logging(json=False, level=cfg.log_level, file=bar.above)
        return bar
    configure_logging(json=True, level=cfg.log_level, file=sys.stdout)
    return None


async def run(cfg: MonitorConfig) -> int:
    bar = _open_output(cfg)
    collector = JobCollector(cfg.job) if cfg.metrics_port else None
    server = serve_metrics(collector, host=cfg.metrics_host, port=cfg.metrics_port) if collector else None
    if server is not None:
        log.info("metrics_serving", url=f"http://{cfg.metrics_host}:{cfg.metrics_port}/metrics")
    page = None
    try:
        if cfg.http_listen is not None:
            # Imported only when asked for: a monitor without a page loads no web server.
            from hsx.monitor.web import WebServer

            page = WebServer(job=cfg.job, interval_s=cfg.interval_s, silent_after_s=cfg.silent_after_s)
            log.info("page_serving", url=await page.start(*cfg.http_listen))
        return await _follow(cfg, bar, collector, page)
    finally:
        if page is not None:
            await page.close()
        if bar is not None:
            bar.finish() if cfg.leave_bar else bar.clear()
        if server is not None:
            server.shutdown()
            server.server_close()


async def _write_index(js, spec: JobSpec) -> None:
    """A job without its index is still whole (readers list it instead), so a failure here is a
    warning naming the command that redoes it, not the monitor's failure."""
    try:
        await build_job_index(js, spec)
    except Exception as exc:
        log.warning(
            "index_not_written",
            dest=spec.dest,
            error=f"{type(exc).__name__}: {exc}"[:300],
            retry=f"hsx index build --job {spec.job}",
        )


async def _follow(
    cfg: MonitorConfig, bar: TerminalBar | None, collector: JobCollector | None, page: "WebServer | None"
) -> int:
    async with job_session(cfg.nats, cfg.job, name=f"hsx-monitor-{cfg.job}") as session:
        if session is None:
            return STOPPED  # a signal came before the job's spec
        js, kv, spec, stopping = session.js, session.kv, session.spec, session.stopping
        maker = None
        if page is not None:
            page.attach(js, kv)
            maker = PageMaker(js, kv, job=cfg.job, silent_after_s=cfg.silent_after_s)
        # A job deleted (or produced again with another plan) under the monitor ends it: the
        # counts it follows are the old plan's.
        watch = JobWatch(kv, spec, stopping)
        tracker = ProgressTracker(js, cfg.job, plan=spec.plan_tag, heartbeats=True)
        await tracker.start()
        readings = _Readings(cfg, tracker, bar, collector, page=page, maker=maker)
        reported = _Reported(cfg)
        summarised = False
        try:
            while not stopping.is_set():
                if await watch.check():
                    break
                spec = watch.current  # NATS reconnecting: the last spec read
                view, reading = await readings.take(spec, summarised=summarised)
                reported.log(view, tracker.fold.heartbeats)
                if view.done and not summarised:
                    await _summarise(js, spec, reading, monitored_s=time.monotonic() - readings.started)
                    summarised = True
                    if cfg.until_done:
                        return DONE
                if view.failed and cfg.until_done:
                    log.error(
                        "job_failed",
                        reason=view.failure_reason,
                        dead_samples=view.dead_samples,
                        dead_letters=view.dead_letters,
                        samples_uploaded=view.samples_uploaded,
                        samples_total=view.total_samples,
                    )
                    return JOB_FAILED
                try:
                    await asyncio.wait_for(stopping.wait(), timeout=cfg.interval_s)
                except TimeoutError:
                    pass
        finally:
            await tracker.stop()
            try:
                await tracker.save_checkpoint()
            except Exception as exc:  # the next reader folds from the last checkpoint: nothing lost
                log.warning("checkpoint_not_saved", error=str(exc) or type(exc).__name__)
        watch.raise_if_lost()
        # Stopped by a signal: without --until-done a monitor that saw the job done says so.
        return DONE if summarised else STOPPED


class _Readings:
    """One reading per interval: the tracker refreshed (its checkpoint saved every
    CHECKPOINT_EVERY_S), the job's status view and the reading with its rates, shown on the bar,
    as a `progress` log line, as metrics and on the page (--http)."""

    def __init__(
        self,
        cfg: MonitorConfig,
        tracker: ProgressTracker,
        bar: TerminalBar | None,
        collector: JobCollector | None,
        *,
        page: "WebServer | None",
        maker: PageMaker | None,
    ) -> None:
        self.cfg, self.tracker, self.bar, self.collector = cfg, tracker, bar, collector
        self.page, self.maker = page, maker
        self.started = self.saved = time.monotonic()
        self.token_rate, self.sample_rate = RateWindow(), RateWindow()

    async def take(self, spec: JobSpec, *, summarised: bool):
        cfg, tracker = self.cfg, self.tracker
        try:
            await tracker.refresh(wait_s=READING_WAIT_S)
            if time.monotonic() - self.saved >= CHECKPOINT_EVERY_S:
                await tracker.save_checkpoint()
                self.saved = time.monotonic()
        except Exception as exc:  # NATS reconnecting: report on the next tick
            log.warning("queue_state_unavailable", error=str(exc) or type(exc).__name__)
        if spec.published and tracker.counts.samples_uploaded == spec.total_samples and not summarised:
            # The counts are read at once, the sums as their markers arrive: the summary
            # waits until the sums hold every marker there is.
            await tracker.wait_sums_current(timeout=SUMS_AT_END_WAIT_S)
        view = status_view(
            spec,
            tracker.fold,
            tracker.queues,
            tracker.counts,
            job=cfg.job,
            live_s=cfg.silent_after_s,
            sums_complete=tracker.sums_caught_up,
            as_of=tracker.as_of,
        )
        if tracker.sums_caught_up:  # not while catching up from a checkpoint: no rate spike
            self.token_rate.add(view.tokens_written)
        self.sample_rate.add(view.samples_uploaded)
        reading = take_reading(
            view,
            tracker.fold.heartbeats,
            now=time.time(),
            silent_after_s=cfg.silent_after_s,
            tokens_per_s=self.token_rate.per_second(),
            samples_per_s=self.sample_rate.per_second(),
        )
        if self.collector is not None:
            self.collector.update(reading)
        if self.maker is not None:
            try:
                self.page.publish(cfg.job, *await self.maker.make(spec, tracker, as_of=view.as_of))
            except Exception as exc:  # NATS reconnecting: the page keeps its last reading
                log.warning("page_not_updated", error=str(exc) or type(exc).__name__)
        if self.bar is not None:
            self.bar.draw(render_bar(reading, job=cfg.job, width=shutil.get_terminal_size().columns))
        else:
            log.info("progress", **progress_line(reading))
        return view, reading


class _Reported:
    """The workers' troubles, each logged once while it lasts: a degraded worker every reading,
    a silent or stalled one when it becomes so (again after it recovered), the destination's
    refusal when it starts and when it clears."""

    def __init__(self, cfg: MonitorConfig) -> None:
        self.cfg = cfg
        self.silent: set[str] = set()
        self.stalled: set[tuple[str, str]] = set()  # (instance, batch)
        self.refusal: str | None = None  # the destination's refusal last logged

    def log(self, view, heartbeats) -> None:
        now, silent_after_s = time.time(), self.cfg.silent_after_s
        for degraded in degraded_workers(heartbeats, now=now, silent_after_s=silent_after_s, done=view.done):
            log.warning("worker_degraded", **degraded)
        silent = silent_workers(heartbeats, now=now, silent_after_s=silent_after_s, done=view.done)
        for worker in silent:
            if worker["instance"] not in self.silent:
                log.warning("consumer_silent", **worker)
                self.silent.add(worker["instance"])
        # A worker that beats again and then falls silent is reported again.
        self.silent &= {worker["instance"] for worker in silent}
        stalled = stalled_workers(heartbeats, now=now, silent_after_s=silent_after_s)
        for worker in stalled:
            if (worker["instance"], worker["batch"]) not in self.stalled:
                log.warning("consumer_stalled", **worker)
                self.stalled.add((worker["instance"], worker["batch"]))
        self.stalled &= {(worker["instance"], worker["batch"]) for worker in stalled}
        # A refusal, not an uploader retrying (`destination_error` says that too): that is a
        # `worker_degraded` warning, and not the job's failure.
        refused = view.destination_refusals[0].reason if view.destination_refusals else None
        if refused != self.refusal:
            if refused:
                log.error(
                    "destination_failed", dest=view.dest, reason=refused, uploaders=len(view.destination_refusals)
                )
            else:
                log.info("destination_recovered", dest=view.dest)
            self.refusal = refused


async def _summarise(js, spec: JobSpec, reading, *, monitored_s: float) -> None:
    """`job_summary`, with the time from the job's first `written` to its last `uploaded` marker
    where they are read; then the job's index written."""
    elapsed_s = None
    try:
        first, last = await marker_times(js, spec.job, spec.plan_tag)
        if first is not None and last is not None:
            elapsed_s = max(0.0, last - first)
    except Exception as exc:  # the summary says the monitored time instead
        log.warning("job_times_unavailable", error=str(exc) or type(exc).__name__)
    log.info("job_summary", **summary_line(reading, monitored_s=monitored_s, elapsed_s=elapsed_s))
    await _write_index(js, spec)
