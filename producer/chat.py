"""Chat rows to tokens: the model's chat template, applied once by the producer (`ChatTokenizer`).
`tokenize` renders a `ChatRow`'s messages with the model's own tokenizer and template; its
`loss_mask` is 1 exactly on the assistant's tokens, from the template's `{% generation %}` markers
where it has them, otherwise by rendering the conversation turn by turn. `tokenize_many` gives the
same result for many rows, row for row, with one batched `apply_chat_template` call per kind of
rendering and one tokenizer call for the chunk. This module knows nothing about files,
--max-seq-len, processes or NATS.

How the mask is found turn by turn, and the batched path's shortcut: docs/ARCHITECTURE.md,
"Module notes".
"""

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hsx.errors import HsxError
from hsx.producer.dataset import ChatRow, DatasetRow

# transformers' own test for generation markers (apply_chat_template, return_assistant_tokens_mask).
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _added_tokens(tokenizer) -> tuple[dict[str, int], "re.Pattern[str] | None"]:
    """The tokenizer's added tokens (text -> id) and a pattern that finds them in raw text as the
    tokenizer does (leftmost, longest first); no pattern where `tokenize_many` must tokenize prefix
    renderings whole: an added token that strips whitespace, matches single words only, or is
    matched on normalized text by a tokenizer with a normalizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    has_normalizer = backend is None or backend.normalizer is not None
    by_text: dict[str, int] = {}
    for token_id, token in tokenizer.added_tokens_decoder.items():
        content = getattr(token, "content", "")
        if (
            not content
            or content in by_text
            or token.lstrip
            or token.rstrip
            or token.single_word
            or (token.normalized and has_normalizer)
        ):
            return {}, None
        by_text[content] = int(token_id)
    if not by_text:
        return {}, None
    return by_text, re.compile("|".join(re.escape(text) for text in sorted(by_text, key=len, reverse=True)))


@dataclass(frozen=True, kw_only=True)
class ChatTemplateInfo:
    """What the report says about how chat rows were tokenized."""

    model: str
    mask_method: str  # "generation_markers" | "turn_by_turn"
    template_sha256: str


class ChatTokenizer:
    """Renders and tokenizes chat rows with one tokenizer; see the module docstring."""

    def __init__(self, tokenizer, *, model: str, trust_remote_code: bool = False) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.trust_remote_code = trust_remote_code  # how a worker process loads it again (producer/chat_pool.py)
        self.template = tokenizer.get_chat_template()
        self.has_generation_markers = bool(_GENERATION_MARKER.search(self.template))
        special = set(tokenizer.all_special_ids)
        special.update(i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False))
        self._special_ids = frozenset(special)
        self._decoded: dict[tuple[int, ...], str] = {}
        self._added_ids, self._added_pattern = _added_tokens(tokenizer)
        self._added_ids_set = frozenset(self._added_ids.values())

    @classmethod
    def load(cls, model: str, *, first_chat_row: str, trust_remote_code: bool = False) -> "ChatTokenizer":
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
        return cls(tokenizer, model=model, trust_remote_code=trust_remote_code)

    @property
    def info(self) -> ChatTemplateInfo:
        import hashlib

        return ChatTemplateInfo(
            model=self.model,
            mask_method="generation_markers" if self.has_generation_markers else "turn_by_turn",
            template_sha256=hashlib.sha256(self.template.encode()).hexdigest(),
        )

    def tokenize(self, row: ChatRow) -> DatasetRow:
        try:
            if self.has_generation_markers:
                input_ids, loss_mask = self._with_markers(row)
            else:
                input_ids, loss_mask = self._turn_by_turn(row)
        except HsxError:
            raise
        except Exception as exc:  # jinja2 TemplateError (e.g. "roles must alternate"), TypeError...
            raise HsxError(
                f"{row.where}: the chat template of model {self.model} failed on this conversation ({_first_line(exc)})"
            ) from None
        if not input_ids:
            raise HsxError(f"{row.where}: the chat template renders this conversation as no tokens")
        return DatasetRow(where=row.where, source_id=row.source_id, input_ids=input_ids, loss_mask=loss_mask)

    def tokenize_many(self, rows: Sequence[ChatRow]) -> list[DatasetRow]:
        """`[self.tokenize(row) for row in rows]`, with fewer calls; see the module docstring."""
        rows = list(rows)
        if not rows:
            return []
        try:
            many = self._many_with_markers if self.has_generation_markers else self._many_turn_by_turn
            tokens = many([row.messages for row in rows])
        except Exception:  # a row the batched calls cannot do (e.g. a template error): tokenize's own error
            tokens = None
        if tokens is None:
            return [self.tokenize(row) for row in rows]
        return [
            DatasetRow(where=row.where, source_id=row.source_id, input_ids=ids, loss_mask=mask)
            for row, (ids, mask) in zip(rows, tokens)
        ]

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # apply_chat_template(tokenize=True) tokenizes its rendering exactly so: no special tokens added.
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    def _render_many(self, conversations: list[list[dict]], *, generation_prompt: bool) -> list[str]:
        if not conversations:
            return []
        return self.tokenizer.apply_chat_template(
            conversations, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _many_with_markers(self, conversations: list[list[dict]]) -> list[tuple[list[int], list[int]]] | None:
        out = self.tokenizer.apply_chat_template(
            conversations,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        tokens = []
        for ids, mask in zip(out["input_ids"], out["assistant_masks"], strict=True):
            if not ids:
                return None
            tokens.append(([int(i) for i in ids], [1 if m else 0 for m in mask]))
        return tokens

    def _many_turn_by_turn(self, conversations: list[list[dict]]) -> list[tuple[list[int], list[int]]] | None:
        """None when a row has to be refused (tokenize says why)."""
        turns = [
            [i for i, message in enumerate(messages) if message["role"] == "assistant"] for messages in conversations
        ]
        if any(assistant and assistant[0] == 0 for assistant in turns):
            return None  # an empty conversation before it: apply_chat_template refuses that one alone
        fulls = self._render_many(conversations, generation_prompt=False)
        befores = self._render_many(
            [messages[:i] for messages, assistant in zip(conversations, turns) for i in assistant],
            generation_prompt=True,
        )
        afters = self._render_many(
            [messages[: i + 1] for messages, assistant in zip(conversations, turns) for i in assistant],
            generation_prompt=False,
        )
        full_ids = self._encode(fulls)
        # Each prefix rendering is tokenized either from its last added token on ("tail": that
        # token's index in the whole conversation's tokens, and the tail text) or whole.
        plans: list[tuple[int, int]] = []  # (index in the whole's tokens where the encoded text starts, text index)
        texts: list[str] = []
        k = 0
        for full, ids, assistant in zip(fulls, full_ids, turns):
            if not ids:
                return None
            added = self._added_in(full, ids)
            for _ in assistant:
                for prefix in (befores[k], afters[k]):
                    tail = self._tail(full, prefix, added)
                    plans.append((0, len(texts)) if tail is None else (tail[0], len(texts)))
                    texts.append(prefix if tail is None else tail[1])
                k += 1
        encoded = self._encode(texts)
        tokens = []
        plan = iter(plans)
        for ids, assistant in zip(full_ids, turns):
            ids = [int(i) for i in ids]
            loss_mask = [0] * len(ids)
            for _ in assistant:
                lengths = []
                for at, text_index in (next(plan), next(plan)):
                    piece = encoded[text_index]
                    if ids[at : at + len(piece)] != piece:
                        return None
                    lengths.append(at + len(piece))
                start, end = lengths
                end = self._drop_after_end_of_turn(ids, start, end)
                if end > start:
                    loss_mask[start:end] = [1] * (end - start)
            tokens.append((ids, loss_mask))
        return tokens

    def _added_in(self, text: str, ids: list[int]) -> tuple[list[int], list[int], list[int]] | None:
        """Where the added tokens are in a rendering (starts, ends) and in its tokens (indices); None
        when the tokens do not have exactly the added tokens found in the text, in that order."""
        if self._added_pattern is None:
            return None
        found = list(self._added_pattern.finditer(text))
        positions = [p for p, token in enumerate(ids) if token in self._added_ids_set]
        if len(found) != len(positions) or any(self._added_ids[m.group()] != ids[p] for m, p in zip(found, positions)):
            return None
        return [m.start() for m in found], [m.end() for m in found], positions

    def _tail(self, full: str, prefix: str, added) -> tuple[int, str] | None:
        """(the whole's token index of the prefix's last added token, the prefix from there), or None
        when the prefix has to be tokenized whole."""
        if added is None or not full.startswith(prefix):
            return None
        starts, ends, positions = added
        n = len(prefix)
        q = bisect.bisect_right(ends, n) - 1
        if q < 0 or (q + 1 < len(starts) and starts[q + 1] < n):  # none before it, or one cut by its end
            return None
        return positions[q], full[starts[q] : n]

    def _with_markers(self, row: ChatRow) -> tuple[list[int], list[int]]:
        out = self.tokenizer.apply_chat_template(
            row.messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        input_ids = [int(i) for i in out["input_ids"]]
        loss_mask = [1 if m else 0 for m in out["assistant_masks"]]
        return input_ids, loss_mask

    def _render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _turn_by_turn(self, row: ChatRow) -> tuple[list[int], list[int]]:
        messages = row.messages
        assistant = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        texts = [self._render(messages, generation_prompt=False)]
        for i in assistant:
            texts.append(self._render(messages[:i], generation_prompt=True))
            texts.append(self._render(messages[: i + 1], generation_prompt=False))
        # apply_chat_template(tokenize=True) tokenizes its rendering exactly so: no special tokens added.
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        input_ids = [int(i) for i in encoded[0]]
        loss_mask = [0] * len(input_ids)
        for k, i in enumerate(assistant):
            before, after = encoded[1 + 2 * k], encoded[2 + 2 * k]
            for what, prefix in (("without", before), ("with", after)):
                if list(prefix) != input_ids[: len(prefix)]:
                    raise HsxError(
                        f"{row.where}: cannot find the tokens of assistant message {i}: the chat template renders "
                        f"the conversation up to it ({what} that message) as something that is not a prefix of the "
                        "whole conversation; use a template with {% generation %} markers or pre-tokenized rows"
                    )
            start, end = len(before), len(after)
            end = self._drop_after_end_of_turn(input_ids, start, end)
            for position in range(start, end):
                loss_mask[position] = 1
        return input_ids, loss_mask

    def _drop_after_end_of_turn(self, ids: list[int], start: int, end: int) -> int:
        last_special = next((p for p in range(end - 1, start - 1, -1) if ids[p] in self._special_ids), None)
        if last_special is None or last_special == end - 1:
            return end
        tail = tuple(ids[last_special + 1 : end])
        text = self._decoded.get(tail)
        if text is None:
            text = self.tokenizer.decode(list(tail))
            if len(tail) <= 4:  # the few end-of-turn tails a template has (ChatML: one newline)
                self._decoded[tail] = text
        if text.strip():
            return end
        return last_special + 1
