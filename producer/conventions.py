"""A trainer's own way of turning a conversation into input ids and a loss mask (`--chat-as`).

hsx's default (producer/chat.py) masks exactly the assistant's replies as the model's chat template
renders them. `--chat-as specforge:TEMPLATE` and `--chat-as speculators` instead give the ids and
mask that SpecForge 0.2.0's `preprocess_conversations` and speculators 0.9.0's
`build_speculator_training_dataset` make of the same row, so that hidden states line up with what
those trainers would compute; each function below restates one trainer's rules, and
tests/test_chat_conventions.py holds them to the trainers' own code. Neither trainer is imported
here: they are test-only dependencies. Truncation is not done here: --on-long truncate cuts the
ids and mask as the trainers' max_length does. This module knows nothing about files or NATS.
"""

import json
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hsx.errors import HsxError


@dataclass(frozen=True, kw_only=True)
class SpecForgeTemplate:
    """One entry of SpecForge 0.2.0's TEMPLATE_REGISTRY (specforge/data/template.py), as data."""

    assistant_header: str
    user_header: str
    system_prompt: str | None
    end_of_turn_token: str
    parser_type: str = "general"  # general | thinking | glm
    assistant_pattern_type: str = "general"  # general | longcat | inkling | glm
    enable_thinking: bool = False
    ignore_token: tuple[str, ...] = ()


_HELPFUL = "You are a helpful assistant."
_LLAMA3_SYSTEM = (
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, while being "
    "safe.  Your answers should not include any harmful, unethical, racist, sexist, toxic, dangerous, or illegal "
    "content. Please ensure that your responses are socially unbiased and positive in nature.\n\nIf a question "
    "does not make any sense, or is not factually coherent, explain why instead of answering something not "
    "correct. If you don't know the answer to a question, please don't share false information."
)
_IM = {"assistant_header": "<|im_start|>assistant\n", "user_header": "<|im_start|>user\n"}

# SpecForge 0.2.0's templates that render through the model's own chat template. Not here:
# gpt-oss (its openai-harmony parser writes its own prompt instead of the model's template) and
# deepseek-r1-distill (no end_of_turn_token: SpecForge's own parser fails on it).
SPECFORGE_TEMPLATES: dict[str, SpecForgeTemplate] = {
    "llama3": SpecForgeTemplate(
        assistant_header="<|start_header_id|>assistant<|end_header_id|>\n\n",
        user_header="<|start_header_id|>user<|end_header_id|>",
        system_prompt=_LLAMA3_SYSTEM,
        end_of_turn_token="<|eot_id|>",
    ),
    "llama4": SpecForgeTemplate(
        assistant_header="<|header_start|>assistant<|header_end|>\n\n",
        user_header="<|header_start|>user<|header_end|>",
        system_prompt=_HELPFUL,
        end_of_turn_token="<|eot|>",
    ),
    "qwen": SpecForgeTemplate(**_IM, system_prompt=_HELPFUL, end_of_turn_token="<|im_end|>\n"),
    "lfm": SpecForgeTemplate(**_IM, system_prompt="", end_of_turn_token="<|im_end|>\n"),
    "phi3": SpecForgeTemplate(
        assistant_header="<|assistant|>\n",
        user_header="<|user|>\n",
        system_prompt=_HELPFUL,
        end_of_turn_token="<|end|>\n",
    ),
    "phi4": SpecForgeTemplate(
        assistant_header="<|im_start|>assistant<|im_sep|>",
        user_header="<|im_start|>user<|im_sep|>",
        system_prompt=_HELPFUL,
        end_of_turn_token="<|im_end|>",
    ),
    "phi4-mini": SpecForgeTemplate(
        assistant_header="<|assistant|>", user_header="<|user|>", system_prompt=_HELPFUL, end_of_turn_token="<|end|>"
    ),
    "gpt-oss-naive": SpecForgeTemplate(
        assistant_header="<|start|>assistant<|channel|>analysis<|message|>",
        user_header="<|start|>user<|message|>",
        system_prompt=None,
        end_of_turn_token="<|end|>",
    ),
    "qwen3-thinking": SpecForgeTemplate(
        **_IM, system_prompt=_HELPFUL, end_of_turn_token="<|im_end|>\n", parser_type="thinking", enable_thinking=True
    ),
    "qwen3-instruct": SpecForgeTemplate(
        **_IM, system_prompt=_HELPFUL, end_of_turn_token="<|im_end|>\n", ignore_token=("<think>\n\n</think>\n\n",)
    ),
    "qwen3-next-thinking": SpecForgeTemplate(
        assistant_header="<|im_start|>assistant\n<think>\n",
        user_header="<|im_start|>user\n",
        system_prompt=_HELPFUL,
        end_of_turn_token="<|im_end|>\n",
        parser_type="thinking",
        enable_thinking=True,
    ),
    "kimi-k2-thinking": SpecForgeTemplate(
        assistant_header="<|im_assistant|>assistant<|im_middle|>",
        user_header="<|im_start|>user\n",
        system_prompt=_HELPFUL,
        end_of_turn_token="<|im_end|>",
        parser_type="thinking",
        enable_thinking=True,
    ),
    "kimi-k2-instruct": SpecForgeTemplate(
        assistant_header="<|im_assistant|>assistant<|im_middle|>",
        user_header="<|im_start|>user\n",
        system_prompt=_HELPFUL,
        end_of_turn_token="<|im_end|>",
    ),
    "kimi-k3-thinking": SpecForgeTemplate(
        assistant_header='<|open|>message role="assistant"<|sep|><|open|>think<|sep|>',
        user_header='<|open|>message role="user"<|sep|>',
        system_prompt=None,
        end_of_turn_token="<|end_of_msg|>",
        parser_type="thinking",
        ignore_token=("<|end_of_msg|>",),
    ),
    "deepseek-v3": SpecForgeTemplate(
        assistant_header="<｜Assistant｜>",
        user_header="<｜User｜>",
        system_prompt=_HELPFUL,
        end_of_turn_token="<｜end▁of▁sentence｜>",
    ),
    "deepseek-v2": SpecForgeTemplate(
        assistant_header="Assistant: ",
        user_header="User: ",
        system_prompt=None,
        end_of_turn_token="<｜end▁of▁sentence｜>",
    ),
    "ling-flash-2.0": SpecForgeTemplate(
        assistant_header="<role>ASSISTANT</role>",
        user_header="<role>HUMAN</role>",
        system_prompt=_HELPFUL,
        end_of_turn_token="<|role_end|>",
    ),
    "deepseek-v32": SpecForgeTemplate(
        assistant_header="<｜Assistant｜>",
        user_header="<｜User｜>",
        system_prompt="",
        end_of_turn_token="<｜end▁of▁sentence｜>",
        parser_type="thinking",
        enable_thinking=True,
    ),
    "glm-5.2": SpecForgeTemplate(
        assistant_header="<|assistant|><think>",
        user_header="<|user|>",
        system_prompt=None,
        end_of_turn_token="<|user|>",
        parser_type="glm",
        assistant_pattern_type="glm",
        ignore_token=("<|user|>",),
    ),
    "gemma": SpecForgeTemplate(
        assistant_header="<start_of_turn>model\n",
        user_header="<start_of_turn>user\n",
        system_prompt=_HELPFUL,
        end_of_turn_token="<end_of_turn>\n",
    ),
    "longcat": SpecForgeTemplate(
        assistant_header=" ASSISTANT:",
        user_header=" USER:",
        system_prompt=_HELPFUL,
        end_of_turn_token="</longcat_s>",
        assistant_pattern_type="longcat",
    ),
    "longcat_xml": SpecForgeTemplate(
        assistant_header="<longcat_assistant>",
        user_header="<longcat_user>",
        system_prompt=_HELPFUL,
        end_of_turn_token="</longcat_s>",
    ),
    "qwen3.5": SpecForgeTemplate(
        assistant_header="<|im_start|>assistant\n<think>\n",
        user_header="<|im_start|>user\n",
        system_prompt="",
        end_of_turn_token="<|im_end|>\n",
        parser_type="thinking",
        enable_thinking=True,
    ),
    "inkling-thinking": SpecForgeTemplate(
        assistant_header="<|message_model|>",
        user_header="<|message_user|>",
        system_prompt=None,
        end_of_turn_token="<|message_user|>",
        parser_type="thinking",
        assistant_pattern_type="inkling",
        enable_thinking=True,
        ignore_token=("<|message_user|>", "<|message_tool|>", "<|message_system|>"),
    ),
}
_NOT_SUPPORTED = {
    "gpt-oss": "its openai-harmony parser writes its own prompt rather than the model's chat template",
    "deepseek-r1-distill": "it has no end_of_turn_token, on which SpecForge 0.2.0's own parser fails",
}


@dataclass(frozen=True)
class ChatConvention:
    """--chat-as: "hsx", "specforge:TEMPLATE" or "speculators"."""

    trainer: str  # hsx | specforge | speculators
    template: str = ""  # the SpecForge template name
    # speculators picks the turn whose row is the sample by the trainer's max length (--max-seq-len):
    # set by the producer, not part of the name.
    max_length: int | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.trainer}:{self.template}" if self.template else self.trainer


HSX = ChatConvention("hsx")


def parse_chat_as(text: str) -> ChatConvention:
    text = str(text).strip()
    if text in ("hsx", "speculators"):
        return ChatConvention(text)
    trainer, _, template = text.partition(":")
    if trainer == "specforge" and template in SPECFORGE_TEMPLATES:
        return ChatConvention("specforge", template)
    if trainer == "specforge" and template in _NOT_SUPPORTED:
        raise HsxError(f"--chat-as {text}: not supported, {_NOT_SUPPORTED[template]}")
    if trainer == "specforge":
        raise HsxError(f"--chat-as {text}: SpecForge 0.2.0 templates are {', '.join(SPECFORGE_TEMPLATES)}")
    raise HsxError(f"--chat-as {text!r}: use hsx, speculators or specforge:TEMPLATE (e.g. specforge:qwen)")


class ConventionSample(NamedTuple):
    input_ids: list[int]
    loss_mask: list[int]
    through: int | None = None  # the last message in it, where a conversation makes one per assistant turn


def tokenize(tokenizer, convention: ChatConvention, messages: list[dict[str, Any]]) -> list[ConventionSample]:
    """The samples one conversation makes by a trainer's convention, untruncated: one for
    SpecForge, one per assistant turn for speculators."""
    if convention.trainer == "specforge":
        return [ConventionSample(*specforge(tokenizer, SPECFORGE_TEMPLATES[convention.template], messages))]
    if convention.trainer == "speculators":
        return speculators(tokenizer, messages, convention.max_length)
    raise ValueError(f"not a trainer's convention: {convention}")


# SpecForge 0.2.0: specforge/data/parse.py (GeneralParser, ThinkingParser, GLMParser).

_SPECFORGE_KEYS = frozenset({"role", "content", "tool_calls"})
_SPECFORGE_THINKING_KEYS = _SPECFORGE_KEYS | {"reasoning_content", "name", "tool_call_id"}


def _specforge_normalize(message: dict) -> dict:
    role = message.get("role", message.get("from", ""))
    content = message.get("content") or message.get("value") or ""
    role = {"human": "user", "gpt": "assistant"}.get(role, role)
    normalized = {**message, "role": role, "content": content}
    normalized.pop("from", None)
    normalized.pop("value", None)
    return normalized


def _specforge_sanitize(message: dict, keys: frozenset[str]) -> dict:
    cleaned = {k: v for k, v in message.items() if k in keys}
    calls = cleaned.get("tool_calls")
    if calls is None:
        return cleaned
    if isinstance(calls, str):
        try:
            calls = json.loads(calls)
        except json.JSONDecodeError:
            cleaned.pop("tool_calls")
            return cleaned
    if isinstance(calls, list):
        out = []
        for call in calls:
            if not isinstance(call, dict):
                continue
            clean = {"id": call.get("id", ""), "type": call.get("type", "function")}
            function = call.get("function", {})
            if isinstance(function, dict):
                arguments = function.get("arguments", {})
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except json.JSONDecodeError:
                        arguments = {}
                clean["function"] = {"name": function.get("name", ""), "arguments": arguments}
            out.append(clean)
        cleaned["tool_calls"] = out
    return cleaned


def specforge_messages(template: SpecForgeTemplate, messages: list[dict]) -> list[dict]:
    """The messages SpecForge renders: the row's system message or the template's default, then from
    the first user turn on, cut at the first out-of-order role."""
    conversation = [_specforge_normalize(m) for m in messages]
    keys = _SPECFORGE_KEYS if template.parser_type == "general" else _SPECFORGE_THINKING_KEYS
    out: list[dict] = []
    if conversation and conversation[0]["role"] == "system":
        out.append({"role": "system", "content": conversation[0]["content"]})
        conversation = conversation[1:]
    elif template.system_prompt:
        out.append({"role": "system", "content": template.system_prompt})
    while conversation and conversation[0]["role"] != "user":
        conversation = conversation[1:]
    for j, message in enumerate(conversation):
        role = message["role"]
        if j > 0:
            before = conversation[j - 1]["role"]
            if role == "tool" and before not in ("assistant", "tool"):
                break
            if role == "assistant" and before not in ("user", "tool"):
                break
        out.append(_specforge_sanitize(message, keys))
    return out


def _assistant_pattern(template: SpecForgeTemplate) -> "re.Pattern[str]":
    header = re.escape(template.assistant_header)
    if template.assistant_pattern_type == "longcat":
        end = re.escape("[Round ") + r"\d+" + re.escape("] USER:")
    elif template.assistant_pattern_type == "inkling":
        end = "|".join(re.escape(t) for t in ("<|message_user|>", "<|message_tool|>", "<|message_system|>"))
    else:
        end = re.escape(template.end_of_turn_token)
    if template.assistant_pattern_type == "glm":
        header += r"(?:</think>)?"
    return re.compile(header + r"([\s\S]*?(?:" + end + "|$))", re.DOTALL)


def specforge(tokenizer, template: SpecForgeTemplate, messages: list[dict]) -> tuple[list[int], list[int]]:
    """SpecForge's GeneralParser.parse: render the messages with the model's template; the loss mask
    covers each match of `assistant_header (.*?) (end_of_turn_token | end)`, from its content through
    the end-of-turn token, each end found as the length of the tokenized text before it; then the
    ignore tokens are zeroed the same way."""
    kwargs: dict[str, Any] = {}
    if template.parser_type == "thinking":
        kwargs["add_special_tokens"] = False
        if template.enable_thinking:
            kwargs["enable_thinking"] = True
    elif template.parser_type == "glm":
        kwargs["enable_thinking"] = False
    text = tokenizer.apply_chat_template(
        specforge_messages(template, messages), tokenize=False, add_generation_prompt=False, tools=None, **kwargs
    )
    input_ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    spans = [(m.start(1), m.end(1), 1) for m in _assistant_pattern(template).finditer(text)]
    for token in template.ignore_token:
        at = text.find(token)
        while at != -1:
            spans.append((at, at + len(token), 0))
            at = text.find(token, at + len(token))
    cuts = sorted({c for start, end, _ in spans for c in (start, end)})
    lengths = dict(zip(cuts, (len(ids) for ids in _encode(tokenizer, [text[:c] for c in cuts]))))
    loss_mask = [0] * len(input_ids)
    for start, end, value in spans:
        first, last = min(lengths[start], len(input_ids)), min(lengths[end], len(input_ids))
        loss_mask[first:last] = [value] * max(0, last - first)
    return input_ids, loss_mask


def cut_replies(convention: ChatConvention, messages: list[dict[str, Any]]) -> bool:
    """Whether the trainer's own parser masks some assistant reply of this conversation otherwise
    than the reply is: SpecForge finds each reply as `assistant_header (.*?) end`, so a reply that
    holds its end-of-turn text is cut there and one that holds the header text starts another
    turn inside it. The mask stays the trainer's (the hidden states must line up with what it
    computes); the producer counts such rows and says so once. hsx's own mask and speculators'
    (from the rendering's boundary to its end) cover every reply whole."""
    if convention.trainer != "specforge":
        return False
    template = SPECFORGE_TEMPLATES[convention.template]
    for message in specforge_messages(template, messages):
        if message["role"] != "assistant":
            continue
        content = message.get("content") or ""
        if template.assistant_header in content or _holds_end(template, content):
            return True
    return False


def _holds_end(template: SpecForgeTemplate, content: str) -> bool:
    """Whether the trainer's end-of-turn pattern matches inside a reply's text."""
    if template.assistant_pattern_type == "longcat":
        return re.search(re.escape("[Round ") + r"\d+" + re.escape("] USER:"), content) is not None
    if template.assistant_pattern_type == "inkling":
        return any(t in content for t in ("<|message_user|>", "<|message_tool|>", "<|message_system|>"))
    return template.end_of_turn_token in content


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


# speculators 0.9.0: speculators/data_generation/preprocessing.py (_normalize_conversation,
# _render_boundary_rows). Its renders come from a vLLM /render endpoint, which renders with the
# model's chat template and tokenizes without adding special tokens, as here.


def speculators_messages(messages: list[dict]) -> list[dict]:
    out = []
    for turn in messages:
        role = turn.get("from", turn.get("role", ""))
        content = turn.get("value") or turn.get("content") or ""
        role = {"human": "user", "user": "user", "gpt": "assistant", "system": "system", "tool": "tool"}.get(
            role, "assistant"
        )  # speculators takes an unknown role (a model's name in on-policy data) for the assistant
        normalized = {"role": role, "content": content}
        for key in ("tool_calls", "tool_call_id"):
            if turn.get(key):
                normalized[key] = turn[key]
        thinking = turn.get("thinking") or turn.get("reasoning_content")
        if thinking:
            normalized["thinking"] = normalized["reasoning_content"] = thinking
        out.append(normalized)
    return out


def _render_ids(tokenizer, messages: list[dict], *, generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def speculators(tokenizer, messages: list[dict], max_length: int | None = None) -> list[ConventionSample]:
    """The rows speculators makes of a conversation, one per assistant turn after another message:
    the rendering of the conversation through that turn, masked from where the rendering of what
    precedes it, with the generation prompt, ends (their common prefix where they differ, as long
    as the history renders alike). With `max_length` (--max-seq-len), as speculators: a turn whose
    prompt alone fills it, or with nothing to train on within it, makes no row."""
    conversation = speculators_messages(messages)
    rows = []
    for j, message in enumerate(conversation):
        if message["role"] != "assistant" or j == 0:
            continue
        prompt = _render_ids(tokenizer, conversation[:j], generation_prompt=True)
        if max_length is not None and len(prompt) >= max_length:
            continue
        full = _render_ids(tokenizer, conversation[: j + 1], generation_prompt=False)
        if full[: len(prompt)] == prompt:
            boundary = len(prompt)
        else:
            boundary = next((k for k, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
            history = _render_ids(tokenizer, conversation[:j], generation_prompt=False)
            if full[: len(history)] != history or boundary < len(history):
                raise HsxError(
                    f"the prompt and full renderings differ inside the history at assistant turn {j}, "
                    "where speculators cannot place its loss mask"
                )
        if boundary < min(len(full), max_length or len(full)):
            rows.append(ConventionSample(full, [0] * boundary + [1] * (len(full) - boundary), through=j))
    if not rows:
        raise HsxError(
            "speculators makes no row of this conversation: no assistant turn after another message "
            "with tokens to train on within --max-seq-len"
        )
    return rows
