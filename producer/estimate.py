"""What a planned job will take, before anything of it runs: every sample file's size in bytes,
exactly (`sample_file_sizes`: the header the writer builds, with the sample's own metadata, and
the tensors' bytes at the job's dtype, float8 scales included, from hsx/storage/samplefile.py's
and layout.py's own code, without making a tensor), the job bundle's files (`bundle_sizes`), the
largest batch, the hours at a given rate (`estimate_job`), and a local destination's free space
against what the job needs (`free_space`, `check_free_space`). It writes nothing anywhere.

A compressed encoding's files are sized exactly but for their states, whose compressed size
is bounded (incompressible states); given the ratio producer/measure.py measured on a sample
of the job's own states, `estimated_bytes` takes each file as far under its bound as its
encoding says (`Encoding.under_bound`), the rest of each file kept exact. Nothing here knows
which encoding the job's is: its files (hsx/storage/layout.py `SampleFiles`) say. The free space is checked against the bound, the safe side.

`hsx produce --dry-run` prints the estimate (`format_estimate`); a real run refuses a local
destination too small for the job with `check_free_space`. docs/operations/planning.md, "The dry
run".
"""

import io
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.packing import PlannedBatch
from hsx.producer.bundle import PLAN_FILE, REPORT_FILE, SPEC_FILE, plan_document
from hsx.producer.measure import Measured
from hsx.storage import samplefile
from hsx.storage.fsutil import free_bytes, human_bytes
from hsx.storage.index import INDEX_FILE, make_index
from hsx.storage.layout import TOKENS_FILE, SampleFiles
from hsx.storage.location import Location
from hsx.storage.tokens import SampleTable, write_tokens
from hsx.wire import schemas

IGNORE_FREE_SPACE_FLAG = "--ignore-free-space"


def sample_file_sizes(rows: SampleTable, files: SampleFiles, *, first_index: int = 0) -> np.ndarray:
    """Each sample's file size (int64, by sample index), as the consumer's writer will make the
    job's `files`; `rows` are the job's samples from `first_index` on (a round of them).

    A header's length depends on the sample only through its token count, whether it has a loss
    mask, the number of digits of its index and the JSON-encoded length of its source id (every
    other value is the job's, and the checksum's length is fixed): one header is built per
    distinct combination, with stand-in values of those lengths, so a job of a million samples
    builds a few thousand."""
    count = len(rows)
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    index = np.arange(first_index, first_index + count, dtype=np.int64)
    digits = np.ones(count, dtype=np.int64)
    for power in range(1, 19):
        digits += index >= 10**power
    columns = [rows.lengths, rows.has_mask.astype(np.int64), digits, _json_lengths(rows.source_ids)]
    tops = [int(column.max()) + 1 for column in columns]
    if math.prod(tops) < 1 << 62:  # one int64 per combination: np.unique of rows (axis=0) is far slower
        key = np.zeros(count, dtype=np.int64)
        for column, top in zip(columns, tops):
            key = key * top + column
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        distinct = np.stack([column[first] for column in columns], axis=1)
    else:
        distinct, inverse = np.unique(np.stack(columns, axis=1), axis=0, return_inverse=True)
    sizes = np.empty(len(distinct), dtype=np.int64)
    shape = (len(files.spec.layers), files.spec.hidden_size)
    for k, (tokens, has_mask, digit_count, source_length) in enumerate(distinct.tolist()):
        metadata = files.metadata(
            sample_index=10 ** (digit_count - 1),
            source_id="x" * (source_length - 2),  # its JSON form: the quotes and this many bytes
            shape=(tokens, *shape),
        )
        shapes = files.tensor_shapes(num_tokens=tokens, has_mask=bool(has_mask))
        sizes[k] = samplefile.file_size(shapes, metadata)
    return sizes[inverse.reshape(-1)]


# What json.dumps escapes in a string (ensure_ascii=False): the quote, the backslash, control characters.
_ESCAPED = r'[\x00-\x1f"\\]'


def _json_lengths(names: pa.Array) -> np.ndarray:
    """Each string's length in bytes as the header's JSON holds it: its UTF-8 bytes and the quotes
    (ensure_ascii=False, as the writer's header), or json.dumps' own for one with escapes."""
    lengths = pc.binary_length(names).to_numpy(zero_copy_only=False).astype(np.int64) + 2
    escaped = np.flatnonzero(pc.match_substring_regex(names, _ESCAPED).to_numpy(zero_copy_only=False))
    for i in escaped.tolist():
        lengths[i] = len(json.dumps(names[i].as_py(), ensure_ascii=False).encode())
    return lengths


def estimated_bytes(files: SampleFiles, rows: SampleTable, *, bound: int, ratio: float) -> int:
    """A job's sample files, `bound` bytes at most (`sample_file_sizes`' sum), with its states at
    `ratio` of their bytes (a compressed encoding's, measured): each file is taken to be as far
    under its bound as its encoding says such states put it (`Encoding.under_bound`; nothing for
    an exact size); headers and other tensors stay as sized."""
    layers, hidden = len(files.spec.layers), files.spec.hidden_size
    lengths, counts = np.unique(rows.lengths, return_counts=True)
    saved = 0.0
    for tokens, count in zip(lengths.tolist(), counts.tolist()):
        saved += count * files.encoding.under_bound(tokens, layers, hidden, ratio=ratio)
    return round(bound - saved)


class _Counter(io.RawIOBase):
    """A binary sink that keeps only the number of bytes written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        self.size += size
        return size


def bundle_sizes(
    spec: JobSpec,
    rows: SampleTable,
    batches: list[PlannedBatch],
    *,
    max_batch_size: int | None,
    report: dict | None,
    file_sizes: np.ndarray,
) -> dict[str, int]:
    """The bytes of each file of the job's bundle (producer/bundle.py) under `<job>/_hsx/`: the
    spec, the samples and the plan as the producer will write them (the samples encoded, as
    stored, and counted, not kept), the input report when known, and the index the monitor
    writes when the job is done, made here with random digests (they do not compress either)."""
    tokens = _Counter()
    write_tokens(rows, tokens, job=spec.job)
    plan = json.dumps(plan_document(spec, batches, max_batch_size=max_batch_size), separators=(",", ":"))
    sizes = {SPEC_FILE: len(schemas.encode(spec)), TOKENS_FILE: tokens.size, PLAN_FILE: len(plan.encode())}
    if report is not None:
        sizes[REPORT_FILE] = len(json.dumps(report, indent=1, sort_keys=True).encode())
    count = len(rows)
    # Seeded: the same job sizes the same every time; random bytes, as incompressible as real digests.
    digests = np.random.default_rng(0).integers(0, 256, (count, 32), dtype=np.uint8)
    index = make_index(
        job=spec.job,
        plan=spec.plan_tag,
        total_samples=count,
        source="events",
        sample_index=np.arange(count),
        size=file_sizes,
        tokens=rows.lengths,
        digest=[bytes(d).hex() for d in digests],
    )
    sizes[INDEX_FILE] = len(index.to_bytes())
    return sizes


@dataclass(frozen=True, kw_only=True)
class FreeSpace:
    """A local destination's room for the job: the nearest existing folder of its path, the free
    bytes there, and what the job still needs (its bytes less what its folder already holds)."""

    dest: str
    measured: str
    free: int
    needed: int

    @property
    def fits(self) -> bool:
        return self.needed <= self.free


def free_space(dest: Location, job: str, *, job_bytes: int) -> FreeSpace | None:
    """None for a remote store (S3, ...): it has no free space to ask."""
    folder = dest.local_folder
    if folder is None:
        return None
    measured = folder
    while not measured.exists() and measured != measured.parent:
        measured = measured.parent
    # Files a stopped run of the job (or a replaced plan) left are overwritten, not added to.
    held = _bytes_under(folder / job)
    return FreeSpace(dest=str(dest), measured=str(measured), free=free_bytes(measured), needed=max(0, job_bytes - held))


def _bytes_under(folder: Path) -> int:
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def check_free_space(room: FreeSpace | None) -> None:
    """Refuse, in one line, a job its local destination has no room for."""
    if room is None or room.fits:
        return
    raise HsxError(
        f"--dest {room.dest}: the job needs {human_bytes(room.needed)} ({room.needed} bytes: its sample files and "
        f"bundle) but {room.measured} has {human_bytes(room.free)} ({room.free} bytes) free; nothing was published; "
        f"free some space or choose another --dest, or pass {IGNORE_FREE_SPACE_FLAG} to run anyway"
    )


@dataclass(frozen=True, kw_only=True)
class LargestBatch:
    """The batch whose sample files are the most bytes: what one consumer's spool holds at once
    beyond its high-water mark."""

    samples: int
    tokens: int
    padded_tokens: int
    bytes: int


@dataclass(frozen=True, kw_only=True)
class JobEstimate:
    job: str
    dtype: str
    samples: int
    tokens: int
    batches: int
    largest_batch: LargestBatch
    files: int
    # The sample files, as the destination will hold them: exact, or for a compressed encoding
    # (bytes_exact False) an estimate when bytes_estimated_from says what it was measured on,
    # else bytes_bound, with the reason it was not measured in bytes_not_estimated.
    bytes: int
    bytes_exact: bool
    bytes_bound: int  # at most this many (incompressible states); `bytes` when exact
    bytes_estimated_from: Measured | None
    bytes_not_estimated: str | None
    bundle_bytes: int
    bundle: dict[str, int]
    max_payload: int  # what the descriptors were checked against
    rate: float | None  # tokens per second per GPU, as given
    gpus: int
    hours: float | None
    free_space: FreeSpace | None


def largest_batch(batches: list[PlannedBatch], rows: SampleTable, file_sizes: np.ndarray) -> LargestBatch:
    best = LargestBatch(samples=0, tokens=0, padded_tokens=0, bytes=0)
    for batch in batches:
        indices = np.asarray(batch.sample_indices, dtype=np.int64)
        size = int(file_sizes[indices].sum())
        if size > best.bytes:
            best = LargestBatch(
                samples=len(indices),
                tokens=int(rows.lengths[indices].sum()),
                padded_tokens=batch.padded_tokens,
                bytes=size,
            )
    return best


def estimate_job(
    files: SampleFiles,
    rows: SampleTable,
    batches: list[PlannedBatch],
    *,
    max_batch_size: int | None,
    report: dict | None,
    max_payload: int,
    rate: float | None,
    gpus: int,
    dest: Location,
    measured: Measured | None = None,
    not_measured: str | None = None,
) -> JobEstimate:
    """The job whose files are `files` sized; `measured`: how a compressed job's states compress
    (producer/measure.py), or None with the reason in `not_measured`."""
    spec = files.spec
    sizes = sample_file_sizes(rows, files)
    total = int(sizes.sum())
    exact = files.encoding.exact_size
    if exact or measured is None:
        measured = None
        guess = total
    else:
        guess = estimated_bytes(files, rows, bound=total, ratio=measured.ratio)
    bundle = bundle_sizes(spec, rows, batches, max_batch_size=max_batch_size, report=report, file_sizes=sizes)
    bundle_total = sum(bundle.values())
    return JobEstimate(
        job=spec.job,
        dtype=spec.dtype,
        samples=len(rows),
        tokens=rows.total_tokens,
        batches=len(batches),
        largest_batch=largest_batch(batches, rows, sizes),
        files=len(rows),
        bytes=guess,
        bytes_exact=exact,
        bytes_bound=total,
        bytes_estimated_from=measured,
        bytes_not_estimated=None if exact else not_measured,
        bundle_bytes=bundle_total,
        bundle=bundle,
        max_payload=max_payload,
        rate=rate,
        gpus=gpus,
        hours=rows.total_tokens / (rate * gpus) / 3600 if rate else None,
        # The bound: a disk filled past the estimate fails in the uploaders, long after this.
        free_space=free_space(dest, spec.job, job_bytes=total + bundle_total),
    )


def format_estimate(estimate: JobEstimate, *, as_json: bool) -> str:
    if as_json:
        return json.dumps(asdict(estimate) | {"free_space_ok": _fits(estimate)})
    largest = estimate.largest_batch
    at_most = "" if estimate.bytes_exact else "at most "
    lines = [
        f"job {estimate.job} (dry run: nothing published): {estimate.samples} samples, {estimate.tokens} tokens, "
        f"{estimate.batches} batches",
        *_sample_files(estimate),
        f"  job bundle (_hsx/): {human_bytes(estimate.bundle_bytes)} ({estimate.bundle_bytes} bytes)",
        f"  largest batch: {largest.samples} samples, {largest.tokens} tokens ({largest.padded_tokens} padded), "
        f"{at_most}{human_bytes(largest.bytes)} of files (a consumer's spool needs its --spool-high-water plus one or "
        "two of these)",
    ]
    if estimate.hours is not None:
        lines.append(f"  time: {_hours(estimate.hours)} at {estimate.rate:g} tokens/s per GPU on {estimate.gpus} GPUs")
    room = estimate.free_space
    if room is not None:
        verdict = "fits" if room.fits else f"does NOT fit: a real run is refused unless {IGNORE_FREE_SPACE_FLAG}"
        bound = "" if estimate.bytes_exact else " (the bound: the safe side)"
        lines.append(
            f"  destination: needs {human_bytes(room.needed)}{bound}, {human_bytes(room.free)} free at "
            f"{room.measured}: {verdict}"
        )
    return "\n".join(lines)


def _sample_files(estimate: JobEstimate) -> list[str]:
    files = f"  sample files: {estimate.files}, "
    if estimate.bytes_exact:
        return [f"{files}{human_bytes(estimate.bytes)} ({estimate.bytes} bytes) at {estimate.dtype}"]
    bound = f"{human_bytes(estimate.bytes_bound)} ({estimate.bytes_bound} bytes)"
    measured = estimate.bytes_estimated_from
    if measured is None:
        return [
            f"{files}at most {bound} at {estimate.dtype} (a bound: compressed files are smaller, by how the "
            "states compress)",
            f"  not estimated: {estimate.bytes_not_estimated}",
        ]
    return [
        f"{files}about {human_bytes(estimate.bytes)} ({estimate.bytes} bytes) at {estimate.dtype}, an estimate: "
        f"the states of {measured.samples} of its samples ({measured.tokens} tokens, run on {measured.device}) "
        f"compressed to {measured.ratio:.3f} of their bytes",
        f"  sample files at most: {bound} (the bound: states that do not compress)",
    ]


def _hours(hours: float) -> str:
    return f"{hours:,.2f} hours" if hours >= 0.01 else f"{hours * 3600:.1f} seconds"


def _fits(estimate: JobEstimate) -> bool | None:
    return None if estimate.free_space is None else estimate.free_space.fits
