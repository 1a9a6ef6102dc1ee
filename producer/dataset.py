"""Reading a dataset's rows from JSONL, Parquet, or a Hugging Face `datasets` save_to_disk folder
(`read_source`): each row's shape checked, pre-tokenized rows yielded as columnar `TokenChunk`s
(hsx/storage/tokens.py) and chat rows as `ChatRow`s (tokenized by producer/chat.py), in dataset
order, every problem naming the file and row. No tokenizing, batches or NATS here.

Row forms: docs/REFERENCE.md, "Input"; memory and row names: docs/ARCHITECTURE.md, "Module notes".
"""

import functools
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hsx.errors import HsxError
from hsx.storage.tokens import SampleTable, SampleTableBuilder, TokenChunk, TokenRow

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_UTF8_BOM = b"\xef\xbb\xbf"
PARQUET_SUFFIXES = (".parquet", ".pq")
_COLUMNS = ("input_ids", "loss_mask", "id")
_CHAT_FIELDS = ("messages", "conversations")  # looked for in this order unless --chat-field names one


class _Row(msgspec.Struct):
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    id: str | int | None = None
    messages: list[Any] | None = None
    conversations: list[Any] | None = None


@functools.cache
def _row_type(chat_field: str | None) -> type:
    """The row struct: `_Row`, or with --chat-field NAME one whose conversation is column NAME
    (`.chat`; neither `messages` nor `conversations` is read then)."""
    if chat_field is None:
        return _Row
    fields = [
        ("input_ids", list[int] | None, None),
        ("loss_mask", list[int] | None, None),
        ("id", str | int | None, None),
        ("chat", list[Any] | None, None),
    ]
    return msgspec.defstruct("_FieldRow", fields, rename={"chat": chat_field}, namespace={"chat_field": chat_field})


@functools.cache
def _decoder(chat_field: str | None) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(_row_type(chat_field))


def chat_columns(chat_field: str | None) -> tuple[str, ...]:
    """The columns a conversation may be in."""
    return _CHAT_FIELDS if chat_field is None else (chat_field,)


class BadRow(HsxError):
    """A row that cannot be a sample of the job: where it is (file:line, or the row index of a
    Parquet file or a datasets folder), the row's id if it has one, and why. Raised wherever a
    row is found bad (reading, checking, rendering its conversation); --on-bad-row decides whether
    it stops the job or is set aside and reported."""

    def __init__(self, where: str, reason: str, *, source_id: str | None = None) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason, self.source_id = where, " ".join(reason.split()), source_id


# A tokenized row: what one sample of the job is made of (one at a time; a job's are a SampleTable).
DatasetRow = TokenRow


@dataclass(frozen=True, slots=True)
class ChatRow:
    """A conversation still to be rendered with the model's chat template and tokenized."""

    where: str
    source_id: str
    messages: list[dict[str, Any]]


SourceRow = DatasetRow | ChatRow
SourceItem = TokenChunk | ChatRow  # what `read_source` yields
_ROWS_PER_CHUNK = 8192
_TOKENS_PER_CHUNK = 1 << 20
_ROWS_PER_READ = 1024  # Arrow rows checked at once

# ShareGPT's `from` values (and role names given there) as chat template roles.
_FROM_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_FROM_ROLES |= {"tool": "tool"}
_ROLES = ("system", "developer", "user", "assistant", "tool")


def _text_of(content: Any, what: str, where: str) -> str:
    """A message's content as text: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise HsxError(f"{where}: {what} must be text or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, dict):
            part = {key: value for key, value in part.items() if value is not None}
            kind = part.get("type", "text")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise HsxError(f"{where}: {what}[{j}] is a {kind!r} part, not text")
            part = part["text"]
        if not isinstance(part, str):
            raise HsxError(f"{where}: {what}[{j}] must be a text part, got {type(part).__name__}")
        texts.append(part)
    return "".join(texts)


def _check_message(message: Any, what: str, where: str) -> dict[str, Any]:
    """One message as the chat template takes it: role and text content (role/content, or
    ShareGPT's from/value), with its other keys (tool_calls, name...) as they are."""
    if not isinstance(message, dict):
        raise HsxError(f"{where}: {what} must be an object with role and content, got {type(message).__name__}")
    # Arrow gives every message every key of the column's struct; a null one was never there.
    message = {key: value for key, value in message.items() if value is not None}
    if "role" not in message and "from" in message:
        name = message.pop("from")
        role = _FROM_ROLES.get(name) if isinstance(name, str) else None
        if role is None:
            raise HsxError(f"{where}: {what}.from is {name!r}; expected one of {', '.join(_FROM_ROLES)}")
        message["role"] = role
        if "value" in message:
            message["content"] = message.pop("value")
    role = message.get("role")
    if role is None:
        raise HsxError(f"{where}: {what} has no role (or from)")
    if role not in _ROLES:
        raise HsxError(f"{where}: {what}.role is {role!r}; expected one of {', '.join(_ROLES)}")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise HsxError(f"{where}: {what}.tool_calls must be a list, got {type(tool_calls).__name__}")
    content = message.get("content")
    if content is None:
        if not (role == "assistant" and tool_calls):
            raise HsxError(f"{where}: {what} (role {role}) has no content")
        content = ""
    message["content"] = _text_of(content, f"{what}.content", where)
    return message


def _check_messages(messages: list[Any], where: str, field: str = "messages") -> list[dict[str, Any]]:
    if not messages:
        raise HsxError(f"{where}: {field} is empty")
    return [_check_message(message, f"{field}[{k}]", where) for k, message in enumerate(messages)]


def _chat_of(row: Any) -> tuple[list[Any] | None, str]:
    """The row's conversation and the field it is in."""
    field = getattr(row, "chat_field", None)
    if field is not None:
        return row.chat, field
    if row.messages is not None:
        return row.messages, "messages"
    return row.conversations, "conversations"


def _check_row(row: Any, where: str, default_id: str) -> SourceRow:
    source_id = default_id if row.id is None else str(row.id)
    chat, field = _chat_of(row)
    if chat is not None:
        if row.input_ids is not None:
            raise HsxError(f"{where}: row has both input_ids and {field}; give one of them")
        if row.loss_mask is not None:
            raise HsxError(f"{where}: loss_mask goes with input_ids; a chat row's mask comes from its assistant turns")
        return ChatRow(where=where, source_id=source_id, messages=_check_messages(chat, where, field))
    if row.input_ids is None:
        names = " or ".join(chat_columns(getattr(row, "chat_field", None)))
        raise HsxError(f"{where}: row has neither input_ids (token ids) nor {names} (a chat)")
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


# What a reading loop does with a bad row: None raises it (the first bad row stops the reading);
# otherwise called with it (--on-bad-row: it raises to stop, or records the row and reading goes on).
OnBadRow = Callable[[BadRow], None] | None


def _set_aside(bad: BadRow, on_bad_row: OnBadRow) -> None:
    if on_bad_row is None:
        raise bad
    on_bad_row(bad)


def _checked(row: _Row, where: str, default_id: str) -> SourceRow:
    """`_check_row`, any error it raises a `BadRow`."""
    try:
        return _check_row(row, where, default_id=default_id)
    except BadRow:
        raise
    except HsxError as exc:
        source_id = None if row.id is None else str(row.id)
        raise BadRow(where, str(exc).removeprefix(f"{where}: "), source_id=source_id) from None


def _id_of(data: object) -> str | None:
    """A bad row's own id, if it has one that can be read."""
    value = data.get("id") if isinstance(data, dict) else None
    return None if value is None or isinstance(value, dict | list) else str(value)


def _read_jsonl(path: Path, on_bad_row: OnBadRow = None, chat_field: str | None = None) -> Iterator[SourceRow]:
    decoder = _decoder(chat_field)
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, start=1):
            if line_number == 1:
                line = line.removeprefix(_UTF8_BOM)  # editors on Windows start a UTF-8 file with one
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                try:
                    row = decoder.decode(line)
                except msgspec.ValidationError as exc:
                    raise BadRow(where, str(exc), source_id=_id_of(_loose_json(line))) from None
                except msgspec.DecodeError as exc:
                    raise BadRow(where, f"not a JSON object ({exc})") from None
                checked = _checked(row, where, default_id=str(line_number - 1))
            except BadRow as bad:
                _set_aside(bad, on_bad_row)
                continue
            yield checked


def _loose_json(line: bytes) -> object:
    try:
        return msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None


def _convert_records(
    records: Iterator[dict], name: str, start: int = 0, on_bad_row: OnBadRow = None, chat_field: str | None = None
) -> Iterator[SourceRow]:
    for row_index, record in enumerate(records, start=start):
        where = f"{name}: row {row_index}"
        try:
            try:
                row = msgspec.convert(record, _row_type(chat_field))
            except msgspec.ValidationError as exc:
                raise BadRow(where, str(exc), source_id=_id_of(record)) from None
            checked = _checked(row, where, default_id=str(row_index))
        except BadRow as bad:
            _set_aside(bad, on_bad_row)
            continue
        yield checked


def _require_columns(names: list[str], what: str, chat_field: str | None = None) -> list[str]:
    columns = [c for c in _COLUMNS + chat_columns(chat_field) if c in names]
    if columns == [c for c in columns if c in ("loss_mask", "id")]:
        wanted = " or ".join(("input_ids",) + chat_columns(chat_field))
        raise HsxError(f"{what}: no {wanted} column (found: {', '.join(names) or 'none'})")
    return columns


def _int_lists(column: pa.Array) -> tuple[np.ndarray, np.ndarray] | None:
    """(offsets from 0, values in their own integer dtype, not copied) of a list-of-integers
    column without null values; None for any other column."""
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
        return None
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    if values.null_count:
        return None
    if pa.types.is_uint64(kind.value_type) and len(values) and pc.max(values).as_py() >= 1 << 63:
        return None
    return offsets - offsets[0], values.to_numpy(zero_copy_only=False)


def _fast_chunk(batch: pa.RecordBatch, name: str, start: int) -> TokenChunk | None:
    """The record batch as a chunk when every row is a well-formed token row (the checks of
    `_check_row`, vectorized); None when any row needs the row-by-row path (a chat row, a bad
    row, an unexpected type): that path then raises the error naming the row, or takes it."""
    n = batch.num_rows
    names = batch.schema.names
    if any(batch.column(c).null_count != n for c in names if c not in _COLUMNS):  # a chat column
        return None
    if "input_ids" not in names or batch.column("input_ids").null_count:
        return None
    parts = _int_lists(batch.column("input_ids"))
    if parts is None:
        return None
    offsets, values = parts
    lengths = np.diff(offsets)
    if not lengths.all() or (len(values) and values.min() < 0):
        return None
    masks = has_mask = None
    if "loss_mask" in names and batch.column("loss_mask").null_count != n:
        column = batch.column("loss_mask")
        mask_parts = _int_lists(column)
        if mask_parts is None:
            return None
        mask_offsets, mask_values = mask_parts
        has_mask = column.is_valid().to_numpy(zero_copy_only=False)
        if not np.array_equal(np.diff(mask_offsets)[has_mask], lengths[has_mask]):
            return None
        if ((mask_values != 0) & (mask_values != 1)).any():
            return None
        masks = np.zeros(len(values), dtype=np.uint8)
        masks[np.repeat(has_mask, lengths)] = mask_values[np.repeat(has_mask, np.diff(mask_offsets))]
    positions = pc.cast(pa.array(np.arange(start, start + n, dtype=np.int64)), pa.string())
    source_ids = positions
    if "id" in names and batch.column("id").null_count != n:
        ids = batch.column("id")
        if not (pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type) or pa.types.is_integer(ids.type)):
            return None
        ids = pc.cast(ids, pa.string())
        source_ids = pc.if_else(pc.is_null(ids), positions, ids) if ids.null_count else ids
    return TokenChunk(
        values=values,
        offsets=offsets,
        masks=masks,
        has_mask=has_mask,
        source_ids=source_ids,
        wheres=pc.binary_join_element_wise(f"{name}: row ", positions, ""),
    )


def _record_batch_items(
    batches: Iterator[pa.RecordBatch],
    name: str,
    start: int = 0,
    on_bad_row: OnBadRow = None,
    chat_field: str | None = None,
) -> Iterator[SourceItem]:
    """The batches' rows, checked: a slice of well-formed token rows at once (`_fast_chunk`), any
    other slice row by row, so that a bad row is named by its index and the good rows around it
    are kept."""
    for whole in batches:
        # Slices (zero-copy) of a few rows: the checks' temporaries grow with the tokens at hand.
        for offset in range(0, whole.num_rows, _ROWS_PER_READ):
            batch = whole.slice(offset, _ROWS_PER_READ)
            chunk = _fast_chunk(batch, name, start)
            if chunk is not None:
                yield chunk
            else:
                records = iter(batch.to_pylist())
                yield from _chunked(
                    _convert_records(records, name, start=start, on_bad_row=on_bad_row, chat_field=chat_field)
                )
            start += batch.num_rows


def _read_parquet(path: Path, on_bad_row: OnBadRow = None, chat_field: str | None = None) -> Iterator[SourceItem]:
    import pyarrow.parquet as pq

    try:
        # No pre-buffering: it keeps every column chunk read so far (memory growing with the file).
        parquet = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
    except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
        raise HsxError(f"{path}: not a readable Parquet file ({exc})") from None
    columns = _require_columns(parquet.schema_arrow.names, str(path), chat_field)
    batches = parquet.iter_batches(columns=columns, batch_size=_ROWS_PER_READ)
    yield from _record_batch_items(batches, str(path), on_bad_row=on_bad_row, chat_field=chat_field)


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


def _read_saved_folder(
    folder: Path, on_bad_row: OnBadRow = None, chat_field: str | None = None
) -> Iterator[SourceItem]:
    files = saved_dataset_files(folder)
    start = 0
    for file in files:
        try:
            # Read, not memory-mapped: every mapped page touched would count in the process's RSS.
            reader = pa.ipc.open_stream(pa.OSFile(str(file)))
        except (pa.ArrowInvalid, OSError) as exc:
            raise HsxError(f"dataset {folder}: {file.name} is not a readable Arrow stream ({exc})") from None
        columns = _require_columns(reader.schema.names, f"dataset {folder}: {file.name}", chat_field)
        count = 0

        def batches() -> Iterator[pa.RecordBatch]:
            nonlocal count
            for record_batch in reader:
                count += record_batch.num_rows
                yield record_batch.select(columns)

        yield from _record_batch_items(
            batches(), str(folder), start=start, on_bad_row=on_bad_row, chat_field=chat_field
        )
        start += count


def _check_path(path: Path) -> None:
    if not path.exists():
        raise HsxError(f"dataset {path} does not exist")
    if not path.is_dir() and path.suffix.lower() not in JSONL_SUFFIXES + PARQUET_SUFFIXES:
        raise HsxError(
            f"dataset {path}: unknown format {path.suffix!r}; use .jsonl, .parquet or a datasets save_to_disk folder"
        )


def read_source(path: Path, *, on_bad_row: OnBadRow = None, chat_field: str | None = None) -> Iterator[SourceItem]:
    """Every row of the dataset, checked, in dataset order: runs of token rows as `TokenChunk`s,
    chat rows one by one. A bad row raises its `BadRow`, or, with `on_bad_row`, is handed to it
    and reading goes on. An error for a dataset without rows (bad rows set aside are rows).
    `chat_field`: the column of the conversations (default: `messages`, else `conversations`)."""
    _check_path(path)
    bad = 0

    def set_aside(row: BadRow) -> None:
        nonlocal bad
        _set_aside(row, on_bad_row)
        bad += 1

    if path.is_dir():
        items = _read_saved_folder(path, set_aside, chat_field)
    elif path.suffix.lower() in JSONL_SUFFIXES:
        items = _chunked(_read_jsonl(path, set_aside, chat_field))
    else:
        items = _read_parquet(path, set_aside, chat_field)
    empty = True
    for item in items:
        empty = False
        yield item
    if empty and not bad:
        raise HsxError(f"dataset {path} has no rows")


def read_pretokenized(path: Path, *, max_seq_len: int | None = None) -> SampleTable:
    """A dataset of pre-tokenized rows only, as a table (chat rows are an error here: tokenizing
    them needs the model's tokenizer, see `producer/chat.py`). With `max_seq_len`, a longer row
    is an error.

    For jobs made before their samples were stored (`hsx verify`); the producer itself goes
    through `producer.inputs.tokenized_rows`, and the samples a job was actually planned from
    are `hsx.storage.tokens.load_table`."""
    builder = SampleTableBuilder()
    for item in read_source(path):
        if isinstance(item, ChatRow):
            raise HsxError(
                f"{item.where}: a chat row; it needs the model's tokenizer (use hsx.storage.tokens.load_table)"
            )
        builder.add(item)
    table = builder.finish()
    if max_seq_len is not None:
        long = np.flatnonzero(table.lengths > max_seq_len)
        if len(long):
            i = int(long[0])
            raise HsxError(f"{table.where(i)}: {table.lengths[i]} tokens is longer than --max-seq-len {max_seq_len}")
    return table


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
