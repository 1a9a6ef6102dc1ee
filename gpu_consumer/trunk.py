"""The part of a causal LM that a layer selection runs (its trunk), and loading only that part,
straight onto the consumer's device.

Decoder layers up to the deepest selected one need the embedding and those layers; `final` needs
every layer and the final norm; nothing needs the output head (lm_head). The model class is the
one `AutoModelForCausalLM` would pick (remote code included, a vision-language checkpoint's text
model where transformers maps it to one), subclassed so that, once built on the meta device and
before any weight is read, it drops the layers past the deepest, the final norm unless asked, and
the output head. transformers' own loader then reads only the checkpoint tensors the trunk holds
(its key renamings and weight conversions applied as for the whole model); the dropped parts'
tensors are never read, and are left out of its report of unused checkpoint weights. With a
`device_map` of the device itself each tensor goes from the file to the device, not through a
copy of the model in host memory. The config stays the checkpoint's: it still names every layer.

Knows the model as a module tree and a checkpoint folder; nothing of hooks, NATS or the job.
"""

import importlib.util
import re
import sys
import time
from dataclasses import dataclass

import structlog
import torch
from torch import nn

from hsx.errors import HsxError
from hsx.job import FINAL, Layer
from hsx.model.modelinfo import remote_code_refused

log = structlog.get_logger("hsx.gpu_consumer.trunk")

_AUTO_CLASS = "AutoModelForCausalLM"


def decoder_stack(model: nn.Module) -> nn.Module:
    """The module that holds `.layers` and `.norm` (`model.model` for most causal LMs)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, model.base_model_prefix, model)
    if not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise HsxError(f"model class {type(model).__name__}: cannot find its decoder layers (no .layers ModuleList)")
    return base


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return decoder_stack(model).layers


@dataclass(frozen=True, kw_only=True)
class Trunk:
    """What a layer selection runs of a model with `total` decoder layers."""

    depth: int  # decoder layers 0 .. depth - 1
    total: int
    final_norm: bool

    @classmethod
    def of(cls, layers: list[Layer], total: int) -> "Trunk":
        indices = [layer for layer in layers if layer != FINAL]
        beyond = [index for index in indices if not 0 <= index < total]
        if beyond:
            raise HsxError(f"layer {max(beyond)} does not exist: the model has {total} decoder layers")
        if FINAL in layers or not indices:
            return cls(depth=total, total=total, final_norm=True)
        return cls(depth=max(indices) + 1, total=total, final_norm=False)


@dataclass(frozen=True, kw_only=True)
class LoadReport:
    """What `load_trunk` loaded, for the consumer's start-up log."""

    layers_loaded: int
    layers_total: int
    final_norm: bool
    weight_bytes: int  # of the parameters the trunk holds, on the device
    seconds: float
    # "direct": each tensor from the file to the device; "via_host": built in host memory first
    # and then moved (a non-CPU device without accelerate, which transformers needs for a device_map).
    placement: str

    def fields(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def causal_lm_class(config, path: str, *, trust_remote_code: bool, revision: str | None) -> tuple[type, object]:
    """The class `AutoModelForCausalLM` would build for `config`, and the config that class takes
    (a vision-language config's `text_config`, where transformers maps the model to its text-only
    causal LM)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    class_ref = (getattr(config, "auto_map", None) or {}).get(_AUTO_CLASS)
    if class_ref and trust_remote_code:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(class_ref, path, revision=revision, local_files_only=True), config
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        if class_ref:
            raise remote_code_refused(path)
        raise HsxError(f"model {path}: transformers has no causal LM for its config ({type(config).__name__})")
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if isinstance(model_class, (list, tuple)):  # several classes for one config: the one it names
        named = {candidate.__name__: candidate for candidate in model_class}
        model_class = next(
            (named[a] for a in getattr(config, "architectures", None) or [] if a in named), model_class[0]
        )
    text_config = getattr(config, "sub_configs", {}).get("text_config")
    if text_config is not None and getattr(model_class, "config_class", None) is text_config:
        quantization = getattr(config, "quantization_config", None)
        config = config.get_text_config()
        if quantization is not None:
            config.quantization_config = quantization
    return model_class, config


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)


def _cut(model: nn.Module, trunk: Trunk) -> None:
    """Drop what the trunk does not run from a model just built (on the meta device, before its
    weights are read), and tell transformers that the checkpoint's tensors for those parts are
    unused on purpose."""
    stack = decoder_stack(model)
    prefix = _name_of(model, stack)
    at = f"{prefix}." if prefix else ""
    dropped = [f"{at}layers.{index}" for index in range(trunk.depth, len(stack.layers))]
    del stack.layers[trunk.depth :]
    if not trunk.final_norm and isinstance(getattr(stack, "norm", None), nn.Module):
        dropped.append(f"{at}norm")
        stack.norm = nn.Identity()  # the stack's own forward stays whole: the last layer's raw output
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Module):
        name = _name_of(model, head)
        dropped.append(name)
        delattr(model, name)  # a full forward (logits) has nothing to compute them with: it fails loudly
    if not dropped:
        return

    def kept(key: str) -> bool:
        return not any(key == name or key.startswith(name + ".") for name in dropped)

    # Ties to the output head: the checkpoint holds the embedding, which the trunk keeps.
    ties = getattr(model, "all_tied_weights_keys", None) or {}
    model.all_tied_weights_keys = {target: source for target, source in ties.items() if kept(target) and kept(source)}
    ignored = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    model._keys_to_ignore_on_load_unexpected = ignored | {rf"^{re.escape(name)}\." for name in dropped}


def trunk_class(model_class: type, trunk: Trunk) -> type:
    """`model_class`, built with only what `trunk` runs. Same name and module, so that what reads
    the class (transformers' loader, the kernel report, a log line) sees the model's own."""

    def __init__(self, config, *args, **kwargs):
        model_class.__init__(self, config, *args, **kwargs)
        _cut(self, trunk)

    namespace = {"__init__": __init__, "__module__": model_class.__module__, "__doc__": model_class.__doc__}
    built = type(model_class.__name__, (model_class,), namespace)
    built.__qualname__ = model_class.__qualname__
    return built


def _weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # a tied weight counts once


def peak_host_rss_bytes() -> int | None:
    """This process's peak resident set so far (Linux reports KiB, macOS bytes); None on Windows."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _hub(trust_remote_code: bool, revision: str | None) -> dict:
    return {
        "local_files_only": True,
        "trust_remote_code": trust_remote_code,
        **({"revision": revision} if revision else {}),
    }


def _resolve(path: str, layers: list[Layer], hub: dict) -> tuple[object, type, Trunk]:
    """The config, the causal LM class and the trunk of the model at `path` for `layers`."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **hub)
    revision = hub.get("revision")
    model_class, config = causal_lm_class(config, path, trust_remote_code=hub["trust_remote_code"], revision=revision)
    return config, model_class, Trunk.of(layers, int(config.get_text_config().num_hidden_layers))


def _load_failed(path: str, exc: Exception) -> HsxError:
    if "trust_remote_code" in str(exc):
        return remote_code_refused(path)
    return HsxError(f"model {path}: cannot load ({str(exc).splitlines()[0]})")


def trunk_weight_bytes(
    path: str, *, layers: list[Layer], dtype: torch.dtype, trust_remote_code: bool = False, revision: str | None = None
) -> int:
    """The bytes of the weights `load_trunk` would load for `layers` in `dtype`: the trunk built
    on the meta device, no weight read (what a caller asks before deciding to load it)."""
    try:
        config, model_class, trunk = _resolve(path, layers, _hub(trust_remote_code, revision))
        with torch.device("meta"):
            model = trunk_class(model_class, trunk)._from_config(config, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise _load_failed(path, exc) from None
    return _weight_bytes(model)


def load_trunk(
    path: str,
    *,
    layers: list[Layer],
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool = False,
    revision: str | None = None,
    attention: str | None = None,
) -> tuple[nn.Module, LoadReport]:
    """The model at `path` with only what `layers` runs, its weights on `device` in `dtype`, in
    eval mode without gradients. A checkpoint that lacks a weight the trunk needs is refused: its
    states would come from a randomly initialised weight."""
    started = time.monotonic()
    hub = _hub(trust_remote_code, revision)
    try:
        config, model_class, trunk = _resolve(path, layers, hub)
        # transformers takes a device_map only with accelerate installed; without one, it loads to the CPU.
        mapped = importlib.util.find_spec("accelerate") is not None
        direct = mapped or device.type == "cpu"
        model, info = trunk_class(model_class, trunk).from_pretrained(
            path,
            config=config,
            dtype=dtype,
            output_loading_info=True,
            # transformers 5.25 kernelizes by default with the `kernels` package, whose layers come
            # from the Hugging Face Hub: nothing is downloaded, and hsx binds its own (kernels.py).
            use_kernels=False,
            **hub,
            **({"attn_implementation": attention} if attention else {}),
            **({"device_map": {"": device}} if mapped else {}),
        )
    except (OSError, ValueError) as exc:
        raise _load_failed(path, exc) from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise HsxError(
            f"model {path}: the checkpoint lacks {len(missing)} weight(s) the forward needs "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        )
    if not direct:
        log.warning("model_loaded_via_host", device=str(device), reason="accelerate is not installed")
    model.to(device).eval()
    model.requires_grad_(False)
    report = LoadReport(
        layers_loaded=trunk.depth,
        layers_total=trunk.total,
        final_norm=trunk.final_norm,
        weight_bytes=_weight_bytes(model),
        seconds=round(time.monotonic() - started, 2),
        placement="direct" if direct else "via_host",
    )
    return model, report
