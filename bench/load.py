"""Loading the model: the consumer's load (`load_model`: only the trunk the layers run, straight to
the device, hsx.gpu_consumer.trunk) against transformers' whole model, as hsx loaded it before
(`AutoModelForCausalLM.from_pretrained`, then `.to(device)`).

The model: a Llama-shaped checkpoint of 32 layers (hidden 2048, MLP 5632, vocab 32000, untied
lm_head; 1.57B parameters, 3.1 GB of bfloat16 safetensors in 1 GB shards), random weights built
from its config (nothing downloaded), once, into --cache. The consumer's load takes layers 1, 8
and 15: the deepest at half depth (16 of 32 layers, no final norm, no lm_head).

Each load runs in a fresh interpreter that imports torch and transformers (and the model's
modeling module, whose first import would otherwise be most of the seconds), notes its resident
set (`base_rss`), loads, and reports the load's seconds, the process's peak resident set (VmHWM:
what the machine must hold for it, imports included) and the bytes of weights it holds. On the
CPU, transformers leaves weights of the checkpoint's dtype mapped from the files and reads them
only when they are used, so each load then reads every weight it holds once (`read_seconds`, as
a copy to a GPU does) before its peak is taken; `ready_seconds` is the two together. The two
loads alternate, after one untimed load of each (the page cache then holds the files for both);
the figures are medians over --repeats. Checks, printed with the figures (exit 1 if one fails):
the consumer's peak RSS is at most 0.6x the whole load's, and at most its weights plus 1 GiB.
Linux only (/proc/self/status).

    .venv/bin/python bench/load.py [--repeats 3] [--device cpu|cuda:0] [--cache DIR]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hsx.storage import encodings

SHAPE = dict(
    model_type="llama",
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=32000,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
LAYERS = [1, 8, 15]  # the deepest at L/2 - 1
GIB = 1 << 30
RATIO_BOUND = 0.6
OVER_WEIGHTS_BOUND = GIB


def build_model(cache: Path) -> Path:
    """The checkpoint, built once (written to a temporary folder, then renamed into place)."""
    folder = cache / "llama-32x2048-bf16"
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(SHAPE)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial, max_shard_size="1GB")
    os.replace(partial, folder)
    return folder


def _status() -> dict[str, int]:
    """This process's memory figures from /proc/self/status, in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def child(kind: str, model: str, device: str) -> None:
    """One load in this fresh process; prints its figures as one JSON line."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401  (imported, not timed)

    from hsx.gpu_consumer.model import load_model

    base = _status()
    started = time.monotonic()
    if kind == "full":
        loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, local_files_only=True)
        loaded.to(torch.device(device)).eval()
    else:
        loaded = load_model(model, layers=LAYERS, encoding=encodings.of_spec("bfloat16"), device=device).model
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.monotonic() - started
    loaded_status = _status()
    tensors = {id(t): t for t in [*loaded.parameters(), *loaded.buffers()]}
    # Mapped from the files on the CPU, read only when used: once here, so that the resident set
    # shows what the load holds, not what it has touched so far (module docstring).
    read_started = time.monotonic()
    with torch.inference_mode():
        for tensor in tensors.values():
            if tensor.device.type == "cpu":
                tensor.sum()
    read_seconds = time.monotonic() - read_started
    after = _status()
    print(
        json.dumps(
            {
                "kind": kind,
                "seconds": round(seconds, 3),
                "read_seconds": round(read_seconds, 3),
                "ready_seconds": round(seconds + read_seconds, 3),
                "base_rss": base["VmRSS"],
                "peak_rss": after["VmHWM"],
                "peak_rss_before_read": loaded_status["VmHWM"],
                "rss_file": after.get("RssFile", 0),
                "rss_anon": after.get("RssAnon", 0),
                "weight_bytes": sum(p.numel() * p.element_size() for p in loaded.parameters()),
                "decoder_layers": len(loaded.model.layers),
                "lm_head": loaded.get_output_embeddings() is not None,
                "devices": sorted({str(t.device) for t in tensors.values()}),
            }
        )
    )


def run_child(kind: str, model: Path, device: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSX_")}
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, "--model", str(model), "--device", device],
        check=True,
        capture_output=True,
        text=True,
        env={**env, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "hsx-bench-load")
    parser.add_argument("--child", choices=["full", "trunk"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model, args.device)
        return 0

    args.cache.mkdir(parents=True, exist_ok=True)
    model = build_model(args.cache)
    disk_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    runs: dict[str, list[dict]] = {"full": [], "trunk": []}
    for kind in runs:  # untimed: fills the page cache, so that neither pays for the disk
        run_child(kind, model, args.device)
    for repeat in range(args.repeats):
        order = ["full", "trunk"] if repeat % 2 == 0 else ["trunk", "full"]
        for kind in order:
            runs[kind].append(run_child(kind, model, args.device))

    def median(kind: str, field: str) -> float:
        return statistics.median(run[field] for run in runs[kind])

    full_peak, trunk_peak = median("full", "peak_rss"), median("trunk", "peak_rss")
    trunk_weights = median("trunk", "weight_bytes")
    result = {
        "device": args.device,
        "model": str(model),
        "disk_bytes": disk_bytes,
        "layers": LAYERS,
        "repeats": args.repeats,
        "medians": {
            kind: {
                field: median(kind, field)
                for field in ("seconds", "read_seconds", "ready_seconds", "base_rss", "peak_rss", "weight_bytes")
            }
            for kind in runs
        },
        "peak_rss_ratio": round(trunk_peak / full_peak, 3),
        "seconds_ratio": round(median("trunk", "seconds") / median("full", "seconds"), 3),
        "ready_seconds_ratio": round(median("trunk", "ready_seconds") / median("full", "ready_seconds"), 3),
        "trunk_peak_over_weights_gib": round((trunk_peak - trunk_weights) / GIB, 3),
        "checks": {
            f"peak_rss_ratio <= {RATIO_BOUND}": trunk_peak <= RATIO_BOUND * full_peak,
            "trunk peak_rss <= weights + 1 GiB": trunk_peak <= trunk_weights + OVER_WEIGHTS_BOUND,
        },
        "runs": runs,
    }
    print(json.dumps(result, indent=1))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
