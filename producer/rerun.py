"""What a rerun of `hsx produce` finds on record, and whether it may go on: the samples of the job
on record from their stored copy when this run asks for the same inputs (`stored_rows`,
`check_same_inputs`), a published job that this run would make another plan of refused in one
line naming every setting that differs (`refuse_published`), and a job never fully published
replaced by this run's plan when nothing has worked on it yet (`replace_unpublished`). The plan
itself, and whether it is the job's, is producer/planning.py's and producer/publishing.py's.
Re-runs, replacement and resume: docs/architecture/producer.md.
"""

import asyncio

import structlog

from hsx.errors import HsxError
from hsx.job import JobSpec, Layer, plan_tag_of
from hsx.producer import stored
from hsx.producer.config import ProducerConfig
from hsx.producer.inputs import check_vocab
from hsx.producer.sources import dataset_digest
from hsx.storage.tokens import SampleTable
from hsx.wire import topology
from hsx.wire.counts import count_stored
from hsx.wire.jobs import count_messages, live_workers

log = structlog.get_logger("hsx.producer")


def check_same_inputs(cfg: ProducerConfig, existing: JobSpec) -> None:
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


async def stored_rows(cfg: ProducerConfig, js, info, existing: JobSpec | None) -> SampleTable | None:
    """The job's samples from its stored copy (a re-run), or None when the dataset is to be read."""
    if existing is not None and existing.tokenized_object:
        try:
            await asyncio.to_thread(check_same_inputs, cfg, existing)
        except HsxError:
            if existing.published:
                raise
            # Not published yet: the re-run may replace the job with other inputs (`replace_unpublished`).
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


# What a job's plan depends on that its spec does not record: when none of what it records
# differs, one of these (or the rows themselves) did.
_UNRECORDED = "--max-batch-size, --chat-field, --on-bad-row, --max-bad-rows"


def refuse_published(
    cfg: ProducerConfig, existing: JobSpec, info, layers: list[Layer], *, digest: str | None = None
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


async def replace_unpublished(js, cfg: ProducerConfig, existing: JobSpec, fingerprint: str) -> None:
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
        plan=plan_tag_of(fingerprint),
        old_dest=existing.dest,
        dest=str(cfg.dest),
        orphan_batches_dropped=orphans,
    )
