"""One batch's forward: right-pad, run the tap, and cut each sample's rows out of the result.

Right padding with an attention mask keeps every real token's computation identical to running
the sample alone (causal attention and recurrent layers read only earlier positions). On an
out-of-memory error the batch is split in halves and each half retried, down to single samples;
the halves run only once nothing of the failed forward is left (its frames, its captures).

Every forward checks that each sample's states are finite (a NaN or Inf, e.g. a float16
overflow, would be stored as it is, or make a float8 scale meaningless): reduced on the device
and copied with the states, so it costs no sync of its own. Samples that fail it are named by
`NonFiniteStates`, which is final for them (the same sample gives the same states again).

A failure of the device itself (`device_failed`: a device-side assert, an illegal address) is
not the batch's: the CUDA context is dead for the process, and nothing here retries it.

Given a staging lease (gpu_consumer/staging.py), every forward copies its states into a host
buffer of that lease, and the states returned are views into those buffers: valid until the
lease is released, which the caller does once it has written them. Without one, each forward's
states are copied into host memory the caller owns.

Launching and landing are apart (`launch_samples` -> `InFlight.wait`): on CUDA the forward is
queued on the compute stream, an event recorded after it, and the copy to the host queued on a
copy stream of its own that waits for that event (`_copy_out`), with an event of its own when it
is done; `launch_samples` returns once all of that is queued, so the next batch's forward can be
queued behind this one while its copy runs. Only `InFlight.wait` blocks the host, on the copy's
event, when the bytes are needed. The device tensors the copy reads are marked as used by the copy
stream (`record_stream`): the caching allocator gives their memory to the compute stream again
only once the copy is done, though nothing here holds them. The lease's buffers are fenced by the
copy's event, so none goes back to the pool while a copy into it may still run. Off CUDA the
forward is done when it returns, and so is the copy.

What crosses to the host is the job's encoding's to say (`loaded.encoding.on_device`, and
`landed` for each sample's states): the states as computed, or, for float8, quantized where they
were computed, before the copy (`hsx.storage.encodings.float8.quantize_float8`: the same bytes as
quantizing on the host): one byte per value and a scale per token and layer cross to the host
instead of bfloat16's two bytes, and the writer threads have no arithmetic left to do. Nothing
here knows which encoding it is.
"""

import traceback
from collections.abc import Callable
from typing import Any

import structlog
import torch

from hsx.errors import HsxError
from hsx.exitcodes import DEVICE_FAILED
from hsx.gpu_consumer.model import LoadedModel
from hsx.gpu_consumer.staging import StagingLease
from hsx.wire.schemas import Sample

log = structlog.get_logger("hsx.gpu_consumer.extract")

# A seam for tests (devkit/faults.py installs a fault here: an out-of-memory error, a hung
# device): called with the samples and their padded token count before each forward.
before_forward: Callable[[list[Sample], int], None] | None = None

# torch.AcceleratorError (a RuntimeError) is what torch 2.13 raises for a CUDA runtime error; an
# older torch, without the class, raises a plain RuntimeError, as some extensions still do.
_ACCELERATOR_ERROR = getattr(torch, "AcceleratorError", None)
_DEVICE_ERROR_TEXTS = ("CUDA error", "Triton Error [CUDA]")


def device_failed(exc: BaseException) -> bool:
    """Whether `exc` is the device's failure rather than the batch's: torch.AcceleratorError, or a
    RuntimeError saying "CUDA error" (older torch, extensions). After a device-side assert or an
    illegal memory access the CUDA context is dead: every later batch of this process would fail
    too, and retrying here would dead-letter them all. Out of memory is not one (torch raises
    OutOfMemoryError, and the context lives on). Every AcceleratorError is taken for one, the
    few that leave the context usable (an invalid launch configuration) too: a restart costs a
    model load, and a batch that does it on every device is dead-lettered after its deliveries."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    if _ACCELERATOR_ERROR is not None and isinstance(exc, _ACCELERATOR_ERROR):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and "out of memory" not in text and any(t in text for t in _DEVICE_ERROR_TEXTS)


class DeviceFailed(HsxError):
    """The consumer's device failed (`device_failed`): the process exits DEVICE_FAILED (3) and its
    supervisor (`hsx up`, Slurm, Kubernetes) restarts it; the batch is left unacked."""

    exit_code = DEVICE_FAILED


class NonFiniteStates(Exception):
    """Some samples' states hold NaN or Inf: (sample, reason) for each."""

    def __init__(self, failed: list[tuple[Sample, str]]) -> None:
        super().__init__("; ".join(f"sample {sample.index}: {reason}" for sample, reason in failed))
        self.failed = failed


def _non_finite(stacked: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, P, k, H] states and [B, P] mask -> [B, k, 2]: whether a real token of the sample holds
    a NaN, an Inf, per selected layer. Reduced per token first (min and max carry both), so the
    device holds nothing the size of the states."""
    low, high = torch.aminmax(stacked, dim=-1)  # [B, P, k]; NaN where a value is NaN
    real = mask.bool().unsqueeze(-1)
    nan = (torch.isnan(high) & real).any(dim=1)
    inf = ((torch.isinf(high) | torch.isinf(low)) & real).any(dim=1)
    return torch.stack([nan, inf], dim=-1)


def _check_finite(loaded: LoadedModel, samples: list[Sample], flags: torch.Tensor) -> None:
    if not flags.any():
        return
    failed = []
    for sample, per_layer in zip(samples, flags.tolist()):
        found = [
            f"{kind} at layers {[layer for layer, hit in zip(loaded.tap.layers, per_layer) if hit[j]]}"
            for j, kind in enumerate(("NaN", "Inf"))
            if any(hit[j] for hit in per_layer)
        ]
        if found:
            failed.append((sample, f"non-finite hidden states ({'; '.join(found)}) computed in {loaded.dtype}"))
    raise NonFiniteStates(failed)


def _forget(exc: BaseException) -> None:
    """Clear the locals of every finished frame in `exc`'s tracebacks (and its chained ones'):
    those frames hold the failed forward's tensors (embeddings, masks, q/k/v, on the device) for
    as long as the exception lives, and a frame holding the exception keeps it in a cycle."""
    pending, seen = [exc], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)  # a frame still running is left alone
        pending += [current.__cause__, current.__context__]


def pad_batch(samples: list[Sample], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, P] token ids and attention mask (1 on real tokens)."""
    padded_len = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), padded_len), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(samples), padded_len), dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : len(sample.input_ids)] = torch.tensor(sample.input_ids, dtype=torch.long)
        mask[row, : len(sample.input_ids)] = 1
    return ids, mask


# One sample's [T, k, H] states as the job's encoding hands them over (`Encoding.landed`): a
# tensor as computed, or float8's Float8States; the writer gives them to the same encoding.
States = Any


class Landing:
    """One forward's states on their way to the host: the host tensors (valid once `done` has
    happened: a CUDA event of the copy stream, None when the copy was synchronous), the
    non-finite flags copied with them, and the encoding that made them."""

    def __init__(self, samples: list[Sample], hosts: list[torch.Tensor], flags: torch.Tensor, done, encoding) -> None:
        self.samples, self.hosts, self.flags, self.done, self.encoding = samples, hosts, flags, done, encoding

    def landed(self) -> bool:
        return self.done is None or self.done.query()

    def states(self) -> list["States"]:
        return [self.encoding.landed(self.hosts, row, len(sample.input_ids)) for row, sample in enumerate(self.samples)]


class InFlight:
    """A batch's forwards (one, or one per part after OOM splits), queued, their copies on their
    way. `wait` blocks until every copy is done, checks the states are finite, and returns them."""

    def __init__(self, loaded: LoadedModel, parts: list[Landing], lease: StagingLease | None, mark: int) -> None:
        self.loaded, self.parts, self.lease, self.mark = loaded, parts, lease, mark

    def landed(self) -> bool:
        """Whether `wait` would return at once (every copy done)."""
        return all(part.landed() for part in self.parts)

    def wait(self) -> list["States"]:
        try:
            for part in self.parts:
                if part.done is not None:
                    part.done.synchronize()
            failed = []
            for part in self.parts:
                try:
                    _check_finite(self.loaded, part.samples, part.flags)
                except NonFiniteStates as exc:
                    failed += exc.failed
            if failed:
                raise NonFiniteStates(failed)
            return [states for part in self.parts for states in part.states()]
        except BaseException:
            # Nothing will read what these forwards copied (a device failure, non-finite states):
            # their buffers go back to the pool, once no copy into them can still run.
            if self.lease is not None:
                self.lease.release_since(self.mark)
            raise


# One copy stream per device, made on the device thread (bound to the device) at its first use.
_COPY_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def copy_stream(device: torch.device) -> "torch.cuda.Stream":
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COPY_STREAMS:
        _COPY_STREAMS[index] = torch.cuda.Stream(device=index)
    return _COPY_STREAMS[index]


def _copy_out(
    device: torch.device, tensors: list[torch.Tensor], flags: torch.Tensor, lease: StagingLease | None
) -> tuple[list[torch.Tensor], torch.Tensor, "torch.cuda.Event"]:
    """Queue the device-to-host copies of `tensors` and `flags` on the copy stream, after what the
    compute stream has queued so far; returns the host tensors, the host flags and the copy's event."""
    compute, copying = torch.cuda.current_stream(device), copy_stream(device)
    computed = torch.cuda.Event()
    computed.record(compute)
    copying.wait_event(computed)
    with torch.cuda.stream(copying):
        hosts = []
        for tensor in tensors:
            if lease is None:
                hosts.append(tensor.to("cpu", non_blocking=True))  # pinned by torch for the copy
            else:
                host = lease.take(tensor.shape, tensor.dtype)
                host.copy_(tensor, non_blocking=True)
                hosts.append(host)
        host_flags = flags.to("cpu", non_blocking=True)
    done = torch.cuda.Event()
    done.record(copying)
    for tensor in (*tensors, flags):
        # Allocated on the compute stream, read by the copy stream: their memory is not handed
        # to the compute stream again before the copy is done, whoever drops them first.
        tensor.record_stream(copying)
    if lease is not None:
        lease.fence(done)
    return hosts, host_flags, done


def _launch(loaded: LoadedModel, samples: list[Sample], lease: StagingLease | None) -> Landing:
    if before_forward is not None:
        before_forward(samples, len(samples) * max(len(s.input_ids) for s in samples))
    ids, mask = pad_batch(samples, loaded.pad_token_id)
    if loaded.device.type == "cuda":
        # From pageable memory the driver may wait for the stream before the copy: pinned, the
        # copy is queued behind the forward before it like everything else.
        ids, mask = ids.pin_memory(), mask.pin_memory()
    with torch.inference_mode():
        mask = mask.to(loaded.device, non_blocking=True)
        captured = loaded.tap.forward(ids.to(loaded.device, non_blocking=True), mask)
        # [B, P, k, H], one device-to-host copy for the whole batch.
        stacked = torch.stack(captured, dim=2).to(loaded.dtype)
        del captured
        flags = _non_finite(stacked, mask)
        tensors = list(loaded.encoding.on_device(stacked))
        del stacked
        if loaded.device.type == "cuda":
            hosts, host_flags, done = _copy_out(loaded.device, tensors, flags, lease)
            return Landing(samples, hosts, host_flags, done, loaded.encoding)
        if lease is None:
            hosts = [tensor.to("cpu") for tensor in tensors]
        else:
            hosts = [lease.take(tensor.shape, tensor.dtype).copy_(tensor) for tensor in tensors]
        return Landing(samples, hosts, flags.to("cpu"), None, loaded.encoding)


def extract_isolating(
    loaded: LoadedModel, samples: list[Sample], *, lease: StagingLease | None = None
) -> tuple[list[tuple[Sample, States]], list[tuple[Sample, str]]]:
    """For a batch that keeps failing: bisect it so that only the samples that fail on their own
    are given up. Returns (sample, states) for those that work and (sample, error) for the rest.
    Samples whose states are not finite are given up as soon as they are found, and the rest run
    without them; a device failure is raised (no sample is to blame)."""
    try:
        return list(zip(samples, extract_samples(loaded, samples, lease=lease))), []
    except NonFiniteStates as exc:
        given_up = exc.failed
    except Exception as exc:
        if device_failed(exc):
            raise
        if len(samples) == 1:
            return [], [(samples[0], f"{type(exc).__name__}: {exc}")]
        given_up = None
    if given_up is not None:
        named = {sample.index for sample, _ in given_up}
        rest = [sample for sample in samples if sample.index not in named]
        good, bad = extract_isolating(loaded, rest, lease=lease) if rest else ([], [])
        return good, given_up + bad
    half = len(samples) // 2
    # The first half's states stay in their leased buffers while the second half runs.
    good_a, bad_a = extract_isolating(loaded, samples[:half], lease=lease)
    good_b, bad_b = extract_isolating(loaded, samples[half:], lease=lease)
    return good_a + good_b, bad_a + bad_b


def extract_samples(loaded: LoadedModel, samples: list[Sample], *, lease: StagingLease | None = None) -> list[States]:
    """Hidden states [T, k, H] per sample, as the job's encoding hands them over (float8's
    `Float8States`), in the order given; splits the batch on OOM. Launched and waited for at once
    (`launch_samples`)."""
    return launch_samples(loaded, samples, lease=lease).wait()


def launch_samples(loaded: LoadedModel, samples: list[Sample], *, lease: StagingLease | None = None) -> InFlight:
    """Queue the batch's forward and its copy to the host (`InFlight.wait` for the states),
    splitting it on OOM: an out-of-memory error is raised when memory is asked for, while the
    forward is queued, so the halves are launched here too."""
    mark = lease.mark() if lease is not None else 0
    return InFlight(loaded, _launch_parts(loaded, samples, lease), lease, mark)


def _launch_parts(loaded: LoadedModel, samples: list[Sample], lease: StagingLease | None) -> list[Landing]:
    mark = lease.mark() if lease is not None else 0
    try:
        try:
            return [_launch(loaded, samples, lease)]
        except torch.OutOfMemoryError as exc:
            if len(samples) == 1:
                raise
            # The halves run below, once this clause is left: inside it, the exception (and
            # with it every frame of the failed forward and its device tensors) is alive, and
            # empty_cache() could free nothing.
            _forget(exc)
        if lease is not None:
            lease.release_since(mark)  # nothing will read what the failed forward copied
        if loaded.device.type == "cuda":
            torch.cuda.empty_cache()
        half = len(samples) // 2
        log.warning("batch_split_on_oom", samples=len(samples), halves=[half, len(samples) - half])
        # The first half's states stay in their leased buffers while the second half runs.
        first = _launch_parts(loaded, samples[:half], lease)
        return first + _launch_parts(loaded, samples[half:], lease)
    except BaseException as exc:
        # Whoever catches this (a retry, a bisection) must not find the failed forward's
        # tensors still held by its frames.
        _forget(exc)
        # Nothing will read what this call copied: its buffers go back to the pool (once no copy
        # into them can run), so a lease holds only the states that will be written.
        if lease is not None:
            lease.release_since(mark)
        raise
