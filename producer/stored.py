"""A job's tokenized samples and input report, kept in the JetStream object store bucket
`hsx_datasets`: `store_tokenized` puts the samples the producer planned from (after --on-long)
as `<job>.tokens.arrow`, whose format is hsx/storage/tokens.py's; `store_report` and
`load_report` the report `<job>.report.json`, JSON: which rows were truncated or skipped
(file/line or row, source id, original length, action), the counts, and how chat rows were
tokenized.

Why they are stored: docs/architecture/producer.md.
"""

import io
import json
import tempfile

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectMeta, ObjectMetaOptions
from nats.js.object_store import OBJ_DEFAULT_CHUNK_SIZE

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.storage.tokens import (  # noqa: F401  (re-exported: the producer's and its tests' names for them)
    SampleTable,
    digests_object_name,
    load_table,
    read_tokens,
    report_object_name,
    spec_of,
    tokens_object_name,
    write_tokens,
)
from hsx.wire import topology
from hsx.wire.natsconn import through_outage

# The job's samples as planned and published, `table[i]` sample i (hsx.storage.tokens.load_table).
load_tokenized = load_table


def decode_rows(data: bytes, *, what: str) -> SampleTable:
    """A stored samples object's bytes as a table (tools and tests; the producer streams)."""
    return read_tokens(data, what=what)


def _chunked(name: str, max_payload: int) -> ObjectMeta:
    """An object's put options with chunks the server takes. nats-py cuts objects into 128 KiB
    messages by default, which a server with a smaller max_payload refuses (MaxPayloadError, after
    preflight had passed). A chunk goes out without headers, so max_payload itself fits; readers
    take any chunk size."""
    return ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=min(OBJ_DEFAULT_CHUNK_SIZE, max_payload)))


async def store_tokenized(js: JetStreamContext, job: str, samples: SampleTable, *, max_payload: int) -> str:
    """Store the job's samples (index order) in chunks of at most `max_payload` bytes (the
    connection's); returns the object name."""
    store = await topology.ensure_datasets_store(js)
    name = tokens_object_name(job)
    with tempfile.TemporaryFile(prefix="hsx-tokens-") as file:
        write_tokens(samples, file, job=job)

        async def put() -> None:  # again from the start after an outage: a put replaces the object whole
            file.seek(0)
            await store.put(name, file, meta=_chunked(name, max_payload))

        await through_outage(put, what="store_samples")
    return name


async def store_digests(js: JetStreamContext, job: str, digests: bytes, *, max_payload: int) -> str:
    """Store the digests of every sample the spec will name (index order; table_digests), before
    it names them: what a consumer checks each descriptor's samples against."""
    store = await topology.ensure_datasets_store(js)
    name = digests_object_name(job)
    await through_outage(lambda: store.put(name, digests, meta=_chunked(name, max_payload)), what="store_digests")
    return name


async def store_report(js: JetStreamContext, job: str, report: dict, *, max_payload: int) -> str:
    store = await topology.ensure_datasets_store(js)
    name = report_object_name(job)
    data = json.dumps(report, indent=1, sort_keys=True).encode()
    await through_outage(lambda: store.put(name, data, meta=_chunked(name, max_payload)), what="store_report")
    return name


async def load_report(js: JetStreamContext, job: str, *, spec: JobSpec | None = None) -> dict:
    """The job's input report (see the module docstring)."""
    spec = await spec_of(js, job, spec)
    if not spec.report_object:
        raise HsxError(f"job {job} has no input report (it was produced by an older hsx)")
    store = await topology.datasets_store(js)
    where = f"job {job}: object {spec.report_object} in bucket {topology.DATASETS_BUCKET}"
    buffer = io.BytesIO()  # writeinto: get() otherwise grows one bytes object chunk by chunk
    try:
        if store is None:
            raise nats.js.errors.ObjectNotFoundError
        await store.get(spec.report_object, writeinto=buffer)
        report = msgspec.json.decode(buffer.getvalue())
    except nats.js.errors.ObjectNotFoundError:
        raise HsxError(f"{where} is missing") from None
    except (msgspec.DecodeError, RecursionError):  # msgspec recurses into nested values
        report = None
    if not isinstance(report, dict):
        raise HsxError(f"{where} is not an input report")
    return report
