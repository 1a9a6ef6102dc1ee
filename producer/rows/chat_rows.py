"""Chat rows: a conversation (`messages`, or ShareGPT's `conversations`) checked message by
message into a `ChatRow`, still to be rendered with the model's chat template and tokenized
(producer/chat.py). This module knows no file type, tokenizer or job setting.

The forms a message may take: docs/reference/data.md, "Chat rows".
"""

from dataclasses import dataclass
from typing import Any

from hsx.errors import HsxError

CHAT_FIELDS = ("messages", "conversations")  # looked for in this order unless --chat-field names one

# ShareGPT's `from` values (and role names given there) as chat template roles.
_FROM_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_FROM_ROLES |= {"tool": "tool"}
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class ChatRow:
    """A conversation still to be rendered with the model's chat template and tokenized."""

    where: str
    source_id: str
    messages: list[dict[str, Any]]


def chat_columns(chat_field: str | None) -> tuple[str, ...]:
    """The columns a conversation may be in."""
    return CHAT_FIELDS if chat_field is None else (chat_field,)


def chat_row(messages: list[Any], *, where: str, source_id: str, field: str = "messages") -> ChatRow:
    """The row of a conversation found in column `field`, its messages checked."""
    return ChatRow(where=where, source_id=source_id, messages=check_messages(messages, where, field))


def _text_of(content: Any, what: str, where: str) -> str:
    """A message's content as text: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise HsxError(f"{where}: {what} must be text or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, dict):
            part = {key: value for key, value in part.items() if value is not None}
            kind = part.get("type", "text")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise HsxError(f"{where}: {what}[{j}] is a {kind!r} part, not text")
            part = part["text"]
        if not isinstance(part, str):
            raise HsxError(f"{where}: {what}[{j}] must be a text part, got {type(part).__name__}")
        texts.append(part)
    return "".join(texts)


def _check_message(message: Any, what: str, where: str) -> dict[str, Any]:
    """One message as the chat template takes it: role and text content (role/content, or
    ShareGPT's from/value), with its other keys (tool_calls, name...) as they are."""
    if not isinstance(message, dict):
        raise HsxError(f"{where}: {what} must be an object with role and content, got {type(message).__name__}")
    # Arrow gives every message every key of the column's struct; a null one was never there.
    message = {key: value for key, value in message.items() if value is not None}
    if "role" not in message and "from" in message:
        name = message.pop("from")
        role = _FROM_ROLES.get(name) if isinstance(name, str) else None
        if role is None:
            raise HsxError(f"{where}: {what}.from is {name!r}; expected one of {', '.join(_FROM_ROLES)}")
        message["role"] = role
        if "value" in message:
            message["content"] = message.pop("value")
    role = message.get("role")
    if role is None:
        raise HsxError(f"{where}: {what} has no role (or from)")
    if role not in _ROLES:
        raise HsxError(f"{where}: {what}.role is {role!r}; expected one of {', '.join(_ROLES)}")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise HsxError(f"{where}: {what}.tool_calls must be a list, got {type(tool_calls).__name__}")
    content = message.get("content")
    if content is None:
        if not (role == "assistant" and tool_calls):
            raise HsxError(f"{where}: {what} (role {role}) has no content")
        content = ""
    message["content"] = _text_of(content, f"{what}.content", where)
    return message


def check_messages(messages: list[Any], where: str, field: str = "messages") -> list[dict[str, Any]]:
    if not messages:
        raise HsxError(f"{where}: {field} is empty")
    return [_check_message(message, f"{field}[{k}]", where) for k, message in enumerate(messages)]
