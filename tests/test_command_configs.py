"""Every command's flags are the fields of its config class, and the config's own checks run
wherever its settings are resolved: the command, and `hsx config show`.

All in this process (`hsx.commands.cli.main`), no NATS, no model: nothing here gets as far as
connecting.
"""

import dataclasses
import json

import pytest
from test_cli_errors import assert_one_line_error

from hsx.commands import cli
from hsx.commands.configs import DeadRetryConfig, ExportConfig, SyncConfig
from hsx.commands.up import UpConfig, passed_to_producer
from hsx.config.fields import flag_fields, option
from hsx.config.settings import Parser, resolve
from hsx.config.values import positive_int
from hsx.wire.natsconn import NatsSettings


@pytest.fixture
def hsx(cli):
    """`hsx ARGS` in this process, with no HSX_* or AWS_* variable set (conftest's `cli`)."""
    return cli


def _declared(cls: type, only=lambda flag: True) -> tuple[set, set]:
    """(option flags, positionals) that config class `cls` declares, each as (name, dest)."""
    flags = [(flag.name, field.name, flag.positional) for field, flag in flag_fields(cls) if only(flag)]
    return {(n, d) for n, d, p in flags if not p}, {(n, d) for n, d, p in flags if p}


def _listed(parser: Parser) -> tuple[set, set]:
    """(option flags, positionals) as the Parser recorded them, each as (name, dest)."""
    return (
        {(max(action.option_strings, key=len), action.dest) for action in parser.hsx_flags},
        {(action.metavar, action.dest) for action in parser.hsx_positionals},
    )


def _nats_flags() -> set:
    return _declared(NatsSettings)[0]


def _commands(parser: Parser):
    """(words, parser) of every command that runs something: `status`, `dead retry`, ..."""
    for name, sub in parser.hsx_commands.items():
        if sub.hsx_commands:
            for action, leaf in sub.hsx_commands.items():
                yield (name, action), leaf
        else:
            yield (name,), sub


def test_every_commands_flags_are_its_configs_fields():
    parser = cli.build_parser()
    services = {name: config for name, config, _ in cli._SERVICES}
    seen = set()
    for words, sub in _commands(parser):
        if words[0] == "config":  # config show / example: they inspect the other commands
            continue
        seen.add(words)
        if words == ("up",):
            # The job's flags and the producer's own that its refusals advise (--replace-output, ...).
            job = _declared(cli.ProducerConfig, only=passed_to_producer)[0]
            assert ("--replace-output", "replace_output") in job
            expected = (_declared(UpConfig)[0] | job | (_nats_flags() - {("--nats", "url")}), set())
            assert ("--nats", "url") in expected[0]  # up's own --nats: a server instead of its own
        elif words[0] in services:
            flags, positionals = _declared(services[words[0]])
            expected = (flags | _nats_flags(), positionals)
        else:
            config = cli.COMMANDS[words].config
            flags, positionals = _declared(config)
            nats = {field.name for field in dataclasses.fields(config)} >= {"nats"}
            expected = (flags | (_nats_flags() if nats else set()), positionals)
        assert _listed(sub) == expected, words
    assert seen == {("up",), *((name,) for name in services), *cli.COMMANDS}


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ExportWithShards(ExportConfig):
    shards: int = option("--shards", default=4, parse=positive_int("--shards"), help="files per trainer shard")


def test_a_new_field_of_a_commands_config_is_its_flag_everywhere(hsx, monkeypatch, tmp_path):
    """The field alone: `hsx export --help`, `hsx config show export`, the job file and the
    built config have it, with no change to the command line's code."""
    command = cli.COMMANDS[("export",)]
    monkeypatch.setitem(cli.COMMANDS, ("export",), dataclasses.replace(command, config=_ExportWithShards))
    helped = hsx("export", "--help")
    assert helped.returncode == 0 and "--shards" in helped.stdout and "files per trainer shard" in helped.stdout
    target = ["export", str(tmp_path / "job"), "--to", "specforge-dflash", str(tmp_path / "out")]
    shown = hsx("config", "show", "--json", *target, "--shards", "8")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["settings"]["export.shards"] == {
        "value": 8,
        "source": "flag",
        "flag": "--shards",
        "env": None,
    }
    file = tmp_path / "hsx.toml"
    file.write_text("[export]\nshards = 0\n")
    assert_one_line_error(
        hsx("--config", str(file), "config", "show", *target), "[export] shards: --shards must be positive, got 0"
    )
    parser = cli.build_parser()
    args = parser.parse_args(target)
    resolve(parser, args, {})
    assert cli.build_command_config(parser, args).shards == 4


PRODUCE = ["--job", "j", "--model", "m", "--dataset", "d.jsonl", "--layers", "1", "--dest", "/tmp/hsx-nowhere"]


def test_a_check_across_flags_fails_config_show_as_it_fails_the_command(hsx):
    budget = ["--token-budget", "100", "--max-seq-len", "4096"]
    ran = hsx("produce", *PRODUCE, *budget)
    shown = hsx("config", "show", "produce", *PRODUCE, *budget)
    line = assert_one_line_error(ran, "--token-budget 100 is smaller than --max-seq-len 4096")
    assert assert_one_line_error(shown) == line
    assert shown.stdout == ""
    # A command whose required flags are not all given is shown as far as it goes.
    partial = hsx("config", "show", "--json", "produce", *budget)
    assert partial.returncode == 0, partial.stderr
    assert json.loads(partial.stdout)["settings"]["job.token_budget"]["value"] == 100


def test_status_checks_its_timeouts_wherever_they_come_from(hsx, tmp_path):
    assert_one_line_error(hsx("status", "--job", "j", "--timeout", "0"), "--timeout must be positive, got 0")
    assert_one_line_error(
        hsx("status", "--job", "j", "--sums-budget", "-1"), "--sums-budget must not be negative, got -1"
    )
    file = tmp_path / "hsx.toml"
    file.write_text("[status]\ntimeout = 0\n")
    for argv in (("status", "--job", "j"), ("config", "show", "status", "--job", "j")):
        assert_one_line_error(hsx("--config", str(file), *argv), "--timeout must be positive, got 0")


def test_config_show_makes_nothing_on_this_machine(hsx, tmp_path):
    """Building a worker's or up's config for its checks creates no spool and asks for no GPU."""
    spool, workdir = tmp_path / "spool", tmp_path / "work"
    assert hsx("config", "show", "consume", "--job", "j", "--spool", str(spool)).returncode == 0
    assert hsx("config", "show", "upload", "--job", "j", "--spool", str(spool)).returncode == 0
    assert hsx("config", "show", "up", "--workdir", str(workdir)).returncode == 0
    assert not spool.exists() and not workdir.exists()


def _config(argv: list[str], environ: dict | None = None):
    parser = cli.build_parser()
    args = parser.parse_args(argv)
    resolve(parser, args, environ or {})
    return cli.build_command_config(parser, args)


def test_a_repeated_flag_and_a_group_of_which_one_is_required(tmp_path):
    retry = _config(["dead", "retry", "--job", "j", "--seq", "3", "--seq", "5"])
    assert isinstance(retry, DeadRetryConfig)
    assert retry.seqs == (3, 5) and not retry.every_letter
    assert _config(["dead", "retry", "--job", "j", "--all"]).seqs is None
    with pytest.raises(SystemExit):  # neither --seq nor --all
        _config(["dead", "retry", "--job", "j"])
    source, out = tmp_path / "ckpt", str(tmp_path / "out")
    source.mkdir()
    every = _config(["sync", str(source), "--dest", out, "--every", "1h30m", "--prefix", "p"])
    assert isinstance(every, SyncConfig)
    assert (every.source, every.every_s, every.retries) == (source.resolve(), 5400.0, 5)
    assert str(every.dest) == (tmp_path / "out" / "p").resolve().as_uri()
    # --once wins over a file's [sync] every: one pass.
    file = tmp_path / "hsx.toml"
    file.write_text('[sync]\nevery = "30m"\n')
    assert _config(["--config", str(file), "sync", str(source), "--dest", out, "--once"]).every_s is None


def test_a_positional_is_the_command_lines_only(hsx, tmp_path):
    """SOURCE and OUT are not settings: not in config show, not keys of a file."""
    shown = hsx("config", "show", "--json", "export", "s3://b/p/job", "--to", "specforge-dflash", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    settings = json.loads(shown.stdout)["settings"]
    assert {name for name in settings if name.startswith("export.")} == {
        "export.to",
        "export.workers",
        "export.dtype",
        "export.json",
    }
    file = tmp_path / "hsx.toml"
    file.write_text('[export]\nsource = "s3://b/p/job"\n')
    assert_one_line_error(hsx("--config", str(file), "status", "--job", "j"), "[export] source: unknown key here")


def test_a_flags_own_error_names_it_once(hsx):
    """argparse's "argument --workers: " is left out when the parser's own message names the flag."""
    result = hsx("verify", "--job", "j", "--workers", "0")
    assert result.returncode == 2
    assert result.stderr == "hsx: error: --workers must be positive, got 0 (see: hsx verify --help)\n"
