"""What a failed forward leaves behind, and what ends it.

- Out of memory: every retry of a half starts with nothing of the failed forward alive (its
  frames, captures and tensors dropped before the halves run), without the cycle collector's
  help; a failed stage's exception does not keep its frames in a cycle with its task.
- A dead device (torch.AcceleratorError: a device-side assert, an illegal address): the consumer
  exits non-zero at once, leaving the batch unacked for another consumer; nothing is
  dead-lettered.
- Non-finite states (NaN, Inf): the sample holding them is dead-lettered at once, naming it; the
  batch's other samples are written.

The memory checks run the extraction in this process with the tiny model and gc disabled, so
that only reference counting frees anything; tests/test_gpu.py checks the device memory itself.
"""

import asyncio
import gc
import json
import subprocess
import time
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_e2e_s3 import logs_of, produce, start_monitor, wait_until_done, write_dataset
from test_fidelity import _spec
from tolerance import assert_within, float32_states_bound

import hsx.gpu_consumer.extract as extract
from devkit.faults import NonFiniteFault
from hsx.gpu_consumer.config import ConsumerConfig
from hsx.gpu_consumer.model import load_model
from hsx.gpu_consumer.service import BatchWorker
from hsx.gpu_consumer.trunk import decoder_layers
from hsx.storage import encodings
from hsx.storage.encodings.float8 import FLOAT8
from hsx.storage.spool import spool_file
from hsx.wire import schemas, topology
from hsx.wire.events import EventPublisher
from hsx.wire.natsconn import NatsSettings, connect
from hsx.wire.pull import Taken

LAYERS = [1, 3]
VOCAB = 512  # tests/conftest.py TINY


def _samples(count: int, *, first: int = 0, length: int = 12, seed: int = 0) -> list[schemas.Sample]:
    generator = torch.Generator().manual_seed(seed)
    return [
        schemas.Sample(
            index=first + i,
            source_id=f"s{first + i}",
            input_ids=torch.randint(0, VOCAB, (length + i,), generator=generator).tolist(),
        )
        for i in range(count)
    ]


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


class _Uncollected:
    """gc off for the block: what a reference cycle holds stays alive, as it would on a busy
    consumer until the collector happens to run."""

    def __enter__(self):
        gc.collect()
        gc.disable()

    def __exit__(self, *_):
        gc.enable()


def test_each_oom_retry_starts_with_nothing_of_the_failed_forward_alive(tiny_model, monkeypatch):
    loaded = load_model(str(tiny_model("qwen3")), layers=LAYERS, encoding=encodings.of_spec("float32"), device="cpu")
    failed: list[weakref.ref] = []  # tensors of the forwards that ran out of memory
    alive_at_start: list[int] = []  # how many of them each forward found still alive

    def out_of_memory(_module, args, kwargs, output):
        # Deep in the forward, as on a device: the embeddings, the masks, the position
        # embeddings, layer 1's captured output (this layer's input) and this layer's output
        # exist, and a scratch tensor only this frame holds.
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.shape[0] > 2:
            scratch = torch.empty(4096)
            failed.extend(weakref.ref(t) for t in [*_tensors(args), *_tensors(kwargs), *_tensors(output), scratch])
            raise torch.OutOfMemoryError("test: out of memory in layer 2")

    def before_forward(samples, padded_tokens):
        alive_at_start.append(sum(ref() is not None for ref in failed))

    handle = decoder_layers(loaded.model)[2].register_forward_hook(out_of_memory, with_kwargs=True)
    monkeypatch.setattr(extract, "before_forward", before_forward)
    samples = _samples(8)
    try:
        with _Uncollected():
            states = extract.extract_samples(loaded, samples)
            alive_after = sum(ref() is not None for ref in failed)
    finally:
        handle.remove()
    # 8 fails, 4 fails, 2 + 2 run, 4 fails, 2 + 2 run: 7 forwards, 3 of them failed.
    assert len(alive_at_start) == 7 and len(failed) >= 3 * 4, (alive_at_start, len(failed))
    assert alive_at_start == [0] * 7 and alive_after == 0, alive_at_start
    assert not loaded.tap._captured
    alone = extract.extract_samples(loaded, samples[5:6])[0]
    assert [s.shape[0] for s in states] == [len(s.input_ids) for s in samples]
    bound = float32_states_bound(loaded.model.config, LAYERS, len(samples[5].input_ids))
    assert_within(states[5], alone, bound, "sample 5 against itself alone")


def test_a_failed_stage_is_not_kept_alive_by_its_task(tiny_model):
    """BatchWorker._watched awaits the stage as a task: the exception it raises holds the
    watcher's frame, which held the task, which holds the exception. Without the cycle collector
    the failed forward's frames (and their device tensors) would live on."""
    model = tiny_model("qwen3")
    loaded = load_model(str(model), layers=LAYERS, encoding=encodings.of_spec("float32"), device="cpu")
    samples = _samples(2)
    spec = _spec("tcycle", model, LAYERS, "float32", samples)
    batch = schemas.BatchDescriptor(job="tcycle", batch_id="tcycle-0", padded_len=13, samples=samples)
    cfg = ConsumerConfig(
        nats=NatsSettings(url="nats://unused:4222"),
        job="tcycle",
        device="cpu",
        spool=Path("/nonexistent"),
        instance="cycle-1",
    )
    refs: list[weakref.ref] = []

    def failing_stage():
        scratch = torch.ones(4096)
        refs.append(weakref.ref(scratch))
        raise RuntimeError("test: the stage failed")

    async def run() -> None:
        # A stage that ends within its bound touches neither NATS nor the spool.
        worker = BatchWorker(cfg, None, None, spec, loaded, asyncio.Event())
        try:
            await worker._watched(
                asyncio.to_thread(failing_stage), stage="forward", batch=batch, taken=None, bound_s=60, on_stall=None
            )
        except RuntimeError:
            pass
        worker.close()

    with _Uncollected():
        asyncio.run(run())
        alive = refs[0]() is not None
    assert refs and not alive


def test_a_device_error_ends_the_consumer_and_leaves_the_batch_unacked(
    hsx, hsx_service, nats_server, tiny_model, job_name, tmp_path
):
    """torch.AcceleratorError (injected on the CPU by HSX_TEST_DEVICE_ERROR_SAMPLE) leaves the
    CUDA context dead: every later batch would fail too. The consumer exits non-zero at once,
    without a nak, a retry or a dead letter; a healthy consumer does the batch after the ack wait."""
    write_dataset(tmp_path / "data.jsonl", 4, min_len=4, max_len=12, seed=5)
    out = tmp_path / "out"
    produce(
        hsx,
        job=job_name,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=256,
        max_seq_len=32,
        env=None,
    )
    spool = str(tmp_path / "spool")
    args = ("consume", "--job", job_name, "--device", "cpu", "--spool", spool, "--ack-wait", "3")
    failing = hsx_service(*args, "--retry-delay", "0.1", env={"HSX_TEST_DEVICE_ERROR_SAMPLE": "2"}, name="failing")
    try:
        code = failing.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the consumer went on after a device error\n{logs_of(failing)}")

    async def queued() -> tuple[int, int]:
        nc = await connect(NatsSettings(url=nats_server.url), name="test-device-error")
        info = await nc.jetstream().consumer_info(topology.BATCHES_STREAM, topology.gpu_durable(job_name))
        await nc.drain()
        return info.num_ack_pending + info.num_pending, info.num_redelivered

    # Not acked (nor nak'ed: no `batch_failed` below): held by the dead consumer until the ack
    # wait (a slow machine may pass it by now), then queued again, never delivered twice yet.
    assert asyncio.run(queued()) == (1, 0)
    log = Path(failing.log_path).read_text()
    assert code == 3, log[-3000:]
    failed = [json.loads(line) for line in log.splitlines() if '"device_failed"' in line]
    assert len(failed) == 1 and "AcceleratorError" in failed[0]["error"] and failed[0]["batch"], log[-3000:]
    assert '"batch_failed"' not in log and '"batch_done"' not in log
    assert "hsx: error: device cpu failed" in log
    assert json.loads(hsx("dead", "list", "--job", job_name, "--json").stdout) == []
    started = time.monotonic()
    healthy = hsx_service(*args, name="healthy")
    uploader = hsx_service("upload", "--job", job_name, "--spool", spool, name="uploader")
    wait_until_done(start_monitor(hsx_service, job_name, None), [healthy, uploader], timeout=90)
    print(f"DEVICE_ERROR healthy consumer done in {time.monotonic() - started:.1f} s")
    view = json.loads(hsx("status", "--job", job_name, "--json").stdout)
    assert view["done"] and view["samples_uploaded"] == 4 and view["dead_letters"] == 0, view


async def _compute_and_finish(url: str, model: Path, job: str, spool: Path, dtype: str, bad: NonFiniteFault):
    loaded = load_model(str(model), layers=LAYERS, encoding=encodings.of_spec(dtype), device="cpu")
    handle = decoder_layers(loaded.model)[0].register_forward_hook(bad.hook)
    samples = _samples(4, first=0, seed=3)
    spec = _spec(job, model, LAYERS, dtype, samples)
    nc = await connect(NatsSettings(url=url), name="test-non-finite")
    js = nc.jetstream()
    await topology.ensure_topology(js)
    descriptor = schemas.BatchDescriptor(
        job=job, batch_id=f"{job}-0", padded_len=max(len(s.input_ids) for s in samples), samples=samples
    )
    await js.publish(topology.batch_subject(job), schemas.encode(descriptor), headers={"Nats-Msg-Id": f"{job}-0"})
    durable = await topology.ensure_gpu_consumer(js, job)
    sub = await js.pull_subscribe_bind(durable=durable, stream=topology.BATCHES_STREAM)
    [msg] = await sub.fetch(1, timeout=5)
    cfg = ConsumerConfig(
        nats=NatsSettings(url=url), job=job, device="cpu", spool=spool, node="node-a", instance="nonfinite-1"
    )
    worker = BatchWorker(cfg, js, EventPublisher(nc, js, job), spec, loaded, asyncio.Event())
    try:
        computed = await worker.compute(Taken.of(msg, interval_s=cfg.in_progress_s))
        assert computed is not None, "the batch was not computed on its first delivery"
        await worker.finish(computed)
        info = await js.consumer_info(topology.BATCHES_STREAM, durable)
    finally:
        handle.remove()
        worker.close()
        await sub.unsubscribe()
        await nc.drain()
    return samples, spec, info


@pytest.mark.parametrize("dtype, value", [("bfloat16", "nan"), ("bfloat16", "inf"), (FLOAT8, "nan"), (FLOAT8, "-inf")])
def test_a_sample_with_non_finite_states_is_dead_lettered_naming_it(
    hsx, monkeypatch, nats_server, tiny_model, job_name, tmp_path, dtype, value
):
    """A NaN would make a float8 file's scale meaningless, an Inf turns its row into NaN, and a
    bfloat16/float16 file would store them as they are: sample 2's states are never written; it
    is dead-lettered on the batch's first delivery, naming it; samples 0, 1 and 3 are written."""
    bad = NonFiniteFault(2, value)
    monkeypatch.setattr(extract, "before_forward", bad.before_forward)
    model, spool = tiny_model("qwen3"), tmp_path / "spool"
    samples, spec, info = asyncio.run(_compute_and_finish(nats_server.url, model, job_name, spool, dtype, bad))
    assert info.num_ack_pending == 0 and info.num_pending == 0 and info.num_redelivered == 0, info
    letters = json.loads(hsx("dead", "list", "--job", job_name, "--json").stdout)
    assert len(letters) == 1 and letters[0]["samples"] == [2] and letters[0]["deliveries"] == 1, letters
    assert "sample 2" in letters[0]["error"] and "non-finite" in letters[0]["error"], letters[0]["error"]
    for sample in samples:
        path = spool_file(spool, job_name, spec.plan_tag, sample.index)
        if sample.index == 2:
            assert not path.exists()
            continue
        tensors = load_file(path)
        assert all(torch.isfinite(t.float()).all() for t in tensors.values()), sample.index
