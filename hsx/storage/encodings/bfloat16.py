"""bfloat16: the states as the bfloat16 forward computed them (the default)."""

from hsx.storage.encodings.base import Tolerance
from hsx.storage.encodings.plain import PlainEncoding

BFLOAT16 = PlainEncoding(
    name="bfloat16",
    stored="bfloat16",
    compute="bfloat16",
    safetensors_dtype="BF16",
    tolerance=Tolerance(measure="relative_error", limit=2e-2),
    help="",
)
