"""The dataset's file formats, one module each, and the registry `hsx produce` finds a dataset's
format in (`source_of`). Adding a format is its module (a `LineSource` or `ArrowSource` subclass
saying how raw rows come out of its files: producer/sources/base.py) and one entry in SOURCES.
What a row may hold is producer/rows/'s, the same in every format.

`read_source` reads a dataset's rows, checked; `dataset_digest` hashes its bytes.
"""

import hashlib
from collections.abc import Iterator
from pathlib import Path

from hsx.errors import HsxError
from hsx.producer.rows import OnBadRow, RowForms
from hsx.producer.sources.base import ArrowSource, LineSource, Source, SourceItem
from hsx.producer.sources.datasets_folder import DatasetsFolder
from hsx.producer.sources.jsonl import JsonlSource
from hsx.producer.sources.parquet import ParquetSource

__all__ = [
    "SOURCES",
    "ArrowSource",
    "LineSource",
    "Source",
    "SourceItem",
    "dataset_digest",
    "read_source",
    "source_of",
]

# Asked in this order; the unknown-format error names them in it.
SOURCES: tuple[type[Source], ...] = (JsonlSource, ParquetSource, DatasetsFolder)


def source_of(path: Path) -> Source:
    """The dataset at `path` in its format; one error naming it when it does not exist or is of
    no format here."""
    if not path.exists():
        raise HsxError(f"dataset {path} does not exist")
    for kind in SOURCES:
        if kind.claims(path):
            return kind(path)
    named = [kind.named for kind in SOURCES]
    raise HsxError(f"dataset {path}: unknown format {path.suffix!r}; use {', '.join(named[:-1])} or {named[-1]}")


def read_source(path: Path, *, on_bad_row: OnBadRow = None, chat_field: str | None = None) -> Iterator[SourceItem]:
    """Every row of the dataset, checked, in dataset order (`Source.read`). `chat_field`: the
    column of the conversations (default: `messages`, else `conversations`)."""
    yield from source_of(path).read(RowForms(chat_field), on_bad_row)


def dataset_digest(path: Path) -> str:
    """sha256 over the dataset's bytes (a folder: its data files, in order), without parsing them.

    Recorded in the job spec, so a producer re-run can tell the dataset changed without reading
    or tokenizing it again."""
    digest = hashlib.sha256()
    for file in source_of(path).files():
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()
