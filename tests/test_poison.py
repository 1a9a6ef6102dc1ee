"""A batch that keeps failing (a token id the model cannot take, published past the producer's
checks): after max_deliver attempts only the sample that fails on its own is dead-lettered, with
its error; the batch's other samples are written; status counts it, `hsx up`-style completion
is `failed` naming the dead sample; `hsx dead list` shows it and `hsx dead retry` sends it back."""

import asyncio
import json

import nats
from conftest import clean_environ
from test_e2e_s3 import produce, read_dir_objects, write_dataset

from devkit.faults import faults_env
from hsx.wire import schemas, topology


async def _publish(url: str, descriptor: schemas.BatchDescriptor) -> None:
    nc = await nats.connect(url)
    await nc.jetstream().publish(
        topology.batch_subject(descriptor.job), schemas.encode(descriptor), headers={"Nats-Msg-Id": descriptor.batch_id}
    )
    await nc.drain()


def test_a_poison_sample_is_isolated_dead_lettered_listed_and_retried(
    hsx, hsx_service, nats_server, tiny_model, job_name, tmp_path
):
    write_dataset(tmp_path / "data.jsonl", 6, min_len=4, max_len=20, seed=3)
    out = tmp_path / "out"
    produce(
        hsx,
        job=job_name,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=128,
        max_seq_len=32,
        env=None,
    )
    # Three extra samples past the planned ones; the middle one holds a token id outside the vocabulary.
    extra = [schemas.Sample(index=6 + i, source_id=f"x{i}", input_ids=[1, 2, 3, 4 + i]) for i in range(3)]
    extra[1] = schemas.Sample(index=7, source_id="poison", input_ids=[1, 2, 10_000_000, 3])
    asyncio.run(
        _publish(
            nats_server.url,
            schemas.BatchDescriptor(job=job_name, batch_id=f"{job_name}-extra", padded_len=4, samples=extra),
        )
    )
    spool = str(tmp_path / "spool")
    consumer = hsx_service(
        "consume", "--job", job_name, "--device", "cpu", "--spool", spool, "--retry-delay", "0.1", name="consumer"
    )
    uploader = hsx_service("upload", "--job", job_name, "--spool", spool, name="uploader")
    monitor = hsx("monitor", "--job", job_name, "--until-done", "--interval", "0.5", timeout=120)
    # Done: every planned sample (0-5) is uploaded; the extra batch's good samples are written too
    # but do not count toward it (they are outside the plan); the poisoned one is dead.
    assert monitor.returncode == 0, (monitor.stdout + monitor.stderr)[-3000:]
    letters = json.loads(hsx("dead", "list", "--job", job_name, "--json").stdout)
    assert len(letters) == 1, letters
    letter = letters[0]
    assert letter["samples"] == [7] and letter["deliveries"] == topology.BATCH_MAX_DELIVER
    assert "sample 7" in letter["error"] and (
        "index out of range" in letter["error"] or "IndexError" in letter["error"]
    )
    names = {key.rsplit("/", 1)[-1] for key in read_dir_objects(out)}
    assert {f"{i}.safetensors" for i in range(6)} <= names, sorted(names)
    assert {"6.safetensors", "8.safetensors"} <= names and "7.safetensors" not in names
    view = json.loads(hsx("status", "--job", job_name, "--json").stdout)
    assert view["dead_letters"] == 1 and view["dead_samples"] == [7]
    assert view["done"] and view["samples_uploaded"] == 6 and view["samples_outside_plan"] == 2, view

    retried = hsx("dead", "retry", "--job", job_name, "--seq", str(letter["seq"]))
    assert retried.returncode == 0, retried.stderr
    # The letter retried is gone. (Its descriptor may already be back as a new letter: five quick
    # failures take less than a loaded machine needs to start `hsx dead list`.)
    assert all(
        other["seq"] != letter["seq"] for other in json.loads(hsx("dead", "list", "--job", job_name, "--json").stdout)
    )
    # The retried descriptor holds only the poisoned sample; it fails again and comes back.
    for _ in range(120):
        again = json.loads(hsx("dead", "list", "--job", job_name, "--json").stdout)
        if again:
            break
        assert consumer.poll() is None and uploader.poll() is None
        asyncio.run(asyncio.sleep(0.5))
    assert again and again[0]["samples"] == [7] and again[0]["batch_id"] == f"{job_name}-extra-poison"


def test_hsx_up_exits_non_zero_naming_the_dead_samples(tmp_path, tiny_model):
    import subprocess
    import sys

    rows = [{"input_ids": list(range(1, 6 + i))} for i in range(6)] + [{"input_ids": list(range(1, 40))}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The test-only OOM switch makes the 39-token sample fail alone on every delivery.
    env = faults_env({**clean_environ(), "HSX_RETRY_DELAY": "0.1"}, HSX_TEST_OOM_ABOVE_TOKENS="30")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hsx.cli",
            "up",
            "--workdir",
            str(tmp_path / "w"),
            "--model",
            str(tiny_model("qwen3")),
            "--dataset",
            str(tmp_path / "d.jsonl"),
            "--layers",
            "1",
            "--token-budget",
            "64",
            "--max-seq-len",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode != 0
    error = [line for line in result.stderr.splitlines() if line.startswith("hsx: error:")]
    assert len(error) == 1 and "dead samples: [6]" in error[0], result.stderr[-3000:]
    assert "uploaded 6/7" in result.stdout
