"""The encodings of hsx/storage/encodings/: every one round-trips its stored states bit for bit
through a real sample file (NaN payloads, infinities, negative zero, subnormals where the dtype
has them), the registry feeds --dtype, and a file naming an encoding this hsx lacks is refused
in one line naming the file."""

import pytest
import torch

from hsx.errors import HsxError
from hsx.producer.config import stored_dtype
from hsx.storage import encodings, samplefile
from hsx.storage.encodings.float8 import Float8States
from hsx.storage.reader import dequantize, load_sample


def _special(dtype: torch.dtype, shape=(5, 3, 64)) -> torch.Tensor:
    """Random states of `dtype` whose first values are the awkward ones: NaNs with payloads
    (both signs), infinities, zeros of both signs, the smallest subnormal and the largest finite."""
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    states = torch.randn(shape).to(dtype)
    info = torch.finfo(dtype)
    flat = states.view(-1)
    flat[:6] = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, info.smallest_normal / 4, info.max]).to(dtype)
    payloads = {
        torch.float32: [0x7FC00001, -0x7FBFFF01],
        torch.float16: [0x7E01, -0x01FF],
        torch.bfloat16: [0x7FC1, -0x003F],
    }
    flat.view(bits)[6:8] = torch.tensor(payloads[dtype], dtype=bits)
    return states


def _round_trip(encoding, states, tmp_path):
    path = tmp_path / f"{encoding.name}.safetensors"
    samplefile.write(
        path, encoding.encode(states), {"dtype": encoding.stored, **encoding.file_metadata(*_shape(states))}
    )
    return load_sample(path.read_bytes())


def _shape(states):
    return tuple((states.values if isinstance(states, Float8States) else states).shape)


def _scaled(encoding) -> bool:
    """Whether the encoding's files hold float8's values and scales."""
    return encodings.SCALE_TENSOR in encoding.file_tensors(1, 1, 1)


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("name", [n for n, e in encodings.ENCODINGS.items() if not _scaled(e)])
def test_each_unquantized_encoding_returns_the_states_bit_for_bit(name, tmp_path):
    encoding = encodings.by_name(name)
    states = _special(getattr(torch, encoding.compute))
    tensors, metadata = _round_trip(encoding, states, tmp_path)
    assert metadata[encodings.ENCODING_KEY] == name
    assert tensors["hidden_states"].dtype == states.dtype and tensors["hidden_states"].shape == states.shape
    assert _bits(tensors["hidden_states"]) == _bits(states)
    assert _bits(dequantize(tensors, metadata)) == _bits(states)


@pytest.mark.parametrize("name", [n for n, e in encodings.ENCODINGS.items() if _scaled(e)])
def test_each_float8_encoding_returns_its_values_and_scales_bit_for_bit(name, tmp_path):
    """e4m3 has NaN (no infinities) and subnormals; the values are laid down as bytes, the scales
    include a subnormal float32 and negative zero is among the values."""
    encoding = encodings.by_name(name)
    values = torch.randn(5, 3, 64).to(torch.float8_e4m3fn)
    raw = values.view(torch.uint8).view(-1)
    raw[:5] = torch.tensor([0x7F, 0xFF, 0x80, 0x01, 0x7E], dtype=torch.uint8)  # NaN, -NaN, -0, subnormal, max
    scale = torch.rand(5, 3) + 0.5
    scale[0, 0] = torch.finfo(torch.float32).smallest_normal / 8
    states = Float8States(values, scale)
    tensors, metadata = _round_trip(encoding, states, tmp_path)
    assert _bits(tensors["hidden_states"]) == _bits(values)
    assert _bits(tensors[encodings.SCALE_TENSOR]) == _bits(scale)
    assert torch.equal(dequantize(tensors, metadata).nan_to_num(), (values.float() * scale[..., None]).nan_to_num())


def test_dtype_choices_are_the_registry_and_each_stored_name_is_known():
    assert encodings.names() == tuple(encodings.ENCODINGS)
    for name, encoding in encodings.ENCODINGS.items():
        assert stored_dtype(name) == encoding.stored and encodings.of_spec(encoding.stored) is encoding
    with pytest.raises(HsxError, match="expected one of bfloat16, "):
        stored_dtype("int8")


def test_a_file_from_before_the_encoding_key_is_read_as_before(tmp_path):
    """Files without `encoding`: known by their `dtype`, or by the float8 scale tensor."""
    float8 = encodings.by_name("float8")
    quantized = float8.encode(torch.randn(4, 2, 16))
    for metadata in ({"dtype": "float8_e4m3"}, {}):
        samplefile.write(tmp_path / "old", quantized, metadata)
        tensors, _ = load_sample((tmp_path / "old").read_bytes())
        assert encodings.of_file(metadata, tensors) is float8
        assert dequantize(tensors).dtype == torch.float32


def test_a_file_of_an_unknown_encoding_is_refused_in_one_line_naming_it(tmp_path):
    from hsx.storage.reader import HiddenStateDataset

    folder = tmp_path / "job"
    path = folder / "00000" / "0.safetensors"
    path.parent.mkdir(parents=True)
    samplefile.write(
        path,
        {"hidden_states": torch.zeros(2, 1, 4, dtype=torch.bfloat16), "input_ids": torch.zeros(2, dtype=torch.int64)},
        {"job": "job", "sample_index": "0", "num_tokens": "2", "dtype": "bfloat16", "encoding": "bfloat16-lz9"},
    )
    with pytest.raises(HsxError) as caught:
        HiddenStateDataset(str(folder))[0]
    message = str(caught.value)
    assert "\n" not in message and str(path.relative_to(tmp_path)) in message and "'bfloat16-lz9'" in message


def test_a_job_file_naming_another_or_an_unknown_encoding_is_not_the_jobs_sample(tmp_path):
    from hsx.storage.expected import ExpectedSamples, mismatches

    expected = ExpectedSamples(job="job", encoding=encodings.by_name("bfloat16"))
    for named, detail in (("bfloat16-lz9", "'bfloat16-lz9' is none this hsx knows"), ("float16", "'float16'")):
        path = tmp_path / f"{named}.safetensors"
        samplefile.write(
            path,
            {
                "hidden_states": torch.zeros(2, 1, 4, dtype=torch.bfloat16),
                "input_ids": torch.zeros(2, dtype=torch.int64),
            },
            {"job": "job", "sample_index": "0", "num_tokens": "2", "dtype": "bfloat16", "encoding": named},
        )
        failed = mismatches(path.read_bytes(), expected, 0)
        assert list(failed) == ["encoding"] and detail in failed["encoding"], failed
