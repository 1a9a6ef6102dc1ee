"""Layer selection: `--layers 1,16,31` are 0-based decoder layer indices; negative indices count
from the end (-1 is the last decoder layer). Validated against the model's layer count."""

from hsx.errors import HsxError


def parse_layers(text: str) -> list[int]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise HsxError("--layers is empty: give 0-based decoder layer indices, e.g. --layers 1,3,5")
    layers = []
    for item in items:
        try:
            layers.append(int(item))
        except ValueError:
            raise HsxError(f"--layers: {item!r} is not a layer index (0-based integers, e.g. 1,3,5 or -1)") from None
    return layers


def resolve_layers(layers: list[int], num_layers: int, *, model: str) -> list[int]:
    resolved = []
    for layer in layers:
        index = layer + num_layers if layer < 0 else layer
        if not 0 <= index < num_layers:
            raise HsxError(
                f"--layers: layer {layer} does not exist: model {model} has {num_layers} decoder layers "
                f"(valid indices 0..{num_layers - 1}, or -{num_layers}..-1)"
            )
        resolved.append(index)
    seen = set()
    for original, index in zip(layers, resolved):
        if index in seen:
            raise HsxError(f"--layers: layer {original} is selected twice")
        seen.add(index)
    return resolved
