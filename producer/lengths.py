"""What happens to a sample longer than --max-seq-len: `--on-long error|truncate|skip`.

- `error` (default): the first such row is an error naming it; nothing is dropped silently.
- `truncate`: the row keeps its first max_seq_len tokens (and loss_mask entries).
- `skip`: the row is left out; it gets no sample index, so the kept samples stay numbered
  0..N-1 without gaps.

Every truncated or skipped row is listed (`LongSample`) for the job's report, which names the
row, its source id, its original length and what was done. Pure functions; no NATS, no files.
"""

from dataclasses import dataclass

from hsx.errors import HsxError
from producer.dataset import DatasetRow

ON_LONG = ("error", "truncate", "skip")


@dataclass(frozen=True, slots=True, kw_only=True)
class LongSample:
    where: str  # the row as errors name it: "file:LINE" or "file: row N"
    source_id: str
    original_length: int
    action: str  # "truncated" | "skipped"
    sample_index: int | None  # the truncated sample's index in the job; None when skipped
    kept_length: int


def apply_on_long(rows: list[DatasetRow], *, max_seq_len: int, on_long: str) -> tuple[list[DatasetRow], list[LongSample]]:
    """(the job's samples in index order, the rows that were truncated or skipped)."""
    if on_long not in ON_LONG:
        raise HsxError(f"--on-long {on_long!r}: use one of {', '.join(ON_LONG)}")
    kept: list[DatasetRow] = []
    long: list[LongSample] = []
    for row in rows:
        length = len(row.input_ids)
        if length <= max_seq_len:
            kept.append(row)
            continue
        if on_long == "error":
            raise HsxError(
                f"{row.where}: {length} tokens is longer than --max-seq-len {max_seq_len} "
                "(raise --max-seq-len, pass --on-long truncate or --on-long skip, or remove the row)"
            )
        if on_long == "skip":
            long.append(LongSample(where=row.where, source_id=row.source_id, original_length=length,
                                   action="skipped", sample_index=None, kept_length=0))
            continue
        long.append(LongSample(where=row.where, source_id=row.source_id, original_length=length,
                               action="truncated", sample_index=len(kept), kept_length=max_seq_len))
        kept.append(DatasetRow(
            where=row.where, source_id=row.source_id, input_ids=row.input_ids[:max_seq_len],
            loss_mask=None if row.loss_mask is None else row.loss_mask[:max_seq_len],
        ))
    return kept, long
