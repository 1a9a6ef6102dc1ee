"""Publishing a job, one route for every plan (`produce`): the job's rounds come from a source
(the dataset read on a thread a round at a time, `RoundReader`, whose one round is the whole
dataset without --round-rows; or, on a rerun, the samples stored with the job, `StoredRound`),
and a `Publisher` takes them one after another: it plans the first (producer/planning.py), checks
everything that can refuse the job before anything of it is written, records the spec and
publishes the round's batches; each later round is planned, checked, recorded (the spec grown)
and published while the next is read; after the last, the samples are stored (where they were
not before the first record) and the spec says `published`. A plan of one round is a plan of
rounds that ends with its first.

What the steps share (the settings, the connection, the spec on record, the plan, the samples so
far, what this run has published) is the Publisher's. A refusal found in a later round records
why in the spec (`stopped`) and ends the run; what was published runs. Re-runs, replacement and
resume: docs/architecture/producer.md.
"""

import asyncio
import time
from typing import NoReturn

import msgspec
import structlog

from hsx.errors import HsxError
from hsx.exitcodes import DONE
from hsx.job import JobSpec, Layer
from hsx.model.modelinfo import ModelInfo
from hsx.producer import bundle, preflight, resume, stored
from hsx.producer.config import ProducerConfig
from hsx.producer.draft import Draft
from hsx.producer.estimate import free_space, sample_file_sizes
from hsx.producer.inputs import Inputs, Round
from hsx.producer.planning import Plan
from hsx.producer.rerun import refuse_published, replace_unpublished, stored_rows
from hsx.producer.rounds import RoundReader
from hsx.producer.sources import dataset_digest
from hsx.producer.specrecord import SpecChanged, SpecRecord
from hsx.storage.layout import SampleFiles
from hsx.storage.sampledigest import table_digests
from hsx.storage.tokens import SampleTable
from hsx.wire import schemas, topology
from hsx.wire.headers import message_headers
from hsx.wire.jetstream import publish_all
from hsx.wire.natsconn import NATS_OUTAGE_ERRORS, OUTAGE_RETRY_S, through_outage

log = structlog.get_logger("hsx.producer")

_PUBLISH_WINDOW = 256
_RECORD_ATTEMPTS = 5


async def produce(cfg: ProducerConfig, nc, info: ModelInfo, layers: list[Layer], *, started: float) -> int:
    """The job published (DONE), from the samples stored with it on a rerun that asks for the same
    inputs, else from the dataset; `started` is when produce began (its summary's seconds)."""
    js = nc.jetstream()
    kv = await topology.ensure_topology(js, replicas=cfg.replicas)
    record = await SpecRecord.read(kv, cfg.job)
    rows = await stored_rows(cfg, js, info, record.spec)
    rounds = RoundReader(cfg, info) if rows is None else StoredRound(rows)
    try:
        publisher = Publisher(Draft(cfg, info, layers), nc, js, record, from_store=rows is not None, started=started)
        return await publisher.run(rounds)
    finally:
        await rounds.close()  # the samples' spill files too


class StoredRound:
    """The samples stored with the job, as the one round of a rerun (`RoundReader`'s interface);
    the job's inputs are on record (`inputs` None)."""

    def __init__(self, rows: SampleTable) -> None:
        self.rows = rows

    async def next(self) -> Round:
        return Round(samples=self.rows, first_sample=0, first_row=0, last=True)

    async def inputs(self) -> Inputs | None:
        return None

    async def close(self) -> None:
        self.rows.close()


class Publisher:
    """One run's publishing of one job, from its first round to the spec that says `published`.
    Holds what its steps share: the run's draft of the job (settings, model, layers), the
    connection, the spec record and the spec as this run read it (`existing`), and, as the rounds
    come, the plan, the samples so far, what reading set aside so far and what was published."""

    def __init__(self, draft: Draft, nc, js, record: SpecRecord, *, from_store: bool, started: float) -> None:
        self.draft, self.cfg = draft, draft.cfg
        self.nc, self.js, self.record = nc, js, record
        self.existing = record.spec
        self.from_store, self.started = from_store, started
        self.plan: Plan | None = None
        self.rows: SampleTable | None = None  # the samples so far
        self.inputs: Inputs | None = None  # the dataset's, once read whole (None from the store)
        self.replaces = False  # this run's plan or destination is not the job's on record
        self.resumed: JobSpec | None = None  # the job on record, when this run goes on with it
        self.created_at = 0.0  # the job's identity (JobWatch): kept by every round and rerun
        # The stored objects and the dataset's digest the spec names ("" until known).
        self.tokens_object = self.report_object = self.digest = ""
        self.long, self.empty, self.rows_bad = [], [], 0  # set aside by the rounds read so far
        self.files: SampleFiles | None = None  # the job's files, once sized
        self.room = {"files": 0, "bundle_per_token": 0.0}  # what the rounds so far need at the destination
        self.digests = bytearray()  # the samples' digests so far (hsx.storage.sampledigest)
        self.spec: JobSpec | None = None  # the spec this run recorded (or would, resuming) last
        self.accounted: set[str] = set()  # batch ids queued or done when publishing began
        self.totals = {"new": 0, "duplicates": 0, "already": 0}

    async def run(self, rounds) -> int:
        """Every round of `rounds` planned, checked, recorded and published; DONE."""
        cut = await rounds.next()
        await self._plan(cut, rounds)
        if self.existing is not None and self.existing.published:
            if self.replaces:
                digest = self.digest or None  # the dataset's, read here when this run has not read it
                await asyncio.to_thread(
                    refuse_published, self.cfg, self.existing, self.draft.info, self.draft.layers, digest=digest
                )
            return await self._already_published()
        await self._preflight()
        await self._record_first()
        try:
            await self._publish(range(len(self.plan.batches)))
            while not cut.last:
                taken = await self._next_round(rounds)
                if taken is None:
                    break  # the dataset's last rows were all set aside: they make no round of their own
                cut, seqs = taken
                await self._grow(cut, seqs)
            await self._finish(rounds)
            return DONE
        except NATS_OUTAGE_ERRORS as exc:
            if self.plan.round_rows:
                await self._record_outage(exc)
            raise

    # ------------------------------------------------------------------ the first round

    async def _plan(self, cut: Round, rounds) -> None:
        """The plan of the first round: the whole (one round: the dataset read, or the stored
        samples), or round 0 of a plan in rounds, named before the rest is read."""
        cfg, draft = self.cfg, self.draft
        if cut.last:
            self.inputs = await rounds.inputs()
            self.rows = self.inputs.samples if self.inputs is not None else cut.samples
            recorded = self.existing if self.from_store else None
            self.plan = await asyncio.to_thread(Plan.of_samples, cfg, draft.layers, self.rows, recorded=recorded)
        else:
            self.digest = await asyncio.to_thread(dataset_digest, cfg.dataset)
            self.rows = cut.samples
            self.plan = Plan.in_rounds(
                cfg,
                draft.layers,
                self.rows.lengths,
                [0],
                model_revision=draft.info.revision,
                dataset_digest=self.digest,
                round_rows=cfg.round_rows,
            )
        self.long, self.empty, self.rows_bad = list(cut.long), list(cut.empty_masks), cut.rows_bad
        self.plan.log_ready(self.rows, from_store=self.from_store)
        existing = self.existing
        self.replaces = existing is not None and (
            existing.plan_fingerprint != self.plan.fingerprint or existing.dest != str(cfg.dest)
        )
        self.resumed = existing if existing is not None and not self.replaces else None
        self.created_at = self.resumed.created_at if self.resumed is not None else time.time()

    async def _already_published(self) -> int:
        """The job on record is this plan, published: its folder claimed again where another plan
        held it, its bundle written again (it skips what is there), nothing published."""
        existing = self.existing
        log.info(
            "job_already_published",
            job=self.cfg.job,
            batches=existing.total_batches,
            seconds=round(time.monotonic() - self.started, 2),
        )
        owner = await self._check_folder()
        if owner is not None:
            await self._remove_replaced(owner)
        await self._write_bundle(existing)
        say_published(self.cfg, existing, new=0)
        return DONE

    async def _preflight(self) -> None:
        """Everything that can refuse the job, before anything of it is written: the first round's
        descriptors and room, the destination, its folder; then the job on record replaced, if
        this run's plan is another, and another plan's bundle removed from the folder."""
        cfg = self.cfg
        checked = await self._check(range(len(self.plan.batches)), self.rows, 0)
        await asyncio.to_thread(preflight.check_destination, cfg.dest, cfg.job)
        owner = await self._check_folder()
        in_rounds = {"round": 0} if self.plan.round_rows else {}
        log.info(
            "preflight_passed",
            job=cfg.job,
            batches=checked,
            max_payload=self.nc.max_payload,
            dest=str(cfg.dest),
            **in_rounds,
        )
        if self.replaces:
            await replace_unpublished(self.js, cfg, self.existing, self.plan.fingerprint)
        if owner is not None:
            await self._remove_replaced(owner)

    async def _record_first(self) -> None:
        """The folder claimed and the spec of the first round recorded (after the samples, when
        they are read whole, and their digests are stored): or, going on with a job in rounds on
        record, its spec kept as it is until this run has read past its rounds."""
        cfg = self.cfg
        if self.inputs is not None:
            self.tokens_object, self.report_object = await self._store_inputs()
            self.digest = self.digest or await asyncio.to_thread(dataset_digest, cfg.dataset)
        elif self.from_store:
            existing = self.existing
            self.tokens_object, self.report_object = existing.tokenized_object, existing.report_object
            self.digest = existing.dataset_digest
        spec = self._spec()
        # The folder says whose files it holds before any worker can write one (producer/bundle.py).
        await asyncio.to_thread(bundle.claim_folder, spec)
        # The digests of the rounds so far, grown by each round's and stored before it is recorded.
        # A rerun stores them only once it has read past the rounds recorded: the object never
        # holds fewer samples than a spec recorded names.
        recorded = self._recorded_rounds()
        self.digests = bytearray(await asyncio.to_thread(table_digests, self.rows))
        if recorded <= 1:
            await stored.store_digests(self.js, cfg.job, bytes(self.digests), max_payload=self.nc.max_payload)
        self.spec = spec
        if recorded == 0:
            self.spec = await self._record_joining(spec)
            self.created_at = self.spec.created_at  # a producer of the same plan may have recorded it first
        elif self.resumed.stopped:  # the cause is gone (this run got past the checks): the job runs on
            await self._record_grown(msgspec.structs.replace(self.resumed, stopped=""))
        # The durables that count the job's markers exist from its start (readers make them too).
        await ensure_progress_counters(self.js, cfg.job, self.plan.tag)
        # Queued or finished already: a producer stopped mid-publish, or one racing this one.
        self.accounted = await accounted(self.js, cfg.job)

    def _recorded_rounds(self) -> int:
        """The rounds of this plan on record (0: nothing of it, or a plan of one round)."""
        return len(self.resumed.round_starts) if self.resumed is not None else 0

    # ------------------------------------------------------------------ each round

    async def _check(self, seqs: range, new: SampleTable, first_index: int) -> int:
        """The round's descriptors against the server's max_payload, and the destination's room
        for every round so far; how many descriptors were checked."""
        cfg = self.cfg
        checked = await asyncio.to_thread(
            preflight.check_payloads,
            self.plan.descriptors(seqs, self.rows),
            max_payload=self.nc.max_payload,
            token_budget=cfg.token_budget,
            max_seq_len=cfg.max_seq_len,
        )
        # A remote store has no free space to ask.
        if not cfg.ignore_free_space and cfg.dest.local_folder is not None:
            await asyncio.to_thread(self._check_room, new, first_index)
        return checked

    def _check_room(self, new: SampleTable, first_index: int) -> None:
        """The destination's free space against every round so far: the first sized exactly
        (`Draft.estimate`), bundle included; each later round's sample files added (sized
        exactly) and the bundle scaled from the first's per token (sizing it again would encode
        every token so far once a round)."""
        cfg, room = self.cfg, self.room
        if first_index == 0:
            estimate = self.draft.estimate(
                self.plan, self.rows, self._inputs_so_far(), self.existing, max_payload=self.nc.max_payload
            )
            room["files"] = estimate.bytes
            room["bundle_per_token"] = estimate.bundle_bytes / max(1, self.rows.total_tokens)
            free = estimate.free_space
        else:
            files = self.draft.files(self._spec())
            room["files"] += int(sample_file_sizes(new, files, first_index=first_index).sum())
            bundle_bytes = int(room["bundle_per_token"] * self.rows.total_tokens)
            free = free_space(cfg.dest, cfg.job, job_bytes=room["files"] + bundle_bytes)
        in_rounds = {"round": len(self.plan.round_starts) - 1} if self.plan.round_rows else {}
        self.draft.refuse_without_room(free, **in_rounds)

    def _inputs_so_far(self) -> Inputs | None:
        """What reading set aside so far, as the estimate's report counts it: the dataset's when
        it is read whole, the rounds' so far (rows not yet counted), None from the store."""
        if self.inputs is not None or self.from_store:
            return self.inputs
        return Inputs(
            samples=self.rows, long=self.long, rows_read=0, chat_rows=0, chat=None, empty_masks=tuple(self.empty)
        )

    async def _next_round(self, rounds) -> tuple[Round, range] | None:
        """The next round read, planned on its own and checked; None when it is an empty last
        round. A refusal (a bad or long row, a cap, no room, a round not where the spec on record
        has it) stops the job: recorded in its spec, raised in one line."""
        try:
            cut = await rounds.next()
            if cut.last and not len(cut.samples):
                return None
            start = len(self.rows)
            self.long += cut.long
            self.empty += cut.empty_masks
            self.rows_bad = cut.rows_bad
            self.rows = SampleTable.concat([self.rows, cut.samples])
            seqs = self.plan.grow(self.cfg, self.rows.lengths, start)
            await self._check(seqs, cut.samples, start)
            self._check_recorded_start(start)
        except HsxError as exc:
            await self._stop_and_raise(exc)
        return cut, seqs

    def _check_recorded_start(self, start: int) -> None:
        """A round on record must start where this run's does: else the dataset was read into other samples."""
        index = len(self.plan.round_starts) - 1
        if index < self._recorded_rounds() and start != self.resumed.round_starts[index]:
            raise HsxError(
                f"round {index} of the dataset starts at sample {start}, but job {self.cfg.job}'s "
                f"spec records it at sample {self.resumed.round_starts[index]}: the dataset was not read "
                "into the same samples as by the run that recorded it"
            )

    async def _grow(self, cut: Round, seqs: range) -> None:
        """The spec grows before the round's batches go out: a worker that gets one finds it
        planned, and its samples' digests are stored before the spec names them."""
        cfg, rounds = self.cfg, len(self.plan.round_starts)
        self.digests += await asyncio.to_thread(table_digests, cut.samples)
        if rounds >= self._recorded_rounds():
            await stored.store_digests(self.js, cfg.job, bytes(self.digests), max_payload=self.nc.max_payload)
        self.spec = self._spec()
        if rounds > self._recorded_rounds():
            await self._record_grown(self.spec)
        await self._publish(seqs)

    async def _publish(self, seqs: range) -> None:
        """The batches of `seqs` that are neither queued nor done published, and those the stream
        remembered from a deleted job of this name published again."""
        plan = self.plan
        self.totals["already"] += sum(plan.batch_id(seq) in self.accounted for seq in seqs)
        new, duplicates = await publish_batches(self.js, plan, self.rows, skip=self.accounted, seqs=seqs)
        republished = await self._republish_forgotten(duplicates)
        self.totals["new"] += new + republished
        self.totals["duplicates"] += len(duplicates) - republished
        if plan.round_rows:
            start = plan.round_starts[-1]
            log.info(
                "round_published",
                job=self.cfg.job,
                round=len(plan.round_starts) - 1,
                samples=len(self.rows) - start,
                batches=len(seqs),
                samples_so_far=len(self.rows),
                seconds=round(time.monotonic() - self.started, 2),
            )

    async def _republish_forgotten(self, duplicates: list[int]) -> int:
        """Publish again the batches the stream called duplicates but holds nowhere: their ids are
        remembered (for the duplicate window) from a job of this name that was deleted or replaced
        since. They go out under an id of this job's making; any other duplicate is queued or done."""
        if not duplicates:
            return 0
        plan = self.plan
        forgotten = {plan.batch_id(seq) for seq in duplicates} - await accounted(self.js, self.cfg.job)
        if not forgotten:
            return 0
        new, _ = await publish_batches(
            self.js,
            plan,
            self.rows,
            skip={plan.batch_id(seq) for seq in range(len(plan.batches))} - forgotten,
            msg_id_suffix=f"@{self.spec.created_at!r}",
        )
        log.warning(
            "batches_republished",
            job=self.cfg.job,
            batches=len(forgotten),
            new=new,
            reason="the stream remembered their ids from an earlier job of this name, which holds them no more",
        )
        return new

    async def _finish(self, rounds) -> None:
        """After the last round: the samples and report stored (a plan in rounds stores them only
        now), the spec `published`, the bundle written, the result said."""
        cfg = self.cfg
        if self.inputs is None and not self.from_store:
            self.inputs = await rounds.inputs()
            self.tokens_object, self.report_object = await self._store_inputs()
            self.rows = self.inputs.samples
            self.spec = self._spec(published=True)
            await self._record_grown(self.spec)
        else:
            self.spec = await self._record_joining(msgspec.structs.replace(self.spec, published=True))
        spec, plan, totals = self.spec, self.plan, self.totals
        in_rounds = {"rounds": len(plan.round_starts)} if plan.round_rows else {}
        log.info(
            "job_published",
            job=cfg.job,
            batches=len(plan.batches),
            **in_rounds,
            packing_efficiency=plan.packing_efficiency(self.rows),
            new=totals["new"],
            duplicates=totals["duplicates"],
            already_queued_or_done=totals["already"],
            samples=len(self.rows),
            samples_empty_mask=spec.samples_empty_mask,
            seconds=round(time.monotonic() - self.started, 2),
        )
        await self._write_bundle(spec)
        say_published(cfg, spec, new=totals["new"])

    # ------------------------------------------------------------------ the spec and the folder

    def _spec(self, *, published: bool = False) -> JobSpec:
        """The spec of the plan and the samples so far."""
        return self.draft.spec(
            self.plan,
            self.rows,
            created_at=self.created_at,
            tokenized_object=self.tokens_object,
            report_object=self.report_object,
            dataset_digest=self.digest,
            counts=self._counts(),
            published=published,
        )

    def _counts(self) -> dict:
        """What reading set aside, as the spec counts it: the dataset's once read whole (or the
        job on record's, from the store), else the rounds' so far (rows read known at the end)."""
        if self.inputs is not None or self.from_store:
            return self.draft.counts(self.inputs, self.existing)
        return {
            "samples_truncated": sum(1 for e in self.long if e.action == "truncated"),
            "samples_skipped": sum(1 for e in self.long if e.action == "skipped"),
            "rows_bad": self.rows_bad,
            "rows_read": 0,
            "on_empty_mask": self.cfg.on_empty_mask,
            "samples_empty_mask": len(self.empty),
        }

    async def _record_joining(self, spec: JobSpec) -> JobSpec:
        """The job's spec written by compare-and-set over what this run read; the spec written. A
        producer of the same plan that recorded it first (two started together) is joined: its
        `created_at` is kept, the job's identity. Anything else recorded meanwhile (a job deleted,
        another plan, a racer further on) stops this run in one line."""
        record = self.record
        for _ in range(_RECORD_ATTEMPTS):
            try:
                await record.write(spec)
                return spec
            except SpecChanged:
                now = await SpecRecord.read(record.kv, spec.job)
                theirs = now.spec
                same = theirs is not None and (theirs.plan_fingerprint, theirs.dest, theirs.total_samples) == (
                    spec.plan_fingerprint,
                    spec.dest,
                    spec.total_samples,
                )
                if not same:
                    break
                record.spec, record.revision = theirs, now.revision
                spec = msgspec.structs.replace(
                    spec, created_at=theirs.created_at, published=spec.published or theirs.published
                )
                log.info(
                    "job_spec_joined",
                    job=spec.job,
                    plan=spec.plan_tag,
                    reason="recorded by a producer of the same plan",
                )
                if spec == theirs:
                    return spec
        raise HsxError(
            f"job {spec.job} was recorded, deleted or produced again by someone else while this producer "
            "ran; nothing of this run was recorded; run hsx produce again to see the job as it is now"
        )

    async def _record_grown(self, grown: JobSpec) -> None:
        """The spec written over the one this run read or wrote last, and only over it: a job
        deleted (or produced again) meanwhile is not brought back by the next round."""
        recorded = self.record.spec
        try:
            await self.record.write(grown)
        except SpecChanged:
            raise HsxError(
                f"job {self.cfg.job} was deleted or produced again while its plan was published in rounds (after "
                f"{len(recorded.round_starts)} rounds, {recorded.total_samples} samples); this producer stopped"
            ) from None

    async def _stop_and_raise(self, exc: HsxError) -> NoReturn:
        """Record in the job's spec why its producer stopped before publishing the whole plan (a
        job deleted meanwhile is left deleted), and raise it in one line: what was published runs."""
        cfg, stopped = self.cfg, self.record.spec  # the largest spec recorded: what was published
        log.error(
            "job_stopped", job=cfg.job, rounds=len(stopped.round_starts), samples=stopped.total_samples, reason=str(exc)
        )
        try:
            await self._record_grown(msgspec.structs.replace(stopped, stopped=str(exc)))
        except HsxError as lost:
            log.warning("job_stop_not_recorded", job=cfg.job, reason=str(lost))
        raise HsxError(
            f"{exc}; job {cfg.job} stopped after {len(stopped.round_starts)} rounds of --round-rows "
            f"{cfg.round_rows} ({stopped.total_samples} samples published, which run; the job then ends failed): "
            f"run hsx produce again once this is fixed and it resumes, or, for another dataset or settings, "
            f"hsx jobs delete {cfg.job} first"
        ) from None

    async def _record_outage(self, exc: BaseException) -> None:
        """Past the outage budget of a step: the spec says why the producer stopped, if NATS answers
        within a few seconds more (a rerun resumes and clears it)."""
        reason = f"NATS did not answer for {OUTAGE_RETRY_S:g} s ({type(exc).__name__})"
        try:
            await self.record.write(msgspec.structs.replace(self.record.spec, stopped=reason), give_up_after_s=5.0)
        except (*NATS_OUTAGE_ERRORS, SpecChanged):
            log.warning("job_stop_not_recorded", job=self.cfg.job, reason=reason)

    async def _store_inputs(self) -> tuple[str, str]:
        """The samples and the input report stored in bucket hsx_datasets; their objects' names."""
        cfg, inputs, max_payload = self.cfg, self.inputs, self.nc.max_payload
        tokens = await stored.store_tokenized(self.js, cfg.job, inputs.samples, max_payload=max_payload)
        report = await stored.store_report(self.js, cfg.job, self.draft.report(inputs), max_payload=max_payload)
        log.info(
            "samples_stored", job=cfg.job, bucket=topology.DATASETS_BUCKET, object=tokens, samples=len(inputs.samples)
        )
        (log.warning if inputs.long or inputs.bad_rows or inputs.empty_masks else log.info)(
            "input_report",
            job=cfg.job,
            bucket=topology.DATASETS_BUCKET,
            object=report,
            samples_truncated=inputs.truncated,
            samples_skipped=inputs.skipped,
            rows_bad=len(inputs.bad_rows),
            first_bad_row=inputs.bad_rows[0].where if inputs.bad_rows else None,
            samples_empty_mask=len(inputs.empty_masks),
            on_empty_mask=cfg.on_empty_mask,
            first_empty_mask=inputs.empty_masks[0].where if inputs.empty_masks else None,
            max_seq_len=cfg.max_seq_len,
        )
        return tokens, report

    async def _check_folder(self) -> preflight.FolderOwner | None:
        cfg = self.cfg
        return await asyncio.to_thread(
            preflight.check_folder,
            cfg.dest,
            cfg.job,
            plan=self.plan.tag,
            total_samples=len(self.rows),
            known=self.existing,
            replace=cfg.replace_output,
        )

    async def _remove_replaced(self, owner: preflight.FolderOwner) -> None:
        """The job takes over a folder of another plan: that plan's bundle goes, its index first. Its
        sample files stay until this job's overwrite them: each names its plan, so neither a reader
        nor the uploader's "already stored" test (size and digest) takes one for this job's."""
        cfg = self.cfg
        removed = await asyncio.to_thread(bundle.remove_replaced, cfg.dest, cfg.job)
        log.warning(
            "output_replaced",
            job=cfg.job,
            folder=f"{cfg.dest}/{cfg.job}",
            replaced=owner.what,
            plan=self.plan.tag,
            removed=removed,
            sample_files="left to be overwritten by this job's",
        )

    async def _write_bundle(self, spec: JobSpec) -> None:
        """The job's bundle (producer/bundle.py), written again whole after an outage (it skips what
        the destination holds already)."""
        batches, max_batch_size = self.plan.batches, self.cfg.max_batch_size
        await through_outage(
            lambda: bundle.write_bundle(self.js, spec, batches, max_batch_size=max_batch_size), what="write_bundle"
        )


async def publish_batches(
    js,
    plan: Plan,
    rows: SampleTable,
    *,
    skip: set[str],
    msg_id_suffix: str = "",
    seqs: range | None = None,
) -> tuple[int, list[int]]:
    """Publish every batch of `seqs` (default all) whose id is not in `skip`; (how many the stream
    took as new, the sequence numbers of those it called duplicates)."""
    subject = topology.batch_subject(plan.job)
    seqs = range(len(plan.batches)) if seqs is None else seqs
    todo = [seq for seq in seqs if plan.batch_id(seq) not in skip]
    published, duplicates = 0, []

    def build(window: list[int]) -> list[tuple[str, bytes]]:
        """The window's descriptors, encoded: CPU work (tens of thousands of samples in a window
        of short ones), done off the event loop, which meanwhile keeps reading the acks."""
        return [(plan.batch_id(seq), schemas.encode(plan.descriptor(seq, rows))) for seq in window]

    for start in range(0, len(todo), _PUBLISH_WINDOW):
        window = todo[start : start + _PUBLISH_WINDOW]
        built = await asyncio.to_thread(build, window)
        # A lost or late ack is retried: the message id keeps a repeat out of the stream.
        acks = await publish_all(
            js,
            [
                (subject, payload, message_headers(plan.job, batch=batch_id, msg_id=batch_id + msg_id_suffix))
                for batch_id, payload in built
            ],
            what="publish_batch",
        )
        results = [not ack.duplicate for ack in acks]
        published += sum(results)
        duplicates += [seq for seq, new in zip(window, results) if not new]
    return published, duplicates


def say_published(cfg: ProducerConfig, spec: JobSpec, *, new: int) -> None:
    """The run's result for a person, on stdout (the log is on stderr): what is queued and what
    to start next."""
    sent = f"{new:,} published now" if new else "nothing new to publish"
    print(
        f"job {cfg.job}: {spec.total_batches:,} batches of {spec.total_samples:,} samples "
        f"({spec.total_tokens:,} tokens) queued or done, {sent}; output to {spec.dest}\n"
        f"next, one per GPU: hsx consume --job {cfg.job} --device cuda:0 --spool DIR; on each node: "
        f"hsx upload --job {cfg.job} --spool DIR; to follow it: hsx monitor --job {cfg.job}",
        flush=True,
    )


async def ensure_progress_counters(js, job: str, plan: str) -> None:
    """The durables that count the job's markers, from its start (readers make them too)."""
    for counter in topology.PROGRESS_COUNTERS:
        await through_outage(
            lambda counter=counter: topology.ensure_progress_counter(js, job, plan, counter), what="progress_counter"
        )


async def accounted(js, job: str) -> set[str]:
    """The batch ids queued or done (producer/resume.py), read again through an outage."""
    return await through_outage(lambda: resume.accounted_batch_ids(js, job), what="read_accounted_batches")
