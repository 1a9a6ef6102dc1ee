"""`hsx produce --dry-run` and the destination's free space (producer/estimate.py).

- Each sample file's size as estimated equals the file the consumer's writer makes, byte for
  byte, at every dtype (float8's scales, a sample without a mask, non-ASCII and escaped source ids,
  indices of one and two digits).
- A float8 dry run's `bytes` matches the files a real run (`hsx up`, file destination) then
  writes, and its bundle estimate the bundle; the dry run needs no NATS server.
- A dry run publishes, stores and writes nothing, and prints the hours at --rate on --gpus.
- A compressed job's estimate, measured on a sample of its tokens (producer/measure.py draws it,
  hsx/commands/measure.py runs it), is within 5% of the files the consumer's code writes for all
  of them; the measured samples are spread over the lengths, at most SAMPLE_TOKENS, the same
  every time. Where it cannot measure (no torch, a device torch cannot use, a trunk over the
  memory limit) or is told not to (--estimate-device none) the dry run gives the bound and says
  why in one line.
- A real run whose local destination lacks room is refused in one line before anything is
  published; --ignore-free-space runs it anyway. The small disk is a real 256 KiB tmpfs where this
  process may mount one, else the free-space probe reports 256 KiB (the producer runs in this
  process).
"""

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from conftest import clean_environ
from test_cli_errors import _state, assert_one_line_error
from test_e2e_s3 import check_ok, write_dataset

from hsx.commands import measure as measuring
from hsx.gpu_consumer.extract import extract_samples
from hsx.gpu_consumer.model import load_model
from hsx.gpu_consumer.writer import write_sample_file
from hsx.job import JobSpec
from hsx.producer import estimate, measure
from hsx.storage import encodings
from hsx.storage.layout import BUNDLE_DIR, SampleFiles
from hsx.storage.location import Location
from hsx.storage.tokens import SampleTableBuilder, TokenRow

HIDDEN = 64  # tests/conftest.py TINY


def _dead_nats() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"nats://127.0.0.1:{sock.getsockname()[1]}"


def _table(count: int):
    builder = SampleTableBuilder()
    for i in range(count):
        length = 1 + (i * 37) % 200
        source = ["row-7", 'quote "é" \\ tab\t', "émoji 🙂", ""][i % 4] + str(i)
        mask = None if i % 3 == 0 else [(i + t) % 2 for t in range(length)]
        builder.add_row(
            TokenRow(where=f"d:{i}", source_id=source, input_ids=[t % 500 for t in range(length)], loss_mask=mask)
        )
    return builder.finish()


def _spec(dtype: str, rows) -> JobSpec:
    return JobSpec(
        job="sizes",
        model="/models/tiny",
        model_revision="0123abcd",
        layers=[1, 3, "final"],
        layer_preset="",
        dtype=dtype,
        dest="file:///out",
        token_budget=4096,
        max_seq_len=256,
        dataset="d.jsonl",
        plan_fingerprint="ab" * 32,
        total_samples=len(rows),
        total_tokens=rows.total_tokens,
        total_batches=1,
        created_at=0.0,
        hidden_size=HIDDEN,
    )


@pytest.mark.parametrize("dtype", [encoding.stored for encoding in encodings.ENCODINGS.values()])
def test_each_estimated_file_size_is_the_written_size(dtype, tmp_path):
    """Exactly, or at most for an encoding whose size is a bound (compressed)."""
    rows = _table(12)
    spec = _spec(dtype, rows)
    sizes = estimate.sample_file_sizes(rows, SampleFiles.of(spec))
    for i in range(len(rows)):
        states = torch.randn(int(rows.lengths[i]), len(spec.layers), HIDDEN)
        encoding = encodings.of_spec(dtype)
        states = states.to(getattr(torch, encoding.compute))
        ready = write_sample_file(
            spool=tmp_path,
            files=SampleFiles.of(spec),
            node="n",
            batch_id="b",
            sample=rows.sample(i),
            hidden_states=states,
        )
        assert ready.size == (tmp_path / ready.spool_path).stat().st_size, i
        if encoding.exact_size:
            assert ready.size == sizes[i], i
        else:
            assert ready.size <= sizes[i], i
    rows.close()


COMPRESSED = [encoding.stored for encoding in encodings.ENCODINGS.values() if not encoding.exact_size]


def test_the_measured_samples_are_spread_over_the_lengths_and_seeded():
    lengths = np.random.default_rng(2).integers(1, 400, 5000)
    picked = measure.pick_samples(lengths)
    assert 1 < len(picked) and lengths[picked].sum() <= measure.SAMPLE_TOKENS
    assert np.array_equal(picked, measure.pick_samples(lengths))
    assert np.array_equal(picked, np.unique(picked))
    # One drawn from each stratum of lengths: the short, the middle and the long are all there.
    quartiles = np.quantile(lengths, [0.25, 0.5, 0.75])
    assert len(set(np.searchsorted(quartiles, lengths[picked]).tolist())) == 4
    assert len(measure.pick_samples(np.array([5000, 6000]))) == 1  # one, even over the tokens
    assert len(measure.pick_samples(np.array([3, 4, 5]))) == 3


@pytest.mark.parametrize("dtype", COMPRESSED)
def test_a_measured_estimate_is_within_5_percent_of_the_written_files(dtype, tiny_model, tmp_path):
    """A job of more tokens than are measured: the estimate from its measured samples against
    every file written from the states the consumer's code computes for all of its samples."""
    rng = np.random.default_rng(5)
    builder = SampleTableBuilder()
    for i in range(90):
        ids = rng.integers(0, 512, int(rng.integers(4, 128))).tolist()
        builder.add_row(TokenRow(where=f"d:{i}", source_id=f"row-{i}", input_ids=ids, loss_mask=None))
    rows = builder.finish()
    model = str(tiny_model("qwen3"))
    spec = msgspec.structs.replace(_spec(dtype, rows), model=model, model_revision="local", layers=[1, 3])
    measured = measuring.measure_states(SampleFiles.of(spec), rows, device="cpu")
    assert measured.tokens <= measure.SAMPLE_TOKENS < rows.total_tokens / 2 and measured.samples < len(rows)
    bound = int(estimate.sample_file_sizes(rows, SampleFiles.of(spec)).sum())
    guess = estimate.estimated_bytes(SampleFiles.of(spec), rows, bound=bound, ratio=measured.ratio)

    loaded = load_model(model, layers=spec.layers, encoding=encodings.of_spec(dtype), device="cpu")
    written = 0
    for start in range(0, len(rows), 8):
        batch = [rows.sample(i) for i in range(start, min(start + 8, len(rows)))]
        for sample, states in zip(batch, extract_samples(loaded, batch)):
            ready = write_sample_file(
                spool=tmp_path, files=SampleFiles.of(spec), node="n", batch_id="b", sample=sample, hidden_states=states
            )
            written += ready.size
    rows.close()
    print(f"{dtype}: {measured}; estimate {guess}, bound {bound}, written {written} bytes")
    assert written <= bound
    assert abs(guess - written) <= written * 0.05


def test_without_torch_the_states_are_not_measured(monkeypatch):
    rows = _table(3)
    monkeypatch.setitem(sys.modules, "torch", None)  # as on a producer-only install: find_spec gives None
    with pytest.raises(measuring.NotMeasured, match=r"^torch is not installed here \(a producer-only install"):
        measuring.measure_states(SampleFiles.of(_spec("bfloat16-zstd", rows)), rows, device="cpu")
    rows.close()


@pytest.mark.parametrize(
    ("device", "reason"),
    [
        ("cpu", "not estimated: the model's trunk for these layers is "),
        ("meta", "not estimated: --estimate-device meta: the meta device holds no data to extract"),
        ("none", "not estimated: --estimate-device none"),
    ],
)
def test_a_dry_run_that_cannot_measure_gives_the_bound_and_says_why(
    device, reason, hsx, tiny_model, job_name, tmp_path, monkeypatch
):
    monkeypatch.setattr(measuring, "MEMORY_FRACTION", 1e-6)  # the trunk is over the limit on any host
    dataset = tmp_path / "data.jsonl"
    write_dataset(dataset, 4, min_len=3, max_len=60, seed=2)
    args = _produce(tiny_model("qwen3"), dataset, tmp_path / "out", job_name, "--dtype", "float8-zstd", "--dry-run")
    args += ["--estimate-device", device]
    text = check_ok(hsx(*args), "dry run").stdout
    assert "sample files: 4, at most " in text and "(a bound: " in text, text
    [line] = [line for line in text.splitlines() if "not estimated" in line]
    assert line.strip().startswith(reason), line
    planned = json.loads(check_ok(hsx(*args, "--json"), "dry run --json").stdout)
    assert planned["bytes"] == planned["bytes_bound"] and planned["bytes_estimated_from"] is None, planned
    assert line.strip() == f"not estimated: {planned['bytes_not_estimated']}"


def test_free_space_is_the_nearest_existing_folders(tmp_path):
    dest = Location.parse(tmp_path / "not" / "yet")
    room = estimate.free_space(dest, "job", job_bytes=10)
    assert room.measured == str(tmp_path)
    # Another process may write meanwhile: the real probe, within a margin.
    assert abs(room.free - shutil.disk_usage(tmp_path).free) < 64 << 20
    assert room.needed == 10 and room.fits
    assert estimate.free_space(Location.parse("s3://bucket/prefix"), "job", job_bytes=10) is None


def _produce(model: Path, dataset: Path, dest: Path, job: str, *extra: str) -> list[str]:
    return [
        "produce",
        "--job",
        job,
        "--model",
        str(model),
        "--dataset",
        str(dataset),
        "--layers",
        "1,3",
        "--dest",
        str(dest),
        "--token-budget",
        "512",
        "--max-seq-len",
        "128",
        *extra,
    ]


def test_dry_run_bytes_are_the_bytes_a_float8_run_writes(hsx, tiny_model, job_name, tmp_path):
    model = tiny_model("qwen3")
    dataset = tmp_path / "data.jsonl"
    write_dataset(dataset, 12, min_len=3, max_len=120, seed=11)
    dest = tmp_path / "out"
    dry = hsx(
        *_produce(model, dataset, dest, job_name, "--dtype", "float8", "--dry-run", "--json"), nats_url=_dead_nats()
    )
    planned = json.loads(check_ok(dry, "hsx produce --dry-run").stdout)
    assert (planned["samples"], planned["files"], planned["dtype"]) == (12, 12, "float8_e4m3")
    assert not dest.exists()

    up = subprocess.run(
        [sys.executable, "-m", "hsx.cli", "up", "--workdir", str(tmp_path / "work"), "--job", job_name]
        + _produce(model, dataset, dest, job_name, "--dtype", "float8")[3:],
        capture_output=True,
        text=True,
        timeout=180,
        env={**clean_environ(), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
    )
    check_ok(up, "hsx up")
    files = sorted((dest / job_name).rglob("*.safetensors"))
    written = sum(path.stat().st_size for path in files)
    print(f"float8 dry run: {planned['bytes']} bytes; written: {written} bytes in {len(files)} files")
    assert len(files) == planned["files"]
    assert abs(planned["bytes"] - written) <= written / 100
    bundle = {path.name: path.stat().st_size for path in (dest / job_name / BUNDLE_DIR).iterdir()}
    print(f"bundle estimate {planned['bundle']}; written {bundle}")
    assert set(bundle) == set(planned["bundle"])
    assert abs(planned["bundle_bytes"] - sum(bundle.values())) <= sum(bundle.values()) / 10
    assert planned["largest_batch"]["bytes"] <= planned["bytes"]


def test_dry_run_publishes_nothing_and_gives_the_hours(hsx, nats_server, tiny_model, job_name, tmp_path):
    model = tiny_model("qwen3")
    dataset = tmp_path / "data.jsonl"
    write_dataset(dataset, 20, min_len=3, max_len=120, seed=3)
    dest = tmp_path / "out"
    args = _produce(model, dataset, dest, job_name, "--dry-run", "--rate", "0.01", "--gpus", "4")
    as_json = json.loads(check_ok(hsx(*args, "--json"), "dry run --json").stdout)
    tokens = as_json["tokens"]
    assert as_json["samples"] == 20 and as_json["batches"] >= 2
    assert as_json["hours"] == pytest.approx(tokens / (0.01 * 4) / 3600)
    assert as_json["largest_batch"]["samples"] >= 1 and as_json["largest_batch"]["tokens"] <= 512
    assert as_json["free_space"]["free"] > 0 and as_json["free_space_ok"] is True
    human = check_ok(hsx(*args), "dry run").stdout
    assert "dry run: nothing published" in human and f"{tokens} tokens" in human
    assert "hours at 0.01 tokens/s per GPU on 4 GPUs" in human
    # Nothing of the job anywhere: no spec, no batch, no stored samples, no folder.
    assert _state(nats_server, job_name) == (None, 0)
    assert not dest.exists()

    wrong = hsx(*_produce(model, dataset, dest, job_name, "--rate", "100"))
    assert_one_line_error(wrong, "--rate", "--dry-run")
    wrong = hsx(*_produce(model, dataset, dest, job_name, "--estimate-device", "cuda:0"))
    assert_one_line_error(wrong, "--estimate-device", "--dry-run")


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A 256 KiB file system at tmp_path/small: a tmpfs where this process may mount one, else a
    folder whose free space the probe reports as 256 KiB."""
    folder = tmp_path / "small"
    folder.mkdir()
    try:
        command = ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)]
        mounted = subprocess.run(command, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):  # no mount command here
        mounted = False
    if not mounted:
        monkeypatch.setattr(estimate, "free_bytes", lambda path: 256 << 10)
    try:
        yield folder
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


def test_a_job_without_room_is_refused_before_anything_is_published(
    hsx, nats_server, tiny_model, job_name, tmp_path, small_disk
):
    model = tiny_model("qwen3")
    dataset = tmp_path / "data.jsonl"
    write_dataset(dataset, 12, min_len=40, max_len=120, seed=5)  # float32 files of ~0.5 KiB a token
    dest = small_disk / "out"
    refused = hsx(*_produce(model, dataset, dest, job_name, "--dtype", "float32"))
    line = assert_one_line_error(refused, f"--dest {dest.as_uri()}", "needs", "free", "--ignore-free-space")
    planned = json.loads(
        check_ok(
            hsx(*_produce(model, dataset, dest, job_name, "--dtype", "float32", "--dry-run", "--json")), "dry run"
        ).stdout
    )
    room = planned["free_space"]
    needed, free = (int(number) for number in re.findall(r"\((\d+) bytes", line))
    # The same sizes but for job.json's creation time, a float whose repr may differ by a digit or two.
    assert abs(needed - room["needed"]) <= 4 and free == room["free"]
    assert room["free"] <= 256 << 10 < room["needed"] and planned["free_space_ok"] is False
    assert _state(nats_server, job_name) == (None, 0)
    assert not dest.exists()  # no folder claim, no probe

    accepted = hsx(*_produce(model, dataset, dest, job_name, "--dtype", "float32", "--ignore-free-space"))
    check_ok(accepted, "--ignore-free-space")
    spec, queued = _state(nats_server, job_name)
    assert spec["published"] and queued == spec["total_batches"]
