"""Where a sample's file lives, and what is inside it (DESIGN section 4).

Key: `<job>/<shard>/<sample_index>.safetensors` under the destination prefix, the same relative
path in a node's spool. A shard holds SHARD_SIZE consecutive samples so no directory grows huge.

Tensors: `hidden_states` [T, k, H] (k selected layers in the order given), `input_ids` [T],
`loss_mask` [T] when known. Metadata makes the file self-describing.
"""

import hashlib
import json

import torch

FORMAT_VERSION = "1"
SHARD_SIZE = 1000
# Layer i is the raw output of decoder layer i (0-based): transformers' output_hidden_states[i + 1]
# for every layer but the last, whose transformers entry has the final norm applied.
LAYER_CONVENTION = "decoder_layer_output"


def sample_key(job: str, sample_index: int) -> str:
    return f"{job}/{sample_index // SHARD_SIZE:05d}/{sample_index}.safetensors"


def tensor_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's raw bytes in name order: the file's content, independent of
    the safetensors header (which holds this checksum)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(name.encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return "sha256:" + digest.hexdigest()


def sample_metadata(
    *,
    job: str,
    sample_index: int,
    source_id: str,
    model: str,
    model_revision: str,
    layers: list[int],
    dtype: str,
    num_tokens: int,
    checksum: str,
) -> dict[str, str]:
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
        "checksum": checksum,
    }
