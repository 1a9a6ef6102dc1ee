"""Benchmark: NATS bytes and messages per sample and per token, by stream (issue 11, "fewer bytes
and messages per sample").

Runs a whole job with `hsx up` (the embedded tiny model and synthetic dataset, file://
destination) against a nats-server started here, while a plain NATS subscription on `hsx.>`
taps every message published to an hsx stream (the streams' subjects are ordinary subjects), so
each stream's traffic is counted exactly: descriptors, file-ready events, progress events,
heartbeats, dead letters. The server's own `/varz` counters give the whole traffic, acks,
`in_progress` and JetStream API calls included. Prints one JSON object with, per subject group,
messages and bytes (payload + headers), per sample and per token, and the totals.

Run: python bench/wire.py [--samples 2000] [--token-budget 4096] [--uploaders 2]
"""

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nats  # noqa: E402

from hsx.commands.embedded import start_nats_server  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
JOB = "benchwire"


def _group(subject: str) -> str:
    """`hsx.batches.J` -> batches; `hsx.events.J.written.P.B` -> events.written;
    `hsx.state.J.heartbeat.S.I` -> state.heartbeat; ..."""
    parts = subject.split(".")
    if parts[1] in ("events", "state"):
        return f"{parts[1]}.{parts[3]}"
    return parts[1]


class Tap(threading.Thread):
    """Counts every message on `hsx.>` (payload and header bytes) until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.ready = threading.Event()
        self._stopping = None
        self._loop = None

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        nc = await nats.connect(self.url)

        async def count(msg) -> None:
            entry = self.counts[_group(msg.subject)]
            entry[0] += 1
            entry[1] += len(msg.data) + sum(len(k) + len(v) + 4 for k, v in (msg.headers or {}).items())

        await nc.subscribe("hsx.>", cb=count, pending_msgs_limit=10_000_000, pending_bytes_limit=-1)
        await nc.flush()
        self.ready.set()
        await self._stopping.wait()
        await nc.drain()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stopping.set)
        self.join(timeout=30)


def _varz(monitoring_url: str) -> dict:
    with urllib.request.urlopen(f"{monitoring_url}/varz", timeout=5) as reply:
        return json.loads(reply.read())


def _job_totals(url: str) -> tuple[int, int]:
    async def read() -> tuple[int, int]:
        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().key_value("hsx_jobs")
            spec = json.loads((await kv.get(JOB)).value)
            return spec["total_samples"], spec["total_tokens"]
        finally:
            await nc.close()

    return asyncio.run(read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--uploaders", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_nats_server(Path(tmp) / "nats")
        tap = Tap(server.url)
        try:
            tap.start()
            tap.ready.wait(10)
            before = _varz(server.monitoring_url)
            run = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "hsx.cli",
                    "up",
                    "--nats",
                    server.url,
                    "--workdir",
                    str(Path(tmp) / "work"),
                    "--job",
                    JOB,
                    "--samples",
                    str(args.samples),
                    "--token-budget",
                    str(args.token_budget),
                    "--uploaders",
                    str(args.uploaders),
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
            )
            if run.returncode != 0:
                sys.exit(f"hsx up exited {run.returncode}\n{run.stderr[-3000:]}")
            after = _varz(server.monitoring_url)
            samples, tokens = _job_totals(server.url)
        finally:
            tap.stop()
            server.stop()
    groups = {
        name: {
            "messages": msgs,
            "bytes": size,
            "messages_per_sample": round(msgs / samples, 3),
            "bytes_per_sample": round(size / samples, 1),
            "bytes_per_token": round(size / tokens, 3),
        }
        for name, (msgs, size) in sorted(tap.counts.items())
    }
    tapped_msgs = sum(msgs for msgs, _ in tap.counts.values())
    tapped_bytes = sum(size for _, size in tap.counts.values())
    server_in = {key: after[key] - before[key] for key in ("in_msgs", "in_bytes")}
    print(
        json.dumps(
            {
                "bench": "wire",
                "samples": samples,
                "tokens": tokens,
                "token_budget": args.token_budget,
                "streams": groups,
                "published_to_streams": {
                    "messages": tapped_msgs,
                    "bytes": tapped_bytes,
                    "messages_per_sample": round(tapped_msgs / samples, 2),
                    "bytes_per_sample": round(tapped_bytes / samples, 1),
                    "bytes_per_token": round(tapped_bytes / tokens, 3),
                },
                # Everything clients sent the server: the above plus acks, in_progress, API requests.
                "server_in": {
                    **server_in,
                    "messages_per_sample": round(server_in["in_msgs"] / samples, 2),
                    "bytes_per_sample": round(server_in["in_bytes"] / samples, 1),
                },
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
