"""What each hsx role may publish and subscribe to on NATS: least privilege, built from the
topology's own names (hsx/wire/topology.py), for `hsx nats-config` and the tests that run a job
with each role's credentials.

A role is what one kind of process does: `producer` (`hsx produce`: it alone creates and updates
the streams and buckets), `consumer` (`hsx consume`), `uploader` (`hsx upload`), `monitor` (the
views: `hsx monitor`, `status`, `jobs list`, `dead list`, `verify`, `index build`), `trainer` (a
`JobStream` following a job) and `admin` (`hsx jobs delete`, `hsx dead retry`, and `hsx up`, which
runs every role: the union of the others and the deletes). Each permission names a subject of
the job (`jobs`, "*" for every job) where hsx's names allow it: message subjects, durable names,
a consumer create's filter (nats-py names the filter in the create subject when the consumer has
a name), ack subjects. Where NATS cannot scope by job, the subject is the stream's, and
docs/operations/roles.md, "Least privilege: one NATS user per role", says what that leaves open. This
module knows names and roles, not users, passwords or files.
"""

import base64
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hsx.wire import topology

ROLES = ("producer", "consumer", "uploader", "monitor", "trainer", "admin")
ANY = "*"

_HSX_STREAMS = (
    topology.BATCHES_STREAM,
    topology.FILES_STREAM,
    topology.EVENTS_STREAM,
    topology.STATE_STREAM,
    topology.DEAD_STREAM,
    topology.ADVISORIES_STREAM,
)
_KV = topology.kv_stream(topology.JOBS_BUCKET)
_OBJ = topology.object_store_stream(topology.DATASETS_BUCKET)
_ALL_STREAMS = (*_HSX_STREAMS, _KV, _OBJ)


@dataclass(frozen=True, kw_only=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def inbox_prefix(user: str) -> str:
    """The reply subjects of `user`'s connections (HSX_NATS_INBOX_PREFIX): each role subscribes
    to its own inboxes only, so no role reads another's replies (fetched batches, specs)."""
    return f"_INBOX.{user}"


def _api(*tokens: str) -> str:
    return "$JS.API." + ".".join(tokens)


def _named(name: str, job: str) -> str:
    """A durable's name of `job` as a permission token: "*" for every job (a name such as
    `gpu-<job>` is one token, and NATS wildcards only whole tokens)."""
    return ANY if job == ANY else name


def _create(stream: str, name: str, filter_subject: str) -> str:
    """The create of a named consumer with its filter, as nats-py sends it: the server checks
    that the request's filter is the subject's, so the filter scopes the create."""
    return _api("CONSUMER", "CREATE", stream, name, filter_subject)


def _pull_durable(stream: str, name: str, filter_subject: str) -> list[str]:
    """Create, look up, fetch from and ack a durable pull consumer."""
    return [
        _create(stream, name, filter_subject),
        _api("CONSUMER", "INFO", stream, name),
        _api("CONSUMER", "MSG", "NEXT", stream, name),
        f"$JS.ACK.{stream}.{name}.>",
    ]


def _ordered(stream: str) -> list[str]:
    """An ordered (ephemeral push) consumer on `stream`: nats-py creates it unnamed, so its
    filter travels in the request body and cannot be scoped; the server's flow control asks
    for replies on $JS.FC."""
    return [_api("CONSUMER", "CREATE", stream), _api("CONSUMER", "INFO", stream, ANY), f"$JS.FC.{stream}.>"]


def _object_meta(name: str) -> str:
    # nats-py's object store keeps an object's metadata on $O.<bucket>.M.<urlsafe base64 name>.
    return f"$O.{topology.DATASETS_BUCKET}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def _base(job: str) -> list[str]:
    """Every role: find the streams and buckets, read the job's spec, list the jobs (a worker
    waiting for its job names those there are)."""
    return [
        _api("STREAM", "NAMES"),
        *(_api("STREAM", "INFO", stream) for stream in _ALL_STREAMS),
        _api("STREAM", "MSG", "GET", _KV),
        _api("DIRECT", "GET", _KV, f"$KV.{topology.JOBS_BUCKET}.{job}"),
        *_ordered(_KV),
    ]


def _datasets_read() -> list[str]:
    """Read an object of the datasets store (a job's tokenized samples, its input report)."""
    return [_api("STREAM", "MSG", "GET", _OBJ), *_ordered(_OBJ)]


def _counters(job: str) -> list[str]:
    """Read the job's counting durables, and make one again when it is missing, filtered to
    another plan, or was fetched from (hsx/wire/counts.py `read_counts`)."""
    if job == ANY:
        names = [ANY]
    else:
        names = [topology.progress_durable(job, counter) for counter in topology.PROGRESS_COUNTERS]
    return [
        permission
        for name in names
        for permission in (
            _api("CONSUMER", "INFO", topology.EVENTS_STREAM, name),
            _create(topology.EVENTS_STREAM, name, f"hsx.events.{job}.>"),
            _api("CONSUMER", "DELETE", topology.EVENTS_STREAM, name),
        )
    ]


def _verdict(job: str) -> list[str]:
    """Whether the job is over (hsx/wire/worker.py `JobVerdict`, which workers with --until-done
    and a trainer's stream read): queues, counts, dead letters, the dead samples' markers."""
    return [
        _api("CONSUMER", "INFO", topology.BATCHES_STREAM, _named(topology.gpu_durable(job), job)),
        _api("CONSUMER", "LIST", topology.FILES_STREAM),
        *_counters(job),
        _api("STREAM", "MSG", "GET", topology.EVENTS_STREAM),
        _api("STREAM", "MSG", "GET", topology.DEAD_STREAM),
        *_ordered(topology.DEAD_STREAM),
    ]


def _follow(job: str) -> list[str]:
    """A reading of the job's sums and heartbeats (`hsx monitor`, `hsx status`, `hsx index
    build`): replays of its markers, a count over a window; the heartbeats and the checkpoint it
    reads and saves on HSX_STATE."""
    return [
        *_verdict(job),
        *_ordered(topology.EVENTS_STREAM),
        _create(topology.EVENTS_STREAM, ANY, f"hsx.events.{job}.>"),  # counts.count_stored
        _api("CONSUMER", "DELETE", topology.EVENTS_STREAM, ANY),  # its consumer, when read
        *_ordered(topology.STATE_STREAM),
        _api("STREAM", "MSG", "GET", topology.STATE_STREAM),
        topology.checkpoint_subject(job),
    ]


def _live_workers(job: str) -> list[str]:
    """Whether the job has live workers or work in hand (a producer re-run, `hsx jobs delete`)."""
    return [
        _api("CONSUMER", "INFO", topology.ADVISORIES_STREAM, _named(topology.exhausted_durable(job), job)),
        _api("CONSUMER", "INFO", topology.FILES_STREAM, ANY),
        _api("STREAM", "MSG", "GET", topology.STATE_STREAM),  # the workers' last heartbeats
    ]


def _producer(job: str, nodes: Sequence[str]) -> list[str]:
    objects = (
        [topology.tokens_object_name(job), topology.report_object_name(job), topology.digests_object_name(job)]
        if job != ANY
        else []
    )
    return [
        *_base(job),
        *_datasets_read(),
        *_follow(job),
        *_live_workers(job),
        *(_api("STREAM", action, stream) for stream in _ALL_STREAMS for action in ("CREATE", "UPDATE")),
        f"$KV.{topology.JOBS_BUCKET}.{job}",
        f"$O.{topology.DATASETS_BUCKET}.C.>",  # chunks go under a random id
        *([_object_meta(name) for name in objects] or [f"$O.{topology.DATASETS_BUCKET}.M.>"]),
        _api("STREAM", "PURGE", _OBJ),  # storing an object again drops its old chunks
        _api("STREAM", "MSG", "GET", topology.BATCHES_STREAM),  # a re-run reads what is queued
        topology.batch_subject(job),
    ]


def _consumer(job: str, nodes: Sequence[str]) -> list[str]:
    durable = _named(topology.gpu_durable(job), job)
    reaper = _named(topology.exhausted_durable(job), job)
    return [
        *_base(job),
        *_datasets_read(),
        *_verdict(job),
        *_pull_durable(topology.BATCHES_STREAM, durable, topology.batch_subject(job)),
        *_pull_durable(
            topology.ADVISORIES_STREAM, reaper, topology.max_deliveries_subject(topology.BATCHES_STREAM, durable)
        ),
        # The reaper reads an exhausted batch and removes it once dead-lettered (by sequence:
        # NATS scopes these to the stream, not to a subject).
        _api("STREAM", "MSG", "GET", topology.BATCHES_STREAM),
        _api("STREAM", "MSG", "DELETE", topology.BATCHES_STREAM),
        *(topology.file_subject(job, node) for node in nodes),
        f"hsx.events.{job}.written.>",
        topology.heartbeat_subject(job, topology.CONSUMER_SERVICE, ANY),
        topology.dead_subject(job, "batch"),
        # A batch handed back on its last delivery goes back as a fresh copy (hsx/wire/jetstream.py give_back).
        topology.batch_subject(job),
    ]


def _uploader(job: str, nodes: Sequence[str]) -> list[str]:
    durables = [
        permission
        for node in nodes
        for permission in _pull_durable(
            topology.FILES_STREAM,
            ANY if ANY in (job, node) else topology.upload_durable(job, node),
            topology.file_subject(job, node),
        )
    ]
    return [
        *_base(job),
        *_datasets_read(),
        *_verdict(job),
        *durables,
        f"hsx.events.{job}.uploaded.>",
        f"hsx.events.{job}.replaced.>",
        topology.event_subject(job, "requeued"),
        topology.heartbeat_subject(job, topology.UPLOADER_SERVICE, ANY),
        topology.dead_subject(job, "file"),
        # A sample lost from the spool goes back for extraction as a batch of its own.
        topology.batch_subject(job),
    ]


def _monitor(job: str, nodes: Sequence[str]) -> list[str]:
    return [*_base(job), *_datasets_read(), *_follow(job)]


def _trainer(job: str, nodes: Sequence[str], *, stream: str = ANY) -> list[str]:
    return [
        *_base(job),
        *_verdict(job),
        # The feed's own consumer (hsx/wire/landed.py): named at random, filtered to the job's markers.
        _create(topology.EVENTS_STREAM, ANY, f"hsx.events.{job}.uploaded.>"),
        _api("CONSUMER", "MSG", "NEXT", topology.EVENTS_STREAM, ANY),
        _api("CONSUMER", "DELETE", topology.EVENTS_STREAM, ANY),
        # The first epoch's end of a stream, recorded by its ranks (topology.epoch_end_subject):
        # of every stream of the job, or of `stream` alone (its own trainer user), whatever the plan.
        f"hsx.events.{job}.epoch.>" if stream == ANY else topology.epoch_end_subject(job, ANY, stream),
    ]


def _admin(job: str, nodes: Sequence[str]) -> list[str]:
    objects = (
        [topology.tokens_object_name(job), topology.report_object_name(job), topology.digests_object_name(job)]
        if job != ANY
        else []
    )
    return [
        *(permission for role in _BUILDERS.values() if role is not _admin for permission in role(job, nodes)),
        # hsx jobs delete: the job's durables, its messages, its objects and its spec.
        *(_api("CONSUMER", "DELETE", stream, ANY) for stream in _HSX_STREAMS),
        *(_api("STREAM", "PURGE", stream) for stream in (*_HSX_STREAMS, _KV)),
        *([_object_meta(name) for name in objects] or [f"$O.{topology.DATASETS_BUCKET}.M.>"]),
        # hsx dead retry: a letter goes back to its job's batch or file subject, then leaves HSX_DEAD.
        topology.files_subject_all(job),
        _api("STREAM", "MSG", "DELETE", topology.DEAD_STREAM),
    ]


_BUILDERS = {
    "producer": _producer,
    "consumer": _consumer,
    "uploader": _uploader,
    "monitor": _monitor,
    "trainer": _trainer,
    "admin": _admin,
}


def _unique(subjects: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(subjects))


def role_permissions(
    role: str, *, user: str, jobs: Sequence[str] = (ANY,), nodes: Sequence[str] = (ANY,), stream: str = ANY
) -> Permissions:
    """What `role` may publish and subscribe to for `jobs` (ANY: every job) on `nodes` (ANY:
    every node; it scopes the consumers' file subjects and the uploaders' durables), connecting
    as `user` (whose inboxes it subscribes to). `stream` (trainer only): the one JobStream name
    whose epoch's end the user may record (ANY: every stream's)."""
    if role not in _BUILDERS:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    if stream != ANY and role != "trainer":
        raise ValueError(f"a stream scopes the trainer role only, not {role!r}")
    jobs = [ANY] if ANY in jobs or not jobs else [topology.check_name(job, "--job") for job in jobs]
    nodes = [ANY] if ANY in nodes or not nodes else [topology.check_name(node, "--node") for node in nodes]
    build = _BUILDERS[role]
    if stream != ANY:
        build = functools.partial(_trainer, stream=topology.check_name(stream, "--trainer-stream"))
    publish = _unique(permission for job in jobs for permission in build(job, nodes))
    return Permissions(publish=publish, subscribe=(f"{inbox_prefix(user)}.>",))
