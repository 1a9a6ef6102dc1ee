"""float8-zstd: the float8 encoding's e4m3 values compressed losslessly (hsx/storage/encodings/
compressed.py), its float32 scales as they are: values and scales bit for bit after decoding.
Quantized on the device like float8; compressed in the writer threads."""

from hsx.storage.encodings.compressed import CompressedEncoding
from hsx.storage.encodings.float8 import FLOAT8_E4M3

FLOAT8_ZSTD = CompressedEncoding(
    name="float8-zstd",
    stored="float8-zstd",
    compute=FLOAT8_E4M3.compute,
    tolerance=FLOAT8_E4M3.tolerance,
    help="float8 with its values compressed losslessly",
    inner=FLOAT8_E4M3,
)
