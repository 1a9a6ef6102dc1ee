"""The monitor's web page (`hsx monitor --http [ADDR:]PORT`): an aiohttp server in the monitor's own
event loop, read-only (GET and HEAD only), on 127.0.0.1 unless told otherwise.

- `/` the page of the job the monitor follows; `/jobs/<job>` the same page for another job of the
  same NATS (read by a `JobFollower` while a browser looks at it); `/static/...` its HTML, CSS and
  script, shipped in the package (no network needed).
- `/api/page?job=J`: the page's data (monitor/page.py); `/api/events?job=J`: the same as
  server-sent events, one per reading; `/api/status?job=J`: what `hsx status --json` prints;
  `/api/jobs`: the jobs the NATS jobs bucket holds.

It serves what it is handed (`publish`) and knows nothing of how a reading is made, except that
it asks monitor/pagefeed.py to follow another job when a browser asks for one.
"""

import asyncio
import contextlib
import json
import time
from pathlib import Path

from aiohttp import web
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from hsx.errors import HsxError
from hsx.logs import get_logger
from hsx.monitor.pagefeed import JobFollower
from hsx.wire.health import host_port, http_url
from hsx.wire.jobs import job_names, read_job_spec
from hsx.wire.topology import job_name

log = get_logger("hsx.monitor")

STATIC = Path(__file__).resolve().parent / "static"
# At most this many other jobs are followed at once; one nobody looked at for FOLLOW_IDLE_S stops.
MAX_FOLLOWED = 8
FOLLOW_IDLE_S = 60.0
# How long a request for a job not yet read waits for its first reading.
FIRST_READING_WAIT_S = 15.0
# A comment line on each open event stream this often, so that proxies keep it open.
KEEPALIVE_S = 15.0
_HEADERS = {
    # Nothing but the page's own files; no frame, no sniffing: the page shows a job, nothing more.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript", ".svg": "image/svg+xml"}


class Feed:
    """The latest page and status of one job, and an event that fires at the next."""

    def __init__(self) -> None:
        self.page: bytes | None = None
        self.status: bytes | None = None
        self.looked_at = time.monotonic()
        self.readers = 0  # open event streams
        self._next = asyncio.Event()

    def publish(self, page: dict, status: bytes) -> None:
        self.page, self.status = json.dumps(page, separators=(",", ":")).encode(), status
        self.wake()

    def wake(self) -> None:
        current, self._next = self._next, asyncio.Event()
        current.set()

    async def wait_next(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._next.wait(), timeout)
            return True
        except TimeoutError:
            return False


class WebServer:
    def __init__(self, *, job: str, interval_s: float, silent_after_s: float) -> None:
        self.job, self.interval_s, self.silent_after_s = job, interval_s, silent_after_s
        self.feeds: dict[str, Feed] = {job: Feed()}
        self.followers: dict[str, JobFollower] = {}
        self.js: JetStreamContext | None = None
        self.kv: KeyValue | None = None
        self.closing = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""
        self._janitor: asyncio.Task | None = None

    # ---- the monitor's side ----

    async def start(self, addr: str, port: int) -> str:
        app = web.Application()
        app.router.add_get("/", self._index)
        app.router.add_get("/jobs/{job}", self._index)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/page", self._page)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/api/events", self._events)
        app.router.add_get("/api/jobs", self._jobs)
        app.on_response_prepare.append(self._secure)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await self.runner.setup()
        try:
            await web.TCPSite(self.runner, addr, port).start()
        except OSError as exc:
            await self.runner.cleanup()
            raise HsxError(f"--http {host_port(addr, port)}: cannot listen ({exc.strerror or exc})") from None
        self.url = http_url(addr, port)
        self._janitor = asyncio.ensure_future(self._stop_idle_followers())
        return self.url

    def attach(self, js: JetStreamContext, kv: KeyValue) -> None:
        """The monitor's NATS session, once open: what other jobs are read through."""
        self.js, self.kv = js, kv

    def publish(self, job: str, page: dict, status: bytes) -> None:
        self.feeds.setdefault(job, Feed()).publish(page, status)

    async def close(self) -> None:
        self.closing.set()
        for feed in self.feeds.values():
            feed.wake()
        if self._janitor is not None:
            self._janitor.cancel()
        await asyncio.gather(*(follower.stop() for follower in self.followers.values()), return_exceptions=True)
        if self.runner is not None:
            await self.runner.cleanup()

    # ---- requests ----

    @staticmethod
    async def _secure(_request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(_HEADERS)

    async def _index(self, request: web.Request) -> web.StreamResponse:
        if "job" in request.match_info:
            self._job_of(request.match_info["job"])
        return web.FileResponse(
            STATIC / "index.html", headers={"Content-Type": "text/html", "Cache-Control": "no-cache"}
        )

    async def _static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        path = STATIC / name
        if "/" in name or name.startswith(".") or path.suffix not in _TYPES or not path.is_file():
            raise web.HTTPNotFound(text="no such file\n")
        return web.FileResponse(path, headers={"Content-Type": _TYPES[path.suffix], "Cache-Control": "no-cache"})

    def _job_of(self, text: str | None) -> str:
        if not text:
            return self.job
        try:
            return job_name(text)
        except (HsxError, ValueError) as exc:
            raise web.HTTPBadRequest(text=f"{exc}\n") from None

    async def _feed(self, request: web.Request, *, first: bool = True) -> Feed:
        """The feed of the job the request names (the monitor's own by default), following it
        when it is another; with `first`, its first reading waited for (503 past the wait)."""
        job = self._job_of(request.query.get("job"))
        if job != self.job:
            await self._follow(job)
        feed = self.feeds[job]
        feed.looked_at = time.monotonic()
        if not first:
            return feed
        if feed.page is None:
            await feed.wait_next(FIRST_READING_WAIT_S)
        if feed.page is None:
            raise web.HTTPServiceUnavailable(
                text=json.dumps({"error": f"no reading of job {job} yet"}), content_type="application/json"
            )
        return feed

    def _following(self, job: str) -> bool:
        follower = self.followers.get(job)
        return follower is not None and (follower.task is None or not follower.task.done())

    async def _follow(self, job: str) -> None:
        if self._following(job):
            return
        if self.js is None or self.kv is None:
            raise web.HTTPServiceUnavailable(text="not connected to NATS yet\n")
        if sum(self._following(name) for name in self.followers) >= MAX_FOLLOWED:
            raise web.HTTPServiceUnavailable(text=f"already following {MAX_FOLLOWED} other jobs; try again later\n")
        try:
            spec = await read_job_spec(self.kv, job)
        except HsxError as exc:  # a spec that does not decode: said, not a server error
            raise web.HTTPBadGateway(text=f"{exc}\n") from None
        if spec is None:
            raise web.HTTPNotFound(text=f"job {job} not found in KV bucket hsx_jobs\n")
        if self._following(job):  # another request started it meanwhile
            return
        self.feeds[job] = Feed()
        follower = JobFollower(
            self.js,
            self.kv,
            spec,
            interval_s=self.interval_s,
            silent_after_s=self.silent_after_s,
            publish=self.publish,
        )
        self.followers[job] = follower
        follower.start()
        log.info("page_follows_job", job=job)

    async def _stop_idle_followers(self) -> None:
        while True:
            await asyncio.sleep(FOLLOW_IDLE_S / 4)
            for job, follower in list(self.followers.items()):
                feed = self.feeds.get(job)
                idle = feed is None or (feed.readers == 0 and time.monotonic() - feed.looked_at > FOLLOW_IDLE_S)
                if idle or (follower.task is not None and follower.task.done()):
                    await follower.stop()
                    del self.followers[job]
                    self.feeds.pop(job, None)

    async def _page(self, request: web.Request) -> web.Response:
        feed = await self._feed(request)
        return web.Response(body=feed.page, content_type="application/json", headers={"Cache-Control": "no-cache"})

    async def _status(self, request: web.Request) -> web.Response:
        feed = await self._feed(request)
        return web.Response(
            body=feed.status + b"\n", content_type="application/json", headers={"Cache-Control": "no-cache"}
        )

    async def _jobs(self, _request: web.Request) -> web.Response:
        names = await job_names(self.kv) if self.kv is not None else []
        return web.json_response({"followed": self.job, "jobs": names})

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """One `data:` event per reading, the last one at once (or the first once there is one:
        a browser that opened the page before the job exists stays connected, as EventSource does
        not reconnect after an error status); a comment line every KEEPALIVE_S."""
        feed = await self._feed(request, first=False)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        feed.readers += 1
        try:
            if feed.page is not None:
                await response.write(b"data: " + feed.page + b"\n\n")
            while not self.closing.is_set():
                if await feed.wait_next(KEEPALIVE_S):
                    if self.closing.is_set():
                        break
                    await response.write(b"data: " + feed.page + b"\n\n")
                else:
                    await response.write(b": keep-alive\n\n")
                feed.looked_at = time.monotonic()
        except ConnectionResetError:  # the browser went away
            return response
        finally:
            feed.readers -= 1
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response
