"""File events have no delivery limit: an event that has outlived many dying uploaders is still
uploaded by the next one (with a limit, JetStream would keep it queued forever and the job would
never finish)."""

import asyncio

from test_e2e_s3 import (
    check_final_status,
    check_outputs,
    produce,
    read_dir_objects,
    start_monitor,
    status,
    wait_until_done,
    wait_until_spooled,
    write_dataset,
)

from hsx.wire import topology
from hsx.wire.natsconn import NatsSettings, connect

NODE = "testnode"  # tests/conftest.py gives every service this node
DELIVERIES = 12  # more than the 10 the file durable used to allow


async def _take_without_acking(url: str, job: str, times: int) -> list[int]:
    """What an uploader that dies holding an event does, `times` times over: fetch it, never ack."""
    nc = await connect(NatsSettings(url=url), name="dying-uploaders")
    try:
        js = nc.jetstream()
        durable = await topology.ensure_upload_consumer(js, job, NODE, ack_wait_s=0.3)
        sub = await js.pull_subscribe_bind(durable=durable, stream=topology.FILES_STREAM)
        deliveries = []
        for _ in range(times):
            msg = (await sub.fetch(1, timeout=5))[0]
            deliveries.append(msg.metadata.num_delivered)
            await asyncio.sleep(0.35)  # past the ack wait: redelivered
        await sub.unsubscribe()
        return deliveries
    finally:
        await nc.drain()


def test_a_file_event_redelivered_many_times_is_still_uploaded(
    hsx, hsx_service, nats_server, tiny_model, job_name, tmp_path
):
    rows = write_dataset(tmp_path / "data.jsonl", 6, min_len=8, max_len=40, seed=5)
    out = tmp_path / "out"
    produce(
        hsx,
        job=job_name,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=128,
        max_seq_len=64,
        env=None,
    )
    spool = tmp_path / "spool"
    consumer = hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", str(spool), name="consumer")
    wait_until_spooled(hsx, consumer, job_name, 6)

    deliveries = asyncio.run(_take_without_acking(nats_server.url, job_name, DELIVERIES))
    assert deliveries == list(range(1, DELIVERIES + 1)), deliveries  # the same event, delivered again each time

    uploader = hsx_service("upload", "--job", job_name, "--spool", str(spool), "--ack-wait", "0.3", name="uploader")
    wait_until_done(start_monitor(hsx_service, job_name, None), [consumer, uploader])
    check_outputs(read_dir_objects(out), job=job_name, rows=rows)
    check_final_status(status(hsx, job_name, None), total=6)
