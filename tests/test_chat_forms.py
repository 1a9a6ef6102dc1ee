"""Chat rows as users have them, and the loss mask from one rendering (issue 23, items 1 and 2).

- Both forms of chat row: `messages` (role/content, content also as text parts) and ShareGPT
  `conversations` (from/value), in JSONL, Parquet and a datasets save_to_disk folder, give the same
  ids and mask; `--chat-field NAME` reads another column; an unknown role, a non-text part or a
  tool call the template cannot render is a one-line `BadRow` naming the row.
- The mask comes from one rendering of the whole conversation: replies that start with
  whitespace, multi-turn, unicode, code blocks, long turns, templates that trim replies or rewrite
  earlier turns (Qwen3's think stripping) all work; on a template with `{% generation %}` markers
  it equals transformers' own `return_assistant_tokens_mask`; a tool call is in its turn's mask.
- `tokenize_many` is one `apply_chat_template` call and one tokenizer call per chunk.

The tokenizer is a byte-level BPE trained here on the test conversations, with ChatML's and
Llama 3's special tokens; each chat template is a string set on a copy of it.
"""

import copy
import json
from pathlib import Path

import pytest
from test_cli_errors import _produce_args
from test_inputs import CHATML, CHATML_MARKERS, _ok, assistant_spans, make_chat_model, stored_rows

from hsx.errors import HsxError
from hsx.producer.chat import ChatTokenizer
from hsx.producer.config import parse_chat_field
from hsx.producer.rows import BadRow, ChatRow
from hsx.producer.sources import read_source

# Llama 3's layout: a header per message, every content trimmed.
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + (message['content'] | trim) + "
    "'<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LLAMA3_MARKERS = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ (message['content'] | trim) + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ (message['content'] | trim) + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Qwen3's habit: an assistant turn before the last keeps only what follows its </think>.
THINK = (
    "{% for message in messages %}{% if message['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\\n' + message['content'].split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ChatML with tool calls after the reply and tool results as user turns (Qwen2.5's layout).
TOOLS = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{{ message['content'] }}{% for call in message.get('tool_calls', []) %}"
    "{{ '\\n<tool_call>\\n' + (call['function'] | tojson) + '\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# DeepSeek-R1's habit: the generation prompt opens a think block that history turns do not have.
PROMPT_THINKS = CHATML.replace(
    "'<|im_start|>assistant\\n' }}{% endif %}", "'<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)
TEMPLATES = {
    "chatml": CHATML,
    "chatml_markers": CHATML_MARKERS,
    "llama3": LLAMA3,
    "llama3_markers": LLAMA3_MARKERS,
    "think": THINK,
    "tools": TOOLS,
    "prompt_thinks": PROMPT_THINKS,
}

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of Peru?"},
        {"role": "assistant", "content": "\n\nLima."},  # a reply that starts with a blank line
        {"role": "user", "content": "Say Lima."},  # the next reply's text is in the question
        {"role": "assistant", "content": "Lima."},
    ],
    [
        {"role": "user", "content": "Écris « bonjour » en japonais, s'il te plaît 🙂"},
        {"role": "assistant", "content": "こんにちは — « konnichiwa » 🙂"},
    ],
    [
        {"role": "user", "content": "Reverse a list in Python?"},
        {"role": "assistant", "content": "```python\nxs = [1, 2, 3]\nxs.reverse()\nprint(xs[::-1])\n```\n"},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "  You're welcome!  "},
    ],
    [
        {"role": "user", "content": "Count."},
        {"role": "assistant", "content": " ".join(str(n) for n in range(400))},  # a long turn
        {"role": "user", "content": "Again, nothing."},
        {"role": "assistant", "content": ""},  # an empty reply: its end-of-turn token only
    ],
]
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
LLAMA3_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


@pytest.fixture(scope="module")
def base_tokenizer():
    """A byte-level BPE trained on the test conversations, with ChatML's and Llama 3's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,  # inside the tiny model's vocabulary of 512
        special_tokens=["<|endoftext|>", *CHATML_TOKENS, *LLAMA3_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [m["content"] for c in CONVERSATIONS for m in c] + ["system user assistant tool\n\n\n", "<tool_call>"]
    bpe.train_from_iterator(corpus * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def chats(base_tokenizer) -> dict[str, ChatTokenizer]:
    out = {}
    for name, template in TEMPLATES.items():
        tokenizer = copy.deepcopy(base_tokenizer)
        tokenizer.chat_template = template
        out[name] = ChatTokenizer(tokenizer, model=f"test-{name}")
    return out


def _row(messages: list[dict], where: str = "chats.jsonl:1") -> ChatRow:
    return ChatRow(where=where, source_id="0", messages=messages)


def _reference_ids(chat: ChatTokenizer, messages: list[dict]) -> list[int]:
    return list(chat.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


def _chat_rows(path: Path, **kwargs) -> list[ChatRow]:
    items = list(read_source(path, **kwargs))
    assert all(isinstance(item, ChatRow) for item in items)
    return items


def _sharegpt(messages: list[dict]) -> list[dict]:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return [{"from": names[m["role"]], "value": m["content"]} for m in messages]


# ---------------------------------------------------------------- the mask from one rendering


@pytest.mark.parametrize("template", ["chatml", "llama3", "prompt_thinks"])
def test_mask_is_each_reply_and_its_end_of_turn(template, chats):
    chat = chats[template]
    end = {"llama3": "<|eot_id|>"}.get(template, "<|im_end|>")
    rows = [_row(c, where=f"chats.jsonl:{n + 1}") for n, c in enumerate(CONVERSATIONS)]
    for row, tokenized in zip(rows, chat.tokenize_many(rows), strict=True):
        assert tokenized.input_ids == _reference_ids(chat, row.messages)
        spans = assistant_spans(chat.tokenizer, tokenized.input_ids, tokenized.loss_mask)
        replies = [m["content"] for m in row.messages if m["role"] == "assistant"]
        if template == "llama3":  # the template trims each reply
            replies = [r.strip() for r in replies]
        # The reply "\n\nLima." shares its first token with the header's own newline; everything
        # else is exactly the reply and its end-of-turn token, in order.
        assert [s.lstrip("\n") for s in spans] == [r.lstrip("\n") + end for r in replies], row.where
        assert tokenized == chat.tokenize(row)


@pytest.mark.parametrize(("markers", "plain"), [("chatml_markers", "chatml"), ("llama3_markers", "llama3")])
def test_one_rendering_equals_transformers_assistant_mask(markers, plain, chats, base_tokenizer):
    """On a template with {% generation %} markers, the one-rendering rule (forced on) gives
    transformers' own return_assistant_tokens_mask, and so does the template without markers."""
    chat = chats[markers]
    assert chat.info.mask_method == "generation_markers"
    forced = ChatTokenizer(chat.tokenizer, model="forced")
    forced.has_generation_markers = False
    rows = [_row(c) for c in CONVERSATIONS]
    for row, one_rendering, without_markers in zip(
        rows, forced.tokenize_many(rows), chats[plain].tokenize_many(rows), strict=True
    ):
        out = chat.tokenizer.apply_chat_template(
            row.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert one_rendering.input_ids == list(out["input_ids"]) == without_markers.input_ids
        assert one_rendering.loss_mask == list(out["assistant_masks"]) == without_markers.loss_mask
        assert sum(one_rendering.loss_mask) > 0


def _holding_template_text(tokens: tuple[str, ...], header: str, end: str) -> list[list[dict]]:
    """Conversations whose system, user and assistant text hold every special token of the
    template, its assistant header and whole quoted turns: data about chat formats and prompting."""
    every = " ".join(tokens)
    turn = f"{header}Hello{end}"
    return [
        [
            {"role": "user", "content": "How does a reply end?"},
            {"role": "assistant", "content": f"write {end} at the end of the reply, then stop"},
        ],
        [
            {"role": "system", "content": f"Tokens: {every}. A turn: {turn}"},
            {"role": "user", "content": f"Quote a turn: {turn}\n{header}"},
            {"role": "assistant", "content": turn},
            {"role": "user", "content": f"{end}\n{header}and again"},
            {"role": "assistant", "content": f"{end}\n{header}Hi{end}{every}\n{header}ok"},
        ],
        [
            {"role": "user", "content": every},
            {"role": "assistant", "content": f"  {every}  "},  # surrounding whitespace, trimmed by some templates
            {"role": "user", "content": "and an empty one"},
            {"role": "assistant", "content": f"{end}"},
        ],
    ]


CHATML_HEADER = "<|im_start|>assistant\n"
LLAMA3_HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"


@pytest.mark.parametrize(
    ("markers", "plain", "tokens", "header", "end"),
    [
        ("chatml_markers", "chatml", CHATML_TOKENS, CHATML_HEADER, "<|im_end|>"),
        ("llama3_markers", "llama3", LLAMA3_TOKENS, LLAMA3_HEADER, "<|eot_id|>"),
    ],
)
def test_replies_holding_template_text_keep_their_whole_mask(markers, plain, tokens, header, end, chats):
    """A reply that holds the end-of-turn token's text, or quotes whole turns, is masked whole:
    the one-rendering rule, on the template with and without markers, gives transformers' own
    return_assistant_tokens_mask, on rows whose every message holds every special token."""
    forced = ChatTokenizer(chats[markers].tokenizer, model="forced")
    forced.has_generation_markers = False
    rows = [_row(c, where=f"r{n}") for n, c in enumerate(_holding_template_text(tokens, header, end))]
    for row, one_rendering, without_markers in zip(
        rows, forced.tokenize_many(rows), chats[plain].tokenize_many(rows), strict=True
    ):
        out = chats[markers].tokenizer.apply_chat_template(
            row.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert one_rendering.input_ids == list(out["input_ids"]) == without_markers.input_ids, row.where
        assert one_rendering.loss_mask == list(out["assistant_masks"]), row.where
        assert without_markers.loss_mask == list(out["assistant_masks"]), row.where


@pytest.mark.parametrize("template", ["think", "tools", "prompt_thinks"])
def test_replies_holding_template_text_on_other_templates(template, chats):
    """The same rows on templates without a markers twin: each span is the reply and its end-of-turn token."""
    chat = chats[template]
    for n, conversation in enumerate(_holding_template_text(CHATML_TOKENS, CHATML_HEADER, "<|im_end|>")):
        row = chat.tokenize(_row(conversation, where=f"r{n}"))
        assert row.input_ids == _reference_ids(chat, conversation)
        replies = [m["content"] for m in conversation if m["role"] == "assistant"]
        assert assistant_spans(chat.tokenizer, row.input_ids, row.loss_mask) == [r + "<|im_end|>" for r in replies], n


def test_template_that_rewrites_earlier_turns(chats):
    """Qwen3-style: an earlier reply is rendered without its think block; the mask is that
    reply as rendered, and the last reply (think block kept) is masked whole."""
    chat = chats["think"]
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n6"},
    ]
    row = chat.tokenize(_row(messages))
    assert row.input_ids == _reference_ids(chat, messages)
    assert assistant_spans(chat.tokenizer, row.input_ids, row.loss_mask) == [
        "4<|im_end|>",
        "<think>\nadd\n</think>\n\n6<|im_end|>",
    ]


def test_tokenize_many_is_two_renderings_and_one_tokenizer_call(chats):
    chat = chats["chatml"]
    rows = [_row(c, where=f"r{n}") for n, c in enumerate(CONVERSATIONS * 8)]
    expected = [chat.tokenize(row) for row in rows]
    calls = {"render": 0, "encode": 0}
    tokenizer = copy.copy(chat.tokenizer)
    render = tokenizer.apply_chat_template

    def counted_render(*args, **kwargs):
        calls["render"] += 1
        return render(*args, **kwargs)

    class Backend:  # the Rust tokenizer, its batch calls counted
        def __init__(self, backend):
            self._backend = backend

        def __getattr__(self, name):
            return getattr(self._backend, name)

        def encode_batch(self, *args, **kwargs):
            calls["encode"] += 1
            return self._backend.encode_batch(*args, **kwargs)

    tokenizer.apply_chat_template = counted_render
    tokenizer._tokenizer = Backend(tokenizer._tokenizer)
    chat_counted = copy.copy(chat)
    chat_counted.tokenizer = tokenizer
    assert chat_counted.tokenize_many(rows) == expected
    # The conversations and their marked twins (producer/reply_spans.py): two renderings.
    assert calls == {"render": 2, "encode": 1}


# ---------------------------------------------------------------- tool calls


TOOL_CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Lima"}}}
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Lima?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "content": '{"sky": "grey"}'},
    {"role": "assistant", "content": "Grey skies in Lima."},
]


def test_tool_calls_on_a_template_that_renders_them(chats, tmp_path):
    chat = chats["tools"]
    path = _write_jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_CONVERSATION}])
    (row,) = _chat_rows(path)
    tokenized = chat.tokenize(row)
    assert tokenized.input_ids == _reference_ids(chat, TOOL_CONVERSATION)
    call = json.dumps(TOOL_CALL["function"])
    # The tool call the assistant wrote is in its turn's mask; the tool's answer is not.
    assert assistant_spans(chat.tokenizer, tokenized.input_ids, tokenized.loss_mask) == [
        f"Let me check.\n<tool_call>\n{call}\n</tool_call><|im_end|>",
        "Grey skies in Lima.<|im_end|>",
    ]


def test_tool_calls_on_a_template_without_them_are_a_one_line_bad_row(chats, tmp_path):
    path = _write_jsonl(tmp_path / "tools.jsonl", [{"messages": CONVERSATIONS[1]}, {"messages": TOOL_CONVERSATION}])
    rows = _chat_rows(path)
    chat = chats["chatml"]
    with pytest.raises(BadRow) as caught:
        chat.tokenize_many(rows)
    bad = caught.value
    assert (bad.where, bad.source_id) == (f"{path}:2", "1")
    assert "tool calls" in bad.reason and "test-chatml" in bad.reason and "\n" not in str(bad)
    kept = chat.tokenize_many(rows, keep_bad=True)
    assert kept[0] == chat.tokenize(rows[0]) and isinstance(kept[1], BadRow)


def test_template_error_is_a_bad_row_naming_the_row(base_tokenizer):
    tokenizer = copy.deepcopy(base_tokenizer)
    tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system messages') }}{% endif %}" + CHATML
    )
    chat = ChatTokenizer(tokenizer, model="strict")
    rows = [_row(CONVERSATIONS[1], where="d.jsonl:1"), _row(CONVERSATIONS[0], where="d.jsonl:2")]
    out = chat.tokenize_many(rows, keep_bad=True)
    assert not isinstance(out[0], BadRow)
    assert isinstance(out[1], BadRow) and out[1].where == "d.jsonl:2" and "no system messages" in out[1].reason


# ---------------------------------------------------------------- row forms


def test_sharegpt_and_text_parts_equal_messages(chats, tmp_path):
    conversation = CONVERSATIONS[0]
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in conversation]
    split = [
        {"role": m["role"], "content": [{"type": "text", "text": c} for c in m["content"].partition(" ")]}
        for m in conversation
    ]
    rows = [
        {"messages": conversation},
        {"conversations": _sharegpt(conversation)},
        {"conversations": conversation},  # role/content entries under `conversations`
        {"messages": parts},
        {"messages": split},
    ]
    chat_rows = _chat_rows(_write_jsonl(tmp_path / "forms.jsonl", rows))
    tokenized = chats["chatml"].tokenize_many(chat_rows)
    for row in tokenized[1:]:
        assert (row.input_ids, row.loss_mask) == (tokenized[0].input_ids, tokenized[0].loss_mask), row.where


def test_sharegpt_in_parquet_and_a_saved_folder(chats, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"conversations": _sharegpt(c)} for c in CONVERSATIONS]
    jsonl = _chat_rows(_write_jsonl(tmp_path / "c.jsonl", rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    expected = [m for m in chats["chatml"].tokenize_many(jsonl)]
    for path in (tmp_path / "c.parquet", tmp_path / "saved"):
        got = chats["chatml"].tokenize_many(_chat_rows(path))
        assert [(r.input_ids, r.loss_mask) for r in got] == [(r.input_ids, r.loss_mask) for r in expected]
        assert got[2].where == f"{path}: row 2"


def test_chat_field_names_another_column(chats, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"dialogue": _sharegpt(c), "id": f"d{n}"} for n, c in enumerate(CONVERSATIONS[:2])]
    jsonl = _write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for path in (jsonl, tmp_path / "d.parquet"):
        got = _chat_rows(path, chat_field="dialogue")
        assert [r.source_id for r in got] == ["d0", "d1"]
        assert got[0].messages[2] == {"role": "assistant", "content": "\n\nLima."}
    with pytest.raises(BadRow, match="neither input_ids .* nor messages or conversations"):
        list(read_source(jsonl))
    with pytest.raises(HsxError, match="no input_ids or messages or conversations column"):
        list(read_source(tmp_path / "d.parquet"))
    assert parse_chat_field(" dialogue ") == "dialogue"
    with pytest.raises(HsxError, match="--chat-field"):
        parse_chat_field("input_ids")


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}, "'robot'"),
        ({"conversations": [{"from": "human", "value": "hi"}, {"from": "bard", "value": "x"}]}, "'bard'"),
        ({"conversations": []}, "conversations is empty"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "'image_url'"),
        ({"messages": [{"role": "user", "content": 5}]}, "text"),
        ({"messages": [{"role": "user"}]}, "no content"),
    ],
)
def test_bad_conversations_are_bad_rows_naming_file_and_line(row, reason, tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONVERSATIONS[1]}, {**row, "id": "r2"}])
    with pytest.raises(BadRow) as caught:
        list(read_source(path))
    bad = caught.value
    assert bad.where == f"{path}:2" and bad.source_id == "r2"
    assert reason in bad.reason and "\n" not in str(bad)


def test_produce_takes_sharegpt_rows_from_chat_field(hsx, nats_server, base_tokenizer, tiny_model, job_name, tmp_path):
    """Through `hsx produce`: ShareGPT rows in another column, a whitespace-led reply among them,
    stored with the same ids and mask as the same conversations given as `messages`."""
    rows = [{"dialogue": _sharegpt(c), "id": f"c{n}"} for n, c in enumerate(CONVERSATIONS[:3])]
    dataset = _write_jsonl(tmp_path / "sharegpt.jsonl", rows)
    files = tmp_path / "tokenizer"
    base_tokenizer.save_pretrained(files)
    model = make_chat_model(tiny_model("qwen3"), files, tmp_path / "model", CHATML)
    _ok(hsx(*_produce_args(model, dataset, tmp_path / "out", job_name, **{"--chat-field": "dialogue"})))
    stored = stored_rows(nats_server.url, job_name)
    chat = ChatTokenizer.load(str(model), first_chat_row="row")
    expected = chat.tokenize_many([_row(c) for c in CONVERSATIONS[:3]])
    assert [(r.source_id, r.input_ids, r.loss_mask) for r in stored] == [
        (f"c{n}", e.input_ids, e.loss_mask) for n, e in enumerate(expected)
    ]
