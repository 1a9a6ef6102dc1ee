"""`hsx up`: one whole job on this machine, each service a separate process.

Starts whatever is not given: a nats-server with its JetStream store in the workdir, a small
random-initialised model, a synthetic dataset, a local destination. It starts `--consumers` GPU
consumers per device (`--device cuda`: every visible GPU, or those of `--devices`; the default,
`auto`, is `cuda` when torch sees a GPU, else `cpu`; hsx/model/devices.py), each its own process
shown only its own GPU and loading the model while the producer plans, `--uploaders` uploaders
sharing the consumers' spool, and the monitor, then makes what the demo needs and runs the
producer; it restarts a worker that crashes (a few times), and returns 0 when every sample is in
the destination. Everything lives in the workdir, so running it again resumes: the producer
publishes nothing twice and only unfinished work runs. Ctrl-C (or SIGTERM) stops every process
cleanly: workers finish their batch, then exit; up exits 75 (STOPPED). A process that ends in a
way up cannot go on from (a refused setting, the monitor or the producer dying, a worker that
keeps crashing) is named with its last error line; up stops the others and exits with the
contract's code for it (hsx/exitcodes.py `of_child`): 2 for bad input, 65 for a failed job, 1
for a crash.
"""

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from hsx.commands.child import order
from hsx.commands.embedded import (
    NatsServer,
    build_tiny_model,
    start_nats_server,
    write_synthetic_dataset,
)
from hsx.commands.services import BUILDERS
from hsx.config.fields import Flag, flag_fields, option
from hsx.config.settings import build_config, resolve
from hsx.config.values import positive_float, positive_int
from hsx.errors import HsxError, JobFailed, Unavailable
from hsx.exitcodes import BAD_INPUT, DONE, JOB_FAILED, STOPPED, of_child
from hsx.gpu_consumer.config import ConsumerConfig, ExpectedModel
from hsx.model.devices import auto_device, child_visible_devices, node_devices, node_gpus, torch_sees_cuda
from hsx.monitor.config import MonitorConfig
from hsx.producer.config import ProducerConfig
from hsx.storage.location import Location
from hsx.uploader.config import UploaderConfig
from hsx.wire.health import http_url, parse_listen
from hsx.wire.natsconn import NatsSettings, redact_url

log = structlog.get_logger("hsx.up")

# How often a worker that crashed (or whose device failed) is started again before up gives up.
_MAX_RESTARTS = 5
# How long a consumer waits for the demo model up makes while the consumers start: a random
# model of a few MB takes seconds; past it the consumer loads the model once the spec is read.
MODEL_MADE_WITHIN_S = 120.0
_STOP_DEADLINE_S = 90.0


# The job settings `hsx up` gives other defaults than `hsx produce`, on purpose: a demo on a
# laptop's CPU finishes in seconds with a small batch and short samples, and needs no flag at all.
# model, dataset and dest default to what up makes in the workdir.
UP_JOB_DEFAULTS = {"job": "demo", "layers": "1,3,5", "token_budget": 4096, "max_seq_len": 1024}
UP_MADE = {"model": None, "dataset": None, "dest": None}
# The producer's command-line-only flags up passes on, so that what its refusals advise
# (another plan's files in the job's folder, a disk too small) works for `hsx up` too.
UP_PRODUCER_FLAGS = ("--replace-output", "--ignore-free-space")


def passed_to_producer(flag: Flag) -> bool:
    """The producer's flags `hsx up` takes: the job's, and UP_PRODUCER_FLAGS."""
    return flag.job or flag.name in UP_PRODUCER_FLAGS


@dataclass(frozen=True, kw_only=True)
class UpConfig:
    # A server to use instead of starting one (`nats` is then it, with the credentials' flags):
    # --nats, HSX_NATS_URL or a job file's [nats] url, as for every other command; none of them
    # set, up starts its own.
    url: str | None = option(
        "--nats",
        default=None,
        env="HSX_NATS_URL",
        secret=redact_url,
        help="use this NATS server instead of starting one (env HSX_NATS_URL; default: start one)",
    )
    workdir: Path = option(
        "--workdir", default=Path("hsx-demo"), parse=Path, help="state, store, spool, logs (default ./hsx-demo)"
    )
    consumers: int = option(
        "--consumers",
        default=1,
        parse=positive_int("--consumers"),
        help="consumers per device (default 1): --device cuda --consumers 2 on 4 GPUs starts 8",
    )
    uploaders: int = option(
        "--uploaders",
        default=1,
        parse=positive_int("--uploaders"),
        help="uploader processes, sharing the consumers' spool (default 1)",
    )
    samples: int = option(
        "--samples", default=256, parse=positive_int("--samples"), help="synthetic dataset size (default 256)"
    )
    # "auto" until from_args resolves it (hsx/model/devices.py auto_device): then cpu, cuda, cuda:N.
    device: str = option(
        "--device",
        default="auto",
        help="where the consumers run: auto (default: cuda when torch sees a GPU, else cpu; "
        "hsx consume's default is cuda, its first GPU), cpu, cuda:N, or cuda for every visible GPU "
        "(CUDA_VISIBLE_DEVICES honoured), one consumer per GPU",
    )
    gpus: str | None = option(
        "--devices",
        default=None,
        metavar="LIST",
        example="0,2",
        help="with --device cuda: only these GPUs, e.g. 0,2 (default: every visible GPU)",
    )
    compile_layers: bool | None = option(
        "--compile",
        default=None,
        example=True,
        help="consumers torch.compile the decoder layers, on cpu too (hsx consume --compile; default: on with CUDA)",
    )
    no_compile: bool = option(
        "--no-compile", default=False, help="consumers never torch.compile (hsx consume --no-compile)"
    )
    allow_slow_kernels: bool = option(
        "--allow-slow-kernels",
        default=False,
        help="consumers on a GPU run a hybrid model on the torch fallback instead of refusing it "
        "(hsx consume --allow-slow-kernels)",
    )
    http: str | None = option(
        "--http",
        default=None,
        parse=parse_listen("--http"),
        env="HSX_HTTP_PORT",
        metavar="[ADDR:]PORT",
        example="8080",
        help="the monitor serves the job's live page on this port (hsx monitor --http) and up prints its "
        "address; ADDR is 127.0.0.1 unless given (env HSX_HTTP_PORT, default: off)",
    )
    timeout_s: float = option(
        "--timeout", default=3600.0, parse=positive_float("--timeout"), help="give up after this many seconds"
    )
    log_level: str = "info"
    nats: NatsSettings | None  # None: start a nats-server in the workdir (each child's nats is then replaced)
    # What up starts, each config resolved here once (flag > env > job file > default) with the
    # builders of its own command (commands/services.py) and passed to the child whole.
    producer: ProducerConfig  # model, dataset and dest made in the workdir where not given
    consumer: ConsumerConfig  # of every consumer, but for its device
    uploader: UploaderConfig
    monitor: MonitorConfig
    make_model: bool  # no --model: a small random model in the workdir
    make_dataset: bool  # no --dataset: --samples synthetic rows
    devices: tuple[str, ...]  # the device of each consumer group, from --device and --devices (hsx/model/devices.py)
    # The CUDA_VISIBLE_DEVICES entry of each GPU `cuda:i` of `devices` names (hsx/model/devices.py
    # visible_gpus); empty off CUDA.
    visible_gpus: tuple[str, ...] = ()
    # Why `device` is what it is when it was not given ("auto: torch sees CUDA"); None: given.
    device_chosen: str | None = None

    @classmethod
    def from_args(
        cls, parser, args: argparse.Namespace, *, nats: NatsSettings | None, environ=None, prepare: bool = True
    ) -> "UpConfig":
        """From `hsx up`'s resolved flags; each child's other settings resolved from `environ`
        (the process's), the job file and the defaults, as its own command would. Without
        `prepare` (hsx config show), nothing on this machine is made or asked: no spool, no GPUs."""
        environ = dict(os.environ if environ is None else environ)
        # Every process up starts on this node names it `local` unless told otherwise.
        environ.setdefault("HSX_NODE", "local")
        workdir = args.workdir.resolve()
        job = {
            field.name: getattr(args, field.name)
            for field, flag in flag_fields(ProducerConfig)
            if passed_to_producer(flag)
        }
        job["model"] = job["model"] or str(workdir / "model")
        job["dataset"] = job["dataset"] or workdir / "dataset.jsonl"
        job["dest"] = job["dest"] or Location.parse(workdir / "out")
        spool = workdir / "spool"
        # Which GPUs the consumers get is this machine's to say: not asked unprepared (config show).
        # --device auto (the default): this machine's GPUs if torch sees any, and why, for the log.
        device, chosen = (
            auto_device(args.device, args.gpus, cuda_visible=torch_sees_cuda) if prepare else (args.device, None)
        )
        visible = tuple(node_gpus(device)) if prepare else ()
        devices = tuple(node_devices(device, args.gpus, gpus=list(visible))) if prepare else (device,)
        stand_in = nats or NatsSettings(url="nats://embedded.invalid")  # replaced once the server runs

        def child(command: str, **given):
            namespace = argparse.Namespace(command=command, config=args.config, log_level=args.log_level, **given)
            resolve(parser, namespace, environ)
            return BUILDERS[command](namespace, stand_in, prepare=prepare)

        return build_config(
            cls,
            args,
            workdir=workdir,
            nats=nats,
            log_level=args.log_level,
            producer=child("produce", **job),
            consumer=child(
                "consume",
                job=args.job,
                device=devices[0],
                spool=spool,
                health_port=None,  # many processes here: one port (HSX_HEALTH_PORT) cannot serve them all
                # Given to up: passed on; not given: the consumer's own layers (HSX_COMPILE, ...) decide.
                **{
                    name: value
                    for name, value in (
                        ("compile_layers", args.compile_layers),
                        ("no_compile", args.no_compile or None),
                        ("allow_slow_kernels", args.allow_slow_kernels or None),
                    )
                    if value is not None
                },
            ),
            uploader=child("upload", job=args.job, spool=spool, health_port=None),
            monitor=replace(
                child(
                    "monitor",
                    job=args.job,
                    until_done=True,
                    interval_s=2.0,
                    **({"http": args.http} if args.http else {}),
                ),
                leave_bar=False,
            ),
            make_model=args.model is None,
            make_dataset=args.dataset is None,
            devices=devices,
            visible_gpus=visible,
            device=device,
            device_chosen=chosen,
        )


def consumer_configs(cfg: UpConfig) -> list[tuple[str, ConsumerConfig, dict[str, str]]]:
    """(name, config, environment) of each consumer: `--consumers` per device, each process on its
    own device, all on one spool (the node's uploaders read it). Each process names its own
    instance (`<node>-<pid>`), so their heartbeats are told apart.

    A GPU consumer is shown its GPU alone (CUDA_VISIBLE_DEVICES) and runs on `cuda:0`: the device
    every thread of it starts on is then the model's (kernels that launch on the current device,
    as Triton's do, land there), and each MIG slice gets a consumer of its own.

    Each loads the producer's model while the producer plans (ExpectedModel)."""
    producer = cfg.producer
    expected = ExpectedModel(
        model=producer.model,
        layers=producer.layers,
        dtype=producer.dtype,
        trust_remote_code=producer.trust_remote_code,
        made_within_s=MODEL_MADE_WITHIN_S if cfg.make_model else 0.0,
    )
    consumers = []
    for device in [device for device in cfg.devices for _ in range(cfg.consumers)]:
        visible = child_visible_devices(device, list(cfg.visible_gpus))
        consumer = replace(cfg.consumer, expected_model=expected)
        if visible is None:
            consumers.append((replace(consumer, device=device), {}))
        else:
            consumers.append((replace(consumer, device="cuda:0"), {"CUDA_VISIBLE_DEVICES": visible}))
    return [(f"consumer-{i}", consumer, env) for i, (consumer, env) in enumerate(consumers)]


class ChildFailed(HsxError):
    """A process up started ended so that up cannot go on: up exits with the contract's code for
    the child's (hsx/exitcodes.py `of_child`)."""

    def __init__(self, message: str, *, code: int | None) -> None:
        super().__init__(message)
        self.exit_code = of_child(code)


class Child:
    """One service process, its log file, and how often it was restarted. With `log_stdout`
    False only its stderr goes to the log (the monitor: its stdout is up's own output)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log_path: Path | None,
        *,
        stdin: bytes | None = None,
        log_stdout: bool = True,
    ) -> None:
        self.name, self.argv, self.env, self.log_path, self.stdin = name, argv, env, log_path, stdin
        self.log_stdout = log_stdout
        self.restarts = 0
        self.process: subprocess.Popen | None = None

    @classmethod
    def of(
        cls, name: str, cfg, *, log_level: str, env: dict[str, str], log_path: Path | None, log_stdout: bool = True
    ) -> "Child":
        """The service of `cfg`, in its own process, given the config whole (commands/child.py)."""
        argv = [sys.executable, "-m", "hsx.commands.child"]
        return cls(name, argv, env, log_path, stdin=order(cfg, log_level=log_level), log_stdout=log_stdout)

    def start(self) -> None:
        out = open(self.log_path, "ab") if self.log_path else None
        self.process = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.PIPE if self.stdin is not None else None,
            stdout=out if self.log_stdout else None,
            stderr=out or None,
            start_new_session=True,
        )
        if out:
            out.close()
        if self.stdin is not None:
            try:
                self.process.stdin.write(self.stdin)
            except BrokenPipeError:  # it died at once: poll() reports its exit code
                pass
            finally:
                try:
                    self.process.stdin.close()
                except BrokenPipeError:
                    pass

    def poll(self) -> int | None:
        return self.process.poll() if self.process else None

    def started(self) -> bool:
        return self.process is not None

    def terminate(self, signum: int = signal.SIGTERM) -> None:
        """`signum` is the one up was given (Ctrl-C: SIGINT), so the child's `stopping` line
        names what the user did."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, deadline: float) -> None:
        if not self.process:
            return
        try:
            self.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("child_killed_after_deadline", child=self.name)
            self.process.kill()
            self.process.wait()

    def last_error(self) -> str:
        """Its `hsx: error:` line, else its log's last line (a traceback's names the exception)."""
        if not self.log_path or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        for line in reversed(lines):
            if line.startswith("hsx: error:"):
                return line.removeprefix("hsx: error:").strip()
        return lines[-1][-300:] if lines else ""

    def failed(self, code: int | None, *, what: str = "exited") -> ChildFailed:
        """The error that ends up for this child's exit `code`, naming it, its last error and its
        log; logged at once, while up stops the others."""
        error = self.last_error() or "no error line in its log"
        log.error("child_failed", child=self.name, exit_code=code, error=error, log=str(self.log_path))
        return ChildFailed(f"{self.name} {what} with code {code}: {error} (log: {self.log_path})", code=code)


def hsx_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "hsx.cli", *args]


def stop_all(children: list[Child], signum: int = signal.SIGTERM) -> None:
    deadline = time.monotonic() + _STOP_DEADLINE_S
    for child in children:
        child.terminate(signum)
    for child in children:
        child.wait(deadline)


async def _job_recorded(nats: NatsSettings, job: str, *, within_s: float = 5.0) -> bool:
    """Whether some producer has recorded `job`'s spec (one short look; no answer is no)."""
    from hsx.wire.jobs import read_job_spec
    from hsx.wire.natsconn import connect
    from hsx.wire.topology import jobs_bucket

    async def look() -> bool:
        nc = await connect(nats, name="hsx-up")
        try:
            kv = await jobs_bucket(nc.jetstream())
            return kv is not None and await read_job_spec(kv, job) is not None
        finally:
            await nc.close()

    try:
        return await asyncio.wait_for(look(), timeout=within_s)
    except Exception:  # NATS slow or away: look again later; the producer's own log says why
        return False


def _stop_line(nats: NatsSettings, job: str) -> str:
    """Where an interrupted run stopped, and how to go on."""
    from hsx.commands.status import read_status

    try:
        view = asyncio.run(asyncio.wait_for(read_status(nats, job), timeout=10))
    except Exception:
        view = None
    if view is None or not view.exists:
        return f"hsx up: stopped before job {job} was recorded; run the same command to resume"
    return (
        f"hsx up: stopped at {view.samples_uploaded:,}/{view.total_samples:,} samples stored; "
        "run the same command to resume"
    )


def restart_crashed(workers: list[Child]) -> None:
    """Start again a worker that exited: a crash, a failed device, a signal from elsewhere (a worker
    up started runs until up stops it). One refused (BAD_INPUT: its settings, its device), one
    whose job failed under it (JOB_FAILED: the job deleted), or one restarted _MAX_RESTARTS times
    ends the run with its last error (ChildFailed)."""
    for child in workers:
        code = child.poll()
        if code is None:
            continue
        if code in (BAD_INPUT, JOB_FAILED):
            raise child.failed(code)
        if child.restarts >= _MAX_RESTARTS:
            raise child.failed(code, what=f"was restarted {child.restarts} times and exited again")
        child.restarts += 1
        log.warning(
            "worker_restarted", worker=child.name, exit_code=code, restarts=child.restarts, error=child.last_error()
        )
        child.start()


def check_monitor(monitor: Child) -> int | None:
    """The monitor's exit code once it ended with the job's verdict (DONE or JOB_FAILED), None
    while it runs; any other end (a crash, a signal not from up) is ChildFailed: up cannot tell
    whether the job is done without it."""
    code = monitor.poll()
    if code is None or code in (DONE, JOB_FAILED):
        return code
    raise monitor.failed(code)


def _interrupted(signum: int, monitor: Child, nats: NatsSettings, job: str) -> int:
    """Ctrl-C or SIGTERM: the monitor stops first (its bar leaves the terminal line), then up says
    where the job stopped and how to resume; the caller stops the rest."""
    monitor.terminate(signum)
    monitor.wait(time.monotonic() + 10)
    log.info("stopping", signal=signal.Signals(signum).name)
    print(_stop_line(nats, job), file=sys.stderr, flush=True)
    return STOPPED


def run_up(cfg: UpConfig) -> int:
    up_started = time.monotonic()
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    logs = cfg.workdir / "logs"
    logs.mkdir(exist_ok=True)
    server: NatsServer | None = None
    children: list[Child] = []
    interrupted = []

    def on_signal(signum, _frame):
        interrupted.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if cfg.nats:
            nats = cfg.nats
        else:
            server = start_nats_server(cfg.workdir / "nats", log_file=logs / "nats-server.log")
            nats = NatsSettings(url=server.url)
        log.info("nats_ready", url=redact_url(nats.url), embedded=server is not None)
        producer_cfg = replace(cfg.producer, nats=nats)
        launch = _Launcher(cfg, nats, logs)
        # The workers start first and wait for the job's spec, the consumers loading the model
        # meanwhile (once up has made it, for the demo), so that the first batch waits for the
        # slower of the producer and a consumer's start, not their sum.
        workers = launch.workers()
        # The monitor starts once the job is recorded: before, it would only say it waits for a
        # job that up is producing itself. Its stdout (the bar, or JSON lines) is up's; its
        # stderr (an error line, a traceback) goes to its log, which names it if it dies.
        monitor = launch.monitor()
        children = [*workers, monitor]
        for process in workers:
            process.start()
        _make_inputs(cfg, producer_cfg)
        producer = launch.service("producer", producer_cfg, logs / "producer.log")
        children.insert(0, producer)
        producer.start()
        log.info("producing", job=producer_cfg.job, dataset=str(producer_cfg.dataset), log=str(producer.log_path))
        if _await_producer(producer, monitor, workers, interrupted, launch, embedded=server is not None):
            return _interrupted(interrupted[0], monitor, nats, producer_cfg.job)
        if _await_monitor(monitor, workers, interrupted, cfg):
            return _interrupted(interrupted[0], monitor, nats, producer_cfg.job)
        return _verdict(cfg, nats, monitor, up_started=up_started)
    finally:
        stop_all(children, interrupted[0] if interrupted else signal.SIGTERM)
        if server is not None:
            server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Launcher:
    """The children of one `hsx up` as Child processes: each service's config with the run's NATS,
    its log in the run's logs folder, the run's environment."""

    def __init__(self, cfg: UpConfig, nats: NatsSettings, logs: Path) -> None:
        self.cfg, self.nats, self.logs = cfg, nats, logs
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if cfg.device == "cpu":
            self.env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.consumers)))

    def service(self, name: str, service_cfg, log_path: Path | None, own_env: dict[str, str] | None = None) -> Child:
        return Child.of(
            name,
            replace(service_cfg, nats=self.nats),
            log_level=self.cfg.log_level,
            env={**self.env, **(own_env or {})},
            log_path=log_path,
        )

    def workers(self) -> list[Child]:
        """A consumer per device (and per --consumers), then the uploaders."""
        cfg, logs = self.cfg, self.logs
        consumers = consumer_configs(cfg)
        log.info(
            "consumers_planned",
            device=cfg.device,
            device_chosen=cfg.device_chosen or "--device",
            devices=list(cfg.devices),
            per_device=cfg.consumers,
            consumers={name: consumer.device for name, consumer, _ in consumers},
            visible_gpus={name: own["CUDA_VISIBLE_DEVICES"] for name, _, own in consumers if own},
        )
        return [self.service(name, consumer, logs / f"{name}.log", own) for name, consumer, own in consumers] + [
            self.service(f"uploader-{i}", cfg.uploader, logs / f"uploader-{i}.log") for i in range(cfg.uploaders)
        ]

    def monitor(self) -> Child:
        return Child.of(
            "monitor",
            replace(self.cfg.monitor, nats=self.nats),
            log_level=self.cfg.log_level,
            env=self.env,
            log_path=self.logs / "monitor.log",
            log_stdout=False,
        )

    def start_monitor(self, monitor: Child) -> None:
        """The monitor started; with --http, up says where its page is."""
        monitor.start()
        if self.cfg.monitor.http_listen is not None:
            log.info("page", job=self.cfg.producer.job, url=http_url(*self.cfg.monitor.http_listen))


def _make_inputs(cfg: UpConfig, producer_cfg) -> None:
    """The embedded demo's model and dataset, where none was given."""
    if cfg.make_model:
        build_tiny_model(Path(producer_cfg.model))
    if cfg.make_dataset:
        from hsx.model.modelinfo import load_model_info

        info = load_model_info(producer_cfg.model, trust_remote_code=producer_cfg.trust_remote_code)
        write_synthetic_dataset(
            producer_cfg.dataset,
            count=cfg.samples,
            vocab_size=info.vocab_size,
            max_len=min(512, producer_cfg.max_seq_len),
        )


def _await_producer(
    producer: Child,
    monitor: Child,
    workers: list[Child],
    interrupted: list[int],
    launch: _Launcher,
    *,
    embedded: bool,
) -> bool:
    """Until the producer ends, the workers restarted as they crash and the monitor started once
    the job is recorded; True when a signal came first. A producer that fails ends the run
    (ChildFailed, its last error)."""
    cfg, nats = launch.cfg, launch.nats
    job = cfg.producer.job
    looked = 0.0
    while producer.poll() is None:
        if interrupted:
            return True
        if not monitor.started() and time.monotonic() - looked > 1.0:
            looked = time.monotonic()
            if asyncio.run(_job_recorded(nats, job)):
                launch.start_monitor(monitor)
        restart_crashed(workers)
        if monitor.started():
            check_monitor(monitor)
        time.sleep(0.1)
    if producer.poll() != DONE:
        error = producer.last_error()
        if embedded and "already exists" in error:
            # Its advice (`hsx jobs delete`) needs this server, which stops with up.
            error += (
                f"; hsx up keeps its jobs in {cfg.workdir / 'nats'}: give another --job, or remove that "
                "folder and pass --replace-output to make the job anew"
            )
        log.error("child_failed", child=producer.name, exit_code=producer.poll(), error=error)
        raise ChildFailed(f"producer failed: {error} (log: {producer.log_path})", code=producer.poll())
    log.info("job_published", job=job, dest=str(cfg.producer.dest))
    if not monitor.started():
        launch.start_monitor(monitor)
    return False


def _await_monitor(monitor: Child, workers: list[Child], interrupted: list[int], cfg: UpConfig) -> bool:
    """Until the monitor ends with the job's verdict, the workers restarted as they crash; True
    when a signal came first. Past --timeout the run stops (Unavailable: a rerun resumes)."""
    started = time.monotonic()
    while True:
        if interrupted:
            return True
        if check_monitor(monitor) is not None:
            return False
        if time.monotonic() - started > cfg.timeout_s:
            raise Unavailable(  # stopped: a rerun resumes
                f"job {cfg.producer.job} not done after --timeout {cfg.timeout_s:.0f} s; run hsx up again to resume"
            )
        restart_crashed(workers)
        time.sleep(0.2)


def _verdict(cfg: UpConfig, nats: NatsSettings, monitor: Child, *, up_started: float) -> int:
    """The job's status printed; DONE when every sample is stored, else JobFailed saying why."""
    from hsx.commands.status import format_status, read_status

    job = cfg.producer.job
    view = asyncio.run(read_status(nats, job))
    print(format_status(view, as_json=False), flush=True)
    print(f"hsx up took {time.monotonic() - up_started:.0f} s in all: start-up, producing and extracting", flush=True)
    if monitor.poll() != DONE or not view.done:
        if view.destination_refusals:
            # Stopping the uploaders leaves their files in the spool: a run after the fix resumes.
            raise JobFailed(
                f"job {job} stopped with {view.total_samples - view.samples_uploaded} samples not "
                f"uploaded: {view.failure_reason}; fix it and run hsx up again to resume"
            )
        raise JobFailed(
            f"job {job} finished without {view.total_samples - view.samples_uploaded} samples; "
            f"dead samples: {view.dead_samples[:50]} (hsx status --job {job})"
        )
    return DONE
