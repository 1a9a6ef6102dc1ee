"""The samples a job's plan names, as its producer recorded them (`PlanSamples.refused`).

A descriptor's sample is extracted only when its digest (hsx/storage/sampledigest.py: its token
ids, loss mask and source id) is the one the producer stored for its index in bucket hsx_datasets
before the spec named it: a descriptor published by hand with the plan's tag and other tokens is
never written as the job's sample, over a stored one or not. The digests (16 bytes a sample, one
object for the job, grown by each round) are read again only when a batch names a sample past
those read. A job of an older hsx (`sample_digests`
false) has none and is not checked. It knows the spec and the object store, not the pull loop.
"""

import asyncio
import io
from collections.abc import Callable

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.storage.sampledigest import DIGEST_BYTES, sample_digest
from hsx.storage.tokens import digests_object_name
from hsx.wire import schemas, topology

# How long one reading of the digests object may take.
_READ_S = 10.0


def batch_placed(spec: JobSpec, batch: schemas.BatchDescriptor) -> bool:
    """Whether `batch` lies inside `spec`'s plan: every sample index below its total, and a batch
    id of the plan's form one of its batches (a re-queued sample's batch or a poisoned batch's
    retry has an id of another form, and samples of the plan)."""
    seq = spec.plan_batch_seq(batch.batch_id)
    in_range = all(0 <= sample.index < spec.total_samples for sample in batch.samples)
    return in_range and (seq is None or seq < spec.total_batches)


class PlanSamplesUnavailable(HsxError):
    """A round's digests are not in the object store (yet, or any more)."""


class PlanSamples:
    def __init__(self, js: JetStreamContext, spec: Callable[[], JobSpec]) -> None:
        self.js, self.spec = js, spec  # `spec()`: the job's spec as last read (a plan in rounds grows)
        self._digests = b""  # as last read: every sample's, in index order

    async def _read(self, spec: JobSpec) -> bytes:
        name = digests_object_name(spec.job)
        buffer = io.BytesIO()
        try:
            store = await self.js.object_store(topology.DATASETS_BUCKET)
            # Bounded: a read that meets the producer storing the object again (the next round's)
            # loses the old object's chunks and would wait for them forever; it is tried again.
            await asyncio.wait_for(store.get(name, writeinto=buffer), timeout=_READ_S)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.NotFoundError, nats.js.errors.BucketNotFoundError):
            raise PlanSamplesUnavailable(
                f"object {name} (the digests of job {spec.job}'s samples) is not in bucket {topology.DATASETS_BUCKET}"
            ) from None
        except (TimeoutError, nats.errors.Error) as exc:
            raise PlanSamplesUnavailable(
                f"object {name} could not be read ({type(exc).__name__}: {exc}); it may be being stored again"
            ) from None
        return buffer.getvalue()

    async def refused(self, batch: schemas.BatchDescriptor) -> list[tuple[int, str]]:
        """(index, why) for each of the batch's samples that is not the plan's; [] when all are
        (or the job records no digests). PlanSamplesUnavailable when the digests are missing. They
        are read again only when a sample lies past those read (a round recorded since)."""
        spec = self.spec()
        if not spec.sample_digests:
            return []
        if max(sample.index for sample in batch.samples) >= len(self._digests) // DIGEST_BYTES:
            self._digests = await self._read(spec)
        recorded_samples = len(self._digests) // DIGEST_BYTES
        if max(sample.index for sample in batch.samples) >= recorded_samples:
            raise PlanSamplesUnavailable(
                f"the digests of job {spec.job} hold {recorded_samples} samples, not yet sample "
                f"{max(sample.index for sample in batch.samples)} of its spec"
            )
        refused = []
        for sample in batch.samples:
            at = sample.index * DIGEST_BYTES
            recorded = self._digests[at : at + DIGEST_BYTES]
            if recorded != sample_digest(sample):
                refused.append((sample.index, "its tokens, mask or source id are not the sample the producer planned"))
        return refused
