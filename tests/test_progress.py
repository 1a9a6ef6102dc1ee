"""The progress fold counts distinct samples and batches, so redeliveries never inflate
progress, and a job whose every missing sample is dead is reported as failed, not running."""

import msgspec

from hsx import schemas
from hsx.progress import ProgressFold, QueueState, status_view
from monitor.rates import RateWindow, eta_seconds


def _spec(total=4, batches=2):
    return schemas.JobSpec(
        job="j", model="m", model_revision="r", layers=[1], dtype="bfloat16", dest="file:///tmp/x", token_budget=64,
        max_seq_len=32, dataset="d", plan_fingerprint="f", total_samples=total, total_tokens=40, total_batches=batches,
        created_at=0.0, published=True,
    )


def _written(batch, indices, attempt=1):
    return schemas.BatchWritten(job="j", batch_id=batch, consumer="c", node="n", sample_indices=indices, tokens=10 * len(indices),
                                bytes=100 * len(indices), seconds=0.1, attempt=attempt)


def _uploaded(index):
    return schemas.FileUploaded(job="j", node="n", uploader="u", sample_index=index, key=f"j/00000/{index}.safetensors",
                                size=100, tokens=10)


def test_redelivered_batches_and_reuploads_are_counted_once():
    fold = ProgressFold()
    for event in [_written("b0", [0, 1]), _written("b0", [0, 1], attempt=2), _uploaded(0), _uploaded(0), _uploaded(1)]:
        fold.apply(schemas.event_decoder.decode(schemas.encode(event)))
    view = status_view(_spec(), fold, QueueState(batches_queued=1), job="j")
    assert (view["samples_written"], view["samples_uploaded"], view["batches_done"]) == (2, 2, 1)
    assert (view["tokens_written"], view["tokens_uploaded"], view["bytes_uploaded"]) == (20, 20, 200)
    assert not view["done"] and not view["failed"]


def test_done_when_every_sample_is_uploaded():
    fold = ProgressFold()
    for event in [_written("b0", [0, 1]), _written("b1", [2, 3])] + [_uploaded(i) for i in range(4)]:
        fold.apply(event)
    assert status_view(_spec(), fold, QueueState(), job="j")["done"]


def test_failed_when_everything_left_is_dead_and_nothing_is_queued():
    fold = ProgressFold()
    for event in [_written("b0", [0, 1]), _uploaded(0), _uploaded(1)]:
        fold.apply(event)
    fold.apply(schemas.DeadLetter(job="j", what="batch", error="boom", deliveries=5, original_subject="s", original=b"x",
                                  batch_id="b1", sample_indices=[2, 3]))
    assert status_view(_spec(), fold, QueueState(dead_letters=1), job="j")["failed"]
    # Still work queued somewhere: not failed yet.
    assert not status_view(_spec(), fold, QueueState(dead_letters=1, files_queued=1), job="j")["failed"]


def test_done_needs_every_planned_sample_of_this_plan():
    """Events of another plan and indices outside range(total) are set aside, never counted; an
    event without a plan (from hsx before events carried one) is taken as this plan's."""
    fold = ProgressFold(plan="p1")
    stray = [msgspec.structs.replace(_uploaded(i), plan="p0") for i in range(4)]  # a former job of this name
    stray += [msgspec.structs.replace(_uploaded(i), plan="p1") for i in (4, 5, 6)]  # past the plan's 4 samples
    stray.append(msgspec.structs.replace(_written("b9", [0, 1, 2, 3]), plan="p0"))
    for event in stray + [msgspec.structs.replace(_uploaded(i), plan="p1") for i in (0, 1)] + [_uploaded(2)]:
        fold.apply(schemas.event_decoder.decode(schemas.encode(event)))
    view = status_view(_spec(), fold, QueueState(), job="j")
    assert not view["done"] and view["samples_uploaded"] == 3 and view["samples_written"] == 0, view
    assert view["samples_outside_plan"] == 3 and view["events_other_plan"] == 5, view
    assert (view["tokens_uploaded"], view["bytes_uploaded"]) == (30, 300), view
    fold.apply(msgspec.structs.replace(_uploaded(3), plan="p1"))
    assert status_view(_spec(), fold, QueueState(), job="j")["done"]


def test_rate_window_and_eta():
    window = RateWindow(window_s=10)
    for second, value in enumerate([0, 100, 200, 300]):
        window.add(value, now=float(second))
    assert window.per_second() == 100.0
    assert eta_seconds(1000, 100.0) == 10.0
    assert eta_seconds(10, 0.0) is None
