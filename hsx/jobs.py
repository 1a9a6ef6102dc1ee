"""Reading job specs from the `hsx_jobs` KV bucket."""

import asyncio

import msgspec
import nats.js.errors
import structlog
from nats.js.kv import KeyValue

from hsx import schemas
from hsx.errors import HsxError

log = structlog.get_logger("hsx.jobs")


async def read_job_spec(kv: KeyValue, job: str) -> schemas.JobSpec | None:
    try:
        entry = await kv.get(job)
    except nats.js.errors.KeyNotFoundError:
        return None
    try:
        return schemas.job_decoder.decode(entry.value)
    except msgspec.DecodeError as exc:
        raise HsxError(f"job {job}: the job spec in KV bucket hsx_jobs does not decode ({exc})") from None


async def require_job_spec(kv: KeyValue, job: str) -> schemas.JobSpec:
    spec = await read_job_spec(kv, job)
    if spec is None:
        raise HsxError(f"job {job} not found in KV bucket hsx_jobs (run hsx produce --job {job} first)")
    return spec


async def wait_for_job_spec(kv: KeyValue, job: str, stopping: asyncio.Event, *, poll_s: float = 2.0) -> schemas.JobSpec | None:
    """The job's spec once the producer has recorded it; None if asked to stop first."""
    announced = False
    while not stopping.is_set():
        spec = await read_job_spec(kv, job)
        if spec is not None:
            return spec
        if not announced:
            log.info("waiting_for_job_spec", job=job, bucket="hsx_jobs")
            announced = True
        try:
            await asyncio.wait_for(stopping.wait(), timeout=poll_s)
        except asyncio.TimeoutError:
            pass
    return None
