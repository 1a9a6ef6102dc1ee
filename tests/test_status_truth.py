"""`hsx status` tells the job's state as it is, and the monitor reports no ghosts.

A published job no worker has touched is `waiting for workers`; one whose workers all stopped with
work left is `stalled` (for as long as no heartbeat came); a finished one is `done`, with how long
it took and its average rate, and the silent workers of a finished job are no problem. Workers
alive are counted by service from their heartbeats, a clean stop (`stopping`) is not alive and not
silent, and an uploader that cannot reach its endpoint is shown in `destination_error`. The ETA is
smoothed over bursts, and the bar never runs into another process's log line.

Real nats-server, real hsx processes, a tiny model; the heartbeats of a worker long gone are
published as a worker publishes its own, with an old `sent_at`.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import nats
import pytest
from conftest import REPO, _free_port
from test_chaos import log_events
from test_e2e_s3 import check_ok, logs_of, produce, status, write_dataset
from test_monitor import wait_for

from hsx.exitcodes import STOPPED
from hsx.monitor.bar import TerminalBar
from hsx.monitor.rates import RateWindow, eta_seconds
from hsx.wire import schemas, topology
from hsx.wire.headers import message_headers


def publish_heartbeat(url: str, job: str, *, instance: str, service: str, state: str, age_s: float) -> None:
    """The heartbeat a worker sends (EventPublisher.heartbeat: same subject and headers), sent
    `age_s` seconds ago by its own clock (the server stores it now, and that is its age)."""

    async def run() -> None:
        nc = await nats.connect(url)
        try:
            beat = schemas.Heartbeat(
                job=job,
                service=service,
                instance=instance,
                node="testnode",
                state=state,
                sent_at=time.time() - age_s,
            )
            await nc.publish(
                topology.heartbeat_subject(job, service, instance),
                schemas.encode(beat),
                headers=message_headers(job),
            )
            await nc.flush()
        finally:
            await nc.close()

    asyncio.run(run())


def _produce(hsx, tmp_path: Path, tiny_model, job: str, *, count: int, dest: str, env: dict | None = None) -> None:
    write_dataset(tmp_path / "data.jsonl", count, min_len=8, max_len=40, seed=5)
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=dest,
        token_budget=128,
        max_seq_len=64,
        env=env,
        layers="1,3",
    )


@pytest.mark.faults
def test_waiting_then_running_then_stalled_then_done_and_no_ghosts(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name
):
    job, count = job_name, 12
    _produce(hsx, tmp_path, tiny_model, job, count=count, dest=str(tmp_path / "out"))

    # Published, no worker yet: not "running".
    view = status(hsx, job, None)
    assert view["state"] == "waiting for workers" and not view["done"] and not view["failed"], view
    assert view["workers_alive"] == {"gpu_consumer": 0, "uploader": 0}, view
    assert view["model"] == str(tiny_model("qwen3")) and view["layers"] == [1, 3], view
    assert view["samples_per_s"] is None and view["eta_s"] is None, view
    text = check_ok(hsx("status", "--job", job), "hsx status").stdout
    assert f"job {job}: waiting for workers" in text and "layers 1,3" in text, text

    # A consumer alone: alive and counted; it writes everything, nothing is uploaded.
    spool = tmp_path / "spool"
    consumer = hsx_service("consume", "--job", job, "--device", "cpu", "--spool", str(spool), name="consume")
    wait_for(
        lambda: (v := status(hsx, job, None))["workers_alive"]["gpu_consumer"] == 1 and v["state"] == "running",
        timeout=90,
        what="the consumer counted alive",
        procs=[consumer],
    )
    wait_for(
        lambda: status(hsx, job, None)["samples_written"] == count,
        timeout=90,
        what="every sample written",
        procs=[consumer],
        period=0.5,
    )
    # Its kernels, per live consumer, as its heartbeat says: a dense model has no linear attention.
    kernels = {
        "type": "kernels.v1",
        "attention": "sdpa",
        "linear_attention": None,
        "conv1d": None,
        "compiled": False,
        "compile_error": "",
    }
    # (the first heartbeat after the model's load carries them: within the 5 s between beats).
    wait_for(
        lambda: [c["kernels"] for c in status(hsx, job, None)["consumers"]] == [kernels],
        timeout=30,
        what="the consumer's kernels in status",
        procs=[consumer],
        period=0.5,
    )
    text = check_ok(hsx("status", "--job", job), "hsx status").stdout
    assert "  kernels  attention sdpa (1 consumer)" in text, text
    # A clean stop: its goodbye says `stopping`, so it is not alive, and work is left: stalled.
    consumer.send_signal(signal.SIGTERM)
    assert consumer.wait(timeout=60) == STOPPED, logs_of(consumer)
    ready = log_events(consumer, "consumer_ready")
    assert [event["kernels"] for event in ready] == [{k: v for k, v in kernels.items() if k != "type"}], ready
    view = status(hsx, job, None)
    assert view["state"] == "stalled" and view["workers_alive"] == {"gpu_consumer": 0, "uploader": 0}, view
    assert view["consumers"] == [], view
    assert view["no_worker_alive_s"] is not None and view["no_worker_alive_s"] < 60, view

    # A beat that says it was sent ten minutes ago was stored now: its age is the server's, not
    # the sender's clock (issue 35, item 9), so that worker counts alive, until its goodbye.
    publish_heartbeat(nats_server.url, job, instance="ghost-consumer", service="gpu_consumer", state="idle", age_s=600)
    view = status(hsx, job, None)
    assert view["state"] == "running" and view["workers_alive"]["gpu_consumer"] == 1, view
    publish_heartbeat(
        nats_server.url, job, instance="ghost-consumer", service="gpu_consumer", state="stopping", age_s=0
    )
    view = status(hsx, job, None)
    assert view["state"] == "stalled" and view["no_worker_alive_s"] < 60, view
    text = check_ok(hsx("status", "--job", job), "hsx status").stdout
    assert f"job {job}: stalled: no worker alive for" in text, text

    # Two uploaders: counted by service, and the job finishes.
    uploaders = [hsx_service("upload", "--job", job, "--spool", str(spool), name=f"upload-{i}") for i in range(2)]
    wait_for(
        lambda: status(hsx, job, None)["workers_alive"] == {"gpu_consumer": 0, "uploader": 2},
        timeout=60,
        what="two uploaders counted alive",
        procs=uploaders,
    )
    wait_for(lambda: status(hsx, job, None)["done"], timeout=60, what="the job done", procs=uploaders)
    view = status(hsx, job, None)
    assert view["state"] == "done" and view["eta_s"] == 0, view
    assert view["elapsed_s"] > 0 and view["finished_at"] >= view["started_at"], view
    assert abs(view["average_samples_per_s"] - count / view["elapsed_s"]) < 0.01, view
    text = check_ok(hsx("status", "--job", job), "hsx status").stdout
    assert f"job {job}: done, " in text and "from the first sample written to the last stored (" in text, text
    for uploader in uploaders:
        uploader.send_signal(signal.SIGTERM)
        assert uploader.wait(timeout=60) == STOPPED, logs_of(uploader)  # never told the job is done

    # A worker of the finished job that falls silent is no problem: the monitor names none, and
    # its summary says how long the job took.
    publish_heartbeat(nats_server.url, job, instance="ghost-uploader", service="uploader", state="retrying", age_s=1)
    monitor = hsx_service(
        "monitor", "--job", job, "--until-done", "--format", "json", "--silent-after", "5", name="monitor"
    )
    assert monitor.wait(timeout=60) == 0, logs_of(monitor)
    assert not log_events(monitor, "consumer_silent"), logs_of(monitor)
    assert not log_events(monitor, "worker_degraded"), logs_of(monitor)
    summary = log_events(monitor, "job_summary")
    assert len(summary) == 1, logs_of(monitor)
    assert summary[0]["elapsed_s"] > 0 and summary[0]["samples_per_s"] > 0, summary
    progress = log_events(monitor, "progress")
    assert progress and progress[-1]["workers_silent"] == 0, progress[-1:]
    assert status(hsx, job, None)["state"] == "done"


@pytest.mark.faults
def test_an_unreachable_endpoint_is_shown_in_status(tmp_path, hsx, hsx_service, tiny_model, job_name, s3_env):
    bucket, env = s3_env
    job = job_name
    _produce(hsx, tmp_path, tiny_model, job, count=6, dest=f"s3://{bucket}/prefix", env=env)
    spool = tmp_path / "spool"
    closed = {**env, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{_free_port()}"}  # nothing listens there
    consumer = hsx_service("consume", "--job", job, "--device", "cpu", "--spool", str(spool), env=env, name="consume")
    uploader = hsx_service("upload", "--job", job, "--spool", str(spool), env=closed, name="upload")
    view = wait_for(
        lambda: (v := status(hsx, job, env))["destination_error"] and v,
        timeout=90,
        what="the uploader's error in hsx status",
        procs=[consumer, uploader],
        period=0.5,
    )
    assert "127.0.0.1" in view["destination_error"] or "connect" in view["destination_error"].lower(), view
    assert view["state"] == "running" and view["workers_alive"]["uploader"] == 1, view
    assert view["samples_uploaded"] == 0 and not view["done"], view
    # Said in every heartbeat until an upload succeeds, while trying again as well as between tries.
    for _ in range(2):
        time.sleep(5.5)  # a heartbeat every 5 s (WorkerConfig.heartbeat_s)
        again = status(hsx, job, env)
        assert again["destination_error"] and not again["failed"], again


def test_status_after_hsx_up_says_its_embedded_nats_is_gone(tmp_path, cli, monkeypatch):
    # What `hsx up` leaves in its workdir (commands/up.py): the embedded server's store and the
    # output folder with the job's bundle; the server itself is gone with hsx up.
    workdir = tmp_path / "hsx-demo"
    (workdir / "nats" / "jetstream").mkdir(parents=True)
    bundle = workdir / "out" / "demo" / "_hsx"
    bundle.mkdir(parents=True)
    (bundle / "job.json").write_text(json.dumps({"job": "demo", "dest": str(workdir / "out")}))
    monkeypatch.chdir(tmp_path)
    run = cli("status", "--job", "demo", "--timeout", "5", env={"HSX_NATS_URL": f"nats://127.0.0.1:{_free_port()}"})
    assert run.returncode != 0, run
    assert "embedded NATS of hsx up" in run.stderr and "is not running" in run.stderr, run.stderr
    assert f"{workdir / 'out'}/demo" in run.stderr and "hsx verify" in run.stderr, run.stderr
    assert "produce" not in run.stderr, run.stderr


def test_a_test_starts_in_an_empty_folder_away_from_the_checkout():
    """What the test above reads is what `make run` leaves in the checkout: so that `make run`
    then `make test` (the README's order, and CI's) passes, no test starts where those files
    are (tests/conftest.py, _working_directory)."""
    here = Path.cwd().resolve()
    assert here != REPO and REPO not in here.parents, here
    assert list(here.iterdir()) == [], here


def test_eta_is_smooth_over_bursts():
    # 250 samples every 75 s (one batch at a time, longer than a minute), read every 5 s: the rate
    # and so the ETA stay within a fifth of themselves, never unknown between two batches.
    window = RateWindow()
    total, done, rates, etas = 100_000, 0, [], []
    for tick in range(0, 3000, 5):
        if tick % 75 == 0:
            done += 250
        window.add(done, now=float(tick))
        if tick >= 1500:
            rates.append(window.per_second())
            etas.append(eta_seconds(total - done, window.per_second()))
    assert all(eta is not None for eta in etas), etas
    assert max(rates) / min(rates) < 1.25, (min(rates), max(rates))
    # About the true rate (250 per 75 s), give or take the burst in hand.
    assert 250 / 75 * 0.85 < min(rates) and max(rates) < 250 / 75 * 1.15, (min(rates), max(rates))
    # A stop lets it fall, not stay where it was.
    before = window.per_second()
    for tick in range(3000, 4500, 5):
        window.add(done, now=float(tick))
    assert window.per_second() < before / 2


class _Screen:
    """A terminal's lines as `\\r`, `\\n` and erase-line draw them (enough for the bar)."""

    def __init__(self) -> None:
        self.lines, self.row, self.col = [""], 0, 0

    def write(self, text: str) -> int:
        index = 0
        while index < len(text):
            if text.startswith("\x1b[2K", index):
                self.lines[self.row] = ""
                index += 4
                continue
            char = text[index]
            index += 1
            if char == "\r":
                self.col = 0
            elif char == "\n":
                self.row, self.col = self.row + 1, 0
                if self.row == len(self.lines):
                    self.lines.append("")
            else:
                line = self.lines[self.row].ljust(self.col)
                self.lines[self.row] = line[: self.col] + char + line[self.col + 1 :]
                self.col += 1
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_a_log_line_of_another_process_does_not_run_into_the_bar():
    screen = _Screen()
    bar = TerminalBar(screen)
    bar.draw("job [#####...............]  25.0% 1/4 | ETA 6s")
    # A worker started with `&` in the same shell writes its log line to the same terminal.
    line = "2025-01-01T00:00:00.000000Z [info     ] batch_done          batch=b0 samples=4 tokens=120 seconds=0.31"
    screen.write(line + "\n")
    bar.draw("job [##########..........]  50.0% 2/4 | ETA 4s")
    bar.above.write("2025-01-01T00:00:01.000000Z [warning  ] worker_degraded     instance=u-1\n")
    bar.finish()
    assert screen.lines[0] == line, screen.lines
    assert screen.lines[1].startswith("2025-01-01T00:00:01") and "worker_degraded" in screen.lines[1], screen.lines
    assert screen.lines[2] == "job [##########..........]  50.0% 2/4 | ETA 4s", screen.lines
