"""What every worker (consumer, uploader, monitor) does around its own work, written once:
start-up (`job_session`: signals, log context, connection, topology, the job spec, waited for and
asked after), heartbeats from the moment it exists to its goodbye (`heartbeats`), the watch on the
job spec it serves (`JobWatch`, `watching`), whether the job is over (`JobVerdict`: done or failed
as `hsx monitor --until-done` reads it; a trainer's stream ends its first epoch on it too), the end
of a worker run with --until-done (`JobEnd`, `until_done`: the job over, the worker's own work
settled), the code a worker exits with once its loop ends (`worker_exit_code`), and the spooling
workers' shared settings (`WorkerConfig`). The pull loop itself is hsx/wire/pull.py.
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from hsx.config.fields import option
from hsx.config.values import positive_float
from hsx.errors import JobFailed
from hsx.exitcodes import DONE, JOB_FAILED, STOPPED, ExitCode
from hsx.job import JobSpec
from hsx.logs import get_logger
from hsx.wire import topology
from hsx.wire.events import (
    EventPublisher,
    WorkerState,
    goodbye_heartbeat,
    heartbeat_loop,
)
from hsx.wire.health import DEFAULT_ADDR, listen_address, parse_listen
from hsx.wire.jobs import read_job_spec, wait_for_job
from hsx.wire.lifecycle import StopEvent, stop_event_on_signals
from hsx.wire.natsconn import NatsSettings, close_connection, connect
from hsx.wire.spec_changes import RefusedChange, refused_change
from hsx.wire.statusview import StatusView, status_view
from hsx.wire.topology import job_name
from hsx.wire.tracker import ProgressTracker

log = get_logger("hsx.worker")


# --wait-for-job when not given under --until-done: a worker of a batch scheduler (a job that
# ends, an allocation that costs) gives up on a job that is not there after this long.
UNTIL_DONE_WAIT_FOR_JOB_S = 600.0


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """The settings every spooling worker (consumer, uploader) has; its flags are declared here
    once for both (hsx/config/fields.py)."""

    nats: NatsSettings
    instance: str  # unique per process across machines: named by the process itself (commands/services.py)
    job: str = option(
        "--job",
        parse=job_name,
        job=True,
        file_key="name",
        env="HSX_JOB",
        example="qwen27b-l5",
        help="the job to work on",
    )
    # The entry point makes it absolute.
    spool: Path = option(
        "--spool",
        default=Path("hsx-spool"),
        parse=Path,
        env="HSX_SPOOL",
        help="local spool directory for finished files; the uploaders of this node read the same one "
        "(env HSX_SPOOL, default ./hsx-spool)",
    )
    # None: the entry point names the node after the host.
    node: str = option(
        "--node",
        default=None,
        env="HSX_NODE",
        example="gpu-node-1",
        help="this node's name (env HSX_NODE, default the host name)",
    )
    # How long a message may go without a sign of life before JetStream redelivers it; the
    # durable holds it, so it is shared by every worker of the job. in_progress() is sent well inside it.
    ack_wait_s: float = option(
        "--ack-wait",
        default=60.0,
        parse=positive_float("--ack-wait"),
        env="HSX_ACK_WAIT",
        help="seconds without a sign of life before JetStream redelivers a message (default 60)",
    )
    until_done: bool = option(
        "--until-done",
        default=False,
        env="HSX_UNTIL_DONE",
        help="exit 0 once the job is done and this worker's own work is settled, 65 once the job "
        "cannot finish (everything left is dead-lettered), as hsx monitor --until-done decides; "
        "stopped before either (SIGTERM), 75",
    )
    # None: wait for the job's spec for as long as it takes (workers may start before the producer).
    # Not given, the entry point makes it UNTIL_DONE_WAIT_FOR_JOB_S under --until-done
    # (commands/services.py): a batch scheduler's worker never waits for ever for a mistyped job.
    wait_for_job_s: float | None = option(
        "--wait-for-job",
        default=None,
        parse=positive_float("--wait-for-job"),
        env="HSX_WAIT_FOR_JOB",
        example=600.0,
        help="give up (exit 2, naming the jobs there are) when the job has not been produced within "
        "this many seconds (default: 600 with --until-done, else wait as long as it takes; either way "
        "saying so every 30 s)",
    )
    # Probes for a scheduler (hsx/wire/health.py): off unless a port is given.
    health_port: str | None = option(
        "--health-port",
        default=None,
        parse=parse_listen("--health-port"),
        env="HSX_HEALTH_PORT",
        metavar="[ADDR:]PORT",
        example="9200",
        help="serve GET /readyz (200 once it takes work) and GET /livez (200 while its loop turns) on "
        "this port, on --health-addr unless ADDR:PORT is given (default: off)",
    )
    health_addr: str = option(
        "--health-addr",
        default=DEFAULT_ADDR,
        env="HSX_HEALTH_ADDR",
        metavar="ADDR",
        help="address the health port listens on (default %(default)s; 0.0.0.0 for a Kubernetes "
        "httpGet probe, which comes to the pod's address)",
    )
    heartbeat_s: float = 5.0
    idle_fetch_timeout_s: float = 1.0

    @property
    def health_listen(self) -> tuple[str, int] | None:
        """(address, port) of the health probes; None: off."""
        return None if self.health_port is None else listen_address(self.health_port, self.health_addr)

    @property
    def in_progress_s(self) -> float:
        return max(0.5, min(10.0, self.ack_wait_s / 3))


class JobLost(JobFailed):
    """The job this worker served was deleted, or its name now carries another plan."""


def _identity(spec: JobSpec) -> tuple:
    # What makes a job the one a worker started for. `published` and the counters change while
    # it runs; a job deleted and produced again gets a new created_at even with the same plan.
    return spec.plan_fingerprint, spec.dest, spec.created_at


class JobWatch:
    """Whether the job a worker started for is still the job of its name in KV bucket hsx_jobs.

    `check()` reads the spec; once it is gone or another (`lost` says which, in one line) the
    worker's stop event is set and it stays lost. `watch()` checks every `every_s` until stopping.
    A message of another plan (JobSpec.owns) asks for a check at once: a worker that is still
    current takes such a message for a stray of an earlier job of the name; a lost one hands it back."""

    def __init__(self, kv: KeyValue, spec: JobSpec, stopping: asyncio.Event, *, every_s: float = 5.0) -> None:
        self.kv, self.spec, self.stopping, self.every_s = kv, spec, stopping, every_s
        self.lost = ""
        self.current = spec  # the spec as last adopted (its `published` flag changes while it runs)
        self._refused: RefusedChange | None = None  # the last change refused, said once

    async def check(self) -> str:
        if self.lost:
            return self.lost
        try:
            current = await read_job_spec(self.kv, self.spec.job)
        except Exception as exc:  # NATS away, or a spec that does not decode: not a verdict
            log.warning("job_spec_unavailable", error=str(exc) or type(exc).__name__)
            return ""
        job, plan = self.spec.job, self.spec.plan_tag
        if current is None:
            self.lost = f"job {job} was deleted while this worker served it (plan {plan}); stopped"
        elif _identity(current) == _identity(self.spec):
            self._adopt(current)
        else:
            self.lost = (
                f"job {job} was deleted and produced again (now plan {current.plan_tag}, dest {current.dest}) while "
                f"this worker served plan {plan}; stopped: start a new worker for the new job"
            )
        if self.lost:
            log.error("job_lost", reason=self.lost)
            self.stopping.set()
        return self.lost

    def _adopt(self, read: JobSpec) -> None:
        """The spec read again, when it moved only as the producer moves it (hsx/wire/spec_changes.py);
        otherwise the spec held stays, and one warning line per refused change says which field."""
        refused = refused_change(self.current, read)
        if refused is None:
            self.current = read
            return
        if refused != self._refused:
            self._refused = refused
            log.warning("job_spec_change_refused", field=refused.field, change=refused.describe())

    async def current_for(self, covers: Callable[[JobSpec], bool]) -> JobSpec:
        """The spec as last read, or, when it does not `covers` a message and the plan is still
        being published (in rounds: it grows, each round recorded before its batches go out),
        as read again now."""
        if covers(self.current) or self.current.published:
            return self.current
        await self.check()
        return self.current

    async def placed(self, covers: Callable[[JobSpec], bool]) -> bool | None:
        """Whether the job's plan covers a message (`covers(spec)`): True when the spec as last read,
        or as read again now, does; None when it does not and the plan is still being published
        (a round is recorded before its batches go out, so this is not a message of the plan yet:
        ask again later, never set it aside for good); False when the whole plan is recorded
        (published, or its producer stopped) and does not cover it."""
        spec = await self.current_for(covers)
        if covers(spec):
            return True
        return False if spec.published or spec.stopped else None

    async def watch(self) -> None:
        while not self.stopping.is_set():
            try:
                await asyncio.wait_for(self.stopping.wait(), timeout=self.every_s)
            except TimeoutError:
                await self.check()

    def raise_if_lost(self) -> None:
        if self.lost:
            raise JobLost(self.lost)


@contextlib.asynccontextmanager
async def watching(watch: JobWatch) -> AsyncIterator[None]:
    """`watch.watch()` beside the block; JobLost on leaving it if the job was lost meanwhile."""
    task = asyncio.create_task(watch.watch())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    watch.raise_if_lost()


@dataclass(frozen=True, kw_only=True)
class Session:
    nc: Client
    js: JetStreamContext
    kv: KeyValue
    spec: JobSpec
    stopping: StopEvent


@contextlib.asynccontextmanager
async def job_session(
    nats: NatsSettings, job: str, *, name: str, wait_s: float | None = None, **log_context: str
) -> AsyncIterator[Session | None]:
    """Connected, with the topology ensured and the job's spec read; None if a stop came before the
    spec did. `name` is the connection's name (`nats server report connections` shows it). The
    spec is waited for, said every 30 s, for at most `wait_s` (None: as long as it takes;
    hsx.wire.jobs.wait_for_job)."""
    stopping = stop_event_on_signals()
    structlog.contextvars.bind_contextvars(job=job, **log_context)
    nc = await connect(nats, name=name)
    try:
        js = nc.jetstream()
        started = time.monotonic()
        kv = await topology.wait_for_jobs_bucket(js, job, stopping, wait_s=wait_s)
        left = None if wait_s is None else max(0.0, wait_s - (time.monotonic() - started))
        spec = None if kv is None else await wait_for_job(kv, job, stopping, wait_s=left, given_wait_s=wait_s)
        yield None if spec is None else Session(nc=nc, js=js, kv=kv, spec=spec, stopping=stopping)
    finally:
        await close_connection(nc)


@contextlib.asynccontextmanager
async def heartbeats(
    events: EventPublisher,
    cfg: WorkerConfig,
    *,
    service: str,
    stopping: asyncio.Event,
    state: Callable[[], WorkerState],
) -> AsyncIterator[Callable[[], None]]:
    """Beats `state()` while the block runs, and at once each time the callable it yields is
    called (a change the monitor should see now); on leaving it, however (a start that failed
    too), the beats stop and the goodbye (`stopping`) is sent, so the worker's last word is that it is gone.
    A second signal (hsx.wire.lifecycle) sends the goodbye before it ends the process. A worker
    refused before it exists (a device it cannot use) opens no block: it sends no heartbeat."""

    async def goodbye() -> None:
        await goodbye_heartbeat(
            events, service=service, instance=cfg.instance, node=cfg.node, state=state, spool=str(cfg.spool)
        )
        await events.nc.flush(timeout=1)

    wake = asyncio.Event()
    beats = asyncio.create_task(
        heartbeat_loop(
            events,
            service=service,
            instance=cfg.instance,
            node=cfg.node,
            interval_s=cfg.heartbeat_s,
            stopping=stopping,
            state=state,
            spool=str(cfg.spool),
            wake=wake,
        )
    )
    if isinstance(stopping, StopEvent):
        stopping.last_words = goodbye
    try:
        yield wake.set
    finally:
        beats.cancel()
        await asyncio.gather(beats, return_exceptions=True)
        if isinstance(stopping, StopEvent):
            stopping.last_words = None
        await goodbye_heartbeat(
            events, service=service, instance=cfg.instance, node=cfg.node, state=state, spool=str(cfg.spool)
        )


# How often a worker run with --until-done reads whether its job is over.
DONE_CHECK_S = 2.0
# How long the first reading of the dead letters may take before the verdict waits for the next.
_DEAD_LETTERS_READ_S = 30.0


class JobVerdict:
    """Whether a job is over, read as `hsx monitor --until-done` reads it (hsx.wire.statusview):
    `done`, every planned sample uploaded and nothing queued; `failed`, nothing queued and every
    missing sample dead-lettered, or the producer stopped before the whole plan and what it
    published has run. A destination that refuses uploads is not a verdict: its files stay
    queued, and it clears once fixed. Used by `JobEnd` and by a trainer's `JobStream`.

    The queues are read first (a few requests); the dead letters and counts only once they are
    empty, when the job may be over: a reader replays the job's letters then, not while it works."""

    def __init__(self, js: JetStreamContext, watch: JobWatch) -> None:
        self.js, self.watch = js, watch
        self.tracker = ProgressTracker(js, watch.spec.job, plan=watch.spec.plan_tag, sums=False)
        self._started = False

    async def read(self) -> StatusView | None:
        """The job's reading once it is done or failed; None while it is not over."""
        spec, tracker = self.watch.current, self.tracker
        queues = await tracker.refresh_queues()
        over = spec.published or bool(spec.stopped)  # a plan still being published is not over
        if queues.batches_queued or queues.files_queued or not over:
            return None
        if not self._started:
            await tracker.start()
            self._started = True
        try:
            await tracker.wait_caught_up(_DEAD_LETTERS_READ_S, sums=False)
        except TimeoutError:
            return None  # the letters are still being read: no verdict without them
        await tracker.refresh_counts()
        view = status_view(spec, tracker.fold, tracker.queues, tracker.counts, job=spec.job)
        return view if view.done or view.failed else None

    async def stop(self) -> None:
        await self.tracker.stop()


class JobEnd:
    """--until-done: whether the job is over (`JobVerdict`), and whether this worker's own work is
    `settled()` (nothing in hand). `check()` is the reading; `watch()` checks every `every_s` and,
    once the job is over and the worker settled, logs the verdict and sets the stop event: the
    worker then stops as on a signal, and exits `exit_code` (DONE or JOB_FAILED; STOPPED until a
    verdict)."""

    def __init__(
        self,
        js: JetStreamContext,
        watch: JobWatch,
        stopping: asyncio.Event,
        *,
        settled: Callable[[], bool],
        every_s: float = DONE_CHECK_S,
    ) -> None:
        self.watch, self.stopping, self.settled, self.every_s = watch, stopping, settled, every_s
        self.verdict_of_job = JobVerdict(js, watch)
        self.verdict = ""  # "done" or "failed", once over
        self.exit_code: ExitCode = STOPPED

    async def check(self) -> str:
        """The verdict once the job is over and this worker settled, else ""."""
        if not self.settled():
            return ""
        view = await self.verdict_of_job.read()
        if view is None:
            return ""
        if view.done:
            log.info("job_done", samples_uploaded=view.samples_uploaded, samples_total=view.total_samples)
            self.verdict, self.exit_code = "done", DONE
        else:
            log.error(
                "job_failed",
                reason=view.failure_reason,
                dead_samples=view.dead_samples[:20],
                dead_letters=view.dead_letters,
                samples_uploaded=view.samples_uploaded,
                samples_total=view.total_samples,
            )
            self.verdict, self.exit_code = "failed", JOB_FAILED
        return self.verdict

    async def watch_until_over(self) -> None:
        try:
            while not self.stopping.is_set():
                try:
                    await asyncio.wait_for(self.stopping.wait(), timeout=self.every_s)
                    return
                except TimeoutError:
                    pass
                try:
                    if await self.check():
                        self.stopping.set()
                        return
                except Exception as exc:  # NATS reconnecting: read again at the next tick
                    log.warning("job_state_unavailable", error=str(exc) or type(exc).__name__)
        finally:
            await self.verdict_of_job.stop()


def worker_exit_code(end: JobEnd | None) -> ExitCode:
    """A worker's exit code once its loop has ended without an error: the job's verdict under
    --until-done (DONE or JOB_FAILED), else STOPPED: a signal stopped it before it was told that
    the job is over, so running it again is safe and may be needed."""
    return end.exit_code if end is not None and end.verdict else STOPPED


@contextlib.asynccontextmanager
async def until_done(end: JobEnd | None) -> AsyncIterator[None]:
    """`end.watch_until_over()` beside the block (nothing without --until-done)."""
    if end is None:
        yield
        return
    task = asyncio.create_task(end.watch_until_over())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
