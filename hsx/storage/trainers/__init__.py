"""The files each drafter trainer reads, made from one hsx sample: the trainer formats, one module
each (SpecForge's DFlash and EAGLE-3 offline features, speculators' cached hidden states), and
the registry that `hsx export --to` looks them up in. Adding a format is its module (a
TrainerFormat, base.py) and one entry in FORMATS below. Also what every format shares: the
exported dtype (`export_dtype`) and atomic writes. `hsx export` (commands/export.py) drives them;
nothing of NATS here.

What each format holds: docs/training.md, "2. Export, on the training machine", and docs/architecture/storage.md;
layer conventions: docs/reference/data.md, "Layers for a trainer".
"""

import json
import os
from pathlib import Path

from hsx.errors import HsxError
from hsx.storage.encodings import Encoding
from hsx.storage.trainers.base import Sample, TrainerFormat
from hsx.storage.trainers.specforge_dflash import SPECFORGE_DFLASH
from hsx.storage.trainers.specforge_eagle3 import SPECFORGE_EAGLE3
from hsx.storage.trainers.speculators import SPECULATORS

__all__ = ["DTYPES", "FORMATS", "Sample", "TrainerFormat", "by_name", "export_dtype", "names", "write_atomically"]


def _registry(*formats: TrainerFormat) -> dict[str, TrainerFormat]:
    """The formats by name (each class checked for its pieces where it is defined, base.py);
    a TypeError naming the name two of them share."""
    registry: dict[str, TrainerFormat] = {}
    for fmt in formats:
        if fmt.name in registry:
            raise TypeError(
                f"trainer formats {type(registry[fmt.name]).__name__} and "
                f"{type(fmt).__name__} are both named {fmt.name!r}"
            )
        registry[fmt.name] = fmt
    return registry


# In --to's order.
FORMATS = _registry(SPECFORGE_DFLASH, SPECFORGE_EAGLE3, SPECULATORS)
DTYPES = ("auto", "bfloat16", "float16", "float32")  # of the exported hidden states


def names() -> tuple[str, ...]:
    """--to's choices."""
    return tuple(FORMATS)


def by_name(name: str) -> TrainerFormat:
    """The format a --to value names; HsxError listing the choices for any other."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise HsxError(f"expected one of {', '.join(FORMATS)}, got {json.dumps(name)}")
    return fmt


def export_dtype(requested: str, encoding: Encoding) -> str:
    """The exported hidden states' dtype: `auto` is the dtype the job's forward ran in (its
    encoding's compute dtype): the job's own for bfloat16, float16 and float32, bfloat16 for float8
    (what the trainers train in; its rounding, 2^-9, is far below float8's own, and float32 would
    be four times the job's size) and for compressed bfloat16."""
    if requested != "auto":
        return requested
    return encoding.compute


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holds all of `data` or is absent: a resumed export trusts every file it finds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with open(partial, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
