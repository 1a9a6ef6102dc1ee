"""Token rows: pre-tokenized `input_ids` (list of int) with an optional `loss_mask` (as long,
0/1), checked into a `DatasetRow`, one at a time (`token_row`) or a batch of Arrow columns at
once (`columnar_chunk`: the same checks, vectorized). This module knows no file type, tokenizer
or job setting.

The form: docs/reference/data.md, "Input"; the columnar path: docs/architecture/producer.md.
"""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hsx.errors import HsxError
from hsx.storage.tokens import TokenChunk, TokenRow

TOKEN_COLUMNS = ("input_ids", "loss_mask", "id")  # a row's `id` is either form's; read with these

# A tokenized row: what one sample of the job is made of (one at a time; a job's are a SampleTable).
DatasetRow = TokenRow


def token_row(input_ids: list[int], loss_mask: list[int] | None, *, where: str, source_id: str) -> DatasetRow:
    """The row of these token ids and loss mask, checked."""
    if not input_ids:
        raise HsxError(f"{where}: input_ids is empty")
    if loss_mask is not None:
        if len(loss_mask) != len(input_ids):
            raise HsxError(f"{where}: loss_mask has {len(loss_mask)} entries but input_ids has {len(input_ids)}")
        if any(value not in (0, 1) for value in loss_mask):
            raise HsxError(f"{where}: loss_mask must hold only 0 and 1")
    if min(input_ids) < 0:
        raise HsxError(f"{where}: input_ids holds a negative token id")
    return DatasetRow(where=where, source_id=source_id, input_ids=input_ids, loss_mask=loss_mask)


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


def columnar_chunk(batch: pa.RecordBatch, *, start: int, where_prefix: str) -> TokenChunk | None:
    """The record batch as a chunk when every row is a well-formed token row (the checks of
    `token_row`, vectorized); None when any row needs the row-by-row path (a chat row, a bad
    row, an unexpected type): that path then raises the error naming the row, or takes it.
    `start` is the index of the batch's first row; a row is named `where_prefix` + its index and,
    without an `id`, has its index as its id."""
    n = batch.num_rows
    names = batch.schema.names
    if any(batch.column(c).null_count != n for c in names if c not in TOKEN_COLUMNS):  # a chat column
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
        wheres=pc.binary_join_element_wise(where_prefix, positions, ""),
    )
