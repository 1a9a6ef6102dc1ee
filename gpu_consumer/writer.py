"""Writing one sample's file into the spool, atomically, and describing it for the uploader."""

import hashlib
from pathlib import Path

import torch
from safetensors.torch import save

from hsx.fsutil import atomic_write_bytes
from hsx.layout import FLOAT8, quantize_float8, sample_key, sample_metadata, tensor_checksum
from hsx.schemas import FileReady, JobSpec, Sample


def write_sample_file(
    *, spool: Path, spec: JobSpec, node: str, batch_id: str, sample: Sample, hidden_states: torch.Tensor
) -> FileReady:
    if spec.dtype == FLOAT8:
        quantized, scale = quantize_float8(hidden_states)
        tensors = {"hidden_states": quantized, "hidden_states_scale": scale}
    else:
        tensors = {"hidden_states": hidden_states.contiguous()}
    tensors["input_ids"] = torch.tensor(sample.input_ids, dtype=torch.int64)
    if sample.loss_mask is not None:
        tensors["loss_mask"] = torch.tensor(sample.loss_mask, dtype=torch.uint8)
    metadata = sample_metadata(
        job=spec.job,
        sample_index=sample.index,
        source_id=sample.source_id,
        model=spec.model,
        model_revision=spec.model_revision,
        layers=spec.layers,
        dtype=spec.dtype,
        num_tokens=len(sample.input_ids),
        checksum=tensor_checksum(tensors),
    )
    data = save(tensors, metadata=metadata)
    key = sample_key(spec.job, sample.index)
    atomic_write_bytes(spool / key, data)
    return FileReady(
        job=spec.job,
        node=node,
        batch_id=batch_id,
        sample_index=sample.index,
        num_tokens=len(sample.input_ids),
        spool_path=key,
        key=key,
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        sample=sample,
    )
