"""Host staging buffers are leased per batch: batch N's files, written from its buffers while
batch N+1's forward runs, hold N's own states even when N+1 splits on OOM or is bisected on its
last delivery (each of which copies into more than one buffer).

The overlap is the consumer's own: a real BatchWorker against the session's nats-server, a tiny
real model with the real staging pool (not pinned on the CPU), N's file writes held open on the
writer threads until N+1's forward has returned, then every written file compared with
transformers' `output_hidden_states[layer + 1]` of its sample run alone. With the former 2-slot
ring, N+1's second fragment landed in N's slot and N's files held N+1's states with a valid
checksum. tests/test_gpu.py runs the same cases on CUDA (pinned buffers).
"""

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_fidelity import _spec
from tolerance import assert_within, depth, float32_bound, float32_states_bound, reduction_length
from transformers import AutoModelForCausalLM

import hsx.gpu_consumer.extract as extract
from devkit.faults import oom_above
from hsx.gpu_consumer.config import ConsumerConfig
from hsx.gpu_consumer.model import load_model
from hsx.gpu_consumer.service import BatchWorker
from hsx.gpu_consumer.staging import HostStaging, block_bytes
from hsx.storage import encodings
from hsx.storage.spool import spool_file
from hsx.wire import schemas, topology
from hsx.wire.events import EventPublisher
from hsx.wire.natsconn import NatsSettings, connect
from hsx.wire.pull import Taken

LAYERS = [1, 3, 4]  # none is the last decoder layer: each is transformers' hidden_states[i + 1]
VOCAB = 512  # tests/conftest.py TINY
OOM_ABOVE = 64  # padded tokens per forward, with the fault devkit.faults.oom_above
SECOND = 2  # batch N+1's first sample index: batch N holds 0 and 1 (every index inside the plan)

# Batch N: 2 samples, 2 x 28 = 56 padded tokens, one forward, one buffer. Batch N+1 (4 samples):
# - oom_split: 4 x 30 tokens > 64: split into [12, 30] and [25, 16], two forwards, two buffers;
# - poison_last_delivery: on its 5th delivery, one sample holds a token id past the vocabulary:
#   the whole batch fails, then [12, 30] runs, [25, bad] fails, [25] runs (bisection);
# - oom_poison_last_delivery: on its 5th delivery, one sample is too long to run even alone: OOM
#   splits, a failed second half gives its first half's buffer back, then bisection.
CASES = {
    "oom_split": dict(lengths=[12, 30, 25, 16], poison=None, last_delivery=False, splits=True),
    "poison_last_delivery": dict(lengths=[12, 30, 25, 16], poison=3, last_delivery=True, splits=False),
    "oom_poison_last_delivery": dict(lengths=[12, 30, 70, 16], poison=None, last_delivery=True, splits=True),
}


def _samples(first_index: int, lengths: list[int], *, seed: int, poison: int | None = None) -> list[schemas.Sample]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for position, length in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        if position == poison:
            ids[length // 2] = VOCAB + 1000
        samples.append(
            schemas.Sample(index=first_index + position, source_id=f"s{first_index + position}", input_ids=ids)
        )
    return samples


def with_staging(loaded):
    """The model with the real staging pool: CUDA models have it; on the CPU it is added, unpinned."""
    return loaded if loaded.staging is not None else dataclasses.replace(loaded, staging=HostStaging(pin=False))


async def _overlap(url: str, model_path: Path, job: str, spool: Path, device: str, case: dict) -> dict:
    """Batch N computed, N's finish started with its writes held open, N+1 computed, N's writes
    let go, N+1 finished. Returns what the checks need."""
    loaded = with_staging(
        load_model(str(model_path), layers=LAYERS, encoding=encodings.of_spec("float32"), device=device)
    )
    first = _samples(0, [20, 28], seed=1)
    second = _samples(SECOND, case["lengths"], seed=2, poison=case["poison"])
    spec = _spec(job, model_path, LAYERS, "float32", first + second)
    nc = await connect(NatsSettings(url=url), name="test-staging")
    js = nc.jetstream()
    await topology.ensure_topology(js)
    for batch_id, samples in ((f"{job}-n", first), (f"{job}-n1", second)):
        descriptor = schemas.BatchDescriptor(
            job=job, batch_id=batch_id, padded_len=max(len(s.input_ids) for s in samples), samples=samples
        )
        await js.publish(topology.batch_subject(job), schemas.encode(descriptor), headers={"Nats-Msg-Id": batch_id})
    durable = await topology.ensure_gpu_consumer(js, job)
    sub = await js.pull_subscribe_bind(durable=durable, stream=topology.BATCHES_STREAM)
    [msg_n] = await sub.fetch(1, timeout=5)
    [msg_n1] = await sub.fetch(1, timeout=5)
    while case["last_delivery"] and msg_n1.metadata.num_delivered < topology.BATCH_MAX_DELIVER:
        await msg_n1.nak()
        [msg_n1] = await sub.fetch(1, timeout=5)  # N is held unacked: only N+1 can come back
    assert schemas.batch_decoder.decode(msg_n.data).batch_id == f"{job}-n"

    cfg = ConsumerConfig(
        nats=NatsSettings(url=url),
        job=job,
        device=device,
        spool=spool,
        node="node-a",
        instance="staging-1",
        spool_high_water_bytes=1 << 60,
        retry_delay_s=0.1,
    )
    worker = BatchWorker(cfg, js, EventPublisher(nc, js, job), spec, loaded, asyncio.Event())
    release_writes = threading.Event()
    entered: list[int] = []
    write_one = worker._write_one

    def held_write(batch_id, sample, hidden):
        if batch_id == f"{job}-n":
            entered.append(sample.index)
            assert release_writes.wait(timeout=60)
        return write_one(batch_id, sample, hidden)

    worker._write_one = held_write
    try:
        computed_n = await worker.compute(Taken.of(msg_n, interval_s=cfg.in_progress_s))
        assert computed_n is not None and not computed_n.failed
        finishing = asyncio.create_task(worker.finish(computed_n))
        deadline = time.monotonic() + 30
        while len(entered) < len(first):  # every write of N is open, none has read its states yet
            assert time.monotonic() < deadline and not finishing.done()
            await asyncio.sleep(0.01)
        computed_n1 = await worker.compute(Taken.of(msg_n1, interval_s=cfg.in_progress_s))
        assert computed_n1 is not None
        leased_during_overlap = loaded.staging.leased_bytes
    finally:
        release_writes.set()
    await finishing
    await worker.finish(computed_n1)
    worker.close()
    await sub.unsubscribe()
    await nc.drain()
    return dict(
        samples=first + second,
        failed=[s.index for s, _ in computed_n1.failed],
        staging=loaded.staging,
        leased_during_overlap=leased_during_overlap,
    )


def check_overlap(nats_server, tiny_model, job_name, tmp_path, monkeypatch, *, device: str, case: dict) -> None:
    monkeypatch.setattr(extract, "before_forward", oom_above(OOM_ABOVE) if case["splits"] else None)
    model_path = tiny_model("qwen3")
    spool = tmp_path / "spool"
    result = asyncio.run(_overlap(nats_server.url, model_path, job_name, spool, device, case))

    bad = (
        {SECOND + case["poison"]}
        if case["poison"] is not None
        else ({SECOND + 2} if case["lengths"][2] > OOM_ABOVE else set())
    )
    assert set(result["failed"]) == bad
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    checked = 0
    for sample in result["samples"]:
        path = spool_file(spool, job_name, _spec(job_name, model_path, LAYERS, "float32", []).plan_tag, sample.index)
        if sample.index in bad:
            assert not path.exists()
            continue
        stored = load_file(path)["hidden_states"]
        with torch.inference_mode():
            states = reference(torch.tensor([sample.input_ids], device=device), output_hidden_states=True).hidden_states
        assert stored.shape == (len(sample.input_ids), len(LAYERS), 64)
        n = reduction_length(reference.config, len(sample.input_ids))
        for j, layer in enumerate(LAYERS):
            expected = states[layer + 1][0].float().cpu()
            bound = float32_bound(n, depth(layer, reference.config.num_hidden_layers))
            assert_within(stored[:, j], expected, bound, f"sample {sample.index} layer {layer} against transformers")
        checked += 1
    assert checked == len(result["samples"]) - len(bad)
    # Both batches were leased at once during the overlap, and every lease was given back after.
    assert result["leased_during_overlap"] > 0
    assert result["staging"].leased_bytes == 0


@pytest.mark.parametrize("name", list(CASES))
def test_batch_files_written_during_the_next_batchs_split_forward_hold_their_own_states(
    nats_server, tiny_model, job_name, tmp_path, monkeypatch, name
):
    check_overlap(nats_server, tiny_model, job_name, tmp_path, monkeypatch, device="cpu", case=CASES[name])


def test_a_leased_buffer_is_never_handed_out_again_before_its_lease_is_released():
    pool = HostStaging(pin=False)
    shape = torch.Size([2, 8, 3, 16])
    held = pool.lease()
    kept = held.take(shape, torch.float32)
    kept.fill_(7.0)
    others = [pool.lease() for _ in range(3)]
    # Many takes from other leases, including ones that are released again: never held's buffer.
    for round_ in range(4):
        for lease in others:
            for size in (shape, torch.Size([1, 8, 3, 16]), torch.Size([4, 8, 3, 16])):
                got = lease.take(size, torch.float32)
                got.fill_(-1.0)
                start, end = got.data_ptr(), got.data_ptr() + got.numel() * 4
                assert end <= kept.data_ptr() or start >= kept.data_ptr() + kept.numel() * 4
            if round_ % 2:
                lease.release_since(0)
        assert torch.equal(kept, torch.full(shape, 7.0))
    for lease in others:
        lease.release()
    # Released, its buffer goes back to the pool and is reused by the next lease of that size.
    held.release()
    assert pool.leased_bytes == 0
    again = pool.lease().take(shape, torch.float32)
    assert again.data_ptr() == kept.data_ptr()
    with pytest.raises(RuntimeError):
        held.take(shape, torch.float32)
    # What the pool keeps is bounded: leased + free <= twice its largest buffer.
    assert pool.held_bytes <= 2 * block_bytes(torch.Size([4, 8, 3, 16]).numel() * 4)


def test_a_failed_forward_gives_its_buffers_back_and_the_lease_keeps_only_written_states(tiny_model, monkeypatch):
    """OOM splits with a sample that fails even alone: the split's first half ran (a buffer),
    then its second half failed: that buffer goes back to the pool at once; bisection then keeps
    one buffer per forward that worked, each holding exactly its samples' states."""
    monkeypatch.setattr(extract, "before_forward", oom_above(OOM_ABOVE))
    loaded = with_staging(
        load_model(str(tiny_model("qwen3")), layers=LAYERS, encoding=encodings.of_spec("float32"), device="cpu")
    )
    samples = _samples(10, CASES["oom_poison_last_delivery"]["lengths"], seed=2)
    lease = loaded.staging.lease()
    with pytest.raises(torch.OutOfMemoryError):
        extract.extract_samples(loaded, samples, lease=lease)
    assert lease.nbytes == 0 and loaded.staging.leased_bytes == 0 and loaded.staging.held_bytes > 0
    good, bad = extract.extract_isolating(loaded, samples, lease=lease)
    assert [s.index for s, _ in bad] == [12]
    # Forwards that worked: [12, 30] and [16]; each buffer its [B, P, k, H] float32 states'
    # bytes rounded up to a power of two (block_bytes).
    assert lease.nbytes == sum(block_bytes(b * p * len(LAYERS) * 64 * 4) for b, p in ((2, 30), (1, 16)))
    alone = {s.index: extract.extract_samples(loaded, [s])[0] for s, _ in good}  # no lease: owned copies
    for sample, states in good:
        bound = float32_states_bound(loaded.model.config, LAYERS, len(sample.input_ids))
        assert_within(states, alone[sample.index], bound, f"sample {sample.index} against itself alone")
    lease.release()
    assert loaded.staging.leased_bytes == 0


def test_the_pool_counts_the_blocks_the_host_allocator_really_holds():
    """torch's pinned allocator rounds each request up to a power of two: the pool asks for that
    size and counts it, so leased_bytes and held_bytes are what is held (a request of 1.25x its
    states' bytes was rounded again, up to 2.5x, while the pool counted 1.25x). tests/test_gpu.py
    checks the same figures against torch's own pinned-memory statistics."""
    assert [block_bytes(n) for n in (0, 1, 2, 3, 1000, 1024, 1025, 3 << 20)] == [1, 1, 2, 4, 1024, 1024, 2048, 4 << 20]
    pool = HostStaging(pin=False)
    lease = pool.lease()
    requests = [(torch.Size([3, 100, 5, 64]), torch.bfloat16), (torch.Size([3, 100, 5]), torch.float32)]
    for shape, dtype in requests:
        states = lease.take(shape, dtype)
        assert states.shape == shape and states.dtype == dtype
    expected = sum(block_bytes(shape.numel() * dtype.itemsize) for shape, dtype in requests)
    assert lease.nbytes == pool.leased_bytes == pool.held_bytes == expected == 262144 + 8192
    lease.release()
    assert pool.leased_bytes == 0 and pool.held_bytes == expected
    # A request that fits a free block (rounding is the headroom) takes it: nothing more is held.
    again = pool.lease()
    again.take(torch.Size([3, 110, 5, 64]), torch.bfloat16)
    assert pool.held_bytes == expected and again.nbytes == 262144
    again.release()


class _Copy:
    """What a buffer's copy is done at, passing when the test says (on CUDA: the copy stream's
    event, tests/test_gpu.py)."""

    def __init__(self, *, done: bool = False) -> None:
        self.passed = threading.Event()
        self.waited = 0
        if done:
            self.passed.set()

    def synchronize(self) -> None:
        self.waited += 1
        assert self.passed.wait(timeout=30)


def test_a_buffer_goes_back_to_the_pool_only_once_the_copy_into_it_is_done():
    """A forward that fails after an earlier part's copy was queued gives that part's buffer
    back: not before its copy's fence has passed, so no other batch can be handed a buffer that
    is still being written into. Only the fences of the buffers given back are waited for."""
    pool = HostStaging(pin=False)
    shape = torch.Size([2, 8, 3, 16])
    lease = pool.lease()
    lease.take(shape, torch.float32)
    kept = _Copy()
    lease.fence(kept)
    mark = lease.mark()
    lease.take(shape, torch.float32)
    pending = _Copy()
    lease.fence(pending)
    lease.take(shape, torch.float32)  # copied synchronously: no fence
    held = pool.leased_bytes
    releasing = threading.Thread(target=lease.release_since, args=(mark,))
    releasing.start()
    releasing.join(timeout=0.3)
    assert releasing.is_alive() and pool.leased_bytes == held, "a buffer went back while its copy ran"
    pending.passed.set()
    releasing.join(timeout=10)
    assert not releasing.is_alive() and pool.leased_bytes == held // 3
    assert (kept.waited, pending.waited) == (0, 1)
    kept.passed.set()
    lease.release()
    assert pool.leased_bytes == 0 and kept.waited == 1
