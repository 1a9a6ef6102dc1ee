"""Makes nats-store.tar.gz: the JetStream store of three jobs recorded by hsx as of commit c2afbbb
(the producer before its one route), for tests/test_compat_c2afbbb.py. Run it once with that
commit's hsx importable, not this checkout's:

    git worktree add /tmp/hsx-c2afbbb c2afbbb
    mkdir -p /tmp/oldpkg && cp -r /tmp/hsx-c2afbbb/hsx /tmp/oldpkg/hsx
    for d in producer gpu_consumer uploader monitor commands; do cp -r /tmp/hsx-c2afbbb/$d /tmp/oldpkg/hsx/$d; done
    PYTHONPATH=/tmp/oldpkg .venv/bin/python tests/data/c2afbbb/make_jobs.py tests/data/c2afbbb

(hsx maps its folders into `hsx.*` when installed; the copy lays them out so, and PYTHONPATH puts
it before this checkout's editable install.) In a working folder holding `model` (a tiny random
Qwen3 model, as tests/conftest.py's `tiny_model("qwen3")`) and `data.jsonl` (written here, and
kept beside the store), that hsx's `hsx produce` records, against one nats-server and a moto S3
with bucket `compat` (whose objects are not kept: a rerun finds the destination empty):

- `compat-done`: one plan, published whole (every batch queued, none run);
- `compat-held`: one plan whose producer stopped after publishing HELD_BATCHES of its batches (its
  spec recorded, not `published`);
- `compat-rounds`: a plan in rounds of ROUND_ROWS rows whose producer stopped after publishing
  HELD_ROUNDS rounds.

The model and dataset are named by relative paths (`model`, `data.jsonl`), so a test in another
folder names them as the spec records them.
"""

import json
import os
import random
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import boto3
from moto.server import ThreadedMotoServer

import hsx.producer.main as producer_main
from hsx.commands.cli import main
from hsx.commands.embedded import build_tiny_model, start_nats_server

# tests/conftest.py's TINY["qwen3"], built with seed 1 as its `tiny_model` fixture builds it.
TINY_QWEN3 = dict(
    model_type="qwen3",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
)
ROWS = 40
HELD_BATCHES = 3
ROUND_ROWS = 10
HELD_ROUNDS = 2
FLAGS = ["--model", "model", "--dataset", "data.jsonl", "--layers", "1,3", "--token-budget", "256"]
FLAGS += ["--max-seq-len", "64", "--dest", "s3://compat/runs"]


class Stopped(Exception):
    """The generator's stand-in for a producer killed mid-publish."""


def write_dataset(path: Path) -> None:
    rng = random.Random(7)
    with open(path, "w") as out:
        for i in range(ROWS):
            ids = [rng.randrange(1, 512) for _ in range(rng.randrange(3, 60))]
            mask = [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2)
            out.write(json.dumps({"id": f"row-{i}", "input_ids": ids, "loss_mask": mask}) + "\n")


ORIGINAL = producer_main._publish_batches


def stop_after(calls: int):
    """`_publish_batches` that publishes on its first `calls` calls (a round each), then raises
    Stopped."""
    original = ORIGINAL
    seen = {"calls": 0}

    async def publish(js, cfg, fingerprint, batches, rows, *, skip, seqs=None, **kwargs):
        seen["calls"] += 1
        if seen["calls"] > calls:
            raise Stopped
        return await original(js, cfg, fingerprint, batches, rows, skip=skip, seqs=seqs, **kwargs)

    return publish


def stop_within_first(batches: int):
    """`_publish_batches` that publishes the plan's first `batches` batches, then raises Stopped."""
    original = ORIGINAL

    async def publish(js, cfg, fingerprint, planned, rows, *, skip, seqs=None, **kwargs):
        await original(js, cfg, fingerprint, planned, rows, skip=skip, seqs=range(batches), **kwargs)
        raise Stopped

    return publish


def produce(job: str, nats_url: str, *extra: str) -> None:
    try:
        code = main(["produce", "--job", job, *FLAGS, *extra, "--nats", nats_url])
    except Stopped:
        code = "stopped"
    print(job, code, file=sys.stderr)


def run(out: Path) -> None:
    work = out / "work"
    work.mkdir(parents=True)
    build_tiny_model(work / "model", seed=1, **TINY_QWEN3)
    write_dataset(work / "data.jsonl")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    os.environ.update(
        AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="k",
        AWS_SECRET_ACCESS_KEY="s",
        AWS_DEFAULT_REGION="us-east-1",
    )
    boto3.client("s3").create_bucket(Bucket="compat")
    server = start_nats_server(out / "store")
    os.chdir(work)
    try:
        produce("compat-done", server.url)
        producer_main._publish_batches = stop_within_first(HELD_BATCHES)
        produce("compat-held", server.url)
        producer_main._publish_batches = stop_after(HELD_ROUNDS)
        produce("compat-rounds", server.url, "--round-rows", str(ROUND_ROWS))
        producer_main._publish_batches = ORIGINAL
    finally:
        server.stop()
        moto.stop()
    with tarfile.open(out / "nats-store.tar.gz", "w:gz") as tar:
        tar.add(out / "store" / "jetstream", arcname="jetstream")
    (out / "data.jsonl").write_bytes((work / "data.jsonl").read_bytes())
    subprocess.run(["rm", "-rf", str(work), str(out / "store")], check=True)


if __name__ == "__main__":
    run(Path(sys.argv[1]).resolve())
