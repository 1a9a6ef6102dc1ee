"""The torch side of the sample-file format: the stored dtypes by name, and float8 storage.

Only what makes or reads tensors imports this (the consumer's writer, the reader, verify); the
format's bytes, keys and checks (hsx/storage/samplefile.py, layout.py) need no torch, so an
uploader or monitor node runs without it.
"""

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


def quantize_float8(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k, H] -> (float8 e4m3 values, float32 scales [T, k]); each token's vector of each layer
    is scaled so that its largest magnitude maps to the format's largest finite value."""
    values = hidden_states.float()
    scale = values.abs().amax(dim=-1) / _FLOAT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = (values / scale[..., None]).clamp(-_FLOAT8_MAX, _FLOAT8_MAX).to(torch.float8_e4m3fn)
    return quantized, scale


def dequantize_float8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.float() * scale[..., None]
