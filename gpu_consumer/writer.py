"""Writing one sample's file into the spool, atomically, and describing it for the uploader."""

import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save

from hsx.fsutil import atomic_write_bytes
from hsx.layout import FLOAT8, quantize_float8, sample_key, sample_metadata, tensor_checksum
from hsx.schemas import FileReady, JobSpec, Sample


# hsx.fsutil.atomic_write_bytes writes `.<name>.<hex>.tmp` next to the file, then renames it.
_TEMP_NAME = re.compile(r"^\..+\.safetensors\.[0-9a-f]+\.tmp$")


def remove_orphaned_temp_files(spool: Path, job: str, *, older_than: float) -> int:
    """Remove the temp files a killed writer left in the job's spool (it died between creating
    and renaming one) that were last modified before `older_than`, this process's start: a live
    writer keeps its temp file's mtime current, and a writer killed before this process started
    will never rename its own. Returns how many were removed."""
    removed = 0
    for path in (spool / job).rglob(".*.tmp"):
        if not _TEMP_NAME.match(path.name):
            continue
        try:
            if path.stat().st_mtime < older_than:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def _canonical_header(data: bytes) -> bytes:
    """The same file with its JSON header's keys sorted.

    safetensors writes the metadata map in a per-process random order (a Rust HashMap), so the
    same sample written by two processes (a batch redelivered after a crash) had different bytes
    and sha256: the uploader then uploaded it again, or, seeing the older event last, took it for
    lost and re-extracted it. Sorted, compact JSON of the same keys and values has the original's
    length, so the space padding and the tensor offsets stay as they are."""
    length = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8 : 8 + length]), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    if len(header) > length:  # not expected; keep the file as written rather than re-lay it out
        return data
    return b"".join((data[:8], header.ljust(length, b" "), memoryview(data)[8 + length :]))


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
    data = _canonical_header(save(tensors, metadata=metadata))
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
