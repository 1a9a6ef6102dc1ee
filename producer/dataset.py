"""Reading a dataset of pre-tokenized rows from JSONL or Parquet.

A row has `input_ids` (list of int), optionally `loss_mask` (same length, 0/1) and `id`. Every
problem names the file and the row (JSONL: 1-based line number; Parquet: 0-based row index).
This module knows nothing about batches or NATS.
"""

from dataclasses import dataclass
from pathlib import Path

import msgspec

from hsx.errors import HsxError


class _Row(msgspec.Struct):
    input_ids: list[int]
    loss_mask: list[int] | None = None
    id: str | int | None = None


@dataclass(frozen=True, slots=True)
class DatasetRow:
    where: str  # how errors name this row: "file:LINE" (JSONL, 1-based) or "file: row N" (Parquet, 0-based)
    source_id: str
    input_ids: list[int]
    loss_mask: list[int] | None


_row_decoder = msgspec.json.Decoder(_Row)


def _check_row(row: _Row, where: str, max_seq_len: int, default_id: str) -> DatasetRow:
    if not row.input_ids:
        raise HsxError(f"{where}: input_ids is empty")
    if len(row.input_ids) > max_seq_len:
        raise HsxError(
            f"{where}: {len(row.input_ids)} tokens is longer than --max-seq-len {max_seq_len} "
            "(raise --max-seq-len or remove the row)"
        )
    if row.loss_mask is not None:
        if len(row.loss_mask) != len(row.input_ids):
            raise HsxError(
                f"{where}: loss_mask has {len(row.loss_mask)} entries but input_ids has {len(row.input_ids)}"
            )
        if any(value not in (0, 1) for value in row.loss_mask):
            raise HsxError(f"{where}: loss_mask must hold only 0 and 1")
    if min(row.input_ids) < 0:
        raise HsxError(f"{where}: input_ids holds a negative token id")
    source_id = default_id if row.id is None else str(row.id)
    return DatasetRow(where=where, source_id=source_id, input_ids=row.input_ids, loss_mask=row.loss_mask)


def _read_jsonl(path: Path, max_seq_len: int) -> list[DatasetRow]:
    rows = []
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                row = _row_decoder.decode(line)
            except msgspec.ValidationError as exc:
                raise HsxError(f"{where}: {exc}") from None
            except msgspec.DecodeError as exc:
                raise HsxError(f"{where}: not a JSON object ({exc})") from None
            rows.append(_check_row(row, where, max_seq_len, default_id=str(line_number - 1)))
    return rows


def _read_parquet(path: Path, max_seq_len: int) -> list[DatasetRow]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
        raise HsxError(f"{path}: not a readable Parquet file ({exc})") from None
    columns = [c for c in ("input_ids", "loss_mask", "id") if c in parquet.schema_arrow.names]
    if "input_ids" not in columns:
        raise HsxError(f"{path}: no input_ids column (found: {', '.join(parquet.schema_arrow.names)})")
    rows = []
    row_index = 0
    for record_batch in parquet.iter_batches(columns=columns, batch_size=8192):
        for record in record_batch.to_pylist():
            where = f"{path}: row {row_index}"
            try:
                row = msgspec.convert(record, _Row)
            except msgspec.ValidationError as exc:
                raise HsxError(f"{where}: {exc}") from None
            rows.append(_check_row(row, where, max_seq_len, default_id=str(row_index)))
            row_index += 1
    return rows


def read_dataset(path: Path, *, max_seq_len: int) -> list[DatasetRow]:
    if not path.exists():
        raise HsxError(f"dataset {path} does not exist")
    if path.is_dir():
        raise HsxError(f"dataset {path} is a directory; give a .jsonl or .parquet file")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        rows = _read_jsonl(path, max_seq_len)
    elif suffix in (".parquet", ".pq"):
        rows = _read_parquet(path, max_seq_len)
    else:
        raise HsxError(f"dataset {path}: unknown format {suffix!r}; use .jsonl or .parquet")
    if not rows:
        raise HsxError(f"dataset {path} has no rows")
    return rows
