"""`hsx jobs list` and `hsx jobs delete` (commands/jobs.py): a job name can be used again.

One round trip on the session's nats-server, with the real CLI, a real consumer and uploader: the
job is listed; deleting it is refused while they are alive (and after they were SIGKILLed, until
their heartbeats go stale), done with --force; every message, durable, stored object and the
spec are gone, the destination keeps its files; the name then takes another dataset (into
another destination: the first job's folder holds its plan, tests/test_output_claim.py), and
after one more delete the first dataset again, into its folder, whose batch ids the stream still
remembers from the deleted job (duplicate window): each batch is queued once.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import nats
import nats.js.errors
import pytest
from test_chaos import sigkill, wait_for
from test_cli_errors import assert_one_line_error
from test_e2e_s3 import check_ok, write_dataset

from hsx.storage.layout import bundle_key
from hsx.wire import topology


def _produce(hsx, job: str, model: Path, dataset: Path, out: Path):
    return check_ok(
        hsx(
            "produce",
            "--job",
            job,
            "--model",
            str(model),
            "--dataset",
            str(dataset),
            "--layers",
            "1,3",
            "--dest",
            str(out),
            "--dtype",
            "float32",
            "--token-budget",
            "128",
            "--max-seq-len",
            "40",
        ),
        f"produce {dataset.name}",
    )


async def _leftovers(url: str, job: str) -> dict:
    """Everything NATS still holds of the job: messages per stream, durables, objects, the spec."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        messages = {}
        for stream, subject in topology.job_subjects(job).items():
            info = await js.stream_info(stream, subjects_filter=subject)
            messages[stream] = sum((info.state.subjects or {}).values())
        durables = []
        for stream in (topology.BATCHES_STREAM, topology.FILES_STREAM):
            durables += [info.name for info in await js.consumers_info(stream) if job in info.name]
        store = await js.object_store(topology.DATASETS_BUCKET)
        objects = []
        for name in (f"{job}.tokens.arrow", f"{job}.report.json"):
            try:
                await store.get_info(name)
                objects.append(name)
            except nats.js.errors.NotFoundError:
                pass
        try:
            spec = json.loads((await (await js.key_value(topology.JOBS_BUCKET)).get(job)).value)
        except nats.js.errors.KeyNotFoundError:
            spec = None
        return {"messages": messages, "durables": sorted(durables), "objects": objects, "spec": spec}
    finally:
        await nc.close()


def leftovers(url: str, job: str) -> dict:
    return asyncio.run(_leftovers(url, job))


def listed(hsx, job: str) -> dict | None:
    jobs = json.loads(check_ok(hsx("jobs", "list", "--json"), "jobs list").stdout)
    return next((row for row in jobs if row["job"] == job), None)


@pytest.mark.faults
def test_jobs_list_and_delete_free_the_name_for_another_dataset(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name
):
    url, job, model, out = nats_server.url, job_name, tiny_model("qwen3"), tmp_path / "out"
    first = write_dataset(tmp_path / "first.jsonl", 20, min_len=4, max_len=40, seed=11)
    other = write_dataset(tmp_path / "other.jsonl", 13, min_len=4, max_len=40, seed=12)
    _produce(hsx, job, model, tmp_path / "first.jsonl", out)
    spec = leftovers(url, job)["spec"]
    row = listed(hsx, job)
    assert row is not None and row["published"] is True and row["total_samples"] == len(first), row
    assert row["batches_queued"] == spec["total_batches"] and row["files_queued"] == 0, row
    assert row["dest"] == spec["dest"] and row["created"], row
    text = check_ok(hsx("jobs", "list"), "jobs list").stdout
    assert any(line.split()[:2] == [job, "yes"] for line in text.splitlines()), text

    # Workers at work: deleting is refused, naming them; still refused once they were SIGKILLed
    # (their last heartbeats are recent); --force deletes.
    spool = str(tmp_path / "spool")
    consumer = hsx_service("consume", "--job", job, "--device", "cpu", "--spool", spool, name="consume")
    uploader = hsx_service("upload", "--job", job, "--spool", spool, name="upload")
    wait_for(
        lambda: list(out.glob(f"{job}/*/*.safetensors")),
        timeout=90,
        what="the first upload",
        procs=[consumer, uploader],
        alive=[consumer, uploader],
    )
    refused = hsx("jobs", "delete", job)
    assert_one_line_error(refused, job, "live workers", "gpu_consumer", "uploader", "--force")
    sigkill(consumer)
    sigkill(uploader)
    assert_one_line_error(hsx("jobs", "delete", job), job, "live workers")
    assert leftovers(url, job)["spec"] == spec, "a refused delete changed the job"
    deleted = check_ok(hsx("jobs", "delete", job, "--force"), "jobs delete --force")
    assert f"files already in {spec['dest']} were not deleted" in deleted.stdout, deleted.stdout
    assert leftovers(url, job) == {
        "messages": dict.fromkeys(topology.job_subjects(job), 0),
        "durables": [],
        "objects": [],
        "spec": None,
    }
    assert listed(hsx, job) is None
    assert (out / bundle_key(job, "job.json")).exists(), "the delete touched the destination"
    assert list(out.glob(f"{job}/*/*.safetensors")), "the delete touched the destination"
    assert_one_line_error(hsx("jobs", "delete", job), job, "not found")

    # The name takes another dataset, written elsewhere: `out` holds the first plan's files.
    _produce(hsx, job, model, tmp_path / "other.jsonl", tmp_path / "out-other")
    state = leftovers(url, job)
    assert state["spec"]["total_samples"] == len(other) and state["spec"]["published"]
    assert state["messages"][topology.BATCHES_STREAM] == state["spec"]["total_batches"]

    # Deleted again (nothing alive now) and given the first dataset again: the same batch ids as
    # the first job's, which the stream's duplicate window still remembers. Each is queued once.
    check_ok(hsx("jobs", "delete", job), "jobs delete")
    again = _produce(hsx, job, model, tmp_path / "first.jsonl", out)
    state = leftovers(url, job)
    assert state["spec"]["plan_fingerprint"] == spec["plan_fingerprint"]
    assert state["messages"][topology.BATCHES_STREAM] == spec["total_batches"], again.stderr[-3000:]
    assert '"batches_republished"' in again.stderr, again.stderr[-3000:]
