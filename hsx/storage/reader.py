"""Reading a finished job's sample files back: one file's bytes to tensors and metadata, float8
dequantization, and `HiddenStateDataset`, a random-access torch Dataset over a job's folder in a
destination (`file:///out/myjob`, `s3://bucket/prefix/myjob` or a plain path).

This module knows the file layout (`hsx/storage/layout.py`) and the destinations (`hsx/storage/destinations.py`);
it knows nothing about NATS, job specs or how the files were made.

With a torch DataLoader, each worker process opens its own destination client on its first
`__getitem__` (a boto3 client must not cross a fork), so `num_workers > 0` works over S3.

Which samples a job has comes from its index (`<job>/_hsx/index.arrow`, hsx/storage/index.py) when that
is complete: two GETs, whatever the job's size. Otherwise the folder is listed, and a
`dataset_listing` log line says why.
"""

from __future__ import annotations

import json
import os
from typing import Any

import structlog
import torch
from safetensors.torch import load as _load_safetensors

from hsx.errors import HsxError
from hsx.storage.destinations import Destination, open_destination, split_job_url
from hsx.storage.index import read_index
from hsx.storage.layout import relative_sample_key, sample_index_of
from hsx.storage.samplefile import SampleFileCorrupt
from hsx.storage.tensors import SCALE_TENSOR, dequantize_float8

log = structlog.get_logger("hsx.data")


def read_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors file's header."""
    if len(data) < 8:
        raise SampleFileCorrupt(f"{len(data)} bytes is too short for a safetensors file")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8:
        raise SampleFileCorrupt(f"header length {header_len} runs past the end of the file ({len(data)} bytes)")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SampleFileCorrupt(f"header is not JSON ({exc})") from None
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        raise SampleFileCorrupt("header has no metadata object")
    return metadata


def load_sample(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One sample file's bytes -> (tensors, metadata); SampleFileCorrupt if it does not load."""
    metadata = read_metadata(data)
    try:
        tensors = _load_safetensors(data)
    except Exception as exc:  # safetensors raises SafetensorError, ValueError, ... for damaged files
        raise SampleFileCorrupt(f"safetensors cannot load it ({type(exc).__name__}: {exc})") from None
    return tensors, metadata


def dequantize(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The real hidden states of a file's tensors: for float8 storage (a `hidden_states_scale`
    tensor [T, k] beside float8 `hidden_states` [T, k, H]) `hidden_states.float() * scale[..., None]`
    in float32; for any other storage `hidden_states` unchanged."""
    hidden = tensors["hidden_states"]
    scale = tensors.get(SCALE_TENSOR)
    if scale is None:
        return hidden
    if tuple(scale.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{SCALE_TENSOR} has shape {tuple(scale.shape)}, expected {tuple(hidden.shape[:-1])}")
    return dequantize_float8(hidden, scale.float())


class HiddenStateDataset(torch.utils.data.Dataset):
    """Random access over one job's sample files, in sample-index order.

    `dataset[i]` is a dict: `hidden_states` [T, k, H] (or [T, k*H] with `concat_layers=True`, the
    DFlash concatenated feature), `input_ids` [T], `loss_mask` [T] when the file has one,
    `sample_index`, `metadata`. Float8 files are dequantized to float32 unless `dequantize=False`,
    which returns the raw float8 tensor and `hidden_states_scale` [T, k]. A folder with no sample
    files is an error (a mistyped URL must not read as an empty dataset).

    `sample_tokens` holds each sample's token count when the job's index was read (for length
    grouping without opening a file), else None.
    """

    def __init__(self, url: str, *, concat_layers: bool = False, dequantize: bool = True) -> None:
        self.url, self.job = split_job_url(url)
        self.concat_layers = concat_layers
        self.dequantize = dequantize
        # The opening client is dropped here: each process that reads opens its own.
        folder = open_destination(self.url, max_connections=4)
        index, why_not = read_index(folder, self.job)
        self.sample_tokens: list[int] | None = None
        if index is not None:
            self.sample_indices: list[int] = index.sample_indices.tolist()
            self.sample_tokens = index.table.column("tokens").to_numpy().tolist()
        else:
            log.info("dataset_listing", url=self.url, reason=why_not)
            self.sample_indices = sorted(
                i for i in (sample_index_of(self.job, key) for key in folder.keys()) if i is not None
            )
        if not self.sample_indices:
            raise HsxError(f"{self.url}: no sample files of job {self.job} there")
        self._dest: Destination | None = None
        self._pid: int | None = None

    def __len__(self) -> int:
        return len(self.sample_indices)

    def _destination(self) -> Destination:
        if self._dest is None or self._pid != os.getpid():
            self._dest = open_destination(self.url, max_connections=4)
            self._pid = os.getpid()
        return self._dest

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_dest"] = None
        state["_pid"] = None
        return state

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} samples")
        key = relative_sample_key(self.job, self.sample_indices[i])
        try:
            tensors, metadata = load_sample(self._destination().read_bytes(key))
        except SampleFileCorrupt as exc:
            raise SampleFileCorrupt(f"{self.url}/{key}: {exc}") from None
        hidden = dequantize(tensors) if self.dequantize else tensors["hidden_states"]
        if self.concat_layers:
            hidden = hidden.reshape(hidden.shape[0], -1)
        item: dict[str, Any] = {
            "hidden_states": hidden,
            "input_ids": tensors["input_ids"],
            "sample_index": self.sample_indices[i],
            "metadata": metadata,
        }
        if "loss_mask" in tensors:
            item["loss_mask"] = tensors["loss_mask"]
        if not self.dequantize and SCALE_TENSOR in tensors:
            item[SCALE_TENSOR] = tensors[SCALE_TENSOR]
        return item
