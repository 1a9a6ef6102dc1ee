"""`hsx export SOURCE --to FORMAT OUT`: a finished job's samples, read from the job's folder in its
destination (no NATS), checked, and written as a drafter trainer reads them (the format, looked up
in hsx/storage/trainers/, says what its files hold and does the format's part of each step). A
rerun resumes OUT. A sample the trainer cannot take is left out and listed; one whose file is
missing, damaged or not this plan's fails the run (exit 1) after the rest is written.
`OUT/hsx-export.json` holds the report.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pyarrow as pa
import structlog
import torch

from hsx.commands.configs import ExportConfig
from hsx.errors import HsxError, JobFailed
from hsx.exitcodes import DONE
from hsx.job import JobSpec
from hsx.storage import trainers
from hsx.storage.destinations import Destination
from hsx.storage.expected import (
    BUNDLE_SPEC_KEY,
    ExpectedSamples,
    describe,
    expected_of_table,
    is_missing,
    load_expected,
    mismatches,
)
from hsx.storage.index import bundle_spec, stored_samples
from hsx.storage.layout import BUNDLE_DIR, TOKENS_FILE, relative_sample_key, sample_key
from hsx.storage.location import Location, open_destination
from hsx.storage.reader import dequantize, load_sample, ordered_map
from hsx.storage.samplefile import SampleFileCorrupt, checked_digest
from hsx.storage.tokens import SampleTable, read_tokens

log = structlog.get_logger("hsx.export")

REPORT = "hsx-export.json"
IDENTITY = ".hsx-export.json"  # what OUT holds, written before the first file
# A run of more missing samples than this is one entry of the report, not one each: its size
# stays that of what is stored, whatever total_samples a bundle without a tokens file claims.
MISSING_LISTED_EACH = 1000


class ExportIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """What an export folder holds: a rerun adds to it only if it is the same export."""

    job: str
    plan: str
    format: str
    dtype: str


def _claim(out: Path, identity: ExportIdentity) -> None:
    """Mark OUT as this export's, or refuse if it holds another: a resumed export trusts every
    file it finds, so files of another job, format or dtype must not be among them."""
    path = out / IDENTITY
    if path.exists():
        try:
            found = msgspec.json.decode(path.read_bytes(), type=ExportIdentity)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise HsxError(f"{path}: not an export's identity ({exc}); remove it if OUT is yours to reuse") from None
        if found != identity:
            raise HsxError(
                f"{out} holds the export of job {found.job} (plan {found.plan}) as {found.format} in {found.dtype}, "
                f"not job {identity.job} (plan {identity.plan}) as {identity.format} in {identity.dtype}: "
                "choose another OUT, or empty it"
            )
        return
    trainers.write_atomically(path, msgspec.json.encode(identity) + b"\n")


class LeftOut(msgspec.Struct, frozen=True, omit_defaults=True):
    sample_index: int
    reason: str
    count: int = 1  # consecutive samples from sample_index that this entry stands for
    source_id: str | None = None  # the dataset row's id, where the sample's file was read

    def named(self) -> str:
        """The sample as the report's text names it: its index, and its row's id when known."""
        return f"{self.sample_index}" if self.source_id is None else f"{self.sample_index} (id {self.source_id})"


class _Failed(Exception):
    """The source file of a sample is not exported; the reason goes to the report."""


class ExportReport(msgspec.Struct, frozen=True, kw_only=True):
    source: str
    job: str
    format: str
    layers: list[int | str]  # hsx's ids
    layer_preset: str
    dtype: str  # of the exported hidden states
    trainer_layer_ids: dict[str, list[int]]  # in the trainer's own convention, for its config
    samples_in_job: int
    samples_exported: int
    left_out: list[LeftOut]  # the trainer cannot take them
    failed: list[LeftOut]  # missing, damaged or not this plan's sample: the run exits 1
    seconds: float
    chat_convention: str = "hsx"  # the job's --chat-as
    convention_note: str = ""  # one line when that is not the trainer's own (also printed to stderr)

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def samples_failed(self) -> int:
        return sum(entry.count for entry in self.failed)


def _bundle_tokens(folder: Destination, url: str) -> SampleTable:
    """The job's tokenized samples, streamed record batch by record batch into a SampleTable
    (which spills the tokens to disk): bounded memory for a job of any size."""
    key = f"{BUNDLE_DIR}/{TOKENS_FILE}"
    try:
        stream = folder.open_read(key)
    except Exception as exc:
        raise HsxError(f"{url}/{key}: cannot read the job's tokenized samples ({type(exc).__name__}: {exc})") from None
    try:
        return read_tokens(pa.PythonFile(stream, mode="r"), what=f"{url}/{key}")
    except OSError as exc:  # the connection broke off mid-object
        raise HsxError(f"{url}/{key}: reading the job's tokenized samples failed ({exc})") from None
    finally:
        stream.close()


def _read(
    folder: Destination, job: str, sample_index: int, dtype: torch.dtype, expected: ExpectedSamples
) -> trainers.Sample:
    """The sample from its file, once the file is found to be this plan's sample; _Failed if not."""
    key = sample_key(job, sample_index)
    try:
        data = folder.read_bytes(relative_sample_key(job, sample_index))
    except Exception as exc:
        if is_missing(exc):
            raise _Failed(f"missing: {key}") from None
        raise _Failed(f"unreadable: {key}: {type(exc).__name__}: {exc}") from None
    try:
        checked_digest([data])  # the checksum inside the file: SampleFileCorrupt if a byte changed
        # The header before the states: nothing is decoded (or allocated) from another sample's file.
        failed = mismatches(data, expected, sample_index)
        if failed:
            raise _Failed(f"mismatching: {key} is not this job's sample {sample_index}: {describe(failed)}")
        tensors, metadata = load_sample(data)
    except SampleFileCorrupt as exc:
        raise _Failed(f"damaged: {key}: {exc}") from None
    ids = tensors["input_ids"].to(torch.int64)
    mask = tensors.get("loss_mask")
    return trainers.Sample(
        sample_index=sample_index,
        input_ids=ids,
        loss_mask=torch.ones_like(ids) if mask is None else mask.to(torch.int64),
        hidden_states=dequantize(tensors, metadata).to(dtype),
        source_id=metadata.get("source_id"),
    )


class _Progress:
    """One line redrawn on a terminal (stderr); nothing otherwise."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.started = total, 0, time.monotonic()
        self.shown = sys.stderr.isatty()

    def step(self) -> None:
        self.done += 1
        if self.shown and (self.done == self.total or self.done % 20 == 0):
            rate = self.done / max(time.monotonic() - self.started, 1e-9)
            print(f"\rexport {self.done}/{self.total} samples, {rate:.0f}/s", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.shown:
            print(file=sys.stderr)


def _job_spec(folder: Destination, url: Location) -> JobSpec:
    """The spec of the job whose folder `url` is, from its bundle; one line when there is none,
    or when it is another job's."""
    spec = bundle_spec(folder)
    if spec is None:
        raise HsxError(
            f"{url}: no job bundle (_hsx/job.json) there: is this a job's folder? (e.g. s3://bucket/prefix/JOB)"
        )
    if spec.job != url.name:
        raise HsxError(f"{url}/{BUNDLE_SPEC_KEY} is job {spec.job}'s, not {url.name}'s")
    return spec


def run_export(cfg: ExportConfig) -> ExportReport:
    started = time.monotonic()
    url = cfg.source
    job = url.name
    folder = open_destination(url, max_connections=cfg.workers)
    spec = _job_spec(folder, url)
    fmt = trainers.by_name(cfg.to)
    trainer_ids = fmt.trainer_layer_ids(spec)
    note = fmt.convention_note(spec.chat_convention)
    if note:
        print(f"hsx export: note: {note}", file=sys.stderr)
    job_expected = ExpectedSamples.of_bundle(spec, url)
    dtype_name = trainers.export_dtype(cfg.dtype, job_expected.encoding)
    dtype = getattr(torch, dtype_name)
    cfg.out.mkdir(parents=True, exist_ok=True)
    _claim(cfg.out, ExportIdentity(job=job, plan=spec.plan_tag, format=cfg.to, dtype=dtype_name))
    # A format that finishes from the job's tokenized samples (speculators' table) reads them
    # here, not from the files: a rerun reads no file it has written. The bundle's claims are
    # checked (total_samples against its tokens) before anything is sized by them.
    tokens = _bundle_tokens(folder, url) if fmt.reads_tokens else None
    try:
        expected = (
            load_expected(folder, url, job_expected) if tokens is None else expected_of_table(job_expected, tokens, url)
        )
    except HsxError:
        if tokens is not None:
            tokens.close()
        raise
    samples, index, why_not = stored_samples(folder, job, spec=spec)
    if index is None:
        log.info("export_listing", reason=why_not)

    left_out: list[LeftOut] = []
    failed = list(_missing(samples, spec.total_samples, job))
    exported: list[int] = []
    progress = _Progress(len(samples))

    def export_one(sample_index: int) -> None:
        path = fmt.path(cfg.out, sample_index)
        if path.exists():
            exported.append(sample_index)  # written by an earlier run, atomically
            return
        sample = _read(folder, job, sample_index, dtype, expected)
        why = fmt.refusal(sample)
        if why is not None:
            left_out.append(LeftOut(sample_index, why, source_id=sample.source_id))
            log.info("export_sample_left_out", sample_index=sample_index, source_id=sample.source_id, reason=why)
            return
        trainers.write_atomically(path, fmt.encode(fmt.features(sample)))
        exported.append(sample_index)

    def guarded(sample_index: int) -> None:
        try:
            export_one(sample_index)
        except _Failed as exc:
            failed.append(LeftOut(sample_index, str(exc)))
            log.warning("export_sample_failed", sample_index=sample_index, reason=str(exc))
        finally:
            progress.step()

    for _ in ordered_map(guarded, samples, in_flight=cfg.workers):
        pass
    progress.close()
    failed.sort(key=lambda entry: entry.sample_index)
    left_out.sort(key=lambda entry: entry.sample_index)
    if not failed:
        fmt.finish(cfg.out, tokens)
    if tokens is not None:
        tokens.close()
    report = ExportReport(
        source=str(url),
        job=job,
        format=cfg.to,
        layers=list(spec.layers),
        layer_preset=spec.layer_preset,
        dtype=dtype_name,
        trainer_layer_ids=trainer_ids,
        samples_in_job=spec.total_samples,
        samples_exported=len(exported),
        left_out=left_out,
        failed=failed,
        seconds=round(time.monotonic() - started, 3),
        chat_convention=spec.chat_convention,
        convention_note=note,
    )
    trainers.write_atomically(cfg.out / REPORT, msgspec.json.format(msgspec.json.encode(report)) + b"\n")
    log.info(
        "export_done",
        job=job,
        format=cfg.to,
        exported=report.samples_exported,
        left_out=len(left_out),
        failed=len(failed),
        out=str(cfg.out),
    )
    return report


def _missing(samples: list[int], total: int, job: str) -> Iterator[LeftOut]:
    """An entry for each of the plan's samples (0 to total - 1) that `samples` (sorted, within the
    plan) lacks; a run longer than MISSING_LISTED_EACH is one entry."""
    previous = -1
    for present in [*samples, total]:
        first, count = previous + 1, present - previous - 1
        if count > MISSING_LISTED_EACH:
            last = sample_key(job, present - 1)
            yield LeftOut(first, f"missing: {sample_key(job, first)} and the {count - 1} after it, to {last}", count)
        else:
            yield from (LeftOut(i, f"missing: {sample_key(job, i)}") for i in range(first, present))
        previous = present


def format_report(report: ExportReport, *, as_json: bool) -> str:
    if as_json:
        return json.dumps(msgspec.to_builtins(report), indent=2)
    lines = [
        f"job {report.job} -> {report.format} ({report.dtype}): {report.samples_exported} of "
        f"{report.samples_in_job} samples exported",
        f"  trainer layer ids: {json.dumps(report.trainer_layer_ids)} (hsx layers {report.layers})",
    ]
    if report.left_out:
        shown = ", ".join(entry.named() for entry in report.left_out[:20])
        lines.append(
            f"  left out {len(report.left_out)} the trainer cannot take: {shown} ({report.left_out[0].reason})"
        )
    if report.failed:
        shown = "; ".join(f"{entry.sample_index}: {entry.reason}" for entry in report.failed[:5])
        lines.append(f"  failed {report.samples_failed}: {shown}; run hsx export again once they are mended")
    return "\n".join(lines)


def export_exit_code(report: ExportReport) -> int:
    if report.ok:
        return DONE
    raise JobFailed(
        f"export of job {report.job} failed {report.samples_failed} samples (first: "
        f"{report.failed[0].sample_index}, {report.failed[0].reason}); see {REPORT}"
    )
