"""Workers that start, end and stop as they say: `--until-done` exits 0 after a finished job and 1
after one that cannot finish; the first Ctrl-C is said at once and a second stops now, the batch
in hand left unacked; a consumer refused at start (a device it cannot use) or whose model does
not load leaves no live heartbeat behind; a job that is not there is waited for, bounded by
`--wait-for-job`.

Real nats-server (and moto S3 for a finished job), real processes, a tiny real model on the CPU.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time
from pathlib import Path

import nats
import pytest
from conftest import _free_port
from test_e2e_s3 import check_ok, logs_of, produce, read_s3_objects, status, write_dataset
from test_exhausted import _batch_of, _block_sample_path

from hsx.commands.cli import build_command_config, build_parser
from hsx.commands.embedded import start_nats_server
from hsx.config.settings import resolve
from hsx.exitcodes import JOB_FAILED, STOPPED
from hsx.wire import topology
from hsx.wire.jobs import last_heartbeats
from hsx.wire.worker import UNTIL_DONE_WAIT_FOR_JOB_S

FAST = ("--ack-wait", "2", "--retry-delay", "0.2")
EXIT_TIMEOUT_S = 150.0


def _records(proc) -> list[dict]:
    return [json.loads(line) for line in Path(proc.log_path).read_text().splitlines() if line.startswith("{")]


def _events(proc, name: str) -> list[dict]:
    return [record for record in _records(proc) if record.get("event") == name]


def _wait_exit(proc, *, timeout: float, others=()) -> int:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            pytest.fail(f"{' '.join(proc.args[3:6])} still running after {timeout:.0f} s\n{logs_of(proc, *others)}")
        time.sleep(0.2)
    return proc.returncode


def _wait_for_event(proc, name: str, *, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _events(proc, name)
        if found:
            return found[0]
        assert proc.poll() is None, f"exited before {name}\n{logs_of(proc)}"
        time.sleep(0.05)
    pytest.fail(f"no {name} within {timeout:.0f} s\n{logs_of(proc)}")


def _heartbeats(url: str, job: str) -> list:
    """Each worker's last heartbeat, read as `hsx jobs` and the status code read them."""

    async def read():
        nc = await nats.connect(url)
        try:
            return await last_heartbeats(nc.jetstream(), job)
        finally:
            await nc.close()

    return asyncio.run(read())


def _queued_batches(url: str, job: str) -> int:
    async def read() -> int:
        nc = await nats.connect(url)
        try:
            info = await nc.jetstream().stream_info(
                topology.BATCHES_STREAM, subjects_filter=topology.batch_subject(job)
            )
            return sum((info.state.subjects or {}).values())
        finally:
            await nc.close()

    return asyncio.run(read())


def _small_job(tmp_path, hsx, tiny_model, job: str, *, dest: str, env: dict | None = None, rows: int = 24) -> None:
    write_dataset(tmp_path / "data.jsonl", rows, min_len=8, max_len=40, seed=7)
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=dest,
        token_budget=96,
        max_seq_len=64,
        env=env,
    )


def test_until_done_workers_exit_0_once_the_job_is_done(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name, s3_env
):
    bucket, env = s3_env
    _small_job(tmp_path, hsx, tiny_model, job_name, dest=f"s3://{bucket}/out", env=env)
    spool = str(tmp_path / "spool")
    consumer = hsx_service(
        "consume", "--job", job_name, "--device", "cpu", "--spool", spool, "--until-done", env=env, name="consume"
    )
    uploader = hsx_service("upload", "--job", job_name, "--spool", spool, "--until-done", env=env, name="upload")
    for proc in (consumer, uploader):
        code = _wait_exit(proc, timeout=EXIT_TIMEOUT_S, others=[consumer, uploader])
        assert code == 0, logs_of(consumer, uploader)
        assert _events(proc, "job_done"), logs_of(proc)
    view = json.loads(check_ok(hsx("status", "--job", job_name, "--json", env=env), "status").stdout)
    assert view["done"] and view["samples_uploaded"] == 24, view
    assert len([key for key in read_s3_objects(bucket, "out") if key.endswith(".safetensors")]) == 24
    # Both said goodbye: neither is left looking alive (or silent) after the job.
    states = {beat.instance: beat.state for beat in _heartbeats(nats_server.url, job_name)}
    assert len(states) == 2 and all(state == "stopping" for state in states.values()), states


def test_until_done_workers_exit_1_when_the_job_cannot_finish(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name
):
    out = tmp_path / "out"
    _small_job(tmp_path, hsx, tiny_model, job_name, dest=str(out))
    bad = 5
    samples = _batch_of(nats_server.url, job_name, bad)
    spool = tmp_path / "spool"
    # The sample's spool file cannot be written on any delivery: its batch is dead-lettered.
    _block_sample_path(spool, out, job_name, bad)
    consumer = hsx_service(
        "consume", "--job", job_name, "--device", "cpu", "--spool", str(spool), *FAST, "--until-done", name="consume"
    )
    uploader = hsx_service("upload", "--job", job_name, "--spool", str(spool), "--until-done", name="upload")
    for proc in (consumer, uploader):
        code = _wait_exit(proc, timeout=EXIT_TIMEOUT_S, others=[consumer, uploader])
        assert code == JOB_FAILED, f"exited {code}, expected {JOB_FAILED} (failed)\n{logs_of(consumer, uploader)}"
        failed = _events(proc, "job_failed")
        assert failed and failed[-1]["dead_samples"] == samples, logs_of(proc)


def test_ctrl_c_says_stopping_at_once_and_a_second_stops_now(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name
):
    out = tmp_path / "out"
    _small_job(tmp_path, hsx, tiny_model, job_name, dest=str(out), rows=6)
    spool = str(tmp_path / "spool")
    marker = tmp_path / "hang"
    # The forward of sample 0's batch hangs (a wedged device): a stop has a batch in hand to finish.
    consumer = hsx_service(
        "consume",
        "--job",
        job_name,
        "--device",
        "cpu",
        "--spool",
        spool,
        env={"HSX_TEST_HANG_SAMPLE": "0", "HSX_TEST_HANG_MARKER": str(marker)},
        name="consume",
    )
    uploader = hsx_service("upload", "--job", job_name, "--spool", spool, name="upload")
    _wait_for_event(consumer, "test_forward_hanging")
    _wait_for_event(uploader, "uploader_ready")

    # The uploader: stopping is said at once, with the uploads it is finishing, and it exits 75.
    uploader.send_signal(signal.SIGINT)
    sent = time.monotonic()
    stopping = _wait_for_event(uploader, "stopping", timeout=10)
    assert time.monotonic() - sent < 1.0, "the uploader said nothing within 1 s of Ctrl-C"
    assert stopping["signal"] == "SIGINT" and isinstance(stopping["uploads_in_hand"], int), stopping
    assert _wait_exit(uploader, timeout=30) == STOPPED, logs_of(uploader)

    # The consumer, its forward hung: stopping names the batch it is finishing, within 1 s.
    consumer.send_signal(signal.SIGINT)
    sent = time.monotonic()
    stopping = _wait_for_event(consumer, "stopping", timeout=10)
    assert time.monotonic() - sent < 1.0, "the consumer said nothing within 1 s of Ctrl-C"
    finishing = stopping["finishing"]
    assert isinstance(finishing, list) and len(finishing) == 1 and finishing[0].startswith(job_name), stopping
    time.sleep(0.5)
    assert consumer.poll() is None, "the first Ctrl-C must let the batch in hand finish"
    # A second Ctrl-C stops now: the batch stays unacked in the queue, for redelivery.
    consumer.send_signal(signal.SIGINT)
    sent = time.monotonic()
    code = _wait_exit(consumer, timeout=10)
    assert time.monotonic() - sent < 5.0, logs_of(consumer)
    assert code == STOPPED, logs_of(consumer)  # stopped now, but as safe to run again as after the first
    assert _events(consumer, "stopping_now"), logs_of(consumer)
    assert _queued_batches(nats_server.url, job_name) >= 1
    states = {beat.instance: beat.state for beat in _heartbeats(nats_server.url, job_name)}
    assert states and all(state == "stopping" for state in states.values()), states
    marker.with_name(marker.name + ".release").touch()


def test_a_refused_consumer_leaves_no_heartbeat(tmp_path, hsx, nats_server, tiny_model, job_name):
    _small_job(tmp_path, hsx, tiny_model, job_name, dest=str(tmp_path / "out"), rows=4)
    spool = str(tmp_path / "spool")
    for device, named in (("cuda:0", "CUDA is not available"), ("mps", "mps")):
        refused = hsx("consume", "--job", job_name, "--device", device, "--spool", spool, timeout=120)
        assert refused.returncode == 2, (refused.stdout + refused.stderr)[-3000:]
        errors = [line for line in refused.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and errors[0].startswith(f"hsx: error: --device {device}"), refused.stderr
        assert named in errors[0] and "Traceback" not in refused.stderr, refused.stderr
        assert _heartbeats(nats_server.url, job_name) == [], f"--device {device} left a heartbeat"
        assert not Path(spool).exists(), f"--device {device} made the spool"


def test_a_consumer_whose_model_does_not_load_leaves_only_its_goodbye(tmp_path, hsx, nats_server, tiny_model, job_name):
    model = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3"), model)
    write_dataset(tmp_path / "data.jsonl", 4, min_len=8, max_len=20, seed=3)
    produce(
        hsx,
        job=job_name,
        model=model,
        dataset=tmp_path / "data.jsonl",
        dest=str(tmp_path / "out"),
        token_budget=96,
        max_seq_len=64,
        env=None,
    )
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    failed = hsx("consume", "--job", job_name, "--device", "cpu", "--spool", str(tmp_path / "spool"), timeout=120)
    assert failed.returncode == 2 and "hsx: error: model" in failed.stderr, (failed.stdout + failed.stderr)[-3000:]
    states = [beat.state for beat in _heartbeats(nats_server.url, job_name)]
    assert states in ([], ["stopping"]), states


@pytest.mark.parametrize("command", ["consume", "upload"])
def test_wait_for_job_bounds_the_wait_for_a_missing_job(tmp_path, hsx, command, tiny_model, job_name):
    """A worker told to wait 2 s for a job that is not there gives up in one line, whatever the
    server holds: beside other jobs it lists them; where no job was ever produced it says so."""
    _small_job(tmp_path, hsx, tiny_model, job_name, dest=str(tmp_path / "out"), rows=4)
    fresh = start_nats_server(tmp_path / "fresh", log_file=tmp_path / "fresh.log")
    missing = f"{job_name}-missing"
    device = ("--device", "cpu") if command == "consume" else ()
    try:
        for nats_url, says in (
            (None, "); jobs there: "),
            (fresh.url, "): no job was ever produced on this server"),
        ):
            given = ("--nats", nats_url) if nats_url else ()
            started = time.monotonic()
            run = hsx(
                command, "--job", missing, *device, "--spool", str(tmp_path / "spool"), "--wait-for-job", "2", *given
            )
            assert time.monotonic() - started < 60
            assert run.returncode != 0, run.stderr
            last = run.stderr.strip().splitlines()[-1]
            assert last.startswith(f"hsx: error: job {missing} not found in KV bucket hsx_jobs after waiting 2 s"), last
            assert says in last, last  # the jobs there are listed (20 at most), or there are none
            waiting = [json.loads(line) for line in run.stderr.splitlines() if '"waiting_for_job_spec"' in line]
            assert waiting and waiting[0]["job"] == missing, run.stderr
    finally:
        fresh.stop()


def _worker_config(*argv: str):
    parser = build_parser()
    args = parser.parse_args(list(argv))
    resolve(parser, args, {})
    return build_command_config(parser, args, prepare=False)


def test_until_done_bounds_the_wait_for_the_job_by_default():
    """A batch scheduler's worker (--until-done) gives up on a job that is not there after at most
    10 minutes unless --wait-for-job says otherwise; a worker without --until-done waits on."""
    for command, extra in (("consume", ("--device", "cpu")), ("upload", ())):
        bounded = _worker_config(command, "--job", "j", *extra, "--until-done").wait_for_job_s
        assert bounded == UNTIL_DONE_WAIT_FOR_JOB_S and 0 < bounded <= 600
        assert _worker_config(command, "--job", "j", *extra, "--until-done", "--wait-for-job", "3").wait_for_job_s == 3
        assert _worker_config(command, "--job", "j", *extra).wait_for_job_s is None


def test_a_mistyped_job_is_named_with_its_near_match_and_until_done_gives_up(
    tmp_path, hsx, nats_server, tiny_model, job_name
):
    """`--job chat-eagl3` beside a job chat-eagle3: the waiting line and the final error say "did
    you mean chat-eagle3?", and under --until-done the worker exits 2 once the wait is over (here
    --wait-for-job 3, the default's stand-in) instead of waiting for ever."""
    job = f"{job_name}-eagle3"
    _small_job(tmp_path, hsx, tiny_model, job, dest=str(tmp_path / "out"), rows=4)
    typo = f"{job_name}-eagl3"
    spool = str(tmp_path / "spool")
    run = hsx("consume", "--job", typo, "--device", "cpu", "--spool", spool, "--until-done", "--wait-for-job", "3")
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"hsx: error: job {typo} not found") and f"did you mean {job}?" in last, last
    waiting = [json.loads(line) for line in run.stderr.splitlines() if '"waiting_for_job_spec"' in line]
    assert waiting and waiting[0]["did_you_mean"] == job, run.stderr[-3000:]
    assert f"did you mean {job}?" in waiting[0]["hint"], waiting[0]
    assert _queued_batches(nats_server.url, job) > 0  # the real job is untouched


def test_a_worker_waiting_for_its_job_rides_out_a_nats_restart(tmp_path, hsx, hsx_service, tiny_model, job_name):
    """An uploader started before its producer, waiting for the spec while the server restarts
    (a JetStream leader lost or a server restarting answers a KV read with 503 or a timeout):
    before, that read's error ended the uploader with a traceback. It waits on, then serves the
    job the producer records once the server is back."""
    store, port = tmp_path / "nats", _free_port()
    server = start_nats_server(store, port=port, log_file=tmp_path / "nats-server.log")
    env = {"HSX_NATS_URL": server.url}
    rows = write_dataset(tmp_path / "data.jsonl", 6, min_len=4, max_len=24, seed=3)

    def produce_job(job: str) -> None:
        produce(
            hsx,
            job=job,
            model=tiny_model("qwen3"),
            dataset=tmp_path / "data.jsonl",
            dest=str(tmp_path / "out" / job),
            token_budget=64,
            max_seq_len=32,
            env=env,
        )

    try:
        # Another job first: the jobs bucket exists, and the uploader waits for its own spec.
        produce_job(f"{job_name}-other")
        spool = str(tmp_path / "spool")
        uploader = hsx_service("upload", "--job", job_name, "--spool", spool, "--until-done", env=env, name="upload")
        deadline = time.monotonic() + 60
        while '"logger": "hsx.jobs"' not in Path(uploader.log_path).read_text():  # its waiting line
            assert uploader.poll() is None and time.monotonic() < deadline, logs_of(uploader)
            time.sleep(0.1)
        server.stop()
        time.sleep(8)  # past the client's 5 s request timeout
        assert uploader.poll() is None, logs_of(uploader)
        server = start_nats_server(store, port=port, log_file=tmp_path / "nats-server.log")
        produce_job(job_name)
        consumer = hsx_service(
            "consume", "--job", job_name, "--device", "cpu", "--spool", spool, "--until-done", env=env, name="consume"
        )
        for proc in (uploader, consumer):
            assert proc.wait(timeout=120) == 0, logs_of(uploader, consumer)
        assert "Traceback" not in Path(uploader.log_path).read_text(), logs_of(uploader)
        view = status(hsx, job_name, env)
        assert view["done"] and view["samples_uploaded"] == len(rows), view
    finally:
        server.stop()
