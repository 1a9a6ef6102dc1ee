"""`hsx consume`: check the device, connect, read the job spec, load the model once, warm up,
then pull batches until stopped (with --until-done: until the job is over, hsx.wire.worker.JobEnd).
Started by `hsx up`, which knows the model before the producer records the spec, it loads the
model while the producer plans (ExpectedModel), and keeps it if the spec names that one.

A device torch cannot use here is refused before anything is connected: a consumer that never
started leaves no heartbeat. From the model's load on it beats (`starting`), and whatever ends it
sends its goodbye (hsx.wire.worker.heartbeats)."""

import asyncio
import dataclasses
import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from hsx.exitcodes import JOB_FAILED, STOPPED
from hsx.gpu_consumer import compiling
from hsx.gpu_consumer.config import ConsumerConfig, ExpectedModel
from hsx.gpu_consumer.device_thread import DeviceThread
from hsx.gpu_consumer.grace import REAPER_STOP_S, turn_bound_s
from hsx.gpu_consumer.kernels import check_kernels, kernel_report, report_fields
from hsx.gpu_consumer.model import LoadedModel, load_model, usable_device
from hsx.gpu_consumer.scheduler import pull_loop
from hsx.gpu_consumer.service import SERVICE, BatchWorker
from hsx.gpu_consumer.writer import remove_orphaned_temp_files
from hsx.job import JobSpec, Layer
from hsx.model.layers import resolve_layers
from hsx.model.modelinfo import load_model_info
from hsx.storage import encodings
from hsx.storage.encodings import Encoding
from hsx.storage.fsutil import make_private_dirs
from hsx.storage.layout import SampleFiles
from hsx.storage.spool import plan_folder, remove_plan_folder, remove_stale_plans, warn_spool_room
from hsx.wire import schemas, topology
from hsx.wire.events import EventPublisher, WorkerState
from hsx.wire.exhausted import reap_exhausted
from hsx.wire.health import Health, serving
from hsx.wire.lifecycle import exit_now
from hsx.wire.load import spool_free
from hsx.wire.worker import JobEnd, JobWatch, heartbeats, job_session, until_done, watching, worker_exit_code

log = structlog.get_logger("hsx.gpu_consumer")


def _warm_up(loaded) -> None:
    """The first forward: kernels loaded, autotuned, and with compiling on, compiled (or found
    not to compile: eager then, gpu_consumer/compiling.py). Two samples of different lengths, so
    that the batch is padded and neither of [B, P] is 1 (which torch.compile would specialise on
    and compile again for the first real batch)."""
    from hsx.gpu_consumer.extract import device_failed, extract_samples

    warm = [
        schemas.Sample(index=-1 - i, source_id="warmup", input_ids=[loaded.pad_token_id] * length)
        for i, length in enumerate((16, 12))
    ]
    compiling.warm_up(loaded.model, lambda: extract_samples(loaded, warm), device_failed=device_failed)


@dataclass(frozen=True)
class ModelKey:
    """What a loaded model serves: a job whose spec names the same."""

    model: str
    revision: str  # as the spec records it: "local" for a folder
    layers: tuple[Layer, ...]
    encoding: Encoding  # its compute dtype, and what its forward hands over (extract.py)
    trust_remote_code: bool

    @classmethod
    def of(cls, files: SampleFiles) -> "ModelKey":
        spec = files.spec
        return cls(spec.model, spec.model_revision, tuple(spec.layers), files.encoding, spec.trust_remote_code)

    def __str__(self) -> str:
        return (
            f"ModelKey(model={self.model!r}, revision={self.revision!r}, layers={self.layers!r}, "
            f"dtype={self.encoding.stored!r}, trust_remote_code={self.trust_remote_code!r})"
        )


def _load_ready(key: ModelKey, *, device: str, compile_layers: bool) -> LoadedModel:
    """The model loaded and warmed up (on the device thread)."""
    loaded = load_model(
        key.model,
        layers=list(key.layers),
        encoding=key.encoding,
        device=device,
        trust_remote_code=key.trust_remote_code,
        revision=None if key.revision == "local" else key.revision,
        compile_layers=compile_layers,
    )
    _warm_up(loaded)
    return loaded


def load_expected(expected: ExpectedModel, *, device: str, compile_layers: bool) -> tuple[ModelKey, LoadedModel]:
    """The model `hsx up` expects the job to name, its layers resolved as the producer resolves them."""
    info = load_model_info(expected.model, trust_remote_code=expected.trust_remote_code)
    layers = resolve_layers(expected.layers, info.num_layers, model=expected.model)
    # The dtype hsx up expects the spec to name, looked up before there is a spec.
    encoding = encodings.of_spec(expected.dtype)
    key = ModelKey(expected.model, info.revision, tuple(layers), encoding, expected.trust_remote_code)
    return key, _load_ready(key, device=device, compile_layers=compile_layers)


async def load_early(
    expected: ExpectedModel, forwards: DeviceThread, *, device: str, compile_layers: bool
) -> tuple[ModelKey, LoadedModel]:
    """`load_expected` on the device thread, once the model's folder is there (hsx up makes the
    demo's while its consumers start). The wait is the event loop's, so a consumer stopped
    meanwhile does not wait it out."""
    deadline = time.monotonic() + expected.made_within_s
    while not Path(expected.model).exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return await forwards.run(load_expected, expected, device=device, compile_layers=compile_layers)


async def model_for(
    files: SampleFiles, early: asyncio.Future | None, forwards: DeviceThread, *, device: str, compile_layers: bool
) -> LoadedModel:
    """The model the spec's files are made with: the one loaded before the spec was read if it is
    that one, else loaded now."""
    spec, wanted = files.spec, ModelKey.of(files)
    if early is not None:
        spec_read = time.monotonic()
        try:
            key, loaded = await early
        except Exception as exc:  # loaded again below, where the spec's model fails as it should
            log.warning("early_model_load_failed", error=f"{type(exc).__name__}: {exc}"[:300])
        else:
            if key == wanted:
                # waited_s: how long the spec waited for the load (0 when the producer was slower).
                log.info("early_model_kept", model=spec.model, waited_s=round(time.monotonic() - spec_read, 2))
                return loaded
            log.info("early_model_dropped", loaded=str(key), spec=str(wanted))
            del loaded
            gc.collect()
            if forwards.device.type == "cuda":
                torch.cuda.empty_cache()
    return await forwards.run(_load_ready, wanted, device=device, compile_layers=compile_layers)


# The reaper's steps are each idempotent, so one cut short at shutdown is redone by whoever reads
# the advisory next; a NATS outage must not hold the consumer's exit for its retry budget
# (REAPER_STOP_S, part of the consumer's grace period: gpu_consumer/grace.py).


async def _stop_reaper(reaper: asyncio.Task, stopping: asyncio.Event) -> None:
    if stopping.is_set():
        await asyncio.wait({reaper}, timeout=REAPER_STOP_S)
    if not reaper.done():  # the pull loop failed, or the reaper is waiting out an outage
        reaper.cancel()
    outcome = (await asyncio.gather(reaper, return_exceptions=True))[0]
    if isinstance(outcome, Exception):
        log.error("exhausted_reaper_failed", error=f"{type(outcome).__name__}: {outcome}")


def limit_host_threads(device) -> None:
    """On a GPU, one intra-op thread for the host's torch work: all of the arithmetic is on the
    device (float8 included), and the writer threads are the parallelism. torch's default, a
    thread per core, gives each writer thread its own OpenMP team, 8 writers x every core of a
    node that runs a consumer per GPU. On the CPU the forward needs them: left alone. Threads
    started later (the writers) take the new count; the device thread keeps its own, and does
    no CPU arithmetic on a GPU."""
    if device.type == "cuda":
        torch.set_num_threads(1)


def _stalled(worker: BatchWorker | None) -> str | None:
    stall = worker.stall if worker is not None else None
    if stall is None:
        return None
    return f"{stall.stage} of batch {stall.batch_id} running {stall.running_s():.0f} s, past its {stall.bound_s:.0f} s bound"


async def run(cfg: ConsumerConfig) -> int:
    device = usable_device(cfg.device)  # refused here, before a connection, a heartbeat or a probe
    health = Health(turn_bound_s=lambda: turn_bound_s(cfg))
    with serving(health, cfg.health_listen):
        return await _run(cfg, device, health)


def _checked_kernels(cfg: ConsumerConfig, loaded: LoadedModel) -> schemas.Kernels:
    """The kernels the loaded model runs (gpu_consumer/kernels.py); refused in one line when they
    are the slow ones and --allow-slow-kernels was not given."""
    kernels = kernel_report(
        loaded.model,
        compiled=compiling.compiled(loaded.model),
        compile_error=compiling.fallback_reason(loaded.model),
    )
    check_kernels(kernels, loaded.device.type, allow_slow=cfg.allow_slow_kernels)
    return kernels


def _log_ready(cfg: ConsumerConfig, spec: JobSpec, loaded: LoadedModel, kernels: schemas.Kernels) -> None:
    log.info(
        "consumer_ready",
        model=spec.model,
        layers=spec.layers,
        dtype=spec.dtype,
        device=str(loaded.device),
        # Which GPU cuda:0 is: hsx up shows each consumer its own alone.
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        attention=loaded.attention,
        compile_layers=kernels.compiled,
        kernels=report_fields(kernels),
        torch_threads=torch.get_num_threads(),
        node=cfg.node,
        spool=str(cfg.spool),
        until_done=cfg.until_done,
    )


async def _run(cfg: ConsumerConfig, device: torch.device, health: Health) -> int:
    started_at = time.time()
    make_private_dirs(cfg.spool)
    compile_layers = cfg.compiles(device.type)
    # Loaded, warmed up and run on one thread bound to the device; started before the spec is
    # read when the model is known (hsx up: while its producer plans).
    forwards = DeviceThread(device)
    abandoned: list[str] = []  # the worker's stalled stages left running at the stop
    early = None
    if cfg.expected_model is not None:
        early = asyncio.ensure_future(
            load_early(cfg.expected_model, forwards, device=cfg.device, compile_layers=compile_layers)
        )
        early.add_done_callback(lambda done: done.cancelled() or done.exception())  # read, if never awaited
    async with job_session(
        cfg.nats,
        cfg.job,
        name=f"hsx-consume-{cfg.job}-{cfg.instance}",
        wait_s=cfg.wait_for_job_s,
        consumer=cfg.instance,
    ) as session:
        if session is None:
            return STOPPED  # a signal came before the job's spec
        js, spec, stopping = session.js, session.spec, session.stopping
        health.watch_stop(stopping)
        # The job's files, its encoding looked up once: the model is loaded for it.
        files = SampleFiles.of(spec)
        warn_spool_room(cfg.spool, files, high_water=cfg.spool_high_water_bytes)
        events = EventPublisher(session.nc, js, cfg.job)
        worker: BatchWorker | None = None
        kernels: schemas.Kernels | None = None  # known once the model is loaded
        watch = JobWatch(session.kv, spec, stopping)

        def state() -> WorkerState:
            if worker is None:  # loading its model: the device is not asked yet (no CUDA context of ours)
                starting = schemas.WorkerLoad(
                    device=cfg.device, spool_free=spool_free(cfg.spool), spool_high_water=cfg.spool_high_water_bytes
                )
                return WorkerState(state="starting", kernels=kernels, load=starting)
            return dataclasses.replace(worker.heartbeat_state(), kernels=kernels)

        def in_hand() -> dict:
            if worker is None:
                return {"finishing": "model load", "model": spec.model}
            return {"finishing": worker.batches_in_hand() or "nothing"}

        stopping.in_hand = in_hand
        # Beating while the model loads (minutes for a large one), so that the consumer is seen
        # starting; a load that fails ends with the goodbye, so it leaves no silent worker.
        async with (
            watching(watch),
            heartbeats(events, cfg, service=SERVICE, stopping=stopping, state=state) as beat_now,
        ):
            loaded = await model_for(files, early, forwards, device=cfg.device, compile_layers=compile_layers)
            # Refused here, before any batch is taken: the goodbye leaves no live worker.
            kernels = _checked_kernels(cfg, loaded)
            # After the load, which may convert a checkpoint's dtype on the CPU with every core.
            limit_host_threads(device)
            folder = plan_folder(cfg.spool, spec.job, spec.plan_tag)
            orphans = await asyncio.to_thread(remove_orphaned_temp_files, folder, older_than=started_at)
            if orphans:
                log.info("spool_temp_files_removed", count=orphans, reason="left by a writer that was killed")
            if await watch.check():
                return JOB_FAILED  # deleted while the model loaded (JobLost on leaving `watching`)
            await asyncio.to_thread(remove_stale_plans, cfg.spool, spec)
            _log_ready(cfg, spec, loaded, kernels)
            durable = await topology.ensure_gpu_consumer(js, cfg.job, ack_wait_s=cfg.ack_wait_s)
            sub = await js.pull_subscribe_bind(durable=durable, stream=topology.BATCHES_STREAM)
            worker = BatchWorker(cfg, js, events, spec, loaded, stopping, watch=watch, forwards=forwards)
            worker.abandoned = abandoned
            end = JobEnd(js, watch, stopping, settled=worker.settled) if cfg.until_done else None
            reaper = asyncio.create_task(reap_exhausted(js, events, stopping))
            # Live while a turn of the loop keeps within its bound at this consumer's pace, for
            # the job's largest batch (its token budget), and nothing is stalled.
            health.turn_bound_s = lambda: turn_bound_s(
                cfg, forward_bound_s=worker.pace.bound_for_tokens(spec.token_budget)
            )
            health.stalled = lambda: _stalled(worker)
            health.ready()
            beat_now()  # no longer starting, and its kernels: seen now, not a heartbeat later
            try:
                async with until_done(end):
                    await pull_loop(worker, sub, cfg, stopping, health)
            finally:
                await _stop_reaper(reaper, stopping)
                await sub.unsubscribe()
                worker.close()
                forwards.close()
                if watch.lost:
                    await asyncio.to_thread(remove_plan_folder, folder, reason="the job was lost")
        log.info("consumer_stopped", **({"verdict": end.verdict} if end is not None and end.verdict else {}))
        code = worker_exit_code(end)
    if abandoned:
        # A hung forward or write cannot be joined, and the interpreter would wait for it at exit:
        # end here, everything else done (the goodbye sent, the connection drained).
        log.warning("exiting_past_hung_stages", stages=abandoned)
        exit_now(code)
    return code
