"""The job bundle: everything resuming a job on another machine needs, beside its samples under
`<dest>/<job>/_hsx/` (`job.json`, `tokens.arrow`, `plan.json`, `report.json`). `claim_folder`
writes `job.json` alone before the first descriptor, `write_bundle` the whole bundle once the job
is published (again on every re-run: what is missing or different), and `remove_replaced`
deletes another plan's bundle files when `--replace-output` takes its folder. This module knows
the bundle's layout; the producer decides when to write it.

The files and when each is written: docs/operations/resume.md, "The job bundle" and "Jobs: what the
producer checks, re-runs, and reusing a name".
"""

import asyncio
import hashlib
import json
import tempfile
from pathlib import Path

import structlog
from nats.js import JetStreamContext

from hsx.errors import HsxError
from hsx.job import JobSpec, plan_batch_id
from hsx.packing import PlannedBatch
from hsx.storage.destinations import error_line, store_errors
from hsx.storage.index import INDEX_FILE
from hsx.storage.layout import TOKENS_FILE, bundle_key
from hsx.storage.location import Location, open_destination, spec_location
from hsx.storage.tokens import download
from hsx.wire import schemas

log = structlog.get_logger("hsx.producer")

PLAN_FORMAT = "hsx.plan.v1"
SPEC_FILE = "job.json"
PLAN_FILE = "plan.json"
REPORT_FILE = "report.json"
# What removing a replaced plan's bundle deletes, the index first: no reader may take it for the
# new job. job.json is not deleted but overwritten, by the new job's claim.
REPLACED_FILES = (INDEX_FILE, PLAN_FILE, TOKENS_FILE, REPORT_FILE)


def plan_document(spec: JobSpec, batches: list[PlannedBatch], *, max_batch_size: int | None) -> dict:
    return {
        "format": PLAN_FORMAT,
        "job": spec.job,
        "plan_fingerprint": spec.plan_fingerprint,
        "token_budget": spec.token_budget,
        "max_batch_size": max_batch_size,
        "total_samples": spec.total_samples,
        "batches": [
            {
                "batch_id": plan_batch_id(spec.job, spec.plan_fingerprint, seq),
                "padded_len": batch.padded_len,
                "sample_indices": list(batch.sample_indices),
            }
            for seq, batch in enumerate(batches)
        ],
    }


async def _bundle_files(
    js: JetStreamContext, spec: JobSpec, batches: list[PlannedBatch], max_batch_size: int | None, folder: Path
) -> dict[str, Path]:
    """Every bundle file, as a file in `folder`: the stored objects are copied there from the
    object store (streamed; the samples object of a large job is gigabytes)."""
    files = {
        SPEC_FILE: schemas.encode(spec),
        PLAN_FILE: json.dumps(
            plan_document(spec, batches, max_batch_size=max_batch_size), separators=(",", ":")
        ).encode(),
    }
    paths = {}
    for name, data in files.items():
        paths[name] = folder / name
        paths[name].write_bytes(data)
    # Jobs made before the samples were stored have neither object; their bundle lacks them too.
    for name, obj in ((TOKENS_FILE, spec.tokenized_object), (REPORT_FILE, spec.report_object)):
        if obj:
            paths[name] = folder / name
            with open(paths[name], "wb") as file:
                await download(js, obj, file)
    return paths


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _put_missing(location: Location, job: str, files: dict[str, Path]) -> tuple[list[str], int]:
    """Put each file whose key does not already hold its bytes; (the names written, their bytes)."""
    dest = open_destination(location, max_connections=4)
    written, size = [], 0
    for name, path in files.items():
        key = bundle_key(job, name)
        length, digest = path.stat().st_size, _sha256(path)
        if dest.has_sha256(key, size=length, sha256=digest):
            continue
        dest.put_file_verified(path, key, size=length, sha256=digest)
        written.append(name)
        size += length
    return written, size


async def write_bundle(
    js: JetStreamContext, spec: JobSpec, batches: list[PlannedBatch], *, max_batch_size: int | None
) -> None:
    with tempfile.TemporaryDirectory(prefix="hsx-bundle-") as folder:
        files = await _bundle_files(js, spec, batches, max_batch_size, Path(folder))
        try:
            written, size = await asyncio.to_thread(_put_missing, spec_location(spec.dest), spec.job, files)
        except store_errors() as exc:
            raise HsxError(
                f"job {spec.job} is published, but writing its bundle to {spec.dest}/{bundle_key(spec.job, '')} "
                f"failed ({error_line(exc)}); run hsx produce again to retry"
            ) from exc
    log.info(
        "bundle_written",
        job=spec.job,
        dest=spec.dest,
        prefix=bundle_key(spec.job, ""),
        written=written,
        unchanged=sorted(set(files) - set(written)),
        bytes=size,
    )


def claim_folder(spec: JobSpec) -> None:
    """Put `spec` as the bundle's job.json unless it is there already: before the first descriptor."""
    data = schemas.encode(spec)
    key = bundle_key(spec.job, SPEC_FILE)
    try:
        dest = open_destination(spec_location(spec.dest), max_connections=1)
        if not dest.has_sha256(key, size=len(data), sha256=hashlib.sha256(data).hexdigest()):
            dest.put_bytes_verified(data, key)
    except store_errors() as exc:
        raise HsxError(
            f"job {spec.job}: writing its spec to {spec.dest}/{key} failed ({error_line(exc)}); "
            "no batch was published; run hsx produce again to retry"
        ) from exc


def remove_replaced(location: Location, job: str) -> list[str]:
    """Delete the bundle files of the plan whose folder a new job takes over (REPLACED_FILES);
    their keys. Deleting a key that is not there is no error."""
    keys = [bundle_key(job, name) for name in REPLACED_FILES]
    try:
        dest = open_destination(location, max_connections=1)
        for key in keys:
            dest.delete(key)
    except store_errors() as exc:
        raise HsxError(
            f"job {job}: removing the replaced plan's bundle from {location}/{bundle_key(job, '')} failed "
            f"({error_line(exc)}); nothing was published; run hsx produce again to retry"
        ) from exc
    return keys
