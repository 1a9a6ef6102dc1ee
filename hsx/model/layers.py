"""Layer selection: `parse_layers` reads `--layers` (0-based decoder layer indices, negative ones
counted from the end, `final`, or one of the trainer presets in `PRESETS`), `preset_layers` gives
a preset's ids for a model's depth, and `resolve_layers` checks the selection against the model.

What an id and a preset mean: docs/reference/data.md, "Layers for a trainer"; notes in
docs/architecture/storage.md.
"""

import re
from typing import Literal

import msgspec

from hsx.errors import HsxError
from hsx.job import FINAL, Layer

PRESETS = ("dflash:N", "eagle3", "speculators")
_DFLASH = re.compile(r"dflash:(\d+)")


class Preset(msgspec.Struct, frozen=True):
    """A trainer's preset as the user named it (`dflash:5`, `eagle3`, `speculators`): its layers
    are known once the model's depth is (`resolve_layers`)."""

    name: str

    def __str__(self) -> str:
        return self.name


# What --layers asks for: a preset, or layer indices as given (negative ones count from the end).
# `resolve_layers` turns either into the job's layers (`list[Layer]`, non-negative or FINAL).
LayerRequest = Preset | tuple[int | Literal["final"], ...]


def parse_layers(text: str) -> LayerRequest:
    """Layer indices and `final`, or one preset (kept as its name until the model's depth is known)."""
    preset = text.strip().lower()
    if preset in ("eagle3", "speculators") or _DFLASH.fullmatch(preset):
        if preset.startswith("dflash:") and int(preset.removeprefix("dflash:")) == 0:
            raise HsxError("--layers dflash:0: give the draft's layer count, e.g. dflash:5")
        return Preset(preset)
    if preset.startswith("dflash"):
        raise HsxError(f"--layers {text.strip()!r}: the DFlash preset is dflash:N, N the draft's layer count")
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise HsxError("--layers is empty: give 0-based decoder layer indices, e.g. --layers 1,3,5 (or 'final')")
    layers: list[Layer] = []
    for item in items:
        if item.lower() == FINAL:
            layers.append(FINAL)
            continue
        try:
            layers.append(int(item))
        except ValueError:
            raise HsxError(
                f"--layers: {item!r} is not a layer index (0-based integers, e.g. 1,3,5 or -1, or 'final') "
                f"nor a preset ({', '.join(PRESETS)})"
            ) from None
    return tuple(layers)


def preset_of(request: LayerRequest) -> str | None:
    """The name of the preset `request` is, if it is one."""
    return request.name if isinstance(request, Preset) else None


def preset_layers(preset: str, num_layers: int) -> list[Layer]:
    """The layers (hsx ids) preset `preset` names on a model with `num_layers` decoder layers."""
    if match := _DFLASH.fullmatch(preset):
        draft_layers = int(match.group(1))
        if draft_layers == 1:
            return [num_layers // 2]
        span = num_layers - 4  # from 1 to num_layers - 3
        return [round(1 + i * span / (draft_layers - 1)) for i in range(draft_layers)]
    if preset == "eagle3":
        return [1, num_layers // 2 - 1, num_layers - 4, FINAL]
    if preset == "speculators":
        return [1, num_layers // 2 - 1, num_layers - 4, num_layers - 1]
    raise AssertionError(preset)


def resolve_layers(request: LayerRequest, num_layers: int, *, model: str) -> list[Layer]:
    """The job's layers: a preset expanded, negative indices counted from the end, each checked
    against the model's depth and for duplicates; a one-line error naming the model otherwise."""
    if isinstance(request, Preset):
        expanded = preset_layers(request.name, num_layers)
        if len(set(expanded)) != len(expanded) or any(isinstance(i, int) and i < 0 for i in expanded):
            raise HsxError(
                f"--layers {request}: model {model} has {num_layers} decoder layers, too few for this preset "
                f"(it gives layers {', '.join(map(str, expanded))}); give --layers explicitly"
            )
        layers = expanded
    else:
        layers = list(request)
    resolved: list[Layer] = []
    for layer in layers:
        if layer == FINAL:
            resolved.append(FINAL)
            continue
        index = layer + num_layers if layer < 0 else layer
        if not 0 <= index < num_layers:
            raise HsxError(
                f"--layers: layer {layer} does not exist: model {model} has {num_layers} decoder layers "
                f"(valid indices 0..{num_layers - 1}, or -{num_layers}..-1, or 'final')"
            )
        resolved.append(index)
    seen: set[Layer] = set()
    for original, selector in zip(layers, resolved):
        if selector in seen:
            what = "the final state" if selector == FINAL else f"layer {original}"
            raise HsxError(
                f"--layers: {what} is selected twice" + (f" (as layer {selector})" if original != selector else "")
            )
        seen.add(selector)
    return resolved
