"""The consumer loads only what its forward runs (hsx.gpu_consumer.trunk): the embedding, the
decoder layers up to the deepest selected one, the final norm only for `final`, never the
lm_head; and what it loads computes exactly what transformers' whole model computes.

The references are transformers' own `AutoModelForCausalLM.from_pretrained` of the same folder
(`output_hidden_states`, bit for bit: the same modules on the same batch take every sum in the
same order, with one torch thread and with the default). The forms a checkpoint comes in are each built here: a
plain causal LM (tests/conftest.py's tiny models), a Qwen3.5 checkpoint in its vision-language
form (`text_config` nested, vision tower weights beside the text model's), a model with its own
code (`--trust-remote-code`), and a checkpoint missing a weight. The host memory a load costs is
bench/load.py's measure; here, on a GPU, only that a load to CUDA puts every weight there and
holds no copy of the model in host memory.
"""

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_families import FAMILIES
from transformers import AutoModelForCausalLM

from hsx.errors import HsxError
from hsx.gpu_consumer.model import load_model
from hsx.gpu_consumer.trunk import decoder_stack
from hsx.job import FINAL
from hsx.model.modelinfo import remote_code_refused
from hsx.storage import encodings

NUM_LAYERS = 6  # tests/conftest.py TINY


def _reference_states(path, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """transformers' hidden_states of the whole model: entry i + 1 is layer i, the last post-norm."""
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return reference(input_ids, output_hidden_states=True).hidden_states


def _tapped(loaded, input_ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.inference_mode():
        return loaded.tap.forward(input_ids, torch.ones_like(input_ids))


def _ids(vocab: int = 512, length: int = 24, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("layers", "depth", "norm"),
    [([1], 2, False), ([0, 3], 4, False), ([4, FINAL], NUM_LAYERS, True), ([NUM_LAYERS - 2], NUM_LAYERS - 1, False)],
)
def test_the_model_holds_what_the_layers_run_and_computes_what_transformers_does(
    layers, depth, norm, tiny_model, torch_threads
):
    path = tiny_model("qwen3")
    loaded = load_model(str(path), layers=layers, encoding=encodings.of_spec("float32"), device="cpu")
    stack = decoder_stack(loaded.model)
    assert len(stack.layers) == depth
    assert isinstance(stack.norm, torch.nn.Identity) is not norm
    assert loaded.model.get_output_embeddings() is None
    report = loaded.load_report
    assert (report.layers_loaded, report.layers_total, report.final_norm) == (depth, NUM_LAYERS, norm)
    assert report.weight_bytes == sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert report.placement == "direct"

    ids = _ids()
    expected = _reference_states(path, ids)
    # Bit for bit, with no tolerance to derive: the trunk is the same modules run on the same
    # batch (same shapes, no padding) in the same process with the same thread count, so each sum
    # is taken in the same order. Either thread count (torch_threads) keeps that true.
    for layer, state in zip(layers, _tapped(loaded, ids)):
        assert torch.equal(state, expected[-1] if layer == FINAL else expected[layer + 1]), layer


def test_a_layer_past_the_model_is_refused_in_one_line(tiny_model):
    with pytest.raises(HsxError) as caught:
        load_model(
            str(tiny_model("qwen3")), layers=[1, NUM_LAYERS], encoding=encodings.of_spec("float32"), device="cpu"
        )
    assert str(caught.value) == f"layer {NUM_LAYERS} does not exist: the model has {NUM_LAYERS} decoder layers"


@pytest.fixture(scope="module")
def vision_language_qwen3_5(tmp_path_factory):
    """A Qwen3.5 checkpoint as Qwen3.5 models ship: `qwen3_5` config with the text model's under
    `text_config`, weights under `model.language_model.` beside a vision tower's `model.visual.`."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = tmp_path_factory.mktemp("qwen3_5-vl") / "model"
    text = {k: v for k, v in FAMILIES["qwen3_5_text"].config.items() if k != "model_type"}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
    config = AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.mark.parametrize("layers", [[1], [2, FINAL]])
def test_a_vision_language_qwen3_5_checkpoint_loads_only_its_text_trunk(layers, vision_language_qwen3_5):
    path = vision_language_qwen3_5
    stored = load_file(path / "model.safetensors")
    assert any(key.startswith("model.language_model.layers.") for key in stored)
    assert any(key.startswith("model.visual.") for key in stored)

    loaded = load_model(str(path), layers=layers, encoding=encodings.of_spec("float32"), device="cpu")
    assert type(loaded.model).__name__ == "Qwen3_5ForCausalLM"
    names = [name for name, _ in loaded.model.named_parameters()]
    assert not any("visual" in name for name in names) and "lm_head.weight" not in names
    assert len(decoder_stack(loaded.model).layers) == (4 if FINAL in layers else 2)
    ids = _ids()
    expected = _reference_states(path, ids)
    for layer, state in zip(layers, _tapped(loaded, ids)):
        assert torch.equal(state, expected[-1] if layer == FINAL else expected[layer + 1]), layer


CONFIGURATION = """
from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "hsx_remote_llama"
"""
MODELING = """
from transformers import LlamaForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig
"""


def test_a_model_with_its_own_code_loads_its_trunk_only_when_trusted(tiny_model, tmp_path, monkeypatch):
    from transformers import dynamic_module_utils

    # transformers copies a model's own code into its modules cache: here, not the user's.
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    source = tiny_model("llama")
    folder = tmp_path / "remote_llama"
    folder.mkdir()
    shutil.copy(source / "model.safetensors", folder)
    config = json.loads((source / "config.json").read_text())
    config.update(
        model_type="hsx_remote_llama",
        architectures=["RemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_remote.py").write_text(CONFIGURATION)
    (folder / "modeling_remote.py").write_text(MODELING)

    with pytest.raises(HsxError) as caught:
        load_model(str(folder), layers=[1], encoding=encodings.of_spec("float32"), device="cpu")
    assert str(caught.value) == str(remote_code_refused(str(folder)))

    loaded = load_model(
        str(folder), layers=[1], encoding=encodings.of_spec("float32"), device="cpu", trust_remote_code=True
    )
    assert type(loaded.model).__name__ == "RemoteForCausalLM"
    assert len(decoder_stack(loaded.model).layers) == 2 and loaded.model.get_output_embeddings() is None
    ids = _ids()
    assert torch.equal(_tapped(loaded, ids)[0], _reference_states(source, ids)[2])


def test_a_weight_missing_from_the_checkpoint_is_refused_where_the_trunk_needs_it(tiny_model, tmp_path):
    source = tiny_model("qwen3")
    folder = tmp_path / "incomplete"
    folder.mkdir()
    shutil.copy(source / "config.json", folder)
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.3.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})

    # Layers 0-2 do not need it: it is never looked for.
    loaded = load_model(str(folder), layers=[2], encoding=encodings.of_spec("float32"), device="cpu")
    ids = _ids()
    assert torch.equal(_tapped(loaded, ids)[0], _reference_states(source, ids)[3])
    # Layer 3 does: its states would come from a random weight.
    with pytest.raises(HsxError) as caught:
        load_model(str(folder), layers=[3], encoding=encodings.of_spec("float32"), device="cpu")
    assert str(caught.value) == (
        f"model {folder}: the checkpoint lacks 1 weight(s) the forward needs (model.layers.3.mlp.down_proj.weight)"
    )


# A load to CUDA in a fresh interpreter (so that its peak resident set is this load's), after the
# CUDA context is made: its figures as one JSON line.
CUDA_LOAD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from hsx.gpu_consumer.model import load_model

    def status(name):
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(name + ":"))
        return int(line.split()[1]) * 1024

    torch.empty(1, device="cuda:0")
    base = status("VmRSS")
    loaded = load_model(sys.argv[1], layers=[int(sys.argv[2])], dtype="bfloat16", device="cuda:0")
    torch.cuda.synchronize()
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    print(json.dumps({
        "growth": status("VmHWM") - base,
        "devices": sorted({str(t.device) for t in tensors}),
        "report": loaded.load_report.fields(),
    }))
    """
)


@pytest.mark.gpu
def test_a_load_to_cuda_puts_every_weight_there_and_no_model_in_host_memory(tmp_path):
    # bfloat16 on disk, 674 MB: the trunk of layers 0-11 is half of it.
    shape = dict(
        model_type="llama",
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    from transformers import AutoConfig

    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    checkpoint_bytes = sum(f.stat().st_size for f in (tmp_path / "bf16").glob("*.safetensors"))
    out = subprocess.run(
        [sys.executable, "-c", CUDA_LOAD, str(tmp_path / "bf16"), "11"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["devices"] == ["cuda:0"], figures
    report = figures["report"]
    assert (report["layers_loaded"], report["placement"]) == (12, "direct"), report
    # What the host may hold while the weights pass through it: the trunk's pages of the mapped
    # files, and a margin. A copy of the whole model in host memory would not fit in it.
    bound = report["weight_bytes"] + (256 << 20)
    assert checkpoint_bytes > bound
    assert figures["growth"] <= bound, figures
