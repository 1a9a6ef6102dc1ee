"""What a failed forward leaves behind, and what ends it.

- Out of memory: every retry of a half starts with nothing of the failed forward alive (its
  frames, captures and tensors dropped before the halves run), without the cycle collector's
  help; a failed stage's exception does not keep its frames in a cycle with its task.

The memory checks run the extraction in this process with the tiny model and gc disabled, so
that only reference counting frees anything; tests/test_gpu.py checks the device memory itself.
"""

import asyncio
import gc
import weakref
from pathlib import Path

import torch
from test_fidelity import _spec

import hsx.gpu_consumer.extract as extract
from hsx.gpu_consumer.config import ConsumerConfig
from hsx.gpu_consumer.model import decoder_layers, load_model
from hsx.gpu_consumer.service import BatchWorker
from hsx.wire import schemas
from hsx.wire.natsconn import NatsSettings

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
    loaded = load_model(str(tiny_model("qwen3")), layers=LAYERS, dtype="float32", device="cpu")
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
    assert torch.allclose(states[5], alone, atol=1e-5)


def test_a_failed_stage_is_not_kept_alive_by_its_task(tiny_model):
    """BatchWorker._watched awaits the stage as a task: the exception it raises holds the
    watcher's frame, which held the task, which holds the exception. Without the cycle collector
    the failed forward's frames (and their device tensors) would live on."""
    model = tiny_model("qwen3")
    loaded = load_model(str(model), layers=LAYERS, dtype="float32", device="cpu")
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
