"""`hsx verify`: check a job's destination against its spec, sample by sample: each file is at its
key, sound, and the file of that sample of that plan (hsx/storage/expected.py); `--recompute K`
reruns K samples on the CPU and compares. It reads the job spec and the destination; it writes
nothing.
"""

from __future__ import annotations

import json
import random
import secrets
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog

from hsx.errors import HsxError
from hsx.job import JobSpec, Layer
from hsx.storage.encodings import Tolerance
from hsx.storage.encodings.float32 import FLOAT32
from hsx.storage.expected import ExpectedSamples, is_missing, mismatches
from hsx.storage.index import INDEX_KEY, read_index
from hsx.storage.layout import BUNDLE_DIR, relative_sample_key, sample_key
from hsx.storage.location import open_job_folder, spec_location
from hsx.storage.reader import dequantize, load_sample
from hsx.storage.samplefile import SampleFileCorrupt, checked_digest
from hsx.storage.tokens import load_table
from hsx.wire import topology
from hsx.wire.jobs import require_job_spec
from hsx.wire.natsconn import NatsSettings, close_connection, connect

log = structlog.get_logger("hsx.verify")

PROGRESS_EVERY = 5000


async def fetch_job(settings: NatsSettings, job: str) -> tuple[JobSpec, Sequence[list[int]] | None]:
    """The job spec, and every sample's token ids as the producer planned them (from the tokenized
    dataset stored with the job; for jobs made before it was stored, from the dataset file):
    `token_ids[i]` reads sample i's from a temp file (hsx/storage/tokens.py), so a job of any size fits."""
    nc = await connect(settings, name=f"hsx-verify-{job}")
    try:
        js = nc.jetstream()
        kv = await topology.require_jobs_bucket(js, job)
        spec = await require_job_spec(kv, job)
        if spec.tokenized_object:
            return spec, (await load_table(js, job, spec=spec)).token_ids
    finally:
        await close_connection(nc)
    return spec, expected_token_ids_from_dataset(spec)


def expected_token_ids_from_dataset(spec: JobSpec) -> Sequence[list[int]] | None:
    """Every sample's token ids in index order, from the dataset the spec names; None when that
    dataset cannot be read on this machine (the comparison is then skipped and reported so)."""
    from hsx.producer.inputs import read_pretokenized

    try:
        rows = read_pretokenized(Path(spec.dataset), max_seq_len=spec.max_seq_len)
    except HsxError as exc:
        log.warning("verify_token_ids_skipped", job=spec.job, dataset=spec.dataset, reason=str(exc))
        return None
    if len(rows) != spec.total_samples:
        log.warning(
            "verify_token_ids_skipped",
            job=spec.job,
            dataset=spec.dataset,
            reason=f"it has {len(rows)} rows, the job has {spec.total_samples} samples (changed since?)",
        )
        return None
    return rows.token_ids


def expected_hidden_size(spec: JobSpec) -> int | None:
    """The model's hidden size: the spec's, or for a job from before the spec recorded it, the
    model config's when it is readable here, else None (then every file must agree with the
    most common size among the files)."""
    if spec.hidden_size:
        return spec.hidden_size
    from hsx.model.modelinfo import load_model_info

    try:
        return load_model_info(spec.model, trust_remote_code=spec.trust_remote_code).hidden_size
    except HsxError as exc:
        log.warning("verify_hidden_size_from_files", job=spec.job, model=spec.model, reason=str(exc))
        return None


class CorruptSample(msgspec.Struct, frozen=True, kw_only=True):
    sample_index: int
    key: str
    reason: str  # "load" (not a loadable sample file), "checksum" (its data was changed) or "read"
    detail: str


class MismatchingSample(msgspec.Struct, frozen=True, kw_only=True):
    sample_index: int
    key: str
    checks: list[str]  # what disagrees: input_ids, hidden_states, metadata keys, the index's digest
    detail: str


class Recomputed(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One sample computed again on the CPU; `max_abs_error` is None when the shapes differ.
    The errors come with the scale they are measured against: the recomputed reference's largest
    magnitude (`reference_max_abs`) and norm (`reference_norm`, the relative error's denominator)."""

    sample_index: int
    ok: bool
    max_abs_error: float | None
    relative_error: float | None
    tolerance: dict[str, float] | None = None  # {"max_abs_error": ...} or {"relative_error": ...}
    reference_max_abs: float | None = None  # max |reference| over the sample's hidden states
    reference_norm: float | None = None  # ||reference||
    detail: str | None = None


class RecomputeReport(msgspec.Struct, frozen=True, kw_only=True):
    requested: int
    seed: int | None
    indices: list[int]
    results: list[Recomputed]


class VerifyReport(msgspec.Struct, frozen=True, kw_only=True):
    """What `hsx verify --json` prints, field for field."""

    job: str
    dest: str
    dtype: str
    layers: list[Layer]
    total_samples: int
    samples_checked: int
    samples_ok: int
    missing: list[int]
    corrupt: list[CorruptSample]
    mismatching: list[MismatchingSample]
    extra_keys: list[str]
    stored_from: str  # "index" or "listing"
    token_ids: str
    token_ids_checked: bool
    hidden_size: int | None
    recompute: RecomputeReport
    seconds: float
    ok: bool


@dataclass
class _Outcome:
    index: int
    status: str  # "ok" | "missing" | "corrupt" | "mismatching"
    reason: str = ""  # corrupt: "load" | "checksum" | "read"
    checks: list[str] = field(default_factory=list)  # mismatching: the failed checks' names
    details: list[str] = field(default_factory=list)
    hidden_size: int | None = None


def check_sample(
    data: bytes,
    *,
    expected: ExpectedSamples,
    index: int,
    expected_ids: list[int] | None,
    hidden_size: int | None,
    indexed_digest: str | None = None,
) -> _Outcome:
    """Every check on one sample file's bytes (already known to be at the sample's key): that it
    loads, its checksum, that it is sample `index` of the plan (hsx.storage.expected.mismatches,
    the ids compared with `expected_ids` when given), and with `indexed_digest` that it is the
    file the job's index recorded."""
    try:
        failed = mismatches(data, expected, index, input_ids=expected_ids, hidden_size=hidden_size)
    except SampleFileCorrupt as exc:  # the header does not parse
        return _Outcome(index, "corrupt", reason="load", details=[str(exc)])
    tensors: dict = {}
    if "hidden_states" not in failed and "encoding" not in failed:  # states of another size: never decoded
        try:
            tensors, _ = load_sample(data)
        except SampleFileCorrupt as exc:
            return _Outcome(index, "corrupt", reason="load", details=[str(exc)])
    try:
        digest = checked_digest([data])
    except SampleFileCorrupt as exc:
        return _Outcome(index, "corrupt", reason="checksum", details=[str(exc)])
    # Last: when the file is another sample's, the checks above say more than its digest does.
    if indexed_digest is not None and digest != indexed_digest and "index" not in failed:
        failed["index"] = (
            f"digest {digest[:12]}, the index recorded {indexed_digest[:12]} (replaced since it was stored?)"
        )
    hidden = tensors.get("hidden_states")
    found_h = hidden.shape[-1] if hidden is not None and hidden.dim() == 3 else None
    if failed:
        return _Outcome(index, "mismatching", checks=list(failed), details=list(failed.values()), hidden_size=found_h)
    return _Outcome(index, "ok", hidden_size=found_h)


def _read_and_check(dest, expected, index, expected_ids, hidden_size, indexed_digest) -> _Outcome:
    try:
        data = dest.read_bytes(relative_sample_key(expected.job, index))
    except Exception as exc:  # anything but a missing object (after the S3 client's retries) is unreadable
        if is_missing(exc):
            return _Outcome(index, "missing")
        return _Outcome(index, "corrupt", reason="read", details=[f"{type(exc).__name__}: {exc}"])
    return check_sample(
        data,
        expected=expected,
        index=index,
        expected_ids=expected_ids,
        hidden_size=hidden_size,
        indexed_digest=indexed_digest,
    )


def _recompute(
    spec: JobSpec, allowed: Tolerance, dest, indices: list[int], token_ids: list[list[int]] | None
) -> list[dict]:
    """Recompute `indices` in float32 on the CPU and compare each with its stored states by the
    job's encoding's `allowed` measure."""
    from hsx.gpu_consumer.extract import extract_samples
    from hsx.gpu_consumer.model import load_model
    from hsx.wire.schemas import Sample

    started = time.monotonic()
    kwargs = {"trust_remote_code": True} if spec.trust_remote_code else {}
    loaded = load_model(spec.model, layers=list(spec.layers), encoding=FLOAT32, device="cpu", **kwargs)
    log.info("verify_model_loaded", model=spec.model, seconds=round(time.monotonic() - started, 2))
    results = []
    for index in indices:
        tensors, metadata = load_sample(dest.read_bytes(relative_sample_key(spec.job, index)))
        ids = token_ids[index] if token_ids is not None else tensors["input_ids"].tolist()
        sample = Sample(index=index, source_id=metadata.get("source_id", str(index)), input_ids=list(ids))
        reference = extract_samples(loaded, [sample])[0].float()
        stored = dequantize(tensors, metadata).float()
        if stored.shape != reference.shape:
            results.append(
                Recomputed(
                    sample_index=index,
                    ok=False,
                    max_abs_error=None,
                    relative_error=None,
                    detail=f"stored shape {list(stored.shape)}, recomputed {list(reference.shape)}",
                )
            )
            continue
        diff = stored - reference
        max_abs = diff.abs().max().item() if diff.numel() else 0.0
        ref_max_abs = reference.abs().max().item() if reference.numel() else 0.0
        ref_norm = reference.norm().item()
        relative = diff.norm().item() / ref_norm if ref_norm > 0 else (0.0 if max_abs == 0 else float("inf"))
        measured = {"max_abs_error": max_abs, "relative_error": relative}[allowed.measure]
        ok, tolerance = measured <= allowed.limit, {allowed.measure: allowed.limit}
        results.append(
            Recomputed(
                sample_index=index,
                ok=bool(ok),
                max_abs_error=max_abs,
                relative_error=relative,
                tolerance=tolerance,
                reference_max_abs=ref_max_abs,
                reference_norm=ref_norm,
            )
        )
        log.info(
            "verify_recomputed",
            sample_index=index,
            max_abs_error=max_abs,
            relative_error=relative,
            tolerance=tolerance,
            reference_max_abs=ref_max_abs,
            ok=ok,
        )
    return results


@dataclass
class _Stored:
    """What the job's folder holds, as the index says or a listing finds: the keys, the indexed
    digests (None from a listing, or for a row an uploader left without one) and the keys that
    are no sample of the job's."""

    keys: set[str]
    digests: list[str | None] | None
    extra: list[str]
    from_index: bool


def _stored(dest, spec: JobSpec, *, list_folder: bool) -> _Stored:
    job, total = spec.job, spec.total_samples
    job_index, why_not = (None, "--list given") if list_folder else read_index(dest, job, spec=spec)
    if job_index is not None:
        # A complete index names every sample's key: nothing to list, and no stray keys looked for.
        listed = {relative_sample_key(job, i) for i in job_index.sample_indices.tolist()}
        # Complete: row i is sample i. Null digests (from uploaders before events carried them) skip the check.
        digests = [d.hex() if d else None for d in job_index.table.column("digest").to_pylist()]
        return _Stored(keys=listed, digests=digests, extra=[], from_index=True)
    log.info("verify_listing", job=job, reason=why_not)
    listed = set(dest.keys())
    expected_keys = {relative_sample_key(job, i) for i in range(total)}
    # The job bundle under `_hsx/` belongs to the job (producer/bundle.py); it is not a stray key.
    extra = sorted(f"{job}/{key}" for key in listed - expected_keys if not key.startswith(f"{BUNDLE_DIR}/"))
    return _Stored(keys=listed, digests=None, extra=extra, from_index=False)


def _check_all(
    dest,
    expected: ExpectedSamples,
    stored: _Stored,
    token_ids: list[list[int]] | None,
    hidden_size: int | None,
    *,
    workers: int,
    started: float,
) -> list[_Outcome]:
    """Every sample of the plan: missing, or read and checked on `workers` threads (a bounded
    number in flight), progress logged every PROGRESS_EVERY; sorted by sample."""
    job, total = expected.job, expected.total
    keys = {relative_sample_key(job, i): i for i in range(total)}
    outcomes = [_Outcome(i, "missing") for key, i in keys.items() if key not in stored.keys]
    to_read = iter(i for key, i in keys.items() if key in stored.keys)
    done = len(outcomes)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hsx-verify") as pool:
        pending: set = set()
        while True:
            for index in to_read:
                pending.add(
                    pool.submit(
                        _read_and_check,
                        dest,
                        expected,
                        index,
                        None if token_ids is None else token_ids[index],
                        hidden_size,
                        stored.digests[index] if stored.digests else None,
                    )
                )
                if len(pending) >= workers * 4:
                    break
            if not pending:
                break
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                outcomes.append(future.result())
                done += 1
                if done % PROGRESS_EVERY == 0:
                    log.info(
                        "verify_progress",
                        job=job,
                        checked=done,
                        total=total,
                        problems=sum(o.status != "ok" for o in outcomes),
                        seconds=round(time.monotonic() - started, 1),
                    )
    if hidden_size is None:
        _agree_on_hidden_size(outcomes)
    return sorted(outcomes, key=lambda o: o.index)


def _agree_on_hidden_size(outcomes: list[_Outcome]) -> None:
    """No model config here: every file must agree with the most common hidden size."""
    sizes = Counter(o.hidden_size for o in outcomes if o.status == "ok" and o.hidden_size is not None)
    if not sizes:
        return
    common = sizes.most_common(1)[0][0]
    for o in outcomes:
        if o.status == "ok" and o.hidden_size != common:
            o.status, o.checks, o.details = (
                "mismatching",
                ["hidden_states"],
                [f"hidden size {o.hidden_size}, the other files have {common}"],
            )


def verify(
    spec: JobSpec,
    token_ids: list[list[int]] | None,
    *,
    recompute: int = 0,
    seed: int | None = None,
    workers: int = 16,
    list_folder: bool = False,
) -> VerifyReport:
    """Check the job's destination against its spec; the report (see `format_report`)."""
    started = time.monotonic()
    job, total = spec.job, spec.total_samples
    expected = ExpectedSamples.of_spec(spec, where=f"job {job}'s spec")
    dest = open_job_folder(spec_location(spec.dest), job, max_connections=workers)
    log.info("verify_started", job=job, dest=spec.dest, total_samples=total, workers=workers)
    if token_ids is not None:
        token_note = "compared with the job's tokenized dataset"
    else:
        token_note = f"not compared: dataset {spec.dataset} is not readable on this machine (see log)"
    hidden_size = expected_hidden_size(spec)
    stored = _stored(dest, spec, list_folder=list_folder)
    outcomes = _check_all(dest, expected, stored, token_ids, hidden_size, workers=workers, started=started)

    readable = [o.index for o in outcomes if o.status in ("ok", "mismatching")]
    seed = secrets.randbelow(2**31) if seed is None else seed
    chosen = sorted(random.Random(seed).sample(readable, min(recompute, len(readable)))) if recompute else []
    recomputed = _recompute(spec, expected.encoding.tolerance, dest, chosen, token_ids) if chosen else []

    missing = [o.index for o in outcomes if o.status == "missing"]
    corrupt = [
        CorruptSample(sample_index=o.index, key=sample_key(job, o.index), reason=o.reason, detail="; ".join(o.details))
        for o in outcomes
        if o.status == "corrupt"
    ]
    mismatching = [
        MismatchingSample(
            sample_index=o.index, key=sample_key(job, o.index), checks=o.checks, detail="; ".join(o.details)
        )
        for o in outcomes
        if o.status == "mismatching"
    ]
    extra = stored.extra
    ok = not missing and not corrupt and not mismatching and not extra and all(r.ok for r in recomputed)
    report = VerifyReport(
        job=job,
        dest=spec.dest,
        dtype=spec.dtype,
        layers=list(spec.layers),
        total_samples=total,
        samples_checked=len(outcomes),
        samples_ok=sum(o.status == "ok" for o in outcomes),
        missing=missing,
        corrupt=corrupt,
        mismatching=mismatching,
        extra_keys=extra,
        stored_from="index" if stored.from_index else "listing",
        token_ids=token_note,
        token_ids_checked=token_ids is not None,
        hidden_size=hidden_size,
        recompute=RecomputeReport(
            requested=recompute, seed=seed if recompute else None, indices=chosen, results=recomputed
        ),
        seconds=round(time.monotonic() - started, 2),
        ok=ok,
    )
    log.info(
        "verify_done",
        job=job,
        ok=ok,
        checked=len(outcomes),
        missing=len(missing),
        corrupt=len(corrupt),
        mismatching=len(mismatching),
        extra_keys=len(extra),
        seconds=report.seconds,
    )
    return report


def _some(items: list, limit: int = 20) -> str:
    return ", ".join(map(str, items[:limit])) + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def format_report(report: VerifyReport, *, as_json: bool) -> str:
    if as_json:
        return json.dumps(msgspec.to_builtins(report), sort_keys=True)
    lines = [
        f"job {report.job}: {'OK' if report.ok else 'PROBLEMS FOUND'}",
        f"  dest     {report.dest}",
        f"  checked  {report.samples_checked}/{report.total_samples} samples, {report.samples_ok} ok",
        f"  tokens   {report.token_ids}",
        f"  missing  {len(report.missing)}" + (f": {_some(report.missing)}" if report.missing else ""),
        f"  corrupt  {len(report.corrupt)}",
    ]
    lines += [f"    {c.key}: {c.reason} ({c.detail})" for c in report.corrupt[:20]]
    lines.append(f"  mismatching {len(report.mismatching)}")
    lines += [f"    {m.key}: {', '.join(m.checks)} ({m.detail})" for m in report.mismatching[:20]]
    if report.stored_from == "index":
        lines.append(f"  extra keys not looked for: what is stored came from {INDEX_KEY} (--list lists the folder)")
    else:
        lines.append(
            f"  extra keys {len(report.extra_keys)}" + (f": {_some(report.extra_keys)}" if report.extra_keys else "")
        )
    rec = report.recompute
    if rec.requested:
        lines.append(f"  recomputed {len(rec.results)} of {rec.requested} requested (seed {rec.seed}): {rec.indices}")
        for r in rec.results:
            if r.max_abs_error is None:
                lines.append(f"    sample {r.sample_index}: FAIL ({r.detail})")
            else:
                lines.append(f"    sample {r.sample_index}: {'ok' if r.ok else 'FAIL'} {_errors_and_scale(r)}")
    return "\n".join(lines)


def _errors_and_scale(r: Recomputed) -> str:
    """The errors, the limit the check holds one of them to, and the scale of the reference."""
    limit = ", ".join(f"{name.replace('_', ' ')} <= {value:.3g}" for name, value in (r.tolerance or {}).items())
    scale = []
    if r.reference_max_abs is not None:
        scale.append(f"max |reference| {r.reference_max_abs:.3g}")
    if r.reference_norm is not None:
        scale.append(f"||reference|| {r.reference_norm:.3g}")
    return (
        f"max abs error {r.max_abs_error:.3g}, relative error {r.relative_error:.3g}"
        + (f" (limit: {limit})" if limit else "")
        + (f"; scale: {', '.join(scale)}" if scale else "")
    )
