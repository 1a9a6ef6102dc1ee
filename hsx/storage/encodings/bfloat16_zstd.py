"""bfloat16-zstd: the bfloat16 states, compressed losslessly (hsx/storage/encodings/compressed.py):
bit for bit the bfloat16 states after decoding, at some 0.70 of their bytes on real models' states
(docs/bench-results/2026-12-03-encodings.md, "Lossless encodings")."""

from hsx.storage.encodings.bfloat16 import BFLOAT16
from hsx.storage.encodings.compressed import CompressedEncoding

BFLOAT16_ZSTD = CompressedEncoding(
    name="bfloat16-zstd",
    stored="bfloat16-zstd",
    compute=BFLOAT16.compute,
    tolerance=BFLOAT16.tolerance,
    help="bfloat16 compressed losslessly (blosc2: byte shuffle, zstd)",
    inner=BFLOAT16,
)
