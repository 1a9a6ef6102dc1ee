"""What a sample file holds is what transformers itself computes for that sample.

The consumer's path (load_model -> extract_samples on a padded batch -> write_sample_file) is run
on tiny random-weight Qwen3 and Llama models, each file is read back with safetensors, and every
selected layer is compared with the reference we did not write: transformers' own
`output_hidden_states`, from a separately loaded model run on the sample alone (batch of one, no
padding). Layer i is `hidden_states[i + 1]`; the last decoder layer is the raw layer output (a
hook of our own on the reference model), not transformers' post-norm last entry.

Float32 states are within tests/tolerance.py's float32 bound (from the reduction length and the
depth) with the samples in one padded batch or in two others, with one torch thread and with the
default (`torch_threads`), and a neighbouring layer, a token shift or a bfloat16 round trip is
shown to exceed it; bfloat16 states are within its bfloat16 bound.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_e2e_s3 import digest_and_checksum
from tolerance import (
    assert_rejects_mistakes,
    assert_within,
    bfloat16_bound,
    depth,
    error,
    float32_bound,
    reduction_length,
)
from transformers import AutoModelForCausalLM

from hsx.gpu_consumer.extract import extract_samples
from hsx.gpu_consumer.model import load_model
from hsx.gpu_consumer.writer import write_sample_file
from hsx.job import JobSpec
from hsx.storage import encodings
from hsx.storage.layout import LAYER_CONVENTION, SampleFiles, sample_key
from hsx.storage.spool import spool_file
from hsx.wire.schemas import FileReady, Sample

FAMILIES = ["qwen3", "llama"]
NUM_LAYERS = 6  # tests/conftest.py TINY
VOCAB = 512
LENGTHS = [5, 17, 33, 64]  # different lengths, so every sample but the longest is padded
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def reference_models(tiny_model):
    """One float32 reference model per family, loaded plainly by transformers (no hsx code)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_model(family), dtype=torch.float32)
            cache[family] = model.eval()
        return cache[family]

    return get


def _samples(seed: int, lengths=LENGTHS) -> list[Sample]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for position, length in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        # Every other sample carries a loss mask, so both the with- and without-mask files are checked.
        mask = torch.randint(0, 2, (length,), generator=generator).tolist() if position % 2 == 0 else None
        samples.append(Sample(index=1000 + 7 * position, source_id=f"row-{position}", input_ids=ids, loss_mask=mask))
    return samples


def _spec(job: str, model: Path, layers: list[int], dtype: str, samples: list[Sample]) -> JobSpec:
    return JobSpec(
        job=job,
        model=str(model),
        model_revision="local",
        layers=layers,
        dtype=dtype,
        dest="file:///tmp/unused",
        token_budget=4096,
        max_seq_len=1024,
        dataset="in-memory",
        plan_fingerprint="0" * 64,
        total_samples=len(samples),
        total_tokens=sum(len(s.input_ids) for s in samples),
        total_batches=1,
        created_at=0.0,
    )


def _reference(model, input_ids: list[int]) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """(transformers' hidden_states, raw output of every decoder layer from our own hooks), batch of 1."""
    raw: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):

        def hook(_module, _args, output, i=i):
            raw[i] = (output[0] if isinstance(output, tuple) else output).detach().clone()

        handles.append(layer.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    return tuple(h[0] for h in out.hidden_states), [raw[i][0] for i in range(len(model.model.layers))]


# The samples of a test in one padded batch, or in two others (each padded to another length,
# beside other rows): positions in the test's list of samples.
COMPOSITIONS = {"one batch": [[0, 1, 2, 3]], "two batches": [[3, 0], [2, 1]]}


def _extract_and_write(
    tmp_path: Path,
    model_path: Path,
    layers: list[int],
    dtype: str,
    samples: list[Sample],
    *,
    compile_layers: bool = False,
    groups: list[list[int]] | None = None,
):
    """The samples' files, written from one batch (or from the batches `groups` names), and
    their FileReady events in the samples' order."""
    loaded = load_model(
        str(model_path), layers=layers, encoding=encodings.of_spec(dtype), device="cpu", compile_layers=compile_layers
    )
    hidden = {}
    for group in groups or [list(range(len(samples)))]:
        batch = [samples[i] for i in group]
        hidden.update({s.index: h for s, h in zip(batch, extract_samples(loaded, batch))})
    spec = _spec("fidelity-job", model_path, layers, dtype, samples)
    spool = tmp_path / "spool"
    ready = [
        write_sample_file(
            spool=spool,
            files=SampleFiles.of(spec),
            node="node-a",
            batch_id="batch-0",
            sample=s,
            hidden_states=hidden[s.index],
        )
        for s in samples
    ]
    return spec, spool, ready


def _bound(model, layer: int | str, samples: list[Sample]) -> float:
    """The float32 bound (tests/tolerance.py) for `layer` of this model on these samples."""
    n = reduction_length(model.config, max(len(s.input_ids) for s in samples))
    return float32_bound(n, depth(layer, NUM_LAYERS))


def _read(spool: Path, ready: FileReady):
    path = spool / ready.spool_path
    tensors = load_file(path)
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    return path, tensors, metadata


def _check_file(spool: Path, spec: JobSpec, sample: Sample, ready: FileReady, layers: list[int]):
    path, tensors, metadata = _read(spool, ready)
    data = path.read_bytes()
    # The event describes exactly the bytes on disk.
    assert ready.size == len(data) == path.stat().st_size
    digest, checksum = digest_and_checksum(data)
    assert ready.digest == digest
    assert ready.sample_index == sample.index
    assert ready.num_tokens == len(sample.input_ids)
    assert ready.key == sample_key(spec.job, sample.index)
    assert spool / ready.spool_path == spool_file(spool, spec.job, spec.plan_tag, sample.index)
    assert ready.job == spec.job and ready.node == "node-a" and ready.batch_id == "batch-0"

    T, k = len(sample.input_ids), len(layers)
    hs = tensors["hidden_states"]
    assert hs.shape == (T, k, 64)
    assert hs.dtype == TORCH_DTYPES[spec.dtype]
    assert tensors["input_ids"].dtype == torch.int64
    assert torch.equal(tensors["input_ids"], torch.tensor(sample.input_ids, dtype=torch.int64))
    if sample.loss_mask is None:
        assert "loss_mask" not in tensors
        assert set(tensors) == {"hidden_states", "input_ids"}
    else:
        assert torch.equal(tensors["loss_mask"].to(torch.int64), torch.tensor(sample.loss_mask))

    assert metadata["job"] == spec.job
    assert metadata["sample_index"] == str(sample.index)
    assert metadata["source_id"] == sample.source_id
    assert json.loads(metadata["layers"]) == layers
    assert metadata["layer_convention"] == LAYER_CONVENTION
    assert metadata["dtype"] == spec.dtype
    assert metadata["num_tokens"] == str(T)
    assert metadata["model"] == spec.model
    assert metadata["model_revision"] == spec.model_revision
    assert metadata["checksum"] == checksum
    return hs


@pytest.mark.parametrize("composition", list(COMPOSITIONS))
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layers", [[0, 2, 4], [4, 0, 2]], ids=["ascending", "unordered"])
def test_float32_matches_transformers_per_sample(
    family, layers, composition, tiny_model, reference_models, tmp_path, torch_threads
):
    model_path = tiny_model(family)
    reference = reference_models(family)
    samples = _samples(seed=FAMILIES.index(family) * 10 + layers[0])
    groups = COMPOSITIONS[composition]
    spec, spool, ready = _extract_and_write(tmp_path, model_path, layers, "float32", samples, groups=groups)

    assert len(ready) == len(samples)
    used, mistakes = 0.0, float("inf")
    for sample, event in zip(samples, ready):
        hs = _check_file(spool, spec, sample, event, layers)
        expected, _raw = _reference(reference, sample.input_ids)
        assert len(expected) == NUM_LAYERS + 1
        for j, layer in enumerate(layers):
            bound = _bound(reference, layer, samples)
            what = f"{family} sample len {len(sample.input_ids)} in {composition}, {torch_threads} thread(s), layer {layer}"
            used = max(used, assert_within(hs[:, j], expected[layer + 1], bound, what) / bound)
            neighbour = expected[layer] if layer else None
            wrong = assert_rejects_mistakes(hs[:, j], expected[layer + 1], bound, what, neighbour=neighbour)
            mistakes = min(mistakes, *(m / bound for m in wrong.values()))
    print(
        json.dumps(
            {
                "float32": family,
                "layers": layers,
                "batches": composition,
                "threads": torch_threads,
                "of_bound": round(used, 3),
                "least_mistake_over_bound": round(mistakes, 1),
            }
        )
    )
    # Atomic writes leave nothing but the final files behind.
    assert sorted(p.name for p in spool.rglob("*") if p.is_file()) == sorted(Path(r.spool_path).name for r in ready)


def test_compiled_layers_match_transformers_per_sample(tiny_model, reference_models, tmp_path):
    """`hsx consume --compile`: the same states, through torch.compile'd decoder layers."""
    layers = [4, 0, 2]
    samples = _samples(seed=5)
    spec, spool, ready = _extract_and_write(
        tmp_path, tiny_model("qwen3"), layers, "float32", samples, compile_layers=True
    )
    for sample, event in zip(samples, ready):
        hs = _check_file(spool, spec, sample, event, layers)
        expected, _raw = _reference(reference_models("qwen3"), sample.input_ids)
        for j, layer in enumerate(layers):
            assert_within(hs[:, j], expected[layer + 1], _bound(reference_models("qwen3"), layer, samples), "compiled")


@pytest.mark.parametrize("family", FAMILIES)
def test_last_layer_is_raw_output_not_post_norm(family, tiny_model, reference_models, tmp_path, torch_threads):
    last = NUM_LAYERS - 1
    layers = [1, last]
    samples = _samples(seed=11, lengths=[9, 40])
    spec, spool, ready = _extract_and_write(tmp_path, tiny_model(family), layers, "float32", samples)
    reference = reference_models(family)
    for sample, event in zip(samples, ready):
        hs = _check_file(spool, spec, sample, event, layers)
        expected, raw = _reference(reference, sample.input_ids)
        # Our own hook agrees with transformers where transformers reports the raw output: one
        # forward, the same tensor seen twice, so the same bits...
        torch.testing.assert_close(raw[1], expected[2], rtol=0, atol=0)
        # ...and differs from its last entry, which has the final norm applied.
        bound = _bound(reference, last, samples)
        assert error(raw[last], expected[last + 1]) > bound
        assert_within(hs[:, 1], raw[last], bound, f"{family} last layer, {torch_threads} thread(s)")
        assert error(hs[:, 1], expected[last + 1]) > bound
        assert_within(hs[:, 0], expected[2], _bound(reference, 1, samples), f"{family} layer 1")


@pytest.mark.parametrize("family", FAMILIES)
def test_only_the_layers_up_to_the_deepest_selected_are_loaded_and_run(family, tiny_model):
    loaded = load_model(str(tiny_model(family)), layers=[1], encoding=encodings.of_spec("float32"), device="cpu")
    model = loaded.model
    # What the forward never runs is not loaded: layers 2.., the final norm, the lm_head.
    assert len(model.model.layers) == 2 and isinstance(model.model.norm, torch.nn.Identity)
    assert model.get_output_embeddings() is None and not hasattr(model, "lm_head")
    outside_layers = {name for name, _ in model.named_parameters() if not name.startswith("model.layers.")}
    assert outside_layers == {"model.embed_tokens.weight"}, outside_layers
    assert model.config.num_hidden_layers == NUM_LAYERS  # the config still describes the checkpoint
    calls: dict[str, int] = {}

    def counter(name):
        def count(_module, _args):
            calls[name] = calls.get(name, 0) + 1

        return count

    # Pre-hooks: they fire when a module starts, before the tap's own forward hook can stop the run.
    modules = {f"layer{i}": layer for i, layer in enumerate(model.model.layers)}
    handles = [module.register_forward_pre_hook(counter(name)) for name, module in modules.items()]
    try:
        out = extract_samples(loaded, _samples(seed=3, lengths=[6, 12, 3]))
    finally:
        for handle in handles:
            handle.remove()
    assert [h.shape for h in out] == [(6, 1, 64), (12, 1, 64), (3, 1, 64)]
    assert calls == {"layer0": 1, "layer1": 1}, calls


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_close_to_float32_reference(family, tiny_model, reference_models, tmp_path):
    layers = [0, 3, NUM_LAYERS - 1]
    samples = _samples(seed=5)
    spec, spool, ready = _extract_and_write(tmp_path, tiny_model(family), layers, "bfloat16", samples)
    used, mistakes = 0.0, float("inf")
    for sample, event in zip(samples, ready):
        hs = _check_file(spool, spec, sample, event, layers)
        assert hs.dtype == torch.bfloat16
        expected, raw = _reference(reference_models(family), sample.input_ids)
        wanted = [expected[1], expected[4], raw[NUM_LAYERS - 1]]
        neighbours = [None, expected[3], expected[NUM_LAYERS - 1]]
        for j, layer in enumerate(layers):
            # A bfloat16 forward rounds every weight and every intermediate result to 8 bits: the
            # bound is tests/tolerance.py's bfloat16 one.
            bound = bfloat16_bound(depth(layer, NUM_LAYERS))
            what = f"{family} len {len(sample.input_ids)} layer {layer}"
            used = max(used, assert_within(hs[:, j], wanted[j], bound, what) / bound)
            wrong = assert_rejects_mistakes(hs[:, j], wanted[j], bound, what, neighbour=neighbours[j])
            mistakes = min(mistakes, *(m / bound for m in wrong.values()))
    print(json.dumps({"bfloat16": family, "of_bound": round(used, 3), "least_mistake_over_bound": round(mistakes, 1)}))
