"""What every file format shares: `Source` owns the reading loop (rows in dataset order, each
named by where it is, bad rows handed to --on-bad-row, a dataset without rows refused). A format
is a subclass of one of the two kinds of raw rows and says only how to get them out of its files:

- `LineSource`: lines of JSON text, one row each (JSONL). The loop numbers the lines from 1
  (`data.jsonl:7`), skips a UTF-8 byte-order mark at the start and blank lines, and hands token
  rows on in chunks of at most 8,192 rows and about 1M tokens.
- `ArrowSource`: Arrow record batches of the columns the row forms read (Parquet, a `datasets`
  folder). The loop numbers the rows from 0 (`data.parquet: row 6`) and checks them 1,024 at a
  time: a slice of good token rows at once, as arrays, any other slice row by row.

A row without an `id` is named by its 0-based position, in every format. What a row may hold is
producer/rows/'s; a format knows nothing of it but the columns to read.
"""

import abc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

import pyarrow as pa

from hsx.errors import HsxError
from hsx.producer.rows import BadRow, ChatRow, DatasetRow, OnBadRow, RowForms, SourceRow, set_aside
from hsx.storage.tokens import TokenChunk

SourceItem = TokenChunk | ChatRow  # what `Source.read` yields
ROWS_PER_READ = 1024  # Arrow rows checked at once
_ROWS_PER_CHUNK = 8192
_TOKENS_PER_CHUNK = 1 << 20
_UTF8_BOM = b"\xef\xbb\xbf"


class Source(abc.ABC):
    """A dataset in one file format at `path`. Subclasses set how the registry
    (producer/sources/__init__.py) knows their datasets: `suffixes` (of a file, any case) or
    `claims`, and `named` (how the unknown-format error names the format)."""

    suffixes: ClassVar[tuple[str, ...]] = ()
    named: ClassVar[str] = ""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def claims(cls, path: Path) -> bool:
        """Whether `path` (which exists) is a dataset of this format."""
        return not path.is_dir() and path.suffix.lower() in cls.suffixes

    def files(self) -> list[Path]:
        """The files holding the dataset's bytes, in row order (its digest is theirs)."""
        return [self.path]

    def read(self, forms: RowForms, on_bad_row: OnBadRow = None) -> Iterator[SourceItem]:
        """Every row, checked, in dataset order: runs of token rows as `TokenChunk`s, chat rows one
        by one. A bad row raises its `BadRow`, or, with `on_bad_row`, is handed to it and reading
        goes on. An error for a dataset without rows (bad rows set aside are rows)."""
        bad = 0

        def counted(row: BadRow) -> None:
            nonlocal bad
            set_aside(row, on_bad_row)
            bad += 1

        empty = True
        for item in self._items(forms, counted):
            empty = False
            yield item
        if empty and not bad:
            raise HsxError(f"dataset {self.path} has no rows")

    @abc.abstractmethod
    def _items(self, forms: RowForms, on_bad_row: Callable[[BadRow], None]) -> Iterator[SourceItem]:
        """The rows as `read` yields them, each bad one handed to `on_bad_row`."""


class LineSource(Source):
    """A format of one JSON object per line."""

    @abc.abstractmethod
    def lines(self) -> Iterator[bytes]:
        """Every line of the dataset in order, blank ones too (each counts in the numbering)."""

    def _items(self, forms: RowForms, on_bad_row: Callable[[BadRow], None]) -> Iterator[SourceItem]:
        return _chunked(self._rows(forms, on_bad_row))

    def _rows(self, forms: RowForms, on_bad_row: Callable[[BadRow], None]) -> Iterator[SourceRow]:
        for line_number, line in enumerate(self.lines(), start=1):
            if line_number == 1:
                line = line.removeprefix(_UTF8_BOM)  # editors on Windows start a UTF-8 file with one
            if not line.strip():
                continue
            where = f"{self.path}:{line_number}"
            try:
                row = forms.from_json(line, where=where, default_id=str(line_number - 1))
            except BadRow as bad:
                on_bad_row(bad)
                continue
            yield row


class ArrowSource(Source):
    """A format read as Arrow record batches."""

    @abc.abstractmethod
    def batches(self, columns: Callable[[list[str], str], list[str]]) -> Iterator[pa.RecordBatch]:
        """The dataset's rows in order, as record batches of the columns `columns(names, what)`
        picks of the `names` a file has (an error naming `what` when it has none a row form
        reads). Batches read one at a time: a dataset is never held whole."""

    def _items(self, forms: RowForms, on_bad_row: Callable[[BadRow], None]) -> Iterator[SourceItem]:
        """The batches' rows, checked: a slice of well-formed token rows at once
        (`RowForms.columnar_chunk`), any other slice row by row, so that a bad row is named by
        its index and the good rows around it are kept."""
        prefix = f"{self.path}: row "
        start = 0
        for whole in self.batches(forms.require_columns):
            # Slices (zero-copy) of a few rows: the checks' temporaries grow with the tokens at hand.
            for offset in range(0, whole.num_rows, ROWS_PER_READ):
                batch = whole.slice(offset, ROWS_PER_READ)
                chunk = forms.columnar_chunk(batch, start=start, where_prefix=prefix)
                if chunk is not None:
                    yield chunk
                else:
                    yield from _chunked(_records(forms, batch.to_pylist(), prefix, start, on_bad_row))
                start += batch.num_rows


def _records(
    forms: RowForms, records: list[dict], prefix: str, start: int, on_bad_row: Callable[[BadRow], None]
) -> Iterator[SourceRow]:
    for row_index, record in enumerate(records, start=start):
        try:
            row = forms.from_record(record, where=f"{prefix}{row_index}", default_id=str(row_index))
        except BadRow as bad:
            on_bad_row(bad)
            continue
        yield row


def _chunked(rows: Iterator[SourceRow]) -> Iterator[SourceItem]:
    """Consecutive token rows gathered into chunks (of at most 8,192 rows and about 1M tokens:
    rows as Python lists cost some 40 bytes a token); chat rows passed on in their place."""
    pending: list[DatasetRow] = []
    tokens = 0
    for row in rows:
        if isinstance(row, ChatRow):
            if pending:
                yield TokenChunk.from_rows(pending)
                pending, tokens = [], 0
            yield row
            continue
        pending.append(row)
        tokens += len(row.input_ids)
        if len(pending) >= _ROWS_PER_CHUNK or tokens >= _TOKENS_PER_CHUNK:
            yield TokenChunk.from_rows(pending)
            pending, tokens = [], 0
    if pending:
        yield TokenChunk.from_rows(pending)
