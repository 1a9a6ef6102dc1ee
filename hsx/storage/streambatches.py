"""How samples that land one after another become each rank's batches (hsx/storage/reader.py,
`JobStream`): `LandingBatcher` cuts the samples, in the order they land, into token-budgeted
batches after a shuffle pool, and `deal` hands the batches round by round to `num_replicas` ranks,
each rank the same number, each sample to one rank.

Both are pure functions of the order the samples come in, the seed and the settings: every
rank, and a trainer restarted from its saved state, computes the same batches from the same
landing order, so a rank skips what it already took without reading a file, and no rank needs
to hear from another. Nothing here reads a file or talks to NATS.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from hsx.errors import HsxError
from hsx.packing import plan_batches, shuffled_epoch
from hsx.wire.landed import Landed

Batch = list[Landed]


class LandingBatcher:
    """Batches of the samples pushed, as `TokenBudgetSampler` cuts them: at most `token_budget`
    padded tokens each (batch size x its longest sample), at most `max_batch_size` samples; with
    `token_budget` None, one sample each.

    `shuffle_pool` 0: cut in landing order, a batch closed when the next sample would not fit.
    Otherwise samples wait in a pool; once it holds `shuffle_pool` of them they are cut as the
    producer cuts a plan (longest first, so a batch's samples have like lengths), and batches
    drawn at random leave until half the pool has; the rest wait with the next arrivals, so a
    sample may leave with one that landed a whole pool later. `finish()` cuts and draws what is
    left. The draws come from `seed` alone."""

    def __init__(
        self, *, token_budget: int | None, max_batch_size: int | None = None, shuffle_pool: int = 0, seed: int = 0
    ) -> None:
        if token_budget is not None and token_budget <= 0:
            raise HsxError(f"token_budget is {token_budget}, expected a positive number of tokens")
        if shuffle_pool < 0:
            raise HsxError(f"shuffle_buffer is {shuffle_pool}, expected 0 (none) or more samples")
        if max_batch_size is not None and max_batch_size <= 0:
            raise HsxError(f"max_batch_size is {max_batch_size}, expected a positive number of samples")
        self.token_budget, self.max_batch_size, self.shuffle_pool = token_budget, max_batch_size, shuffle_pool
        self._rng = np.random.default_rng(seed)
        self._current: Batch = []
        self._current_longest = 0
        self._pool: list[Landed] = []

    def push(self, sample: Landed) -> list[Batch]:
        """The batches `sample`'s arrival completes (often none)."""
        if self.token_budget is not None and sample.tokens > self.token_budget:
            raise HsxError(
                f"sample {sample.index} has {sample.tokens} tokens, more than the token budget {self.token_budget}"
            )
        if self.shuffle_pool:
            self._pool.append(sample)
            return self._draw(keep=self.shuffle_pool // 2) if len(self._pool) >= self.shuffle_pool else []
        return self._in_order(sample)

    def finish(self) -> list[Batch]:
        """The batches of every sample still held, once no sample will land any more."""
        if self.shuffle_pool:
            return self._draw(keep=0)
        done, self._current, self._current_longest = self._current, [], 0
        return [done] if done else []

    def _fits(self, count: int, longest: int) -> bool:
        if self.max_batch_size is not None and count > self.max_batch_size:
            return False
        if self.token_budget is None:
            return count <= 1
        return count * longest <= self.token_budget

    def _in_order(self, sample: Landed) -> list[Batch]:
        longest = max(self._current_longest, sample.tokens)
        if self._fits(len(self._current) + 1, longest):
            self._current.append(sample)
            self._current_longest = longest
            return []
        done, self._current, self._current_longest = self._current, [sample], sample.tokens
        return [done]

    def _cut(self, samples: list[Landed]) -> list[Batch]:
        if self.token_budget is None:
            return [[sample] for sample in samples]
        planned = plan_batches(
            [s.tokens for s in samples], token_budget=self.token_budget, max_batch_size=self.max_batch_size
        )
        return [[samples[i] for i in batch.sample_indices] for batch in planned]

    def _draw(self, *, keep: int) -> list[Batch]:
        batches = self._cut(self._pool)
        order = self._rng.permutation(len(batches))
        left = len(self._pool)
        out: list[Batch] = []
        for position in order:
            if left <= keep:
                break
            out.append(batches[position])
            left -= len(batches[position])
        drawn = {id(batch) for batch in out}
        self._pool = [s for batch in batches if id(batch) not in drawn for s in batch]
        return out


def check_rank(num_replicas: int, rank: int) -> None:
    """One line when `rank` is not one of `num_replicas` ranks."""
    if not 0 <= rank < num_replicas:
        raise HsxError(f"rank {rank} is not one of num_replicas {num_replicas} (0 to {num_replicas - 1})")


def deal(batches: Iterable[Batch], *, num_replicas: int, rank: int) -> Iterator[Batch]:
    """Rank `rank`'s batches of `batches` (every rank passes the same ones in the same order):
    round by round, each round's `num_replicas` batches one to each rank, the r-th to rank r.

    Every rank takes the same number (one with fewer would wait forever at its next all-reduce):
    the last two rounds are held until `batches` ends, and when the last one is short its batches
    and the round before are split in two, largest first, into two full rounds (a part of a
    batch is within its budget). When they hold fewer samples than two rounds need, the ranks
    left over get an empty batch."""
    check_rank(num_replicas, rank)
    if num_replicas == 1:  # every count is whole rounds: nothing to hold
        yield from batches
        return
    held: deque[Batch] = deque()
    for batch in batches:
        held.append(batch)
        if len(held) >= 2 * num_replicas:
            round_ = [held.popleft() for _ in range(num_replicas)]
            yield round_[rank]
    tail = split_to_rounds(list(held), num_replicas)
    yield from tail[rank::num_replicas]


def split_to_rounds(batches: list[Batch], num_replicas: int) -> list[Batch]:
    """`batches` made a whole number of rounds: the largest split in two (its first half, then its
    second, in its place) until the count is a multiple of `num_replicas`, then empty batches
    where no batch has two samples left to split."""
    target = -(-len(batches) // num_replicas) * num_replicas
    batches = list(batches)
    while len(batches) < target:
        largest = max(range(len(batches)), key=lambda i: len(batches[i]), default=None)
        if largest is None or len(batches[largest]) < 2:
            batches += [[] for _ in range(target - len(batches))]
            break
        batch = batches[largest]
        half = len(batch) // 2
        batches[largest : largest + 1] = [batch[:half], batch[half:]]
    return batches


def shuffled_batches(
    indices: np.ndarray,
    tokens: np.ndarray,
    *,
    token_budget: int | None,
    max_batch_size: int | None,
    seed: int,
    epoch: int,
) -> Iterator[Batch]:
    """An epoch after the first, when every sample is known (`indices` and their `tokens`, in
    landing order): the samples drawn as `TokenBudgetSampler` draws them (`shuffled_epoch`), from
    (seed, epoch). Held: the two arrays and the plan's positions, some 50 bytes a sample; each
    batch's samples are made as it is handed on."""
    if token_budget is None:
        order = np.random.default_rng((seed, epoch)).permutation(len(indices))
        for position in order.tolist():
            yield [Landed(index=int(indices[position]), tokens=int(tokens[position]))]
        return
    for positions in shuffled_epoch(
        tokens, token_budget=token_budget, max_batch_size=max_batch_size, seed=seed, epoch=epoch
    ):
        yield [Landed(index=int(i), tokens=int(n)) for i, n in zip(indices[positions], tokens[positions])]
