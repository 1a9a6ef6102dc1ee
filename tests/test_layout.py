"""The import rule of docs/ARCHITECTURE.md ("Layout"), read from the source with `ast`: every
import in every module, at the top or inside a function, is checked against the rooms it may
reach. commands -> services -> core; the core never imports a service or a command; a service
never imports another service; nothing in the product imports devkit/.

Also: the uploader's service module, `hsx upload --help` and `hsx monitor --help` do not import
torch (an uploader or monitor node installs no torch; `pip install hsx` without the `gpu` extra).
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SERVICES = ("producer", "gpu_consumer", "uploader", "monitor")

# Each room of the core and the rooms it may import (besides itself and the standard library).
CORE = {
    "hsx.base": set(),  # hsx/__init__.py, hsx/errors.py, hsx/logs.py
    "hsx.config": {"hsx.base"},  # below the others: a config class anywhere declares its flags with it
    "hsx.wire": {"hsx.base", "hsx.config"},
    "hsx.storage": {"hsx.base", "hsx.config", "hsx.wire"},
    "hsx.model": {"hsx.base", "hsx.config", "hsx.wire"},  # the job spec's types (LayerSelector)
}


def room_of(module: str) -> str | None:
    """`hsx.wire.events` -> hsx.wire; `uploader.service` -> uploader; None outside the product."""
    parts = module.split(".")
    if parts[0] in SERVICES or parts[0] == "devkit":
        return parts[0]
    if parts[0] != "hsx":
        return None
    if module == "hsx.cli" or (len(parts) > 1 and parts[1] == "commands"):
        return "hsx.commands"
    if len(parts) > 1 and f"hsx.{parts[1]}" in CORE:
        return f"hsx.{parts[1]}"
    return "hsx.base"


def may_import(room: str) -> set[str]:
    if room in CORE:
        return CORE[room] | {room}
    if room in SERVICES:
        return set(CORE) | {room}
    if room == "hsx.commands":
        return set(CORE) | set(SERVICES) | {room}
    raise AssertionError(room)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import; `from hsx.wire import schemas` is hsx.wire.schemas."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: relative import; the rule is read from absolute names")
    return found


def product_modules() -> list[Path]:
    return sorted(p for top in ("hsx", *SERVICES) for p in (REPO / top).rglob("*.py"))


def violations(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        room = room_of(module_name(path))
        for line, imported in imports_of(path):
            target = room_of(imported)
            if target is not None and target not in may_import(room):
                found.append(f"{path.relative_to(REPO)}:{line}: {room} imports {imported} ({target})")
    return found


def test_every_product_module_follows_the_import_rule():
    modules = product_modules()
    assert len(modules) > 60  # the walk found the product, not an empty folder
    assert violations(modules) == []


def test_the_rule_catches_each_kind_of_violation(tmp_path, monkeypatch):
    """The check itself can fail: a core module importing a service or a command, and a service
    importing another service or devkit, are each reported."""
    fake = tmp_path / "repo"
    (fake / "hsx" / "wire").mkdir(parents=True)
    (fake / "uploader").mkdir()
    (fake / "hsx" / "wire" / "bad.py").write_text(
        "from gpu_consumer.model import load\n\ndef f():\n    from hsx.commands import up\n    import hsx.storage.index\n"
    )
    (fake / "uploader" / "bad.py").write_text("import producer.preflight\nfrom devkit import start_nats_cluster\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", fake)
    found = violations([fake / "hsx" / "wire" / "bad.py", fake / "uploader" / "bad.py"])
    assert [line.split(": ", 1)[1] for line in found] == [
        "hsx.wire imports gpu_consumer.model.load (gpu_consumer)",
        "hsx.wire imports hsx.commands.up (hsx.commands)",
        "hsx.wire imports hsx.storage.index (hsx.storage)",
        "uploader imports producer.preflight (producer)",
        "uploader imports devkit.start_nats_cluster (devkit)",
    ]


def _torch_after(code: str) -> str:
    """`True`/`False`: whether torch is in sys.modules after running `code` in a fresh interpreter."""
    result = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('torch' in sys.modules)"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "code",
    [
        "import uploader.service, uploader.main",
        "import monitor.main",
        "from hsx.commands.cli import main\ntry:\n    main(['upload', '--help'])\nexcept SystemExit:\n    pass",
        "from hsx.commands.cli import main\ntry:\n    main(['monitor', '--help'])\nexcept SystemExit:\n    pass",
    ],
)
def test_uploader_and_monitor_do_not_import_torch(code):
    assert _torch_after(code) == "False"


def test_the_torch_check_sees_torch_when_it_is_imported():
    assert _torch_after("import gpu_consumer.writer") == "True"


def test_no_argparse_private_api():
    """argparse's private names (`argparse._SubParsersAction`, `parser._actions`, ...) are not used
    by the product: hsx.config.settings.Parser lists what was declared on it instead."""
    private = {
        "_actions",
        "_mutually_exclusive_groups",
        "_group_actions",
        "_option_string_actions",
        "_expand_help",
        "_subparsers",
        "_registries",
        "_defaults",
    }
    found = []
    for path in product_modules():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Attribute):
                continue
            on_argparse = isinstance(node.value, ast.Name) and node.value.id == "argparse" and node.attr.startswith("_")
            if on_argparse or node.attr in private:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
