"""Which value each flag takes, and where it came from: flag > environment > config file > default.

Every command's flags are declared on its config class (hsx/config/fields.py); `add_config_flags`
puts them on a `Parser` and `build_config` makes the config from the resolved values. `resolve`
fills in each flag not given from the environment, the job file (hsx/config/configfile.py) and the
declared default, checks the required ones and records each source for `hsx config show`
(`describe`); `hsx config example` writes the file (`example_file`). A wrong value is a one-line
HsxError naming the flag, the variable, or the file, table and key; a secret is never quoted.
"""

import argparse
import contextlib
import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hsx.config import configfile
from hsx.config.configfile import Place
from hsx.config.fields import Flag, flag_fields, key_of
from hsx.errors import HsxError

_CONFIG_DEST = "config"  # the global --config: where the file is; it is resolved before the file is read


def declare_env(parser: argparse.ArgumentParser, **variables: str) -> None:
    """Environment variable per flag dest, for the global flags that belong to no config: it sets
    the flag when the flag is not given."""
    for dest, variable in variables.items():
        _action(parser, dest).hsx_env = variable


def declare_command_line_only(parser: argparse.ArgumentParser, *dests: str) -> None:
    """Flags (of no config) that a config file may not set."""
    for dest in dests:
        _action(parser, dest).hsx_in_file = False


def add_config_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    defaults: Mapping[str, object] | None = None,
    only: Callable[[Flag], bool] = lambda _flag: True,
) -> None:
    """The flags of config class `cls` (hsx/config/fields.py) on `parser`, each with the field's
    name as its dest, so that `build_config` finds it. `defaults` gives a field another default
    on this command, on purpose (and makes a required one optional); `only` picks the flags."""
    defaults = defaults or {}
    groups: dict[str, _Group] = {}
    for field, flag in flag_fields(cls):
        if not only(flag):
            continue
        if flag.positional:  # argparse's own: command line only, required unless it has a default
            optional = field.default is not dataclasses.MISSING
            parser.add_argument(
                field.name,
                metavar=flag.name,
                help=flag.help,
                type=flag.parse,
                choices=flag.choices,
                **({"nargs": "?", "default": field.default} if optional else {}),
            )
            continue
        kwargs: dict = {"dest": field.name, "help": flag.help}
        if flag.example is not None:
            kwargs["example"] = flag.example
        boolean = field.type in (bool, "bool", bool | None, "bool | None")  # None: not set
        if flag.metavar or not (flag.choices or boolean):
            kwargs["metavar"] = flag.metavar or key_of(flag.name).upper()
        if field.name in defaults:
            kwargs["default"] = defaults[field.name]
        elif field.default is dataclasses.MISSING:
            kwargs["default"], kwargs["required"] = None, True
        else:
            kwargs["default"] = field.default
        if boolean:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = flag.parse
            kwargs["choices"] = flag.choices
            if flag.repeat:
                kwargs["action"] = "append"
        target = parser
        if flag.one_of:
            if flag.one_of not in groups:
                groups[flag.one_of] = parser.add_mutually_exclusive_group(required=True)
            target = groups[flag.one_of]
        action = target.add_argument(flag.name, **kwargs)
        action.hsx_key = flag.key
        if flag.env:
            action.hsx_env = flag.env
            if isinstance(action.help, str) and flag.env not in action.help:  # --help names every variable
                action.help = f"{action.help} (env {flag.env})"
        if flag.secret:
            action.hsx_redact = flag.secret
        if flag.command_line_only or flag.repeat:
            action.hsx_in_file = False
        if flag.job:
            action.hsx_job_key = flag.key


def build_config(cls: type, args: argparse.Namespace, **given: object):
    """Config class `cls` from the resolved flags in `args`, and `given` for its fields that are
    not flags (the NATS connection) or that the entry point finishes (a spool made absolute)."""
    values = {field.name: getattr(args, field.name) for field, _ in flag_fields(cls) if field.name not in given}
    for field, flag in flag_fields(cls):
        if flag.repeat and isinstance(values.get(field.name), list):
            values[field.name] = tuple(values[field.name])  # a frozen config holds no list
    return cls(**values, **given)


def argparse_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """`parse` as argparse calls a type: an HsxError becomes argparse's one-line flag error."""
    if getattr(parse, "hsx_converts", False):
        return parse

    def convert(text: str) -> object:
        try:
            return parse(text)
        except HsxError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value")  # argparse's "invalid <name> value"
    convert.expects = getattr(parse, "expects", None)
    convert.hsx_converts = True
    return convert


REQUIRED_GROUP = "required (from the flag, its environment variable or the job file)"


class Parser(argparse.ArgumentParser):
    """argparse, declared through its public methods, that lists what was declared on it: its
    flags (`hsx_flags`, in order), its positional arguments (`hsx_positionals`), its subcommands
    (`hsx_commands`, under `hsx_command_dest`) and its exclusive groups of which one flag is
    required (`hsx_one_required`). A flag error is one line (`hsx: error: ...`, exit 2) instead of
    a usage dump; subcommand parsers are Parsers too. Its help keeps the line breaks of its
    description and epilog (the examples), and lists the required flags, and the exclusive groups
    of which one is required, in a group of their own (REQUIRED_GROUP) after the positional
    arguments."""

    def __init__(self, *args, **kwargs) -> None:
        self.hsx_flags: list[argparse.Action] = []
        self.hsx_positionals: list[argparse.Action] = []
        self.hsx_commands: dict[str, Parser] = {}
        self.hsx_command_dest: str | None = None
        self.hsx_one_required: list[list[argparse.Action]] = []
        self._hsx_one_required_groups: list = []  # their argparse groups, for the usage line
        self._hsx_declaring = False  # argparse makes its own groups while it starts
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        # argparse lists its groups in the order they were made: this one right after its own
        # "positional arguments" and before "options" (empty, it is not shown).
        self._hsx_required = super().add_argument_group(REQUIRED_GROUP)
        self._action_groups.insert(1, self._action_groups.pop())
        self._hsx_declaring = True

    def format_usage(self) -> str:
        with self._required_shown():
            return super().format_usage()

    def format_help(self) -> str:
        with self._required_shown():
            return super().format_help()

    @contextlib.contextmanager
    def _required_shown(self):
        """argparse brackets every flag it does not require itself; these are required by
        `resolve` (from the flag, the environment or the file), so while the usage line is written
        they are argparse's required flags too: shown bare, one of a group as `(--a | --b)`."""
        flags = [action for action in self.hsx_flags if action.hsx_required]
        for item in (*flags, *self._hsx_one_required_groups):
            item.required = True
        try:
            yield
        finally:
            for item in (*flags, *self._hsx_one_required_groups):
                item.required = False

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        if kwargs.get("required") and args and str(args[0]).startswith("-"):
            return self._declare(self._hsx_required.add_argument, args, kwargs)
        return self._declare(super().add_argument, args, kwargs)

    def _declare(self, add, args: tuple, kwargs: dict, group: list | None = None) -> argparse.Action:
        if callable(kwargs.get("type")) and not isinstance(kwargs["type"], type):
            kwargs["type"] = argparse_type(kwargs["type"])  # a parser's HsxError is argparse's one-line error
        if not args or not str(args[0]).startswith("-"):
            action = add(*args, **kwargs)  # a positional: argparse's own, command line only
            self.hsx_positionals.append(action)
            return action
        if kwargs.get("action") in ("help", "version"):
            return add(*args, **kwargs)  # -h / --version: argparse's own
        # A required flag may still come from the environment or the file: `resolve` checks it.
        required = kwargs.pop("required", False)
        example = kwargs.pop("example", None)  # `hsx config example`'s value where there is no default
        action = add(*args, **kwargs)
        action.hsx_example = example
        # argparse gets its "absent" sentinel, so a flag in the namespace is one that was given;
        # the declared default (argparse's own for store_true and the like) is kept for `resolve`.
        action.hsx_default, action.hsx_required = action.default, required
        action.hsx_key = key_of(_flag(action))  # its key in the job file
        action.default = argparse.SUPPRESS
        if isinstance(action.help, str) and "%(default)s" in action.help:
            action.help = action.help.replace("%(default)s", str(action.hsx_default).replace("%", "%%"))
        self.hsx_flags.append(action)
        if group is not None:
            group.append(action)
        return action

    def add_argument_group(self, *args, **kwargs):
        group = super().add_argument_group(*args, **kwargs)
        return _Group(self, group, None) if self._hsx_declaring else group

    def add_mutually_exclusive_group(self, *, required: bool = False) -> "_Group":
        members: list[argparse.Action] = []
        if required:  # checked by `resolve`: the one flag may come from the environment or the file
            self.hsx_one_required.append(members)
            group = self._hsx_required.add_mutually_exclusive_group(required=False)
            self._hsx_one_required_groups.append(group)
            return _Group(self, group, members)
        return _Group(self, super().add_mutually_exclusive_group(required=False), members)

    def add_subparsers(self, **kwargs) -> "_Commands":
        self.hsx_command_dest = kwargs.get("dest")
        return _Commands(self, super().add_subparsers(**kwargs))

    def error(self, message: str):
        message = " ".join(message.split())
        # "argument --every: --every '3x': not a duration": a parser's own error names its flag.
        named, _, reason = message.partition(": ")
        if named.startswith("argument ") and reason.startswith(named.removeprefix("argument ").split("/")[-1] + " "):
            message = reason
        self.exit(2, f"hsx: error: {message} (see: {self.prog} --help)\n")


class _Group:
    """A flag group of a Parser whose flags the parser lists as its own."""

    def __init__(self, parser: Parser, group, members: list | None) -> None:
        self._parser, self._group, self._members = parser, group, members

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        return self._parser._declare(self._group.add_argument, args, kwargs, self._members)


class _Commands:
    """A Parser's subcommands, listed by name as they are added."""

    def __init__(self, parser: Parser, commands) -> None:
        self._parser, self._commands = parser, commands

    def add_parser(self, name: str, **kwargs) -> Parser:
        child = self._commands.add_parser(name, **kwargs)
        self._parser.hsx_commands[name] = child
        return child


@dataclass(frozen=True, kw_only=True)
class Setting:
    name: str  # its place in the config file, dotted: "consume.device", "log_level"
    flag: str  # "--device"
    env: str | None  # the variable that sets it, if any
    value: object
    source: str  # "flag", "env", "file" or "default"
    redact: Callable[[str], str] | None = None

    @property
    def shown(self) -> object:
        """The value as `hsx config show` prints it: secrets redacted, paths as text."""
        if self.value is None:
            return None
        if self.redact is not None:
            return self.redact(str(self.value))
        plain = isinstance(self.value, str | int | float | bool | list | tuple)
        return self.value if plain else str(self.value)  # a path, a destination: as text


@dataclass(frozen=True, kw_only=True)
class Resolution:
    command: str  # "consume", "dead list"
    config_file: Path | None
    settings: tuple[Setting, ...]
    missing: tuple[str, ...] = ()  # required flags that no layer set (resolved with require=False)


def resolve(
    parser: argparse.ArgumentParser, args: argparse.Namespace, environ: Mapping[str, str], *, require: bool = True
) -> Resolution:
    """Sets every flag of the chosen command on `args` (given, or from the environment, the file,
    the default) and `args.config` to the file read, if any, and says where each came from. With
    `require`, a required flag that no layer sets is an error as argparse would give it."""
    names, path = _chosen_path(parser, args)
    config_file, given_by = _config_file(parser, args, environ)
    from_file = _read_file(parser, config_file, given_by) if config_file else {}
    # hsx up hands the file on to the processes it starts.
    setattr(args, _CONFIG_DEST, str(config_file) if config_file else None)
    settings, missing = [], []
    for table, action in ((table, action) for table, sub in path for action in _flags(sub)):
        if action.dest == _CONFIG_DEST:
            continue
        place = _place(table, action)
        variable = getattr(action, "hsx_env", None)
        if action.dest in vars(args):
            value, source = getattr(args, action.dest), "flag"
        elif variable and environ.get(variable):
            value, source = _from_env(action, environ[variable], variable), "env"
        elif _in_file(action) and place in from_file:
            value, source = _from_file(action, *from_file[place]), "file"
        else:
            value, source = _default(action), "default"
        setattr(args, action.dest, value)
        if getattr(action, "hsx_required", False) and value is None:
            missing.append(_flag(action))
        settings.append(
            Setting(
                name=place.dotted,
                flag=_flag(action),
                env=variable,
                value=value,
                source=source,
                redact=getattr(action, "hsx_redact", None),
            )
        )
    if missing and require:
        path[-1][1].error(f"the following arguments are required: {', '.join(missing)}")
    for group in getattr(path[-1][1], "hsx_one_required", []) if require else []:
        if all(getattr(args, action.dest) in (None, False) for action in group):
            path[-1][1].error(f"one of the arguments {' '.join(_flag(action) for action in group)} is required")
    return Resolution(
        command=" ".join(names), config_file=config_file, settings=tuple(settings), missing=tuple(missing)
    )


def describe(resolution: Resolution, environment: Mapping[str, str | None], *, as_json: bool) -> str:
    """`hsx config show`: every setting, its (redacted) value, its source and the environment
    variable that sets it; `environment` is
    what other libraries read themselves (AWS_*), already redacted by the caller."""
    if as_json:
        return json.dumps(
            {
                "command": resolution.command,
                "config_file": str(resolution.config_file) if resolution.config_file else None,
                "settings": {
                    s.name: {"value": s.shown, "source": s.source, "flag": s.flag, "env": s.env}
                    for s in resolution.settings
                },
                "environment": dict(environment),
            },
            indent=2,
        )
    file = f"config file {resolution.config_file}" if resolution.config_file else "no config file"
    lines = [f"hsx {resolution.command} ({file}); precedence: flag > env > file > default"]
    width = max(len(s.name) for s in resolution.settings) + 2
    for s in sorted(resolution.settings, key=_table_first):
        origin = {"flag": s.flag, "env": s.env, "file": "file", "default": "default"}[s.source]
        source = s.source if origin == s.source else f"{s.source} {origin}"
        variable = f"  (env {s.env})" if s.env and s.source != "env" else ""  # where else it may come from
        lines.append(f"  {s.name:<{width}}{_text(s.shown):<32} {source}{variable}")
    if environment:
        lines.append("read by the S3 client itself (AWS_*):")
        lines += [f"  {name:<{width}}{_text(value)}" for name, value in environment.items()]
    return "\n".join(lines)


def example_file(parser: Parser) -> str:
    """`hsx config example`: a job file with every key a file may set, each commented out with its
    default (or, where it has none, an example value) and its flag's help, so that uncommented it
    is a valid file. A [job] key whose default differs between commands says so."""
    shared: dict[Place, list[tuple[str, argparse.Action]]] = {}
    for table, sub in _all_parsers(parser, ""):
        for action in _flags(sub):
            if _in_file(action):
                shared.setdefault(_place(table, action), []).append((table, action))
    tables = ["", "nats", "job", *(name for name in command_names(parser) if name != "config")]
    lines = [*configfile.EXAMPLE_HEADER, ""]
    for table in tables:
        places = [place for place in shared if place.table == table]
        if not places:
            continue
        if table:
            lines += ["", f"[{table}]"]
        lines += [f"# {note}" for note in configfile.TABLE_NOTES.get(table, ())]
        for place in places:
            users = shared[place]
            action = next((a for command, a in users if command != "up"), users[0][1])
            value = action.hsx_example if action.hsx_default is None else action.hsx_default
            if value is None:
                raise AssertionError(f"{_flag(action)} has neither a default nor an example for hsx config example")
            others = sorted(
                {
                    f"hsx {command}: {_toml(a.hsx_default)}"
                    for command, a in users
                    if a.hsx_default != action.hsx_default and a.hsx_default is not None
                }
            )
            about = " ".join((action.help or "").split()) if isinstance(action.help, str) else ""
            variable = getattr(action, "hsx_env", None)
            if variable and variable not in about:
                about = f"{about} (env {variable})".strip()
            if others:
                about = f"{about}; " + ", ".join(others) if about else ", ".join(others)
            lines.append(f"# {_flag(action)}: {about}" if about else f"# {_flag(action)}")
            lines.append(f"# {place.key} = {_toml(value)}")
    return "\n".join(lines) + "\n"


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def _table_first(setting: Setting) -> int:
    """Display order: the global flags, [nats], [job], then the command's own table."""
    table = setting.name.partition(".")[0] if "." in setting.name else ""
    return {"": 0, "nats": 1, "job": 2}.get(table, 3)


def _text(value: object) -> str:
    if value is None:
        return "-"
    if value == "":
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# -- the parser tree (what a Parser recorded) ----------------------------------------------------


def _flags(parser: Parser) -> list[argparse.Action]:
    return parser.hsx_flags


def _all_parsers(parser: Parser, table: str):
    """(table, parser) for the parser and every subcommand below it; a subcommand's flags live in
    the table of its top-level command (`dead list` and `dead retry` share [dead])."""
    yield table, parser
    seen = set()
    for name, child in parser.hsx_commands.items():
        if id(child) not in seen:  # aliases map to the same parser
            seen.add(id(child))
            yield from _all_parsers(child, table or name)


def command_names(parser: Parser) -> list[str]:
    """The top-level subcommands, in the order declared."""
    return list(parser.hsx_commands)


def _place(table: str, action: argparse.Action) -> Place:
    return configfile.place_of(table, action.hsx_key, job_key=getattr(action, "hsx_job_key", None))


def _chosen_path(parser: Parser, args: argparse.Namespace) -> tuple[list[str], list[tuple[str, Parser]]]:
    """The chosen subcommand names (["dead", "list"]) and [(table, parser)] from the top parser
    down to the chosen subcommand."""
    names, path, current = [], [("", parser)], parser
    while current.hsx_command_dest and getattr(args, current.hsx_command_dest, None):
        names.append(getattr(args, current.hsx_command_dest))
        current = current.hsx_commands[names[-1]]
        path.append((names[0], current))
    return names, path


def _action(parser: Parser, dest: str) -> argparse.Action:
    for action in parser.hsx_flags:
        if action.dest == dest:
            return action
    raise AssertionError(f"{parser.prog} has no flag with dest {dest!r}")


def _flag(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def _in_file(action: argparse.Action) -> bool:
    return getattr(action, "hsx_in_file", True)


# -- the config file -----------------------------------------------------------------------------


def _config_file(
    parser: argparse.ArgumentParser, args: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[Path | None, str]:
    if getattr(args, _CONFIG_DEST, None):
        return Path(getattr(args, _CONFIG_DEST)), "--config"
    variable = getattr(_action(parser, _CONFIG_DEST), "hsx_env", None)
    if variable and environ.get(variable):
        return Path(environ[variable]), variable
    return None, ""


def file_layout(parser: argparse.ArgumentParser) -> tuple[dict[Place, argparse.Action], dict[Place, str]]:
    """Every key a file may set, with the flag that reads it (the first command's, where several
    share it); and the flags a file may not set, by the place they would have."""
    layout: dict[Place, argparse.Action] = {}
    command_line_only: dict[Place, str] = {}
    for table, sub in _all_parsers(parser, ""):
        for action in _flags(sub):
            place = _place(table, action)
            if _in_file(action):
                layout.setdefault(place, action)
            else:
                command_line_only.setdefault(place, _flag(action))
    return layout, command_line_only


def _read_file(parser: argparse.ArgumentParser, path: Path, given_by: str) -> dict[Place, tuple[object, str]]:
    """Every value of the file with where it is written, for the error messages. The whole file is
    checked, not only the chosen command's tables: a typo in [upload] fails `hsx consume` too."""
    layout, command_line_only = file_layout(parser)
    written = configfile.check_names(
        configfile.read_toml(path, given_by=given_by),
        path,
        {place: _flag(action) for place, action in layout.items()},
        command_line_only,
    )
    values = {}
    for place, (key, raw) in written.items():
        where = f"{path} [{place.table}] {key}" if place.table else f"{path} {key}"
        _from_file(layout[place], raw, where)  # the check; each command converts with its own flag
        values[place] = (raw, where)
    return values


# -- converting values ---------------------------------------------------------------------------

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _kind(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "bool"  # store_true and the like
    if action.type is int or getattr(action.type, "expects", None) is int:
        return "int"
    if action.type is float or getattr(action.type, "expects", None) is float:
        return "float"
    return "text"


def _from_env(action: argparse.Action, text: str, variable: str) -> object:
    if _kind(action) == "bool":
        if text.strip().lower() in _TRUE + _FALSE:
            return text.strip().lower() in _TRUE
        raise HsxError(f"{variable}: expected 1 or 0, got {_quote(action, text)}")
    return _parse(action, text.strip(), variable)


def _from_file(action: argparse.Action, value: object, where: str) -> object:
    kind = _kind(action)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise HsxError(f"{where}: expected true or false, got {_quote(action, value)}")
    # A text flag takes a TOML integer too (spool_high_water = 1073741824), never a float.
    accepted = {"int": (int,), "float": (int, float), "text": (str, int)}[kind]
    if isinstance(value, bool) or not isinstance(value, accepted):
        raise HsxError(f"{where}: expected {_EXPECTED[kind]}, got {_quote(action, value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise HsxError(f"{where}: expected a finite number, got {_quote(action, value)}")
    return _parse(action, str(value), where)


_EXPECTED = {"int": "an integer", "float": "a number", "text": "a string"}


def _parse(action: argparse.Action, text: str, where: str) -> object:
    """`text` through the flag's own type and choices, as argparse would parse it."""
    kind = _kind(action)
    try:
        value = action.type(text) if callable(action.type) else text
    except argparse.ArgumentTypeError as exc:
        raise HsxError(f"{where}: {_unless_secret(action, str(exc))}") from None
    except HsxError as exc:
        raise HsxError(f"{where}: {_unless_secret(action, str(exc))}") from None
    except (TypeError, ValueError):
        raise HsxError(f"{where}: expected {_EXPECTED[kind]}, got {_quote(action, text)}") from None
    if action.choices is not None and value not in action.choices:
        raise HsxError(f"{where}: expected one of {', '.join(map(str, action.choices))}, got {_quote(action, text)}")
    return value


def _default(action: argparse.Action) -> object:
    default = action.hsx_default
    # argparse parses a text default with the flag's type; keep that behaviour.
    if isinstance(default, str) and callable(action.type):
        return action.type(default)
    return default


def _quote(action: argparse.Action, value: object) -> str:
    """The value for an error: JSON-quoted, or only its kind for a secret (or a table/array)."""
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array (write it as on the command line, e.g. a comma-separated string)"
    if getattr(action, "hsx_redact", None) is not None:
        kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
        return kinds.get(type(value), "a value") + " (not shown: secret)"
    return json.dumps(value) if isinstance(value, (str, int, float, bool)) else type(value).__name__


def _unless_secret(action: argparse.Action, message: str) -> str:
    return "not a valid value (not shown: secret)" if getattr(action, "hsx_redact", None) is not None else message
