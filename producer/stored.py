"""A job's tokenized samples and input report, kept in the JetStream object store.

The producer tokenizes a dataset once; the samples it planned from (after --on-long) are stored
in object store bucket `hsx_datasets` as `<job>.tokens.arrow`, and the job spec names the object.
A producer re-run reads them back instead of reading and tokenizing the dataset again, so a
tokenizer or chat template changed on the machine since cannot change the plan; `hsx verify`
compares the files in the destination with them.

Format: one Arrow IPC stream (zstd-compressed), one row per sample in sample-index order, columns
`where` (string, how errors name the dataset row), `source_id` (string), `input_ids`
(list<int32>), `loss_mask` (list<uint8>, null when the row has none); schema metadata
`hsx_format` = `hsx.tokens.v1` and `job`.

The report, `<job>.report.json`, is JSON: which rows were truncated or skipped (file/line or row,
source id, original length, action), the counts, and how chat rows were tokenized.
"""

import io
import json

import msgspec
import nats.js.errors
import numpy as np
import pyarrow as pa
from nats.js import JetStreamContext

from hsx import schemas, topology
from hsx.errors import HsxError
from hsx.jobs import read_job_spec
from producer.dataset import DatasetRow

TOKENS_FORMAT = "hsx.tokens.v1"
_SCHEMA = pa.schema(
    [
        pa.field("where", pa.string(), nullable=False),
        pa.field("source_id", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=True),
    ]
)
_ROWS_PER_BATCH = 65536


def tokens_object_name(job: str) -> str:
    return f"{job}.tokens.arrow"


def report_object_name(job: str) -> str:
    return f"{job}.report.json"


def encode_rows(rows: list[DatasetRow], *, job: str) -> bytes:
    schema = _SCHEMA.with_metadata({"hsx_format": TOKENS_FORMAT, "job": job})
    sink = io.BytesIO()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_stream(sink, schema, options=options) as writer:
        for start in range(0, len(rows), _ROWS_PER_BATCH):
            chunk = rows[start : start + _ROWS_PER_BATCH]
            writer.write_batch(pa.record_batch(
                [
                    pa.array([r.where for r in chunk], pa.string()),
                    pa.array([r.source_id for r in chunk], pa.string()),
                    pa.array([r.input_ids for r in chunk], pa.list_(pa.int32())),
                    pa.array([r.loss_mask for r in chunk], pa.list_(pa.uint8())),
                ],
                schema=schema,
            ))
    return sink.getvalue()


def _lists(column: pa.ChunkedArray) -> list[list[int] | None]:
    out: list[list[int] | None] = []
    for chunk in column.chunks:
        offsets = chunk.offsets.to_numpy()
        values = chunk.values.to_numpy(zero_copy_only=False).astype(np.int64)
        valid = chunk.is_valid().to_numpy(zero_copy_only=False)
        for k in range(len(chunk)):
            out.append(values[offsets[k] : offsets[k + 1]].tolist() if valid[k] else None)
    return out


def decode_rows(data: bytes, *, what: str) -> list[DatasetRow]:
    try:
        table = pa.ipc.open_stream(data).read_all()
    except pa.ArrowInvalid as exc:
        raise HsxError(f"{what}: not an Arrow stream ({exc})") from None
    found = (table.schema.metadata or {}).get(b"hsx_format", b"").decode()
    if found != TOKENS_FORMAT:
        raise HsxError(f"{what}: format {found or 'unknown'!r}, expected {TOKENS_FORMAT!r}")
    wheres = table.column("where").to_pylist()
    ids = table.column("source_id").to_pylist()
    input_ids = _lists(table.column("input_ids"))
    masks = _lists(table.column("loss_mask"))
    return [
        DatasetRow(where=w, source_id=s, input_ids=t, loss_mask=m)
        for w, s, t, m in zip(wheres, ids, input_ids, masks)
    ]


async def _get(store, name: str) -> bytes:
    # writeinto: ObjectStore.get otherwise grows one bytes object chunk by chunk (quadratic).
    buffer = io.BytesIO()
    await store.get(name, writeinto=buffer)
    return buffer.getvalue()


async def stored_bytes(js: JetStreamContext, name: str) -> bytes:
    """One stored object byte for byte (the job bundle copies them to the destination)."""
    store = await topology.ensure_datasets_store(js)
    try:
        return await _get(store, name)
    except nats.js.errors.ObjectNotFoundError:
        raise HsxError(f"object {name} in object store bucket {topology.DATASETS_BUCKET} is missing") from None


async def store_tokenized(js: JetStreamContext, job: str, rows: list[DatasetRow]) -> str:
    """Store the job's samples (index order); returns the object name."""
    store = await topology.ensure_datasets_store(js)
    name = tokens_object_name(job)
    await store.put(name, encode_rows(rows, job=job))
    return name


async def store_report(js: JetStreamContext, job: str, report: dict) -> str:
    store = await topology.ensure_datasets_store(js)
    name = report_object_name(job)
    await store.put(name, json.dumps(report, indent=1, sort_keys=True).encode())
    return name


async def _spec_of(js: JetStreamContext, job: str, spec: schemas.JobSpec | None) -> schemas.JobSpec:
    if spec is not None:
        return spec
    kv = await topology.ensure_topology(js)
    found = await read_job_spec(kv, job)
    if found is None:
        raise HsxError(f"job {job} not found in KV bucket {topology.JOBS_BUCKET} (run hsx produce --job {job} first)")
    return found


async def load_tokenized(js: JetStreamContext, job: str, *, spec: schemas.JobSpec | None = None) -> list[DatasetRow]:
    """The job's samples exactly as planned and published: `rows[i]` is sample i (its token ids,
    loss mask, source id, and the dataset row it came from). Reads the job spec from KV unless
    given. An HsxError when the job has no stored samples (made before they were stored) or the
    object is missing or unreadable."""
    spec = await _spec_of(js, job, spec)
    if not spec.tokenized_object:
        raise HsxError(f"job {job} has no stored tokenized samples (it was produced by an older hsx)")
    what = f"object {spec.tokenized_object} in object store bucket {topology.DATASETS_BUCKET}"
    store = await topology.ensure_datasets_store(js)
    try:
        data = await _get(store, spec.tokenized_object)
    except nats.js.errors.ObjectNotFoundError:
        raise HsxError(f"job {job}: {what} is missing (deleted?); the job's samples cannot be read back") from None
    except nats.js.errors.DigestMismatchError:
        raise HsxError(f"job {job}: {what} does not match its checksum") from None
    rows = decode_rows(data, what=what)
    if len(rows) != spec.total_samples:
        raise HsxError(f"job {job}: {what} holds {len(rows)} samples but the job has {spec.total_samples}")
    return rows


async def load_report(js: JetStreamContext, job: str, *, spec: schemas.JobSpec | None = None) -> dict:
    """The job's input report (see the module docstring)."""
    spec = await _spec_of(js, job, spec)
    if not spec.report_object:
        raise HsxError(f"job {job} has no input report (it was produced by an older hsx)")
    store = await topology.ensure_datasets_store(js)
    try:
        return msgspec.json.decode(await _get(store, spec.report_object))
    except nats.js.errors.ObjectNotFoundError:
        raise HsxError(f"job {job}: object {spec.report_object} in bucket {topology.DATASETS_BUCKET} is missing") from None
