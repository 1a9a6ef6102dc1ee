"""Spool files lost or corrupted while their file-ready events are pending: the uploader notices
(missing file / data not matching its checksum), sends those samples back for extraction, and the job still
ends with every sample in the destination exactly once and correct. The events name their samples
(no tokens): the uploader takes the lost samples' tokens from the job's stored samples."""

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
    wait_until_spooled,
    write_dataset,
)
from test_headers import stored

from hsx.wire import schemas, topology


@pytest.mark.faults
def test_lost_and_corrupted_spool_files_are_extracted_again(
    hsx, hsx_service, nats_server, tiny_model, job_name, tmp_path
):
    rows = write_dataset(tmp_path / "data.jsonl", 12, min_len=8, max_len=48, seed=21)
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
    spool = tmp_path / "spool"
    consumer = hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", str(spool), name="consumer")
    wait_until_spooled(hsx, consumer, job_name, 12)
    files = sorted((spool / job_name).rglob("*.safetensors"), key=lambda p: int(p.stem))
    assert len(files) == 12, "every sample should be waiting in the spool (no uploader yet)"
    # The consumer's file events, unconsumed: each names its sample, none carries its tokens again.
    announced = [m.data for m in stored(nats_server.url, topology.FILES_STREAM, f"hsx.files.{job_name}.>")]
    events = [schemas.file_decoder.decode(data) for data in announced]
    assert {e.sample_index for e in events} == set(range(12))
    assert all(e.sample is None and e.plan for e in events)
    assert not [data for data in announced if b"input_ids" in data or b'"sample":' in data]
    lost, corrupted = files[:2], files[5:7]
    for path in lost:
        path.unlink()
    for path in corrupted:
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))

    uploader = hsx_service("upload", "--job", job_name, "--spool", str(spool), name="uploader")
    wait_until_done(start_monitor(hsx_service, job_name, None), [consumer, uploader])
    objects = check_outputs(read_dir_objects(out), job=job_name, rows=rows)
    reference = Reference(tiny_model("qwen3"))
    for path in lost + corrupted:
        index = int(path.stem)
        # Its tokens came from the job's stored samples: exactly the planned ones (no truncation here).
        assert objects[index]["input_ids"].tolist() == rows[index]["input_ids"], f"re-extracted sample {index}"
        assert objects[index]["loss_mask"].tolist() == rows[index]["loss_mask"], f"re-extracted sample {index}"
        reference.check(objects[index]["hidden_states"], rows[index]["input_ids"], what=f"re-extracted sample {index}")
    view = status(hsx, job_name, None)
    check_final_status(view, total=12)
    assert view["samples_requeued"] == 4
    assert view["batches_done"] == view["batches_total"]
