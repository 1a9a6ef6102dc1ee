"""A GPU consumer dies by SIGKILL at the worst moment: its batch's files are written and announced,
but the batch is not acked. JetStream redelivers it after --ack-wait; a second consumer redoes
it; every sample still ends in the destination exactly once, complete and correct.

The test-only switch HSX_TEST_CRASH_BEFORE_ACK=<marker> makes the first consumer to finish a
batch create the marker and SIGKILL itself right before ack_sync(); later consumers see the
marker and run normally.

While the pipeline runs, a background thread lists the bucket every ~0.2 s and GETs every new key
once: a truncated object or a key outside `prefix/<job>/<shard>/<index>.safetensors` would be a
partial file visible to a trainer, and fails the test.
"""

from __future__ import annotations

import re
import threading
import time

import boto3
import pytest
from test_e2e_s3 import (
    Reference,
    check_final_status,
    check_outputs,
    check_sample_file,
    logs_of,
    produce,
    read_s3_objects,
    spool_files,
    start_monitor,
    status,
    wait_until_done,
    write_dataset,
)

COUNT = 24
ACK_WAIT = "3"


class BucketWatcher(threading.Thread):
    """Lists the bucket every `period` s and GETs each new key once, checking it is complete."""

    def __init__(self, bucket: str, prefix: str, job: str, rows: list[dict], period: float = 0.2) -> None:
        super().__init__(daemon=True, name="bucket-watcher")
        self.bucket, self.prefix, self.job, self.rows, self.period = bucket, prefix, job, rows, period
        self.pattern = re.compile(rf"{re.escape(prefix)}/{re.escape(job)}/\d{{5}}/\d+\.safetensors")
        self.client = boto3.client("s3")
        self.seen: set[str] = set()
        self.problems: list[str] = []
        self.listings = 0
        self.stopping = threading.Event()

    def _poll(self) -> None:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        for obj in (o for page in pages for o in page.get("Contents", [])):
            key = obj["Key"]
            if key in self.seen:
                continue
            self.seen.add(key)
            if key.startswith(f"{self.prefix}/{self.job}/_hsx/"):
                continue  # the job bundle, written by the producer (tests/test_bundle.py checks it)
            if not self.pattern.fullmatch(key):
                self.problems.append(f"unexpected key {key!r} appeared")
                continue
            data = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            try:
                check_sample_file(data, key[len(self.prefix) + 1 :], job=self.job, rows=self.rows)
            except Exception as exc:  # noqa: BLE001 - reported by the test thread
                self.problems.append(
                    f"{key} ({len(data)} bytes, listed {obj['Size']}) seen incomplete or wrong: "
                    f"{type(exc).__name__}: {str(exc)[:300]}"
                )

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self._poll()
                self.listings += 1
            except Exception as exc:  # noqa: BLE001
                self.problems.append(f"watcher failed: {type(exc).__name__}: {exc}")
                return
            self.stopping.wait(self.period)

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=30)
        assert not self.is_alive(), "bucket watcher did not stop"
        self._poll()  # one last look, after everything settled


def wait_for_exit(proc, timeout: float, *others) -> int:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            pytest.fail(f"consumer #1 did not crash within {timeout:.0f} s\n{logs_of(proc, *others)}")
        time.sleep(0.1)
    return proc.returncode


def wait_settled(hsx, job: str, env: dict, spool, procs, timeout: float = 30.0) -> dict:
    """After `done`: the redelivered batch is acked, no file event is queued, the spool is empty.

    `done` only says every sample is in the destination; the crashed batch's redelivery can still
    be running (it rewrites files the uploader then deletes), so wait for the queues to drain."""
    deadline = time.monotonic() + timeout
    while True:
        view = status(hsx, job, env)
        if (
            view["batches_queued"] == 0
            and view["files_waiting_upload"] == 0
            and view["batch_redeliveries"] >= 1
            and not spool_files(spool)
        ):
            return view
        if time.monotonic() > deadline:
            pytest.fail(
                f"queues did not drain within {timeout:.0f} s after done: {view}, spool {spool_files(spool)[:5]}\n"
                f"{logs_of(*procs)}"
            )
        time.sleep(0.5)


def test_consumer_sigkill_before_ack_loses_and_duplicates_nothing(
    tmp_path, hsx, hsx_service, tiny_model, job_name, s3_env, caplog
):
    caplog.set_level("WARNING", logger="werkzeug")  # moto logs every request the watcher makes
    bucket, env = s3_env
    model = tiny_model("qwen3")
    job = job_name
    rows = write_dataset(tmp_path / "data.jsonl", COUNT, min_len=6, max_len=60, seed=11)
    spool = tmp_path / "spool"
    marker = tmp_path / "crashed.marker"
    crash_env = {**env, "HSX_TEST_CRASH_BEFORE_ACK": str(marker)}
    produce(
        hsx,
        job=job,
        model=model,
        dataset=tmp_path / "data.jsonl",
        dest=f"s3://{bucket}/prefix",
        token_budget=128,
        max_seq_len=64,
        env=env,
    )
    planned = status(hsx, job, env)
    assert planned["batches_total"] >= 4, planned

    watcher = BucketWatcher(bucket, "prefix", job, rows)
    watcher.start()
    consume_args = ("consume", "--job", job, "--device", "cpu", "--spool", str(spool), "--ack-wait", ACK_WAIT)
    first = hsx_service(*consume_args, env=crash_env, name="consume-crashing")
    rc = wait_for_exit(first, 60)
    assert rc == -9, f"consumer #1 exited {rc}, not by SIGKILL\n{logs_of(first)}"
    assert marker.exists(), f"consumer #1 died without the crash marker\n{logs_of(first)}"
    crashed = status(hsx, job, env)
    # It wrote and announced its batch (files are in the spool, events queued) but never acked it.
    assert crashed["samples_written"] >= 1 and crashed["batches_queued"] == crashed["batches_total"], crashed
    assert crashed["files_waiting_upload"] == crashed["samples_written"] == len(spool_files(spool)), crashed

    second = hsx_service(*consume_args, env=crash_env, name="consume")
    uploader = hsx_service("upload", "--job", job, "--spool", str(spool), env=env, name="upload")
    monitor = start_monitor(hsx_service, job, env)
    try:
        wait_until_done(monitor, [second, uploader])
        view = wait_settled(hsx, job, env, spool, [monitor, second, uploader])
    finally:
        watcher.stop()

    assert not watcher.problems, "\n".join(watcher.problems)
    assert watcher.listings >= 5, f"bucket watched only {watcher.listings} times"
    objects = read_s3_objects(bucket, "prefix")
    assert set(watcher.seen) == {f"prefix/{k}" for k in objects}, "the watcher saw keys that are gone now"
    outputs = check_outputs(objects, job=job, rows=rows)
    check_final_status(view, total=COUNT)
    assert view["batch_redeliveries"] >= 1, view
    assert not spool_files(spool), spool_files(spool)
    assert second.poll() is None and uploader.poll() is None, logs_of(second, uploader)

    reference = Reference(model)
    for index, tensors in sorted(outputs.items()):
        reference.check(tensors["hidden_states"], rows[index]["input_ids"], what=f"sample {index}")
