"""The job's samples in bounded memory (hsx/storage/tokens.py) and loss masks as spans on the wire.

- An object written by the old, list-based encoder (`tests/data/tokens_v1_old.arrow`, made with
  `producer.stored.encode_rows` of commit 0ee1e2a) reads back row for row; the streaming writer's
  output reads back the same, and is still format hsx.tokens.v1 read with pyarrow alone.
- The plan fingerprint over the columnar table is the old formula's, byte for byte, for Parquet
  (the vectorized path) and JSONL, with and without masks, so existing jobs keep their batch ids.
- Parquet batches the vectorized path cannot take (a bad row) go row by row: the same error.
- `Sample.loss_spans` round trips through the wire; a descriptor with spans and one with the
  per-token list give sample files with identical bytes.
- `load_samples` returns a few samples by index from the stored object (real nats-server).
"""

import asyncio
import hashlib
import json
import random
from pathlib import Path

import msgspec
import nats
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.producer.inputs import tokenized_rows
from hsx.producer.sources import read_source
from hsx.storage.layout import SampleFiles
from hsx.storage.tokens import TokenRow, load_samples, loss_spans, read_tokens, tokens_object_name, write_tokens
from hsx.wire import schemas

OLD_OBJECT = Path(__file__).parent / "data" / "tokens_v1_old.arrow"


def _old_fixture_rows() -> list[TokenRow]:
    """The rows `tests/data/tokens_v1_old.arrow` was made from (same recipe, same seed)."""
    rng = random.Random(11)
    rows = []
    for i in range(40):
        n = rng.randint(1, 50)
        ids = [rng.randrange(0, 2**31 - 1) if i == 7 else rng.randrange(0, 50000) for _ in range(n)]
        mask = None if i % 4 == 1 else [rng.randint(0, 1) for _ in range(n)]
        rows.append(
            TokenRow(
                where=f"data.jsonl:{i + 1}", source_id=f"doc-{i}" if i % 3 else str(i), input_ids=ids, loss_mask=mask
            )
        )
    return rows


def test_an_object_of_the_old_encoder_reads_back_and_the_new_writer_keeps_the_format(tmp_path):
    expected = _old_fixture_rows()
    table = read_tokens(OLD_OBJECT.read_bytes(), what="old object")
    assert list(table) == expected
    with open(OLD_OBJECT, "rb") as file:  # streamed from a file, as the producer and verify read it
        assert list(read_tokens(file, what="old object")) == expected

    written = tmp_path / "new.arrow"
    with open(written, "wb") as file:
        write_tokens(table, file, job="oldjob")
    assert list(read_tokens(written.read_bytes(), what="new object")) == expected
    # What any reader of hsx.tokens.v1 sees, with pyarrow alone (as the old decoder read it).
    plain = pa.ipc.open_stream(written.read_bytes()).read_all()
    assert plain.schema.metadata[b"hsx_format"] == b"hsx.tokens.v1" and plain.schema.metadata[b"job"] == b"oldjob"
    assert plain.schema.field("input_ids").type == pa.list_(pa.int32())
    assert plain.column("input_ids").to_pylist() == [r.input_ids for r in expected]
    assert plain.column("loss_mask").to_pylist() == [r.loss_mask for r in expected]
    assert plain.column("source_id").to_pylist() == [r.source_id for r in expected]
    with pytest.raises(HsxError, match="not an Arrow stream"):
        read_tokens(b"not arrow at all", what="junk")


def _old_fingerprint(header: list, rows: list[dict]) -> str:
    """The plan fingerprint as hsx computed it from Python lists before the columnar table."""
    digest = hashlib.sha256()
    digest.update(msgspec.json.encode(header))
    for i, row in enumerate(rows):
        digest.update(np.asarray(row["input_ids"], dtype=np.int64).tobytes())
        mask = row.get("loss_mask")
        digest.update(b"|" if mask is None else np.asarray(mask, dtype=np.int8).tobytes())
        digest.update(str(row.get("id", i)).encode() + b"\n")
    return digest.hexdigest()


def _rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        n = rng.randint(1, 300)
        row = {"input_ids": [rng.randrange(500) for _ in range(n)]}
        if i % 5:
            row["loss_mask"] = [rng.randint(0, 1) for _ in range(n)]
        if i % 3 == 0:
            row["id"] = f"doc-{i}"
        rows.append(row)
    return rows


@pytest.mark.parametrize("form", ["parquet", "jsonl"])
def test_the_plan_fingerprint_is_the_old_formula(form, tiny_model, tmp_path):
    from hsx.producer.config import ProducerConfig
    from hsx.producer.planning import plan_fingerprint
    from hsx.wire.natsconn import NatsSettings

    rows = _rows(20000, seed=3)  # several record batches and chunks
    if form == "parquet":
        path = tmp_path / "data.parquet"
        pq.write_table(
            pa.table(
                {
                    "id": pa.array([row.get("id") for row in rows], pa.string()),
                    "input_ids": pa.array([row["input_ids"] for row in rows], pa.list_(pa.int64())),
                    "loss_mask": pa.array([row.get("loss_mask") for row in rows], pa.list_(pa.int8())),
                }
            ),
            path,
            row_group_size=5000,
        )
    else:
        path = tmp_path / "data.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    inputs = tokenized_rows(path, model=str(tiny_model), vocab_size=512, max_seq_len=4096, on_long="error")
    cfg = ProducerConfig(
        nats=NatsSettings(url="nats://unused"),
        job="j",
        model=str(tiny_model),
        dataset=path,
        layers=(1,),
        dest="file:///unused",
        dtype="bfloat16",
        token_budget=4096,
        max_seq_len=4096,
    )
    assert plan_fingerprint(cfg, [1], inputs.samples) == _old_fingerprint(
        [str(tiny_model), [1], "bfloat16", 4096, None], rows
    )
    # Spot checks that the table holds the rows themselves.
    for i in (0, 1, 4999, 5000, 19999):
        row = inputs.samples[i]
        assert (row.input_ids, row.loss_mask, row.source_id) == (
            rows[i]["input_ids"],
            rows[i].get("loss_mask"),
            str(rows[i].get("id", i)),
        )


def test_a_bad_row_in_a_parquet_batch_gives_the_row_by_row_error(tmp_path):
    rows = _rows(100, seed=4)
    rows[57]["loss_mask"] = [2] * len(rows[57]["input_ids"])
    path = tmp_path / "bad.parquet"
    pq.write_table(
        pa.table(
            {
                "input_ids": pa.array([row["input_ids"] for row in rows], pa.list_(pa.int64())),
                "loss_mask": pa.array([row.get("loss_mask") for row in rows], pa.list_(pa.int8())),
            }
        ),
        path,
    )
    with pytest.raises(HsxError) as raised:
        list(read_source(path))
    assert str(raised.value) == f"{path}: row 57: loss_mask must hold only 0 and 1"


def test_loss_spans_round_trip_and_old_messages_still_read():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100, 4096):
        for mask in (rng.integers(0, 2, n), np.zeros(n, int), np.ones(n, int)):
            spans = loss_spans(mask)
            assert all(0 <= a < b <= n for a, b in spans)
            sample = schemas.Sample(index=3, source_id="s", input_ids=list(range(n)), loss_spans=spans)
            decoded = schemas.batch_decoder.decode(
                schemas.encode(schemas.BatchDescriptor(job="j", batch_id="b", padded_len=n, samples=[sample]))
            ).samples[0]
            assert decoded.mask() == mask.tolist() and decoded.loss_mask is None
    reply = [0] * 300 + [1] * 200  # a prompt and its reply: one span instead of 500 ints
    assert loss_spans(np.array(reply)) == [(300, 500)]
    # A descriptor of an older producer, still in a stream: the per-token list.
    old = b'{"type":"sample.v1","index":0,"source_id":"a","input_ids":[5,6,7],"loss_mask":[0,1,1]}'
    assert msgspec.json.decode(old, type=schemas.Sample).mask() == [0, 1, 1]
    unmasked = msgspec.json.decode(
        b'{"type":"sample.v1","index":0,"source_id":"a","input_ids":[5]}', type=schemas.Sample
    )
    assert unmasked.mask() is None


def test_files_from_spans_and_from_the_list_are_identical(tmp_path):
    from hsx.gpu_consumer.writer import write_sample_file

    spec = JobSpec(
        job="j",
        model="m",
        model_revision="r",
        layers=[1],
        dtype="float32",
        dest="file:///x",
        token_budget=64,
        max_seq_len=64,
        dataset="d",
        plan_fingerprint="f" * 64,
        total_samples=1,
        total_tokens=9,
        total_batches=1,
        created_at=0.0,
    )
    mask = [0, 0, 1, 1, 1, 0, 1, 0, 1]
    hidden = torch.randn(1, 9, 8)
    files = {}
    for form, sample in {
        "list": schemas.Sample(index=0, source_id="s", input_ids=list(range(9)), loss_mask=mask),
        "spans": schemas.Sample(
            index=0, source_id="s", input_ids=list(range(9)), loss_spans=loss_spans(np.array(mask))
        ),
    }.items():
        ready = write_sample_file(
            spool=tmp_path / form,
            files=SampleFiles.of(spec),
            node="n",
            batch_id="b",
            sample=sample,
            hidden_states=hidden,
        )
        files[form] = (tmp_path / form / ready.spool_path).read_bytes()
    assert files["list"] == files["spans"]
    from safetensors.torch import load

    assert load(files["spans"])["loss_mask"].tolist() == mask


def test_load_samples_reads_a_few_by_index(nats_server, tmp_path):
    expected = _old_fixture_rows()

    async def run():
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            from hsx.wire import topology

            store = await topology.ensure_datasets_store(js)
            job = f"tokens-{random.randrange(1 << 30)}"
            await store.put(tokens_object_name(job), OLD_OBJECT.read_bytes())
            spec = JobSpec(
                job=job,
                model="m",
                model_revision="r",
                layers=[1],
                dtype="float32",
                dest="file:///x",
                token_budget=64,
                max_seq_len=64,
                dataset="d",
                plan_fingerprint="f" * 64,
                total_samples=len(expected),
                total_tokens=0,
                total_batches=1,
                created_at=0.0,
                tokenized_object=tokens_object_name(job),
            )
            got = await load_samples(js, job, [39, 1, 7], spec=spec)
            with pytest.raises(HsxError, match="asked for"):
                await load_samples(js, job, [40], spec=spec)
            return got
        finally:
            await nc.close()

    got = asyncio.run(run())
    assert [s.index for s in got] == [39, 1, 7]
    for sample in got:
        row = expected[sample.index]
        assert (sample.source_id, sample.input_ids, sample.mask()) == (row.source_id, row.input_ids, row.loss_mask)
    assert got[1].loss_spans is None  # row 1 has no mask
