"""The producer checks everything before it writes anything, and resumes a half-published job
with exactly what is missing (producer/preflight.py, producer/resume.py).

- A descriptor too large for the server's max_payload (with room for the dead letter it may
  become) is refused before the job spec, the stored samples or any batch is written, with a
  --token-budget that fits; run again with that budget, the job is published.
- A destination that cannot be written (a missing S3 bucket, a file:// path under a regular
  file, which stops root too) is refused with one line naming it and the reason, before anything
  is published.
- A job never fully published is replaced by a re-run with other settings (its orphan batches
  dropped), unless work on the old settings exists.
- A producer stopped mid-publish, re-run after the 24 h duplicate window: only the batches
  neither queued nor finished are published, and each batch is extracted exactly once.

Real nats-server (one of its own where the test changes server or stream settings), real moto
S3, the real CLI, a tiny real model.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import msgspec
import nats
import nats.js.errors
import pytest
from test_chaos import forget_batch_ids, log_events, stop, wait_for
from test_cli_errors import assert_one_line_error
from test_e2e_s3 import (
    LAYERS,
    check_final_status,
    check_ok,
    check_outputs,
    logs_of,
    read_dir_objects,
    start_monitor,
    status,
    wait_until_done,
    write_dataset,
)

from hsx.commands.embedded import start_nats_server
from hsx.wire import headers, schemas, topology

SMALL_MAX_PAYLOAD = 64 * 1024


def _produce_args(
    job: str, model: Path, dataset: Path, dest: str, *, budget: int, max_seq_len: int, layers: str = "1,3"
) -> list[str]:
    return [
        "produce",
        "--job",
        job,
        "--model",
        str(model),
        "--dataset",
        str(dataset),
        "--layers",
        layers,
        "--dest",
        dest,
        "--dtype",
        "float32",
        "--token-budget",
        str(budget),
        "--max-seq-len",
        str(max_seq_len),
    ]


async def _read_state(url: str, job: str) -> dict:
    """The job's spec (plain JSON, or None), its queued descriptors (seq, batch id, payload) read
    by sequence without consuming them, and whether its samples are in the object store."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        try:
            spec = json.loads((await (await js.key_value(topology.JOBS_BUCKET)).get(job)).value)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError):
            spec = None
        queued, seq = [], 1
        while True:
            try:
                msg = await js.get_msg(topology.BATCHES_STREAM, seq=seq, subject=topology.batch_subject(job), next=True)
            except nats.js.errors.NotFoundError:
                break
            queued.append((msg.seq, schemas.batch_decoder.decode(msg.data).batch_id, msg.data))
            seq = msg.seq + 1
        try:
            store = await js.object_store(topology.DATASETS_BUCKET)
            await store.get_info(f"{job}.tokens.arrow")
            stored = True
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            stored = False
        return {"spec": spec, "queued": queued, "stored": stored}
    finally:
        await nc.close()


def state(url: str, job: str) -> dict:
    return asyncio.run(_read_state(url, job))


def assert_nothing_written(url: str, job: str) -> None:
    after = state(url, job)
    assert after == {"spec": None, "queued": [], "stored": False}, f"a refused run left {after}"


# ---------------------------------------------------------------- max_payload


def _descriptor(samples: int, tokens_each: int) -> schemas.BatchDescriptor:
    return schemas.BatchDescriptor(
        job="j",
        batch_id="j-0",
        padded_len=tokens_each,
        samples=[schemas.Sample(index=i, source_id=str(i), input_ids=[100] * tokens_each) for i in range(samples)],
    )


def test_a_descriptor_must_leave_room_for_its_dead_letter():
    from hsx.producer import preflight

    descriptor = _descriptor(4, 500)
    size = len(schemas.encode(descriptor))
    headroom = schemas.dead_letter_headroom(4)
    # Fits max_payload itself, but its dead letter would not: refused.
    with pytest.raises(Exception, match=r"max_payload") as refused:
        preflight.check_payloads([descriptor], max_payload=size + headroom - 1, token_budget=2000, max_seq_len=500)
    assert "dead letter" in str(refused.value) and "j-0" in str(refused.value)
    # With the headroom it fits.
    assert preflight.check_payloads([descriptor], max_payload=size + headroom, token_budget=2000, max_seq_len=500) == 1


def test_an_oversized_descriptor_is_refused_before_anything_is_written_and_the_advice_works(
    tmp_path, hsx, tiny_model, job_name
):
    server = start_nats_server(tmp_path / "nats", log_file=tmp_path / "nats.log", max_payload=SMALL_MAX_PAYLOAD)
    try:
        env = {"HSX_NATS_URL": server.url}
        write_dataset(tmp_path / "data.jsonl", 80, min_len=150, max_len=256, seed=5)
        out = tmp_path / "out"
        big = hsx(
            *_produce_args(
                job_name, tiny_model("qwen3"), tmp_path / "data.jsonl", str(out), budget=16384, max_seq_len=256
            ),
            env=env,
        )
        line = assert_one_line_error(
            big, job_name, f"max_payload {SMALL_MAX_PAYLOAD}", "nothing was published", "--token-budget"
        )
        assert_nothing_written(server.url, job_name)
        assert not out.exists(), "the refused run wrote to the destination"

        budget = int(re.search(r"--token-budget (\d+)", line).group(1))
        assert 256 <= budget < 16384, line
        again = check_ok(
            hsx(
                *_produce_args(
                    job_name, tiny_model("qwen3"), tmp_path / "data.jsonl", str(out), budget=budget, max_seq_len=256
                ),
                env=env,
            ),
            "produce with the advised budget",
        )
        after = state(server.url, job_name)
        assert after["spec"]["published"] and after["spec"]["token_budget"] == budget, after["spec"]
        assert len(after["queued"]) == after["spec"]["total_batches"] > 1, again.stderr[-2000:]
        for _, batch_id, payload in after["queued"]:
            samples = len(schemas.batch_decoder.decode(payload).samples)
            assert len(payload) + schemas.dead_letter_headroom(samples) <= SMALL_MAX_PAYLOAD, batch_id
    finally:
        server.stop()


async def _stored_object(url: str, name: str) -> tuple[bytes, int]:
    """An object of bucket hsx_datasets: its bytes and the number of chunks it was stored in."""
    nc = await nats.connect(url)
    try:
        store = await nc.jetstream().object_store(topology.DATASETS_BUCKET)
        info = await store.get_info(name)
        return (await store.get(name)).data, info.chunks
    finally:
        await nc.close()


def test_a_server_whose_max_payload_is_below_the_object_chunk_stores_the_samples(tmp_path, hsx, tiny_model, job_name):
    """nats-py cuts an object into 128 KiB messages; a server with a smaller max_payload refused
    them, and the producer died with a MaxPayloadError traceback after preflight had passed."""
    server = start_nats_server(tmp_path / "nats", log_file=tmp_path / "nats.log", max_payload=SMALL_MAX_PAYLOAD)
    try:
        env, out = {"HSX_NATS_URL": server.url}, tmp_path / "out"
        # Random token ids compress poorly: the stored samples come to well over max_payload.
        write_dataset(tmp_path / "data.jsonl", 500, min_len=150, max_len=256, seed=10)
        args = _produce_args(
            job_name, tiny_model("qwen3"), tmp_path / "data.jsonl", str(out), budget=4096, max_seq_len=256
        )
        check_ok(hsx(*args, env=env), "produce on a server with max_payload 64 KiB")
        data, chunks = asyncio.run(_stored_object(server.url, f"{job_name}.tokens.arrow"))
        assert len(data) > SMALL_MAX_PAYLOAD and chunks == -(-len(data) // SMALL_MAX_PAYLOAD), (len(data), chunks)
        # Read back in those chunks: the bundle's copy, and a re-run that plans from the stored samples.
        assert (out / job_name / "_hsx" / "tokens.arrow").read_bytes() == data
        rerun = check_ok(hsx(*args, env=env), "the re-run")
        assert log_events_of(rerun.stderr, "samples_from_store"), rerun.stderr[-3000:]
    finally:
        server.stop()


# ---------------------------------------------------------------- destination


@pytest.mark.parametrize("kind", ["s3-missing-bucket", "file-under-a-regular-file"])
def test_a_destination_that_cannot_be_written_is_refused_before_publishing(
    kind, request, tmp_path, hsx, nats_server, tiny_model, job_name
):
    write_dataset(tmp_path / "data.jsonl", 12, min_len=4, max_len=32, seed=6)
    if kind == "s3-missing-bucket":
        bucket, _ = request.getfixturevalue("s3_env")  # AWS_* for the CLI; this bucket exists, the one named does not
        dest, needles = f"s3://{bucket}-missing/hidden", (f"s3://{bucket}-missing/hidden", "NoSuchBucket")
    else:
        (tmp_path / "a-file").write_text("not a directory")
        dest = str(tmp_path / "a-file" / "out")
        needles = (dest, "Not a directory")
    result = hsx(
        *_produce_args(job_name, tiny_model("qwen3"), tmp_path / "data.jsonl", dest, budget=128, max_seq_len=32)
    )
    assert_one_line_error(result, *needles, f"{job_name}/_hsx/", "nothing was published")
    assert_nothing_written(nats_server.url, job_name)


# ---------------------------------------------------------------- unpublished jobs


async def _mark_unpublished(url: str, job: str, *, written_event: bool = False) -> None:
    """What a producer stopped mid-publish leaves: the spec without `published`."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        kv = await js.key_value(topology.JOBS_BUCKET)
        spec = schemas.job_decoder.decode((await kv.get(job)).value)
        await kv.put(job, schemas.encode(msgspec.structs.replace(spec, published=False)))
        if written_event:  # as a consumer announces a finished batch
            await js.publish(
                topology.written_subject(job, spec.plan_tag, f"{job}-x"),
                schemas.encode(
                    schemas.BatchWritten(
                        job=job,
                        batch_id=f"{job}-x",
                        consumer="c",
                        node="n",
                        sample_indices=[0],
                        tokens=1,
                        bytes=1,
                        seconds=0.1,
                    )
                ),
            )
    finally:
        await nc.close()


def test_an_unpublished_job_is_replaced_by_a_rerun_unless_work_on_it_exists(
    tmp_path, hsx, nats_server, tiny_model, job_name
):
    model, url = tiny_model("qwen3"), nats_server.url
    write_dataset(tmp_path / "data.jsonl", 30, min_len=8, max_len=40, seed=8)
    args = dict(model=model, dataset=tmp_path / "data.jsonl", dest=str(tmp_path / "out"), max_seq_len=64)
    check_ok(hsx(*_produce_args(job_name, budget=128, **args)), "first produce")
    first = state(url, job_name)
    asyncio.run(_mark_unpublished(url, job_name))

    replaced = check_ok(hsx(*_produce_args(job_name, budget=256, **args)), "re-run with another budget")
    assert '"job_spec_replaced"' in replaced.stderr, replaced.stderr[-3000:]
    after = state(url, job_name)
    assert after["spec"]["published"] and after["spec"]["token_budget"] == 256
    assert after["spec"]["plan_fingerprint"] != first["spec"]["plan_fingerprint"]
    assert after["spec"]["created_at"] > first["spec"]["created_at"]
    # The old plan's batches are gone; the new plan's are each queued once.
    ids = [batch_id for _, batch_id, _ in after["queued"]]
    assert len(ids) == len(set(ids)) == after["spec"]["total_batches"]
    assert all(after["spec"]["plan_fingerprint"][:12] in batch_id for batch_id in ids), ids[:3]

    # Once a consumer has written a batch of it, an unpublished job is no longer replaced.
    asyncio.run(_mark_unpublished(url, job_name, written_event=True))
    refused = hsx(*_produce_args(job_name, budget=512, **args))
    assert_one_line_error(refused, job_name, "1 batches written", f"hsx jobs delete {job_name}")
    assert state(url, job_name)["queued"] == after["queued"]


@pytest.mark.faults
def test_a_rerun_after_the_duplicate_window_publishes_only_what_is_neither_queued_nor_done(
    tmp_path,
    hsx,
    hsx_service,
    tiny_model,
    job_name,
):
    # A server of its own: the test deletes and declares again the HSX_BATCHES stream.
    server = start_nats_server(tmp_path / "nats", log_file=tmp_path / "nats.log")
    try:
        url, job = server.url, job_name
        env = {"HSX_NATS_URL": url}
        rows = write_dataset(tmp_path / "data.jsonl", 40, min_len=8, max_len=40, seed=9)
        out, spool = tmp_path / "out", str(tmp_path / "spool")
        args = _produce_args(
            job,
            tiny_model("qwen3"),
            tmp_path / "data.jsonl",
            str(out),
            budget=128,
            max_seq_len=64,
            layers=",".join(map(str, LAYERS)),
        )
        check_ok(hsx(*args, env=env), "produce")
        queued = state(url, job)["queued"]
        total = len(queued)
        assert total >= 9, total
        # The crash, rebuilt: of the plan's batches, 3 never reached the stream, 3 reached it and
        # are still queued, the rest were extracted before the producer is run again.
        never, still_queued = queued[:3], queued[3:6]
        asyncio.run(_delete(url, [seq for seq, _, _ in never + still_queued]))
        consumer = hsx_service("consume", "--job", job, "--device", "cpu", "--spool", spool, env=env, name="consume")
        uploader = hsx_service("upload", "--job", job, "--spool", spool, env=env, name="upload")
        wait_for(
            lambda: len(log_events(consumer, "batch_done")) == total - 6,
            timeout=90,
            what="the batches queued before the crash",
            procs=[consumer],
            alive=[consumer],
        )
        # Stopped: what reaches the queue now stays queued until the re-run is over.
        stop(consumer)
        # More than 24 h later: the stream remembers no batch id.
        forget_batch_ids(url, job)
        asyncio.run(_republish(url, job, still_queued))
        asyncio.run(_mark_unpublished(url, job))

        rerun = check_ok(hsx(*args, env=env), "the re-run")
        published = log_events_of(rerun.stderr, "job_published")
        assert published and published[0]["new"] == 3 and published[0]["already_queued_or_done"] == total - 3, (
            rerun.stderr[-3000:]
        )
        assert sorted(b for _, b, _ in state(url, job)["queued"]) == sorted(b for _, b, _ in never + still_queued)

        again = hsx_service("consume", "--job", job, "--device", "cpu", "--spool", spool, env=env, name="consume")
        wait_until_done(start_monitor(hsx_service, job, env), [again, uploader])
        extracted = [r["batch"] for worker in (consumer, again) for r in log_events(worker, "batch_done")]
        assert sorted(extracted) == sorted(b for _, b, _ in queued), (
            f"{len(extracted)} extractions of {total} batches\n{logs_of(consumer, again)}"
        )
        check_outputs(read_dir_objects(out), job=job, rows=rows)
        check_final_status(status(hsx, job, env), total=len(rows))
    finally:
        server.stop()


def log_events_of(stderr: str, name: str) -> list[dict]:
    records = []
    for line in stderr.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == name:
            records.append(record)
    return records


async def _delete(url: str, seqs: list[int]) -> None:
    nc = await nats.connect(url)
    try:
        for seq in seqs:
            await nc.jetstream().delete_msg(topology.BATCHES_STREAM, seq)
    finally:
        await nc.close()


async def _republish(url: str, job: str, batches: list[tuple[int, str, bytes]]) -> None:
    """As the crashed producer published them (same id), after the window forgot every id."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for _, batch_id, payload in batches:
            ack = await js.publish(
                topology.batch_subject(job),
                payload,
                headers=headers.message_headers(job, batch=batch_id, msg_id=batch_id),
            )
            assert not ack.duplicate
    finally:
        await nc.close()


def test_produce_ends_with_a_line_for_a_person_on_stdout(tmp_path, hsx, tiny_model, job_name):
    """Without a terminal the log is JSON on stderr; stdout holds the result in words, and the
    commands to start next (issue 38, item 5). A rerun says it published nothing new."""
    write_dataset(tmp_path / "data.jsonl", 40, min_len=16, max_len=64, seed=4)
    args = _produce_args(
        job_name, tiny_model("qwen3"), tmp_path / "data.jsonl", str(tmp_path / "out"), budget=1024, max_seq_len=64
    )
    first = check_ok(hsx(*args), "produce")
    lines = first.stdout.splitlines()
    assert re.fullmatch(
        rf"job {job_name}: \d+ batches of 40 samples \([\d,]+ tokens\) queued or done, \d+ published now; "
        r"output to file:///\S+",
        lines[0],
    ), first.stdout
    assert lines[1].startswith(f"next, one per GPU: hsx consume --job {job_name} --device cuda:0"), first.stdout
    assert len(lines) == 2 and all(line.startswith("{") for line in first.stderr.splitlines() if line), first.stderr
    again = check_ok(hsx(*args), "the rerun")
    assert "queued or done, nothing new to publish;" in again.stdout.splitlines()[0], again.stdout
