"""The base of SpecForge's offline formats (DFlash, EAGLE-3): a sample's file is
`rows_<g>-<g+2000>/data_<i>.ckpt`, `torch.save` in zip format, which SpecForge reads with
`torch.load(mmap=True)`; the trainer's own masks are those SpecForge's preprocess_conversations
makes (--chat-as specforge:TEMPLATE); nothing is written after the samples."""

from __future__ import annotations

import io
from pathlib import Path

from hsx.storage.trainers.base import TrainerFormat, masked_otherwise

SPECFORGE_GROUP = 2000  # SpecForge's writer: rows_<g>-<g+2000>


class SpecForgeFormat(TrainerFormat, abstract=True):
    reads_tokens = False

    def convention_note(self, chat_convention: str) -> str:
        if chat_convention.startswith("specforge:"):
            return ""
        return masked_otherwise(
            chat_convention, "SpecForge's preprocess_conversations makes (--chat-as specforge:TEMPLATE)"
        )

    def path(self, out: Path, sample_index: int) -> Path:
        group = sample_index // SPECFORGE_GROUP * SPECFORGE_GROUP
        return out / f"rows_{group}-{group + SPECFORGE_GROUP}" / f"data_{sample_index}.ckpt"

    def encode(self, tensors):
        import torch

        buffer = io.BytesIO()
        torch.save(tensors, buffer)  # the zip format: SpecForge loads it with mmap=True
        return buffer.getvalue()

    def finish(self, out: Path, tokens) -> None:
        pass
