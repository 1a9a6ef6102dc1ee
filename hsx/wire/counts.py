"""A job's progress markers as JetStream counts them: exact, in constant time, none delivered.

Every planned batch written and every planned sample uploaded leaves a marker on a subject of its
own (`topology.written_subject`, `topology.uploaded_subject`), stored at most once
(`EventPublisher.mark`). A durable that is never fetched from (`topology.PROGRESS_COUNTERS`) has
them all pending, so `read_counts` is exact whatever the job's size, one consumer-info request
per counter. Markers of another plan, and of sample indices outside the plan (`<plan>.extra.`),
are counted apart: neither stands in for a missing sample. Also here: one marker looked up
(`find_marker`), the newest sequence under a filter (`last_sequence`), and for a one-off reading
(`hsx status`) when the job's markers began and ended (`marker_times`) and how many samples were
uploaded over a recent window (`recent_upload_rate`).
"""

import asyncio
import datetime
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from hsx.wire import topology


@dataclass
class QueueState:
    batches_queued: int = 0
    files_queued: int = 0
    dead_letters: int = 0
    batch_redeliveries: int = 0
    file_redeliveries: int = 0
    # File events delivered to an uploader and not yet acked: what the job's uploaders hold, as
    # JetStream counts it (a heartbeat cannot make it up).
    files_in_hand: int = 0
    # Batches delivered to a GPU consumer and not yet acked (JetStream's count).
    batches_in_hand: int = 0


@dataclass(frozen=True)
class ProgressCounts:
    """Distinct markers, counted by JetStream (see the module docstring)."""

    samples_uploaded: int = 0  # this plan's samples with an `uploaded` marker
    batches_done: int = 0  # this plan's batches with a `written` marker
    samples_outside_plan: int = 0  # `uploaded` markers of this plan set aside: indices outside range(total)
    events_other_plan: int = 0  # markers of another plan under this job name
    samples_requeued: int = 0  # `requeued` events: a spool file lost or corrupted, sent back for extraction
    # Of the dead-lettered samples, those with no `uploaded` marker: what a dead letter still holds back.
    dead_unfinished: frozenset[int] = frozenset()


async def count_stored(
    js: JetStreamContext, stream: str, subject_filter: str, *, since: datetime.datetime | None = None
) -> int:
    """Messages in `stream` under `subject_filter` (stored at or after `since`, when given), counted
    by the server: an ephemeral consumer is created, read for its pending count and deleted; no
    message is delivered. For one-off counts (a producer re-run, `hsx status`'s rate, tests); a
    monitor's reading counts through the durables (`read_counts`), since a cluster pays every
    consumer created as a meta-layer proposal."""
    config = ConsumerConfig(
        # Named, so that nats-py creates it on a subject that names its filter: a role's NATS
        # user may count its own job's messages and no other's (hsx/wire/permissions.py).
        name=uuid.uuid4().hex,
        filter_subject=subject_filter,
        ack_policy=AckPolicy.NONE,
        mem_storage=True,
        inactive_threshold=30.0,
        deliver_policy=DeliverPolicy.ALL if since is None else DeliverPolicy.BY_START_TIME,
        opt_start_time=since,
    )
    info = await js.add_consumer(stream, config)
    try:
        return info.num_pending or 0
    finally:
        try:
            await js.delete_consumer(stream, info.name)
        except nats.js.errors.NotFoundError:
            pass


async def read_counts(js: JetStreamContext, job: str, plan: str) -> ProgressCounts:
    """The job's counts: one consumer-info request per counting durable (topology.PROGRESS_COUNTERS,
    created on first use), all at once, whatever the job's size. A durable that no longer counts
    everything under its filter, because someone fetched from it (every trainer's user may fetch
    from HSX_EVENTS' consumers: hsx/wire/permissions.py), is made again."""

    async def count(counter: str) -> int:
        durable = topology.progress_durable(job, counter)
        try:
            info = await js.consumer_info(topology.EVENTS_STREAM, durable)
        except nats.js.errors.NotFoundError:
            info = None
        if info is not None and info.delivered is not None and info.delivered.consumer_seq:
            try:
                await js.delete_consumer(topology.EVENTS_STREAM, durable)
            except nats.js.errors.NotFoundError:
                pass
            info = None
        if info is None or info.config.filter_subject != topology.progress_counter_filter(job, plan, counter):
            info = await topology.ensure_progress_counter(js, job, plan, counter)
        return info.num_pending or 0

    found = dict(zip(topology.PROGRESS_COUNTERS, await asyncio.gather(*map(count, topology.PROGRESS_COUNTERS))))
    return ProgressCounts(
        samples_uploaded=found["uploaded"],
        batches_done=found["written"],
        samples_outside_plan=found["uploaded-extra"],
        events_other_plan=(found["uploaded-any"] - found["uploaded"]) + (found["written-any"] - found["written"]),
        samples_requeued=found["requeued"],
    )


async def last_sequence(js: JetStreamContext, stream: str, subject_filter: str) -> int:
    """The stream sequence of the newest message under `subject_filter` (0: none); one direct read."""
    try:
        return (await js.get_last_msg(stream, subject_filter)).seq
    except nats.js.errors.NotFoundError:
        return 0


def _epoch(stamp: datetime.datetime | None) -> float | None:
    return None if stamp is None else stamp.timestamp()


async def marker_times(js: JetStreamContext, job: str, plan: str) -> tuple[float | None, float | None]:
    """(when the job's first planned `written` marker was stored, when its newest planned
    `uploaded` marker was), as the server's clock says; None where there is none. Two direct reads."""
    plan = plan or "none"
    try:
        first = await js.get_msg(
            topology.EVENTS_STREAM, seq=1, subject=topology.progress_counter_filter(job, plan, "written"), next=True
        )
        started = _epoch(first.time)
    except nats.js.errors.NotFoundError:
        started = None
    try:
        last = await js.get_last_msg(topology.EVENTS_STREAM, topology.progress_counter_filter(job, plan, "uploaded"))
        finished = _epoch(last.time)
    except nats.js.errors.NotFoundError:
        finished = None
    return started, finished


async def recent_upload_rate(
    js: JetStreamContext, job: str, plan: str, *, window_s: float, started_at: float | None
) -> float | None:
    """Samples uploaded per second over the last `window_s` (or since `started_at`, the job's first
    marker, when that is more recent); None before anything was written."""
    if started_at is None:
        return None
    now = time.time()
    span = min(window_s, now - started_at)
    if span <= 1.0:
        return None
    since = datetime.datetime.fromtimestamp(now - span, tz=datetime.UTC)
    uploaded = await count_stored(
        js, topology.EVENTS_STREAM, topology.progress_counter_filter(job, plan or "none", "uploaded"), since=since
    )
    return uploaded / span


async def find_marker(js: JetStreamContext, subject: Callable[..., str], job: str, plan: str, name: int | str):
    """The marker of batch or sample `name` of `plan` (`subject`: topology.written_subject or
    uploaded_subject), planned or (outside the plan) set aside; None when there is none."""
    for planned in (True, False):
        try:
            return await js.get_last_msg(topology.EVENTS_STREAM, subject(job, plan or "none", name, planned=planned))
        except nats.js.errors.NotFoundError:
            pass
    return None


async def has_uploaded_marker(js: JetStreamContext, job: str, plan: str, index: int) -> bool:
    """Whether sample `index` has an `uploaded` marker of `plan`: whether it is in the
    destination, as the job's journal says."""
    return await find_marker(js, topology.uploaded_subject, job, plan, index) is not None
