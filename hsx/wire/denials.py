"""Permission violations the NATS server reports on this process's connections: the NATS user
asked for something its permissions do not allow (each role's: hsx/wire/permissions.py).

The server answers such a publish or request with nothing but an asynchronous error, so a
request times out as it would in an outage. `note` keeps the error as it arrives (the error
callback of hsx/wire/natsconn.py `connect`) and logs it once per subject; the code that saw a
timeout asks `raise_if_denied(started)` and stops with one line naming the subject, instead of
waiting out an outage that is not one. It knows the server's error text, not what was asked.
"""

import time

from hsx.errors import HsxError
from hsx.logs import get_logger

log = get_logger("hsx.nats")

_MARK = "permissions violation"
# (when, the server's words, the user), oldest first; one process holds few connections, and a
# denial is a configuration error, so the list stays short.
_noted: list[tuple[float, str, str | None]] = []
_GUIDE = (
    "these credentials do not cover this command: each role has its own NATS user "
    '(hsx nats-config; docs/operations/roles.md, "Least privilege: one NATS user per role")'
)


class PermissionDenied(HsxError):
    """The NATS server refused this role's user a subject the command needs."""


def is_denial(exc: BaseException) -> bool:
    return _MARK in str(exc).lower()


def note(exc: BaseException, *, user: str | None) -> bool:
    """Keep `exc` if it is a permission violation (True), logged the first time its words are seen."""
    if not is_denial(exc):
        return False
    words = str(exc).removeprefix("nats: ").strip()
    if all(seen != words for _, seen, _ in _noted):
        log.error("nats_permission_denied", denied=words, user=user, hint=_GUIDE)
    _noted.append((time.monotonic(), words, user))
    del _noted[:-64]
    return True


def since(started: float, *, about: str = "") -> str | None:
    """The first violation noted at or after `started` (a time.monotonic()) whose words contain
    `about` (nats-py gives the server's words in lower case), as one line naming the user; None
    when there is none."""
    for when, words, user in _noted:
        if when >= started and about.lower() in words.lower():
            return f"{words} (NATS user {user})" if user else words
    return None


def denied(started: float, *, what: str, about: str = "") -> PermissionDenied | None:
    """The one-line error of the first violation noted since `started` (see `since`), if any."""
    found = since(started, about=about)
    return None if found is None else PermissionDenied(f"NATS refused {what}: {found}; {_GUIDE}")


def raise_if_denied(started: float, *, what: str, about: str = "") -> None:
    error = denied(started, what=what, about=about)
    if error is not None:
        raise error
