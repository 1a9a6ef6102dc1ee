"""`hsx monitor` on real runs: its /metrics and its JSON lines agree with `hsx status --json`
before, during and after a job; on a terminal it draws the bar instead; a GPU consumer killed
mid-run is named with its instance, node and the last batch it worked on, and its node's spool
backlog is reported in bytes; two monitors of one running job, the second started mid-run, each
show what `hsx status` reads within two of their intervals (issue 38, item 5: a second monitor
was said to lag about 10 s behind).

Real nats-server, tiny real model on the CPU, every service a subprocess; where the pace of a job
must be known, the test marks its samples uploaded itself, as an uploader does. The monitors run
with their stdout and stderr in separate files (or a pty), since what is on stdout is what is tested.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import nats
import pytest
from conftest import _env, _free_port
from prometheus_client.parser import text_string_to_metric_families
from test_chaos import log_events, sigkill
from test_e2e_s3 import check_ok, job_plan, logs_of, produce, status, write_dataset

from hsx.exitcodes import DONE, STOPPED
from hsx.monitor.report import PROGRESS_FIELDS, SUMMARY_FIELDS
from hsx.storage.spool import spool_usage
from hsx.wire import schemas, topology
from hsx.wire.events import EventPublisher

NODE = "testnode"  # HSX_NODE of every service the fixtures start

# Each metric and the field of `hsx status --json` it must equal once the job is done.
METRIC_STATUS_FIELDS = {
    "hsx_samples_written_total": "samples_written",
    "hsx_samples_uploaded_total": "samples_uploaded",
    "hsx_tokens_written_total": "tokens_written",
    "hsx_tokens_uploaded_total": "tokens_uploaded",
    "hsx_bytes_written_total": "bytes_written",
    "hsx_bytes_uploaded_total": "bytes_uploaded",
    "hsx_batches_done_total": "batches_done",
    "hsx_samples_requeued_total": "samples_requeued",
    "hsx_job_samples": "total_samples",
    "hsx_job_tokens": "total_tokens",
    "hsx_job_batches": "batches_total",
    "hsx_batches_pending": "batches_queued",
    "hsx_files_pending": "files_waiting_upload",
    "hsx_dead_letters": "dead_letters",
    "hsx_job_done": "done",
    "hsx_job_failed": "failed",
}
COUNTERS = [name for name in METRIC_STATUS_FIELDS if name.endswith("_total")]


@pytest.fixture
def spawn(nats_server, tmp_path):
    """Start `hsx ARGS` with stdout and stderr in their own files (or stdout on a given fd)."""
    started: list[subprocess.Popen] = []

    def start(*args: str, name: str, stdout=None, env: dict | None = None) -> subprocess.Popen:
        out = open(tmp_path / f"{name}.out", "wb") if stdout is None else None
        err = open(tmp_path / f"{name}.err", "wb")
        process = subprocess.Popen(
            [sys.executable, "-m", "hsx.cli", *args],
            env=_env(nats_server.url, env),
            stdout=out if stdout is None else stdout,
            stderr=err,
        )
        process.out_path, process.err_path = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        process.log_path = process.out_path  # for logs_of / log_events
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(samples: dict, name: str, job: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted({"job": job, **labels}.items()))))


def wait_for(condition, *, timeout: float, what: str, procs, period: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s\n{logs_of(*procs)}")
        time.sleep(period)


def json_lines(process) -> list[dict]:
    """Every line the monitor wrote to stdout, each of which must be one JSON object."""
    records = []
    for number, line in enumerate(Path(process.out_path).read_text().splitlines(), 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"{process.out_path}:{number} is not JSON: {line[:300]!r}")
    return records


class PtyReader(threading.Thread):
    """Everything a child writes to the terminal side of a pty."""

    def __init__(self, master: int) -> None:
        super().__init__(daemon=True)
        self.master, self.data = master, b""

    def run(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # EIO: the child closed the terminal
                return
            if not chunk:
                return
            self.data += chunk


def test_metrics_and_json_lines_agree_with_status_and_a_terminal_gets_the_bar(
    tmp_path,
    hsx,
    hsx_service,
    spawn,
    tiny_model,
    job_name,
):
    job = job_name
    write_dataset(tmp_path / "data.jsonl", 24, min_len=4, max_len=120, seed=5)
    spool = tmp_path / "spool"
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(tmp_path / "out"),
        token_budget=256,
        max_seq_len=128,
        env=None,
    )
    port = _free_port()
    monitor = spawn("monitor", "--job", job, "--interval", "0.5", "--metrics-port", str(port), name="monitor-json")
    master, terminal = os.openpty()
    bar_monitor = spawn(
        "monitor",
        "--job",
        job,
        "--interval",
        "0.5",
        "--until-done",
        name="monitor-bar",
        stdout=terminal,
        env={"COLUMNS": "250"},
    )
    os.close(terminal)
    screen = PtyReader(master)
    screen.start()

    def scraped() -> dict | None:
        try:
            samples = scrape(port)
        except OSError:  # not listening yet
            return None
        return samples if metric(samples, "hsx_job_samples", job) is not None else None

    # Before any worker: the job's size is known, nothing is done, the ETA is unknown.
    before = wait_for(scraped, timeout=30, what="the first /metrics reading", procs=[monitor])
    planned = status(hsx, job, None)
    for name, field in METRIC_STATUS_FIELDS.items():
        assert metric(before, name, job) == planned[field], (name, before)
    assert planned["samples_written"] == 0 and planned["batches_queued"] == planned["batches_total"] >= 3, planned
    assert math.isnan(metric(before, "hsx_eta_seconds", job))

    workers = [
        hsx_service("consume", "--job", job, "--device", "cpu", "--spool", str(spool), name="consume"),
        hsx_service("upload", "--job", job, "--spool", str(spool), name="upload"),
    ]
    procs = [monitor, *workers]
    readings = [before]

    def done() -> bool:
        assert all(w.poll() is None for w in workers), f"a worker exited\n{logs_of(*procs)}"
        readings.append(scrape(port))
        return metric(readings[-1], "hsx_job_done", job) == 1

    wait_for(done, timeout=90, what="hsx_job_done 1", procs=procs, period=0.3)
    final = status(hsx, job, None)
    after = scrape(port)
    assert final["done"] and final["samples_uploaded"] == 24, final
    for name, field in METRIC_STATUS_FIELDS.items():
        assert metric(after, name, job) == final[field], (name, metric(after, name, job), final[field])
    assert metric(after, "hsx_redeliveries", job, queue="batches") == final["batch_redeliveries"]
    assert metric(after, "hsx_redeliveries", job, queue="files") == final["file_redeliveries"]
    assert metric(after, "hsx_eta_seconds", job) == 0
    # Counters never went down from one scrape to the next.
    for name in COUNTERS:
        values = [metric(r, name, job) for r in readings]
        assert values == sorted(values), (name, values)
    assert len(readings) >= 2
    # Both workers are alive and say so, from node testnode.
    for service in ("gpu_consumer", "uploader"):
        live = sum(
            value
            for (name, labels), value in after.items()
            if name == "hsx_workers" and ("service", service) in labels and ("state", "silent") not in labels
        )
        assert live == 1, (service, after)

    # The spool drains to nothing, and the heartbeats say so (they come every 5 s).
    assert spool_usage(spool, job, job_plan(tmp_path / "out", job)) == (0, 0)
    wait_for(
        lambda: metric(scrape(port), "hsx_spool_bytes", job, node=NODE) == 0,
        timeout=20,
        what="hsx_spool_bytes 0 for the drained spool",
        procs=procs,
    )
    assert metric(scrape(port), "hsx_spool_files", job, node=NODE) == 0

    # The terminal got the bar: redrawn in place, no JSON, and the summary once done.
    assert bar_monitor.wait(timeout=30) == 0, logs_of(bar_monitor)
    screen.join(timeout=10)
    os.close(master)
    drawn = screen.data.decode(errors="replace")
    (tmp_path / "terminal.txt").write_text(drawn)  # what a person would have seen, for a failure's post-mortem
    assert drawn.count("\r\x1b[2K") >= 2, drawn[-2000:]
    assert f"{job} [" in drawn and "ETA" in drawn and "tok/s" in drawn and "workers" in drawn, drawn[-2000:]
    assert f"{job} done: 24/24 samples" in drawn, drawn[-2000:]
    assert '{"' not in drawn, drawn[-2000:]
    assert "job_summary" in drawn  # the log line, printed above the bar

    # Not a terminal: JSON lines on stdout, nothing on stderr. It saw the job done: exit 0.
    monitor.terminate()
    assert monitor.wait(timeout=30) == DONE, logs_of(monitor)
    assert Path(monitor.err_path).read_text() == ""
    records = json_lines(monitor)
    progress = [r for r in records if r["event"] == "progress"]
    assert len(progress) >= 3
    for record in progress:
        assert set(PROGRESS_FIELDS) <= set(record), sorted(set(PROGRESS_FIELDS) - set(record))
    last = progress[-1]
    assert (last["samples_total"], last["samples_written"], last["samples_uploaded"], last["percent"]) == (
        24,
        24,
        24,
        100.0,
    )
    assert (last["tokens_done"], last["bytes_uploaded"]) == (final["tokens_written"], final["bytes_uploaded"])
    assert (last["batches_done"], last["batches_total"]) == (final["batches_done"], final["batches_total"])
    assert last["done"] is True and last["eta_s"] == 0
    # The drained spool is in the lines once a heartbeat measured it. Not asserted of the last line
    # alone: a line may come between the last upload and the beat that measured the drain, and then
    # shows the newest measurement before it (a consumer's walk while files were still there).
    assert {NODE: 0} in [r["spool_bytes"] for r in progress if r["done"]], [r["spool_bytes"] for r in progress]
    assert last["workers_by_service"] == {"gpu_consumer": 1, "uploader": 1}
    summaries = [r for r in records if r["event"] == "job_summary"]
    assert len(summaries) == 1 and set(SUMMARY_FIELDS) <= set(summaries[0]), summaries
    assert (summaries[0]["samples"], summaries[0]["bytes"]) == (24, final["bytes_uploaded"])


@pytest.mark.faults
def test_a_consumer_killed_mid_run_is_named_with_its_node_and_last_batch(
    tmp_path,
    hsx,
    hsx_service,
    spawn,
    tiny_model,
    job_name,
):
    """The consumer pauses at a 1-byte spool high-water mark after its first batches (no uploader
    runs), so its heartbeat's detail is the pause's reason: the monitor must still name the last
    batch. Then it is SIGKILLed with its spool full and batches left in the queue."""
    job = job_name
    write_dataset(tmp_path / "data.jsonl", 16, min_len=4, max_len=60, seed=9)
    spool = tmp_path / "spool"
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(tmp_path / "out"),
        token_budget=128,
        max_seq_len=64,
        env=None,
    )
    port = _free_port()
    monitor = spawn(
        "monitor", "--job", job, "--interval", "0.5", "--silent-after", "7", "--metrics-port", str(port), name="monitor"
    )
    consumer = hsx_service(
        "consume", "--job", job, "--device", "cpu", "--spool", str(spool), "--spool-high-water", "1", name="consume"
    )
    procs = [monitor, consumer]

    def paused() -> bool:
        assert consumer.poll() is None, f"the consumer exited\n{logs_of(*procs)}"
        return any(
            r["service"] == "gpu_consumer" and r["state"] == "paused" for r in log_events(monitor, "worker_degraded")
        )

    wait_for(paused, timeout=60, what="the monitor seeing the consumer paused", procs=procs)
    done = log_events(consumer, "batch_done")
    assert done, logs_of(consumer)
    worked_on = [r["batch"] for r in done]
    instance = done[-1]["consumer"]  # the id the consumer gives itself, in every log line
    sigkill(consumer)

    def reported() -> list[dict]:
        return [r for r in log_events(monitor, "consumer_silent") if r["instance"] == instance]

    silent = wait_for(reported, timeout=30, what="consumer_silent for the killed consumer", procs=procs)
    assert len(silent) == 1, silent  # reported once, not every interval
    assert silent[0]["node"] == NODE and silent[0]["service"] == "gpu_consumer", silent
    assert silent[0]["last_batch"] == worked_on[-1], (silent, worked_on, logs_of(*procs)[-6000:])
    assert silent[0]["last_state"] == "paused" and silent[0]["silent_s"] >= 7, silent  # rounded to 0.1 s

    # The job is unfinished: batches are still queued; the node's spool holds what was written.
    view = status(hsx, job, None)
    assert 0 < view["batches_done"] < view["batches_total"] and view["batches_queued"] > 0, view
    files, used = spool_usage(spool, job, job_plan(tmp_path / "out", job))
    assert used > 0 and files == view["samples_written"], (files, used, view)
    samples = scrape(port)
    assert metric(samples, "hsx_workers", job, service="gpu_consumer", node=NODE, state="silent") == 1, samples
    assert metric(samples, "hsx_spool_bytes", job, node=NODE) == used
    assert metric(samples, "hsx_spool_files", job, node=NODE) == files
    last = [r for r in log_events(monitor, "progress")][-1]
    assert last["spool_bytes"] == {NODE: used} and last["workers_silent"] == 1 and last["workers"] == 0, last


def progress_readings(process) -> list[tuple[float, int]]:
    """(when it was logged, samples_uploaded) of each `progress` line the monitor wrote."""
    return [
        (datetime.fromisoformat(r["timestamp"].replace("Z", "+00:00")).timestamp(), r["samples_uploaded"])
        for r in json_lines(process)
        if r["event"] == "progress"
    ]


class SteadyUploads(threading.Thread):
    """Marks the job's samples uploaded one by one, every `every_s`, as an uploader marks each it
    stored (EventPublisher.mark): a job that moves at a known pace, whatever the machine's speed."""

    def __init__(self, url: str, job: str, plan: str, total: int, every_s: float) -> None:
        super().__init__(daemon=True)
        self.url, self.job, self.plan, self.total, self.every_s = url, job, plan, total, every_s
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._mark_all())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    async def _mark_all(self) -> None:
        nc = await nats.connect(self.url)
        try:
            events = EventPublisher(nc, nc.jetstream(), self.job)
            for index in range(self.total):
                uploaded = schemas.FileUploaded(
                    job=self.job,
                    node=NODE,
                    uploader="steady",
                    sample_index=index,
                    key=f"{self.job}/{index}",
                    size=1,
                    tokens=1,
                    plan=self.plan,
                )
                assert await events.mark(uploaded, subject=topology.uploaded_subject(self.job, self.plan, index))
                await asyncio.sleep(self.every_s)
        finally:
            await nc.close()


def test_two_monitors_of_a_running_job_keep_up_with_status(tmp_path, hsx, spawn, nats_server, tiny_model, job_name):
    job, interval, total = job_name, 1.0, 64
    write_dataset(tmp_path / "data.jsonl", total, min_len=4, max_len=60, seed=7)
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(tmp_path / "out"),
        token_budget=256,
        max_seq_len=64,
        env=None,
    )
    first = spawn("monitor", "--job", job, "--interval", str(interval), "--format", "json", name="monitor-1")
    wait_for(lambda: progress_readings(first), timeout=30, what="the first monitor's first reading", procs=[first])
    uploads = SteadyUploads(nats_server.url, job, job_plan(tmp_path / "out", job), total, every_s=0.25)
    uploads.start()

    def uploaded() -> int:
        return json.loads(check_ok(hsx("status", "--job", job, "--json"), "hsx status").stdout)["samples_uploaded"]

    # The second monitor starts once the job is under way and the first has followed it a while.
    wait_for(lambda: uploaded() >= total // 4, timeout=30, what="a quarter of the samples", procs=[first])
    second = spawn("monitor", "--job", job, "--interval", str(interval), "--format", "json", name="monitor-2")
    procs = [first, second]
    # The truth as `hsx status` reads it, each with the moments before and after it was read.
    truth: list[tuple[float, float, int]] = []
    while not truth or truth[-1][2] < total:
        assert uploads.is_alive() or uploads.error is None, uploads.error
        assert len(truth) < 200, (truth, logs_of(*procs))
        before = time.time()
        value = uploaded()
        truth.append((before, time.time(), value))
        time.sleep(0.3)
    uploads.join(timeout=30)
    assert uploads.error is None, uploads.error
    time.sleep(3 * interval)  # readings after the last status, for the comparison below
    for monitor in procs:
        monitor.terminate()
        # Its batches are still queued (no consumer ran): the job is not done, the monitor stopped.
        assert monitor.wait(timeout=30) == STOPPED, logs_of(monitor)
    running = [(t0, t1, value) for t0, t1, value in truth if value < total]
    # Only a job that moved while both monitors watched can show one of them behind.
    assert len({value for _, _, value in running}) >= 10, truth
    for monitor in procs:
        readings = progress_readings(monitor)
        # One reading per interval, none held up.
        gaps = [b - a for (a, _), (b, _) in zip(readings, readings[1:])]
        assert gaps and max(gaps) <= 2 * interval, (monitor.out_path.name, readings)
        for t0, t1, value in truth:
            # Read after the truth was: at least that much, within two intervals.
            later = [shown for at, shown in readings if at >= t1 + 2 * interval]
            assert later and later[0] >= value, (monitor.out_path.name, (t0, t1, value), readings)
            # Read before it: never more (the count only grows).
            earlier = [shown for at, shown in readings if at <= t0]
            assert not earlier or earlier[-1] <= value, (monitor.out_path.name, (t0, t1, value), readings)
