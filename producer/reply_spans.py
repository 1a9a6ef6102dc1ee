"""Where a chat template rendered each assistant reply: character spans in one rendering of a
conversation, found from the rendering's structure, never by scanning for the template's tokens.

The conversation is rendered a second time with each message's text wrapped in markers the data
cannot hold (private-use characters, checked absent from the row). Where the marked rendering,
markers removed, is the rendering itself, each marker says exactly where that message's text
went, whatever the text holds: a reply that quotes `<|im_end|>` or a whole turn of the template
is one reply. The caller tries the markings in order (`MARKINGS`) until one renders the same
text: around each whole text; inside its surrounding whitespace (templates that trim: the
template trims the same characters); then the same two with only the assistant messages marked
(templates that look at a user message's text, as Qwen3's `startswith('<tool_response>')` does).
Where none does, the caller finds the replies by the older rule (producer/chat.py).

For each assistant message the span is:
- its text as rendered: from its start marker (and back over the leading whitespace the template
  kept) to its end marker; where the template dropped the start marker with the beginning of the
  text (Qwen3 keeps only what follows an earlier turn's `</think>`), from the end of the first
  assistant header after the message before it, else the longest end of the text that was rendered;
- then through the end-of-turn token: the first special token after the text and before the next
  message's text (where the template has an assistant header; without one, only when nothing but
  whitespace separates it from the text), so that what the template renders between them (tool
  calls) is in the span, and what follows it (ChatML's newline) is not.

This module knows nothing about tokenizers' loading, files, masks' storage or trainers.
"""

import bisect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Start marker: U+E000, the message's index, U+E001; end marker: U+E002, the index, U+E003.
_OPEN, _OPEN_END, _CLOSE, _CLOSE_END = "\ue000", "\ue001", "\ue002", "\ue003"
_MARKERS = frozenset(_OPEN + _OPEN_END + _CLOSE + _CLOSE_END)
_MARKER = re.compile("([\ue000\ue002])([0-9]+)[\ue001\ue003]")


def _every(message: dict) -> bool:
    return True


def _assistant(message: dict) -> bool:
    return message["role"] == "assistant"


# (which messages are marked, markers inside the text's surrounding whitespace), in the order tried.
MARKINGS: tuple[tuple[Callable[[dict], bool], bool], ...] = (
    (_every, False),
    (_every, True),
    (_assistant, False),
    (_assistant, True),
)


@dataclass(frozen=True, kw_only=True)
class Marked:
    """Where each marked message's text went in the unmarked rendering: start and end characters
    (None where the template dropped that marker)."""

    starts: dict[int, int]
    ends: dict[int, int]


def _wrap(content: str, k: int, *, inside_whitespace: bool) -> str:
    if not inside_whitespace:
        return f"{_OPEN}{k}{_OPEN_END}{content}{_CLOSE}{k}{_CLOSE_END}"
    core = content.strip()
    if not core:
        return f"{content}{_OPEN}{k}{_OPEN_END}{_CLOSE}{k}{_CLOSE_END}"
    lead = content[: len(content) - len(content.lstrip())]
    trail = content[len(content.rstrip()) :]
    return f"{lead}{_OPEN}{k}{_OPEN_END}{core}{_CLOSE}{k}{_CLOSE_END}{trail}"


def has_edge_whitespace(messages: Sequence[dict]) -> bool:
    """Whether some message's text starts or ends with whitespace (where the two ways of marking differ)."""
    return any((content := message.get("content") or "") != content.strip() for message in messages)


def marked_messages(
    messages: Sequence[dict], which: Callable[[dict], bool], *, inside_whitespace: bool
) -> list[dict] | None:
    """The messages with the text of each one `which` selects wrapped in its markers: around the
    whole text, or `inside_whitespace` (for templates that trim); None when a message's text holds
    a marker character (then the markers could not be told from the data)."""
    out = []
    for k, message in enumerate(messages):
        content = message.get("content") or ""
        if _MARKERS.intersection(content):
            return None
        marked = _wrap(content, k, inside_whitespace=inside_whitespace)
        out.append({**message, "content": marked} if which(message) else message)
    return out


def read_markers(marked_text: str, text: str) -> Marked | None:
    """The markers' places in `text`, the unmarked rendering; None when the marked rendering is
    not `text` once its markers are removed (the markers changed what the template did)."""
    starts: dict[int, int] = {}
    ends: dict[int, int] = {}
    pieces = []
    removed = at = 0
    for match in _MARKER.finditer(marked_text):
        pieces.append(marked_text[at : match.start()])
        place = match.start() - removed
        k = int(match.group(2))
        (starts if match.group(1) == _OPEN else ends)[k] = place  # a text rendered twice: its last place
        removed += match.end() - match.start()
        at = match.end()
    pieces.append(marked_text[at:])
    if "".join(pieces) != text:
        return None
    return Marked(starts=starts, ends=ends)


def reply_spans(
    messages: Sequence[dict],
    text: str,
    marked: Marked,
    *,
    header: str | None,
    special_starts: Sequence[tuple[int, int]],
) -> list[tuple[int, int] | None]:
    """[begin, end) of each assistant message's reply through its end-of-turn token, in message
    order; None for one whose text the template did not render (its end marker is absent).
    `special_starts`: (start, end) characters of each special token in the rendering, in order."""
    spans: list[tuple[int, int] | None] = []
    previous_end = 0  # the end of the last marked text before the message at hand
    order = sorted(set(marked.starts.values()) | set(marked.ends.values()))
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            if k in marked.ends:
                previous_end = max(previous_end, marked.ends[k])
            continue
        end = marked.ends.get(k)
        if end is None:
            spans.append(None)
            continue
        content = message.get("content") or ""
        begin = _begin(text, marked.starts.get(k), end, content, previous_end, header)
        spans.append((begin, _through_end_of_turn(text, end, order, special_starts, with_header=header is not None)))
        previous_end = end
    return spans


def _begin(text: str, start: int | None, end: int, content: str, previous_end: int, header: str | None) -> int:
    if start is not None:
        return start
    if header is not None:
        at = text.find(header, previous_end, end)
        if at >= 0:
            return at + len(header)
    core = content.strip()
    n = 0
    while n < min(len(core), end - previous_end) and text[end - n - 1] == core[len(core) - n - 1]:
        n += 1
    return end - n


def _through_end_of_turn(
    text: str, end: int, order: Sequence[int], special_starts: Sequence[tuple[int, int]], *, with_header: bool
) -> int:
    """`end` moved past the end-of-turn token: the first special token starting at or after `end`
    and before the next marker (the next message's text)."""
    following = order[bisect.bisect_right(order, end) :] if order else []
    limit = following[0] if following else len(text)
    k = bisect.bisect_left(special_starts, end, key=lambda s: s[0])
    if k >= len(special_starts):
        return end
    start, stop = special_starts[k]
    if start >= limit:
        return end
    if not with_header and text[end:start].strip():
        return end
    return stop
