"""`hsx verify` on a real finished job: a 12-sample job runs through the real pipeline (produce ->
consume on CPU -> upload to a file:// destination), then verify passes with a recompute (each error
shown beside its limit and the reference's scale), and each
damage done to the destination (a flipped data byte, a flipped header byte, a deleted file,
another sample's file under a key, a stray sample file) is named. Each damage is undone after
its check, so the tests stay independent while sharing the one job.

The module-scoped `Services` here is the module-lifetime counterpart of conftest's `hsx` and
`hsx_service` fixtures; tests/test_data.py reuses it.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch
from conftest import _env
from test_e2e_s3 import run_pipeline

from hsx import cli
from hsx.commands.verify import VerifyReport, format_report
from hsx.exitcodes import JOB_FAILED
from hsx.storage.layout import sample_key
from hsx.storage.reader import load_sample

COUNT = 12


class Services:
    """`hsx ARGS` to completion, or in the background, for a whole test module."""

    def __init__(self, nats_url: str, log_dir: Path) -> None:
        self.nats_url = nats_url
        self.log_dir = log_dir
        self.started: list[subprocess.Popen] = []

    def hsx(self, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "hsx.cli", *args],
            env=_env(self.nats_url, env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def service(self, *args: str, env: dict | None = None, name: str = "svc") -> subprocess.Popen:
        log = open(self.log_dir / f"{name}-{len(self.started)}.log", "wb")
        process = subprocess.Popen(
            [sys.executable, "-m", "hsx.cli", *args], env=_env(self.nats_url, env), stdout=log, stderr=log
        )
        process.log_path = Path(log.name)
        self.started.append(process)
        return process

    def stop_all(self) -> None:
        """SIGTERM (graceful) every service still running, SIGKILL what does not stop in 10 s."""
        running = [p for p in self.started if p.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        for process in running:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def services(nats_server, tmp_path_factory):
    started = Services(nats_server.url, tmp_path_factory.mktemp("service-logs"))
    yield started
    started.stop_all()


@pytest.fixture(scope="module")
def file_job(services, tiny_model, tmp_path_factory):
    """A finished float32 job of COUNT samples in a file:// destination."""
    tmp = tmp_path_factory.mktemp("verify-job")
    job = f"v{uuid.uuid4().hex[:8]}"
    out = tmp / "out"
    rows, _spool, _workers = run_pipeline(
        tmp, services.hsx, services.service, job=job, model=tiny_model("qwen3"), dest=str(out), env=None, count=COUNT
    )
    services.stop_all()  # the job is done; idle workers would only take CPU from the checks
    return SimpleNamespace(job=job, out=out, rows=rows, nats_url=services.nats_url)


def run_cli(*args: str) -> tuple[int, str, str]:
    """The real CLI entry point in this process (no interpreter start-up per check); stdout and
    stderr go to buffers of their own (structlog keeps the stream it first wrote to, so a
    per-test capture that gets closed must not be it)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return code, out.getvalue(), err.getvalue()


def verify_in_process(job: str, nats_url: str, *flags: str) -> tuple[int, dict]:
    code, out, err = run_cli("verify", "--job", job, "--nats", nats_url, "--json", *flags)
    assert out, f"verify printed no report (exit {code})\n{err[-3000:]}"
    return code, json.loads(out)


def problems(report: dict) -> dict:
    return {k: report[k] for k in ("missing", "corrupt", "mismatching", "extra_keys")}


@contextlib.contextmanager
def restored(*paths: Path):
    """Put every given file back (or remove it, if it did not exist) after the block."""
    saved = {path: path.read_bytes() if path.exists() else None for path in paths}
    try:
        yield
    finally:
        for path, data in saved.items():
            if data is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(data)


def data_offset(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


def test_verify_passes_and_recomputes(file_job, services):
    result = services.hsx("verify", "--job", file_job.job, "--recompute", "3", "--seed", "11", "--json")
    assert result.returncode == 0, f"verify exited {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    report = json.loads(result.stdout)
    assert report["ok"] is True, report
    assert report["samples_checked"] == COUNT and report["samples_ok"] == COUNT, report
    assert problems(report) == {"missing": [], "corrupt": [], "mismatching": [], "extra_keys": []}, report
    assert report["token_ids_checked"] is True and report["hidden_size"] == 64, report
    assert report["stored_from"] == "index", report  # the monitor wrote it when the job was done
    recompute = report["recompute"]
    assert recompute["seed"] == 11 and len(recompute["indices"]) == 3, recompute
    assert [r["sample_index"] for r in recompute["results"]] == recompute["indices"], recompute
    for r in recompute["results"]:
        # The float32 encoding's limit, which holds here by the arithmetic: the tiny qwen3's states
        # of layers 0, 2, 5 stay under |0.2|, and two float32 forwards of them differ by at most
        # tests/tolerance.py's float32 bound at depth 6, 3.2e-5 of (median |ref| + |ref|): < 1e-5.
        assert r["ok"] and r["max_abs_error"] <= 1e-4 and r["relative_error"] < 1e-4, r
        # Each error beside the limit and the scale it is measured against: the sample's relative
        # error (hsx/storage/encodings/float32.py), which a bfloat16 round trip exceeds.
        assert r["tolerance"] == {"relative_error": 1e-3} and r["reference_max_abs"] > 0 < r["reference_norm"], r
    states = load_sample((file_job.out / sample_key(file_job.job, recompute["indices"][0])).read_bytes())[0]
    hidden = states["hidden_states"].float()
    rounded = hidden.to(torch.bfloat16).float()
    assert ((rounded - hidden).norm() / hidden.norm()).item() > 1e-3
    text = format_report(msgspec.convert(report, VerifyReport), as_json=False)
    first = recompute["results"][0]
    line = next(line for line in text.splitlines() if f"sample {first['sample_index']}: ok" in line)
    assert "limit: relative error <= 0.001" in line and f"max |reference| {first['reference_max_abs']:.3g}" in line, (
        text
    )
    # Progress goes to the log stream, the report alone to stdout.
    assert '"event": "verify_done"' in result.stderr, result.stderr[-2000:]


def test_flipped_data_byte_is_corrupt(file_job):
    index = 5
    path = file_job.out / sample_key(file_job.job, index)
    data = bytearray(path.read_bytes())
    position = data_offset(bytes(data)) + (len(data) - data_offset(bytes(data))) // 2  # inside hidden_states
    data[position] ^= 0x01
    with restored(path):
        path.write_bytes(bytes(data))
        code, report = verify_in_process(file_job.job, file_job.nats_url)
    assert code == JOB_FAILED and report["ok"] is False, report
    assert [(c["sample_index"], c["reason"]) for c in report["corrupt"]] == [(index, "checksum")], report
    assert report["missing"] == [] and report["mismatching"] == [] and report["samples_ok"] == COUNT - 1, report


def test_flipped_header_byte_is_corrupt(file_job):
    index = 2
    path = file_job.out / sample_key(file_job.job, index)
    data = bytearray(path.read_bytes())
    data[8] ^= 0xFF  # the header's opening brace
    with restored(path):
        path.write_bytes(bytes(data))
        code, report = verify_in_process(file_job.job, file_job.nats_url)
    assert code == JOB_FAILED, report
    assert [(c["sample_index"], c["reason"]) for c in report["corrupt"]] == [(index, "load")], report
    assert report["missing"] == [] and report["mismatching"] == [], report


def test_deleted_file_is_missing(file_job):
    index = 7
    path = file_job.out / sample_key(file_job.job, index)
    with restored(path):
        path.unlink()
        code, report = verify_in_process(file_job.job, file_job.nats_url)
    assert code == JOB_FAILED, report
    assert problems(report) == {"missing": [index], "corrupt": [], "mismatching": [], "extra_keys": []}, report


def test_other_samples_file_under_a_key_is_mismatching(file_job):
    source, target = 3, 4
    target_path = file_job.out / sample_key(file_job.job, target)
    with restored(target_path):
        shutil.copyfile(file_job.out / sample_key(file_job.job, source), target_path)
        code, report = verify_in_process(file_job.job, file_job.nats_url)
    assert code == JOB_FAILED, report
    assert report["missing"] == [] and report["corrupt"] == [], report
    [entry] = report["mismatching"]
    assert entry["sample_index"] == target and "sample_index" in entry["checks"], entry
    assert "input_ids" in entry["checks"], entry  # compared with the dataset's row
    assert "index" in entry["checks"], entry  # not the file the job's index recorded
    text = format_report(msgspec.convert(report, VerifyReport), as_json=False)  # the JSON reads back as the report
    assert "PROBLEMS FOUND" in text and f"{sample_key(file_job.job, target)}: sample_index" in text, text


def test_stray_sample_file_is_an_extra_key(file_job):
    stray = file_job.out / sample_key(file_job.job, COUNT)  # one past the job's last sample
    with restored(stray):
        shutil.copyfile(file_job.out / sample_key(file_job.job, 0), stray)
        _code, from_index = verify_in_process(file_job.job, file_job.nats_url)
        # Only a listing finds keys that are not the job's samples; the index names those that are.
        code, report = verify_in_process(file_job.job, file_job.nats_url, "--list")
    assert from_index["ok"] and from_index["stored_from"] == "index", from_index
    assert code == JOB_FAILED and report["stored_from"] == "listing", report
    assert problems(report) == {
        "missing": [],
        "corrupt": [],
        "mismatching": [],
        "extra_keys": [sample_key(file_job.job, COUNT)],
    }, report


def test_token_ids_come_from_the_job_not_the_dataset_file(file_job, tmp_path):
    """Token ids are compared with the tokenized dataset stored with the job, so verify needs no
    copy of the dataset: with the file moved away, a swapped file is still caught by its
    sample_index and by its token ids."""
    dataset = file_job.out.parent / "data.jsonl"
    moved = tmp_path / "data.jsonl"
    target_path = file_job.out / sample_key(file_job.job, 1)
    with restored(target_path):
        shutil.copyfile(file_job.out / sample_key(file_job.job, 0), target_path)
        shutil.move(dataset, moved)
        try:
            code, report = verify_in_process(file_job.job, file_job.nats_url)
        finally:
            shutil.move(moved, dataset)
    assert code == JOB_FAILED and report["token_ids_checked"] is True, report
    assert "tokenized dataset" in report["token_ids"], report
    assert [
        (m["sample_index"], "sample_index" in m["checks"], "input_ids" in m["checks"]) for m in report["mismatching"]
    ] == [(1, True, True)], report


def test_unknown_job_is_a_user_error(file_job):
    code, out, err = run_cli("verify", "--job", "no-such-job-here", "--nats", file_job.nats_url)
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith("hsx: error: job no-such-job-here not found"), err
