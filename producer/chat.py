"""Chat rows to tokens: the model's chat template, applied once by the producer.

A `ChatRow`'s `messages` are rendered with the model's own tokenizer and chat template
(`AutoTokenizer.from_pretrained(model, local_files_only=True)`) and tokenized. Its `loss_mask` is
1 exactly on the assistant's tokens:

- when the template marks them (`{% generation %}` ... `{% endgeneration %}`), from transformers'
  `return_assistant_tokens_mask`;
- otherwise turn by turn: for each assistant message i, the conversation up to message i is
  rendered with the generation prompt (`<|im_start|>assistant\\n`) and the conversation up to and
  including message i without it; the tokens between the two are the ones message i added. Both
  renderings must be token prefixes of the whole conversation's tokens, or the row is refused
  (a template that rewrites earlier turns, e.g. dropping old reasoning, has no such split). Text
  the template puts after the end-of-turn token (ChatML's newline after `<|im_end|>`) is not
  something the model generates, so when all that follows the span's last special token is
  whitespace it is left out: the mask covers the reply and its end-of-turn token, as the
  generation-marker templates of the same format do.

This module knows nothing about files, --max-seq-len or NATS.
"""

import re
from dataclasses import dataclass
from pathlib import Path

from hsx.errors import HsxError
from producer.dataset import ChatRow, DatasetRow

# transformers' own test for generation markers (apply_chat_template, return_assistant_tokens_mask).
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass(frozen=True, kw_only=True)
class ChatTemplateInfo:
    """What the report says about how chat rows were tokenized."""

    model: str
    mask_method: str  # "generation_markers" | "turn_by_turn"
    template_sha256: str


class ChatTokenizer:
    """Renders and tokenizes chat rows with one tokenizer; see the module docstring."""

    def __init__(self, tokenizer, *, model: str) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.template = tokenizer.get_chat_template()
        self.has_generation_markers = bool(_GENERATION_MARKER.search(self.template))
        special = set(tokenizer.all_special_ids)
        special.update(i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False))
        self._special_ids = frozenset(special)

    @classmethod
    def load(cls, model: str, *, first_chat_row: str, trust_remote_code: bool = False) -> "ChatTokenizer":
        """The model's tokenizer; a missing tokenizer or chat template is an error naming the row
        that needed it."""
        from transformers import AutoTokenizer

        need = f"{first_chat_row}: chat rows are tokenized with model {model}'s chat template, but"
        folder = Path(model)
        if folder.is_dir() and not any((folder / name).exists() for name in _TOKENIZER_FILES):
            raise HsxError(f"{need} the model folder has no tokenizer ({', '.join(_TOKENIZER_FILES[:2])}); "
                           "add the tokenizer files or give pre-tokenized input_ids rows")
        try:
            tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True, trust_remote_code=trust_remote_code)
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for a bad tokenizer
            raise HsxError(f"{need} its tokenizer does not load ({_first_line(exc)})") from None
        try:
            tokenizer.get_chat_template()
        except Exception:  # ValueError: no chat template
            raise HsxError(f"{need} its tokenizer has no chat template; add one (chat_template.jinja) "
                           "or give pre-tokenized input_ids rows") from None
        if not getattr(tokenizer, "is_fast", False):
            raise HsxError(f"{need} its tokenizer is not a fast (tokenizers) tokenizer, which assistant masks need")
        return cls(tokenizer, model=model)

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
            raise HsxError(f"{row.where}: the chat template of model {self.model} failed on this conversation "
                           f"({_first_line(exc)})") from None
        if not input_ids:
            raise HsxError(f"{row.where}: the chat template renders this conversation as no tokens")
        return DatasetRow(where=row.where, source_id=row.source_id, input_ids=input_ids, loss_mask=loss_mask)

    def _with_markers(self, row: ChatRow) -> tuple[list[int], list[int]]:
        out = self.tokenizer.apply_chat_template(
            row.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
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
        if self.tokenizer.decode(ids[last_special + 1 : end]).strip():
            return end
        return last_special + 1
