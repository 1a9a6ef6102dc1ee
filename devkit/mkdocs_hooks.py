"""mkdocs hooks (mkdocs.yml `hooks:`): the tests a page cites become links to their source.

A page cites a test as code, `test_chaos.py::test_uploader_sigkilled_mid_upload` or
`tests/test_chaos.py`; on the site each such citation links to a page made from that test module
(`tests/<module>.md`, out of the nav): its docstring, then each test with its docstring and
source. A citation of a module or test that does not exist fails the build, so a renamed test
cannot leave a page pointing at nothing.

This module reads the test files with `ast` and knows nothing of hsx.
"""

import ast
import posixpath
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

TESTS = Path(__file__).resolve().parent.parent / "tests"
# `test_x.py`, `tests/test_x.py`, `test_x.py::test_y`, `test_x.py::test_y[case]` inside backticks.
CITATION = re.compile(r"`(?:tests/)?(test_\w+)\.py(?:::(test_\w+)(?:\[[^\]`]*\])?)?`")


def _tests(module: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse((TESTS / f"{module}.py").read_text())
    return {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _page(module: str) -> str:
    source = (TESTS / f"{module}.py").read_text()
    tree, lines = ast.parse(source), source.splitlines()
    page = [f"# {module}.py", "", "```text", ast.get_docstring(tree) or "", "```", ""]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            page += [f"## {node.name}", "", "```python", *lines[start - 1 : node.end_lineno], "```", ""]
    return "\n".join(page)


def on_files(files, config):
    for path in sorted(TESTS.glob("test_*.py")):
        uri = f"tests/{path.stem}.md"
        files.append(File.generated(config, uri, content=_page(path.stem)))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.startswith("tests/"):
        return markdown
    here = posixpath.dirname(page.file.src_uri)
    fenced = False
    out = []
    for line in markdown.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        out.append(line if fenced else CITATION.sub(lambda match: _link(match, here, page), line))
    return "".join(out)


def _link(match: re.Match, here: str, page) -> str:
    module, test = match.group(1), match.group(2)
    if not (TESTS / f"{module}.py").is_file():
        raise PluginError(f"{page.file.src_uri} cites {match.group(0)}: there is no tests/{module}.py")
    if test and test not in _tests(module):
        raise PluginError(f"{page.file.src_uri} cites {match.group(0)}: tests/{module}.py has no {test}")
    target = posixpath.relpath(f"tests/{module}.md", here or ".")
    return f"[{match.group(0)}]({target}{'#' + test if test else ''})"
