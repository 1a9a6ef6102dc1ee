"""A sample of the plan that fails on its own on every delivery (devkit/faults.py
HSX_TEST_FAIL_SAMPLE: its forward raises an IndexError, as an embedding given a token id past its
table does): after max_deliver attempts only that sample is dead-lettered, with its error; the
batch's other samples are written and uploaded; status counts it and the job is `failed` naming
the dead sample (`monitor --until-done` exits 65); `hsx dead list` shows it and `hsx dead retry`
sends back a batch of that sample alone, which fails again and comes back.

The poison sample is one the producer planned: a descriptor with samples the producer did not
record is refused, never extracted (tests/test_plan_events.py), so it cannot poison a job."""

import json
import time

from conftest import clean_environ
from test_e2e_s3 import produce, read_dir_objects, write_dataset

from devkit.faults import faults_env
from hsx.exitcodes import JOB_FAILED
from hsx.wire import topology

POISON = 3


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
    spool = str(tmp_path / "spool")
    consumer = hsx_service(
        *("consume", "--job", job_name, "--device", "cpu", "--spool", spool, "--retry-delay", "0.1"),
        env={"HSX_TEST_FAIL_SAMPLE": str(POISON)},
        name="consumer",
    )
    uploader = hsx_service("upload", "--job", job_name, "--spool", spool, name="uploader")
    monitor = hsx("monitor", "--job", job_name, "--until-done", "--interval", "0.5", timeout=120)
    # Failed: every planned sample but the poisoned one is uploaded, and that one is dead.
    assert monitor.returncode == JOB_FAILED, (monitor.stdout + monitor.stderr)[-3000:]
    [failed] = [
        record
        for line in (monitor.stdout + monitor.stderr).splitlines()
        if line.startswith("{") and (record := json.loads(line)).get("event") == "job_failed"
    ]
    assert failed["dead_samples"] == [POISON] and failed["samples_uploaded"] == 5, failed
    letters = json.loads(hsx("dead", "list", "--job", job_name, "--json").stdout)
    assert len(letters) == 1, letters
    letter = letters[0]
    assert letter["samples"] == [POISON] and letter["deliveries"] == topology.BATCH_MAX_DELIVER
    assert not letter["resolved"] and not letter["refused"], letter
    assert f"sample {POISON}" in letter["error"] and (
        "index out of range" in letter["error"] or "IndexError" in letter["error"]
    )
    names = {key.rsplit("/", 1)[-1] for key in read_dir_objects(out)}
    assert {f"{i}.safetensors" for i in range(6) if i != POISON} <= names, sorted(names)
    assert f"{POISON}.safetensors" not in names
    view = json.loads(hsx("status", "--job", job_name, "--json").stdout)
    assert view["dead_letters"] == 1 and view["dead_samples"] == [POISON]
    assert not view["done"] and view["failed"] and view["samples_uploaded"] == 5, view
    assert view["samples_outside_plan"] == 0, view

    retried = hsx("dead", "retry", "--job", job_name, "--seq", str(letter["seq"]))
    assert retried.returncode == 0, retried.stderr
    # The letter retried is gone. (Its descriptor may already be back as a new letter: five quick
    # failures take less than a loaded machine needs to start `hsx dead list`.)
    assert all(
        other["seq"] != letter["seq"] for other in json.loads(hsx("dead", "list", "--job", job_name, "--json").stdout)
    )
    # The retried descriptor holds only the poisoned sample, as its planned batch's `-poison`
    # part; the plan's own sample, so the consumer takes it: it fails again and comes back.
    for _ in range(120):
        again = json.loads(hsx("dead", "list", "--job", job_name, "--json").stdout)
        if again:
            break
        assert consumer.poll() is None and uploader.poll() is None
        time.sleep(0.5)
    assert again and again[0]["samples"] == [POISON] and again[0]["batch_id"] == f"{letter['batch_id']}-poison"
    assert "batch_refused" not in consumer.log_path.read_text()


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
