"""The chunked blosc2 framing of the lossless encodings (hsx/storage/encodings/compressed.py):
states longer than a chunk come back whole, incompressible bytes stay within the size bound the
dry run and the free-space check use, and damaged compressed bytes are SampleFileCorrupt."""

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
