"""Progress is counted, not replayed (hsx/wire/counts.py): each planned batch and sample leaves one
marker, stored once, that JetStream counts; the sums are folded once and checkpointed. So
redeliveries and re-uploads never inflate progress, a job whose every missing sample is dead is
failed, not running, and a reading that stops early says its sums are short instead of
under-counting."""

import asyncio
import time

import nats
import pytest

from hsx.commands.status import read_status
from hsx.job import JobSpec
from hsx.monitor.rates import RateWindow, eta_seconds
from hsx.wire import schemas, topology
from hsx.wire.counts import ProgressCounts, QueueState, count_stored
from hsx.wire.events import EventPublisher, WorkerState, heartbeat_loop
from hsx.wire.fold import ProgressFold
from hsx.wire.jobs import last_heartbeats
from hsx.wire.natsconn import NatsSettings
from hsx.wire.statusview import status_view
from hsx.wire.tracker import ProgressTracker

PLAN = "abcdefabcdef"


def _spec(total=4, batches=2, job="j"):
    return JobSpec(
        job=job,
        model="m",
        model_revision="r",
        layers=[1],
        dtype="bfloat16",
        dest="file:///tmp/x",
        token_budget=64,
        max_seq_len=32,
        dataset="d",
        plan_fingerprint=PLAN + "0" * 52,
        total_samples=total,
        total_tokens=40,
        total_batches=batches,
        created_at=0.0,
        published=True,
    )


def _written(batch, indices, attempt=1, job="j"):
    return schemas.BatchWritten(
        job=job,
        batch_id=batch,
        consumer="c",
        node="n",
        sample_indices=indices,
        tokens=10 * len(indices),
        bytes=100 * len(indices),
        seconds=0.1,
        attempt=attempt,
        plan=PLAN,
    )


def _uploaded(index, job="j", attempt=1):
    return schemas.FileUploaded(
        job=job,
        node="n",
        uploader="u",
        sample_index=index,
        key=f"{job}/00000/{index}.safetensors",
        size=100,
        tokens=10,
        attempt=attempt,
        plan=PLAN,
    )


def test_done_when_every_sample_is_uploaded_and_nothing_is_queued():
    counts = ProgressCounts(samples_uploaded=4, batches_done=2)
    assert status_view(_spec(), ProgressFold(), QueueState(), counts, job="j").done
    assert not status_view(_spec(), ProgressFold(), QueueState(batches_queued=1), counts, job="j").done
    assert not status_view(_spec(), ProgressFold(), QueueState(), ProgressCounts(samples_uploaded=3), job="j").done


def test_failed_when_everything_left_is_dead_and_nothing_is_queued():
    counts = ProgressCounts(samples_uploaded=2, dead_unfinished=frozenset({2, 3}))
    view = status_view(_spec(), ProgressFold(), QueueState(dead_letters=1), counts, job="j")
    assert view.failed and view.dead_samples == [2, 3] and "2 samples dead-lettered" in view.failure_reason
    # Still work queued somewhere: not failed yet.
    assert not status_view(_spec(), ProgressFold(), QueueState(dead_letters=1, files_queued=1), counts, job="j").failed
    # A sample missing that no letter holds: it may still come (a lost event is redelivered), not failed.
    short = ProgressCounts(samples_uploaded=1, dead_unfinished=frozenset({2, 3}))
    assert not status_view(_spec(), ProgressFold(), QueueState(dead_letters=1), short, job="j").failed


async def _publisher(url: str, job: str):
    nc = await nats.connect(url)
    js = nc.jetstream()
    kv = await topology.ensure_topology(js)
    spec = _spec(job=job)
    await kv.put(job, schemas.encode(spec))
    return nc, js, EventPublisher(nc, js, job), spec


def test_dead_letters_of_another_plan_under_the_job_name_are_not_the_jobs():
    """A worker of a deleted job that stored a letter before it noticed: its samples are not this
    plan's dead samples (they would make the job look failed)."""

    def letter(index: int, plan: str) -> schemas.DeadLetter:
        batch = schemas.BatchDescriptor(
            job="j",
            batch_id=f"b{index}",
            padded_len=1,
            samples=[schemas.Sample(index=index, source_id="s", input_ids=[1])],
            plan=plan,
        )
        return schemas.DeadLetter(
            job="j", what="batch", error="e", deliveries=5, original_subject="s", batch=batch, sample_indices=[index]
        )

    fold = ProgressFold(job="j", plan="aaaaaaaaaaaa")
    for event in (letter(1, "aaaaaaaaaaaa"), letter(2, "bbbbbbbbbbbb"), letter(3, "")):
        fold.apply(event)
    assert fold.dead_samples == {1, 3}


def test_a_redelivered_batch_and_a_reupload_are_stored_once_and_counted_once(nats_server, job_name):
    async def run() -> dict:
        nc, js, events, spec = await _publisher(nats_server.url, job_name)
        try:
            batch = topology.written_subject(job_name, PLAN, "b0")
            assert await events.mark(_written("b0", [0, 1], job=job_name), subject=batch)
            assert not await events.mark(_written("b0", [0, 1], attempt=2, job=job_name), subject=batch)
            for index in (0, 0, 1):
                await events.mark(
                    _uploaded(index, job=job_name), subject=topology.uploaded_subject(job_name, PLAN, index)
                )
            assert (
                await count_stored(js, topology.EVENTS_STREAM, topology.marker_filter(job_name, "uploaded", PLAN)) == 2
            )
        finally:
            await nc.drain()
        return await read_status(NatsSettings(url=nats_server.url), job_name, sums_budget_s=30)

    view = asyncio.run(run())
    assert (view.samples_written, view.samples_uploaded, view.batches_done) == (2, 2, 1), view
    assert (view.tokens_written, view.tokens_uploaded, view.bytes_uploaded) == (20, 20, 200), view
    assert view.sums_complete and not view.done and view.batch_redeliveries == 0, view


def test_sums_go_on_from_the_checkpoint_and_a_short_reading_says_so(nats_server, job_name):
    """A reading with no time for the sums still counts exactly and says its sums are short; each
    reading saves how far it got, and the next goes on from there to the same sums as one that
    read everything."""
    total = 30_000  # more than a reading without time for its sums can fold

    async def fill() -> None:
        nc, js, events, spec = await _publisher(nats_server.url, job_name)
        try:
            # As the workers publish them (stored once), but without waiting for each store.
            for batch in range(total // 3):
                indices = [3 * batch, 3 * batch + 1, 3 * batch + 2]
                await nc.publish(
                    topology.written_subject(job_name, PLAN, f"b{batch}"),
                    schemas.encode(_written(f"b{batch}", indices, attempt=1 + batch % 2, job=job_name)),
                    headers=topology.ONCE_HEADERS,
                )
                for index in indices:
                    await nc.publish(
                        topology.uploaded_subject(job_name, PLAN, index),
                        schemas.encode(_uploaded(index, job=job_name)),
                        headers=topology.ONCE_HEADERS,
                    )
            await nc.flush()
            while (
                await count_stored(js, topology.EVENTS_STREAM, topology.marker_filter(job_name, "uploaded", PLAN))
                < total
            ):
                await asyncio.sleep(0.05)
        finally:
            await nc.drain()

    asyncio.run(fill())
    settings = NatsSettings(url=nats_server.url)
    short = asyncio.run(read_status(settings, job_name, sums_budget_s=0.0))
    assert short.samples_uploaded == total and short.batches_done == total // 3, short
    assert not short.sums_complete and short.tokens_uploaded < 10 * total, short

    readings = [short]
    for _ in range(200):
        readings.append(asyncio.run(read_status(settings, job_name, sums_budget_s=0.2)))
        if readings[-1].sums_complete:
            break
    last = readings[-1]
    assert last.sums_complete, readings[-1]
    assert [r.tokens_uploaded for r in readings] == sorted(r.tokens_uploaded for r in readings)  # never back
    expected = {
        "samples_written": total,
        "tokens_written": 10 * total,
        "bytes_written": 100 * total,
        "tokens_uploaded": 10 * total,
        "bytes_uploaded": 100 * total,
        "batch_redeliveries": total // 6,
    }
    assert {key: getattr(last, key) for key in expected} == expected, last

    # A fold from nothing reaches the same sums as the one that went on from checkpoints.
    async def from_nothing() -> ProgressFold:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        await js.purge_stream(topology.STATE_STREAM, subject=topology.checkpoint_subject(job_name))
        tracker = ProgressTracker(js, job_name, plan=PLAN)
        await tracker.start()
        await tracker.wait_caught_up(30)
        await tracker.stop()
        await nc.drain()
        return tracker.fold

    fold = asyncio.run(from_nothing())
    assert (fold.samples_written, fold.tokens_written, fold.tokens_uploaded, fold.batch_redeliveries) == (
        total,
        10 * total,
        10 * total,
        total // 6,
    )


def test_concurrent_checkpoints_merge_to_the_furthest_of_each_kind(nats_server, job_name):
    from hsx.wire.fold import load_checkpoint, save_checkpoint

    async def run() -> tuple[schemas.ProgressCheckpoint, list[int], list[int]]:
        nc, js, events, spec = await _publisher(nats_server.url, job_name)
        try:
            # The markers the checkpoints' sums end at: a checkpoint is used only while they are there.
            written = [
                (
                    await js.publish(
                        topology.written_subject(job_name, PLAN, f"b{i}"),
                        schemas.encode(_written(f"b{i}", [i], job=job_name)),
                    )
                ).seq
                for i in range(6)
            ]
            uploaded = [
                (
                    await js.publish(
                        topology.uploaded_subject(job_name, PLAN, i), schemas.encode(_uploaded(i, job=job_name))
                    )
                ).seq
                for i in range(10)
            ]
            ahead_in_written = schemas.ProgressCheckpoint(
                job=job_name,
                plan=PLAN,
                written_seq=written[5],
                tokens_written=500,
                uploaded_seq=uploaded[1],
                tokens_uploaded=10,
            )
            ahead_in_uploaded = schemas.ProgressCheckpoint(
                job=job_name,
                plan=PLAN,
                written_seq=written[2],
                tokens_written=200,
                uploaded_seq=uploaded[9],
                tokens_uploaded=90,
            )
            await asyncio.gather(save_checkpoint(js, ahead_in_written), save_checkpoint(js, ahead_in_uploaded))
            behind = schemas.ProgressCheckpoint(
                job=job_name, plan=PLAN, written_seq=written[0], uploaded_seq=uploaded[0]
            )
            await save_checkpoint(js, behind)
            saved, _ = await load_checkpoint(js, job_name, PLAN)
            other_plan, _ = await load_checkpoint(js, job_name, "0123456789ab")
            assert other_plan is None
            # HSX_STATE keeps the last save only, whatever number of saves.
            info = await js.stream_info(topology.STATE_STREAM, subjects_filter=topology.checkpoint_subject(job_name))
            assert info.state.subjects == {topology.checkpoint_subject(job_name): 1}, info.state.subjects
            return saved, written, uploaded
        finally:
            await nc.drain()

    saved, written, uploaded = asyncio.run(run())
    assert (saved.written_seq, saved.tokens_written, saved.uploaded_seq, saved.tokens_uploaded) == (
        written[5],
        500,
        uploaded[9],
        90,
    )


def test_a_checkpoint_whose_markers_are_gone_or_left_in_hsx_events_is_not_used(nats_server, job_name):
    """The sums are folded again from the markers when the checkpoint's markers were purged
    (HSX_STATE and HSX_EVENTS are purged apart: an older hsx's `jobs delete` knew only HSX_EVENTS),
    and a checkpoint an older hsx left on `hsx.events.<job>.checkpoint` is not read at all."""
    from hsx.wire.fold import load_checkpoint, save_checkpoint

    async def run() -> tuple:
        nc, js, events, spec = await _publisher(nats_server.url, job_name)
        try:
            for batch in range(3):
                await events.mark(
                    _written(f"b{batch}", [batch], job=job_name),
                    subject=topology.written_subject(job_name, PLAN, f"b{batch}"),
                )
            last = (await js.stream_info(topology.EVENTS_STREAM)).state.last_seq
            # Sums far above what the markers say, as an older hsx's checkpoint (its own subject).
            inflated = schemas.ProgressCheckpoint(job=job_name, plan=PLAN, written_seq=last, samples_written=1000)
            await js.publish(f"hsx.events.{job_name}.checkpoint", schemas.encode(inflated))
            tracker = ProgressTracker(js, job_name, plan=PLAN)
            await tracker.start()
            await tracker.wait_caught_up(30)
            await tracker.stop()
            from_markers = tracker.fold.samples_written
            # The same checkpoint where this hsx keeps it: used while its markers are there ...
            await save_checkpoint(js, inflated)
            kept, _ = await load_checkpoint(js, job_name, PLAN)
            # ... and not once they are purged; markers stored again after it are all counted.
            await js.purge_stream(topology.EVENTS_STREAM, subject=f"hsx.events.{job_name}.>")
            await events.mark(_written("b9", [9], job=job_name), subject=topology.written_subject(job_name, PLAN, "b9"))
            stale, seq = await load_checkpoint(js, job_name, PLAN)
            again = ProgressTracker(js, job_name, plan=PLAN)
            await again.start()
            await again.wait_caught_up(30)
            await again.stop()
            return from_markers, kept, stale, seq, again.fold.samples_written
        finally:
            await nc.drain()

    from_markers, kept, stale, seq, after_purge = asyncio.run(run())
    assert from_markers == 3
    assert kept is not None and kept.samples_written == 1000
    assert stale is None and seq > 0  # the save's sequence still serializes the next saver
    assert after_purge == 1


def test_a_dead_sample_uploaded_after_all_is_not_holding_the_job_back(nats_server, job_name):
    async def run() -> tuple[ProgressCounts, ProgressCounts]:
        nc, js, events, spec = await _publisher(nats_server.url, job_name)
        try:
            await events.store_dead_letter(
                what="batch",
                error="boom",
                subject="s",
                payload=b"x",
                deliveries=5,
                batch_id="b1",
                sample_indices=[2, 3],
            )
            tracker = ProgressTracker(js, job_name, plan=PLAN)
            await tracker.start()
            await tracker.wait_caught_up(30)
            before = await tracker.refresh_counts()
            # Sample 2 made it after all (the letter was retried by hand, say).
            await events.mark(_uploaded(2, job=job_name), subject=topology.uploaded_subject(job_name, PLAN, 2))
            after = await tracker.refresh_counts()
            await tracker.stop()
            return before, after
        finally:
            await nc.drain()

    before, after = asyncio.run(run())
    assert before.dead_unfinished == {2, 3} and after.dead_unfinished == {3}, (before, after)


@pytest.mark.parametrize("done_samples", [0, 1000])
def test_counting_reads_no_marker(nats_server, job_name, done_samples):
    """The counts are the server's: no message is delivered to read them, however many there are."""
    job = f"{job_name}-{done_samples}"

    async def run() -> tuple[int, int]:
        nc, js, events, spec = await _publisher(nats_server.url, job)
        try:
            for index in range(done_samples):
                await nc.publish(topology.uploaded_subject(job, PLAN, index), schemas.encode(_uploaded(index, job=job)))
            await nc.flush()
            deadline = time.monotonic() + 30
            while (
                await count_stored(js, topology.EVENTS_STREAM, topology.marker_filter(job, "uploaded", PLAN))
                < done_samples
            ):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            before = nc.stats["in_msgs"]
            counted = (await ProgressTracker(js, job, plan=PLAN).refresh_counts()).samples_uploaded
            return counted, nc.stats["in_msgs"] - before
        finally:
            await nc.drain()

    counted, delivered = asyncio.run(run())
    assert counted == done_samples
    assert delivered <= 30, delivered  # API replies only: a dozen requests, nothing per marker


def test_rate_window_and_eta():
    window = RateWindow(window_s=10)
    for second, value in enumerate([0, 100, 200, 300]):
        window.add(value, now=float(second))
    assert window.per_second() == 100.0
    assert eta_seconds(1000, 100.0) == 10.0
    assert eta_seconds(10, 0.0) is None


def test_streams_of_an_older_hsx_without_hsx_state_are_read_without_heartbeats_or_a_checkpoint(nats_server, job_name):
    """Until a producer of this version adds HSX_STATE, a reader finds no heartbeat and no
    checkpoint and saves none, and its sums are folded from the markers: no error."""

    async def run() -> tuple:
        nc, js, events, spec = await _publisher(nats_server.url, job_name)
        try:
            await events.mark(
                _written("b0", [0, 1], job=job_name), subject=topology.written_subject(job_name, PLAN, "b0")
            )
            await js.delete_stream(topology.STATE_STREAM)
            try:
                assert await topology.jobs_bucket(js) is not None
                tracker = ProgressTracker(js, job_name, plan=PLAN, heartbeats=True)
                await tracker.start()
                await tracker.wait_caught_up(30)
                await tracker.save_checkpoint()
                await tracker.stop()
                return tracker.fold.samples_written, tracker.fold.heartbeats, await last_heartbeats(js, job_name)
            finally:
                await topology.ensure_topology(js)  # the server is the session's: HSX_STATE back
        finally:
            await nc.drain()

    assert asyncio.run(run()) == (2, {}, [])


def test_a_worker_beats_at_once_when_told_not_a_heartbeat_later(nats_server, job_name):
    """`heartbeats()` yields a callable that sends the next beat now (the consumer calls it once
    its model is loaded: the page then shows it ready with its kernels). Each wait below is far
    under the 600 s interval, so only the wake can explain a second beat."""
    interval_s, phase = 600.0, ["starting"]

    def state() -> WorkerState:
        return WorkerState(state=phase[0])

    async def states(js) -> list[str]:
        return [beat.state for beat in await last_heartbeats(js, job_name)]

    async def until(js, expected: str) -> None:
        deadline = time.monotonic() + 60
        while await states(js) != [expected]:
            assert time.monotonic() < deadline, await states(js)
            await asyncio.sleep(0.05)

    async def run() -> None:
        nc, js, events, _spec = await _publisher(nats_server.url, job_name)
        stopping, wake = asyncio.Event(), asyncio.Event()
        loop = asyncio.create_task(
            heartbeat_loop(
                events,
                service="gpu_consumer",
                instance="w1",
                node="n1",
                interval_s=interval_s,
                stopping=stopping,
                state=state,
                wake=wake,
            )
        )
        try:
            await until(js, "starting")
            phase[0] = "idle"
            wake.set()
            await until(js, "idle")
            stopping.set()
            await asyncio.wait_for(loop, 60)  # the wait ends on stopping too, not after the interval
        finally:
            loop.cancel()
            await nc.drain()

    asyncio.run(run())
