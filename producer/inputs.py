"""From a dataset to the job's samples: read, tokenize chat rows, apply --on-long, check the vocabulary.

`tokenized_rows` is everything the producer does to a dataset before planning; what it returns
is what gets stored (`producer/stored.py`), planned and published. `report_document` is the
job's input report. No NATS here.
"""

import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from hsx.errors import HsxError
from producer.chat import ChatTemplateInfo, ChatTokenizer
from producer.dataset import ChatRow, DatasetRow, read_rows
from producer.lengths import LongSample, apply_on_long

log = structlog.get_logger("hsx.producer")

_PROGRESS_EVERY_S = 10.0


@dataclass(frozen=True, kw_only=True)
class Inputs:
    rows: list[DatasetRow]  # the job's samples; rows[i] is sample i
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


def check_vocab(rows: list[DatasetRow], *, model: str, vocab_size: int) -> None:
    for row in rows:
        top = max(row.input_ids)
        if top >= vocab_size:
            raise HsxError(f"{row.where}: token id {top} is outside model {model}'s vocabulary of {vocab_size}")


def _tokenize(rows: list, *, model: str, trust_remote_code: bool) -> tuple[list[DatasetRow], ChatTemplateInfo | None]:
    first_chat = next((row for row in rows if isinstance(row, ChatRow)), None)
    if first_chat is None:
        return rows, None
    chat = ChatTokenizer.load(model, first_chat_row=first_chat.where, trust_remote_code=trust_remote_code)
    total = sum(1 for row in rows if isinstance(row, ChatRow))
    log.info("tokenizing_chats", rows=total, model=model, mask_method=chat.info.mask_method)
    started = last_log = time.monotonic()
    out: list[DatasetRow] = []
    done = 0
    for row in rows:
        if isinstance(row, ChatRow):
            row = chat.tokenize(row)
            done += 1
            if time.monotonic() - last_log > _PROGRESS_EVERY_S:
                last_log = time.monotonic()
                log.info("tokenizing_chats_progress", done=done, rows=total,
                         rows_per_s=round(done / (last_log - started), 1))
        out.append(row)
    log.info("chats_tokenized", rows=total, seconds=round(time.monotonic() - started, 2))
    return out, chat.info


def tokenized_rows(
    path: Path, *, model: str, vocab_size: int, max_seq_len: int, on_long: str, trust_remote_code: bool = False
) -> Inputs:
    source = read_rows(path)
    tokenized, chat = _tokenize(source, model=model, trust_remote_code=trust_remote_code)
    rows, long = apply_on_long(tokenized, max_seq_len=max_seq_len, on_long=on_long)
    if not rows:
        raise HsxError(f"dataset {path}: all {len(source)} rows are longer than --max-seq-len {max_seq_len} "
                       "and --on-long skip leaves no samples")
    check_vocab(rows, model=model, vocab_size=vocab_size)
    return Inputs(rows=rows, long=long, rows_read=len(source),
                  chat_rows=sum(1 for row in source if isinstance(row, ChatRow)), chat=chat)


def report_document(*, job: str, dataset: Path, max_seq_len: int, on_long: str, inputs: Inputs) -> dict:
    """The job's input report (stored as `<job>.report.json`)."""
    return {
        "format": "hsx.input_report.v1",
        "job": job,
        "dataset": str(dataset),
        "max_seq_len": max_seq_len,
        "on_long": on_long,
        "rows_read": inputs.rows_read,
        "chat_rows": inputs.chat_rows,
        "samples": len(inputs.rows),
        "samples_truncated": inputs.truncated,
        "samples_skipped": inputs.skipped,
        "chat_template": None if inputs.chat is None else {
            "model": inputs.chat.model, "mask_method": inputs.chat.mask_method,
            "template_sha256": inputs.chat.template_sha256,
        },
        "long_rows": [
            {"where": e.where, "source_id": e.source_id, "original_length": e.original_length, "action": e.action,
             "sample_index": e.sample_index, "kept_length": e.kept_length}
            for e in inputs.long
        ],
    }
