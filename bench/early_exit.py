"""CPU benchmark: what the consumer's early exit (gpu_consumer.model.LayerTap) saves against the
whole model with output_hidden_states=True, the baseline one-off extraction scripts use.

A Qwen3-shaped model (hidden 256, 16 layers, vocab 32000; random float32 weights built from its
config, nothing downloaded) runs the same padded batches (hsx.packing.plan_batches +
gpu_consumer.extract.pad_batch) three ways, under torch.inference_mode:
- full: `model(..., output_hidden_states=True, use_cache=False)`, all 16 layers, the final norm
  and the lm_head over every position (picking the selected entries out of it costs nothing);
- tap_half: LayerTap with layers 1, 4, 7 (the deepest at L/2 - 1): half the layers, no lm_head;
- tap_all: LayerTap with layers 1, 7, 15 (the deepest at L - 1): every layer, no final norm and
  no lm_head, so the lm_head saving alone shows.
Prints one JSON object with the ratios tap time / full time (medians of --repeats passes, the
three interleaved), beside the ratios the matmul FLOPs predict for the same padded batches.

Run: python bench/early_exit.py [--samples 32] [--repeats 3] [--threads N]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu import forward_flops  # noqa: E402
from hsx.commands.embedded import synthetic_lengths  # noqa: E402
from hsx.gpu_consumer.extract import pad_batch  # noqa: E402
from hsx.gpu_consumer.model import LayerTap  # noqa: E402
from hsx.packing import plan_batches  # noqa: E402
from hsx.wire.schemas import Sample  # noqa: E402

SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=32000,
    tie_word_embeddings=False,
)
LAYERS_TO_HALF = [1, 4, 7]
LAYERS_TO_LAST = [1, 7, 15]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--median-len", type=int, default=200)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **SHAPE), dtype=torch.float32)
    model.eval().requires_grad_(False)

    lengths = synthetic_lengths(args.samples, median=args.median_len, max_len=args.max_len, seed=0).tolist()
    rng = np.random.default_rng(0)
    samples = [
        Sample(index=i, source_id=str(i), input_ids=rng.integers(0, SHAPE["vocab_size"], size=n).tolist())
        for i, n in enumerate(lengths)
    ]
    plan = plan_batches(lengths, token_budget=args.token_budget)
    # Padded once, outside the timings: both sides compute on exactly the same tensors.
    batches = [pad_batch([samples[i] for i in b.sample_indices], 0) for b in plan]

    def full_model(padded: list) -> None:
        for ids, mask in padded:
            model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)

    def layer_tap(layers: list[int]):
        def run(padded: list) -> None:
            # A tap's hooks stop every forward at its deepest layer, the full model's too, so each
            # tap lives only for its own pass.
            tap = LayerTap(model, layers)
            try:
                for ids, mask in padded:
                    tap.forward(ids, mask)
            finally:
                tap.remove()

        return run

    passes = {"full": full_model, "tap_half": layer_tap(LAYERS_TO_HALF), "tap_all": layer_tap(LAYERS_TO_LAST)}
    seconds: dict[str, list[float]] = {name: [] for name in passes}
    with torch.inference_mode():
        for run in passes.values():  # warm-up
            run(batches[:1])
        for _ in range(args.repeats):
            for name, run in passes.items():
                start = time.perf_counter()
                run(batches)
                seconds[name].append(time.perf_counter() - start)
    median = {name: statistics.median(times) for name, times in seconds.items()}

    # Matmul FLOPs of the padded batches: what the ratios would be if time followed compute.
    padded_lengths = [b.padded_len for b in plan for _ in b.sample_indices]
    padded_tokens = sum(padded_lengths)
    layer_flops = {n: forward_flops(padded_lengths, SHAPE, n) for n in (8, 16)}
    full_flops = layer_flops[16] + padded_tokens * 2 * SHAPE["hidden_size"] * SHAPE["vocab_size"]  # + lm_head

    out = {
        "model": "qwen3-shaped (16 layers, hidden 256, vocab 32000), random float32, cpu",
        "attention": model.config._attn_implementation,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "samples": len(samples),
        "batches": len(plan),
        "real_tokens": sum(lengths),
        "padded_tokens": padded_tokens,
        "full_tokens_per_s": round(sum(lengths) / median["full"]),
        "tap_half_layers": LAYERS_TO_HALF,
        "tap_half_vs_full": round(median["tap_half"] / median["full"], 3),
        "tap_half_vs_full_flops": round(layer_flops[8] / full_flops, 3),
        "tap_all_layers": LAYERS_TO_LAST,
        "tap_all_vs_full": round(median["tap_all"] / median["full"], 3),
        "tap_all_vs_full_flops": round(layer_flops[16] / full_flops, 3),
        "repeats": args.repeats,
        "raw_seconds": {name: [round(t, 3) for t in times] for name, times in seconds.items()},
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
