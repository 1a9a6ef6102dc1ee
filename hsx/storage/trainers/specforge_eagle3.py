"""`specforge-eagle3`: SpecForge's EAGLE-3 offline features, `input_ids` [T] int64, `loss_mask` [T]
int64, `aux_hidden_state` [1, T, 3H] (three decoder layers) and `hidden_state` [1, T, H] (the
post-norm final state, `final`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hsx.errors import HsxError
from hsx.job import FINAL, JobSpec
from hsx.storage.trainers.base import Sample
from hsx.storage.trainers.specforge import SpecForgeFormat

if TYPE_CHECKING:
    import torch


class SpecForgeEagle3(SpecForgeFormat):
    name = "specforge-eagle3"

    def trainer_layer_ids(self, spec: JobSpec) -> dict[str, list[int]]:
        layers = list(spec.layers)
        ints = [layer for layer in layers if layer != FINAL]
        if len(ints) != 3 or layers[-1] != FINAL or len(layers) != 4:
            raise HsxError(
                f"job {spec.job} has layers {layers}: SpecForge's EAGLE-3 reads three decoder layers and "
                "the final state; make the job with --layers eagle3 (or three layers then final)"
            )
        return {"aux_hidden_state_layer_ids": ints}

    def refusal(self, sample: Sample) -> str | None:
        return None

    def features(self, sample: Sample) -> dict[str, torch.Tensor]:
        hidden = sample.hidden_states
        tokens, width = hidden.shape[0], hidden.shape[-1]
        return {
            "input_ids": sample.input_ids,
            "loss_mask": sample.loss_mask,
            "aux_hidden_state": hidden[:, :3].reshape(1, tokens, 3 * width).contiguous(),
            "hidden_state": hidden[:, 3].reshape(1, tokens, width).contiguous(),
        }


SPECFORGE_EAGLE3 = SpecForgeEagle3()
