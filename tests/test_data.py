"""`hsx.storage.reader.HiddenStateDataset` over a real finished job, and `hsx verify` over S3 with float8.

One float8 job of COUNT samples runs through the real pipeline into a moto S3 bucket. The reader's
items are compared with the objects read independently (boto3 + safetensors); the same objects
copied to a local folder are read through file:// and a plain path; a DataLoader with two worker
processes returns every sample exactly once. `hsx verify` passes on the S3 job (recomputing two
samples within the float8 tolerance) and names an object replaced with one flipped byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace

import boto3
import pytest
import torch
from conftest import aws_bucket
from safetensors.torch import load as load_safetensors
from test_e2e_s3 import check_ok, start_monitor, wait_until_done, write_dataset
from test_verify import Services, data_offset, run_cli

from hsx.errors import HsxError
from hsx.exitcodes import JOB_FAILED
from hsx.packing import plan_batches
from hsx.storage.layout import sample_key
from hsx.storage.reader import (
    HiddenStateDataset,
    PrefetchedBatches,
    TokenBudgetSampler,
    dequantize,
    pack_collate,
    pad_collate,
    prefetched,
)

COUNT = 10
LAYERS = [1, 5]
HIDDEN = 64


@pytest.fixture(scope="module")
def s3_job(nats_server, s3_server, tiny_model, tmp_path_factory):
    """A finished float8 job in s3://<bucket>/prefix, with AWS settings in this process too."""
    tmp = tmp_path_factory.mktemp("data-job")
    services = Services(nats_server.url, tmp)
    with aws_bucket(s3_server, tmp) as (env, bucket):
        job = f"d{uuid.uuid4().hex[:8]}"
        rows = write_dataset(tmp / "data.jsonl", COUNT, min_len=3, max_len=90, seed=5)
        try:
            check_ok(
                services.hsx(
                    "produce",
                    "--job",
                    job,
                    "--model",
                    str(tiny_model("qwen3")),
                    "--dataset",
                    str(tmp / "data.jsonl"),
                    "--layers",
                    ",".join(map(str, LAYERS)),
                    "--dest",
                    f"s3://{bucket}/prefix",
                    "--dtype",
                    "float8",
                    "--token-budget",
                    "256",
                    "--max-seq-len",
                    "128",
                    env=env,
                ),
                "hsx produce",
            )
            spool = tmp / "spool"
            workers = [
                services.service(
                    "consume", "--job", job, "--device", "cpu", "--spool", str(spool), env=env, name="consume"
                ),
                services.service("upload", "--job", job, "--spool", str(spool), env=env, name="upload"),
            ]
            wait_until_done(start_monitor(services.service, job, env), workers)
        finally:
            services.stop_all()
        yield SimpleNamespace(
            job=job,
            bucket=bucket,
            rows=rows,
            env=env,
            nats_url=nats_server.url,
            url=f"s3://{bucket}/prefix/{job}",
            tmp=tmp,
        )


def read_object(s3_job, index: int) -> bytes:
    return (
        boto3.client("s3")
        .get_object(Bucket=s3_job.bucket, Key=f"prefix/{sample_key(s3_job.job, index)}")["Body"]
        .read()
    )


def header_metadata(data: bytes) -> dict:
    return json.loads(data[8 : data_offset(data)])["__metadata__"]


def keep_list_in_worker(batch: list) -> list:
    """Runs in the DataLoader worker: each item, and whether this worker reads through a
    destination client it opened itself (a boto3 client must not be inherited across fork)."""
    dataset = torch.utils.data.get_worker_info().dataset
    own_client = dataset._dest is not None and dataset._pid == os.getpid()
    return [(item, os.getpid(), own_client) for item in batch]


def test_items_equal_the_stored_files(s3_job):
    dataset = HiddenStateDataset(s3_job.url)
    assert len(dataset) == COUNT
    for i in range(COUNT):
        data = read_object(s3_job, i)
        stored = load_safetensors(data)
        item = dataset[i]
        tokens = len(s3_job.rows[i]["input_ids"])
        assert item["sample_index"] == i and item["metadata"] == header_metadata(data), item["metadata"]
        assert stored["hidden_states"].dtype == torch.float8_e4m3fn, stored["hidden_states"].dtype
        expected = stored["hidden_states"].float() * stored["hidden_states_scale"][..., None]
        assert item["hidden_states"].dtype == torch.float32 and item["hidden_states"].shape == (
            tokens,
            len(LAYERS),
            HIDDEN,
        )
        assert torch.equal(item["hidden_states"], expected), f"sample {i}: dequantized values differ"
        assert item["input_ids"].tolist() == s3_job.rows[i]["input_ids"], f"sample {i}: input_ids"
        assert item["loss_mask"].tolist() == s3_job.rows[i]["loss_mask"], f"sample {i}: loss_mask"
        assert "hidden_states_scale" not in item


def test_raw_float8_and_concatenated_layers(s3_job):
    index = 3
    stored = load_safetensors(read_object(s3_job, index))
    raw = HiddenStateDataset(s3_job.url, dequantize=False)[index]
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn
    assert torch.equal(raw["hidden_states"].view(torch.uint8), stored["hidden_states"].view(torch.uint8))
    assert torch.equal(raw["hidden_states_scale"], stored["hidden_states_scale"])
    assert torch.equal(dequantize(raw), HiddenStateDataset(s3_job.url)[index]["hidden_states"])

    concat = HiddenStateDataset(s3_job.url, concat_layers=True)[index]["hidden_states"]
    tokens = len(s3_job.rows[index]["input_ids"])
    real = stored["hidden_states"].float() * stored["hidden_states_scale"][..., None]
    assert concat.shape == (tokens, len(LAYERS) * HIDDEN)
    assert torch.equal(concat, real.reshape(tokens, len(LAYERS) * HIDDEN))
    # DFlash's feature: layer j's vector at columns [j*H, (j+1)*H).
    assert torch.equal(concat[:, HIDDEN:], real[:, 1])


def test_dataloader_with_two_workers_reads_every_sample_once(s3_job):
    dataset = HiddenStateDataset(s3_job.url)
    dataset[0]  # this process now holds a client; the forked workers must open their own
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=3,
        shuffle=True,
        num_workers=2,
        collate_fn=keep_list_in_worker,
        generator=torch.Generator().manual_seed(0),
    )
    results = [entry for batch in loader for entry in batch]
    seen = [item["sample_index"] for item, _pid, _own in results]
    assert sorted(seen) == list(range(COUNT)), seen
    assert len({pid for _item, pid, _own in results}) == 2 and os.getpid() not in {pid for _i, pid, _o in results}
    assert all(own for _item, _pid, own in results), "a worker read through a client it did not open"


def test_file_url_and_plain_path_read_the_same_files(s3_job):
    root = s3_job.tmp / "copy" / "out"
    for i in range(COUNT):
        path = root / sample_key(s3_job.job, i)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(read_object(s3_job, i))
    # Neither an unfinished temp file nor a file whose name is not a sample index is a sample.
    (root / s3_job.job / "00000" / ".4.safetensors.0123abcd.tmp").write_bytes(b"partial")
    (root / s3_job.job / "00000" / "notes.safetensors").write_bytes(b"not a sample")
    from_s3 = HiddenStateDataset(s3_job.url)
    with pytest.raises(HsxError, match="no sample files of job nosuchjob"):
        HiddenStateDataset(f"s3://{s3_job.bucket}/prefix/nosuchjob")
    for url in (Path(root / s3_job.job).as_uri(), str(root / s3_job.job) + "/"):
        local = HiddenStateDataset(url)
        assert len(local) == COUNT and local.job == s3_job.job, url
        assert local.sample_indices == list(range(COUNT)), local.sample_indices
        for i in (0, COUNT - 1):
            assert torch.equal(local[i]["hidden_states"], from_s3[i]["hidden_states"]), (url, i)


def test_verify_over_s3_float8(s3_job, monkeypatch):
    for key, value in s3_job.env.items():
        monkeypatch.setenv(key, value)
    code, out, err = run_cli(
        "verify", "--job", s3_job.job, "--nats", s3_job.nats_url, "--json", "--recompute", "2", "--seed", "3"
    )
    report = json.loads(out)
    assert code == 0 and report["ok"] is True, f"{report}\n{err[-3000:]}"
    assert report["samples_checked"] == COUNT and report["dtype"] == "float8_e4m3", report
    results = report["recompute"]["results"]
    assert len(results) == 2, report["recompute"]
    for r in results:
        # float8 keeps about 2 significant digits: a real, nonzero error, inside the limit. e4m3
        # rounds each element within 2^-4 of itself (so the states within 0.0625 of their norm),
        # on top of the bfloat16 forward's own (~0.01): under the encoding's 8e-2; and rounding to
        # 4 significant bits leaves far more than 1e-3 (a float32 file: ~1e-7).
        assert r["ok"] and 1e-3 < r["relative_error"] <= 8e-2, r

    index = 6
    key = f"prefix/{sample_key(s3_job.job, index)}"
    original = read_object(s3_job, index)
    damaged = bytearray(original)
    damaged[data_offset(original) + 5] ^= 0x10
    client = boto3.client("s3")
    client.put_object(Bucket=s3_job.bucket, Key=key, Body=bytes(damaged))
    try:
        code, out, err = run_cli("verify", "--job", s3_job.job, "--nats", s3_job.nats_url, "--json")
    finally:
        client.put_object(Bucket=s3_job.bucket, Key=key, Body=original)
    report = json.loads(out)
    assert code == JOB_FAILED, report
    assert [(c["sample_index"], c["reason"]) for c in report["corrupt"]] == [(index, "checksum")], report
    assert report["missing"] == [] and report["mismatching"] == [], report


def test_the_token_budget_sampler_groups_by_length_from_the_index(s3_job):
    """Every sample once per epoch, each batch within the budget (size x longest), cut as the
    producer's plan cuts it, from the index's lengths; epochs differ, an epoch repeats."""
    dataset = HiddenStateDataset(s3_job.url)
    lengths = [len(row["input_ids"]) for row in s3_job.rows]
    assert dataset.sample_tokens == lengths  # read from the index: no file opened
    sampler = TokenBudgetSampler(dataset, token_budget=256, seed=7)
    first = list(sampler)
    assert len(first) == len(sampler) == len(plan_batches(lengths, token_budget=256))
    assert sorted(i for batch in first for i in batch) == list(range(COUNT))
    assert all(len(batch) * max(lengths[i] for i in batch) <= 256 for batch in first)
    assert list(sampler) == first
    epochs = []
    for epoch in range(1, 7):
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
        assert sorted(i for batch in epochs[-1] for i in batch) == list(range(COUNT))
    assert any(batches != first for batches in epochs)  # the batches' order is drawn per epoch
    ties = TokenBudgetSampler([4] * 8, token_budget=8, seed=3)  # which equal samples pair up, too
    pairings = set()
    for epoch in range(4):
        ties.set_epoch(epoch)
        pairings.add(frozenset(frozenset(batch) for batch in ties))
    assert len(pairings) > 1 and all(len(batch) == 2 for batch in ties)
    capped = TokenBudgetSampler(lengths, token_budget=10_000, max_batch_size=3, shuffle=False)
    assert all(len(batch) <= 3 for batch in capped) and len(capped) == -(-COUNT // 3)
    with pytest.raises(HsxError, match="more than the token budget 16"):
        TokenBudgetSampler(lengths, token_budget=16)


def test_pad_and_pack_collate_hold_each_item_exactly(s3_job):
    dataset = HiddenStateDataset(s3_job.url)
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=TokenBudgetSampler(dataset, token_budget=256, seed=1), collate_fn=pad_collate
    )
    seen = []
    for batch in loader:
        for row, index in enumerate(batch["sample_index"].tolist()):
            item, length = dataset[index], int(batch["lengths"][row])
            assert length == len(s3_job.rows[index]["input_ids"])
            assert torch.equal(batch["hidden_states"][row, :length], item["hidden_states"])
            assert not batch["hidden_states"][row, length:].any()
            assert batch["input_ids"][row, :length].tolist() == item["input_ids"].tolist()
            assert batch["attention_mask"][row].tolist() == [1] * length + [0] * (batch["input_ids"].shape[1] - length)
            assert batch["loss_mask"][row, :length].tolist() == s3_job.rows[index]["loss_mask"]
            seen.append(index)
    assert sorted(seen) == list(range(COUNT))

    items = [dataset[i] for i in (4, 0, 7)]
    packed = pack_collate(items)
    sizes = [len(item["input_ids"]) for item in items]
    assert packed["cu_seqlens"].tolist() == [0, sizes[0], sizes[0] + sizes[1], sum(sizes)]
    assert torch.equal(packed["hidden_states"], torch.cat([item["hidden_states"] for item in items]))
    assert packed["position_ids"].tolist() == [p for size in sizes for p in range(size)]
    assert packed["sample_index"].tolist() == [4, 0, 7]


def test_a_batch_is_read_on_threads_at_once(s3_job):
    """`__getitems__` (what a DataLoader calls for a batch) has its reads in flight together: three
    reads wait at a barrier that only three concurrent reads pass (one at a time would time out)."""
    dataset = HiddenStateDataset(s3_job.url, max_connections=3)
    destination = dataset._destination()
    together = threading.Barrier(3, timeout=20)
    plain_read = destination.read_bytes

    def read_when_three_are_waiting(key: str) -> bytes:
        together.wait()
        return plain_read(key)

    destination.read_bytes = read_when_three_are_waiting
    try:
        items = dataset.__getitems__([5, 2, 8])
    finally:
        destination.read_bytes = plain_read
    assert [item["sample_index"] for item in items] == [5, 2, 8]
    for item in items:
        assert torch.equal(item["hidden_states"], dataset[item["sample_index"]]["hidden_states"])


@pytest.mark.parametrize("collate", [pack_collate, pad_collate])
def test_worker_batches_arrive_in_shared_memory_and_exact(s3_job, collate):
    """Batches cut by the sampler and collated in two worker processes: each batch's hidden
    states were made in shared memory (sent to the training process without another copy) and
    hold each item exactly; every sample arrives once."""
    dataset = HiddenStateDataset(s3_job.url, max_connections=4)
    sampler = TokenBudgetSampler(dataset, token_budget=256, shuffle=False)

    def collate_and_say_if_shared(items: list) -> tuple[dict, bool]:  # runs in the worker
        batch = collate(items)
        return batch, batch["hidden_states"].is_shared()  # before sending, which would share a copy

    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=2, collate_fn=collate_and_say_if_shared
    )
    seen = []
    for batch, made_shared in loader:
        assert made_shared
        indices = batch["sample_index"].tolist()
        items = [dataset[i] for i in indices]
        if collate is pack_collate:
            assert torch.equal(batch["hidden_states"], torch.cat([item["hidden_states"] for item in items]))
        else:
            for row, item in enumerate(items):
                length = len(item["input_ids"])
                assert torch.equal(batch["hidden_states"][row, :length], item["hidden_states"])
                assert not batch["hidden_states"][row, length:].any()  # shared memory is not zeroed for us
        seen += indices
    assert sorted(seen) == list(range(COUNT))


def test_prefetched_batches_are_the_samplers_batches_collated(s3_job):
    """Read ahead across batch boundaries, yet each batch is exactly the sampler's, in its order;
    through a DataLoader (batch_size=None) too; set_epoch reaches the sampler."""
    dataset = HiddenStateDataset(s3_job.url)
    sampler = TokenBudgetSampler(dataset, token_budget=256, seed=3)
    batches = PrefetchedBatches(dataset, sampler, collate_fn=pad_collate, in_flight=3)
    for epoch in (0, 1):
        batches.set_epoch(epoch)
        expected = list(sampler)
        got = list(torch.utils.data.DataLoader(batches, batch_size=None)) if epoch else list(batches)
        assert len(got) == len(expected) == len(batches)
        for batch, positions in zip(got, expected):
            assert batch["sample_index"].tolist() == positions
            reference = pad_collate([dataset[i] for i in positions])
            assert all(torch.equal(batch[key], reference[key]) for key in reference), positions
    with pytest.raises(HsxError, match="num_workers=0, not 2"):  # two workers would yield each batch twice
        list(torch.utils.data.DataLoader(batches, batch_size=None, num_workers=2))


def test_each_rank_takes_its_share_of_the_batches_and_all_the_same_number():
    lengths = [7, 30, 12, 64, 3, 50, 9, 41, 22, 18, 5, 60, 33]
    whole = TokenBudgetSampler(lengths, token_budget=64, seed=11)
    for replicas in (2, 3, 4):
        ranks = [
            TokenBudgetSampler(lengths, token_budget=64, seed=11, num_replicas=replicas, rank=rank)
            for rank in range(replicas)
        ]
        shares = [list(sampler) for sampler in ranks]
        assert all(len(share) == len(sampler) == -(-len(whole) // replicas) for share, sampler in zip(shares, ranks))
        dealt = [batch for round_ in zip(*shares) for batch in round_]  # rank 0, 1, ... per step
        assert dealt[: len(whole)] == list(whole)  # every batch of the epoch, once, in its order
        assert dealt[len(whole) :] == list(whole)[: len(dealt) - len(whole)]  # the last round filled
    few = [TokenBudgetSampler([10, 20], token_budget=64, shuffle=False, num_replicas=4, rank=rank) for rank in range(4)]
    assert [[sorted(batch) for batch in sampler] for sampler in few] == [[[0, 1]]] * 4  # one batch, four ranks
    with pytest.raises(HsxError, match="rank 2 is not one of num_replicas 2"):
        TokenBudgetSampler(lengths, token_budget=64, num_replicas=2, rank=2)


def test_prefetched_reads_ahead_and_yields_in_order(s3_job):
    dataset = HiddenStateDataset(s3_job.url)
    order = [5, 1, 9, 0, 3, 8, 2, 7, 4, 6]
    items = list(prefetched(dataset, order, in_flight=4))
    assert [item["sample_index"] for item in items] == order
    for item in items:
        assert torch.equal(item["hidden_states"], dataset[item["sample_index"]]["hidden_states"])


def test_the_sampler_needs_the_index_for_lengths(s3_job, tmp_path):
    folder = tmp_path / "out" / s3_job.job
    for i in range(2):  # two files and no index: the dataset lists the folder
        path = tmp_path / "out" / sample_key(s3_job.job, i)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(read_object(s3_job, i))
    listed = HiddenStateDataset(str(folder))
    assert listed.sample_tokens is None
    with pytest.raises(HsxError, match="no complete index"):
        TokenBudgetSampler(listed, token_budget=256)


TRAINING_SCRIPT = """
import logging, sys
url, folder, nats, configured = sys.argv[1:]
if configured == "yes":
    logging.basicConfig(level=logging.INFO)
from hsx.storage.reader import HiddenStateDataset, JobStream, PrefetchedBatches, TokenBudgetSampler

dataset = HiddenStateDataset(url)
read = sum(len(batch["sample_index"]) for batch in PrefetchedBatches(dataset, TokenBudgetSampler(dataset, token_budget=256)))
listed = HiddenStateDataset(folder)  # no index there: listed, and a log line says so
streamed = sum(len(batch["sample_index"]) for batch in JobStream(url, nats=nats, token_budget=256))
print(f"read {read}, listed {len(listed)}, streamed {streamed}")
"""


def test_a_training_scripts_stdout_is_its_own_and_hsx_logs_through_logging(s3_job, tmp_path):
    """hsx used as a library writes nothing to stdout: its records go through `logging`, quiet
    until the script configures it, then there (stderr for basicConfig), `event key=value`."""
    folder = tmp_path / "out" / s3_job.job
    for i in range(2):
        path = tmp_path / "out" / sample_key(s3_job.job, i)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(read_object(s3_job, i))

    def train(configured: str) -> str:
        result = subprocess.run(
            [sys.executable, "-c", TRAINING_SCRIPT, s3_job.url, str(folder), s3_job.nats_url, configured],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout == f"read {COUNT}, listed 2, streamed {COUNT}\n", result.stdout + result.stderr[-3000:]
        return result.stderr

    quiet = train("no")
    assert "dataset_listing" not in quiet and "stream_epoch_end" not in quiet, quiet
    logged = train("yes").splitlines()
    assert any(line.startswith("INFO:hsx.data:dataset_listing url=") for line in logged), logged
    ended = [line for line in logged if line.startswith("INFO:hsx.data:stream_epoch_end ")]
    assert ended and f"job={s3_job.job}" in ended[0] and f"samples={COUNT}" in ended[0], logged


def test_the_jobs_tokenized_samples_stream_from_s3(s3_job):
    """What the speculators export builds its table from: the bundle's tokens.arrow, read as a
    stream from the bucket (not held whole in memory), equal to the dataset's rows."""
    from hsx.commands.export import _bundle_tokens
    from hsx.storage.location import Location, open_destination

    table = _bundle_tokens(open_destination(Location.parse(s3_job.url)), s3_job.url)
    try:
        assert len(table) == COUNT
        for i, row in enumerate(s3_job.rows):
            assert table.input_ids(i).tolist() == row["input_ids"]
            assert table.loss_mask(i).tolist() == row["loss_mask"]
    finally:
        table.close()


def test_export_reads_the_job_straight_from_s3(s3_job, tmp_path):
    """`hsx export` of the float8 job in the bucket (no NATS): each file's checksum checked,
    dequantized as HiddenStateDataset gives it and rounded to bfloat16 (`--dtype auto`), the
    layers in order, the report complete."""
    from hsx.commands.export import ExportConfig, run_export
    from hsx.storage.location import Location

    out = tmp_path / "dflash"
    report = run_export(ExportConfig(source=Location.parse(s3_job.url), to="specforge-dflash", out=out, workers=4))
    assert report.ok and report.trainer_layer_ids == {"target_layer_ids": LAYERS} and report.dtype == "bfloat16"
    dataset = HiddenStateDataset(s3_job.url, concat_layers=True)
    left = {entry.sample_index for entry in report.left_out}
    assert report.samples_exported == COUNT - len(left)
    for i in range(COUNT):
        path = out / "rows_0-2000" / f"data_{i}.ckpt"
        assert path.exists() == (i not in left)
        if i in left:
            continue
        saved = torch.load(path, weights_only=False, mmap=True)  # as SpecForge's reader loads it
        assert torch.equal(saved["hidden_states"], dataset[i]["hidden_states"].to(torch.bfloat16))
        assert saved["input_ids"].tolist() == s3_job.rows[i]["input_ids"]
        assert saved["loss_mask"].tolist() == s3_job.rows[i]["loss_mask"]
