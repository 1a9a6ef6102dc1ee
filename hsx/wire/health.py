"""A worker's health for its scheduler's probes: `GET /readyz` and `GET /livez` on an optional
HTTP port (`--health-port`, off by default), served by the standard library's http.server on a
daemon thread.

`Health` is what the worker tells it: `ready()` once it can take work (a consumer: its model
loaded and warmed up and bound to its durable; an uploader: bound to its durable), `tick()` each
time its pull loop turns, `stalled` (what is past its bound, or None), `watch_stop(event)`: the
event a signal or the job's end sets, and `turn_bound_s`, how long one turn of its loop may take.

- /readyz: 200 while ready and not stopping; 503 before (starting: a model load takes minutes)
  and once stopping (draining: send it no work).
- /livez: 200 while starting (a scheduler's startup probe waits on /readyz instead), then while
  the loop has turned within `turn_bound_s()` and nothing is stalled; 503 otherwise: the worker
  should be restarted.

Each answer is a small JSON object saying why. Knows nothing of NATS, models or what the loop does.
"""

import asyncio
import contextlib
import ipaddress
import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hsx.errors import HsxError
from hsx.logs import get_logger

log = get_logger("hsx.health")

DEFAULT_ADDR = "127.0.0.1"


def parse_listen(flag: str) -> Callable[[str], str]:
    """`PORT` or `ADDR:PORT` (an IPv4 address, a host name, or an IPv6 address in brackets as in
    a URL: `[::]:9200`), checked, as given."""

    def parse(text: str) -> str:
        text = text.strip()
        addr, colon, port = text.rpartition(":")
        if not port.isdigit() or not 0 < int(port) <= 65535:
            raise HsxError(f"{flag} {text!r}: expected PORT or ADDR:PORT with a port from 1 to 65535")
        if colon and not addr.strip("[]"):
            raise HsxError(f"{flag} {text!r}: the address before the port is empty")
        if addr.startswith("[") and addr.endswith("]"):
            try:
                ipaddress.IPv6Address(addr[1:-1])
            except ValueError:
                raise HsxError(f"{flag} {text!r}: {addr} is not an IPv6 address") from None
        elif ":" in addr or "[" in addr or "]" in addr:
            raise HsxError(f"{flag} {text!r}: an IPv6 address goes in brackets, as in [::]:{port}")
        return text

    return parse


def host_port(addr: str, port: int) -> str:
    """`ADDR:PORT` as a URL writes it: an IPv6 address in brackets."""
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def http_url(addr: str, port: int) -> str:
    """The address as a browser takes it, ending in "/"."""
    return f"http://{host_port(addr, port)}/"


def listen_address(listen: str, default_addr: str) -> tuple[str, int]:
    """(address, port) of a `parse_listen` value, an IPv6 address without its brackets; the
    address `default_addr` when it names none."""
    addr, _, port = listen.rpartition(":")
    return (addr.removeprefix("[").removesuffix("]") or default_addr), int(port)


class Health:
    """What a worker says about itself; read by the probe server's thread."""

    def __init__(self, *, turn_bound_s: Callable[[], float], stalled: Callable[[], str | None] = lambda: None) -> None:
        self.turn_bound_s, self.stalled = turn_bound_s, stalled
        self._ready = False
        self._stop: asyncio.Event | None = None
        self._last_tick: float | None = None  # monotonic; None until the loop first turns

    def ready(self) -> None:
        self._ready = True

    def watch_stop(self, event: asyncio.Event) -> None:
        """The worker's stop event (read from the server's thread: its flag alone)."""
        self._stop = event

    @property
    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def tick(self) -> None:
        self._last_tick = time.monotonic()

    def readiness(self) -> tuple[bool, dict]:
        if self._stopping:
            return False, {"ready": False, "state": "stopping"}
        return self._ready, {"ready": self._ready, "state": "ready" if self._ready else "starting"}

    def liveness(self) -> tuple[bool, dict]:
        if self._last_tick is None:
            return True, {"live": True, "state": "starting"}
        since, bound = time.monotonic() - self._last_tick, self.turn_bound_s()
        said = {"last_turn_s": round(since, 1), "bound_s": round(bound, 1)}
        try:
            stalled = self.stalled()
        except Exception as exc:  # what is stalled is read from the worker's own state: never fatal here
            stalled = None
            said["stalled_unknown"] = str(exc) or type(exc).__name__
        if stalled:
            return False, {"live": False, "state": "stalled", "stalled": stalled, **said}
        if since > bound:
            return False, {"live": False, "state": "loop not turning", **said}
        return True, {"live": True, "state": "stopping" if self._stopping else "running", **said}


def _handler(health: Health) -> type[BaseHTTPRequestHandler]:
    class Probe(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if path == "/readyz":
                ok, body = health.readiness()
            elif path == "/livez":
                ok, body = health.liveness()
            else:
                ok, body = None, {"error": "not found", "paths": ["/readyz", "/livez"]}
            data = json.dumps(body).encode() + b"\n"
            self.send_response(404 if ok is None else 200 if ok else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - a probe every few seconds is not news
            pass

    return Probe


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class HealthServer:
    """`health` served on (addr, port) until `close()`; a port it cannot listen on is one HsxError."""

    def __init__(self, health: Health, *, addr: str, port: int, flag: str = "--health-port") -> None:
        server_class = _IPv6Server if ":" in addr else ThreadingHTTPServer
        try:
            self.server = server_class((addr, port), _handler(health))
        except OSError as exc:
            raise HsxError(f"{flag}: cannot listen on {host_port(addr, port)} ({exc.strerror or exc})") from None
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="hsx-health", daemon=True)
        self.thread.start()
        # Port 0: the one the system gave.
        self.url = http_url(addr, self.server.server_address[1]).removesuffix("/")
        log.info("health_serving", readyz=f"{self.url}/readyz", livez=f"{self.url}/livez")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def serving(health: Health, listen: tuple[str, int] | None):
    """`health` served on `listen` (address, port) for the block; nothing when None."""
    server = None if listen is None else HealthServer(health, addr=listen[0], port=listen[1])
    try:
        yield
    finally:
        if server is not None:
            server.close()
