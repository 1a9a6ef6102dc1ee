"""Parsers of flag values: text (from the command line, the environment or the job file) to a
value, or a one-line HsxError that names the flag. hsx/config/fields.py declares which flag
uses which; `expects` on a parser says what TOML type a job file must give."""

import re
from collections.abc import Callable

from hsx.errors import HsxError


def hide(_value: str) -> str:
    """The redaction of a secret with nothing in it worth showing (a password, a token)."""
    return "***"


def positive_int(flag: str) -> Callable[[str], int]:
    """The parser of a positive integer flag; its error names the flag."""
    return _integer(flag, minimum=1, below="must be positive")


def count(flag: str) -> Callable[[str], int]:
    """The parser of an integer flag that may be 0 (none); its error names the flag."""
    return _integer(flag, minimum=0, below="must be 0 or more")


def _integer(flag: str, *, minimum: int, below: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise HsxError(f"{flag} must be an integer, got {text!r}") from None
        if value < minimum:
            raise HsxError(f"{flag} {below}, got {value}")
        return value

    parse.expects = int  # a config file must give a TOML integer, not "16384"
    return parse


def positive_float(flag: str, unit: str = "seconds") -> Callable[[str], float]:
    """The parser of a positive number flag (a duration in `unit`); its error names the flag."""

    def parse(text: str) -> float:
        value = float(text)  # a ValueError: "expected a number" / argparse's "invalid float value"
        if not 0 < value < float("inf"):
            raise HsxError(f"{flag} must be a positive number of {unit}, got {text}")
        return value

    parse.expects = float
    parse.__name__ = "float"
    return parse


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhd]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, flag: str) -> float:
    """`90`, `90s`, `30m`, `2h`, `1d`, `1h30m`, `1.5h` -> seconds; anything else is a one-line error."""
    raw = text.strip().lower()
    parts = _DURATION_PART.findall(raw)
    if not raw or "".join(number + unit for number, unit in parts) != raw:
        raise HsxError(f"{flag} {text!r}: not a duration (e.g. 90s, 30m, 2h, 1h30m)")
    seconds = sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    if seconds <= 0:
        raise HsxError(f"{flag} {text!r}: must be longer than zero")
    return seconds


def duration(flag: str) -> Callable[[str], float]:
    """The parser of a duration flag (`parse_duration`); its error names the flag."""

    def parse(text: str) -> float:
        return parse_duration(text, flag)

    return parse


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str, flag: str) -> int:
    """A byte count: 1048576, 500G, 2T (binary units; a trailing B or iB is allowed)."""
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = raw[-1] if raw and raw[-1] in _SIZE_UNITS else ""
    try:
        value = float(raw[: len(raw) - len(unit)]) * _SIZE_UNITS[unit]
    except ValueError:
        raise HsxError(f"{flag} {text!r}: not a size (e.g. 500G, 2T, 1048576)") from None
    if value <= 0:
        raise HsxError(f"{flag} {text!r}: must be positive")
    return int(value)


def size_or_auto(flag: str) -> Callable[[str], str]:
    """A byte count as written (checked with parse_size, so `hsx config show` shows "200G"), or
    "auto" for the entry point to measure."""

    def parse(text: str) -> str:
        if text.strip().lower() == "auto":
            return "auto"
        parse_size(text, flag)
        return text

    return parse


def port_or_off(flag: str) -> Callable[[str], int]:
    """A TCP port number to listen on, or 0 for no listener."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise HsxError(f"{flag} must be a port number, got {text!r}") from None
        if not 0 <= value <= 65535:
            raise HsxError(f"{flag} must be 0 (off) to 65535, got {value}")
        return value

    parse.expects = int
    return parse


def path_not_contents(flag: str) -> Callable[[str], str]:
    """A file path flag that must never hold the file's contents: a pasted credentials file or key
    would then be shown as a value. The error does not quote the value."""

    def parse(text: str) -> str:
        if "\n" in text or "-----BEGIN" in text:
            raise HsxError(f"{flag} takes the path of a file, not the file's contents")
        return text

    return parse
