"""GPU benchmark: the consumer's extraction path on a model of a real shape (random weights,
built from its config, nothing downloaded), bf16, projected onto the seeds' job.

Shapes (`--model`):
- `qwen3_8b` (default): Qwen3-8B, 36 layers, 5 captured layers (1,9,17,25,33): the earlier runs';
- `qwen3_5`: Qwen3.5-27B's own text dimensions and layer pattern (hidden 5120, MLP 17408, Gated
  DeltaNet linear attention with 16 key / 48 value heads of 128, full attention (24 query / 4 kv
  heads of 256, output gate) every 4th layer; vocabulary 248,320), cut to `--depth` layers
  (default 24; the real model has 64, and fits an H200 too: `--depth 64`). `--kernels fallback`
  hides fla and causal-conv1d, so transformers runs its pure-torch delta rule and convolution
  (what a node without them runs); `auto` uses them when they import.

Captured layers, `qwen3_5` (`--layers seeds-io`, the default): the seeds' job captures 5 layers
(1,16,31,46,61) of 64 and so runs 62 layers' FLOPs for 5 x 5120 x 2 bytes written per token. A cut
of D layers capturing 5 would write ~62/D times the real job's bytes per FLOP (4x at 16 layers),
and the disk would look busier than it will be. So every one of the D layers runs and k of them
are captured, evenly spaced up to the last, k = round(5 x FLOPs(D layers) / FLOPs(62 layers)):
at 24 layers, 2 (11 and 23), 1.03x the seeds' bytes per FLOP (`io_per_flop_vs_seeds`); at 64,
the seeds' own layers. `--layers 1,4,7` names them instead.

Output: JSON lines on stdout, each printed (and flushed) as soon as it is measured, so a run cut
short by a timeout keeps what it measured. Each line's `what`:
- `config`: shape, layers, io_per_flop_vs_seeds, kernels the forward runs, the plan's batches;
  `built_s`; then `warm_up` (seconds; the first passes pay for fla's autotune and compiling);
- `disk` per spool: its filesystem and its own write rate (one file, 16 MiB writes, one fsync,
  `--disk-gb` of it: what bench/write.py calls raw_one_file);
- `pipeline` per spool and pass: the real consumer loop (gpu_consumer.scheduler.pull_loop with a
  BatchWorker) against a real nats-server: fetch, forward, files written while the next batch
  computes, file-ready and progress events, acks (no uploader: the files stay). `gpu_busy` is
  measured inside that loop: CUDA events on the current stream around each LayerTap.forward,
  their spans summed, over the loop's wall time from its start to the last ack (wall clock on a
  CPU, where the forward is synchronous); `mfu` is the loop's, `mfu_while_busy` the forward's;
- `pass` (path `forward`, `extract`, `baseline`): the same batches outside the loop: the tap
  alone; forward + stacking (+ float8) + device-to-host copy; and what the one-off scripts do,
  the whole model with output_hidden_states, the chosen layers copied to the host. The baseline
  keeps the logits of the last position only (logits_to_keep=1): the lm_head over the whole
  vocabulary for every token (248,320 x 5120 per token here) is not what those scripts need and
  is left out of it;
- `summary` after every repeat: the medians so far (the earlier runs' keys);
- `projection` (`qwen3_5`) after every repeat: the seeds' job (914,000 samples, 624.4M tokens,
  4 GPUs of one node) at the measured rates, scaled from the measured forward to the real one by
  their FLOPs (forward_flops, same samples; bytes scale alike at the seeds' I/O per FLOP): hours
  bound by the GPU (the loop on a tmpfs spool), by the disk (its own write rate against the
  node's 4 consumers' bytes), by the network where `--network-gb-per-s` is given (no network on
  the device to measure), and which of them binds;
- `compare` for the experiments `--compile-layers` (eager vs each decoder layer torch.compile'd)
  and `--attn-compare` (sdpa vs flash_attention_2, when flash-attn imports).
FLOPs are counted by `forward_flops` (its docstring has the formula); MFU against 989 TFLOP/s
(H200 dense bf16).

Run: python bench/gpu.py [--model qwen3_5 [--depth 24]] [--plan-samples 100000 --batches 8]
     [--token-budget 32768] [--spool /tmp/hsx-bench-spool --spool /dev/shm/hsx-bench-spool]
     [--dtype float8] [--kernels fallback] [--compile] [--network-gb-per-s 1.25]
     python bench/gpu.py --smoke [--model qwen3_5]   # tiny shapes, at most 8 layers, on the CPU
Medians over --repeats passes over the same batches.
"""

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hsx.commands.embedded import synthetic_lengths
from hsx.gpu_consumer.extract import extract_samples, pad_batch
from hsx.gpu_consumer.model import LayerTap, LoadedModel, choose_attention
from hsx.gpu_consumer.staging import HostStaging
from hsx.gpu_consumer.trunk import decoder_layers
from hsx.job import JobSpec
from hsx.packing import plan_batches
from hsx.storage import encodings
from hsx.storage.encodings.float8 import FLOAT8
from hsx.wire.schemas import Sample

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
    vocab_size=1024,
)
PEAK_BF16_FLOPS = 989e12
SEEDS_JOB = {"samples": 914_000, "tokens": 624_400_000, "gpus": 4, "layers": [1, 16, 31, 46, 61], "depth": 64}
GDN_CHUNK = 64  # the chunk length of the chunked delta rule (fla's and transformers' fallback)


def emit(what: str, **fields) -> None:
    """One JSON line on stdout, at once: whatever is cut short later keeps it."""
    print(json.dumps({"what": what, **fields}), flush=True)


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


def seeds_io_layers(lengths: list[int], shape: dict) -> list[int]:
    """The layers to capture so that bytes written per FLOP are the seeds' job's (module
    docstring): all of `shape`'s layers run, k of them captured, evenly spaced up to the last."""
    depth = shape["num_hidden_layers"]
    if depth == SEEDS_JOB["depth"]:
        return list(SEEDS_JOB["layers"])
    real = {**shape, "num_hidden_layers": SEEDS_JOB["depth"]}
    share = forward_flops(lengths, shape, depth) / forward_flops(lengths, real, max(SEEDS_JOB["layers"]) + 1)
    count = max(1, round(len(SEEDS_JOB["layers"]) * share))
    spacing = depth / count
    return [round(depth - 1 - spacing * (count - 1 - j)) for j in range(count)]


def io_per_flop_vs_seeds(lengths: list[int], shape: dict, layers: list[int]) -> float:
    """Bytes written per forward FLOP here over the seeds' job's, same samples (same hidden size)."""
    real = {**shape, "num_hidden_layers": SEEDS_JOB["depth"]}
    here = len(layers) / forward_flops(lengths, shape, max(layers) + 1)
    seeds = len(SEEDS_JOB["layers"]) / forward_flops(lengths, real, max(SEEDS_JOB["layers"]) + 1)
    return here / seeds


def filesystem(path: Path) -> str:
    """The type of the filesystem `path` is on (tmpfs, ext4, overlay, ...), from /proc/mounts."""
    target, best, kind = str(path.resolve()), "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


def disk_write_rate(directory: Path, nbytes: int) -> float:
    """The disk's own sequential write rate in bytes/s: one file, 16 MiB writes, one fsync."""
    directory.mkdir(parents=True, exist_ok=True)
    chunk = memoryview(os.urandom(16 << 20))
    path = directory / "hsx-bench-disk.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start, written = time.perf_counter(), 0
        while written < nbytes:
            written += os.write(fd, chunk[: min(len(chunk), nbytes - written)])
        os.fsync(fd)
        return written / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def forward_spans(device: torch.device):
    """LayerTap.forward, wrapped for the block: each call's span on the stream it runs on (CUDA
    events recorded on the current stream before and after; the wall clock on a CPU, where the
    forward is synchronous). Yields a list; `busy_seconds` sums it once the work is done."""
    spans: list = []
    original = LayerTap.forward

    def timed(self, *args, **kwargs):
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            try:
                return original(self, *args, **kwargs)
            finally:
                end.record(stream)
                spans.append((start, end))
        began = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spans.append(time.perf_counter() - began)

    LayerTap.forward = timed
    try:
        yield spans
    finally:
        LayerTap.forward = original


def busy_seconds(spans: list) -> float:
    total = 0.0
    for span in spans:
        if isinstance(span, tuple):
            span[1].synchronize()
            total += span[0].elapsed_time(span[1]) / 1000
        else:
            total += span
    return total


async def _service_pass(loaded, batches, spec, spool: Path) -> dict:
    """One pass of the real consumer loop over `batches`: bytes written, seconds from the loop's
    start to the last batch acked, and the GPU's seconds inside LayerTap.forward meanwhile.
    Starting NATS and publishing come before the clock starts; tearing down after it stops."""
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
        with forward_spans(loaded.device) as spans:
            started = time.perf_counter()
            loop_task = asyncio.create_task(pull_loop(worker, sub, cfg, stopping))
            while True:
                if loop_task.done():  # the loop ended before the work did: its error, not a hang
                    loop_task.result()
                    raise RuntimeError("the consumer loop ended with batches left")
                info = await js.consumer_info(topology.BATCHES_STREAM, durable)
                if info.num_pending == 0 and info.num_ack_pending == 0:
                    break
                await asyncio.sleep(0.01)
            seconds = time.perf_counter() - started
            stopping.set()
            await loop_task
        busy = busy_seconds(spans)
        worker.close()
        await sub.unsubscribe()
        await nc.drain()
    finally:
        server.stop()
    written = sum(p.stat().st_size for p in (spool / spec.job).rglob("*.safetensors"))
    return {"bytes": written, "seconds": seconds, "busy_s": busy, "forwards": len(spans)}


def _compare_compiled(model, forward_only, timed, repeats: int, real_tokens: int, flops: float) -> int:
    """An experiment, not the consumer's path: what fusing each decoder layer's element-wise work
    with torch.compile would buy the forward."""
    eager = statistics.median(timed(forward_only) for _ in range(repeats))
    emit("pass", path="forward_eager", seconds=round(eager, 4), tokens_per_s=round(real_tokens / eager))
    start = time.perf_counter()
    for layer in decoder_layers(model):
        layer.compile(dynamic=True)
    first = timed(forward_only)  # pays for compiling
    compile_s = time.perf_counter() - start - first
    emit("compile", first_compiled_pass_s=round(first + max(compile_s, 0), 1))
    compiled = statistics.median(timed(forward_only) for _ in range(repeats))
    emit(
        "compare",
        forward_eager_tokens_per_s=round(real_tokens / eager),
        mfu_eager=round(flops / eager / PEAK_BF16_FLOPS, 4),
        forward_compiled_tokens_per_s=round(real_tokens / compiled),
        mfu_compiled=round(flops / compiled / PEAK_BF16_FLOPS, 4),
        compiled_vs_eager=round(eager / compiled, 3),
        repeats=repeats,
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
            "raw_seconds": round(seconds, 4),
        }
    emit("compare", attention_compare=figures, repeats=repeats)
    return 0


def _projection(
    *,
    shape: dict,
    lengths: list[int],
    flops: float,
    summary: dict,
    disks: dict,
    float8: bool,
    network_gb_per_s: float | None,
) -> dict:
    """The seeds' job (SEEDS_JOB) at the measured rates, on one node of SEEDS_JOB["gpus"] GPUs.
    The real model runs layers 0..61 of 64 where this run ran `max(layers) + 1` of `--depth`:
    each measured rate is divided by the ratio of the two forwards' FLOPs (same samples). Bytes
    are the real job's: 5 layers x hidden x 2 bytes per token (1 byte + a float32 scale per
    layer in float8)."""
    real = {**shape, "num_hidden_layers": SEEDS_JOB["depth"]}
    ratio = forward_flops(lengths, real, max(SEEDS_JOB["layers"]) + 1) / flops
    layers, hidden, gpus, tokens = (
        len(SEEDS_JOB["layers"]),
        shape["hidden_size"],
        SEEDS_JOB["gpus"],
        SEEDS_JOB["tokens"],
    )
    bytes_per_token = layers * (hidden + 4) if float8 else layers * hidden * 2
    per_gpu = {"forward": summary["forward_tokens_per_s"] / ratio}
    tmpfs_rates, disk_rates = [], []
    for spool, figures in summary["pipeline_by_spool"].items():
        rate = figures["tokens_per_s"] / ratio
        per_gpu[f"pipeline {spool}"] = rate
        (tmpfs_rates if disks.get(spool, {}).get("fs") == "tmpfs" else disk_rates).append(rate)
    # The GPU's bound: the consumer loop with nothing but memory under its spool.
    gpu_rate = max(tmpfs_rates or disk_rates)
    needed = gpu_rate * gpus * bytes_per_token / 1e9
    hours = {"gpu": tokens / (gpu_rate * gpus) / 3600}
    disk_rate = max((d["write_gb_per_s"] for d in disks.values() if d["fs"] != "tmpfs"), default=None)
    if disk_rate:
        hours["disk"] = tokens * bytes_per_token / (disk_rate * 1e9) / 3600
    if network_gb_per_s:
        hours["network"] = tokens * bytes_per_token / (network_gb_per_s * 1e9) / 3600
    binds = max(hours, key=hours.get)
    return {
        "job": f"{SEEDS_JOB['samples']} samples, {tokens / 1e6:.1f}M tokens, layers {SEEDS_JOB['layers']} "
        f"of {SEEDS_JOB['depth']}, {gpus} GPUs of one node",
        "flops_ratio_real_to_measured": round(ratio, 3),
        "tokens_per_s_per_gpu_at_full_depth": {k: round(v) for k, v in per_gpu.items()},
        "bytes_per_token": bytes_per_token,
        "job_needs_gb_per_s": {"per_gpu": round(needed / gpus, 3), "per_node": round(needed, 3)},
        "disk_write_gb_per_s": disk_rate,
        "network_gb_per_s": network_gb_per_s or "not measured (no network on the device): pass --network-gb-per-s",
        "hours": {k: round(v, 2) for k, v in hours.items()},
        "binds": binds,
        "job_hours": round(hours[binds], 2),
        "one_gpu_on_the_disk_vs_tmpfs": round(max(disk_rates) / max(tmpfs_rates), 3)
        if disk_rates and tmpfs_rates
        else None,
    }


def _summary(results: dict, per_spool: dict, real_tokens: int, flops: float) -> dict:
    median = {k: statistics.median(v) for k, v in results.items() if v}
    full_s = median.get("baseline")
    forward_s = median["forward"]
    return {
        "full_model_output_hidden_states_tokens_per_s": round(real_tokens / full_s) if full_s else None,
        "forward_tokens_per_s": round(real_tokens / forward_s),
        "early_exit_ratio": round(forward_s / full_s, 4) if full_s else None,
        "extract_tokens_per_s": round(real_tokens / median["extract"]) if "extract" in median else None,
        "mfu_forward": round(flops / forward_s / PEAK_BF16_FLOPS, 4),
        "pipeline_by_spool": {
            spool: {
                "tokens_per_s": round(real_tokens / statistics.median(f["seconds"])),
                "gpu_busy": round(statistics.median(f["gpu_busy"]), 4),
                "mfu": round(flops / statistics.median(f["seconds"]) / PEAK_BF16_FLOPS, 4),
                "write_gb_per_s": round(statistics.median(f["write_gb_per_s"]), 3),
            }
            for spool, f in per_spool.items()
            if f["seconds"]
        },
        "repeats": len(results["forward"]),
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
        "--depth", type=int, default=24, help="qwen3_5: decoder layers built (the real model has 64; default 24)"
    )
    parser.add_argument(
        "--layers",
        default=None,
        help="captured layers, e.g. 1,4,7 (default: qwen3_8b 1,9,17,25,33; qwen3_5 seeds-io: the seeds' "
        "bytes per FLOP, module docstring)",
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
    parser.add_argument("--disk-gb", type=float, default=2.0, help="bytes written to measure each spool's disk")
    parser.add_argument(
        "--network-gb-per-s",
        type=float,
        default=None,
        help="the node's upload rate, for the projection (not measured: the device has no network)",
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
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model and batches on the CPU, no torch.compile: checks the script, measures nothing",
    )
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
        if args.model == "qwen3_5":
            shape["num_hidden_layers"] = min(args.depth, 8)
        # torch.compile on a CPU spends tens of seconds tracing for nothing the script needs checked.
        args.compile = args.compile_layers = False
        args.plan_samples, args.token_budget, args.max_len = min(args.plan_samples, 500), 256, 128
        args.batches, args.repeats, args.disk_gb = min(args.batches, 2), 1, 0.004
        device = torch.device("cpu")
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        emit("skipped", reason="no CUDA device")
        return 0
    else:
        device = torch.device("cuda")
        torch.set_num_threads(1)  # as the consumer does on a GPU (gpu_consumer/main.py)
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

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

    depth = shape["num_hidden_layers"]
    if args.layers and args.layers != "seeds-io":
        layers = [int(x) for x in args.layers.split(",")]
    elif args.model == "qwen3_5":
        layers = seeds_io_layers(lengths, shape)
    else:
        layers = [1, 9, 17, 25, 33]
    flops = forward_flops(lengths, shape, max(layers) + 1)
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
    staging = HostStaging() if device.type == "cuda" else None
    cuda = device.type == "cuda"

    def with_tap() -> LoadedModel:
        return LoadedModel(
            model=model,
            tap=LayerTap(model, layers),
            device=device,
            dtype=torch.bfloat16,
            pad_token_id=0,
            attention=args.attn,
            encoding=encodings.by_name(args.dtype),
            staging=staging,
        )

    loaded = with_tap()
    emit(
        "config",
        gpu=torch.cuda.get_device_name(0) if cuda else "cpu (smoke run: figures mean nothing)",
        torch=torch.__version__,
        transformers=transformers.__version__,
        attention=args.attn,
        model=f"{args.model}-shaped ({depth} layers, hidden {shape['hidden_size']}), random bf16",
        layers=layers,
        layers_run=max(layers) + 1,
        io_per_flop_vs_seeds=round(io_per_flop_vs_seeds(lengths, shape, layers), 3)
        if args.model == "qwen3_5"
        else None,
        stored_dtype=args.dtype,
        compiled_layers=args.compile,
        kernels=kernels_in_use(model),
        plan=f"{len(plan)} batches spread over the plan of {args.plan_samples} samples ({len(full_plan)} batches)",
        samples=len(samples),
        real_tokens=real_tokens,
        packing_efficiency=round(real_tokens / padded_tokens, 4),
        forward_flops=flops,
        baseline="whole model, output_hidden_states=True, logits of the last position only (logits_to_keep=1)",
        built_s=round(build_s, 1),
    )

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    warm_start = time.perf_counter()
    float8 = args.dtype == "float8"
    extract_samples(loaded, batches[0][:2])  # warm-up (and compiling, with --compile)
    extract_samples(loaded, batches[0])  # fla autotunes per shape: the full batch's too
    sync()
    emit("warm_up", seconds=round(time.perf_counter() - warm_start, 1))

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
                    logits_to_keep=1,
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
    disks = {}
    for spool in spools:
        rate = disk_write_rate(spool, int(args.disk_gb * 1e9))
        disks[str(spool)] = {"fs": filesystem(spool), "write_gb_per_s": round(rate / 1e9, 3)}
        emit("disk", spool=str(spool), fs=disks[str(spool)]["fs"], write_gb_per_s=round(rate / 1e9, 3), gb=args.disk_gb)
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
        plan_fingerprint=hashlib.sha256(b"bench").hexdigest(),  # a plan's form: the spool folder is named by it
        total_samples=args.plan_samples,
        total_tokens=real_tokens,
        total_batches=len(plan),
        created_at=0.0,
    )

    def pipeline(spool: Path) -> dict:
        """The real consumer service loop (gpu_consumer.scheduler.pull_loop) against a real
        nats-server: fetch, forward, files written on the writer pool while the next batch
        computes, file-ready events, progress events, ack. No uploader: files stay in the spool."""
        sync()
        figures = asyncio.run(_service_pass(loaded, batches, spec, spool))
        shutil.rmtree(spool / "bench", ignore_errors=True)
        return figures

    results: dict[str, list[float]] = {"forward": [], "extract": [], "baseline": []}
    per_spool = {str(spool): {"seconds": [], "gpu_busy": [], "write_gb_per_s": []} for spool in spools}
    for repeat in range(args.repeats):
        for spool in spools:
            figures = pipeline(spool)
            seconds = figures["seconds"]
            busy = figures["busy_s"] / seconds
            kept = per_spool[str(spool)]
            kept["seconds"].append(seconds)
            kept["gpu_busy"].append(busy)
            kept["write_gb_per_s"].append(figures["bytes"] / seconds / 1e9)
            emit(
                "pipeline",
                spool=str(spool),
                repeat=repeat,
                seconds=round(seconds, 4),
                tokens_per_s=round(real_tokens / seconds),
                gpu_busy=round(busy, 4),
                forward_gpu_s=round(figures["busy_s"], 4),
                forwards=figures["forwards"],
                mfu=round(flops / seconds / PEAK_BF16_FLOPS, 4),
                mfu_while_busy=round(flops / figures["busy_s"] / PEAK_BF16_FLOPS, 4) if figures["busy_s"] else None,
                write_gb_per_s=round(figures["bytes"] / seconds / 1e9, 3),
            )
        paths = {"forward": forward_only, "extract": extract_only}
        if not args.compile:
            paths["baseline"] = full_model_baseline
        for name, run in paths.items():
            seconds = timed(run)
            results[name].append(seconds)
            emit(
                "pass",
                path=name,
                repeat=repeat,
                seconds=round(seconds, 4),
                tokens_per_s=round(real_tokens / seconds),
                mfu=round(flops / seconds / PEAK_BF16_FLOPS, 4) if name != "baseline" else None,
            )
        summary = _summary(results, per_spool, real_tokens, flops)
        emit("summary", **summary)
        if args.model == "qwen3_5":
            emit(
                "projection",
                **_projection(
                    shape=shape,
                    lengths=lengths,
                    flops=flops,
                    summary=summary,
                    disks=disks,
                    float8=float8,
                    network_gb_per_s=args.network_gb_per_s,
                ),
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
