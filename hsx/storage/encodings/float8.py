"""float8: e4m3 values with one float32 scale per token and layer, quantized where the states
were computed (`on_device`: the consumer's forward quantizes a whole batch on the device before
the copy to the host, gpu_consumer/extract.py; `encode` quantizes states given as computed). In the file: `hidden_states` [T, k, H] float8 e4m3 and `hidden_states_scale` [T, k]
float32; value = hidden_states.float() * hidden_states_scale[..., None]. The forward runs in
bfloat16."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from hsx.storage.encodings.base import HIDDEN, Encoding, TensorShapes, Tolerance
from hsx.storage.encodings.plain import SCALE_TENSOR

if TYPE_CHECKING:
    import torch

FLOAT8 = "float8_e4m3"  # JobSpec.dtype and the files' `dtype` of float8 jobs
_FLOAT8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


class Float8States(NamedTuple):
    """A sample's states already quantized (by `quantize_float8`, on the device before the copy to
    the host): what the writer stores as they are."""

    values: torch.Tensor  # float8 e4m3 [T, k, H]
    scale: torch.Tensor  # float32 [T, k]

    @property
    def shape(self) -> torch.Size:
        """[T, k, H], as of the states they hold."""
        return self.values.shape


def quantize_float8(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., H] -> (float8 e4m3 values, float32 scales [...]); each token's vector of each layer
    is scaled so that its largest magnitude maps to the format's largest finite value.

    Runs where its input is: the consumer quantizes a whole batch [B, P, k, H] on the GPU before
    the copy to the host. Every step is exact or correctly rounded (max, negation, IEEE division,
    round-to-nearest-even to e4m3), so the bytes are the same on any device and for a batch as for
    each sample's rows alone. One float32 working copy: max(max x, -min x) is max |x| without an
    |x| copy, and the division and clamp are in place."""
    import torch

    values = hidden_states.to(torch.float32, copy=True)
    scale = torch.maximum(values.amax(dim=-1), values.amin(dim=-1).neg_()) / _FLOAT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values.div_(scale[..., None]).clamp_(-_FLOAT8_MAX, _FLOAT8_MAX)
    return values.to(torch.float8_e4m3fn), scale


def dequantize_float8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.float() * scale[..., None]


@dataclass(frozen=True, kw_only=True)
class Float8Encoding(Encoding):
    def on_device(self, states):
        # [B, P, k, H] e4m3 and [B, P, k] float32 scales cross to the host: half of bfloat16's bytes.
        return quantize_float8(states)

    def landed(self, hosts, row: int, length: int) -> Float8States:
        values, scale = hosts
        return Float8States(values[row, :length], scale[row, :length])

    def file_tensors(self, tokens: int, layers: int, hidden: int) -> TensorShapes:
        return {HIDDEN: ("float8_e4m3fn", [tokens, layers, hidden]), SCALE_TENSOR: ("float32", [tokens, layers])}

    def quantized(self, states) -> Float8States:
        if isinstance(states, Float8States):
            return states
        return Float8States(*quantize_float8(states))

    def encode(self, states):
        quantized = self.quantized(states)
        return {HIDDEN: quantized.values, SCALE_TENSOR: quantized.scale}

    def values(self, tensors):
        hidden, scale = tensors[HIDDEN], tensors.get(SCALE_TENSOR)
        if scale is None:
            raise ValueError(f"a float8 file without {SCALE_TENSOR}")
        if tuple(scale.shape) != tuple(hidden.shape[:-1]):
            raise ValueError(f"{SCALE_TENSOR} has shape {tuple(scale.shape)}, expected {tuple(hidden.shape[:-1])}")
        return dequantize_float8(hidden, scale.float())

    def header_dtype(self) -> str:
        return "F8_E4M3"

    def header_problems(self, header: dict, states: dict | None) -> dict[str, str]:
        scale = header.get(SCALE_TENSOR)
        sound = (
            isinstance(scale, dict)
            and scale.get("dtype") == "F32"
            and states is not None
            and scale.get("shape") == (states.get("shape") or [None])[:-1]
        )
        if sound:
            return {}
        found = "absent" if not isinstance(scale, dict) else f"{scale.get('dtype')} {scale.get('shape')}"
        return {SCALE_TENSOR: f"{SCALE_TENSOR} {found}, expected F32 [T, k]"}


FLOAT8_E4M3 = Float8Encoding(
    name="float8",
    stored=FLOAT8,
    compute="bfloat16",
    tolerance=Tolerance(measure="relative_error", limit=8e-2),
    help="e4m3 with a per-token scale",
)
