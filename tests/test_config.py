"""The job file and the order of settings: flag > environment > file > default.

Most checks call `hsx.cli.main` in this process (no subprocess, no model: milliseconds each) and
read `hsx config show --json`; the environment is emptied of HSX_* and AWS_* variables first, so
only what a test sets counts. Two checks run the real CLI as a process: a consumer started with
only a job file binds to the file's job on the file's NATS server and spools where the file says,
and the one-line error format of a bad file.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_cli_errors import assert_one_line_error

from hsx.commands.child import order, read_order
from hsx.commands.cli import build_parser
from hsx.commands.up import UpConfig
from hsx.config.configfile import Place
from hsx.config.fields import key_of
from hsx.config.settings import file_layout, resolve
from hsx.exitcodes import STOPPED
from hsx.storage import encodings
from hsx.wire.natsconn import redact_url, split_servers

SECRETS = {  # each one a distinct string, so a leak names its source
    "file_password": "pw-from-file-Q7xk2",
    "url_password": "pw-in-url-R4nd9",
    "env_token": "tok-from-env-Z8wq1",
    "aws_secret": "aws-secret-M3vp6",
}


def _show(cli, *argv: str, env: dict | None = None) -> dict:
    """`hsx [global flags] config show --json COMMAND [flags]`: {setting: {value, source, ...}}."""
    split = argv.index("--")
    result = cli(*argv[:split], "config", "show", "--json", *argv[split + 1 :], env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["settings"]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# Each row: a setting, its value per layer, and its default. A layer is given or not; the value
# shown must be the highest layer given, with that layer as its source.
@dataclass
class Layers:
    name: str  # as `config show` names it (the file's dotted key)
    command: list[str]
    flag: list[str]  # the flag and its value, placed before or after the command as it belongs
    global_flag: bool
    env: tuple[str, str] | None
    file: str  # TOML for the file layer
    values: dict[str, object]  # layer -> the value config show must print


LAYERS = [
    Layers(
        "consume.device",
        ["consume"],
        ["--device", "cuda:1"],
        False,
        ("HSX_DEVICE", "cuda:2"),
        '[consume]\ndevice = "cuda:3"\n',
        {"flag": "cuda:1", "env": "cuda:2", "file": "cuda:3", "default": "cuda:0"},
    ),
    Layers(
        "consume.retry_delay",
        ["consume"],
        ["--retry-delay", "3"],
        False,
        ("HSX_RETRY_DELAY", "4.5"),
        "[consume]\nretry_delay = 5\n",
        {"flag": 3.0, "env": 4.5, "file": 5.0, "default": 2.0},
    ),
    Layers(
        "consume.compile",
        ["consume"],
        ["--compile"],
        False,
        ("HSX_COMPILE", "0"),
        "[consume]\ncompile = true\n",
        {"flag": True, "env": False, "file": True, "default": None},  # None: on with CUDA
    ),
    Layers(
        "consume.spool",
        ["consume"],
        ["--spool", "/s/flag"],
        False,
        ("HSX_SPOOL", "/s/env"),
        '[consume]\nspool = "/s/file"\n',
        {"flag": "/s/flag", "env": "/s/env", "file": "/s/file", "default": "hsx-spool"},
    ),
    Layers(
        "nats.url",
        ["status"],
        ["--nats", "nats://flag:1"],
        False,
        ("HSX_NATS_URL", "nats://env:2"),
        '[nats]\nurl = "nats://file:3"\n',
        {"flag": "nats://flag:1", "env": "nats://env:2", "file": "nats://file:3", "default": "nats://127.0.0.1:4222"},
    ),
    Layers(
        "nats.user",
        ["upload"],
        ["--nats-user", "flag-user"],
        False,
        ("HSX_NATS_USER", "env-user"),
        '[nats]\nuser = "file-user"\n',
        {"flag": "flag-user", "env": "env-user", "file": "file-user", "default": None},
    ),
    Layers(
        "log_level",
        ["monitor"],
        ["--log-level", "debug"],
        True,
        ("HSX_LOG_LEVEL", "warning"),
        'log_level = "error"\n',
        {"flag": "debug", "env": "warning", "file": "error", "default": "info"},
    ),
    Layers(
        "job.token_budget",
        ["produce"],
        ["--token-budget", "111"],
        False,
        None,
        "[job]\ntoken_budget = 222\n",
        {"flag": 111, "file": 222, "default": 16384},
    ),
    Layers(
        "job.name",
        ["consume"],
        ["--job", "from-flag"],
        False,
        None,
        '[job]\nname = "from-file"\n',
        {"flag": "from-flag", "file": "from-file", "default": None},
    ),
]


@pytest.mark.parametrize("layers", LAYERS, ids=lambda layers: layers.name)
def test_each_layer_beats_the_ones_below(layers, cli, tmp_path):
    file = _write(tmp_path / "hsx.toml", layers.file)
    present = [layer for layer in ("flag", "env", "file") if layer in layers.values]
    for mask in range(1 << len(present)):
        given = {layer for i, layer in enumerate(present) if mask & (1 << i)}
        before = ["--config", str(file)] if "file" in given else []
        after = list(layers.command)
        if "flag" in given:
            (before if layers.global_flag else after).extend(layers.flag)
        env = dict([layers.env]) if "env" in given else {}
        setting = _show(cli, *before, "--", *after, env=env)[layers.name]
        expected = next((layer for layer in ("flag", "env", "file") if layer in given), "default")
        assert setting["source"] == expected, (given, setting)
        assert setting["value"] == layers.values[expected], (given, setting)


def test_the_file_comes_from_HSX_CONFIG_unless_config_is_given(cli, tmp_path, monkeypatch):
    from_env = _write(tmp_path / "env.toml", '[consume]\ndevice = "cuda:5"\n')
    from_flag = _write(tmp_path / "flag.toml", '[consume]\ndevice = "cuda:6"\n')
    assert _show(cli, "--", "consume", env={"HSX_CONFIG": str(from_env)})["consume.device"]["value"] == "cuda:5"
    shown = _show(cli, "--config", str(from_flag), "--", "consume", env={"HSX_CONFIG": str(from_env)})
    assert shown["consume.device"]["value"] == "cuda:6"
    # No file is read unless one is named: not even ./hsx.toml.
    _write(tmp_path / "hsx.toml", '[consume]\ndevice = "cuda:7"\n')
    monkeypatch.chdir(tmp_path)
    assert _show(cli, "--", "consume")["consume.device"]["source"] == "default"


def test_keys_may_be_spelled_with_dashes_and_hsx_sync_keeps_its_own_dest(cli, tmp_path):
    file = _write(
        tmp_path / "hsx.toml",
        '[job]\ndest = "s3://job/out"\n[consume]\nspool-high-water = "10G"\n[sync]\ndest = "/backups"\n',
    )
    assert _show(cli, "--config", str(file), "--", "consume")["consume.spool_high_water"]["value"] == "10G"
    # sync has no --job: [job] dest is the job's destination, not where sync uploads to.
    shown = _show(cli, "--config", str(file), "--", "sync", str(tmp_path), "--once")
    assert shown["sync.dest"] == {"value": "/backups", "source": "file", "flag": "--dest", "env": None}


def test_a_required_flag_may_come_from_the_file(cli, tmp_path):
    missing = cli("consume", "--device", "cpu")
    assert missing.returncode == 2
    assert missing.stderr.strip() == "hsx: error: the following arguments are required: --job (see: hsx consume --help)"
    file = _write(tmp_path / "hsx.toml", '[job]\nname = "from-file"\n[sync]\ndest = "/d"\nonce = true\n')
    assert _show(cli, "--config", str(file), "--", "consume")["job.name"]["value"] == "from-file"
    # One of a required group of exclusive flags (sync --every / --once) may come from the file too.
    parser = build_parser()
    with_file = parser.parse_args(["--config", str(file), "sync", str(tmp_path)])
    resolve(parser, with_file, {})
    assert with_file.once is True and with_file.every_s is None and with_file.dest == "/d"
    without = parser.parse_args(["sync", str(tmp_path), "--dest", "/d"])
    with pytest.raises(SystemExit) as exited:
        resolve(parser, without, {})
    assert exited.value.code == 2


BAD_FILES = {
    "unknown key": ("[job]\ntoken_budgte = 5\n", "[job] token_budgte: unknown key here (did you mean token_budget?)"),
    "unknown table": ('[consumer]\ndevice = "cpu"\n', "[consumer]: unknown table (did you mean [consume]?)"),
    "key in the wrong table": (
        '[consume]\njob = "j"\n',
        "[consume] job: unknown key here (--job is set as [job] name)",
    ),
    "wrong type": ('[job]\ntoken_budget = "big"\n', '[job] token_budget: expected an integer, got "big"'),
    "float for an integer": ("[job]\nmax_seq_len = 4096.5\n", "[job] max_seq_len: expected an integer, got 4096.5"),
    "not positive": ("[job]\ntoken_budget = 0\n", "[job] token_budget: --token-budget must be positive, got 0"),
    "not a choice": (
        '[job]\ndtype = "fp8"\n',
        f'[job] dtype: expected one of {", ".join(encodings.names())}, got "fp8"',
    ),
    "not a boolean": ('[consume]\ncompile = "yes"\n', '[consume] compile: expected true or false, got "yes"'),
    "array for a list flag": ("[job]\nlayers = [1, 2]\n", "[job] layers: expected a string, got an array"),
    "command-line only": ("[dead]\nall = true\n", "[dead] all: --all is given on the command line only, not in a file"),
    "given twice": ("[job]\ntoken_budget = 1\ntoken-budget = 2\n", "[job] token-budget: given twice"),
    "bad TOML": ('[job]\nname = "unterminated\n', ": not valid TOML: "),
}


@pytest.mark.parametrize("case", BAD_FILES, ids=str)
def test_a_bad_file_is_one_line_naming_file_table_and_key(case, cli, tmp_path):
    text, needle = BAD_FILES[case]
    file = _write(tmp_path / "bad.toml", text)
    # Checked for every command, not only the one whose table is wrong: a typo fails at once.
    result = cli("--config", str(file), "status", "--job", "j")
    line = assert_one_line_error(result, f"{file}{needle}" if needle.startswith(":") else f"{file} {needle}")
    assert result.stdout == ""
    assert line == result.stderr.strip()


def test_a_missing_file_and_bad_environment_values_are_one_line(cli, tmp_path):
    missing = tmp_path / "nowhere.toml"
    assert_one_line_error(
        cli("--config", str(missing), "status", "--job", "j"), f"{missing}: no such config file (from --config)"
    )
    assert_one_line_error(cli("status", "--job", "j", env={"HSX_CONFIG": str(missing)}), "(from HSX_CONFIG)")
    assert_one_line_error(
        cli("consume", "--job", "j", env={"HSX_RETRY_DELAY": "soon"}), 'HSX_RETRY_DELAY: expected a number, got "soon"'
    )
    assert_one_line_error(
        cli("consume", "--job", "j", env={"HSX_COMPILE": "maybe"}), 'HSX_COMPILE: expected 1 or 0, got "maybe"'
    )


def test_the_real_cli_prints_one_line_for_a_bad_file(tmp_path):
    file = _write(tmp_path / "hsx.toml", '[job]\ntoken_budget = "big"\n')
    result = subprocess.run(
        [sys.executable, "-m", "hsx.cli", "--config", str(file), "produce"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_clean_env(),
    )
    assert result.returncode == 2
    assert result.stderr == f'hsx: error: {file} [job] token_budget: expected an integer, got "big"\n'


def _clean_env(**extra: str) -> dict:
    env = {name: value for name, value in os.environ.items() if not name.startswith(("HSX_", "AWS_"))}
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_secrets_never_appear_in_show_or_errors(cli, tmp_path):
    url = f"nats://hsx:{SECRETS['url_password']}@127.0.0.1:{_free_port()}"  # nothing listens there
    file = _write(
        tmp_path / "hsx.toml",
        f'[nats]\nurl = "{url}"\nuser = "hsx"\npassword = "{SECRETS["file_password"]}"\n[job]\nname = "j"\n',
    )
    env = {
        "HSX_NATS_TOKEN": SECRETS["env_token"],
        "AWS_SECRET_ACCESS_KEY": SECRETS["aws_secret"],
        "AWS_ACCESS_KEY_ID": "key-id-is-not-secret",
    }
    text = cli("--config", str(file), "config", "show", "upload", env=env)
    as_json = cli("--config", str(file), "config", "show", "--json", "upload", env=env)
    assert text.returncode == as_json.returncode == 0, text.stderr + as_json.stderr
    shown = json.loads(as_json.stdout)
    assert shown["settings"]["nats.password"] == {
        "value": "***",
        "source": "file",
        "flag": "--nats-password",
        "env": "HSX_NATS_PASSWORD",
    }
    assert shown["settings"]["nats.token"]["value"] == "***" and shown["settings"]["nats.token"]["source"] == "env"
    assert shown["settings"]["nats.url"]["value"] == url.replace(SECRETS["url_password"], "***")
    assert shown["environment"] == {"AWS_SECRET_ACCESS_KEY": "***", "AWS_ACCESS_KEY_ID": "key-id-is-not-secret"}
    assert "nats://hsx:***@127.0.0.1" in text.stdout
    # A real command with the same settings fails to connect; its error names the URL, redacted.
    refused = cli("--config", str(file), "status", env=env)
    assert_one_line_error(refused, "cannot connect to NATS at nats://hsx:***@127.0.0.1")
    # A secret of the wrong type is described, never quoted.
    wrong = _write(tmp_path / "wrong.toml", "[nats]\npassword = 987654.321\n")
    wrong_type = cli("--config", str(wrong), "status", "--job", "j")
    assert_one_line_error(wrong_type, "[nats] password: expected a string, got a number (not shown: secret)")
    pasted = _write(tmp_path / "pasted.toml", '[nats]\ncreds = """-----BEGIN NATS USER JWT-----\nabc.def\n"""\n')
    assert_one_line_error(
        cli("--config", str(pasted), "status", "--job", "j"),
        "[nats] creds: --nats-creds takes the path of a file, not the file's contents",
    )
    everything = "".join(r.stdout + r.stderr for r in (text, as_json, refused, wrong_type))
    for secret in [*SECRETS.values(), "987654"]:
        assert secret not in everything


def test_a_nats_url_without_a_scheme_or_with_a_bad_port_never_shows_its_password(cli):
    """nats-py takes `user:password@host:port` as a nats:// URL; it is redacted as one. A port
    that is not a number is one line naming --nats, not the redactor's traceback (issue 35, item 10)."""
    secret = SECRETS["url_password"]
    bare = f"alice:{secret}@127.0.0.1:{_free_port()}"  # nothing listens there
    shown = cli("config", "show", "--json", "status", env={"HSX_NATS_URL": bare})
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["settings"]["nats.url"]["value"] == bare.replace(secret, "***")
    refused = cli("status", "--job", "j", env={"HSX_NATS_URL": bare})
    assert_one_line_error(refused, f"cannot connect to NATS at {bare.replace(secret, '***')}")
    bad_port = cli("status", "--job", "j", "--nats", f"nats://alice:{secret}@127.0.0.1:42x22")
    assert_one_line_error(bad_port, "--nats nats://alice:***@127.0.0.1:42x22: the port is not a number")
    bad_scheme = cli("status", "--job", "j", "--nats", f"http://alice:{secret}@127.0.0.1:4222")
    assert_one_line_error(bad_scheme, "the scheme must be one of nats://")
    everything = "".join(r.stdout + r.stderr for r in (shown, refused, bad_port, bad_scheme))
    assert secret not in everything and "Traceback" not in everything


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://alice:Secret1,x@h:4222", "nats://alice:***@h:4222"),
        ("alice:Secret1,x@h:4222", "alice:***@h:4222"),
        ("nats://a:p1@h1:4222,nats://b:q,2@h2:4222", "nats://a:***@h1:4222,nats://b:***@h2:4222"),
        ("a:p1@h1:4222, b:q,2@h2", "a:***@h1:4222,b:***@h2"),
        ("nats://tok,en@h:4222", "nats://***@h:4222"),
        ("nats://a:p@ss@h:4222", "nats://a:***@h:4222"),  # an unencoded @: userinfo runs to the last one
        ("nats://h1:4222,nats://h2:4222", "nats://h1:4222,nats://h2:4222"),
    ],
)
def test_redaction_parses_userinfo_before_splitting_servers(url, shown):
    """RFC 3986 userinfo may hold commas: it runs to the last @ before its host, and the server
    list splits on commas outside it, so no part of a password is ever shown."""
    assert redact_url(url) == shown
    assert len(split_servers(url)) == shown.count(",") + 1


def test_a_comma_in_a_nats_password_is_never_shown(cli):
    secret = "Secret1"
    for url in (f"nats://alice:{secret},x@127.0.0.1:42x22", f"nats://alice:x,{secret}@127.0.0.1:42x22"):
        bad_port = cli("status", "--job", "j", "--nats", url)
        assert_one_line_error(bad_port, "--nats nats://alice:***@127.0.0.1:42x22: the port is not a number")
        assert secret not in bad_port.stdout + bad_port.stderr


def test_hsx_up_passes_trust_remote_code_and_the_file_to_what_it_starts(tmp_path):
    """up resolves each child's config once, as its own command would (flag > env > file >
    default), and hands it over whole: what up itself sets (job, spool, device) beats the file."""
    file = _write(
        tmp_path / "hsx.toml",
        '[job]\nname = "remote"\ntrust_remote_code = true\n[produce]\nreplicas = 3\n'
        '[consume]\nretry_delay = 7.0\nspool = "/not/this/one"\n[upload]\nprobe_every = 9.0\n'
        "[monitor]\nsilent_after = 11.0\n",
    )
    parser = build_parser()
    for argv, from_file in (
        (["--config", str(file), "up", "--workdir", str(tmp_path)], True),
        (["up", "--trust-remote-code", "--job", "remote", "--workdir", str(tmp_path)], False),
    ):
        args = parser.parse_args(argv)
        resolve(parser, args, {})
        cfg = UpConfig.from_args(parser, args, nats=None, environ={})
        assert (cfg.producer.job, cfg.producer.trust_remote_code) == ("remote", True)
        assert cfg.consumer.job == cfg.uploader.job == cfg.monitor.job == "remote"
        assert cfg.consumer.spool == cfg.uploader.spool == tmp_path.resolve() / "spool"
        assert cfg.producer.replicas == (3 if from_file else None)
        assert cfg.consumer.retry_delay_s == (7.0 if from_file else 2.0)
        assert cfg.uploader.probe_every_s == (9.0 if from_file else 30.0)
        assert cfg.monitor.silent_after_s == (11.0 if from_file else 30.0)
        assert cfg.monitor.until_done and cfg.consumer.node == cfg.uploader.node == "local"
        # What a child reads back is what up built, but for its own instance.
        for service_cfg in (cfg.producer, cfg.consumer, cfg.uploader, cfg.monitor):
            assert read_order(order(service_cfg, log_level="debug")) == (service_cfg, "debug")


def test_a_consumer_with_only_a_job_file_binds_to_the_files_job(nats_server, job_name, tmp_path):
    """The real effect: no --job, --nats, --spool, --device flag and no HSX_* variable."""
    spool = tmp_path / "spool-from-file"
    file = _write(
        tmp_path / "hsx.toml",
        f'[nats]\nurl = "{nats_server.url}"\n[job]\nname = "{job_name}"\n'
        f'[consume]\ndevice = "cpu"\nspool = "{spool}"\nnode = "filenode"\n',
    )
    log = tmp_path / "consumer.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "hsx.cli", "--config", str(file), "consume"],
            stdout=out,
            stderr=out,
            env=_clean_env(),
        )
    try:
        deadline = time.monotonic() + 90
        waiting = []
        while time.monotonic() < deadline and not waiting:
            assert process.poll() is None, log.read_text()
            records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
            waiting = [r for r in records if r.get("event") == "waiting_for_job_spec"]
            time.sleep(0.2)
        assert waiting, f"the consumer never waited for its job:\n{log.read_text()}"
        # Connected to the file's server, waiting for the file's job, spooling where the file says.
        assert waiting[0]["job"] == job_name
        assert waiting[0]["consumer"].startswith("filenode-")
        assert spool.is_dir()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == STOPPED, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_example_file_shows_every_key_with_a_valid_value(cli, tmp_path):
    """`hsx config example` comments out every key a file may set; uncommented, it is a valid file."""
    made = cli("config", "example")
    assert made.returncode == 0, made.stderr
    text = made.stdout
    uncommented = re.sub(r"^# (?=[a-z_]+ = )", "", text, flags=re.MULTILINE)
    data = tomllib.loads(uncommented)
    written = {Place(table, key) for table, keys in data.items() if isinstance(keys, dict) for key in keys}
    written |= {Place("", key) for key, value in data.items() if not isinstance(value, dict)}
    layout, _ = file_layout(build_parser())
    assert written == set(layout), (
        f"missing: {sorted(set(layout) - written)}, not keys: {sorted(written - set(layout))}"
    )
    file = _write(tmp_path / "every-key.toml", uncommented)
    for command in (["consume"], ["produce"], ["up"], ["monitor"], ["sync", str(tmp_path)], ["dead", "list"]):
        result = cli("--config", str(file), "config", "show", *command)
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("command", ["produce", "consume", "upload", "monitor"])
def test_every_setting_of_a_service_has_its_variable_and_config_show_lists_it(cli, command):
    """A batch scheduler configures a worker by its environment alone: every setting of produce,
    consume, upload and monitor that a job file may set has an HSX_* variable, which `--help`
    and `hsx config show` name; a variable set is the setting's value and its source."""
    parser = build_parser()
    command_line_only = {
        key_of(max(action.option_strings, key=len))
        for action in parser.hsx_commands[command].hsx_flags
        if not getattr(action, "hsx_in_file", True)
    }
    settings = _show(cli, "--", command, "--job", "j1")
    text = cli("config", "show", command, "--job", "j1")
    assert text.returncode == 0, text.stderr
    lines = {line.split()[0]: line for line in text.stdout.splitlines()[1:]}
    missing = []
    for name, setting in settings.items():
        if name.rpartition(".")[2] in command_line_only:
            assert setting["env"] is None, (name, setting)
            continue
        if setting["env"] is None or not setting["env"].startswith("HSX_"):
            missing.append(name)
            continue
        assert f"(env {setting['env']})" in lines[name], lines[name]
    assert not missing, f"hsx {command}: settings without an environment variable: {missing}"
    help_text = parser.hsx_commands[command].format_help()
    unnamed = [s["env"] for name, s in settings.items() if "." in name and s["env"] and s["env"] not in help_text]
    assert not unnamed, f"hsx {command} --help does not name {unnamed}"  # the global flags' are in hsx --help

    # Set by the environment alone, and said so.
    variables = {"HSX_JOB": "from-env"} | ({"HSX_UNTIL_DONE": "1"} if command != "produce" else {})
    shown = _show(cli, "--", command, env=variables)
    assert shown["job.name"] == {"value": "from-env", "source": "env", "flag": "--job", "env": "HSX_JOB"}
    if command != "produce":
        assert shown[f"{command}.until_done"]["value"] is True and shown[f"{command}.until_done"]["source"] == "env"


def test_hsx_up_http_gives_its_monitor_the_page_on_localhost(tmp_path):
    """`hsx up --http PORT` (or HSX_HTTP_PORT) is its monitor's --http; the page is on 127.0.0.1
    unless an address is given; a bad value is the flag's one-line error."""
    parser = build_parser()
    for argv, environ, listen in (
        (["up", "--workdir", str(tmp_path), "--http", "8080"], {}, ("127.0.0.1", 8080)),
        (["up", "--workdir", str(tmp_path)], {"HSX_HTTP_PORT": "0.0.0.0:9090"}, ("0.0.0.0", 9090)),
        (["up", "--workdir", str(tmp_path)], {}, None),
    ):
        args = parser.parse_args(argv)
        resolve(parser, args, environ)
        cfg = UpConfig.from_args(parser, args, nats=None, environ=environ)
        assert cfg.monitor.http_listen == listen, argv
        assert read_order(order(cfg.monitor, log_level="info"))[0].http_listen == listen


def test_a_bad_http_port_is_one_line(cli):
    for value, why in (("0", "a port from 1 to 65535"), (":80", "the address before the port is empty")):
        result = cli("monitor", "--job", "j", "--http", value)
        assert_one_line_error(result, f"--http {value!r}: ")
        assert why in result.stderr
