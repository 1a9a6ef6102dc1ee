"""Messages anyone who can publish on the job's NATS server may send (issue 35, items 6 to 9): a
crafted one never makes a worker touch a file, subject or sample outside what its own job's plan
names, never replaces a stored sample, and never fails a healthy job.

Everything is real: nats-server, the workers as processes, a tiny qwen3 model; the crafted
messages are raw JSON published with nats-py on the subjects hsx's own publishers use.
"""

import asyncio
import json
import time

import msgspec
import nats
from test_e2e_s3 import (
    check_ok,
    check_outputs,
    logs_of,
    produce,
    read_dir_objects,
    start_monitor,
    status,
    wait_until_done,
    write_dataset,
)

from hsx.wire import schemas, topology
from hsx.wire.events import HEARTBEAT_CLOCK_SKEW_S, heard_heartbeat
from hsx.wire.jobs import live_workers


def _beat(job: str, **fields) -> schemas.Heartbeat:
    return schemas.Heartbeat(job=job, service="uploader", instance="intruder", node="n", state="refused", **fields)


def test_a_heartbeat_is_believed_only_within_its_clock_skew_and_only_for_its_own_subject():
    stored = 1_000_000.0
    subject = topology.heartbeat_subject("j", "intruder")
    future = schemas.encode(_beat("j", sent_at=stored + 1e9, detail="bucket gone"))
    assert heard_heartbeat(future, subject=subject, stored_at=stored, job="j").sent_at == stored
    near = schemas.encode(_beat("j", sent_at=stored - HEARTBEAT_CLOCK_SKEW_S + 1))
    assert (
        heard_heartbeat(near, subject=subject, stored_at=stored, job="j").sent_at == stored - HEARTBEAT_CLOCK_SKEW_S + 1
    )
    # Another job's beat, a beat on another instance's subject, a payload of another kind: not heard.
    assert heard_heartbeat(future, subject=subject, stored_at=stored, job="k") is None
    other = topology.heartbeat_subject("j", "someone-else")
    assert heard_heartbeat(future, subject=other, stored_at=stored, job="j") is None
    assert heard_heartbeat(b'{"type": "heartbeat.v1"}', subject=subject, stored_at=stored, job="j") is None
    assert heard_heartbeat(b"\xff", subject=subject, stored_at=stored, job="j") is None


def test_a_crafted_refusal_from_the_future_neither_fails_a_healthy_job_nor_keeps_it_alive(
    hsx, hsx_service, nats_server, tiny_model, job_name, tmp_path
):
    rows = write_dataset(tmp_path / "data.jsonl", 12, min_len=4, max_len=40, seed=41)
    out, spool = tmp_path / "out", str(tmp_path / "spool")
    produce(
        hsx,
        job=job_name,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=64,
        max_seq_len=64,
        env=None,
    )
    crafted = _beat(job_name, sent_at=time.time() + 1e9, detail="s3://b: NoSuchBucket on PutObject")

    async def publish() -> float:
        nc = await nats.connect(nats_server.url)
        try:
            ack = await nc.jetstream().publish(
                topology.heartbeat_subject(job_name, "intruder"), msgspec.json.encode(crafted)
            )
            stored = await nc.jetstream().get_msg(topology.EVENTS_STREAM, ack.seq)
            return stored.time.timestamp()
        finally:
            await nc.drain()

    stored_at = asyncio.run(publish())
    view = status(hsx, job_name, None)
    assert not view["failed"] and view["batches_queued"] > 0, view
    monitor = start_monitor(hsx_service, job_name, None)
    workers = [
        hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", spool, name="consume"),
        hsx_service("upload", "--job", job_name, "--spool", spool, name="upload"),
    ]
    wait_until_done(monitor, workers, timeout=120)
    assert monitor.returncode == 0, logs_of(monitor)
    check_outputs(read_dir_objects(out), job=job_name, rows=rows)
    for worker in workers:
        worker.terminate()
        worker.wait(timeout=30)

    async def alive_later() -> list[str]:
        nc = await nats.connect(nats_server.url)
        try:
            return await live_workers(nc.jetstream(), job_name, now=stored_at + 31)
        finally:
            await nc.drain()

    # Its word lasts as long as a real worker's would from when the server stored it: `hsx jobs
    # delete` is not refused for good.
    assert not [worker for worker in asyncio.run(alive_later()) if "intruder" in worker]
    assert json.loads(check_ok(hsx("status", "--job", job_name, "--json"), "status").stdout)["done"]
