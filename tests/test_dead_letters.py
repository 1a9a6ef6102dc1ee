"""A descriptor that does not decode is poison: it is dead-lettered with its error, removed from
the work queue, counted by status, and the rest of the job completes. `hsx dead` on a job that
does not exist is a one-line error, not an empty list."""

import asyncio
import json

import nats
import pytest
from test_cli_errors import assert_one_line_error

from hsx.wire import schemas, topology


def _write_dataset(path, count=6):
    rows = [{"id": f"r{i}", "input_ids": list(range(1, 5 + 3 * i))} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return count


async def _publish_poison(url: str, job: str) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.publish(
        topology.batch_subject(job), b'{"type": "batch.v1", "job": 42}', headers={"Nats-Msg-Id": f"{job}-poison"}
    )
    await nc.drain()


async def _read_dead(url: str, job: str) -> tuple[list[schemas.DeadLetter], int]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    sub = await js.subscribe(topology.dead_subject_all(job), ordered_consumer=True)
    letters = [schemas.dead_decoder.decode((await sub.next_msg(timeout=5)).data)]
    info = await js.stream_info(topology.BATCHES_STREAM, subjects_filter=topology.batch_subject(job))
    await sub.unsubscribe()
    await nc.drain()
    return letters, sum((info.state.subjects or {}).values())


@pytest.mark.faults
def test_undecodable_descriptor_is_dead_lettered_and_the_job_completes(
    hsx, hsx_service, nats_server, tiny_model, job_name, tmp_path
):
    count = _write_dataset(tmp_path / "data.jsonl")
    produced = hsx(
        "produce",
        "--job",
        job_name,
        "--model",
        str(tiny_model("qwen3")),
        "--dataset",
        str(tmp_path / "data.jsonl"),
        "--layers",
        "1",
        "--dest",
        str(tmp_path / "out"),
        "--dtype",
        "float32",
        "--token-budget",
        "64",
        "--max-seq-len",
        "32",
    )
    assert produced.returncode == 0, produced.stderr
    asyncio.run(_publish_poison(nats_server.url, job_name))
    spool = str(tmp_path / "spool")
    hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", spool, name="consumer")
    hsx_service("upload", "--job", job_name, "--spool", spool, name="uploader")
    monitor = hsx("monitor", "--job", job_name, "--until-done", "--interval", "0.5", timeout=120)
    assert monitor.returncode == 0, (monitor.stdout + monitor.stderr)[-2000:]

    status = json.loads(hsx("status", "--job", job_name, "--json").stdout)
    assert status["done"] and status["samples_uploaded"] == count
    assert status["dead_letters"] == 1
    letters, queued = asyncio.run(_read_dead(nats_server.url, job_name))
    assert queued == 0, "the poison descriptor is still in the work queue"
    assert letters[0].what == "batch" and "does not decode" in letters[0].error
    assert letters[0].original == b'{"type": "batch.v1", "job": 42}'


def test_dead_list_of_a_job_that_does_not_exist_is_a_one_line_error(hsx, job_name):
    for command in (["list"], ["list", "--json"], ["retry", "--all"]):
        result = hsx("dead", *command, "--job", job_name)
        assert_one_line_error(result, f"job {job_name} not found", "hsx jobs list")
        assert result.stdout == "", result.stdout
