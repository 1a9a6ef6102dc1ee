"""One batch's forward: right-pad, run the tap, and cut each sample's rows out of the result.

Right padding with an attention mask keeps every real token's computation identical to running
the sample alone (causal attention and recurrent layers read only earlier positions). On an
out-of-memory error the batch is split in halves and each half retried, down to single samples.
"""

import os

import structlog
import torch

from gpu_consumer.model import LoadedModel
from hsx.schemas import Sample

log = structlog.get_logger("hsx.gpu_consumer.extract")

# Test-only switch: raise an out-of-memory error for any forward of more padded tokens than this,
# so the split path runs on CPU machines.
_FAKE_OOM_ABOVE = int(os.environ.get("HSX_TEST_OOM_ABOVE_TOKENS", "0") or 0)


def pad_batch(samples: list[Sample], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, P] token ids and attention mask (1 on real tokens)."""
    padded_len = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), padded_len), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(samples), padded_len), dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : len(sample.input_ids)] = torch.tensor(sample.input_ids, dtype=torch.long)
        mask[row, : len(sample.input_ids)] = 1
    return ids, mask


def _forward(loaded: LoadedModel, samples: list[Sample]) -> list[torch.Tensor]:
    padded_len = max(len(s.input_ids) for s in samples)
    if _FAKE_OOM_ABOVE and len(samples) * padded_len > _FAKE_OOM_ABOVE:
        raise torch.OutOfMemoryError(f"test switch: {len(samples)}x{padded_len} tokens > {_FAKE_OOM_ABOVE}")
    ids, mask = pad_batch(samples, loaded.pad_token_id)
    with torch.inference_mode():
        captured = loaded.tap.forward(ids.to(loaded.device, non_blocking=True), mask.to(loaded.device, non_blocking=True))
        # [B, P, k, H], one device-to-host copy for the whole batch.
        stacked = torch.stack(captured, dim=2).to(loaded.dtype)
        if loaded.staging is not None:
            host = loaded.staging.take(stacked.shape, stacked.dtype)
            host.copy_(stacked, non_blocking=True)
            torch.cuda.current_stream(loaded.device).synchronize()
        else:
            host = stacked.to("cpu")
    return [host[row, : len(sample.input_ids)] for row, sample in enumerate(samples)]


def _own(loaded: LoadedModel, states: list[torch.Tensor]) -> list[torch.Tensor]:
    """States that outlive further forwards: views into a staging slot are copied out."""
    return [state.clone() for state in states] if loaded.staging is not None else states


def extract_isolating(
    loaded: LoadedModel, samples: list[Sample]
) -> tuple[list[tuple[Sample, torch.Tensor]], list[tuple[Sample, str]]]:
    """For a batch that keeps failing: bisect it so that only the samples that fail on their own
    are given up. Returns (sample, states) for those that work and (sample, error) for the rest."""
    try:
        return list(zip(samples, extract_samples(loaded, samples))), []
    except Exception as exc:
        if len(samples) == 1:
            return [], [(samples[0], f"{type(exc).__name__}: {exc}")]
    half = len(samples) // 2
    good_a, bad_a = extract_isolating(loaded, samples[:half])
    good_a = list(zip([s for s, _ in good_a], _own(loaded, [t for _, t in good_a])))
    good_b, bad_b = extract_isolating(loaded, samples[half:])
    return good_a + good_b, bad_a + bad_b


def extract_samples(loaded: LoadedModel, samples: list[Sample]) -> list[torch.Tensor]:
    """Hidden states [T, k, H] per sample, in the order given; splits the batch on OOM."""
    try:
        return _forward(loaded, samples)
    except torch.OutOfMemoryError:
        if len(samples) == 1:
            raise
        if loaded.device.type == "cuda":
            torch.cuda.empty_cache()
        half = len(samples) // 2
        log.warning("batch_split_on_oom", samples=len(samples), halves=[half, len(samples) - half])
        first = _own(loaded, extract_samples(loaded, samples[:half]))
        return first + extract_samples(loaded, samples[half:])
