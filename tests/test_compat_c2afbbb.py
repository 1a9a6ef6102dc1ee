"""Jobs recorded by an earlier hsx (commit c2afbbb, before the producer's one route) still match
on a rerun and resume under this one: the JetStream store of three jobs that hsx produced
(tests/data/c2afbbb/make_jobs.py says how it was made: one plan published whole, one whose
producer stopped after 3 of its 6 batches, one in rounds of 10 rows stopped after publishing 2 of
its 3 recorded rounds) is served by a nats-server of its own, the same dataset and a tiny model
named by the paths the specs record (`model`, `data.jsonl`), the destination `s3://compat/runs`.

A rerun with the same flags must find each job's own plan (its fingerprint, and so its batch ids
and its identity, `created_at`), publish only the batches not queued, and the consumers and
uploaders of this hsx must finish the jobs from the descriptors that one published.
"""

import asyncio
import json
import shutil
import tarfile
from pathlib import Path

import boto3
import nats
import pytest
from test_e2e_s3 import check_ok, start_monitor, status, wait_until_done
from test_producer_checks import log_events_of

from hsx.commands.embedded import start_nats_server
from hsx.job import JobSpec
from hsx.wire import schemas, topology

DATA = Path(__file__).parent / "data" / "c2afbbb"
FLAGS = ["--model", "model", "--dataset", "data.jsonl", "--layers", "1,3", "--token-budget", "256"]
FLAGS += ["--max-seq-len", "64", "--dest", "s3://compat/runs"]
SAMPLES = 40  # rows of data.jsonl, one sample each


@pytest.fixture
def old_jobs(tmp_path, tiny_model, s3_env, monkeypatch):
    """The recorded store served by a nats-server of its own; the working folder holds the model
    and the dataset under the names the specs record; the bucket `compat` exists, empty."""
    store = tmp_path / "nats"
    store.mkdir()
    with tarfile.open(DATA / "nats-store.tar.gz") as tar:
        tar.extractall(store, filter="data")
    work = tmp_path / "work"
    work.mkdir()
    (work / "model").symlink_to(tiny_model("qwen3"))
    shutil.copy(DATA / "data.jsonl", work / "data.jsonl")
    monkeypatch.chdir(work)
    s3 = boto3.client("s3")
    if "compat" not in [bucket["Name"] for bucket in s3.list_buckets()["Buckets"]]:
        s3.create_bucket(Bucket="compat")
    server = start_nats_server(store, log_file=tmp_path / "nats-server.log")
    yield server
    server.stop()


def _specs(url: str) -> dict[str, JobSpec]:
    async def read():
        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().key_value(topology.JOBS_BUCKET)
            return {key: schemas.job_decoder.decode((await kv.get(key)).value) for key in await kv.keys()}
        finally:
            await nc.close()

    return asyncio.run(read())


def _produce(hsx, job: str, url: str, *extra: str):
    return check_ok(hsx("produce", "--job", job, *FLAGS, *extra, nats_url=url, timeout=180), f"produce {job}")


def test_jobs_recorded_by_c2afbbb_match_on_rerun_and_resume(old_jobs, hsx, hsx_service, tmp_path):
    url = old_jobs.url
    recorded = _specs(url)
    assert {job: spec.published for job, spec in recorded.items()} == {
        "compat-done": True,
        "compat-held": False,
        "compat-rounds": False,
    }
    assert recorded["compat-rounds"].round_starts == [0, 10, 20]

    done = _produce(hsx, "compat-done", url)
    assert log_events_of(done.stderr, "job_already_published") and "nothing new to publish" in done.stdout
    held = _produce(hsx, "compat-held", url)
    rounds = _produce(hsx, "compat-rounds", url, "--round-rows", "10")
    for result in (done, held, rounds):
        assert not log_events_of(result.stderr, "job_spec_replaced"), result.stderr[-3000:]
    [published] = log_events_of(held.stderr, "job_published")
    assert (published["new"], published["already_queued_or_done"]) == (3, 3), published
    [published] = log_events_of(rounds.stderr, "job_published")
    assert published["already_queued_or_done"] == 5, published

    now = _specs(url)
    for job, before in recorded.items():
        after = now[job]
        same = (
            "plan_fingerprint",
            "created_at",
            "dest",
            "layers",
            "dtype",
            "total_samples" if before.published else "job",
        )
        assert all(getattr(after, name) == getattr(before, name) for name in same), (job, before, after)
        assert after.published and after.total_samples == SAMPLES and not after.stopped, after
    assert now["compat-rounds"].round_starts == [0, 10, 20, 30]
    assert now["compat-held"].total_batches == recorded["compat-held"].total_batches

    # This hsx's workers finish every job: the batches c2afbbb published and those published now.
    spool = tmp_path / "spool"
    env = {"HSX_NATS_URL": url}
    for job in now:
        workers = [
            hsx_service("consume", "--job", job, "--device", "cpu", "--spool", str(spool), env=env, name="consume"),
            hsx_service("upload", "--job", job, "--spool", str(spool), env=env, name="upload"),
        ]
        wait_until_done(start_monitor(hsx_service, job, env), workers)
        for worker in workers:
            worker.terminate()
            worker.wait(60)
        view = status(hsx, job, env)
        assert view["done"] and view["samples_uploaded"] == SAMPLES, json.dumps(view)
        assert view["batches_done"] == view["batches_total"] == now[job].total_batches, json.dumps(view)
