"""Nothing stale, nothing foreign: readers take only this job's data (issue 21).

One job name, used twice in one file destination through the real pipeline (produce, consume on
the CPU, upload; no monitor, so no index): 24 samples with layers 2,4, `hsx jobs delete`, then
10 samples with layers 1,3,5 (`--replace-output`). The folder then holds the new job's 10 files
and 14 of the deleted job's. On that folder (or a copy of it, damaged as each test says): `hsx export`,
`HiddenStateDataset`, `hsx index rebuild` and `hsx verify` read samples 0..9 of this plan only,
check each file against the job's bundle (job, plan, sample index, layers, dtype, shape, token
count, input ids) before they export, yield or index it, and say in one line what is wrong with
one that is not this sample, missing, or past the plan; a bundle that claims a billion samples is
refused in one line, in bounded memory.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import boto3
import pytest
import torch
from conftest import _env, aws_bucket, run_in_process
from test_e2e_s3 import check_ok, write_dataset
from test_verify import restored, verify_in_process

from hsx.errors import HsxError
from hsx.exitcodes import JOB_FAILED
from hsx.gpu_consumer.writer import write_sample_file
from hsx.job import JobSpec
from hsx.logs import configure_logging
from hsx.storage.layout import SampleFiles, sample_key
from hsx.storage.reader import HiddenStateDataset, pack_collate, pad_collate, prefetched
from hsx.wire import schemas

OLD, NEW = 24, 10  # samples of the deleted job, and of the job now under the name
OLD_LAYERS, NEW_LAYERS = "2,4", "1,3,5"


def _hsx(args: list[str], nats_url: str | None, *, timeout: float = 120) -> subprocess.CompletedProcess:
    with pytest.MonkeyPatch.context() as patch:
        return run_in_process(args, _env(nats_url, None), patch, timeout=timeout)


def _run_job(
    nats_url: str, root: Path, *, job: str, model: Path, dataset: Path, layers: str, out: Path, tag: str, extra=()
):
    """`hsx produce`, then a consumer and an uploader until `hsx status` says done; both stopped."""
    check_ok(
        _hsx(
            ["produce", "--job", job, "--model", str(model), "--dataset", str(dataset), "--layers", layers,
             "--dest", str(out), "--dtype", "float32", "--token-budget", "128", "--max-seq-len", "32", *extra],
            nats_url,
        ),
        f"produce {tag}",
    )  # fmt: skip
    services = []
    for args in (["consume", "--device", "cpu"], ["upload"]):
        log = open(root / f"{tag}-{args[0]}.log", "wb")
        services.append(
            subprocess.Popen(
                [sys.executable, "-m", "hsx.cli", *args, "--job", job, "--spool", str(root / f"spool-{tag}")],
                env=_env(nats_url, None),
                stdout=log,
                stderr=log,
            )
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            status = _hsx(["status", "--job", job, "--json"], nats_url)
            if status.returncode == 0 and json.loads(status.stdout)["done"]:
                break
            assert all(p.poll() is None for p in services), f"a service exited early (logs in {root})"
            assert time.monotonic() < deadline, f"job {tag} not done in 180 s (logs in {root})"
            time.sleep(0.5)
    finally:
        for process in services:
            process.terminate()
        for process in services:
            process.wait(60)


@pytest.fixture(scope="module")
def reused(nats_server, tiny_model, tmp_path_factory):
    """The name used twice: the folder, the new job's rows, and sample 3 of the deleted job's plan."""
    root = tmp_path_factory.mktemp("reused")
    model, out, job = tiny_model("qwen3"), root / "out", f"reuse-{uuid.uuid4().hex[:8]}"
    write_dataset(root / "old.jsonl", OLD, min_len=3, max_len=24, seed=31)
    new_rows = write_dataset(root / "new.jsonl", NEW, min_len=3, max_len=24, seed=32)
    _run_job(
        nats_server.url, root, job=job, model=model, dataset=root / "old.jsonl", layers=OLD_LAYERS, out=out, tag="old"
    )
    stale_3 = (out / sample_key(job, 3)).read_bytes()
    # Its workers are stopped; --force: a goodbye not yet seen must not refuse the delete.
    check_ok(_hsx(["jobs", "delete", job, "--force"], nats_server.url), "jobs delete")
    # The producer refuses a folder of another plan unless told (producer/preflight.py); told,
    # it replaces the old bundle and leaves the old plan's sample files to be overwritten.
    _run_job(
        nats_server.url, root, job=job, model=model, dataset=root / "new.jsonl", layers=NEW_LAYERS, out=out, tag="new",
        extra=["--replace-output"],
    )  # fmt: skip
    return SimpleNamespace(job=job, out=out, folder=out / job, rows=new_rows, stale_3=stale_3, nats_url=nats_server.url)


def _copy(reused, tmp_path: Path) -> Path:
    """A copy of the job's folder (the folder's name is the job's, as readers take it)."""
    copy = tmp_path / "copy" / reused.job
    shutil.copytree(reused.folder, copy)
    return copy


def _export(source: Path | str, fmt: str, out: Path) -> subprocess.CompletedProcess:
    return _hsx(["export", str(source), "--to", fmt, str(out)], None)


def _report(out: Path) -> dict:
    return json.loads((out / "hsx-export.json").read_text())


def _one_line_error(result: subprocess.CompletedProcess, *needles: str, code: int = 2) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("hsx: error:")]
    assert result.returncode == code and len(lines) == 1, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr, result.stderr[-3000:]
    assert all(needle in lines[0] for needle in needles), lines[0]
    return lines[0]


def _dataset_error(url: str, position: int, **options) -> str:
    """The error reading position `position` raises: one line (an HsxError), returned."""
    with pytest.raises(HsxError) as raised:
        HiddenStateDataset(url, **options)[position]
    assert "\n" not in str(raised.value), str(raised.value)
    return str(raised.value)


def _foreign_file(tmp_path: Path, index: int) -> bytes:
    """Sample `index` of another job, made by the consumer's own writer: another model width
    (32), other layers (0, 2), 40 tokens; its checksum is sound."""
    other = JobSpec(
        job="someone-elses-job", model="elsewhere/other-model", model_revision="main", layers=[0, 2],
        dtype="float32", dest=str(tmp_path), token_budget=64, max_seq_len=64, dataset="other.jsonl",
        plan_fingerprint="f" * 64, total_samples=100, total_tokens=4000, total_batches=10, created_at=0.0,
    )  # fmt: skip
    sample = schemas.Sample(index=index, source_id="x", input_ids=list(range(40)))
    spool = tmp_path / "foreign-spool"
    ready = write_sample_file(
        spool=spool,
        files=SampleFiles.of(other),
        node="n",
        batch_id="b",
        sample=sample,
        hidden_states=torch.randn(40, 2, 32),
    )
    return (spool / ready.spool_path).read_bytes()


def _strip_plan(data: bytes) -> bytes:
    """The same file as hsx before plan tags wrote it: `plan` left out of its header (the
    checksum covers the data section, which is unchanged)."""
    end = 8 + int.from_bytes(data[:8], "little")
    header = json.loads(data[8:end])
    header["__metadata__"].pop("plan", None)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (end - 8 - len(text))  # the data stays where the header's offsets say it is
    return len(text).to_bytes(8, "little") + text + data[end:]


@contextlib.contextmanager
def _json_logs():
    """The JSON log lines hsx writes while the block runs (to stderr, as the CLI's)."""
    lines: list[dict] = []
    err = io.StringIO()
    configure_logging(json=True)
    with contextlib.redirect_stderr(err):
        yield lines
    lines += [json.loads(line) for line in err.getvalue().splitlines() if line.startswith("{")]


# ---------------------------------------------------------------- item 1: stale and foreign files


@pytest.mark.faults
def test_a_reused_name_reads_only_this_plans_samples(reused, tmp_path):
    """The reproduction: export wrote 19 of "10" samples with the old job's token ids, and
    HiddenStateDataset said 24. Now both take samples 0..9 of this plan, each with its own row."""
    stored = sorted(int(path.stem) for path in reused.folder.glob("*/*.safetensors"))
    assert stored == list(range(OLD)), stored  # the deleted job's files past 10 are still there

    out = tmp_path / "dflash"
    result = _export(reused.folder, "specforge-dflash", out)
    assert result.returncode == 0, result.stderr[-3000:]
    report = _report(out)
    assert report["samples_in_job"] == NEW and report["failed"] == [], report
    assert report["samples_exported"] + len(report["left_out"]) == NEW, report
    written = sorted(out.rglob("*.ckpt"))
    assert len(written) == report["samples_exported"], written
    for path in written:
        index = int(path.stem.removeprefix("data_"))
        assert index < NEW, path
        assert torch.load(path, weights_only=False)["input_ids"].tolist() == reused.rows[index]["input_ids"], path

    dataset = HiddenStateDataset(str(reused.folder))
    assert len(dataset) == NEW and dataset.sample_indices == list(range(NEW)), dataset.sample_indices
    for i in range(NEW):
        assert dataset[i]["input_ids"].tolist() == reused.rows[i]["input_ids"], i

    # The index from the destination alone holds the same ten, and verify passes from it; a
    # listing names the deleted job's files as keys that are not this job's samples.
    rebuilt = _hsx(["index", "rebuild", str(reused.folder), "--json"], None)
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert json.loads(rebuilt.stdout)["samples"] == NEW and json.loads(rebuilt.stdout)["complete"]
    code, verified = verify_in_process(reused.job, reused.nats_url)
    assert code == 0 and verified["ok"] and verified["samples_ok"] == NEW, verified
    code, listed = verify_in_process(reused.job, reused.nats_url, "--list")
    assert listed["samples_ok"] == NEW and listed["mismatching"] == [], listed
    assert listed["extra_keys"] == sorted(sample_key(reused.job, i) for i in range(NEW, OLD)), listed
    (reused.folder / "_hsx" / "index.arrow").unlink()  # the other tests read the folder as it was


def test_another_jobs_file_over_a_sample_is_named_and_the_rest_read(reused, tmp_path):
    """Another job's file (sound checksum, other layers and width, 40 token ids) over sample 1:
    export exited 0 and wrote it as sample 1; the dataset yielded it. Now export lists it with
    what disagrees and exits 65 after writing the rest; the dataset raises one line naming the key,
    or, asked to, skips it and says so; index rebuild leaves it out; verify calls it mismatching."""
    copy = _copy(reused, tmp_path)
    key = sample_key(reused.job, 1)
    (copy.parent / key).write_bytes(_foreign_file(tmp_path, 1))

    out = tmp_path / "dflash"
    result = _export(copy, "specforge-dflash", out)
    assert result.returncode == JOB_FAILED, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    report = _report(out)
    assert [entry["sample_index"] for entry in report["failed"]] == [1], report
    reason = report["failed"][0]["reason"]
    assert reason.startswith("mismatching: ") and key in reason, reason
    assert "someone-elses-job" in reason and "layers" in reason, reason
    assert report["samples_exported"] + len(report["left_out"]) == NEW - 1, report
    assert not list(out.rglob("data_1.ckpt"))

    error = _dataset_error(str(copy), 1)
    assert key in error and "someone-elses-job" in error, error
    assert HiddenStateDataset(str(copy))[2]["input_ids"].tolist() == reused.rows[2]["input_ids"]

    with _json_logs() as logs:
        skipping = HiddenStateDataset(str(copy), on_bad_file="skip")
        assert skipping[1] is None
        items = list(prefetched(skipping, range(NEW), in_flight=3))
        batch = skipping.__getitems__([0, 1, 2])
    skipped = [line for line in logs if line.get("event") == "sample_file_skipped"]
    assert skipped and all(key in line["key"] and "someone-elses-job" in line["reason"] for line in skipped), logs
    assert [item["sample_index"] for item in items] == [i for i in range(NEW) if i != 1]
    assert batch[1] is None
    assert pad_collate(batch)["sample_index"].tolist() == [0, 2]
    assert pack_collate(batch)["sample_index"].tolist() == [0, 2]

    rebuilt = _hsx(["index", "rebuild", str(copy)], None)
    assert rebuilt.returncode == JOB_FAILED and f"index of {NEW - 1}/{NEW} samples" in rebuilt.stdout, rebuilt.stderr[
        -3000:
    ]
    assert key in rebuilt.stderr, rebuilt.stderr[-3000:]  # the file left out is named in its log

    with restored(reused.out / key):
        (reused.out / key).write_bytes(_foreign_file(tmp_path, 1))
        code, verified = verify_in_process(reused.job, reused.nats_url)
    assert code == JOB_FAILED, verified
    [entry] = verified["mismatching"]
    assert entry["sample_index"] == 1 and {"job", "plan", "layers", "hidden_states"} <= set(entry["checks"]), entry


def test_a_file_of_the_names_earlier_plan_is_refused(reused, tmp_path):
    """Sample 3 of the deleted job put back under its key: the same job name, another plan."""
    copy = _copy(reused, tmp_path)
    key = sample_key(reused.job, 3)
    (copy.parent / key).write_bytes(reused.stale_3)
    out = tmp_path / "dflash"
    result = _export(copy, "specforge-dflash", out)
    assert result.returncode == JOB_FAILED, result.stderr[-3000:]
    [entry] = _report(out)["failed"]
    assert entry["sample_index"] == 3 and "plan" in entry["reason"] and key in entry["reason"], entry
    error = _dataset_error(str(copy), 3)
    assert key in error and "plan" in error, error
    rebuilt = _hsx(["index", "rebuild", str(copy)], None)
    assert rebuilt.returncode == JOB_FAILED and f"index of {NEW - 1}/{NEW} samples" in rebuilt.stdout, rebuilt.stderr[
        -3000:
    ]


def test_a_file_from_before_plan_tags_is_taken_by_its_contents(reused, tmp_path):
    """A file without `plan` (hsx before plan tags) is this job's sample when all the rest,
    input ids included, is; the deleted job's sample 3 without its plan is still refused."""
    copy = _copy(reused, tmp_path)
    (copy.parent / sample_key(reused.job, 2)).write_bytes(
        _strip_plan((copy.parent / sample_key(reused.job, 2)).read_bytes())
    )
    (copy.parent / sample_key(reused.job, 3)).write_bytes(_strip_plan(reused.stale_3))
    dataset = HiddenStateDataset(str(copy))
    assert dataset[2]["input_ids"].tolist() == reused.rows[2]["input_ids"]
    error = _dataset_error(str(copy), 3)
    assert sample_key(reused.job, 3) in error and "input_ids" in error, error


# ---------------------------------------------------------------- item 3: a missing file


def test_a_missing_file_is_listed_by_export_and_one_line_in_the_reader(reused, tmp_path, s3_server):
    """Sample 4 deleted after the index was made (so the readers expect it): export raised
    FileNotFoundError with a traceback and wrote no report, the reader a raw FileNotFoundError
    (or botocore's NoSuchKey). Now export lists it, writes the rest and the report, exits 65; the
    reader says in one line which key is missing, over file:// and S3."""
    copy = _copy(reused, tmp_path)
    assert _hsx(["index", "rebuild", str(copy)], None).returncode == 0
    key = sample_key(reused.job, 4)
    (copy.parent / key).unlink()

    out = tmp_path / "dflash"
    result = _export(copy, "specforge-dflash", out)
    assert result.returncode == JOB_FAILED and "Traceback" not in result.stderr, result.stderr[-3000:]
    report = _report(out)
    assert report["failed"] == [{"sample_index": 4, "reason": f"missing: {key}"}], report
    assert report["samples_exported"] + len(report["left_out"]) == NEW - 1, report

    error = _dataset_error(str(copy), 4)
    assert key in error and "missing" in error, error
    skipping = HiddenStateDataset(str(copy), on_bad_file="skip")
    assert skipping[4] is None and skipping[5]["sample_index"] == 5

    with aws_bucket(s3_server, tmp_path) as (_env_vars, bucket):
        s3 = boto3.client("s3")
        for path in copy.rglob("*"):
            if path.is_file():
                s3.upload_file(str(path), bucket, f"p/{path.relative_to(copy.parent)}")
        error = _dataset_error(f"s3://{bucket}/p/{reused.job}", 4)
        assert key in error and "missing" in error, error


# ---------------------------------------------------------------- item 4: absurd bundle values


def test_a_bundle_claiming_a_billion_samples_is_refused_in_one_line(reused, tmp_path):
    """`total_samples` 1e9 in job.json: export built a set of a billion ints (MemoryError). Now
    the claim is checked against the bundle's tokens file first, in bounded memory."""
    copy = _copy(reused, tmp_path)
    spec_path = copy / "_hsx" / "job.json"
    spec = json.loads(spec_path.read_text())
    spec["total_samples"] = 1_000_000_000
    spec_path.write_text(json.dumps(spec))

    _one_line_error(_export(copy, "specforge-dflash", tmp_path / "out"), "job.json", "1000000000", str(NEW))
    _one_line_error(_hsx(["index", "rebuild", str(copy)], None), "job.json", "1000000000", str(NEW))
    with pytest.raises(HsxError, match=rf"1000000000.*{NEW}") as raised:
        HiddenStateDataset(str(copy))
    assert "job.json" in str(raised.value)


def test_a_bundle_without_its_tokens_file_is_checked_by_its_spec(reused, tmp_path):
    """A bundle from an hsx that stored no tokenized samples: files are checked against the
    spec (a log line says the input ids are not), so another job's file is still refused; an
    absurd total_samples cannot be checked then, and costs what is stored, not what is claimed:
    export lists the billion missing samples as one entry."""
    copy = _copy(reused, tmp_path)
    (copy / "_hsx" / "tokens.arrow").unlink()
    (copy.parent / sample_key(reused.job, 1)).write_bytes(_foreign_file(tmp_path, 1))
    with _json_logs() as logs:
        dataset = HiddenStateDataset(str(copy))
    assert [line["event"] for line in logs if line.get("event") == "bundle_without_tokens"], logs
    assert len(dataset) == NEW and dataset[0]["input_ids"].tolist() == reused.rows[0]["input_ids"]
    assert "someone-elses-job" in _dataset_error(str(copy), 1)

    spec_path = copy / "_hsx" / "job.json"
    spec_path.write_text(json.dumps({**json.loads(spec_path.read_text()), "total_samples": 1_000_000_000}))
    out = tmp_path / "dflash"
    result = _export(copy, "specforge-dflash", out)
    assert result.returncode == JOB_FAILED and "Traceback" not in result.stderr, result.stderr[-3000:]
    failed = _report(out)["failed"]
    # Sample 1 (another job's), 10..23 (the deleted job's plan), then one entry for the rest.
    assert [entry["sample_index"] for entry in failed] == [1, *range(NEW, OLD), OLD], failed
    assert "plan" in failed[1]["reason"] and failed[-1]["count"] == 1_000_000_000 - OLD, failed[-1]
    assert "failed 999999991 samples" in result.stderr, result.stderr[-3000:]


def test_the_header_dtypes_are_the_stored_tensors(tmp_path):
    """The safetensors dtype the check expects of the hidden states for each encoding is the one
    its writer gives them, and the header shows the states' shape."""
    from hsx.storage import encodings, samplefile
    from hsx.storage.expected import read_header

    for name, encoding in encodings.ENCODINGS.items():
        states = torch.zeros(2, 3, 4).to(getattr(torch, encoding.compute))
        metadata = encoding.file_metadata(2, 3, 4)
        samplefile.write(tmp_path / name, encoding.encode(states), metadata)
        header, _ = read_header((tmp_path / name).read_bytes())
        entry = encoding.header_states(header, metadata)
        assert entry["dtype"] == encoding.header_dtype() and entry["shape"] == [2, 3, 4], name
        assert encoding.header_problems(header, entry) == {}, name


def test_a_file_past_the_plan_is_not_the_jobs(reused, tmp_path):
    """Sample 0's file copied to key 12 of a 10-sample plan: speculators' export looked its row up
    in the job's 10 tokenized samples (IndexError). Now nothing past the plan is read: every
    reader sees the plan's 10 samples."""
    copy = _copy(reused, tmp_path)
    for stale in range(NEW, OLD):
        (copy.parent / sample_key(reused.job, stale)).unlink()
    shutil.copyfile(copy.parent / sample_key(reused.job, 0), copy.parent / sample_key(reused.job, NEW + 2))
    out = tmp_path / "speculators"
    result = _export(copy, "speculators", out)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    report = _report(out)
    assert report["samples_exported"] == NEW and report["failed"] == [], report
    assert sorted(p.name for p in (out / "hidden_states").iterdir()) == sorted(
        f"hs_{i}.safetensors" for i in range(NEW)
    )
    assert len(HiddenStateDataset(str(copy))) == NEW
    rebuilt = _hsx(["index", "rebuild", str(copy), "--json"], None)
    assert rebuilt.returncode == 0 and json.loads(rebuilt.stdout)["samples"] == NEW, rebuilt.stderr[-3000:]
