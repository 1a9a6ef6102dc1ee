"""Which form a raw row is, and the row it makes: `RowForms` (one per reading, built from
--chat-field) takes a row as a source hands it over (JSON text, a dict, or a batch of Arrow
columns) and gives a token row (producer/rows/token_rows.py), a chat row
(producer/rows/chat_rows.py) or a `BadRow` naming it. It knows no file type: where a row is
(`where`) and the id it has without one (`default_id`) are the source's to say.
"""

import functools
from typing import Any

import msgspec
import pyarrow as pa

from hsx.errors import HsxError
from hsx.producer.rows.bad import BadRow
from hsx.producer.rows.chat_rows import ChatRow, chat_columns, chat_row
from hsx.producer.rows.token_rows import TOKEN_COLUMNS, DatasetRow, columnar_chunk, token_row
from hsx.storage.tokens import TokenChunk

SourceRow = DatasetRow | ChatRow


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


def _id_of(data: object) -> str | None:
    """A bad row's own id, if it has one that can be read."""
    value = data.get("id") if isinstance(data, dict) else None
    return None if value is None or isinstance(value, dict | list) else str(value)


def _loose_json(line: bytes) -> object:
    try:
        return msgspec.json.decode(line)
    except (msgspec.DecodeError, RecursionError):
        return None


class RowForms:
    """The forms a row of the dataset may take: a token row (`input_ids`, `loss_mask`) or a chat
    row (its conversation in `messages`, else `conversations`; with `chat_field`, that column
    alone), either with an `id`."""

    def __init__(self, chat_field: str | None = None) -> None:
        self.chat_field = chat_field
        self.chat_columns = chat_columns(chat_field)
        self._type = _row_type(chat_field)
        self._decoder = _decoder(chat_field)

    def from_json(self, line: bytes, *, where: str, default_id: str) -> SourceRow:
        """The row of one JSON object (decoded straight into the row's fields, no dict between);
        a `BadRow` for anything else."""
        try:
            row = self._decoder.decode(line)
        except msgspec.ValidationError as exc:
            raise BadRow(where, str(exc), source_id=_id_of(_loose_json(line))) from None
        except msgspec.DecodeError as exc:
            raise BadRow(where, f"not a JSON object ({exc})") from None
        except RecursionError:  # msgspec recurses into nested values, read or skipped alike
            raise BadRow(where, "JSON nested deeper than a row is") from None
        return self._checked(row, where, default_id)

    def from_record(self, record: dict, *, where: str, default_id: str) -> SourceRow:
        """The row of one record (an Arrow row as Python values); a `BadRow` for anything else."""
        try:
            row = msgspec.convert(record, self._type)
        except msgspec.ValidationError as exc:
            raise BadRow(where, str(exc), source_id=_id_of(record)) from None
        return self._checked(row, where, default_id)

    def columnar_chunk(self, batch: pa.RecordBatch, *, start: int, where_prefix: str) -> TokenChunk | None:
        """The batch as one chunk when all its rows are good token rows, else None (then each row
        goes through `from_record`); producer/rows/token_rows.py `columnar_chunk`."""
        return columnar_chunk(batch, start=start, where_prefix=where_prefix)

    def require_columns(self, names: list[str], what: str) -> list[str]:
        """The columns of `names` that a row form reads; an error naming `what` when none of them
        holds token ids or a conversation."""
        columns = [c for c in TOKEN_COLUMNS + self.chat_columns if c in names]
        if columns == [c for c in columns if c in ("loss_mask", "id")]:
            wanted = " or ".join(("input_ids",) + self.chat_columns)
            raise HsxError(f"{what}: no {wanted} column (found: {', '.join(names) or 'none'})")
        return columns

    def _chat_of(self, row: Any) -> tuple[list[Any] | None, str]:
        """The row's conversation and the field it is in."""
        if self.chat_field is not None:
            return row.chat, self.chat_field
        if row.messages is not None:
            return row.messages, "messages"
        return row.conversations, "conversations"

    def _check(self, row: Any, where: str, default_id: str) -> SourceRow:
        source_id = default_id if row.id is None else str(row.id)
        chat, field = self._chat_of(row)
        if chat is not None:
            if row.input_ids is not None:
                raise HsxError(f"{where}: row has both input_ids and {field}; give one of them")
            if row.loss_mask is not None:
                raise HsxError(
                    f"{where}: loss_mask goes with input_ids; a chat row's mask comes from its assistant turns"
                )
            return chat_row(chat, where=where, source_id=source_id, field=field)
        if row.input_ids is None:
            names = " or ".join(self.chat_columns)
            raise HsxError(f"{where}: row has neither input_ids (token ids) nor {names} (a chat)")
        return token_row(row.input_ids, row.loss_mask, where=where, source_id=source_id)

    def _checked(self, row: Any, where: str, default_id: str) -> SourceRow:
        """`_check`, any error it raises a `BadRow`."""
        try:
            return self._check(row, where, default_id)
        except BadRow:
            raise
        except HsxError as exc:
            source_id = None if row.id is None else str(row.id)
            raise BadRow(where, str(exc).removeprefix(f"{where}: "), source_id=source_id) from None
