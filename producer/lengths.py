"""What happens to a sample longer than --max-seq-len: `--on-long error|truncate|skip`.

- `error` (default): the first such row is an error naming it; nothing is dropped silently.
- `truncate`: the row keeps its first max_seq_len tokens (and loss_mask entries).
- `skip`: the row is left out; it gets no sample index, so the kept samples stay numbered
  0..N-1 without gaps.

Every truncated or skipped row is listed (`LongSample`) for the job's report, which names the
row, its source id, its original length and what was done. The policy is decided from the
samples' lengths alone (`apply_on_long_table`: a job's SampleTable, nothing copied); no NATS.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hsx.errors import HsxError
from hsx.producer.config import ON_LONG
from hsx.producer.rows import DatasetRow
from hsx.storage.tokens import SampleTable


@dataclass(frozen=True, slots=True, kw_only=True)
class LongSample:
    where: str  # the row as errors name it: "file:LINE" or "file: row N"
    source_id: str
    original_length: int
    action: str  # "truncated" | "skipped"
    sample_index: int | None  # the truncated sample's index in the job; None when skipped
    kept_length: int


def _decide(
    lengths: np.ndarray, name: Callable[[int], tuple[str, str]], *, max_seq_len: int, on_long: str
) -> tuple[np.ndarray, np.ndarray, list[LongSample]]:
    """(indices of the rows kept, their lengths after cutting, the rows truncated or skipped);
    `name(i)` is row i's (where, source_id)."""
    if on_long not in ON_LONG:
        raise HsxError(f"--on-long {on_long!r}: use one of {', '.join(ON_LONG)}")
    lengths = np.asarray(lengths, dtype=np.int64)
    long_rows = np.flatnonzero(lengths > max_seq_len)
    if not len(long_rows):
        return np.arange(len(lengths)), lengths, []
    if on_long == "error":
        i = int(long_rows[0])
        raise HsxError(
            f"{name(i)[0]}: {lengths[i]} tokens is longer than --max-seq-len {max_seq_len} "
            "(raise --max-seq-len, pass --on-long truncate or --on-long skip, or remove the row)"
        )
    skip = on_long == "skip"
    long = []
    for i in long_rows.tolist():
        where, source_id = name(i)
        long.append(
            LongSample(
                where=where,
                source_id=source_id,
                original_length=int(lengths[i]),
                action="skipped" if skip else "truncated",
                sample_index=None if skip else i,
                kept_length=0 if skip else max_seq_len,
            )
        )
    if skip:
        kept = np.flatnonzero(lengths <= max_seq_len)
        return kept, lengths[kept], long
    return np.arange(len(lengths)), np.minimum(lengths, max_seq_len), long


def apply_on_long_table(table: SampleTable, *, max_seq_len: int, on_long: str) -> tuple[SampleTable, list[LongSample]]:
    """(the job's samples in index order, the rows that were truncated or skipped)."""
    kept, lengths, long = _decide(
        table.lengths, lambda i: (table.where(i), table.source_id(i)), max_seq_len=max_seq_len, on_long=on_long
    )
    if not long:
        return table, long
    return table.select(kept, lengths), long


def apply_on_long(
    rows: list[DatasetRow], *, max_seq_len: int, on_long: str
) -> tuple[list[DatasetRow], list[LongSample]]:
    """`apply_on_long_table` for a few rows as Python values."""
    lengths = np.fromiter((len(row.input_ids) for row in rows), dtype=np.int64, count=len(rows))
    kept, kept_lengths, long = _decide(
        lengths, lambda i: (rows[i].where, rows[i].source_id), max_seq_len=max_seq_len, on_long=on_long
    )
    out = []
    for i, length in zip(kept.tolist(), kept_lengths.tolist()):
        row = rows[i]
        if length < len(row.input_ids):
            row = DatasetRow(
                where=row.where,
                source_id=row.source_id,
                input_ids=row.input_ids[:length],
                loss_mask=None if row.loss_mask is None else row.loss_mask[:length],
            )
        out.append(row)
    return out, long
