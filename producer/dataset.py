"""Reading a dataset's rows from JSONL, Parquet, or a Hugging Face `datasets` save_to_disk folder.

A row is either pre-tokenized, `input_ids` (list of int) with optional `loss_mask` (same length,
0/1), or a chat, `messages` (list of {role, content}); both may carry an `id`. This module checks
each row's shape and returns `DatasetRow` (pre-tokenized) or `ChatRow` (to be tokenized by
`producer/chat.py`); it does not tokenize, apply --max-seq-len, or know about batches or NATS.

Every problem names the file (or folder) and the row: JSONL by 1-based line number ("data.jsonl:7"),
Parquet and save_to_disk folders by 0-based row index ("data.parquet: row 6"; for a folder the index
is the one `datasets.load_from_disk(folder)[i]` gives). A row without an `id` is named by that same
0-based position, so the same rows give the same sample ids in every format.

A save_to_disk folder is read with pyarrow alone (its data files are Arrow IPC streams listed in
`state.json`), so the `datasets` library is not needed at run time.
"""

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from hsx.errors import HsxError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
_COLUMNS = ("input_ids", "loss_mask", "id", "messages")


class _Row(msgspec.Struct):
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    id: str | int | None = None
    messages: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class DatasetRow:
    """A tokenized row: what one sample of the job is made of."""

    where: str  # how errors name this row: "file:LINE" (JSONL, 1-based) or "file: row N" (0-based)
    source_id: str
    input_ids: list[int]
    loss_mask: list[int] | None


@dataclass(frozen=True, slots=True)
class ChatRow:
    """A conversation still to be rendered with the model's chat template and tokenized."""

    where: str
    source_id: str
    messages: list[dict[str, Any]]


SourceRow = DatasetRow | ChatRow

_row_decoder = msgspec.json.Decoder(_Row)


def _check_messages(messages: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    if not messages:
        raise HsxError(f"{where}: messages is empty")
    checked = []
    for k, message in enumerate(messages):
        # Arrow gives every message every key of the column's struct; a null one was never there.
        message = {key: value for key, value in message.items() if value is not None}
        role = message.get("role")
        if role is None:
            raise HsxError(f"{where}: messages[{k}] has no role")
        if not isinstance(role, str) or not role:
            raise HsxError(f"{where}: messages[{k}].role must be a non-empty string, got {role!r}")
        content = message.get("content")
        if content is None:
            raise HsxError(f"{where}: messages[{k}] (role {role}) has no content")
        if not isinstance(content, str):
            raise HsxError(f"{where}: messages[{k}].content must be a string, got {type(content).__name__}")
        checked.append(message)
    return checked


def _check_row(row: _Row, where: str, default_id: str) -> SourceRow:
    source_id = default_id if row.id is None else str(row.id)
    if row.messages is not None:
        if row.input_ids is not None:
            raise HsxError(f"{where}: row has both input_ids and messages; give one of them")
        if row.loss_mask is not None:
            raise HsxError(f"{where}: loss_mask goes with input_ids; a chat row's mask comes from its assistant turns")
        return ChatRow(where=where, source_id=source_id, messages=_check_messages(row.messages, where))
    if row.input_ids is None:
        raise HsxError(f"{where}: row has neither input_ids (token ids) nor messages (a chat)")
    if not row.input_ids:
        raise HsxError(f"{where}: input_ids is empty")
    if row.loss_mask is not None:
        if len(row.loss_mask) != len(row.input_ids):
            raise HsxError(
                f"{where}: loss_mask has {len(row.loss_mask)} entries but input_ids has {len(row.input_ids)}"
            )
        if any(value not in (0, 1) for value in row.loss_mask):
            raise HsxError(f"{where}: loss_mask must hold only 0 and 1")
    if min(row.input_ids) < 0:
        raise HsxError(f"{where}: input_ids holds a negative token id")
    return DatasetRow(where=where, source_id=source_id, input_ids=row.input_ids, loss_mask=row.loss_mask)


def _read_jsonl(path: Path) -> Iterator[SourceRow]:
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
            yield _check_row(row, where, default_id=str(line_number - 1))


def _convert_records(records: Iterator[dict], name: str, start: int = 0) -> Iterator[SourceRow]:
    for row_index, record in enumerate(records, start=start):
        where = f"{name}: row {row_index}"
        try:
            row = msgspec.convert(record, _Row)
        except msgspec.ValidationError as exc:
            raise HsxError(f"{where}: {exc}") from None
        yield _check_row(row, where, default_id=str(row_index))


def _require_columns(names: list[str], what: str) -> list[str]:
    columns = [c for c in _COLUMNS if c in names]
    if "input_ids" not in columns and "messages" not in columns:
        raise HsxError(f"{what}: no input_ids or messages column (found: {', '.join(names) or 'none'})")
    return columns


def _read_parquet(path: Path) -> Iterator[SourceRow]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
        raise HsxError(f"{path}: not a readable Parquet file ({exc})") from None
    columns = _require_columns(parquet.schema_arrow.names, str(path))

    def records() -> Iterator[dict]:
        for record_batch in parquet.iter_batches(columns=columns, batch_size=8192):
            yield from record_batch.to_pylist()

    yield from _convert_records(records(), str(path))


def saved_dataset_files(folder: Path) -> list[Path]:
    """The Arrow data files of a `datasets` save_to_disk folder, in row order."""
    if (folder / "dataset_dict.json").exists():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        except (OSError, ValueError, AttributeError):
            splits = []
        example = f" (e.g. {folder / splits[0]})" if splits else ""
        raise HsxError(
            f"dataset {folder} is a DatasetDict with splits {', '.join(map(str, splits)) or '?'}; "
            f"give the folder of one split{example}"
        )
    state_file = folder / "state.json"
    if not state_file.exists():
        raise HsxError(
            f"dataset {folder} is a directory but not a datasets save_to_disk folder (no state.json); "
            "give a .jsonl or .parquet file or a save_to_disk folder"
        )
    try:
        state = json.loads(state_file.read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HsxError(f"dataset {folder}: state.json does not list the data files ({exc})") from None
    files = [folder / name for name in names]
    for file in files:
        if not file.is_file():
            raise HsxError(f"dataset {folder}: data file {file.name} listed in state.json is missing")
    return files


def _read_saved_folder(folder: Path) -> Iterator[SourceRow]:
    import pyarrow as pa

    files = saved_dataset_files(folder)
    start = 0
    for file in files:
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(file)))
        except (pa.ArrowInvalid, OSError) as exc:
            raise HsxError(f"dataset {folder}: {file.name} is not a readable Arrow stream ({exc})") from None
        columns = _require_columns(reader.schema.names, f"dataset {folder}: {file.name}")
        count = 0

        def records() -> Iterator[dict]:
            nonlocal count
            for record_batch in reader:
                batch = record_batch.select(columns).to_pylist()
                count += len(batch)
                yield from batch

        yield from _convert_records(records(), str(folder), start=start)
        start += count


def _check_path(path: Path) -> None:
    if not path.exists():
        raise HsxError(f"dataset {path} does not exist")
    if not path.is_dir() and path.suffix.lower() not in JSONL_SUFFIXES + PARQUET_SUFFIXES:
        raise HsxError(
            f"dataset {path}: unknown format {path.suffix!r}; use .jsonl, .parquet or a datasets save_to_disk folder"
        )


def read_rows(path: Path) -> list[SourceRow]:
    """Every row of the dataset, checked, in dataset order."""
    _check_path(path)
    if path.is_dir():
        rows = list(_read_saved_folder(path))
    elif path.suffix.lower() in JSONL_SUFFIXES:
        rows = list(_read_jsonl(path))
    else:
        rows = list(_read_parquet(path))
    if not rows:
        raise HsxError(f"dataset {path} has no rows")
    return rows


def read_dataset(path: Path, *, max_seq_len: int | None = None) -> list[DatasetRow]:
    """A dataset of pre-tokenized rows only (chat rows are an error here: tokenizing them needs
    the model's tokenizer, see `producer/chat.py`). With `max_seq_len`, a longer row is an error.

    Kept for callers that want the raw token rows; the producer itself goes through
    `producer.inputs.tokenized_rows`, and the rows a job was actually planned from are
    `producer.stored.load_tokenized`."""
    rows = read_rows(path)
    for row in rows:
        if isinstance(row, ChatRow):
            raise HsxError(f"{row.where}: a chat row; it needs the model's tokenizer (use producer.stored.load_tokenized)")
        if max_seq_len is not None and len(row.input_ids) > max_seq_len:
            raise HsxError(f"{row.where}: {len(row.input_ids)} tokens is longer than --max-seq-len {max_seq_len}")
    return rows  # type: ignore[return-value]


def dataset_digest(path: Path) -> str:
    """sha256 over the dataset's bytes (a folder: its data files, in order), without parsing them.

    Recorded in the job spec, so a producer re-run can tell the dataset changed without reading
    or tokenizing it again."""
    _check_path(path)
    files = saved_dataset_files(path) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()
