"""torch.compile on by default on CUDA, off on a CPU, with explicit switches both ways; and a
compile that fails at the warm-up's first forward falls back to eager: one log line, and the
kernel report says so (gpu_consumer/compiling.py).

The failure is real torch: dynamo traces the tiny model's decoder layer and hands the graph to a
backend, installed through the module's seam, that fails as inductor does on a machine without
a C compiler; dynamo raises its own BackendCompilerFailed from the first forward.
"""

import pytest
import structlog
import torch

from hsx.commands.cli import build_parser
from hsx.commands.services import consumer_config
from hsx.commands.up import UpConfig
from hsx.config.settings import resolve
from hsx.gpu_consumer import compiling
from hsx.gpu_consumer.extract import extract_samples
from hsx.gpu_consumer.kernels import kernel_report
from hsx.gpu_consumer.main import ModelKey, _load_ready
from hsx.gpu_consumer.model import load_model
from hsx.storage import encodings
from hsx.wire import schemas

LAYERS = (1, 3)


def _no_compiler(graph, example_inputs):
    raise RuntimeError("test: no C compiler on this node")


def test_a_failing_compile_falls_back_to_eager_in_one_line_and_the_report_says_so(tiny_model, monkeypatch):
    monkeypatch.setattr(compiling, "backend", _no_compiler)
    path = tiny_model("qwen3")
    key = ModelKey(str(path), "local", LAYERS, encodings.of_spec("float32"), False)
    with structlog.testing.capture_logs() as logs:
        loaded = _load_ready(key, device="cpu", compile_layers=True)
    warnings = [entry for entry in logs if entry["log_level"] in ("warning", "error")]
    assert [entry["event"] for entry in warnings] == ["compile_failed_running_eager"], logs
    reason = warnings[0]["reason"]
    assert "\n" not in reason and reason == "RuntimeError: test: no C compiler on this node", reason
    assert not compiling.compiled(loaded.model) and compiling.fallback_reason(loaded.model) == reason
    report = kernel_report(
        loaded.model, compiled=compiling.compiled(loaded.model), compile_error=compiling.fallback_reason(loaded.model)
    )
    assert report == schemas.Kernels(attention="sdpa", compiled=False, compile_error=reason)
    # Eager from then on: the states of a plain eager model, bit for bit (the same modules on the
    # same batches in one process: every sum in the same order, no tolerance to derive).
    samples = [schemas.Sample(index=i, source_id=str(i), input_ids=list(range(3, 3 + n))) for i, n in enumerate((9, 4))]
    eager = load_model(str(path), layers=list(LAYERS), encoding=encodings.of_spec("float32"), device="cpu")
    for got, expected in zip(extract_samples(loaded, samples), extract_samples(eager, samples)):
        assert torch.equal(got, expected)


def test_a_compile_that_works_is_kept(tiny_model, monkeypatch):
    """The seam's plain backend (dynamo's graph run as traced): nothing falls back."""
    monkeypatch.setattr(compiling, "backend", "eager")
    key = ModelKey(str(tiny_model("qwen3")), "local", LAYERS, encodings.of_spec("float32"), False)
    with structlog.testing.capture_logs() as logs:
        loaded = _load_ready(key, device="cpu", compile_layers=True)
    assert compiling.compiled(loaded.model) and compiling.fallback_reason(loaded.model) == ""
    assert not [entry for entry in logs if entry["event"] == "compile_failed_running_eager"], logs


@pytest.mark.parametrize(
    "argv, env, cuda, cpu",
    [
        ([], {}, True, False),
        (["--compile"], {}, True, True),
        (["--no-compile"], {}, False, False),
        ([], {"HSX_COMPILE": "0"}, False, False),
        ([], {"HSX_COMPILE": "1"}, True, True),
        (["--no-compile"], {"HSX_COMPILE": "1"}, False, False),
    ],
    ids=["default", "on", "off", "env-off", "env-on", "off-wins"],
)
def test_compiling_is_on_with_cuda_by_default_and_switched_both_ways(argv, env, cuda, cpu):
    parser = build_parser()
    args = parser.parse_args(["consume", "--job", "j", *argv])
    resolve(parser, args, env)
    cfg = consumer_config(args, None, prepare=False)
    assert (cfg.compiles("cuda"), cfg.compiles("cpu")) == (cuda, cpu)


@pytest.mark.parametrize("argv, expected", [([], (True, False)), (["--no-compile"], (False, False))])
def test_hsx_up_hands_the_compile_switches_to_its_consumers(argv, expected, tmp_path):
    parser = build_parser()
    args = parser.parse_args(["up", "--workdir", str(tmp_path), *argv])
    resolve(parser, args, {})
    consumer = UpConfig.from_args(parser, args, nats=None, environ={}, prepare=False).consumer
    assert (consumer.compiles("cuda"), consumer.compiles("cpu")) == expected


def test_a_batch_that_fails_compiling_later_runs_eagerly(tiny_model, monkeypatch):
    """Past the warm-up (a batch's shapes make dynamo compile again, and that fails): the batch's
    forward turns compiling off and runs again eagerly, in one log line; other failures are the
    forward's own and are raised."""
    path = tiny_model("qwen3")
    loaded = load_model(
        str(path), layers=list(LAYERS), encoding=encodings.of_spec("float32"), device="cpu", compile_layers=True
    )
    monkeypatch.setattr(compiling, "backend", _no_compiler)
    compiling.compile_decoder_layers(loaded.model)  # compiled again, with the failing backend
    samples = [schemas.Sample(index=0, source_id="0", input_ids=list(range(3, 14)))]
    with structlog.testing.capture_logs() as logs:
        states = compiling.eager_on_failure(loaded.model, lambda: extract_samples(loaded, samples))
    assert [entry["event"] for entry in logs if entry["log_level"] == "warning"] == ["compile_failed_running_eager"]
    assert not compiling.compiled(loaded.model) and states[0].shape == (11, len(LAYERS), 64)
    with pytest.raises(ValueError):
        compiling.eager_on_failure(loaded.model, lambda: (_ for _ in ()).throw(ValueError("the forward's own")))
