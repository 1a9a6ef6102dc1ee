"""The JetStream topology, declared once and created idempotently at every service's start-up.

Names are part of the user interface (`nats stream ls`, `nats consumer ls HSX_BATCHES` show them),
so every stream, subject, consumer and bucket name is built here and nowhere else.

Consumers are created with `add_consumer` and then bound (never implicitly by `pull_subscribe`,
which silently keeps an old config). Work-queue streams allow one consumer per subject, so workers
scale by binding many processes to one durable:

- `gpu-<job>` on HSX_BATCHES, filtered to `hsx.batches.<job>`: every GPU process of the job.
- `upload-<job>-<node>` on HSX_FILES, filtered to `hsx.files.<job>.<node>`: every uploader of a node,
  because only that node's spool holds those files.
"""

import re

import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from hsx.errors import HsxError

log = structlog.get_logger("hsx.topology")

BATCHES_STREAM = "HSX_BATCHES"
FILES_STREAM = "HSX_FILES"
EVENTS_STREAM = "HSX_EVENTS"
DEAD_STREAM = "HSX_DEAD"
JOBS_BUCKET = "hsx_jobs"
# Object store: each job's tokenized dataset (`<job>.tokens.arrow`) and input report (`<job>.report.json`).
DATASETS_BUCKET = "hsx_datasets"

DAY = 24 * 3600.0

# Deliveries of one message before it is dead-lettered. A batch fails for real (bad token id,
# a model that cannot take it) far less often than a GPU process dies holding it, so give it room.
BATCH_MAX_DELIVER = 5
FILE_MAX_DELIVER = 10
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


def heartbeat_subject(job: str, instance: str) -> str:
    return f"hsx.events.{job}.heartbeat.{instance}"


def heartbeats_subject_all(job: str) -> str:
    return f"hsx.events.{job}.heartbeat.>"


def dead_subject(job: str, what: str) -> str:
    return f"hsx.dead.{job}.{what}"


def dead_subject_all(job: str) -> str:
    return f"hsx.dead.{job}.*"


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
        description="hsx progress events and heartbeats, folded by the monitor and `hsx status`",
        subjects=["hsx.events.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=30 * DAY,
    ),
    StreamConfig(
        name=DEAD_STREAM,
        description="hsx dead letters: messages that failed max_deliver times, with their error",
        subjects=["hsx.dead.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=90 * DAY,
    ),
)


async def ensure_topology(js: JetStreamContext) -> KeyValue:
    """Create or update every stream and the jobs bucket; return the bucket."""
    for config in STREAMS:
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != 10058:  # stream name already in use with a different configuration
                raise
            await js.update_stream(config)
            log.info("stream_updated", stream=config.name)
    try:
        return await js.key_value(JOBS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_key_value(
            bucket=JOBS_BUCKET, description="hsx job specs, key = job name", history=1,
            storage=StorageType.FILE,
        )


async def ensure_datasets_store(js: JetStreamContext) -> ObjectStore:
    """Create (idempotently) and return the object store bucket of tokenized datasets and reports."""
    try:
        return await js.object_store(DATASETS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_object_store(
            DATASETS_BUCKET,
            config=ObjectStoreConfig(
                description="hsx tokenized datasets (<job>.tokens.arrow) and input reports (<job>.report.json)",
                storage=StorageType.FILE,
            ),
        )


async def ensure_gpu_consumer(js: JetStreamContext, job: str, *, ack_wait_s: float = BATCH_ACK_WAIT_S) -> str:
    durable = gpu_durable(job)
    await js.add_consumer(
        BATCHES_STREAM,
        ConsumerConfig(
            durable_name=durable,
            description=f"GPU extraction workers of job {job}",
            filter_subject=batch_subject(job),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait_s,
            max_deliver=BATCH_MAX_DELIVER,
            max_ack_pending=10_000,
        ),
    )
    return durable


async def ensure_upload_consumer(
    js: JetStreamContext, job: str, node: str, *, ack_wait_s: float = FILE_ACK_WAIT_S
) -> str:
    durable = upload_durable(job, node)
    await js.add_consumer(
        FILES_STREAM,
        ConsumerConfig(
            durable_name=durable,
            description=f"uploaders of job {job} on node {node}",
            filter_subject=file_subject(job, node),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait_s,
            max_deliver=FILE_MAX_DELIVER,
            max_ack_pending=100_000,
        ),
    )
    return durable
