"""What every worker (consumer, uploader, monitor) does around its own work, written once:
start-up (`job_session`: signals, log context, connection, topology, the job spec), heartbeats
from the moment it exists to its goodbye (`heartbeats`), the watch on the job spec it serves
(`JobWatch`, `watching`), and the spooling workers' shared settings (`WorkerConfig`). The pull
loop itself is hsx/wire/pull.py.
"""

import asyncio
import contextlib
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
from hsx.wire import schemas, topology
from hsx.wire.events import (
    EventPublisher,
    WorkerState,
    goodbye_heartbeat,
    heartbeat_loop,
)
from hsx.wire.jobs import read_job_spec, wait_for_job_spec
from hsx.wire.lifecycle import stop_event_on_signals
from hsx.wire.natsconn import NatsSettings, close_connection, connect
from hsx.wire.topology import job_name

log = structlog.get_logger("hsx.worker")


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """The settings every spooling worker (consumer, uploader) has; its flags are declared here
    once for both (hsx/config/fields.py)."""

    nats: NatsSettings
    instance: str  # unique per process across machines: named by the process itself (commands/services.py)
    job: str = option(
        "--job", parse=job_name, job=True, file_key="name", example="qwen27b-l5", help="the job to work on"
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
        help="seconds without a sign of life before JetStream redelivers a message (default 60)",
    )
    heartbeat_s: float = 5.0
    idle_fetch_timeout_s: float = 1.0

    @property
    def in_progress_s(self) -> float:
        return max(0.5, min(10.0, self.ack_wait_s / 3))


class JobLost(JobFailed):
    """The job this worker served was deleted, or its name now carries another plan."""


def _identity(spec: schemas.JobSpec) -> tuple:
    # What makes a job the one a worker started for. `published` and the counters change while
    # it runs; a job deleted and produced again gets a new created_at even with the same plan.
    return spec.plan_fingerprint, spec.dest, spec.created_at


class JobWatch:
    """Whether the job a worker started for is still the job of its name in KV bucket hsx_jobs.

    `check()` reads the spec; once it is gone or another (`lost` says which, in one line) the
    worker's stop event is set and it stays lost. `watch()` checks every `every_s` until stopping.
    A message of another plan (JobSpec.owns) asks for a check at once: a worker that is still
    current takes such a message for a stray of an earlier job of the name; a lost one hands it back."""

    def __init__(self, kv: KeyValue, spec: schemas.JobSpec, stopping: asyncio.Event, *, every_s: float = 5.0) -> None:
        self.kv, self.spec, self.stopping, self.every_s = kv, spec, stopping, every_s
        self.lost = ""
        self.current = spec  # the spec as last read (its `published` flag changes while it runs)

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
            self.current = current
        else:
            self.lost = (
                f"job {job} was deleted and produced again (now plan {current.plan_tag}, dest {current.dest}) while "
                f"this worker served plan {plan}; stopped: start a new worker for the new job"
            )
        if self.lost:
            log.error("job_lost", reason=self.lost)
            self.stopping.set()
        return self.lost

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
    spec: schemas.JobSpec
    stopping: asyncio.Event


@contextlib.asynccontextmanager
async def job_session(nats: NatsSettings, job: str, *, name: str, **log_context: str) -> AsyncIterator[Session | None]:
    """Connected, with the topology ensured and the job's spec read; None if a stop came before the
    spec did. `name` is the connection's name (`nats server report connections` shows it)."""
    stopping = stop_event_on_signals()
    structlog.contextvars.bind_contextvars(job=job, **log_context)
    nc = await connect(nats, name=name)
    try:
        js = nc.jetstream()
        kv = await topology.ensure_topology(js)
        spec = await wait_for_job_spec(kv, job, stopping)
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
    ready: Callable[[], bool] = lambda: True,
) -> AsyncIterator[None]:
    """Beats `state()` while the block runs; on leaving it the beats stop, then, if the worker is
    `ready()` by then (it got to serve), the goodbye is sent."""
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
        )
    )
    try:
        yield
    finally:
        beats.cancel()
        await asyncio.gather(beats, return_exceptions=True)
        if ready():
            await goodbye_heartbeat(
                events, service=service, instance=cfg.instance, node=cfg.node, state=state, spool=str(cfg.spool)
            )
