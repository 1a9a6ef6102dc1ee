"""Out of memory on a batch (injected on CPU by the test-only switch HSX_TEST_OOM_ABOVE_TOKENS):
the batch is split in halves and retried in-process, so there is no redelivery storm, and every
sample's states are still exactly right."""

from pathlib import Path

import pytest
from test_e2e_s3 import (
    Reference,
    check_final_status,
    check_outputs,
    produce,
    read_dir_objects,
    start_monitor,
    status,
    wait_until_done,
    write_dataset,
)


@pytest.mark.faults
def test_an_oom_batch_is_split_and_nothing_is_redelivered(hsx, hsx_service, tiny_model, job_name, tmp_path):
    rows = write_dataset(tmp_path / "data.jsonl", 16, min_len=10, max_len=60, seed=11)
    out = tmp_path / "out"
    produce(
        hsx,
        job=job_name,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=512,
        max_seq_len=64,
        env=None,
    )
    spool = str(tmp_path / "spool")
    consumer = hsx_service(
        "consume",
        "--job",
        job_name,
        "--device",
        "cpu",
        "--spool",
        spool,
        env={"HSX_TEST_OOM_ABOVE_TOKENS": "100"},
        name="consumer",
    )
    uploader = hsx_service("upload", "--job", job_name, "--spool", spool, name="uploader")
    wait_until_done(start_monitor(hsx_service, job_name, None), [consumer, uploader])

    log = Path(consumer.log_path).read_text()
    assert log.count('"batch_split_on_oom"') >= 2, log[-3000:]
    assert '"batch_failed"' not in log
    objects = check_outputs(read_dir_objects(out), job=job_name, rows=rows)
    reference = Reference(tiny_model("qwen3"))
    for index, tensors in objects.items():
        reference.check(tensors["hidden_states"], rows[index]["input_ids"], what=f"sample {index}")
    view = status(hsx, job_name, None)
    check_final_status(view, total=16)
    assert view["batch_redeliveries"] == 0
