"""The files each drafter trainer reads, made from one hsx sample (`FORMATS`: SpecForge's DFlash and
EAGLE-3 offline features, speculators' cached hidden states; `features`, `encode`,
`write_speculators_table`), and the layer ids to give each trainer (`trainer_layer_ids`).
`hsx export` (commands/export.py) drives them; nothing of NATS here.

What each format holds: docs/TRAINING.md, "Export", and docs/ARCHITECTURE.md, "Module notes";
layer conventions: docs/REFERENCE.md, "Layers for a trainer".
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hsx.errors import HsxError
from hsx.storage import encodings
from hsx.wire import schemas
from hsx.wire.schemas import FINAL

if TYPE_CHECKING:
    import torch

    from hsx.storage.tokens import SampleTable

# torch is imported where tensors are saved, so that the CLI names the formats without it.
FORMATS = ("specforge-dflash", "specforge-eagle3", "speculators")
SPECFORGE_GROUP = 2000  # SpecForge's writer: rows_<g>-<g+2000>
DTYPES = ("auto", "bfloat16", "float16", "float32")  # of the exported hidden states


def export_dtype(requested: str, stored: str) -> str:
    """The exported hidden states' dtype: `auto` is the dtype the job's forward ran in (its
    encoding's compute dtype): the job's own for bfloat16, float16 and float32, bfloat16 for float8
    (what the trainers train in; its rounding, 2^-9, is far below float8's own, and float32 would
    be four times the job's size) and for compressed bfloat16."""
    if requested != "auto":
        return requested
    return encodings.of_spec(stored).compute


@dataclass(frozen=True, kw_only=True)
class Sample:
    sample_index: int
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] int64 (all ones when the dataset had none)
    hidden_states: torch.Tensor  # [T, k, H], dequantized
    source_id: str | None = None  # the dataset row's id (its file's metadata), to name a sample left out


def trainer_layer_ids(fmt: str, spec: schemas.JobSpec) -> dict:
    """What the trainer's config must name for this export (its own convention), or a one-line
    HsxError saying which `--layers` would make this format."""
    layers = list(spec.layers)
    ints = [layer for layer in layers if layer != FINAL]
    if fmt == "specforge-dflash":
        if FINAL in layers:
            raise HsxError(
                f"job {spec.job} has layers {layers}: SpecForge's DFlash reads decoder layers only, not "
                "'final'; make the job with --layers dflash:N (N = the draft's layers)"
            )
        return {"target_layer_ids": ints}
    if fmt == "specforge-eagle3":
        if len(ints) != 3 or layers[-1] != FINAL or len(layers) != 4:
            raise HsxError(
                f"job {spec.job} has layers {layers}: SpecForge's EAGLE-3 reads three decoder layers and "
                "the final state; make the job with --layers eagle3 (or three layers then final)"
            )
        return {"aux_hidden_state_layer_ids": ints}
    if fmt == "speculators":
        last = spec.num_layers - 1 if spec.num_layers else None
        if spec.layer_preset == "speculators" and last is None:
            last = layers[-1]
        if FINAL in layers or len(layers) < 2 or last is None or layers[-1] != last:
            raise HsxError(
                f"job {spec.job} has layers {layers}: speculators reads its layers then the last decoder "
                "layer's raw output; make the job with --layers speculators (or your layers then -1)"
            )
        return {"target_layer_ids": [layer + 1 for layer in layers[:-1]]}
    raise AssertionError(fmt)


def has_adjacent_supervised(loss_mask: torch.Tensor) -> bool:
    """SpecForge's DFlash reader needs two consecutive supervised tokens in a sample."""
    mask = loss_mask.bool()
    return bool((mask[1:] & mask[:-1]).any()) if mask.numel() > 1 else False


def specforge_path(out: Path, sample_index: int) -> Path:
    group = sample_index // SPECFORGE_GROUP * SPECFORGE_GROUP
    return out / f"rows_{group}-{group + SPECFORGE_GROUP}" / f"data_{sample_index}.ckpt"


def speculators_path(out: Path, row: int) -> Path:
    return out / "hidden_states" / f"hs_{row}.safetensors"


def convention_note(fmt: str, chat_convention: str) -> str:
    """One line when the job's chat rows were masked by another convention (--chat-as) than the
    trainer's own preprocessing; "" when they agree. Not a refusal: the masks are a choice, the
    hidden states are right either way, and extracting again costs GPU hours."""
    if fmt.startswith("specforge-"):
        if chat_convention.startswith("specforge:"):
            return ""
        theirs = "SpecForge's preprocess_conversations makes (--chat-as specforge:TEMPLATE)"
    else:
        if chat_convention == "speculators":
            return ""
        theirs = "speculators' preprocessing makes (--chat-as speculators)"
    return (
        f"the job's chat rows were masked by --chat-as {chat_convention}, not as {theirs}: "
        "their loss masks differ from the trainer's own (docs/TRAINING.md, Chat conventions)"
    )


def refusal(fmt: str, sample: Sample) -> str | None:
    """Why the trainer cannot take `sample` (it is left out and listed), or None."""
    if fmt == "specforge-dflash" and not has_adjacent_supervised(sample.loss_mask):
        return "no two consecutive supervised tokens (SpecForge's DFlash reader raises on it)"
    return None


def features(fmt: str, sample: Sample) -> dict[str, torch.Tensor]:
    """The tensors of the trainer's file for `sample`."""
    hidden = sample.hidden_states
    tokens, width = hidden.shape[0], hidden.shape[-1]
    if fmt == "specforge-dflash":
        return {
            "input_ids": sample.input_ids,
            "loss_mask": sample.loss_mask,
            "hidden_states": hidden.reshape(tokens, -1).contiguous(),
        }
    if fmt == "specforge-eagle3":
        return {
            "input_ids": sample.input_ids,
            "loss_mask": sample.loss_mask,
            "aux_hidden_state": hidden[:, :3].reshape(1, tokens, 3 * width).contiguous(),
            "hidden_state": hidden[:, 3].reshape(1, tokens, width).contiguous(),
        }
    if fmt == "speculators":
        return {"hidden_states": hidden.contiguous(), "token_ids": sample.input_ids}
    raise AssertionError(fmt)


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holds all of `data` or is absent: a resumed export trusts every file it finds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with open(partial, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def encode(fmt: str, tensors: dict[str, torch.Tensor]) -> bytes:
    if fmt == "speculators":
        from safetensors.torch import save

        return save(tensors)
    import torch

    buffer = io.BytesIO()
    torch.save(tensors, buffer)  # the zip format: SpecForge loads it with mmap=True
    return buffer.getvalue()


def write_speculators_table(out: Path, table: SampleTable) -> None:
    """The datasets folder speculators' ArrowDataset opens, from the job's tokenized samples (its
    bundle's tokens.arrow, sample i at row i <-> hidden_states/hs_<i>): int64 lists, as its own
    preprocessing writes them, in shards of at most 500 MB. Made in bounded memory, whatever the
    job's size: the rows go run by run into one Arrow file in OUT (`.table.rows.arrow`, 16 bytes
    a token, removed after), which datasets maps from disk and cuts into its shards."""
    try:
        import datasets
    except ImportError:
        raise HsxError(
            "--to speculators writes a datasets folder: pip install datasets (or the checkout's '.[export]' extra)"
        ) from None
    import shutil

    import numpy as np
    import pyarrow as pa

    partial, rows = out / ".table.partial", out / ".table.rows.arrow"
    if partial.exists():
        shutil.rmtree(partial)
    schema = pa.schema(
        [("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())), ("seq_len", pa.int64())]
    )
    with pa.OSFile(str(rows), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for first, offsets, tokens, masks in table.runs():
            lengths = np.diff(offsets)
            # A sample without a mask had none in its dataset: every token counts.
            unmasked = np.repeat(~table.has_mask[first : first + len(lengths)], lengths)
            mask_values = np.ones(len(tokens), dtype=np.int64) if masks is None else masks.astype(np.int64)
            mask_values[unmasked] = 1
            list_offsets = pa.array(offsets.astype(np.int32))  # a run is a few million tokens
            writer.write_batch(
                pa.record_batch(
                    [
                        pa.ListArray.from_arrays(list_offsets, pa.array(tokens.astype(np.int64))),
                        pa.ListArray.from_arrays(list_offsets, pa.array(mask_values)),
                        pa.array(lengths),
                    ],
                    schema=schema,
                )
            )
    dataset = datasets.Dataset.from_file(str(rows))  # memory-mapped, not loaded
    dataset.set_format(type="torch")  # speculators compares token ids with torch.equal
    dataset.save_to_disk(str(partial), max_shard_size="500MB")
    del dataset
    rows.unlink()
    for name in os.listdir(partial):  # beside hidden_states/, where speculators looks for them
        os.replace(partial / name, out / name)
    partial.rmdir()
