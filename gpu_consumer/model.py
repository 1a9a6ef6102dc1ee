"""Loading the model once and capturing the selected layers' outputs.

`load_model` loads only what the selection runs (hsx.gpu_consumer.trunk): the embedding, the
decoder layers up to the deepest selected one, the final norm for `final`, never the lm_head,
straight onto the device. Forward hooks sit on the selected decoder layers only. The hook on the
deepest selected layer raises `_StopForward` after capturing, so nothing after it runs, also on a
whole model (bench/gpu.py taps one it builds itself): a capture of layers up to L/2 costs about
half a full forward. Layer i means the raw output of decoder layer i (0-based), which is
transformers' `output_hidden_states[i + 1]` except for the last layer (transformers applies the
final norm to that entry). The `final` selector captures the final norm's output instead, and the
forward stops there.
"""

import importlib.util
import os
from dataclasses import dataclass

import structlog
import torch
from torch import nn

from hsx.errors import HsxError
from hsx.gpu_consumer.compiling import compile_decoder_layers
from hsx.gpu_consumer.kernels import bind_fla_conv
from hsx.gpu_consumer.staging import HostStaging
from hsx.gpu_consumer.trunk import LoadReport, decoder_stack, load_trunk, peak_host_rss_bytes
from hsx.job import FINAL, Layer
from hsx.logs import route_transformers_logging
from hsx.model.devices import visible_text
from hsx.storage.encodings import Encoding

log = structlog.get_logger("hsx.gpu_consumer.model")


class _StopForward(Exception):
    """Raised by the deepest hook: everything the job needs has been captured."""


class LayerTap:
    """Runs the decoder only as far as the selection needs and returns the selected states."""

    def __init__(self, model: nn.Module, layers: list[Layer]) -> None:
        self.model = model
        self.base = decoder_stack(model)
        self.layers = list(layers)
        modules = self.base.layers
        indices = sorted({layer for layer in self.layers if layer != FINAL})
        if indices and indices[-1] >= len(modules):
            raise HsxError(f"layer {indices[-1]} does not exist: the model has {len(modules)} decoder layers")
        self._captured: dict[Layer, torch.Tensor] = {}
        if FINAL in self.layers:
            norm = getattr(self.base, "norm", None)
            if not isinstance(norm, nn.Module):
                raise HsxError(f"model class {type(model).__name__}: no final norm (.norm) to capture 'final' from")
            self.stop_at: Layer = FINAL
            self._handles = [norm.register_forward_hook(self._hook(FINAL))]
        else:
            self.stop_at = indices[-1]
            self._handles = []
        self._handles += [modules[i].register_forward_hook(self._hook(i)) for i in indices]

    def _hook(self, selector: Layer):
        def capture(_module, _args, output):
            self._captured[selector] = output[0] if isinstance(output, tuple) else output
            if selector == self.stop_at:
                raise _StopForward

        return capture

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """[B, P] ids and mask -> one [B, P, H] tensor per selected layer, in the order given."""
        self._captured.clear()
        try:
            try:
                self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            except _StopForward:
                pass
            else:
                raise RuntimeError("the forward finished without reaching the last selected state; its hook never ran")
            return [self._captured[layer] for layer in self.layers]
        finally:
            # Also when the forward failed (out of memory): what was captured must not outlive it.
            self._captured.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    model: nn.Module
    tap: LayerTap
    device: torch.device
    dtype: torch.dtype  # compute dtype
    pad_token_id: int
    attention: str
    # The job's encoding, which the model was loaded for: its compute dtype is `dtype`, and the
    # forward hands its states over as it makes them on the device (`on_device`, extract.py).
    encoding: Encoding
    staging: HostStaging | None = None  # pinned host buffers, on CUDA devices
    load_report: LoadReport | None = None  # what load_model loaded (hsx.gpu_consumer.trunk)


def choose_attention(
    device: torch.device, compute_dtype: torch.dtype, *, flash_attn_installed: bool | None = None
) -> str | None:
    """flash-attention 2 on a CUDA device in 16-bit when the package is installed (it skips the
    padding inside the attention); otherwise None: transformers' own choice for the model (SDPA
    where the model supports it). flash-attn has no float32 or CPU path."""
    if flash_attn_installed is None:
        flash_attn_installed = importlib.util.find_spec("flash_attn") is not None
    if device.type == "cuda" and compute_dtype in (torch.bfloat16, torch.float16) and flash_attn_installed:
        return "flash_attention_2"
    return None


def usable_device(device: str) -> torch.device:
    """`--device` as a torch device this process can compute on, or a one-line HsxError naming the
    flag: not a device, no CUDA, no such GPU, or a backend torch has no use of here (`mps` off a
    Mac, `xpu` without its build): a tensor is made there to find out."""
    try:
        target = torch.device(device)
    except (RuntimeError, ValueError):
        raise HsxError(
            f"--device {device!r} is not a torch device (use cpu, cuda:N, or another torch device)"
        ) from None
    if target.type == "cuda" and not torch.cuda.is_available():
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "" if listed is None else f" (CUDA_VISIBLE_DEVICES={listed!r}: what this process was allocated)"
        raise HsxError(f"--device {device}: CUDA is not available on this machine{shown}; use --device cpu")
    if target.type == "cuda" and target.index is not None and target.index >= torch.cuda.device_count():
        raise HsxError(
            f"--device {device}: there is no GPU {target.index}: "
            f"{visible_text(torch.cuda.device_count(), os.environ.get('CUDA_VISIBLE_DEVICES'))}"
        )
    if target.type == "meta":
        raise HsxError(f"--device {device}: the meta device holds no data to extract; use cpu or cuda:N")
    backend = getattr(torch.backends, target.type, None) or getattr(torch, target.type, None)
    available = getattr(backend, "is_available", None)
    if callable(available) and not available():
        raise HsxError(f"--device {device}: {target.type} is not available on this machine; use cpu or cuda:N")
    try:
        torch.empty(1, device=target)
    except Exception as exc:  # NotImplementedError, AssertionError, ModuleNotFoundError, RuntimeError
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0][:160]
        raise HsxError(f"--device {device}: torch cannot use this device here ({reason}); use cpu or cuda:N") from None
    return target


def load_model(
    path: str,
    *,
    layers: list[Layer],
    encoding: Encoding,
    device: str,
    trust_remote_code: bool = False,
    revision: str | None = None,
    compile_layers: bool = False,
) -> LoadedModel:
    """The trunk of the model at `path` that `layers` runs (hsx.gpu_consumer.trunk), its weights
    loaded straight onto `device` in `encoding`'s compute dtype. `revision`: the cache snapshot the producer resolved (pinned so
    that every consumer loads the weights the job spec names, even if the cache's `main` moves);
    None for a local folder."""
    route_transformers_logging()
    compute_dtype = getattr(torch, encoding.compute)
    target = usable_device(device)
    attention = choose_attention(target, compute_dtype)
    model, report = load_trunk(
        path,
        layers=layers,
        dtype=compute_dtype,
        device=target,
        trust_remote_code=trust_remote_code,
        revision=revision,
        attention=attention,
    )
    log.info(
        "model_loaded", model=path, device=str(target), **report.fields(), host_peak_rss_bytes=peak_host_rss_bytes()
    )
    if target.type == "cuda":
        bind_fla_conv(model)  # fla's causal conv where causal-conv1d is missing
    if compile_layers:
        compile_decoder_layers(model)
    config = model.config.get_text_config()
    pad = getattr(config, "pad_token_id", None)
    return LoadedModel(
        model=model,
        tap=LayerTap(model, layers),
        device=target,
        dtype=compute_dtype,
        pad_token_id=int(pad) if isinstance(pad, int) and 0 <= pad < config.vocab_size else 0,
        attention=str(getattr(model.config, "_attn_implementation", "unknown")),
        encoding=encoding,
        staging=HostStaging() if target.type == "cuda" else None,
        load_report=report,
    )
