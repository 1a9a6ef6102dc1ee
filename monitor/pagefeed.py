"""Readings of a job for the web page (`hsx monitor --http`): `PageMaker` turns what a
`ProgressTracker` holds into the page's data (monitor/page.py) and the status `hsx status --json`
prints, with the rates and the rate history of its own readings; `JobFollower` keeps one for a
job the monitor does not follow (a second job opened from the page's list), reading it every
interval while a browser looks at it.

It reads NATS (the job's marker times, the files waiting per node, the jobs bucket's names) and
the destination's free space; it knows nothing of HTTP. The job the monitor follows is read by its
own loop (monitor/main.py), which calls `PageMaker.make` after each of its readings.
"""

import asyncio
import shutil
import time

import msgspec
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from hsx.job import JobSpec
from hsx.logs import get_logger
from hsx.monitor.page import DestinationRoom, RateHistory, Rates, page_data
from hsx.monitor.rates import RateWindow
from hsx.monitor.report import take_reading
from hsx.storage.location import spec_location
from hsx.wire.counts import marker_times
from hsx.wire.jobs import job_names, read_job_spec, waiting_files
from hsx.wire.statusview import StatusView, status_view
from hsx.wire.tracker import READING_WAIT_S, ProgressTracker

log = get_logger("hsx.monitor")

# How often the slower readings are taken again: the jobs bucket's names, the destination's free space.
SLOW_READ_S = 30.0


def status_json(view: StatusView) -> bytes:
    """`hsx status --json`'s output for `view` (commands/status.py format_status), as bytes."""
    return msgspec.json.encode(msgspec.to_builtins(view), order="sorted")


def destination_room(dest: str) -> DestinationRoom | None:
    """The free bytes at a local destination (its nearest existing folder); None for a remote
    store (S3, ...) or when the path cannot be read from here."""
    try:
        measured = spec_location(dest).local_folder
    except Exception:  # noqa: BLE001 - a spec's dest was checked where it was decoded; nothing to show
        return None
    if measured is None:
        return None
    while not measured.exists() and measured != measured.parent:
        measured = measured.parent
    try:
        return DestinationRoom(measured=str(measured), free=shutil.disk_usage(measured).free)
    except OSError:
        return None


class PageMaker:
    """The page of one job, made after each reading of its tracker."""

    def __init__(self, js: JetStreamContext, kv: KeyValue, *, job: str, silent_after_s: float) -> None:
        self.js, self.kv, self.job, self.silent_after_s = js, kv, job, silent_after_s
        self.written, self.uploaded = RateWindow(), RateWindow()
        self.tokens_written, self.tokens_uploaded = RateWindow(), RateWindow()
        self.history = RateHistory()
        self.started_at: float | None = None
        self.last_uploaded_at: float | None = None
        self._ended = False  # the last `uploaded` marker read once every sample had one
        self._plan = ""
        self._slow_read_at = -SLOW_READ_S
        self._jobs: list[str] = []
        self._room: DestinationRoom | None = None

    async def make(self, spec: JobSpec, tracker: ProgressTracker, *, as_of: float) -> tuple[dict, bytes]:
        """(the page's data, the status JSON), from what `tracker` holds now, which holds everything
        stored before `as_of` (ProgressTracker.refresh)."""
        if spec.plan_tag != self._plan:  # a job produced again under its name: another plan's times
            self._plan, self.started_at, self.last_uploaded_at, self._ended = spec.plan_tag, None, None, False
        fold, counts = tracker.fold, tracker.counts
        # The first `written` marker until there is one; the last `uploaded` one once every
        # sample has its marker (it is only shown then: the job's end).
        all_uploaded = spec.published and counts.samples_uploaded == spec.total_samples
        if self.started_at is None or (all_uploaded and not self._ended):
            self.started_at, self.last_uploaded_at = await marker_times(self.js, self.job, spec.plan_tag)
            self._ended = all_uploaded
        files_waiting = await waiting_files(self.js, self.job)
        if time.monotonic() - self._slow_read_at >= SLOW_READ_S:
            self._slow_read_at = time.monotonic()
            self._jobs = await job_names(self.kv)
            self._room = await asyncio.to_thread(destination_room, spec.dest)
        now = time.monotonic()
        self.written.add(fold.samples_written, now)
        self.uploaded.add(counts.samples_uploaded, now)
        if tracker.sums_caught_up:  # not while catching up from a checkpoint: no rate spike
            self.tokens_written.add(fold.tokens_written, now)
            self.tokens_uploaded.add(fold.tokens_uploaded, now)
        rates = Rates(
            samples_written=self.written.per_second(),
            samples_uploaded=self.uploaded.per_second(),
            tokens_written=self.tokens_written.per_second(),
            tokens_uploaded=self.tokens_uploaded.per_second(),
        )
        view = status_view(
            spec,
            fold,
            tracker.queues,
            counts,
            job=self.job,
            live_s=self.silent_after_s,
            sums_complete=tracker.sums_caught_up,
            samples_per_s=rates.samples_uploaded if self.started_at is not None else None,
            started_at=self.started_at,
            last_uploaded_at=self.last_uploaded_at,
            as_of=as_of,
        )
        self.history.add(
            view.as_of, rates.samples_written, rates.samples_uploaded, rates.tokens_written, rates.tokens_uploaded
        )
        reading = take_reading(
            view,
            fold.heartbeats,
            now=view.as_of,
            silent_after_s=self.silent_after_s,
            tokens_per_s=rates.tokens_written,
            samples_per_s=rates.samples_uploaded,
        )
        page = page_data(
            reading,
            spec=spec,
            heartbeats=fold.heartbeats,
            rates=rates,
            history=self.history,
            silent_after_s=self.silent_after_s,
            batches_in_hand=tracker.queues.batches_in_hand,
            files_waiting=files_waiting,
            dead_errors=fold.dead_errors,
            room=self._room,
            jobs=self._jobs,
            now=view.as_of,
        )
        return page, status_json(view)


class JobFollower:
    """Reads a job the monitor does not follow, every `interval_s`, handing each page and status
    to `publish(job, page, status)`, until `stop()` or the job is gone (deleted from the bucket)."""

    def __init__(
        self,
        js: JetStreamContext,
        kv: KeyValue,
        spec: JobSpec,
        *,
        interval_s: float,
        silent_after_s: float,
        publish,
    ) -> None:
        self.js, self.kv, self.spec, self.interval_s, self.publish = js, kv, spec, interval_s, publish
        self.maker = PageMaker(js, kv, job=spec.job, silent_after_s=silent_after_s)
        self.tracker = ProgressTracker(js, spec.job, plan=spec.plan_tag, heartbeats=True)
        self._stopping = asyncio.Event()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        self._stopping.set()
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)

    async def _run(self) -> None:
        job = self.spec.job
        try:
            try:
                await self.tracker.start()
            except Exception as exc:  # NATS away, or the job's streams gone: the page says no reading
                log.warning("page_reading_unavailable", job=job, error=str(exc) or type(exc).__name__)
                return
            while not self._stopping.is_set():
                try:
                    spec = await read_job_spec(self.kv, job)
                    if spec is None or spec.plan_tag != self.spec.plan_tag:
                        log.info("page_job_gone", job=job)
                        return
                    self.spec = spec
                    as_of = await self.tracker.refresh(wait_s=READING_WAIT_S) or time.time()
                    page, status = await self.maker.make(spec, self.tracker, as_of=as_of)
                    self.publish(job, page, status)
                except Exception as exc:  # NATS reconnecting: the next tick tries again
                    log.warning("page_reading_unavailable", job=job, error=str(exc) or type(exc).__name__)
                try:
                    await asyncio.wait_for(self._stopping.wait(), timeout=self.interval_s)
                except TimeoutError:
                    pass
        finally:
            await self.tracker.stop()
