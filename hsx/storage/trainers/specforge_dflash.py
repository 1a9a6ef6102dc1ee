"""`specforge-dflash`: SpecForge's DFlash offline features, `input_ids` [T] int64, `loss_mask` [T]
int64 and `hidden_states` [T, k*H], the job's k decoder layers concatenated in order. SpecForge's
reader raises on a sample without two adjacent supervised tokens, so such a sample is left out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hsx.errors import HsxError
from hsx.job import FINAL, JobSpec
from hsx.storage.trainers.base import Sample
from hsx.storage.trainers.specforge import SpecForgeFormat

if TYPE_CHECKING:
    import torch


def has_adjacent_supervised(loss_mask: torch.Tensor) -> bool:
    """SpecForge's DFlash reader needs two consecutive supervised tokens in a sample."""
    mask = loss_mask.bool()
    return bool((mask[1:] & mask[:-1]).any()) if mask.numel() > 1 else False


class SpecForgeDFlash(SpecForgeFormat):
    name = "specforge-dflash"

    def trainer_layer_ids(self, spec: JobSpec) -> dict[str, list[int]]:
        layers = list(spec.layers)
        if FINAL in layers:
            raise HsxError(
                f"job {spec.job} has layers {layers}: SpecForge's DFlash reads decoder layers only, not "
                "'final'; make the job with --layers dflash:N (N = the draft's layers)"
            )
        return {"target_layer_ids": layers}

    def refusal(self, sample: Sample) -> str | None:
        if not has_adjacent_supervised(sample.loss_mask):
            return "no two consecutive supervised tokens (SpecForge's DFlash reader raises on it)"
        return None

    def features(self, sample: Sample) -> dict[str, torch.Tensor]:
        hidden = sample.hidden_states
        return {
            "input_ids": sample.input_ids,
            "loss_mask": sample.loss_mask,
            "hidden_states": hidden.reshape(hidden.shape[0], -1).contiguous(),
        }


SPECFORGE_DFLASH = SpecForgeDFlash()
