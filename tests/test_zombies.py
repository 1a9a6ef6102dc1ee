"""A worker serves one job spec for its whole life, and nothing in an event names a file (issue 21,
items 5-7).

- A deleted job's consumer, uploader and monitor stop within 30 s with one line, and never serve
  the next job of that name (which carries another plan): its output holds only its own layers,
  and it finishes although the first job's workers shared its node.
- `hsx jobs delete` refuses while files wait for upload in a spool; forced, it says on which nodes
  they wait. Leftovers of a deleted plan never gate the next job of that name at the spool's
  high-water mark; its workers remove them.
- Crafted events: a file-ready event whose `spool_path` names another job's spooled sample, or an
  unrelated file, deletes nothing (the uploader derives the path from the sample, as the
  destination key is derived); an event for a finished sample re-queues nothing; a batch or a
  file event of another plan under the job's name is not handled.

Everything real: nats-server, a tiny qwen3 on the CPU, every service a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import msgspec
import nats
from safetensors import safe_open
from test_chaos import log_events, wait_for
from test_cli_errors import assert_one_line_error
from test_e2e_s3 import check_ok, logs_of, produce, read_dir_objects, spool_files, status, write_dataset

from hsx.exitcodes import JOB_FAILED, STOPPED
from hsx.wire import schemas, topology

ZOMBIE_STOP_S = 30.0


def _produce(hsx, job: str, model: Path, dataset: Path, out: Path, *, layers: str, budget: int = 64) -> None:
    produce(
        hsx,
        job=job,
        model=model,
        dataset=dataset,
        dest=str(out),
        token_budget=budget,
        max_seq_len=40,
        env=None,
        layers=layers,
    )


def _consume(hsx_service, job: str, spool: Path, *extra: str, name: str = "consume"):
    return hsx_service("consume", "--job", job, "--device", "cpu", "--spool", str(spool), *extra, name=name)


def _upload(hsx_service, job: str, spool: Path, *extra: str, name: str = "upload"):
    return hsx_service("upload", "--job", job, "--spool", str(spool), *extra, name=name)


def _wait_done(hsx, job: str, procs, *, timeout: float = 90) -> dict:
    wait_for(lambda: status(hsx, job, None)["done"], timeout=timeout, what=f"job {job} done", procs=procs, period=0.5)
    return status(hsx, job, None)


def _metadata(data: bytes) -> dict[str, str]:
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    return header["__metadata__"]


def _error_line(proc) -> str:
    lines = [line for line in Path(proc.log_path).read_text().splitlines() if line.startswith("hsx: error: ")]
    assert len(lines) == 1, f"expected one 'hsx: error:' line\n{logs_of(proc)}"
    return lines[0]


def _publish(url: str, subject: str, payload: bytes, msg_id: str) -> None:
    async def send() -> None:
        nc = await nats.connect(url)
        try:
            await nc.jetstream().publish(subject, payload, headers={"Nats-Msg-Id": msg_id})
        finally:
            await nc.drain()

    asyncio.run(send())


def test_a_deleted_jobs_workers_stop_and_never_serve_the_next_job_of_its_name(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name
):
    job, model = job_name, tiny_model("qwen3")
    write_dataset(tmp_path / "first.jsonl", 12, min_len=4, max_len=40, seed=31)
    second_rows = write_dataset(tmp_path / "second.jsonl", 10, min_len=4, max_len=40, seed=32)
    first_out, second_out = tmp_path / "out1", tmp_path / "out2"
    _produce(hsx, job, model, tmp_path / "first.jsonl", first_out, layers="1,3")
    old_spool = tmp_path / "spool-old"
    zombies = [
        _consume(hsx_service, job, old_spool, name="consume-old"),
        _upload(hsx_service, job, old_spool),
        hsx_service("monitor", "--job", job, "--interval", "0.5", name="monitor-old"),
    ]
    _wait_done(hsx, job, zombies)

    check_ok(hsx("jobs", "delete", job, "--force"), "jobs delete --force")
    deleted_at = time.monotonic()
    # The name at once takes another plan (other data, other layers), with workers of its own on
    # the same node, another spool.
    _produce(hsx, job, model, tmp_path / "second.jsonl", second_out, layers="2")
    new_spool = tmp_path / "spool-new"
    workers = [_consume(hsx_service, job, new_spool, name="consume-new"), _upload(hsx_service, job, new_spool)]

    # The old workers (and the old monitor) stop by themselves, each with one line naming the job.
    wait_for(
        lambda: all(z.poll() is not None for z in zombies),
        timeout=ZOMBIE_STOP_S - (time.monotonic() - deleted_at),
        what="the deleted job's workers stopping",
        procs=zombies + workers,
    )
    print(f"\nZOMBIES stopped {time.monotonic() - deleted_at:.1f} s after the delete")
    for zombie in zombies:
        assert zombie.returncode == JOB_FAILED, (
            f"a worker whose job was deleted exited {zombie.returncode}\n{logs_of(zombie)}"
        )
        line = _error_line(zombie)
        assert job in line and ("deleted" in line or "replaced" in line), line
    view = _wait_done(hsx, job, workers + zombies)
    assert view["total_samples"] == len(second_rows) and view["dead_letters"] == 0, view

    # The new job's output is its own: every file of the new plan, with its one layer.
    objects = {key: data for key, data in read_dir_objects(second_out).items() if key.endswith(".safetensors")}
    assert len(objects) == len(second_rows), sorted(objects)
    for key, data in objects.items():
        metadata = _metadata(data)
        assert metadata["layers"] == "[2]", f"{key} holds layers {metadata['layers']} (the deleted job's)"
        with safe_open(str(second_out / key), "pt") as f:
            assert f.get_slice("hidden_states").get_shape()[1:] == [1, 64], key
    # Nothing of the old plan was left in the old spool for anyone to trip over.
    assert not [p for p in spool_files(old_spool) if p.suffix == ".safetensors"], spool_files(old_spool)


def test_delete_refuses_while_files_wait_and_their_leftovers_never_gate_the_next_job_of_the_name(
    tmp_path, hsx, hsx_service, tiny_model, job_name
):
    job, model = job_name, tiny_model("qwen3")
    write_dataset(tmp_path / "first.jsonl", 8, min_len=20, max_len=40, seed=34)
    rows = write_dataset(tmp_path / "second.jsonl", 6, min_len=4, max_len=30, seed=35)
    _produce(hsx, job, model, tmp_path / "first.jsonl", tmp_path / "out1", layers="1,3")
    spool = tmp_path / "spool"
    first = _consume(hsx_service, job, spool, name="consume-first")
    wait_for(
        lambda: status(hsx, job, None)["files_waiting_upload"] == 8,
        timeout=60,
        what="every file of the first plan spooled",
        procs=[first],
        alive=[first],
        period=0.3,
    )
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == STOPPED, logs_of(first)

    # No worker is alive, but files wait for upload: refused; forced, the delete says where they lie.
    refused = hsx("jobs", "delete", job)
    assert_one_line_error(refused, job, "8 files", "waiting for upload", "testnode", "--force")
    forced = check_ok(hsx("jobs", "delete", job, "--force"), "jobs delete --force")
    assert "8 files" in forced.stdout and "testnode" in forced.stdout and str(spool) in forced.stdout, forced.stdout
    leftovers = [p for p in spool_files(spool) if p.suffix == ".safetensors"]
    assert len(leftovers) == 8, leftovers
    leftover_bytes = sum(p.stat().st_size for p in leftovers)

    # The same name, another plan, the same spool, a high-water mark the leftovers alone reach.
    _produce(hsx, job, model, tmp_path / "second.jsonl", tmp_path / "out2", layers="2")
    workers = [
        _consume(hsx_service, job, spool, "--spool-high-water", str(leftover_bytes), name="consume-second"),
        _upload(hsx_service, job, spool),
    ]
    view = _wait_done(hsx, job, workers, timeout=60)
    assert view["total_samples"] == len(rows), view
    assert not any(log_events(workers[0], "spool_high_water_paused")), logs_of(workers[0])
    assert not [p for p in leftovers if p.exists()], "the deleted plan's files are still in the spool"


def test_crafted_events_delete_nothing_requeue_nothing_and_another_plans_work_is_not_handled(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name
):
    job, url = job_name, nats_server.url
    rows = write_dataset(tmp_path / "data.jsonl", 6, min_len=4, max_len=30, seed=36)
    out = tmp_path / "out"
    _produce(hsx, job, tiny_model("qwen3"), tmp_path / "data.jsonl", out, layers="1,3", budget=256)
    files = topology.file_subject(job, "testnode")

    def crafted(sample: int, spool_path: str, seq: int) -> None:
        event = schemas.FileReady(
            job=job,
            node="testnode",
            batch_id=f"{job}-crafted",
            sample_index=sample,
            num_tokens=3,
            spool_path=spool_path,
            key=f"{job}/00000/{sample}.safetensors",
            size=1234,
            digest="ab" * 32,
        )
        _publish(url, files, schemas.encode(event), f"crafted-{seq}")

    # Another job's spooled sample and an unrelated file, in the same spool.
    spool = tmp_path / "spool"
    other_job = spool / "otherjob" / "00000" / "0.safetensors"
    other_job.parent.mkdir(parents=True)
    other_job.write_bytes(b"another job's sample" * 50)
    unrelated = spool / "unrelated.bin"
    unrelated.write_bytes(b"x" * 4000)
    # Queued ahead of the job's own events: the spool files they aim at exist when they are handled.
    crafted(0, "otherjob/00000/0.safetensors", 1)
    crafted(1, "unrelated.bin", 2)
    # A batch of another plan under the job's name (a deleted job's stray descriptor).
    stray = schemas.BatchDescriptor(
        job=job,
        batch_id=f"{job}-stray",
        padded_len=3,
        samples=[schemas.Sample(index=2, source_id="stray", input_ids=[5, 6, 7])],
    )
    stray_payload = {**msgspec.to_builtins(stray), "plan": "ffffffffffff"}
    _publish(url, topology.batch_subject(job), msgspec.json.encode(stray_payload), "stray-batch")

    consumer = _consume(hsx_service, job, spool)
    wait_for(
        lambda: status(hsx, job, None)["samples_written"] >= len(rows),
        timeout=60,
        what="every sample written",
        procs=[consumer],
        alive=[consumer],
        period=0.3,
    )
    uploader = _upload(hsx_service, job, spool, "--max-inflight", "1")
    procs = [consumer, uploader]
    view = _wait_done(hsx, job, procs)
    assert other_job.exists(), f"a crafted event deleted another job's spooled sample\n{logs_of(uploader)}"
    assert unrelated.exists(), f"a crafted event deleted an unrelated file\n{logs_of(uploader)}"
    assert view["samples_requeued"] == 0 and view["dead_letters"] == 0, view
    # The stray batch of another plan was not extracted: sample 2's file holds the plan's tokens.
    assert not [r for r in log_events(consumer, "batch_done") if r["batch"] == stray.batch_id], logs_of(consumer)
    data = (out / f"{job}/00000/2.safetensors").read_bytes()
    assert _metadata(data)["source_id"] != "stray", "a batch of another plan was handled"

    # An event for a sample that is finished (its spool file long gone, uploaded) re-queues nothing.
    crafted(3, "00000/3.safetensors", 3)
    # A file event of another plan is not handled either.
    _publish(
        url,
        files,
        schemas.encode(
            schemas.FileReady(
                job=job,
                node="testnode",
                batch_id=f"{job}-stray",
                sample_index=4,
                num_tokens=3,
                spool_path="00000/4.safetensors",
                key=f"{job}/00000/4.safetensors",
                size=1234,
                digest="cd" * 32,
                plan="ffffffffffff",
            )
        ),
        "stray-file",
    )
    wait_for(
        lambda: status(hsx, job, None)["files_waiting_upload"] == 0,
        timeout=30,
        what="the crafted events handled",
        procs=procs,
        alive=procs,
        period=0.3,
    )
    time.sleep(1.0)
    after = status(hsx, job, None)
    assert after["samples_requeued"] == 0 and after["batches_queued"] == 0 and after["done"], after
    assert after["dead_letters"] == 0, after
