"""The job file (`hsx --config hsx.toml COMMAND`): which table holds each flag, reading the TOML,
and checking every table and key name.

Keys are the long flag names with `_` (or `-`), in a table named after their command
(`[consume] spool_high_water`), except for what several commands share: `[nats]` holds the
connection (`url` is --nats, `user` is --nats-user, ...), `[job]` what defines the job (`name` is
--job, then `model`, `layers`, `token_budget`, ...), and the global `log_level` sits above every
table. So each setting has exactly one place in the file.

This module knows the layout and TOML. It knows neither argparse nor the environment, and it
does not convert values (hsx/config/settings.py does, with each flag's own parser). An error names the
file, the table and the key, never a value.
"""

import difflib
import tomllib
from dataclasses import dataclass
from pathlib import Path

from hsx.errors import HsxError

# The top of `hsx config example` (hsx/config/settings.py writes the keys from the flags).
EXAMPLE_HEADER = (
    "# A job file: `hsx --config hsx.toml COMMAND` (or HSX_CONFIG=hsx.toml hsx COMMAND).",
    "# Made by `hsx config example` from the flags themselves: every key a file may set, commented",
    "# out, with its flag, help and default (or an example value where there is no default).",
    "#",
    "# Every key is a long flag name (`_` or `-`), in the table of its command, except what several",
    "# commands share: [nats] (the connection) and [job] (what defines the job). A value means",
    "# exactly what it means on the command line (relative paths are relative to the working",
    "# directory, not to this file).",
    "#",
    "# Precedence: flag > environment variable > this file > default.",
    "# `hsx --config hsx.toml config show COMMAND` prints what a command would use and where each",
    "# value came from. No file is read unless named: hsx never picks up ./hsx.toml by itself.",
    "# An unknown table or key, or a value of the wrong type, is an error naming file, table and key.",
    "# Secrets ([nats] password, token) are better kept in the environment; a file that holds one",
    "# should be 0600. They are never printed: config show shows ***.",
)
TABLE_NOTES = {
    "nats": ("For `hsx up`: url is a server to use instead of starting one (as --nats and HSX_NATS_URL are).",),
    "job": ("Read by every command that takes --job (produce, consume, upload, monitor, status, verify, dead, up).",),
    "up": (
        "hsx up resolves [produce], [consume], [upload] and [monitor] for the processes it starts too,",
        "except what up sets itself (job, device, spool, interval, ...).",
    ),
    "sync": ("Has no --job, so [job] does not apply: dest here is where sync uploads.",),
}


@dataclass(frozen=True, order=True)
class Place:
    """Where a setting lives in the file: `table` is "" for the top level."""

    table: str
    key: str

    @property
    def dotted(self) -> str:
        """The TOML dotted key (`consume.device`), which is also how `hsx config show` names it."""
        return f"{self.table}.{self.key}" if self.table else self.key

    def __str__(self) -> str:
        return f"[{self.table}] {self.key}" if self.table else self.key


def place_of(command: str, key: str, *, job_key: str | None) -> Place:
    """The place of the flag whose name is `key` (`token_budget` for --token-budget) in `command`
    ("" for the global flags before the command). `job_key`: the flag defines the job, so it is
    read from [job] under that key; another command's --dest (hsx sync) is its own, in its table."""
    if not command:
        return Place("", key)
    if key == "nats":
        return Place("nats", "url")
    if key.startswith("nats_"):
        return Place("nats", key.removeprefix("nats_"))
    if job_key:
        return Place("job", job_key)
    return Place(command, key)


def read_toml(path: Path, *, given_by: str) -> dict:
    """The parsed file; a missing, unreadable or malformed file is a one-line HsxError.
    `given_by` says where the path came from (--config or HSX_CONFIG), for the error."""
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise HsxError(f"{path}: no such config file (from {given_by})") from None
    except IsADirectoryError:
        raise HsxError(f"{path}: is a directory, not a config file (from {given_by})") from None
    except OSError as exc:
        raise HsxError(f"{path}: cannot read the config file ({exc.strerror or exc}) (from {given_by})") from None
    except tomllib.TOMLDecodeError as exc:
        # tomllib's messages name the line and column, never the text there.
        raise HsxError(f"{path}: not valid TOML: {exc}") from None


def check_names(
    data: dict, path: Path, known: dict[Place, str], command_line_only: dict[Place, str]
) -> dict[Place, tuple[str, object]]:
    """Every value of the file by place, as (the key as written, value), after checking that each
    table and key is one of `known` ({place: its flag, e.g. "--nats-user"}); `command_line_only`
    are flags a file may not set, named in the error. Values are not checked here. A key spelled
    with `-` is the same key as with `_`, and so is a table (`[nats-config]`, a command's name)."""
    tables = {place.table for place in known if place.table}
    by_normal = {_normal(table): table for table in tables}
    found: dict[Place, tuple[str, object]] = {}
    for name, value in data.items():
        if isinstance(value, dict) and _normal(name) in by_normal:
            table = by_normal[_normal(name)]
            for key, inner in value.items():
                _add(found, Place(table, _normal(key)), key, inner, path, known, command_line_only)
        elif isinstance(value, dict) and Place("", _normal(name)) not in known:
            close = difflib.get_close_matches(_normal(name), sorted(tables), n=1)
            hint = f"did you mean [{close[0]}]?" if close else f"tables: {', '.join(_table_order(tables))}"
            raise HsxError(f"{path} [{name}]: unknown table ({hint})")
        else:
            _add(found, Place("", _normal(name)), name, value, path, known, command_line_only)
    return found


def _add(
    found: dict,
    place: Place,
    written: str,
    value: object,
    path: Path,
    known: dict[Place, str],
    command_line_only: dict[Place, str],
) -> None:
    where = f"{path} [{place.table}] {written}" if place.table else f"{path} {written}"
    if place not in known and place in command_line_only:
        raise HsxError(f"{where}: {command_line_only[place]} is given on the command line only, not in a file")
    if place not in known:
        raise HsxError(f"{where}: unknown key here ({_hint(place, known)})")
    if place in found:
        raise HsxError(f"{where}: given twice (as {found[place][0]} and {written})")
    found[place] = (written, value)


def _hint(place: Place, known: dict[Place, str]) -> str:
    flag = "--" + place.key.replace("_", "-")
    elsewhere = sorted({other for other, other_flag in known.items() if other_flag == flag or other.key == place.key})
    if elsewhere:
        return f"{known[elsewhere[0]]} is set as " + " or ".join(str(other) for other in elsewhere)
    here = sorted(other.key for other in known if other.table == place.table)
    close = difflib.get_close_matches(place.key, here, n=1)
    if close:
        return f"did you mean {close[0]}?"
    table = f"[{place.table}]" if place.table else "the top level"
    return f"keys in {table}: {', '.join(here)}" if here else f"{table} has no keys"


def _table_order(tables: set[str]) -> list[str]:
    shared = [name for name in ("nats", "job") if name in tables]
    return shared + sorted(tables - set(shared))


def _normal(name: str) -> str:
    return name.replace("-", "_")
