"""A dead letter always fits the server's max_payload (hsx/wire/deadletter.py), on a real nats-server
started with a small max_payload: a batch as large as the server takes is dead-lettered (in one
letter when the producer left the headroom, split over several otherwise) and `hsx dead retry`
sends every sample back; a file-ready event and an undecodable payload at the limit fit too.
Before, a letter held the payload base64-encoded (x4/3) and the last delivery's dead-lettering
failed with MaxPayloadError, leaving the batch in the work queue for good."""

from __future__ import annotations

import asyncio

import nats
import pytest

from hsx.commands.dead import retry_dead
from hsx.commands.embedded import start_nats_server
from hsx.job import JobSpec
from hsx.wire import schemas, topology
from hsx.wire.events import EventPublisher
from hsx.wire.natsconn import NatsSettings

MAX_PAYLOAD = 32 * 1024


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    store = tmp_path_factory.mktemp("nats-small")
    server = start_nats_server(store, log_file=store / "nats-server.log", max_payload=MAX_PAYLOAD)
    yield server
    server.stop()


def _batch(job: str, *, samples: int, tokens: int) -> schemas.BatchDescriptor:
    return schemas.BatchDescriptor(
        job=job,
        batch_id=f"{job}-b0",
        padded_len=tokens,
        samples=[
            schemas.Sample(index=i, source_id=f"row-{i}", input_ids=[100_000 + i] * tokens, loss_mask=[1] * tokens)
            for i in range(samples)
        ],
    )


def _sized(job: str, *, target: int, samples: int) -> schemas.BatchDescriptor:
    """The largest batch of `samples` equal samples whose descriptor is at most `target` bytes."""
    tokens = 1
    while len(schemas.encode(_batch(job, samples=samples, tokens=tokens + 1))) <= target:
        tokens += 1
    return _batch(job, samples=samples, tokens=tokens)


async def _dead_letter_from_queue(url: str, job: str, payload: bytes, error: str) -> list[schemas.DeadLetter]:
    """Publish `payload` to the job's batch queue, take it as a consumer would, dead-letter it; the
    letters stored in HSX_DEAD."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await topology.ensure_topology(js)
        durable = await topology.ensure_gpu_consumer(js, job)
        await js.publish(topology.batch_subject(job), payload)
        sub = await js.pull_subscribe_bind(durable=durable, stream=topology.BATCHES_STREAM)
        msg = (await sub.fetch(1, timeout=5))[0]
        await EventPublisher(nc, js, job).dead_letter(msg, what="batch", error=error)
        await sub.unsubscribe()
        for _ in range(50):  # term() is a plain publish: the server removes the message soon after
            info = await js.stream_info(topology.BATCHES_STREAM, subjects_filter=topology.batch_subject(job))
            if not sum((info.state.subjects or {}).values()):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the dead-lettered batch is still queued")
        return await _letters(js, job)
    finally:
        await nc.close()


async def _letters(js, job: str) -> list[schemas.DeadLetter]:
    info = await js.stream_info(topology.DEAD_STREAM, subjects_filter=topology.dead_subject_all(job))
    count = sum((info.state.subjects or {}).values())
    sub = await js.subscribe(topology.dead_subject_all(job), stream=topology.DEAD_STREAM, ordered_consumer=True)
    letters = [schemas.dead_decoder.decode((await sub.next_msg(timeout=5)).data) for _ in range(count)]
    await sub.unsubscribe()
    return letters


async def _record_spec(url: str, job: str, *, samples: int) -> None:
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(topology.JOBS_BUCKET)
        spec = JobSpec(
            job=job,
            model="m",
            model_revision="r",
            layers=[0],
            dtype="bfloat16",
            dest="file:///tmp/hsx-unused",
            token_budget=1 << 20,
            max_seq_len=1 << 20,
            dataset="d",
            plan_fingerprint="0" * 64,
            total_samples=samples,
            total_tokens=0,
            total_batches=1,
            created_at=0.0,
            published=True,
        )
        await kv.put(job, schemas.encode(spec))
    finally:
        await nc.close()


async def _requeued(url: str, job: str) -> list[schemas.BatchDescriptor]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        batches, seq = [], 0
        while True:
            try:
                raw = await js.get_msg(topology.BATCHES_STREAM, seq + 1, subject=topology.batch_subject(job), next=True)
            except nats.js.errors.NotFoundError:
                return batches
            batches.append(schemas.batch_decoder.decode(raw.data))
            seq = raw.seq
    finally:
        await nc.close()


def test_a_batch_at_the_servers_limit_is_dead_lettered_split_and_retried_whole(small_server, job_name):
    batch = _sized(job_name, target=MAX_PAYLOAD - 2048, samples=6)
    payload = schemas.encode(batch)
    assert len(payload) * 4 // 3 > MAX_PAYLOAD, "the old base64 letter would have fitted: the test proves nothing"
    letters = asyncio.run(_dead_letter_from_queue(small_server.url, job_name, payload, "é" * 5000))
    assert len(letters) > 1, "a letter this large cannot fit whole: it is split"
    assert sorted(i for letter in letters for i in letter.sample_indices) == list(range(6))
    for letter in letters:
        assert letter.batch is not None and not letter.original_truncated
        assert [s.index for s in letter.batch.samples] == letter.sample_indices
        assert letter.batch_id == batch.batch_id and letter.deliveries == 1 and letter.source_seq > 0
    asyncio.run(_record_spec(small_server.url, job_name, samples=6))  # retry sends only to a job that exists
    asyncio.run(retry_dead(NatsSettings(url=small_server.url), job_name, None))
    sent_back = asyncio.run(_requeued(small_server.url, job_name))
    assert sorted(s.index for b in sent_back for s in b.samples) == list(range(6))
    assert {s.index: s for b in sent_back for s in b.samples} == {s.index: s for s in batch.samples}


def test_a_batch_within_the_producers_headroom_is_one_letter(small_server, job_name):
    samples = 6
    batch = _sized(job_name, target=MAX_PAYLOAD - schemas.dead_letter_headroom(samples) - 1024, samples=samples)
    letters = asyncio.run(_dead_letter_from_queue(small_server.url, job_name, schemas.encode(batch), "x" * 10_000))
    assert len(letters) == 1 and letters[0].batch == batch, [letter.sample_indices for letter in letters]
    assert len(letters[0].error) == schemas.DEAD_LETTER_ERROR_CHARS


def test_an_undecodable_payload_at_the_limit_is_kept_cut_to_fit(small_server, job_name):
    garbage = b"\xff" * (MAX_PAYLOAD - 512)
    letters = asyncio.run(_dead_letter_from_queue(small_server.url, job_name, garbage, "does not decode"))
    assert len(letters) == 1 and letters[0].original_truncated
    assert 0 < len(letters[0].original) < len(garbage) and garbage.startswith(letters[0].original)


def test_a_file_event_at_the_limit_fits(small_server, job_name):
    async def scenario() -> schemas.DeadLetter:
        nc = await nats.connect(small_server.url)
        try:
            js = nc.jetstream()
            await topology.ensure_topology(js)
            sample = _sized(job_name, target=MAX_PAYLOAD - 3000, samples=1).samples[0]
            ready = schemas.FileReady(
                job=job_name,
                node="n1",
                batch_id="b",
                sample_index=0,
                num_tokens=len(sample.input_ids),
                spool_path="p",
                key="k",
                size=1,
                digest="0" * 64,
                sample=sample,
            )
            assert len(schemas.encode(ready)) < MAX_PAYLOAD
            await EventPublisher(nc, js, job_name).store_dead_letter(
                what="file",
                error="e" * 3000,
                subject=topology.file_subject(job_name, "n1"),
                payload=schemas.encode(ready),
                deliveries=1,
                source_seq=7,
            )
            return (await _letters(js, job_name))[0]
        finally:
            await nc.close()

    letter = asyncio.run(scenario())
    assert letter.sample_indices == [0] and letter.batch_id == "b"
    # Either the event travels whole or, when even one sample cannot fit, the letter names it.
    assert letter.file is not None or letter.original_truncated
