"""What a job's bundle says each of its samples is (`ExpectedSamples`, `load_expected`), and
whether a sample file is that sample (`mismatches`, read from its header: `read_header`,
`read_metadata`): the one check that `hsx verify`, `hsx export`, `hsx index rebuild` and
`HiddenStateDataset` apply, so that no file of another job, or of an earlier job of the same
name, is read as this job's. No torch here; it reads the bundle and never writes.

Design notes: docs/architecture/storage.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from hsx.errors import HsxError
from hsx.job import JobSpec, Layer
from hsx.logs import get_logger
from hsx.storage import encodings
from hsx.storage.destinations import Destination
from hsx.storage.encodings import Encoding
from hsx.storage.layout import BUNDLE_DIR, TOKENS_FILE, SampleFiles
from hsx.storage.samplefile import SampleFileCorrupt, json_or, parse_header
from hsx.storage.tokens import SampleTable, record_batches

log = get_logger("hsx.expected")

BUNDLE_SPEC_KEY = f"{BUNDLE_DIR}/job.json"  # relative to the job's folder
BUNDLE_TOKENS_KEY = f"{BUNDLE_DIR}/{TOKENS_FILE}"
IDS_DIGEST_BYTES = 16


def is_missing(exc: BaseException) -> bool:
    """Whether a destination's read failed because the key holds no object: every destination
    raises FileNotFoundError then (the Destination protocol, hsx/storage/destinations/base.py)."""
    return isinstance(exc, FileNotFoundError)


_INT32 = np.iinfo(np.int32)


def ids_digest(input_ids: Sequence[int] | np.ndarray) -> bytes:
    """The digest of token ids, as their int32 bytes; b"" (which no digest equals) for ids that
    do not fit int32, which no job's samples have (the tokens file holds int32)."""
    ids = np.asarray(input_ids, dtype=np.int64)
    if ids.size and (int(ids.min()) < _INT32.min or int(ids.max()) > _INT32.max):
        return b""
    return hashlib.blake2b(ids.astype("<i4").tobytes(), digest_size=IDS_DIGEST_BYTES).digest()


def _row_digests(offsets: np.ndarray, values: np.ndarray) -> np.ndarray:
    """[rows, 16] uint8: `ids_digest` of each row of a flattened list column of int32 ids."""
    data = memoryview(np.ascontiguousarray(values, dtype="<i4")).cast("B")
    bounds = (np.asarray(offsets, dtype=np.int64) * 4).tolist()
    out = bytearray()
    for start, end in zip(bounds, bounds[1:]):
        out += hashlib.blake2b(data[start:end], digest_size=IDS_DIGEST_BYTES).digest()
    return np.frombuffer(out, dtype=np.uint8).reshape(-1, IDS_DIGEST_BYTES)


@dataclass(frozen=True, eq=False)
class ExpectedSamples:
    """What each sample of a job must be. A field left None is not checked: a folder without a
    bundle is known only by its job name (`ExpectedSamples(job=...)`), its files checked
    against their keys and themselves."""

    job: str
    plan: str | None = None
    model: str | None = None
    model_revision: str | None = None
    layers: list[Layer] | None = None
    encoding: Encoding | None = None  # the job's, its `stored` name the spec's dtype
    hidden_size: int = 0  # 0: not known (a job from before the spec recorded it)
    total: int | None = None
    lengths: np.ndarray | None = None  # int64 [total]: sample i's token count
    digests: np.ndarray | None = None  # uint8 [total, 16]: ids_digest of sample i's input ids

    @classmethod
    def of_spec(cls, spec: JobSpec, *, where: str) -> ExpectedSamples:
        """The job-wide expectations of a spec, its values checked (`where` names it in errors)."""
        for name in ("total_samples", "hidden_size", "num_layers"):
            if getattr(spec, name) < 0:
                raise HsxError(f"{where}: {name} is {getattr(spec, name)}, not a count")
        files = SampleFiles.of(spec, where=where)
        if not spec.layers:
            raise HsxError(f"{where}: the job names no layers")
        return cls(
            job=spec.job,
            plan=spec.plan_tag,
            model=spec.model,
            model_revision=spec.model_revision,
            layers=list(spec.layers),
            encoding=files.encoding,
            hidden_size=spec.hidden_size,
            total=spec.total_samples,
        )

    @classmethod
    def of_bundle(cls, spec: JobSpec, url: str) -> ExpectedSamples:
        """`of_spec` for the spec of the bundle in the job folder at `url`."""
        return cls.of_spec(spec, where=f"{url}/{BUNDLE_SPEC_KEY}")

    def with_lengths(self, lengths: Sequence[int] | np.ndarray) -> ExpectedSamples:
        return dataclasses.replace(self, lengths=np.asarray(lengths, dtype=np.int64))

    @property
    def input_ids_known(self) -> bool:
        return self.digests is not None

    def tokens(self, index: int) -> int | None:
        if self.lengths is None or not 0 <= index < len(self.lengths):
            return None
        return int(self.lengths[index])

    def ids_digest(self, index: int) -> bytes | None:
        if self.digests is None or not 0 <= index < len(self.digests):
            return None
        return self.digests[index].tobytes()


def load_expected(
    folder: Destination, url: str, expected: ExpectedSamples, *, input_ids: bool = True
) -> ExpectedSamples:
    """The expectations of the job whose folder is `folder` (at `url`, for errors), `expected`
    its bundle spec's (`ExpectedSamples.of_bundle`): with `input_ids`, each sample's token count
    and ids digest from the bundle's tokens.arrow, whose row count must be the spec's
    total_samples (one-line HsxError otherwise); without, the spec's alone (no download)."""
    spec_key = f"{url}/{BUNDLE_SPEC_KEY}"
    if not input_ids:
        return expected
    what = f"{url}/{BUNDLE_TOKENS_KEY}"
    try:
        stream = folder.open_read(BUNDLE_TOKENS_KEY)
    except Exception as exc:
        if is_missing(exc):
            log.info("bundle_without_tokens", url=url, consequence="input ids and token counts are not compared")
            return expected
        raise HsxError(f"{what}: cannot read the job's tokenized samples ({type(exc).__name__}: {exc})") from None

    def rows() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for batch in record_batches(pa.PythonFile(stream, mode="r"), what=what):
            column = batch.column("input_ids")
            offsets = column.offsets.to_numpy().astype(np.int64)
            yield offsets - offsets[0], column.flatten().to_numpy(zero_copy_only=False)

    try:
        return _with_input_ids(expected, rows(), claimed_by=spec_key)
    except (pa.ArrowException, KeyError) as exc:
        raise HsxError(f"{what}: unreadable samples ({exc})") from None
    except OSError as exc:  # the connection broke off mid-object
        raise HsxError(f"{what}: reading the job's tokenized samples failed ({exc})") from None
    finally:
        stream.close()


def expected_of_table(expected: ExpectedSamples, table: SampleTable, url: str) -> ExpectedSamples:
    """As `load_expected`, from the bundle's tokenized samples already read into `table` (export
    to speculators needs the table itself: the tokens file is downloaded once)."""
    spec_key = f"{url}/{BUNDLE_SPEC_KEY}"
    runs = ((offsets, tokens) for _first, offsets, tokens, _masks in table.runs())
    return _with_input_ids(expected, runs, claimed_by=spec_key)


def _with_input_ids(
    expected: ExpectedSamples, rows: Iterable[tuple[np.ndarray, np.ndarray]], *, claimed_by: str
) -> ExpectedSamples:
    """`expected` with each sample's token count and ids digest, from consecutive runs of the
    job's samples, (offsets from 0, token ids); their count must be the claimed total."""
    claimed = expected.total or 0
    lengths: list[np.ndarray] = []
    digests: list[np.ndarray] = []
    count = 0
    for offsets, values in rows:
        count += len(offsets) - 1
        if count > claimed:  # stop here: the claim, not the file, is what is small
            raise HsxError(
                f"{claimed_by}: total_samples {claimed}, but {TOKENS_FILE} beside it holds more "
                f"(at least {count}): the bundle is not one job's"
            )
        lengths.append(np.diff(offsets))
        digests.append(_row_digests(offsets, values))
    if count != claimed:
        raise HsxError(
            f"{claimed_by}: total_samples {claimed}, but {TOKENS_FILE} beside it holds {count} samples: "
            "the bundle is not one job's"
        )
    return dataclasses.replace(
        expected,
        lengths=np.concatenate(lengths) if lengths else np.zeros(0, np.int64),
        digests=np.concatenate(digests) if digests else np.zeros((0, IDS_DIGEST_BYTES), np.uint8),
    )


def read_header(data: bytes | memoryview) -> tuple[dict, int]:
    """A safetensors file's header (its `__metadata__` and one entry per tensor, their forms
    checked: hsx.storage.samplefile.parse_header) and where its data section starts; `data` may
    be the file or any prefix that holds the header. SampleFileCorrupt when it is not one."""
    if len(data) < 8:
        raise SampleFileCorrupt(f"{len(data)} bytes is too short for a safetensors file")
    end = 8 + int.from_bytes(data[:8], "little")
    if end > len(data):
        raise SampleFileCorrupt(f"header length {end - 8} runs past the end of the file ({len(data)} bytes)")
    return parse_header(bytes(data[8:end])), end


def read_metadata(data: bytes | memoryview) -> dict[str, str]:
    """The `__metadata__` of a safetensors file's header (`data`: the file or a prefix holding
    the header); SampleFileCorrupt when the header does not parse."""
    return read_header(data)[0].get("__metadata__", {})


def _describe(entry: object) -> str:
    if not isinstance(entry, dict):
        return "absent"
    return f"{entry.get('dtype')} {entry.get('shape')}"


def _shape(entry: object, rank: int) -> list[int] | None:
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if isinstance(shape, list) and len(shape) == rank and all(isinstance(n, int) for n in shape):
        return shape
    return None


class _Findings:
    """What disagrees so far, check -> detail: each check's first finding, in the order checked."""

    def __init__(self) -> None:
        self.failed: dict[str, str] = {}

    def expect(self, check: str, good: bool, detail: str) -> None:
        if not good and check not in self.failed:
            self.failed[check] = detail


def mismatches(
    data: bytes | memoryview,
    expected: ExpectedSamples,
    index: int,
    *,
    input_ids: Sequence[int] | None = None,
    hidden_size: int | None = None,
    header_only: bool = False,
) -> dict[str, str]:
    """What disagrees between the sample file `data` (found at sample `index`'s key) and sample
    `index` of `expected`: {check: one-line detail}, in the order checked; empty when the file is
    that sample. `input_ids`: the sample's ids when the caller has them (hsx verify) instead of
    the bundle's digest. `hidden_size`: H to expect instead of the spec's (None: the spec's when
    it has one). `header_only`: `data` is the header alone; the ids' bytes are not compared.
    SampleFileCorrupt when the header does not parse."""
    header, start = read_header(data)
    metadata = header.get("__metadata__", {})
    if expected.total is not None and not 0 <= index < expected.total:
        return {"sample_index": f"sample {index} is past the plan's {expected.total} samples"}
    found = _Findings()
    _check_identity(found, metadata, expected, index)
    tokens = _check_input_ids(
        found, header, memoryview(data)[start:], expected, index, input_ids=input_ids, header_only=header_only
    )
    found.expect(
        "num_tokens",
        tokens is not None and metadata.get("num_tokens") == str(tokens),
        f"metadata num_tokens {metadata.get('num_tokens')!r}, the sample has {tokens} tokens",
    )
    _check_states(found, header, metadata, expected, tokens=tokens, hidden_size=hidden_size)
    mask = header.get("loss_mask")
    if mask is not None:
        mask_shape = _shape(mask, 1)
        found.expect(
            "loss_mask",
            mask_shape is not None and (tokens is None or mask_shape[0] == tokens),
            f"loss_mask shape {mask.get('shape') if isinstance(mask, dict) else mask}, expected [{tokens}]",
        )
    return found.failed


def _check_identity(found: _Findings, metadata: dict, expected: ExpectedSamples, index: int) -> None:
    """Whose sample the metadata says the file is: the job, its plan, the sample, the model, the
    layers and the dtype."""
    expect = found.expect
    expect("job", metadata.get("job") == expected.job, f"metadata job is {metadata.get('job')!r}, not {expected.job!r}")
    if expected.plan is not None:
        plan = metadata.get("plan")
        # A file from before plan tags has none: it is taken when all the rest, input ids too, is this sample.
        expect(
            "plan",
            plan is None or plan == expected.plan,
            f"metadata plan is {plan!r}, this job's is {expected.plan!r} (a file of an earlier job of this name?)",
        )
    expect(
        "sample_index",
        metadata.get("sample_index") == str(index),
        f"metadata sample_index is {metadata.get('sample_index')!r}, the key is sample {index}'s",
    )
    if expected.model is not None:
        model = (metadata.get("model"), metadata.get("model_revision"))
        expect(
            "model",
            model == (expected.model, expected.model_revision),
            f"metadata model {model[0]!r} at {model[1]!r}, the job's is {expected.model!r} at {expected.model_revision!r}",
        )
    if expected.layers is not None:
        layers = json_or(metadata.get("layers", "null"), metadata.get("layers"))
        expect("layers", layers == expected.layers, f"metadata layers {layers!r}, the job has {expected.layers}")
    if expected.encoding is not None:
        expect(
            "dtype",
            metadata.get("dtype") == expected.encoding.stored,
            f"metadata dtype {metadata.get('dtype')!r}, the job has {expected.encoding.stored!r}",
        )


def _check_input_ids(
    found: _Findings,
    header: dict,
    body: memoryview,
    expected: ExpectedSamples,
    index: int,
    *,
    input_ids: Sequence[int] | None,
    header_only: bool,
) -> int | None:
    """The file's input ids against the sample's (their count, and their digest from the bytes
    in `body`, the data section, unless `header_only`); the sample's token count, the file's when
    the job's is not known, None when neither is."""
    ids = header.get("input_ids")
    ids_shape = _shape(ids, 1)
    found.expect(
        "input_ids",
        ids_shape is not None and ids.get("dtype") == "I64",
        "no input_ids tensor" if ids is None else f"input_ids {_describe(ids)}, expected I64 [T]",
    )
    want_tokens = len(input_ids) if input_ids is not None else expected.tokens(index)
    want_digest = ids_digest(input_ids) if input_ids is not None else expected.ids_digest(index)
    if "input_ids" not in found.failed and want_tokens is not None:
        found.expect(
            "input_ids",
            ids_shape[0] == want_tokens,
            f"{ids_shape[0]} input ids, the job's sample {index} has {want_tokens} tokens",
        )
    if "input_ids" not in found.failed and want_digest is not None and not header_only:
        low, high = ids.get("data_offsets", (0, -1))
        sound = 0 <= low <= high <= len(body) and (high - low) % 8 == 0
        found.expect(
            "input_ids",
            sound and ids_digest(np.frombuffer(body[low:high], dtype="<i8")) == want_digest,
            f"input_ids differ from the job's tokenized sample {index}",
        )
    return want_tokens if want_tokens is not None else (ids_shape[0] if ids_shape is not None else None)


def _check_states(
    found: _Findings,
    header: dict,
    metadata: dict,
    expected: ExpectedSamples,
    *,
    tokens: int | None,
    hidden_size: int | None,
) -> None:
    """The hidden states as the file's encoding holds them: the job's encoding when the bundle
    says it, else the one the file names (or is inferred); their shape [T, k, H] and dtype, and
    what else the encoding's header must hold."""
    expect = found.expect
    encoding = expected.encoding
    try:
        named = encodings.of_file(metadata, header)
    except encodings.UnknownEncoding as exc:
        expect("encoding", False, str(exc))
    else:
        if encoding is None:
            encoding = named
        elif encodings.ENCODING_KEY in metadata:
            expect(
                "encoding",
                named is encoding,
                f"metadata encoding {named.name!r}, the job stores {encoding.stored!r}",
            )
    hidden = encoding.header_states(header, metadata) if encoding is not None else header.get("hidden_states")
    width = hidden_size if hidden_size is not None else (expected.hidden_size or None)
    layers_count = len(expected.layers) if expected.layers is not None else None
    if hidden is None:
        expect("hidden_states", False, "no hidden_states tensor")
    else:
        shape = _shape(hidden, 3)
        shape_ok = (
            shape is not None
            and (tokens is None or shape[0] == tokens)
            and (layers_count is None or shape[1] == layers_count)
            and (width is None or shape[2] == width)
        )
        want = f"[{tokens if tokens is not None else 'T'}, {layers_count or 'k'}, {width or 'H'}]"
        expect("hidden_states", shape_ok, f"hidden_states shape {hidden.get('shape')}, expected {want}")
        if expected.encoding is not None:
            stored = encoding.header_dtype()
            expect(
                "hidden_states",
                hidden.get("dtype") == stored,
                f"hidden_states dtype {hidden.get('dtype')}, the job stores {stored}",
            )
    if encoding is not None and (expected.encoding is not None or "dtype" in metadata):
        for check, detail in encoding.header_problems(header, hidden).items():
            expect(check, False, detail)


def describe(failed: dict[str, str]) -> str:
    """`mismatches`' findings as one line: what disagrees, check by check."""
    return "; ".join(f"{check}: {detail}" for check, detail in failed.items())
