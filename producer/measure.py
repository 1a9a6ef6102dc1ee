"""How a compressed job's states compress, measured on a sample of its own data, for
`hsx produce --dry-run` (producer/estimate.py sizes every file exactly but for its compressed
states, which only the states themselves can size): what is measured and what a measurement says.

`pick_samples` draws up to SAMPLE_TOKENS tokens of the job's planned samples, spread over their
lengths and seeded: the same job measures the same samples every time. The measurement itself
(`Measure`: the trunk loaded, the samples run through it with the consumer's own code, their
states encoded with the job's encoding) is hsx/commands/measure.py's, handed to the producer by
the command (a service never imports another): it returns a `Measured`, or raises `NotMeasured`
with one line saying why not, and the dry run keeps the bound.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hsx.storage.layout import SampleFiles
from hsx.storage.tokens import SampleTable

NO_MEASURE = "none"  # --estimate-device none: the bound alone
SAMPLE_TOKENS = 2048  # the most tokens measured: seconds of a forward on a CPU for a small model
SEED = 0


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What an estimate was measured on: `samples` of the job's samples, `tokens` in all, run on
    `device`; `ratio` is their states' compressed bytes over their uncompressed bytes."""

    samples: int
    tokens: int
    ratio: float
    device: str


class NotMeasured(Exception):
    """Why the states were not measured, in one line."""


# (the job's files, its samples, the device) -> Measured, or NotMeasured.
Measure = Callable[[SampleFiles, SampleTable, str], Measured]


def pick_samples(lengths: np.ndarray, *, tokens: int = SAMPLE_TOKENS, seed: int = SEED) -> np.ndarray:
    """Indices of samples to measure, ascending: the samples in order of length cut into as many
    strata of equal count as samples of their mean length fit in `tokens`, one drawn from each
    (seeded); while those are more than `tokens`, one of them, at random, is left out. At least
    one, even longer than `tokens` (`measure_states` then runs its first `tokens` tokens)."""
    count = len(lengths)
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng(seed)
    order = np.argsort(lengths, kind="stable")
    strata = min(count, max(1, tokens // max(1, round(float(np.mean(lengths))))))
    bounds = np.linspace(0, count, strata + 1).astype(np.int64)
    picks = order[rng.integers(bounds[:-1], bounds[1:])]
    keep = np.ones(len(picks), dtype=bool)
    total = int(lengths[picks].sum())
    for i in rng.permutation(len(picks)).tolist():
        if total <= tokens or keep.sum() == 1:
            break
        keep[i] = False
        total -= int(lengths[picks[i]])
    return np.sort(picks[keep])
