"""End to end through the real CLI: produce -> consume (CPU) -> upload -> monitor --until-done.

Real nats-server, a real moto S3 server over HTTP (or a local directory), a tiny real qwen3
model, every service a subprocess. The output is read back independently (boto3 / the file
system, safetensors, transformers) and checked sample by sample against the dataset.

The helpers here are shared with tests/test_crash_recovery.py.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from tolerance import assert_within, depth, error, float32_bound, reduction_length

from hsx.job import FINAL
from hsx.storage.layout import SHARD_SIZE, bundle_key, relative_sample_key
from hsx.wire import schemas

LAYERS = [0, 2, 5]  # of the tiny qwen3's 6 decoder layers: 5 is the last (pre-norm in hsx, post-norm in HF)
HIDDEN = 64
PIPELINE_TIMEOUT_S = 60.0


# ---------------------------------------------------------------- dataset and services


def write_dataset(path: Path, count: int, *, min_len: int, max_len: int, seed: int, vocab: int = 512) -> list[dict]:
    """JSONL rows with `id`, `input_ids` and `loss_mask`; lengths spread over [min_len, max_len]."""
    rng = random.Random(seed)
    lengths = [min_len, max_len] + [rng.randint(min_len, max_len) for _ in range(count - 2)]
    rng.shuffle(lengths)
    rows = []
    for index, length in enumerate(lengths):
        split = rng.randint(0, length)
        rows.append(
            {
                "id": f"row-{index}",
                "input_ids": [rng.randrange(vocab) for _ in range(length)],
                "loss_mask": [0] * split + [1] * (length - split),
            }
        )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def logs_of(*procs: subprocess.Popen, tail: int = 3000) -> str:
    parts = []
    for proc in procs:
        text = Path(proc.log_path).read_text(errors="replace") if getattr(proc, "log_path", None) else ""
        parts.append(
            f"----- {' '.join(proc.args[3:6])} (pid {proc.pid}, rc {proc.poll()}) {proc.log_path}\n{text[-tail:]}"
        )
    return "\n".join(parts)


def check_ok(result: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (
        f"{what} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    )
    return result


def produce(
    hsx,
    *,
    job: str,
    model: Path,
    dataset: Path,
    dest: str,
    token_budget: int,
    max_seq_len: int,
    env: dict | None,
    layers: str = ",".join(map(str, LAYERS)),
    dtype: str = "float32",
):
    check_ok(
        hsx(
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
            dtype,
            "--token-budget",
            str(token_budget),
            "--max-seq-len",
            str(max_seq_len),
            env=env,
        ),
        "hsx produce",
    )


def status(hsx, job: str, env: dict | None) -> dict:
    # A generous sums budget: these tests read the sums (samples written, tokens) exactly.
    return json.loads(
        check_ok(hsx("status", "--job", job, "--json", "--sums-budget", "30", env=env, timeout=60), "hsx status").stdout
    )


def wait_until_spooled(hsx, consumer: subprocess.Popen, job: str, count: int, timeout: float = 90) -> None:
    """Until the consumer has written all `count` samples (no uploader runs: they wait in its spool)."""
    deadline = time.monotonic() + timeout
    while status(hsx, job, None)["samples_written"] < count:
        assert consumer.poll() is None, "the consumer exited before writing every sample"
        assert time.monotonic() < deadline, f"the consumer did not write {count} samples within {timeout:.0f} s"
        time.sleep(0.5)


def wait_until_done(
    monitor: subprocess.Popen, workers: list[subprocess.Popen], timeout: float = PIPELINE_TIMEOUT_S
) -> float:
    """Wait for `hsx monitor --until-done` to exit 0; fail with every log on timeout, on a bad exit,
    or as soon as a worker dies. Returns the seconds waited."""
    started = time.monotonic()
    while monitor.poll() is None:
        dead = [w for w in workers if w.poll() is not None]
        if dead:
            pytest.fail(f"a worker exited while the job ran\n{logs_of(monitor, *workers)}")
        if time.monotonic() - started > timeout:
            pytest.fail(
                f"job not done after {timeout:.0f} s (monitor --until-done still running)\n{logs_of(monitor, *workers)}"
            )
        time.sleep(0.2)
    assert monitor.returncode == 0, f"monitor --until-done exited {monitor.returncode}\n{logs_of(monitor, *workers)}"
    return time.monotonic() - started


def start_monitor(hsx_service, job: str, env: dict | None) -> subprocess.Popen:
    return hsx_service("monitor", "--job", job, "--until-done", "--interval", "1", env=env, name="monitor")


# ---------------------------------------------------------------- output checks


def spool_files(spool: Path) -> list[Path]:
    """Everything left in a spool that is not a directory (finished files and temp files alike)."""
    return sorted(p for p in spool.rglob("*") if not p.is_dir()) if spool.exists() else []


def spooled(spool: Path, job: str, index: int) -> Path | None:
    """Sample `index`'s file in the spool, under its plan's folder (hsx/storage/spool.py), or None."""
    return next(spool.glob(f"{job}/*/{relative_sample_key(job, index)}"), None)


def job_plan(out: Path, job: str) -> str:
    """The job's plan tag, from the job.json of its bundle in a local destination."""
    return schemas.job_decoder.decode((out / bundle_key(job, "job.json")).read_bytes()).plan_tag


def expected_key(job: str, index: int) -> str:
    return f"{job}/{index // SHARD_SIZE:05d}/{index}.safetensors"


def check_sample_file(data: bytes, key: str, *, job: str, rows: list[dict]) -> dict[str, torch.Tensor]:
    """One sample file: complete, self-describing, and holding exactly its dataset row."""
    match = re.fullmatch(rf"{re.escape(job)}/(\d{{5}})/(\d+)\.safetensors", key)
    assert match, f"unexpected key {key!r}"
    index = int(match.group(2))
    assert int(match.group(1)) == index // SHARD_SIZE, f"{key}: wrong shard for sample {index}"
    assert 0 <= index < len(rows), f"{key}: no sample {index} in a dataset of {len(rows)}"
    row = rows[index]
    tensors = load_safetensors(data)
    metadata = _metadata(data)
    tokens = len(row["input_ids"])
    assert set(tensors) == {"hidden_states", "input_ids", "loss_mask"}, f"{key}: tensors {sorted(tensors)}"
    hidden = tensors["hidden_states"]
    assert hidden.dtype == torch.float32, f"{key}: hidden_states dtype {hidden.dtype}"
    assert tuple(hidden.shape) == (tokens, len(LAYERS), HIDDEN), (
        f"{key}: hidden_states {tuple(hidden.shape)}, {tokens} tokens"
    )
    assert torch.isfinite(hidden).all(), f"{key}: non-finite hidden states"
    assert tensors["input_ids"].tolist() == row["input_ids"], f"{key}: input_ids differ from dataset row {index}"
    assert tensors["loss_mask"].tolist() == row["loss_mask"], f"{key}: loss_mask differs from dataset row {index}"
    assert metadata["sample_index"] == str(index), f"{key}: metadata sample_index {metadata['sample_index']}"
    assert metadata["job"] == job and metadata["source_id"] == row["id"], f"{key}: metadata {metadata}"
    assert json.loads(metadata["layers"]) == LAYERS and metadata["dtype"] == "float32", f"{key}: metadata {metadata}"
    assert metadata["num_tokens"] == str(tokens), f"{key}: metadata num_tokens {metadata['num_tokens']}"
    assert metadata["checksum"] == digest_and_checksum(data)[1], f"{key}: checksum in metadata does not match its data"
    return tensors


def digest_and_checksum(data: bytes) -> tuple[str, str]:
    """A sample file's digest (sha256 of its first 8 + header bytes) and the checksum its header
    should hold (sha256 of everything after the header), computed here with hashlib alone."""
    header_end = 8 + int.from_bytes(data[:8], "little")
    return hashlib.sha256(data[:header_end]).hexdigest(), "sha256:" + hashlib.sha256(data[header_end:]).hexdigest()


def _metadata(data: bytes) -> dict[str, str]:
    header_len = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + header_len]).get("__metadata__", {})


def sample_objects(objects: dict[str, bytes], job: str) -> dict[str, bytes]:
    """The objects that are not the job bundle under `<job>/_hsx/` (tests/test_bundle.py checks it)."""
    return {key: data for key, data in objects.items() if not key.startswith(bundle_key(job, ""))}


def check_outputs(objects: dict[str, bytes], *, job: str, rows: list[dict]) -> dict[int, dict[str, torch.Tensor]]:
    """Exactly one complete file per sample, under exactly the expected keys; returns them by index."""
    objects = sample_objects(objects, job)
    expected = {expected_key(job, i) for i in range(len(rows))}
    missing, extra = sorted(expected - set(objects)), sorted(set(objects) - expected)
    assert not missing and not extra, (
        f"{len(objects)} objects for {len(rows)} samples; missing {missing[:10]}, extra {extra[:10]}"
    )
    return {
        int(key.rsplit("/", 1)[1].split(".")[0]): check_sample_file(data, key, job=job, rows=rows)
        for key, data in objects.items()
    }


def check_final_status(view: dict, *, total: int) -> None:
    assert view["done"] is True, view
    assert view["total_samples"] == total, view
    assert view["samples_written"] == total, view
    assert view["samples_uploaded"] == total, view
    assert view["batches_total"] > 1 and view["batches_done"] == view["batches_total"], view
    assert view["dead_letters"] == 0 and view["dead_samples"] == [], view


def read_s3_objects(bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object in the bucket, keyed relative to `prefix/`; anything outside the prefix fails."""
    import boto3

    client = boto3.client("s3")
    keys = [
        obj["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for obj in page.get("Contents", [])
    ]
    outside = [k for k in keys if not k.startswith(prefix + "/")]
    assert not outside, f"objects outside {prefix}/: {outside[:10]}"
    return {k[len(prefix) + 1 :]: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def read_dir_objects(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- reference hidden states


class Reference:
    """transformers run on one sample alone, independent of hsx's extraction code."""

    def __init__(self, model_path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def run(self, input_ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor, tuple[torch.Tensor, ...]]:
        """(raw output of each LAYERS entry [T, H], the final norm module, HF hidden_states [T, H] each)."""
        raw = {}
        layers = self.model.model.layers
        handles = [
            layers[i].register_forward_hook(
                lambda _m, _a, out, i=i: raw.__setitem__(i, out[0] if isinstance(out, tuple) else out)
            )
            for i in LAYERS
        ]
        try:
            out = self.model(input_ids=torch.tensor([input_ids]), output_hidden_states=True)
        finally:
            for handle in handles:
                handle.remove()
        return [raw[i][0] for i in LAYERS], self.model.model.norm, tuple(h[0] for h in out.hidden_states)

    def check(self, hidden: torch.Tensor, input_ids: list[int], *, what: str) -> None:
        """Each stored layer within tests/tolerance.py's float32 bound of the sample run alone."""
        raw, norm, hf = self.run(input_ids)
        last = len(self.model.model.layers) - 1
        n = reduction_length(self.model.config, len(input_ids))
        for slot, layer in enumerate(LAYERS):
            got = hidden[:, slot]
            bound = float32_bound(n, depth(layer, last + 1))
            assert_within(got, raw[slot], bound, f"{what} layer {layer}")
            if layer != last:
                # The output format (docs/reference/data.md): layer i == output_hidden_states[i + 1] for every layer but the last ...
                assert_within(got, hf[layer + 1], bound, f"{what} layer {layer} vs HF")
            else:
                # ... whose HF entry has the final norm applied (one reduction more): hsx stores the pre-norm state.
                with torch.inference_mode():
                    normed = norm(got)
                post_norm = float32_bound(n, depth(FINAL, last + 1))
                assert_within(normed, hf[layer + 1], post_norm, f"{what} last layer {layer}, normed, vs HF")
                assert error(got, hf[layer + 1]) > post_norm, f"{what}: last layer stored post-norm"


# ---------------------------------------------------------------- the pipeline


def run_pipeline(tmp_path, hsx, hsx_service, *, job: str, model: Path, dest: str, env: dict | None, count: int = 40):
    rows = write_dataset(tmp_path / "data.jsonl", count, min_len=4, max_len=200, seed=7)
    spool = tmp_path / "spool"
    produce(
        hsx,
        job=job,
        model=model,
        dataset=tmp_path / "data.jsonl",
        dest=dest,
        token_budget=1024,
        max_seq_len=256,
        env=env,
    )
    workers = [hsx_service("consume", "--job", job, "--device", "cpu", "--spool", str(spool), env=env, name="consume")]
    workers += [hsx_service("upload", "--job", job, "--spool", str(spool), env=env, name="upload") for _ in range(2)]
    monitor = start_monitor(hsx_service, job, env)
    waited = wait_until_done(monitor, workers)
    print(f"pipeline of {count} samples done in {waited:.1f} s")
    return rows, spool, workers


def check_pipeline_result(
    objects: dict[str, bytes], *, hsx, job: str, rows, spool: Path, model: Path, env, workers
) -> None:
    outputs = check_outputs(objects, job=job, rows=rows)
    leftover = spool_files(spool)
    assert not leftover, f"spool not empty: {leftover[:10]}\n{logs_of(*workers)}"
    check_final_status(status(hsx, job, env), total=len(rows))
    reference = Reference(model)
    # The longest sample shares its batch with others (right-padded), the shortest is mostly padding.
    longest = max(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    shortest = min(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    for index in (longest, shortest):
        reference.check(outputs[index]["hidden_states"], rows[index]["input_ids"], what=f"sample {index}")


def test_e2e_s3_destination(tmp_path, hsx, hsx_service, tiny_model, job_name, s3_env):
    bucket, env = s3_env
    model = tiny_model("qwen3")
    rows, spool, workers = run_pipeline(
        tmp_path, hsx, hsx_service, job=job_name, model=model, dest=f"s3://{bucket}/prefix", env=env
    )
    objects = read_s3_objects(bucket, "prefix")
    check_pipeline_result(objects, hsx=hsx, job=job_name, rows=rows, spool=spool, model=model, env=env, workers=workers)


def test_e2e_file_destination(tmp_path, hsx, hsx_service, tiny_model, job_name):
    model = tiny_model("qwen3")
    out = tmp_path / "out"
    rows, spool, workers = run_pipeline(tmp_path, hsx, hsx_service, job=job_name, model=model, dest=str(out), env=None)
    objects = read_dir_objects(out)
    check_pipeline_result(
        objects, hsx=hsx, job=job_name, rows=rows, spool=spool, model=model, env=None, workers=workers
    )
