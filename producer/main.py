"""`hsx produce`: dataset -> samples (stored) -> plan -> job spec in KV -> one descriptor per batch.

The dataset is read and its chat rows tokenized once (`producer/inputs.py`); the resulting samples
are stored with the job in the object store (`producer/stored.py`) before the job spec names them.
A re-run for an existing job plans from that stored copy, never from the dataset again, so a
tokenizer or template changed since cannot change the plan (the dataset's bytes are only hashed,
to refuse a different dataset under the same job name).

Batch ids derive from the plan's fingerprint (model, layers, dtype, budget and every sample's
tokens), so the same samples and settings always give the same ids; they go out as
`Nats-Msg-Id`, and the job spec records when everything was published, so running the producer
again publishes nothing twice. A job name already used for a different plan is refused.
Once the job is published, its bundle (spec, samples, plan, report) goes to the destination under
`<job>/_hsx/` (producer/bundle.py), on every run, so the job can be resumed elsewhere.
"""

import asyncio
import hashlib
import time

import msgspec
import numpy as np
import structlog

from hsx import schemas, topology
from hsx.errors import HsxError
from hsx.headers import message_headers
from hsx.jobs import read_job_spec
from hsx.layers import resolve_layers
from hsx.modelinfo import load_model_info
from hsx.natsconn import connect
from producer.config import ProducerConfig
from producer import bundle, stored
from producer.dataset import DatasetRow, dataset_digest
from producer.inputs import Inputs, check_vocab, report_document, tokenized_rows
from producer.planner import PlannedBatch, plan_batch_id, plan_batches

log = structlog.get_logger("hsx.producer")

_PUBLISH_WINDOW = 256


def plan_fingerprint(cfg: ProducerConfig, layers: list[int], rows: list[DatasetRow]) -> str:
    digest = hashlib.sha256()
    digest.update(msgspec.json.encode([cfg.model, layers, cfg.dtype, cfg.token_budget, cfg.max_batch_size]))
    for row in rows:
        digest.update(np.asarray(row.input_ids, dtype=np.int64).tobytes())
        digest.update(b"|" if row.loss_mask is None else np.asarray(row.loss_mask, dtype=np.int8).tobytes())
        digest.update(row.source_id.encode() + b"\n")
    return digest.hexdigest()


def _descriptor(job: str, batch_id: str, batch: PlannedBatch, rows: list[DatasetRow]) -> schemas.BatchDescriptor:
    return schemas.BatchDescriptor(
        job=job,
        batch_id=batch_id,
        padded_len=batch.padded_len,
        samples=[
            schemas.Sample(
                index=i, source_id=rows[i].source_id, input_ids=rows[i].input_ids, loss_mask=rows[i].loss_mask
            )
            for i in batch.sample_indices
        ],
    )


async def _publish_all(js, cfg: ProducerConfig, fingerprint: str, batches: list[PlannedBatch], rows, max_payload: int) -> int:
    subject = topology.batch_subject(cfg.job)
    published = 0

    async def publish_one(seq: int, batch: PlannedBatch) -> bool:
        batch_id = plan_batch_id(cfg.job, fingerprint, seq)
        payload = schemas.encode(_descriptor(cfg.job, batch_id, batch, rows))
        if len(payload) > max_payload:
            raise HsxError(
                f"batch {batch_id} encodes to {len(payload)} bytes, more than the NATS server's max_payload "
                f"{max_payload}; lower --token-budget or raise max_payload on the server"
            )
        ack = await js.publish(subject, payload, headers=message_headers(cfg.job, batch=batch_id, msg_id=batch_id))
        return not ack.duplicate

    for start in range(0, len(batches), _PUBLISH_WINDOW):
        window = batches[start : start + _PUBLISH_WINDOW]
        results = await asyncio.gather(*(publish_one(start + k, b) for k, b in enumerate(window)))
        published += sum(results)
    return published


async def run(cfg: ProducerConfig) -> int:
    info = load_model_info(cfg.model, trust_remote_code=cfg.trust_remote_code)
    layers = resolve_layers(list(cfg.layers), info.num_layers, model=cfg.model)
    if cfg.token_budget < cfg.max_seq_len:
        raise HsxError(
            f"--token-budget {cfg.token_budget} is smaller than --max-seq-len {cfg.max_seq_len}: "
            "the longest allowed sample must fit in one batch"
        )
    # Reach NATS first: an unreachable server is reported at once, not after reading a big dataset.
    nc = await connect(cfg.nats, name=f"hsx-producer-{cfg.job}")
    try:
        return await _produce(cfg, nc, info, layers)
    finally:
        await nc.drain()


def _check_same_inputs(cfg: ProducerConfig, existing: schemas.JobSpec) -> None:
    """A re-run uses the stored samples; refuse it when it asks for different ones."""
    if (existing.max_seq_len, existing.on_long) != (cfg.max_seq_len, cfg.on_long):
        raise HsxError(
            f"job {cfg.job} already exists with --max-seq-len {existing.max_seq_len} --on-long {existing.on_long} "
            f"(this run: --max-seq-len {cfg.max_seq_len} --on-long {cfg.on_long}); its samples were made with "
            "those; run with the same settings or use another --job name"
        )
    if existing.dataset_digest and dataset_digest(cfg.dataset) != existing.dataset_digest:
        raise HsxError(
            f"job {cfg.job} already exists with a different dataset: {cfg.dataset} is not the data the job was made "
            f"from ({existing.dataset}, sha256 {existing.dataset_digest[:12]}...); use another --job name"
        )


async def _job_rows(cfg: ProducerConfig, js, info, existing: schemas.JobSpec | None):
    """(samples, freshly read inputs or None when the samples come from the job's stored copy)."""
    if existing is not None and existing.tokenized_object:
        await asyncio.to_thread(_check_same_inputs, cfg, existing)
        rows = await stored.load_tokenized(js, cfg.job, spec=existing)
        await asyncio.to_thread(check_vocab, rows, model=cfg.model, vocab_size=info.vocab_size)
        log.info("samples_from_store", job=cfg.job, samples=len(rows), bucket=topology.DATASETS_BUCKET,
                 object=existing.tokenized_object)
        return rows, None
    inputs = await asyncio.to_thread(
        tokenized_rows, cfg.dataset, model=cfg.model, vocab_size=info.vocab_size, max_seq_len=cfg.max_seq_len,
        on_long=cfg.on_long, trust_remote_code=cfg.trust_remote_code,
    )
    return inputs.rows, inputs


async def _store_inputs(cfg: ProducerConfig, js, inputs: Inputs) -> tuple[str, str]:
    tokens = await stored.store_tokenized(js, cfg.job, inputs.rows)
    report = await stored.store_report(js, cfg.job, report_document(
        job=cfg.job, dataset=cfg.dataset, max_seq_len=cfg.max_seq_len, on_long=cfg.on_long, inputs=inputs,
    ))
    log.info("samples_stored", job=cfg.job, bucket=topology.DATASETS_BUCKET, object=tokens, samples=len(inputs.rows))
    (log.warning if inputs.long else log.info)(
        "input_report", job=cfg.job, bucket=topology.DATASETS_BUCKET, object=report,
        samples_truncated=inputs.truncated, samples_skipped=inputs.skipped, max_seq_len=cfg.max_seq_len,
    )
    return tokens, report


async def _produce(cfg: ProducerConfig, nc, info, layers: list[int]) -> int:
    js = nc.jetstream()
    kv = await topology.ensure_topology(js, replicas=cfg.replicas)
    existing = await read_job_spec(kv, cfg.job)
    rows, inputs = await _job_rows(cfg, js, info, existing)
    lengths = [len(row.input_ids) for row in rows]
    batches = plan_batches(lengths, token_budget=cfg.token_budget, max_batch_size=cfg.max_batch_size)
    fingerprint = plan_fingerprint(cfg, layers, rows)
    total_tokens = sum(lengths)
    padded = sum(b.padded_tokens for b in batches)
    log.info(
        "plan_ready", job=cfg.job, samples=len(rows), batches=len(batches), tokens=total_tokens,
        packing_efficiency=round(total_tokens / padded, 4), fingerprint=fingerprint[:12],
        from_store=inputs is None,
    )
    if existing is not None:
        if existing.plan_fingerprint != fingerprint or existing.dest != cfg.dest:
            raise HsxError(
                f"job {cfg.job} already exists with a different dataset or settings "
                f"(model {existing.model}, layers {existing.layers}, dest {existing.dest}, "
                f"{existing.total_samples} samples); use another --job name"
            )
        if existing.published:
            log.info("job_already_published", job=cfg.job, batches=existing.total_batches)
            await bundle.write_bundle(js, existing, batches, max_batch_size=cfg.max_batch_size)
            return 0
    if inputs is not None:
        tokens_object, report_object = await _store_inputs(cfg, js, inputs)
        digest = await asyncio.to_thread(dataset_digest, cfg.dataset)
        truncated, skipped = inputs.truncated, inputs.skipped
    else:
        tokens_object, report_object = existing.tokenized_object, existing.report_object
        digest, truncated, skipped = existing.dataset_digest, existing.samples_truncated, existing.samples_skipped
    spec = schemas.JobSpec(
        job=cfg.job, model=cfg.model, model_revision=info.revision, layers=layers, dtype=cfg.dtype,
        dest=cfg.dest, token_budget=cfg.token_budget, max_seq_len=cfg.max_seq_len, dataset=str(cfg.dataset),
        plan_fingerprint=fingerprint, total_samples=len(rows), total_tokens=total_tokens,
        total_batches=len(batches), created_at=existing.created_at if existing else time.time(),
        trust_remote_code=cfg.trust_remote_code, tokenized_object=tokens_object, report_object=report_object,
        dataset_digest=digest, on_long=cfg.on_long, samples_truncated=truncated, samples_skipped=skipped,
    )
    await kv.put(cfg.job, schemas.encode(spec))
    published = await _publish_all(js, cfg, fingerprint, batches, rows, nc.max_payload)
    spec = msgspec.structs.replace(spec, published=True)
    await kv.put(cfg.job, schemas.encode(spec))
    log.info("job_published", job=cfg.job, batches=len(batches), new=published, duplicates=len(batches) - published)
    await bundle.write_bundle(js, spec, batches, max_batch_size=cfg.max_batch_size)
    return 0
