"""Every model family hsx claims to support stores what transformers itself computes per sample.

For tiny random-initialised configs of each family, a batch of four samples of clearly different
lengths is run through the consumer's own path (`load_model` -> `extract_samples`: right padding,
attention mask, hooks, early stop) in float32, and every selected state is compared with the
reference we did not write: a separately loaded transformers model run on each sample alone
(batch of one, no padding). Layer i (not the last) is `output_hidden_states[i + 1]`; the last
decoder layer is its raw output (a hook of our own on the reference; transformers' last entry has
the final norm applied); `final` is `output_hidden_states[-1]`. The four samples go through in one
batch and again in two other batches (each padded to another length, beside other rows), with one
torch thread and with the default (`torch_threads`); every state is within the float32 bound of
tests/tolerance.py (from the reduction length and the depth), and a neighbouring layer, a token
shift or a bfloat16 round trip is shown to exceed that bound.

The families differ where batching and padding can go wrong: sliding-window masks (Mistral,
Gemma 3), mixture-of-experts routing (Qwen3-MoE, Qwen3-Next), and hybrid stacks whose
linear-attention layers carry a recurrent state and a causal convolution across positions
(Qwen3-Next, Qwen3.5), where a padded token reaching a real one would change every later state.
What fails here is a padded position reaching a real token's state. (Left padding with the mask
would pass too, on CPU with transformers 5.24: rotary attention is relative, and the linear-attention
layers zero masked positions before their convolution and recurrence. Ignoring the mask in the
linear-attention layers under left padding fails both hybrids, by 3e-3 and 6e-3; dropping the mask
altogether under left padding fails every family.)
Each family also proves that the consumer loads only what its forward runs: no layer after the
deepest selected one, no final norm unless `final` is asked for, never the lm_head
(hsx.gpu_consumer.trunk), and that all it holds runs.

Gemma: transformers 5.24 builds and runs gemma, gemma2 and gemma3_text on CPU, and all three
pass. gemma3_text is tested because it is the current text-only Gemma and has what the older ones
have (sqrt(hidden)-scaled embeddings, (1 + w) RMSNorm, norms around both sublayers) plus
interleaved sliding-window/full attention and q/k norms. gemma2 is tested too because it is the
one family here that transformers runs with eager attention (its attention-logit softcapping),
a different batched-attention kernel from every other family's sdpa; gemma (v1) adds nothing
that these two and Llama do not cover.
"""

import json
import time
from dataclasses import dataclass, field

import pytest
import torch
from tolerance import assert_rejects_mistakes, assert_within, depth, error, float32_bound, reduction_length
from transformers import AutoModelForCausalLM

from hsx.commands.embedded import build_tiny_model
from hsx.gpu_consumer.extract import extract_samples
from hsx.gpu_consumer.model import load_model
from hsx.gpu_consumer.trunk import decoder_stack
from hsx.job import FINAL
from hsx.storage import encodings
from hsx.wire.schemas import Sample

VOCAB = 512
NUM_LAYERS = 4
# Clearly different lengths: three of four samples are padded, one by 87 positions. 90 > 64 also
# puts the longest sample (and, padded, every sample) across two chunks of the chunked
# gated-delta-rule path (chunk size 64), while 3, 17 and 40 fit in one chunk when run alone.
LENGTHS = [3, 17, 40, 90]
SELECTED = [0, 2, NUM_LAYERS - 1, FINAL]  # first, a middle one, the last decoder layer, post-norm
STOP_AFTER = 1  # a middle layer: layers 2.. and the norm must not run

DENSE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
SMALL_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
SMALL_LINEAR_ATTENTION = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
# Linear-attention layers first, as in the released hybrids; the selection [0, 2, 3] captures two
# linear-attention layers (0 and 2, the latter after a full-attention layer) and a full one (3).
HYBRID_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


@dataclass(frozen=True)
class Family:
    config: dict
    # Attention kinds that must be among the captured layers (checked against the built config).
    kinds: tuple[str, ...] = field(default=())


FAMILIES = {
    "llama": Family(dict(model_type="llama", **DENSE)),
    # A 16-token sliding window, so the 40- and 90-token samples run through it with padding.
    "mistral": Family(dict(model_type="mistral", **DENSE, sliding_window=16)),
    "qwen2": Family(dict(model_type="qwen2", **DENSE)),
    "qwen3": Family(dict(model_type="qwen3", **DENSE)),
    "qwen3_moe": Family(dict(model_type="qwen3_moe", **DENSE, **SMALL_MOE)),
    "gemma2": Family(
        dict(
            model_type="gemma2",
            **DENSE,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        ),
        kinds=("sliding_attention", "full_attention"),
    ),
    "gemma3_text": Family(
        dict(
            model_type="gemma3_text",
            **DENSE,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        ),
        kinds=("sliding_attention", "full_attention"),
    ),
    "qwen3_next": Family(
        dict(
            model_type="qwen3_next",
            **DENSE,
            **SMALL_MOE,
            **SMALL_LINEAR_ATTENTION,
            shared_expert_intermediate_size=32,
            layer_types=HYBRID_LAYER_TYPES,
        ),
        kinds=("linear_attention", "full_attention"),
    ),
    "qwen3_5_text": Family(
        dict(model_type="qwen3_5_text", **DENSE, **SMALL_LINEAR_ATTENTION, layer_types=HYBRID_LAYER_TYPES),
        kinds=("linear_attention", "full_attention"),
    ),
}


@pytest.fixture(scope="session")
def family_model(tmp_path_factory):
    """Each family's tiny model, built once per session into a local folder."""
    root = tmp_path_factory.mktemp("family-models")
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_tiny_model(root / name, seed=7, **FAMILIES[name].config)
        return built[name]

    return get


# The same four samples in other batches: each padded to another length, beside other rows.
COMPOSITIONS = {"one batch": [[0, 1, 2, 3]], "two batches": [[3, 0], [2, 1]]}


@pytest.fixture(scope="module")
def references():
    """(reference model, {sample index: (hidden_states, last layer's raw output)}) per family:
    transformers run on each sample alone, computed once per module (under the thread count of
    the first test that asks, so the other thread count's tests compare across the two)."""
    cache = {}

    def get(name: str, path, samples: list[Sample]):
        if name not in cache:
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[name] = reference, {s.index: _alone(reference, s.input_ids) for s in samples}
        return cache[name]

    return get


def _samples(seed: int) -> list[Sample]:
    generator = torch.Generator().manual_seed(seed)
    return [
        Sample(index=i, source_id=f"s{i}", input_ids=torch.randint(0, VOCAB, (n,), generator=generator).tolist())
        for i, n in enumerate(LENGTHS)
    ]


def _alone(reference, input_ids: list[int]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """transformers' hidden_states for one sample run alone, and the last layer's raw output."""
    raw = {}
    last = decoder_stack(reference).layers[-1]
    handle = last.register_forward_hook(
        lambda _m, _a, out: raw.__setitem__("last", (out[0] if isinstance(out, tuple) else out).detach().clone())
    )
    try:
        with torch.inference_mode():
            out = reference(torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        handle.remove()
    return tuple(h[0] for h in out.hidden_states), raw["last"][0]


def _counting(modules: dict[str, torch.nn.Module], calls: dict[str, int]) -> list:
    """Pre-hooks fire when a module starts, before any forward hook of the tap can stop the run."""

    def counter(name):
        def count(_module, _args):
            calls[name] = calls.get(name, 0) + 1

        return count

    return [module.register_forward_pre_hook(counter(name)) for name, module in modules.items()]


def _watched(model) -> dict[str, torch.nn.Module]:
    """The decoder layers, the final norm and the lm_head, those of them that the model holds."""
    stack = decoder_stack(model)
    modules = {f"layer{i}": layer for i, layer in enumerate(stack.layers)}
    if not isinstance(stack.norm, torch.nn.Identity):
        modules["norm"] = stack.norm
    if model.get_output_embeddings() is not None:
        modules["lm_head"] = model.get_output_embeddings()
    return modules


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers_per_sample_and_stops_early(name, family_model, references, torch_threads):
    started = time.perf_counter()
    family = FAMILIES[name]
    path = family_model(name)
    samples = _samples(seed=len(name))
    reference, alone = references(name, path, samples)
    config = reference.config.get_text_config()
    assert config.model_type == family.config["model_type"]
    assert config.num_hidden_layers == NUM_LAYERS
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * NUM_LAYERS
    captured_kinds = {layer_types[layer] for layer in SELECTED if layer != FINAL}
    assert set(family.kinds) <= captured_kinds, f"{name}: captured layers are {captured_kinds}, need {family.kinds}"
    n = reduction_length(config, max(LENGTHS))

    # 1. Every selected state of a padded batch equals the sample run alone, whichever batch the
    # sample is in (COMPOSITIONS) and whatever the thread count (torch_threads).
    loaded = load_model(str(path), layers=SELECTED, encoding=encodings.of_spec("float32"), device="cpu")
    assert loaded.attention == ("eager" if name == "gemma2" else "sdpa")
    worst, used, mistakes = 0.0, 0.0, float("inf")
    for composition, groups in COMPOSITIONS.items():
        calls: dict[str, int] = {}
        handles = _counting(_watched(loaded.model), calls)
        stored = {}
        try:
            for group in groups:
                batch = [samples[i] for i in group]
                stored.update({s.index: states for s, states in zip(batch, extract_samples(loaded, batch))})
        finally:
            for handle in handles:
                handle.remove()
        # `final` needs the whole stack and the norm, once per batch; the lm_head is not loaded.
        assert loaded.model.get_output_embeddings() is None
        assert calls == {**{f"layer{i}": len(groups) for i in range(NUM_LAYERS)}, "norm": len(groups)}, calls

        for sample in samples:
            states, T = stored[sample.index], len(sample.input_ids)
            assert states.shape == (T, len(SELECTED), 64) and states.dtype == torch.float32
            expected, raw_last = alone[sample.index]
            assert len(expected) == NUM_LAYERS + 1
            # The last layer's raw output and the post-norm state are different things, so a mix-up shows.
            assert error(raw_last, expected[-1]) > float32_bound(n, depth(FINAL, NUM_LAYERS))
            wanted = {0: expected[1], 2: expected[3], NUM_LAYERS - 1: raw_last, FINAL: expected[-1]}
            neighbours = {2: expected[2], NUM_LAYERS - 1: expected[NUM_LAYERS - 1], FINAL: raw_last}
            for j, layer in enumerate(SELECTED):
                got, ref = states[:, j], wanted[layer]
                bound = float32_bound(n, depth(layer, NUM_LAYERS))
                what = f"{name} sample of {T} tokens in {composition}, {torch_threads} thread(s), layer {layer}"
                measured = assert_within(got, ref, bound, what)
                worst, used = max(worst, measured), max(used, measured / bound)
                wrong = assert_rejects_mistakes(got, ref, bound, what, neighbour=neighbours.get(layer))
                mistakes = min(mistakes, *(m / bound for m in wrong.values()))

    # 2. Stopping after a middle layer: the model holds layers 0..STOP_AFTER alone, no final norm
    # and no lm_head, and every module it holds runs.
    loaded.tap.remove()
    early = load_model(str(path), layers=[STOP_AFTER], encoding=encodings.of_spec("float32"), device="cpu")
    assert list(_watched(early.model)) == [f"layer{i}" for i in range(STOP_AFTER + 1)]
    assert early.load_report.layers_loaded == STOP_AFTER + 1 and early.load_report.layers_total == NUM_LAYERS
    calls.clear()
    handles = _counting(_watched(early.model), calls)
    try:
        out = extract_samples(early, samples)
    finally:
        for handle in handles:
            handle.remove()
    assert [o.shape for o in out] == [(n, 1, 64) for n in LENGTHS]
    assert calls == {f"layer{i}": 1 for i in range(STOP_AFTER + 1)}, calls
    for sample, states in zip(samples, out):
        bound = float32_bound(n, depth(STOP_AFTER, NUM_LAYERS))
        assert_within(states[:, 0], alone[sample.index][0][STOP_AFTER + 1], bound, f"{name} stopped early")

    print(
        json.dumps(
            {
                "family": name,
                "threads": torch_threads,
                "max_error": f"{worst:.3g}",
                "of_bound": round(used, 3),
                "least_mistake_over_bound": round(mistakes, 1),
                "seconds": round(time.perf_counter() - started, 2),
            }
        )
    )
