"""Finding a lost spool file's sample again, so that the uploader can send it back for extraction.

A file-ready event names its sample (job, `sample_index`, the writing plan's tag) instead of
carrying its tokens a second time: the tokens are in the job's stored samples
(`JobSpec.tokenized_object`, sample i at index i). Reading them costs a download of the whole
object, so it happens only when a loss needs it, once per uploader process: the first loss loads
the table (hsx.storage.tokens.load_table: bounded memory, tokens in temp files) and every later one reads
one sample from it. An event from an older GPU consumer still carries its sample and is sent back
with that, nothing loaded.

This module knows where a lost sample's tokens come from; re-queueing it is the service's.
"""

import asyncio
import time

import structlog
from nats.js import JetStreamContext

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.storage.tokens import SampleTable, load_table, spec_of
from hsx.wire import schemas

log = structlog.get_logger("hsx.uploader")


class SampleNotFound(Exception):
    """The event's sample cannot be found again (the job has no stored samples, or they are of
    another plan): it cannot be re-extracted, and its event is dead-lettered. `later`: not yet,
    the job's plan is still being published in rounds and its samples are stored after the last
    (producer/main.py): the event is to be tried again."""

    def __init__(self, message: str, *, later: bool = False) -> None:
        super().__init__(message)
        self.later = later


class StoredSamples:
    def __init__(self, job: str) -> None:
        self.job = job
        self._lock = asyncio.Lock()  # concurrent losses wait for one load, not one each
        self._table: SampleTable | None = None
        self._spec: JobSpec | None = None
        # Why the stored samples cannot be read (none stored, object missing or corrupt): kept,
        # since downloading the whole object again for every lost file cannot change the answer.
        self._unreadable = ""

    async def sample_for(self, js: JetStreamContext, ready: schemas.FileReady) -> schemas.Sample:
        """The sample `ready` announced, exactly as planned; SampleNotFound when it cannot be had."""
        if ready.sample is not None:
            return ready.sample
        index = ready.sample_index
        table, spec = await self._load(js, index)
        # A job deleted and made again under the same name numbers other samples the same way.
        if ready.plan and ready.plan != spec.plan_tag:
            raise SampleNotFound(
                f"sample {index} was written under plan {ready.plan}; the job's stored samples are plan {spec.plan_tag}"
            )
        if not 0 <= index < len(table) or int(table.lengths[index]) != ready.num_tokens:
            raise SampleNotFound(
                f"sample {index} ({ready.num_tokens} tokens) is not in the job's stored samples ({len(table)} samples)"
            )
        return await asyncio.to_thread(table.sample, index)

    async def _load(self, js: JetStreamContext, index: int) -> tuple[SampleTable, JobSpec]:
        async with self._lock:
            if self._unreadable:
                raise SampleNotFound(f"sample {index}: {self._unreadable}")
            if self._table is None:
                started = time.monotonic()
                try:
                    # The spec as it is now, not as the uploader started: the plan check needs the
                    # plan the stored object belongs to.
                    spec = await spec_of(js, self.job, None)
                    if not spec.tokenized_object and not spec.published:
                        raise SampleNotFound(
                            f"sample {index}: job {self.job}'s samples are stored once its plan is published",
                            later=True,
                        )
                    if spec.tokenized_object:
                        log.info(
                            "stored_samples_loading",
                            object=spec.tokenized_object,
                            samples=spec.total_samples,
                            tokens=spec.total_tokens,
                        )
                    table = await load_table(js, self.job, spec=spec)
                except HsxError as exc:
                    self._unreadable = str(exc)
                    raise SampleNotFound(f"sample {index}: {exc}") from None
                self._table, self._spec = table, spec
                log.info(
                    "stored_samples_loaded",
                    samples=len(table),
                    tokens=table.total_tokens,
                    seconds=round(time.monotonic() - started, 2),
                )
            return self._table, self._spec

    def close(self) -> None:
        if self._table is not None:
            self._table.close()
            self._table = None
