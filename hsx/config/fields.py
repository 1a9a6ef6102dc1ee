"""A config field that is also a setting: its flag (or positional argument), environment variable,
help and parser are declared on the field itself, once, next to its default:

    token_budget: int = option("--token-budget", default=16384, parse=positive_int("--token-budget"),
                               job=True, help="...")

From these hsx/config/settings.py makes every command's flags, job-file keys, `hsx config show`
and config. A field without `option` (the NATS connection, a worker's instance) is not a flag: the
entry point supplies it. This module imports nothing of argparse or the environment.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

_METADATA_KEY = "hsx"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Flag:
    # The long flag, "--token-budget" (its key in the job file is token_budget); or, without
    # dashes, a positional argument named so in the usage ("SOURCE"): command line only.
    name: str
    help: str = ""
    env: str | None = None  # the environment variable that sets it, e.g. HSX_SPOOL
    # Text (from the command line, the environment or the file) -> the field's value; raises
    # argparse.ArgumentTypeError or HsxError with a one-line reason. `expects = int` on it: a file
    # must give a TOML integer. None: the text itself.
    parse: Callable[[str], Any] | None = None
    choices: tuple | None = None
    # The field defines the job (what the producer records in its spec): every command with this
    # flag reads it from the file's [job] table, under `file_key` or the flag's own name.
    job: bool = False
    file_key: str | None = None
    secret: Callable[[str], str] | None = None  # how `hsx config show` shows it (redacted)
    command_line_only: bool = False  # a job file may not set it
    metavar: str | None = None
    example: object = None  # `hsx config example`'s value for a flag without a default
    # The flag may be given again and again; the field is the tuple of the values (None: not
    # given). A file has no way to write a list: such a flag is command line only.
    repeat: bool = False
    # The flags of a command with the same `one_of` exclude each other on the command line, and
    # one of them is required (from the command line, the environment or the file).
    one_of: str | None = None

    @property
    def key(self) -> str:
        return self.file_key or key_of(self.name)

    @property
    def positional(self) -> bool:
        return not self.name.startswith("-")


def key_of(flag: str) -> str:
    """`--token-budget` -> `token_budget`: the flag's key in a job file."""
    return flag.removeprefix("--").replace("-", "_")


def option(name: str, *, default: Any = dataclasses.MISSING, **flag: Any) -> Any:
    """A dataclass field (keyword-only, like every hsx config) that is the flag `name`. Without
    a default the flag is required (from the command line, the environment or the file)."""
    return dataclasses.field(default=default, metadata={_METADATA_KEY: Flag(name=name, **flag)})


def flag_fields(cls: type) -> list[tuple[dataclasses.Field, Flag]]:
    """The fields of config class `cls` that are flags, in declaration order (inherited first)."""
    return [
        (field, field.metadata[_METADATA_KEY]) for field in dataclasses.fields(cls) if _METADATA_KEY in field.metadata
    ]
