"""A job's tokenized samples in bounded memory: the columnar `SampleTable` (built by
`SampleTableBuilder`), which keeps per sample only its numbers and names in memory (some 60 bytes)
and spills the tokens and loss masks to anonymous temp files; and the stored format
`hsx.tokens.v1` (`<job>.tokens.arrow` in object store bucket `hsx_datasets`), written and read
record batch by record batch (`write_tokens`, `read_tokens`). `load_table` and `load_samples`
read a job's stored samples for any service; reading datasets and the producer's policies
(--on-long, vocabulary) live in `producer/`.

Memory and format in detail: docs/architecture/storage.md.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, repeat

import msgspec
import nats.js.errors
import numpy as np
import pyarrow as pa
from nats.js import JetStreamContext

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.wire import schemas, topology
from hsx.wire.jobs import read_job_spec
from hsx.wire.topology import (  # noqa: F401 (their names where the samples are)
    digests_object_name,
    report_object_name,
    tokens_object_name,
)

TOKENS_FORMAT = "hsx.tokens.v1"
SCHEMA = pa.schema(
    [
        pa.field("where", pa.string(), nullable=False),
        pa.field("source_id", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=True),
    ]
)
ROWS_PER_BATCH = 8192
# Reads of consecutive samples are cut at about this many tokens (16 MB of int32).
_TOKENS_PER_READ = 1 << 22


@dataclass(frozen=True, slots=True)
class TokenRow:
    """One sample as Python values: for a few samples at a time (errors, tests, tools), never a
    whole job."""

    where: str  # how errors name this row: "file:LINE" (JSONL, 1-based) or "file: row N" (0-based)
    source_id: str
    input_ids: list[int]
    loss_mask: list[int] | None
    # The samples after this one that the same dataset row makes (`--chat-as speculators`: one per
    # assistant turn); they follow it in the job's sample order.
    more: tuple[TokenRow, ...] = ()


@dataclass(frozen=True, kw_only=True)
class TokenChunk:
    """Consecutive samples, columnar: what dataset readers hand to a `SampleTableBuilder`."""

    # Every row's token ids, concatenated, in the reader's integer dtype: `row_max` (the vocabulary
    # check) is taken from these, before the spill file stores them as int32.
    values: np.ndarray
    offsets: np.ndarray  # int64, len rows + 1: row k is values[offsets[k]:offsets[k+1]]
    masks: np.ndarray | None  # uint8, same positions as values (0 where a row has no mask); None: no row has one
    has_mask: np.ndarray | None  # bool per row; None: no row has one
    source_ids: pa.Array  # string
    wheres: pa.Array  # string

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def from_rows(cls, rows: Sequence[TokenRow]) -> TokenChunk:
        lengths = np.fromiter((len(r.input_ids) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        values = np.fromiter(chain.from_iterable(r.input_ids for r in rows), dtype=np.int64, count=total)
        has_mask = np.fromiter((r.loss_mask is not None for r in rows), dtype=bool, count=len(rows))
        masks = None
        if has_mask.any():
            masks = np.fromiter(
                chain.from_iterable(
                    r.loss_mask if r.loss_mask is not None else repeat(0, len(r.input_ids)) for r in rows
                ),
                dtype=np.uint8,
                count=total,
            )
        return cls(
            values=values,
            offsets=offsets,
            masks=masks,
            has_mask=has_mask if masks is not None else None,
            source_ids=pa.array([r.source_id for r in rows], pa.string()),
            wheres=pa.array([r.where for r in rows], pa.string()),
        )


class _Spill:
    """An anonymous file that only grows; positions are in elements of `dtype`."""

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = np.dtype(dtype)
        self.file = tempfile.TemporaryFile(prefix="hsx-samples-")
        self.size = 0  # elements

    def append(self, array: np.ndarray) -> int:
        start = self.size
        self.write_at(start, array)
        return start

    def write_at(self, start: int, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array, dtype=self.dtype)
        if self.file.tell() != start * self.dtype.itemsize:
            self.file.seek(start * self.dtype.itemsize)
        self.file.write(memoryview(data).cast("B"))
        self.size = max(self.size, start + len(data))

    def finish(self, size: int) -> None:
        """Flush, and make the file `size` elements long (a sparse tail of zeros when shorter)."""
        self.file.flush()
        if size > self.size:
            os.ftruncate(self.file.fileno(), size * self.dtype.itemsize)
            self.size = size

    def read(self, start: int, count: int) -> np.ndarray:
        item = self.dtype.itemsize
        out = np.empty(count, dtype=self.dtype)
        view = memoryview(out).cast("B")
        done = 0
        while done < count * item:  # pread may return less than asked for
            n = os.preadv(self.file.fileno(), [view[done:]], start * item + done)
            if n <= 0:
                raise HsxError(f"spilled samples file ended early at element {start + done // item}")
            done += n
        return out

    def close(self) -> None:
        self.file.close()


class SampleTableBuilder:
    """Appends chunks (and single rows) in sample order; `reserve` keeps a place for a row whose
    tokens come later (a chat row tokenized after the whole dataset was read), `drop` gives a
    place up (a row that turned out bad): the table has no sample for it, and the samples after
    it move up one index. `fill` with a row whose `more` holds further samples (one dataset row
    making several) places them right after it."""

    def __init__(self) -> None:
        self._tokens = _Spill(np.int32)
        self._masks = _Spill(np.uint8)
        self._starts: list[np.ndarray] = []
        self._lengths: list[np.ndarray] = []
        self._has_mask: list[np.ndarray] = []
        self._row_max: list[np.ndarray] = []
        self._source_ids: list[pa.Array] = []
        self._wheres: list[pa.Array] = []
        self._rows = 0
        self._pending: list[TokenRow] = []
        self._filled: list[tuple[int, int, int, bool, int]] = []  # (index, start, length, has_mask, max)
        self._dropped: list[int] = []
        self._renamed: dict[int, str] = {}  # index -> source id, where fill named the sample anew
        self._after: list[tuple[int, int, int, bool, int, str]] = []  # (index, start, length, has_mask, max, source id)

    @property
    def rows(self) -> int:
        """Places taken: rows added and reserved, dropped ones included, `more` samples not."""
        return self._rows + len(self._pending)

    @property
    def dropped(self) -> int:
        return len(self._dropped)

    def add(self, chunk: TokenChunk) -> None:
        self._flush_pending()
        n = chunk.rows
        if n == 0:
            return
        lengths = np.diff(chunk.offsets)
        start = self._tokens.append(chunk.values)
        if chunk.masks is not None:
            self._masks.write_at(start, chunk.masks)
        self._starts.append(start + chunk.offsets[:-1])
        self._lengths.append(lengths)
        self._has_mask.append(chunk.has_mask if chunk.has_mask is not None else np.zeros(n, dtype=bool))
        row_max = np.full(n, -1, dtype=np.int64)
        nonempty = lengths > 0
        if nonempty.any():
            row_max[nonempty] = np.maximum.reduceat(chunk.values, chunk.offsets[:-1][nonempty])
        self._row_max.append(row_max)
        self._source_ids.append(chunk.source_ids)
        self._wheres.append(chunk.wheres)
        self._rows += n

    def add_row(self, row: TokenRow) -> None:
        self._pending.append(row)
        if len(self._pending) >= ROWS_PER_BATCH:
            self._flush_pending()

    def reserve(self, *, where: str, source_id: str) -> int:
        """A place for a row whose tokens `fill` gives later; returns its index."""
        index = self.rows
        self.add_row(TokenRow(where=where, source_id=source_id, input_ids=[], loss_mask=None))
        return index

    def fill(self, index: int, input_ids: Sequence[int], loss_mask: Sequence[int] | None) -> None:
        self._filled.append((index, *self._store(input_ids, loss_mask)))

    def fill_row(self, index: int, row: TokenRow) -> None:
        """`fill` with a row's tokens and its source id, and its `more` samples placed after it."""
        self.fill(index, row.input_ids, row.loss_mask)
        if row.source_id != self._source_id_at(index):
            self._renamed[index] = row.source_id
        for extra in row.more:
            self._after.append((index, *self._store(extra.input_ids, extra.loss_mask), extra.source_id))

    def _source_id_at(self, index: int) -> str:
        if index >= self._rows:
            return self._pending[index - self._rows].source_id
        for part in self._source_ids:  # rare (a renamed sample); parts are record-batch sized
            if index < len(part):
                return part[index].as_py()
            index -= len(part)
        raise IndexError(index)

    def _store(self, input_ids: Sequence[int], loss_mask: Sequence[int] | None) -> tuple[int, int, bool, int]:
        values = np.asarray(input_ids, dtype=np.int64)
        start = self._tokens.append(values)
        if loss_mask is not None:
            self._masks.write_at(start, np.asarray(loss_mask, dtype=np.uint8))
        return start, len(values), loss_mask is not None, int(values.max()) if len(values) else -1

    def drop(self, index: int) -> None:
        """Give up the place `reserve` kept at `index`: the table will have no sample for it."""
        if not 0 <= index < self.rows:
            raise IndexError(index)
        self._dropped.append(index)

    def _flush_pending(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            self.add(TokenChunk.from_rows(pending))

    def finish(self) -> SampleTable:
        """The table of every place taken; the builder is done."""
        return self.window(0, self.rows)

    def window(self, since: int, upto: int) -> SampleTable:
        """The samples of places `since`..`upto`-1 (a round of the dataset), numbered from 0; every
        place before `upto` must be filled or dropped. The spill files are shared with the builder,
        which goes on taking places after `upto` (what this table covers is not written again)."""
        self._flush_pending()
        self._tokens.finish(self._tokens.size)
        self._masks.finish(self._tokens.size)

        def cat(parts: list[np.ndarray], dtype) -> np.ndarray:
            return np.concatenate(parts).astype(dtype, copy=False)[:upto] if parts else np.zeros(0, dtype)

        starts, lengths = cat(self._starts, np.int64).copy(), cat(self._lengths, np.int64).copy()
        has_mask, row_max = cat(self._has_mask, bool).copy(), cat(self._row_max, np.int64).copy()
        for index, start, length, masked, top in self._filled:
            if index < upto:
                starts[index], lengths[index], has_mask[index], row_max[index] = start, length, masked, top
        source_ids, wheres = _one_array(self._source_ids)[:upto], _one_array(self._wheres)[:upto]
        renamed = {index: name for index, name in self._renamed.items() if index < upto}
        if renamed:
            names = source_ids.to_pylist()
            for index, name in renamed.items():
                names[index] = name
            source_ids = pa.array(names, type=source_ids.type)
        keep = np.ones(len(starts), dtype=bool)
        keep[[index for index in self._dropped if index < upto]] = False
        places = np.arange(len(starts))
        after = [entry for entry in self._after if entry[0] < upto]
        if after:
            # Each place's further samples right after it, in the order given.
            at = np.array([entry[0] for entry in after], dtype=np.int64)
            places = np.concatenate([places, at])
            order = np.lexsort((np.arange(len(places)), places))
            places = places[order]
            starts = np.concatenate([starts, [entry[1] for entry in after]])[order]
            lengths = np.concatenate([lengths, [entry[2] for entry in after]])[order]
            has_mask = np.concatenate([has_mask, [entry[3] for entry in after]])[order]
            row_max = np.concatenate([row_max, [entry[4] for entry in after]])[order]
            keep = np.concatenate([keep, np.ones(len(at), dtype=bool)])[order]
            extra_ids = pa.array([entry[5] for entry in after], type=source_ids.type)
            source_ids = pa.concat_arrays([source_ids, extra_ids]).take(pa.array(order))
            wheres = pa.concat_arrays([wheres, wheres.take(pa.array(at))]).take(pa.array(order))
        keep &= places >= since
        if not keep.all():
            starts, lengths, has_mask, row_max = starts[keep], lengths[keep], has_mask[keep], row_max[keep]
            source_ids, wheres = source_ids.filter(pa.array(keep)), wheres.filter(pa.array(keep))
        return SampleTable(
            tokens=self._tokens,
            masks=self._masks,
            starts=starts,
            lengths=lengths,
            has_mask=has_mask,
            # One array each: a chunked array finds element i by walking its chunks.
            row_max=row_max,
            source_ids=source_ids,
            wheres=wheres,
        )


def _one_array(parts: list[pa.Array]) -> pa.Array:
    return pa.chunked_array(parts, pa.string()).combine_chunks() if parts else pa.array([], pa.string())


class SampleTable:
    """A job's samples, sample i at index i (see the module docstring). `table[i]` is a
    `TokenRow`; iterate `runs()` to walk every sample without one Python object per token."""

    def __init__(
        self,
        *,
        tokens: _Spill,
        masks: _Spill,
        starts: np.ndarray,
        lengths: np.ndarray,
        has_mask: np.ndarray,
        row_max: np.ndarray,
        source_ids: pa.Array,
        wheres: pa.Array,
    ) -> None:
        self._tokens, self._masks = tokens, masks
        self.starts = starts  # int64: sample i's first token's position in the spill files
        self.lengths = lengths  # int64: sample i's token count
        self.has_mask = has_mask  # bool
        self.row_max = row_max  # int64: sample i's largest token id (-1 when empty)
        self.source_ids = source_ids
        self.wheres = wheres

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    def input_ids(self, i: int) -> np.ndarray:
        return self._tokens.read(int(self.starts[i]), int(self.lengths[i]))

    def loss_mask(self, i: int) -> np.ndarray | None:
        return self._masks.read(int(self.starts[i]), int(self.lengths[i])) if self.has_mask[i] else None

    def source_id(self, i: int) -> str:
        return self.source_ids[i].as_py()

    def where(self, i: int) -> str:
        return self.wheres[i].as_py()

    def __getitem__(self, i: int) -> TokenRow:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        mask = self.loss_mask(i)
        return TokenRow(
            where=self.where(i),
            source_id=self.source_id(i),
            input_ids=self.input_ids(i).tolist(),
            loss_mask=None if mask is None else mask.tolist(),
        )

    def __iter__(self) -> Iterator[TokenRow]:
        return (self[i] for i in range(len(self)))

    @property
    def token_ids(self) -> _TokenIds:
        """`token_ids[i]`: sample i's token ids as a list (what `hsx verify` compares files with)."""
        return _TokenIds(self)

    def sample(self, i: int) -> schemas.Sample:
        """Sample i as it goes on the wire: token ids inline, the loss mask as spans."""
        mask = self.loss_mask(i)
        return schemas.Sample(
            index=i,
            source_id=self.source_id(i),
            input_ids=self.input_ids(i).tolist(),
            loss_spans=None if mask is None else loss_spans(mask),
        )

    def select(self, indices: np.ndarray, lengths: np.ndarray | None = None) -> SampleTable:
        """The samples at `indices` (renumbered 0..), each cut to `lengths` when given; the spill
        files are shared, nothing is copied."""
        indices = np.asarray(indices, dtype=np.int64)
        new_lengths = self.lengths[indices] if lengths is None else np.asarray(lengths, dtype=np.int64)
        row_max = self.row_max[indices]
        for k in np.flatnonzero(new_lengths < self.lengths[indices]):  # cut rows: their largest id may be gone
            start = int(self.starts[indices[k]])
            row_max[k] = int(self._tokens.read(start, int(new_lengths[k])).max()) if new_lengths[k] else -1
        take = pa.array(indices)
        return SampleTable(
            tokens=self._tokens,
            masks=self._masks,
            starts=self.starts[indices],
            lengths=new_lengths,
            has_mask=self.has_mask[indices],
            row_max=row_max,
            source_ids=self.source_ids.take(take),
            wheres=self.wheres.take(take),
        )

    @staticmethod
    def concat(tables: Sequence[SampleTable]) -> SampleTable:
        """The tables' samples one after another, renumbered from 0; every table must share its
        spill files (windows and selections of one builder's tables); nothing is copied."""
        first = tables[0]
        if any(t._tokens is not first._tokens or t._masks is not first._masks for t in tables):
            raise ValueError("SampleTable.concat: the tables do not share their spill files")

        def cat(name: str) -> np.ndarray:
            return np.concatenate([getattr(t, name) for t in tables])

        return SampleTable(
            tokens=first._tokens,
            masks=first._masks,
            starts=cat("starts"),
            lengths=cat("lengths"),
            has_mask=cat("has_mask"),
            row_max=cat("row_max"),
            source_ids=pa.concat_arrays([t.source_ids for t in tables]),
            wheres=pa.concat_arrays([t.wheres for t in tables]),
        )

    def runs(
        self, *, max_rows: int = ROWS_PER_BATCH
    ) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray | None]]:
        """(first sample, offsets, tokens int32, masks uint8 or None) for consecutive samples,
        at most `max_rows` and about 4M tokens at a time, read with one or two preads when the
        samples lie next to each other in the spill files (they do unless chat rows or cuts
        interleave)."""
        n = len(self)
        cumulative = np.cumsum(self.lengths)
        first = 0
        while first < n:
            before = int(cumulative[first - 1]) if first else 0
            end = int(np.searchsorted(cumulative, before + _TOKENS_PER_READ, side="right"))
            end = max(first + 1, min(end, first + max_rows))
            total = int(cumulative[end - 1]) - before
            lengths = self.lengths[first:end]
            offsets = np.zeros(end - first + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            starts = self.starts[first:end]
            low, high = int(starts.min()), int((starts + lengths).max())
            masked = bool(self.has_mask[first:end].any())
            if high - low == total and np.array_equal(starts - low, offsets[:-1]):
                tokens = self._tokens.read(low, total)
                masks = self._masks.read(low, total) if masked else None
            elif high - low <= 2 * total + (1 << 20):
                index = np.repeat(starts - low - offsets[:-1], lengths) + np.arange(total)
                tokens = self._tokens.read(low, high - low)[index]
                masks = self._masks.read(low, high - low)[index] if masked else None
            else:
                tokens = np.concatenate([self._tokens.read(int(s), int(k)) for s, k in zip(starts, lengths)])
                masks = (
                    np.concatenate([self._masks.read(int(s), int(k)) for s, k in zip(starts, lengths)])
                    if masked
                    else None
                )
            yield first, offsets, tokens, masks
            first = end

    def close(self) -> None:
        self._tokens.close()
        self._masks.close()


class _TokenIds(Sequence):
    def __init__(self, table: SampleTable) -> None:
        self._table = table

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, i):  # type: ignore[override]
        return self._table.input_ids(i).tolist()


def loss_spans(mask: np.ndarray) -> list[tuple[int, int]]:
    """A 0/1 mask as the half-open [start, end) runs of its 1s (`Sample.loss_spans`). Scanned as
    bytes (`bytes.find`, two calls a run): a descriptor's masks are many and small, where NumPy's
    per-call cost was most of the time of building a descriptor."""
    data = np.asarray(mask, dtype=np.uint8).tobytes()
    spans, start = [], data.find(1)
    while start != -1:
        end = data.find(0, start)
        if end == -1:
            end = len(data)
        spans.append((start, end))
        start = data.find(1, end)
    return spans


# ---------------------------------------------------------------- the stored format


def write_tokens(table: SampleTable, sink, *, job: str) -> None:
    """Write `table` in format hsx.tokens.v1 to a binary file object, record batch by record batch."""
    schema = SCHEMA.with_metadata({"hsx_format": TOKENS_FORMAT, "job": job})
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_stream(sink, schema, options=options) as writer:
        for first, offsets, tokens, masks in table.runs():
            end = first + len(offsets) - 1
            has_mask = table.has_mask[first:end]
            if masks is None:
                mask_column = pa.nulls(end - first, pa.list_(pa.uint8()))
            else:
                # Rows without a mask are null and hold no values.
                keep = np.repeat(has_mask, np.diff(offsets))
                mask_offsets = np.zeros(end - first + 1, dtype=np.int32)
                np.cumsum(np.where(has_mask, np.diff(offsets), 0), out=mask_offsets[1:])
                mask_column = pa.ListArray.from_arrays(
                    pa.array(mask_offsets), pa.array(masks[keep], pa.uint8()), mask=pa.array(~has_mask)
                )
            writer.write_batch(
                pa.record_batch(
                    [
                        table.wheres.slice(first, end - first),
                        table.source_ids.slice(first, end - first),
                        pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(tokens, pa.int32())),
                        mask_column,
                    ],
                    schema=schema,
                )
            )


def _list_parts(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets from 0, values) of a list column, slice-aware."""
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    return offsets - offsets[0], values.to_numpy(zero_copy_only=False)


def _chunk_of(batch: pa.RecordBatch) -> TokenChunk:
    offsets, values = _list_parts(batch.column("input_ids"))
    masks_column = batch.column("loss_mask")
    has_mask = masks_column.is_valid().to_numpy(zero_copy_only=False)
    masks = None
    if has_mask.any():
        mask_offsets, mask_values = _list_parts(masks_column)
        masks = np.zeros(int(offsets[-1]), dtype=np.uint8)
        lengths = np.diff(offsets)
        mask_lengths = np.diff(mask_offsets)
        if not np.array_equal(mask_lengths[has_mask], lengths[has_mask]):
            raise ValueError("a loss_mask's length differs from its row's input_ids")
        masks[np.repeat(has_mask, lengths)] = mask_values[np.repeat(has_mask, mask_lengths)]
    return TokenChunk(
        values=values.astype(np.int64),
        offsets=offsets,
        masks=masks,
        has_mask=has_mask if masks is not None else None,
        source_ids=batch.column("source_id").cast(pa.string()),
        wheres=batch.column("where").cast(pa.string()),
    )


def record_batches(source, *, what: str) -> Iterator[pa.RecordBatch]:
    """The record batches of a stored samples object (bytes or a binary file object), its format
    checked first."""
    try:
        reader = pa.ipc.open_stream(pa.BufferReader(source) if isinstance(source, (bytes, bytearray)) else source)
    except (pa.ArrowInvalid, OSError) as exc:
        raise HsxError(f"{what}: not an Arrow stream ({exc})") from None
    found = (reader.schema.metadata or {}).get(b"hsx_format", b"").decode()
    if found != TOKENS_FORMAT:
        raise HsxError(f"{what}: format {found or 'unknown'!r}, expected {TOKENS_FORMAT!r}")
    try:
        yield from reader
    except pa.ArrowInvalid as exc:
        raise HsxError(f"{what}: not an Arrow stream ({exc})") from None


def read_tokens(source, *, what: str) -> SampleTable:
    """A stored samples object (bytes or a binary file object) as a table."""
    builder = SampleTableBuilder()
    for batch in record_batches(source, what=what):
        try:
            builder.add(_chunk_of(batch))
        except (ValueError, KeyError, pa.ArrowException) as exc:
            raise HsxError(f"{what}: unreadable samples ({exc})") from None
    return builder.finish()


# ---------------------------------------------------------------- a job's stored samples


async def spec_of(js: JetStreamContext, job: str, spec: JobSpec | None) -> JobSpec:
    if spec is not None:
        return spec
    found = await read_job_spec(await topology.require_jobs_bucket(js, job), job)
    if found is None:
        raise HsxError(f"job {job} not found in KV bucket {topology.JOBS_BUCKET} (run hsx produce --job {job} first)")
    return found


async def download(js: JetStreamContext, name: str, into, *, job: str | None = None) -> None:
    """Object `name` of bucket hsx_datasets into the binary file `into` (left at its start)."""
    store = await topology.datasets_store(js)
    what = f"object {name} in object store bucket {topology.DATASETS_BUCKET}"
    prefix = f"job {job}: " if job else ""
    try:
        if store is None:
            raise nats.js.errors.ObjectNotFoundError
        await store.get(name, writeinto=into)
    except nats.js.errors.ObjectNotFoundError:
        raise HsxError(f"{prefix}{what} is missing (deleted?); the job's samples cannot be read back") from None
    except nats.js.errors.DigestMismatchError:
        raise HsxError(f"{prefix}{what} does not match its checksum") from None
    into.flush()
    into.seek(0)


async def _stored_object(js: JetStreamContext, job: str, spec: JobSpec | None):
    spec = await spec_of(js, job, spec)
    if not spec.tokenized_object:
        raise HsxError(f"job {job} has no stored tokenized samples (it was produced by an older hsx)")
    return spec, f"object {spec.tokenized_object} in object store bucket {topology.DATASETS_BUCKET}"


async def load_table(js: JetStreamContext, job: str, *, spec: JobSpec | None = None) -> SampleTable:
    """The job's samples exactly as planned and published (sample i at index i), in bounded
    memory: the object is downloaded to a temp file and read record batch by record batch, in a
    thread: at hundreds of millions of tokens that is long work, and the caller's heartbeats and
    `in_progress` must keep going meanwhile. Reads the job spec from KV unless given. An HsxError
    when the job has no stored samples (made before they were stored) or the object is missing or
    unreadable."""
    spec, what = await _stored_object(js, job, spec)
    with tempfile.TemporaryFile(prefix="hsx-tokens-") as file:
        await download(js, spec.tokenized_object, file, job=job)
        table = await asyncio.to_thread(read_tokens, file, what=what)
    if len(table) != spec.total_samples:
        table.close()
        raise HsxError(f"job {job}: {what} holds {len(table)} samples but the job has {spec.total_samples}")
    return table


async def load_samples(
    js: JetStreamContext, job: str, indices: Iterable[int], *, spec: JobSpec | None = None
) -> list[schemas.Sample]:
    """A few of the job's samples by index, as they go on the wire (in the order asked), read
    from the stored object one record batch at a time: memory for one batch, not the job."""
    spec, what = await _stored_object(js, job, spec)
    wanted = sorted(set(int(i) for i in indices))
    bad = [i for i in wanted if not 0 <= i < spec.total_samples]
    if bad:
        raise HsxError(f"job {job} has samples 0..{spec.total_samples - 1}; asked for {bad[:5]}")
    found: dict[int, schemas.Sample] = {}
    with tempfile.TemporaryFile(prefix="hsx-tokens-") as file:
        await download(js, spec.tokenized_object, file, job=job)
        first = 0
        for batch in record_batches(file, what=what):
            end = first + batch.num_rows
            here = [i for i in wanted if first <= i < end]
            if here:
                part = SampleTableBuilder()
                part.add(_chunk_of(batch.take(pa.array([i - first for i in here]))))
                table = part.finish()
                for k, i in enumerate(here):
                    found[i] = msgspec.structs.replace(table.sample(k), index=i)
                table.close()
            first = end
            if len(found) == len(wanted):
                break
    missing = [i for i in wanted if i not in found]
    if missing:
        raise HsxError(f"job {job}: {what} holds fewer samples than the job's {spec.total_samples}")
    return [found[int(i)] for i in indices]
