"""`--layers dflash:N | eagle3 | speculators`, resolved for several depths, checked against the
trainers' own default-id functions (installed from the registry as test extras, `--no-deps`):
`dflash.model.build_target_layer_ids` and SpecForge's copy of it, SpecForge's EAGLE-3
`resolve_eagle_capture_layers`, speculators' `resolve_target_layer_ids`. Then a real job run with a
preset records it, and its files hold what those ids name in transformers' own output.
"""

import json
import re
import time
import warnings
from types import SimpleNamespace

import pytest

from hsx.errors import HsxError
from hsx.job import FINAL
from hsx.model.layers import Preset, parse_layers, preset_layers, resolve_layers

DEPTHS = (8, 12, 28, 36, 64)

with warnings.catch_warnings():  # their import warns about flash_attn and torch.jit
    warnings.simplefilter("ignore")
    dflash_model = pytest.importorskip("dflash.model", reason="dflash is a test extra (make setup)")
    specforge_dflash = pytest.importorskip("specforge.modeling.draft.dflash", reason="specforge is a test extra")
    specforge_providers = pytest.importorskip("specforge.algorithms.model_providers")
    speculators_utils = pytest.importorskip("speculators.models.utils", reason="speculators is a test extra")


def _resolved(text: str, depth: int) -> list:
    return resolve_layers(parse_layers(text), depth, model="m")


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("draft_layers", (1, 2, 3, 5, 8))
def test_dflash_preset_is_build_target_layer_ids(depth, draft_layers):
    theirs = dflash_model.build_target_layer_ids(depth, draft_layers)
    assert specforge_dflash.build_target_layer_ids(depth, draft_layers) == theirs
    if len(set(theirs)) < len(theirs):  # e.g. 8 draft layers of an 8-layer model: refused, not repeated
        with pytest.raises(HsxError, match=f"dflash:{draft_layers}: model m has {depth} decoder layers"):
            _resolved(f"dflash:{draft_layers}", depth)
        return
    # Both read decoder layer `id`'s output as hidden_states[id + 1] (extract_context_feature): hsx's ids.
    assert _resolved(f"dflash:{draft_layers}", depth) == theirs


def test_dflash_5_on_64_layers_is_the_seeds_layers():
    assert _resolved("dflash:5", 64) == [1, 16, 31, 46, 61]


@pytest.mark.parametrize("depth", DEPTHS)
def test_eagle3_preset_is_specforges_capture_layers_and_the_final_state(depth):
    settings = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=None))
    theirs = specforge_providers.resolve_eagle_capture_layers(settings, {}, SimpleNamespace(num_hidden_layers=depth))
    # SpecForge's ids are decoder-layer outputs, as hsx's; its `hidden_state` is the post-norm state.
    assert _resolved("eagle3", depth) == [*theirs, FINAL]


@pytest.mark.parametrize("depth", DEPTHS)
def test_speculators_preset_is_its_default_ids_and_the_last_layer(depth, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": depth}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "--target-layer-ids is not explicitly set"
        theirs = speculators_utils.resolve_target_layer_ids(None, str(tmp_path))
    # speculators' ids index transformers' hidden_states (its DFlash converter adds 1 to z-lab's
    # ids to get them), so its id i is decoder layer i - 1; its file's extra last slot is the last
    # decoder layer's raw output.
    assert _resolved("speculators", depth) == [i - 1 for i in theirs] + [depth - 1]


@pytest.mark.parametrize("depth", (4, 6))
def test_a_model_too_shallow_for_a_preset_is_refused_as_its_trainer_refuses_it(depth, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": depth}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="invalid"):
            speculators_utils.resolve_target_layer_ids(None, str(tmp_path))
    for preset in ("speculators", "eagle3"):
        with pytest.raises(HsxError, match=f"--layers {preset}: model m has {depth} decoder layers, too few"):
            _resolved(preset, depth)


def test_presets_are_names_until_the_depth_is_known():
    assert parse_layers(" DFlash:5 ") == Preset("dflash:5")
    assert parse_layers("eagle3") == Preset("eagle3") and parse_layers("speculators") == Preset("speculators")
    assert preset_layers("eagle3", 64) == [1, 31, 60, FINAL]
    for text, needle in (
        ("dflash", "dflash:N"),
        ("dflash:x", "dflash:N"),
        ("dflash:0", "draft's layer count"),
        ("eagel3", "nor a preset (dflash:N, eagle3, speculators)"),
    ):
        with pytest.raises(HsxError, match=re.escape(needle)):
            parse_layers(text)


def test_a_job_with_a_preset_records_it_and_its_files_hold_those_layers(hsx, hsx_service, job_name, tmp_path):
    """A real job with `--layers eagle3` on an 8-layer model (1, 3, 4 and final): the spec and every
    file name the preset and what it resolved to, and the file's slots are transformers'
    hidden_states[id + 1] and hidden_states[-1]."""
    import torch
    from conftest import TINY
    from safetensors import safe_open
    from tolerance import assert_within, depth, float32_bound, reduction_length
    from transformers import AutoModelForCausalLM

    from hsx.commands.embedded import build_tiny_model

    model = build_tiny_model(tmp_path / "qwen3-8", seed=1, **{**TINY["qwen3"], "num_hidden_layers": 8})
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps({"input_ids": [3 + i, 7, 11 + i, 2, 5]}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    produced = hsx(
        "produce", "--job", job_name, "--model", str(model), "--dataset", str(dataset),
        "--layers", "eagle3", "--dest", str(out), "--dtype", "float32",
    )  # fmt: skip
    assert produced.returncode == 0, produced.stderr
    spool = str(tmp_path / "spool")
    hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", spool, name="consumer")
    hsx_service("upload", "--job", job_name, "--spool", spool, name="uploader")
    deadline, files = time.monotonic() + 120, []
    while time.monotonic() < deadline and len(files) < 3:
        files = sorted((out / job_name).rglob("*.safetensors"))
        time.sleep(0.3)
    assert len(files) == 3, "the job did not finish within 120 s"
    status = json.loads(hsx("status", "--job", job_name, "--json").stdout)
    assert status["total_samples"] == 3
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for path in files:
        with safe_open(str(path), "pt") as f:
            meta, hidden, ids = f.metadata(), f.get_tensor("hidden_states"), f.get_tensor("input_ids")
        assert meta["layer_preset"] == "eagle3" and json.loads(meta["layers"]) == [1, 3, 4, FINAL]
        with torch.no_grad():
            states = reference(ids[None].long(), output_hidden_states=True).hidden_states
        n = reduction_length(reference.config, len(ids))
        for slot, hf_index in enumerate((2, 4, 5, 8)):  # decoder layer id: hidden_states[id + 1]; final: [-1]
            # The float32 bound of tests/tolerance.py at that depth (final: 8 layers and the norm).
            bound = float32_bound(n, hf_index if hf_index < 8 else depth(FINAL, 8))
            assert_within(hidden[:, slot], states[hf_index][0], bound, f"{path.name} slot {slot}")
