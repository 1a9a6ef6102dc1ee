"""A job stored with each lossless encoding (every registered encoding whose size is a bound)
runs through the real pipeline (produce -> consume on CPU -> upload to a file:// destination),
its dry run giving an estimate measured on the job's own states, within 5% of the bytes the files
take, and a bound they keep to, and saying which is which:
`HiddenStateDataset` reads its states back decoded, in the stored dtype of the encoding it
compresses, as `JobStream` does, `hsx verify --recompute` passes within the encoding's
tolerance, and `hsx export` writes the decoded states, which speculators' `ArrowDataset` and
SpecForge's DFlash feature reader load as they load any export."""

import json
import uuid
import warnings

import msgspec
import pytest
import torch
from safetensors.torch import load_file
from test_e2e_s3 import LAYERS, produce, start_monitor, wait_until_done, write_dataset
from test_export import _specforge_batches, speculators_data
from test_jobstream import _Reading, _samples_of

from hsx.producer import estimate
from hsx.storage import encodings
from hsx.storage.encodings.base import HIDDEN
from hsx.storage.encodings.compressed import SHAPE_KEY
from hsx.storage.fsutil import human_bytes
from hsx.storage.reader import BadSampleFile, HiddenStateDataset, JobStream, load_sample
from hsx.storage.samplefile import SampleFileCorrupt

COUNT = 8


@pytest.mark.parametrize("name", [n for n, e in encodings.ENCODINGS.items() if not e.exact_size])
def test_a_lossless_job_reads_back_and_verifies(name, hsx, hsx_service, tiny_model, nats_server, tmp_path):
    encoding = encodings.by_name(name)
    job, out = f"z{uuid.uuid4().hex[:8]}", tmp_path / "out"
    write_dataset(tmp_path / "data.jsonl", COUNT, min_len=16, max_len=120, seed=3)
    args = ["--model", str(tiny_model("qwen3")), "--dataset", str(tmp_path / "data.jsonl"), "--dest", str(out)]
    args += ["--layers", ",".join(map(str, LAYERS)), "--dtype", name, "--token-budget", "1024", "--max-seq-len", "128"]
    dry = hsx("produce", "--job", job, *args, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr[-3000:]
    planned = json.loads(dry.stdout)
    assert planned["bytes_exact"] is False and planned["dtype"] == name, planned
    measured = planned["bytes_estimated_from"]
    assert measured["samples"] == COUNT and measured["device"] == "cpu", planned  # every sample: < 2,048 tokens
    assert planned["bytes"] < planned["bytes_bound"] and planned["bytes_not_estimated"] is None, planned
    planned.pop("free_space_ok")
    text = estimate.format_estimate(msgspec.convert(planned, estimate.JobEstimate), as_json=False)
    assert f"sample files: {COUNT}, about " in text and "an estimate" in text, text
    assert f"at most: {human_bytes(planned['bytes_bound'])}" in text and "(the bound" in text, text
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=1024,
        max_seq_len=128,
        env=None,
        dtype=name,
    )
    spool = tmp_path / "spool"
    workers = [
        hsx_service("consume", "--job", job, "--device", "cpu", "--spool", str(spool), name="consume"),
        hsx_service("upload", "--job", job, "--spool", str(spool), name="upload"),
    ]
    wait_until_done(start_monitor(hsx_service, job, None), workers)
    written = sum(path.stat().st_size for path in (out / job).glob("0*/*.safetensors"))
    print(f"{name}: estimate {planned['bytes']}, bound {planned['bytes_bound']}, written {written} bytes")
    assert 0 < written <= planned["bytes_bound"], (written, planned)
    assert abs(planned["bytes"] - written) <= written * 0.05, (written, planned)

    dataset = HiddenStateDataset(str(out / job), dequantize=False)
    assert len(dataset) == COUNT
    stored_dtype = encoding.inner.file_tensors(1, 1, 1)[HIDDEN][0]
    for i in range(COUNT):
        item = dataset[i]
        assert item["metadata"][encodings.ENCODING_KEY] == name
        assert str(item["hidden_states"].dtype) == f"torch.{stored_dtype}", item["hidden_states"].dtype
        assert item["hidden_states"].shape[0] == len(item["input_ids"])
        assert (encodings.SCALE_TENSOR in item) == (encodings.SCALE_TENSOR in encoding.inner.file_tensors(1, 1, 1))
    verified = hsx("verify", "--job", job, "--recompute", "2", "--seed", "1", "--json")
    assert verified.returncode == 0, verified.stderr[-3000:]
    report = json.loads(verified.stdout)
    assert report["ok"] and report["samples_ok"] == COUNT, report
    for result in report["recompute"]["results"]:
        assert result["ok"] and result["tolerance"] == {encoding.tolerance.measure: encoding.tolerance.limit}, result

    # hsx export decodes too: speculators' files hold the states in the job's compute dtype.
    exported = tmp_path / "exported"
    done = hsx("export", str(out / job), "--to", "speculators", str(exported))
    assert done.returncode == 0, done.stderr[-3000:]
    decoded = HiddenStateDataset(str(out / job))
    for i in range(COUNT):
        written = load_file(str(exported / "hidden_states" / f"hs_{i}.safetensors"))["hidden_states"]
        states = decoded[i]["hidden_states"].to(getattr(torch, encoding.compute))
        assert written.dtype == states.dtype and torch.equal(written.flatten(), states.flatten()), i

    # The trainers' own readers take the decoded export as any other: speculators' dataset...
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a token mismatch is only a warning there
        theirs = speculators_data.ArrowDataset(max_len=256, datapath=str(exported), on_missing="raise")
        items = [theirs[i] for i in range(len(theirs))]
    assert len(items) == COUNT
    for i, item in enumerate(items):
        states = decoded[i]["hidden_states"].to(getattr(torch, encoding.compute))
        assert torch.equal(item["input_ids"], decoded[i]["input_ids"].to(item["input_ids"].dtype))
        assert torch.equal(item["hidden_states"], states[:, :-1].reshape(len(item["input_ids"]), -1))
        assert torch.equal(item["verifier_last_hidden_states"], states[:, -1])
    # ... and SpecForge's DFlash feature reader, batch by batch.
    dflash = tmp_path / "dflash"
    done = hsx("export", str(out / job), "--to", "specforge-dflash", str(dflash))
    assert done.returncode == 0, done.stderr[-3000:]
    by_ids = {tuple(decoded[i]["input_ids"].tolist()): decoded[i] for i in range(COUNT)}
    batches = _specforge_batches("dflash", dflash)
    assert len(batches) == json.loads((dflash / "hsx-export.json").read_text())["samples_exported"] > 0
    for batch in batches:
        ids = tuple(batch.tensors["input_ids"][0].tolist())
        states = by_ids[ids]["hidden_states"].to(getattr(torch, encoding.compute))
        assert torch.equal(batch.tensors["hidden_states"][0], states.reshape(len(ids), -1))

    # JobStream decodes as the dataset does: its epoch of the finished job, batch by batch.
    stream = JobStream(f"file://{out}/{job}", nats=nats_server.url, name=f"r{job}", token_budget=1024)
    batches = _Reading(stream).result(timeout=60)
    assert sorted(_samples_of(batches)) == list(range(COUNT))
    for batch in batches:
        expected = torch.cat([decoded[i]["hidden_states"] for i in batch["sample_index"].tolist()])
        assert torch.equal(batch["hidden_states"], expected)

    # A file whose own metadata claims states of another size is a bad file before anything is
    # allocated from that claim: verify lists it and goes on, the dataset raises BadSampleFile.
    path = next((out / job).glob("*/3.safetensors"))
    good = path.read_bytes()
    for claim in ([2**40, 2**40, 2**40], [json.loads(_header(good)["__metadata__"][SHAPE_KEY])[0], 2, 1 << 28]):
        path.write_bytes(_with_metadata(good, {SHAPE_KEY: json.dumps(claim)}))
        verified = hsx("verify", "--job", job, "--json")
        report = json.loads(verified.stdout)
        assert verified.returncode != 0 and "Traceback" not in verified.stderr, verified.stderr[-3000:]
        assert report["samples_ok"] == COUNT - 1, report
        with pytest.raises(BadSampleFile, match="hidden_states"):
            HiddenStateDataset(str(out / job))[3]
        with pytest.raises(SampleFileCorrupt):
            load_sample(path.read_bytes())  # without the job's bundle: the file's own sizes bound it
    path.write_bytes(good)


def _header(data: bytes) -> dict:
    return json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])


def _with_metadata(data: bytes, changes: dict[str, str]) -> bytes:
    """The safetensors file `data` with these metadata entries replaced (tensor bytes unchanged)."""
    header = _header(data)
    header["__metadata__"].update(changes)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return len(encoded).to_bytes(8, "little") + encoded + data[8 + int.from_bytes(data[:8], "little") :]
