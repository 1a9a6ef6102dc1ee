"""GPU benchmark: the consumer's extraction path on a model of a real shape (random weights,
built from its config, nothing downloaded), bf16.

Shapes (`--model`):
- `qwen3_8b` (default): Qwen3-8B, 36 layers, 5 captured layers (1,9,17,25,33);
- `qwen3_5`: Qwen3.5-27B's own text dimensions and layer pattern (hidden 5120, MLP 17408, Gated
  DeltaNet linear attention with 16 key / 48 value heads of 128, full attention (24 query / 4 kv
  heads of 256, output gate) every 4th layer; vocabulary 248,320), cut to `--depth` layers
  (default 16, the real model has 64) and captured at the seeds' layers scaled to that depth:
  the seeds' job is `dflash:5` on 64 layers = 1,16,31,46,61, so `dflash:5` on 16 = 1,4,7,10,13.
  `--kernels fallback` hides fla and causal-conv1d, so transformers runs its pure-torch delta
  rule and convolution (what a node without them runs); `auto` uses them when they import.

Prints one JSON object with, for the same packed batches:
- full_model_output_hidden_states_tokens_per_s: the baseline the one-off scripts use (whole
  model, output_hidden_states=True, then pick the layers and copy them to the host);
- forward_tokens_per_s: the layer tap alone (forward up to the deepest layer);
- extract_tokens_per_s: forward + stacking (+ float8 quantization with `--dtype float8`) +
  device-to-host copy (what the consumer computes);
- pipeline_tokens_per_s: the real consumer loop (gpu_consumer.scheduler) against a real
  nats-server: forward, files written on the writer pool while the next batch computes,
  file-ready and progress events, acks (no uploader);
- mfu: model FLOP utilisation of the forward (against 989 TFLOP/s dense bf16), FLOPs counted by
  `forward_flops` (its docstring has the formula, Gated DeltaNet layers included);
- gpu_busy: bare forward time of the same batches / the consumer loop's wall time;
- write_gb_per_s: bytes written per second in the pipeline loop;
- projection (`qwen3_5`): the seeds' job (914,000 samples, 624.4M tokens, 4 GPUs) at the
  measured rates, scaled from the measured depth to the real one by the FLOPs of the forward.

Experiments instead of the run above: `--compile-layers` (eager vs each decoder layer
torch.compile'd) and `--attn-compare` (the forward with sdpa vs flash_attention_2, when
flash-attn imports; the consumer picks flash-attention whenever it is installed, which this
measures rather than assumes).

Run: python bench/gpu.py [--model qwen3_5 --depth 16] [--plan-samples 100000 --batches 8]
     [--token-budget 32768] [--spool /tmp/hsx-bench-spool --spool /dev/shm/hsx-bench-spool]
     [--dtype float8] [--kernels fallback] [--compile]
     python bench/gpu.py --smoke [--model qwen3_5]   # tiny shapes on the CPU: checks the script
Medians over --repeats passes over the same batches.
"""

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hsx.commands.embedded import synthetic_lengths  # noqa: E402
from hsx.gpu_consumer.extract import extract_samples, pad_batch  # noqa: E402
from hsx.gpu_consumer.model import LayerTap, LoadedModel, choose_attention, decoder_layers  # noqa: E402
from hsx.gpu_consumer.staging import HostStaging  # noqa: E402
from hsx.packing import plan_batches  # noqa: E402
from hsx.storage.layout import FLOAT8  # noqa: E402
from hsx.wire.schemas import JobSpec, Sample  # noqa: E402

QWEN3_8B = dict(
    model_type="qwen3",
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)
# Qwen/Qwen3.5-27B's text_config (config.json); num_hidden_layers is set by --depth.
QWEN3_5_27B = dict(
    model_type="qwen3_5_text",
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    attn_output_gate=True,
    full_attention_interval=4,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    vocab_size=248320,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
)
SHAPES = {"qwen3_8b": QWEN3_8B, "qwen3_5": QWEN3_5_27B}
SMOKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
PEAK_BF16_FLOPS = 989e12
SEEDS_JOB = {"samples": 914_000, "tokens": 624_400_000, "gpus": 4, "layers": [1, 16, 31, 46, 61], "depth": 64}
GDN_CHUNK = 64  # the chunk length of the chunked delta rule (fla's and transformers' fallback)


def layer_types(cfg: dict) -> list[str]:
    """Each layer's kind, as transformers derives it: full attention every `full_attention_interval`th
    layer of a hybrid model, linear attention (Gated DeltaNet) otherwise; all full for a dense one."""
    interval = cfg.get("full_attention_interval")
    if interval is None:
        return ["full_attention"] * cfg["num_hidden_layers"]
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(cfg["num_hidden_layers"])
    ]


def forward_flops(lengths: list[int], cfg: dict, layers_run: int) -> float:
    """Matmul FLOPs (2 per multiply-add) of the forward through the first `layers_run` layers, per
    sample (no padding counted), norms, rotary, activations and the embedding lookup left out:

    - every layer: its MLP, 2 * 3 * h * i per token;
    - full attention: q (x2 with the output gate), k, v and o projections, 2 * h * (nh * hd * g +
      2 * nkv * hd) + 2 * nh * hd * h per token, and QK^T and AV over the causal half,
      2 * 2 * nh * hd * t^2 / 2 per sample of t tokens;
    - Gated DeltaNet (linear attention; dk, dv head dims, nk key / nv value heads, C = 64):
      projections in_proj_qkv (2 * nk * dk + nv * dv outputs), in_proj_z (nv * dv), in_proj_a and
      in_proj_b (nv each) and out_proj (nv * dv -> h): 2 * h * (2 * nk * dk + 2 * nv * dv + 2 * nv)
      + 2 * nv * dv * h per token; the depthwise causal conv, 2 * k * (2 * nk * dk + nv * dv) per
      token; and the chunked delta rule per token and value head (q and k shared across the
      nv / nk heads of a group): three products with the dk x dv state (the read-out q S, the
      correction k S, the update k^T u), 3 * 2 * dk * dv, and the chunk's own products (Q K^T and
      K K^T over the chunk, then the chunk's attention times V), 2 * C * (2 * dk + dv). Linear in
      t: no t^2 term.
    """
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    gate = 2 if cfg.get("attn_output_gate") else 1
    mlp = 2 * 3 * h * i
    full = 2 * h * (nh * hd * gate + 2 * nkv * hd) + 2 * nh * hd * h
    linear = 0.0
    if cfg.get("full_attention_interval") is not None:
        nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv, k = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
        conv_dim = 2 * nk * dk + nv * dv
        linear = 2 * h * (conv_dim + nv * dv + 2 * nv) + 2 * nv * dv * h
        linear += 2 * k * conv_dim + nv * (3 * 2 * dk * dv + 2 * GDN_CHUNK * (2 * dk + dv))
    kinds = layer_types(cfg)[:layers_run]
    per_token = sum(mlp + (full if kind == "full_attention" else linear) for kind in kinds)
    full_layers = sum(kind == "full_attention" for kind in kinds)
    total = 0.0
    for t in lengths:
        total += t * per_token
        total += full_layers * 2 * 2 * nh * hd * t * t / 2  # QK^T and AV, causal half
    return total


def hide_fast_kernels() -> None:
    """Make fla and causal-conv1d unimportable before transformers' modeling module binds its
    kernels (it does so when imported): the pure-torch fallback a node without them runs."""
    for name in ("fla", "causal_conv1d"):
        sys.modules[name] = None  # an import of it now raises ImportError


def kernels_in_use(model) -> dict:
    """What the built model's forward runs (gpu_consumer/kernels.py when present)."""
    try:
        from hsx.gpu_consumer.kernels import kernel_report, report_fields

        return report_fields(kernel_report(model, compiled=False))
    except Exception as exc:  # an older tree without the report: say what is importable
        import importlib.util

        return {
            "fla_importable": sys.modules.get("fla", 0) is not None and importlib.util.find_spec("fla") is not None,
            "report": f"unavailable ({type(exc).__name__})",
        }


async def _service_pass(loaded, batches, spec, spool: Path) -> tuple[int, float]:
    """One pass of the real consumer loop over `batches`; returns (bytes written, seconds from the
    loop's start to the last batch acked). Starting NATS and publishing come before the clock
    starts; tearing down and deleting the files after it stops."""
    from hsx.commands.embedded import start_nats_server
    from hsx.gpu_consumer.config import ConsumerConfig
    from hsx.gpu_consumer.scheduler import pull_loop
    from hsx.gpu_consumer.service import BatchWorker
    from hsx.wire import schemas, topology
    from hsx.wire.events import EventPublisher
    from hsx.wire.natsconn import NatsSettings, connect

    server = start_nats_server(Path(tempfile.mkdtemp(prefix="hsx-bench-nats-")))
    try:
        settings = NatsSettings(url=server.url)
        nc = await connect(settings, name="bench")
        js = nc.jetstream()
        kv = await topology.ensure_topology(js)
        await kv.put(spec.job, schemas.encode(spec))
        for seq, batch in enumerate(batches):
            descriptor = schemas.BatchDescriptor(
                job=spec.job, batch_id=f"b{seq}", padded_len=max(len(s.input_ids) for s in batch), samples=batch
            )
            await js.publish(topology.batch_subject(spec.job), schemas.encode(descriptor))
        durable = await topology.ensure_gpu_consumer(js, spec.job)
        sub = await js.pull_subscribe_bind(durable=durable, stream=topology.BATCHES_STREAM)
        cfg = ConsumerConfig(
            nats=settings,
            job=spec.job,
            device=str(loaded.device),
            spool=spool,
            node="bench",
            instance="bench-1",
            spool_high_water_bytes=1 << 60,
            idle_fetch_timeout_s=0.05,
        )
        stopping = asyncio.Event()
        worker = BatchWorker(cfg, js, EventPublisher(nc, js, spec.job), spec, loaded, stopping)
        started = time.perf_counter()
        loop_task = asyncio.create_task(pull_loop(worker, sub, cfg, stopping))
        while True:
            info = await js.consumer_info(topology.BATCHES_STREAM, durable)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.01)
        seconds = time.perf_counter() - started
        stopping.set()
        await loop_task
        worker.close()
        await sub.unsubscribe()
        await nc.drain()
    finally:
        server.stop()
    return sum(p.stat().st_size for p in (spool / spec.job).rglob("*.safetensors")), seconds


def _compare_compiled(model, forward_only, timed, repeats: int, real_tokens: int, flops: float) -> int:
    """An experiment, not the consumer's path: what fusing each decoder layer's element-wise work
    with torch.compile would buy the forward."""
    eager = statistics.median(timed(forward_only) for _ in range(repeats))
    start = time.perf_counter()
    for layer in decoder_layers(model):
        layer.compile(dynamic=True)
    first = timed(forward_only)  # pays for compiling
    compile_s = time.perf_counter() - start - first
    compiled = statistics.median(timed(forward_only) for _ in range(repeats))
    print(
        json.dumps(
            {
                "forward_eager_tokens_per_s": round(real_tokens / eager),
                "mfu_eager": round(flops / eager / PEAK_BF16_FLOPS, 4),
                "forward_compiled_tokens_per_s": round(real_tokens / compiled),
                "mfu_compiled": round(flops / compiled / PEAK_BF16_FLOPS, 4),
                "compiled_vs_eager": round(eager / compiled, 3),
                "first_compiled_pass_s": round(first + max(compile_s, 0), 1),
                "repeats": repeats,
            },
            indent=1,
        )
    )
    return 0


def _compare_attention(model, forward_only, timed, repeats: int, real_tokens: int, flops: float) -> int:
    """An experiment, not the consumer's path: the forward with each attention implementation
    that imports here (transformers' flash_attention_2 unpads the batch, which synchronises with
    the device twice per layer; SDPA takes the padding mask)."""
    import importlib.util

    figures = {}
    for attention in ("sdpa", "flash_attention_2"):
        if attention == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            figures[attention] = "flash-attn not installed"
            continue
        model.set_attn_implementation(attention)
        timed(forward_only)  # warm-up under this implementation
        seconds = statistics.median(timed(forward_only) for _ in range(repeats))
        figures[attention] = {
            "forward_tokens_per_s": round(real_tokens / seconds),
            "mfu": round(flops / seconds / PEAK_BF16_FLOPS, 4),
            "raw_seconds": seconds,
        }
    print(json.dumps({"attention_compare": figures, "repeats": repeats}, indent=1))
    return 0


def _projection(out: dict, lengths: list[int], shape: dict, flops: float, real_tokens: int, forward_s: float) -> dict:
    """The seeds' job (SEEDS_JOB) at the measured rates. The real model runs layers 0..61 of 64
    where this run ran `max(layers) + 1` of `--depth`: each measured rate is scaled by the ratio
    of the two forwards' FLOPs (forward_flops, same samples), i.e. the time per token is taken
    to grow with the FLOPs; writes are the real job's (5 layers x 5120 x 2 bytes per token) and
    are not scaled."""
    real = {**shape, "num_hidden_layers": SEEDS_JOB["depth"]}
    ratio = forward_flops(lengths, real, max(SEEDS_JOB["layers"]) + 1) / flops
    rates = {"forward": real_tokens / forward_s / ratio}
    for spool, figures in out["pipeline_by_spool"].items():
        rates[f"pipeline {spool}"] = figures["tokens_per_s"] / ratio
    gpus, tokens = SEEDS_JOB["gpus"], SEEDS_JOB["tokens"]
    return {
        "job": f"{SEEDS_JOB['samples']} samples, {tokens / 1e6:.1f}M tokens, layers {SEEDS_JOB['layers']} "
        f"of {SEEDS_JOB['depth']}, {gpus} GPUs",
        "flops_ratio_real_to_measured": round(ratio, 3),
        "tokens_per_s_per_gpu_at_full_depth": {k: round(v) for k, v in rates.items()},
        "hours": {k: round(tokens / (v * gpus) / 3600, 2) for k, v in rates.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--plan-samples",
        type=int,
        default=100_000,
        help="plan a job of this many samples and measure a few of its batches",
    )
    parser.add_argument("--batches", type=int, default=8, help="batches measured, spread evenly over the plan")
    parser.add_argument("--token-budget", type=int, default=32768)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--model", choices=sorted(SHAPES), default="qwen3_8b", help="the model's shape")
    parser.add_argument(
        "--depth", type=int, default=16, help="qwen3_5: decoder layers built (the real model has 64; default 16)"
    )
    parser.add_argument(
        "--layers",
        default=None,
        help="captured layers (default: qwen3_8b 1,9,17,25,33; qwen3_5 the seeds' dflash:5 at --depth)",
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float8"), default="bfloat16", help="stored dtype")
    parser.add_argument(
        "--kernels",
        choices=("auto", "fallback"),
        default="auto",
        help="fallback: hide fla and causal-conv1d (transformers' pure-torch linear attention)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--spool",
        type=Path,
        action="append",
        default=None,
        help="spool directory for the consumer-loop pass; repeat to measure several disks",
    )
    parser.add_argument("--attn", default=None, help="attention implementation (default: what the consumer picks)")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="every hsx path with torch.compile'd decoder layers (hsx consume --compile); "
        "the full-model baseline is then skipped (it would be compiled too)",
    )
    parser.add_argument(
        "--compile-layers",
        action="store_true",
        help="only compare the forward eager vs with each decoder layer torch.compile'd",
    )
    parser.add_argument(
        "--attn-compare",
        action="store_true",
        help="only compare the forward with sdpa vs flash_attention_2 (when flash-attn is installed)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, measures nothing")
    args = parser.parse_args()
    from hsx.logs import configure_logging

    configure_logging(json=True, level="warning")
    if args.kernels == "fallback":
        hide_fast_kernels()
    shape = dict(SHAPES[args.model])
    if args.model == "qwen3_5":
        shape["num_hidden_layers"] = args.depth
    if args.smoke:
        shape.update(SMOKE if args.model == "qwen3_5" else {k: v for k, v in SMOKE.items() if "linear" not in k})
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    else:
        device = torch.device("cuda")
        torch.set_num_threads(1)  # as the consumer does on a GPU (gpu_consumer/main.py)
    from transformers import AutoConfig, AutoModelForCausalLM

    from hsx.model.layers import preset_layers

    depth = shape["num_hidden_layers"]
    if args.layers:
        layers = [int(x) for x in args.layers.split(",")]
    elif args.model == "qwen3_5":
        layers = preset_layers("dflash:5", depth)
    else:
        layers = [1, 9, 17, 25, 33]
    model_type = shape.pop("model_type")
    config = AutoConfig.for_model(model_type, **shape)
    shape["model_type"] = model_type
    args.attn = args.attn or choose_attention(device, torch.bfloat16) or "sdpa"
    config._attn_implementation = args.attn
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    if args.compile:
        for layer in decoder_layers(model):
            layer.compile(dynamic=True)
    build_s = time.perf_counter() - t0
    kernels = kernels_in_use(model)
    staging = HostStaging() if device.type == "cuda" else None

    def with_tap() -> LoadedModel:
        return LoadedModel(
            model=model,
            tap=LayerTap(model, layers),
            device=device,
            dtype=torch.bfloat16,
            pad_token_id=0,
            attention=args.attn,
            staging=staging,
        )

    loaded = with_tap()

    # The batches of a real job: plan a large synthetic dataset as the producer would, then take a
    # few batches spread evenly over the plan (long and short ones alike). Their padding is what a
    # whole job's is; a small dataset planned on its own would be dominated by its long tail.
    all_lengths = synthetic_lengths(args.plan_samples, median=500, max_len=args.max_len, seed=0).tolist()
    full_plan = plan_batches(all_lengths, token_budget=args.token_budget)
    step = len(full_plan) / args.batches
    plan = [full_plan[int(i * step + step / 2)] for i in range(min(args.batches, len(full_plan)))]
    rng = np.random.default_rng(0)
    samples = [
        Sample(index=i, source_id=str(i), input_ids=rng.integers(0, shape["vocab_size"], size=all_lengths[i]).tolist())
        for b in plan
        for i in b.sample_indices
    ]
    by_index = {s.index: s for s in samples}
    batches = [[by_index[i] for i in b.sample_indices] for b in plan]
    lengths = [len(s.input_ids) for s in samples]
    real_tokens = sum(lengths)
    padded_tokens = sum(b.padded_tokens for b in plan)
    flops = forward_flops(lengths, shape, max(layers) + 1)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    warm_start = time.perf_counter()
    float8 = args.dtype == "float8"
    extract_samples(loaded, batches[0][:2], float8=float8)  # warm-up (and compiling, with --compile)
    if args.compile:
        extract_samples(loaded, batches[0], float8=float8)
    sync()
    warm_up_s = time.perf_counter() - warm_start

    def timed(fn) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    def forward_only():
        for batch in batches:
            ids, mask = pad_batch(batch, 0)
            with torch.inference_mode():
                loaded.tap.forward(ids.to(device), mask.to(device))

    if args.compile_layers:
        return _compare_compiled(model, forward_only, timed, args.repeats, real_tokens, flops)
    if args.attn_compare:
        return _compare_attention(model, forward_only, timed, args.repeats, real_tokens, flops)

    def full_model_baseline():
        """What the one-off scripts do: the whole model with output_hidden_states, then pick layers."""
        nonlocal loaded
        loaded.tap.remove()
        for batch in batches:
            ids, mask = pad_batch(batch, 0)
            with torch.inference_mode():
                out = model(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    output_hidden_states=True,
                    use_cache=False,
                    logits_to_keep=0,
                )
                torch.stack([out.hidden_states[i + 1] for i in layers], dim=2).cpu()
            del out
        loaded = with_tap()

    def extract_only():
        for batch in batches:
            # As the consumer does: the copy goes into pinned buffers leased to the batch.
            lease = staging.lease() if staging is not None else None
            extract_samples(loaded, batch, lease=lease, float8=float8)
            if lease is not None:
                lease.release()

    spools = args.spool or [Path(tempfile.mkdtemp(prefix="hsx-bench-spool-"))]
    spec = JobSpec(
        job="bench",
        model=f"{args.model}-shaped-random",
        model_revision="none",
        layers=layers,
        dtype=FLOAT8 if float8 else "bfloat16",
        dest="file:///dev/null",
        token_budget=args.token_budget,
        max_seq_len=args.max_len,
        dataset="synthetic",
        plan_fingerprint="x",
        total_samples=args.plan_samples,
        total_tokens=real_tokens,
        total_batches=len(plan),
        created_at=0.0,
    )

    def pipeline(spool: Path) -> tuple[int, float]:
        """The real consumer service loop (gpu_consumer.scheduler.pull_loop) against a real
        nats-server: fetch, forward, files written on the writer pool while the next batch
        computes, file-ready events, progress events, ack. No uploader: files stay in the spool."""
        sync()
        written, seconds = asyncio.run(_service_pass(loaded, batches, spec, spool))
        shutil.rmtree(spool / "bench", ignore_errors=True)
        return written, seconds

    results = {"full": [], "forward": [], "extract": []}
    per_spool = {str(spool): {"pipeline": [], "gpu_busy": [], "write_gbps": []} for spool in spools}
    for _ in range(args.repeats):
        if not args.compile:
            results["full"].append(timed(full_model_baseline))
        forward_seconds = timed(forward_only)
        results["forward"].append(forward_seconds)
        results["extract"].append(timed(extract_only))
        for spool in spools:
            written, seconds = pipeline(spool)
            figures = per_spool[str(spool)]
            figures["pipeline"].append(seconds)
            # The forward alone of the same batches over the service's wall time: the share of
            # the run the GPU spent on the work that matters.
            figures["gpu_busy"].append(forward_seconds / seconds)
            figures["write_gbps"].append(written / seconds / 1e9)
    forward_s = statistics.median(results["forward"])
    full_s = statistics.median(results["full"]) if results["full"] else None
    out = {
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu (smoke run: figures mean nothing)",
        "torch": torch.__version__,
        "attention": args.attn,
        "model": f"{args.model}-shaped ({depth} layers, hidden {shape['hidden_size']}), random bf16",
        "layers": layers,
        "stored_dtype": args.dtype,
        "kernels": kernels,
        "plan": f"{len(plan)} batches spread over the plan of {args.plan_samples} samples ({len(full_plan)} batches)",
        "samples": len(samples),
        "real_tokens": real_tokens,
        "packing_efficiency": round(real_tokens / padded_tokens, 4),
        "build_s": round(build_s, 1),
        "compiled_layers": args.compile,
        "warm_up_s": round(warm_up_s, 1),
        "full_model_output_hidden_states_tokens_per_s": round(real_tokens / full_s) if full_s else None,
        "forward_tokens_per_s": round(real_tokens / forward_s),
        "early_exit_ratio": round(forward_s / full_s, 4) if full_s else None,
        "extract_tokens_per_s": round(real_tokens / statistics.median(results["extract"])),
        "mfu_forward": round(flops / forward_s / PEAK_BF16_FLOPS, 4),
        "pipeline_by_spool": {
            spool: {
                "tokens_per_s": round(real_tokens / statistics.median(figures["pipeline"])),
                "gpu_busy": round(statistics.median(figures["gpu_busy"]), 4),
                "write_gb_per_s": round(statistics.median(figures["write_gbps"]), 3),
                "raw_seconds": [round(x, 3) for x in figures["pipeline"]],
            }
            for spool, figures in per_spool.items()
        },
        "repeats": args.repeats,
        "raw_seconds": {k: [round(x, 3) for x in v] for k, v in results.items()},
    }
    if args.model == "qwen3_5":
        out["projection"] = _projection(out, lengths, shape, flops, real_tokens, forward_s)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
