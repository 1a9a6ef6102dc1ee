"""The bytes of one sample file, and their digest: `write` (one pass, straight from the tensors'
memory), `checked_digest` and `checked_file_digest` (the data checked against the checksum in the
header, and the file's digest), `parse_header` (a header's JSON, its form checked before any
reader looks into it), `SampleFileCorrupt`. A sample file is a standard safetensors file with a
sorted header and a checksum inside (docs/reference/data.md, "Output"). No torch import here.

Why it is written this way: docs/architecture/storage.md.
"""

import hashlib
import json
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from hsx.storage.fsutil import atomic_write

if TYPE_CHECKING:
    import torch

CHECKSUM_KEY = "checksum"
_CHECKSUM_PREFIX = "sha256:"
_PLACEHOLDER = _CHECKSUM_PREFIX + "0" * 64
_CHUNK = 1 << 20  # hashed then written while it is still in the CPU cache
_MAX_HEADER = 100 << 20  # safetensors refuses larger headers too

# By torch's dtype name, so that checking a file (the uploader) needs no torch.
_SAFETENSORS_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_ELEMENT_SIZES = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def element_size(dtype: str) -> int:
    """The bytes of one element of the torch dtype of this name."""
    return _ELEMENT_SIZES[dtype]


class SampleFileCorrupt(ValueError):
    """The bytes are not a sound sample file: truncated, a damaged header, or data that does not
    match the checksum in the header."""


def json_or(text: str, default: object) -> object:
    """`text` parsed as JSON, or `default` when it is not JSON. json raises ValueError (not its
    JSONDecodeError) for an integer literal past Python's 4300 digits, and RecursionError for
    nesting past the recursion limit: a file's text is not trusted to be either."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return default


def _count(value: object) -> bool:
    return type(value) is int and value >= 0  # not a bool, which JSON's true would be


# A safetensors dtype's name (F32, BF16, F8_E4M3, U8, ...): what a reader quotes in a one-line error.
_DTYPE_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,15}")


def _tensor_entry(entry: object) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return False
    if not _DTYPE_NAME.fullmatch(entry["dtype"]):
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    return (
        isinstance(shape, list)
        and all(_count(n) for n in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(_count(n) for n in offsets)
        and offsets[0] <= offsets[1]
    )


def parse_header(text: bytes) -> dict:
    """A safetensors header's JSON (the bytes after its length prefix), checked to be what the
    format says before anything reads it: an object whose `__metadata__`, when present, maps
    strings to strings, and whose every other entry is a tensor's `dtype` (a dtype's name, such
    as BF16), `shape` (counts) and `data_offsets` ([begin, end], 0 <= begin <= end);
    SampleFileCorrupt naming the first thing that is not."""
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:  # as in `json_or`; UnicodeDecodeError is a ValueError
        raise SampleFileCorrupt(f"header is not JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(header, dict):
        raise SampleFileCorrupt("header is not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise SampleFileCorrupt("header has no metadata object of strings")
    for name, entry in header.items():
        if name != "__metadata__" and not _tensor_entry(entry):
            raise SampleFileCorrupt(f"header entry {name[:80]!r} is not a tensor's dtype, shape and data_offsets")
    return header


def _header(entries: dict[str, dict], metadata: dict[str, str]) -> bytes:
    text = json.dumps({"__metadata__": metadata, **entries}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    encoded = text.encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors pads the header so the data starts 8-aligned
    return len(encoded).to_bytes(8, "little") + encoded


def _layout(tensors: dict[str, tuple[str, list[int]]]) -> tuple[dict[str, dict], list[str], int]:
    """The header entries of tensors given as name -> (torch dtype name, shape), the names in data
    order, and the data section's size. Widest element first, then by name, so every tensor starts
    aligned to its element size, as safetensors' own writer does."""
    order = sorted(tensors, key=lambda n: (-_ELEMENT_SIZES[tensors[n][0]], n))
    entries: dict[str, dict] = {}
    offset = 0
    for name in order:
        dtype, shape = tensors[name]
        nbytes = math.prod(shape) * _ELEMENT_SIZES[dtype]
        entries[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    return entries, order, offset


def file_size(tensors: dict[str, tuple[str, list[int]]], metadata: dict[str, str]) -> int:
    """The size of the file `write` makes of tensors of these dtypes (torch names) and shapes with
    this metadata, without the tensors: the same header and layout, the checksum's fixed length."""
    entries, _, data = _layout(tensors)
    return len(_header(entries, {**metadata, CHECKSUM_KEY: _PLACEHOLDER})) + data


def _flat_bytes(tensor: "torch.Tensor") -> memoryview:
    """The tensor's bytes, without copying when it is already contiguous."""
    import torch

    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def write(
    final: Path, tensors: dict[str, "torch.Tensor"], metadata: dict[str, str], *, sync_dir: bool = True
) -> tuple[int, str]:
    """Write `tensors` and `metadata` (plus the checksum) atomically to `final` (`sync_dir`: as
    hsx.storage.fsutil.atomic_write).

    Returns (file size, digest). Tensors are laid out as `_layout` says."""
    for name, tensor in tensors.items():
        if str(tensor.dtype).removeprefix("torch.") not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors name")
    entries, order, offset = _layout(
        {name: (str(tensor.dtype).removeprefix("torch."), list(tensor.shape)) for name, tensor in tensors.items()}
    )
    buffers: list[memoryview] = []
    for name in order:
        data = _flat_bytes(tensors[name])
        assert data.nbytes == entries[name]["data_offsets"][1] - entries[name]["data_offsets"][0]
        buffers.append(data)
    if CHECKSUM_KEY in metadata:
        raise ValueError(f"metadata key {CHECKSUM_KEY!r} is the writer's own")
    data_start = len(_header(entries, {**metadata, CHECKSUM_KEY: _PLACEHOLDER}))
    result: list[str] = []

    def write(fd: int) -> None:
        checksum = hashlib.sha256()
        position = data_start
        for buffer in buffers:
            for start in range(0, buffer.nbytes, _CHUNK):
                chunk = buffer[start : start + _CHUNK]
                checksum.update(chunk)  # releases the GIL: writer threads hash in parallel
                _pwrite_all(fd, chunk, position)
                position += chunk.nbytes
        header = _header(entries, {**metadata, CHECKSUM_KEY: _CHECKSUM_PREFIX + checksum.hexdigest()})
        assert len(header) == data_start
        _pwrite_all(fd, header, 0)
        result.append(hashlib.sha256(header).hexdigest())

    atomic_write(final, write, sync_dir=sync_dir)
    return data_start + offset, result[0]


def _pwrite_all(fd: int, data: memoryview | bytes, position: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written


class DigestCheck:
    """Fed a sample file's bytes in order (any chunking), gives its digest after checking that the
    data matches the checksum in the header. One pass; it keeps only the header in memory."""

    def __init__(self) -> None:
        self._head = bytearray()
        self._header_end: int | None = None  # 8 + the header length, once the first 8 bytes are in
        self._in_header = True
        self._digest = ""
        self._expected_checksum = ""
        self._data_len = 0
        self._data_seen = 0
        self._data_hash = hashlib.sha256()

    def update(self, chunk: bytes | memoryview) -> None:
        view = memoryview(chunk)
        while self._in_header:
            target = 8 if self._header_end is None else self._header_end
            take = target - len(self._head)
            self._head += view[:take]
            view = view[take:]
            if len(self._head) < target:
                return
            if self._header_end is None:
                self._header_end = 8 + int.from_bytes(self._head, "little")
                if self._header_end > _MAX_HEADER:
                    raise SampleFileCorrupt(f"the header claims {self._header_end - 8} bytes")
                continue
            self._read_header(bytes(self._head))
            self._in_header = False
        self._data_hash.update(view)
        self._data_seen += view.nbytes

    def _read_header(self, header: bytes) -> None:
        try:
            parsed = parse_header(header[8:])
        except SampleFileCorrupt as exc:
            raise SampleFileCorrupt(f"the header does not parse as a sample file's ({exc})") from None
        metadata = parsed.pop("__metadata__", {})
        if CHECKSUM_KEY not in metadata:
            raise SampleFileCorrupt(f"the header does not parse as a sample file's (no {CHECKSUM_KEY} in its metadata)")
        self._expected_checksum = metadata[CHECKSUM_KEY]
        self._data_len = max((entry["data_offsets"][1] for entry in parsed.values()), default=0)
        self._digest = hashlib.sha256(header).hexdigest()

    def result(self) -> str:
        """The digest; SampleFileCorrupt if the file was short, long, or its data was changed."""
        if self._in_header:
            raise SampleFileCorrupt(f"the file ends inside its header ({len(self._head)} bytes)")
        if self._data_seen != self._data_len:
            raise SampleFileCorrupt(
                f"the data section has {self._data_seen} bytes, the header describes {self._data_len}"
            )
        actual = _CHECKSUM_PREFIX + self._data_hash.hexdigest()
        if actual != self._expected_checksum:
            raise SampleFileCorrupt(f"the header's checksum is {self._expected_checksum}, the data hashes to {actual}")
        return self._digest


def checked_digest(chunks: Iterable[bytes | memoryview]) -> str:
    check = DigestCheck()
    for chunk in chunks:
        check.update(chunk)
    return check.result()


def read_chunks(path: Path, chunk_size: int = 8 << 20) -> Iterable[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            yield chunk


def checked_file_digest(path: Path) -> str:
    """The digest of the sample file at `path`, after checking it (one read)."""
    return checked_digest(read_chunks(path))
