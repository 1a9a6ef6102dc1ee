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
states are copied into ordinary host memory the caller owns.

With `float8`, the batch is quantized where it was computed, before the copy
(`hsx.storage.tensors.quantize_float8`: the same bytes as quantizing on the host): one byte per
value and a scale per token and layer cross to the host instead of bfloat16's two bytes, and the
writer threads have no arithmetic left to do. Each sample's states are then `Float8States`.
"""

import traceback
from collections.abc import Callable

import structlog
import torch

from hsx.errors import HsxError
from hsx.gpu_consumer.model import LoadedModel
from hsx.gpu_consumer.staging import StagingLease
from hsx.storage.tensors import Float8States, quantize_float8
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
    """The consumer's device failed (`device_failed`): the process exits with code 3 and its
    supervisor (`hsx up`, Slurm, Kubernetes) restarts it; the batch is left unacked."""

    exit_code = 3


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


States = torch.Tensor | Float8States  # one sample's [T, k, H], as computed or quantized


def _to_host(tensor: torch.Tensor, lease: StagingLease | None, cuda: bool) -> torch.Tensor:
    if lease is None:
        return tensor.to("cpu")
    host = lease.take(tensor.shape, tensor.dtype)
    host.copy_(tensor, non_blocking=cuda)
    return host


def _forward(loaded: LoadedModel, samples: list[Sample], lease: StagingLease | None, float8: bool) -> list[States]:
    if before_forward is not None:
        before_forward(samples, len(samples) * max(len(s.input_ids) for s in samples))
    ids, mask = pad_batch(samples, loaded.pad_token_id)
    with torch.inference_mode():
        mask = mask.to(loaded.device, non_blocking=True)
        captured = loaded.tap.forward(ids.to(loaded.device, non_blocking=True), mask)
        # [B, P, k, H], one device-to-host copy for the whole batch.
        stacked = torch.stack(captured, dim=2).to(loaded.dtype)
        cuda = loaded.device.type == "cuda"
        # Issued before the states' copy: the sync that copy needs (below, or the blocking copy
        # without a lease) covers this one too (pinned by torch, as non_blocking to the host is).
        flags = _non_finite(stacked, mask).to("cpu", non_blocking=True)
        if float8:
            values, scale = quantize_float8(stacked)  # [B, P, k, H] e4m3, [B, P, k] float32
            host_values, host_scale = _to_host(values, lease, cuda), _to_host(scale, lease, cuda)
        else:
            host = _to_host(stacked, lease, cuda)
        if cuda and lease is not None:
            torch.cuda.current_stream(loaded.device).synchronize()
    _check_finite(loaded, samples, flags)
    if float8:
        return [
            Float8States(host_values[row, : len(sample.input_ids)], host_scale[row, : len(sample.input_ids)])
            for row, sample in enumerate(samples)
        ]
    return [host[row, : len(sample.input_ids)] for row, sample in enumerate(samples)]


def extract_isolating(
    loaded: LoadedModel, samples: list[Sample], *, lease: StagingLease | None = None, float8: bool = False
) -> tuple[list[tuple[Sample, States]], list[tuple[Sample, str]]]:
    """For a batch that keeps failing: bisect it so that only the samples that fail on their own
    are given up. Returns (sample, states) for those that work and (sample, error) for the rest.
    Samples whose states are not finite are given up as soon as they are found, and the rest run
    without them; a device failure is raised (no sample is to blame)."""
    try:
        return list(zip(samples, extract_samples(loaded, samples, lease=lease, float8=float8))), []
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
        good, bad = extract_isolating(loaded, rest, lease=lease, float8=float8) if rest else ([], [])
        return good, given_up + bad
    half = len(samples) // 2
    # The first half's states stay in their leased buffers while the second half runs.
    good_a, bad_a = extract_isolating(loaded, samples[:half], lease=lease, float8=float8)
    good_b, bad_b = extract_isolating(loaded, samples[half:], lease=lease, float8=float8)
    return good_a + good_b, bad_a + bad_b


def extract_samples(
    loaded: LoadedModel, samples: list[Sample], *, lease: StagingLease | None = None, float8: bool = False
) -> list[States]:
    """Hidden states [T, k, H] per sample (`Float8States` with `float8`), in the order given;
    splits the batch on OOM."""
    mark = lease.mark() if lease is not None else 0
    try:
        try:
            return _forward(loaded, samples, lease, float8)
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
        first = extract_samples(loaded, samples[:half], lease=lease, float8=float8)
        return first + extract_samples(loaded, samples[half:], lease=lease, float8=float8)
    except BaseException as exc:
        # Whoever catches this (a retry, a bisection) must not find the failed forward's
        # tensors still held by its frames.
        _forget(exc)
        # Nothing will read what this call copied: its buffers go back to the pool now, so a
        # lease holds only the states that will be written.
        if lease is not None:
            lease.release_since(mark)
        raise
