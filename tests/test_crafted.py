"""Messages anyone who can publish on the job's NATS server may send (issue 35, items 6 to 9): a
crafted one never makes a worker touch a file, subject or sample outside what its own job's plan
names, never replaces a stored sample, and never fails a healthy job.

Everything is real: nats-server, the workers as processes, a tiny qwen3 model; the crafted
messages are raw JSON published with nats-py on the subjects hsx's own publishers use.
"""

import asyncio
import json
import time

import msgspec
import nats
from test_e2e_s3 import (
    check_ok,
    check_outputs,
    logs_of,
    produce,
    read_dir_objects,
    start_monitor,
    status,
    wait_until_done,
    write_dataset,
)

from hsx.exitcodes import JOB_FAILED, STOPPED
from hsx.storage.layout import SampleFiles
from hsx.wire import schemas, topology
from hsx.wire.events import HEARTBEAT_CLOCK_SKEW_S, heard_heartbeat
from hsx.wire.jobs import live_workers


def _beat(job: str, **fields) -> schemas.Heartbeat:
    return schemas.Heartbeat(job=job, service="uploader", instance="intruder", node="n", state="refused", **fields)


def test_a_heartbeat_is_believed_only_within_its_clock_skew_and_only_for_its_own_subject():
    stored = 1_000_000.0
    subject = topology.heartbeat_subject("j", "uploader", "intruder")
    future = schemas.encode(_beat("j", sent_at=stored + 1e9, detail="bucket gone"))
    assert heard_heartbeat(future, subject=subject, stored_at=stored, job="j").sent_at == stored
    near = schemas.encode(_beat("j", sent_at=stored - HEARTBEAT_CLOCK_SKEW_S + 1))
    assert (
        heard_heartbeat(near, subject=subject, stored_at=stored, job="j").sent_at == stored - HEARTBEAT_CLOCK_SKEW_S + 1
    )
    # Another job's beat, a beat on another instance's or service's subject, a payload of another
    # kind: not heard.
    assert heard_heartbeat(future, subject=subject, stored_at=stored, job="k") is None
    other = topology.heartbeat_subject("j", "uploader", "someone-else")
    assert heard_heartbeat(future, subject=other, stored_at=stored, job="j") is None
    consumers = topology.heartbeat_subject("j", topology.CONSUMER_SERVICE, "intruder")
    assert heard_heartbeat(future, subject=consumers, stored_at=stored, job="j") is None
    assert heard_heartbeat(b'{"type": "heartbeat.v1"}', subject=subject, stored_at=stored, job="j") is None
    assert heard_heartbeat(b"\xff", subject=subject, stored_at=stored, job="j") is None


def test_a_crafted_refusal_from_the_future_neither_fails_a_healthy_job_nor_keeps_it_alive(
    hsx, hsx_service, nats_server, tiny_model, job_name, tmp_path
):
    rows = write_dataset(tmp_path / "data.jsonl", 12, min_len=4, max_len=40, seed=41)
    out, spool = tmp_path / "out", str(tmp_path / "spool")
    produce(
        hsx,
        job=job_name,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=64,
        max_seq_len=64,
        env=None,
    )
    crafted = _beat(job_name, sent_at=time.time() + 1e9, detail="s3://b: NoSuchBucket on PutObject")

    async def publish() -> float:
        nc = await nats.connect(nats_server.url)
        try:
            ack = await nc.jetstream().publish(
                topology.heartbeat_subject(job_name, "uploader", "intruder"), msgspec.json.encode(crafted)
            )
            stored = await nc.jetstream().get_msg(topology.STATE_STREAM, ack.seq)
            return stored.time.timestamp()
        finally:
            await nc.drain()

    stored_at = asyncio.run(publish())
    view = status(hsx, job_name, None)
    assert not view["failed"] and view["batches_queued"] > 0, view
    monitor = start_monitor(hsx_service, job_name, None)
    workers = [
        hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", spool, name="consume"),
        hsx_service("upload", "--job", job_name, "--spool", spool, name="upload"),
    ]
    wait_until_done(monitor, workers, timeout=120)
    assert monitor.returncode == 0, logs_of(monitor)
    check_outputs(read_dir_objects(out), job=job_name, rows=rows)
    for worker in workers:
        worker.terminate()
        worker.wait(timeout=30)

    async def alive_later() -> list[str]:
        nc = await nats.connect(nats_server.url)
        try:
            return await live_workers(nc.jetstream(), job_name, now=stored_at + 31)
        finally:
            await nc.drain()

    # Its word lasts as long as a real worker's would from when the server stored it: `hsx jobs
    # delete` is not refused for good.
    assert not [worker for worker in asyncio.run(alive_later()) if "intruder" in worker]
    assert json.loads(check_ok(hsx("status", "--job", job_name, "--json"), "status").stdout)["done"]


# ---------------------------------------------------------------- shared: a job and its workers


def _spec_entry(url: str, job: str) -> tuple[dict, int]:
    async def read():
        nc = await nats.connect(url)
        try:
            entry = await (await nc.jetstream().key_value(topology.JOBS_BUCKET)).get(job)
            return json.loads(entry.value), entry.revision
        finally:
            await nc.close()

    return asyncio.run(read())


def _put_spec(url: str, job: str, spec: dict) -> None:
    async def put():
        nc = await nats.connect(url)
        try:
            await (await nc.jetstream().key_value(topology.JOBS_BUCKET)).put(job, json.dumps(spec).encode())
        finally:
            await nc.close()

    asyncio.run(put())


def _produce(hsx, tmp_path, tiny_model, job: str, count: int = 8):
    rows = write_dataset(tmp_path / "data.jsonl", count, min_len=4, max_len=30, seed=43)
    out = tmp_path / "out"
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=64,
        max_seq_len=64,
        env=None,
    )
    return rows, out


def _wait_for_line(proc, event: str, timeout: float = 60) -> dict:
    from pathlib import Path

    deadline = time.monotonic() + timeout
    while True:
        for line in Path(proc.log_path).read_text(errors="replace").splitlines():
            if f'"event": "{event}"' in line:
                return json.loads(line)
        assert time.monotonic() < deadline and proc.poll() is None, logs_of(proc)
        time.sleep(0.2)


# ---------------------------------------------------------------- item 6: dead letters


def test_dead_retry_sends_only_to_the_jobs_own_subjects_and_lists_the_rest_refused(
    hsx, nats_server, tiny_model, job_name, tmp_path
):
    _produce(hsx, tmp_path, tiny_model, job_name)
    other = f"{job_name}x"
    (tmp_path / "other").mkdir()
    _produce(hsx, tmp_path / "other", tiny_model, other)
    other_spec, other_revision = _spec_entry(nats_server.url, other)
    batch_subject = topology.batch_subject(job_name)

    async def plant() -> tuple[int, dict]:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        try:
            marker_count = (await js.stream_info(topology.EVENTS_STREAM)).state.messages
            queued = await js.get_msg(topology.BATCHES_STREAM, 1, subject=batch_subject, next=True)
            real = schemas.batch_decoder.decode(queued.data)
            letters = [
                # A letter that would overwrite another job's spec, one that would purge every
                # job's markers, one whose payload is another job's batch: all crafted.
                dict(original_subject=f"$KV.{topology.JOBS_BUCKET}.{other}", batch=real),
                dict(original_subject=f"$JS.API.STREAM.PURGE.{topology.EVENTS_STREAM}", original=b"{}"),
                dict(
                    original_subject=batch_subject,
                    batch=msgspec.structs.replace(real, job=other, batch_id=f"{other}-stray"),
                ),
                # The job's own batch on the job's own subject: sent back.
                dict(original_subject=batch_subject, batch=real),
            ]
            for n, fields in enumerate(letters):
                letter = schemas.DeadLetter(job=job_name, what="batch", error=f"crafted {n}", deliveries=5, **fields)
                await js.publish(topology.dead_subject(job_name, "batch"), schemas.encode(letter))
            return marker_count, msgspec.to_builtins(real)
        finally:
            await nc.close()

    markers_before, real = asyncio.run(plant())
    listed = json.loads(check_ok(hsx("dead", "list", "--job", job_name, "--json"), "dead list").stdout)
    assert [bool(letter["refused"]) for letter in listed] == [True, True, True, False], listed
    assert listed[0]["subject"] == f"$KV.{topology.JOBS_BUCKET}.{other}" and "names subject" in listed[0]["refused"]
    assert "does not decode as a batch" in listed[1]["refused"] and f"job {other!r}" in listed[2]["refused"]
    retried = hsx("dead", "retry", "--job", job_name, "--all")
    assert retried.returncode == JOB_FAILED and "Traceback" not in retried.stderr, retried
    assert "refused 3 letters" in retried.stdout, retried.stdout
    left = json.loads(check_ok(hsx("dead", "list", "--job", job_name, "--json"), "dead list").stdout)
    assert len(left) == 3 and all(letter["refused"] for letter in left), left
    # Nothing outside the job was touched: the other job's spec and every marker are as they were.
    assert _spec_entry(nats_server.url, other) == (other_spec, other_revision)

    async def after() -> tuple[int, int]:
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(topology.BATCHES_STREAM, subjects_filter=batch_subject)
            return (await js.stream_info(topology.EVENTS_STREAM)).state.messages, sum(
                (info.state.subjects or {}).values()
            )
        finally:
            await nc.close()

    markers_after, queued = asyncio.run(after())
    assert markers_after >= markers_before and queued >= 1 and real["job"] == job_name


# ---------------------------------------------------------------- item 7: a crafted spec


def test_a_spec_naming_a_path_outside_the_spool_is_refused_and_nothing_is_removed(
    hsx, hsx_service, nats_server, tiny_model, job_name, tmp_path
):
    """A spec whose plan tag is `../../victim` made an uploader that started on it remove
    `<spool>/<job>/../../victim`, a sibling of its spool, when the job went away. Now such a spec
    does not decode: a worker refuses to start on it in one line, one that serves the job keeps
    its own spec, and nothing outside the spool is touched."""
    _produce(hsx, tmp_path, tiny_model, job_name)
    spool = tmp_path / "work" / "spool"
    (spool / job_name).mkdir(parents=True)
    victim = tmp_path / "work" / "victim"  # <spool>/<job>/../../victim
    victim.mkdir()
    (victim / "keep.txt").write_text("not the job's")
    spec, _ = _spec_entry(nats_server.url, job_name)
    crafted = {**spec, "plan_fingerprint": "../../victim" + "0" * 52}
    _put_spec(nats_server.url, job_name, crafted)
    refused = hsx("upload", "--job", job_name, "--spool", str(spool), "--wait-for-job", "5")
    assert refused.returncode == 2 and "plan_fingerprint" in refused.stderr.strip().splitlines()[-1], refused
    _put_spec(nats_server.url, job_name, spec)
    uploader = hsx_service("upload", "--job", job_name, "--spool", str(spool), name="upload")
    _wait_for_line(uploader, "uploader_ready")
    _put_spec(nats_server.url, job_name, crafted)
    # The watch reads the spec every 5 s: refused where it is decoded, the worker keeps its own.
    warning = _wait_for_line(uploader, "job_spec_unavailable", timeout=30)
    assert "plan_fingerprint" in warning["error"], warning
    assert uploader.poll() is None and (victim / "keep.txt").read_text() == "not the job's"
    for field, value, named in (
        ("job", "other", "not its key"),
        ("dest", "../../elsewhere", "is not a destination URL"),
        ("dtype", "../int8", "`dtype`"),
        ("layers", [1, 1], "names a layer twice"),
        ("round_starts", [0, 5, 3], "round_starts"),
    ):
        _put_spec(nats_server.url, job_name, {**spec, field: value})
        shown = hsx("status", "--job", job_name)
        assert shown.returncode == 2 and named in shown.stderr, (field, shown.stderr)
    _put_spec(nats_server.url, job_name, spec)
    uploader.terminate()
    assert uploader.wait(timeout=30) == STOPPED, logs_of(uploader)
    assert (victim / "keep.txt").exists()


# ---------------------------------------------------------------- item 8: a crafted descriptor


def test_a_crafted_descriptor_never_replaces_a_stored_sample_and_a_replaced_file_is_caught(
    hsx, hsx_service, nats_server, tiny_model, job_name, tmp_path
):
    from pathlib import Path

    import pytest
    import torch

    from hsx.gpu_consumer.writer import write_sample_file
    from hsx.storage.layout import sample_key
    from hsx.storage.reader import BadSampleFile, JobStream
    from hsx.wire.jobs import decode_job_spec

    rows, out = _produce(hsx, tmp_path, tiny_model, job_name)
    spool = tmp_path / "spool"
    workers = [
        hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", str(spool), name="consume"),
        hsx_service("upload", "--job", job_name, "--spool", str(spool), name="upload"),
    ]
    wait_until_done(start_monitor(hsx_service, job_name, None), workers, timeout=120)
    key = out / sample_key(job_name, 3)
    stored = key.read_bytes()
    spec = decode_job_spec(json.dumps(_spec_entry(nats_server.url, job_name)[0]).encode(), job=job_name)
    length = len(rows[3]["input_ids"])
    forged = schemas.Sample(index=3, source_id=rows[3]["id"], input_ids=[(t + 1) % 500 for t in rows[3]["input_ids"]])

    async def publish() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            # The plan's tag, a plan batch id, sample 3 with other tokens: what anyone may publish.
            descriptor = schemas.BatchDescriptor(
                job=job_name,
                batch_id=f"{job_name}-{spec.plan_tag}-000000",
                padded_len=length,
                samples=[forged],
                plan=spec.plan_tag,
            )
            await nc.jetstream().publish(
                topology.batch_subject(job_name), schemas.encode(descriptor), headers={"Nats-Msg-Id": "forged"}
            )
        finally:
            await nc.close()

    # The job's spec rewritten first with only its sample check turned off (same plan, destination
    # and created_at): a running worker never relaxes a check because the spec says so now.
    entry, _ = _spec_entry(nats_server.url, job_name)
    _put_spec(nats_server.url, job_name, {**entry, "sample_digests": False})
    changed = _wait_for_line(workers[0], "job_spec_change_refused", timeout=60)
    assert changed["field"] == "sample_digests", changed
    asyncio.run(publish())
    refused = _wait_for_line(workers[0], "batch_refused", timeout=60)
    assert refused["samples"] == [3] and "not the plan's" in refused["reason"], refused
    view = status(hsx, job_name, None)
    assert view["done"] and view["batches_queued"] == 0 and view["dead_letters"] == 0, view
    assert key.read_bytes() == stored  # never extracted, never uploaded over the stored sample
    for worker in workers:
        worker.terminate()
        worker.wait(timeout=30)
    # A file replaced in the destination by other means (same sample index, plan and token count,
    # other tokens): a reader of the job checks it against what the sample's marker records.
    fake_spool = tmp_path / "forged"
    ready = write_sample_file(
        spool=fake_spool,
        files=SampleFiles.of(spec),
        node="n",
        batch_id="forged",
        sample=forged,
        hidden_states=torch.zeros(length, len(spec.layers), spec.hidden_size),
    )
    key.write_bytes((fake_spool / ready.spool_path).read_bytes())
    stream = JobStream(f"file://{out}/{job_name}", nats=nats_server.url, name="checker", shuffle_buffer=0)
    with pytest.raises(BadSampleFile, match="not those its uploaded marker records"):
        for _ in stream:
            pass
    assert Path(key).exists()
