"""Every service stops on SIGTERM within a deadline, finishing or returning its in-flight work,
and exits 75 (STOPPED: it was not told that the job is done); restarting is the resume and
nothing is lost or duplicated."""

import json
import signal
import time
from pathlib import Path

from test_e2e_s3 import (
    check_final_status,
    check_outputs,
    produce,
    read_dir_objects,
    start_monitor,
    status,
    wait_until_done,
    write_dataset,
)

from hsx.exitcodes import STOPPED

DEADLINE_S = 30


def _wait_for(path: Path, needle: str, process, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in path.read_text():
            return
        assert process.poll() is None, path.read_text()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"{needle} not seen in {path} within {timeout} s:\n{path.read_text()[-3000:]}")


def _stop(process) -> float:
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=DEADLINE_S)
    return time.monotonic() - started


def test_sigterm_mid_run_then_restart_completes_exactly_once(hsx, hsx_service, tiny_model, job_name, tmp_path):
    rows = write_dataset(tmp_path / "data.jsonl", 60, min_len=20, max_len=120, seed=5)
    out = tmp_path / "out"
    produce(
        hsx,
        job=job_name,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=256,
        max_seq_len=128,
        env=None,
    )
    spool = str(tmp_path / "spool")
    consumer = hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", spool, name="consumer")
    uploader = hsx_service("upload", "--job", job_name, "--spool", spool, name="uploader")
    monitor = hsx_service("monitor", "--job", job_name, "--interval", "1", name="monitor")
    _wait_for(Path(consumer.log_path), '"batch_done"', consumer)

    for process, stopped in [(consumer, '"consumer_stopped"'), (uploader, '"uploader_stopped"'), (monitor, None)]:
        seconds = _stop(process)
        assert process.returncode == STOPPED, Path(process.log_path).read_text()[-3000:]
        assert seconds < DEADLINE_S
        if stopped:
            assert stopped in Path(process.log_path).read_text()
    log = Path(consumer.log_path).read_text()
    started = [json.loads(line)["batch"] for line in log.splitlines() if '"batch_done"' in line]
    assert started, "no batch finished before the stop"

    consumer = hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", spool, name="consumer2")
    uploader = hsx_service("upload", "--job", job_name, "--spool", spool, name="uploader2")
    wait_until_done(start_monitor(hsx_service, job_name, None), [consumer, uploader])
    check_outputs(read_dir_objects(out), job=job_name, rows=rows)
    check_final_status(status(hsx, job_name, None), total=60)
