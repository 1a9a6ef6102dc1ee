"""Connecting to NATS: one place for connection options, credentials, start-up errors and URL
redaction.

A service that cannot reach NATS at start-up fails at once with one line naming the URL (never a
secret). Once connected, it reconnects forever: a NATS restart mid-run is an outage to ride out,
not an exit. Credentials: user/password, token, a credentials file (JWT + nkey seed), and TLS
with a CA and optionally a client certificate.
"""

import asyncio
import os
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import nats
import nats.errors
from nats.aio.client import Client as NATS

from hsx.config.fields import flag_fields, option
from hsx.config.values import hide, path_not_contents
from hsx.errors import HsxError, Unavailable
from hsx.logs import get_logger
from hsx.wire import denials

log = get_logger("hsx.nats")

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
_STARTUP_ATTEMPTS = 3
# How long finishing a message (announce, report, ack) keeps trying through a NATS outage before
# leaving the message to its redelivery.
OUTAGE_RETRY_S = 120.0
# How long closing a connection may wait for what is in flight to flush (nats-py's own default,
# stated here: a worker's grace period after SIGTERM counts it; gpu_consumer/grace.py).
DRAIN_TIMEOUT_S = 30.0


def _userinfo_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) of each server's user information in a comma-separated server list, read once,
    before anything splits the list: RFC 3986 userinfo may hold commas and runs to the last `@`
    before its host. An `@` with no comma after the one before it belongs to the same userinfo
    (an unencoded `@` in a password); otherwise its userinfo starts after that comma, or after
    the `://` that follows it."""
    spans: list[tuple[int, int]] = []
    previous = -1  # the last @ seen
    for at, char in enumerate(text):
        if char != "@":
            continue
        comma = text.find(",", previous + 1, at) if previous >= 0 else -1
        if previous >= 0 and comma < 0:  # the same server's userinfo: it runs on to this @
            spans[-1] = (spans[-1][0], at)
        else:
            start = 0 if previous < 0 else comma + 1
            scheme = text.rfind("://", start, at)
            spans.append((start if scheme < 0 else scheme + 3, at))
        previous = at
    return spans


def split_servers(text: str) -> list[str]:
    """The server URLs of a comma-separated list, split on the commas outside user information."""
    inside = [False] * len(text)
    for start, end in _userinfo_spans(text):
        inside[start:end] = [True] * (end - start)
    servers, start = [], 0
    for at, char in enumerate(text):
        if char == "," and not inside[at]:
            servers.append(text[start:at])
            start = at + 1
    servers.append(text[start:])
    return [one.strip() for one in servers if one.strip()]


def redact_url(url: str) -> str:
    """The URL(s) with any password or token in them replaced, safe for logs and errors, whatever
    the text: with or without a scheme (nats-py takes `user:pw@host:4222` as a nats:// URL), with
    a port that is not a number, with commas or `@` in a password. Plain text work, which cannot
    fail: each server's user information is found once in the whole text (`_userinfo_spans`);
    its user name is kept, everything after its first `:` is replaced."""
    out, at = [], 0
    for start, end in _userinfo_spans(url):
        user, colon, _ = url[start:end].partition(":")
        out += [url[at:start], f"{user}:***" if colon else "***"]
        at = end
    out.append(url[at:])
    return ",".join(split_servers("".join(out)))


_SCHEMES = ("nats", "tls", "ws", "wss")


def nats_urls(text: str) -> str:
    """--nats: one or more comma-separated server URLs as nats-py takes them (`nats://`, `tls://`,
    `ws://`, `wss://`; a URL without a scheme is a nats:// one), each with a host and a numeric
    port if any; else a one-line HsxError showing the URL redacted."""
    servers = split_servers(text)
    if not servers:
        raise HsxError("--nats: no server URL given")
    for one in servers:
        shown = redact_url(one)
        split = urlsplit(one if "://" in one else f"nats://{one}")
        if split.scheme not in _SCHEMES:
            raise HsxError(f"--nats {shown}: the scheme must be one of {', '.join(s + '://' for s in _SCHEMES)}")
        try:
            split.port  # noqa: B018 - urllib checks the port when asked for it
        except ValueError:
            raise HsxError(f"--nats {shown}: the port is not a number from 0 to 65535") from None
        if not split.hostname:
            raise HsxError(f"--nats {shown}: no host in the URL")
    return text


@dataclass(frozen=True, kw_only=True)
class NatsSettings:
    """The connection; its flags are declared here once for every command (hsx/config/fields.py)."""

    url: str = option(
        "--nats",
        default=DEFAULT_NATS_URL,
        env="HSX_NATS_URL",
        parse=nats_urls,
        secret=lambda url: redact_url(url),
        help="NATS server URL(s), comma-separated (env HSX_NATS_URL, default %(default)s)",
    )
    user: str | None = option("--nats-user", default=None, env="HSX_NATS_USER", example="hsx", help="user name")
    password: str | None = option(
        "--nats-password", default=None, env="HSX_NATS_PASSWORD", secret=hide, example="", help="password"
    )
    token: str | None = option(
        "--nats-token", default=None, env="HSX_NATS_TOKEN", secret=hide, example="", help="token"
    )
    creds_file: str | None = option(
        "--nats-creds",
        default=None,
        env="HSX_NATS_CREDS",
        parse=path_not_contents("--nats-creds"),
        example="/etc/hsx/user.creds",
        help="credentials file (JWT + nkey), env HSX_NATS_CREDS",
    )
    tls_ca: str | None = option(
        "--nats-tls-ca",
        default=None,
        env="HSX_NATS_TLS_CA",
        example="/etc/hsx/ca.pem",
        help="CA bundle, env HSX_NATS_TLS_CA",
    )
    tls_cert: str | None = option(
        "--nats-tls-cert",
        default=None,
        env="HSX_NATS_TLS_CERT",
        example="/etc/hsx/client.pem",
        help="client certificate, env HSX_NATS_TLS_CERT",
    )
    tls_key: str | None = option(
        "--nats-tls-key",
        default=None,
        env="HSX_NATS_TLS_KEY",
        parse=path_not_contents("--nats-tls-key"),
        example="/etc/hsx/client.key",
        help="client key, env HSX_NATS_TLS_KEY",
    )
    inbox_prefix: str | None = option(
        "--nats-inbox-prefix",
        default=None,
        env="HSX_NATS_INBOX_PREFIX",
        example="_INBOX.hsx-consumer",
        parse=lambda text: subject_prefix(text, "--nats-inbox-prefix"),
        help="subject prefix of this process's reply inboxes, which its NATS user may subscribe to "
        "(hsx nats-config sets it per role), env HSX_NATS_INBOX_PREFIX, default _INBOX",
    )
    connect_timeout_s: float = 3.0

    def __repr__(self) -> str:  # the URL may carry a password
        return f"NatsSettings(url={redact_url(self.url)!r}, user={self.user!r}, creds_file={self.creds_file!r})"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **given: str) -> "NatsSettings":
        """The settings from the HSX_NATS_* variables the CLI reads (`given` fields first): for
        code outside the CLI, such as a trainer's `JobStream`."""
        environ = os.environ if environ is None else environ
        values = {field.name: environ[flag.env] for field, flag in flag_fields(cls) if flag.env in environ}
        return cls(**{**values, **{name: value for name, value in given.items() if value is not None}})

    def as_env(self) -> dict[str, str]:
        """The settings as the HSX_NATS_* variables the CLI reads, for child processes."""
        values = {flag.env: getattr(self, field.name) for field, flag in flag_fields(NatsSettings)}
        return {name: value for name, value in values.items() if value is not None}

    def connect_options(self) -> dict:
        options: dict = {}
        if self.user is not None:
            options["user"] = self.user
        if self.password is not None:
            options["password"] = self.password
        if self.token is not None:
            options["token"] = self.token
        if self.creds_file:
            options["user_credentials"] = self.creds_file
        if self.inbox_prefix:
            options["inbox_prefix"] = self.inbox_prefix
        if self.tls_ca or self.tls_cert:
            context = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key)
            options["tls"] = context
        return options


_SUBJECT_PREFIX_RE = re.compile(r"^[^.*>\s]+(\.[^.*>\s]+)*$")


def subject_prefix(text: str, flag: str) -> str:
    """A subject's leading tokens: no wildcard, no empty token, no white space."""
    if not _SUBJECT_PREFIX_RE.match(text):
        raise HsxError(f"{flag} {text!r}: give subject tokens separated by '.', without '*', '>' or spaces")
    return text


async def connect(settings: NatsSettings, *, name: str) -> NATS:
    last_error: list[BaseException] = []

    async def on_error(exc: BaseException) -> None:
        last_error.append(exc)
        if denials.note(exc, user=settings.user):  # logged there; the request that met it says so
            return
        if nc.is_connected or nc.is_reconnecting:
            log.warning("nats_error", error=str(exc) or type(exc).__name__)

    async def on_disconnect() -> None:
        if not (nc.is_draining or nc.is_closed):
            log.warning("nats_disconnected", url=redact_url(settings.url))

    async def on_reconnect() -> None:
        log.info("nats_reconnected", url=redact_url(settings.url))

    nc = NATS()
    servers = split_servers(settings.url)
    try:
        options = settings.connect_options()
    except (OSError, ssl.SSLError) as exc:
        raise HsxError(f"NATS TLS settings: cannot load certificate or CA ({exc})") from None
    try:
        await nc.connect(
            servers=servers,
            name=name,
            connect_timeout=settings.connect_timeout_s,
            drain_timeout=DRAIN_TIMEOUT_S,
            allow_reconnect=True,
            max_reconnect_attempts=_STARTUP_ATTEMPTS,
            reconnect_time_wait=0.5,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            **options,
        )
    except (TimeoutError, nats.errors.NoServersError, OSError, nats.errors.Error) as exc:
        refused = [e for e in last_error if "authorization" in str(e).lower() or "authentication" in str(e).lower()]
        if refused:
            raise HsxError(
                f"NATS at {redact_url(settings.url)} refused the credentials ({str(refused[-1]).removeprefix('nats: ')}); "
                "check HSX_NATS_USER/HSX_NATS_PASSWORD, HSX_NATS_TOKEN or HSX_NATS_CREDS"
            ) from None
        cause = last_error[-1] if last_error else exc
        reason = getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
        raise Unavailable(
            f"cannot connect to NATS at {redact_url(settings.url)} ({reason}); "
            "start a nats-server with JetStream (-js) or pass --nats URL / set HSX_NATS_URL"
        ) from None
    # Bounded attempts were for start-up only; from here on an outage is waited out.
    nc.options["max_reconnect_attempts"] = -1
    nc.options["reconnect_time_wait"] = 1.0
    return nc


# What a publish, request or ack raises while NATS is away: a timeout, a client error (no
# connection, reconnecting, closed), or InvalidStateError from a reply future that the client's
# teardown resolved after its timeout (nats-py, a connection closed while NATS is down). Not a
# bug: the message is left to its redelivery, and a line without a traceback says so.
NATS_OUTAGE_ERRORS = (TimeoutError, nats.errors.Error, asyncio.InvalidStateError)


async def through_outage(
    operation: Callable[[], Awaitable],
    *,
    what: str,
    stopping: asyncio.Event | None = None,
    give_up_after_s: float = OUTAGE_RETRY_S,
    retry_s: float = 1.0,
):
    """Await `operation()` (an idempotent publish or ack) until it succeeds, riding out a NATS
    outage: a disconnect, a server restart, JetStream not answering yet. Without this, one
    failed publish or ack while finishing a message would leave the message to its ack wait
    (a minute or more) and redo its work. Raises the last error once `give_up_after_s` have
    passed or `stopping` is set; the message is then redelivered as usual."""
    started = time.monotonic()
    while True:
        try:
            return await operation()
        except NATS_OUTAGE_ERRORS as exc:
            denials.raise_if_denied(started, what=what)  # no outage: this user may not do it
            if time.monotonic() - started >= give_up_after_s or (stopping is not None and stopping.is_set()):
                raise
            log.warning("nats_retry", what=what, error=str(exc) or type(exc).__name__, retry_in_s=retry_s)
            await asyncio.sleep(retry_s)


async def close_connection(nc: NATS) -> None:
    """Close `nc` whatever state it is in, at the end of a command or service. Drain (finish what
    is in flight) when connected; during an outage `drain()` raises ConnectionReconnectingError and
    there is nothing to drain to, so just close: a process asked to stop while NATS is down still
    exits cleanly, its unacked messages are redelivered as usual."""
    if nc.is_closed:
        return
    if nc.is_connected:
        try:
            await nc.drain()
            return
        except (TimeoutError, nats.errors.Error, OSError) as exc:  # the server went away mid-drain
            log.warning("nats_drain_failed", error=str(exc) or type(exc).__name__)
    try:
        await nc.close()
    except (TimeoutError, nats.errors.Error, OSError) as exc:
        log.warning("nats_close_failed", error=str(exc) or type(exc).__name__)
