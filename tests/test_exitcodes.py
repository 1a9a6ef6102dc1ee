"""The exit-code contract (hsx/exitcodes.py), each code of each long-running command seen from a
real process: 0 once the job is done, 65 once it failed (everything left dead-lettered), 75 when
a signal stops it first (safe to run again: a rerun resumes), 2 for bad input, 1 for a crash, and
`hsx up` naming a child that died.

Elsewhere, through real processes too: consume, upload and monitor SIGTERMed mid-run exit 75 and
a restart finishes the job (test_shutdown.py); `hsx up` done 0, SIGTERM 75, Ctrl-C 75, a producer
that refuses 2 (test_up.py); `hsx up` and `monitor --until-done` 65 when the destination refuses
(test_destination_errors.py); a failed device 3 (test_forward_faults.py); sync 75 on SIGTERM
(test_sync.py); the consumer's grace period (test_grace.py).
"""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, clean_environ
from test_e2e_s3 import check_ok, logs_of, produce, status, write_dataset

from devkit.faults import faults_env
from hsx.exitcodes import BAD_INPUT, CRASHED, DONE, JOB_FAILED, MEANING, STOPPED, ExitCode

POISON = 3
FAST = ("--retry-delay", "0.1", "--ack-wait", "5")
EXIT_S = 180.0


def _wait_exit(proc, *, timeout: float = EXIT_S, others=()) -> int:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            pytest.fail(f"{' '.join(proc.args[3:6])} still running after {timeout:.0f} s\n{logs_of(proc, *others)}")
        time.sleep(0.2)
    return proc.returncode


def _events(proc, name: str) -> list[dict]:
    records = [json.loads(line) for line in Path(proc.log_path).read_text().splitlines() if line.startswith("{")]
    return [record for record in records if record.get("event") == name]


def _wait_for_event(proc, name: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not _events(proc, name):
        assert proc.poll() is None, logs_of(proc)
        assert time.monotonic() < deadline, f"no {name} within {timeout:.0f} s\n{logs_of(proc)}"
        time.sleep(0.1)


def test_workers_exit_65_once_the_job_failed_and_0_once_it_is_done(hsx, hsx_service, tiny_model, job_name, tmp_path):
    """One job, failed then mended: a sample that fails on every delivery is dead-lettered, and
    consume, upload and monitor with --until-done exit 65; its letter retried with a healthy
    consumer, the three exit 0."""
    write_dataset(tmp_path / "data.jsonl", 6, min_len=4, max_len=20, seed=3)
    out = tmp_path / "out"
    produce(
        hsx,
        job=job_name,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=128,
        max_seq_len=32,
        env=None,
    )
    spool = str(tmp_path / "spool")
    workers = [
        hsx_service(
            *("consume", "--job", job_name, "--device", "cpu", "--spool", spool, *FAST, "--until-done"),
            env={"HSX_TEST_FAIL_SAMPLE": str(POISON)},
            name="consume-failing",
        ),
        hsx_service("upload", "--job", job_name, "--spool", spool, "--until-done", name="upload"),
        hsx_service("monitor", "--job", job_name, "--until-done", "--interval", "0.5", name="monitor"),
    ]
    codes = {proc.args[3]: _wait_exit(proc, others=workers) for proc in workers}
    print(f"\nEXITCODES failed job: {codes}")
    assert codes == {"consume": JOB_FAILED, "upload": JOB_FAILED, "monitor": JOB_FAILED}, logs_of(*workers)
    for proc in workers:
        assert _events(proc, "job_failed")[-1]["dead_samples"] == [POISON], logs_of(proc)
    assert status(hsx, job_name, None)["failed"]

    check_ok(hsx("dead", "retry", "--job", job_name, "--all"), "dead retry")
    workers = [
        hsx_service(
            *("consume", "--job", job_name, "--device", "cpu", "--spool", spool, *FAST, "--until-done"), name="consume"
        ),
        hsx_service("upload", "--job", job_name, "--spool", spool, "--until-done", name="upload-after"),
        hsx_service("monitor", "--job", job_name, "--until-done", "--interval", "0.5", name="monitor-after"),
    ]
    codes = {proc.args[3]: _wait_exit(proc, others=workers) for proc in workers}
    print(f"EXITCODES done job: {codes}")
    assert codes == {"consume": DONE, "upload": DONE, "monitor": DONE}, logs_of(*workers)
    assert status(hsx, job_name, None)["done"]


def test_workers_stopped_before_the_job_is_there_exit_75(hsx_service, job_name):
    """SIGTERM to workers with --until-done still waiting for their job's spec: stopped, not done."""
    workers = [
        hsx_service("upload", "--job", job_name, "--spool", "spool", "--until-done", name="upload"),
        hsx_service("monitor", "--job", job_name, "--until-done", name="monitor"),
    ]
    for proc in workers:
        _wait_for_event(proc, "waiting_for_job_spec")
        proc.send_signal(signal.SIGTERM)
    codes = {proc.args[3]: _wait_exit(proc, timeout=60, others=workers) for proc in workers}
    print(f"\nEXITCODES stopped while waiting: {codes}")
    assert codes == {"upload": STOPPED, "monitor": STOPPED}, logs_of(*workers)


def _hsx_process(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsx.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean_environ(), "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def test_bad_input_exits_2_with_one_line(nats_server, tiny_model, job_name, tmp_path):
    """Each long-running command refused for what it was given: a flag's value, a job that never
    came, a layer the model lacks, a GPU that is not there. One line, exit 2, never retried."""
    nats = {"HSX_NATS_URL": nats_server.url}
    (tmp_path / "data.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    cases = {
        "consume": (["consume", "--job", job_name, "--device", "cpu", "--wait-for-job", "1"], "after waiting 1 s"),
        "upload": (["upload", "--job", job_name, "--max-inflight", "0"], "--max-inflight"),
        "monitor": (["monitor", "--job", job_name, "--until-done", "--interval", "0"], "--interval"),
        "produce": (
            [
                *("produce", "--job", job_name, "--model", str(tiny_model("qwen3")), "--layers", "99"),
                *("--dataset", str(tmp_path / "data.jsonl"), "--dest", str(tmp_path / "out")),
            ],
            "layer 99",
        ),
        "up": (["up", "--workdir", str(tmp_path / "up"), "--device", "cuda:7"], "cuda:7"),
        "sync": (["sync", str(tmp_path / "missing"), "--once", "--dest", str(tmp_path / "out")], "no such directory"),
    }
    seen = {}
    for command, (args, needle) in cases.items():
        result = _hsx_process(*args, env=nats)
        errors = [line for line in result.stderr.splitlines() if line.startswith("hsx: error:")]
        seen[command] = result.returncode
        assert result.returncode == BAD_INPUT and len(errors) == 1 and needle in errors[0], (command, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
    print(f"\nEXITCODES bad input: {seen}")


def test_produce_stopped_by_sigterm_exits_75_and_a_rerun_publishes_the_rest(
    hsx, hsx_service, tiny_model, job_name, tmp_path
):
    """SIGTERM while the producer publishes (its spec recorded, no batch out yet): 75; run again,
    the same job is published whole, each batch once."""
    write_dataset(tmp_path / "data.jsonl", 12, min_len=4, max_len=20, seed=9)
    hold = tmp_path / "hold"
    hold.mkdir()
    args = [
        *("produce", "--job", job_name, "--model", str(tiny_model("qwen3")), "--layers", "1"),
        *("--dataset", str(tmp_path / "data.jsonl"), "--dest", str(tmp_path / "out"), "--token-budget", "64"),
        *("--max-seq-len", "32", "--dtype", "float32"),
    ]
    producer = hsx_service(*args, env={"HSX_TEST_HOLD_PUBLISH": str(hold)}, name="produce")
    deadline = time.monotonic() + 120
    while not (hold / "holding").exists():
        assert producer.poll() is None and time.monotonic() < deadline, logs_of(producer)
        time.sleep(0.1)
    producer.send_signal(signal.SIGTERM)
    code = _wait_exit(producer, timeout=60)
    print(f"\nEXITCODES produce stopped: {code}")
    assert code == STOPPED, logs_of(producer)
    assert _events(producer, "producer_stopped"), logs_of(producer)
    assert "Traceback" not in Path(producer.log_path).read_text(), logs_of(producer)
    view = status(hsx, job_name, None)
    assert not view["plan_complete"] and view["batches_queued"] == 0, view

    rerun = hsx(*args)
    assert rerun.returncode == DONE, rerun.stderr[-3000:]
    view = status(hsx, job_name, None)
    assert view["plan_complete"] and view["batches_queued"] == view["batches_total"] > 1, view


def test_up_names_a_child_that_died_stops_the_rest_and_exits_1(tmp_path):
    """The monitor of `hsx up` dies at its start (a module missing from the install) while the
    consumer and the uploader work: up says which child and its error, stops the others cleanly
    (each logs its stop) and exits 1, not with a verdict on the job."""
    workdir = tmp_path / "work"
    result = _hsx_process(
        *("up", "--workdir", str(workdir), "--samples", "16", "--layers", "1,3", "--token-budget", "512"),
        *("--max-seq-len", "256"),
        env=faults_env({}, HSX_TEST_MISSING_MODULE="hsx.monitor.main"),
        timeout=240,
    )
    print(f"\nEXITCODES up with a dead monitor: {result.returncode}")
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == CRASHED, result.stderr[-3000:]
    assert last.startswith("hsx: error: monitor exited with code 1: ModuleNotFoundError"), last
    assert "hsx.monitor.main" in last and str(workdir / "logs" / "monitor.log") in last, last
    assert "finished without" not in result.stderr, result.stderr[-3000:]
    logs = workdir / "logs"
    for name, stopped in (("consumer-0", "consumer_stopped"), ("uploader-0", "uploader_stopped")):
        text = (logs / f"{name}.log").read_text()
        assert f'"{stopped}"' in text and "Traceback" not in text, text[-3000:]


def test_the_reference_table_is_the_module():
    """docs/reference/commands.md's table of exit codes lists each of hsx/exitcodes.py's, by name
    and number, and no other."""
    text = (REPO / "docs" / "reference" / "commands.md").read_text()
    section = text[text.index("## Exit codes") :]
    section = section[: section.index("\n#", 1)] if "\n#" in section[1:] else section
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|", section, re.MULTILINE)
    assert sorted((int(number), name) for number, name in rows) == sorted((int(c), c.name) for c in ExitCode)
    assert set(MEANING) == set(ExitCode)
