"""The consumer's device path, checked where it is not CUDA-specific (tests/test_gpu.py runs the
same on a GPU):

- float8 is quantized where the batch was computed, before the copy to the host
  (gpu_consumer/extract.py): the bytes stored are those the writer made from the bfloat16 states
  before that change (the former `quantize_float8`, kept here verbatim), file for file;
- every forward runs on one thread bound to the device (gpu_consumer/device_thread.py): a real
  BatchWorker against the session's nats-server, a tiny real model.
"""

import asyncio
import contextvars
import dataclasses
import threading

import torch
from test_fidelity import _spec

import hsx.gpu_consumer.extract as extract
from hsx.gpu_consumer.config import ConsumerConfig
from hsx.gpu_consumer.device_thread import DeviceThread
from hsx.gpu_consumer.model import load_model
from hsx.gpu_consumer.service import BatchWorker
from hsx.gpu_consumer.staging import HostStaging
from hsx.gpu_consumer.writer import write_sample_file
from hsx.storage import encodings
from hsx.storage.encodings.float8 import FLOAT8, Float8States, quantize_float8
from hsx.storage.layout import SampleFiles
from hsx.storage.spool import spool_file
from hsx.wire import schemas, topology
from hsx.wire.events import EventPublisher
from hsx.wire.natsconn import NatsSettings, connect
from hsx.wire.pull import Taken

LAYERS = [1, 3, 4]
_MAX = torch.finfo(torch.float8_e4m3fn).max


def _quantize_before(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hsx.storage.encodings.float8.quantize_float8 as it was when the writer threads quantized on the CPU."""
    values = hidden_states.float()
    scale = values.abs().amax(dim=-1) / _MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = (values / scale[..., None]).clamp(-_MAX, _MAX).to(torch.float8_e4m3fn)
    return quantized, scale


def _samples(lengths: list[int], seed: int = 0) -> list[schemas.Sample]:
    generator = torch.Generator().manual_seed(seed)
    return [
        schemas.Sample(index=i, source_id=f"s{i}", input_ids=torch.randint(0, 512, (n,), generator=generator).tolist())
        for i, n in enumerate(lengths)
    ]


def test_quantizing_a_batch_gives_each_samples_former_bytes():
    """Whole [B, P, k, H] batches, with the edge cases of a scale: zero rows, -0, infinities, NaN,
    magnitudes from 1e-30 to 1e30, in bf16, fp16 and fp32."""
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for _ in range(5):
            magnitudes = 10.0 ** torch.randint(-30, 30, (3, 11, 4, 1), generator=generator).float()
            batch = (torch.randn(3, 11, 4, 96, generator=generator) * magnitudes).to(dtype)
            batch[0, 0, 0] = 0
            batch[0, 1, 1] = -0.0
            batch[1, 2, 0, 5] = float("inf")
            batch[1, 3, 2, 7] = float("-inf")
            batch[2, 4, 3, 1] = float("nan")
            values, scale = quantize_float8(batch)
            for row, length in enumerate((11, 7, 4)):  # each sample's rows, as the writer had them
                before_values, before_scale = _quantize_before(batch[row, :length])
                assert torch.equal(values[row, :length].view(torch.uint8), before_values.view(torch.uint8)), dtype
                assert torch.equal(scale[row, :length].view(torch.int32), before_scale.view(torch.int32)), dtype


def test_float8_files_from_the_forward_are_the_files_the_writer_made(tiny_model, tmp_path):
    """A real tiny model, one padded batch, staged as the consumer stages it: the float8 files
    written from states quantized in the forward are byte for byte those written from its
    bfloat16 states quantized by the writer as before."""
    path = tiny_model("qwen3")
    loaded = load_model(str(path), layers=LAYERS, encoding=encodings.of_spec(FLOAT8), device="cpu")
    assert loaded.dtype == torch.bfloat16
    samples = _samples([5, 17, 30, 9])
    spec = _spec("f8", path, LAYERS, FLOAT8, samples)
    staging = HostStaging(pin=False)
    lease = staging.lease()
    quantized = extract.extract_samples(loaded, samples, lease=lease)
    # The same forward, its states handed over as computed: what the writer quantized before.
    states = extract.extract_samples(dataclasses.replace(loaded, encoding=encodings.by_name("bfloat16")), samples)
    assert all(isinstance(q, Float8States) for q in quantized)
    for sample, q, bf16 in zip(samples, quantized, states):
        ours = write_sample_file(
            spool=tmp_path / "device",
            files=SampleFiles.of(spec),
            node="n",
            batch_id="b",
            sample=sample,
            hidden_states=q,
        )
        theirs = write_sample_file(
            spool=tmp_path / "host",
            files=SampleFiles.of(spec),
            node="n",
            batch_id="b",
            sample=sample,
            hidden_states=bf16,
        )
        before_values, before_scale = _quantize_before(bf16)
        assert torch.equal(q.values.view(torch.uint8), before_values.view(torch.uint8))
        assert torch.equal(q.scale, before_scale)
        assert ours.digest == theirs.digest and ours.size == theirs.size
        ours_bytes = spool_file(tmp_path / "device", "f8", spec.plan_tag, sample.index).read_bytes()
        theirs_bytes = spool_file(tmp_path / "host", "f8", spec.plan_tag, sample.index).read_bytes()
        assert ours_bytes == theirs_bytes
    # Values and scales both came through the lease: 1 byte per value, 4 per token and layer.
    padded = len(samples) * 30 * len(LAYERS)
    assert lease.nbytes >= padded * 64 + padded * 4
    lease.release()
    assert staging.leased_bytes == 0


def test_the_device_thread_binds_itself_once_and_runs_everything(monkeypatch):
    """On a CUDA device the thread calls torch.cuda.set_device before running anything (recorded
    here: no GPU); every call then runs on that thread, with the caller's contextvars."""
    bound: list[tuple[int, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: bound.append((threading.get_ident(), device)))
    forwards = DeviceThread("cuda:1")
    field = contextvars.ContextVar("field")

    async def main() -> list[tuple[int, str]]:
        field.set("batch-7")
        return [await forwards.run(lambda: (threading.get_ident(), field.get())) for _ in range(4)]

    try:
        ran = asyncio.run(main())
    finally:
        forwards.close()
    assert bound == [(forwards.bound_thread, torch.device("cuda:1"))]
    assert {ident for ident, _ in ran} == {forwards.bound_thread} != {threading.get_ident()}
    assert {value for _, value in ran} == {"batch-7"}
    off_cuda = DeviceThread("cpu")
    try:
        assert asyncio.run(off_cuda.run(threading.get_ident)) == off_cuda.bound_thread
    finally:
        off_cuda.close()
    assert len(bound) == 1  # nothing to bind off CUDA


async def _computed_on(url: str, loaded, spec, forwards: DeviceThread | None, spool) -> list[int]:
    """Three batches through a real BatchWorker's compute and finish; the thread of each forward."""
    threads: list[int] = []
    nc = await connect(NatsSettings(url=url), name="test-device-thread")
    js = nc.jetstream()
    await topology.ensure_topology(js)
    samples = _samples([6, 12, 9, 4, 15, 8])
    for n in range(3):
        batch = samples[2 * n : 2 * n + 2]
        descriptor = schemas.BatchDescriptor(
            job=spec.job, batch_id=f"{spec.job}-{n}", padded_len=max(len(s.input_ids) for s in batch), samples=batch
        )
        await js.publish(topology.batch_subject(spec.job), schemas.encode(descriptor))
    durable = await topology.ensure_gpu_consumer(js, spec.job)
    sub = await js.pull_subscribe_bind(durable=durable, stream=topology.BATCHES_STREAM)
    cfg = ConsumerConfig(
        nats=NatsSettings(url=url),
        job=spec.job,
        device="cpu",
        spool=spool,
        node="node-a",
        instance="thread-1",
        spool_high_water_bytes=1 << 60,
    )
    worker = BatchWorker(cfg, js, EventPublisher(nc, js, spec.job), spec, loaded, asyncio.Event(), forwards=forwards)
    extract.before_forward = lambda _samples, _tokens: threads.append(threading.get_ident())
    try:
        for _ in range(3):
            [msg] = await sub.fetch(1, timeout=5)
            computed = await worker.compute(Taken.of(msg, interval_s=cfg.in_progress_s))
            assert computed is not None
            await worker.finish(computed)
    finally:
        extract.before_forward = None
        worker.close()
        await sub.unsubscribe()
        await nc.drain()
    return threads + [worker.forwards.bound_thread]


def test_a_workers_forwards_all_run_on_its_device_thread(nats_server, tiny_model, job_name, tmp_path):
    """The consumer's own thread (given, as main.py gives the one that loaded the model) or, when
    none is given, one of the worker's: every forward on it, none on the event loop's thread or
    asyncio's default pool."""
    path = tiny_model("qwen3")
    loaded = load_model(str(path), layers=LAYERS, encoding=encodings.of_spec("float32"), device="cpu")
    given = DeviceThread("cpu")
    try:
        for forwards, job in ((given, job_name), (None, f"{job_name}b")):
            spec = _spec(job, path, LAYERS, "float32", _samples([6, 12, 9, 4, 15, 8]))
            *threads, bound = asyncio.run(_computed_on(nats_server.url, loaded, spec, forwards, tmp_path / job))
            assert len(threads) == 3 and set(threads) == {bound} != {threading.get_ident()}
            if forwards is not None:
                assert bound == given.bound_thread
    finally:
        given.close()
