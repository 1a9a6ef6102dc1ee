"""The job's spec in KV bucket hsx_jobs as one producer run writes it (`SpecRecord`).

Every write is a compare-and-set on the revision this run last read or wrote: a run never writes
over a spec it has not seen (a job deleted meanwhile, a job of the name produced again, a second
producer), and what it recorded only grows, so that a worker never reads a spec smaller than one
it read before. A write is retried through a NATS outage; a retry whose first attempt landed (its
reply lost) finds its own bytes under the key and takes that revision as its own. It knows the
bucket and the spec's bytes, not what the producer publishes.
"""

import nats.js.errors
from nats.js.kv import KeyValue

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.wire import schemas
from hsx.wire.jobs import decode_job_spec
from hsx.wire.natsconn import OUTAGE_RETRY_S, through_outage


class SpecChanged(HsxError):
    """The key holds another revision than the one this run last read or wrote."""


class SpecRecord:
    """`spec` and `revision`: what this run last read or wrote (None and None: no job of the
    name existed when it read)."""

    def __init__(self, kv: KeyValue, job: str, spec: JobSpec | None, revision: int | None) -> None:
        self.kv, self.job, self.spec, self.revision = kv, job, spec, revision

    @classmethod
    async def read(cls, kv: KeyValue, job: str) -> "SpecRecord":
        async def get():
            try:
                return await kv.get(job)
            except nats.js.errors.KeyNotFoundError:
                return None

        entry = await through_outage(get, what="read_job_spec")
        if entry is None:
            return cls(kv, job, None, None)
        return cls(kv, job, decode_job_spec(entry.value, job=job), entry.revision)

    async def write(self, spec: JobSpec, *, give_up_after_s: float = OUTAGE_RETRY_S) -> None:
        """Record `spec` over the revision last read or written; SpecChanged when the key moved on;
        through an outage of up to `give_up_after_s` (then NATS's error)."""
        payload = schemas.encode(spec)
        attempts = 0

        async def put() -> int:
            nonlocal attempts
            attempts += 1
            try:
                if self.revision is None:
                    return await self.kv.create(self.job, payload)
                return await self.kv.update(self.job, payload, last=self.revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                if attempts > 1:  # an earlier attempt may have landed, its reply lost in the outage
                    landed = await self._revision_holding(payload)
                    if landed is not None:
                        return landed
                raise SpecChanged(
                    f"job {self.job}: its spec in KV bucket hsx_jobs changed under this producer"
                ) from None

        self.revision = await through_outage(put, what="record_job_spec", give_up_after_s=give_up_after_s)
        self.spec = spec

    async def _revision_holding(self, payload: bytes) -> int | None:
        try:
            entry = await self.kv.get(self.job)
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.revision if entry.value == payload else None
