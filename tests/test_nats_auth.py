"""A NATS server that requires a password: a wrong password is a clear one-line error that never
shows the secret; the right one (from the environment) runs a job to completion; the secret
appears in nothing the run prints or writes."""

import json
import subprocess
import sys

import pytest
from conftest import clean_environ
from test_e2e_s3 import check_outputs, read_dir_objects, write_dataset

from hsx.commands.embedded import start_nats_server

PASSWORD = "pw-Zq8uJ2-never-log-this"


@pytest.fixture
def password_server(tmp_path):
    server = start_nats_server(tmp_path / "nats-auth", extra_args=("--user", "hsx", "--pass", PASSWORD))
    yield server
    server.stop()


def _cli(*args, env, timeout=120, log=None):
    return subprocess.run(
        [sys.executable, "-m", "hsx.cli", *args],
        env={**clean_environ(), "PYTHONUNBUFFERED": "1", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.faults
def test_wrong_password_is_refused_without_showing_it(password_server, tmp_path, tiny_model, job_name):
    write_dataset(tmp_path / "d.jsonl", 4, min_len=4, max_len=16, seed=1)
    wrong = "wrong-" + PASSWORD[::-1]
    for env in ({"HSX_NATS_USER": "hsx", "HSX_NATS_PASSWORD": wrong}, {}):
        result = _cli(
            "produce",
            "--job",
            job_name,
            "--model",
            str(tiny_model("qwen3")),
            "--dataset",
            str(tmp_path / "d.jsonl"),
            "--layers",
            "1",
            "--dest",
            str(tmp_path / "out"),
            "--nats",
            password_server.url,
            env=env,
        )
        assert result.returncode == 2
        errors = [line for line in result.stderr.splitlines() if line.startswith("hsx: error:")]
        assert len(errors) == 1 and "refused the credentials" in errors[0] and password_server.url in errors[0], (
            result.stderr
        )
        assert "Traceback" not in result.stderr
        assert wrong not in result.stdout + result.stderr


def test_right_password_runs_the_job_and_the_secret_is_never_written(password_server, tmp_path, tiny_model, job_name):
    rows = write_dataset(tmp_path / "d.jsonl", 8, min_len=4, max_len=40, seed=2)
    env = {"HSX_NATS_USER": "hsx", "HSX_NATS_PASSWORD": PASSWORD, "HSX_NODE": "authnode"}
    out = tmp_path / "out"
    workdir = tmp_path / "w"
    # The URL also carries the password (user:password@host): it must be redacted everywhere too.
    url_with_secret = password_server.url.replace("nats://", f"nats://hsx:{PASSWORD}@")
    result = _cli(
        "up",
        "--workdir",
        str(workdir),
        "--nats",
        url_with_secret,
        "--model",
        str(tiny_model("qwen3")),
        "--dataset",
        str(tmp_path / "d.jsonl"),
        "--layers",
        "0,2,5",
        "--dtype",
        "float32",
        "--dest",
        str(out),
        "--job",
        job_name,
        "--token-budget",
        "256",
        "--max-seq-len",
        "64",
        env=env,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    check_outputs(read_dir_objects(out), job=job_name, rows=rows)
    status = _cli("status", "--job", job_name, "--json", "--nats", password_server.url, env=env)
    assert json.loads(status.stdout)["done"]
    everything = result.stdout + result.stderr + status.stdout + status.stderr
    for path in workdir.rglob("*"):
        if path.is_file() and path.suffix in (".log", ".jsonl", ".json", ""):
            everything += path.read_text(errors="replace")
    assert "hsx:***@" in everything  # the URL was logged, redacted
    assert PASSWORD not in everything
