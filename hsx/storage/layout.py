"""Where a sample's file lives, and what is inside it (the output format of docs/REFERENCE.md).

Key: `<job>/<shard>/<sample_index>.safetensors` under the destination prefix, the same relative
path in a node's spool. A shard holds SHARD_SIZE consecutive samples so no directory grows huge.
The job's bundle (what resuming it elsewhere needs) is under `<job>/_hsx/`.

Tensors: `hidden_states` [T, k, H] (k selected layers in the order given), `input_ids` [T],
`loss_mask` [T] when known. With float8 storage, `hidden_states` is float8 e4m3 and
`hidden_states_scale` [T, k] float32 holds one scale per token and layer:
value = hidden_states.float() * hidden_states_scale[..., None]. Metadata makes the file
self-describing. The tensors themselves (dtypes, float8 scaling) are hsx/storage/tensors.py.
"""

import json
import re

from hsx.errors import HsxError
from hsx.wire.schemas import Layer

FORMAT_VERSION = "2"  # 2: `checksum` is the sha256 of the data section (hsx.storage.samplefile)
SHARD_SIZE = 1000
# Layer i is the raw output of decoder layer i (0-based): transformers' output_hidden_states[i + 1]
# for every layer but the last, whose transformers entry has the final norm applied.
LAYER_CONVENTION = "decoder_layer_output"


FLOAT8 = "float8_e4m3"
SCALE_TENSOR = "hidden_states_scale"  # float8 files' per-token, per-layer scales [T, k]
# --dtype: what a job's files hold; float8 is stored as FLOAT8, e4m3 with a per-token scale.
DTYPE_CHOICES = ("bfloat16", "float16", "float32", "float8")


# The stored dtype -> the torch dtype name of `hidden_states` in the file (hsx/storage/tensors.py
# has the torch dtypes themselves; this side needs no torch).
_HIDDEN_DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", FLOAT8: "float8_e4m3fn"}


def sample_tensor_shapes(
    *, dtype: str, num_tokens: int, num_layers: int, hidden_size: int, has_mask: bool
) -> dict[str, tuple[str, list[int]]]:
    """The tensors of a sample file as name -> (torch dtype name, shape): what the consumer's
    writer (gpu_consumer/writer.py) makes, for sizing files without making them."""
    shapes = {
        "hidden_states": (_HIDDEN_DTYPE_NAMES[dtype], [num_tokens, num_layers, hidden_size]),
        "input_ids": ("int64", [num_tokens]),
    }
    if dtype == FLOAT8:
        shapes[SCALE_TENSOR] = ("float32", [num_tokens, num_layers])
    if has_mask:
        shapes["loss_mask"] = ("uint8", [num_tokens])
    return shapes


def stored_dtype(name: str) -> str:
    """The --dtype choice as the job spec and the files name it."""
    if name not in DTYPE_CHOICES:
        raise HsxError(f"expected one of {', '.join(DTYPE_CHOICES)}, got {json.dumps(name)}")
    return FLOAT8 if name == "float8" else name


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
