"""float32: the states as the float32 forward computed them. A float32 recomputation on the CPU
differs from the stored states only by the order of sums, which grows with the reduction length
and the depth: about sqrt(n) * 2^-24 per layer, relative to the magnitudes summed. For a 64-layer
target with n ~ 3e4 (the MLP's intermediate size) that is ~7e-4 at the deepest layer; a trained
model's deep layers hold channels of ~1e4, so an absolute limit would refuse correct files. The
limit is the whole sample's relative error, 1e-3; a bfloat16 round trip (2^-8 ~ 4e-3 per element)
exceeds it."""

from hsx.storage.encodings.base import Tolerance
from hsx.storage.encodings.plain import PlainEncoding

FLOAT32 = PlainEncoding(
    name="float32",
    stored="float32",
    compute="float32",
    safetensors_dtype="F32",
    tolerance=Tolerance(measure="relative_error", limit=1e-3),
    help="",
)
