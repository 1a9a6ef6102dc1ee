"""The house measured from the source with `ast`: how the product's files import each other and
how long its functions are. `python devkit/house.py` prints the figures (`--json` as one JSON
document); tests/test_layout.py holds the product to the ones that are rules (no circle between
files, no function over `MAX_FUNCTION_LINES`).

What it counts, exactly:

- **a file's imports**: every `import` and `from ... import` in it, at the top or inside a
  function, resolved to the product file it names: `from hsx.wire import schemas` is
  hsx/wire/schemas.py, `from hsx.wire.schemas import Sample` is the same file, and a name a
  package's `__init__.py` defines is that `__init__.py`. A package's `__init__.py` that Python
  runs on the way to a submodule is not counted: only the file named.
- **import circles**: the strongly connected components of more than one file in that graph.
- **dtype to encoding**: each place in the product, outside the encodings registry itself, that
  names `by_name` or `of_spec` of `hsx.storage.encodings`: where a `--dtype` value or a job
  spec's `dtype` string is turned into an `Encoding` (a call or the function handed on, as a
  flag's parser). `of_file` (a sample file's own metadata, read per file) is counted apart.
- **long functions**: every function or method, nested ones included, whose span from `def` to
  its last line is over `MAX_FUNCTION_LINES`.

It knows nothing of what the code does; it reads text.
"""

import argparse
import ast
import json
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVICES = ("producer", "gpu_consumer", "uploader", "monitor")
# Each top-level folder of the product and the name it is installed under (pyproject.toml).
FOLDERS = {"hsx": "hsx", **{folder: f"hsx.{folder}" for folder in (*SERVICES, "commands")}}
MAX_FUNCTION_LINES = 100
ENCODINGS = "hsx.storage.encodings"
HUB = "hsx.producer.main"


def product_modules(repo: Path = REPO) -> list[Path]:
    return sorted(p for top in FOLDERS for p in (repo / top).rglob("*.py"))


def module_name(path: Path, repo: Path = REPO) -> str:
    """The installed name of a source file: producer/main.py -> hsx.producer.main."""
    folder, *rest = path.relative_to(repo).with_suffix("").parts
    parts = [*FOLDERS[folder].split("."), *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every import, inside functions too; `from hsx.wire import schemas` is
    hsx.wire.schemas (a module or a name: `resolve` tells which)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: relative import; the rule is read from absolute names")
    return found


def resolve(name: str, modules: Iterable[str]) -> str | None:
    """The product module an imported name lives in: the longest prefix of `name` that is one."""
    modules = set(modules)
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def file_graph(repo: Path = REPO) -> dict[str, set[str]]:
    """Each product module and the other product modules it imports."""
    paths = {module_name(path, repo): path for path in product_modules(repo)}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        targets = {resolve(name, paths) for _, name in imports_of(path)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected component of more than one module, sorted
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


@dataclass(frozen=True, kw_only=True)
class Function:
    name: str  # qualified within its file: Class.method, outer.inner
    file: str
    line: int
    lines: int


def functions(path: Path, repo: Path = REPO) -> list[Function]:
    """Every function and method of a file, nested ones included, with its span in lines."""
    found: list[Function] = []
    file = str(path.relative_to(repo))

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                found.append(
                    Function(name=name, file=file, line=child.lineno, lines=child.end_lineno - child.lineno + 1)
                )
                walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text(), filename=str(path)), "")
    return found


def long_functions(repo: Path = REPO, limit: int = MAX_FUNCTION_LINES) -> list[Function]:
    found = [f for path in product_modules(repo) for f in functions(path, repo) if f.lines > limit]
    return sorted(found, key=lambda f: -f.lines)


def encoding_lookups(repo: Path = REPO) -> dict[str, list[str]]:
    """`file:line` of each place outside the registry that names encodings.by_name/of_spec
    (`dtype`) or encodings.of_file (`file`), however the registry was imported."""
    found: dict[str, list[str]] = {"dtype": [], "file": []}
    kinds = {"by_name": "dtype", "of_spec": "dtype", "of_file": "file"}
    for path in product_modules(repo):
        module = module_name(path, repo)
        if module == ENCODINGS or module.startswith(f"{ENCODINGS}."):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        # The names this file binds to the registry (`from hsx.storage import encodings`) or to
        # its functions (`from hsx.storage.encodings import of_spec`).
        registry, direct = set(), {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "hsx.storage":
                registry |= {a.asname or a.name for a in node.names if a.name == "encodings"}
            elif isinstance(node, ast.ImportFrom) and node.module == ENCODINGS:
                direct |= {a.asname or a.name: a.name for a in node.names if a.name in kinds}
            elif isinstance(node, ast.Import):
                registry |= {a.asname for a in node.names if a.name == ENCODINGS and a.asname}
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and node.attr in kinds:
                base = ast.unparse(node.value)
                if base in registry or base == ENCODINGS:
                    name = node.attr
            elif isinstance(node, ast.Name) and node.id in direct and isinstance(node.ctx, ast.Load):
                name = direct[node.id]
            if name is not None:
                found[kinds[name]].append(f"{path.relative_to(repo)}:{node.lineno}")

    def key(place: str) -> tuple[str, int]:
        file, line = place.rsplit(":", 1)
        return file, int(line)

    return {kind: sorted(places, key=key) for kind, places in found.items()}


def measure(repo: Path = REPO) -> dict:
    graph = file_graph(repo)
    hub = next(p for p in product_modules(repo) if module_name(p, repo) == HUB)
    return {
        "producer_main": {"lines": len(hub.read_text().splitlines()), "imports": len(graph[HUB])},
        "dtype_to_encoding": encoding_lookups(repo),
        "long_functions": [asdict(f) for f in long_functions(repo)],
        "circles": circles(graph),
    }


def report(figures: dict) -> str:
    main, lookups = figures["producer_main"], figures["dtype_to_encoding"]
    lines = [
        f"producer/main.py: {main['lines']} lines, imports {main['imports']} product files",
        f"dtype string -> Encoding (encodings.by_name/of_spec): {len(lookups['dtype'])} places",
        *(f"  {place}" for place in lookups["dtype"]),
        f"sample file -> Encoding (encodings.of_file): {len(lookups['file'])} places",
        *(f"  {place}" for place in lookups["file"]),
        f"functions over {MAX_FUNCTION_LINES} lines: {len(figures['long_functions'])}",
        *(f"  {f['lines']:4d}  {f['file']}:{f['line']} {f['name']}" for f in figures["long_functions"]),
        f"file-level import circles: {len(figures['circles'])}",
        *(f"  {' <-> '.join(c)}" for c in figures["circles"]),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="the figures as one JSON document")
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout to measure (default: this one)")
    args = parser.parse_args(argv)
    figures = measure(args.repo.resolve())
    print(json.dumps(figures, indent=2) if args.json else report(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
