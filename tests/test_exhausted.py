"""Every batch ends: a batch that uses up its deliveries is dead-lettered naming its samples, the
job reports `failed`, and `hsx dead retry --all` brings the samples back to a complete, exact
destination. Never stuck in the work queue, whatever took its deliveries:

1. the spool cannot take one sample's file on any delivery (its path is a directory: EISDIR);
2. the consumer is SIGKILLed by the same batch on every delivery (host OOM killer, segfault),
   so only JetStream knows the batch is spent (its max-deliveries advisory, hsx/wire/exhausted.py);
3. the nats-server is stopped and restarted at the moment the consumer stores the dead letter;
4. the backstop sweep finds a spent batch whose advisory never arrived.

Real nats-server, real processes, a real tiny model; `hsx verify` recomputes samples from scratch.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import nats
import pytest
from conftest import _free_port
from test_e2e_s3 import check_ok, check_outputs, job_plan, logs_of, produce, read_dir_objects, write_dataset

from hsx.commands.embedded import start_nats_server
from hsx.exitcodes import JOB_FAILED
from hsx.storage.spool import spool_file
from hsx.wire import schemas, topology
from hsx.wire.events import EventPublisher

FAST = ("--ack-wait", "2", "--retry-delay", "0.2")
TIMEOUT_S = 150.0


def _produce_job(tmp_path, hsx, tiny_model, job: str, env: dict | None = None) -> tuple[list[dict], Path, dict]:
    rows = write_dataset(tmp_path / "data.jsonl", 24, min_len=8, max_len=40, seed=7)
    out = tmp_path / "out"
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=96,
        max_seq_len=64,
        env=env,
    )
    view = json.loads(check_ok(hsx("status", "--job", job, "--json", env=env), "status").stdout)
    assert view["batches_total"] >= 4, view
    return rows, out, view


def _batch_of(url: str, job: str, sample: int) -> list[int]:
    """The sample indices of the queued batch that holds `sample`."""

    async def read() -> list[int]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            seq = 0
            while True:
                raw = await js.get_msg(topology.BATCHES_STREAM, seq + 1, subject=topology.batch_subject(job), next=True)
                batch = schemas.batch_decoder.decode(raw.data)
                if sample in [s.index for s in batch.samples]:
                    return sorted(s.index for s in batch.samples)
                seq = raw.seq
        finally:
            await nc.close()

    return asyncio.run(read())


def _wait_exit(proc, *, timeout: float, others=()) -> int:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            pytest.fail(f"{' '.join(proc.args[3:6])} still running after {timeout:.0f} s\n{logs_of(proc, *others)}")
        time.sleep(0.2)
    return proc.returncode


def _monitor_fails_naming(hsx_service, job: str, samples: list[int], env: dict | None, others) -> dict:
    monitor = hsx_service("monitor", "--job", job, "--until-done", "--interval", "0.5", env=env, name="monitor")
    code = _wait_exit(monitor, timeout=TIMEOUT_S, others=others)
    assert code == JOB_FAILED, f"monitor --until-done exited {code}, expected {JOB_FAILED}\n{logs_of(monitor, *others)}"
    lines = [json.loads(line) for line in Path(monitor.log_path).read_text().splitlines() if line.startswith("{")]
    failed = [line for line in lines if line.get("event") == "job_failed"]
    assert failed and failed[-1]["dead_samples"] == samples, f"job_failed names {failed[-1:]} not {samples}"
    return failed[-1]


def _retry_and_finish(hsx, hsx_service, job: str, rows, out: Path, env: dict | None, workers) -> None:
    listed = json.loads(check_ok(hsx("dead", "list", "--job", job, "--json", env=env), "dead list").stdout)
    assert listed, "no dead letters listed"
    check_ok(hsx("dead", "retry", "--job", job, "--all", env=env), "dead retry")
    monitor = hsx_service("monitor", "--job", job, "--until-done", "--interval", "0.5", env=env, name="monitor-after")
    code = _wait_exit(monitor, timeout=TIMEOUT_S, others=workers)
    assert code == 0, f"after the retry monitor --until-done exited {code}\n{logs_of(monitor, *workers)}"
    check_outputs(read_dir_objects(out), job=job, rows=rows)
    verify = hsx("verify", "--job", job, "--recompute", "3", "--json", env=env, timeout=180)
    assert verify.returncode == 0, (
        f"verify exited {verify.returncode}\n{verify.stdout[-3000:]}\n{verify.stderr[-3000:]}"
    )
    view = json.loads(check_ok(hsx("status", "--job", job, "--json", env=env), "status").stdout)
    assert view["done"] and view["samples_uploaded"] == len(rows) and view["dead_letters"] == 0, view


def _block_sample_path(spool: Path, out: Path, job: str, sample: int) -> Path:
    """Make the sample's spool file impossible to write: its path is a non-empty directory."""
    blocker = spool_file(spool, job, job_plan(out, job), sample)
    blocker.mkdir(parents=True)
    (blocker / "in-the-way").write_text("x")
    return blocker


def test_a_write_that_fails_on_every_delivery_ends_dead_lettered_then_retried(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name
):
    rows, out, _ = _produce_job(tmp_path, hsx, tiny_model, job_name)
    bad = 5
    samples = _batch_of(nats_server.url, job_name, bad)
    spool = tmp_path / "spool"
    blocker = _block_sample_path(spool, out, job_name, bad)
    consumer = hsx_service(
        "consume", "--job", job_name, "--device", "cpu", "--spool", str(spool), *FAST, name="consume"
    )
    uploader = hsx_service("upload", "--job", job_name, "--spool", str(spool), name="upload")
    _monitor_fails_naming(hsx_service, job_name, samples, None, [consumer, uploader])
    letters = json.loads(hsx("dead", "list", "--job", job_name, "--json").stdout)
    assert [sorted(letter["samples"]) for letter in letters] == [samples], letters
    assert letters[0]["deliveries"] == topology.BATCH_MAX_DELIVER and "Is a directory" in letters[0]["error"], letters
    shutil.rmtree(blocker)
    _retry_and_finish(hsx, hsx_service, job_name, rows, out, None, [consumer, uploader])


def test_a_batch_that_kills_its_consumer_every_time_is_dead_lettered_then_retried(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name
):
    rows, out, _ = _produce_job(tmp_path, hsx, tiny_model, job_name)
    bad = 11
    samples = _batch_of(nats_server.url, job_name, bad)
    spool = str(tmp_path / "spool")
    uploader = hsx_service("upload", "--job", job_name, "--spool", spool, name="upload")
    monitor = hsx_service("monitor", "--job", job_name, "--until-done", "--interval", "0.5", name="monitor")
    kills = 0
    consumer = None
    deadline = time.monotonic() + TIMEOUT_S
    # A supervisor's restart loop: each consumer dies (SIGKILL) as soon as it starts the batch.
    while monitor.poll() is None:
        assert time.monotonic() < deadline, f"not failed after {kills} kills\n{logs_of(monitor, consumer, uploader)}"
        if consumer is None or consumer.poll() is not None:
            if consumer is not None:
                assert consumer.returncode == -9, logs_of(consumer)
                kills += 1
            consumer = hsx_service(
                "consume",
                "--job",
                job_name,
                "--device",
                "cpu",
                "--spool",
                spool,
                *FAST,
                env={"HSX_TEST_CRASH_ON_SAMPLE": str(bad)},
                name="consume-crashing",
            )
        time.sleep(0.2)
    assert monitor.returncode == JOB_FAILED, logs_of(monitor, consumer, uploader)
    assert kills == topology.BATCH_MAX_DELIVER, f"{kills} kills"
    failed = [json.loads(line) for line in Path(monitor.log_path).read_text().splitlines() if '"job_failed"' in line]
    assert failed and failed[-1]["dead_samples"] == samples, failed
    letters = json.loads(hsx("dead", "list", "--job", job_name, "--json").stdout)
    assert [sorted(letter["samples"]) for letter in letters] == [samples] and "never finished" in letters[0]["error"], (
        letters
    )
    consumer.kill()
    healthy = hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", spool, *FAST, name="consume")
    _retry_and_finish(hsx, hsx_service, job_name, rows, out, None, [healthy, uploader])
    print(f"\nEXHAUSTED sigkill: kills={kills} samples={samples}")


def test_nats_restart_while_dead_lettering_loses_nothing(tmp_path, hsx, hsx_service, tiny_model, job_name):
    store, port = tmp_path / "nats", _free_port()
    server = start_nats_server(store, port=port, log_file=tmp_path / "nats-server.log")
    try:
        env = {"HSX_NATS_URL": server.url}
        rows, out, _ = _produce_job(tmp_path, hsx, tiny_model, job_name, env)
        bad = 3
        samples = _batch_of(server.url, job_name, bad)
        spool = tmp_path / "spool"
        blocker = _block_sample_path(spool, out, job_name, bad)
        hold = tmp_path / "hold"
        hold.mkdir()
        consumer = hsx_service(
            "consume",
            "--job",
            job_name,
            "--device",
            "cpu",
            "--spool",
            str(spool),
            *FAST,
            env={**env, "HSX_TEST_HOLD_DEAD_LETTER": str(hold)},
            name="consume",
        )
        uploader = hsx_service("upload", "--job", job_name, "--spool", str(spool), env=env, name="upload")
        deadline = time.monotonic() + TIMEOUT_S
        while not (hold / "holding").exists():
            assert time.monotonic() < deadline and consumer.poll() is None, logs_of(consumer, uploader)
            time.sleep(0.05)
        server.stop()
        (hold / "release").touch()  # the letter is now stored while NATS is gone
        time.sleep(3.0)
        server = start_nats_server(store, port=port, log_file=tmp_path / "nats-server.log")
        _monitor_fails_naming(hsx_service, job_name, samples, env, [consumer, uploader])
        assert consumer.poll() is None and uploader.poll() is None, logs_of(consumer, uploader)
        letters = json.loads(hsx("dead", "list", "--job", job_name, "--json", env=env).stdout)
        assert [sorted(letter["samples"]) for letter in letters] == [samples], letters
        shutil.rmtree(blocker)
        _retry_and_finish(hsx, hsx_service, job_name, rows, out, env, [consumer, uploader])
    finally:
        server.stop()


async def _one_batch_queued(js, job: str, *, samples: int, ack_wait_s: float):
    """The job's durable (with this ack wait), one batch published to its queue, and a bound pull
    subscription: (durable, batch, subscription)."""
    await topology.ensure_topology(js)
    durable = await topology.ensure_gpu_consumer(js, job, ack_wait_s=ack_wait_s)
    batch = schemas.BatchDescriptor(
        job=job,
        batch_id=f"{job}-b0",
        padded_len=3,
        samples=[schemas.Sample(index=i, source_id=str(i), input_ids=[1, 2, 3]) for i in range(samples)],
    )
    await js.publish(topology.batch_subject(job), schemas.encode(batch), headers={"Nats-Msg-Id": batch.batch_id})
    return durable, batch, await js.pull_subscribe_bind(durable=durable, stream=topology.BATCHES_STREAM)


def test_sweep_dead_letters_a_spent_batch_whose_advisory_was_lost(nats_server, job_name):
    from hsx.wire.exhausted import sweep

    async def scenario() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            durable, batch, sub = await _one_batch_queued(js, job_name, samples=2, ack_wait_s=0.5)
            for _ in range(topology.BATCH_MAX_DELIVER):  # every delivery taken and never acked
                await sub.fetch(1, timeout=5)
                await asyncio.sleep(0.7)
            with pytest.raises((asyncio.TimeoutError, nats.errors.TimeoutError)):
                await sub.fetch(1, timeout=1)  # spent: never delivered again
            # The server takes the last delivery off the durable's pending list once its ack wait
            # has passed, when its own timer looks: waited for as the state the sweep reads, not
            # assumed from the clock.
            deadline = time.monotonic() + 60
            while (await js.consumer_info(topology.BATCHES_STREAM, durable)).num_ack_pending:
                assert time.monotonic() < deadline, "the spent delivery is still pending after 60 s"
                await asyncio.sleep(0.1)
            # The advisory is lost (as in a leader election at that moment).
            await js.purge_stream(
                topology.ADVISORIES_STREAM, subject=topology.max_deliveries_subject(topology.BATCHES_STREAM, durable)
            )
            events = EventPublisher(nc, js, job_name)
            assert await sweep(js, events) == 1
            assert await sweep(js, events) == 0
            info = await js.stream_info(topology.BATCHES_STREAM, subjects_filter=topology.batch_subject(job_name))
            assert not sum((info.state.subjects or {}).values()), "the spent batch is still queued"
            dead = await js.subscribe(topology.dead_subject_all(job_name), ordered_consumer=True)
            letter = schemas.dead_decoder.decode((await dead.next_msg(timeout=5)).data)
            assert letter.sample_indices == [0, 1] and letter.batch == batch and letter.source_seq > 0
            await sub.unsubscribe()
            await dead.unsubscribe()
        finally:
            await nc.close()

    asyncio.run(scenario())


def test_a_batch_handed_back_on_its_last_delivery_is_queued_fresh(nats_server, job_name):
    """A consumer stopping with a batch in hand on its last delivery (graceful stop, or the
    descriptor it fetched ahead): a nak would strand it; it is published again with a fresh
    delivery count and the spent copy removed."""
    from hsx.wire.jetstream import give_back

    async def scenario() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            _, batch, sub = await _one_batch_queued(js, job_name, samples=1, ack_wait_s=30)
            for delivery in range(1, topology.BATCH_MAX_DELIVER + 1):
                (msg,) = await sub.fetch(1, timeout=5)
                assert msg.metadata.num_delivered == delivery
                await give_back(js, msg)  # a nak until the last delivery
            (fresh,) = await sub.fetch(1, timeout=5)
            assert fresh.metadata.num_delivered == 1 and schemas.batch_decoder.decode(fresh.data) == batch
            assert fresh.metadata.sequence.stream != msg.metadata.sequence.stream
            await fresh.ack_sync()
            info = await js.stream_info(topology.BATCHES_STREAM, subjects_filter=topology.batch_subject(job_name))
            assert not sum((info.state.subjects or {}).values()), "the spent copy is still queued"
            await sub.unsubscribe()
        finally:
            await nc.close()

    asyncio.run(scenario())
