"""`hsx jobs list` and `hsx jobs delete`: the jobs NATS holds, and removing everything NATS holds of
one (not its output in the destination) so that its name can be used again; refused while the
job's workers are alive or its files wait in a spool, unless forced.
"""

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path

import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from hsx.errors import HsxError
from hsx.exitcodes import DONE
from hsx.job import JobSpec
from hsx.storage.spool import plan_folder
from hsx.wire import topology
from hsx.wire.jobs import count_messages, job_durables, last_heartbeats, live_workers, read_job_spec, waiting_files
from hsx.wire.natsconn import NatsSettings, connect

log = structlog.get_logger("hsx.jobs")


def _created(spec: JobSpec) -> str:
    return datetime.fromtimestamp(spec.created_at, UTC).isoformat(timespec="seconds")


async def _job_names(kv: KeyValue) -> list[str]:
    try:
        return sorted(await kv.keys())
    except nats.js.errors.NoKeysError:
        return []


async def list_jobs(js: JetStreamContext, kv: KeyValue | None) -> list[dict]:
    jobs = []
    for name in await _job_names(kv) if kv is not None else []:
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
            published=spec.published,
            total_samples=spec.total_samples,
            total_batches=spec.total_batches,
            batches_queued=await count_messages(js, topology.BATCHES_STREAM, topology.batch_subject(name)),
            files_queued=await count_messages(js, topology.FILES_STREAM, topology.files_subject_all(name)),
            dest=spec.dest,
            model=spec.model,
            created=_created(spec),
            created_at=spec.created_at,
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
        (job["job"], "-", "-", "-", "-", "-", job["error"])
        if "error" in job
        else (
            job["job"],
            "yes" if job["published"] else "no",
            str(job["total_samples"]),
            str(job["batches_queued"]),
            str(job["files_queued"]),
            job["created"],
            job["dest"],
        )
        for job in jobs
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1] for row in [header, *rows]
    )


async def delete_job(js: JetStreamContext, kv: KeyValue | None, job: str, *, force: bool) -> dict:
    """Remove everything NATS holds of `job`; refuse while its workers are alive unless `force`.
    The spec goes last, so a delete that stops half-way still lists the job and can be run again."""
    from hsx.storage.tokens import digests_object_name, report_object_name, tokens_object_name

    not_found = HsxError(
        f"job {job} not found: nothing in KV bucket {topology.JOBS_BUCKET}, the hsx streams or "
        f"object store {topology.DATASETS_BUCKET} (hsx jobs list shows the jobs)"
    )
    if kv is None:  # no producer ever ran on this server: it holds no job
        raise not_found
    try:
        spec = await read_job_spec(kv, job)
    except HsxError:  # a spec that does not decode is deleted like any other
        spec = None
    subjects = topology.job_subjects(job)
    messages = {stream: await count_messages(js, stream, subject) for stream, subject in subjects.items()}
    durables = await job_durables(js, job)
    store = await topology.datasets_store(js)
    objects = {tokens_object_name(job), report_object_name(job), digests_object_name(job)}
    if spec is not None:
        objects |= {name for name in (spec.tokenized_object, spec.report_object) if name}
    stored = []
    for name in sorted(objects) if store is not None else []:
        try:
            info = await store.get_info(name)
        except nats.js.errors.NotFoundError:
            continue
        if not info.deleted:
            stored.append(name)
    in_kv = spec is not None or await _has_key(kv, job)
    if not (in_kv or any(messages.values()) or durables or stored):
        raise not_found
    if not force:
        alive = await live_workers(js, job)
        if alive:
            raise HsxError(
                f"job {job} has {len(alive)} live workers: {'; '.join(alive[:5])}"
                f"{' ...' if len(alive) > 5 else ''}; stop them first, or pass --force"
            )
    waiting = await waiting_files(js, job)
    if waiting and not force:
        raise HsxError(
            f"job {job} has {sum(waiting.values())} files waiting for upload in the spools of "
            f"{_per_node(waiting)}; run its uploaders there until they are uploaded (hsx upload --job {job}), "
            "or pass --force to delete them with the job"
        )
    spools = await _spool_folders(js, job, spec) if waiting else {}
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
        "job": job,
        "messages": messages,
        "durables": [durable for _, durable in durables],
        "objects": stored,
        "spec": in_kv,
        "dest": spec.dest if spec else None,
        "forced": force,
        "files_waiting": waiting,  # node -> files that were waiting for upload there
        "spool_folders": spools,  # node -> where they lie, as the node's workers last said
    }
    log.info("job_deleted", **summary)
    return summary


def _per_node(counts: dict[str, int]) -> str:
    return ", ".join(f"node {node} ({count})" for node, count in counts.items())


async def _spool_folders(js: JetStreamContext, job: str, spec: JobSpec | None) -> dict[str, list[str]]:
    """Per node, the folders holding the job's spooled files, from its workers' last heartbeats."""
    folders: dict[str, set[str]] = {}
    for beat in await last_heartbeats(js, job):
        if beat.spool:
            folder = plan_folder(Path(beat.spool), job, spec.plan_tag) if spec else Path(beat.spool) / job
            folders.setdefault(beat.node, set()).add(str(folder))
    return {node: sorted(paths) for node, paths in sorted(folders.items())}


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
    if summary["files_waiting"]:
        waiting = summary["files_waiting"]
        where = "; ".join(
            f"node {node}: {count} in {', '.join(summary['spool_folders'].get(node, [])) or 'its spool (no worker said where)'}"
            for node, count in waiting.items()
        )
        lines.append(
            f"{sum(waiting.values())} files were waiting for upload ({where}); the job's workers still running there "
            f"remove them as they stop, as does the next worker of a job named {summary['job']} on that node; "
            "otherwise remove those folders by hand"
        )
    if summary["dest"]:
        lines.append(f"files already in {summary['dest']} were not deleted")
    return "\n".join(lines)


async def _with_jetstream(settings: NatsSettings, name: str, action):
    nc = await connect(settings, name=name)
    try:
        js = nc.jetstream()
        return await action(js, await topology.jobs_bucket(js))
    finally:
        await nc.drain()


def run_list(settings: NatsSettings, *, as_json: bool) -> int:
    jobs = asyncio.run(_with_jetstream(settings, "hsx-jobs-list", list_jobs))
    print(format_jobs(jobs, as_json=as_json))
    return DONE


def run_delete(settings: NatsSettings, job: str, *, force: bool, as_json: bool) -> int:
    summary = asyncio.run(
        _with_jetstream(settings, f"hsx-jobs-delete-{job}", lambda js, kv: delete_job(js, kv, job, force=force))
    )
    print(format_deleted(summary, as_json=as_json))
    return DONE
