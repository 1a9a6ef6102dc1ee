"""`hsx sync`: a directory uploaded pass after pass, to file:// and to S3 (moto), read back with
boto3 / the file system. Only what changed is uploaded again, also by a restarted sync; failing
uploads are retried with backoff; a signal lets the file in hand finish; bad arguments are one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import pytest
from conftest import clean_environ

from hsx import cli
from hsx.commands.sync import SyncConfig, Syncer
from hsx.exitcodes import STOPPED
from hsx.storage.destinations import VerificationError, s3
from hsx.storage.location import Location, open_destination
from hsx.wire.lifecycle import stop_flag_on_signals


def _write(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _bucket_tree(bucket: str, prefix: str) -> dict[str, bytes]:
    s3 = boto3.client("s3")
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            out[obj["Key"][len(prefix) + 1 :]] = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


def _events(text: str, name: str) -> list[dict]:
    return [
        e for e in (json.loads(line) for line in text.splitlines() if line.startswith("{")) if e.get("event") == name
    ]


def _sync(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsx.cli", "sync", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean_environ(), **(env or {})},
    )


def _modify(path: Path, data: bytes) -> None:
    """New content and a new mtime, even on a file system with coarse timestamps."""
    before = path.stat().st_mtime_ns
    path.write_bytes(data)
    os.utime(path, ns=(before + 2_000_000_000, before + 2_000_000_000))


FIRST = {
    "step-100/model.safetensors": b"weights-100" * 1000,
    "step-100/optim.pt": b"optim-100" * 500,
    "trainer_state.json": b'{"step": 100}',
    "logs/events.txt": b"loss 1.0\n",
}


def test_once_to_file_then_only_changes_even_after_a_restart(tmp_path):
    source, out = tmp_path / "ckpt", tmp_path / "out"
    _write(source, FIRST)
    first = _sync(str(source), "--once", "--dest", str(out), "--prefix", "run1")
    assert first.returncode == 0, first.stderr
    assert _tree(out / "run1") == FIRST
    assert {e["key"] for e in _events(first.stderr, "sync_file_uploaded")} == set(FIRST)

    _modify(source / "trainer_state.json", b'{"step": 200}')
    os.utime(source / "logs/events.txt")  # touched, same bytes
    _write(source, {"step-200/model.safetensors": b"weights-200" * 1000})
    # A new process: what is already there is recognised by size and sha256, not uploaded again.
    second = _sync(str(source), "--once", "--dest", out.as_uri(), "--prefix", "/run1/")
    assert second.returncode == 0, second.stderr
    assert {e["key"] for e in _events(second.stderr, "sync_file_uploaded")} == {
        "trainer_state.json",
        "step-200/model.safetensors",
    }
    [done] = _events(second.stderr, "sync_pass_done")
    assert (done["uploaded"], done["unchanged"], done["failed"]) == (2, 3, 0)
    assert _tree(out / "run1") == _tree(source)


def test_every_to_s3_reuploads_only_the_changed_file_and_stops_on_sigterm(tmp_path, s3_env):
    bucket, env = s3_env
    source = tmp_path / "ckpt"
    _write(source, FIRST)
    log = tmp_path / "sync.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hsx.cli",
                "sync",
                str(source),
                "--every",
                "1s",
                "--dest",
                f"s3://{bucket}/checkpoints",
                "--prefix",
                "run1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**clean_environ(), **env},
        )
    try:

        def passes() -> list[dict]:
            return _events(log.read_text(), "sync_pass_done")

        def wait_for_passes(count: int) -> None:
            deadline = time.monotonic() + 30
            while len(passes()) < count:
                assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)

        wait_for_passes(1)
        assert _bucket_tree(bucket, "checkpoints/run1") == FIRST
        _modify(source / "step-100/optim.pt", b"optim-101" * 500)
        seen = len(passes())
        wait_for_passes(seen + 1)
        uploaded = [e["key"] for e in _events(log.read_text(), "sync_file_uploaded")]
        assert sorted(uploaded) == sorted([*FIRST, "step-100/optim.pt"])  # once each, the changed one twice
        assert passes()[-1]["uploaded"] == 1 and passes()[-1]["unchanged"] == len(FIRST) - 1
        stored = _bucket_tree(bucket, "checkpoints/run1")
        assert stored == _tree(source)
        head = boto3.client("s3").head_object(Bucket=bucket, Key="checkpoints/run1/step-100/optim.pt")
        assert head["Metadata"]["hsx-sha256"] == hashlib.sha256(b"optim-101" * 500).hexdigest()
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == STOPPED, log.read_text()[-3000:]  # --every never ends on its own
        assert _events(log.read_text(), "sync_stopped")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_multipart_upload_is_verified_by_sha256(tmp_path, s3_env, monkeypatch):
    bucket, _ = s3_env
    monkeypatch.setattr(s3, "MULTIPART_THRESHOLD", 5 << 20)
    monkeypatch.setattr(s3, "MULTIPART_CHUNK", 5 << 20)
    source = tmp_path / "ckpt"
    big = os.urandom(11 << 20)  # three parts
    _write(source, {"big.bin": big})
    cfg = SyncConfig(source=source, dest=Location.parse(f"s3://{bucket}/mp"), every_s=None)
    syncer = Syncer(cfg, open_destination(cfg.dest), threading.Event())
    assert syncer.run_pass().uploaded == ["big.bin"]
    head = boto3.client("s3").head_object(Bucket=bucket, Key="mp/big.bin")
    assert "-" in head["ETag"]  # a multipart object
    assert head["Metadata"]["hsx-sha256"] == hashlib.sha256(big).hexdigest()
    assert _bucket_tree(bucket, "mp") == {"big.bin": big}
    assert syncer.run_pass().unchanged == 1


class _Flaky:
    """A file:// destination whose first `failures` puts raise, as an unreachable S3 would."""

    def __init__(self, root: Path, failures: int) -> None:
        self.inner, self.failures, self.puts = open_destination(Location.parse(root)), failures, 0
        self.url = self.inner.url

    def put_file_verified(self, local, key, *, size, sha256):
        self.puts += 1
        if self.puts <= self.failures:
            raise VerificationError(f"injected failure {self.puts}")
        self.inner.put_file_verified(local, key, size=size, sha256=sha256)

    def has_sha256(self, key, *, size, sha256):
        return self.inner.has_sha256(key, size=size, sha256=sha256)


def test_failing_uploads_are_retried_with_backoff_then_left_to_the_next_pass(tmp_path):
    source, out = tmp_path / "ckpt", tmp_path / "out"
    _write(source, {"a.bin": b"a" * 100})
    cfg = SyncConfig(source=source, dest=Location.parse(out), every_s=None, retries=3, backoff_s=0.01)
    flaky = _Flaky(out, failures=2)
    result = Syncer(cfg, flaky, threading.Event()).run_pass()
    assert result.uploaded == ["a.bin"] and flaky.puts == 3 and _tree(out) == _tree(source)

    hopeless = _Flaky(tmp_path / "out2", failures=10)
    syncer = Syncer(cfg, hopeless, threading.Event())
    result = syncer.run_pass()
    assert result.failed == ["a.bin"] and hopeless.puts == 3  # `retries` attempts, then the next pass
    hopeless.failures = 0
    assert syncer.run_pass().uploaded == ["a.bin"]


def test_sigterm_lets_the_file_in_hand_finish(tmp_path):
    source, out = tmp_path / "ckpt", tmp_path / "out"
    _write(source, {f"f{i}.bin": bytes([i]) * 1000 for i in range(5)})
    inner = open_destination(Location.parse(out))

    class SignalledMidUpload:
        url = inner.url
        has_sha256 = inner.has_sha256

        @staticmethod
        def put_file_verified(local, key, *, size, sha256):
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while this file is being uploaded
            inner.put_file_verified(local, key, size=size, sha256=sha256)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        stopping = stop_flag_on_signals()
        result = Syncer(
            SyncConfig(source=source, dest=Location.parse(out), every_s=None), SignalledMidUpload(), stopping
        ).run_pass()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert stopping.is_set() and result.stopped
    assert result.uploaded == ["f0.bin"] and _tree(out) == {"f0.bin": (source / "f0.bin").read_bytes()}


def _cli(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(["sync", *args])
        except SystemExit as exc:  # argparse errors
            code = exc.code
    return code, err.getvalue()


@pytest.mark.parametrize(
    "args, message",
    [
        (["{missing}", "--once", "--dest", "{out}"], "hsx: error: PATH '{missing}': no such directory"),
        (["{file}", "--once", "--dest", "{out}"], "hsx: error: PATH '{file}': not a directory"),
        (["{src}", "--every", "3x", "--dest", "{out}"], "hsx: error: --every '3x': not a duration"),
        (["{src}", "--every", "0m", "--dest", "{out}"], "hsx: error: --every '0m': must be longer than zero"),
        (["{src}", "--dest", "{out}"], "hsx: error: one of the arguments --every --once is required"),
        (
            ["{src}", "--once", "--every", "1m", "--dest", "{out}"],
            "hsx: error: argument --every: not allowed with argument --once",
        ),
        (["{src}", "--once", "--dest", "{src}/copy"], "hsx: error: --dest '{src}/copy' is inside PATH"),
        (["{src}", "--once", "--dest", "ftp://x/y"], "hsx: error: --dest 'ftp://x/y': unsupported scheme"),
    ],
    ids=["missing", "file", "bad-every", "zero-every", "no-every", "every-and-once", "dest-inside", "bad-dest"],
)
def test_bad_arguments_are_one_line_errors(tmp_path, args, message):
    names = {"missing": tmp_path / "nope", "file": tmp_path / "f.txt", "src": tmp_path / "src", "out": tmp_path / "out"}
    names["file"].write_text("x")
    names["src"].mkdir()
    fill = {k: str(v) for k, v in names.items()}
    code, err = _cli(*(a.format(**fill) for a in args))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message.format(**fill)), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "text, seconds",
    [("90", 90), ("90s", 90), ("30m", 1800), ("2h", 7200), ("1h30m", 5400), ("1.5h", 5400), ("1d", 86400)],
)
def test_durations(text, seconds):
    from hsx.commands.sync import parse_duration

    assert parse_duration(text, "--every") == seconds
