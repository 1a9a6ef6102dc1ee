"""GPU benchmark: the consumer's extraction path on a Qwen3-8B-shaped model (random weights,
built from its config, nothing downloaded), 5 captured layers, bf16.

Prints one JSON object with, for the same packed batches:
- full_model_output_hidden_states_tokens_per_s: the baseline the one-off scripts use (whole
  model, output_hidden_states=True, then pick the layers and copy them to the host);
- forward_tokens_per_s: the layer tap alone (forward up to the deepest layer);
- extract_tokens_per_s: forward + stacking + device-to-host copy (what the consumer computes);
- pipeline_tokens_per_s: the real consumer loop (gpu_consumer.scheduler) against a real
  nats-server: forward, files written on the writer pool while the next batch computes,
  file-ready and progress events, acks (no uploader);
- mfu: model FLOP utilisation of the forward (against 989 TFLOP/s dense bf16);
- gpu_busy: bare forward time of the same batches / the consumer loop's wall time;
- write_gb_per_s: bytes written per second in the pipeline loop.

Run: python bench/gpu.py [--plan-samples 100000 --batches 8] [--token-budget 32768]
     [--spool /tmp/hsx-bench-spool --spool /dev/shm/hsx-bench-spool]
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
from hsx.wire.schemas import JobSpec, Sample  # noqa: E402

QWEN3_8B = dict(
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
PEAK_BF16_FLOPS = 989e12


def forward_flops(lengths: list[int], cfg: dict, layers_run: int) -> float:
    """Matmul FLOPs of the forward up to `layers_run` layers (causal attention counted half)."""
    h, i, nh, nkv, hd = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    per_token_layer = 2 * (h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 3 * h * i)
    total = 0.0
    for t in lengths:
        total += t * layers_run * per_token_layer
        total += layers_run * 2 * 2 * nh * hd * t * t / 2  # QK^T and AV, causal half
    return total


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
    for layer in model.model.layers:
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
    parser.add_argument("--layers", default="1,9,17,25,33")
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
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, measures nothing")
    args = parser.parse_args()
    from hsx.logs import configure_logging

    configure_logging(json=True, level="warning")
    shape = dict(QWEN3_8B)
    if args.smoke:
        shape.update(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=36,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=151936,
        )
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    else:
        device = torch.device("cuda")
    from transformers import AutoConfig, AutoModelForCausalLM

    layers = [int(x) for x in args.layers.split(",")]
    config = AutoConfig.for_model("qwen3", **shape)
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
        Sample(index=i, source_id=str(i), input_ids=rng.integers(0, 151936, size=all_lengths[i]).tolist())
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
    extract_samples(loaded, batches[0][:2])  # warm-up (and compiling, with --compile)
    if args.compile:
        extract_samples(loaded, batches[0])
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
            extract_samples(loaded, batch, lease=lease)
            if lease is not None:
                lease.release()

    spools = args.spool or [Path(tempfile.mkdtemp(prefix="hsx-bench-spool-"))]
    spec = JobSpec(
        job="bench",
        model="qwen3-8b-shaped-random",
        model_revision="none",
        layers=layers,
        dtype="bfloat16",
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
        "model": "qwen3-8b-shaped (36 layers, hidden 4096), random bf16",
        "layers": layers,
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
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
