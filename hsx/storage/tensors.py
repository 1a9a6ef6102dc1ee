"""The torch side of the sample-file format: the stored dtypes by name, and float8 storage.

Only what makes or reads tensors imports this (the consumer's writer, the reader, verify); the
format's bytes, keys and checks (hsx/storage/samplefile.py, layout.py) need no torch, so an
uploader or monitor node runs without it.
"""

from typing import NamedTuple

import torch

from hsx.storage.layout import FLOAT8
from hsx.storage.layout import SCALE_TENSOR as SCALE_TENSOR  # named in layout.py, which headers are checked by

# Metadata `dtype` (the job's storage dtype) -> the dtype of the stored `hidden_states` tensor.
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    FLOAT8: torch.float8_e4m3fn,
}
_FLOAT8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


class Float8States(NamedTuple):
    """A sample's states already quantized (by `quantize_float8`, on the device before the copy to
    the host): what the writer stores as they are."""

    values: torch.Tensor  # float8 e4m3 [T, k, H]
    scale: torch.Tensor  # float32 [T, k]


def quantize_float8(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., H] -> (float8 e4m3 values, float32 scales [...]); each token's vector of each layer
    is scaled so that its largest magnitude maps to the format's largest finite value.

    Runs where its input is: the consumer quantizes a whole batch [B, P, k, H] on the GPU before
    the copy to the host. Every step is exact or correctly rounded (max, negation, IEEE division,
    round-to-nearest-even to e4m3), so the bytes are the same on any device and for a batch as for
    each sample's rows alone. One float32 working copy: max(max x, -min x) is max |x| without an
    |x| copy, and the division and clamp are in place."""
    values = hidden_states.to(torch.float32, copy=True)
    scale = torch.maximum(values.amax(dim=-1), values.amin(dim=-1).neg_()) / _FLOAT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values.div_(scale[..., None]).clamp_(-_FLOAT8_MAX, _FLOAT8_MAX)
    return values.to(torch.float8_e4m3fn), scale


def dequantize_float8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.float() * scale[..., None]
