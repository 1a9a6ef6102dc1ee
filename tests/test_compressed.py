"""The chunked blosc2 framing of the lossless encodings (hsx/storage/encodings/compressed.py):
states longer than a chunk come back whole, incompressible bytes stay within the size bound the
dry run and the free-space check use, and damaged compressed bytes are SampleFileCorrupt."""

import json

import numpy as np
import pytest

from hsx.storage.encodings import compressed
from hsx.storage.samplefile import SampleFileCorrupt


def test_states_over_several_chunks_come_back_whole(monkeypatch):
    monkeypatch.setattr(compressed, "CHUNK", 1 << 16)  # a real sample's chunk is 64 MiB: the framing, smaller
    raw = np.random.default_rng(0).integers(0, 4, size=(5 << 16) + 6, dtype=np.uint8)
    data = compressed.compress(raw, 2)
    out = np.empty_like(raw)
    compressed.decompress(data, out)
    assert np.array_equal(out, raw)


def test_incompressible_states_stay_within_the_bound():
    import blosc2

    assert blosc2.MAX_OVERHEAD == compressed._OVERHEAD
    for size in (0, 1, 4096, 3 << 20):
        raw = np.random.default_rng(size).integers(0, 256, size=size, dtype=np.uint8)
        data = compressed.compress(raw, 1)
        assert data.size <= compressed.compressed_bound(size), size
        out = np.empty_like(raw)
        compressed.decompress(data, out)
        assert np.array_equal(out, raw)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "short states"])
def test_damaged_compressed_bytes_are_a_corrupt_file(damage):
    raw = np.arange(1 << 16, dtype=np.uint16).view(np.uint8)
    data = compressed.compress(raw, 2)
    out = np.empty_like(raw)
    if damage == "truncated":
        data = data[: data.size // 2]
    elif damage == "flipped":
        data = data.copy()
        data[12:16] = 0xFF  # the chunk header's compressed length
    else:
        out = np.empty(raw.size - 2, dtype=np.uint8)
    with pytest.raises(SampleFileCorrupt, match="hidden_states.zst"):
        compressed.decompress(data, out)


@pytest.mark.parametrize("name", ["bfloat16-zstd", "float8-zstd"])
def test_sizes_a_file_claims_are_checked_before_anything_is_allocated(name):
    """A file's own `hidden_states_shape` and its chunks' headers are claims: states past what
    the compressed bytes can hold (a run of zeros compresses to a few bytes), or of another size
    than the chunks hold, or not [T, ...] for its input ids, are SampleFileCorrupt, not an
    allocation (or torch's overflow) sized from the claim."""
    import torch

    from hsx.storage import encodings

    encoding = encodings.by_name(name)
    tokens, layers, hidden = 4, 2, 8
    states = torch.randn(tokens, layers, hidden, dtype=getattr(torch, encoding.compute))
    written = encoding.encode(states)
    ids = torch.arange(tokens, dtype=torch.int64)
    metadata = encoding.file_metadata(tokens, layers, hidden)

    def decode(data=None, shape=None, input_ids=ids):
        tensors = {**written, "input_ids": input_ids}
        if data is not None:
            tensors[compressed.COMPRESSED] = data
        meta = {**metadata, compressed.SHAPE_KEY: json.dumps(shape)} if shape is not None else metadata
        return encoding.decode(tensors, meta)

    assert decode()["hidden_states"].shape == (tokens, layers, hidden)
    with pytest.raises(SampleFileCorrupt, match="input ids"):
        decode(shape=[2**40, 2**40, 2**40])
    with pytest.raises(SampleFileCorrupt, match="claims"):
        decode(shape=[tokens, 2**40, 2**40])
    with pytest.raises(SampleFileCorrupt, match="holds"):
        decode(shape=[tokens, layers, hidden * 2])
    # Chunks that truly hold a huge run of zeros in a few bytes: refused by the ratio, unread.
    zeros = compressed.compress(np.zeros(64 << 20, dtype=np.uint8), 1)
    assert compressed.claimed_bytes(zeros) == 64 << 20 and zeros.size * compressed.MAX_RATIO < 64 << 20
    width = (64 << 20) // (tokens * layers * encoding.states_bytes(1, 1, 1))
    with pytest.raises(SampleFileCorrupt, match="claims"):
        decode(data=torch.from_numpy(zeros), shape=[tokens, layers, width])
