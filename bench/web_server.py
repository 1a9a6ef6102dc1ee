"""Benchmark: which HTTP server `hsx monitor --http` runs on. The monitor is one asyncio loop (nats-py)
that must keep reading the job while it serves the page, so each candidate serves the same routes
from a process shaped like it: an asyncio loop whose "reading" task sleeps 10 ms at a time and
records how late it wakes (the loop's lag: what a busy server takes from the monitor).

Candidates: aiohttp (in the loop: AppRunner + TCPSite), Starlette under uvicorn (in the loop:
`uvicorn.Server.serve()` as a task), and the standard library's ThreadingHTTPServer on a thread
(as prometheus_client serves /metrics today), sharing the loop's data through the GIL.

For each, in a fresh interpreter: the seconds its imports take, the resident memory it adds
(VmRSS after import and start, less before), then --requests GETs of a --body-kb JSON document
(the page's data at 64 workers is about 20 KB) from --clients keep-alive connections of another
process; the server's CPU seconds per 1,000 requests (/proc/<pid>/stat utime + stime), requests
per second, and the loop's lag meanwhile (p99 and max, ms). Also the installed size of each
candidate's distributions that hsx does not already have. Prints one JSON object.

Run: .venv/bin/python bench/web_server.py [--requests 4000] [--clients 8] [--body-kb 20]
Linux only (reads /proc).
"""

import argparse
import asyncio
import http.client
import importlib.metadata as metadata
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

CANDIDATES = ("aiohttp", "starlette-uvicorn", "stdlib")
# What each adds to hsx's own dependencies (already there: anyio, h11, idna, sniffio through httpx).
DISTRIBUTIONS = {
    "aiohttp": ("aiohttp", "aiohappyeyeballs", "aiosignal", "attrs", "frozenlist", "multidict", "propcache", "yarl"),
    "starlette-uvicorn": ("starlette", "uvicorn", "click"),
    "stdlib": (),
}


def _rss_kb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the server side (a child process) ----


def serve(kind: str, port: int, body_kb: int) -> None:
    rss_before = _rss_kb()
    began = time.perf_counter()
    if kind == "aiohttp":
        from aiohttp import web
    elif kind == "starlette-uvicorn":
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import Response
        from starlette.routing import Route
    else:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import_s = time.perf_counter() - began
    body = json.dumps({"workers": [{"instance": f"node-{i}", "x": "y" * 200} for i in range(body_kb * 4)]}).encode()
    body = body[: body_kb * 1024 - 2] + b"]}" if len(body) > body_kb * 1024 else body
    lags: list[float] = []

    async def reading() -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - start - 0.01)

    async def main() -> None:
        asyncio.ensure_future(reading())
        if kind == "aiohttp":

            async def status(_request):
                return web.Response(body=body, content_type="application/json")

            app = web.Application()
            app.router.add_get("/api/status", status)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        elif kind == "starlette-uvicorn":

            async def status(_request):
                return Response(body, media_type="application/json")

            app = Starlette(routes=[Route("/api/status", status)])
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
            server.install_signal_handlers = lambda: None  # older uvicorn; newer ones ask nothing of the loop
            asyncio.ensure_future(server.serve())
        else:

            class Handler(BaseHTTPRequestHandler):
                protocol_version = "HTTP/1.1"

                def do_GET(self):  # noqa: N802
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

                def log_message(self, *args):
                    pass

            httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
            httpd.daemon_threads = True
            threading.Thread(target=httpd.serve_forever, daemon=True).start()
        await asyncio.sleep(0.5)
        print(json.dumps({"ready": True, "import_s": import_s, "rss_mb": (_rss_kb() - rss_before) / 1024}), flush=True)
        loop = asyncio.get_running_loop()
        command = await loop.run_in_executor(None, sys.stdin.readline)  # "lags\n" when the load is over
        while command.strip() == "reset":
            lags.clear()
            print(json.dumps({"reset": True}), flush=True)
            command = await loop.run_in_executor(None, sys.stdin.readline)
        ordered = sorted(lags)
        print(
            json.dumps(
                {
                    "lag_p99_ms": 1000 * ordered[int(0.99 * (len(ordered) - 1))] if ordered else None,
                    "lag_max_ms": 1000 * ordered[-1] if ordered else None,
                }
            ),
            flush=True,
        )

    asyncio.run(main())


# ---- the load and the report ----


def _load(port: int, requests: int, clients: int) -> float:
    """Wall seconds for `requests` GETs over `clients` keep-alive connections, on threads of this process."""
    per_client = requests // clients
    errors: list[BaseException] = []

    def client() -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            for _ in range(per_client):
                conn.request("GET", "/api/status")
                response = conn.getresponse()
                response.read()
                assert response.status == 200
            conn.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - began


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _installed_mb(names: tuple[str, ...]) -> float:
    total = 0
    for name in names:
        dist = metadata.distribution(name)
        for file in dist.files or []:
            try:
                total += os.path.getsize(dist.locate_file(file))
            except OSError:
                pass
    return round(total / 2**20, 2)


def measure(kind: str, *, requests: int, clients: int, body_kb: int) -> dict:
    port = _free_port()
    child = subprocess.Popen(
        [sys.executable, __file__, "serve", "--kind", kind, "--port", str(port), "--body-kb", str(body_kb)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        started = json.loads(child.stdout.readline())
        _load(port, min(200, requests), clients)  # warm-up
        child.stdin.write("reset\n")
        child.stdin.flush()
        json.loads(child.stdout.readline())
        cpu0 = _cpu_s(child.pid)
        wall = _load(port, requests, clients)
        cpu = _cpu_s(child.pid) - cpu0
        child.stdin.write("lags\n")
        child.stdin.flush()
        lags = json.loads(child.stdout.readline())
    finally:
        child.kill()
        child.wait()
    return {
        "import_s": round(started["import_s"], 3),
        "rss_added_mb": round(started["rss_mb"], 1),
        "requests_per_s": round(requests / wall),
        "server_cpu_s_per_1000": round(1000 * cpu / requests, 3),
        "loop_lag_p99_ms": round(lags["lag_p99_ms"], 2),
        "loop_lag_max_ms": round(lags["lag_max_ms"], 2),
        "installed_mb": _installed_mb(DISTRIBUTIONS[kind]),
        "distributions": len(DISTRIBUTIONS[kind]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    child = sub.add_parser("serve")
    child.add_argument("--kind", choices=CANDIDATES, required=True)
    child.add_argument("--port", type=int, required=True)
    child.add_argument("--body-kb", type=int, default=20)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--body-kb", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.command == "serve":
        serve(args.kind, args.port, args.body_kb)
        return 0
    results = {}
    for kind in CANDIDATES:
        runs = [
            measure(kind, requests=args.requests, clients=args.clients, body_kb=args.body_kb)
            for _ in range(args.repeats)
        ]
        results[kind] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    print(
        json.dumps(
            {
                "requests": args.requests,
                "clients": args.clients,
                "body_kb": args.body_kb,
                "cpus": os.cpu_count(),
                "python": sys.version.split()[0],
                "versions": {name: metadata.version(name) for name in ("aiohttp", "starlette", "uvicorn")},
                "results": results,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
