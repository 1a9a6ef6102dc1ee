"""Layer selection: `parse_layers` reads `--layers` (0-based decoder layer indices, negative ones
counted from the end, `final`, or one of the trainers' presets, `PRESET_FAMILIES`: a preset is
its function and its line there), `Preset.layers` gives a preset's ids for a model's depth, and
`resolve_layers` checks the selection against the model: the job's `Layer`s, resolved once by the
producer and recorded in its spec (with the preset's name, `layer_preset`), which is what every
reader, the trainers' formats included, reads.

What an id and a preset mean: docs/reference/data.md, "Layers for a trainer"; notes in
docs/architecture/storage.md.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from hsx.errors import HsxError
from hsx.job import FINAL, Layer

_COUNT = re.compile(r"\d+")


@dataclass(frozen=True, kw_only=True)
class PresetFamily:
    """A trainer's layers, as `--layers` names them: `name` alone (`eagle3`), or `name:N` when the
    trainer's layers depend on a count (`dflash:N`, N the draft's layers); `layers` gives them, as
    hsx ids, for a model of `num_layers` decoder layers (and N)."""

    name: str
    layers: Callable[..., list[Layer]]  # (num_layers) or (num_layers, count)
    takes_count: bool = False

    def spelled(self) -> str:
        return f"{self.name}:N" if self.takes_count else self.name


def _dflash(num_layers: int, draft_layers: int) -> list[Layer]:
    # SpecForge's build_target_layer_ids: spread from 1 to num_layers - 3, one in the middle alone.
    if draft_layers == 1:
        return [num_layers // 2]
    span = num_layers - 4  # from 1 to num_layers - 3
    return [round(1 + i * span / (draft_layers - 1)) for i in range(draft_layers)]


# The presets, by name; adding one is its function and its line here. In --layers' help order.
PRESET_FAMILIES: dict[str, PresetFamily] = {
    family.name: family
    for family in (
        PresetFamily(name="dflash", layers=_dflash, takes_count=True),
        PresetFamily(name="eagle3", layers=lambda n: [1, n // 2 - 1, n - 4, FINAL]),
        PresetFamily(name="speculators", layers=lambda n: [1, n // 2 - 1, n - 4, n - 1]),
    )
}
PRESETS = tuple(family.spelled() for family in PRESET_FAMILIES.values())


class Preset(msgspec.Struct, frozen=True):
    """A trainer's preset as the user named it (`dflash:5`, `eagle3`, `speculators`): its layers
    are known once the model's depth is (`layers`, `resolve_layers`)."""

    name: str

    def __str__(self) -> str:
        return self.name

    def layers(self, num_layers: int) -> list[Layer]:
        """The layers (hsx ids) this preset names on a model with `num_layers` decoder layers."""
        family, _, count = self.name.partition(":")
        preset = PRESET_FAMILIES[family]
        return preset.layers(num_layers, int(count)) if preset.takes_count else preset.layers(num_layers)


# What --layers asks for: a preset, or layer indices as given (negative ones count from the end).
# `resolve_layers` turns either into the job's layers (`list[Layer]`, non-negative or FINAL).
LayerRequest = Preset | tuple[int | Literal["final"], ...]


def _preset(given: str) -> Preset | None:
    """The preset `given` names (one of PRESET_FAMILIES, its count given where it takes one), None
    when it names none; a one-line error for a preset's name spelled without its count or with one
    it does not take."""
    text = given.lower()
    name, colon, count = text.partition(":")
    family = PRESET_FAMILIES.get(name)
    if family is None:
        return None
    if family.takes_count != bool(colon) or (colon and not _COUNT.fullmatch(count)):
        raise HsxError(
            f"--layers {given!r}: the {family.name} preset is {family.spelled()}"
            + (", N the draft's layer count" if family.takes_count else "")
        )
    if colon and int(count) == 0:
        raise HsxError(f"--layers {text}: give the draft's layer count, e.g. {family.name}:5")
    return Preset(text)


def parse_layers(text: str) -> LayerRequest:
    """Layer indices and `final`, or one preset (kept as its name until the model's depth is known)."""
    preset = _preset(text.strip())
    if preset is not None:
        return preset
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
    return Preset(preset).layers(num_layers)


def resolve_layers(request: LayerRequest, num_layers: int, *, model: str) -> list[Layer]:
    """The job's layers: a preset expanded, negative indices counted from the end, each checked
    against the model's depth and for duplicates; a one-line error naming the model otherwise."""
    if isinstance(request, Preset):
        expanded = request.layers(num_layers)
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
