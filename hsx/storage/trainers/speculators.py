"""`speculators`: speculators' cached hidden states. Each sample's file is
`hidden_states/hs_<row>.safetensors` holding `hidden_states` [T, k+1, H] (the k layers, then the
last decoder layer's raw output) and `token_ids` [T] int64; once every sample is there, the
token table beside it is a `datasets` `save_to_disk` folder (`write_speculators_table`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from hsx.errors import HsxError
from hsx.job import FINAL, JobSpec
from hsx.storage.trainers.base import Sample, TrainerFormat, masked_otherwise

if TYPE_CHECKING:
    import torch

    from hsx.storage.tokens import SampleTable


class Speculators(TrainerFormat):
    name = "speculators"
    reads_tokens = True  # its table comes from the job's tokenized samples: a rerun reads no file it wrote

    def trainer_layer_ids(self, spec: JobSpec) -> dict[str, list[int]]:
        layers, last = list(spec.layers), spec.last_decoder_layer
        if FINAL in layers or len(layers) < 2 or last is None or layers[-1] != last:
            raise HsxError(
                f"job {spec.job} has layers {layers}: speculators reads its layers then the last decoder "
                "layer's raw output; make the job with --layers speculators (or your layers then -1)"
            )
        return {"target_layer_ids": [layer + 1 for layer in layers[:-1]]}

    def convention_note(self, chat_convention: str) -> str:
        if chat_convention == "speculators":
            return ""
        return masked_otherwise(chat_convention, "speculators' preprocessing makes (--chat-as speculators)")

    def path(self, out: Path, sample_index: int) -> Path:
        # Row i of the table is sample i: the table is written only once every sample is there.
        return out / "hidden_states" / f"hs_{sample_index}.safetensors"

    def refusal(self, sample: Sample) -> str | None:
        return None

    def features(self, sample: Sample) -> dict[str, torch.Tensor]:
        return {"hidden_states": sample.hidden_states.contiguous(), "token_ids": sample.input_ids}

    def encode(self, tensors: dict[str, torch.Tensor]) -> bytes:
        from safetensors.torch import save

        return save(tensors)

    def finish(self, out: Path, tokens: SampleTable | None) -> None:
        assert tokens is not None, "reads_tokens: export passes the job's tokenized samples"
        write_speculators_table(out, tokens)


SPECULATORS = Speculators()


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
