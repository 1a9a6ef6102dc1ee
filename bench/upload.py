"""Upload-path benchmark: hsx uploaders moving sample files to S3 vs `aws s3 cp --recursive` of
the same files to the same server.

The S3 server is moto's (`moto.server.ThreadedMotoServer`, as tests/conftest.py starts it) in its
own process on a free port; clients get AWS_ENDPOINT_URL, fake credentials and a region, and
AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE point into the work directory so ~/.aws is not read.
The files are real hsx sample files (`gpu_consumer.writer.write_sample_file`), Qwen3-8B-shaped by
default (hidden 4096, 5 layers, bf16: 40 KiB per token) with lognormal lengths (median 500, max
4096), written once into a pristine spool and copied for every pass (uploaders delete what they
upload). Every pass goes to a fresh bucket, checked afterwards (every key, total bytes) and deleted.

hsx path: `hsx upload` processes (1, 2, 4 on the same job and node, so they share the node's
durable; each with the default --max-inflight) against a real nats-server. The job spec (dest
`s3://<bucket>/hsx`) is recorded in the KV bucket, the durable is paused (JetStream consumer
pause), the `file.v1` events the consumer would publish are published to `hsx.files.<job>.<node>`,
the uploaders are started and wait until each heartbeats ready; then the durable is released and
the time runs from the release to the `uploaded` event of the last file. Process start-up and
publishing are outside the timing.

Baseline: `aws s3 cp --recursive <spool>/<job> s3://<bucket>/aws/<job>` (aws CLI defaults:
max_concurrent_requests 10, multipart_threshold 8 MB, multipart_chunksize 8 MB), timed around the
process. Its start-up (import and one request: `aws s3 ls` of the empty bucket, measured just
before) is subtracted for `aws_bytes_per_s`, the figure the ratio uses; `aws_with_startup` keeps it.

Target (issue 5): hsx (1 uploader) / aws >= 1.0. Passes are interleaved (aws, hsx x1, x2, x4 per
repeat); figures are medians of --repeats. CPU seconds per process during each timed window
(/proc) show who the bottleneck is: on a small machine it is mostly moto.

The aws CLI is not a dependency of hsx (it pins botocore): install it apart, e.g.
  python3 -m venv .venv-awscli && .venv-awscli/bin/pip install awscli
Run: .venv/bin/python bench/upload.py [--samples 16] [--repeats 3] [--uploaders 1,2,4] [--aws PATH]
Prints one JSON object. About 1.5 minutes on 2 cores with the defaults (16 files, 0.33 GB per pass;
--samples 64 is 1.8 GB per pass and about 4.5 minutes with --uploaders 1,4).
"""

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.pipeline import (  # noqa: E402
    _DAY_S,
    _RELEASE_S,
    CpuWindow,
    JobEvents,
    _cpu_s,
    _pause_until,
    _wait_until,
)
from hsx.commands.embedded import start_nats_server, synthetic_lengths  # noqa: E402
from hsx.commands.up import Child, hsx_argv, stop_all  # noqa: E402
from hsx.errors import HsxError  # noqa: E402
from hsx.gpu_consumer.writer import write_sample_file  # noqa: E402
from hsx.job import JobSpec
from hsx.storage.layout import SampleFiles
from hsx.uploader.config import UploaderConfig  # noqa: E402
from hsx.uploader.service import SERVICE as UPLOADER_SERVICE  # noqa: E402
from hsx.wire import schemas, topology  # noqa: E402
from hsx.wire.natsconn import NatsSettings, connect  # noqa: E402

JOB = "bench"
NODE = "bench"
REPO = Path(__file__).resolve().parent.parent
AWS_DEFAULTS = {"max_concurrent_requests": 10, "multipart_threshold": "8MB", "multipart_chunksize": "8MB"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _find_aws(given: str | None) -> Path | None:
    if given:
        return Path(given) if Path(given).exists() else None
    found = shutil.which("aws")
    if found:
        return Path(found)
    local = REPO / ".venv-awscli" / "bin" / "aws"
    return local if local.exists() else None


def isolate_aws(workdir: Path) -> None:
    """This process's AWS settings: bench credentials, config files in `workdir` (never ~/.aws),
    and no endpoint, profile or session token of the caller's; the moto endpoint is set once the
    server runs."""
    (workdir / "aws-config").write_text("")
    (workdir / "aws-creds").write_text("")
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(name, None)
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "bench-key-id",
            "AWS_SECRET_ACCESS_KEY": "bench-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": str(workdir / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(workdir / "aws-creds"),
        }
    )


def _start_moto(log_path: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    code = (
        "import signal; from moto.server import ThreadedMotoServer; "
        f"ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False).start(); signal.pause()"
    )
    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise HsxError(f"moto server exited at start (log: {log_path})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise HsxError("moto server did not start within 30 s")


def _spec(args, dest: str) -> JobSpec:
    return JobSpec(
        job=JOB,
        model="bench",
        model_revision="none",
        layers=list(range(args.layers)),
        dtype="bfloat16",
        dest=dest,
        token_budget=0,
        max_seq_len=args.max_len,
        dataset="synthetic",
        plan_fingerprint="x",
        total_samples=args.samples,
        total_tokens=0,
        total_batches=0,
        created_at=0.0,
    )


def _write_pristine(args, root: Path) -> list[schemas.FileReady]:
    lengths = synthetic_lengths(args.samples, median=args.median_len, max_len=args.max_len, seed=0).tolist()
    spec = _spec(args, "file:///dev/null")

    def one(i: int) -> schemas.FileReady:
        ids = np.random.default_rng(i).integers(0, 151936, size=lengths[i]).tolist()
        sample = schemas.Sample(index=i, source_id=str(i), input_ids=ids)
        hidden = torch.randn(lengths[i], args.layers, args.hidden, generator=torch.Generator().manual_seed(i))
        return write_sample_file(
            spool=root,
            files=SampleFiles.of(spec),
            node=NODE,
            batch_id="b0",
            sample=sample,
            hidden_states=hidden.to(torch.bfloat16),
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(one, range(args.samples)))


class Bench:
    def __init__(self, args, workdir: Path, aws: Path, endpoint: str, moto_pid: int) -> None:
        self.args, self.workdir, self.aws, self.endpoint, self.moto_pid = args, workdir, aws, endpoint, moto_pid
        version = subprocess.run([str(aws), "--version"], capture_output=True, text=True)
        self.aws_version = (version.stdout or version.stderr).strip()
        self.pristine = workdir / "pristine"
        self.spool = workdir / "spool"
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        import boto3

        self.s3 = boto3.client("s3", endpoint_url=endpoint)
        self.files: list[schemas.FileReady] = []
        self.nc = None
        self.nats: NatsSettings | None = None
        self.nats_pid = 0

    def fresh_spool(self) -> None:
        shutil.rmtree(self.spool, ignore_errors=True)
        shutil.copytree(self.pristine, self.spool)
        os.sync()

    def new_bucket(self) -> str:
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        self.s3.create_bucket(Bucket=bucket)
        return bucket

    def check_and_drop(self, bucket: str, prefix: str) -> None:
        """Every file is in the bucket with its size; then the bucket goes (moto keeps objects)."""
        stored = {}
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            stored.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        expected = {f"{prefix}/{f.key}": f.size for f in self.files}
        for key in stored:
            self.s3.delete_object(Bucket=bucket, Key=key)
        self.s3.delete_bucket(Bucket=bucket)
        if stored != expected:
            missing = sorted(set(expected) - set(stored))[:5]
            raise HsxError(f"bucket {bucket}: {len(stored)} objects, expected {len(expected)}; missing e.g. {missing}")

    def _aws(self, *argv: str) -> tuple[float, float]:
        """Runs the aws CLI; returns (wall seconds, CPU seconds of the process)."""
        started = time.perf_counter()
        process = subprocess.Popen(
            [str(self.aws), *argv, "--endpoint-url", self.endpoint], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        error = process.stderr.read().decode(errors="replace")
        process.stderr.close()
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            raise HsxError(f"aws {argv[0]} {argv[1]} exited {process.returncode}: {error.strip()[-1500:]}")
        return seconds, usage.ru_utime + usage.ru_stime

    def aws_pass(self) -> dict:
        bucket = self.new_bucket()
        self.fresh_spool()
        startup_s, _ = self._aws("s3", "ls", f"s3://{bucket}")
        moto0 = _cpu_s(self.moto_pid)
        seconds, cpu = self._aws(
            "s3", "cp", "--recursive", "--quiet", str(self.spool / JOB), f"s3://{bucket}/aws/{JOB}"
        )
        moto_cpu = _cpu_s(self.moto_pid) - moto0
        self.check_and_drop(bucket, "aws")
        return {"seconds": seconds, "startup_s": startup_s, "cpu_s": {"aws": round(cpu, 2), "moto": round(moto_cpu, 2)}}

    async def hsx_pass(self, uploaders: int) -> dict:
        js = self.nc.jetstream()
        kv = await topology.ensure_topology(js)
        bucket = self.new_bucket()
        await kv.put(JOB, schemas.encode(_spec(self.args, f"s3://{bucket}/hsx")))
        self.fresh_spool()
        durable = await topology.ensure_upload_consumer(js, JOB, NODE)
        await _pause_until(self.nc, topology.FILES_STREAM, durable, _DAY_S)
        for ready in self.files:
            await js.publish(topology.file_subject(JOB, NODE), schemas.encode(ready))
        events = JobEvents()
        await events.start(self.nc, JOB)
        by_uploader: dict[str, int] = {}

        async def count(msg) -> None:
            event = schemas.event_decoder.decode(msg.data)
            by_uploader[event.uploader] = by_uploader.get(event.uploader, 0) + 1

        counting = await self.nc.subscribe(topology.markers_all(JOB, "uploaded", "*"), cb=count)
        env = {**os.environ, **self.nats.as_env(), "HSX_NODE": NODE, "PYTHONUNBUFFERED": "1"}
        argv = hsx_argv("upload", "--job", JOB, "--spool", str(self.spool))
        if self.args.max_inflight:
            argv += ["--max-inflight", str(self.args.max_inflight)]
        workers = [
            Child(f"uploader-{i}", argv, env, self.logs / f"uploader-{uploaders}-{i}.log") for i in range(uploaders)
        ]
        for child in workers:
            child.start()
        try:
            await _wait_until(lambda: events.ready_count(UPLOADER_SERVICE) >= uploaders, workers, "the uploaders")
            cpu = CpuWindow(
                {
                    "uploaders": [c.process.pid for c in workers],
                    "moto": [self.moto_pid],
                    "nats_server": [self.nats_pid],
                    "bench": [os.getpid()],
                }
            )
            started = await _pause_until(self.nc, topology.FILES_STREAM, durable, _RELEASE_S)
            await asyncio.sleep(started - time.monotonic())
            cpu.start()
            await _wait_until(lambda: len(events.uploaded) >= len(self.files), workers, "the last upload", 900)
            cpu.stop()
            seconds = max(events.uploaded.values()) - started
        finally:
            stop_all(workers)
            await events.stop()
            await counting.unsubscribe()
        left = [p for p in (self.spool / JOB).rglob("*.safetensors")]
        if left:
            raise HsxError(f"{len(left)} files left in the spool after the hsx pass")
        info = await js.consumer_info(topology.FILES_STREAM, durable)
        if info.num_pending or info.num_ack_pending or info.num_redelivered:
            raise HsxError(
                f"upload durable not drained cleanly: pending {info.num_pending}, "
                f"ack pending {info.num_ack_pending}, redelivered {info.num_redelivered}"
            )
        self.check_and_drop(bucket, "hsx")
        return {
            "seconds": seconds,
            "cpu_s": cpu.result,
            "files_by_uploader": sorted(by_uploader.values(), reverse=True),
        }

    async def run(self) -> dict:
        args = self.args
        written = time.monotonic()
        self.files = await asyncio.to_thread(_write_pristine, args, self.pristine)
        written = time.monotonic() - written
        total = sum(f.size for f in self.files)
        server = start_nats_server(self.workdir / "nats", log_file=self.logs / "nats-server.log")
        self.nats, self.nats_pid = NatsSettings(url=server.url), server.process.pid
        self.nc = await connect(self.nats, name="hsx-bench-upload")
        counts = [int(n) for n in args.uploaders.split(",")]
        aws: list[dict] = []
        hsx: dict[int, list[dict]] = {n: [] for n in counts}
        try:
            for _ in range(args.repeats):  # interleaved: drift on a shared machine hits every path alike
                aws.append(await asyncio.to_thread(self.aws_pass))
                for n in counts:
                    hsx[n].append(await self.hsx_pass(n))
        finally:
            await self.nc.drain()
            server.stop()

        def med(values) -> float:
            return statistics.median(values)

        aws_s = med(p["seconds"] - p["startup_s"] for p in aws)
        aws_rate = total / aws_s
        out = {
            "files": len(self.files),
            "bytes": total,
            "file_mb": {
                "min": round(min(f.size for f in self.files) / 1e6, 1),
                "median": round(med(f.size for f in self.files) / 1e6, 1),
                "max": round(max(f.size for f in self.files) / 1e6, 1),
            },
            "shape_per_token": [args.layers, args.hidden],
            "cpus": os.cpu_count(),
            "aws": {
                "bytes_per_s": round(aws_rate),
                "mb_per_s": round(aws_rate / 1e6, 1),
                "files_per_s": round(len(self.files) / aws_s, 2),
                "with_startup_mb_per_s": round(total / med(p["seconds"] for p in aws) / 1e6, 1),
                "startup_s": round(med(p["startup_s"] for p in aws), 2),
                "settings": AWS_DEFAULTS,
                "version": self.aws_version,
                "cpu_s": {k: round(med(p["cpu_s"][k] for p in aws), 2) for k in aws[0]["cpu_s"]},
                "raw_seconds": [round(p["seconds"], 2) for p in aws],
            },
            "hsx": {},
            "hsx_vs_aws": None,
            "hsx_vs_aws_per_repeat": None,
            "target": 1.0,
            "uploader_max_inflight": args.max_inflight or UploaderConfig.__dataclass_fields__["max_inflight"].default,
            "repeats": args.repeats,
            "write_files_s": round(written, 1),
        }
        base = None
        for n, passes in hsx.items():
            seconds = med(p["seconds"] for p in passes)
            base = base or seconds
            out["hsx"][str(n)] = {
                "bytes_per_s": round(total / seconds),
                "mb_per_s": round(total / seconds / 1e6, 1),
                "files_per_s": round(len(self.files) / seconds, 2),
                "ratio_vs_first": round(base / seconds, 3),
                "cpu_s": {k: round(med(p["cpu_s"][k] for p in passes), 2) for k in passes[0]["cpu_s"]},
                "raw_seconds": [round(p["seconds"], 2) for p in passes],
                "files_by_uploader": [p["files_by_uploader"] for p in passes],
            }
        out["hsx_vs_aws"] = round(out["hsx"][str(counts[0])]["bytes_per_s"] / aws_rate, 3)
        out["hsx_vs_aws_per_repeat"] = [
            round((a["seconds"] - a["startup_s"]) / h["seconds"], 3) for a, h in zip(aws, hsx[counts[0]])
        ]
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16, help="sample files per pass")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--median-len", type=int, default=500)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--uploaders", default="1,2,4", help="uploader process counts; the first is compared to aws")
    parser.add_argument("--max-inflight", type=int, default=None, help="hsx upload --max-inflight (default: its own)")
    parser.add_argument("--aws", default=None, help="aws CLI (default: `aws` on PATH, else .venv-awscli/bin/aws)")
    parser.add_argument("--dir", type=Path, default=None, help="where the spool and moto's files go (default: temp)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args()
    aws = _find_aws(args.aws)
    if aws is None:
        print(
            f"bench/upload.py: error: aws CLI not found ({args.aws or 'aws on PATH or .venv-awscli/bin/aws'}); "
            "install it apart: python3 -m venv .venv-awscli && .venv-awscli/bin/pip install awscli",
            file=sys.stderr,
        )
        return 2
    from hsx.logs import configure_logging

    configure_logging(json=True, level="warning")
    workdir = Path(tempfile.mkdtemp(prefix="hsx-bench-upload-", dir=args.dir))
    started = time.monotonic()
    isolate_aws(workdir)
    os.environ["TMPDIR"] = str(workdir)  # moto spills objects over 8 MB to temp files
    moto = None
    try:
        moto, endpoint = _start_moto(workdir / "moto.log")
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        bench = Bench(args, workdir, aws, endpoint, moto.pid)
        out = asyncio.run(bench.run())
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(10)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    out["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
