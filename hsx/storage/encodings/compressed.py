"""The base of the lossless encodings: another encoding's `hidden_states` (bfloat16, float8 e4m3),
its bytes compressed by blosc2 (byte shuffle, so each byte of an element is in a plane of its
own, then zstd level 1) in chunks of at most CHUNK bytes laid end to end in one uint8 tensor,
`hidden_states.zst`; the metadata's `hidden_states_shape` is the states' [T, k, H]. Every other
tensor (float8's scales) is the inner encoding's, uncompressed. Decoding gives back the inner
encoding's tensors bit for bit, so every reader past `decode` sees an uncompressed file.

Each blosc2 chunk begins with a header that holds its compressed length, so the chunks need no
index. Encode and decode run one thread each (the consumer's writer threads, a reader's pool are
the parallelism). Why blosc2 and these settings: docs/bench-results/2026-12-03-encodings.md, "Lossless encodings".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from hsx.storage import samplefile
from hsx.storage.encodings.base import HIDDEN, Encoding, TensorShapes
from hsx.storage.samplefile import SampleFileCorrupt

COMPRESSED = "hidden_states.zst"
SHAPE_KEY = "hidden_states_shape"
CHUNK = 64 << 20  # blosc2 takes at most 2 GiB a chunk; a long sample's states are several
_OVERHEAD = 32  # blosc2.MAX_OVERHEAD: the most a chunk grows (incompressible data is stored as it is)
_BLOCKSIZE = 1 << 20  # measured: a better ratio than blosc2's automatic block size, as fast


def compressed_bound(nbytes: int) -> int:
    return nbytes + _OVERHEAD * max(1, -(-nbytes // CHUNK))


def compress(raw: np.ndarray, typesize: int) -> np.ndarray:
    """Flat uint8 `raw` (elements of `typesize` bytes) -> the chunks, end to end."""
    import blosc2

    params = {
        "codec": blosc2.Codec.ZSTD,
        "clevel": 1,
        "typesize": typesize,
        "filters": [blosc2.Filter.SHUFFLE],
        "blocksize": _BLOCKSIZE,
        "nthreads": 1,
    }
    chunk = CHUNK - CHUNK % typesize
    parts = [blosc2.compress2(raw[start : start + chunk], **params) for start in range(0, max(1, raw.size), chunk)]
    out = np.empty(sum(len(part) for part in parts), dtype=np.uint8)
    position = 0
    for part in parts:
        out[position : position + len(part)] = np.frombuffer(part, dtype=np.uint8)
        position += len(part)
    return out


# The most bytes of states a file may claim per compressed byte. Real hidden states compress to
# 0.70-0.86 of their size (docs/bench-results/2026-12-03-encodings.md); a claim past this is a crafted or
# damaged file, refused before anything is allocated from it (blosc2 stores a run of zeros in a
# few bytes, so a chunk header alone could ask for any size).
MAX_RATIO = 64
_RATIO_SLACK = 1 << 20  # tiny samples: a header's worth of fixed cost, whatever the ratio


def claimed_bytes(data: np.ndarray) -> int:
    """The bytes of states the chunks in flat uint8 `data` say they hold (their headers, read
    without decompressing); SampleFileCorrupt when a header does not read or runs past the data."""
    import blosc2

    read = total = 0
    while read < data.size:
        try:
            nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(data[read:])
        except Exception as exc:
            raise SampleFileCorrupt(f"{COMPRESSED}: no blosc2 chunk at byte {read} ({exc})") from None
        if cbytes <= 0 or read + cbytes > data.size:
            raise SampleFileCorrupt(f"{COMPRESSED}: the chunk at byte {read} runs past the data")
        read, total = read + cbytes, total + nbytes
    return total


def decompress(data: np.ndarray, out: np.ndarray) -> None:
    """The chunks in flat uint8 `data` -> flat uint8 `out`, which they must fill exactly."""
    import blosc2

    read = written = 0
    while read < data.size:
        try:
            nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(data[read:])
        except Exception as exc:
            raise SampleFileCorrupt(f"{COMPRESSED}: no blosc2 chunk at byte {read} ({exc})") from None
        if cbytes <= 0 or read + cbytes > data.size or written + nbytes > out.size:
            raise SampleFileCorrupt(f"{COMPRESSED}: the chunk at byte {read} runs past the data or the states")
        if nbytes:  # blosc2 takes no empty destination
            try:
                blosc2.decompress2(data[read : read + cbytes], dst=out[written : written + nbytes], nthreads=1)
            except Exception as exc:
                raise SampleFileCorrupt(f"{COMPRESSED}: the chunk at byte {read} does not decompress ({exc})") from None
        read, written = read + cbytes, written + nbytes
    if written != out.size:
        raise SampleFileCorrupt(f"{COMPRESSED}: {written} bytes of states decompressed, {out.size} expected")


def _shape(metadata: dict[str, str]) -> list[int] | None:
    shape = samplefile.json_or(metadata.get(SHAPE_KEY, "null"), None)
    ok = isinstance(shape, list) and len(shape) == 3 and all(isinstance(n, int) and n >= 0 for n in shape)
    return shape if ok else None


@dataclass(frozen=True, kw_only=True)
class CompressedEncoding(Encoding):
    inner: Encoding  # whose tensors this stores, its `hidden_states` compressed
    exact_size: bool = False

    def _stored(self, tokens: int, layers: int, hidden: int) -> tuple[str, list[int]]:
        return self.inner.file_tensors(tokens, layers, hidden)[HIDDEN]

    def states_bytes(self, tokens: int, layers: int, hidden: int) -> int:
        """The bytes of a file's states before they are compressed (what `compress` takes)."""
        dtype, shape = self._stored(tokens, layers, hidden)
        return math.prod(shape) * samplefile.element_size(dtype)

    def on_device(self, states):
        return self.inner.on_device(states)

    def landed(self, hosts, row: int, length: int):
        return self.inner.landed(hosts, row, length)

    def under_bound(self, tokens: int, layers: int, hidden: int, *, ratio: float) -> float:
        states = self.states_bytes(tokens, layers, hidden)
        return compressed_bound(states) - ratio * states

    def file_tensors(self, tokens: int, layers: int, hidden: int) -> TensorShapes:
        shapes = self.inner.file_tensors(tokens, layers, hidden)
        del shapes[HIDDEN]
        shapes[COMPRESSED] = ("uint8", [compressed_bound(self.states_bytes(tokens, layers, hidden))])
        return shapes

    def file_metadata(self, tokens: int, layers: int, hidden: int) -> dict[str, str]:
        return {**super().file_metadata(tokens, layers, hidden), SHAPE_KEY: json.dumps([tokens, layers, hidden])}

    def encode(self, states):
        import torch

        tensors = self.inner.encode(states)
        hidden = tensors.pop(HIDDEN).contiguous()
        raw = hidden.reshape(-1).view(torch.uint8).numpy()
        tensors[COMPRESSED] = torch.from_numpy(compress(raw, hidden.element_size()))
        return tensors

    def decode(self, tensors, metadata):
        import torch

        data, shape = tensors.pop(COMPRESSED, None), _shape(metadata)
        if data is None or data.dtype != torch.uint8 or data.dim() != 1 or shape is None:
            raise SampleFileCorrupt(f"a {self.name} file needs a 1-D uint8 {COMPRESSED} and {SHAPE_KEY} [T, k, H]")
        ids = tensors.get("input_ids")
        if ids is not None and shape[0] != len(ids):
            raise SampleFileCorrupt(f"{SHAPE_KEY} {shape} is not [T, k, H] for the file's {len(ids)} input ids")
        # Sizes from the file's own claims are checked in Python integers before torch sees them.
        stored = self.states_bytes(*shape)
        if stored > MAX_RATIO * data.numel() + _RATIO_SLACK:
            raise SampleFileCorrupt(
                f"{SHAPE_KEY} {shape} claims {stored} bytes of states from {data.numel()} compressed bytes"
            )
        claimed = claimed_bytes(data.numpy())
        if claimed != stored:
            raise SampleFileCorrupt(f"{COMPRESSED} holds {claimed} bytes of states, {SHAPE_KEY} {shape} is {stored}")
        dtype = getattr(torch, self._stored(*shape)[0])
        hidden = torch.empty(shape, dtype=dtype)
        decompress(data.numpy(), hidden.reshape(-1).view(torch.uint8).numpy())
        return self.inner.decode({**tensors, HIDDEN: hidden}, metadata)

    def values(self, tensors):
        return self.inner.values(tensors)

    def header_states(self, header: dict, metadata: dict[str, str]) -> dict | None:
        entry, shape = header.get(COMPRESSED), _shape(metadata)
        if not isinstance(entry, dict) or entry.get("dtype") != "U8" or len(entry.get("shape") or []) != 1:
            return None
        return {"dtype": self.inner.header_dtype(), "shape": shape}

    def header_dtype(self) -> str:
        return self.inner.header_dtype()

    def header_problems(self, header: dict, states: dict | None) -> dict[str, str]:
        problems = dict(self.inner.header_problems(header, states))
        if HIDDEN in header:
            problems[HIDDEN] = f"an uncompressed {HIDDEN} tensor in a {self.name} file"
        return problems
