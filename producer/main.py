"""`hsx produce`: dataset -> samples (stored) -> plan -> job spec in KV -> one descriptor per
batch. `run` checks everything that can refuse the job before anything is written
(producer/preflight.py), then stores the samples, claims the destination folder, publishes the
batches under ids derived from the plan's fingerprint, and writes the bundle (producer/bundle.py).
With --dry-run it stops after planning: the job is sized (producer/estimate.py) and printed,
with no NATS server and nothing published, stored or written. SIGTERM or Ctrl-C stops it where it
is (exit 75, STOPPED): what it published stays, and a rerun resumes.
Re-runs, replacement and resume: docs/architecture/producer.md."""

import asyncio
import contextlib
import hashlib
import signal
import time
from dataclasses import asdict, dataclass

import msgspec
import numpy as np
import structlog

from hsx.errors import HsxError, Unavailable
from hsx.exitcodes import DONE, STOPPED
from hsx.model.layers import preset_of, resolve_layers
from hsx.model.modelinfo import ModelInfo, load_model_info
from hsx.packing import PlannedBatch, plan_batches, plan_in_rounds
from hsx.producer import bundle, preflight, resume, stored
from hsx.producer.config import ProducerConfig
from hsx.producer.estimate import (
    FreeSpace,
    JobEstimate,
    check_free_space,
    estimate_job,
    format_estimate,
    free_space,
    sample_file_sizes,
)
from hsx.producer.inputs import Inputs, check_vocab, report_document
from hsx.producer.measure import NO_MEASURE, Measure, NotMeasured
from hsx.producer.rounds import RoundReader, read_inputs, round_fingerprint
from hsx.producer.sources import dataset_digest
from hsx.producer.specrecord import SpecChanged, SpecRecord
from hsx.storage import encodings
from hsx.storage.sampledigest import table_digests
from hsx.storage.tokens import SampleTable, report_object_name, tokens_object_name
from hsx.wire import schemas, topology
from hsx.wire.counts import count_stored
from hsx.wire.headers import message_headers
from hsx.wire.jetstream import publish_all
from hsx.wire.jobs import count_messages, live_workers
from hsx.wire.lifecycle import exit_now
from hsx.wire.natsconn import NATS_OUTAGE_ERRORS, OUTAGE_RETRY_S, close_connection, connect, redact_url, through_outage
from hsx.wire.schemas import Layer, plan_batch_id

log = structlog.get_logger("hsx.producer")

_PUBLISH_WINDOW = 256
# nats-server's max_payload unless its configuration says otherwise: what --dry-run checks
# descriptors against without a server to ask.
DEFAULT_MAX_PAYLOAD = 1 << 20


def plan_fingerprint(cfg: ProducerConfig, layers: list[Layer], samples: SampleTable) -> str:
    """sha256 over the settings and, per sample in index order, its tokens as int64 bytes, its
    mask as int8 bytes (b"|" without one) and its source id and a newline. The byte stream is
    the one of every hsx before the columnar table (batch ids of existing jobs must not change),
    fed from the table a run of samples at a time."""
    digest = hashlib.sha256()
    digest.update(msgspec.json.encode([cfg.model, layers, cfg.dtype, cfg.token_budget, cfg.max_batch_size]))
    for first, offsets, tokens, masks in samples.runs():
        count = len(offsets) - 1
        wide = tokens.astype(np.int64)
        narrow = None if masks is None else masks.view(np.int8)
        ids = samples.source_ids.slice(first, count).to_pylist()
        has_mask = samples.has_mask[first : first + count].tolist()
        bounds = offsets.tolist()
        for k in range(count):
            start, end = bounds[k], bounds[k + 1]
            digest.update(wide[start:end])
            digest.update(narrow[start:end] if has_mask[k] else b"|")
            digest.update(ids[k].encode() + b"\n")
    return digest.hexdigest()


def _descriptor(
    job: str, fingerprint: str, batch_id: str, batch: PlannedBatch, samples: SampleTable
) -> schemas.BatchDescriptor:
    # Built when published (or measured), from the table's offsets: one descriptor's tokens at a time.
    return schemas.BatchDescriptor(
        job=job,
        batch_id=batch_id,
        padded_len=batch.padded_len,
        samples=[samples.sample(i) for i in batch.sample_indices],
        plan=schemas.plan_tag_of(fingerprint),
    )


def _descriptors(job: str, fingerprint: str, batches: list[PlannedBatch], rows):
    """Every descriptor of the plan, made one at a time (the preflight check measures and drops each)."""
    for seq, batch in enumerate(batches):
        yield _descriptor(job, fingerprint, plan_batch_id(job, fingerprint, seq), batch, rows)


async def _publish_batches(
    js,
    cfg: ProducerConfig,
    fingerprint: str,
    batches: list[PlannedBatch],
    rows,
    *,
    skip: set[str],
    msg_id_suffix: str = "",
    seqs: range | None = None,
) -> tuple[int, list[int]]:
    """Publish every batch of `seqs` (default all) whose id is not in `skip`; (how many the stream
    took as new, the sequence numbers of those it called duplicates)."""
    subject = topology.batch_subject(cfg.job)
    seqs = range(len(batches)) if seqs is None else seqs
    todo = [seq for seq in seqs if plan_batch_id(cfg.job, fingerprint, seq) not in skip]
    published, duplicates = 0, []

    def build(window: list[int]) -> list[tuple[str, bytes]]:
        """The window's descriptors, encoded: CPU work (tens of thousands of samples in a window
        of short ones), done off the event loop, which meanwhile keeps reading the acks."""
        built = []
        for seq in window:
            batch_id = plan_batch_id(cfg.job, fingerprint, seq)
            built.append((batch_id, schemas.encode(_descriptor(cfg.job, fingerprint, batch_id, batches[seq], rows))))
        return built

    for start in range(0, len(todo), _PUBLISH_WINDOW):
        window = todo[start : start + _PUBLISH_WINDOW]
        built = await asyncio.to_thread(build, window)
        # A lost or late ack is retried: the message id keeps a repeat out of the stream.
        acks = await publish_all(
            js,
            [
                (subject, payload, message_headers(cfg.job, batch=batch_id, msg_id=batch_id + msg_id_suffix))
                for batch_id, payload in built
            ],
            what="publish_batch",
        )
        results = [not ack.duplicate for ack in acks]
        published += sum(results)
        duplicates += [seq for seq, new in zip(window, results) if not new]
    return published, duplicates


async def run(cfg: ProducerConfig, *, measure: Measure | None = None) -> int:
    """`measure`: how a dry run measures a compressed job's states (hsx/commands/measure.py).
    DONE once every batch is published (or the dry run printed); STOPPED when SIGTERM or SIGINT
    stopped it first (`_stopped_by_signals`)."""
    with _stopped_by_signals() as stopped:
        try:
            return await _run(cfg, measure=measure)
        except asyncio.CancelledError:
            if not stopped:
                raise
    # Everything published stays published and a rerun publishes only what is neither queued nor
    # done, so the job is safe to produce again; no `stopped` is recorded in its spec (that would
    # end it failed once what was published has run).
    log.warning(
        "producer_stopped",
        job=cfg.job,
        signal=signal.Signals(stopped[0]).name,
        then="run hsx produce again with the same settings: it resumes, publishing nothing twice",
    )
    return STOPPED


@contextlib.contextmanager
def _stopped_by_signals():
    """The first SIGTERM or SIGINT cancels the running task (its `finally` blocks close the
    connection and the spill files); a second ends the process at once, STOPPED. Yields the
    signals received."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        if len(received) == 1:
            log.info("stopping", signal=signal.Signals(signum).name, then="a second signal stops now")
            task.cancel()
        else:
            exit_now(STOPPED)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        yield received
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _run(cfg: ProducerConfig, *, measure: Measure | None) -> int:
    started = time.monotonic()
    info = load_model_info(cfg.model, trust_remote_code=cfg.trust_remote_code)
    layers = resolve_layers(cfg.layers, info.num_layers, model=cfg.model)
    if cfg.dry_run:
        return await _dry_run(cfg, info, layers, measure)
    # Reach NATS first: an unreachable server is reported at once, not after reading a big dataset.
    nc = await connect(cfg.nats, name=f"hsx-producer-{cfg.job}")
    try:
        return await _produce(cfg, nc, info, layers, started=started)
    except NATS_OUTAGE_ERRORS as exc:
        # Each step rides out an outage for OUTAGE_RETRY_S (through_outage); past that, one line.
        raise Unavailable(
            f"NATS at {redact_url(cfg.nats.url)} did not answer for {OUTAGE_RETRY_S:g} s "
            f"({type(exc).__name__}: {exc or 'no reply'}); job {cfg.job} is not fully published: run hsx "
            "produce again once NATS is back, and it resumes (nothing published is published twice)"
        ) from None
    finally:
        await close_connection(nc)


@dataclass(frozen=True, kw_only=True)
class Sizing:
    """What sizing a job takes: the model, its layers, the plan and the samples it packs, and the
    inputs' counts (those of the job on record where this run read nothing new)."""

    info: ModelInfo
    layers: list[Layer]
    fingerprint: str
    rows: SampleTable
    batches: list[PlannedBatch]
    inputs: Inputs | None
    existing: schemas.JobSpec | None


def _estimate(cfg: ProducerConfig, job: Sizing, *, max_payload: int, measure: Measure | None = None) -> JobEstimate:
    """The job sized (producer/estimate.py) from its spec as it will be, but for the stored
    objects' names and the dataset's digest, which only the bundle's job.json holds (their length,
    not their value, counts; reading the dataset again for its digest would not). With
    `measure` (a dry run's), a compressed job's states are measured on --estimate-device."""
    spec = _job_spec(
        cfg,
        job.info,
        job.layers,
        job.fingerprint,
        job.rows,
        job.batches,
        created_at=time.time(),
        tokenized_object=tokens_object_name(cfg.job),
        report_object=report_object_name(cfg.job),
        dataset_digest="0" * 64,
        **_input_counts(cfg, job.inputs, job.existing),
    )
    measured = not_measured = None
    if measure is not None and cfg.estimate_device == NO_MEASURE:
        not_measured = f"--estimate-device {NO_MEASURE}"
    elif measure is not None and not encodings.of_spec(spec.dtype).exact_size:
        try:
            measured = measure(spec, job.rows, cfg.estimate_device)
            log.info("states_measured", job=cfg.job, **asdict(measured))
        except NotMeasured as exc:
            not_measured = str(exc)
            log.warning("states_not_measured", job=cfg.job, reason=not_measured)
    return estimate_job(
        spec,
        job.rows,
        job.batches,
        max_batch_size=cfg.max_batch_size,
        report=None if job.inputs is None else _report(cfg, job.inputs),
        max_payload=max_payload,
        rate=cfg.rate,
        gpus=cfg.gpus,
        dest=cfg.dest,
        measured=measured,
        not_measured=not_measured,
    )


def _check_free_space(cfg: ProducerConfig, job: Sizing, *, max_payload: int) -> None:
    """Refuse a local destination without room for the job's files (a remote store has no free
    space to ask)."""
    if cfg.dest.local_folder is None:
        return
    _refuse_without_room(cfg, _estimate(cfg, job, max_payload=max_payload).free_space)


def _refuse_without_room(cfg: ProducerConfig, room: FreeSpace | None, **context) -> None:
    """Log the destination's free space against the job's need (`free_space_checked`), then
    refuse the job if it does not fit (check_free_space); `room` None: nothing to ask."""
    if room is not None:
        log.info(
            "free_space_checked",
            job=cfg.job,
            dest=str(cfg.dest),
            needed=room.needed,
            free=room.free,
            fits=room.fits,
            **context,
        )
    check_free_space(room)


async def _dry_run(cfg: ProducerConfig, info, layers: list[Layer], measure: Measure | None) -> int:
    """`--dry-run`: the inputs read and planned as a run would, the plan's descriptors checked
    against --max-payload, the job sized and printed. No NATS: nothing is published, stored,
    claimed or written."""
    starts: list[int] = []
    inputs = await _read_inputs(cfg, info, on_round=lambda cut: starts.append(cut.first_sample))
    rows = inputs.samples
    try:
        batches, fingerprint = await _plan(cfg, layers, rows, from_store=False, round_starts=starts)
        max_payload = cfg.max_payload or DEFAULT_MAX_PAYLOAD
        await asyncio.to_thread(
            preflight.check_payloads,
            _descriptors(cfg.job, fingerprint, batches, rows),
            max_payload=max_payload,
            token_budget=cfg.token_budget,
            max_seq_len=cfg.max_seq_len,
        )
        sizing = Sizing(
            info=info, layers=layers, fingerprint=fingerprint, rows=rows, batches=batches, inputs=inputs, existing=None
        )
        estimate = await asyncio.to_thread(
            _estimate, cfg, sizing, max_payload=max_payload, measure=measure or _no_measure
        )
    finally:
        rows.close()
    print(format_estimate(estimate, as_json=cfg.as_json), flush=True)
    return DONE


def _no_measure(spec: schemas.JobSpec, rows: SampleTable, device: str):
    raise NotMeasured("this producer was started without a measurement (hsx produce hands it one)")


def _check_same_inputs(cfg: ProducerConfig, existing: schemas.JobSpec) -> None:
    """A re-run uses the stored samples; refuse it when it asks for different ones."""
    if (existing.max_seq_len, existing.on_long) != (cfg.max_seq_len, cfg.on_long):
        raise HsxError(
            f"job {cfg.job} already exists with --max-seq-len {existing.max_seq_len} --on-long {existing.on_long} "
            f"(this run: --max-seq-len {cfg.max_seq_len} --on-long {cfg.on_long}); its samples were made with "
            "those; run with the same settings or use another --job name"
        )
    if existing.chat_convention != str(cfg.chat_as):
        raise HsxError(
            f"job {cfg.job} already exists with --chat-as {existing.chat_convention} (this run: --chat-as "
            f"{cfg.chat_as}); its samples were made with that; run with the same setting or use another --job name"
        )
    if existing.rows_bad:
        rows = existing.rows_read
        if not rows:  # a spec from before rows_read: one row a sample, as every convention then made
            rows = existing.total_samples + existing.samples_skipped + existing.rows_bad
            if existing.on_empty_mask == "skip":
                rows += existing.samples_empty_mask
        cap = cfg.max_bad_rows
        if cfg.on_bad_row != "skip" or (cap is not None and not cap.allows(existing.rows_bad, rows)):
            asked = f"--on-bad-row {cfg.on_bad_row}" + (f" --max-bad-rows {cap}" if cap is not None else "")
            raise HsxError(
                f"job {cfg.job} already exists with {existing.rows_bad} of {rows} rows set aside as bad "
                f"(--on-bad-row skip; this run: {asked}); its samples were made without them; run with "
                "--on-bad-row skip and a cap they fit, or use another --job name"
            )
    if existing.samples_empty_mask and existing.on_empty_mask != cfg.on_empty_mask:
        raise HsxError(
            f"job {cfg.job} already exists with {existing.samples_empty_mask} samples of an all-zero loss mask "
            f"(--on-empty-mask {existing.on_empty_mask}; this run: --on-empty-mask {cfg.on_empty_mask}); its "
            "samples were made with that; run with the same setting or use another --job name"
        )
    if existing.dataset_digest and dataset_digest(cfg.dataset) != existing.dataset_digest:
        raise HsxError(
            f"job {cfg.job} already exists with a different dataset: {cfg.dataset} is not the data the job was made "
            f"from ({existing.dataset}, sha256 {existing.dataset_digest[:12]}...); use another --job name"
        )


async def _stored_rows(cfg: ProducerConfig, js, info, existing: schemas.JobSpec | None) -> SampleTable | None:
    """The job's samples from its stored copy (a re-run), or None when the dataset is to be read."""
    if existing is not None and existing.tokenized_object:
        try:
            await asyncio.to_thread(_check_same_inputs, cfg, existing)
        except HsxError:
            if existing.published:
                raise
            # Not published yet: the re-run may replace the job with other inputs (see _produce).
            return None
        rows = await stored.load_tokenized(js, cfg.job, spec=existing)
        await asyncio.to_thread(check_vocab, rows, model=cfg.model, vocab_size=info.vocab_size)
        log.info(
            "samples_from_store",
            job=cfg.job,
            samples=len(rows),
            bucket=topology.DATASETS_BUCKET,
            object=existing.tokenized_object,
        )
        return rows
    return None


async def _read_inputs(cfg: ProducerConfig, info, *, on_round=None) -> Inputs:
    """The dataset read and tokenized under the job's settings (`on_round`: each round's `Round`)."""
    return await asyncio.to_thread(read_inputs, cfg, info, on_round=on_round)


def _report(cfg: ProducerConfig, inputs: Inputs) -> dict:
    return report_document(
        job=cfg.job,
        dataset=cfg.dataset,
        max_seq_len=cfg.max_seq_len,
        on_long=cfg.on_long,
        inputs=inputs,
        chat_as=str(cfg.chat_as),
        on_bad_row=cfg.on_bad_row,
        max_bad_rows=cfg.max_bad_rows,
        on_empty_mask=cfg.on_empty_mask,
    )


async def _store_inputs(cfg: ProducerConfig, js, inputs: Inputs, *, max_payload: int) -> tuple[str, str]:
    tokens = await stored.store_tokenized(js, cfg.job, inputs.samples, max_payload=max_payload)
    report = await stored.store_report(js, cfg.job, _report(cfg, inputs), max_payload=max_payload)
    log.info("samples_stored", job=cfg.job, bucket=topology.DATASETS_BUCKET, object=tokens, samples=len(inputs.samples))
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


async def _produce(cfg: ProducerConfig, nc, info, layers: list[Layer], *, started: float) -> int:
    js = nc.jetstream()
    kv = await topology.ensure_topology(js, replicas=cfg.replicas)
    record = await SpecRecord.read(kv, cfg.job)
    existing = record.spec
    stored_rows = await _stored_rows(cfg, js, info, existing)
    if stored_rows is None and cfg.round_rows:
        return await _produce_in_rounds(cfg, nc, js, record, info, layers, existing, started=started)
    if stored_rows is not None:
        rows, inputs = stored_rows, None
    else:
        inputs = await _read_inputs(cfg, info)
        rows = inputs.samples
    try:
        return await _plan_and_publish(cfg, nc, js, record, info, layers, existing, rows, inputs, started=started)
    finally:
        rows.close()  # the spilled tokens' temp files


async def _produce_in_rounds(
    cfg: ProducerConfig, nc, js, record: SpecRecord, info, layers: list[Layer], existing, *, started: float
) -> int:
    """The dataset read in rounds of --round-rows rows: one round, the whole dataset, goes the one
    plan's way (`_plan_and_publish`, as without rounds); more are planned and published a round
    at a time (`_publish_rounds`) while the next is read."""
    reader = RoundReader(cfg, info)
    try:
        first = await reader.next()
        if first.last:
            inputs = await reader.inputs()
            return await _plan_and_publish(
                cfg, nc, js, record, info, layers, existing, inputs.samples, inputs, started=started
            )
        return await _publish_rounds(cfg, nc, js, record, info, layers, existing, reader, first, started=started)
    finally:
        await reader.close()  # the samples' spill files too


async def _plan(
    cfg: ProducerConfig,
    layers: list[Layer],
    rows: SampleTable,
    *,
    from_store: bool,
    round_starts: list[int] | None = None,
    rounds_of: schemas.JobSpec | None = None,
) -> tuple[list[PlannedBatch], str]:
    """The plan and its fingerprint: one plan over `rows`, or, with more than one of
    `round_starts` (a dry run's rounds) or for `rounds_of`, a stored job published in rounds,
    the rounds' plans one after another (producer/rounds.py)."""
    if rounds_of is not None and len(rounds_of.round_starts) > 1:
        round_starts = rounds_of.round_starts
    if round_starts is not None and len(round_starts) > 1:
        batches = plan_in_rounds(
            rows.lengths, round_starts, token_budget=cfg.token_budget, max_batch_size=cfg.max_batch_size
        )
        if rounds_of is not None:
            fingerprint = round_fingerprint(
                cfg,
                layers,
                model_revision=rounds_of.model_revision,
                dataset_digest=rounds_of.dataset_digest,
                round_rows=rounds_of.round_rows,
            )
        else:  # a dry run: no dataset digest is read; only the fingerprint's length counts there
            fingerprint = round_fingerprint(
                cfg, layers, model_revision="", dataset_digest="", round_rows=cfg.round_rows
            )
    else:
        batches = plan_batches(rows.lengths, token_budget=cfg.token_budget, max_batch_size=cfg.max_batch_size)
        fingerprint = await asyncio.to_thread(plan_fingerprint, cfg, layers, rows)
    padded = sum(b.padded_tokens for b in batches)
    log.info(
        "plan_ready",
        job=cfg.job,
        samples=len(rows),
        batches=len(batches),
        tokens=rows.total_tokens,
        packing_efficiency=round(rows.total_tokens / padded, 4),
        fingerprint=fingerprint[:12],
        from_store=from_store,
    )
    return batches, fingerprint


async def _plan_and_publish(
    cfg: ProducerConfig,
    nc,
    js,
    record: SpecRecord,
    info,
    layers: list[Layer],
    existing,
    rows: SampleTable,
    inputs: Inputs | None,
    *,
    started: float,
) -> int:
    """Plan, check, store and publish; `started` is when produce began (its summary's seconds)."""
    batches, fingerprint = await _plan(
        cfg, layers, rows, from_store=inputs is None, rounds_of=existing if inputs is None else None
    )
    replaces = existing is not None and (existing.plan_fingerprint != fingerprint or existing.dest != str(cfg.dest))
    plan = schemas.plan_tag_of(fingerprint)
    if existing is not None and existing.published:
        if replaces:
            await asyncio.to_thread(_refuse_published, cfg, existing, info, layers)
        log.info(
            "job_already_published",
            job=cfg.job,
            batches=existing.total_batches,
            seconds=round(time.monotonic() - started, 2),
        )
        owner = await _check_folder(cfg, plan, len(rows), existing)
        if owner is not None:
            await _remove_replaced(cfg, owner, plan)
        await _write_bundle(js, existing, batches, max_batch_size=cfg.max_batch_size)
        _say_published(cfg, existing, new=0)
        return DONE
    # Everything that can refuse the job, before anything of it is written.
    checked = await asyncio.to_thread(
        preflight.check_payloads,
        _descriptors(cfg.job, fingerprint, batches, rows),
        max_payload=nc.max_payload,
        token_budget=cfg.token_budget,
        max_seq_len=cfg.max_seq_len,
    )
    if not cfg.ignore_free_space:
        sizing = Sizing(
            info=info,
            layers=layers,
            fingerprint=fingerprint,
            rows=rows,
            batches=batches,
            inputs=inputs,
            existing=existing,
        )
        await asyncio.to_thread(_check_free_space, cfg, sizing, max_payload=nc.max_payload)
    await asyncio.to_thread(preflight.check_destination, cfg.dest, cfg.job)
    owner = await _check_folder(cfg, plan, len(rows), existing)
    log.info("preflight_passed", job=cfg.job, batches=checked, max_payload=nc.max_payload, dest=str(cfg.dest))
    if replaces:
        await _replace_unpublished(js, cfg, existing, fingerprint)
    if owner is not None:
        await _remove_replaced(cfg, owner, plan)
    if inputs is not None:
        tokens_object, report_object = await _store_inputs(cfg, js, inputs, max_payload=nc.max_payload)
        digest = await asyncio.to_thread(dataset_digest, cfg.dataset)
    else:
        tokens_object, report_object, digest = (
            existing.tokenized_object,
            existing.report_object,
            existing.dataset_digest,
        )
    spec = _job_spec(
        cfg,
        info,
        layers,
        fingerprint,
        rows,
        batches,
        created_at=existing.created_at if existing and not replaces else time.time(),
        tokenized_object=tokens_object,
        report_object=report_object,
        dataset_digest=digest,
        **_input_counts(cfg, inputs, existing),
    )
    # The folder says whose files it holds before any worker can write one (producer/bundle.py).
    await asyncio.to_thread(bundle.claim_folder, spec)
    await stored.store_digests(js, cfg.job, await asyncio.to_thread(table_digests, rows), max_payload=nc.max_payload)
    spec = await _record(record, spec)
    # The durables that count the job's markers exist from its start (readers make them too).
    await _ensure_progress_counters(js, cfg.job, spec.plan_tag)
    # Queued or finished already: a producer stopped mid-publish, or one racing this one.
    accounted = await _accounted(js, cfg.job)
    already = sum(plan_batch_id(cfg.job, fingerprint, seq) in accounted for seq in range(len(batches)))
    published, duplicates = await _publish_batches(js, cfg, fingerprint, batches, rows, skip=accounted)
    republished = await _republish_forgotten(js, cfg, spec, batches, rows, duplicates)
    spec = await _record(record, msgspec.structs.replace(spec, published=True))
    log.info(
        "job_published",
        job=cfg.job,
        batches=len(batches),
        new=published + republished,
        duplicates=len(duplicates) - republished,
        already_queued_or_done=already,
        samples=len(rows),
        samples_empty_mask=spec.samples_empty_mask,
        seconds=round(time.monotonic() - started, 2),
    )
    await _write_bundle(js, spec, batches, max_batch_size=cfg.max_batch_size)
    _say_published(cfg, spec, new=published + republished)
    return DONE


def _say_published(cfg: ProducerConfig, spec: schemas.JobSpec, *, new: int) -> None:
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


async def _write_bundle(js, spec: schemas.JobSpec, batches: list[PlannedBatch], *, max_batch_size) -> None:
    """The job's bundle (producer/bundle.py), written again whole after an outage (it skips what
    the destination holds already)."""
    await through_outage(
        lambda: bundle.write_bundle(js, spec, batches, max_batch_size=max_batch_size), what="write_bundle"
    )


async def _ensure_progress_counters(js, job: str, plan: str) -> None:
    """The durables that count the job's markers, from its start (readers make them too)."""
    for counter in topology.PROGRESS_COUNTERS:
        await through_outage(
            lambda counter=counter: topology.ensure_progress_counter(js, job, plan, counter), what="progress_counter"
        )


async def _accounted(js, job: str) -> set[str]:
    """The batch ids queued or done (producer/resume.py), read again through an outage."""
    return await through_outage(lambda: resume.accounted_batch_ids(js, job), what="read_accounted_batches")


# What a job's plan depends on that its spec does not record: when none of what it records
# differs, one of these (or the rows themselves) did.
_UNRECORDED = "--max-batch-size, --chat-field, --on-bad-row, --max-bad-rows"


def _refuse_published(
    cfg: ProducerConfig, existing: schemas.JobSpec, info, layers: list[Layer], *, digest: str | None = None
) -> None:
    """One line naming each setting of this run that differs from the published job's (`digest`:
    the dataset's, when the caller has it; read here otherwise)."""
    if digest is None and existing.dataset_digest:
        digest = dataset_digest(cfg.dataset)
    recorded = [
        ("--model", existing.model, cfg.model),
        ("the model's revision", existing.model_revision, info.revision),
        ("--layers", _layer_list(existing.layers), _layer_list(layers)),
        ("--dtype", existing.dtype, cfg.dtype),
        ("--dest", existing.dest, str(cfg.dest)),
        ("--token-budget", existing.token_budget, cfg.token_budget),
        ("--max-seq-len", existing.max_seq_len, cfg.max_seq_len),
        ("--on-long", existing.on_long, cfg.on_long),
        ("--chat-as", existing.chat_convention, str(cfg.chat_as)),
        ("--on-empty-mask", existing.on_empty_mask, cfg.on_empty_mask),
    ]
    if existing.round_rows:  # a job published in rounds: their size decides its plan
        recorded.append(("--round-rows", existing.round_rows, cfg.round_rows))
    differ = [f"{name} {theirs} (this run: {ours})" for name, theirs, ours in recorded if theirs != ours]
    if existing.dataset_digest and digest and digest != existing.dataset_digest:
        differ.insert(0, f"--dataset {existing.dataset} (this run: {cfg.dataset}, other data)")
    what = "; ".join(differ) if differ else f"the same recorded settings, so the rows or one of {_UNRECORDED}"
    raise HsxError(
        f"job {cfg.job} already exists with a different dataset or settings ({existing.total_samples} samples): "
        f"{what}; use another --job name, or delete the job first (hsx jobs delete {cfg.job})"
    )


def _layer_list(layers) -> str:
    return ",".join(str(layer) for layer in layers)


def _round_descriptors(cfg: ProducerConfig, fingerprint: str, batches: list[PlannedBatch], seqs: range, rows):
    for seq in seqs:
        yield _descriptor(cfg.job, fingerprint, plan_batch_id(cfg.job, fingerprint, seq), batches[seq], rows)


async def _publish_rounds(
    cfg: ProducerConfig,
    nc,
    js,
    record: SpecRecord,
    info,
    layers: list[Layer],
    existing: schemas.JobSpec | None,
    reader: RoundReader,
    first,
    *,
    started: float,
) -> int:
    """A plan of several rounds: each round planned on its own, checked (payloads, room), recorded
    in the spec (totals grown, `round_starts` one longer) and then published, while the reader
    reads the next; after the last, the samples and report are stored and the spec says
    `published`. Round 0 is checked as a whole plan is (nothing is written before it passes); a
    refusal found in a later round (a bad or long row, a cap, no room) leaves what was published
    to run, records why in the spec (`stopped`: the job then ends failed, naming it) and exits
    with that reason. Run again, the same job resumes: its fingerprint does not depend on the
    samples, and batches already queued or done are not published twice."""
    digest = await asyncio.to_thread(dataset_digest, cfg.dataset)
    fingerprint = round_fingerprint(
        cfg, layers, model_revision=info.revision, dataset_digest=digest, round_rows=cfg.round_rows
    )
    plan = schemas.plan_tag_of(fingerprint)
    replaces = existing is not None and (existing.plan_fingerprint != fingerprint or existing.dest != str(cfg.dest))
    if existing is not None and existing.published and replaces:
        _refuse_published(cfg, existing, info, layers, digest=digest)
    # The job's identity (JobWatch): fixed when it is first recorded, kept by every round and rerun.
    created_at = existing.created_at if existing and not replaces else time.time()
    cut, starts = first, [0]
    long, empty = list(first.long), list(first.empty_masks)
    rows = first.samples
    batches = plan_in_rounds(rows.lengths, starts, token_budget=cfg.token_budget, max_batch_size=cfg.max_batch_size)

    room = {"files": 0, "bundle_per_token": 0.0}  # what the rounds so far need at the destination

    def check_room(new: SampleTable, first_index: int) -> None:
        """The destination's free space against every round so far: round 0 sized exactly, as a
        whole plan is (`_estimate`); each later round's sample files added (sized exactly) and
        the bundle scaled from round 0's per token (sizing it again would encode every token so
        far once a round)."""
        if first_index == 0:
            so_far = Inputs(samples=rows, long=long, rows_read=0, chat_rows=0, chat=None, empty_masks=tuple(empty))
            sizing = Sizing(
                info=info,
                layers=layers,
                fingerprint=fingerprint,
                rows=rows,
                batches=batches,
                inputs=so_far,
                existing=existing,
            )
            estimate = _estimate(cfg, sizing, max_payload=nc.max_payload)
            room["files"] = estimate.bytes
            room["bundle_per_token"] = estimate.bundle_bytes / max(1, rows.total_tokens)
            free = estimate.free_space
        else:
            room["files"] += int(sample_file_sizes(new, round_spec(), first_index=first_index).sum())
            bundle = int(room["bundle_per_token"] * rows.total_tokens)
            free = free_space(cfg.dest, cfg.job, job_bytes=room["files"] + bundle)
        _refuse_without_room(cfg, free, round=len(starts) - 1)

    async def check(seqs: range, new: SampleTable, first_index: int) -> int:
        checked = await asyncio.to_thread(
            preflight.check_payloads,
            _round_descriptors(cfg, fingerprint, batches, seqs, rows),
            max_payload=nc.max_payload,
            token_budget=cfg.token_budget,
            max_seq_len=cfg.max_seq_len,
        )
        if not cfg.ignore_free_space and cfg.dest.local_folder is not None:
            await asyncio.to_thread(check_room, new, first_index)
        return checked

    def round_spec(**final) -> schemas.JobSpec:
        counts = final.pop("counts", None) or {
            "samples_truncated": sum(1 for e in long if e.action == "truncated"),
            "samples_skipped": sum(1 for e in long if e.action == "skipped"),
            "rows_bad": cut.rows_bad,
            "rows_read": 0,  # known once the dataset is read
            "on_empty_mask": cfg.on_empty_mask,
            "samples_empty_mask": len(empty),
        }
        spec = _job_spec(
            cfg,
            info,
            layers,
            fingerprint,
            rows,
            batches,
            created_at=created_at,
            tokenized_object=final.pop("tokenized_object", ""),
            report_object=final.pop("report_object", ""),
            dataset_digest=digest,
            **counts,
        )
        return msgspec.structs.replace(spec, round_rows=cfg.round_rows, round_starts=list(starts), **final)

    # Round 0: everything that can refuse the job, before anything of it is written.
    checked = await check(range(len(batches)), rows, 0)
    await asyncio.to_thread(preflight.check_destination, cfg.dest, cfg.job)
    owner = await _check_folder(cfg, plan, len(rows), existing)
    log.info("preflight_passed", job=cfg.job, batches=checked, max_payload=nc.max_payload, dest=str(cfg.dest), round=0)
    if replaces:
        await _replace_unpublished(js, cfg, existing, fingerprint)
    if owner is not None:
        await _remove_replaced(cfg, owner, plan)
    spec = round_spec()
    await asyncio.to_thread(bundle.claim_folder, spec)

    async def record_grown(grown: schemas.JobSpec) -> None:
        """The spec written over the one this run read or wrote last, and only over it: a job
        deleted (or produced again) meanwhile is not brought back by the next round."""
        recorded = record.spec
        try:
            await record.write(grown)
        except SpecChanged:
            raise HsxError(
                f"job {cfg.job} was deleted or produced again while its plan was published in rounds (after "
                f"{len(recorded.round_starts)} rounds, {recorded.total_samples} samples); this producer stopped"
            ) from None

    # A rerun of a job whose rounds are recorded resumes from them: the spec it read stays as it
    # is (workers serve those rounds meanwhile) until this run has read past them; a spec this
    # run would write for fewer rounds is never written.
    resumed = existing if existing is not None and not replaces else None
    recorded_rounds = len(resumed.round_starts) if resumed is not None else 0
    # The digests of the rounds so far, grown by each round's and stored before it is recorded.
    # A rerun stores them only once it has read past the rounds recorded: the object never holds
    # fewer samples than a spec recorded names.
    digests = bytearray(await asyncio.to_thread(table_digests, rows))
    if recorded_rounds <= 1:
        await stored.store_digests(js, cfg.job, bytes(digests), max_payload=nc.max_payload)
    if recorded_rounds == 0:
        spec = await _record(record, spec)
        created_at = spec.created_at  # a producer of the same plan may have recorded it first
    elif resumed.stopped:  # the cause is gone (this run got past the checks): the job runs on
        await record_grown(msgspec.structs.replace(resumed, stopped=""))

    await _ensure_progress_counters(js, cfg.job, spec.plan_tag)
    accounted = await _accounted(js, cfg.job)
    totals = {"new": 0, "duplicates": 0, "already": 0}

    async def publish(seqs: range) -> None:
        totals["already"] += sum(plan_batch_id(cfg.job, fingerprint, seq) in accounted for seq in seqs)
        new, duplicates = await _publish_batches(js, cfg, fingerprint, batches, rows, skip=accounted, seqs=seqs)
        republished = await _republish_forgotten(js, cfg, spec, batches, rows, duplicates)
        totals["new"] += new + republished
        totals["duplicates"] += len(duplicates) - republished
        log.info(
            "round_published",
            job=cfg.job,
            round=len(starts) - 1,
            samples=len(rows) - starts[-1],
            batches=len(seqs),
            samples_so_far=len(rows),
            seconds=round(time.monotonic() - started, 2),
        )

    try:
        await publish(range(len(batches)))
        while not cut.last:
            try:
                cut = await reader.next()
                if cut.last and not len(cut.samples):
                    break  # the dataset's last rows were all set aside: they make no round of their own
                starts.append(len(rows))
                long += cut.long
                empty += cut.empty_masks
                rows = SampleTable.concat([rows, cut.samples])
                before = len(batches)
                batches = (
                    batches
                    + plan_in_rounds(  # the new round's alone; the others are planned
                        rows.lengths, starts[-1:], token_budget=cfg.token_budget, max_batch_size=cfg.max_batch_size
                    )
                )
                await check(range(before, len(batches)), cut.samples, starts[-1])
                if len(starts) <= recorded_rounds and starts[-1] != resumed.round_starts[len(starts) - 1]:
                    raise HsxError(
                        f"round {len(starts) - 1} of the dataset starts at sample {starts[-1]}, but job {cfg.job}'s "
                        f"spec records it at sample {resumed.round_starts[len(starts) - 1]}: the dataset was not read "
                        "into the same samples as by the run that recorded it"
                    )
            except HsxError as exc:
                stopped = record.spec  # the largest spec recorded: what was published, which runs
                await _stop(record_grown, stopped, str(exc))
                raise HsxError(
                    f"{exc}; job {cfg.job} stopped after {len(stopped.round_starts)} rounds of --round-rows "
                    f"{cfg.round_rows} ({stopped.total_samples} samples published, which run; the job then ends failed): "
                    f"run hsx produce again once this is fixed and it resumes, or, for another dataset or settings, "
                    f"hsx jobs delete {cfg.job} first"
                ) from None
            # The spec grows before the round's batches go out: a worker that gets one finds it planned,
            # and its samples' digests are stored before the spec names them.
            digests += await asyncio.to_thread(table_digests, cut.samples)
            if len(starts) >= recorded_rounds:
                await stored.store_digests(js, cfg.job, bytes(digests), max_payload=nc.max_payload)
            spec = round_spec()
            if len(starts) > recorded_rounds:
                await record_grown(spec)
            await publish(range(before, len(batches)))
        inputs = await reader.inputs()
        tokens_object, report_object = await _store_inputs(cfg, js, inputs, max_payload=nc.max_payload)
        rows = inputs.samples
        spec = round_spec(
            tokenized_object=tokens_object,
            report_object=report_object,
            counts=_input_counts(cfg, inputs, existing),
            published=True,
        )
        await record_grown(spec)
        log.info(
            "job_published",
            job=cfg.job,
            batches=len(batches),
            rounds=len(starts),
            packing_efficiency=round(rows.total_tokens / max(1, sum(b.padded_tokens for b in batches)), 4),
            new=totals["new"],
            duplicates=totals["duplicates"],
            already_queued_or_done=totals["already"],
            samples=len(rows),
            samples_empty_mask=spec.samples_empty_mask,
            seconds=round(time.monotonic() - started, 2),
        )
        await _write_bundle(js, spec, batches, max_batch_size=cfg.max_batch_size)
        _say_published(cfg, spec, new=totals["new"])
        return DONE
    except NATS_OUTAGE_ERRORS as exc:
        # Past the outage budget of a step: the spec says why the producer stopped, if NATS answers
        # within a few seconds more (a rerun resumes and clears it).
        reason = f"NATS did not answer for {OUTAGE_RETRY_S:g} s ({type(exc).__name__})"
        try:
            await record.write(msgspec.structs.replace(record.spec, stopped=reason), give_up_after_s=5.0)
        except (*NATS_OUTAGE_ERRORS, SpecChanged):
            log.warning("job_stop_not_recorded", job=cfg.job, reason=reason)
        raise


async def _record(record: SpecRecord, spec: schemas.JobSpec) -> schemas.JobSpec:
    """The job's spec written by compare-and-set over what this run read; the spec written. A
    producer of the same plan that recorded it first (two started together) is joined: its
    `created_at` is kept, the job's identity. Anything else recorded meanwhile (a job deleted,
    another plan, a racer further on) stops this run in one line."""
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
                "job_spec_joined", job=spec.job, plan=spec.plan_tag, reason="recorded by a producer of the same plan"
            )
            if spec == theirs:
                return spec
    raise HsxError(
        f"job {spec.job} was recorded, deleted or produced again by someone else while this producer "
        "ran; nothing of this run was recorded; run hsx produce again to see the job as it is now"
    )


_RECORD_ATTEMPTS = 5


async def _stop(record, spec: schemas.JobSpec, reason: str) -> None:
    """Record in the job's spec (with `record`) why its producer stopped before publishing the
    whole plan; a job deleted meanwhile is left deleted."""
    log.error("job_stopped", job=spec.job, rounds=len(spec.round_starts), samples=spec.total_samples, reason=reason)
    try:
        await record(msgspec.structs.replace(spec, stopped=reason))
    except HsxError as exc:
        log.warning("job_stop_not_recorded", job=spec.job, reason=str(exc))


def _input_counts(cfg: ProducerConfig, inputs: Inputs | None, existing: schemas.JobSpec | None) -> dict:
    """The job spec's fields that count what reading the dataset set aside: this run's, or the
    stored job's when its samples come from the store (`inputs` None)."""
    if inputs is not None:
        return {
            "samples_truncated": inputs.truncated,
            "samples_skipped": inputs.skipped,
            "rows_bad": len(inputs.bad_rows),
            "rows_read": inputs.rows_read,
            "on_empty_mask": cfg.on_empty_mask,
            "samples_empty_mask": len(inputs.empty_masks),
        }
    return {
        "samples_truncated": existing.samples_truncated,
        "samples_skipped": existing.samples_skipped,
        "rows_bad": existing.rows_bad,
        "rows_read": existing.rows_read,
        "on_empty_mask": existing.on_empty_mask,
        "samples_empty_mask": existing.samples_empty_mask,
    }


def _job_spec(
    cfg: ProducerConfig,
    info,
    layers: list[Layer],
    fingerprint: str,
    rows: SampleTable,
    batches: list[PlannedBatch],
    *,
    created_at: float,
    tokenized_object: str,
    report_object: str,
    dataset_digest: str,
    **input_counts,
) -> schemas.JobSpec:
    return schemas.JobSpec(
        job=cfg.job,
        model=cfg.model,
        model_revision=info.revision,
        layers=layers,
        layer_preset=preset_of(cfg.layers) or "",
        num_layers=info.num_layers,
        hidden_size=info.hidden_size,
        dtype=cfg.dtype,
        dest=str(cfg.dest),
        token_budget=cfg.token_budget,
        max_seq_len=cfg.max_seq_len,
        dataset=str(cfg.dataset),
        plan_fingerprint=fingerprint,
        total_samples=len(rows),
        total_tokens=rows.total_tokens,
        total_batches=len(batches),
        created_at=created_at,
        trust_remote_code=cfg.trust_remote_code,
        tokenized_object=tokenized_object,
        report_object=report_object,
        dataset_digest=dataset_digest,
        on_long=cfg.on_long,
        chat_convention=str(cfg.chat_as),
        sample_digests=True,
        **input_counts,
    )


async def _republish_forgotten(
    js, cfg: ProducerConfig, spec: schemas.JobSpec, batches: list[PlannedBatch], rows, duplicates: list[int]
) -> int:
    """Publish again the batches the stream called duplicates but holds nowhere: their ids are
    remembered (for the duplicate window) from a job of this name that was deleted or replaced
    since. They go out under an id of this job's making; any other duplicate is queued or done."""
    if not duplicates:
        return 0
    accounted = await _accounted(js, cfg.job)
    forgotten = {plan_batch_id(cfg.job, spec.plan_fingerprint, seq) for seq in duplicates} - accounted
    if not forgotten:
        return 0
    new, _ = await _publish_batches(
        js,
        cfg,
        spec.plan_fingerprint,
        batches,
        rows,
        skip={plan_batch_id(cfg.job, spec.plan_fingerprint, seq) for seq in range(len(batches))} - forgotten,
        msg_id_suffix=f"@{spec.created_at!r}",
    )
    log.warning(
        "batches_republished",
        job=cfg.job,
        batches=len(forgotten),
        new=new,
        reason="the stream remembered their ids from an earlier job of this name, which holds them no more",
    )
    return new


async def _check_folder(
    cfg: ProducerConfig, plan: str, total_samples: int, existing: schemas.JobSpec | None
) -> preflight.FolderOwner | None:
    return await asyncio.to_thread(
        preflight.check_folder,
        cfg.dest,
        cfg.job,
        plan=plan,
        total_samples=total_samples,
        known=existing,
        replace=cfg.replace_output,
    )


async def _remove_replaced(cfg: ProducerConfig, owner: preflight.FolderOwner, plan: str) -> None:
    """The job takes over a folder of another plan: that plan's bundle goes, its index first. Its
    sample files stay until this job's overwrite them: each names its plan, so neither a reader
    nor the uploader's "already stored" test (size and digest) takes one for this job's."""
    removed = await asyncio.to_thread(bundle.remove_replaced, cfg.dest, cfg.job)
    log.warning(
        "output_replaced",
        job=cfg.job,
        folder=f"{cfg.dest}/{cfg.job}",
        replaced=owner.what,
        plan=plan,
        removed=removed,
        sample_files="left to be overwritten by this job's",
    )


async def _replace_unpublished(js, cfg: ProducerConfig, existing: schemas.JobSpec, fingerprint: str) -> None:
    """A job never fully published takes other settings on a re-run, as long as nothing has worked
    on the old ones: no worker alive (it read the old spec at start), nothing written, dead or
    waiting for upload. Its orphan batches are dropped from the queue first."""
    alive = await live_workers(js, cfg.job)
    job = cfg.job
    progress = {
        "batches written": await count_stored(js, topology.EVENTS_STREAM, topology.markers_all(job, "written", "*")),
        "dead letters": await count_messages(js, topology.DEAD_STREAM, topology.dead_subject_all(job)),
        "files waiting for upload": await count_messages(js, topology.FILES_STREAM, topology.files_subject_all(job)),
    }
    worked = {what: count for what, count in progress.items() if count}
    if alive or worked:
        found = (
            f"{len(alive)} live workers ({'; '.join(alive[:3])})"
            if alive
            else ", ".join(f"{count} {what}" for what, count in worked.items())
        )
        raise HsxError(
            f"job {cfg.job} exists with other settings (dest {existing.dest}, {existing.total_samples} samples, plan "
            f"{existing.plan_fingerprint[:12]}) and is not fully published, but it has {found}; "
            f"delete it first (hsx jobs delete {cfg.job}) or use another --job name"
        )
    orphans = await count_messages(js, topology.BATCHES_STREAM, topology.batch_subject(cfg.job))
    if orphans:
        await js.purge_stream(topology.BATCHES_STREAM, subject=topology.batch_subject(cfg.job))
    log.warning(
        "job_spec_replaced",
        job=cfg.job,
        old_plan=existing.plan_fingerprint[:12],
        plan=schemas.plan_tag_of(fingerprint),
        old_dest=existing.dest,
        dest=str(cfg.dest),
        orphan_batches_dropped=orphans,
    )
