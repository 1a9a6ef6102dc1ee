"""deploy/slurm/'s scripts as files: each parses, and the settings docs/operations/slurm.md lists are
the ones they read, with the same defaults. `make slurm-test` (tests/slurm/run.py) runs them on a
Slurm cluster; this needs no Slurm and runs in `make test`."""

import re
import subprocess

import pytest
from conftest import REPO

SCRIPTS = sorted((REPO / "deploy" / "slurm").glob("*.sbatch"))
PAGE = REPO / "docs" / "operations" / "slurm.md"
# A setting read at the top of a script: `HSX_X=${HSX_X:-default}` or `${HSX_X:?message}`.
SETTING = re.compile(r"^(?:export )?(HSX\w*)=\$\{\1:([-?])([^}]*)\}", re.MULTILINE)
ROW = re.compile(r"^\| ((?:`HSX\w*`(?:, )?)+) \| ([^|]+) \|", re.MULTILINE)


def script_settings() -> dict[str, str]:
    """Each setting the scripts read -> its default: the text after `:-`, or "required"."""
    found: dict[str, str] = {}
    for script in SCRIPTS:
        for name, kind, default in SETTING.findall(script.read_text()):
            found[name] = "required" if kind == "?" else default
    return found


def page_settings() -> dict[str, str]:
    """The page's table of settings: name -> its default column."""
    found = {}
    for names, default in ROW.findall(PAGE.read_text()):
        for name in re.findall(r"`(HSX\w*)`", names):
            found[name] = default.strip()
    return found


def test_the_scripts_are_there_and_parse():
    assert {s.name for s in SCRIPTS} == {"hsx-node.sbatch", "hsx-array.sbatch", "hsx-produce.sbatch"}
    for script in SCRIPTS:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script.name}: {proc.stderr}"


def test_the_page_lists_each_setting_the_scripts_read():
    scripts, page = script_settings(), page_settings()
    assert len(scripts) > 15  # the pattern found the settings, not nothing
    assert set(scripts) == set(page), (
        f"only in the scripts: {set(scripts) - set(page)}, only on the page: {set(page) - set(scripts)}"
    )


@pytest.mark.parametrize("name", sorted(script_settings()))
def test_the_page_gives_each_default_as_the_script_has_it(name):
    default, said = script_settings()[name], page_settings()[name]
    if default == "":
        assert said == "none", f"{name}: the script has no default, the page says {said!r}"
    elif default == "required" or re.fullmatch(r"[\w:/.-]+", default):
        assert said.startswith((f"`{default}`", default)), (
            f"{name}: the script's default {default!r}, the page's {said!r}"
        )
    else:  # a default made of other variables ($SLURM_SUBMIT_DIR): said in words
        assert said
