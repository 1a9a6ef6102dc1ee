"""Which implementations the loaded model's forward runs (`kernel_report`), and what a consumer
does about a slow one (`check_kernels`: refused on CUDA unless allowed).

transformers picks a hybrid model's linear-attention kernels when its modeling module is imported
(`use_kernel_func_from_hub_with_fallback`): the fast package's function when `fla` (pip
`fla-core`) or `causal_conv1d` imports, else its own pure-torch one, with no error and only a
transformers warning. So the report reads what the loaded model's linear-attention layers will
call, not which packages are installed. It knows the model only as a loaded module tree; nothing
of NATS or the job.

transformers binds a causal convolution only from `causal-conv1d`, which has no wheel for most
GPU images (it compiles CUDA code at install). fla-core, pure Python on Triton, has one of its
own (`fla.modules.convolution.causal_conv1d`): on CUDA, where transformers would run its torch
convolution and fla imports, `bind_fla_conv` puts fla's in its place. The forward finds
`causal_conv1d_fn` in its modeling module's namespace at each call (transformers 5.17 to 5.25; 5.25
calls it from its `causal_conv1d_forward` helper),
so that is where it is bound; only the prefill path (a whole sequence, no cache: what extraction
runs) is replaced, never the one-step decode update. docs/architecture/consumer.md, "fla's causal conv".
"""

import importlib
import inspect
import sys
from collections.abc import Callable

import structlog
from torch import nn

from hsx.errors import HsxError
from hsx.gpu_consumer.trunk import decoder_layers
from hsx.wire.schemas import Kernels

log = structlog.get_logger("hsx.gpu_consumer.kernels")

TORCH = "torch"  # transformers' reference implementation: correct, many times slower on a GPU
UNKNOWN = "unknown"  # a linear-attention layer whose kernels this module cannot name (remote code)
# Device types with fast kernels to miss: fla and causal-conv1d are CUDA (and ROCm, which torch
# also calls "cuda") kernels. On a CPU the torch path is the only one there is, not a fallback.
FAST_KERNEL_DEVICES = ("cuda",)
INSTALL_HINT = "pip install -e '.[kernels]' in an hsx checkout, or pip install 'hsx-extract[kernels]'"


def plain_function(function: Callable | None) -> Callable | None:
    """The function a kernels `Func` module calls (with the `kernels` package installed,
    transformers 5.25 wraps each kernel function in one), else `function` itself."""
    if isinstance(function, nn.Module):
        try:
            return inspect.getclosurevars(type(function).forward).nonlocals.get("func", function)
        except TypeError:
            return function
    return function


def _implementation(function: Callable | None) -> str:
    """Who implements `function`: its top-level package, `torch` for transformers' own code. A
    transformers fallback wrapper is looked through to the implementation it closed over."""
    function = plain_function(function)
    if function is None:  # transformers < 5 kept None where the fast package was missing
        return TORCH
    try:
        chosen = inspect.getclosurevars(function).nonlocals.get("implementation", function)
    except TypeError:  # a builtin or a callable object: no closure to look into
        chosen = function
    package = (getattr(chosen, "__module__", None) or "").split(".")[0]
    return TORCH if package in ("", "transformers", "transformers_modules", "torch") else package


def _called(mixer: nn.Module) -> dict[str, Callable | None]:
    """The kernel functions a linear-attention layer's forward calls, by name: what it holds
    itself (transformers < 5: `self.chunk_gated_delta_rule`, `self.causal_conv1d_fn`), else the
    module-level functions its forward names, in the namespace of its modeling file."""
    found: dict[str, Callable | None] = {}
    for name, value in vars(mixer).items():
        if _is_kernel_name(name) and (value is None or callable(value)):
            found[name] = value
    if found:
        return found
    module = type(mixer).__module__
    namespace = vars(sys.modules.get(module, object))
    forward = inspect.unwrap(type(mixer).forward)
    names = list(getattr(getattr(forward, "__code__", None), "co_names", ()))
    # transformers 5.25 calls the convolution through a helper of the same file
    # (`causal_conv1d_forward`, which looks `causal_conv1d_fn` up when called): the helpers the
    # forward names are read one level down.
    for name in list(names):
        value = plain_function(namespace.get(name))
        if inspect.isfunction(value) and value.__module__ == module and not _is_kernel_name(name):
            names += getattr(inspect.unwrap(value).__code__, "co_names", ())
    for name in names:
        value = namespace.get(name)
        if callable(value) and _is_kernel_name(name):
            found[name] = value
    return found


def _is_kernel_name(name: str) -> bool:
    return "delta_rule" in name or "conv1d_fn" in name


def _pick(functions: dict[str, Callable | None], *, conv: bool) -> str:
    """The implementation of the prefill path (a whole sequence, no cache: what extraction runs):
    the chunked rule rather than the one-token recurrent one, the convolution over a sequence
    rather than its one-step update."""
    candidates = {name: fn for name, fn in functions.items() if ("conv1d" in name) == conv}
    preferred = [name for name in candidates if ("conv1d_fn" in name if conv else "chunk" in name)]
    names = preferred or list(candidates)
    return _implementation(candidates[names[0]]) if names else UNKNOWN


def linear_attention_layers(model: nn.Module) -> list[nn.Module]:
    """The sequence mixers of the decoder layers the config calls `linear_attention`."""
    config = model.config.get_text_config()
    kinds = getattr(config, "layer_types", None) or []
    mixers = []
    for index, layer in enumerate(decoder_layers(model)):
        if index < len(kinds) and kinds[index] == "linear_attention":
            mixers.append(getattr(layer, "linear_attn", layer))
    return mixers


def kernel_report(model: nn.Module, *, compiled: bool, compile_error: str = "") -> Kernels:
    """What the loaded model's forward runs. A model without linear-attention layers reports
    None for the linear attention and the convolution."""
    attention = str(getattr(model.config, "_attn_implementation", None) or UNKNOWN)
    mixers = linear_attention_layers(model)
    if not mixers:
        return Kernels(attention=attention, compiled=compiled, compile_error=compile_error)
    # One modeling file per model: every linear-attention layer calls the same functions.
    functions = _called(mixers[0])
    return Kernels(
        attention=attention,
        linear_attention=_pick(functions, conv=False),
        conv1d=_pick(functions, conv=True),
        compiled=compiled,
        compile_error=compile_error,
    )


def report_fields(report: Kernels | None) -> dict | None:
    """The report as plain fields, for a log line."""
    return None if report is None else {name: getattr(report, name) for name in report.__struct_fields__}


def fallbacks(report: Kernels, device_type: str) -> list[str]:
    """The parts of the forward running transformers' torch fallback where a fast kernel exists
    for the device: `linear_attention` (fla), `conv1d` (causal_conv1d). Empty on a CPU."""
    if device_type not in FAST_KERNEL_DEVICES:
        return []
    parts = {"linear_attention": report.linear_attention, "conv1d": report.conv1d}
    return [part for part, used in parts.items() if used == TORCH]


def check_kernels(report: Kernels, device_type: str, *, allow_slow: bool) -> None:
    """On a device with fast kernels, a hybrid model on the torch fallback is refused (one-line
    HsxError naming what is missing and the opt-out), or with --allow-slow-kernels logged once as
    a warning. Elsewhere (a CPU) the torch path is the only one there is: nothing to say."""
    slow = fallbacks(report, device_type)
    if not slow:
        return
    if not allow_slow:
        parts = " and ".join(_PARTS[part][0] for part in slow)
        packages = ", ".join(_PARTS[part][1] for part in slow)
        raise HsxError(
            f"the model's {parts} would run transformers' torch fallback on {device_type}, many times "
            f"slower ({packages} not importable here); install the kernels ({INSTALL_HINT}), or pass "
            f"--allow-slow-kernels to run it so"
        )
    log.warning("slow_kernels", fallbacks=slow, install=INSTALL_HINT)


# Each part of the forward that has a fast kernel: its name in a sentence, the package that has it.
_PARTS = {"linear_attention": ("linear attention", "fla-core"), "conv1d": ("causal conv1d", "causal-conv1d")}


# The functions bind_fla_conv replaced, by (module or layer, name): what unbind_fla_conv restores.
_REPLACED: dict[tuple[int, str], tuple[object, Callable | None]] = {}
_CONV = "causal_conv1d_fn"


def fla_causal_conv1d() -> Callable | None:
    """fla's Triton causal convolution, [B, T, D] in and out, or None where fla does not import."""
    for module in ("fla.modules.convolution", "fla.modules.causal_conv1d", "fla.modules"):
        try:
            function = getattr(importlib.import_module(module), "causal_conv1d", None)
        except Exception:  # not installed, or no Triton that works here
            continue
        if callable(function):
            return function
    return None


def _as_causal_conv1d_fn(implementation: Callable) -> Callable:
    """transformers' `causal_conv1d_fn` contract (x [B, D, T], weight [D, W], bias, activation;
    returns [B, D, T]) on a convolution of fla's contract (x [B, T, D]; returns (y, state) or y)."""

    def causal_conv1d_fn(x, weight, bias=None, activation=None, seq_idx=None, **_unused):
        if seq_idx is not None:  # packed sequences: never from hsx, which pads its batches
            raise ValueError("causal_conv1d_fn bound to fla: packed sequences (seq_idx) are not supported")
        out = implementation(x.transpose(1, 2), weight=weight, bias=bias, activation=activation)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

    return causal_conv1d_fn


def bind_fla_conv(model: nn.Module, *, implementation: Callable | None = None) -> bool:
    """Bind fla's causal convolution (or `implementation`, of fla's contract) where the model's
    linear-attention layers would call transformers' torch one; True if it was bound. A model
    without such layers, one on causal-conv1d already, or no fla here: nothing is changed."""
    mixers = linear_attention_layers(model)
    if not mixers:
        return False
    own = [mixer for mixer in mixers if _CONV in vars(mixer)]  # transformers < 5 held it per layer
    holders = own or [sys.modules[type(mixers[0]).__module__]]
    current = getattr(holders[0], _CONV, None)
    if current is None and not own:
        return False  # a modeling file without the function: nothing this knows how to bind
    if _implementation(current) != TORCH:
        return False
    implementation = implementation or fla_causal_conv1d()
    if implementation is None:
        return False
    bound = _as_causal_conv1d_fn(implementation)
    for holder in holders:
        _REPLACED.setdefault((id(holder), _CONV), (holder, getattr(holder, _CONV, None)))
        setattr(holder, _CONV, bound)
    log.info("conv1d_bound", implementation=_implementation(bound), layers=len(mixers))
    return True


def unbind_fla_conv() -> None:
    """Put back what bind_fla_conv replaced (tests)."""
    for holder, original in _REPLACED.values():
        setattr(holder, _CONV, original)
    _REPLACED.clear()
