"""What a trainer format is: the files one drafter trainer reads, made from a job's samples,
named by `hsx export --to`. A format owns its name, the layer ids its trainer's config must name
(and its refusal of a job whose layers it cannot take: `trainer_layer_ids`), whether the job's
masks are its trainer's own (`convention_note`), where a sample's file goes (`path`), which
samples its trainer cannot take (`refusal`), the tensors of a sample's file (`features`) and
their bytes (`encode`), and what it writes once every sample is there (`finish`, from the job's
tokenized samples when `reads_tokens`). The registry of formats is
hsx/storage/trainers/__init__.py.

Every piece is the format's own, with no default: a class that lacks one is refused when it is
defined (`TrainerFormat.__init_subclass__`), so a format never writes with another's behaviour.
A family's shared pieces live in a base defined with `abstract=True` (specforge.py).

No torch at import: the CLI names the formats without it; the formats import it when they run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from hsx.job import JobSpec

if TYPE_CHECKING:
    import torch

    from hsx.storage.tokens import SampleTable


@dataclass(frozen=True, kw_only=True)
class Sample:
    sample_index: int
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] int64 (all ones when the dataset had none)
    hidden_states: torch.Tensor  # [T, k, H], dequantized
    source_id: str | None = None  # the dataset row's id (its file's metadata), to name a sample left out


# What a concrete format must define (itself or in its family's abstract base).
ATTRIBUTES = {"name": str, "reads_tokens": bool}
METHODS = ("trainer_layer_ids", "convention_note", "path", "refusal", "features", "encode", "finish")


class TrainerFormat(ABC):
    name: ClassVar[str]  # the --to value
    reads_tokens: ClassVar[bool]  # `finish` is given the job's tokenized samples (None otherwise)

    def __init_subclass__(cls, *, abstract: bool = False, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if not abstract:
            _check_pieces(cls)

    @abstractmethod
    def trainer_layer_ids(self, spec: JobSpec) -> dict[str, list[int]]:
        """What the trainer's config must name for this export (its own convention), or a
        one-line HsxError saying which `--layers` would make this format."""

    @abstractmethod
    def convention_note(self, chat_convention: str) -> str:
        """One line when the job's chat rows were masked by another convention (--chat-as) than
        the trainer's own preprocessing (`masked_otherwise`); "" when they agree. Not a refusal:
        the masks are a choice, the hidden states are right either way, and extracting again
        costs GPU hours."""

    @abstractmethod
    def path(self, out: Path, sample_index: int) -> Path:
        """The file in OUT that holds the sample: a rerun keeps what is there."""

    @abstractmethod
    def refusal(self, sample: Sample) -> str | None:
        """Why the trainer cannot take `sample` (it is left out and listed), or None."""

    @abstractmethod
    def features(self, sample: Sample) -> dict[str, torch.Tensor]:
        """The tensors of the trainer's file for `sample`."""

    @abstractmethod
    def encode(self, tensors: dict[str, torch.Tensor]) -> bytes:
        """The bytes of the file that holds `tensors`."""

    @abstractmethod
    def finish(self, out: Path, tokens: SampleTable | None) -> None:
        """What OUT holds besides the samples' files, written once every sample is there; `tokens`
        is the job's tokenized samples when `reads_tokens`, None otherwise."""


def _check_pieces(cls: type[TrainerFormat]) -> None:
    """A TypeError, one line naming the format and the piece, for a concrete format that lacks
    one: its own name, or anything else its family has not defined."""
    own_name = cls.__dict__.get("name")
    if not (isinstance(own_name, str) and own_name):
        raise TypeError(f"trainer format {cls.__name__} lacks its name (a class attribute `name`, the --to value)")
    named = f"trainer format {own_name!r} ({cls.__name__})"
    for attribute, kind in ATTRIBUTES.items():
        if not isinstance(getattr(cls, attribute, None), kind):  # an annotation alone is none
            raise TypeError(f"{named} lacks {attribute} (a {kind.__name__} class attribute)")
    for method in METHODS:
        if getattr(getattr(cls, method), "__isabstractmethod__", False):
            raise TypeError(f"{named} lacks {method}()")


def masked_otherwise(chat_convention: str, theirs: str) -> str:
    """The note of a job whose chat rows were masked by `chat_convention`, not as `theirs` (what
    the trainer's own preprocessing makes, and the --chat-as that makes it)."""
    return (
        f"the job's chat rows were masked by --chat-as {chat_convention}, not as {theirs}: "
        "their loss masks differ from the trainer's own (docs/training.md, Chat conventions)"
    )
