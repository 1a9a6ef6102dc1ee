"""Layer selection: negative indices, the post-norm `final` selector, clear errors; float8
storage; models that need remote code are refused unless allowed."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tolerance import (
    assert_rejects_mistakes,
    assert_within,
    depth,
    error,
    float8_bound,
    float32_bound,
    reduction_length,
)

from hsx.errors import HsxError
from hsx.gpu_consumer.extract import extract_samples
from hsx.gpu_consumer.model import load_model
from hsx.gpu_consumer.writer import write_sample_file
from hsx.job import FINAL, JobSpec
from hsx.model.layers import parse_layers, resolve_layers
from hsx.storage import encodings
from hsx.storage.encodings.float8 import FLOAT8, dequantize_float8
from hsx.storage.layout import SampleFiles
from hsx.storage.spool import spool_file
from hsx.wire.schemas import Sample


def test_negative_indices_and_final_resolve_in_the_order_given():
    assert resolve_layers(parse_layers("-1,0,FINAL"), 6, model="m") == [5, 0, FINAL]
    assert resolve_layers(parse_layers("2,-2"), 6, model="m") == [2, 4]


@pytest.mark.parametrize(
    "text, needle",
    [
        ("1,6", "6 decoder layers"),
        ("-7", "6 decoder layers"),
        ("1,1", "selected twice"),
        ("5,-1", "selected twice"),
        ("final,final", "final state is selected twice"),
        ("one", "not a layer index"),
        (",", "empty"),
    ],
)
def test_bad_selections_are_one_line_errors(text, needle):
    with pytest.raises(HsxError) as caught:
        resolve_layers(parse_layers(text), 6, model="m")
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def _samples(lengths, vocab=512, seed=3):
    generator = torch.Generator().manual_seed(seed)
    return [
        Sample(index=i, source_id=str(i), input_ids=torch.randint(0, vocab, (n,), generator=generator).tolist())
        for i, n in enumerate(lengths)
    ]


def _reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_final_selector_is_the_post_norm_state_and_the_lm_head_is_not_loaded(tiny_model):
    path = tiny_model("qwen3")
    loaded = load_model(str(path), layers=[FINAL, 2], encoding=encodings.of_spec("float32"), device="cpu")
    # `final` needs every layer and the norm; nothing needs the lm_head.
    assert loaded.model.get_output_embeddings() is None
    assert len(loaded.model.model.layers) == loaded.model.config.num_hidden_layers
    calls = {"norm": 0}
    loaded.model.model.norm.register_forward_pre_hook(lambda *_: calls.__setitem__("norm", calls["norm"] + 1))
    samples = _samples([9, 40, 23])
    outputs = extract_samples(loaded, samples)
    assert calls == {"norm": 1}
    reference = _reference(path)
    for sample, stored in zip(samples, outputs):
        with torch.inference_mode():
            states = reference(torch.tensor([sample.input_ids]), output_hidden_states=True).hidden_states
        n, levels = reduction_length(reference.config, len(sample.input_ids)), reference.config.num_hidden_layers
        final_bound = float32_bound(n, depth(FINAL, levels))
        assert_within(stored[:, 0], states[-1][0], final_bound, f"sample {sample.index} final")
        assert_within(stored[:, 1], states[3][0], float32_bound(n, depth(2, levels)), f"sample {sample.index} layer 2")
        assert error(stored[:, 0], states[-2][0]) > final_bound  # `final` is not the state before the norm


def _spec(path, layers, dtype):
    return JobSpec(
        job="j",
        model=str(path),
        model_revision="local",
        layers=layers,
        dtype=dtype,
        dest="file:///x",
        token_budget=1024,
        max_seq_len=256,
        dataset="d",
        plan_fingerprint="f" * 64,
        total_samples=1,
        total_tokens=1,
        total_batches=1,
        created_at=0.0,
    )


def test_float8_files_are_smaller_and_dequantize_close_to_float32(tiny_model, tmp_path):
    path = tiny_model("llama")
    layers = [0, 3, 5]
    samples = _samples([64, 17], seed=5)
    reference = extract_samples(
        load_model(str(path), layers=layers, encoding=encodings.of_spec("float32"), device="cpu"), samples
    )
    loaded = load_model(str(path), layers=layers, encoding=encodings.of_spec(FLOAT8), device="cpu")
    sizes = {}
    for dtype, spool, model in [
        (FLOAT8, tmp_path / "f8", loaded),
        (
            "bfloat16",
            tmp_path / "bf16",
            load_model(str(path), layers=layers, encoding=encodings.of_spec("bfloat16"), device="cpu"),
        ),
    ]:
        outputs = extract_samples(model, samples)
        sizes[dtype] = 0
        for sample, hidden in zip(samples, outputs):
            ready = write_sample_file(
                spool=spool,
                files=SampleFiles.of(_spec(path, layers, dtype)),
                node="n",
                batch_id="b",
                sample=sample,
                hidden_states=hidden,
            )
            sizes[dtype] += ready.size
    worst = 0.0
    for sample, expected in zip(samples, reference):
        tensors = load_file(str(spool_file(tmp_path / "f8", "j", _spec(path, layers, FLOAT8).plan_tag, sample.index)))
        assert tensors["hidden_states"].dtype == torch.float8_e4m3fn
        assert tensors["hidden_states_scale"].shape == (len(sample.input_ids), len(layers))
        restored = dequantize_float8(tensors["hidden_states"], tensors["hidden_states_scale"])
        relative = ((restored - expected).norm(dim=-1) / expected.norm(dim=-1)).max().item()
        worst = max(worst, relative)
        for j, layer in enumerate(layers):
            # tests/tolerance.py's float8 bound: the bfloat16 forward's, plus e4m3's step.
            bound = float8_bound(depth(layer, 6))
            assert_within(restored[:, j], expected[:, j], bound, f"sample {sample.index} layer {layer} float8")
            neighbour = expected[:, j - 1] if j else None  # layers 0, 3, 5: another layer's state
            assert_rejects_mistakes(
                restored[:, j], expected[:, j], bound, "float8", neighbour=neighbour, float32_asked=False
            )
    print(
        json.dumps(
            {"float8_vs_bf16_size": round(sizes[FLOAT8] / sizes["bfloat16"], 3), "float8_max_rel_err": round(worst, 4)}
        )
    )
    assert sizes[FLOAT8] < 0.62 * sizes["bfloat16"]
    # Per token, ||restored - ref|| / ||ref||: e4m3 rounds each element within 2^-4 of itself, so
    # the vector within 2^-4 = 0.0625 of its norm, and the bfloat16 forward adds its own (<= 0.013
    # per token here): under 0.08, the float8 encoding's limit for `hsx verify --recompute`.
    assert worst < 0.08


def test_a_model_with_custom_code_is_refused_unless_allowed(hsx, tmp_path, job_name):
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "hsx_custom_thing",
                "num_hidden_layers": 2,
                "auto_map": {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"},
            }
        )
    )
    (tmp_path / "d.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    result = hsx(
        "produce",
        "--job",
        job_name,
        "--model",
        str(folder),
        "--dataset",
        str(tmp_path / "d.jsonl"),
        "--layers",
        "0",
        "--dest",
        str(tmp_path / "out"),
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("hsx: error:") and "--trust-remote-code" in result.stderr
    assert "Traceback" not in result.stderr
