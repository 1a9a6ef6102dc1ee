"""From a dataset to the job's samples: read, tokenize chat rows, apply --on-long, check the vocabulary.

`tokenized_rows` is everything the producer does to a dataset before planning; what it returns
is what gets stored (`producer/stored.py`), planned and published. `report_document` is the
job's input report. No NATS here.

Token rows stream from the reader into a columnar `SampleTable` (hsx/storage/tokens.py: tokens spilled to
a temp file, a few numbers per sample in memory). Chat rows keep a place in the table while the
dataset is read; `_tokenize` then turns them into tokens, in order, and each result is written
into its place as it comes, so only the conversations' text is held meanwhile.
"""

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog

from hsx.errors import HsxError
from hsx.producer.chat import ChatTemplateInfo, ChatTokenizer
from hsx.producer.chat_pool import tokenize_chats
from hsx.producer.conventions import HSX, ChatConvention
from hsx.producer.dataset import ChatRow, DatasetRow, read_source
from hsx.producer.lengths import LongSample, apply_on_long_table
from hsx.storage.tokens import SampleTable, SampleTableBuilder

log = structlog.get_logger("hsx.producer")

_PROGRESS_EVERY_S = 10.0


@dataclass(frozen=True, kw_only=True)
class Inputs:
    samples: SampleTable  # the job's samples; sample i at index i
    long: list[LongSample]  # rows truncated or skipped by --on-long
    rows_read: int
    chat_rows: int
    chat: ChatTemplateInfo | None  # how chat rows were tokenized; None without chat rows

    @property
    def truncated(self) -> int:
        return sum(1 for entry in self.long if entry.action == "truncated")

    @property
    def skipped(self) -> int:
        return sum(1 for entry in self.long if entry.action == "skipped")


def check_vocab(samples: SampleTable, *, model: str, vocab_size: int) -> None:
    outside = np.flatnonzero(samples.row_max >= vocab_size)
    if len(outside):
        i = int(outside[0])
        raise HsxError(
            f"{samples.where(i)}: token id {samples.row_max[i]} is outside model {model}'s vocabulary of {vocab_size}"
        )


def _tokenize(
    rows: list, *, model: str, trust_remote_code: bool, chat_as: ChatConvention = HSX
) -> tuple[list[DatasetRow], ChatTemplateInfo | None]:
    first_chat = next((row for row in rows if isinstance(row, ChatRow)), None)
    if first_chat is None:
        return rows, None
    chat = ChatTokenizer.load(
        model, first_chat_row=first_chat.where, trust_remote_code=trust_remote_code, convention=chat_as
    )
    total = sum(1 for row in rows if isinstance(row, ChatRow))
    log.info("tokenizing_chats", rows=total, model=model, mask_method=chat.info.mask_method)
    started = last_log = time.monotonic()
    out: list[DatasetRow] = []
    done = 0
    # In chunks (one batched call each), on every usable core for a large dataset
    # (producer/chat_pool.py); row for row the same result, and error, as `chat.tokenize`.
    tokenized = tokenize_chats(chat, (row for row in rows if isinstance(row, ChatRow)), total=total)
    for row in rows:
        if isinstance(row, ChatRow):
            row = next(tokenized)
            done += 1
            if time.monotonic() - last_log > _PROGRESS_EVERY_S:
                last_log = time.monotonic()
                log.info(
                    "tokenizing_chats_progress", done=done, rows=total, rows_per_s=round(done / (last_log - started), 1)
                )
        out.append(row)
    log.info("chats_tokenized", rows=total, seconds=round(time.monotonic() - started, 2))
    return out, chat.info


def tokenized_rows(
    path: Path,
    *,
    model: str,
    vocab_size: int,
    max_seq_len: int,
    on_long: str,
    trust_remote_code: bool = False,
    chat_as: ChatConvention = HSX,
) -> Inputs:
    builder = SampleTableBuilder()
    chats: list[ChatRow] = []
    places: list[int] = []
    for item in read_source(path):
        if isinstance(item, ChatRow):
            places.append(builder.reserve(where=item.where, source_id=item.source_id))
            chats.append(item)
        else:
            builder.add(item)
    rows_read = builder.rows
    chat = None
    if chats:
        tokenized, chat = _tokenize(chats, model=model, trust_remote_code=trust_remote_code, chat_as=chat_as)
        for place, row in zip(places, tokenized, strict=True):
            builder.fill(place, row.input_ids, row.loss_mask)
        del chats, tokenized
    samples, long = apply_on_long_table(builder.finish(), max_seq_len=max_seq_len, on_long=on_long)
    if not len(samples):
        raise HsxError(
            f"dataset {path}: all {rows_read} rows are longer than --max-seq-len {max_seq_len} "
            "and --on-long skip leaves no samples"
        )
    check_vocab(samples, model=model, vocab_size=vocab_size)
    return Inputs(samples=samples, long=long, rows_read=rows_read, chat_rows=len(places), chat=chat)


def report_document(
    *, job: str, dataset: Path, max_seq_len: int, on_long: str, inputs: Inputs, chat_as: str = "hsx"
) -> dict:
    """The job's input report (stored as `<job>.report.json`)."""
    return {
        "format": "hsx.input_report.v1",
        "job": job,
        "dataset": str(dataset),
        "max_seq_len": max_seq_len,
        "on_long": on_long,
        "chat_convention": chat_as,  # --chat-as
        "rows_read": inputs.rows_read,
        "chat_rows": inputs.chat_rows,
        "samples": len(inputs.samples),
        "samples_truncated": inputs.truncated,
        "samples_skipped": inputs.skipped,
        "chat_template": None
        if inputs.chat is None
        else {
            "model": inputs.chat.model,
            "mask_method": inputs.chat.mask_method,
            "template_sha256": inputs.chat.template_sha256,
        },
        "long_rows": [
            {
                "where": e.where,
                "source_id": e.source_id,
                "original_length": e.original_length,
                "action": e.action,
                "sample_index": e.sample_index,
                "kept_length": e.kept_length,
            }
            for e in inputs.long
        ],
    }
