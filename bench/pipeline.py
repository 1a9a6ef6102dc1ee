"""CPU pipeline benchmark: the whole hsx pipeline against the forward pass it exists to run.

Everything runs the way users run it: a real nats-server (`hsx.embedded.start_nats_server`),
`hsx produce`, then `hsx consume --device cpu` and `hsx upload` as separate processes on one spool,
moving files to a `file://` destination. Model loading and start-up are left out of the timing:
the bench creates the job's durable and pauses it (JetStream consumer pause), starts the services,
waits until every one of them heartbeats `idle` (model loaded and warmed up, pull loop running),
then resumes the durable and times from there until the `uploaded` event of the last sample
arrives on `hsx.events.<job>.>`. `hsx status` then has to say done, with no redelivery.

Prints one JSON object with:
- efficiency: tokens/s of the pipeline (1 consumer, 1 uploader) / tokens/s of a bare in-process
  loop of `LayerTap.forward` over the same batches (read back from the job's stream), same model
  folder, same torch thread count (the consumer's is read from its `consumer_ready` log line);
  target >= 0.90. With it, where the CPU went during the timed window: CPU seconds of each
  process (consumer, uploader, nats-server, this bench) and of everything else on the machine.
- consumers: pipeline tokens/s with 1 and 2 consumer processes on the job (torch threads split
  between them as `hsx up` does: OMP_NUM_THREADS = --threads // consumers), ratio against 1.
- uploaders: files/s and MB/s with 1, 2 and 4 uploader processes on one node's durable, draining a
  spool that a consumer filled beforehand with a tiny model (upload durable paused meanwhile,
  consumer stopped before the drain is timed), ratio against 1.
Figures are medians of --repeats passes; each pass is a fresh job.

The model: a Qwen3-shaped stack, hidden 512, MLP 4096 (8x), 4 decoder layers, random weights,
float32 (this CPU has AVX2 and no bf16 units: bf16 matmuls run about 4x slower than float32), and
layers 1,3 captured, so the forward runs all four layers. That is about 60 MFLOP per token, roughly
2 ms of 2-core CPU time, against 4 KB stored per token: writing, hashing, copying and announcing a
token's bytes costs microseconds, so the ratio measures what the pipeline adds to a forward-bound
job (scheduling, events, acks, processes sharing the cores), not the disk. Wider or deeper
makes each pass slower without changing the picture; --hidden/--intermediate/--num-layers change it.

Run: .venv/bin/python bench/pipeline.py [--samples 48] [--repeats 3] [--threads N] [--token-budget 2048]
     [--upload-samples 384] [--skip-scaling] [--keep]
About 4 minutes on 2 cores with the defaults. Linux (CPU accounting reads /proc).
"""

import argparse
import asyncio
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats.js.errors
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_consumer.extract import pad_batch  # noqa: E402
from gpu_consumer.model import load_model  # noqa: E402
from gpu_consumer.service import SERVICE as CONSUMER_SERVICE  # noqa: E402
from hsx import schemas, topology  # noqa: E402
from hsx.embedded import DEMO_MODEL_CONFIG, build_tiny_model, start_nats_server, write_synthetic_dataset  # noqa: E402
from hsx.errors import HsxError  # noqa: E402
from hsx.jobs import require_job_spec  # noqa: E402
from hsx.natsconn import NatsSettings, connect  # noqa: E402
from hsx.status import read_status  # noqa: E402
from hsx.up import _Child, _hsx, _stop_all  # noqa: E402
from uploader.service import SERVICE as UPLOADER_SERVICE  # noqa: E402

NODE = "bench"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process, all its threads (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (every core, every user) since boot."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks[:8]) - idle) / _CLOCK_TICKS


@dataclass
class CpuWindow:
    """CPU seconds per role between start() and stop(), and what the rest of the machine used."""

    pids: dict[str, list[int]]
    start_s: dict[int, float] = field(default_factory=dict)
    busy0: float = 0.0
    started: float = 0.0
    result: dict[str, float] = field(default_factory=dict)

    def start(self) -> None:
        self.start_s = {pid: _process_cpu_s(pid) for pids in self.pids.values() for pid in pids}
        self.busy0 = _machine_busy_s()
        self.started = time.monotonic()

    def stop(self) -> dict[str, float]:
        busy = _machine_busy_s() - self.busy0
        self.result = {
            role: round(sum(_process_cpu_s(pid) - self.start_s[pid] for pid in pids), 2) for role, pids in self.pids.items()
        }
        self.result["others"] = round(busy - sum(self.result.values()), 2)
        self.result["machine_busy"] = round(busy, 2)
        self.result["others_cores"] = round(self.result["others"] / (time.monotonic() - self.started), 2)
        return self.result


class JobEvents:
    """A job's `hsx.events.<job>.>` as they arrive, with arrival times (time.monotonic)."""

    def __init__(self) -> None:
        self.ready: dict[str, str] = {}  # instance -> service, once past start-up
        self.written: dict[str, float] = {}  # batch id -> arrival
        self.bytes_written = 0
        self.uploaded: dict[int, float] = {}  # sample -> arrival
        self.bytes_uploaded = 0
        self.sub = None

    async def start(self, nc, job: str) -> None:
        self.sub = await nc.subscribe(topology.event_subject(job, ">"), cb=self._on_msg)

    async def stop(self) -> None:
        await self.sub.unsubscribe()

    async def _on_msg(self, msg) -> None:
        now = time.monotonic()
        try:
            event = schemas.event_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if isinstance(event, schemas.Heartbeat) and event.state not in ("starting", "stopping"):
            self.ready.setdefault(event.instance, event.service)
        elif isinstance(event, schemas.BatchWritten) and event.batch_id not in self.written:
            self.written[event.batch_id] = now
            self.bytes_written += event.bytes
        elif isinstance(event, schemas.FileUploaded) and event.sample_index not in self.uploaded:
            self.uploaded[event.sample_index] = now
            self.bytes_uploaded += event.size

    def ready_count(self, service: str) -> int:
        return sum(1 for s in self.ready.values() if s == service)


async def _wait_until(condition, children: list[_Child], what: str, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for child in children:
            if child.poll() is not None:
                raise HsxError(f"{child.name} exited with code {child.poll()} while waiting for {what}: "
                               f"{child.last_error()} (log: {child.log_path})")
        if time.monotonic() > deadline:
            raise HsxError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.01)


async def _set_paused(nc, stream: str, durable: str, paused: bool) -> None:
    """JetStream consumer pause (nats-server >= 2.11): a paused durable delivers nothing to its
    bound pull subscribers. The services' idempotent add_consumer leaves the pause in place."""
    until = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)
    body = {"pause_until": until.isoformat().replace("+00:00", "Z")} if paused else {}
    reply = json.loads((await nc.request(f"$JS.API.CONSUMER.PAUSE.{stream}.{durable}", json.dumps(body).encode())).data)
    if "error" in reply or reply.get("paused") != paused:
        raise HsxError(f"cannot {'pause' if paused else 'resume'} {stream}/{durable}: {reply}")


async def _read_batches(js, job: str) -> list[schemas.BatchDescriptor]:
    """The job's descriptors as they sit in the stream (read by sequence, no consumer needed)."""
    batches, seq = [], 1
    while True:
        try:
            msg = await js.get_msg(topology.BATCHES_STREAM, seq=seq, subject=topology.batch_subject(job), next=True)
        except nats.js.errors.NotFoundError:
            return batches
        batches.append(schemas.batch_decoder.decode(msg.data))
        seq = msg.seq + 1


def _consumer_threads(log_path: Path) -> int | None:
    for line in log_path.read_text(errors="replace").splitlines():
        if '"consumer_ready"' in line:
            return json.loads(line).get("torch_threads")
    return None


class Bench:
    def __init__(self, args, workdir: Path, nats: NatsSettings, nats_pid: int) -> None:
        self.args, self.workdir, self.nats, self.nats_pid = args, workdir, nats, nats_pid
        self.dest = (workdir / "out").as_uri()
        self.spool = workdir / "spool"
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.nc = None

    def _env(self, consumers: int) -> dict[str, str]:
        threads = str(max(1, self.args.threads // consumers))  # hsx up's rule for CPU consumers
        return {**os.environ, **self.nats.as_env(), "HSX_NODE": NODE, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": threads}

    async def produce(self, job: str, model: Path, dataset: Path, layers: str, token_budget: int) -> float:
        argv = _hsx("produce", "--job", job, "--model", str(model), "--dataset", str(dataset), "--layers", layers,
                    "--dest", self.dest, "--dtype", "float32", "--token-budget", str(token_budget),
                    "--max-seq-len", str(self.args.max_len))
        started = time.monotonic()
        done = await asyncio.to_thread(subprocess.run, argv, env=self._env(1), capture_output=True, text=True)
        if done.returncode != 0:
            raise HsxError(f"hsx produce failed: {done.stderr.strip()[-2000:]}")
        return time.monotonic() - started

    def _start(self, job: str, what: str, count: int, env: dict[str, str]) -> list[_Child]:
        children = []
        for i in range(count):
            argv = _hsx("consume", "--job", job, "--device", "cpu", "--spool", str(self.spool)) if what == "consumer" \
                else _hsx("upload", "--job", job, "--spool", str(self.spool))
            child = _Child(f"{what}-{i}", argv, env, self.logs / f"{job}-{what}-{i}.log")
            child.start()
            children.append(child)
        return children

    async def _check_done(self, job: str) -> dict:
        view = await read_status(self.nats, job)
        if not view["done"] or view["batch_redeliveries"] or view["file_redeliveries"] or view["dead_letters"]:
            raise HsxError(f"job {job} did not finish cleanly: {json.dumps(view)[:1500]}")
        return view

    async def pipeline_pass(self, job: str, *, consumers: int, uploaders: int) -> dict:
        """Services started and idle, then the batches released: seconds until the last upload."""
        js = self.nc.jetstream()
        spec = await require_job_spec(await topology.ensure_topology(js), job)
        durable = await topology.ensure_gpu_consumer(js, job)
        await _set_paused(self.nc, topology.BATCHES_STREAM, durable, True)
        events = JobEvents()
        await events.start(self.nc, job)
        workers = (self._start(job, "consumer", consumers, self._env(consumers))
                   + self._start(job, "uploader", uploaders, self._env(consumers)))
        try:
            await _wait_until(lambda: events.ready_count(CONSUMER_SERVICE) >= consumers
                              and events.ready_count(UPLOADER_SERVICE) >= uploaders, workers, "the services to be ready")
            cpu = CpuWindow({"consumers": [c.process.pid for c in workers[:consumers]],
                             "uploaders": [c.process.pid for c in workers[consumers:]],
                             "nats_server": [self.nats_pid], "bench": [os.getpid()]})
            cpu.start()
            started = time.monotonic()
            await _set_paused(self.nc, topology.BATCHES_STREAM, durable, False)
            await _wait_until(lambda: len(events.uploaded) >= spec.total_samples, workers, "the last upload")
            cpu.stop()
            finished = max(events.uploaded.values())
        finally:
            _stop_all(workers)
            await events.stop()
        await self._check_done(job)
        seconds = finished - started
        return {
            "seconds": seconds,
            "tokens_per_s": spec.total_tokens / seconds,
            "first_batch_written_s": min(events.written.values()) - started,
            "last_batch_written_s": max(events.written.values()) - started,
            "upload_tail_s": finished - max(events.written.values()),
            "bytes_written": events.bytes_written,
            "cpu_s": cpu.result,
            "consumer_torch_threads": [_consumer_threads(c.log_path) for c in workers[:consumers]],
        }

    async def upload_pass(self, job: str, *, uploaders: int) -> dict:
        """A spool filled by one consumer (upload durable paused, consumer stopped), then drained by
        `uploaders` processes: seconds from release until the last upload."""
        js = self.nc.jetstream()
        spec = await require_job_spec(await topology.ensure_topology(js), job)
        durable = await topology.ensure_upload_consumer(js, job, NODE)
        await _set_paused(self.nc, topology.FILES_STREAM, durable, True)
        events = JobEvents()
        await events.start(self.nc, job)
        consumer = self._start(job, "consumer", 1, self._env(1))
        workers = self._start(job, "uploader", uploaders, self._env(1))
        try:
            await _wait_until(lambda: len(events.written) >= spec.total_batches
                              and events.ready_count(UPLOADER_SERVICE) >= uploaders, consumer + workers,
                              "the spool to fill and the uploaders to be ready")
            _stop_all(consumer)
            cpu = CpuWindow({"uploaders": [c.process.pid for c in workers], "nats_server": [self.nats_pid],
                             "bench": [os.getpid()]})
            cpu.start()
            started = time.monotonic()
            await _set_paused(self.nc, topology.FILES_STREAM, durable, False)
            await _wait_until(lambda: len(events.uploaded) >= spec.total_samples, workers, "the last upload")
            cpu.stop()
            seconds = max(events.uploaded.values()) - started
        finally:
            _stop_all(consumer + workers)
            await events.stop()
        await self._check_done(job)
        return {"seconds": seconds, "files_per_s": spec.total_samples / seconds,
                "mb_per_s": events.bytes_uploaded / seconds / 1e6, "cpu_s": cpu.result}


def _forward_one(loaded, batch: schemas.BatchDescriptor) -> None:
    ids, mask = pad_batch(batch.samples, loaded.pad_token_id)
    with torch.inference_mode():
        loaded.tap.forward(ids, mask)


async def _forward_pass(loaded, batches: list[schemas.BatchDescriptor], *, main_thread: bool = False) -> dict:
    """The baseline: LayerTap.forward over the batches, nothing else (bench/gpu.py forward_only).
    Each forward runs on a worker thread (asyncio.to_thread), as the consumer runs it: on a CPU
    shared with other processes, libgomp's spin-waiting makes the same loop on the main thread
    up to 2x slower, a handicap the consumer does not have (see --also-main-thread)."""
    busy0, cpu0, started = _machine_busy_s(), time.process_time(), time.perf_counter()
    for batch in batches:
        if main_thread:
            _forward_one(loaded, batch)
        else:
            await asyncio.to_thread(_forward_one, loaded, batch)
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu0
    others = _machine_busy_s() - busy0 - cpu
    return {"seconds": seconds, "cpu_s": {"bench": round(cpu, 2), "others": round(others, 2),
                                          "others_cores": round(others / seconds, 2)}}


def _median(passes: list[dict], key: str) -> float:
    return statistics.median(p[key] for p in passes)


def _median_cpu(passes: list[dict]) -> dict[str, float]:
    return {role: round(statistics.median(p["cpu_s"][role] for p in passes), 2) for role in passes[0]["cpu_s"]}


async def run(args, workdir: Path) -> dict:
    server = start_nats_server(workdir / "nats", log_file=workdir / "nats-server.log")
    nats = NatsSettings(url=server.url)
    bench = Bench(args, workdir, nats, server.process.pid)
    bench.nc = await connect(nats, name="hsx-bench-pipeline")
    try:
        shape = dict(DEMO_MODEL_CONFIG, hidden_size=args.hidden, intermediate_size=args.intermediate,
                     num_hidden_layers=args.num_layers, num_attention_heads=8, num_key_value_heads=4,
                     head_dim=args.hidden // 8)
        model = build_tiny_model(workdir / "model", **shape)
        dataset = write_synthetic_dataset(workdir / "dataset.jsonl", count=args.samples, vocab_size=shape["vocab_size"],
                                          median=args.median_len, max_len=args.max_len)
        produce_s = [await bench.produce("eff-0", model, dataset, args.layers, args.token_budget)]
        js = bench.nc.jetstream()
        spec = await require_job_spec(await topology.ensure_topology(js), "eff-0")
        batches = await _read_batches(js, "eff-0")
        torch.set_num_threads(args.threads)
        loaded = load_model(str(model), layers=spec.layers, dtype=spec.dtype, device="cpu")
        with torch.inference_mode():  # warm-up, as the consumer does
            loaded.tap.forward(*pad_batch(batches[-1].samples[:1], loaded.pad_token_id))

        forward, forward_main, pipeline, two = [], [], [], []
        for i in range(args.repeats):
            if i:
                produce_s.append(await bench.produce(f"eff-{i}", model, dataset, args.layers, args.token_budget))
            forward.append(await _forward_pass(loaded, batches))
            if args.also_main_thread:
                forward_main.append(await _forward_pass(loaded, batches, main_thread=True))
            pipeline.append(await bench.pipeline_pass(f"eff-{i}", consumers=1, uploaders=1))
        del loaded
        threads_seen = {t for p in pipeline for t in p["consumer_torch_threads"]}
        if threads_seen != {args.threads}:
            raise HsxError(f"the consumer ran {threads_seen} torch threads, the baseline {args.threads}")
        forward_tps = spec.total_tokens / _median(forward, "seconds")
        pipeline_tps = _median(pipeline, "tokens_per_s")
        out = {
            "config": {
                "model": {k: v for k, v in shape.items() if k != "max_position_embeddings"}, "layers": spec.layers,
                "dtype": spec.dtype, "samples": spec.total_samples, "tokens": spec.total_tokens,
                "batches": spec.total_batches, "token_budget": args.token_budget, "median_len": args.median_len,
                "max_len": args.max_len, "threads": args.threads, "cpu_count": os.cpu_count(), "repeats": args.repeats,
                "torch": torch.__version__, "dest": "file://", "upload_samples": args.upload_samples,
                "upload_model": "hsx.embedded.DEMO_MODEL_CONFIG, layers 1,3,5, float32",
            },
            "efficiency": {
                "forward_tokens_per_s": round(forward_tps, 1),
                "pipeline_tokens_per_s": round(pipeline_tps, 1),
                "ratio": round(pipeline_tps / forward_tps, 4),
                "target": 0.90,
                "producer_s": round(statistics.median(produce_s), 2),
                "first_batch_written_s": round(_median(pipeline, "first_batch_written_s"), 2),
                "upload_tail_s": round(_median(pipeline, "upload_tail_s"), 3),
                "mb_written": round(pipeline[0]["bytes_written"] / 1e6, 2),
                "cpu_s_forward": _median_cpu(forward),
                "cpu_s_pipeline": _median_cpu(pipeline),
                "raw_seconds": {"forward": [round(p["seconds"], 2) for p in forward],
                                "pipeline": [round(p["seconds"], 2) for p in pipeline]},
            },
        }
        if forward_main:
            out["efficiency"]["forward_main_thread"] = {
                "tokens_per_s": round(spec.total_tokens / _median(forward_main, "seconds"), 1),
                "cpu_s": _median_cpu(forward_main), "raw_seconds": [round(p["seconds"], 2) for p in forward_main],
            }
        if args.skip_scaling:
            return out
        for i in range(args.repeats):
            await bench.produce(f"c2-{i}", model, dataset, args.layers, args.token_budget)
            two.append(await bench.pipeline_pass(f"c2-{i}", consumers=2, uploaders=1))
        out["consumers"] = {
            "1": {"tokens_per_s": round(pipeline_tps, 1), "ratio_vs_1": 1.0},
            "2": {"tokens_per_s": round(_median(two, "tokens_per_s"), 1),
                  "ratio_vs_1": round(_median(two, "tokens_per_s") / pipeline_tps, 4),
                  "torch_threads_each": sorted({t for p in two for t in p["consumer_torch_threads"]}),
                  "cpu_s": _median_cpu(two), "raw_seconds": [round(p["seconds"], 2) for p in two]},
        }

        tiny = build_tiny_model(workdir / "tiny-model")
        tiny_data = write_synthetic_dataset(workdir / "upload-dataset.jsonl", count=args.upload_samples,
                                            vocab_size=DEMO_MODEL_CONFIG["vocab_size"], median=args.median_len,
                                            max_len=args.max_len)
        uploads: dict[int, list[dict]] = {}
        for n in (1, 2, 4):
            for i in range(args.repeats):
                await bench.produce(f"up{n}-{i}", tiny, tiny_data, "1,3,5", 4096)
                uploads.setdefault(n, []).append(await bench.upload_pass(f"up{n}-{i}", uploaders=n))
        base = _median(uploads[1], "files_per_s")
        out["uploaders"] = {
            str(n): {"files_per_s": round(_median(p, "files_per_s"), 1), "mb_per_s": round(_median(p, "mb_per_s"), 1),
                     "ratio_vs_1": round(_median(p, "files_per_s") / base, 4), "cpu_s": _median_cpu(p),
                     "raw_seconds": [round(x["seconds"], 2) for x in p]}
            for n, p in uploads.items()
        }
        return out
    finally:
        await bench.nc.drain()
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=48, help="samples per efficiency/consumer-scaling job")
    parser.add_argument("--median-len", type=int, default=96, help="median sample length (lognormal)")
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of the baseline and of a single consumer (split among consumers)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--layers", default="1,3", help="captured layers")
    parser.add_argument("--upload-samples", type=int, default=384, help="files per uploader-scaling job")
    parser.add_argument("--also-main-thread", action="store_true",
                        help="also time the forward loop on the main thread (bench/gpu.py's way)")
    parser.add_argument("--skip-scaling", action="store_true", help="efficiency only")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, store, output)")
    args = parser.parse_args()
    from hsx.logs import configure_logging

    configure_logging(json=True, level="warning")
    workdir = Path(tempfile.mkdtemp(prefix="hsx-bench-pipeline-"))
    started = time.monotonic()
    try:
        out = asyncio.run(run(args, workdir))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    out["wall_s"] = round(time.monotonic() - started, 1)
    if args.keep:
        out["workdir"] = str(workdir)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
