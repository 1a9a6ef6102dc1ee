"""Hostile file-ready events and file permissions.

An event cannot make an uploader read outside its spool (`..` paths, absolute paths: the uploader
derives the path from the sample and never reads the event's; a symlink planted where the file
would lie) nor write outside the job's prefix (a forged key): each such event is refused
(dead-lettered, or removed when its sample is not the plan's), and nothing outside is read or
written. Spool files are 0600 in 0700
directories. The S3 secret key appears in nothing a run prints or writes."""

import asyncio
import json
import os
import stat
import time
from pathlib import Path

import nats
from test_e2e_s3 import (
    check_final_status,
    check_outputs,
    job_plan,
    produce,
    read_s3_objects,
    start_monitor,
    status,
    wait_until_done,
    write_dataset,
)

from hsx.storage.spool import spool_file
from hsx.wire import schemas, topology


async def _publish_events(url: str, job: str, node: str, events: list[schemas.FileReady]) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    for event in events:
        await js.publish(topology.file_subject(job, node), schemas.encode(event))
    await nc.drain()


def _event(job: str, index: int, spool_path: str, key: str | None = None) -> schemas.FileReady:
    return schemas.FileReady(
        job=job,
        node="testnode",
        batch_id="forged",
        sample_index=index,
        num_tokens=3,
        spool_path=spool_path,
        key=key or f"{job}/00000/{index}.safetensors",
        size=5,
        digest="0" * 64,
    )


def test_hostile_events_are_refused_and_nothing_outside_is_touched(
    hsx, hsx_service, nats_server, tiny_model, job_name, tmp_path
):
    """Events for samples outside the plan are removed unhandled (`file_event_outside_plan`, not
    dead-lettered: they are none of the job's work). Events for the plan's own samples that point
    out of the spool (a link planted where the file would lie) or out of the job's prefix (a
    forged key) are dead-lettered naming why; the samples themselves are then extracted and
    uploaded as usual, and nothing outside is read or written."""
    write_dataset(tmp_path / "d.jsonl", 2, min_len=4, max_len=8, seed=1)
    out = tmp_path / "out"
    produce(
        hsx,
        job=job_name,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "d.jsonl",
        dest=str(out),
        token_budget=64,
        max_seq_len=16,
        env=None,
    )
    spool = tmp_path / "spool"
    secret = tmp_path / "outside" / "secret.safetensors"
    secret.parent.mkdir()
    secret.write_bytes(b"do not read")
    # A link planted where sample 0's file would lie (the uploader derives that path itself).
    planted = spool_file(spool, job_name, job_plan(out, job_name), 0)
    planted.parent.mkdir(parents=True)
    planted.symlink_to(secret)
    forged = [
        _event(job_name, 0, "anything"),  # the derived path is a link out of the spool
        _event(job_name, 1, "1.safetensors", key="../../escaped.safetensors"),  # key escape
        _event(job_name, 901, "../outside/secret.safetensors"),  # outside the plan (and a .. path)
        _event(job_name, 902, str(secret)),  # outside the plan (and an absolute path)
    ]
    asyncio.run(_publish_events(nats_server.url, job_name, "testnode", forged))
    # The uploader alone first: the forged events are its only work.
    uploader = hsx_service("upload", "--job", job_name, "--spool", str(spool), name="uploader")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        letters = json.loads(hsx("dead", "list", "--job", job_name, "--json").stdout)
        refused = Path(uploader.log_path).read_text().count('"file_event_outside_plan"')
        if len(letters) == 2 and refused == 2:
            break
        assert uploader.poll() is None
        time.sleep(0.5)
    assert sorted(letter["samples"][0] for letter in letters) == [0, 1], letters
    assert all(letter["what"] == "file" for letter in letters)
    reasons = " ".join(letter["error"] for letter in letters)
    assert "outside the spool" in reasons and "names key" in reasons, reasons
    assert refused == 2
    assert secret.read_bytes() == b"do not read"
    planted.unlink()
    consumer = hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", str(spool), name="consumer")
    wait_until_done(start_monitor(hsx_service, job_name, None), [consumer, uploader])
    assert secret.read_bytes() == b"do not read"
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.safetensors") if p.is_file())
    assert not any("escaped" in p for p in written), written
    assert sorted(p.name for p in (out / job_name / "00000").iterdir()) == ["0.safetensors", "1.safetensors"]
    # The two letters are resolved: their samples were uploaded since.
    letters = json.loads(hsx("dead", "list", "--job", job_name, "--json").stdout)
    assert all(letter["resolved"] for letter in letters), letters


def test_spool_permissions_and_no_secret_in_anything_a_run_writes(
    hsx, hsx_service, s3_env, tiny_model, job_name, tmp_path
):
    bucket, env = s3_env
    rows = write_dataset(tmp_path / "d.jsonl", 6, min_len=4, max_len=24, seed=2)
    produce(
        hsx,
        job=job_name,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "d.jsonl",
        dest=f"s3://{bucket}/p",
        token_budget=64,
        max_seq_len=32,
        env=env,
    )
    spool = tmp_path / "spool"
    consumer = hsx_service(
        "consume", "--job", job_name, "--device", "cpu", "--spool", str(spool), env=env, name="consumer"
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(spool.rglob("*.safetensors"))) < 6:
        assert consumer.poll() is None
        time.sleep(0.2)
    files = list(spool.rglob("*.safetensors"))
    assert len(files) == 6
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for directory in [spool, *[p for p in spool.rglob("*") if p.is_dir()]]:
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory

    uploader = hsx_service("upload", "--job", job_name, "--spool", str(spool), env=env, name="uploader")
    monitor = start_monitor(hsx_service, job_name, env)
    wait_until_done(monitor, [consumer, uploader])
    check_outputs(read_s3_objects(bucket, "p"), job=job_name, rows=rows)
    view_text = hsx("status", "--job", job_name, env=env).stdout
    view = status(hsx, job_name, env)
    check_final_status(view, total=6)
    secret = env["AWS_SECRET_ACCESS_KEY"]
    everything = view_text + json.dumps(view)
    for process in (consumer, uploader, monitor):
        everything += open(process.log_path, errors="replace").read()
    assert "uploader_ready" in everything and secret not in everything
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == secret  # the services really had it
