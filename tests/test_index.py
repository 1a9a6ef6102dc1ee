"""The job's index (`<job>/_hsx/index.arrow`, hsx/storage/index.py) on a real finished S3 job.

One job of COUNT samples runs through the real pipeline into a moto S3 bucket, one of its samples
stored as by an uploader killed between its verified put and its `uploaded` event (the next
uploader finds the object and reports it); the monitor writes the index when the job is done. Every S3 request the readers make is recorded with a botocore
`before-call` hook on the clients hsx opens: `HiddenStateDataset` and `hsx verify` open the job
with GETs and no ListObjects. A crash that leaves no index, or a stale one, makes them list again
(and say why); `hsx index build` (from the events) and `hsx index rebuild` (from the destination
alone) make a complete index again, equal to the monitor's, row for row.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import boto3
import pytest
from conftest import aws_bucket
from test_e2e_s3 import check_ok, logs_of, spooled, start_monitor, wait_until_done, write_dataset
from test_verify import Services, run_cli

from hsx.commands.verify import fetch_job, verify
from hsx.exitcodes import JOB_FAILED
from hsx.storage.destinations.s3 import S3Destination
from hsx.storage.index import INDEX_KEY, StoredIndex, read_index
from hsx.storage.layout import sample_key
from hsx.storage.location import Location, open_destination
from hsx.storage.reader import HiddenStateDataset
from hsx.storage.samplefile import checked_file_digest
from hsx.wire.natsconn import NatsSettings

COUNT = 6


@pytest.fixture(scope="module")
def s3_job(nats_server, s3_server, tiny_model, tmp_path_factory):
    """A finished job in s3://<bucket>/prefix, with AWS settings in this process too."""
    tmp = tmp_path_factory.mktemp("index-job")
    services = Services(nats_server.url, tmp)
    with aws_bucket(s3_server, tmp) as (env, bucket):
        job = f"i{uuid.uuid4().hex[:8]}"
        rows = write_dataset(tmp / "data.jsonl", COUNT, min_len=3, max_len=60, seed=11)
        try:
            check_ok(
                services.hsx(
                    "produce",
                    "--job",
                    job,
                    "--model",
                    str(tiny_model("qwen3")),
                    "--dataset",
                    str(tmp / "data.jsonl"),
                    "--layers",
                    "1,3",
                    "--dest",
                    f"s3://{bucket}/prefix",
                    "--token-budget",
                    "256",
                    "--max-seq-len",
                    "64",
                    env=env,
                ),
                "hsx produce",
            )
            spool = tmp / "spool"
            workers = [
                services.service(
                    "consume", "--job", job, "--device", "cpu", "--spool", str(spool), env=env, name="consume"
                )
            ]
            spooled = wait_for_spool(spool, job, workers[0])
            local = spooled[0]
            open_destination(Location.parse(f"s3://{bucket}/prefix")).put_verified(
                local, sample_key(job, 0), size=local.stat().st_size, digest=checked_file_digest(local)
            )
            workers.append(services.service("upload", "--job", job, "--spool", str(spool), env=env, name="upload"))
            wait_until_done(start_monitor(services.service, job, env), workers)
        finally:
            services.stop_all()
        yield SimpleNamespace(
            job=job,
            bucket=bucket,
            rows=rows,
            nats_url=nats_server.url,
            url=f"s3://{bucket}/prefix/{job}",
            index_key=f"prefix/{job}/{INDEX_KEY}",
        )


def wait_for_spool(spool: Path, job: str, consumer, timeout: float = 90.0) -> list[Path]:
    """Every sample's file in the spool, by sample index, once the consumer has written them all."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and consumer.poll() is None:
        paths = [spooled(spool, job, i) for i in range(COUNT)]
        if all(paths):
            return paths
        time.sleep(0.2)
    pytest.fail(f"the consumer did not write {COUNT} files to {spool} (exit {consumer.poll()})\n{logs_of(consumer)}")


@contextlib.contextmanager
def s3_requests():
    """The name of every S3 operation hsx's destinations send while the block runs."""
    calls: list[str] = []
    original = S3Destination.reconnect

    def reconnect(self) -> None:
        original(self)
        self.client.meta.events.register(
            "before-call.s3.*", lambda event_name, **_: calls.append(event_name.rsplit(".", 1)[1])
        )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(S3Destination, "reconnect", reconnect)
        yield calls


def stored_index(s3_job) -> StoredIndex:
    data = boto3.client("s3").get_object(Bucket=s3_job.bucket, Key=s3_job.index_key)["Body"].read()
    return StoredIndex.from_bytes(data)


def why_listed(s3_job) -> str:
    """The reason the readers give (log line `dataset_listing`) for listing instead of the index."""
    index, reason = read_index(open_destination(Location.parse(s3_job.url)), s3_job.job)
    assert index is None
    return reason


def rows_of(index: StoredIndex) -> list[dict]:
    return index.table.to_pylist()


def test_monitor_writes_a_complete_index_of_what_is_stored(s3_job):
    index = stored_index(s3_job)
    assert index.complete and index.source == "events" and index.total_samples == COUNT, index.summary()
    s3 = boto3.client("s3")
    for row in rows_of(index):
        head = s3.head_object(Bucket=s3_job.bucket, Key=f"prefix/{row['key']}")
        assert row["key"] == f"{s3_job.job}/00000/{row['sample_index']}.safetensors"
        assert row["size"] == head["ContentLength"] and row["digest"].hex() == head["Metadata"]["hsx-digest"], row
        assert row["tokens"] == len(s3_job.rows[row["sample_index"]]["input_ids"]), row


def test_dataset_opens_through_the_index_without_listing(s3_job):
    with s3_requests() as calls:
        dataset = HiddenStateDataset(s3_job.url)
        opened = list(calls)
        item = dataset[COUNT - 1]
    # The bundle's job spec, its tokenized samples (each file's input ids are checked against
    # them) and the index: three GETs, whatever the job's size.
    assert opened == ["GetObject", "GetObject", "GetObject"], opened
    assert not [c for c in calls if c.startswith("List")], calls
    assert dataset.sample_indices == list(range(COUNT))
    assert dataset.sample_tokens == [len(row["input_ids"]) for row in s3_job.rows]
    assert item["input_ids"].tolist() == s3_job.rows[COUNT - 1]["input_ids"]
    with s3_requests() as calls:
        lengths_only = HiddenStateDataset(s3_job.url, check_input_ids=False)
        opened = list(calls)
        assert lengths_only[COUNT - 1]["input_ids"].tolist() == s3_job.rows[COUNT - 1]["input_ids"]
    assert opened == ["GetObject", "GetObject"], opened  # no tokens file: the spec and the index


def test_verify_reads_the_index_without_listing(s3_job):
    spec, token_ids = asyncio.run(fetch_job(NatsSettings(url=s3_job.nats_url), s3_job.job))
    with s3_requests() as calls:
        report = verify(spec, token_ids, workers=2)
    assert report.ok and report.stored_from == "index" and report.samples_ok == COUNT, report
    assert not [c for c in calls if c.startswith("List")], calls
    # Control: --list lists the folder (and would name stray keys).
    with s3_requests() as calls:
        report = verify(spec, token_ids, workers=2, list_folder=True)
    assert report.ok and report.stored_from == "listing" and "ListObjectsV2" in calls, (report, calls)


def test_index_is_made_again_after_a_crash(s3_job):
    s3 = boto3.client("s3")
    written = stored_index(s3_job)
    # A crash before the index was written: readers list, and say so.
    s3.delete_object(Bucket=s3_job.bucket, Key=s3_job.index_key)
    with s3_requests() as calls:
        assert len(HiddenStateDataset(s3_job.url)) == COUNT
    assert "ListObjectsV2" in calls, calls
    assert why_listed(s3_job).startswith(f"no {INDEX_KEY}"), why_listed(s3_job)

    code, out, err = run_cli("index", "build", "--job", s3_job.job, "--nats", s3_job.nats_url, "--json")
    assert code == 0 and json.loads(out)["complete"], (out, err[-2000:])
    assert rows_of(stored_index(s3_job)) == rows_of(written)

    # A stale index (written before its last samples were stored): readers list, and say why.
    stale = StoredIndex(
        job=written.job,
        plan=written.plan,
        total_samples=COUNT,
        source="events",
        table=written.table.slice(0, COUNT - 2),
    )
    s3.put_object(Bucket=s3_job.bucket, Key=s3_job.index_key, Body=stale.to_bytes())
    with s3_requests() as calls:
        assert len(HiddenStateDataset(s3_job.url)) == COUNT
    assert "ListObjectsV2" in calls, calls
    assert why_listed(s3_job) == f"{INDEX_KEY} holds {COUNT - 2} of the job's {COUNT} samples"

    # With the job's events gone, the destination alone rebuilds it: same rows as the monitor's.
    code, out, err = run_cli("index", "rebuild", s3_job.url, "--json")
    assert code == 0 and json.loads(out)["complete"], (out, err[-2000:])
    rebuilt = stored_index(s3_job)
    assert rebuilt.source == "destination" and rows_of(rebuilt) == rows_of(written)
    with s3_requests() as calls:
        assert len(HiddenStateDataset(s3_job.url)) == COUNT
    assert calls == ["GetObject", "GetObject", "GetObject"], calls


def test_rebuild_leaves_out_a_damaged_file_and_says_the_index_is_incomplete(s3_job):
    s3 = boto3.client("s3")
    key = f"prefix/{s3_job.job}/00000/2.safetensors"
    original = s3.get_object(Bucket=s3_job.bucket, Key=key)["Body"].read()
    s3.put_object(Bucket=s3_job.bucket, Key=key, Body=b"\xff" * 16)
    try:
        code, out, err = run_cli("index", "rebuild", s3_job.url)
        assert code == JOB_FAILED and f"index of {COUNT - 1}/{COUNT} samples" in out and "INCOMPLETE" in out, (
            out,
            err[-2000:],
        )
        assert 2 not in stored_index(s3_job).sample_indices.tolist()
    finally:
        s3.put_object(Bucket=s3_job.bucket, Key=key, Body=original)
        check = run_cli("index", "rebuild", s3_job.url)
        assert check[0] == 0, check


def test_rebuild_of_a_folder_without_a_bundle_is_one_line(tmp_path):
    code, out, err = run_cli("index", "rebuild", str(tmp_path / "nojob"))
    assert code == 2 and out == "", (code, out, err)
    assert (
        err
        == f"hsx: error: {(tmp_path / 'nojob').as_uri()}: no job bundle there (_hsx/job.json); the index needs the job's spec\n"
    ), err
