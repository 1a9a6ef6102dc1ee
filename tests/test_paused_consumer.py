"""A consumer that cannot work holds no work back (issue 10, item 6).

1. Paused at its spool's high-water mark (node A: no uploader, a 1-byte mark): it stops after its
   first batch holding nothing (no descriptor fetched ahead and kept alive through the pause);
   node B's consumer and uploader finish every other batch. An uploader started for node A at
   the end drains its spool; the job is done with every sample in the destination once.
2. A forward that hangs (test switch HSX_TEST_HANG_SAMPLE): past its bound (`--stall-after`) the
   consumer stops vouching for the batch and says `stalled`; the monitor logs `consumer_stalled`
   naming the batch; JetStream redelivers it after the ack wait and a second consumer finishes it.
   Then the hung forward ends after all: its batch is no longer in the queue (done by the second
   consumer), so the late result is dropped; the job is done with every sample once.

Everything real: nats-server, a tiny qwen3 on the CPU, every service a subprocess.
"""

from __future__ import annotations

import asyncio
import time

import nats
from test_chaos import check_uploaded_once, log_events, log_time, wait_for
from test_crash_recovery import wait_settled
from test_e2e_s3 import (
    check_final_status,
    check_outputs,
    logs_of,
    produce,
    read_dir_objects,
    spool_files,
    start_monitor,
    status,
    wait_until_done,
    write_dataset,
)

from hsx.wire import topology


def gpu_durable_state(url: str, job: str) -> tuple[int, int]:
    """(num_ack_pending, num_pending) of the job's GPU durable: batches in some consumer's hands,
    and batches waiting in the queue."""

    async def read() -> tuple[int, int]:
        nc = await nats.connect(url)
        try:
            info = await nc.jetstream().consumer_info(topology.BATCHES_STREAM, topology.gpu_durable(job))
            return info.num_ack_pending, info.num_pending
        finally:
            await nc.drain()

    return asyncio.run(read())


def test_a_paused_consumer_holds_no_batch_and_the_other_node_finishes_every_batch(
    tmp_path,
    hsx,
    hsx_service,
    nats_server,
    tiny_model,
    job_name,
):
    job = job_name
    rows = write_dataset(tmp_path / "data.jsonl", 40, min_len=8, max_len=40, seed=81)
    out = tmp_path / "out"
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=128,
        max_seq_len=64,
        env=None,
    )
    total_batches = status(hsx, job, None)["batches_total"]
    assert total_batches >= 8, total_batches
    spool_a, spool_b = tmp_path / "spool-a", tmp_path / "spool-b"
    monitor = start_monitor(hsx_service, job, None)
    consumer_a = hsx_service(
        "consume",
        "--job",
        job,
        "--device",
        "cpu",
        "--spool",
        str(spool_a),
        "--spool-high-water",
        "1",
        env={"HSX_NODE": "nodea"},
        name="consume-a",
    )
    procs = [monitor, consumer_a]

    def a_paused() -> bool:
        return bool(log_events(consumer_a, "spool_high_water_paused")) and any(
            r["node"] == "nodea" and r["state"] == "paused" for r in log_events(monitor, "worker_degraded")
        )

    wait_for(
        a_paused, timeout=60, what="node A paused and its heartbeat saying so", procs=procs, alive=procs, period=0.2
    )
    done_by_a = [r["batch"] for r in log_events(consumer_a, "batch_done")]
    # The 1-byte mark is passed by its first batch: it fetched nothing ahead of it, started nothing after.
    assert len(done_by_a) == 1, f"node A did {len(done_by_a)} batches before pausing\n{logs_of(consumer_a)}"
    # Paused, it holds nothing: no batch is in any consumer's hands, every other one waits in the queue.
    for _ in range(6):
        held, waiting = gpu_durable_state(nats_server.url, job)
        assert (held, waiting) == (0, total_batches - 1), (
            f"node A paused holds {held} batches, {waiting} wait in the queue\n{logs_of(consumer_a)}"
        )
        time.sleep(0.5)

    consumer_b = hsx_service(
        "consume", "--job", job, "--device", "cpu", "--spool", str(spool_b), env={"HSX_NODE": "nodeb"}, name="consume-b"
    )
    uploader_b = hsx_service(
        "upload", "--job", job, "--spool", str(spool_b), env={"HSX_NODE": "nodeb"}, name="upload-b"
    )
    procs += [consumer_b, uploader_b]
    wait_for(
        lambda: status(hsx, job, None)["batches_done"] == total_batches,
        timeout=60,
        what="every batch written",
        procs=procs,
        alive=procs,
        period=0.5,
    )
    done_by_b = [r["batch"] for r in log_events(consumer_b, "batch_done")]
    assert (
        sorted(done_by_b + done_by_a) == sorted(set(done_by_b + done_by_a)) and len(done_by_b) == total_batches - 1
    ), (done_by_a, done_by_b)
    assert [r["batch"] for r in log_events(consumer_a, "batch_done")] == done_by_a, "node A worked while paused"
    assert not log_events(consumer_a, "spool_resumed"), logs_of(consumer_a)
    # Node A's files wait in its spool (no uploader there): the job is not done yet.
    assert len(spool_files(spool_a)) == log_events(consumer_a, "batch_done")[0]["samples"] > 0, spool_files(spool_a)
    assert monitor.poll() is None, logs_of(monitor)

    uploader_a = hsx_service(
        "upload", "--job", job, "--spool", str(spool_a), env={"HSX_NODE": "nodea"}, name="upload-a"
    )
    wait_until_done(monitor, [consumer_a, consumer_b, uploader_a, uploader_b])
    check_outputs(read_dir_objects(out), job=job, rows=rows)
    view = status(hsx, job, None)
    check_final_status(view, total=len(rows))
    # No batch was handed back and forth: not one delivery was spent on the pause.
    assert view["batch_redeliveries"] == 0 and view["samples_requeued"] == 0, view
    check_uploaded_once(nats_server.url, job, len(rows))
    assert not spool_files(spool_a) and not spool_files(spool_b), (spool_files(spool_a), spool_files(spool_b))
    paused_at = log_time(log_events(consumer_a, "spool_high_water_paused")[0])
    b_ready = log_time(log_events(consumer_b, "consumer_ready")[0])
    b_done = max(log_time(r) for r in log_events(consumer_b, "batch_done"))
    print(
        f"\nPAUSED batches={total_batches} node_a_batches={len(done_by_a)} held_while_paused=0 "
        f"node_b_batches={len(done_by_b)} batch_redeliveries={view['batch_redeliveries']} "
        f"a_paused_to_b_ready_s={b_ready - paused_at:.1f} b_ready_to_all_written_s={b_done - b_ready:.1f}"
    )


HANG_SAMPLE = 5


def test_a_hung_forward_is_reported_stalled_and_its_batch_finished_by_another_consumer(
    tmp_path,
    hsx,
    hsx_service,
    nats_server,
    tiny_model,
    job_name,
):
    job = job_name
    rows = write_dataset(tmp_path / "data.jsonl", 24, min_len=8, max_len=40, seed=83)
    out = tmp_path / "out"
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=128,
        max_seq_len=64,
        env=None,
    )
    spool = tmp_path / "spool"
    marker = tmp_path / "hang.marker"
    consume_args = (
        "consume",
        "--job",
        job,
        "--device",
        "cpu",
        "--spool",
        str(spool),
        "--ack-wait",
        "2",
        "--stall-after",
        "2",
    )
    hang_env = {"HSX_TEST_HANG_SAMPLE": str(HANG_SAMPLE), "HSX_TEST_HANG_MARKER": str(marker)}
    monitor = start_monitor(hsx_service, job, None)
    uploader = hsx_service("upload", "--job", job, "--spool", str(spool), name="upload")
    hung = hsx_service(*consume_args, env=hang_env, name="consume-hung")
    procs = [monitor, uploader, hung]

    wait_for(
        lambda: log_events(hung, "forward_stalled"),
        timeout=60,
        what="the hung forward declared stalled",
        procs=procs,
        alive=procs,
        period=0.1,
    )
    assert log_events(hung, "test_forward_hanging"), logs_of(hung)
    stalled_batch = log_events(hung, "forward_stalled")[0]["batch"]
    instance = log_events(hung, "consumer_ready")[0]["consumer"]

    def reported() -> list[dict]:
        return [r for r in log_events(monitor, "consumer_stalled") if r["instance"] == instance]

    wait_for(
        reported, timeout=30, what="the monitor reporting the consumer stalled", procs=procs, alive=procs, period=0.2
    )
    report = reported()[0]
    assert report["batch"] == stalled_batch and report["service"] == "gpu_consumer", report
    assert report["stalled_s"] >= 2, report
    assert any(r["instance"] == instance and r["state"] == "stalled" for r in log_events(monitor, "worker_degraded"))

    # Released: a second consumer gets the stalled batch (after the ack wait: no in_progress was
    # sent for it since the stall) and the one the stalled consumer had fetched ahead (handed back
    # at the stall), and everything after them. Kept alive, neither would ever come to it.
    second = hsx_service(*consume_args, env=hang_env, name="consume-2")
    procs.append(second)

    def redone() -> list[dict]:
        return [r for r in log_events(second, "batch_done") if r["batch"] == stalled_batch]

    wait_for(
        redone,
        timeout=60,
        what="the stalled batch finished by the second consumer",
        procs=procs,
        alive=procs,
        period=0.2,
    )
    assert not log_events(hung, "batch_done") or stalled_batch not in {
        r["batch"] for r in log_events(hung, "batch_done")
    }
    total_batches = status(hsx, job, None)["batches_total"]
    wait_for(
        lambda: (
            len({r["batch"] for r in log_events(second, "batch_done") + log_events(hung, "batch_done")})
            == total_batches
        ),
        timeout=60,
        what="every batch written",
        procs=procs,
        alive=procs,
        period=0.2,
    )

    # The hung forward ends after all: its batch was finished by the second consumer meanwhile
    # (acked, out of the queue), so the late result is dropped, nothing written twice.
    (tmp_path / "hang.marker.release").touch()
    # (The monitor may have seen the job done and exited already: every sample was in place.)
    wait_for(
        lambda: [r for r in log_events(hung, "released_batch_settled_elsewhere") if r["batch"] == stalled_batch],
        timeout=30,
        what="the late forward dropping its batch, settled elsewhere",
        procs=procs,
        alive=[uploader, hung, second],
        period=0.2,
    )
    assert log_events(hung, "stalled_forward_finished"), logs_of(hung)
    assert stalled_batch not in {r["batch"] for r in log_events(hung, "batch_done")}, logs_of(hung)
    wait_until_done(monitor, [uploader, hung, second])
    view = wait_settled(hsx, job, None, spool, procs)
    check_outputs(read_dir_objects(out), job=job, rows=rows)
    check_final_status(view, total=len(rows))
    assert view["samples_requeued"] == 0 and view["batch_redeliveries"] >= 1, view
    # Each sample was uploaded once.
    check_uploaded_once(nats_server.url, job, len(rows))
    assert hung.poll() is None and second.poll() is None, logs_of(hung, second)
    stalled_at = log_time(log_events(hung, "forward_stalled")[0])
    hang_began = log_time(log_events(hung, "test_forward_hanging")[0])
    second_ready = log_time(log_events(second, "consumer_ready")[0])
    print(
        f"\nSTALL bound_s={log_events(hung, 'forward_stalled')[0]['bound_s']} "
        f"hang_to_stalled_s={stalled_at - hang_began:.1f} "
        f"stalled_to_monitor_s={log_time(reported()[0]) - stalled_at:.1f} "
        f"second_ready_to_redone_s={log_time(redone()[0]) - second_ready:.1f} "
        f"redone_attempt={redone()[0]['attempt']} batch_redeliveries={view['batch_redeliveries']}"
    )


def test_the_stall_bound_grows_with_the_batch_and_the_measured_pace_and_has_a_floor():
    from hsx.gpu_consumer.stall import ForwardPace
    from hsx.wire.schemas import BatchDescriptor, Sample

    def batch(size: int, padded_len: int) -> BatchDescriptor:
        samples = [Sample(index=i, source_id=str(i), input_ids=[1] * padded_len) for i in range(size)]
        return BatchDescriptor(job="j", batch_id=f"b{size}x{padded_len}", padded_len=padded_len, samples=samples)

    pace = ForwardPace(stall_after_s=300, stall_factor=10)
    assert pace.bound_s(batch(64, 512)) == 300  # nothing measured yet: the floor
    pace.add(batch(64, 512), 8.0)  # 32768 padded tokens in 8 s
    assert pace.bound_s(batch(64, 512)) == 300  # 10 x 8 s is under the floor
    assert pace.bound_s(batch(256, 512)) == 10 * 32.0  # four times the tokens: 10 x 32 s
    pace.add(batch(64, 512), 16.0)  # one slow batch moves the pace a fifth of the way
    # float64 arithmetic on a value of 384: a few units of 2^-52 * 384 (1e-13) apart at most.
    assert abs(pace.bound_s(batch(256, 512)) - 10 * 32.0 * 1.2) < 1e-6
