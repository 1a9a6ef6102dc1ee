"""The index of what a job has stored, one Arrow IPC file `<job>/_hsx/index.arrow` (`StoredIndex`)
that readers GET instead of listing the job's folder: compacted from the job's `uploaded` events
(`index_from_events`) or made from the destination alone (`index_from_destination`,
`rebuild_job_index`), written by `write_index`. `read_index` returns it only when it is complete
(else why not), and `stored_samples` lists the folder otherwise. It never writes samples.

Format and where it comes from: docs/operations/resume.md, "The index of stored samples"; notes in
docs/architecture/storage.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import numpy as np
import pyarrow as pa

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.logs import get_logger
from hsx.storage.destinations import Destination, error_line, store_errors
from hsx.storage.expected import (
    BUNDLE_SPEC_KEY,
    ExpectedSamples,
    describe,
    is_missing,
    load_expected,
    mismatches,
    read_metadata,
)
from hsx.storage.layout import BUNDLE_DIR, sample_index_of, sample_key
from hsx.storage.location import Location, open_destination, open_job_folder, spec_location
from hsx.wire import schemas
from hsx.wire.events import read_marker

log = get_logger("hsx.index")

INDEX_FORMAT = "hsx.index.v1"
INDEX_FILE = "index.arrow"
METADATA_KEY = b"hsx.index"
# Relative to the job's folder (hsx.storage.location.open_job_folder), beside the bundle's
# job spec (BUNDLE_SPEC_KEY, producer/bundle.py).
INDEX_KEY = f"{BUNDLE_DIR}/{INDEX_FILE}"
DIGEST_BYTES = 32
# A sample file's header is a few hundred bytes; one ranged GET of this much almost always holds it.
HEADER_PROBE_BYTES = 64 << 10

SCHEMA = pa.schema(
    [
        ("sample_index", pa.int64()),
        ("key", pa.string()),
        ("size", pa.int64()),
        ("tokens", pa.int64()),
        ("digest", pa.binary(DIGEST_BYTES)),
    ]
)


class NotAnIndex(HsxError):
    """The object at the index's key is not an hsx index."""


@dataclass(frozen=True)
class StoredIndex:
    job: str
    plan: str
    total_samples: int
    source: str  # "events" | "destination"
    table: pa.Table

    @property
    def sample_indices(self) -> np.ndarray:
        return self.table.column("sample_index").to_numpy()

    @property
    def complete(self) -> bool:
        """Every sample of the plan is in it, once each (rows are written in sample-index order)."""
        return self.table.num_rows == self.total_samples and bool(
            np.array_equal(self.sample_indices, np.arange(self.total_samples))
        )

    def summary(self) -> dict:
        return {
            "job": self.job,
            "plan": self.plan,
            "source": self.source,
            "samples": self.table.num_rows,
            "total_samples": self.total_samples,
            "complete": self.complete,
            "bytes": int(self.table.column("size").to_numpy().sum()),
            "tokens": int(self.table.column("tokens").to_numpy().sum()),
        }

    def to_bytes(self) -> bytes:
        # No timestamp: the same rows give the same bytes, so two monitors writing one job's index
        # at once put identical objects and each one's verified put holds.
        metadata = {
            "format": INDEX_FORMAT,
            "job": self.job,
            "plan": self.plan,
            "total_samples": self.total_samples,
            "source": self.source,
        }
        table = self.table.replace_schema_metadata({METADATA_KEY: json.dumps(metadata).encode()})
        sink = pa.BufferOutputStream()
        # zstd: the index, keys and sizes shrink several times; the digests do not, and stay the bulk.
        with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
            writer.write_table(table)
        return sink.getvalue().to_pybytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> StoredIndex:
        try:
            table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
            metadata = json.loads((table.schema.metadata or {})[METADATA_KEY])
            if metadata.get("format") != INDEX_FORMAT:
                raise ValueError(f"format {metadata.get('format')!r}, expected {INDEX_FORMAT!r}")
            if not table.schema.remove_metadata().equals(SCHEMA):
                raise ValueError(f"columns {table.schema.names}, expected {SCHEMA.names}")
            return cls(
                job=metadata["job"],
                plan=metadata["plan"],
                total_samples=int(metadata["total_samples"]),
                source=metadata["source"],
                table=table.replace_schema_metadata(None),
            )
        except (pa.ArrowException, KeyError, TypeError, ValueError) as exc:
            raise NotAnIndex(f"not an hsx index ({type(exc).__name__}: {exc})") from None


def make_index(
    *,
    job: str,
    plan: str,
    total_samples: int,
    source: str,
    sample_index: Sequence[int] | np.ndarray,
    size: Sequence[int] | np.ndarray,
    tokens: Sequence[int] | np.ndarray,
    digest: Sequence[str | None],
) -> StoredIndex:
    """An index from parallel columns (any order; digests as hex, None or "" when unknown)."""
    order = np.argsort(np.asarray(sample_index, dtype=np.int64), kind="stable")
    indices = np.asarray(sample_index, dtype=np.int64)[order]
    table = pa.table(
        {
            "sample_index": pa.array(indices, pa.int64()),
            "key": pa.array([sample_key(job, int(i)) for i in indices], pa.string()),
            "size": pa.array(np.asarray(size, dtype=np.int64)[order], pa.int64()),
            "tokens": pa.array(np.asarray(tokens, dtype=np.int64)[order], pa.int64()),
            "digest": pa.array(
                [bytes.fromhex(digest[i]) if digest[i] else None for i in order], pa.binary(DIGEST_BYTES)
            ),
        },
        schema=SCHEMA,
    )
    return StoredIndex(job=job, plan=plan, total_samples=total_samples, source=source, table=table)


def bundle_spec(folder: Destination) -> JobSpec | None:
    """The job spec the producer put into the bundle; None for a job from before bundles."""
    try:
        data = folder.read_bytes(BUNDLE_SPEC_KEY)
    except Exception as exc:
        if is_missing(exc):
            return None
        raise
    try:
        return schemas.job_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise HsxError(f"{folder.url}/{BUNDLE_SPEC_KEY}: the bundle's job spec does not decode ({exc})") from None


def read_index(folder: Destination, job: str, *, spec: JobSpec | None = None) -> tuple[StoredIndex | None, str]:
    """(the index, "") when the job folder holds a complete one for `spec` (by default the
    bundle's job.json; a job without a bundle is taken at the index's word); else (None, why)."""
    if spec is None:
        spec = bundle_spec(folder)
    try:
        index = StoredIndex.from_bytes(folder.read_bytes(INDEX_KEY))
    except NotAnIndex as exc:
        return None, f"{INDEX_KEY} is {exc}"
    except Exception as exc:
        if is_missing(exc):
            return None, f"no {INDEX_KEY} (run hsx index build --job {job}, or hsx index rebuild)"
        raise
    if index.job != job:
        return None, f"{INDEX_KEY} is job {index.job}'s"
    if spec is not None and (index.plan, index.total_samples) != (spec.plan_tag, spec.total_samples):
        return None, (
            f"{INDEX_KEY} is of plan {index.plan} ({index.total_samples} samples), the job's is "
            f"{spec.plan_tag} ({spec.total_samples} samples)"
        )
    if not index.complete:
        return None, f"{INDEX_KEY} holds {index.table.num_rows} of the job's {index.total_samples} samples"
    return index, ""


def stored_samples(
    folder: Destination, job: str, *, spec: JobSpec | None = None
) -> tuple[list[int], StoredIndex | None, str]:
    """The job's stored sample indices in order, from its complete index (returned too), else from
    a listing of its folder, with why the index was not used. With a spec, only the plan's
    samples (0 to total_samples - 1): a file past them is another job's (an earlier one of this
    name), whatever its header says."""
    index, why_not = read_index(folder, job, spec=spec)
    if index is not None:
        return index.sample_indices.tolist(), index, ""
    total = spec.total_samples if spec is not None else None
    listed = sorted(
        i
        for i in (sample_index_of(job, key) for key in folder.keys())
        if i is not None and (total is None or i < total)
    )
    return listed, None, why_not


def write_index(folder: Destination, index: StoredIndex) -> int:
    """Put the index with the destinations' verified put; the bytes written."""
    data = index.to_bytes()
    folder.put_bytes_verified(data, INDEX_KEY)
    return len(data)


async def index_from_events(js, spec: JobSpec, *, timeout_s: float = 600.0) -> StoredIndex:
    """The index compacted from the job's `uploaded` markers (this plan's, within the plan's
    samples), then the later uploads that replaced a marker's object (`replaced` reports), the
    newest standing, as the last put does."""
    from nats.js.api import DeliverPolicy

    from hsx.wire import topology
    from hsx.wire.counts import last_sequence

    total, job, plan = spec.total_samples, spec.job, spec.plan_tag or "none"
    size = np.full(total, -1, dtype=np.int64)  # -1: no `uploaded` marker for the sample
    tokens = np.zeros(total, dtype=np.int64)
    digests: list[str] = [""] * total
    for subject in (topology.marker_filter(job, "uploaded", plan), topology.replaced_subject(job, plan, "*")):
        newest = await last_sequence(js, topology.EVENTS_STREAM, subject)
        if not newest:
            continue
        caught_up = asyncio.Event()

        async def on_msg(msg) -> None:
            event = read_marker(msg.data, subject=msg.subject, job=job)
            if event is None:
                log.warning("marker_refused", subject=msg.subject, reason="not what its subject names")
            if isinstance(event, schemas.FileUploaded) and 0 <= event.sample_index < total:
                size[event.sample_index] = event.size
                tokens[event.sample_index] = event.tokens
                digests[event.sample_index] = event.digest
            if msg.metadata.num_pending == 0 or msg.metadata.sequence.stream >= newest:
                caught_up.set()

        sub = await js.subscribe(
            subject, stream=topology.EVENTS_STREAM, cb=on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
        )
        try:
            await asyncio.wait_for(caught_up.wait(), timeout_s)
        except TimeoutError:
            raise HsxError(f"job {job}: its uploaded markers were not all read within {timeout_s:g} s") from None
        finally:
            await sub.unsubscribe()
    stored = np.nonzero(size >= 0)[0]
    return make_index(
        job=job,
        plan=spec.plan_tag,
        total_samples=total,
        source="events",
        sample_index=stored,
        size=size[stored],
        tokens=tokens[stored],
        digest=[digests[i] for i in stored],
    )


def _header_entry(folder: Destination, key: str, index: int, expected: ExpectedSamples) -> tuple[int, int, str] | str:
    """(size, tokens, digest) of the sample file at `key`, from its header alone; or, when the
    header says it is not sample `index` of `expected`, what disagrees."""
    head, size = folder.read_prefix(key, HEADER_PROBE_BYTES)
    end = 8 + int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
    if not 8 < end <= size:
        raise ValueError(f"header length runs past the end of the file ({size} bytes)")
    if end > len(head):
        head, _ = folder.read_prefix(key, end)
    failed = mismatches(head[:end], expected, index, header_only=True)
    if failed:
        return f"not this job's sample {index}: {describe(failed)}"
    metadata = read_metadata(head[:end])
    return size, int(metadata["num_tokens"]), hashlib.sha256(head[:end]).hexdigest()


def index_from_destination(
    folder: Destination, spec: JobSpec, *, expected: ExpectedSamples | None = None, workers: int = 32
) -> tuple[StoredIndex, list[str]]:
    """The index made by listing the job folder and reading each sample file's header, checked
    against `expected` (by default the spec's own values; hsx.storage.expected); also the files
    left out, "key: why": a header that does not read, or that says another job, plan, sample,
    layers, dtype, shape or token count (hsx verify says more about each)."""
    if expected is None:
        expected = ExpectedSamples.of_spec(spec, where=f"job {spec.job}'s spec")
    found = sorted(
        (i, key)
        for key in folder.keys()
        if (i := sample_index_of(spec.job, key)) is not None and i < spec.total_samples
    )
    entries, left_out = [], []

    def read(item: tuple[int, str]):
        try:
            return item, _header_entry(folder, item[1], item[0], expected)
        except Exception as exc:  # a damaged header, an object gone since the LIST: not indexed
            return item, f"unreadable: {type(exc).__name__}: {exc}"

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hsx-index") as pool:
        for (i, key), entry in pool.map(read, found):
            if isinstance(entry, str):
                log.warning("index_entry_left_out", key=f"{spec.job}/{key}", reason=entry)
                left_out.append(f"{spec.job}/{key}: {entry}")
            else:
                entries.append((i, *entry))
    columns = list(zip(*entries)) if entries else [[], [], [], []]
    index = make_index(
        job=spec.job,
        plan=spec.plan_tag,
        total_samples=spec.total_samples,
        source="destination",
        sample_index=columns[0],
        size=columns[1],
        tokens=columns[2],
        digest=columns[3],
    )
    return index, left_out


@contextlib.contextmanager
def _destination_errors(where: str) -> Iterator[None]:
    """What the destination raised, after its client's own retries, as one line naming it."""
    try:
        yield
    except store_errors() as exc:
        raise HsxError(f"{where}: {error_line(exc)}") from exc


async def build_job_index(js, spec: JobSpec) -> StoredIndex:
    """`hsx index build` and the monitor at the job's end: compact the events, write the index."""
    started = time.monotonic()
    index = await index_from_events(js, spec)
    with _destination_errors(f"writing the index to {spec.dest}/{spec.job}/{INDEX_KEY}"):
        written = await asyncio.to_thread(
            lambda: write_index(open_job_folder(spec_location(spec.dest), spec.job, max_connections=4), index)
        )
    log.info(
        "index_written",
        **index.summary(),
        key=f"{spec.job}/{INDEX_KEY}",
        dest=spec.dest,
        index_bytes=written,
        seconds=round(time.monotonic() - started, 2),
    )
    return index


def rebuild_job_index(folder_url: Location, *, workers: int = 32) -> StoredIndex:
    """`hsx index rebuild JOB_URL`: the index from the destination alone (the bundle's spec, a
    LIST, each file's header), written over whatever index was there."""
    started = time.monotonic()
    job = folder_url.name
    folder = open_destination(folder_url, max_connections=workers)
    with _destination_errors(f"rebuilding the index of {folder_url}"):
        spec = bundle_spec(folder)
        if spec is None:
            raise HsxError(f"{folder_url}: no job bundle there ({BUNDLE_SPEC_KEY}); the index needs the job's spec")
        if spec.job != job:
            raise HsxError(f"{folder_url}: its bundle is job {spec.job}'s, not {job}'s")
        # The bundle's claims are checked (total_samples against its tokens file) before the
        # listing is bounded by them; each header is then checked against its sample.
        expected = load_expected(folder, str(folder_url), ExpectedSamples.of_bundle(spec, str(folder_url)))
        index, left_out = index_from_destination(folder, spec, expected=expected, workers=workers)
        written = write_index(folder, index)
    log.info(
        "index_written",
        **index.summary(),
        key=f"{job}/{INDEX_KEY}",
        dest=str(folder_url),
        index_bytes=written,
        left_out=len(left_out),
        seconds=round(time.monotonic() - started, 2),
    )
    return index


async def run_build(settings, job: str) -> StoredIndex:
    """`hsx index build --job J`: the spec from KV bucket hsx_jobs, the index from the events."""
    from hsx.wire import topology
    from hsx.wire.jobs import require_job_spec
    from hsx.wire.natsconn import close_connection, connect

    nc = await connect(settings, name=f"hsx-index-{job}")
    try:
        js = nc.jetstream()
        spec = await require_job_spec(await topology.require_jobs_bucket(js, job), job)
        return await build_job_index(js, spec)
    finally:
        await close_connection(nc)


def format_summary(index: StoredIndex, *, as_json: bool) -> str:
    summary = index.summary()
    if as_json:
        return json.dumps(summary, sort_keys=True)
    state = "complete" if summary["complete"] else "INCOMPLETE (readers will list the folder instead)"
    return (
        f"job {summary['job']}: index of {summary['samples']}/{summary['total_samples']} samples from "
        f"{summary['source']}, {state}; {summary['bytes']} bytes, {summary['tokens']} tokens stored"
    )
