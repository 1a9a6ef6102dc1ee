"""The base of the encodings that store the states as they are, in one dtype (float32, float16,
bfloat16): `hidden_states` [T, k, H] in the file, nothing else."""

from __future__ import annotations

from dataclasses import dataclass

from hsx.storage.encodings.base import HIDDEN, Encoding, TensorShapes

SCALE_TENSOR = "hidden_states_scale"  # float8's; named here because no plain file may hold one


@dataclass(frozen=True, kw_only=True)
class PlainEncoding(Encoding):
    safetensors_dtype: str  # the header's name of the compute dtype

    def file_tensors(self, tokens: int, layers: int, hidden: int) -> TensorShapes:
        return {HIDDEN: (self.compute, [tokens, layers, hidden])}

    def encode(self, states):
        return {HIDDEN: states.contiguous()}

    def header_dtype(self) -> str:
        return self.safetensors_dtype

    def header_problems(self, header: dict, states: dict | None) -> dict[str, str]:
        if SCALE_TENSOR in header:
            return {SCALE_TENSOR: f"a {SCALE_TENSOR} tensor in a {self.stored} file"}
        return {}
