"""A three-node JetStream cluster with every hsx stream and bucket replicated three times (R3):
the leader of HSX_BATCHES is killed (SIGKILL) in the middle of a job, and the job still ends with
every sample in the destination exactly once and correct.

Every process is given all three URLs (`--nats a,b,c`), as GPU nodes on other machines would be.
The consumer's spool high-water mark is below the job's output, so without an uploader it writes
a few batches and pauses; the kill comes once it has written its first batch and before any
uploader has started. Most batches are then extracted, and every file uploaded, with one server
of three gone, and a descriptor the consumer holds across the kill is acked to the new leader.
"""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from test_e2e_s3 import (
    LAYERS,
    Reference,
    check_final_status,
    check_ok,
    check_outputs,
    read_dir_objects,
    start_monitor,
    status,
    wait_until_done,
    write_dataset,
)

from devkit import start_nats_cluster
from hsx.wire import topology
from hsx.wire.jobs import count_messages

NODE = "gpu-a"
REPLICATED = (
    *(config.name for config in topology.STREAMS),
    topology.kv_stream(topology.JOBS_BUCKET),
    topology.object_store_stream(topology.DATASETS_BUCKET),
)


@pytest.fixture
def cluster(tmp_path):
    nats_cluster = start_nats_cluster(tmp_path / "nats", log_dir=tmp_path)
    yield nats_cluster
    nats_cluster.stop()


async def _replication(urls: str) -> dict[str, tuple[int, str, int]]:
    """stream -> (replicas configured, leader, followers known)."""
    nc = await nats.connect(urls.split(","))
    try:
        js = nc.jetstream()
        views = {}
        for stream in REPLICATED:
            info = await js.stream_info(stream)
            views[stream] = (info.config.num_replicas, info.cluster.leader, len(info.cluster.replicas or []))
        return views
    finally:
        await nc.drain()


async def _written_events(urls: str, job: str) -> int:
    """The job's `written` markers, counted from the stream's subjects (one request, no consumer
    created: in a cluster creating one is a meta-layer proposal, which a loaded machine can take
    longer than the API timeout to answer); 0 while the cluster does not answer in time."""
    nc = await nats.connect(urls.split(","))
    try:
        return await count_messages(nc.jetstream(), topology.EVENTS_STREAM, topology.markers_all(job, "written", "*"))
    except nats.errors.TimeoutError:
        return 0
    finally:
        await nc.drain()


def test_job_completes_when_the_stream_leader_dies(tmp_path, cluster, hsx, hsx_service, tiny_model, job_name):
    job, urls = job_name, cluster.urls
    env = {"HSX_NATS_URL": urls}
    rows = write_dataset(tmp_path / "data.jsonl", 40, min_len=4, max_len=120, seed=11)
    out, spool = tmp_path / "out", tmp_path / "spool"
    check_ok(
        hsx(
            "produce",
            "--job",
            job,
            "--model",
            str(tiny_model("qwen3")),
            "--dataset",
            str(tmp_path / "data.jsonl"),
            "--layers",
            ",".join(map(str, LAYERS)),
            "--dest",
            str(out),
            "--dtype",
            "float32",
            "--token-budget",
            "256",
            "--max-seq-len",
            "128",
            "--replicas",
            "3",
            env=env,
            nats_url=urls,
        ),
        "hsx produce --replicas 3",
    )
    replication = asyncio.run(_replication(urls))
    assert all(replicas == 3 and followers == 2 for replicas, _, followers in replication.values()), replication

    worker_args = ("--spool", str(spool), "--node", NODE, "--ack-wait", "5")
    consumer = hsx_service(
        "consume", "--job", job, "--device", "cpu", "--spool-high-water", "512K", *worker_args, env=env, name="consume"
    )
    deadline = time.monotonic() + 60
    while asyncio.run(_written_events(urls, job)) == 0:
        assert consumer.poll() is None, "the consumer exited"
        assert time.monotonic() < deadline, "no batch written within 60 s"
        time.sleep(0.2)

    before = status(hsx, job, env)
    assert before["samples_uploaded"] == 0 and before["batches_done"] < before["batches_total"], before
    leader = asyncio.run(_replication(urls))[topology.BATCHES_STREAM][1]
    cluster.server_named(leader).kill()
    survivors = ",".join(server.url for server in cluster.servers if server.name != leader)

    uploader = hsx_service("upload", "--job", job, *worker_args, env=env, name="upload")
    monitor = start_monitor(hsx_service, job, env)
    waited = wait_until_done(monitor, [consumer, uploader], timeout=75)
    print(
        f"done {waited:.1f} s after killing the HSX_BATCHES leader {leader}; before it, "
        f"{before['batches_done']} of {before['batches_total']} batches were done"
    )

    after = asyncio.run(_replication(survivors))
    assert after[topology.BATCHES_STREAM][1] != leader, "HSX_BATCHES has no new leader"
    objects = {key: data for key, data in read_dir_objects(out).items() if "/_hsx/" not in key}
    outputs = check_outputs(objects, job=job, rows=rows)
    check_final_status(status(hsx, job, {"HSX_NATS_URL": survivors}), total=len(rows))
    longest = max(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    Reference(tiny_model("qwen3")).check(
        outputs[longest]["hidden_states"], rows[longest]["input_ids"], what=f"sample {longest}"
    )


def test_replicas_are_refused_by_a_single_server(tmp_path, hsx, tiny_model, job_name):
    write_dataset(tmp_path / "data.jsonl", 4, min_len=4, max_len=16, seed=1)
    result = hsx(
        "produce",
        "--job",
        job_name,
        "--model",
        str(tiny_model("qwen3")),
        "--dataset",
        str(tmp_path / "data.jsonl"),
        "--layers",
        "0",
        "--dest",
        str(tmp_path / "out"),
        "--replicas",
        "3",
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        "hsx: error: --replicas 3: JetStream refused it (replicas > 1 not supported in non-clustered mode)"
    ), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
