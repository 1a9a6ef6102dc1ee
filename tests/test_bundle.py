"""The job bundle (producer/bundle.py): after `hsx produce`, the destination holds under
`<job>/_hsx/` the job spec, the tokenized samples, the batch plan and the input report, and each
is checked against its source of truth: the KV entry, the object store's objects, and the batch
descriptors actually published to HSX_BATCHES. A re-run writes nothing already there and
completes a bundle that lost a file; the bundle's samples, produced again against a new NATS
server (docs/operations/resume.md, "Resume and sync"), give the same plan; `hsx verify` does not count
the bundle as stray keys.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import time
from pathlib import Path

import boto3
from test_e2e_s3 import check_ok, logs_of, start_monitor, wait_until_done, write_dataset

from hsx.commands.embedded import start_nats_server
from hsx.exitcodes import JOB_FAILED
from hsx.producer.stored import decode_rows
from hsx.wire import schemas, topology
from hsx.wire.natsconn import NatsSettings, connect

MAX_SEQ_LEN = 96
BUNDLE_FILES = {"job.json", "tokens.arrow", "plan.json", "report.json"}


def _produce(hsx, *, job: str, model: Path, dataset: Path, dest: str, env: dict | None):
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
            dest,
            "--dtype",
            "float32",
            "--token-budget",
            "384",
            "--max-seq-len",
            str(MAX_SEQ_LEN),
            "--on-long",
            "truncate",
            env=env,
        ),
        "hsx produce",
    )


def _dataset(tmp_path: Path, count: int) -> tuple[Path, list[dict]]:
    # Some rows longer than --max-seq-len, so the report lists truncations.
    rows = write_dataset(tmp_path / "data.jsonl", count, min_len=4, max_len=2 * MAX_SEQ_LEN, seed=3)
    assert any(len(r["input_ids"]) > MAX_SEQ_LEN for r in rows)
    return tmp_path / "data.jsonl", rows


async def _job_state(url: str, job: str) -> dict:
    """What NATS holds for the job: the KV entry's bytes, the stored objects, the descriptors published."""
    nc = await connect(NatsSettings(url=url), name="test-bundle")
    try:
        js = nc.jetstream()
        spec_bytes = (await (await js.key_value(topology.JOBS_BUCKET)).get(job)).value
        spec = schemas.job_decoder.decode(spec_bytes)
        store = await js.object_store(topology.DATASETS_BUCKET)
        objects = {}
        for name in (spec.tokenized_object, spec.report_object):
            buffer = io.BytesIO()
            await store.get(name, writeinto=buffer)
            objects[name] = buffer.getvalue()
        descriptors, seq = [], 1
        subject = topology.batch_subject(job)
        while len(descriptors) < spec.total_batches:  # read in place: nothing consumes them here
            msg = await js.get_msg(topology.BATCHES_STREAM, seq=seq, subject=subject, next=True)
            descriptors.append(schemas.batch_decoder.decode(msg.data))
            seq = msg.seq + 1
        return {"spec_bytes": spec_bytes, "spec": spec, "objects": objects, "descriptors": descriptors}
    finally:
        await nc.drain()


def _check_bundle(files: dict[str, bytes], state: dict, rows: list[dict]) -> None:
    spec = state["spec"]
    assert set(files) == BUNDLE_FILES, sorted(files)
    assert files["job.json"] == state["spec_bytes"]  # the KV entry, byte for byte
    assert spec.published
    assert files["tokens.arrow"] == state["objects"][spec.tokenized_object]
    assert files["report.json"] == state["objects"][spec.report_object]
    samples = decode_rows(files["tokens.arrow"], what="tokens.arrow")
    assert [s.input_ids for s in samples] == [r["input_ids"][:MAX_SEQ_LEN] for r in rows]
    report = json.loads(files["report.json"])
    assert report["samples_truncated"] == sum(len(r["input_ids"]) > MAX_SEQ_LEN for r in rows) > 0, report
    plan = json.loads(files["plan.json"])
    assert plan["format"] == "hsx.plan.v1" and plan["plan_fingerprint"] == spec.plan_fingerprint
    assert plan["total_samples"] == spec.total_samples == len(rows)
    published = [(d.batch_id, d.padded_len, [s.index for s in d.samples]) for d in state["descriptors"]]
    assert [(b["batch_id"], b["padded_len"], b["sample_indices"]) for b in plan["batches"]] == published
    assert sorted(i for b in plan["batches"] for i in b["sample_indices"]) == list(range(len(rows)))


def _bundle_written_events(stderr: str) -> list[dict]:
    return [
        e
        for e in (json.loads(line) for line in stderr.splitlines() if line.startswith("{"))
        if e.get("event") == "bundle_written"
    ]


def test_file_bundle_matches_the_job_and_reruns_are_idempotent(tmp_path, hsx, tiny_model, job_name, nats_server):
    dataset, rows = _dataset(tmp_path, 24)
    out = tmp_path / "out"
    _produce(hsx, job=job_name, model=tiny_model("qwen3"), dataset=dataset, dest=str(out), env=None)
    folder = out / job_name / "_hsx"
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    _check_bundle(files, asyncio.run(_job_state(nats_server.url, job_name)), rows)

    # A re-run rewrites nothing that is there, and puts back what is missing.
    mtimes = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    (folder / "plan.json").unlink()
    time.sleep(0.01)
    result = _produce(hsx, job=job_name, model=tiny_model("qwen3"), dataset=dataset, dest=str(out), env=None)
    events = _bundle_written_events(result.stderr)
    assert [e["written"] for e in events] == [["plan.json"]], result.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
    assert {n: t for n, t in ((p.name, p.stat().st_mtime_ns) for p in folder.iterdir()) if n != "plan.json"} == {
        n: t for n, t in mtimes.items() if n != "plan.json"
    }


def test_s3_bundle_matches_the_job_and_verify_ignores_it(
    tmp_path, hsx, hsx_service, tiny_model, job_name, nats_server, s3_env
):
    bucket, env = s3_env
    dataset, rows = _dataset(tmp_path, 12)
    spool = tmp_path / "spool"
    _produce(hsx, job=job_name, model=tiny_model("qwen3"), dataset=dataset, dest=f"s3://{bucket}/hs", env=env)
    state = asyncio.run(_job_state(nats_server.url, job_name))  # before the consumer takes the descriptors
    workers = [
        hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", str(spool), env=env, name="consume"),
        hsx_service("upload", "--job", job_name, "--spool", str(spool), env=env, name="upload"),
    ]
    wait_until_done(start_monitor(hsx_service, job_name, env), workers)

    s3 = boto3.client("s3")
    prefix = f"hs/{job_name}/_hsx/"
    listed = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    files = {key[len(prefix) :]: s3.get_object(Bucket=bucket, Key=key)["Body"].read() for key in listed}
    # Beside the bundle, the index the monitor writes when the job is done (hsx/storage/index.py).
    assert "index.arrow" in files, sorted(files)
    _check_bundle({name: data for name, data in files.items() if name != "index.arrow"}, state, rows)
    for key in listed:  # stored with its sha256, as the verified put checks it
        head = s3.head_object(Bucket=bucket, Key=key)
        assert head["Metadata"]["hsx-sha256"] == hashlib.sha256(files[key[len(prefix) :]]).hexdigest()

    result = hsx("verify", "--job", job_name, "--json", env=env)
    report = json.loads(result.stdout or "{}")
    assert result.returncode == 0 and report["ok"] and report["extra_keys"] == [], (
        f"{result.stdout}\n{result.stderr[-3000:]}\n{logs_of(*workers)}"
    )
    # Control: a stray key beside the bundle is still reported by a verify that lists.
    s3.put_object(Bucket=bucket, Key=f"hs/{job_name}/stray.bin", Body=b"x")
    result = hsx("verify", "--job", job_name, "--json", "--list", env=env)
    assert result.returncode == JOB_FAILED and json.loads(result.stdout)["extra_keys"] == [f"{job_name}/stray.bin"], (
        result.stdout
    )


def bundle_to_parquet(tokens_arrow: Path, parquet: Path) -> None:
    """The conversion docs/operations/resume.md shows: the bundle's samples as a dataset hsx produce reads."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.ipc.open_stream(tokens_arrow.read_bytes()).read_all()
    pq.write_table(
        pa.table({"id": table["source_id"], "input_ids": table["input_ids"], "loss_mask": table["loss_mask"]}), parquet
    )


def test_bundle_resumes_the_same_plan_on_a_new_nats_server(tmp_path, hsx, tiny_model, job_name, nats_server):
    dataset, _rows = _dataset(tmp_path, 16)
    out = tmp_path / "out"
    model = tiny_model("qwen3")
    _produce(hsx, job=job_name, model=model, dataset=dataset, dest=str(out), env=None)
    folder = out / job_name / "_hsx"
    plan_before = (folder / "plan.json").read_bytes()
    parquet = tmp_path / "samples.parquet"
    bundle_to_parquet(folder / "tokens.arrow", parquet)

    # Another machine: a NATS server that never saw the job, the bundle's samples as the dataset.
    fresh = start_nats_server(tmp_path / "nats2", log_file=tmp_path / "nats2.log")
    try:
        result = _produce(
            hsx, job=job_name, model=model, dataset=parquet, dest=str(out), env={"HSX_NATS_URL": fresh.url}
        )
        spec = asyncio.run(_job_state(fresh.url, job_name))["spec"]
    finally:
        fresh.stop()
    [event] = _bundle_written_events(result.stderr)
    assert "plan.json" in event["unchanged"], event  # the same batches under the same ids
    assert (folder / "plan.json").read_bytes() == plan_before
    assert json.loads(plan_before)["plan_fingerprint"] == spec.plan_fingerprint
