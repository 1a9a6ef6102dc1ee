"""torch.compile for the consumer's forward: whether to compile (`ConsumerConfig.compiles`: on with
CUDA by default), compiling each decoder layer (`compile_decoder_layers`), and going back to the
eager forward when compiling fails (`warm_up`).

torch.compile is lazy: `compile_decoder_layers` only wraps each layer, and a compile that cannot
work (no C compiler for inductor, a Triton too old for the GPU, an operator dynamo cannot trace)
fails at the first forward. The consumer's warm-up is that first forward: it runs the compiled
path, and on a failure turns compiling off (`run_eager`), says so in one log line and in the
kernel report (`fallback_reason`, `Kernels.compile_error`), and warms up again eagerly. A forward
that fails eagerly too is the model's failure, not the compiler's, and is raised. A batch whose
shapes make dynamo compile again later, and fail at it (`is_compile_error`), turns compiling
off the same way and runs again eagerly (`eager_on_failure`), so that a compiler's bug costs no
batch a delivery.

It knows the model only as its decoder layers; nothing of batches, NATS or the job.
"""

import weakref
from collections.abc import Callable

import structlog
from torch import nn

from hsx.gpu_consumer.trunk import decoder_layers

log = structlog.get_logger("hsx.gpu_consumer.compiling")

# A seam for tests: the backend torch.compile is given (tests install a backend that fails, the
# way inductor fails on a machine without a compiler, to see the fallback on a CPU).
backend: str | Callable = "inductor"

# Why a model asked to compile runs eagerly: the compile's failure, one line.
_fallbacks: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def compile_decoder_layers(model: nn.Module) -> None:
    """Per layer, not the whole model: the layer tap's hooks end the forward early, and every
    layer shares one compiled graph. dynamic: each batch has its own [B, P]."""
    try:
        for layer in decoder_layers(model):
            layer.compile(dynamic=True, backend=backend)
    except Exception as exc:  # torch.compile refusing at once (a Python dynamo does not support)
        run_eager(model, reason=one_line(exc))


def compiled(model: nn.Module) -> bool:
    """Whether the forward runs compiled layers."""
    return any(getattr(layer, "_compiled_call_impl", None) is not None for layer in decoder_layers(model))


def run_eager(model: nn.Module, *, reason: str) -> None:
    """Turn compiling off (nn.Module.compile's own switch: `_compiled_call_impl`), saying why."""
    for layer in decoder_layers(model):
        layer._compiled_call_impl = None
    _fallbacks[model] = reason
    log.warning("compile_failed_running_eager", reason=reason)


def fallback_reason(model: nn.Module) -> str:
    """Why a model asked to compile runs eagerly ("" if it was not asked, or compiles)."""
    return _fallbacks.get(model, "")


def one_line(exc: BaseException) -> str:
    """The root of a compile failure, as one line: dynamo wraps the backend's own exception
    (BackendCompilerFailed.inner_exception, or the chained cause) in a screen of text."""
    root = exc
    while True:
        inner = getattr(root, "inner_exception", None) or root.__cause__
        if inner is None or inner is root:
            break
        root = inner
    first = next((line.strip() for line in str(root).splitlines() if line.strip()), "")
    return f"{type(root).__name__}: {first}"[:300] if first else type(root).__name__


def warm_up(model: nn.Module, first_forward: Callable[[], object], *, device_failed: Callable[[BaseException], bool]):
    """Run `first_forward` (the warm-up) compiled; if it fails while compiled, run it again
    eagerly. A device failure is raised as it is (a dead CUDA context fails eagerly as well)."""
    if not compiled(model):
        return first_forward()
    try:
        return first_forward()
    except Exception as exc:
        if device_failed(exc):
            raise
        reason = one_line(exc)
    run_eager(model, reason=reason)
    return first_forward()


def is_compile_error(exc: BaseException) -> bool:
    """Whether `exc` is torch.compile's own failure (dynamo's, or inductor's), not the forward's."""
    try:
        from torch._dynamo.exc import TorchDynamoException
        from torch._inductor.exc import InductorError
    except ImportError:  # a torch without them compiles nothing
        return False
    return isinstance(exc, (TorchDynamoException, InductorError))


def eager_on_failure(model: nn.Module, run: Callable[[], object]):
    """`run()` (a batch's forward); if it fails compiling, compiling is turned off and it runs
    again, eagerly."""
    try:
        return run()
    except Exception as exc:
        if not (compiled(model) and is_compile_error(exc)):
            raise
        reason = one_line(exc)
    run_eager(model, reason=reason)
    return run()
