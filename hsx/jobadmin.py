"""`hsx jobs list` and `hsx jobs delete`: the jobs NATS holds, and removing one so that its name
can be used again.

A job lives in NATS in: its spec (KV bucket `hsx_jobs`), its stored samples and input report
(object store `hsx_datasets`), its messages in HSX_BATCHES, HSX_FILES, HSX_EVENTS, HSX_DEAD and
HSX_ADVISORIES (`topology.job_subjects`), and its durables (`gpu-<job>`, `upload-<job>-<node>`,
`exhausted-<job>`). Deleting removes all of that; the files already in the destination are the
job's output and stay where they are.

A job whose workers are alive is not deleted unless forced: its consumers and uploaders would
lose their durables under them. A worker counts as alive when its last heartbeat (every 5 s) is
younger than LIVE_HEARTBEAT_S and is not its goodbye (`stopping`), or when one of the job's
durables has a pull request waiting at the server (a worker fetching right now; this catches
workers too old to send heartbeats). A worker killed without a goodbye keeps the job "alive"
for LIVE_HEARTBEAT_S, the time after which the monitor calls it silent.
"""

import asyncio
import json
import time
from datetime import datetime, timezone

import msgspec
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from hsx import schemas, topology
from hsx.errors import HsxError
from hsx.jobs import read_job_spec
from hsx.natsconn import NatsSettings, connect

log = structlog.get_logger("hsx.jobs")

# The monitor's default --silent-after: a heartbeat older than this is a worker gone.
LIVE_HEARTBEAT_S = 30.0


async def count_messages(js: JetStreamContext, stream: str, subject: str) -> int:
    try:
        info = await js.stream_info(stream, subjects_filter=subject)
    except nats.js.errors.NotFoundError:
        return 0
    return sum((info.state.subjects or {}).values())


async def _durables(js: JetStreamContext, job: str) -> list[tuple[str, str]]:
    """(stream, durable) of every durable of the job that exists."""
    found = []
    for stream, durable in ((topology.BATCHES_STREAM, topology.gpu_durable(job)),
                            (topology.ADVISORIES_STREAM, topology.exhausted_durable(job)),
                            *((topology.EVENTS_STREAM, topology.progress_durable(job, counter))
                              for counter in topology.PROGRESS_COUNTERS)):
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
        found += [(topology.FILES_STREAM, info.name) for info in page
                  if (info.config.filter_subject or "").split(".")[2:3] == [job]]
        offset += len(page)
        if len(page) < 256:  # the server's page size
            return found


async def live_workers(js: JetStreamContext, job: str, *, now: float | None = None) -> list[str]:
    """The job's workers that look alive, each as `instance (service on node, last heartbeat N s
    ago)` or `durable D: N pull requests waiting`."""
    now = time.time() if now is None else now
    alive = []
    subject = topology.heartbeats_subject_all(job)
    try:
        info = await js.stream_info(topology.EVENTS_STREAM, subjects_filter=subject)
    except nats.js.errors.NotFoundError:
        info = None
    for beat_subject in sorted((info.state.subjects or {}) if info else {}):
        try:
            msg = await js.get_last_msg(topology.EVENTS_STREAM, beat_subject)
            beat = schemas.event_decoder.decode(msg.data)
        except (nats.js.errors.NotFoundError, msgspec.DecodeError):
            continue
        if isinstance(beat, schemas.Heartbeat) and beat.state != "stopping" and now - beat.sent_at < LIVE_HEARTBEAT_S:
            alive.append(f"{beat.instance} ({beat.service} on {beat.node}, last heartbeat "
                         f"{max(0.0, now - beat.sent_at):.0f} s ago)")
    for stream, durable in await _durables(js, job):
        try:
            waiting = (await js.consumer_info(stream, durable)).num_waiting or 0
        except nats.js.errors.NotFoundError:
            continue
        if waiting:
            alive.append(f"durable {durable}: {waiting} pull requests waiting")
    return alive


def _created(spec: schemas.JobSpec) -> str:
    return datetime.fromtimestamp(spec.created_at, timezone.utc).isoformat(timespec="seconds")


async def _job_names(kv: KeyValue) -> list[str]:
    try:
        return sorted(await kv.keys())
    except nats.js.errors.NoKeysError:
        return []


async def list_jobs(js: JetStreamContext, kv: KeyValue) -> list[dict]:
    jobs = []
    for name in await _job_names(kv):
        row: dict = {"job": name}
        try:
            spec = await read_job_spec(kv, name)
        except HsxError as exc:
            row["error"] = str(exc)
            jobs.append(row)
            continue
        if spec is None:  # deleted since the keys were listed
            continue
        row.update(
            published=spec.published, total_samples=spec.total_samples, total_batches=spec.total_batches,
            batches_queued=await count_messages(js, topology.BATCHES_STREAM, topology.batch_subject(name)),
            files_queued=await count_messages(js, topology.FILES_STREAM, topology.files_subject_all(name)),
            dest=spec.dest, model=spec.model, created=_created(spec), created_at=spec.created_at,
        )
        jobs.append(row)
    return jobs


def format_jobs(jobs: list[dict], *, as_json: bool) -> str:
    if as_json:
        return json.dumps(jobs)
    if not jobs:
        return "no jobs"
    header = ("job", "published", "samples", "batches queued", "files queued", "created", "dest")
    rows = [
        (job["job"], "-", "-", "-", "-", "-", job["error"]) if "error" in job else
        (job["job"], "yes" if job["published"] else "no", str(job["total_samples"]), str(job["batches_queued"]),
         str(job["files_queued"]), job["created"], job["dest"])
        for job in jobs
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1]
                     for row in [header, *rows])


async def delete_job(js: JetStreamContext, kv: KeyValue, job: str, *, force: bool) -> dict:
    """Remove everything NATS holds of `job`; refuse while its workers are alive unless `force`.
    The spec goes last, so a delete that stops half-way still lists the job and can be run again."""
    from hsx.tokens import report_object_name, tokens_object_name

    try:
        spec = await read_job_spec(kv, job)
    except HsxError:  # a spec that does not decode is deleted like any other
        spec = None
    subjects = topology.job_subjects(job)
    messages = {stream: await count_messages(js, stream, subject) for stream, subject in subjects.items()}
    durables = await _durables(js, job)
    store = await topology.ensure_datasets_store(js)
    objects = {tokens_object_name(job), report_object_name(job)}
    if spec is not None:
        objects |= {name for name in (spec.tokenized_object, spec.report_object) if name}
    stored = []
    for name in sorted(objects):
        try:
            info = await store.get_info(name)
        except nats.js.errors.NotFoundError:
            continue
        if not info.deleted:
            stored.append(name)
    in_kv = spec is not None or await _has_key(kv, job)
    if not (in_kv or any(messages.values()) or durables or stored):
        raise HsxError(f"job {job} not found: nothing in KV bucket {topology.JOBS_BUCKET}, the hsx streams or "
                       f"object store {topology.DATASETS_BUCKET} (hsx jobs list shows the jobs)")
    if not force:
        alive = await live_workers(js, job)
        if alive:
            raise HsxError(f"job {job} has {len(alive)} live workers: {'; '.join(alive[:5])}"
                           f"{' ...' if len(alive) > 5 else ''}; stop them first, or pass --force")
    # Durables first: a worker still bound (with --force) then gets no more of the job's messages.
    for stream, durable in durables:
        try:
            await js.delete_consumer(stream, durable)
        except nats.js.errors.NotFoundError:
            pass
    for stream, subject in topology.job_subjects(job).items():
        if messages[stream]:
            await js.purge_stream(stream, subject=subject)
    for name in stored:
        try:
            await store.delete(name)
        except nats.js.errors.NotFoundError:
            pass
    if in_kv:
        await kv.purge(job)
    summary = {
        "job": job, "messages": messages, "durables": [durable for _, durable in durables], "objects": stored,
        "spec": in_kv, "dest": spec.dest if spec else None, "forced": force,
    }
    log.info("job_deleted", **summary)
    return summary


async def _has_key(kv: KeyValue, job: str) -> bool:
    try:
        await kv.get(job)
        return True
    except nats.js.errors.KeyNotFoundError:
        return False


def format_deleted(summary: dict, *, as_json: bool) -> str:
    if as_json:
        return json.dumps(summary)
    purged = ", ".join(f"{count} from {stream}" for stream, count in summary["messages"].items() if count) or "none"
    lines = [
        f"deleted job {summary['job']}: messages {purged}; durables {', '.join(summary['durables']) or 'none'}; "
        f"objects {', '.join(summary['objects']) or 'none'}; job spec {'yes' if summary['spec'] else 'none'}",
    ]
    if summary["dest"]:
        lines.append(f"files already in {summary['dest']} were not deleted")
    return "\n".join(lines)


async def _with_jetstream(settings: NatsSettings, name: str, action):
    nc = await connect(settings, name=name)
    try:
        js = nc.jetstream()
        kv = await topology.ensure_topology(js)
        return await action(js, kv)
    finally:
        await nc.drain()


def run_list(settings: NatsSettings, *, as_json: bool) -> int:
    jobs = asyncio.run(_with_jetstream(settings, "hsx-jobs-list", list_jobs))
    print(format_jobs(jobs, as_json=as_json))
    return 0


def run_delete(settings: NatsSettings, job: str, *, force: bool, as_json: bool) -> int:
    summary = asyncio.run(_with_jetstream(
        settings, f"hsx-jobs-delete-{job}", lambda js, kv: delete_job(js, kv, job, force=force)))
    print(format_deleted(summary, as_json=as_json))
    return 0
