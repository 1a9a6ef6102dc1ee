"""What a running worker accepts when it reads its job's spec again: the one rule, in one place.

A worker (consumer, uploader, monitor, a trainer's stream) holds the spec it started with and
reads the job's KV entry again while it runs (hsx/wire/worker.py `JobWatch`). The entry is
written by the producer, but anyone who may write the bucket can rewrite it; a rewritten spec of
the same plan, destination and creation time must not change what the worker checks or counts.
So a spec read again is adopted only when every field moved the way the producer moves it:

- `published`: from false to true, never back;
- while the plan is still being published (the held spec's `published` is false):
  `round_starts` grows by appending; `total_samples`, `total_tokens`, `total_batches` and the
  counts of what reading set aside (`rows_read`, `rows_bad`, `samples_truncated`,
  `samples_skipped`, `samples_empty_mask`) never fall; `tokenized_object` and `report_object` are
  set once from ""; `stopped` is set (a later round refused) or cleared (a producer resumed);
- every other field, and every field once the plan is published, stays as it is.

Anything else is refused: the worker keeps the spec it holds and says so in one warning line
naming the field (`job_spec_change_refused`). A job deleted or produced again (another plan,
destination or creation time) is not a change but another job: `JobWatch` stops for it.
This module knows the spec's fields and nothing of NATS.
"""

from __future__ import annotations

from dataclasses import dataclass

from hsx.job import JobSpec

_GROWING = ("total_samples", "total_tokens", "total_batches")
_COUNTS = ("rows_read", "rows_bad", "samples_truncated", "samples_skipped", "samples_empty_mask")
_SET_ONCE = ("tokenized_object", "report_object")
# Fields that may change while the plan is published in rounds (each with its own rule below).
_WHILE_PUBLISHING = frozenset((*_GROWING, *_COUNTS, *_SET_ONCE, "round_starts", "stopped"))


@dataclass(frozen=True, kw_only=True)
class RefusedChange:
    """The first field of a spec read again that moved in a way the producer never moves it."""

    field: str
    held: object
    read: object
    rule: str

    def describe(self) -> str:
        return f"{self.field} {self.held!r} -> {self.read!r}: {self.rule}"


def _refusal(field: str, held: JobSpec, read: JobSpec, rule: str) -> RefusedChange:
    return RefusedChange(field=field, held=getattr(held, field), read=getattr(read, field), rule=rule)


def refused_change(held: JobSpec, read: JobSpec) -> RefusedChange | None:
    """None when `read` is a legitimate later state of the job whose spec a worker holds (`held`,
    same identity); else the first field that is not. Fields in declaration order."""
    publishing = not held.published
    for field in JobSpec.__struct_fields__:
        before, after = getattr(held, field), getattr(read, field)
        if before == after:
            continue
        if field == "published":
            if before and not after:
                return _refusal(field, held, read, "a published plan is never unpublished")
            continue
        if field not in _WHILE_PUBLISHING:
            return _refusal(field, held, read, "fixed for the job's plan")
        if not publishing:
            return _refusal(field, held, read, "fixed once the plan is published")
        if field == "round_starts" and after[: len(before)] != before:
            return _refusal(field, held, read, "rounds are only appended")
        if field in _GROWING + _COUNTS and after < before:
            return _refusal(field, held, read, "never falls while rounds are appended")
        if field in _SET_ONCE and before:
            return _refusal(field, held, read, "set once")
    return None
