"""CPU pipeline benchmark: the whole hsx pipeline against the forward pass it exists to run.

Everything runs the way users run it: a real nats-server (`hsx.commands.embedded.start_nats_server`), and
`hsx produce`, `hsx consume --device cpu` and `hsx upload` as separate processes on one spool,
moving files to a `file://` destination. Start-up (imports, model loading, warm-up) is outside the
timing: the bench creates the job's durable and pauses it (JetStream consumer pause), starts the
producer and the services together, waits until the producer is done and every service heartbeats
ready (model loaded and warmed up, pull loop running), then lets the pause run out and times from
that instant to the arrival of the last sample's `uploaded` event on `hsx.events.<job>.>`.
`hsx status` must then say done, with no redelivery and no dead letter.

Prints one JSON object with:
- efficiency: tokens/s of the pipeline (1 consumer, 1 uploader) / tokens/s of a bare in-process
  loop of `LayerTap.forward` over the same batches (read back from the job's stream), same model
  folder, same torch thread count (the consumer's is read from its `consumer_ready` log line);
  target >= 0.90. With it, where the time went: `written_lag_s`, per batch, when its `written`
  event arrived minus when the bare loop had finished the same forward; and CPU seconds in the
  timed window of each process (consumer, uploader, nats-server, this bench), of the consumer's
  event loop and its other threads (forward, file writers), and of everything else on the machine
  (`others`, `others_cores`: on a shared machine other users' load moves the ratio; compare it
  between the forward and the pipeline passes). `cpu_ratio` = the forward's CPU seconds / those of
  consumer + uploader + nats-server, which other users' load moves less.
- consumers: pipeline tokens/s with 1 and 2 consumer processes on the job (torch threads split
  as `hsx up` splits them: OMP_NUM_THREADS = --threads // consumers), ratio against 1.
- uploaders: files/s and MB/s with 1, 2 and 4 uploader processes on the node's shared durable,
  draining a spool one consumer filled beforehand with a tiny model (upload durable paused, the
  consumer stopped before the drain is timed), ratio against 1.
Figures are medians of --repeats passes; each pass is a fresh job, forward and pipeline passes
alternate.

The model: Qwen3-shaped, hidden 512, MLP 4096 (8x), 4 decoder layers, random weights, float32
(this kind of CPU has no bf16 units: bf16 matmuls run about 4x slower), layers 1 and 3 captured,
so the forward runs all four layers: about 60 MFLOP per token against 4 KiB stored per token.
On 2 cores the forward takes about 1 ms of CPU per token while writing, hashing, copying and
announcing that token's 4 KiB takes microseconds, so the ratio measures what the pipeline adds to
a forward-bound job (processes and threads sharing the cores, events, acks), not disk bandwidth.
A wider or deeper model only makes each pass slower (--hidden, --intermediate, --num-layers).

With --include-startup, also `with_startup`: the same job timed with start-up on both sides
(issue 11 item 4): the pipeline, nothing paused, from launching producer, consumer and uploader
(one each, the consumer's threads and the uploader's --max-inflight as `hsx up` gives them) to
the last upload; the bare loop as a fresh process (imports, model load, warm-up, forwards) from
launch to exit; ratio = bare seconds / pipeline seconds.

Run: .venv/bin/python bench/pipeline.py [--samples 48] [--repeats 3] [--threads N]
     [--token-budget 2048] [--upload-samples 1000] [--max-inflight N] [--skip-scaling]
     [--include-startup] [--keep]
About 5 minutes on 2 idle cores with the defaults (efficiency only: --skip-scaling, about 1).
Linux only (CPU accounting reads /proc).
"""

import argparse
import asyncio
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats.js.errors
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hsx.commands.embedded import DEMO_MODEL_CONFIG, build_tiny_model, start_nats_server, write_synthetic_dataset  # noqa: E402
from hsx.commands.status import read_status  # noqa: E402
from hsx.commands.up import Child, hsx_argv, stop_all  # noqa: E402
from hsx.errors import HsxError  # noqa: E402
from hsx.gpu_consumer.extract import pad_batch  # noqa: E402
from hsx.gpu_consumer.model import load_model  # noqa: E402
from hsx.gpu_consumer.service import SERVICE as CONSUMER_SERVICE  # noqa: E402
from hsx.job import JobSpec
from hsx.storage import encodings
from hsx.uploader.service import SERVICE as UPLOADER_SERVICE  # noqa: E402
from hsx.wire import schemas, topology  # noqa: E402
from hsx.wire.jobs import require_job_spec  # noqa: E402
from hsx.wire.natsconn import NatsSettings, connect  # noqa: E402

NODE = "bench"
_DAY_S = 86400.0
_RELEASE_S = 0.3  # from the request that ends the pause to the pause's end
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of a process (all its threads, live or gone), or of one thread."""
    path = Path(f"/proc/{pid}/stat") if tid is None else Path(f"/proc/{pid}/task/{tid}/stat")
    fields = path.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (every core, every user) since boot."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / _CLOCK_TICKS  # less idle and iowait


_SPLIT = {"consumers": "consumer", "uploaders": "uploader"}  # roles whose main thread is told apart


@dataclass
class CpuWindow:
    """CPU seconds per role between start() and stop(); for consumers and uploaders, split between
    their main thread (the event loop: NATS, events, acks) and their other threads (consumer:
    forward and file writers; uploader: file moves); and what the rest of the machine used."""

    pids: dict[str, list[int]]
    _before: dict[tuple[int, int | None], float] = field(default_factory=dict)
    _busy: float = 0.0
    _started: float = 0.0
    result: dict[str, float] = field(default_factory=dict)

    def _read(self) -> dict[tuple[int, int | None], float]:
        every = {(pid, None) for pids in self.pids.values() for pid in pids}
        every |= {(pid, pid) for role in _SPLIT for pid in self.pids.get(role, [])}
        return {key: _cpu_s(*key) for key in every}

    def start(self) -> None:
        self._before = self._read()
        self._busy, self._started = _machine_busy_s(), time.monotonic()

    def stop(self) -> dict[str, float]:
        busy, seconds = _machine_busy_s() - self._busy, time.monotonic() - self._started
        used = {key: cpu - self._before[key] for key, cpu in self._read().items()}
        result = {role: sum(used[pid, None] for pid in pids) for role, pids in self.pids.items()}
        result["others"] = busy - sum(result.values())
        result["others_cores"] = result["others"] / seconds
        for role, name in _SPLIT.items():
            if self.pids.get(role):
                result[f"{name}_event_loop"] = sum(used[pid, pid] for pid in self.pids[role])
                result[f"{name}_other_threads"] = result[role] - result[f"{name}_event_loop"]
        self.result = {key: round(value, 2) for key, value in result.items()}
        return self.result


class JobEvents:
    """A job's `hsx.events.<job>.>` and heartbeats as they arrive, with their arrival times
    (time.monotonic)."""

    def __init__(self) -> None:
        self.ready: dict[str, str] = {}  # instance -> service, once it heartbeats past start-up
        self.written: dict[str, float] = {}  # batch id -> arrival
        self.bytes_written = 0
        self.uploaded: dict[int, float] = {}  # sample -> arrival
        self.bytes_uploaded = 0
        self._subs = []

    async def start(self, nc, job: str) -> None:
        self._subs = [
            await nc.subscribe(subject, cb=self._on_msg)
            for subject in (topology.event_subject(job, ">"), topology.heartbeats_subject_all(job))
        ]

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()

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


async def _wait_until(condition, watched: list[Child], what: str, timeout_s: float = 600.0) -> None:
    """Poll `condition` every 20 ms; a watched process that exits meanwhile is an error. (Times are
    taken from event arrivals, not from here.)"""
    deadline = time.monotonic() + timeout_s
    while not condition():
        for child in watched:
            if child.poll() is not None:
                raise HsxError(
                    f"{child.name} exited with code {child.poll()} while waiting for {what}: "
                    f"{child.last_error()} (log: {child.log_path})"
                )
        if time.monotonic() > deadline:
            raise HsxError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.02)


async def _pause_until(nc, stream: str, durable: str, delay_s: float) -> float:
    """Pause a durable (JetStream consumer pause, nats-server >= 2.11) until `delay_s` from now;
    returns the time.monotonic() at which it resumes. Its pull subscribers get nothing meanwhile;
    the pull requests waiting at the server are served the moment the pause runs out (an explicit
    unpause leaves them waiting until they expire: up to the services' 1 s fetch timeout). The
    services' idempotent add_consumer keeps the pause."""
    wall, resumes = time.time() + delay_s, time.monotonic() + delay_s
    until = datetime.datetime.fromtimestamp(wall, datetime.UTC).isoformat().replace("+00:00", "Z")
    reply = json.loads(
        (
            await nc.request(f"$JS.API.CONSUMER.PAUSE.{stream}.{durable}", json.dumps({"pause_until": until}).encode())
        ).data
    )
    if "error" in reply or not reply.get("paused"):
        raise HsxError(f"cannot pause {stream}/{durable}: {reply}")
    return resumes


async def _read_batches(js, job: str) -> list[schemas.BatchDescriptor]:
    """The job's descriptors as they sit in the stream (read by sequence; no consumer needed)."""
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


@dataclass(frozen=True)
class JobInput:
    model: Path
    dataset: Path
    layers: str
    token_budget: int


@dataclass
class Started:
    """One job's processes, started together and ready."""

    spec: JobSpec
    consumers: list[Child]
    uploaders: list[Child]
    producer_s: float
    startup_s: float  # from starting the processes until the last one is ready


class Bench:
    def __init__(self, args, workdir: Path, nats: NatsSettings, nats_pid: int) -> None:
        self.args, self.workdir, self.nats, self.nats_pid = args, workdir, nats, nats_pid
        self.out = workdir / "out"
        self.spool = workdir / "spool"
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.nc = None
        self.js = None

    def _env(self, consumers: int) -> dict[str, str]:
        threads = str(max(1, self.args.threads // consumers))  # what hsx up gives CPU consumers
        return {
            **os.environ,
            **self.nats.as_env(),
            "HSX_NODE": NODE,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": threads,
        }

    def _child(self, job: str, name: str, args: list[str], env: dict[str, str]) -> Child:
        """`hsx ARGS` as a process logging to the work directory (info: `consumer_ready` is read)."""
        child = Child(name, hsx_argv("--log-level", "info", *args), env, self.logs / f"{job}-{name}.log")
        child.start()
        return child

    async def start_job(self, job: str, inp: JobInput, events: JobEvents, *, consumers: int, uploaders: int) -> Started:
        """`hsx produce`, `consumers` x `hsx consume` and `uploaders` x `hsx upload` started together
        (the services wait for the job spec, then load the model); returns once the producer is
        done and every service heartbeats ready."""
        env = self._env(consumers)
        started = time.monotonic()
        producer = self._child(
            job,
            "producer",
            [
                "produce",
                "--job",
                job,
                "--model",
                str(inp.model),
                "--dataset",
                str(inp.dataset),
                "--layers",
                inp.layers,
                "--dest",
                self.out.as_uri(),
                "--dtype",
                "float32",
                "--token-budget",
                str(inp.token_budget),
                "--max-seq-len",
                str(self.args.max_len),
            ],
            env,
        )
        consume = ["consume", "--job", job, "--device", "cpu", "--spool", str(self.spool)]
        workers = [self._child(job, f"consumer-{i}", consume, env) for i in range(consumers)]
        upload = ["upload", "--job", job, "--spool", str(self.spool)]
        if self.args.max_inflight:
            upload += ["--max-inflight", str(self.args.max_inflight)]
        workers += [self._child(job, f"uploader-{i}", upload, env) for i in range(uploaders)]
        try:
            await _wait_until(lambda: producer.poll() is not None, workers, "hsx produce")
            producer_s = time.monotonic() - started
            if producer.poll() != 0:
                raise HsxError(f"hsx produce failed: {producer.last_error()} (log: {producer.log_path})")
            await _wait_until(
                lambda: (
                    events.ready_count(CONSUMER_SERVICE) >= consumers
                    and events.ready_count(UPLOADER_SERVICE) >= uploaders
                ),
                workers,
                "the services to be ready",
            )
        except BaseException:
            stop_all([producer, *workers])
            raise
        spec = await require_job_spec(await topology.ensure_topology(self.js), job)
        return Started(spec, workers[:consumers], workers[consumers:], producer_s, time.monotonic() - started)

    async def finish_job(self, job: str) -> None:
        view = await read_status(self.nats, job)
        if not view.done or view.batch_redeliveries or view.file_redeliveries or view.dead_letters:
            raise HsxError(f"job {job} did not finish cleanly: {msgspec.json.encode(view).decode()[:1500]}")
        shutil.rmtree(self.out / job, ignore_errors=True)

    async def pipeline_pass(
        self,
        job: str,
        inp: JobInput,
        *,
        consumers: int,
        uploaders: int,
        read_batches: bool = False,
        include_startup: bool = False,
    ) -> dict:
        """Everything ready and idle, then the batches released: seconds until the last upload.
        `include_startup`: nothing paused, seconds from starting the processes (the producer
        and the services together) until the last upload; CPU from when all are ready."""
        durable = await topology.ensure_gpu_consumer(self.js, job)
        if not include_startup:
            await _pause_until(self.nc, topology.BATCHES_STREAM, durable, _DAY_S)
        events = JobEvents()
        await events.start(self.nc, job)
        launched = time.monotonic()
        run = await self.start_job(job, inp, events, consumers=consumers, uploaders=uploaders)
        workers = run.consumers + run.uploaders
        try:
            batches = await _read_batches(self.js, job) if read_batches else None
            cpu = CpuWindow(
                {
                    "consumers": [c.process.pid for c in run.consumers],
                    "uploaders": [c.process.pid for c in run.uploaders],
                    "nats_server": [self.nats_pid],
                    "bench": [os.getpid()],
                }
            )
            if include_startup:
                started = launched
            else:
                started = await _pause_until(self.nc, topology.BATCHES_STREAM, durable, _RELEASE_S)
                await asyncio.sleep(started - time.monotonic())
            cpu.start()
            await _wait_until(lambda: len(events.uploaded) >= run.spec.total_samples, workers, "the last upload")
            cpu.stop()
        finally:
            stop_all(workers)
            await events.stop()
        await self.finish_job(job)
        finished = max(events.uploaded.values())
        return {
            "seconds": finished - started,
            "tokens_per_s": run.spec.total_tokens / (finished - started),
            "startup_s": run.startup_s,
            "producer_s": run.producer_s,
            "written_at": [events.written[b] - started for b in sorted(events.written)],  # ids sort in plan order
            "upload_tail_s": finished - max(events.written.values()),
            "bytes_written": events.bytes_written,
            "cpu_s": cpu.result,
            "consumer_torch_threads": [_consumer_threads(c.log_path) for c in run.consumers],
            "spec": run.spec,
            "batches": batches,
        }

    async def upload_pass(self, job: str, inp: JobInput, *, uploaders: int) -> dict:
        """A spool filled by one consumer (the upload durable paused, the consumer then stopped),
        drained by `uploaders` processes: seconds from the release until the last upload."""
        durable = await topology.ensure_upload_consumer(self.js, job, NODE)
        await _pause_until(self.nc, topology.FILES_STREAM, durable, _DAY_S)
        events = JobEvents()
        await events.start(self.nc, job)
        run = await self.start_job(job, inp, events, consumers=1, uploaders=uploaders)
        try:
            await _wait_until(
                lambda: len(events.written) >= run.spec.total_batches,
                run.consumers + run.uploaders,
                "the consumer to write every file",
            )
            stop_all(run.consumers)
            cpu = CpuWindow(
                {
                    "uploaders": [c.process.pid for c in run.uploaders],
                    "nats_server": [self.nats_pid],
                    "bench": [os.getpid()],
                }
            )
            started = await _pause_until(self.nc, topology.FILES_STREAM, durable, _RELEASE_S)
            await asyncio.sleep(started - time.monotonic())
            cpu.start()
            await _wait_until(lambda: len(events.uploaded) >= run.spec.total_samples, run.uploaders, "the last upload")
            cpu.stop()
        finally:
            stop_all(run.consumers + run.uploaders)
            await events.stop()
        await self.finish_job(job)
        seconds = max(events.uploaded.values()) - started
        return {
            "seconds": seconds,
            "files_per_s": run.spec.total_samples / seconds,
            "mb_per_s": events.bytes_uploaded / seconds / 1e6,
            "mb_per_file": events.bytes_uploaded / len(events.uploaded) / 1e6,
            "cpu_s": cpu.result,
        }


def _forward_one(loaded, batch: schemas.BatchDescriptor) -> None:
    ids, mask = pad_batch(batch.samples, loaded.pad_token_id)
    with torch.inference_mode():
        loaded.tap.forward(ids, mask)


async def _forward_pass(loaded, batches: list[schemas.BatchDescriptor], *, main_thread: bool = False) -> dict:
    """The baseline: LayerTap.forward over the batches and nothing else (bench/gpu.py forward_only).
    Each forward runs on a worker thread (asyncio.to_thread), as the consumer runs it; on a CPU
    shared with other processes libgomp's spin-waiting has made the same loop on the main thread
    up to 2x slower (--also-main-thread measures it too)."""
    busy0, cpu0, started = _machine_busy_s(), time.process_time(), time.perf_counter()
    ends = []
    for batch in batches:
        if main_thread:
            _forward_one(loaded, batch)
        else:
            await asyncio.to_thread(_forward_one, loaded, batch)
        ends.append(time.perf_counter() - started)
    seconds = ends[-1]
    cpu = time.process_time() - cpu0
    others = _machine_busy_s() - busy0 - cpu
    return {
        "seconds": seconds,
        "ends": ends,
        "cpu_s": {"bench": round(cpu, 2), "others": round(others, 2), "others_cores": round(others / seconds, 2)},
    }


def _bare_forward_main(args) -> int:
    """`--bare-forward`: the baseline with its start-up, as its own process: import, load the
    model, warm up, run LayerTap.forward over the batches of --batches (JSON lines), exit."""
    torch.set_num_threads(args.threads)
    decoder = msgspec.json.Decoder(schemas.BatchDescriptor)
    batches = [decoder.decode(line) for line in Path(args.batches).read_bytes().splitlines() if line]
    loaded = load_model(
        args.model,
        layers=[int(x) for x in args.layers.split(",")],
        encoding=encodings.of_spec(args.dtype),
        device="cpu",
    )
    _forward_one(loaded, batches[-1])  # warm-up, as the consumer does
    for batch in batches:
        _forward_one(loaded, batch)
    return 0


async def _with_startup(
    args, bench: Bench, inp: JobInput, spec: JobSpec, batches: list[schemas.BatchDescriptor]
) -> dict:
    """Start-up included on both sides: the pipeline from launching its processes (nothing
    paused) to the last upload, against the bare loop as a fresh process (imports, model load,
    warm-up, the forwards) from launch to exit; both with the consumer's thread count."""
    batch_file = bench.workdir / "batches.jsonl"
    batch_file.write_bytes(b"\n".join(schemas.encode(b) for b in batches) + b"\n")
    env = bench._env(1)
    forward, pipeline = [], []
    for i in range(args.repeats):
        pipeline.append(await bench.pipeline_pass(f"start-{i}", inp, consumers=1, uploaders=1, include_startup=True))
        launched = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(Path(__file__).resolve()),
            "--bare-forward",
            "--model",
            str(inp.model),
            "--layers",
            ",".join(str(x) for x in spec.layers),
            "--dtype",
            spec.dtype,
            "--batches",
            str(batch_file),
            "--threads",
            str(args.threads),
            env=env,
        )
        if await proc.wait() != 0:
            raise HsxError("the bare forward process failed")
        forward.append({"seconds": time.monotonic() - launched})
    forward_s, pipeline_s = _median(forward, "seconds"), _median(pipeline, "seconds")
    return {
        "forward_s": round(forward_s, 2),
        "pipeline_s": round(pipeline_s, 2),
        "ratio": round(forward_s / pipeline_s, 4),
        "target": 0.90,
        "pipeline_startup_s": round(_median(pipeline, "startup_s"), 2),
        "cpu_s_pipeline_after_ready": _median_cpu(pipeline),
        "raw_seconds": {"forward": _raw(forward), "pipeline": _raw(pipeline)},
    }


def _median(passes: list[dict], key: str) -> float:
    return statistics.median(p[key] for p in passes)


def _median_cpu(passes: list[dict]) -> dict[str, float]:
    return {role: round(statistics.median(p["cpu_s"][role] for p in passes), 2) for role in passes[0]["cpu_s"]}


def _raw(passes: list[dict]) -> list[float]:
    return [round(p["seconds"], 2) for p in passes]


async def _efficiency(args, bench: Bench, inp: JobInput) -> tuple[dict, JobSpec, list]:
    forward, forward_main, pipeline = [], [], []
    loaded = batches = None
    for i in range(args.repeats):
        pipeline.append(await bench.pipeline_pass(f"eff-{i}", inp, consumers=1, uploaders=1, read_batches=not i))
        if loaded is None:
            spec, batches = pipeline[0]["spec"], pipeline[0]["batches"]
            torch.set_num_threads(args.threads)
            loaded = load_model(
                str(inp.model), layers=spec.layers, encoding=encodings.of_spec(spec.dtype), device="cpu"
            )
            await asyncio.to_thread(_forward_one, loaded, batches[-1])  # warm-up, as the consumer does
        forward.append(await _forward_pass(loaded, batches))
        if args.also_main_thread:
            forward_main.append(await _forward_pass(loaded, batches, main_thread=True))
    spec = pipeline[0]["spec"]
    threads_seen = {t for p in pipeline for t in p["consumer_torch_threads"]}
    if threads_seen != {args.threads}:
        raise HsxError(f"the consumer ran {threads_seen} torch threads, the baseline {args.threads}")
    forward_tps = spec.total_tokens / _median(forward, "seconds")
    pipeline_tps = _median(pipeline, "tokens_per_s")
    cpu_forward, cpu_pipeline = _median_cpu(forward), _median_cpu(pipeline)
    pipeline_cpu = sum(cpu_pipeline[k] for k in ("consumers", "uploaders", "nats_server"))
    lag = [
        statistics.median(p["written_at"][k] - f["ends"][k] for p, f in zip(pipeline, forward))
        for k in range(len(forward[0]["ends"]))
    ]
    out = {
        "forward_tokens_per_s": round(forward_tps, 1),
        "pipeline_tokens_per_s": round(pipeline_tps, 1),
        "ratio": round(pipeline_tps / forward_tps, 4),
        "target": 0.90,
        "cpu_ratio": round(cpu_forward["bench"] / pipeline_cpu, 4),
        "excluded_startup_s": round(_median(pipeline, "startup_s"), 2),
        "producer_s": round(_median(pipeline, "producer_s"), 2),
        # Per batch, in plan order: when the pipeline's `written` event arrived minus when the bare
        # loop had finished the same batch's forward (both from the start of the pass).
        "written_lag_s": [round(x, 3) for x in lag],
        "upload_tail_s": round(_median(pipeline, "upload_tail_s"), 3),
        "mb_written": round(pipeline[0]["bytes_written"] / 1e6, 2),
        "cpu_s_forward": cpu_forward,
        "cpu_s_pipeline": cpu_pipeline,
        "raw_seconds": {"forward": _raw(forward), "pipeline": _raw(pipeline)},
    }
    if forward_main:
        out["forward_main_thread"] = {
            "tokens_per_s": round(spec.total_tokens / _median(forward_main, "seconds"), 1),
            "cpu_s": _median_cpu(forward_main),
            "raw_seconds": _raw(forward_main),
        }
    return out, spec, batches


async def run(args, workdir: Path) -> dict:
    server = start_nats_server(workdir / "nats", log_file=workdir / "nats-server.log")
    nats = NatsSettings(url=server.url)
    bench = Bench(args, workdir, nats, server.process.pid)
    bench.nc = await connect(nats, name="hsx-bench-pipeline")
    bench.js = bench.nc.jetstream()
    await topology.ensure_topology(bench.js)
    try:
        shape = dict(
            DEMO_MODEL_CONFIG,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_hidden_layers=args.num_layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=args.hidden // 8,
        )
        inp = JobInput(
            model=build_tiny_model(workdir / "model", **shape),
            dataset=write_synthetic_dataset(
                workdir / "dataset.jsonl",
                count=args.samples,
                vocab_size=shape["vocab_size"],
                median=args.median_len,
                max_len=args.max_len,
            ),
            layers=args.layers,
            token_budget=args.token_budget,
        )
        efficiency, spec, batches = await _efficiency(args, bench, inp)
        out = {
            "config": {
                "model": {k: v for k, v in shape.items() if k != "max_position_embeddings"},
                "layers": spec.layers,
                "dtype": spec.dtype,
                "samples": spec.total_samples,
                "tokens": spec.total_tokens,
                "batches": spec.total_batches,
                "token_budget": args.token_budget,
                "median_len": args.median_len,
                "max_len": args.max_len,
                "threads": args.threads,
                "cpu_count": os.cpu_count(),
                "repeats": args.repeats,
                "torch": torch.__version__,
                "dest": "file://",
                "upload_max_inflight": args.max_inflight or "hsx default",
            },
            "efficiency": efficiency,
        }
        if args.include_startup:
            out["with_startup"] = await _with_startup(args, bench, inp, spec, batches)
        if args.skip_scaling:
            return out

        two = [await bench.pipeline_pass(f"c2-{i}", inp, consumers=2, uploaders=1) for i in range(args.repeats)]
        one_tps = efficiency["pipeline_tokens_per_s"]
        out["consumers"] = {
            "1": {"tokens_per_s": one_tps, "ratio_vs_1": 1.0, "torch_threads_each": args.threads},
            "2": {
                "tokens_per_s": round(_median(two, "tokens_per_s"), 1),
                "ratio_vs_1": round(_median(two, "tokens_per_s") / one_tps, 4),
                "torch_threads_each": max(1, args.threads // 2),
                "cpu_s": _median_cpu(two),
                "raw_seconds": _raw(two),
            },
        }

        tiny = JobInput(
            model=build_tiny_model(workdir / "tiny-model"),
            dataset=write_synthetic_dataset(
                workdir / "upload-dataset.jsonl",
                count=args.upload_samples,
                vocab_size=DEMO_MODEL_CONFIG["vocab_size"],
                median=args.median_len,
                max_len=args.max_len,
            ),
            layers="1,3,5",
            token_budget=4096,
        )
        uploads = {
            n: [await bench.upload_pass(f"up{n}-{i}", tiny, uploaders=n) for i in range(args.repeats)]
            for n in (1, 2, 4)
        }
        base = _median(uploads[1], "files_per_s")
        out["config"]["uploads"] = {
            "samples": args.upload_samples,
            "mb_per_file": round(_median(uploads[1], "mb_per_file"), 3),
            "model": "hsx.commands.embedded.DEMO_MODEL_CONFIG (hidden 128), layers 1,3,5, float32",
        }
        out["uploaders"] = {
            str(n): {
                "files_per_s": round(_median(p, "files_per_s"), 1),
                "mb_per_s": round(_median(p, "mb_per_s"), 1),
                "ratio_vs_1": round(_median(p, "files_per_s") / base, 4),
                "cpu_s": _median_cpu(p),
                "raw_seconds": _raw(p),
            }
            for n, p in uploads.items()
        }
        return out
    finally:
        await bench.nc.drain()
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=48, help="samples per efficiency / consumer-scaling job")
    parser.add_argument("--median-len", type=int, default=96, help="median sample length (lognormal)")
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads of the baseline and of a single consumer (split among consumers)",
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--layers", default="1,3", help="captured layers")
    parser.add_argument("--upload-samples", type=int, default=1000, help="files per uploader-scaling job")
    parser.add_argument(
        "--max-inflight", type=int, default=None, help="hsx upload --max-inflight for every uploader (default: hsx's)"
    )
    parser.add_argument(
        "--also-main-thread",
        action="store_true",
        help="also time the forward loop on the main thread (as bench/gpu.py does)",
    )
    parser.add_argument("--skip-scaling", action="store_true", help="efficiency only")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, store, output)")
    parser.add_argument(
        "--include-startup",
        action="store_true",
        help="also time both sides with their start-up (with_startup): the pipeline from launch, "
        "the bare loop as a fresh process",
    )
    parser.add_argument("--bare-forward", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--batches", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_forward:
        return _bare_forward_main(args)
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
