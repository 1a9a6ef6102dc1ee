"""What hsx needs to know about a model without loading its weights: layer count, vocabulary
size, revision. Models come from a local folder or the local Hugging Face cache, never the
network."""

from dataclasses import dataclass
from pathlib import Path

from hsx.errors import HsxError


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    name: str
    revision: str
    num_layers: int
    vocab_size: int
    hidden_size: int


def load_model_info(model: str, *, trust_remote_code: bool = False) -> ModelInfo:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model, local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise HsxError(
                f"model {model} needs its own Python code (custom code in the model folder) to load; "
                "hsx refuses to run it unless you pass --trust-remote-code"
            ) from None
        raise HsxError(f"model {model}: cannot read its config ({str(exc).splitlines()[0]})") from None
    except OSError as exc:
        where = "folder has no usable config.json" if Path(model).is_dir() else "not a local folder and not in the local Hugging Face cache"
        raise HsxError(f"model {model}: {where} ({str(exc).splitlines()[0]})") from None
    text = config.get_text_config()
    revision = getattr(config, "_commit_hash", None) or "local"
    return ModelInfo(
        name=model,
        revision=revision,
        num_layers=int(text.num_hidden_layers),
        vocab_size=int(text.vocab_size),
        hidden_size=int(text.hidden_size),
    )
