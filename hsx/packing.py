"""Packing samples into token-budgeted batches: the producer's plan (producer/main.py) and the
trainer-side sampler (hsx/storage/reader.py, TokenBudgetSampler) cut batches the same way.

Samples are sorted by length (longest first, ties by index, so the plan is deterministic) and
cut greedily: a batch's padded length is its first (longest) sample's length, and samples join
it while `batch_size * padded_len <= token_budget`. Sorting keeps padding small, so nearly every
computed token is a real one. Longest-first also means an out-of-memory batch shows up at once,
not hours into a run. `shuffled_epoch` draws a trainer's epoch from them (TokenBudgetSampler,
and JobStream's epochs after the first). Pure functions; they know nothing about NATS or models.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class PlannedBatch:
    sample_indices: tuple[int, ...]
    padded_len: int

    @property
    def padded_tokens(self) -> int:
        return len(self.sample_indices) * self.padded_len


def plan_batches(lengths, *, token_budget: int, max_batch_size: int | None = None) -> list[PlannedBatch]:
    """`lengths`: every sample's token count (a list or a NumPy array), sample i at index i."""
    if token_budget <= 0:
        raise ValueError("token_budget must be positive")
    lengths = np.asarray(lengths, dtype=np.int64)
    # Longest first, ties by index: a stable sort of the negated lengths.
    order = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[order].tolist()
    order = order.tolist()
    batches: list[PlannedBatch] = []
    start = 0
    while start < len(order):
        padded_len = sorted_lengths[start]
        if padded_len > token_budget:
            raise ValueError(
                f"sample {order[start]} has {padded_len} tokens, more than the token budget {token_budget}"
            )
        size = token_budget // padded_len
        if max_batch_size is not None:
            size = min(size, max_batch_size)
        members = order[start : start + size]
        batches.append(PlannedBatch(sample_indices=tuple(members), padded_len=padded_len))
        start += len(members)
    return batches


def plan_in_rounds(
    lengths, round_starts, *, token_budget: int, max_batch_size: int | None = None
) -> list[PlannedBatch]:
    """`plan_batches` over each round on its own (round k: samples round_starts[k] up to the next
    start, or the end; samples before round_starts[0] are left out), the rounds' batches one after
    another, sample indices the job's. A round is planned as soon as it is read, so the first
    batches need not wait for the whole dataset."""
    lengths = np.asarray(lengths, dtype=np.int64)
    bounds = [*round_starts, len(lengths)]
    batches: list[PlannedBatch] = []
    for start, end in zip(bounds, bounds[1:]):
        for batch in plan_batches(lengths[start:end], token_budget=token_budget, max_batch_size=max_batch_size):
            batches.append(
                PlannedBatch(sample_indices=tuple(start + i for i in batch.sample_indices), padded_len=batch.padded_len)
            )
    return batches


def shuffled_epoch(
    lengths, *, token_budget: int, max_batch_size: int | None, seed: int, epoch: int
) -> Iterator[np.ndarray]:
    """One epoch of a trainer's batches (TokenBudgetSampler, and JobStream's epochs after the
    first): the samples drawn in a random order, cut by `plan_batches`, the batches in a random
    order, all from (seed, epoch); each batch as the positions in `lengths` of its samples."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rng = np.random.default_rng((seed, epoch))
    order = rng.permutation(len(lengths))
    planned = plan_batches(lengths[order], token_budget=token_budget, max_batch_size=max_batch_size)
    for number in rng.permutation(len(planned)).tolist():
        yield order[list(planned[number].sample_indices)]
