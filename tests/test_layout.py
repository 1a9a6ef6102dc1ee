"""The import rule of docs/architecture/index.md ("Layout"), read from the source with `ast`: every
import in every module, at the top or inside a function, is checked against the rooms it may
reach. commands -> services -> core; the core never imports a service or a command; a service
never imports another service; nothing in the product imports devkit/; and every module is
imported by its installed name (`hsx.producer`, not the folder name `producer`). Between files
too, no import circle (devkit/house.py draws the graph of files, imports inside functions
included).

Also: the uploader's service module, `hsx upload --help` and `hsx monitor --help` do not import
torch (an uploader or monitor node installs no torch; `pip install -e .` without the `gpu` extra).
"""

import ast
import re
import subprocess
import sys
from graphlib import TopologicalSorter
from pathlib import Path

import pytest

from devkit import house
from devkit.house import FOLDERS, SERVICES, imports_of

REPO = Path(__file__).resolve().parent.parent

# Each room of the core and the rooms it may import (besides itself and the standard library).
CORE = {
    "hsx.base": set(),  # hsx/__init__.py, hsx/errors.py, hsx/logs.py, hsx/job.py, ...
    "hsx.config": {"hsx.base"},  # below the others: a config class anywhere declares its flags with it
    "hsx.wire": {"hsx.base", "hsx.config"},
    "hsx.storage": {"hsx.base", "hsx.config", "hsx.wire"},
    "hsx.model": {"hsx.base", "hsx.config"},  # the job's own types (Layer) are the base's: hsx/job.py
}
BY_FOLDER_NAME = "a folder name (not installed)"


def room_of(module: str) -> str | None:
    """`hsx.wire.events` -> hsx.wire; `hsx.uploader.service` -> uploader; `hsx.cli` and
    `hsx.commands.*` -> commands; None outside the product."""
    parts = module.split(".")
    if parts[0] == "devkit":
        return "devkit"
    if parts[0] in FOLDERS and parts[0] != "hsx":
        return BY_FOLDER_NAME
    if parts[0] != "hsx":
        return None
    if module == "hsx.cli" or (len(parts) > 1 and parts[1] == "commands"):
        return "commands"
    if len(parts) > 1 and parts[1] in SERVICES:
        return parts[1]
    if len(parts) > 1 and f"hsx.{parts[1]}" in CORE:
        return f"hsx.{parts[1]}"
    return "hsx.base"


def may_import(room: str) -> set[str]:
    if room in CORE:
        return CORE[room] | {room}
    if room in SERVICES:
        return set(CORE) | {room}
    if room == "commands":
        return set(CORE) | set(SERVICES) | {room}
    raise AssertionError(room)


def module_name(path: Path) -> str:
    """The installed name of a source file: producer/main.py -> hsx.producer.main."""
    return house.module_name(path, REPO)


def product_modules() -> list[Path]:
    return house.product_modules(REPO)


def violations(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        room = room_of(module_name(path))
        for line, imported in imports_of(path):
            target = room_of(imported)
            if target is not None and target not in may_import(room):
                found.append(f"{path.relative_to(REPO)}:{line}: {room} imports {imported} ({target})")
    return found


def room_graph() -> dict[str, set[str]]:
    """Each room and the other rooms its modules import, drawn from the source."""
    graph: dict[str, set[str]] = {}
    for path in product_modules():
        room = room_of(module_name(path))
        targets = {room_of(imported) for _, imported in imports_of(path)}
        graph.setdefault(room, set()).update(t for t in targets if t is not None and t != room)
    return graph


# Top floor first: every import points to a later floor.
FLOORS = ["commands", *SERVICES, "hsx.storage", "hsx.model", "hsx.wire", "hsx.config", "hsx.base"]


def drawn(graph: dict[str, set[str]]) -> str:
    """The graph as docs/architecture/index.md shows it: one line a room, top floor first."""
    tuple(TopologicalSorter(graph).static_order())  # raises CycleError on a circle
    upward = [f"{room} -> {to}" for room in graph for to in graph[room] if FLOORS.index(to) <= FLOORS.index(room)]
    assert upward == [], f"arrows pointing up: {upward}"
    return "\n".join(
        f"{room} -> {', '.join(sorted(graph[room], key=FLOORS.index)) or '(standard library)'}"
        for room in FLOORS
        if room in graph
    )


def test_every_product_module_follows_the_import_rule():
    modules = product_modules()
    assert len(modules) > 60  # the walk found the product, not an empty folder
    assert violations(modules) == []


def test_the_rooms_draw_a_graph_without_circles_and_the_docs_show_it():
    graph = room_graph()
    assert set(graph) == {*CORE, *SERVICES, "commands"}
    picture = drawn(graph)
    assert picture in (REPO / "docs" / "architecture" / "index.md").read_text(), picture


def test_a_circle_and_an_upward_arrow_are_caught():
    with pytest.raises(Exception, match="cycle"):
        drawn({"hsx.wire": {"hsx.storage"}, "hsx.storage": {"hsx.wire"}})
    with pytest.raises(AssertionError, match="arrows pointing up: .'hsx.wire -> producer'"):
        drawn({"hsx.wire": {"producer"}, "producer": set()})


def test_no_import_circle_between_files():
    graph = house.file_graph(REPO)
    assert len(graph) > 60
    assert house.circles(graph) == []


def test_a_circle_between_files_is_caught_through_an_import_inside_a_function(tmp_path):
    """A circle that an import inside a function hides from Python is still one; a name from a
    package's __init__.py is that file's, and a submodule's import of its package is no circle."""
    fake = tmp_path / "repo"
    (fake / "hsx" / "pkg").mkdir(parents=True)
    (fake / "producer").mkdir()
    (fake / "hsx" / "a.py").write_text("from hsx.b import thing\n")
    (fake / "hsx" / "b.py").write_text("def f():\n    from hsx.c import other\n")
    (fake / "hsx" / "c.py").write_text("import hsx.a\n")
    (fake / "hsx" / "pkg" / "__init__.py").write_text("from hsx.pkg.part import PART\n")
    (fake / "hsx" / "pkg" / "part.py").write_text("PART = 1\n")
    (fake / "producer" / "main.py").write_text("from hsx.pkg import PART\nfrom hsx.producer import main\n")
    graph = house.file_graph(fake)
    assert graph["hsx.producer.main"] == {"hsx.pkg"}
    assert house.circles(graph) == [["hsx.a", "hsx.b", "hsx.c"]]


def test_no_function_of_the_product_is_over_100_lines():
    """Each function, method and nested function, from its `def` to its last line."""
    found = [f"{f.file}:{f.line} {f.name} ({f.lines} lines)" for f in house.long_functions(REPO)]
    assert found == []


def test_a_long_function_is_found_nested_or_in_a_class(tmp_path):
    fake = tmp_path / "repo"
    (fake / "monitor").mkdir(parents=True)

    def body(indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(100))

    nested = "class Loop:\n    def run(self):\n        def inner():\n" + body(" " * 12) + "        return inner\n"
    (fake / "monitor" / "long.py").write_text(
        nested + "\n\ndef short():\n    return 1\n\n\ndef long():\n" + body("    ") + "    return x0\n"
    )
    found = {(f.name, f.lines) for f in house.long_functions(fake)}
    assert found == {("Loop.run", 103), ("Loop.run.inner", 101), ("long", 102)}


def test_the_producer_package_names_its_modules_and_no_other():
    """producer/__init__.py's "Modules" paragraph names each module and subpackage of the
    producer (in backticks, a subpackage with its slash), and nothing that is not one."""
    folder = REPO / "producer"
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
    listed = re.findall(r"`([a-z_]+/?)`", doc[doc.index("Modules") :])
    present = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    present |= {f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").exists()}
    assert sorted(listed) == sorted(present)


def test_the_rule_catches_each_kind_of_violation(tmp_path, monkeypatch):
    """The check itself can fail: a core module importing a service or a command, a service
    importing another service or devkit, and an import by a folder name are each reported."""
    fake = tmp_path / "repo"
    (fake / "hsx" / "wire").mkdir(parents=True)
    (fake / "uploader").mkdir()
    (fake / "hsx" / "wire" / "bad.py").write_text(
        "from hsx.gpu_consumer.model import load\n\ndef f():\n    from hsx.commands import up\n    import hsx.storage.index\n"
    )
    (fake / "uploader" / "bad.py").write_text(
        "import hsx.producer.preflight\nfrom devkit import start_nats_cluster\nfrom hsx.uploader import main\nimport uploader.main\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", fake)
    found = violations([fake / "hsx" / "wire" / "bad.py", fake / "uploader" / "bad.py"])
    assert [line.split(": ", 1)[1] for line in found] == [
        "hsx.wire imports hsx.gpu_consumer.model.load (gpu_consumer)",
        "hsx.wire imports hsx.commands.up (commands)",
        "hsx.wire imports hsx.storage.index (hsx.storage)",
        "uploader imports hsx.producer.preflight (producer)",
        "uploader imports devkit.start_nats_cluster (devkit)",
        f"uploader imports uploader.main ({BY_FOLDER_NAME})",
    ]


def test_the_services_are_installed_under_hsx_only():
    """Outside the checkout, `hsx.producer` imports and no top-level `producer` (or any other
    service or command folder name) exists to collide with a user's own package."""
    code = (
        "import importlib.util, hsx.producer, hsx.gpu_consumer, hsx.uploader, hsx.monitor, hsx.commands\n"
        "print([n for n in ('producer', 'gpu_consumer', 'uploader', 'monitor', 'commands') if importlib.util.find_spec(n)])"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _torch_after(code: str) -> str:
    """`True`/`False`: whether torch is in sys.modules after running `code` in a fresh interpreter."""
    result = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "code",
    [
        "import hsx.uploader.service, hsx.uploader.main",
        "import hsx.monitor.main",
        "from hsx.commands.cli import main\ntry:\n    main(['upload', '--help'])\nexcept SystemExit:\n    pass",
        "from hsx.commands.cli import main\ntry:\n    main(['monitor', '--help'])\nexcept SystemExit:\n    pass",
    ],
)
def test_uploader_and_monitor_do_not_import_torch(code):
    assert _torch_after(code) == "False"


def test_the_torch_check_sees_torch_when_it_is_imported():
    assert _torch_after("import hsx.gpu_consumer.writer") == "True"


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
