"""From a dataset to the job's samples: read, tokenize chat rows, apply --on-long, check the vocabulary.

`tokenized_rows` is everything the producer does to a dataset before planning; what it returns
is what gets stored (`producer/stored.py`), planned and published. `report_document` is the
job's input report. `read_pretokenized` reads a dataset of token rows alone, for `hsx verify`.
The rows come from producer/sources/ (the file formats), each checked by producer/rows/ (the
row forms). No NATS here.

Token rows stream from the reader into a columnar `SampleTable` (hsx/storage/tokens.py: tokens spilled to
a temp file, a few numbers per sample in memory). Chat rows keep a place in the table as the
dataset is read, and go on to the tokenizer (`_ChatStream`); each result is written into its place
as it comes back, in order, so only the rows in flight are held, at any dataset size. A row that
makes several samples (`--chat-as speculators`) has them placed one after another.

A bad row (`BadRow`: found reading, rendering its conversation, or holding ids outside the
vocabulary) goes to `BadRows`, the --on-bad-row policy: `error` stops the job at the first one,
`skip` records it (where, id, a reason cut to 300 characters) and its place gets no sample;
--max-bad-rows refuses the dataset when too many are bad. All of it before anything is stored.

After --on-long (a cut can leave a mask all 0), `apply_on_empty_mask` finds the samples that have
a loss mask with no 1 in it, nothing to train on (a row without a mask trains on every token and
is not one of them): --on-empty-mask `keep` extracts them anyway, `skip` leaves them out (the kept
samples stay numbered 0..N-1), `error` names the first; kept or skipped, each is listed
(`EmptyMask`) for the report.
"""

import dataclasses
import resource
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path

import numpy as np
import structlog

from hsx.errors import HsxError
from hsx.producer import conventions
from hsx.producer.chat import ChatTemplateInfo, ChatTokenizer
from hsx.producer.chat_pool import POOL_MIN_ROWS, tokenize_chats
from hsx.producer.config import ON_EMPTY_MASK, BadRowCap
from hsx.producer.conventions import HSX, ChatConvention
from hsx.producer.lengths import LongSample, apply_on_long_table
from hsx.producer.rows import BadRow, ChatRow
from hsx.producer.sources import read_source
from hsx.storage.tokens import SampleTable, SampleTableBuilder

log = structlog.get_logger("hsx.producer")

_PROGRESS_EVERY_S = 10.0
_REASON_CHARS = 300  # of a bad row's reason, kept for the report


@dataclass(frozen=True, slots=True)
class BadRowEntry:
    """A row set aside by --on-bad-row skip, as the report lists it."""

    where: str  # "file:LINE" (JSONL) or "file: row N" (Parquet, datasets folder)
    source_id: str | None
    reason: str


class BadRows:
    """--on-bad-row and --max-bad-rows: called with each bad row, in the order they are found.
    `error` raises the row's one-line error; `skip` records it, and raises the refusal as soon as
    a count cap is passed (a percentage is checked by `check_cap` once the rows are counted)."""

    def __init__(self, *, on_bad_row: str = "error", cap: BadRowCap | None = None) -> None:
        self.on_bad_row, self.cap = on_bad_row, cap
        self.entries: list[BadRowEntry] = []

    def __len__(self) -> int:
        return len(self.entries)

    def __call__(self, bad: BadRow) -> None:
        if self.on_bad_row != "skip":
            raise BadRow(bad.where, f"{bad.reason} (--on-bad-row skip sets bad rows aside)", source_id=bad.source_id)
        reason = bad.reason if len(bad.reason) <= _REASON_CHARS else bad.reason[: _REASON_CHARS - 3] + "..."
        self.entries.append(BadRowEntry(where=bad.where, source_id=bad.source_id, reason=reason))
        if self.cap is not None and not self.cap.percent and not self.cap.allows(len(self), 0):
            raise self._refusal(None)

    def check_cap(self, rows: int) -> None:
        """Refuse the dataset when more of its `rows` (bad ones included) are bad than the cap allows."""
        if self.cap is not None and not self.cap.allows(len(self), rows):
            raise self._refusal(rows)

    def _refusal(self, rows: int | None) -> HsxError:
        first = self.entries[0]
        counted = f"more than {self.cap} rows are bad" if rows is None else f"{len(self)} of {rows} rows are bad"
        return HsxError(
            f"{counted}, more than --max-bad-rows {self.cap} allows; the first: {first.where}: {first.reason}"
        )


@dataclass(frozen=True, slots=True)
class EmptyMask:
    """A sample whose loss mask is all 0, as the report lists it."""

    where: str  # the row's "file:LINE" or "file: row N"
    source_id: str
    sample_index: int | None  # in the job; None when --on-empty-mask skip left it out
    reason: str


def empty_mask_indices(samples: SampleTable) -> np.ndarray:
    """The indices of the samples that have a loss mask and no 1 in it (one pass over the masks)."""
    if not samples.has_mask.any():
        return np.zeros(0, dtype=np.int64)
    supervised = np.zeros(len(samples), dtype=np.int64)
    for first, offsets, _tokens, masks in samples.runs():
        if masks is None:
            continue
        ones = np.zeros(len(masks) + 1, dtype=np.int64)
        np.cumsum(masks != 0, out=ones[1:])
        supervised[first : first + len(offsets) - 1] = ones[offsets[1:]] - ones[offsets[:-1]]
    return np.flatnonzero(samples.has_mask & (supervised == 0))


def apply_on_empty_mask(
    samples: SampleTable, *, on_empty_mask: str, long: Sequence[LongSample] = ()
) -> tuple[SampleTable, list[EmptyMask], list[LongSample]]:
    """(the job's samples, those whose loss mask is all 0, `long` renumbered): `keep` keeps them,
    `skip` leaves them out, `error` raises naming the first. `long` (the rows --on-long truncated or
    skipped) says which were cut; a truncated one that is left out here keeps no sample index."""
    if on_empty_mask not in ON_EMPTY_MASK:
        raise HsxError(f"--on-empty-mask {on_empty_mask!r}: use one of {', '.join(ON_EMPTY_MASK)}")
    empty = empty_mask_indices(samples)
    if not len(empty):
        return samples, [], list(long)
    cut = {entry.sample_index: entry for entry in long if entry.action == "truncated"}

    def reason(i: int) -> str:
        if i in cut:
            return (
                f"its loss mask is all 0 in its first {cut[i].kept_length} tokens "
                f"(--on-long truncate cut {cut[i].original_length})"
            )
        return "its loss mask is all 0 (no reply the chat template marks, or a token row's all-zero loss_mask)"

    if on_empty_mask == "error":
        i = int(empty[0])
        raise HsxError(
            f"{samples.where(i)}: sample {samples.source_id(i)!r} has nothing to train on: {reason(i)}; "
            f"{len(empty)} such samples in all (--on-empty-mask keep extracts them anyway, skip leaves them out)"
        )
    skip = on_empty_mask == "skip"
    entries = [
        EmptyMask(
            where=samples.where(i),
            source_id=samples.source_id(i),
            sample_index=None if skip else i,
            reason=reason(i),
        )
        for i in empty.tolist()
    ]
    if skip:
        keep = np.ones(len(samples), dtype=bool)
        keep[empty] = False
        renumbered = np.cumsum(keep) - 1
        long = [
            entry
            if entry.sample_index is None
            else dataclasses.replace(
                entry, sample_index=int(renumbered[entry.sample_index]) if keep[entry.sample_index] else None
            )
            for entry in long
        ]
        samples = samples.select(np.flatnonzero(keep))
    return samples, entries, list(long)


@dataclass(frozen=True, kw_only=True)
class Inputs:
    samples: SampleTable  # the job's samples; sample i at index i
    long: list[LongSample]  # rows truncated or skipped by --on-long
    rows_read: int  # every row of the dataset, bad ones included
    chat_rows: int
    chat: ChatTemplateInfo | None  # how chat rows were tokenized; None without chat rows
    bad_rows: tuple[BadRowEntry, ...] = ()  # rows set aside by --on-bad-row skip, in the order found
    empty_masks: tuple[EmptyMask, ...] = ()  # samples with an all-zero loss mask, kept or skipped

    @property
    def truncated(self) -> int:
        return sum(1 for entry in self.long if entry.action == "truncated")

    @property
    def skipped(self) -> int:
        return sum(1 for entry in self.long if entry.action == "skipped")


def check_vocab(samples: SampleTable, *, model: str, vocab_size: int) -> None:
    outside = np.flatnonzero(samples.row_max >= vocab_size)
    if len(outside):
        i = int(outside[0])
        raise HsxError(
            f"{samples.where(i)}: token id {samples.row_max[i]} is outside model {model}'s vocabulary of {vocab_size}"
        )


def _outside_vocab(samples: SampleTable, bad: BadRows, *, model: str, vocab_size: int) -> SampleTable:
    """The samples without the rows holding a token id outside the vocabulary, each handed to `bad`."""
    outside = np.flatnonzero(samples.row_max >= vocab_size)
    for i in outside.tolist():
        reason = f"token id {samples.row_max[i]} is outside model {model}'s vocabulary of {vocab_size}"
        bad(BadRow(samples.where(i), reason, source_id=samples.source_id(i)))
    return samples.select(np.flatnonzero(samples.row_max < vocab_size)) if len(outside) else samples


class _ChatStream:
    """The chat rows of a dataset as it is read: each gets its place in the table (token rows are
    added as they come), and `tokenize` fills the places, in order, as the tokenizer gives them
    back; so only the rows in flight are held, never the dataset."""

    def __init__(self, builder: SampleTableBuilder, items, rounds: "_Rounds | None" = None) -> None:
        self.builder, self.items, self.rounds = builder, items, rounds
        self.places: deque[int] = deque()
        self.rows = 0

    def _complete(self) -> None:
        """Tell the rounds how far every place is filled: up to the first chat row still in flight."""
        if self.rounds is not None:
            self.rounds.ready(self.places[0] if self.places else self.builder.rows)

    def __iter__(self) -> Iterator[ChatRow]:
        for item in self.items:
            if isinstance(item, ChatRow):
                self.places.append(self.builder.reserve(where=item.where, source_id=item.source_id))
                self.rows += 1
                yield item
            else:
                self.builder.add(item)
                self._complete()

    def tokenize(
        self, *, model: str, trust_remote_code: bool, bad: BadRows, chat_as: ChatConvention = HSX
    ) -> ChatTemplateInfo | None:
        rows = iter(self)
        head = list(islice(rows, POOL_MIN_ROWS))  # reads on to the first chat row (or the end)
        if not head:
            return None
        chat = ChatTokenizer.load(
            model, first_chat_row=head[0].where, trust_remote_code=trust_remote_code, convention=chat_as
        )
        total = len(head) if len(head) < POOL_MIN_ROWS else None  # None: many, on every core
        log.info("tokenizing_chats", rows=total, model=model, mask_method=chat.info.mask_method)
        started = last_log = time.monotonic()
        before = _cpu_seconds()
        done = 0
        cut: list[str] = []  # the rows whose replies the trainer's own parser cuts (--chat-as)

        def noted(chats: Iterator[ChatRow]) -> Iterator[ChatRow]:
            for chat_row in chats:
                if conventions.cut_replies(chat_as, chat_row.messages):
                    cut.append(chat_row.where)
                yield chat_row

        # In chunks (one batched call each), on every usable core for a large dataset
        # (producer/chat_pool.py); row for row the same result, and error, as `chat.tokenize`.
        for row in tokenize_chats(chat, noted(chain(head, rows)), total=total):
            place = self.places.popleft()
            if isinstance(row, BadRow):
                bad(row)  # --on-bad-row error: stops here, at the first bad conversation
                self.builder.drop(place)
            else:
                self.builder.fill_row(place, row)
            self._complete()
            done += 1
            if time.monotonic() - last_log > _PROGRESS_EVERY_S:
                last_log = time.monotonic()
                log.info("tokenizing_chats_progress", done=done, rows_per_s=round(done / (last_log - started), 1))
        main_cpu_s, pool_cpu_s = (now - then for now, then in zip(_cpu_seconds(), before))
        # main_cpu_s is the part no core count divides (reading, handing out, placing results):
        # with enough cores this stage takes about that long (bench/scale.py).
        log.info(
            "chats_tokenized",
            rows=done,
            seconds=round(time.monotonic() - started, 2),
            main_cpu_s=round(main_cpu_s, 2),
            pool_cpu_s=round(pool_cpu_s, 2),
        )
        if cut:
            log.warning(
                "chat_as_cuts_replies",
                chat_as=str(chat_as),
                rows=len(cut),
                first=cut[0],
                consequence="these rows' loss masks are the trainer's own, which end a reply at its end-of-turn "
                "text or start a turn at its header text inside the reply (docs/training.md)",
            )
        return dataclasses.replace(chat.info, rows_replies_cut=len(cut))


def _cpu_seconds() -> tuple[float, float]:
    """(this process's CPU seconds, its finished children's: the chat pool's workers once it closed)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@dataclass(frozen=True, kw_only=True)
class Round:
    """A round of the dataset (`--round-rows` rows of it, the last one what is left), read,
    tokenized and set right as the whole dataset is (bad rows, --on-long, --on-empty-mask): the
    producer plans and publishes it while the rounds after it are read."""

    samples: SampleTable  # the round's samples, numbered from 0 (they share the job's spill files)
    first_sample: int  # the job's index of the round's first sample
    first_row: int  # the place it starts at: rows counted as read, a line that does not parse not counted
    last: bool  # the dataset ends with this round
    long: tuple[LongSample, ...] = ()  # its rows --on-long truncated or skipped (sample indices the job's)
    empty_masks: tuple[EmptyMask, ...] = ()  # its samples with an all-zero loss mask
    rows_bad: int = 0  # bad rows found so far (this round's and any read ahead of it)


class RoundsCancelled(Exception):
    """The reading was stopped from outside (the producer gave up on the job)."""


class _Rounds:
    """Cuts the dataset, as its places fill in order, into rounds of `round_rows` rows (0: one
    round, the whole dataset), and sets each right on its own (every rule is per sample, so the
    rounds together are what the whole would be). Each round goes to `on_round` as it is cut."""

    def __init__(
        self,
        builder: SampleTableBuilder,
        bad: BadRows,
        *,
        round_rows: int,
        on_round,
        cancelled,
        path: Path,
        model: str,
        vocab_size: int,
        max_seq_len: int,
        on_long: str,
        on_empty_mask: str,
    ) -> None:
        self.builder, self.bad, self.round_rows, self.on_round, self.cancelled = (
            builder,
            bad,
            round_rows,
            on_round,
            cancelled,
        )
        self.path, self.model, self.vocab_size = path, model, vocab_size
        self.max_seq_len, self.on_long, self.on_empty_mask = max_seq_len, on_long, on_empty_mask
        self.since = 0  # the place the next round starts at
        self.tables: list[SampleTable] = []
        self.long: list[LongSample] = []
        self.empty: list[EmptyMask] = []
        self.samples = 0
        self.vocab_bad = 0  # bad rows the rounds cut so far found outside the vocabulary

    def ready(self, complete: int) -> None:
        """Every place before `complete` is filled or dropped: cut the rounds that lie before it."""
        if self.cancelled is not None and self.cancelled.is_set():
            raise RoundsCancelled
        # A full round is cut once a row past it is read: until then it may be the last (a dataset
        # of a multiple of --round-rows rows ends with a full round, not with an empty one).
        while self.round_rows and complete - self.since > self.round_rows:
            self._cut(self.since + self.round_rows, last=False)

    def finish(self, rows_read: int) -> SampleTable:
        """The last round; the whole dataset's samples."""
        self._cut(self.builder.rows, last=True, rows_read=rows_read)
        if not self.samples:
            raise HsxError(
                f"dataset {self.path}: no samples are left of its {rows_read} rows "
                f"(--on-long {self.on_long}, --on-empty-mask {self.on_empty_mask})"
            )
        return SampleTable.concat(self.tables)

    def _cut(self, upto: int, *, last: bool, rows_read: int = 0) -> None:
        before = len(self.bad)
        table = _outside_vocab(
            self.builder.window(self.since, upto), self.bad, model=self.model, vocab_size=self.vocab_size
        )
        if not last:
            self.vocab_bad += len(self.bad) - before
        if last:
            self.bad.check_cap(rows_read)
            if self.bad.entries and not self.samples and not len(table):
                raise HsxError(
                    f"dataset {self.path}: all {rows_read} rows are bad; the first: "
                    f"{self.bad.entries[0].where}: {self.bad.entries[0].reason}"
                )
        samples, long = apply_on_long_table(table, max_seq_len=self.max_seq_len, on_long=self.on_long)
        if last and not self.samples and not len(samples) and long:
            raise HsxError(
                f"dataset {self.path}: all {rows_read} rows are longer than --max-seq-len {self.max_seq_len} "
                "and --on-long skip leaves no samples"
            )
        kept, empty, long = apply_on_empty_mask(samples, on_empty_mask=self.on_empty_mask, long=long)
        if last and not self.samples and not len(kept) and empty:
            raise HsxError(
                f"dataset {self.path}: all {len(samples)} samples have an all-zero loss mask and --on-empty-mask "
                f"skip leaves no samples; the first: {empty[0].where}"
            )
        offset = self.samples
        long = [_shifted(entry, offset) for entry in long]
        empty = [_shifted(entry, offset) for entry in empty]
        self.long += long
        self.empty += empty
        self.tables.append(kept)
        cut = Round(
            samples=kept,
            first_sample=offset,
            first_row=self.since,
            last=last,
            long=tuple(long),
            empty_masks=tuple(empty),
            rows_bad=len(self.bad),
        )
        self.since, self.samples = upto, self.samples + len(kept)
        if self.on_round is not None:
            self.on_round(cut)


def _shifted(entry, offset: int):
    """A report entry of a round, its sample index made the job's."""
    if entry.sample_index is None or not offset:
        return entry
    return dataclasses.replace(entry, sample_index=entry.sample_index + offset)


def tokenized_rows(
    path: Path,
    *,
    model: str,
    vocab_size: int,
    max_seq_len: int,
    on_long: str,
    trust_remote_code: bool = False,
    chat_as: ChatConvention = HSX,
    on_bad_row: str = "error",
    max_bad_rows: BadRowCap | None = None,
    chat_field: str | None = None,
    on_empty_mask: str = "keep",
    round_rows: int = 0,
    on_round=None,
    cancelled=None,
) -> Inputs:
    """The dataset's samples and what was set aside. With `round_rows`, each round of that many
    rows goes to `on_round` (a `Round`) as soon as it is read, from this thread; `cancelled` (a
    threading.Event), once set, stops the reading at the next row (RoundsCancelled)."""
    builder = SampleTableBuilder()
    bad = BadRows(on_bad_row=on_bad_row, cap=max_bad_rows)
    rounds = _Rounds(
        builder,
        bad,
        round_rows=round_rows,
        on_round=on_round,
        cancelled=cancelled,
        path=path,
        model=model,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        on_long=on_long,
        on_empty_mask=on_empty_mask,
    )
    chats = _ChatStream(builder, read_source(path, on_bad_row=bad, chat_field=chat_field), rounds)
    chat = chats.tokenize(model=model, trust_remote_code=trust_remote_code, bad=bad, chat_as=chat_as)
    # Rows out of the vocabulary are placed rows and bad ones: counted once.
    rows_read = builder.rows + len(bad) - builder.dropped - rounds.vocab_bad
    kept = rounds.finish(rows_read)
    empty = rounds.empty
    if empty:
        log.warning(
            "samples_without_supervised_tokens",
            samples=len(empty),
            action="skipped" if on_empty_mask == "skip" else "kept",
            first=empty[0].where,
            first_id=empty[0].source_id,
            hint="listed in the job's report (empty_masks); --on-empty-mask skip leaves them out"
            if on_empty_mask == "keep"
            else "listed in the job's report (empty_masks)",
        )
    return Inputs(
        samples=kept,
        long=rounds.long,
        rows_read=rows_read,
        chat_rows=chats.rows,
        chat=chat,
        bad_rows=tuple(bad.entries),
        empty_masks=tuple(empty),
    )


def read_pretokenized(path: Path, *, max_seq_len: int | None = None) -> SampleTable:
    """A dataset of pre-tokenized rows only, as a table (chat rows are an error here: tokenizing
    them needs the model's tokenizer, see `producer/chat.py`). With `max_seq_len`, a longer row
    is an error.

    For jobs made before their samples were stored (`hsx verify`); the producer itself goes
    through `tokenized_rows`, and the samples a job was actually planned from are
    `hsx.storage.tokens.load_table`."""
    builder = SampleTableBuilder()
    for item in read_source(path):
        if isinstance(item, ChatRow):
            raise HsxError(
                f"{item.where}: a chat row; it needs the model's tokenizer (use hsx.storage.tokens.load_table)"
            )
        builder.add(item)
    table = builder.finish()
    if max_seq_len is not None:
        long = np.flatnonzero(table.lengths > max_seq_len)
        if len(long):
            i = int(long[0])
            raise HsxError(f"{table.where(i)}: {table.lengths[i]} tokens is longer than --max-seq-len {max_seq_len}")
    return table


def report_document(
    *,
    job: str,
    dataset: Path,
    max_seq_len: int,
    on_long: str,
    inputs: Inputs,
    chat_as: str = "hsx",
    on_bad_row: str = "error",
    max_bad_rows: BadRowCap | None = None,
    on_empty_mask: str = "keep",
) -> dict:
    """The job's input report (stored as `<job>.report.json`)."""
    return {
        "format": "hsx.input_report.v1",
        "job": job,
        "dataset": str(dataset),
        "max_seq_len": max_seq_len,
        "on_long": on_long,
        "chat_convention": chat_as,  # --chat-as
        "rows_read": inputs.rows_read,
        "chat_rows": inputs.chat_rows,
        "samples": len(inputs.samples),
        "samples_truncated": inputs.truncated,
        "samples_skipped": inputs.skipped,
        "on_bad_row": on_bad_row,
        "max_bad_rows": None if max_bad_rows is None else str(max_bad_rows),
        "rows_bad": len(inputs.bad_rows),
        "on_empty_mask": on_empty_mask,
        "samples_empty_mask": len(inputs.empty_masks),
        "chat_template": None
        if inputs.chat is None
        else {
            "model": inputs.chat.model,
            "mask_method": inputs.chat.mask_method,
            "template_sha256": inputs.chat.template_sha256,
            "rows_replies_cut": inputs.chat.rows_replies_cut,
        },
        "long_rows": [
            {
                "where": e.where,
                "source_id": e.source_id,
                "original_length": e.original_length,
                "action": e.action,
                "sample_index": e.sample_index,
                "kept_length": e.kept_length,
            }
            for e in inputs.long
        ],
        "bad_rows": [{"where": e.where, "id": e.source_id, "reason": e.reason} for e in inputs.bad_rows],
        "empty_masks": [
            {"where": e.where, "id": e.source_id, "sample_index": e.sample_index, "reason": e.reason}
            for e in inputs.empty_masks
        ],
    }
