"""Where a sample's file lives, and what is inside it (DESIGN section 4).

Key: `<job>/<shard>/<sample_index>.safetensors` under the destination prefix, the same relative
path in a node's spool. A shard holds SHARD_SIZE consecutive samples so no directory grows huge.
The job's bundle (what resuming it elsewhere needs) is under `<job>/_hsx/`.

Tensors: `hidden_states` [T, k, H] (k selected layers in the order given), `input_ids` [T],
`loss_mask` [T] when known. With float8 storage, `hidden_states` is float8 e4m3 and
`hidden_states_scale` [T, k] float32 holds one scale per token and layer:
value = hidden_states.float() * hidden_states_scale[..., None]. Metadata makes the file
self-describing.
"""

import json

import torch

FORMAT_VERSION = "2"  # 2: `checksum` is the sha256 of the data section (hsx.samplefile)
SHARD_SIZE = 1000
# Layer i is the raw output of decoder layer i (0-based): transformers' output_hidden_states[i + 1]
# for every layer but the last, whose transformers entry has the final norm applied.
LAYER_CONVENTION = "decoder_layer_output"


FLOAT8 = "float8_e4m3"
_FLOAT8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_float8(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k, H] -> (float8 e4m3 values, float32 scales [T, k]); each token's vector of each layer
    is scaled so that its largest magnitude maps to the format's largest finite value."""
    values = hidden_states.float()
    scale = values.abs().amax(dim=-1) / _FLOAT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = (values / scale[..., None]).clamp(-_FLOAT8_MAX, _FLOAT8_MAX).to(torch.float8_e4m3fn)
    return quantized, scale


def dequantize_float8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.float() * scale[..., None]


def sample_key(job: str, sample_index: int) -> str:
    return f"{job}/{sample_index // SHARD_SIZE:05d}/{sample_index}.safetensors"


# The job bundle (producer/bundle.py: spec, tokenized samples, batch plan, input report) sits
# beside the shards under `<job>/_hsx/`; the underscore keeps it apart from the five-digit shard
# folders, and readers of sample files (hsx verify, HiddenStateDataset) pass over it.
BUNDLE_DIR = "_hsx"


def bundle_key(job: str, name: str) -> str:
    return f"{job}/{BUNDLE_DIR}/{name}"


def sample_metadata(
    *,
    job: str,
    sample_index: int,
    source_id: str,
    model: str,
    model_revision: str,
    layers: list[int | str],
    dtype: str,
    num_tokens: int,
) -> dict[str, str]:
    """The metadata every sample file carries; the writer adds `checksum` (hsx.samplefile)."""
    return {
        "format": "pt",
        "hsx_format_version": FORMAT_VERSION,
        "job": job,
        "sample_index": str(sample_index),
        "source_id": source_id,
        "model": model,
        "model_revision": model_revision,
        "layers": json.dumps(layers),
        "layer_convention": LAYER_CONVENTION,
        "dtype": dtype,
        "num_tokens": str(num_tokens),
    }
