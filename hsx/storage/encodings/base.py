"""What an encoding is: one way of storing a sample's hidden states [T, k, H] in its file, named
by `--dtype`. An encoding owns the dtype the forward runs in, what it does to a batch's states on
the device before they cross to the host (`on_device`, `landed`: float8 quantizes there, the others
pass them on), the tensors and metadata it writes (`encode`), how they become the stored states
again (`decode`) and their real values (`values`), what a header of its files must hold
(`header_states`, `header_problems`), the size of those tensors (exact, or a bound when
`exact_size` is False, with how far under it a measured ratio puts a file: `under_bound`) and the
tolerance `hsx verify --recompute` allows. The registry of encodings is
hsx/storage/encodings/__init__.py; a job's encoding is looked up there once, from its spec
(hsx/storage/layout.py `SampleFiles`), and handed on as this object.

No torch at import: the producer, uploader and monitor name encodings and check headers without
it; encode and decode import it when they run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hsx.storage.samplefile import SampleFileCorrupt

if TYPE_CHECKING:
    import torch

HIDDEN = "hidden_states"
ENCODING_KEY = "encoding"  # the metadata key that names a file's encoding (files before it: inferred)

# name -> (torch dtype name, shape), as hsx.storage.samplefile.file_size sizes a file.
TensorShapes = dict[str, tuple[str, list[int]]]


class UnknownEncoding(SampleFileCorrupt):
    """A file whose metadata names an encoding this hsx does not have (a newer hsx wrote it?)."""


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """How far `hsx verify --recompute` lets stored states be from a float32 recomputation:
    `measure` is "max_abs_error" or "relative_error" (||stored - ref|| / ||ref||)."""

    measure: str
    limit: float


@dataclass(frozen=True, kw_only=True)
class Encoding:
    name: str  # the --dtype value, and `encoding` in its files' metadata
    stored: str  # JobSpec.dtype and the files' `dtype` metadata (the name, but for float8's)
    compute: str  # the torch dtype the forward runs in (and `hsx export --dtype auto` writes)
    tolerance: Tolerance
    help: str  # for --dtype's help, beside the name ("" when the name says it)
    exact_size: bool = True  # False: `file_tensors` is a bound (compressed encodings)

    def on_device(self, states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What of a batch's states [B, P, k, H] (in the compute dtype, on the device where the
        forward made them) crosses to the host: the states themselves, or what the encoding makes
        of them there (gpu_consumer/extract.py copies these tensors)."""
        return (states,)

    def landed(self, hosts: Sequence[torch.Tensor], row: int, length: int) -> Any:
        """One sample's states, as `encode` takes them, from the host copies of `on_device`'s
        tensors: batch row `row`, its first `length` tokens (a view)."""
        return hosts[0][row, :length]

    def file_tensors(self, tokens: int, layers: int, hidden: int) -> TensorShapes:
        """The hidden-state tensors of a file of [tokens, layers, hidden] states, exactly or at most."""
        raise NotImplementedError

    def under_bound(self, tokens: int, layers: int, hidden: int, *, ratio: float) -> float:
        """How many bytes a file of [tokens, layers, hidden] states is expected to be under its size
        from `file_tensors` when its states take `ratio` of their bytes (producer/measure.py
        measures it): 0 where that size is exact."""
        return 0.0

    def file_metadata(self, tokens: int, layers: int, hidden: int) -> dict[str, str]:
        """The metadata its files carry besides hsx.storage.layout.sample_metadata's."""
        return {ENCODING_KEY: self.name}

    def encode(self, states: Any) -> dict[str, torch.Tensor]:
        """A sample's states (a [T, k, H] tensor in the compute dtype, or what the forward handed
        over) -> the tensors its file holds. Runs in the consumer's writer threads."""
        raise NotImplementedError

    def decode(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, torch.Tensor]:
        """A loaded file's tensors -> the stored states as readers return them (`hidden_states`,
        float8's `hidden_states_scale`), the other tensors unchanged; SampleFileCorrupt if they
        do not decode."""
        return tensors

    def values(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The real hidden states of decoded tensors (float8: dequantized to float32)."""
        return tensors[HIDDEN]

    def header_states(self, header: dict, metadata: dict[str, str]) -> dict | None:
        """What a file's header says its stored states are, as a safetensors header entry
        ({"dtype", "shape"}); None when it holds none."""
        entry = header.get(HIDDEN)
        return entry if isinstance(entry, dict) else None

    def header_dtype(self) -> str:
        """The safetensors dtype `header_states` must have."""
        raise NotImplementedError

    def header_problems(self, header: dict, states: dict | None) -> dict[str, str]:
        """What else in a header is not as this encoding writes it, check -> detail."""
        return {}
