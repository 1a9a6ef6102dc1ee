"""The encodings of a job's hidden states, one module each, and the registry that `--dtype`,
the consumer's writer, the readers and `hsx verify` look them up in. Adding an encoding is its
module and one entry in ENCODINGS below.

A file names its encoding in its metadata (`encoding`); a file from before that key is known by
its `dtype` metadata, or by a float8 scale tensor (`of_file`).
"""

import json

from hsx.errors import HsxError
from hsx.storage.encodings.base import ENCODING_KEY, HIDDEN, Encoding, Tolerance, UnknownEncoding
from hsx.storage.encodings.bfloat16 import BFLOAT16
from hsx.storage.encodings.bfloat16_zstd import BFLOAT16_ZSTD
from hsx.storage.encodings.float8 import FLOAT8_E4M3
from hsx.storage.encodings.float8_zstd import FLOAT8_ZSTD
from hsx.storage.encodings.float16 import FLOAT16
from hsx.storage.encodings.float32 import FLOAT32
from hsx.storage.encodings.plain import SCALE_TENSOR

__all__ = [
    "ENCODINGS",
    "ENCODING_KEY",
    "HIDDEN",
    "SCALE_TENSOR",
    "Encoding",
    "Tolerance",
    "UnknownEncoding",
    "by_name",
    "names",
    "of_file",
    "of_spec",
]

# In --dtype's order.
ENCODINGS: dict[str, Encoding] = {
    encoding.name: encoding
    for encoding in (
        BFLOAT16,
        FLOAT16,
        FLOAT32,
        FLOAT8_E4M3,
        BFLOAT16_ZSTD,
        FLOAT8_ZSTD,
    )
}
_BY_STORED = {encoding.stored: encoding for encoding in ENCODINGS.values()}
assert len(_BY_STORED) == len(ENCODINGS), "two encodings store under one name"


def names() -> tuple[str, ...]:
    """--dtype's choices."""
    return tuple(ENCODINGS)


def by_name(name: str) -> Encoding:
    """The encoding a --dtype value names; HsxError listing the choices for any other."""
    encoding = ENCODINGS.get(name)
    if encoding is None:
        raise HsxError(f"expected one of {', '.join(ENCODINGS)}, got {json.dumps(name)}")
    return encoding


def of_spec(stored: str, *, where: str = "") -> Encoding:
    """The encoding of a job whose spec says `dtype` `stored`; HsxError (prefixed with `where`)
    for a name this hsx has none of."""
    encoding = _BY_STORED.get(stored)
    if encoding is None:
        prefix = f"{where}: " if where else ""
        raise HsxError(f"{prefix}dtype {stored!r} is none of {', '.join(_BY_STORED)}")
    return encoding


def of_file(metadata: dict[str, str], tensor_names) -> Encoding:
    """The encoding of a file with this metadata and these tensors (or header entries); an
    UnknownEncoding when its metadata names one this hsx has none of."""
    name = metadata.get(ENCODING_KEY)
    if name is not None:
        encoding = ENCODINGS.get(name)
        if encoding is None:
            raise UnknownEncoding(
                f"its encoding {name!r} is none this hsx knows ({', '.join(ENCODINGS)}): written by a newer hsx?"
            )
        return encoding
    # Files from before the `encoding` key: their `dtype`, or as the reader told them apart then.
    encoding = _BY_STORED.get(metadata.get("dtype", ""))
    if encoding is not None:
        return encoding
    return FLOAT8_E4M3 if SCALE_TENSOR in tensor_names else BFLOAT16
