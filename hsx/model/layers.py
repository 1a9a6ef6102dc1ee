"""Layer selection.

`--layers 1,16,31` are 0-based decoder layer indices: layer i is the raw output of decoder layer i.
Negative indices count from the end (-1 is the last decoder layer). `final` selects the post-norm
final state (the last layer's output after the model's final norm; transformers'
`output_hidden_states[-1]`, the state EAGLE-3 trainers call `hidden_state`). Entries keep the order
given; duplicates and out-of-range indices are errors naming the model's layer count.
"""

from hsx.errors import HsxError
from hsx.wire.schemas import LayerSelector

FINAL = "final"


def parse_layers(text: str) -> tuple[LayerSelector, ...]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise HsxError("--layers is empty: give 0-based decoder layer indices, e.g. --layers 1,3,5 (or 'final')")
    layers: list[LayerSelector] = []
    for item in items:
        if item.lower() == FINAL:
            layers.append(FINAL)
            continue
        try:
            layers.append(int(item))
        except ValueError:
            raise HsxError(
                f"--layers: {item!r} is not a layer index (0-based integers, e.g. 1,3,5 or -1, or 'final')"
            ) from None
    return tuple(layers)


def resolve_layers(layers: list[LayerSelector], num_layers: int, *, model: str) -> list[LayerSelector]:
    resolved: list[LayerSelector] = []
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
    seen: set[LayerSelector] = set()
    for original, selector in zip(layers, resolved):
        if selector in seen:
            what = "the final state" if selector == FINAL else f"layer {original}"
            raise HsxError(
                f"--layers: {what} is selected twice" + (f" (as layer {selector})" if original != selector else "")
            )
        seen.add(selector)
    return resolved
