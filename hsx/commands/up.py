"""`hsx up`: one whole job on this machine, each service a separate process.

Starts whatever is not given: a nats-server with its JetStream store in the workdir, a small
random-initialised model, a synthetic dataset, a local destination. Then it runs the producer,
`--consumers` GPU consumers per device (`--device cuda`: every visible GPU, or those of
`--devices`; hsx/model/devices.py), each its own process on its own device, `--uploaders` uploaders
sharing the consumers' spool, and the monitor; it restarts a worker that crashes, and returns 0
when every sample is in the destination. Everything lives in the workdir, so running it again
resumes: the producer publishes nothing twice and only unfinished work runs. Ctrl-C (or SIGTERM)
stops every process cleanly: workers finish their batch, then exit.
"""

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from hsx.commands.embedded import (
    NatsServer,
    build_tiny_model,
    start_nats_server,
    write_synthetic_dataset,
)
from hsx.errors import HsxError, JobFailed
from hsx.model.devices import node_devices
from hsx.wire.natsconn import NatsSettings, redact_url

log = structlog.get_logger("hsx.up")

_MAX_RESTARTS = 5
_STOP_DEADLINE_S = 90.0


@dataclass(frozen=True, kw_only=True)
class UpConfig:
    workdir: Path
    job: str
    nats: NatsSettings | None  # None: start an embedded nats-server
    model: str | None
    dataset: Path | None
    layers: str
    dtype: str
    dest: str | None
    consumers: int
    uploaders: int
    token_budget: int
    max_seq_len: int
    samples: int
    device: str  # as given: cpu, cuda, cuda:N
    devices: tuple[str, ...]  # the device of each consumer group, from --device and --devices (hsx/model/devices.py)
    timeout_s: float
    log_level: str = "info"
    on_long: str = "error"  # passed to hsx produce --on-long
    compile_layers: bool = False  # passed to hsx consume --compile
    trust_remote_code: bool = False  # passed to hsx produce --trust-remote-code
    # The job file (--config or HSX_CONFIG), passed to every process started, so its [consume],
    # [upload], [monitor] and [produce] settings apply to them; what up passes as a flag wins.
    config_file: Path | None = None

    @classmethod
    def from_args(cls, args, *, nats: NatsSettings | None) -> "UpConfig":
        return cls(
            workdir=args.workdir.resolve(),
            job=args.job,
            nats=nats,
            model=args.model,
            dataset=args.dataset,
            layers=args.layers,
            dtype=args.dtype,
            dest=args.dest,
            consumers=args.consumers,
            uploaders=args.uploaders,
            token_budget=args.token_budget,
            max_seq_len=args.max_seq_len,
            samples=args.samples,
            device=args.device,
            devices=tuple(node_devices(args.device, args.devices)),
            timeout_s=args.timeout,
            log_level=args.log_level,
            on_long=args.on_long,
            compile_layers=args.compile,
            trust_remote_code=args.trust_remote_code,
            config_file=Path(args.config).resolve() if args.config else None,
        )


class Child:
    """One service process, its log file, and how often it was restarted."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path | None) -> None:
        self.name, self.argv, self.env, self.log_path = name, argv, env, log_path
        self.restarts = 0
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        out = open(self.log_path, "ab") if self.log_path else None
        self.process = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=out or None, start_new_session=True)
        if out:
            out.close()

    def poll(self) -> int | None:
        return self.process.poll() if self.process else None

    def terminate(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

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
        if not self.log_path or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        for line in reversed(lines):
            if line.startswith("hsx: error:"):
                return line.removeprefix("hsx: error:").strip()
        return lines[-1][-300:] if lines else ""


def hsx_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "hsx.cli", *args]


def global_flags(cfg: UpConfig) -> list[str]:
    """The flags before the command that every process up starts gets."""
    return ["--log-level", cfg.log_level, *(["--config", str(cfg.config_file)] if cfg.config_file else [])]


def produce_args(cfg: UpConfig, *, model: str, dataset: Path, dest: str) -> list[str]:
    """`hsx produce` and its flags for this job, the model, dataset and destination resolved."""
    return [
        "produce",
        "--job",
        cfg.job,
        "--model",
        model,
        "--dataset",
        str(dataset),
        "--layers",
        cfg.layers,
        "--dest",
        dest,
        "--dtype",
        cfg.dtype,
        "--token-budget",
        str(cfg.token_budget),
        "--max-seq-len",
        str(cfg.max_seq_len),
        "--on-long",
        cfg.on_long,
        *(["--trust-remote-code"] if cfg.trust_remote_code else []),
    ]


def consumer_args(cfg: UpConfig, *, spool: Path) -> list[tuple[str, list[str]]]:
    """(name, `hsx consume` and its flags) of each consumer: `--consumers` per device, each process
    on its own device, all on one spool (the node's uploaders read it). Each process names its
    own instance (`<node>-<pid>`), so their heartbeats are told apart."""
    per_device = [device for device in cfg.devices for _ in range(cfg.consumers)]
    return [
        (
            f"consumer-{i}",
            [
                "consume",
                "--job",
                cfg.job,
                "--device",
                device,
                "--spool",
                str(spool),
                *(["--compile"] if cfg.compile_layers else []),
            ],
        )
        for i, device in enumerate(per_device)
    ]


def stop_all(children: list[Child]) -> None:
    deadline = time.monotonic() + _STOP_DEADLINE_S
    for child in children:
        child.terminate()
    for child in children:
        child.wait(deadline)


def run_up(cfg: UpConfig) -> int:
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
        model = cfg.model or str(build_tiny_model(cfg.workdir / "model"))
        dataset = cfg.dataset
        if dataset is None:
            from hsx.model.modelinfo import load_model_info

            info = load_model_info(model, trust_remote_code=cfg.trust_remote_code)
            dataset = write_synthetic_dataset(
                cfg.workdir / "dataset.jsonl",
                count=cfg.samples,
                vocab_size=info.vocab_size,
                max_len=min(512, cfg.max_seq_len),
            )
        dest = cfg.dest or str(cfg.workdir / "out")
        env = {**os.environ, **nats.as_env(), "HSX_NODE": os.environ.get("HSX_NODE", "local"), "PYTHONUNBUFFERED": "1"}
        if cfg.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.consumers)))
        common = global_flags(cfg)

        producer = Child(
            "producer",
            hsx_argv(*common, *produce_args(cfg, model=model, dataset=dataset, dest=dest)),
            env,
            logs / "producer.log",
        )
        producer.start()
        while producer.poll() is None:
            if interrupted:
                stop_all([producer])
                return 130
            time.sleep(0.1)
        if producer.poll() != 0:
            raise HsxError(f"producer failed: {producer.last_error()} (log: {producer.log_path})")
        log.info("job_published", job=cfg.job, dest=dest)

        spool = cfg.workdir / "spool"
        consumers = consumer_args(cfg, spool=spool)
        log.info(
            "consumers_planned",
            devices=list(cfg.devices),
            per_device=cfg.consumers,
            consumers={name: args[args.index("--device") + 1] for name, args in consumers},
        )
        workers = [Child(name, hsx_argv(*common, *args), env, logs / f"{name}.log") for name, args in consumers] + [
            Child(
                f"uploader-{i}",
                hsx_argv(*common, "upload", "--job", cfg.job, "--spool", str(spool)),
                env,
                logs / f"uploader-{i}.log",
            )
            for i in range(cfg.uploaders)
        ]
        monitor = Child(
            "monitor", hsx_argv(*common, "monitor", "--job", cfg.job, "--until-done", "--interval", "2"), env, None
        )
        children = workers + [monitor]
        for child in children:
            child.start()

        started = time.monotonic()
        while True:
            if interrupted:
                log.info("stopping", reason="signal")
                return 130
            code = monitor.poll()
            if code is not None:
                break
            if time.monotonic() - started > cfg.timeout_s:
                raise HsxError(
                    f"job {cfg.job} not done after --timeout {cfg.timeout_s:.0f} s; run hsx up again to resume"
                )
            for child in workers:
                code = child.poll()
                if code is None:
                    continue
                if code == 2 or child.restarts >= _MAX_RESTARTS:
                    raise HsxError(
                        f"{child.name} exited with code {code}: {child.last_error()} (log: {child.log_path})"
                    )
                child.restarts += 1
                log.warning("worker_restarted", worker=child.name, exit_code=code, restarts=child.restarts)
                child.start()
            time.sleep(0.2)

        from hsx.commands.status import format_status, read_status

        view = asyncio.run(read_status(nats, cfg.job))
        print(format_status(view, as_json=False), flush=True)
        if monitor.poll() != 0 or not view.done:
            if view.destination_error:
                # Stopping the uploaders leaves their files in the spool: a run after the fix resumes.
                raise JobFailed(
                    f"job {cfg.job} stopped with {view.total_samples - view.samples_uploaded} samples not "
                    f"uploaded: {view.failure_reason}; fix it and run hsx up again to resume"
                )
            raise JobFailed(
                f"job {cfg.job} finished without {view.total_samples - view.samples_uploaded} samples; "
                f"dead samples: {view.dead_samples[:50]} (hsx status --job {cfg.job})"
            )
        return 0
    finally:
        stop_all(children)
        if server is not None:
            server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
