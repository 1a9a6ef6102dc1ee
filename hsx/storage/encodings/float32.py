"""float32: the states as the float32 forward computed them. Checked by absolute error: a float32
recomputation on the CPU differs from the stored states only by kernel order."""

from hsx.storage.encodings.base import Tolerance
from hsx.storage.encodings.plain import PlainEncoding

FLOAT32 = PlainEncoding(
    name="float32",
    stored="float32",
    compute="float32",
    safetensors_dtype="F32",
    tolerance=Tolerance(measure="max_abs_error", limit=1e-4),
    help="",
)
