"""float16: the states as the float16 forward computed them."""

from hsx.storage.encodings.base import Tolerance
from hsx.storage.encodings.plain import PlainEncoding

FLOAT16 = PlainEncoding(
    name="float16",
    stored="float16",
    compute="float16",
    safetensors_dtype="F16",
    tolerance=Tolerance(measure="relative_error", limit=2e-2),
    help="",
)
