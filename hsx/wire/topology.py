"""The JetStream topology, declared once: every stream, subject, consumer and bucket name is built
here and nowhere else (names are part of the user interface: `nats stream ls` and `nats consumer
ls HSX_BATCHES` show them), with the streams' and consumers' settings. The producer creates the
streams and buckets idempotently (`ensure_topology`); every other process looks them up
(`jobs_bucket`, `wait_for_jobs_bucket`, `datasets_store`) and creates only its own durables.

All the names: docs/operations/nats.md, "Streams, subjects, consumers and buckets"; notes in
docs/architecture/wire.md.
"""

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    ConsumerInfo,
    DeliverPolicy,
    DiscardPolicy,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from hsx.errors import HsxError, Unavailable
from hsx.logs import get_logger
from hsx.wire import denials
from hsx.wire.natsconn import OUTAGE_RETRY_S

log = get_logger("hsx.topology")

T = TypeVar("T")

BATCHES_STREAM = "HSX_BATCHES"
FILES_STREAM = "HSX_FILES"
EVENTS_STREAM = "HSX_EVENTS"
# What only its last message of a subject matters for: workers' heartbeats, the progress checkpoint.
STATE_STREAM = "HSX_STATE"
DEAD_STREAM = "HSX_DEAD"
# JetStream's own advisories for messages that used up max_deliver, kept so none is lost while no
# hsx process listens (hsx/wire/exhausted.py acts on them).
ADVISORIES_STREAM = "HSX_ADVISORIES"
JOBS_BUCKET = "hsx_jobs"
# Object store: each job's tokenized dataset (`<job>.tokens.arrow`) and input report (`<job>.report.json`).
DATASETS_BUCKET = "hsx_datasets"

DAY = 24 * 3600.0

# Deliveries of one message before it is dead-lettered. A batch fails for real (bad token id,
# a model that cannot take it) far less often than a GPU process dies holding it, so give it room.
BATCH_MAX_DELIVER = 5
# File events are delivered without limit. Every delivery is idempotent, a failing upload is
# retried inside the uploader (keeping the event alive), and a bad event is dead-lettered at once,
# so only uploaders dying or NATS outages use deliveries up. A cap would strand the event: after
# the last delivery JetStream keeps it in the work queue but never hands it out again, and the
# job could never finish (10 uploader restarts on a node over a long run would be enough).
FILE_MAX_DELIVER = -1
# Redelivery happens this long after the last sign of life; busy workers send in_progress()
# well inside it, so only a dead worker's message is redelivered.
BATCH_ACK_WAIT_S = 60.0
FILE_ACK_WAIT_S = 60.0

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_name(value: str, what: str) -> str:
    """Job and node names become NATS subject tokens and consumer names."""
    if not _NAME_RE.match(value):
        raise HsxError(
            f"invalid {what} {value!r}: use 1-64 letters, digits, '-' or '_' (it becomes a NATS subject token)"
        )
    return value


def job_name(text: str) -> str:
    """The parser of --job."""
    return check_name(text, "--job")


def node_name(raw: str) -> str:
    """A host name made safe as a subject token (dots and other characters become '-')."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", raw)[:64] or "node"


def batch_subject(job: str) -> str:
    return f"hsx.batches.{job}"


def file_subject(job: str, node: str) -> str:
    return f"hsx.files.{job}.{node}"


def files_subject_all(job: str) -> str:
    return f"hsx.files.{job}.*"


def event_subject(job: str, kind: str) -> str:
    return f"hsx.events.{job}.{kind}"


# Progress markers (hsx/wire/counts.py counts them): one subject per planned batch written and per
# planned sample uploaded, each stored at most once (`ONCE_HEADERS`), so JetStream's count of a
# filter's subjects is the number of distinct batches or samples, read in constant time. What is
# not of the plan (a re-queued sample's batch, a sample index outside the plan) goes under
# `<plan>.extra.`, which the plan's counting filter (`<plan>.*`, one token) does not match.
EXTRA = "extra"


def written_subject(job: str, plan: str, batch_id: str, *, planned: bool = True) -> str:
    return f"hsx.events.{job}.written.{plan or 'none'}.{'' if planned else EXTRA + '.'}{batch_id}"


def uploaded_subject(job: str, plan: str, index: int, *, planned: bool = True) -> str:
    return f"hsx.events.{job}.uploaded.{plan or 'none'}.{'' if planned else EXTRA + '.'}{index}"


def replaced_subject(job: str, plan: str, index: int | str) -> str:
    """A sample's later upload that stored its object again after its `uploaded` marker (its
    digest may differ: a redone extraction is not always bit-identical); the index takes the
    newest. Not a marker: counted nowhere."""
    return f"hsx.events.{job}.replaced.{plan or 'none'}.{index}"


def marker_filter(job: str, kind: str, plan: str = "*", *, extra: bool = False) -> str:
    """The markers of `kind` ("written" | "uploaded") of `plan` ("*": every plan): the planned
    ones, or with `extra` those set aside."""
    return f"hsx.events.{job}.{kind}.{plan}.{EXTRA + '.*' if extra else '*'}"


def markers_all(job: str, kind: str, plan: str) -> str:
    """Every marker of `kind` of `plan`, planned and extra, in stream order (what the sums fold)."""
    return f"hsx.events.{job}.{kind}.{plan}.>"


# The durables that count a job's markers (hsx/wire/counts.py `read_counts`): never fetched from, so
# each one's num_pending is the number of messages under its filter, kept current by the server
# and read with one cheap request (creating a consumer per reading would cost a cluster a
# meta-layer proposal each time). Name -> (kind, plan or "*", extra); "requeued" counts events.
PROGRESS_COUNTERS: dict[str, tuple[str, str, bool]] = {
    "uploaded": ("uploaded", "<plan>", False),
    "uploaded-any": ("uploaded", "*", False),
    "uploaded-extra": ("uploaded", "<plan>", True),
    "written": ("written", "<plan>", False),
    "written-any": ("written", "*", False),
    "requeued": ("requeued", "", False),
}


def progress_durable(job: str, counter: str) -> str:
    return f"progress-{job}-{counter}"


def progress_counter_filter(job: str, plan: str, counter: str) -> str:
    kind, which, extra = PROGRESS_COUNTERS[counter]
    if kind == "requeued":
        return event_subject(job, kind)
    return marker_filter(job, kind, plan if which == "<plan>" else which, extra=extra)


# The objects of a job in bucket hsx_datasets (producer/stored.py writes them).
def tokens_object_name(job: str) -> str:
    return f"{job}.tokens.arrow"


def report_object_name(job: str) -> str:
    return f"{job}.report.json"


def digests_object_name(job: str) -> str:
    """The digests of the job's samples the spec names (hsx/storage/sampledigest.py), in index
    order: stored again, grown, before each round is recorded."""
    return f"{job}.digests"


def epoch_end_subject(job: str, plan: str, stream: str) -> str:
    """Where the ranks of a trainer's stream of `plan` record the first epoch's end: every rank,
    whenever it starts, ends the epoch at the first valid record there (hsx/wire/epochend.py)."""
    return f"hsx.events.{job}.epoch.{plan or 'none'}.{stream}"


def checkpoint_subject(job: str) -> str:
    """The job's progress checkpoint (hsx/wire/fold.py): HSX_STATE keeps its last save only."""
    return f"hsx.state.{job}.checkpoint"


# A marker is published only if its subject holds no message yet: a redelivered batch or a
# re-uploaded sample is recorded once, and its sums are counted once.
ONCE_HEADERS = {"Nats-Expected-Last-Subject-Sequence": "0"}
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code when that expectation fails


# The services that send heartbeats, as their heartbeats' subjects name them: a role may then beat
# for its own service only (hsx/wire/permissions.py).
CONSUMER_SERVICE = "gpu_consumer"
UPLOADER_SERVICE = "uploader"


def heartbeat_subject(job: str, service: str, instance: str) -> str:
    """One worker's heartbeats: HSX_STATE keeps its last one only."""
    return f"hsx.state.{job}.heartbeat.{service}.{instance}"


def heartbeats_subject_all(job: str) -> str:
    return f"hsx.state.{job}.heartbeat.>"


def dead_subject(job: str, what: str) -> str:
    return f"hsx.dead.{job}.{what}"


def dead_subject_all(job: str) -> str:
    return f"hsx.dead.{job}.*"


def job_subjects(job: str) -> dict[str, str]:
    """Stream -> the subject filter holding every message of `job` there: what `hsx jobs delete`
    purges. A job name is one subject token, so `hsx.events.<job>.>` holds no other job's."""
    return {
        BATCHES_STREAM: batch_subject(job),
        FILES_STREAM: f"hsx.files.{job}.>",
        EVENTS_STREAM: f"hsx.events.{job}.>",
        STATE_STREAM: f"hsx.state.{job}.>",
        DEAD_STREAM: f"hsx.dead.{job}.>",
        ADVISORIES_STREAM: max_deliveries_subject(BATCHES_STREAM, gpu_durable(job)),
    }


def max_deliveries_subject(stream: str, durable: str) -> str:
    """The subject of the server's advisory for a message of `durable` that used up max_deliver."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{durable}"


def exhausted_durable(job: str) -> str:
    return f"exhausted-{job}"


def gpu_durable(job: str) -> str:
    return f"gpu-{job}"


def upload_durable(job: str, node: str) -> str:
    return f"upload-{job}-{node}"


STREAMS: tuple[StreamConfig, ...] = (
    StreamConfig(
        name=BATCHES_STREAM,
        description="hsx batch descriptors: one message per batch of samples to extract",
        subjects=["hsx.batches.>"],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        # The producer also records completion in the job spec, so a re-run after the window
        # still publishes nothing; the window covers concurrent producers.
        duplicate_window=DAY,
        discard=DiscardPolicy.OLD,
    ),
    StreamConfig(
        name=FILES_STREAM,
        description="hsx file-ready events: one per sample file waiting in a node's spool",
        subjects=["hsx.files.>"],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        duplicate_window=120.0,
    ),
    StreamConfig(
        name=EVENTS_STREAM,
        description="hsx progress markers and events, folded by the monitor and `hsx status`",
        subjects=["hsx.events.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        # No age limit: `done` is folded from every `written`/`uploaded` event since the job began,
        # so a long job, or one paused for weeks and resumed, must not lose its early events.
        # Retention follows the job: `hsx jobs delete` purges its subjects.
        max_age=0,
        # No rollups: a message with `Nats-Rollup: all` would erase every job's markers, and a
        # subject permission cannot refuse a header. Set on a stream an older hsx made too (the
        # server takes the update in place; it had rollups for heartbeats, now in HSX_STATE).
        allow_rollup_hdrs=False,
    ),
    StreamConfig(
        name=STATE_STREAM,
        description="hsx heartbeats and progress checkpoints: the last message of each subject",
        subjects=["hsx.state.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        # Heartbeats are sent for as long as a worker runs: the per-subject limit keeps each
        # worker's last one, and the checkpoint's last save, with no header needed to say so.
        max_msgs_per_subject=1,
        max_age=0,
        allow_rollup_hdrs=False,
    ),
    StreamConfig(
        name=DEAD_STREAM,
        description="hsx dead letters: messages that failed max_deliver times, with their error",
        subjects=["hsx.dead.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        # No age limit either: a letter is the only record of its samples (`hsx status` calls the
        # job failed from it, `hsx dead retry` resends it); it goes with the job, or when retried.
        max_age=0,
        # A letter's message id is its payload's stream and sequence: the consumer on its last
        # delivery and the exhausted-message reaper may both store one; only the first is kept.
        duplicate_window=DAY,
    ),
    StreamConfig(
        name=ADVISORIES_STREAM,
        description="hsx: JetStream's advisories for hsx messages that used up their deliveries, until dead-lettered",
        subjects=[max_deliveries_subject(BATCHES_STREAM, "*"), max_deliveries_subject(FILES_STREAM, "*")],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_age=90 * DAY,
    ),
)


def kv_stream(bucket: str) -> str:
    """The stream behind a KV bucket, as `nats stream ls --all` shows it."""
    return f"KV_{bucket}"


def object_store_stream(bucket: str) -> str:
    """The stream behind an object store bucket, as `nats stream ls --all` shows it."""
    return f"OBJ_{bucket}"


_STREAM_EXISTS_DIFFERENTLY = 10058  # JetStream error code: stream name in use with another configuration


# JetStream's error code while a cluster has no metadata leader (an election after a server died
# takes seconds): wait. A 503 without it, or no responder at all, means no JetStream: say so.
_JETSTREAM_TEMPORARILY_UNAVAILABLE = 10008
_JETSTREAM_UNAVAILABLE = (nats.errors.TimeoutError, asyncio.TimeoutError, nats.js.errors.ServiceUnavailableError)


async def while_unavailable(operation: Callable[[], Awaitable[T]], *, what: str) -> T:
    """Run an idempotent topology operation, waiting out a JetStream that does not answer yet (up
    to OUTAGE_RETRY_S): a service started while a cluster elects new leaders waits, not exits."""
    started = time.monotonic()
    while True:
        try:
            return await operation()
        except _JETSTREAM_UNAVAILABLE as exc:
            denials.raise_if_denied(started, what=what)  # no outage: this role's user may not do it
            no_jetstream = isinstance(exc, nats.js.errors.ServiceUnavailableError) and (
                exc.err_code != _JETSTREAM_TEMPORARILY_UNAVAILABLE
            )
            if no_jetstream:
                raise HsxError(
                    f"NATS has no JetStream for hsx ({exc.description or 'nothing answers the JetStream API'}) "
                    f"while setting up {what}: start nats-server with JetStream (-js, or a jetstream {{}} block) "
                    "and enable it for the account hsx uses"
                ) from None
            if time.monotonic() - started >= OUTAGE_RETRY_S:
                raise Unavailable(
                    f"JetStream did not answer for {OUTAGE_RETRY_S:.0f} s while setting up {what} "
                    f"({exc}); in a cluster, check that a majority of the servers are up"
                ) from None
            log.warning("jetstream_unavailable", what=what, error=str(exc) or type(exc).__name__, retry_in_s=1.0)
            await asyncio.sleep(1.0)


async def ensure_topology(js: JetStreamContext, *, replicas: int | None = None) -> KeyValue:
    """Create or update every stream and both buckets; return the jobs bucket.

    `replicas` is how many servers of a JetStream cluster hold each stream and bucket (R1 on a
    single server, R3 on a three-node cluster). None keeps whatever exists and creates R1: only
    the process given --replicas changes it, so a consumer started without the flag never
    scales a replicated stream back down. Consumers inherit their stream's replica count."""
    return await while_unavailable(lambda: _ensure_topology(js, replicas), what="the hsx streams and buckets")


async def _ensure_topology(js: JetStreamContext, replicas: int | None) -> KeyValue:
    try:
        for config in STREAMS:
            await _ensure_stream(js, config, replicas)
        await _ensure_datasets_store(js, replicas)
        return await _ensure_jobs_bucket(js, replicas)
    except nats.js.errors.APIError as exc:
        unavailable = isinstance(exc, _JETSTREAM_UNAVAILABLE)
        if replicas and replicas > 1 and not unavailable and exc.err_code != _STREAM_EXISTS_DIFFERENTLY:
            raise HsxError(
                f"--replicas {replicas}: JetStream refused it ({exc.description}); replicated streams need a "
                f"JetStream cluster of at least {replicas} servers (docs/operations/multi-node.md)"
            ) from None
        raise


# Only the producer (and `hsx up`, through it) creates and updates the streams and buckets; every
# other process looks them up: each role's NATS user may create nothing but its own consumers
# (hsx/wire/permissions.py). The jobs bucket is created last, so once it exists the rest does.


async def jobs_bucket(js: JetStreamContext) -> KeyValue | None:
    """The jobs bucket, or None when no producer has made the topology on this server yet. Each
    stream is asked for once, as creating it would: on a cluster that is electing leaders (a
    server died) the process waits here for every stream to answer, not at its first read."""
    try:
        kv = await while_unavailable(lambda: js.key_value(JOBS_BUCKET), what=f"bucket {JOBS_BUCKET}")
    except nats.js.errors.BucketNotFoundError:
        return None
    for config in STREAMS:
        try:
            await while_unavailable(lambda name=config.name: js.stream_info(name), what=f"stream {config.name}")
        except nats.js.errors.NotFoundError:  # made by an older producer: the next run of this one adds it
            log.warning("stream_missing", stream=config.name, fix="run hsx produce of this version once")
    return kv


async def require_jobs_bucket(js: JetStreamContext, job: str) -> KeyValue:
    """The jobs bucket; an HsxError naming the job when there is none (nothing produced here)."""
    kv = await jobs_bucket(js)
    if kv is None:
        raise HsxError(f"job {job} not found in KV bucket {JOBS_BUCKET} (run hsx produce --job {job} first)")
    return kv


async def wait_for_jobs_bucket(
    js: JetStreamContext, job: str, stopping: asyncio.Event, *, poll_s: float = 0.5, wait_s: float | None = None
) -> KeyValue | None:
    """The jobs bucket, once some producer has made it on this server (a worker started before
    any job waits for it, saying so once); None if asked to stop first; past `wait_s` (None: no
    bound, as --wait-for-job) an HsxError naming the job."""
    started, announced = time.monotonic(), False
    while not stopping.is_set():
        kv = await jobs_bucket(js)
        if kv is not None:
            return kv
        waited = time.monotonic() - started
        if wait_s is not None and waited >= wait_s:
            raise HsxError(
                f"job {job} not found in KV bucket {JOBS_BUCKET} after waiting {wait_s:g} s (--wait-for-job): "
                f"no job was ever produced on this server (run hsx produce --job {job} first, or check --nats)"
            )
        if not announced:
            log.info("waiting_for_job_spec", job=job, bucket=JOBS_BUCKET)
            announced = True
        timeout = poll_s if wait_s is None else max(0.0, min(poll_s, wait_s - waited))
        try:
            await asyncio.wait_for(stopping.wait(), timeout=timeout)
        except TimeoutError:
            pass
    return None


async def datasets_store(js: JetStreamContext) -> ObjectStore | None:
    """The object store of tokenized datasets and reports, looked up; None when it does not exist."""
    try:
        return await while_unavailable(lambda: js.object_store(DATASETS_BUCKET), what=f"bucket {DATASETS_BUCKET}")
    except nats.js.errors.BucketNotFoundError:
        return None


async def ensure_datasets_store(js: JetStreamContext) -> ObjectStore:
    """Return the object store bucket of tokenized datasets and reports, created if missing (R1;
    `ensure_topology` has usually created it already, with the replicas asked for): the
    producer's, which stores them."""
    return await while_unavailable(lambda: _ensure_datasets_store(js, None), what=f"bucket {DATASETS_BUCKET}")


async def _replicas_of(js: JetStreamContext, stream: str) -> int | None:
    try:
        return (await js.stream_info(stream)).config.num_replicas or 1
    except nats.js.errors.NotFoundError:
        return None


async def _ensure_stream(js: JetStreamContext, config: StreamConfig, replicas: int | None) -> None:
    wanted = replace(config, num_replicas=replicas or await _replicas_of(js, config.name) or 1)
    try:
        await js.add_stream(wanted)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != _STREAM_EXISTS_DIFFERENTLY:
            raise
        await js.update_stream(wanted)
        log.info("stream_updated", stream=config.name, replicas=wanted.num_replicas)


async def _scale_bucket(js: JetStreamContext, stream: str, replicas: int | None) -> None:
    """A KV or object store bucket is a stream: scale it like one when asked to."""
    if replicas is None:
        return
    info = await js.stream_info(stream)
    if (info.config.num_replicas or 1) != replicas:
        await js.update_stream(replace(info.config, num_replicas=replicas))
        log.info("stream_updated", stream=stream, replicas=replicas)


async def _ensure_jobs_bucket(js: JetStreamContext, replicas: int | None) -> KeyValue:
    try:
        kv = await js.key_value(JOBS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_key_value(
            bucket=JOBS_BUCKET,
            description="hsx job specs, key = job name",
            history=1,
            storage=StorageType.FILE,
            replicas=replicas or 1,
        )
    await _scale_bucket(js, kv_stream(JOBS_BUCKET), replicas)
    return kv


async def _ensure_datasets_store(js: JetStreamContext, replicas: int | None) -> ObjectStore:
    try:
        store = await js.object_store(DATASETS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_object_store(
            DATASETS_BUCKET,
            config=ObjectStoreConfig(
                description="hsx tokenized datasets (<job>.tokens.arrow) and input reports (<job>.report.json)",
                storage=StorageType.FILE,
                replicas=replicas or 1,
            ),
        )
    await _scale_bucket(js, object_store_stream(DATASETS_BUCKET), replicas)
    return store


# Durables are created with `name` as well as `durable_name`: nats-py then sends the create on
# $JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>, whose subject names the job twice, so a role's
# NATS user can be allowed its own job's durables and no other (hsx/wire/permissions.py).


async def ensure_gpu_consumer(js: JetStreamContext, job: str, *, ack_wait_s: float = BATCH_ACK_WAIT_S) -> str:
    durable = gpu_durable(job)
    await while_unavailable(
        lambda: js.add_consumer(
            BATCHES_STREAM,
            ConsumerConfig(
                name=durable,
                durable_name=durable,
                description=f"GPU extraction workers of job {job}",
                filter_subject=batch_subject(job),
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=ack_wait_s,
                max_deliver=BATCH_MAX_DELIVER,
                max_ack_pending=10_000,
            ),
        ),
        what=f"consumer {durable}",
    )
    return durable


async def ensure_exhausted_consumer(js: JetStreamContext, job: str) -> str:
    """The durable over the job's max-deliveries advisories, shared by every GPU consumer of the job."""
    durable = exhausted_durable(job)
    await while_unavailable(
        lambda: js.add_consumer(
            ADVISORIES_STREAM,
            ConsumerConfig(
                name=durable,
                durable_name=durable,
                description=f"batches of job {job} that used up their deliveries, to dead-letter",
                filter_subject=max_deliveries_subject(BATCHES_STREAM, gpu_durable(job)),
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=30.0,
                max_deliver=-1,
            ),
        ),
        what=f"consumer {durable}",
    )
    return durable


async def ensure_progress_counter(js: JetStreamContext, job: str, plan: str, counter: str) -> ConsumerInfo:
    """The counting durable `counter` of `job`, created or (another plan under the job's name)
    re-filtered; its info, whose num_pending is the count."""
    config = ConsumerConfig(
        name=progress_durable(job, counter),
        durable_name=progress_durable(job, counter),
        filter_subject=progress_counter_filter(job, plan, counter),
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.ALL,
        mem_storage=True,
        description=f"hsx: counts {counter} markers of job {job} (never fetched from)",
    )
    return await while_unavailable(
        lambda: js.add_consumer(EVENTS_STREAM, config), what=f"counter {progress_durable(job, counter)}"
    )


async def ensure_upload_consumer(
    js: JetStreamContext, job: str, node: str, *, ack_wait_s: float = FILE_ACK_WAIT_S
) -> str:
    durable = upload_durable(job, node)
    await while_unavailable(
        lambda: js.add_consumer(
            FILES_STREAM,
            ConsumerConfig(
                name=durable,
                durable_name=durable,
                description=f"uploaders of job {job} on node {node}",
                filter_subject=file_subject(job, node),
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=ack_wait_s,
                max_deliver=FILE_MAX_DELIVER,
                max_ack_pending=100_000,
            ),
        ),
        what=f"consumer {durable}",
    )
    return durable
