"""A consumer stopped while its forward hangs (a wedged device: devkit/faults.py
HSX_TEST_HANG_SAMPLE) exits 75 within its grace period, the bound gpu_consumer/grace.py derives
from its settings: the hung stage is waited for up to its bound, then abandoned, its batch left
to its redelivery; a consumer started after it finishes the job, every sample once.
"""

import asyncio
import json
import signal
import time
from pathlib import Path

import nats
from test_e2e_s3 import check_outputs, logs_of, produce, read_dir_objects, status, write_dataset

from hsx.exitcodes import DONE, STOPPED
from hsx.gpu_consumer.config import ConsumerConfig
from hsx.gpu_consumer.grace import stop_bound_s
from hsx.wire import schemas, topology
from hsx.wire.natsconn import NatsSettings

STALL_AFTER_S = 5.0


def _first_batch(url: str, job: str) -> list[int]:
    """The samples of the first descriptor in the queue: the first a new consumer takes."""

    async def read() -> list[int]:
        nc = await nats.connect(url)
        try:
            raw = await nc.jetstream().get_msg(
                topology.BATCHES_STREAM, 1, subject=topology.batch_subject(job), next=True
            )
            return sorted(sample.index for sample in schemas.batch_decoder.decode(raw.data).samples)
        finally:
            await nc.close()

    return asyncio.run(read())


def _events(proc, name: str) -> list[dict]:
    lines = Path(proc.log_path).read_text().splitlines()
    return [record for line in lines if line.startswith("{") and (record := json.loads(line)).get("event") == name]


def test_a_consumer_stopped_on_a_hung_forward_exits_75_within_its_grace(
    hsx, hsx_service, nats_server, tiny_model, job_name, tmp_path
):
    rows = write_dataset(tmp_path / "data.jsonl", 12, min_len=8, max_len=30, seed=21)
    out = tmp_path / "out"
    produce(
        hsx,
        job=job_name,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=64,
        max_seq_len=32,
        env=None,
    )
    hung = _first_batch(nats_server.url, job_name)[0]
    marker = tmp_path / "hang"
    spool = str(tmp_path / "spool")
    settings = ("--stall-after", str(STALL_AFTER_S), "--ack-wait", "5")
    consumer = hsx_service(
        *("consume", "--job", job_name, "--device", "cpu", "--spool", spool, *settings),
        env={"HSX_TEST_HANG_SAMPLE": str(hung), "HSX_TEST_HANG_MARKER": str(marker)},
        name="consume-hung",
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert consumer.poll() is None and time.monotonic() < deadline, logs_of(consumer)
        time.sleep(0.05)
    # The first forward hangs, so no pace is measured: every forward's bound is --stall-after.
    bound = stop_bound_s(
        ConsumerConfig(nats=NatsSettings(url=nats_server.url), instance="x", job=job_name, stall_after_s=STALL_AFTER_S)
    )
    signalled = time.monotonic()
    consumer.send_signal(signal.SIGTERM)
    while consumer.poll() is None:
        assert time.monotonic() - signalled < bound, f"still running {bound:.0f} s after SIGTERM\n{logs_of(consumer)}"
        time.sleep(0.05)
    took = time.monotonic() - signalled
    print(f"\nGRACE SIGTERM on a hung forward -> exit {consumer.returncode} in {took:.1f} s (bound {bound:.0f} s)")
    assert consumer.returncode == STOPPED, logs_of(consumer)
    abandoned = _events(consumer, "stalled_stage_abandoned")
    assert abandoned and abandoned[0]["stage"] == "forward", logs_of(consumer)
    assert _events(consumer, "consumer_stopped") and _events(consumer, "exiting_past_hung_stages"), logs_of(consumer)

    # The hung batch was left unacked: a new consumer gets it after the ack wait; the job is done.
    workers = [
        hsx_service(
            *("consume", "--job", job_name, "--device", "cpu", "--spool", spool, *settings, "--until-done"),
            name="consume",
        ),
        hsx_service("upload", "--job", job_name, "--spool", spool, "--until-done", name="upload"),
    ]
    for worker in workers:
        assert worker.wait(timeout=180) == DONE, logs_of(*workers)
    check_outputs(read_dir_objects(out), job=job_name, rows=rows)
    view = status(hsx, job_name, None)
    assert view["done"] and view["samples_uploaded"] == len(rows) and view["dead_letters"] == 0, view
