"""How far a stored hidden state may be from its reference, derived from the arithmetic.

What this knows: the unit roundoff of each dtype, the longest reduction in a decoder layer (from
the model's config and the sequence length), how many layers a state has passed through, and
one measure of the difference. What it does not know: any machine's kernels or thread count;
the bounds hold for any order of summation, which is what changes between machines, thread
counts and batch compositions. docs/fidelity.md quotes the measured errors against these bounds.

The measure: the largest |got - ref| over the state's elements, in units of (s + |ref|), where
s = median |ref| over the state (the typical magnitude the next reductions sum) and |ref| is
the element's own (an element far above the typical, like the few ~1e4 channels of a trained
model's deep layers, carries an error relative to itself). It is torch.testing's allclose with
atol = bound * s and rtol = bound.

Float32 against float32 (a padded batch against the sample alone, one thread against several):
both sides compute the same function, and only the order of some sums differs (a matrix product
blocked for another number of rows, attention over another padded length, a sum split among
threads). A float32 sum of n terms taken in another order differs by about sqrt(n) * u of the
sum of the terms' magnitudes (u = 2^-24; Higham and Mary's probabilistic bound; n * u is the
worst case, for adversarial signs only). Each decoder layer adds its own such error to the
residual stream, so after layer i (depth i + 1; the post-norm `final` is one reduction more)

    bound = C_FLOAT32 * sqrt(n) * u * depth,   n = max(hidden, intermediate sizes, tokens).

C_FLOAT32 = 8: sqrt(2) because both sides round, times ~5 standard deviations, as the largest of
the ~1e6 elements a test compares is that far out. Measured (docs/fidelity.md), the worst case
uses at most 0.28 of the bound, and the mistakes the bound exists to catch exceed it: a bfloat16
round trip (relative rounding up to 2^-8) by 5.9x or more, a neighbouring layer or a token
shifted by one position by over 1000x.

A bfloat16 forward against the float32 reference: here every weight and every intermediate
result is rounded to 8 significant bits (u = 2^-8), a perturbation of the function itself, not
only of the order of sums. A layer rounds each state along its path some 8 times (its weights,
the norm, each projection, the attention, the residual sum); these errors are independent
across layers and add up like a random walk:

    bound = C_BFLOAT16 * u * sqrt(depth),   C_BFLOAT16 = 16 (8 roundings, x2 for the largest element).

Measured, the worst case uses 0.31 of it, and a neighbouring layer or a token shift exceeds it 7x.

Float8 (e4m3, a float32 scale per token and layer) stores the bfloat16 states with 4 significant
bits: a further 2^-4 of each element's magnitude on top of the bfloat16 bound.
"""

import math

import torch

from hsx.job import FINAL

U_FLOAT32 = 2.0**-24
U_BFLOAT16 = 2.0**-8
U_FLOAT8_E4M3 = 2.0**-4
C_FLOAT32 = 8.0
C_BFLOAT16 = 16.0


def reduction_length(config, tokens: int) -> int:
    """The longest sum a decoder layer of this model takes: over the hidden size (projections,
    the norm), an intermediate size (the MLP's down projection, the experts'), or the tokens
    (attention over keys, a linear-attention recurrence)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    sizes = [text.hidden_size, tokens]
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        size = getattr(text, name, None)
        if isinstance(size, int):
            sizes.append(size)
    return max(sizes)


def depth(layer: int | str, num_layers: int) -> int:
    """How many layers' errors a state carries: decoder layer i has run i + 1 layers; `final`
    all of them and the norm."""
    return num_layers + 1 if layer == FINAL else int(layer) + 1


def float32_bound(n: int, depth: int) -> float:
    return C_FLOAT32 * math.sqrt(n) * U_FLOAT32 * depth


def float32_states_bound(config, layers: list[int | str], tokens: int) -> float:
    """The float32 bound for states of several layers compared at once ([T, k, H]): that of the
    deepest, the loosest of them."""
    num_layers = (config.get_text_config() if hasattr(config, "get_text_config") else config).num_hidden_layers
    n = reduction_length(config, tokens)
    return max(float32_bound(n, depth(layer, num_layers)) for layer in layers)


def bfloat16_bound(depth: int) -> float:
    return C_BFLOAT16 * U_BFLOAT16 * math.sqrt(depth)


def float8_bound(depth: int) -> float:
    return bfloat16_bound(depth) + U_FLOAT8_E4M3


def error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / (median |ref| + |ref|): the measure every bound here is stated in."""
    got, ref = got.float(), ref.float()
    assert got.shape == ref.shape, (tuple(got.shape), tuple(ref.shape))
    magnitude = ref.abs()
    return ((got - ref).abs() / (magnitude.median() + magnitude)).max().item()


def assert_within(got: torch.Tensor, ref: torch.Tensor, bound: float, what: str) -> float:
    """Fail, naming `what`, unless error(got, ref) <= bound; return the error."""
    measured = error(got, ref)
    assert measured <= bound, f"{what}: error {measured:.3g} > bound {bound:.3g} (units of median |ref| + |ref|)"
    return measured


def assert_rejects_mistakes(
    got: torch.Tensor,
    ref: torch.Tensor,
    bound: float,
    what: str,
    *,
    neighbour: torch.Tensor | None = None,
    float32_asked: bool = True,
) -> dict[str, float]:
    """The bound is far below what a real mistake gives: the state of a neighbouring layer
    (`neighbour`, when given), the rows shifted by one token, and (where float32 was asked and
    `got` is float32) a bfloat16 round trip each exceed it. Returns each mistake's error."""
    mistakes = {}
    if neighbour is not None:
        mistakes["neighbouring layer"] = error(neighbour, ref)
    if len(ref) > 1:
        mistakes["shifted token"] = error(got[1:], ref[:-1])
    if float32_asked and got.dtype == torch.float32:
        mistakes["bfloat16 round trip"] = error(got.to(torch.bfloat16), ref)
    for name, measured in mistakes.items():
        assert measured > bound, f"{what}: {name} gives error {measured:.3g}, within the bound {bound:.3g}"
    return mistakes
