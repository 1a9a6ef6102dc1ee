"""hsx.storage.samplefile against references it did not write: the safetensors library reads every file
back, and the digest and checksum are recomputed here with hashlib."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_e2e_s3 import digest_and_checksum

from hsx.storage import samplefile


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    hidden = torch.randn(37, 3, 64)
    return {
        "hidden_states": hidden.to(torch.bfloat16),
        "hidden_states_scale": torch.rand(37, 3),
        "input_ids": torch.arange(37, dtype=torch.int64),
        "loss_mask": (torch.arange(37) % 2).to(torch.uint8),
        "as_float8": hidden.to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 64, dtype=torch.bfloat16),
    }


METADATA = {"job": "j", "sample_index": "7", "layers": json.dumps([1, "final"]), "note": "ünïcode"}


def test_safetensors_reads_back_every_tensor_and_the_metadata(tmp_path):
    tensors = _tensors()
    size, digest = samplefile.write(tmp_path / "a.safetensors", tensors, METADATA)
    data = (tmp_path / "a.safetensors").read_bytes()
    assert size == len(data)
    loaded = load_file(tmp_path / "a.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name].view(torch.uint8), tensor.view(torch.uint8)), name
    with safe_open(tmp_path / "a.safetensors", framework="pt") as f:  # memory-mapped, offsets must be sound
        metadata = f.metadata()
        assert torch.equal(f.get_tensor("input_ids"), tensors["input_ids"])
    expected_digest, expected_checksum = digest_and_checksum(data)
    assert metadata == {**METADATA, "checksum": expected_checksum}
    assert digest == expected_digest
    assert samplefile.checked_file_digest(tmp_path / "a.safetensors") == digest


def test_the_same_tensors_give_the_same_bytes(tmp_path):
    samplefile.write(tmp_path / "a.safetensors", _tensors(), METADATA)
    samplefile.write(tmp_path / "b.safetensors", _tensors(), dict(reversed(METADATA.items())))
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


@pytest.mark.parametrize("chunk", [1, 7, 8, 9, 4096, 1 << 30])
def test_any_chunking_gives_the_same_digest(tmp_path, chunk):
    _, digest = samplefile.write(tmp_path / "a.safetensors", _tensors(), METADATA)
    data = (tmp_path / "a.safetensors").read_bytes()
    assert samplefile.checked_digest(data[i : i + chunk] for i in range(0, len(data), chunk)) == digest


def test_a_changed_truncated_or_extended_file_is_refused(tmp_path):
    _, digest = samplefile.write(tmp_path / "a.safetensors", _tensors(), METADATA)
    data = (tmp_path / "a.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")

    def flipped(at: int) -> bytes:
        changed = bytearray(data)
        changed[at] ^= 0x01
        return bytes(changed)

    for bad in (flipped(header_end), flipped(len(data) - 1), data[:-1], data + b"\0", data[: header_end - 3], data[:5]):
        with pytest.raises(samplefile.SampleFileCorrupt):
            samplefile.checked_digest([bad])
    # A changed header byte that still parses changes the digest.
    renamed = data.replace(b'"sample_index":"7"', b'"sample_index":"8"')
    assert renamed != data and samplefile.checked_digest([renamed]) != digest


def test_the_checksum_key_is_the_writers_own(tmp_path):
    with pytest.raises(ValueError, match="checksum"):
        samplefile.write(tmp_path / "a.safetensors", _tensors(), {"checksum": "forged"})
    assert not list(tmp_path.iterdir())
