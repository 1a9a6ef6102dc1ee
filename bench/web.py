"""Benchmark: the monitor's page (`hsx monitor --http`) at the seeds' size, a job of 914,000 planned
samples with 64 workers: how long the page takes to render in Chromium, and what serving it costs
the monitor's CPU against a monitor of the same job without --http, both measured in one run.

It starts a fresh nats-server (temp store), records a job spec of --samples samples (batches of
--batch-size) and publishes the markers of its first --done share (one `written` per batch, one
`uploaded` per sample, as real workers leave them), plus a few dead letters. Then, for the whole
run, it simulates the fleet from this process: --consumers GPU consumers and --uploaders
uploaders over --nodes nodes, each sending a heartbeat every 5 s as real workers do (state,
kernels, load: rate, batches in hand, busy share, GPU utilization and memory, spool and free
disk), and the job's progress at --pace samples/s (a `written` marker per batch, an `uploaded`
one per sample).

Two monitors follow the job with the same --interval: A without --http, B with it, each with its
output to a file. Once both have caught up with the markers, a headless Chromium (Debian's
chromium, driven by Playwright) opens B's page --renders times: `render_ms` is from the start of
the navigation to the end of the page's first full draw (its 64 worker rows, nodes, dead letters
and the rate plot), `draw_ms` the draw alone. Then, with the page left open (its event stream
live), the CPU seconds of each monitor over --window seconds (/proc/<pid>/stat utime + stime):
`cpu_ratio` is B's over A's. Prints one JSON object.

Run: .venv/bin/python bench/web.py [--samples 914000] [--done 0.3] [--consumers 48] [--uploaders 16]
     [--nodes 8] [--pace 200] [--interval 2] [--window 60] [--renders 5]
Linux only (reads /proc); needs /usr/bin/chromium (apt-get install chromium).
"""

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nats  # noqa: E402

from hsx.commands.embedded import start_nats_server  # noqa: E402
from hsx.job import JobSpec, plan_batch_id
from hsx.wire import schemas, topology  # noqa: E402
from hsx.wire.events import EventPublisher  # noqa: E402
from hsx.wire.headers import message_headers  # noqa: E402

JOB = "benchweb"
TOKENS_PER_SAMPLE = 500
BYTES_PER_SAMPLE = TOKENS_PER_SAMPLE * 5 * 5120 * 2
WINDOW = 2000  # publishes in flight at once
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _spec(samples: int, batch_size: int) -> JobSpec:
    return JobSpec(
        job=JOB,
        model="Qwen/Qwen3-27B",
        model_revision="local",
        layers=[1, 16, 31, 46, 61],
        dtype="bfloat16",
        dest="s3://bench-bucket/hidden-states",
        token_budget=batch_size * TOKENS_PER_SAMPLE,
        max_seq_len=TOKENS_PER_SAMPLE,
        dataset="bench",
        plan_fingerprint="c" * 64,
        total_samples=samples,
        total_tokens=samples * TOKENS_PER_SAMPLE,
        total_batches=-(-samples // batch_size),
        created_at=time.time(),
        published=True,
    )


def _batch_events(spec: JobSpec, batch: int, batch_size: int):
    plan = spec.plan_tag
    start = batch * batch_size
    indices = list(range(start, min(start + batch_size, spec.total_samples)))
    batch_id = plan_batch_id(JOB, spec.plan_fingerprint, batch)
    yield (
        topology.written_subject(JOB, plan, batch_id),
        schemas.BatchWritten(
            job=JOB,
            batch_id=batch_id,
            consumer="c",
            node=f"gpu-{batch % 8}",
            sample_indices=indices,
            tokens=len(indices) * TOKENS_PER_SAMPLE,
            bytes=len(indices) * BYTES_PER_SAMPLE,
            seconds=1.0,
            plan=plan,
        ),
        batch_id,
        None,
    )
    for index in indices:
        yield (
            topology.uploaded_subject(JOB, plan, index),
            schemas.FileUploaded(
                job=JOB,
                node=f"gpu-{batch % 8}",
                uploader="u",
                sample_index=index,
                key=f"{JOB}/{index // 1000:05d}/{index}.safetensors",
                size=BYTES_PER_SAMPLE,
                tokens=TOKENS_PER_SAMPLE,
                plan=plan,
            ),
            batch_id,
            index,
        )


async def _publish(js, events) -> int:
    count, pending = 0, []
    for subject, event, batch_id, sample in events:
        headers = {**message_headers(JOB, batch=batch_id, sample=sample), **topology.ONCE_HEADERS}
        pending.append(js.publish(subject, schemas.encode(event), headers=headers))
        if len(pending) >= WINDOW:
            await asyncio.gather(*pending)
            count, pending = count + len(pending), []
    await asyncio.gather(*pending)
    return count + len(pending)


async def _fill(url: str, samples: int, batch_size: int, done: float) -> dict:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        kv = await topology.ensure_topology(js)
        spec = _spec(samples, batch_size)
        await kv.put(JOB, schemas.encode(spec))
        batches = int(spec.total_batches * done)
        started = time.perf_counter()
        count = await _publish(js, (e for b in range(batches) for e in _batch_events(spec, b, batch_size)))
        events = EventPublisher(nc, js, JOB)
        for i in range(3):  # a few dead letters, each naming a batch's samples
            await events.store_dead_letter(
                what="batch",
                error=f"sample {samples - 1 - i}: IndexError: index out of range in self",
                subject=topology.batch_subject(JOB),
                payload=b"{}",
                deliveries=topology.BATCH_MAX_DELIVER,
                batch_id=f"dead-{i}",
                sample_indices=[samples - 1 - i],
            )
        return {"markers": count, "publish_s": round(time.perf_counter() - started, 1), "batches_done": batches}
    finally:
        await nc.close()


class Fleet(threading.Thread):
    """The workers' heartbeats every 5 s and the job's progress at `pace` samples/s, from a loop
    of its own, from batch `first_batch` on."""

    def __init__(self, url: str, spec: JobSpec, args, first_batch: int) -> None:
        super().__init__(daemon=True)
        self.url, self.spec, self.args, self.next_batch = url, spec, args, first_batch
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # noqa: BLE001 - reported by main
            self.error = exc

    async def _run(self) -> None:
        args = self.args
        nc = await nats.connect(self.url)
        js = nc.jetstream()
        events = EventPublisher(nc, js, JOB)
        kernels = schemas.Kernels(attention="flash_attention_2", compiled=True)
        started = time.monotonic()
        beat_at = 0.0
        while not self.stopping.is_set():
            now = time.monotonic()
            if now - beat_at >= 5.0:
                beat_at = now
                for i in range(args.consumers):
                    node = f"gpu-{i % args.nodes}"
                    await events.heartbeat(
                        service="gpu_consumer",
                        instance=f"{node}-{1000 + i}",
                        node=node,
                        state="working",
                        last_batch=f"batch-{i}",
                        spool_files=120,
                        spool_bytes=120 * BYTES_PER_SAMPLE,
                        kernels=kernels,
                        load=schemas.WorkerLoad(
                            device=f"cuda:{i // args.nodes}",
                            samples_per_s=args.pace / args.consumers,
                            in_hand=2,
                            busy=0.93,
                            gpu_utilization=97.0,
                            gpu_memory_used=120 << 30,
                            gpu_memory_total=141 << 30,
                            spool_free=3 << 40,
                            spool_high_water=400 << 30,
                        ),
                    )
                for i in range(args.uploaders):
                    node = f"gpu-{i % args.nodes}"
                    await events.heartbeat(
                        service="uploader",
                        instance=f"{node}-{2000 + i}",
                        node=node,
                        state="working",
                        detail="inflight=100",
                        spool_files=120,
                        spool_bytes=120 * BYTES_PER_SAMPLE,
                        load=schemas.WorkerLoad(
                            samples_per_s=args.pace / args.uploaders, in_hand=100, spool_free=3 << 40
                        ),
                    )
            # Progress: the batches due by now at `pace` samples/s.
            due = int((time.monotonic() - started) * args.pace / args.batch_size)
            while due > 0 and self.next_batch < self.spec.total_batches:
                await _publish(js, _batch_events(self.spec, self.next_batch, args.batch_size))
                self.next_batch += 1
                due -= 1
                started += args.batch_size / args.pace
            await asyncio.sleep(0.2)
        await nc.close()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _caught_up(out: Path, tokens: int) -> bool:
    for line in reversed(out.read_text().splitlines()):
        record = json.loads(line)
        if record.get("event") == "progress":
            return record["tokens_done"] >= tokens
    return False


def _render(url: str, renders: int) -> dict:
    from playwright.sync_api import sync_playwright

    playwright = sync_playwright().start()  # stopped by the caller, once the page has been left open
    browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
    page = browser.new_page(bypass_csp=True, viewport={"width": 1600, "height": 1200})
    first, draws = [], []
    for _ in range(renders):
        page.goto(url)
        page.wait_for_function("() => window.hsxFirstDrawnAt !== undefined", timeout=30000)
        first.append(page.evaluate("() => window.hsxFirstDrawnAt"))
        draws.append(page.evaluate("() => window.hsxDrawMs"))
    rows = page.evaluate("() => document.querySelectorAll('#workers tbody tr').length")
    return {"page": page, "browser": browser, "playwright": playwright, "first": first, "draws": draws, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=914_000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--done", type=float, default=0.3)
    parser.add_argument("--consumers", type=int, default=48)
    parser.add_argument("--uploaders", type=int, default=16)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--pace", type=float, default=200.0)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--renders", type=int, default=5)
    args = parser.parse_args()
    result: dict = {"bench": "web", "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = start_nats_server(tmp / "nats")
        monitors: list[subprocess.Popen] = []
        fleet = None
        try:
            result["fill"] = asyncio.run(_fill(server.url, args.samples, args.batch_size, args.done))
            spec = _spec(args.samples, args.batch_size)
            fleet = Fleet(server.url, spec, args, result["fill"]["batches_done"])
            fleet.start()
            port = _free_port()
            env = {**os.environ, "HSX_NATS_URL": server.url}
            env = {k: v for k, v in env.items() if k not in ("HSX_HTTP_PORT", "HSX_METRICS_PORT")}
            for name, extra in (("A", []), ("B", ["--http", str(port)])):
                out = tmp / f"monitor-{name}.out"
                monitors.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "hsx.cli", "monitor", "--job", JOB, "--interval", str(args.interval)]
                        + ["--format", "json", *extra],
                        env=env,
                        stdout=open(out, "wb"),
                        stderr=subprocess.STDOUT,
                    )
                )
                monitors[-1].out = out
            tokens = result["fill"]["batches_done"] * args.batch_size * TOKENS_PER_SAMPLE
            began = time.monotonic()
            while not all(m.out.exists() and _caught_up(m.out, tokens) for m in monitors):
                assert all(m.poll() is None for m in monitors), [m.out.read_text()[-2000:] for m in monitors]
                assert fleet.error is None, fleet.error
                time.sleep(1)
            result["monitors_caught_up_s"] = round(time.monotonic() - began, 1)
            url = f"http://127.0.0.1:{port}/"
            with urllib.request.urlopen(url + "api/page", timeout=30) as response:
                page_bytes = len(response.read())
            shown = _render(url, args.renders)
            result["page"] = {
                "bytes": page_bytes,
                "worker_rows": shown["rows"],
                "render_ms": [round(ms, 1) for ms in shown["first"]],
                "render_ms_median": round(statistics.median(shown["first"]), 1),
                "draw_ms": [round(ms, 1) for ms in shown["draws"]],
            }
            # The page stays open (its event stream live) while the CPU is measured.
            before = [_cpu_s(m.pid) for m in monitors]
            time.sleep(args.window)
            after = [_cpu_s(m.pid) for m in monitors]
            draws_seen = shown["page"].evaluate("() => Number(document.body.dataset.readings)")
            shown["browser"].close()
            shown["playwright"].stop()
            cpu = [round(b - a, 2) for a, b in zip(before, after)]
            result["cpu"] = {
                "window_s": args.window,
                "without_http_s": cpu[0],
                "with_http_s": cpu[1],
                "cpu_ratio": round(cpu[1] / cpu[0], 3) if cpu[0] else None,
                "page_updates_in_window": draws_seen,
            }
            result["progress_batches_published"] = fleet.next_batch - result["fill"]["batches_done"]
        finally:
            if fleet is not None:
                fleet.stopping.set()
                fleet.join(timeout=10)
            for m in monitors:
                m.terminate()
                m.wait(timeout=30)
            server.stop()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
