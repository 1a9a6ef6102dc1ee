"""A job's folder in the destination, `<dest>/<job>`, holds one plan's files (issue 21, "nothing
stale, nothing foreign"; producer/preflight.py `check_folder`, producer/bundle.py).

- A job deleted from NATS (`hsx jobs delete`) leaves its files; producing the name again with
  another plan into the same destination is refused in one line naming the folder and the old
  plan, before anything is written. The same plan again is taken.
- The bundle's job.json claims the folder before the first descriptor is published: a producer
  that stops between publishing and its bundle leaves a folder that says whose files it holds.
- A folder with sample files but no job.json (an older hsx) is judged by one file's metadata.
- `--replace-output` lets the new job take the folder: the old bundle (its index first) is
  removed, and after a full run every sample file holds the new plan, even when the old plan's
  file for that sample had the same tensors (the uploader's "already stored" test compares
  digests, and the plan is in the header).

Real nats-server, real moto S3, the real CLI, a tiny real model, real workers.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import boto3
import msgspec
import pytest
import torch
from test_cli_errors import assert_one_line_error
from test_e2e_s3 import _metadata, check_ok, logs_of, start_monitor, wait_until_done, write_dataset
from test_producer_checks import _produce_args, assert_nothing_written, log_events_of, state

from hsx.errors import HsxError
from hsx.exitcodes import STOPPED
from hsx.job import JobSpec
from hsx.storage import samplefile
from hsx.storage.destinations.file import FileDestination
from hsx.storage.layout import bundle_key, sample_key
from hsx.storage.location import Location
from hsx.wire import schemas


def _tag(spec: dict) -> str:
    """JobSpec.plan_tag of a spec read as JSON."""
    return spec["plan_fingerprint"][:12]


def test_a_folder_of_another_plan_is_refused_and_the_same_plan_is_taken_again(
    tmp_path, hsx, nats_server, tiny_model, job_name, s3_env
):
    bucket, env = s3_env
    url, job, model, dest = nats_server.url, job_name, tiny_model("qwen3"), f"s3://{bucket}/hidden"
    first = write_dataset(tmp_path / "first.jsonl", 20, min_len=4, max_len=40, seed=21)
    write_dataset(tmp_path / "other.jsonl", 13, min_len=4, max_len=40, seed=22)
    args = dict(model=model, dest=dest, budget=128, max_seq_len=40)
    check_ok(hsx(*_produce_args(job, dataset=tmp_path / "first.jsonl", **args), env=env), "first produce")
    old = state(url, job)["spec"]
    s3 = boto3.client("s3")
    claimed = s3.get_object(Bucket=bucket, Key=f"hidden/{bundle_key(job, 'job.json')}")["Body"].read()
    check_ok(hsx("jobs", "delete", job, env=env), "jobs delete")

    refused = hsx(*_produce_args(job, dataset=tmp_path / "other.jsonl", **args), env=env)
    assert_one_line_error(
        refused,
        f"{dest}/{job} ",
        f"plan {_tag(old)}",
        f"{len(first)} samples",
        "another --job name",
        "another --dest",
        "--replace-output",
        "nothing was published",
    )
    assert_nothing_written(url, job)
    after = s3.get_object(Bucket=bucket, Key=f"hidden/{bundle_key(job, 'job.json')}")["Body"].read()
    assert after == claimed, "a refused run changed the folder's job.json"

    # The folder's own plan again (the name reused for the same job) is taken.
    check_ok(hsx(*_produce_args(job, dataset=tmp_path / "first.jsonl", **args), env=env), "the same plan again")
    assert state(url, job)["spec"]["plan_fingerprint"] == old["plan_fingerprint"]


def test_the_folder_is_claimed_before_the_first_descriptor_is_published(
    tmp_path, hsx, nats_server, tiny_model, job_name, monkeypatch
):
    from hsx.producer import bundle as producer_bundle

    async def stopped(*_args, **_kwargs):
        raise HsxError("test fault: the producer stopped before writing its bundle")

    # The producer stops after publishing and before its bundle, as a killed one would.
    monkeypatch.setattr(producer_bundle, "write_bundle", stopped)
    url, job, model, out = nats_server.url, job_name, tiny_model("qwen3"), tmp_path / "out"
    write_dataset(tmp_path / "first.jsonl", 16, min_len=4, max_len=40, seed=23)
    write_dataset(tmp_path / "other.jsonl", 11, min_len=4, max_len=40, seed=24)
    args = dict(model=model, dest=str(out), budget=128, max_seq_len=40)
    stopped_run = hsx(*_produce_args(job, dataset=tmp_path / "first.jsonl", **args))
    assert stopped_run.returncode != 0 and "test fault" in stopped_run.stderr, stopped_run.stderr[-3000:]
    spec = state(url, job)["spec"]
    assert spec is not None and spec["published"], "the producer did not get as far as publishing"
    claim = out / bundle_key(job, "job.json")
    assert claim.exists(), "batches were published while the folder held no job.json"
    assert json.loads(claim.read_bytes())["plan_fingerprint"] == spec["plan_fingerprint"]

    check_ok(hsx("jobs", "delete", job), "jobs delete")
    refused = hsx(*_produce_args(job, dataset=tmp_path / "other.jsonl", **args))
    assert_one_line_error(refused, f"{out.as_uri()}/{job} ", f"plan {_tag(spec)}", "--replace-output")
    assert_nothing_written(url, job)


def _old_sample_file(out: Path, job: str, index: int, *, plan: str) -> None:
    """A sample file as an hsx of its time wrote it: with `plan` in its metadata, or none ("")."""
    metadata = {
        "format": "pt",
        "hsx_format_version": "2",
        "job": job,
        "sample_index": str(index),
        "source_id": f"row-{index}",
        "model": "old-model",
        "model_revision": "",
        "layers": "[1, 3]",
        "layer_convention": "decoder_layer_output",
        "dtype": "float32",
        "num_tokens": "2",
        **({"plan": plan} if plan else {}),
    }
    path = out / sample_key(job, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"hidden_states": torch.zeros(2, 2, 4), "input_ids": torch.ones(2, dtype=torch.int64)}
    samplefile.write(path, tensors, metadata)


@pytest.mark.parametrize("plan", ["", "0123456789ab"], ids=["no-plan", "other-plan"])
def test_sample_files_without_a_job_json_are_judged_by_their_metadata(
    plan, tmp_path, hsx, nats_server, tiny_model, job_name
):
    """What an older hsx left (files from before plans, or a producer that died before its bundle):
    one listed file's header says whose it is."""
    url, job, model, out = nats_server.url, job_name, tiny_model("qwen3"), tmp_path / "out"
    write_dataset(tmp_path / "data.jsonl", 12, min_len=4, max_len=40, seed=25)
    _old_sample_file(out, job, 3, plan=plan)
    refused = hsx(
        *_produce_args(job, model=model, dataset=tmp_path / "data.jsonl", dest=str(out), budget=128, max_seq_len=40)
    )
    needles = [f"plan {plan}"] if plan else ["no plan", "an hsx from before plans"]
    assert_one_line_error(refused, f"{out.as_uri()}/{job} ", "old-model", *needles, "--replace-output")
    assert_nothing_written(url, job)


def _run_to_done(hsx_service, job: str, spool: Path) -> None:
    """Consume, upload and monitor until done; the workers stopped (SIGTERM) before returning."""
    workers = [
        hsx_service("consume", "--job", job, "--device", "cpu", "--spool", str(spool), name="consume"),
        hsx_service("upload", "--job", job, "--spool", str(spool), name="upload"),
    ]
    wait_until_done(start_monitor(hsx_service, job, None), workers)
    for worker in workers:
        worker.send_signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait(timeout=60) == STOPPED, logs_of(worker)


@pytest.mark.faults
def test_replace_output_takes_the_folder_and_every_sample_file_ends_with_the_new_plan(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name
):
    url, job, model, out, spool = nats_server.url, job_name, tiny_model("qwen3"), tmp_path / "out", tmp_path / "spool"
    rows = write_dataset(tmp_path / "data.jsonl", 12, min_len=4, max_len=40, seed=26)
    # The same samples under another --token-budget: another plan whose files may hold the very
    # same tensors, the case where only the plan in the header tells the files apart.
    args = dict(model=model, dataset=tmp_path / "data.jsonl", dest=str(out), max_seq_len=40)
    check_ok(hsx(*_produce_args(job, budget=96, **args)), "the first job")
    old = _tag(state(url, job)["spec"])
    _run_to_done(hsx_service, job, spool)
    index = out / bundle_key(job, "index.arrow")
    assert index.exists(), "the first job left no index"
    check_ok(hsx("jobs", "delete", job), "jobs delete")

    assert_one_line_error(hsx(*_produce_args(job, budget=128, **args)), f"plan {old}", "--replace-output")
    replaced = check_ok(hsx(*_produce_args(job, budget=128, **args), "--replace-output"), "produce --replace-output")
    new = _tag(state(url, job)["spec"])
    assert new != old
    warnings = log_events_of(replaced.stderr, "output_replaced")
    assert warnings and warnings[0]["level"] == "warning" and old in warnings[0]["replaced"], replaced.stderr[-3000:]
    assert not index.exists(), "the old plan's index is still there for a reader to take"
    assert _tag(json.loads((out / bundle_key(job, "job.json")).read_bytes())) == new

    _run_to_done(hsx_service, job, spool)
    plans = {i: _metadata((out / sample_key(job, i)).read_bytes()).get("plan") for i in range(len(rows))}
    assert set(plans.values()) == {new}, plans


def test_whose_folder_is_it(tmp_path):
    """The rules of producer/preflight.check_folder, on a file destination: a folder is taken when
    it is empty or this plan's, or holds the files of the job's spec in KV (a re-run, or an
    unpublished job replaced); another plan's only with --replace-output."""
    from hsx.producer.preflight import check_folder

    dest, job, out = Location.parse(tmp_path / "out"), "j", tmp_path / "out"
    spec = JobSpec(
        job=job,
        model="m",
        model_revision="",
        layers=[1, 3],
        dtype="float32",
        dest=str(dest),
        token_budget=128,
        max_seq_len=40,
        dataset="d",
        plan_fingerprint="a" * 64,
        total_samples=10,
        total_tokens=100,
        total_batches=2,
        created_at=0.0,
    )
    other = msgspec.structs.replace(spec, plan_fingerprint="b" * 64)
    elsewhere = msgspec.structs.replace(spec, dest=str(Location.parse(tmp_path / "elsewhere")))

    def check(plan: str, *, known=None, replace=False):
        return check_folder(dest, job, plan=plan, total_samples=10, known=known, replace=replace)

    assert check("a" * 12) is None  # nothing there
    _old_sample_file(out, job, 0, plan="")
    with pytest.raises(HsxError, match="no plan"):
        check("a" * 12)
    assert check("a" * 12, known=spec) is None  # files of an older hsx, the job in KV re-run
    assert check("b" * 12, known=spec).before_plans  # the same, replaced while unpublished
    with pytest.raises(HsxError, match="no plan"):
        check("a" * 12, known=elsewhere)  # the job in KV writes elsewhere: not its files

    FileDestination(out).put_bytes_verified(schemas.encode(spec), bundle_key(job, "job.json"))
    assert check("a" * 12) is None  # this plan's folder
    with pytest.raises(HsxError, match=f"plan {'a' * 12} \\(10 samples, model m, layers \\[1, 3\\]"):
        check("b" * 12)
    with pytest.raises(HsxError, match=f"plan {'a' * 12}"):
        check("b" * 12, known=other)  # the job in KV is another plan than the folder's
    assert check("b" * 12, known=spec).plan == "a" * 12  # the job in KV, replaced while unpublished
    assert check("b" * 12, replace=True).plan == "a" * 12
