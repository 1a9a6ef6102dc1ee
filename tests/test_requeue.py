"""Where a lost spool file's sample comes from when the uploader sends it back for extraction
(real nats-server, a real FileMover; the spool files never existed): file events name their
sample instead of carrying its tokens, so the tokens come from the job's stored samples, loaded
once per uploader; an event of an older consumer still carries its sample and is sent back with
it, nothing loaded; a job with no stored samples cannot send it back and dead-letters the event."""

import asyncio
import hashlib

import msgspec
import nats
import pytest

from hsx.job import JobSpec
from hsx.producer.stored import store_tokenized
from hsx.storage.destinations.file import FileDestination
from hsx.storage.layout import sample_key
from hsx.storage.tokens import SampleTableBuilder, TokenRow, tokens_object_name
from hsx.uploader.config import UploaderConfig
from hsx.uploader.service import FileMover
from hsx.wire import schemas, topology
from hsx.wire.events import EventPublisher
from hsx.wire.natsconn import NatsSettings

NODE = "n"
PLAN = "a" * 64
ROWS = [
    TokenRow(where="d.jsonl:1", source_id="row-0", input_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1]),
    TokenRow(where="d.jsonl:2", source_id="row-1", input_ids=[9, 10, 11], loss_mask=None),
    TokenRow(where="d.jsonl:3", source_id="row-2", input_ids=[12, 13, 14, 15, 16], loss_mask=[1, 0, 1, 0, 1]),
]


def _spec(job: str, *, tokenized_object: str) -> JobSpec:
    return JobSpec(
        job=job,
        model="m",
        model_revision="r",
        layers=[1],
        dtype="float32",
        dest="file:///x",
        token_budget=64,
        max_seq_len=64,
        dataset="d",
        plan_fingerprint=PLAN,
        total_samples=len(ROWS),
        total_tokens=sum(len(r.input_ids) for r in ROWS),
        total_batches=1,
        created_at=0.0,
        published=True,
        tokenized_object=tokenized_object,
    )


def _lost(job: str, index: int, *, sample: schemas.Sample | None = None, plan: str = PLAN[:12]) -> schemas.FileReady:
    key = sample_key(job, index)
    return schemas.FileReady(
        job=job,
        node=NODE,
        batch_id="b0",
        sample_index=index,
        num_tokens=len(ROWS[index].input_ids),
        spool_path=key,
        key=key,
        size=100,
        digest="0" * 64,
        sample=sample,
        plan=plan,
    )


async def _stored(js, stream: str, subject: str) -> list[bytes]:
    """Every message of `stream` on `subject`, read by sequence (work-queue streams too, unconsumed)."""
    info = await js.stream_info(stream, subjects_filter=subject)
    count = sum((info.state.subjects or {}).values())
    found, seq = [], info.state.first_seq
    while len(found) < count:
        message = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        found.append(message.data)
        seq = message.seq + 1
    return found


async def _run(
    url: str,
    tmp_path,
    spec: JobSpec,
    rounds: list[list[schemas.FileReady]],
    *,
    store_samples: bool,
    delete_samples_after: int | None = None,
):
    """Record the spec (and store ROWS as the job's samples if asked), then per round publish its
    file events and let one FileMover handle each; the stored samples are deleted after round
    `delete_samples_after`. Returns (redo batches, dead letters, file events left in HSX_FILES)."""
    job = spec.job
    nc = await nats.connect(url)
    mover = None
    try:
        js = nc.jetstream()
        kv = await topology.ensure_topology(js)
        await kv.put(job, schemas.encode(spec))
        if store_samples:
            builder = SampleTableBuilder()
            for row in ROWS:
                builder.add_row(row)
            table = builder.finish()
            await store_tokenized(js, job, table, max_payload=nc.max_payload)
            table.close()
        cfg = UploaderConfig(nats=NatsSettings(url=url), job=job, spool=tmp_path / "spool", node=NODE, instance="u")
        mover = FileMover(cfg, FileDestination(tmp_path / "dest"), EventPublisher(nc, js, job), spec)
        durable = await topology.ensure_upload_consumer(js, job, NODE)
        sub = await js.pull_subscribe_bind(durable=durable, stream=topology.FILES_STREAM)
        for k, readies in enumerate(rounds):
            for ready in readies:
                await js.publish(topology.file_subject(job, NODE), schemas.encode(ready))
            for _ in readies:
                msg = (await sub.fetch(1, timeout=5))[0]
                await mover.handle(msg, asyncio.Event())
            if k == delete_samples_after:
                await (await topology.ensure_datasets_store(js)).delete(tokens_object_name(job))
        await sub.unsubscribe()
        batches = await _stored(js, topology.BATCHES_STREAM, topology.batch_subject(job))
        letters = await _stored(js, topology.DEAD_STREAM, topology.dead_subject_all(job))
        redo = [schemas.batch_decoder.decode(d) for d in batches]
        dead = [schemas.dead_decoder.decode(d) for d in letters]
        left = await _stored(js, topology.FILES_STREAM, f"hsx.files.{job}.>")
        return redo, dead, left
    finally:
        if mover is not None:
            mover.close()
        await nc.close()


def test_an_event_that_carries_its_sample_is_sent_back_with_it(nats_server, tmp_path, job_name):
    # The spec names stored samples that are not there: loading them would fail and dead-letter.
    spec = _spec(job_name, tokenized_object=tokens_object_name(job_name))
    carried = schemas.Sample(index=1, source_id="row-1", input_ids=[9, 10, 11])
    ready = _lost(job_name, 1, sample=carried, plan="")
    assert b'"input_ids":[9,10,11]' in schemas.encode(ready)  # what consumers before references sent
    redo, dead, left = asyncio.run(_run(nats_server.url, tmp_path, spec, [[ready]], store_samples=False))
    assert dead == [], [d.error for d in dead]
    assert len(redo) == 1 and redo[0].samples == [carried] and redo[0].padded_len == 3 and redo[0].redo_reason
    assert left == []


def test_an_event_that_names_its_sample_is_sent_back_from_the_stored_samples(nats_server, tmp_path, job_name):
    spec = _spec(job_name, tokenized_object=tokens_object_name(job_name))
    # Rounds 1 and 2 come after the stored samples are deleted: the table loaded in round 0 serves them.
    rounds = [[_lost(job_name, 2), _lost(job_name, 0)], [_lost(job_name, 1)], [_lost(job_name, 1, plan="b" * 12)]]
    redo, dead, left = asyncio.run(
        _run(nats_server.url, tmp_path, spec, rounds, store_samples=True, delete_samples_after=0)
    )
    assert sorted(s.index for b in redo for s in b.samples) == [0, 1, 2]
    for batch in redo:
        (sample,) = batch.samples
        row = ROWS[sample.index]
        assert (sample.source_id, sample.input_ids, sample.mask()) == (row.source_id, row.input_ids, row.loss_mask)
        assert batch.padded_len == len(row.input_ids) and batch.redo_reason
    # An event written under another plan of the same job name (a stray of a deleted job): not this
    # uploader's to handle, dropped from the queue, nothing sent back, nothing dead-lettered.
    assert dead == [], [d.error for d in dead]
    assert left == []


def test_without_stored_samples_an_event_without_its_sample_is_dead_lettered(nats_server, tmp_path, job_name):
    spec = _spec(job_name, tokenized_object="")  # a job made by an hsx from before samples were stored
    redo, dead, left = asyncio.run(_run(nats_server.url, tmp_path, spec, [[_lost(job_name, 2)]], store_samples=False))
    assert redo == []
    assert len(dead) == 1 and dead[0].sample_indices == [2] and dead[0].file is not None
    assert dead[0].file.sample_index == 2 and dead[0].file.sample is None
    assert "sample 2" in dead[0].error and "stored" in dead[0].error and "\n" not in dead[0].error
    assert left == []  # out of the work queue, kept in HSX_DEAD for `hsx dead retry`


def test_file_events_leave_the_sample_out_and_older_ones_still_decode():
    ready = _lost("j", 0)
    encoded = schemas.encode(ready)
    assert b'"sample":' not in encoded and b"input_ids" not in encoded
    assert schemas.file_decoder.decode(encoded) == ready
    # As a consumer before references published them: every field written out, the sample inline
    # (its digest a sha256 in hex, as file.v2 events have always carried; one that is not does
    # not decode).
    digest = hashlib.sha256(b"header").hexdigest().encode()
    older = (
        b'{"type":"file.v2","job":"j","node":"n","batch_id":"b0","sample_index":0,"num_tokens":1,'
        b'"spool_path":"p","key":"k","size":1,"digest":"' + digest + b'",'
        b'"sample":{"type":"sample.v1","index":0,"source_id":"s","input_ids":[7],"loss_spans":[[0,1]]},"plan":""}'
    )
    assert schemas.file_decoder.decode(older).sample == schemas.Sample(
        index=0, source_id="s", input_ids=[7], loss_spans=[(0, 1)]
    )
    with pytest.raises(msgspec.ValidationError, match="digest"):
        schemas.file_decoder.decode(older.replace(digest, b"d"))
