"""The one rule for a job spec read again by a running worker (hsx/wire/spec_changes.py), field by
field: every field of JobSpec is either fixed, or moves only as the producer moves it, and each
move the producer never makes is refused naming that field. A field added to JobSpec later is
fixed until the rule says otherwise (the test walks the struct's own fields)."""

import msgspec
import pytest

from hsx.job import JobSpec
from hsx.wire.spec_changes import refused_change

HELD = JobSpec(
    job="j",
    model="m",
    model_revision="r",
    layers=[1, 3],
    dtype="bfloat16",
    dest="file:///tmp/hsx-unused",
    token_budget=4096,
    max_seq_len=2048,
    dataset="data.jsonl",
    plan_fingerprint="0" * 64,
    total_samples=100,
    total_tokens=5000,
    total_batches=10,
    created_at=1.0,
    published=False,
    tokenized_object="",
    report_object="",
    rows_read=100,
    round_rows=50,
    round_starts=[0, 50],
    sample_digests=True,
    num_layers=4,
    hidden_size=64,
)


def _other(value):
    """A value of the same type as `value`, not equal to it."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 1.0
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return [*value, value[-1] + 1 if value and isinstance(value[-1], int) else 7]
    raise AssertionError(type(value))


def _with(spec: JobSpec, **changes) -> JobSpec:
    return msgspec.structs.replace(spec, **changes)


FIELDS = JobSpec.__struct_fields__
WHILE_PUBLISHING = {
    "published",
    "round_starts",
    "stopped",
    "total_samples",
    "total_tokens",
    "total_batches",
    "rows_read",
    "rows_bad",
    "samples_truncated",
    "samples_skipped",
    "samples_empty_mask",
    "tokenized_object",
    "report_object",
}


@pytest.mark.parametrize("field", FIELDS)
def test_every_field_is_fixed_once_the_plan_is_published(field):
    held = _with(HELD, published=True)
    read = _with(held, **{field: _other(getattr(held, field))})
    refused = refused_change(held, read)
    assert refused is not None and refused.field == field, refused


@pytest.mark.parametrize("field", sorted(set(FIELDS) - WHILE_PUBLISHING))
def test_fields_of_the_plan_are_fixed_while_it_is_published_in_rounds(field):
    read = _with(HELD, **{field: _other(getattr(HELD, field))})
    refused = refused_change(HELD, read)
    assert refused is not None and refused.field == field, refused


def test_the_producers_own_moves_are_adopted():
    """A round appended with its totals and counts, the bundle's objects named, a stop set and
    cleared, then the plan published: each is what the producer writes, each is taken."""
    grown = _with(
        HELD,
        round_starts=[0, 50, 100],
        total_samples=150,
        total_tokens=7000,
        total_batches=15,
        rows_read=150,
        rows_bad=1,
        samples_skipped=2,
        samples_truncated=3,
        samples_empty_mask=1,
    )
    stopped = _with(grown, stopped="round 3: a bad row")
    resumed = _with(stopped, stopped="")
    named = _with(resumed, tokenized_object="j.tokens.arrow", report_object="j.report.json")
    published = _with(named, published=True)
    for held, read in [(HELD, grown), (grown, stopped), (stopped, resumed), (resumed, named), (named, published)]:
        assert refused_change(held, read) is None, (held, read)
    assert refused_change(published, published) is None


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"published": False}, "published"),
        ({"total_samples": 99}, "total_samples"),  # a shrunk plan would end the job early
        ({"total_batches": 9}, "total_batches"),
        ({"round_starts": [0, 40]}, "round_starts"),
        ({"round_starts": [0]}, "round_starts"),
        ({"rows_read": 10}, "rows_read"),
        ({"sample_digests": False}, "sample_digests"),  # a worker never relaxes a check
        ({"stopped": "crafted"}, "stopped"),  # a healthy published job is never stopped
    ],
)
def test_moves_the_producer_never_makes_are_refused_naming_the_field(change, field):
    held = _with(HELD, published=True) if field in ("published", "stopped", "sample_digests") else HELD
    refused = refused_change(held, _with(held, **change))
    assert refused is not None and refused.field == field, refused
    assert field in refused.describe()


def test_a_name_set_once_is_not_renamed():
    named = _with(HELD, tokenized_object="j.tokens.arrow")
    refused = refused_change(named, _with(named, tokenized_object="other.tokens.arrow"))
    assert refused is not None and refused.field == "tokenized_object"
