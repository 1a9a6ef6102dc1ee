"""Chat rows to tokens on every usable core: `ChatTokenizer.tokenize_many` over chunks of rows in
worker processes, results in input order.

The parent has loaded the `ChatTokenizer` (so a missing tokenizer or template is its error, naming
the first chat row). Workers are spawned, not forked (the producer calls this from a thread while
its NATS connection runs), and get the parent's tokenizer pickled once in their initializer (no
torch import, about a second each); a tokenizer that does not pickle is loaded again from the
model folder. Each worker tokenizes one chunk at a time with the fast tokenizer's own threads off
(the processes are the parallelism). A bad row comes back in its place as its `BadRow` (sent by
a worker as its reason and id: an exception does not pickle whole); the caller decides whether it
stops the job (--on-bad-row). Few rows, or one
usable core: the same chunks in this process, no pool.

This module knows nothing about files, --max-seq-len or NATS.
"""

import dataclasses
import multiprocessing
import os
import pickle
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import islice

import numpy as np

from hsx.errors import HsxError
from hsx.producer.chat import ChatTokenizer
from hsx.producer.conventions import ChatConvention
from hsx.producer.rows import BadRow, ChatRow, DatasetRow

CHUNK_ROWS = 512
# Below this many rows a pool's start-up (about a second per worker, in parallel) costs more than it saves.
POOL_MIN_ROWS = 4096

_worker_chat: ChatTokenizer | None = None


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_workers(rows: int | None) -> int:
    """Worker processes for `rows` chat rows (None: unknown, many): 1 means no pool."""
    if rows is not None and rows < POOL_MIN_ROWS:
        return 1
    return usable_cores()


def _chunks(rows: Iterable[ChatRow], size: int) -> Iterator[list[ChatRow]]:
    it = iter(rows)
    while chunk := list(islice(it, size)):
        yield chunk


def _init_worker(tokenizer: bytes | None, model: str, trust_remote_code: bool, convention: ChatConvention) -> None:
    global _worker_chat
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker; before the tokenizer is built
    if tokenizer is not None:
        loaded = pickle.loads(tokenizer)
    else:
        from transformers import AutoTokenizer

        loaded = AutoTokenizer.from_pretrained(model, local_files_only=True, trust_remote_code=trust_remote_code)
    _worker_chat = ChatTokenizer(loaded, model=model, trust_remote_code=trust_remote_code, convention=convention)


def _work(chunk: list[ChatRow]) -> list:
    """Per row its `DatasetRow` (tokens as arrays), or (reason, source_id) for a bad row."""
    assert _worker_chat is not None
    return [
        (row.reason, row.source_id) if isinstance(row, BadRow) else _as_arrays(row)
        for row in _worker_chat.tokenize_many(chunk, keep_bad=True)
    ]


def _as_arrays(row: DatasetRow) -> DatasetRow:
    """The row's tokens and mask as NumPy arrays: made here, in the worker, they cross to the
    parent as one buffer each (a list pickles int by int) and the parent, the one process no
    core count divides, stores them without converting (SampleTableBuilder.fill_row)."""
    return dataclasses.replace(
        row,
        input_ids=np.asarray(row.input_ids, dtype=np.int32),  # token ids < 2**31
        loss_mask=None if row.loss_mask is None else np.asarray(row.loss_mask, dtype=np.uint8),
        more=tuple(_as_arrays(extra) for extra in row.more),
    )


def tokenize_chats(
    chat: ChatTokenizer,
    rows: Iterable[ChatRow],
    *,
    workers: int | None = None,
    chunk_rows: int = CHUNK_ROWS,
    total: int | None = None,
) -> Iterator[DatasetRow | BadRow]:
    """`chat.tokenize(row)` for every row, in order, a bad row's `BadRow` in its place; `workers`
    processes (default: every usable core, or none below POOL_MIN_ROWS of `total`)."""
    workers = default_workers(total) if workers is None else workers
    if workers <= 1:
        for chunk in _chunks(rows, chunk_rows):
            yield from chat.tokenize_many(chunk, keep_bad=True)
        return
    yield from _pooled(chat, rows, workers=workers, chunk_rows=chunk_rows)


def _pooled(
    chat: ChatTokenizer, rows: Iterable[ChatRow], *, workers: int, chunk_rows: int
) -> Iterator[DatasetRow | BadRow]:
    try:
        tokenizer = pickle.dumps(chat.tokenizer)
    except Exception:  # e.g. a remote-code tokenizer class: each worker loads it from the model folder
        tokenizer = None
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(tokenizer, chat.model, chat.trust_remote_code, chat.convention),
    )
    try:
        chunks = _chunks(rows, chunk_rows)
        pending: deque = deque()
        for chunk in islice(chunks, 2 * workers):  # a bounded number in flight: results come back in order
            pending.append((chunk, pool.submit(_work, chunk)))
        while pending:
            chunk, future = pending.popleft()
            try:
                out = future.result()
            except BrokenProcessPool as exc:
                raise HsxError(
                    f"a chat tokenization worker process died while tokenizing the rows from "
                    f"{chunk[0].where} on ({exc}); is the machine out of memory?"
                ) from None
            for row, result in zip(chunk, out, strict=True):
                if isinstance(result, tuple):
                    reason, source_id = result
                    yield BadRow(row.where, reason, source_id=source_id)
                else:
                    yield result
            following = next(chunks, None)
            if following is not None:
                pending.append((following, pool.submit(_work, following)))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
