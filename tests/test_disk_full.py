"""The spool disk full: writes fail with ENOSPC; the consumer keeps the batch, backs off, says
so, does not crash-loop, and finishes once space is freed; at start it warns that the disk cannot
hold one batch (`spool_short_of_room`). Uses a real small tmpfs (needs root and mount; skipped
where the machine does not allow it). `batch_bytes`, the one batch it measures against, bounds
the files a full batch really makes (their sizes from the writer's own layout)."""

import subprocess
import time
import uuid
from pathlib import Path

import pytest
from test_e2e_s3 import (
    check_final_status,
    check_outputs,
    produce,
    read_dir_objects,
    start_monitor,
    status,
    wait_until_done,
    write_dataset,
)

from hsx.job import JobSpec
from hsx.storage import encodings
from hsx.storage.encodings.float8 import FLOAT8
from hsx.storage.layout import SampleFiles, sample_metadata, sample_tensor_shapes
from hsx.storage.samplefile import file_size
from hsx.storage.spool import batch_bytes


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount_point)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.faults
def test_consumer_waits_out_a_full_spool_disk_and_recovers(
    hsx, hsx_service, tiny_model, job_name, tmp_path, small_disk
):
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (480 << 10))  # leaves ~32 KiB: not enough for a batch of files
    rows = write_dataset(tmp_path / "data.jsonl", 10, min_len=20, max_len=60, seed=7)
    out = tmp_path / "out"
    produce(
        hsx,
        job=job_name,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=256,
        max_seq_len=64,
        env=None,
    )
    spool = small_disk / "spool"
    consumer = hsx_service(
        "consume",
        "--job",
        job_name,
        "--device",
        "cpu",
        "--spool",
        str(spool),
        "--spool-high-water",
        "1G",
        name="consumer",
    )
    uploader = hsx_service("upload", "--job", job_name, "--spool", str(spool), name="uploader")

    log = Path(consumer.log_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and log.read_text().count('"spool_disk_full"') < 2:
        assert consumer.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    assert log.read_text().count('"spool_disk_full"') >= 2, "the consumer never reported a full spool disk"
    assert '"spool_short_of_room"' in log.read_text(), "the consumer did not warn that one batch cannot fit"
    assert consumer.poll() is None, "the consumer exited instead of waiting for space"
    assert '"batch_failed"' not in log.read_text() and '"dead_lettered"' not in log.read_text()

    filler.unlink()
    wait_until_done(start_monitor(hsx_service, job_name, None), [consumer, uploader])
    check_outputs(read_dir_objects(out), job=job_name, rows=rows)
    view = status(hsx, job_name, None)
    check_final_status(view, total=10)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", FLOAT8])
def test_one_batch_of_spool_bytes_bounds_what_a_full_batch_writes(dtype):
    spec = JobSpec(
        job="j",
        model="m",
        model_revision="r",
        layers=[1, 3, 5, 7, 9],
        dtype=dtype,
        dest="file:///x",
        token_budget=4096,
        max_seq_len=4096,
        dataset="d",
        plan_fingerprint="f" * 64,
        total_samples=1,
        total_tokens=1,
        total_batches=1,
        created_at=0.0,
        hidden_size=640,
    )

    def files(count: int, tokens: int) -> int:
        shapes = sample_tensor_shapes(
            encoding=encodings.of_spec(dtype), num_tokens=tokens, num_layers=5, hidden_size=640, has_mask=True
        )
        metadata = sample_metadata(
            job="j",
            sample_index=123456,
            source_id="row-123456",
            model="m",
            model_revision="r",
            layers=spec.layers,
            dtype=dtype,
            num_tokens=tokens,
            plan="f" * 12,
        )
        return count * file_size(shapes, metadata)

    largest = max(files(1, 4096), files(256, 16))  # one long sample; the shortest samples, 256 files
    need = batch_bytes(SampleFiles.of(spec))
    assert largest <= need <= 1.1 * largest, (largest, need)
