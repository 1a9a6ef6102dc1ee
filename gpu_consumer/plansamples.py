"""The samples a job's plan names, as its producer recorded them (`PlanSamples.refused`).

A descriptor's sample is extracted only when its digest (hsx/storage/sampledigest.py: its token
ids, loss mask and source id) is the one the producer stored for its index in bucket hsx_datasets
before the spec named it: a descriptor published by hand with the plan's tag and other tokens is
never written as the job's sample, over a stored one or not. Each round's digests (16 bytes a
sample) are read once, when a batch first needs them. A job of an older hsx (`sample_digests`
false) has none and is not checked. It knows the spec and the object store, not the pull loop.
"""

import bisect
import io
from collections.abc import Callable

import nats.js.errors
from nats.js import JetStreamContext

from hsx.errors import HsxError
from hsx.storage.sampledigest import DIGEST_BYTES, sample_digest
from hsx.storage.tokens import digests_object_name
from hsx.wire import schemas, topology


class PlanSamplesUnavailable(HsxError):
    """A round's digests are not in the object store (yet, or any more)."""


class PlanSamples:
    def __init__(self, js: JetStreamContext, spec: Callable[[], schemas.JobSpec]) -> None:
        self.js, self.spec = js, spec  # `spec()`: the job's spec as last read (a plan in rounds grows)
        self._rounds: dict[int, bytes] = {}

    async def _round(self, spec: schemas.JobSpec, round_index: int) -> bytes:
        if round_index not in self._rounds:
            name = digests_object_name(spec.job, spec.plan_tag, round_index)
            buffer = io.BytesIO()
            try:
                store = await self.js.object_store(topology.DATASETS_BUCKET)
                await store.get(name, writeinto=buffer)
            except (
                nats.js.errors.ObjectNotFoundError,
                nats.js.errors.NotFoundError,
                nats.js.errors.BucketNotFoundError,
            ):
                raise PlanSamplesUnavailable(
                    f"object {name} (the digests of round {round_index} of job {spec.job}) is not in bucket "
                    f"{topology.DATASETS_BUCKET}"
                ) from None
            self._rounds[round_index] = buffer.getvalue()
        return self._rounds[round_index]

    async def refused(self, batch: schemas.BatchDescriptor) -> list[tuple[int, str]]:
        """(index, why) for each of the batch's samples that is not the plan's; [] when all are
        (or the job records no digests). PlanSamplesUnavailable when a round's digests are missing."""
        spec = self.spec()
        if not spec.sample_digests:
            return []
        starts = spec.round_starts or [0]
        refused = []
        for sample in batch.samples:
            round_index = bisect.bisect_right(starts, sample.index) - 1
            recorded = await self._round(spec, round_index)
            at = (sample.index - starts[round_index]) * DIGEST_BYTES
            if at + DIGEST_BYTES > len(recorded):
                refused.append((sample.index, "no digest is recorded for it"))
            elif recorded[at : at + DIGEST_BYTES] != sample_digest(sample):
                refused.append((sample.index, "its tokens, mask or source id are not the sample the producer planned"))
        return refused
