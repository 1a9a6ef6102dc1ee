"""The consumer's kernel report says what transformers resolved on the loaded model, and a hybrid
model on transformers' torch fallback is refused, or with --allow-slow-kernels warned about, only
where fast kernels exist (CUDA).

The tiny hybrid models (Qwen3.5, Qwen3-Next) are test_families.py's. Without fla-core and
causal-conv1d (this machine: they are CUDA packages) transformers binds its torch functions. With
them, it binds theirs when the modeling module is imported: that is re-done here with transformers'
own decorator and two stand-in packages of those names, so that the report is seen to follow the
binding rather than what is installed. A CUDA consumer's real report is tests/test_gpu.py's.
"""

import importlib
import sys

import msgspec
import pytest
import structlog
import torch
from test_families import FAMILIES
from tolerance import assert_within, float32_states_bound
from transformers.integrations import hub_kernels

from hsx.commands.cli import build_parser
from hsx.commands.embedded import build_tiny_model
from hsx.commands.up import UpConfig
from hsx.config.settings import resolve
from hsx.errors import HsxError
from hsx.gpu_consumer.kernels import (
    check_kernels,
    fallbacks,
    kernel_report,
    linear_attention_layers,
    plain_function,
)
from hsx.gpu_consumer.model import load_model
from hsx.storage import encodings
from hsx.wire import schemas

HYBRIDS = ["qwen3_5_text", "qwen3_next"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("kernel-models")
    models = {}

    def get(name: str):
        if name not in models:
            path = build_tiny_model(root / name, seed=7, **FAMILIES[name].config)
            # Layer 2: the trunk holds layers 0-2, two of them linear attention (HYBRID_LAYER_TYPES).
            models[name] = load_model(str(path), layers=[2], encoding=encodings.of_spec("float32"), device="cpu")
        return models[name]

    return get


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_hybrid_without_the_packages_reports_the_torch_fallback(name, loaded):
    assert importlib.util.find_spec("fla") is None and importlib.util.find_spec("causal_conv1d") is None
    model = loaded(name).model
    mixers = linear_attention_layers(model)
    assert len(mixers) == 2 and all("GatedDeltaNet" in type(m).__name__ for m in mixers), mixers
    report = kernel_report(model, compiled=True)
    assert report == schemas.Kernels(
        attention=model.config._attn_implementation, linear_attention="torch", conv1d="torch", compiled=True
    )
    assert report.attention == "sdpa"
    assert fallbacks(report, "cuda") == ["linear_attention", "conv1d"]
    assert fallbacks(report, "cpu") == []


@pytest.mark.parametrize("name", ["qwen3", "gemma2"])
def test_a_model_without_linear_attention_reports_none(name, loaded):
    model = loaded(name).model
    report = kernel_report(model, compiled=False)
    # gemma2 is the family transformers runs with eager attention: the report follows the model.
    assert report == schemas.Kernels(attention="eager" if name == "gemma2" else "sdpa", compiled=False)
    assert fallbacks(report, "cuda") == []


@pytest.mark.parametrize("name", HYBRIDS)
def test_the_report_follows_the_functions_transformers_bound(name, loaded, tmp_path, monkeypatch):
    # Where transformers imports them from: fla.ops.gated_delta_rule, causal_conv1d.
    (tmp_path / "fla" / "ops").mkdir(parents=True)
    (tmp_path / "causal_conv1d").mkdir()
    for module, function in [
        ("fla/__init__.py", None),
        ("fla/ops/__init__.py", None),
        ("fla/ops/gated_delta_rule.py", "chunk_gated_delta_rule"),
        ("causal_conv1d/__init__.py", "causal_conv1d_fn"),
    ]:
        stand_in = f"def {function}(*args, **kwargs):\n    raise NotImplementedError('never called')\n"
        (tmp_path / module).write_text(stand_in if function else "")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = loaded(name).model
    modeling = sys.modules[type(linear_attention_layers(model)[0]).__module__]
    try:
        for attribute, (function, package) in {
            "torch_chunk_gated_delta_rule": ("chunk_gated_delta_rule", "fla"),
            "causal_conv1d_fn": ("causal_conv1d_fn", "causal_conv1d"),
        }.items():
            torch_function = plain_function(getattr(modeling, attribute)).__wrapped__
            bound = hub_kernels.use_kernel_func_from_hub_with_fallback(function, package)(torch_function)
            monkeypatch.setattr(modeling, attribute, bound)
        report = kernel_report(model, compiled=False)
    finally:
        for package in ("fla", "causal_conv1d"):
            for loaded_name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
                del sys.modules[loaded_name]
    assert (report.linear_attention, report.conv1d) == ("fla", "causal_conv1d"), report
    assert fallbacks(report, "cuda") == []


SLOW = schemas.Kernels(attention="sdpa", linear_attention="torch", conv1d="torch")
HALF = schemas.Kernels(attention="sdpa", linear_attention="fla", conv1d="torch")
FAST = schemas.Kernels(attention="flash_attention_2", linear_attention="fla", conv1d="causal_conv1d")
DENSE = schemas.Kernels(attention="sdpa")


def test_on_cuda_a_fallback_is_refused_in_one_line_unless_allowed():
    with pytest.raises(HsxError) as refused:
        check_kernels(HALF, "cuda", allow_slow=False)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("the model's causal conv1d would run transformers' torch "), (
        message
    )
    assert "fallback on cuda" in message and "(causal-conv1d not importable here)" in message, message
    assert "linear" not in message and "pip install -e '.[kernels]'" in message, message
    assert message.endswith("or pass --allow-slow-kernels to run it so"), message

    with structlog.testing.capture_logs() as logs:
        check_kernels(SLOW, "cuda", allow_slow=True)
    assert [entry["event"] for entry in logs] == ["slow_kernels"], logs
    assert logs[0]["log_level"] == "warning" and logs[0]["fallbacks"] == ["linear_attention", "conv1d"]
    assert "pip install -e '.[kernels]'" in logs[0]["install"], logs


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_real_hybrid_models_report_is_refused_on_cuda(name, loaded):
    """The check is not CUDA-specific: a tiny real Qwen3.5 / Qwen3-Next's own report (torch
    fallback here), checked as a CUDA consumer checks it, is refused in one line naming both
    parts; allowed, it runs with one warning; on the CPU it is what runs, and nothing is said."""
    report = kernel_report(loaded(name).model, compiled=False)
    with pytest.raises(HsxError) as refused:
        check_kernels(report, "cuda", allow_slow=False)
    message = str(refused.value)
    assert "\n" not in message, message
    assert message.startswith("the model's linear attention and causal conv1d would run transformers' torch "), message
    assert "(fla-core, causal-conv1d not importable here)" in message and "--allow-slow-kernels" in message, message
    with structlog.testing.capture_logs() as logs:
        check_kernels(report, "cuda", allow_slow=True)
        check_kernels(report, "cpu", allow_slow=False)
    assert [entry["event"] for entry in logs] == ["slow_kernels"], logs


@pytest.mark.parametrize(
    "report, device",
    [(FAST, "cuda"), (DENSE, "cuda"), (SLOW, "cpu")],
    ids=["fast-on-cuda", "dense-on-cuda", "torch-on-cpu"],
)
def test_nothing_to_warn_about_or_refuse(report, device):
    """On a CPU the torch path is the only one there is: it is never refused."""
    with structlog.testing.capture_logs() as logs:
        for allow_slow in (False, True):
            check_kernels(report, device, allow_slow=allow_slow)
    assert logs == []


def test_a_heartbeat_without_kernels_still_decodes():
    beat = schemas.Heartbeat(job="j", service="gpu_consumer", instance="n-1", node="n", state="idle", kernels=FAST)
    sent = msgspec.json.decode(schemas.encode(beat))
    assert schemas.event_decoder.decode(schemas.encode(beat)).kernels == FAST
    del sent["kernels"]  # a consumer from before the field
    assert schemas.event_decoder.decode(msgspec.json.encode(sent)).kernels is None


@pytest.mark.parametrize("given", [False, True])
def test_hsx_up_passes_allow_slow_kernels_to_its_consumers(given, tmp_path):
    parser = build_parser()
    args = parser.parse_args(["up", "--workdir", str(tmp_path), *(["--allow-slow-kernels"] if given else [])])
    resolve(parser, args, {})
    assert UpConfig.from_args(parser, args, nats=None, environ={}, prepare=False).consumer.allow_slow_kernels is given


def _conv_of_flas_contract(x, weight, bias=None, activation=None):
    """fla's `causal_conv1d` contract ([B, T, D] in; (y, final state) out; accumulated and
    activated in float32, as its Triton kernel does), in plain torch: what runs here in fla's
    place (its kernel needs CUDA; tests/test_gpu.py checks the real one against transformers')."""
    width = weight.shape[1]
    y = torch.nn.functional.conv1d(
        x.transpose(1, 2).float(),
        weight.float().unsqueeze(1),
        None if bias is None else bias.float(),
        padding=width - 1,
        groups=weight.shape[0],
    )[..., : x.shape[1]]
    if activation in ("silu", "swish"):
        y = torch.nn.functional.silu(y)
    return y.transpose(1, 2).to(x.dtype), None


@pytest.mark.parametrize("name", HYBRIDS)
def test_fla_conv_is_bound_where_transformers_runs_its_torch_conv(name, loaded):
    """bind_fla_conv puts a convolution of fla's contract where the modeling module's forward
    looks `causal_conv1d_fn` up: the report names it (conv1d no longer a fallback), the states
    are the torch convolution's, a second bind changes nothing, and unbinding restores it."""
    from hsx.gpu_consumer.extract import extract_samples
    from hsx.gpu_consumer.kernels import bind_fla_conv, unbind_fla_conv

    model = loaded(name)
    samples = [
        schemas.Sample(index=i, source_id=str(i), input_ids=list(range(5, 5 + n))) for i, n in enumerate((9, 30))
    ]
    before = extract_samples(model, samples)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return _conv_of_flas_contract(*args, **kwargs)

    try:
        assert bind_fla_conv(model.model, implementation=counted)
        report = kernel_report(model.model, compiled=False)
        assert report.conv1d == __name__ and fallbacks(report, "cuda") == ["linear_attention"], report
        assert not bind_fla_conv(model.model, implementation=_conv_of_flas_contract)
        for sample, got, expected in zip(samples, extract_samples(model, samples), before):
            # Another implementation of the same convolution sums its taps in its own order: the
            # float32 bound of tests/tolerance.py for the deepest layer the model holds.
            bound = float32_states_bound(model.model.config, [2], len(sample.input_ids))  # loaded with layers=[2]
            assert_within(got, expected, bound, f"{name} sample {sample.index}")
        # Called by the forward (layer 0 is a linear-attention one), with [B, T, D].
        assert calls and calls[0][:2] == (2, 30), calls
    finally:
        unbind_fla_conv()
    assert kernel_report(model.model, compiled=False).conv1d == "torch"
