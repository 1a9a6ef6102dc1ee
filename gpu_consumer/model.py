"""Loading the model once and capturing the selected decoder layers' outputs.

Forward hooks sit on the selected layers only. The hook on the deepest selected layer raises
`_StopForward` after capturing, so later layers, the final norm and the lm_head never run: a
capture of layers up to L/2 costs about half a full forward. Layer i means the raw output of
decoder layer i (0-based), which is transformers' `output_hidden_states[i + 1]` except for the
last layer (transformers applies the final norm to that entry).
"""

from dataclasses import dataclass

import structlog
import torch
from torch import nn

from hsx.errors import HsxError

log = structlog.get_logger("hsx.gpu_consumer.model")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class _StopForward(Exception):
    """Raised by the deepest hook: everything the job needs has been captured."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, model.base_model_prefix)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise HsxError(f"model class {type(model).__name__}: cannot find its decoder layers (no .layers ModuleList)")
    return layers


class LayerTap:
    """Runs the decoder up to the deepest selected layer and returns the selected outputs."""

    def __init__(self, model: nn.Module, layers: list[int]) -> None:
        self.model = model
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, model.base_model_prefix)
        self.layers = list(layers)
        self.deepest = max(self.layers)
        self._captured: dict[int, torch.Tensor] = {}
        modules = decoder_layers(model)
        if self.deepest >= len(modules):
            raise HsxError(f"layer {self.deepest} does not exist: the model has {len(modules)} decoder layers")
        self._handles = [modules[i].register_forward_hook(self._hook(i)) for i in sorted(set(self.layers))]

    def _hook(self, index: int):
        def capture(_module, _args, output):
            self._captured[index] = output[0] if isinstance(output, tuple) else output
            if index == self.deepest:
                raise _StopForward

        return capture

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """[B, P] ids and mask -> one [B, P, H] tensor per selected layer, in the order given."""
        self._captured.clear()
        try:
            self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        else:
            raise RuntimeError("the deepest selected layer never ran; the model's forward skipped it")
        captured = [self._captured[i] for i in self.layers]
        self._captured.clear()
        return captured

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    model: nn.Module
    tap: LayerTap
    device: torch.device
    dtype: torch.dtype
    pad_token_id: int
    attention: str


def load_model(path: str, *, layers: list[int], dtype: str, device: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    torch_dtype = DTYPES[dtype]
    try:
        target = torch.device(device)
    except RuntimeError:
        raise HsxError(f"--device {device!r} is not a torch device (use cpu, cuda or cuda:N)") from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise HsxError(f"--device {device}: CUDA is not available on this machine")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError) as exc:
        raise HsxError(f"model {path}: cannot load ({str(exc).splitlines()[0]})") from None
    model.to(target).eval()
    model.requires_grad_(False)
    config = model.config.get_text_config()
    pad = getattr(config, "pad_token_id", None)
    return LoadedModel(
        model=model,
        tap=LayerTap(model, layers),
        device=target,
        dtype=torch_dtype,
        pad_token_id=int(pad) if isinstance(pad, int) and 0 <= pad < config.vocab_size else 0,
        attention=str(getattr(model.config, "_attn_implementation", "unknown")),
    )
