"""A dataset read in rounds (`--round-rows`): while the producer plans and publishes one round,
the next is read and tokenized, so the first batches go out after one round of the dataset, not
after all of it (914,000 chat rows take minutes on a small machine: docs/performance/index.md).

`RoundReader` runs the reading (producer/inputs.py, `tokenized_rows` with `on_round`) on a thread
and hands the rounds to the event loop in order; without --round-rows its one round is the whole
dataset. How a plan of rounds is named is producer/planning.py's; the publishing itself, and what
a refusal found in a later round does, producer/publishing.py's.
"""

import asyncio
import dataclasses
import threading

from hsx.producer.config import ProducerConfig
from hsx.producer.inputs import Inputs, Round, RoundsCancelled, tokenized_rows


def read_inputs(cfg: ProducerConfig, info, *, on_round=None, cancelled=None) -> Inputs:
    """The dataset read and tokenized under the job's settings, in rounds of --round-rows rows
    (each handed to `on_round` as it is read; producer/inputs.py `tokenized_rows`)."""
    return tokenized_rows(
        cfg.dataset,
        model=cfg.model,
        vocab_size=info.vocab_size,
        max_seq_len=cfg.max_seq_len,
        on_long=cfg.on_long,
        trust_remote_code=cfg.trust_remote_code,
        chat_as=dataclasses.replace(cfg.chat_as, max_length=cfg.max_seq_len),  # speculators' turn choice
        on_bad_row=cfg.on_bad_row,
        max_bad_rows=cfg.max_bad_rows,
        chat_field=cfg.chat_field,
        on_empty_mask=cfg.on_empty_mask,
        round_rows=cfg.round_rows,
        on_round=on_round,
        cancelled=cancelled,
    )


class RoundReader:
    """The dataset read and tokenized on a thread, a round at a time (`next()`, in order; the last
    has `last` set), then the whole (`inputs()`: what `tokenized_rows` returns). An error of the
    reading (a bad row, a long one, a cap passed) is raised by the `next()` that would have got
    the round it is in. `close()`, once the caller is done with every round and with `inputs()`,
    stops the reading at its next row, or closes the samples' spill files (which every round shares)."""

    def __init__(self, cfg: ProducerConfig, info) -> None:
        self._loop = asyncio.get_running_loop()
        self._rounds: asyncio.Queue[Round] = asyncio.Queue()
        self._cancelled = threading.Event()
        self._task = asyncio.create_task(
            asyncio.to_thread(read_inputs, cfg, info, on_round=self._hand_over, cancelled=self._cancelled)
        )

    def _hand_over(self, cut: Round) -> None:  # on the reading thread
        self._loop.call_soon_threadsafe(self._rounds.put_nowait, cut)

    async def next(self) -> Round:
        getting = asyncio.ensure_future(self._rounds.get())
        await asyncio.wait({getting, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if getting.done():
            return getting.result()
        getting.cancel()
        if not self._rounds.empty():  # the reading ended right after handing over its last round
            return self._rounds.get_nowait()
        self._task.result()  # the reading's error
        raise RuntimeError("the dataset's reading ended without its last round")

    async def inputs(self) -> Inputs:
        return await self._task

    async def close(self) -> None:
        self._cancelled.set()
        await asyncio.gather(self._task, return_exceptions=True)
        if not self._task.cancelled() and self._task.exception() is None:
            self._task.result().samples.close()


__all__ = ["RoundReader", "RoundsCancelled", "read_inputs"]
