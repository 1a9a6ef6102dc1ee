"""`hsx up` end to end on the embedded defaults: its own nats-server, a random tiny model, a
synthetic dataset, a local destination. Also: a second run on the same workdir resumes and
redoes nothing; Ctrl-C stops every process and a later run finishes the job."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import clean_environ
from safetensors import safe_open

from hsx.exitcodes import STOPPED
from hsx.job import JobSpec

SMALL = ["--samples", "24", "--layers", "1,3", "--token-budget", "1024", "--max-seq-len", "256"]


def _up(workdir: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsx.cli", "up", "--workdir", str(workdir), *SMALL, *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean_environ(), "PYTHONUNBUFFERED": "1"},
    )


def _outputs(workdir: Path) -> list[Path]:
    return sorted((workdir / "out" / "demo").rglob("*.safetensors"))


def _log_events(path: Path, event: str) -> list[dict]:
    found = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == event:
                found.append(record)
    return found


def _dataset_lengths(workdir: Path) -> list[int]:
    return [len(json.loads(line)["input_ids"]) for line in (workdir / "dataset.jsonl").read_text().splitlines()]


def test_up_runs_the_embedded_demo_then_resumes_without_redoing(tmp_path):
    workdir = tmp_path / "work"
    first = _up(workdir)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "job demo: done" in first.stdout
    assert "uploaded 24/24" in first.stdout
    assert "Traceback" not in first.stderr
    # The monitor's lines are on stdout (its output is its product); hsx up's own log is on stderr.
    summaries = [
        json.loads(line)
        for line in first.stdout.splitlines()
        if line.startswith("{") and json.loads(line).get("event") == "job_summary"
    ]
    assert summaries and summaries[0]["samples"] == 24

    files = _outputs(workdir)
    lengths = _dataset_lengths(workdir)
    assert len(files) == 24
    for path in files:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            shape = f.get_slice("hidden_states").get_shape()
        index = int(meta["sample_index"])
        assert path.name == f"{index}.safetensors"
        assert shape == [lengths[index], 2, 128]
        assert json.loads(meta["layers"]) == [1, 3]
    assert not list((workdir / "spool").rglob("*.safetensors"))
    batches_first = len(_log_events(workdir / "logs" / "consumer-0.log", "batch_done"))
    assert batches_first > 0
    # Started beside the producer, the consumer loaded the model meanwhile and kept it.
    assert _log_events(workdir / "logs" / "consumer-0.log", "early_model_kept")

    second = _up(workdir)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "uploaded 24/24" in second.stdout
    assert _log_events(workdir / "logs" / "producer.log", "job_already_published")
    assert len(_log_events(workdir / "logs" / "consumer-0.log", "batch_done")) == batches_first
    assert _outputs(workdir) == files


@pytest.mark.faults
def test_sigterm_stops_everything_exits_75_and_a_rerun_completes(tmp_path):
    workdir = tmp_path / "work"
    # The batch the consumer fetched ahead is handed back (a nak) as it stops, but the embedded
    # nats-server stops with up, and a restarted server keeps no nak: the batch comes back after
    # the ack wait, here 5 s instead of 60.
    job_file = tmp_path / "job.toml"
    job_file.write_text("[consume]\nack_wait = 5\n")
    args = ["--samples", "64", "--layers", "1,3", "--token-budget", "512", "--max-seq-len", "256"]
    process = subprocess.Popen(
        [sys.executable, "-m", "hsx.cli", "--config", str(job_file), "up", "--workdir", str(workdir), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**clean_environ(), "PYTHONUNBUFFERED": "1"},
    )
    consumer_log = workdir / "logs" / "consumer-0.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (consumer_log.exists() and "batch_done" in consumer_log.read_text()):
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.2)
    assert consumer_log.exists() and "batch_done" in consumer_log.read_text(), "no batch finished within 120 s"
    process.send_signal(signal.SIGTERM)  # a scheduler's stop (Slurm's --signal, Kubernetes' pod deletion)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == STOPPED, stderr[-3000:]
    assert "child_failed" not in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-6000:]
    assert _log_events(consumer_log, "consumer_stopped"), "the consumer did not stop cleanly"
    assert _log_events(workdir / "logs" / "uploader-0.log", "uploader_stopped")
    server_log = (workdir / "logs" / "nats-server.log").read_text()
    assert "Server Exiting" in server_log

    rerun = subprocess.run(
        [sys.executable, "-m", "hsx.cli", "--config", str(job_file), "up", "--workdir", str(workdir), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**clean_environ(), "PYTHONUNBUFFERED": "1"},
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    files = _outputs(workdir)
    assert sorted(int(p.stem) for p in files) == list(range(64))


def test_a_model_loaded_early_is_kept_only_for_the_spec_it_serves(tiny_model):
    """The consumer's early load (hsx up: before the spec is read) is used when the spec names
    the same model, revision, layers and dtype; a spec that names other layers gets its own."""
    import asyncio

    from hsx.gpu_consumer.config import ExpectedModel
    from hsx.gpu_consumer.device_thread import DeviceThread
    from hsx.gpu_consumer.main import load_expected, model_for
    from hsx.model.layers import parse_layers
    from hsx.storage.layout import SampleFiles

    model = str(tiny_model())
    expected = ExpectedModel(model=model, layers=parse_layers("1,-1"), dtype="float32")

    def spec(layers: list[int]) -> JobSpec:
        return JobSpec(
            **dict(job="j", model=model, model_revision="local", layers=layers, dtype="float32", dest="file:///x"),
            **dict(token_budget=64, max_seq_len=64, dataset="d", plan_fingerprint="f" * 64),
            **dict(total_samples=1, total_tokens=1, total_batches=1, created_at=0.0),
        )

    async def serve(layers: list[int]):
        forwards = DeviceThread("cpu")
        early = asyncio.ensure_future(forwards.run(load_expected, expected, device="cpu", compile_layers=False))
        _, early_model = await asyncio.shield(early)
        loaded = await model_for(SampleFiles.of(spec(layers)), early, forwards, device="cpu", compile_layers=False)
        forwards.close()
        return loaded, early_model

    last = json.loads((tiny_model() / "config.json").read_text())["num_hidden_layers"] - 1
    kept, early_model = asyncio.run(serve([1, last]))
    assert kept is early_model and kept.tap.layers == [1, last]
    other, early_model = asyncio.run(serve([1]))
    assert other is not early_model and other.tap.layers == [1]


@pytest.mark.faults
def test_ctrl_c_in_a_terminal_leaves_a_readable_screen_saying_where_it_stopped(tmp_path):
    """`hsx up` in a pseudo-terminal (the progress bar drawn), Ctrl-C typed once the job runs: the
    screen, as a terminal emulator (pyte) shows it, has no log line written over the bar, the
    workers' `stopping` names the signal typed (SIGINT), and the last line says where the job
    stopped and how to resume."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    import pyte

    columns, rows = 160, 60
    screen = pyte.Screen(columns, rows)
    stream = pyte.ByteStream(screen)
    argv = [sys.executable, "-m", "hsx.cli", "up", "--workdir", str(tmp_path / "work"), "--samples", "5000"]
    argv += ["--layers", "1,3", "--token-budget", "512", "--max-seq-len", "256"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session of its own on the terminal, as a shell would start it
        os.chdir(tmp_path)
        os.execve(sys.executable, argv, {**clean_environ(), "PYTHONUNBUFFERED": "1", "COLUMNS": str(columns)})
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    output = bytearray()

    def read_for(seconds: float, until: bytes | None = None) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (until and until in output):
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child is gone
                return
            if not chunk:
                return
            output.extend(chunk)

    try:
        read_for(150, until=b"batches ")  # the bar is drawn: batches are being done
        assert b"batches " in output, output.decode(errors="replace")[-3000:]
        os.write(fd, b"\x03")  # Ctrl-C, through the terminal driver: SIGINT to the foreground group
        read_for(120)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    stream.feed(bytes(output))
    lines = [line.rstrip() for line in screen.display if line.strip()]
    text = "\n".join(lines)
    assert os.waitstatus_to_exitcode(status) == STOPPED, text
    assert "SIGTERM" not in text and "signal=SIGINT" in text, text
    # No log line shares its row with the bar's remains ("| batches 3/65").
    assert not [line for line in lines if "[info" in line and "| batches" in line], text
    assert re.fullmatch(r"hsx up: stopped at [\d,]+/5,000 samples stored; run the same command to resume", lines[-1]), (
        text
    )


def test_a_rerun_with_another_dataset_gets_advice_that_works_for_up(tmp_path):
    """A second `hsx up` with other settings is refused by its producer, the job being in up's own
    NATS store: the advice is what an `hsx up` user can do (before, `hsx jobs delete`, which needs
    the NATS server up had stopped). With the store started over (the job new to NATS) but the
    job's folder holding the first dataset's files, another dataset is refused: the flag that
    refusal advises is one `hsx up` takes (before, `--replace-output` was unrecognized), and
    re-running with it finishes the new job."""
    workdir = tmp_path / "work"
    first = _up(workdir)
    assert first.returncode == 0, first.stderr[-3000:]
    settings = _up(workdir, "--token-budget", "2048")
    assert settings.returncode == 2, settings.stderr[-3000:]
    last = settings.stderr.strip().splitlines()[-1]
    assert "already exists" in last and "--token-budget 1024 (this run: 2048)" in last, last
    assert f"hsx up keeps its jobs in {workdir / 'nats'}" in last and "another --job" in last, last
    other = tmp_path / "other.jsonl"
    other.write_text("".join((workdir / "dataset.jsonl").read_text().splitlines(keepends=True)[:10]))
    shutil.rmtree(workdir / "nats")

    refused = _up(workdir, "--dataset", str(other))
    assert refused.returncode == 2, refused.stderr[-3000:]
    last = refused.stderr.strip().splitlines()[-1]
    advised = re.search(r"pass (--[a-z-]+)", last)
    assert last.startswith("hsx: error: producer failed: ") and advised, last
    assert advised.group(1) == "--replace-output", last

    replaced = _up(workdir, "--dataset", str(other), advised.group(1))
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert "uploaded 10/10" in replaced.stdout, replaced.stdout[-3000:]
