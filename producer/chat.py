"""Chat rows to tokens: the model's chat template, applied once by the producer (`ChatTokenizer`).
`tokenize` renders a `ChatRow`'s messages with the model's own tokenizer and template; its
`loss_mask` is 1 exactly on the assistant's replies. Where the template has `{% generation %}`
markers the mask is transformers' own assistant mask; otherwise it is found from the rendering
of the whole conversation (the rule below). `tokenize_many` gives the same result for many rows,
row for row, with two batched `apply_chat_template` calls (the rows, their marked twins) and one
tokenizer call for the chunk.
This module knows nothing about files, --max-seq-len, processes or NATS.

The mask from the rendering: each assistant reply's characters, through its end-of-turn token,
are found from where the template put that message's text (`producer/reply_spans.py`: a second
rendering with each text between markers), so text inside a reply, `<|im_end|>` or a whole quoted
turn, can never end it or start another. The mask is 1 on every token that overlaps a reply's span.

Where markers change what a template renders (`_mask_by_search`, the older rule), for each
assistant message in order:
- its turn starts after the template's assistant header (what `add_generation_prompt` adds,
  found once per tokenizer), searched from the end of the message before it (a message may hold
  the header's text: that is the message's, not a turn); the reply is the message's content
  found first after the header (else its content stripped of surrounding whitespace; else the
  whole rendered turn), and the turn ends with the first special token after the reply;
- a template without a header (no generation prompt), or whose history turns do not repeat it
  (DeepSeek-R1's prompt adds `<think>`): the content (else trimmed) is searched forward from the
  previous message's (found the same way), and the end-of-turn token is in the mask only when
  nothing but whitespace separates it from the reply.
Character spans become tokens through the fast tokenizer's offsets.
"""

import bisect
import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hsx.errors import HsxError
from hsx.producer import conventions
from hsx.producer.conventions import HSX, ChatConvention, ConventionSample
from hsx.producer.reply_spans import MARKINGS, Marked, has_edge_whitespace, marked_messages, read_markers, reply_spans
from hsx.producer.rows import BadRow, ChatRow, DatasetRow

# transformers' own test for generation markers (apply_chat_template, return_assistant_tokens_mask).
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
_PROBE = [{"role": "user", "content": "hsx probe"}]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _assistant_header(tokenizer) -> str | None:
    """What the template adds for `add_generation_prompt` after a user message (ChatML:
    `<|im_start|>assistant\\n`); None when it adds nothing or the probe does not render."""
    try:
        without = tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=False)
        with_prompt = tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that needs a system message, tools...: no header, search forward
        return None
    if not with_prompt.startswith(without) or len(with_prompt) == len(without):
        return None
    return with_prompt[len(without) :]


def _start(offset: tuple[int, int]) -> int:
    return offset[0]


def _end(offset: tuple[int, int]) -> int:
    return offset[1]


def _ending_after(offsets: list[tuple[int, int]], at: int) -> int:
    """The index of the first token that ends after character `at`."""
    return bisect.bisect_right(offsets, at, key=_end)


def _end_of_turn(offsets: list[tuple[int, int]], specials: list[int], at: int) -> int | None:
    """The first special token (`specials`: their indices) that ends after character `at`."""
    k = bisect.bisect_left(specials, _ending_after(offsets, at))
    return specials[k] if k < len(specials) else None


def _set_span(mask: list[int], offsets: list[tuple[int, int]], begin: int, end: int) -> None:
    """1 on every token that overlaps characters [begin, end): those ending after begin and
    starting before end."""
    first, last = _ending_after(offsets, begin), bisect.bisect_left(offsets, end, key=_start)
    mask[first:last] = [1] * (last - first)


def _tool_support(template: str) -> tuple[bool, bool]:
    """(renders assistant tool_calls, knows the tool role): what the template's source mentions."""
    return "tool_calls" in template, bool(re.search(r"[\"']tool[\"']", template))


@dataclass(frozen=True, kw_only=True)
class ChatTemplateInfo:
    """What the report says about how chat rows were tokenized."""

    model: str
    mask_method: str  # "generation_markers" | "one_rendering"
    template_sha256: str
    # --chat-as a trainer whose own parser cuts replies that hold its template's text
    # (producer/conventions.py `cut_replies`): how many rows have such a reply.
    rows_replies_cut: int = 0


class ChatTokenizer:
    """Renders and tokenizes chat rows with one tokenizer; see the module docstring."""

    def __init__(
        self, tokenizer, *, model: str, trust_remote_code: bool = False, convention: ChatConvention = HSX
    ) -> None:
        self.tokenizer = tokenizer
        self.convention = convention  # --chat-as: a trainer's own masking instead of hsx's (producer/conventions.py)
        self.model = model
        self.trust_remote_code = trust_remote_code  # how a worker process loads it again (producer/chat_pool.py)
        self.template = tokenizer.get_chat_template()
        self.has_generation_markers = bool(_GENERATION_MARKER.search(self.template))
        special = set(tokenizer.all_special_ids)
        special.update(i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False))
        self._special_ids = frozenset(special)
        self._header = _assistant_header(tokenizer)
        self._tool_calls, self._tool_role = _tool_support(self.template)

    @classmethod
    def load(
        cls, model: str, *, first_chat_row: str, trust_remote_code: bool = False, convention: ChatConvention = HSX
    ) -> "ChatTokenizer":
        """The model's tokenizer; a missing tokenizer or chat template is an error naming the row
        that needed it."""
        from transformers import AutoTokenizer

        need = f"{first_chat_row}: chat rows are tokenized with model {model}'s chat template, but"
        folder = Path(model)
        if folder.is_dir() and not any((folder / name).exists() for name in _TOKENIZER_FILES):
            raise HsxError(
                f"{need} the model folder has no tokenizer ({', '.join(_TOKENIZER_FILES[:2])}); "
                "add the tokenizer files or give pre-tokenized input_ids rows"
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True, trust_remote_code=trust_remote_code)
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for a bad tokenizer
            raise HsxError(f"{need} its tokenizer does not load ({_first_line(exc)})") from None
        try:
            tokenizer.get_chat_template()
        except Exception:  # ValueError: no chat template
            raise HsxError(
                f"{need} its tokenizer has no chat template; add one (chat_template.jinja) "
                "or give pre-tokenized input_ids rows"
            ) from None
        if not getattr(tokenizer, "is_fast", False):
            raise HsxError(f"{need} its tokenizer is not a fast (tokenizers) tokenizer, which assistant masks need")
        return cls(tokenizer, model=model, trust_remote_code=trust_remote_code, convention=convention)

    @property
    def info(self) -> ChatTemplateInfo:
        import hashlib

        return ChatTemplateInfo(
            model=self.model,
            mask_method="generation_markers" if self.has_generation_markers else "one_rendering",
            template_sha256=hashlib.sha256(self.template.encode()).hexdigest(),
        )

    def tokenize(self, row: ChatRow) -> DatasetRow:
        """The row's tokens and mask; a `BadRow` naming it when the template cannot render it."""
        result = self.tokenize_many([row], keep_bad=True)[0]
        if isinstance(result, BadRow):
            raise result
        return result

    def tokenize_many(self, rows: Sequence[ChatRow], *, keep_bad: bool = False) -> list:
        """`[self.tokenize(row) for row in rows]` with one rendering call and one tokenizer call
        for them all. A row the template cannot render is a `BadRow`: raised (the first one), or
        with `keep_bad` returned in that row's place."""
        rows = list(rows)
        out: list = [self._unsupported(row) for row in rows]
        good = [i for i, bad in enumerate(out) if bad is None]
        try:
            tokens = self._tokens([rows[i] for i in good])
        except Exception:  # a row the batched call cannot render (a template error): each alone says which
            tokens = [self._tokens_or_bad(rows[i]) for i in good]
        for i, result in zip(good, tokens, strict=True):
            out[i] = result if isinstance(result, BadRow) else self._row(rows[i], result)
        if not keep_bad:
            bad = next((result for result in out if isinstance(result, BadRow)), None)
            if bad is not None:
                raise bad
        return out

    def _unsupported(self, row: ChatRow) -> BadRow | None:
        tool_calls = any(m.get("tool_calls") for m in row.messages)
        tool_role = any(m["role"] == "tool" for m in row.messages)
        if (tool_calls and not self._tool_calls) or (tool_role and not self._tool_role):
            what = "tool calls" if tool_calls and not self._tool_calls else "tool messages"
            return BadRow(
                row.where,
                f"has {what}, which model {self.model}'s chat template does not render",
                source_id=row.source_id,
            )
        return None

    def _row(self, row: ChatRow, samples: list[ConventionSample]) -> DatasetRow | BadRow:
        """The row's sample; where it makes one per assistant turn, the first, the others in its
        `more`, each named `<id>#<index of its last message>`."""
        if not samples[0].input_ids:
            return BadRow(
                row.where, "the chat template renders this conversation as no tokens", source_id=row.source_id
            )
        made = [
            DatasetRow(
                where=row.where,
                source_id=row.source_id if sample.through is None else f"{row.source_id}#{sample.through}",
                input_ids=sample.input_ids,
                loss_mask=sample.loss_mask,
            )
            for sample in samples
        ]
        return dataclasses.replace(made[0], more=tuple(made[1:])) if len(made) > 1 else made[0]

    def _tokens_or_bad(self, row: ChatRow):
        try:
            return self._tokens([row])[0]
        except BadRow as exc:
            return exc
        except Exception as exc:  # jinja2 TemplateError (e.g. "roles must alternate"), TypeError...
            return BadRow(
                row.where,
                f"the chat template of model {self.model} failed on this conversation ({_first_line(exc)})",
                source_id=row.source_id,
            )

    def _by_convention(self, row: ChatRow):
        try:
            return conventions.tokenize(self.tokenizer, self.convention, row.messages)
        except HsxError as exc:
            return BadRow(row.where, f"--chat-as {self.convention}: {exc}", source_id=row.source_id)

    def _tokens(self, rows: list[ChatRow]) -> list:
        """The samples (`ConventionSample`s) or a BadRow of each row; raises when the batched call fails."""
        if not rows:
            return []
        if self.convention != HSX:
            return [self._by_convention(row) for row in rows]
        if self.has_generation_markers:
            return [[ConventionSample(*pair)] for pair in self._many_with_markers([row.messages for row in rows])]
        texts = self._render_many([row.messages for row in rows], generation_prompt=False)
        markers = self._markers_many(rows, texts)
        out = []
        for row, text, marked, (ids, offsets) in zip(rows, texts, markers, self._encode(texts), strict=True):
            try:
                if marked is None:
                    mask = self._mask_by_search(row, text, ids, offsets)
                else:
                    mask = self._mask_from_markers(row, text, marked, ids, offsets)
                out.append([ConventionSample(ids, mask)])
            except BadRow as exc:
                out.append(exc)
        return out

    def _markers_many(self, rows: list[ChatRow], texts: list[str]) -> list[Marked | None]:
        """Each row's text places (producer/reply_spans.py): the markings tried in order, each one
        batched over the rows no earlier marking placed; None for a row none places."""
        out: list[Marked | None] = [None] * len(rows)
        for which, inside_whitespace in MARKINGS:
            todo = [i for i, marked in enumerate(out) if marked is None]
            if inside_whitespace:  # the same marking as before for a row without edge whitespace
                todo = [i for i in todo if has_edge_whitespace(rows[i].messages)]
            if not todo:
                continue
            marked = {i: marked_messages(rows[i].messages, which, inside_whitespace=inside_whitespace) for i in todo}
            todo = [i for i in todo if marked[i] is not None]
            for i, marked_text in zip(todo, self._render_marked([marked[i] for i in todo]), strict=True):
                if marked_text is not None:
                    out[i] = read_markers(marked_text, texts[i])
        return out

    def _render_marked(self, conversations: list[list[dict]]) -> list[str | None]:
        """The marked renderings, in one call; each alone where that call fails (None for one the
        template refuses)."""
        try:
            return self._render_many(conversations, generation_prompt=False)
        except Exception:  # a template that refuses some marked text: each alone
            pass
        out: list[str | None] = []
        for conversation in conversations:
            try:
                out.append(self._render_many([conversation], generation_prompt=False)[0])
            except Exception:  # this one refused: the next marking, else the older rule
                out.append(None)
        return out

    def _mask_from_markers(self, row: ChatRow, text: str, marked: Marked, ids: list[int], offsets: list) -> list[int]:
        specials = [offsets[t] for t, token in enumerate(ids) if token in self._special_ids]
        spans = reply_spans(row.messages, text, marked, header=self._header, special_starts=specials)
        mask = [0] * len(ids)
        for k, span in zip((k for k, m in enumerate(row.messages) if m["role"] == "assistant"), spans, strict=True):
            if span is None:
                raise BadRow(
                    row.where,
                    f"cannot find assistant message {k} in the chat template's rendering of the conversation",
                    source_id=row.source_id,
                )
            _set_span(mask, offsets, *span)
        return mask

    def _encode(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Each text's token ids and their character offsets, as apply_chat_template(tokenize=True)
        tokenizes its rendering: no special tokens added, no truncation or padding. The Rust
        tokenizer's own batch call where it has neither set (transformers' call makes the same
        call, then copies every list)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and backend.truncation is None and backend.padding is None:
            return [(e.ids, e.offsets) for e in backend.encode_batch(texts, add_special_tokens=False)]
        encoded = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return [
            ([int(i) for i in ids], [tuple(o) for o in offsets])
            for ids, offsets in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)
        ]

    def _mask_by_search(self, row: ChatRow, text: str, ids: list[int], offsets: list) -> list[int]:
        """The loss mask of one row by the older rule (module docstring), for templates that
        render marked text otherwise."""
        specials = [t for t, token in enumerate(ids) if token in self._special_ids]
        mask = [0] * len(ids)
        reply_end = seen = 0  # the end of the last reply found; of the last message found
        for k, message in enumerate(row.messages):
            content = message.get("content") or ""
            if message["role"] != "assistant":
                for candidate in (content, content.strip()) if content.strip() else ():
                    at = text.find(candidate, seen)
                    if at >= 0:
                        seen = at + len(candidate)
                        break
                continue
            span = self._reply_span(text, offsets, specials, content, max(seen, reply_end))
            if span is None:
                raise BadRow(
                    row.where,
                    f"cannot find assistant message {k} in the chat template's rendering of the conversation",
                    source_id=row.source_id,
                )
            _set_span(mask, offsets, *span)
            reply_end = seen = span[1]
        return mask

    def _reply_span(self, text: str, offsets, specials: list[int], content: str, seen: int) -> tuple[int, int] | None:
        """Characters [begin, end) of one reply and its end-of-turn token in the rendering: in the
        turn after the first header from `seen` (the end of the message before it) on, else
        searched forward from there. From `seen`, not from the last reply: a message before the
        reply may hold the header's own text, which is that message's, not a turn."""
        at = -1 if self._header is None else text.find(self._header, seen)
        if at >= 0:
            turn = at + len(self._header)
            # The reply first, then its end: a reply may hold the end-of-turn token's text.
            reply_end = -1
            for candidate in (content, content.strip()) if content.strip() else (content,):
                begin = text.find(candidate, turn)
                if begin >= 0:
                    reply_end = begin + len(candidate)
                    break
            else:
                begin = turn  # the template changed the reply: the whole rendered turn
            eot = _end_of_turn(offsets, specials, max(turn, reply_end))
            if eot is not None:
                return begin, offsets[eot][1]
            return (begin, reply_end) if reply_end >= 0 else None
        for candidate in (content, content.strip()):
            begin = text.find(candidate, seen)
            if begin >= 0:
                end = begin + len(candidate)
                eot = _end_of_turn(offsets, specials, end)
                if eot is not None and not text[end : offsets[eot][0]].strip():
                    end = offsets[eot][1]
                return begin, end
        return None

    def _render_many(self, conversations: list[list[dict]], *, generation_prompt: bool) -> list[str]:
        if not conversations:
            return []
        return self.tokenizer.apply_chat_template(
            conversations, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _many_with_markers(self, conversations: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
        out = self.tokenizer.apply_chat_template(
            conversations,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        return [
            ([int(i) for i in ids], [1 if m else 0 for m in mask])
            for ids, mask in zip(out["input_ids"], out["assistant_masks"], strict=True)
        ]
