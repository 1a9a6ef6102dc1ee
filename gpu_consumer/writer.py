"""Writing one sample's file into the spool, atomically, and describing it for the uploader."""

import re
from pathlib import Path

import torch

from hsx.storage import samplefile
from hsx.storage.layout import SampleFiles, sample_key
from hsx.storage.sampledigest import sample_digest
from hsx.storage.spool import spool_file
from hsx.wire.schemas import FileReady, Sample

# hsx.storage.fsutil.atomic_write writes `.<name>.<hex>.tmp` next to the file, then renames it.
_TEMP_NAME = re.compile(r"^\..+\.safetensors\.[0-9a-f]+\.tmp$")


def remove_orphaned_temp_files(folder: Path, *, older_than: float) -> int:
    """Remove the temp files a killed writer left in the plan's spool folder (it died between
    creating and renaming one) that were last modified before `older_than`, this process's start:
    a live writer keeps its temp file's mtime current, and a writer killed before this process
    started will never rename its own. Returns how many were removed."""
    removed = 0
    for path in folder.rglob(".*.tmp"):
        if not _TEMP_NAME.match(path.name):
            continue
        try:
            if path.stat().st_mtime < older_than:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def write_sample_file(
    *,
    spool: Path,
    files: SampleFiles,
    node: str,
    batch_id: str,
    sample: Sample,
    hidden_states,
    sync_dir: bool = True,
) -> FileReady:
    """Write the sample's file into the spool (fsynced, renamed into place) and describe it.
    `sync_dir=False`: the caller fsyncs the file's folder (`hsx.storage.fsutil.fsync_dir`) once for all
    the files it writes there, before it announces any of them. `hidden_states` [T, k, H] are as
    the job's encoding handed them over on the device (gpu_consumer/extract.py; float8's come
    quantized), or as computed; the encoding makes the file's tensors from them here, in the
    caller's writer thread (compression included)."""
    spec = files.spec
    tensors = files.encoding.encode(hidden_states)
    tensors["input_ids"] = torch.tensor(sample.input_ids, dtype=torch.int64)
    mask = sample.mask()  # from loss_spans, or from the per-token list of older descriptors
    if mask is not None:
        tensors["loss_mask"] = torch.tensor(mask, dtype=torch.uint8)
    metadata = files.metadata(sample_index=sample.index, source_id=sample.source_id, shape=tuple(hidden_states.shape))
    path = spool_file(spool, spec.job, spec.plan_tag, sample.index)
    size, digest = samplefile.write(path, tensors, metadata, sync_dir=sync_dir)
    return FileReady(
        job=spec.job,
        node=node,
        batch_id=batch_id,
        sample_index=sample.index,
        num_tokens=len(sample.input_ids),
        # For uploaders before paths were derived; a current one derives it from the sample.
        spool_path=str(path.relative_to(spool)),
        key=sample_key(spec.job, sample.index),
        size=size,
        digest=digest,
        plan=spec.plan_tag,
        sample_digest=sample_digest(sample).hex(),
    )
