"""Fuzzing the sample file's header where every reader decodes it.

Real files, written by the consumer's writer (gpu_consumer/writer.py `write_sample_file`) in every
encoding hsx has, get their header mutated (tests/fuzzing.py: its JSON, its metadata values, the
JSON inside them such as `layers` and `hidden_states_shape`, its tensors' shapes, dtypes and
data_offsets) or their length prefix replaced, the data section kept. Each is fed to every reader
of sample files: the header parser, the sample check (`mismatches`), the checksum, `hsx verify`'s
check, `HiddenStateDataset`'s read through a real destination folder, and `hsx export`'s read.
The property: each refuses with its own one-line error (SampleFileCorrupt, BadSampleFile, verify's
outcome, export's failure), never another exception; what is accepted is the sample itself; and
the stored file is never changed by being read.
"""

import dataclasses
import hashlib
import json
import os

import numpy as np
import pytest
import torch
from fuzzing import FUZZ, HOSTILE_NUMBER, HOSTILE_TEXT, RAW_VALUES, Cases, mutated
from hypothesis import given
from hypothesis import strategies as st

from hsx.commands.export import _Failed
from hsx.commands.export import _read as export_read
from hsx.commands.verify import check_sample
from hsx.gpu_consumer.writer import write_sample_file
from hsx.job import JobSpec
from hsx.storage import encodings
from hsx.storage.destinations.file import FileDestination
from hsx.storage.expected import ExpectedSamples, ids_digest, mismatches, read_header
from hsx.storage.layout import SampleFiles, relative_sample_key
from hsx.storage.reader import BadSampleFile, _read_checked, load_sample
from hsx.storage.sampledigest import sample_digest
from hsx.storage.samplefile import SampleFileCorrupt, checked_digest
from hsx.wire import schemas

JOB = "fuzz-files"
FINGERPRINT = hashlib.sha256(b"the fuzzed files' plan").hexdigest()
SAMPLE = schemas.Sample(index=2, source_id="row-2", input_ids=[5, 7, 11, 13], loss_spans=[(1, 4)])
LAYERS, HIDDEN = [1, 3], 8


def _spec(dtype: str) -> JobSpec:
    return JobSpec(
        job=JOB,
        model="tiny/qwen3",
        model_revision="main",
        layers=LAYERS,
        dtype=dtype,
        dest="file:///srv/out",
        token_budget=64,
        max_seq_len=16,
        dataset="rows.jsonl",
        plan_fingerprint=FINGERPRINT,
        total_samples=4,
        total_tokens=16,
        total_batches=2,
        created_at=1765000000.25,
        published=True,
        num_layers=4,
        hidden_size=HIDDEN,
    )


def _split(data: bytes) -> tuple[dict, bytes]:
    end = 8 + int.from_bytes(data[:8], "little")
    return json.loads(data[8:end]), data[end:]


def _joined(header_json: bytes, body: bytes) -> bytes:
    return len(header_json).to_bytes(8, "little") + header_json + body


# Texts for a metadata value that is itself JSON (`layers`, `hidden_states_shape`, counts).
METADATA_TEXT = st.one_of(
    HOSTILE_TEXT,
    st.sampled_from(RAW_VALUES),
    st.lists(HOSTILE_NUMBER, min_size=0, max_size=4).map(lambda v: json.dumps(v)),
    st.sampled_from(
        [
            "[1099511627776, 1099511627776, 1099511627776]",  # 2^40 each: a claim no file holds
            "[4, 2, 8]",
            "[4, 2, -8]",
            "[4, 2]",
            "[4.0, 2, 8]",
            "[true, 2, 8]",
            "[1, 3]",
            '[1, "final"]',
            "4",
            "2",
        ]
    ),
)
METADATA_KEYS = (
    "layers",
    "hidden_states_shape",
    "num_tokens",
    "sample_index",
    "encoding",
    "dtype",
    "plan",
    "job",
    "checksum",
    "source_id",
)


@st.composite
def mutated_file(draw, data: bytes) -> bytes:
    """`data` with its header mutated (as JSON, or a metadata value as text) or its length prefix
    replaced; the data section as it was."""
    header, body = _split(data)
    how = draw(st.sampled_from(["header", "metadata", "metadata text", "tensors", "prefix", "cut"]))
    if how == "prefix":
        prefix = draw(
            st.one_of(st.sampled_from([0, 1, 7, 2**63, 2**64 - 1, len(data), len(data) - 8]), st.integers(0, 2**64 - 1))
        )
        return prefix.to_bytes(8, "little") + data[8:]
    if how == "cut":
        return data[: draw(st.integers(0, len(data) - 1))]
    if how == "metadata text":
        header["__metadata__"][draw(st.sampled_from(METADATA_KEYS))] = draw(METADATA_TEXT)
        return _joined(json.dumps(header).encode(), body)
    focus = {"header": (), "metadata": ("__metadata__",)}.get(how)
    if focus is None:
        focus = (draw(st.sampled_from(sorted(name for name in header if name != "__metadata__"))),)
    return _joined(draw(mutated(header, focus=focus)), body)


@pytest.fixture(scope="module")
def real_files(tmp_path_factory) -> dict[str, bytes]:
    """One file of SAMPLE per encoding, as the consumer writes it."""
    spool = tmp_path_factory.mktemp("spool")
    torch.manual_seed(0)
    files = {}
    for encoding in encodings.ENCODINGS.values():
        spec = _spec(encoding.stored)
        states = torch.randn(len(SAMPLE.input_ids), len(LAYERS), HIDDEN).to(getattr(torch, encoding.compute))
        ready = write_sample_file(
            spool=spool, files=SampleFiles.of(spec), node="n", batch_id="b", sample=SAMPLE, hidden_states=states
        )
        files[encoding.name] = (spool / ready.spool_path).read_bytes()
    return files


def _expected(dtype: str) -> ExpectedSamples:
    """What the bundle says of the job's samples: SAMPLE at its index, among others."""
    digests = np.zeros((4, 16), np.uint8)
    digests[SAMPLE.index] = np.frombuffer(ids_digest(SAMPLE.input_ids), np.uint8)
    expected = ExpectedSamples.of_spec(_spec(dtype), where="fuzz").with_lengths([4, 4, len(SAMPLE.input_ids), 4])
    return dataclasses.replace(expected, digests=digests)


@pytest.mark.parametrize("name", list(encodings.ENCODINGS))
def test_a_fuzzed_sample_file_header_is_refused_in_one_line_by_every_reader(
    name, real_files, tmp_path, record_property
):
    real = real_files[name]
    encoding = encodings.ENCODINGS[name]
    expected = _expected(encoding.stored)
    folder = tmp_path / "dest"
    key = relative_sample_key(JOB, SAMPLE.index)
    (folder / key).parent.mkdir(parents=True)
    destination = FileDestination(folder)
    cases = Cases()
    # The reader is sound: the real file passes every check.
    assert not mismatches(real, expected, SAMPLE.index)
    assert check_sample(real, expected=expected, index=SAMPLE.index, expected_ids=None, hidden_size=None).status == "ok"

    @FUZZ
    @given(mutated_file(real), st.booleans())
    def check(data: bytes, streamed: bool) -> None:
        cases(f"sample file header ({name})")
        header = None
        try:
            header, _ = read_header(data)
        except SampleFileCorrupt:
            pass
        if header is not None:
            try:
                encodings.of_file(header.get("__metadata__", {}), header)
            except encodings.UnknownEncoding:
                pass
        try:
            failed = mismatches(data, expected, SAMPLE.index)
        except SampleFileCorrupt:
            failed = None
        assert failed is None or all(isinstance(v, str) and "\n" not in v for v in failed.values())
        if failed is not None and "hidden_states" not in failed and "encoding" not in failed:
            try:  # as `hsx verify` decodes it: only once its states are the sample's size
                load_sample(data)
            except SampleFileCorrupt:
                pass
        try:
            checked_digest([data])
        except SampleFileCorrupt:
            pass
        outcome = check_sample(data, expected=expected, index=SAMPLE.index, expected_ids=None, hidden_size=None)
        assert outcome.status in ("ok", "corrupt", "mismatching"), outcome
        assert all("\n" not in detail for detail in outcome.details), outcome
        # HiddenStateDataset's read, through a real destination folder: the stored file unchanged.
        (folder / key).write_bytes(data)
        before = sorted(os.walk(folder))
        try:
            item = _read_checked(
                destination,
                folder.as_uri(),
                expected,
                SAMPLE.index,
                concat_layers=False,
                dequantized=True,
                on_bad_file="raise",
                missing="",
                # A JobStream reads with what the sample's `uploaded` marker says of it too.
                tokens=len(SAMPLE.input_ids) if streamed else None,
                sample_digest=sample_digest(SAMPLE).hex() if streamed else "",
            )
        except BadSampleFile as exc:
            assert "\n" not in str(exc)
            item = None
        assert (folder / key).read_bytes() == data and sorted(os.walk(folder)) == before
        if item is not None:
            assert item["input_ids"].tolist() == SAMPLE.input_ids
            assert tuple(item["hidden_states"].shape) == (len(SAMPLE.input_ids), len(LAYERS), HIDDEN)
        try:
            exported = export_read(destination, JOB, SAMPLE.index, torch.float32, expected)
        except _Failed:
            exported = None
        if exported is not None:
            assert exported.input_ids.tolist() == SAMPLE.input_ids

    check()
    cases.record(record_property)
