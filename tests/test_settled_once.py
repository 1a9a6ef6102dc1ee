"""A batch is settled once (issue 21, items 8, 9 and 11).

- A forward released by the stall watchdog on its batch's last delivery, which ends only after the
  exhausted-batch reaper dead-lettered the batch, writes nothing: the batch is dead-lettered or
  written, never both; `hsx dead retry` then finishes it.
- A descriptor fetched ahead that is a redelivery, waiting for the batch before it to be written,
  stays in progress: no other consumer can take it meanwhile (in-process, a real BatchWorker and
  pull loop against the session's nats-server).
- A dead letter whose samples were written after all (a consumer that handed back a spent batch
  as a fresh copy and died before removing the spent one) is shown resolved and not retried.
  Batches that are not the plan's own (a poison retry of a planned sample) are extracted but
  never push `batches_done` past `batches_total` (the same job, afterwards).
- A spool write that hangs is a stall like a hung forward: the batch is released and another
  consumer finishes the job.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import msgspec
import nats
import nats.errors
from test_chaos import check_uploaded_once, log_events, wait_for
from test_e2e_s3 import (
    check_ok,
    logs_of,
    produce,
    spool_files,
    start_monitor,
    status,
    wait_until_done,
    write_dataset,
)
from test_fidelity import _spec

from hsx.gpu_consumer.config import ConsumerConfig
from hsx.gpu_consumer.model import load_model
from hsx.gpu_consumer.scheduler import pull_loop
from hsx.gpu_consumer.service import BatchWorker
from hsx.storage import encodings
from hsx.wire import schemas, topology
from hsx.wire.events import EventPublisher
from hsx.wire.natsconn import NatsSettings, connect


def _job(hsx, tiny_model, tmp_path, job: str, count: int, *, seed: int, lengths, budget: int, max_seq_len: int):
    """A job of `count` dataset rows (`lengths`: min and max tokens) produced into tmp_path/out;
    returns the rows."""
    rows = write_dataset(tmp_path / "data.jsonl", count, min_len=lengths[0], max_len=lengths[1], seed=seed)
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(tmp_path / "out"),
        token_budget=budget,
        max_seq_len=max_seq_len,
        env=None,
    )
    return rows


def _spend_deliveries(url: str, job: str, count: int, *, ack_wait_s: float) -> tuple[int, bytes]:
    """Take the job's batch `count` times and nak it each time (as consumers that failed on it
    would); returns its stream sequence and payload. The job has one batch: with more, each
    fetch could take another."""

    async def spend() -> tuple[int, bytes]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            durable = await topology.ensure_gpu_consumer(js, job, ack_wait_s=ack_wait_s)
            sub = await js.pull_subscribe_bind(durable=durable, stream=topology.BATCHES_STREAM)
            for _ in range(count):
                [msg] = await sub.fetch(1, timeout=5)
                await msg.nak()
            await sub.unsubscribe()
            return msg.metadata.sequence.stream, msg.data
        finally:
            await nc.drain()

    return asyncio.run(spend())


def _pull_once(url: str, job: str) -> None:
    """One pull request on the job's GPU durable, as another consumer's would be: JetStream finds
    a message whose deliveries are used up only when it next looks for one to deliver."""

    async def pull() -> None:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            sub = await js.pull_subscribe_bind(durable=topology.gpu_durable(job), stream=topology.BATCHES_STREAM)
            try:
                for msg in await sub.fetch(1, timeout=1):
                    await msg.nak()
            except (TimeoutError, nats.errors.TimeoutError):
                pass
            await sub.unsubscribe()
        finally:
            await nc.drain()

    asyncio.run(pull())


def _dead_letters(hsx, job: str) -> list[dict]:
    return json.loads(check_ok(hsx("dead", "list", "--job", job, "--json"), "dead list").stdout)


def test_a_stalled_forward_on_the_last_delivery_writes_nothing_once_its_batch_is_dead_lettered(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name
):
    job = job_name
    _job(hsx, tiny_model, tmp_path, job, 4, seed=41, lengths=(4, 30), budget=256, max_seq_len=32)
    assert status(hsx, job, None)["batches_total"] == 1
    _spend_deliveries(nats_server.url, job, topology.BATCH_MAX_DELIVER - 1, ack_wait_s=2)
    spool = tmp_path / "spool"
    marker = tmp_path / "hang.marker"
    consumer = hsx_service(
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
        "1",
        env={"HSX_TEST_HANG_SAMPLE": "0", "HSX_TEST_HANG_MARKER": str(marker)},
        name="consume",
    )
    wait_for(
        lambda: log_events(consumer, "forward_stalled"),
        timeout=60,
        what="the last delivery's forward stalled",
        procs=[consumer],
        alive=[consumer],
        period=0.1,
    )

    # Once the ack wait has passed (in_progress stopped at the stall), the next pull makes
    # JetStream find the spent batch. When the server's timer notices that an ack wait has passed
    # is its own affair: pull until the reaper has dead-lettered it, rather than once after a sleep.
    def pulled_and_dead_lettered() -> list[dict]:
        _pull_once(nats_server.url, job)
        return _dead_letters(hsx, job)

    wait_for(
        pulled_and_dead_lettered,
        timeout=60,
        what="the spent batch dead-lettered by the reaper",
        procs=[consumer],
        alive=[consumer],
        period=0.5,
    )
    (tmp_path / "hang.marker.release").touch()
    wait_for(
        lambda: log_events(consumer, "stalled_forward_finished"),
        timeout=30,
        what="the hung forward ending",
        procs=[consumer],
        alive=[consumer],
        period=0.1,
    )
    time.sleep(2.0)
    view = status(hsx, job, None)
    assert view["samples_written"] == 0 and not log_events(consumer, "batch_done"), (
        f"a batch both dead-lettered and written\n{view}\n{logs_of(consumer)}"
    )
    assert not [p for p in spool_files(spool) if p.suffix == ".safetensors"], spool_files(spool)
    letters = _dead_letters(hsx, job)
    assert len(letters) == 1 and sorted(letters[0]["samples"]) == [0, 1, 2, 3] and not letters[0]["resolved"], letters

    check_ok(hsx("dead", "retry", "--job", job, "--all"), "dead retry")
    wait_for(
        lambda: status(hsx, job, None)["samples_written"] == 4,
        timeout=60,
        what="the retried batch written",
        procs=[consumer],
        alive=[consumer],
        period=0.5,
    )


class _RedeliveredAhead:
    """The consumer's subscription, except that the descriptor it fetches ahead (its second fetch)
    comes as a redelivery: fetched, nak'ed, fetched again, as a batch whose consumer died would."""

    def __init__(self, sub) -> None:
        self.sub, self.calls = sub, 0
        self.redelivered = asyncio.Event()  # the redelivery is in the consumer's hands

    async def fetch(self, batch: int, timeout: float):
        self.calls += 1
        if self.calls != 2:
            return await self.sub.fetch(batch, timeout=timeout)
        [msg] = await self.sub.fetch(1, timeout=5)
        await msg.nak()
        again = await self.sub.fetch(1, timeout=5)
        self.redelivered.set()
        return again


async def _held_while_waiting(url: str, model_path, job: str, spool) -> tuple[list, int]:
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    samples = [schemas.Sample(index=i, source_id=str(i), input_ids=row) for i, row in enumerate(ids)]
    spec = _spec(job, model_path, [1, 3], "float32", samples)
    nc = await connect(NatsSettings(url=url), name="test-held")
    js = nc.jetstream()
    await topology.ensure_topology(js)
    for sample in samples:
        batch_id = f"{job}-{sample.index}"
        descriptor = schemas.BatchDescriptor(
            job=job, batch_id=batch_id, padded_len=len(sample.input_ids), samples=[sample]
        )
        await js.publish(topology.batch_subject(job), schemas.encode(descriptor), headers={"Nats-Msg-Id": batch_id})
    ack_wait = 1.0
    durable = await topology.ensure_gpu_consumer(js, job, ack_wait_s=ack_wait)
    sub = await js.pull_subscribe_bind(durable=durable, stream=topology.BATCHES_STREAM)
    cfg = ConsumerConfig(
        nats=NatsSettings(url=url),
        job=job,
        device="cpu",
        spool=spool,
        node="node-a",
        instance="held-1",
        spool_high_water_bytes=1 << 60,
        retry_delay_s=0.1,
        ack_wait_s=ack_wait,
    )
    stopping = asyncio.Event()
    loaded = load_model(str(model_path), layers=[1, 3], encoding=encodings.of_spec("float32"), device="cpu")
    worker = BatchWorker(cfg, js, EventPublisher(nc, js, job), spec, loaded, stopping)
    # The first batch's files are written slowly (a slow disk): the descriptor fetched ahead, a
    # redelivery, waits for it, for several ack waits.
    release = threading.Event()
    write_one = worker._write_one

    def slow_write(batch_id, sample, hidden):
        if sample.index == 0:
            release.wait(timeout=30)
        return write_one(batch_id, sample, hidden)

    worker._write_one = slow_write
    ahead = _RedeliveredAhead(sub)
    looping = asyncio.create_task(pull_loop(worker, ahead, cfg, stopping))
    taken = []
    other = await js.pull_subscribe_bind(durable=durable, stream=topology.BATCHES_STREAM)
    try:
        await asyncio.wait_for(ahead.redelivered.wait(), timeout=30)
        # Four ack waits: a held message without in_progress would be handed out again.
        try:
            taken = await other.fetch(1, timeout=4 * ack_wait)
        except (TimeoutError, nats.errors.TimeoutError):
            taken = []
        for msg in taken:
            await msg.nak()
    finally:
        release.set()
        deadline = time.monotonic() + 30
        while len(list(spool.rglob("*.safetensors"))) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stopping.set()
        await looping
        await other.unsubscribe()
        await sub.unsubscribe()
        worker.close()
    queued = (await js.consumer_info(topology.BATCHES_STREAM, durable)).num_pending
    await nc.drain()
    return [schemas.batch_decoder.decode(m.data).batch_id for m in taken], queued


def test_a_redelivered_descriptor_fetched_ahead_stays_in_progress_while_it_waits(
    nats_server, tiny_model, job_name, tmp_path
):
    taken, queued = asyncio.run(_held_while_waiting(nats_server.url, tiny_model("qwen3"), job_name, tmp_path / "spool"))
    assert taken == [], f"another consumer took {taken} while this one held it"
    assert queued == 0


def test_a_letter_whose_samples_were_written_after_all_is_resolved_and_not_retried(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name
):
    job, url = job_name, nats_server.url
    rows = _job(hsx, tiny_model, tmp_path, job, 5, seed=42, lengths=(4, 30), budget=256, max_seq_len=32)
    assert status(hsx, job, None)["batches_total"] == 1
    # A consumer hands back a batch on its last delivery as a fresh copy (gpu_consumer.service
    # give_back) and dies before removing the spent one: both are in the stream.
    seq, payload = _spend_deliveries(url, job, topology.BATCH_MAX_DELIVER, ack_wait_s=1)

    async def copy() -> None:
        nc = await nats.connect(url)
        try:
            await nc.jetstream().publish(
                topology.batch_subject(job), payload, headers={"Nats-Msg-Id": f"requeue:{seq}"}
            )
        finally:
            await nc.drain()

    asyncio.run(copy())
    spool = tmp_path / "spool"
    workers = [
        hsx_service("consume", "--job", job, "--device", "cpu", "--spool", str(spool), name="consume"),
        hsx_service("upload", "--job", job, "--spool", str(spool), name="upload"),
    ]
    wait_for(
        lambda: status(hsx, job, None)["done"] and _dead_letters(hsx, job),
        timeout=90,
        what="the job done and the spent batch dead-lettered",
        procs=workers,
        alive=workers,
        period=0.5,
    )
    extracted = len(log_events(workers[0], "batch_done"))
    retried = check_ok(hsx("dead", "retry", "--job", job, "--all"), "dead retry")
    time.sleep(2.0)
    assert len(log_events(workers[0], "batch_done")) == extracted, (
        f"a letter whose samples were written was sent back and extracted again\n{retried.stdout}"
    )
    assert "resolved" in retried.stdout, retried.stdout
    [letter] = _dead_letters(hsx, job)
    assert letter["resolved"], letter
    view = status(hsx, job, None)
    assert view["batches_queued"] == 0 and view["done"] and view["dead_samples"] == [], view
    check_uploaded_once(url, job, len(rows))

    # A batch that is not one of the plan's (a poisoned batch's retry, a dead letter's half)
    # holding a planned sample, exactly as the producer planned it (taken from the planned
    # batch: a sample that is not the one recorded is refused, never extracted), is extracted,
    # but never counted as a batch of the plan.
    planned = schemas.batch_decoder.decode(payload)
    sample = planned.samples[0]
    extra = msgspec.structs.replace(
        planned, batch_id=f"{planned.batch_id}-poison", padded_len=len(sample.input_ids), samples=[sample]
    )

    async def publish_extra() -> None:
        nc = await nats.connect(url)
        try:
            await nc.jetstream().publish(
                topology.batch_subject(job), schemas.encode(extra), headers={"Nats-Msg-Id": extra.batch_id}
            )
        finally:
            await nc.drain()

    asyncio.run(publish_extra())
    wait_for(
        lambda: [r for r in log_events(workers[0], "batch_done") if r["batch"] == extra.batch_id],
        timeout=30,
        what="the extra batch written",
        procs=workers,
        alive=workers,
        period=0.2,
    )
    assert not log_events(workers[0], "batch_refused"), logs_of(workers[0])
    view = status(hsx, job, None)
    assert view["batches_done"] == view["batches_total"] == 1, view


def test_a_hung_spool_write_is_a_stall_and_another_consumer_finishes_the_job(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name
):
    job = job_name
    _job(hsx, tiny_model, tmp_path, job, 16, seed=43, lengths=(8, 40), budget=128, max_seq_len=64)
    spool = tmp_path / "spool"
    marker = tmp_path / "write.marker"
    args = ("consume", "--job", job, "--device", "cpu", "--spool", str(spool), "--ack-wait", "2", "--stall-after", "2")
    env = {"HSX_TEST_HANG_WRITE_SAMPLE": "5", "HSX_TEST_HANG_WRITE_MARKER": str(marker)}
    monitor = start_monitor(hsx_service, job, None)
    uploader = hsx_service("upload", "--job", job, "--spool", str(spool), name="upload")
    hung = hsx_service(*args, env=env, name="consume-hung")
    procs = [monitor, uploader, hung]
    wait_for(
        lambda: log_events(hung, "test_write_hanging"),
        timeout=60,
        what="the spool write hanging",
        procs=procs,
        alive=procs,
        period=0.1,
    )
    instance = log_events(hung, "consumer_ready")[0]["consumer"]
    wait_for(
        lambda: [
            r for r in log_events(monitor, "worker_degraded") if r["instance"] == instance and r["state"] == "stalled"
        ],
        timeout=30,
        what="the monitor reporting the consumer stalled",
        procs=procs,
        alive=procs,
        period=0.2,
    )
    second = hsx_service(*args, env=env, name="consume-2")
    procs.append(second)
    try:
        waited = wait_until_done(monitor, [uploader, hung, second], timeout=90)
        print(f"\nSTALLED WRITE second consumer started -> job done {waited:.1f} s")
    finally:
        marker.with_name(marker.name + ".release").touch()
    check_uploaded_once(nats_server.url, job, 16)
