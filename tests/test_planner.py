"""hsx.packing.plan_batches: token-budgeted packing.

Checked on several length distributions: every batch fits the budget (`len * padded_len <=
budget`), its padded length is its longest member, every sample lands in exactly one batch, the
plan is deterministic, `max_batch_size` is respected, and a sample longer than the budget is
refused. Packing efficiency on a realistic lognormal distribution is measured, not assumed.
"""

import math
from collections import Counter

import numpy as np
import pytest

from hsx.packing import plan_batches


def _lognormal(count: int, *, median: int, max_len: int, seed: int, sigma: float = 0.8) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=math.log(median), sigma=sigma, size=count)
    return np.clip(lengths.astype(np.int64), 1, max_len).tolist()


def _uniform(count: int, *, low: int, high: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(low, high + 1, size=count).tolist()


# name -> (lengths, token_budget)
CASES = {
    "lognormal-small": (_lognormal(3000, median=120, max_len=2048, seed=0), 4096),
    "lognormal-long-tail": (_lognormal(5000, median=500, max_len=4096, seed=1, sigma=1.2), 16384),
    "uniform": (_uniform(2000, low=1, high=1000, seed=2), 3000),
    "all-equal": ([77] * 1000, 1000),
    "all-equal-divides-budget": ([256] * 513, 4096),
    "single-sample": ([5], 16),
    "single-sample-at-budget": ([16], 16),
    "all-at-budget": ([64] * 9, 64),
    "mixed-with-budget-length": (_uniform(500, low=1, high=512, seed=3) + [512, 512, 512], 512),
    "length-one": ([1] * 100, 7),
    "bimodal": (_uniform(800, low=1, high=8, seed=4) + _uniform(200, low=900, high=1024, seed=5), 2048),
}


def _check_plan(lengths: list[int], budget: int, batches, max_batch_size: int | None = None) -> None:
    seen = Counter()
    for batch in batches:
        members = list(batch.sample_indices)
        assert members, "a batch is empty"
        assert len(members) * batch.padded_len <= budget, (len(members), batch.padded_len, budget)
        assert batch.padded_len == max(lengths[i] for i in members)
        assert batch.padded_tokens == len(members) * batch.padded_len
        if max_batch_size is not None:
            assert len(members) <= max_batch_size
        seen.update(members)
    assert set(seen) == set(range(len(lengths))), "some sample is in no batch"
    assert all(count == 1 for count in seen.values()), [i for i, c in seen.items() if c > 1][:10]
    assert sum(len(b.sample_indices) for b in batches) == len(lengths)


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_invariants(name):
    lengths, budget = CASES[name]
    batches = plan_batches(lengths, token_budget=budget)
    _check_plan(lengths, budget, batches)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("max_batch_size", [1, 3, 64])
def test_max_batch_size_respected(name, max_batch_size):
    lengths, budget = CASES[name]
    batches = plan_batches(lengths, token_budget=budget, max_batch_size=max_batch_size)
    _check_plan(lengths, budget, batches, max_batch_size=max_batch_size)
    # The cap actually binds where the budget alone would allow bigger batches.
    unlimited = plan_batches(lengths, token_budget=budget)
    if max(len(b.sample_indices) for b in unlimited) > max_batch_size:
        assert max(len(b.sample_indices) for b in batches) == max_batch_size


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_is_deterministic(name):
    lengths, budget = CASES[name]
    first = plan_batches(list(lengths), token_budget=budget)
    second = plan_batches(list(lengths), token_budget=budget)
    assert first == second
    assert [b.sample_indices for b in first] == [b.sample_indices for b in second]


def test_equal_lengths_fill_batches():
    # 1000 samples of 77 tokens, budget 1000: 12 per batch (12 * 77 = 924; 13 * 77 = 1001 > 1000).
    batches = plan_batches([77] * 1000, token_budget=1000)
    sizes = [len(b.sample_indices) for b in batches]
    assert sizes == [12] * 83 + [4]


def test_single_sample():
    batches = plan_batches([5], token_budget=16)
    assert [(b.sample_indices, b.padded_len) for b in batches] == [((0,), 5)]


def test_length_equal_to_budget_is_accepted_alone():
    batches = plan_batches([10, 64, 3, 64], token_budget=64)
    _check_plan([10, 64, 3, 64], 64, batches)
    full = [b for b in batches if b.padded_len == 64]
    assert sorted(b.sample_indices for b in full) == [(1,), (3,)]


@pytest.mark.parametrize("lengths", [[65], [1, 2, 65, 3], [10] * 5 + [10_000]])
def test_sample_longer_than_budget_raises(lengths):
    with pytest.raises(ValueError, match="budget"):
        plan_batches(lengths, token_budget=64)


def test_empty_input_gives_no_batches():
    assert plan_batches([], token_budget=64) == []


@pytest.mark.parametrize("budget", [0, -1])
def test_nonpositive_budget_raises(budget):
    with pytest.raises(ValueError):
        plan_batches([1, 2, 3], token_budget=budget)


def test_packing_efficiency_lognormal():
    """20k lognormal lengths (median 500, max 4096), budget 16384: real tokens / padded tokens."""
    lengths = _lognormal(20_000, median=500, max_len=4096, seed=1234)
    budget = 16384
    batches = plan_batches(lengths, token_budget=budget)
    _check_plan(lengths, budget, batches)
    efficiency = sum(lengths) / sum(b.padded_tokens for b in batches)
    print(f"packing efficiency {efficiency:.4f} over {len(batches)} batches")
    assert efficiency >= 0.9, efficiency
