"""Where a sample's file lives, and what is inside it (the output format of docs/reference/data.md).

Key: `<job>/<shard>/<sample_index>.safetensors` under the destination prefix, the same relative
path in a node's spool. A shard holds SHARD_SIZE consecutive samples so no directory grows huge.
The job's bundle (what resuming it elsewhere needs) is under `<job>/_hsx/`.

Tensors: `hidden_states` [T, k, H] (k selected layers in the order given), `input_ids` [T],
`loss_mask` [T] when known; how the hidden states are held (dtype, float8 scales, compression)
is the job's encoding's (hsx/storage/encodings/), named in the file's metadata. Metadata makes
the file self-describing.

`SampleFiles` is a job's files as its spec makes them, the spec's `dtype` looked up in the
encodings' registry here, once: the consumer's writer makes files with it, the producer sizes
them with it (producer/estimate.py), and the readers check files against it
(hsx/storage/expected.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from hsx.job import JobSpec, Layer
from hsx.storage import encodings
from hsx.storage.encodings import Encoding

FORMAT_VERSION = "2"  # 2: `checksum` is the sha256 of the data section (hsx.storage.samplefile)
SHARD_SIZE = 1000
# Layer i is the raw output of decoder layer i (0-based): transformers' output_hidden_states[i + 1]
# for every layer but the last, whose transformers entry has the final norm applied.
LAYER_CONVENTION = "decoder_layer_output"


def sample_tensor_shapes(
    *, encoding: Encoding, num_tokens: int, num_layers: int, hidden_size: int, has_mask: bool
) -> dict[str, tuple[str, list[int]]]:
    """The tensors of a sample file as name -> (torch dtype name, shape): what the consumer's
    writer (gpu_consumer/writer.py) makes, for sizing files without making them. For an encoding
    whose size is not exact (compressed), the hidden states' entry is its bound."""
    shapes = encoding.file_tensors(num_tokens, num_layers, hidden_size)
    shapes["input_ids"] = ("int64", [num_tokens])
    if has_mask:
        shapes["loss_mask"] = ("uint8", [num_tokens])
    return shapes


def sample_key(job: str, sample_index: int) -> str:
    return f"{job}/{sample_index // SHARD_SIZE:05d}/{sample_index}.safetensors"


def relative_sample_key(job: str, sample_index: int) -> str:
    return sample_key(job, sample_index)[len(job) + 1 :]


_RELATIVE_KEY = re.compile(r"^\d{5}/(\d+)\.safetensors$")


def sample_index_of(job: str, relative_key: str) -> int | None:
    """The sample index a key in a job folder stands for, or None if it is not a sample file key."""
    match = _RELATIVE_KEY.match(relative_key)
    if not match:
        return None
    index = int(match.group(1))
    return index if relative_sample_key(job, index) == relative_key else None


# The job bundle (producer/bundle.py: spec, tokenized samples, batch plan, input report) sits
# beside the shards under `<job>/_hsx/`; the underscore keeps it apart from the five-digit shard
# folders, and readers of sample files (hsx verify, HiddenStateDataset) pass over it.
BUNDLE_DIR = "_hsx"
TOKENS_FILE = "tokens.arrow"  # in the bundle: the job's tokenized samples (producer/bundle.py)


def bundle_key(job: str, name: str) -> str:
    return f"{job}/{BUNDLE_DIR}/{name}"


def sample_metadata(
    *,
    job: str,
    sample_index: int,
    source_id: str,
    model: str,
    model_revision: str,
    layers: list[Layer],
    dtype: str,
    num_tokens: int,
    plan: str,
    layer_preset: str = "",
) -> dict[str, str]:
    """The metadata every sample file carries; the writer adds `checksum` (hsx.storage.samplefile).
    `plan` is the job's JobSpec.plan_tag: a file says which plan of a job name it was made for, so
    a reader never takes a file left by an earlier job of that name as this one's.
    `layer_preset` (dflash:5, eagle3, ...) only when the job named its layers by one."""
    preset = {"layer_preset": layer_preset} if layer_preset else {}
    return {
        **preset,
        "plan": plan,
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


@dataclass(frozen=True)
class SampleFiles:
    """A job's sample files as its spec makes them: the encoding of their states (the spec's
    `dtype`, looked up once: `of`), and the tensors and metadata each file holds."""

    spec: JobSpec
    encoding: Encoding

    @classmethod
    def of(cls, spec: JobSpec, *, where: str = "") -> SampleFiles:
        """The spec's files; HsxError (prefixed with `where`) for a dtype this hsx has no encoding of."""
        return cls(spec, encodings.of_spec(spec.dtype, where=where))

    def metadata(self, *, sample_index: int, source_id: str, shape: tuple[int, int, int]) -> dict[str, str]:
        """The metadata of the file of a sample whose states are [T, k, H] `shape`: every file's
        (`sample_metadata`) and its encoding's; the writer adds `checksum`."""
        spec = self.spec
        metadata = sample_metadata(
            job=spec.job,
            sample_index=sample_index,
            source_id=source_id,
            model=spec.model,
            model_revision=spec.model_revision,
            layers=spec.layers,
            dtype=spec.dtype,
            num_tokens=shape[0],
            plan=spec.plan_tag,
            layer_preset=spec.layer_preset,
        )
        metadata.update(self.encoding.file_metadata(*shape))
        return metadata

    def tensor_shapes(self, *, num_tokens: int, has_mask: bool) -> dict[str, tuple[str, list[int]]]:
        """The tensors of a sample's file (`sample_tensor_shapes`), the job's states bounded where
        their size is not exact."""
        spec = self.spec
        return sample_tensor_shapes(
            encoding=self.encoding,
            num_tokens=num_tokens,
            num_layers=len(spec.layers),
            hidden_size=spec.hidden_size,
            has_mask=has_mask,
        )
