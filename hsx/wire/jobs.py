"""A job in NATS: its spec in the `hsx_jobs` KV bucket, its durables, and whether its workers look alive.

A worker counts as alive when its last heartbeat (every 5 s) is younger than LIVE_HEARTBEAT_S and
is not its goodbye (`stopping`), or when one of the job's durables has a pull request waiting at
the server (a worker fetching right now; this catches workers too old to send heartbeats). A
worker killed without a goodbye keeps the job "alive" for LIVE_HEARTBEAT_S, the time after which
the monitor calls it silent.
"""

import asyncio
import difflib
import logging
import re
import time
from urllib.parse import unquote, urlsplit

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from hsx.errors import HsxError
from hsx.job import FINAL, STORED_DTYPE_FORM, JobSpec
from hsx.logs import get_logger
from hsx.wire import schemas, topology
from hsx.wire.events import heard_heartbeat
from hsx.wire.natsconn import NATS_OUTAGE_ERRORS, through_outage

log = get_logger("hsx.jobs")


async def read_job_spec(kv: KeyValue, job: str) -> JobSpec | None:
    try:
        entry = await kv.get(job)
    except nats.js.errors.KeyNotFoundError:
        return None
    return decode_job_spec(entry.value, job=job)


def decode_job_spec(data: bytes, *, job: str) -> JobSpec:
    """The spec stored under key `job`, checked (its fields' own checks are schemas'): one line
    naming the job and the field when it is not a spec the producer could have written."""
    try:
        spec = schemas.job_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise HsxError(f"job {job}: the job spec in KV bucket hsx_jobs does not decode ({exc})") from None
    problem = _spec_problem(spec, job)
    if problem:
        raise HsxError(f"job {job}: the job spec in KV bucket hsx_jobs is refused: {problem}")
    return spec


_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")


def _dest_form(dest: str) -> bool:
    """Whether `dest` has the shape of a destination URL as the producer writes one (a Location's
    canonical form, hsx/storage/location.py): `scheme://bucket/prefix`, or `scheme:///absolute/dir`
    with no host, with no empty or dot segment, no trailing slash, query or fragment. Which
    schemes there are and each one's own rules are the destination registry's
    (hsx/storage/destinations/), below this floor: a spec naming a scheme this hsx has none of is
    refused, in one line, where its `dest` is opened (`spec_location`)."""
    try:
        split = urlsplit(dest)
    except ValueError:  # a bracket that opens no IPv6 host: no URL the producer writes
        return False
    # A local path is read percent-decoded (hsx.storage.location): the segments are checked as
    # they would be used, so that `%2E%2E` is a `..` and `%00` a NUL, whatever the store.
    path = unquote(split.path)
    segments = path.strip("/").split("/") if path.strip("/") else []
    if any(segment in ("", ".", "..") for segment in segments) or split.query or split.fragment or "\x00" in path:
        return False
    if not _SCHEME.fullmatch(split.scheme) or not dest.startswith(f"{split.scheme}://"):
        return False
    if split.netloc:
        return not split.path.endswith("/")
    return split.path.startswith("/")


def _spec_problem(spec: JobSpec, key: str) -> str:
    if spec.job != key:
        return f"`job` is {spec.job!r}, not its key"
    if not re.fullmatch(STORED_DTYPE_FORM, spec.dtype):
        return f"`dtype` {spec.dtype!r} is not an encoding's name"
    if not _dest_form(spec.dest):
        return f"`dest` {spec.dest!r} is not a destination URL (scheme://bucket/prefix or file:///absolute/dir)"
    layers = [layer for layer in spec.layers if layer != FINAL]
    if len(set(spec.layers)) != len(spec.layers):
        return f"`layers` {spec.layers} names a layer twice"
    if spec.num_layers and any(layer >= spec.num_layers for layer in layers):
        return f"`layers` {spec.layers} goes past the model's {spec.num_layers} decoder layers"
    starts = spec.round_starts
    if starts and (
        starts[0] != 0 or any(a >= b for a, b in zip(starts, starts[1:])) or starts[-1] >= max(1, spec.total_samples)
    ):
        return (
            f"`round_starts` {starts[:5]}... are not increasing rounds from 0 within its {spec.total_samples} samples"
        )
    return ""


async def require_job_spec(kv: KeyValue, job: str) -> JobSpec:
    spec = await read_job_spec(kv, job)
    if spec is None:
        near = near_job(job, await job_names(kv))
        guess = f"did you mean {near}? " if near else ""
        raise HsxError(f"job {job} not found in KV bucket hsx_jobs ({guess}run hsx produce --job {job} first)")
    return spec


def near_job(job: str, names: list[str]) -> str | None:
    """The job of `names` closest to `job`, when close enough to be what a typo in --job meant."""
    near = difflib.get_close_matches(job, [name for name in names if name != job], n=1, cutoff=0.75)
    return near[0] if near else None


async def wait_for_job_spec(kv: KeyValue, job: str, stopping: asyncio.Event, *, poll_s: float = 2.0) -> JobSpec | None:
    """The job's spec once the producer has recorded it; None if asked to stop first."""
    announced = False
    while not stopping.is_set():
        # A JetStream leader lost or a server restarting while a worker starts (503, timeouts):
        # ridden out like any outage, not a traceback.
        try:
            spec = await through_outage(lambda: read_job_spec(kv, job), what="read the job spec", stopping=stopping)
        except NATS_OUTAGE_ERRORS:
            if stopping.is_set():
                return None
            raise
        if spec is not None:
            return spec
        if not announced:
            log.info("waiting_for_job_spec", job=job, bucket="hsx_jobs")
            announced = True
        try:
            await asyncio.wait_for(stopping.wait(), timeout=poll_s)
        except TimeoutError:
            pass
    return None


# How often a worker waiting for its job says so again, with the jobs that exist.
WAIT_REPORT_S = 30.0


async def job_names(kv: KeyValue) -> list[str]:
    """The jobs the KV bucket hsx_jobs holds, sorted."""
    try:
        return sorted(await kv.keys())
    except nats.js.errors.NoKeysError:
        return []


def _named(names: list[str]) -> str:
    return ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "") if names else "none"


async def wait_for_job(
    kv: KeyValue,
    job: str,
    stopping: asyncio.Event,
    *,
    wait_s: float | None = None,
    given_wait_s: float | None = None,  # the --wait-for-job the error names (wait_s is what is left of it)
    poll_s: float = 0.5,  # a KV read: cheap, and a worker started beside its producer starts sooner
    report_every_s: float = WAIT_REPORT_S,
) -> JobSpec | None:
    """The job's spec once the producer has recorded it; None if asked to stop first. While it
    waits it says so at once and every `report_every_s` (`waiting_for_job_spec`, with the jobs
    that exist: a typo in --job shows); past `wait_s` (None: no bound) it gives up with one line
    naming the job and the jobs that exist (HsxError)."""
    started = time.monotonic()
    reported = None
    while not stopping.is_set():
        # A JetStream leader lost or a server restarting while a worker starts (503, timeouts):
        # ridden out like any outage, not a traceback.
        try:
            spec = await through_outage(lambda: read_job_spec(kv, job), what="read the job spec", stopping=stopping)
        except NATS_OUTAGE_ERRORS:
            if stopping.is_set():
                return None
            raise
        if spec is not None:
            if reported is not None:
                log.info("job_spec_found", job=job, waited_s=round(time.monotonic() - started, 1))
            return spec
        waited = time.monotonic() - started
        if wait_s is not None and waited >= wait_s:
            names = await job_names(kv)
            near = near_job(job, names)
            raise HsxError(
                f"job {job} not found in KV bucket hsx_jobs after waiting {given_wait_s or wait_s:g} s (--wait-for-job); "
                + (f"did you mean {near}? " if near else "")
                + f"jobs there: {_named(names)} (run hsx produce --job {job} first, or check --job)"
            )
        if reported is None or time.monotonic() - reported >= report_every_s:
            names = await through_outage(lambda: job_names(kv), what="list the jobs", stopping=stopping)
            near = near_job(job, names)
            log.log(
                logging.WARNING if near else logging.INFO,
                "waiting_for_job_spec",
                job=job,
                bucket="hsx_jobs",
                waited_s=round(waited),
                jobs=names[:20],
                did_you_mean=near,
                wait_for_job_s=wait_s,
                hint=(f"did you mean {near}? " if near else "")
                + f"hsx produce --job {job} records it; a job named otherwise is not this one",
            )
            reported = time.monotonic()
        timeout = poll_s if wait_s is None else max(0.0, min(poll_s, wait_s - waited))
        try:
            await asyncio.wait_for(stopping.wait(), timeout=timeout)
        except TimeoutError:
            pass
    return None


# The monitor's default --silent-after: a heartbeat older than this is a worker gone.
LIVE_HEARTBEAT_S = 30.0


async def count_messages(js: JetStreamContext, stream: str, subject: str) -> int:
    try:
        info = await js.stream_info(stream, subjects_filter=subject)
    except nats.js.errors.NotFoundError:
        return 0
    return sum((info.state.subjects or {}).values())


async def job_durables(js: JetStreamContext, job: str) -> list[tuple[str, str]]:
    """(stream, durable) of every durable of the job that exists."""
    found = []
    for stream, durable in (
        (topology.BATCHES_STREAM, topology.gpu_durable(job)),
        (topology.ADVISORIES_STREAM, topology.exhausted_durable(job)),
        *((topology.EVENTS_STREAM, topology.progress_durable(job, counter)) for counter in topology.PROGRESS_COUNTERS),
    ):
        try:
            await js.consumer_info(stream, durable)
            found.append((stream, durable))
        except nats.js.errors.NotFoundError:
            pass
    # One upload durable per node, each filtered to hsx.files.<job>.<node>; matched by the filter,
    # not the name (`upload-a-b-n` could be job `a` on node `b-n` or job `a-b` on node `n`).
    offset = 0
    while True:
        page = await js.consumers_info(topology.FILES_STREAM, offset=offset)
        found += [
            (topology.FILES_STREAM, info.name)
            for info in page
            if (info.config.filter_subject or "").split(".")[2:3] == [job]
        ]
        offset += len(page)
        if len(page) < 256:  # the server's page size
            return found


async def last_heartbeats(js: JetStreamContext, job: str) -> list[schemas.Heartbeat]:
    """The last heartbeat of each of the job's workers (one subject each), oldest worker first."""
    subject = topology.heartbeats_subject_all(job)
    try:
        info = await js.stream_info(topology.STATE_STREAM, subjects_filter=subject)
    except nats.js.errors.NotFoundError:  # streams of an older hsx: no heartbeat of this one is stored
        return []
    beats = []
    for beat_subject in sorted(info.state.subjects or {}):
        try:
            msg = await js.get_last_msg(topology.STATE_STREAM, beat_subject)
        except nats.js.errors.NotFoundError:
            continue
        beat = heard_heartbeat(
            msg.data, subject=msg.subject, stored_at=msg.time.timestamp() if msg.time else None, job=job
        )
        if beat is not None:
            beats.append(beat)
    return beats


async def waiting_files(js: JetStreamContext, job: str) -> dict[str, int]:
    """Files announced and not yet uploaded, per node: they lie in that node's spool."""
    try:
        info = await js.stream_info(topology.FILES_STREAM, subjects_filter=topology.files_subject_all(job))
    except nats.js.errors.NotFoundError:
        return {}
    # hsx.files.<job>.<node>: a job name and a node name are one subject token each.
    return {subject.split(".")[3]: count for subject, count in sorted((info.state.subjects or {}).items()) if count}


async def live_workers(js: JetStreamContext, job: str, *, now: float | None = None) -> list[str]:
    """The job's workers that look alive, each as `instance (service on node, last heartbeat N s
    ago)` or `durable D: N pull requests waiting`."""
    now = time.time() if now is None else now
    alive = [
        f"{beat.instance} ({beat.service} on {beat.node}, last heartbeat {max(0.0, now - beat.sent_at):.0f} s ago)"
        for beat in await last_heartbeats(js, job)
        if beat.state != "stopping" and now - beat.sent_at < LIVE_HEARTBEAT_S
    ]
    for stream, durable in await job_durables(js, job):
        try:
            waiting = (await js.consumer_info(stream, durable)).num_waiting or 0
        except nats.js.errors.NotFoundError:
            continue
        if waiting:
            alive.append(f"durable {durable}: {waiting} pull requests waiting")
    return alive
