"""Connecting to NATS: one place for connection options, start-up errors and URL redaction.

A service that cannot reach NATS at start-up fails at once with one line naming the URL. Once
connected, it reconnects forever: a NATS restart mid-run is an outage to ride out, not an exit.
"""

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import nats
import nats.errors
import structlog
from nats.aio.client import Client as NATS

from hsx.errors import HsxError

log = structlog.get_logger("hsx.nats")

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
_STARTUP_ATTEMPTS = 3


@dataclass(frozen=True, kw_only=True)
class NatsSettings:
    url: str = DEFAULT_NATS_URL
    connect_timeout_s: float = 3.0


def redact_url(url: str) -> str:
    """The URL with any password or token in it replaced, safe for logs and errors."""
    parts = []
    for one in url.split(","):
        split = urlsplit(one.strip())
        if split.username is not None or split.password is not None:
            host = split.hostname or ""
            if split.port:
                host = f"{host}:{split.port}"
            user = "***" if split.password is None else f"{split.username}:***"
            one = urlunsplit((split.scheme, f"{user}@{host}", split.path, split.query, split.fragment))
        parts.append(one.strip())
    return ",".join(parts)


async def connect(settings: NatsSettings, *, name: str) -> NATS:
    last_error: list[BaseException] = []

    async def on_error(exc: BaseException) -> None:
        last_error.append(exc)
        if nc.is_connected or nc.is_reconnecting:
            log.warning("nats_error", error=str(exc) or type(exc).__name__)

    async def on_disconnect() -> None:
        if not (nc.is_draining or nc.is_closed):
            log.warning("nats_disconnected", url=redact_url(settings.url))

    async def on_reconnect() -> None:
        log.info("nats_reconnected", url=redact_url(settings.url))

    nc = NATS()
    servers = [s.strip() for s in settings.url.split(",") if s.strip()]
    try:
        await nc.connect(
            servers=servers,
            name=name,
            connect_timeout=settings.connect_timeout_s,
            allow_reconnect=True,
            max_reconnect_attempts=_STARTUP_ATTEMPTS,
            reconnect_time_wait=0.5,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
    except (nats.errors.NoServersError, OSError, asyncio.TimeoutError) as exc:
        cause = last_error[-1] if last_error else exc
        reason = getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
        raise HsxError(
            f"cannot connect to NATS at {redact_url(settings.url)} ({reason}); "
            "start a nats-server with JetStream (-js) or pass --nats URL / set HSX_NATS_URL"
        ) from None
    # Bounded attempts were for start-up only; from here on an outage is waited out.
    nc.options["max_reconnect_attempts"] = -1
    nc.options["reconnect_time_wait"] = 1.0
    return nc
