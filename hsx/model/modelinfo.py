"""What hsx needs to know about a model without loading its weights: layer count, vocabulary
size, revision. Models come from a local folder or the local Hugging Face cache, never the
network."""

import re
from dataclasses import dataclass
from pathlib import Path

from hsx.errors import HsxError
from hsx.logs import route_transformers_logging


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    name: str
    revision: str
    num_layers: int
    vocab_size: int
    hidden_size: int


def remote_code_refused(model: str) -> HsxError:
    return HsxError(
        f"model {model} needs its own Python code (custom code in the model folder) to load; "
        "hsx refuses to run it unless you pass --trust-remote-code"
    )


def load_model_info(model: str, *, trust_remote_code: bool = False) -> ModelInfo:
    from transformers import AutoConfig

    route_transformers_logging()
    try:
        config = AutoConfig.from_pretrained(model, local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise remote_code_refused(model) from None
        raise HsxError(f"model {model}: cannot read its config ({str(exc).splitlines()[0]})") from None
    except OSError as exc:
        if Path(model).is_dir():
            raise HsxError(
                f"model {model}: the folder has no usable config.json ({str(exc).splitlines()[0]})"
            ) from None
        # transformers' own text here talks about connecting to the hub, which never happens.
        raise HsxError(
            f"model {model}: not a local folder and not in the local Hugging Face cache (nothing is downloaded; "
            "give a folder, or fill the cache with `hf download` on a machine that has network access)"
        ) from None
    text = config.get_text_config()
    revision = getattr(config, "_commit_hash", None) or _cached_commit(model) or "local"
    return ModelInfo(
        name=model,
        revision=revision,
        num_layers=int(text.num_hidden_layers),
        vocab_size=int(text.vocab_size),
        hidden_size=int(text.hidden_size),
    )


def _cached_commit(model: str) -> str | None:
    """The snapshot commit a cached model id resolves to (transformers 5 no longer records it on
    the config); None for a local folder."""
    if Path(model).is_dir():
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        path = try_to_load_from_cache(model, "config.json")
    except ValueError:  # not a valid repo id
        return None
    found = re.search(r"snapshots[/\\]([0-9a-f]{40})[/\\]", path) if isinstance(path, str) else None
    return found.group(1) if found else None
