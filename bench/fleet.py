"""Control-plane benchmark at fleet scale: what NATS, events, files and uploads cost per sample
when the forward costs nothing (issue 11 item 4).

Runs a whole job the way users run it: `hsx up` (producer, consumers, uploaders and monitor, each
its own process, with the settings `hsx up` chooses) against one nats-server started here
(`hsx.commands.embedded.start_nats_server`, so its store and PID are known), a file:// destination, a
trivial model (Qwen3-shaped, 2 decoder layers, hidden 64, random weights; layer 1 captured) and
short samples (token counts uniform in [--min-len, --max-len], seeded, with a loss mask over the
second half as in `hsx up`'s synthetic data).

Start-up is outside the timing: the bench creates the job's batch durable and pauses it
(JetStream consumer pause), starts `hsx up`, waits until the producer is done and every consumer
and uploader says it is ready in its log (`consumer_ready`, `uploader_ready`), then lets the pause
run out. From that release:
- samples_per_s: samples / seconds until the last sample file was stored in the destination
  (newest mtime there; read at the end), and `monitor_samples_per_s` until `hsx monitor
  --until-done` (hsx up's) exited 0 (it reads every 2 s, so it is up to 2 s late);
- CPU seconds per sample of each process and its children (`/proc/<pid>/stat` utime + stime +
  cutime + cstime, polled every --poll-s; the last reading before each process exits counts):
  each consumer and uploader, the monitor, `hsx up` itself, nats-server, the `hsx status` calls
  below and this bench; the producer runs before the release, its whole CPU is reported apart;
  `others`: the rest of the machine (other users of a shared box);
- `hsx status --json` latency: one call every --status-every seconds while the job runs (a
  subprocess, as a user runs it), median and max wall seconds;
- NATS: the JetStream store directory's size at the end (du), and the server's /varz counters
  over the window (messages and bytes in and out, per sample), and /jsz's stored totals.
Completion is also checked through `hsx status --json` (done, no dead letters). Prints one JSON
object.

Run: .venv/bin/python bench/fleet.py [--samples 20000] [--consumers 1] [--uploaders 2]
     [--status-every 10] [--keep] [--workdir DIR]
Linux only (reads /proc).
"""

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline import _pause_until  # noqa: E402  (bench/pipeline.py, beside this file)

from hsx.commands.embedded import build_tiny_model, start_nats_server  # noqa: E402
from hsx.wire import topology  # noqa: E402
from hsx.wire.natsconn import NatsSettings, connect  # noqa: E402

JOB = "fleet"
_TICKS = os.sysconf("SC_CLK_TCK")
_DAY_S = 86400.0
_RELEASE_S = 0.3
MODEL_SHAPE = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
)


def _stat(pid: int) -> tuple[int, float, float] | None:
    """(ppid, own CPU s, own + waited-for children's CPU s) of a live process, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    own = (int(fields[11]) + int(fields[12])) / _TICKS
    return int(fields[1]), own, own + (int(fields[13]) + int(fields[14])) / _TICKS


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie its parent has yet to wait for)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (FileNotFoundError, ProcessLookupError):
        return []


def _machine_busy_s() -> float:
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / _TICKS


def _role(argv: list[str]) -> str | None:
    for command in ("produce", "consume", "upload", "monitor", "status"):
        if command in argv[:8] or command in argv:
            return command
    return None


class ProcessWatch(threading.Thread):
    """Polls the process tree under `hsx up` (and the named extra processes): the last CPU reading of
    every process seen, by role, and the reading at `mark()` (the release)."""

    def __init__(self, up_pid: int, extra: dict[str, int], poll_s: float) -> None:
        super().__init__(daemon=True)
        self.up_pid, self.extra, self.poll_s = up_pid, extra, poll_s
        self.names: dict[int, str] = {}  # pid -> role name (consumer-0, uploader-1, monitor, ...)
        self.last: dict[int, float] = {}
        self.at_mark: dict[int, float] | None = None
        self.exited_before_mark: set[int] = set()
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def _role_name(self, pid: int, argv: list[str]) -> str:
        role = _role(argv) or "other"
        role = {"consume": "consumer", "upload": "uploader", "produce": "producer"}.get(role, role)
        if role in ("consumer", "uploader", "status"):
            n = self._counts.get(role, 0)
            self._counts[role] = n + 1
            return f"{role}-{n}" if role != "status" else f"status-{n}"
        return role

    def poll_once(self) -> None:
        children: dict[int, list[int]] = {}
        stats = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            st = _stat(pid)
            if st is None:
                continue
            stats[pid] = st
            children.setdefault(st[0], []).append(pid)
        tree, todo = set(), [self.up_pid]
        while todo:
            pid = todo.pop()
            if pid in tree:
                continue
            tree.add(pid)
            todo.extend(children.get(pid, []))
        with self._lock:
            for pid in tree | set(self.extra.values()) | {os.getpid()}:
                if pid not in stats:
                    continue
                if pid not in self.names:
                    if pid == self.up_pid:
                        self.names[pid] = "hsx_up"
                    elif pid == os.getpid():
                        self.names[pid] = "bench"
                    elif pid in self.extra.values():
                        self.names[pid] = next(k for k, v in self.extra.items() if v == pid)
                    else:
                        argv = _cmdline(pid)
                        if stats[pid][0] != self.up_pid and "hsx.cli" not in argv:
                            continue  # a grandchild (nothing hsx starts has any): counted by its parent's cutime
                        self.names[pid] = self._role_name(pid, argv)
                # hsx up waits for its children, so its cutime holds theirs: count only its own.
                self.last[pid] = stats[pid][1] if pid == self.up_pid else stats[pid][2]

    def mark(self) -> None:
        self.poll_once()
        with self._lock:
            self.at_mark = dict(self.last)

    def add(self, name: str, pid: int) -> None:
        with self._lock:
            self.extra[name] = pid

    def run(self) -> None:
        while not self._halt.wait(self.poll_s):
            self.poll_once()

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def window(self) -> dict[str, float]:
        """CPU seconds per process name since mark()."""
        with self._lock:
            out: dict[str, float] = {}
            for pid, cpu in self.last.items():
                name = self.names[pid]
                base = (self.at_mark or {}).get(pid, 0.0)
                if name == "producer":
                    continue
                out[name] = out.get(name, 0.0) + cpu - base
            return out

    def total(self, name: str) -> float:
        with self._lock:
            return sum(cpu for pid, cpu in self.last.items() if self.names[pid] == name)


def write_dataset(path: Path, *, count: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> int:
    """Pre-tokenized JSONL, written in chunks; returns the token count."""
    rng = np.random.default_rng(seed)
    tokens = 0
    tmp = path.with_suffix(".partial")
    with open(tmp, "w") as out:
        for start in range(0, count, 10_000):
            n = min(10_000, count - start)
            lengths = rng.integers(min_len, max_len + 1, size=n)
            ids = rng.integers(0, vocab_size, size=int(lengths.sum()))
            lines, at = [], 0
            for i, length in enumerate(lengths.tolist()):
                row = ids[at : at + length].tolist()
                at += length
                half = length // 2
                lines.append(
                    json.dumps(
                        {"id": f"s{start + i}", "input_ids": row, "loss_mask": [0] * half + [1] * (length - half)}
                    )
                )
            out.write("\n".join(lines) + "\n")
            tokens += int(lengths.sum())
    os.replace(tmp, path)
    return tokens


def _du(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def _newest_mtime(path: Path) -> tuple[int, float]:
    """(sample files, newest mtime) under a file:// job folder (the job's _hsx folder aside)."""
    count, newest = 0, 0.0
    for entry in os.scandir(path):
        if not entry.is_dir() or entry.name.startswith("_"):
            continue
        for f in os.scandir(entry.path):
            if f.name.endswith(".safetensors"):
                count += 1
                newest = max(newest, f.stat().st_mtime)
    return count, newest


def _http_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


async def _pause(url: str, job: str, delay_s: float) -> float:
    """Create the job's batch durable (idempotent, as consumers do) and pause it until `delay_s` from
    now (bench/pipeline.py's `_pause_until`); returns the wall-clock time it resumes."""
    nc = await connect(NatsSettings(url=url), name="hsx-bench-fleet")
    try:
        js = nc.jetstream()
        await topology.ensure_topology(js)
        durable = await topology.ensure_gpu_consumer(js, job)
        resumes = await _pause_until(nc, topology.BATCHES_STREAM, durable, delay_s)
        return time.time() + (resumes - time.monotonic())
    finally:
        await nc.close()


class StatusSampler(threading.Thread):
    """`hsx status --json` as a subprocess every `every_s` seconds: wall time of each call."""

    def __init__(self, url: str, every_s: float, watch: ProcessWatch) -> None:
        super().__init__(daemon=True)
        self.url, self.every_s, self.watch = url, every_s, watch
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.last: dict | None = None
        self.cpu_s = 0.0
        self._halt = threading.Event()

    def call(self) -> dict | None:
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "hsx.cli", "status", "--job", JOB, "--json", "--nats", self.url, "--timeout", "600"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = proc.communicate()
        seconds = time.monotonic() - started
        if proc.returncode != 0:
            self.failures.append(err.strip()[-300:])
            return None
        self.latencies.append(seconds)
        self.last = json.loads(out)
        return self.last

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            before = os.times()
            self.call()
            after = os.times()
            self.cpu_s += (after.children_user + after.children_system) - (
                before.children_user + before.children_system
            )

    def stop(self) -> None:
        self._halt.set()
        self.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--consumers", type=int, default=1)
    parser.add_argument("--uploaders", type=int, default=2)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-budget", type=int, default=None, help="hsx up --token-budget (default: hsx up's)")
    parser.add_argument("--status-every", type=float, default=10.0, help="seconds between hsx status calls")
    parser.add_argument("--poll-s", type=float, default=2.0, help="seconds between /proc readings")
    parser.add_argument("--timeout", type=float, default=36_000.0)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a fresh temporary directory")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()

    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="hsx-bench-fleet-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    out_dir = workdir / "out"
    wall_started = time.monotonic()
    server = start_nats_server(workdir / "nats", log_file=workdir / "nats-server.log")
    up = None
    try:
        model = build_tiny_model(workdir / "model", **MODEL_SHAPE)
        dataset = workdir / "dataset.jsonl"
        tokens = write_dataset(
            dataset, count=args.samples, min_len=args.min_len, max_len=args.max_len, vocab_size=2048, seed=args.seed
        )
        asyncio.run(_pause(server.url, JOB, _DAY_S))
        argv = [
            sys.executable,
            "-m",
            "hsx.cli",
            "up",
            "--nats",
            server.url,
            "--workdir",
            str(workdir / "up"),
            "--job",
            JOB,
            "--model",
            str(model),
            "--dataset",
            str(dataset),
            "--layers",
            "1",
            "--dest",
            out_dir.as_uri(),
            "--consumers",
            str(args.consumers),
            "--uploaders",
            str(args.uploaders),
            "--timeout",
            str(args.timeout),
            *(["--token-budget", str(args.token_budget)] if args.token_budget else []),
        ]
        up_log = open(workdir / "hsx-up.log", "wb")
        started = time.monotonic()
        up = subprocess.Popen(argv, cwd=REPO, stdout=up_log, stderr=subprocess.STDOUT)
        watch = ProcessWatch(up.pid, {"nats_server": server.process.pid}, args.poll_s)
        watch.start()
        logs = workdir / "up" / "logs"

        def ready(name: str, event: str) -> bool:
            path = logs / f"{name}.log"
            return path.exists() and f'"{event}"' in path.read_text(errors="replace")

        while not (
            all(ready(f"consumer-{i}", "consumer_ready") for i in range(args.consumers))
            and all(ready(f"uploader-{i}", "uploader_ready") for i in range(args.uploaders))
        ):
            if up.poll() is not None:
                raise SystemExit(f"hsx up exited {up.returncode} before the services were ready; see {workdir}")
            time.sleep(0.2)
        startup_s = time.monotonic() - started
        _, up_own, up_all = _stat(up.pid)
        producer_cpu_s = up_all - up_own  # hsx up has waited for the producer only
        resumes = asyncio.run(_pause(server.url, JOB, _RELEASE_S))
        time.sleep(max(0.0, resumes - time.time()))
        release_wall, release = time.time(), time.monotonic()
        watch.mark()
        busy0 = _machine_busy_s()
        varz0 = _http_json(f"{server.monitoring_url}/varz")
        sampler = StatusSampler(server.url, args.status_every, watch)
        sampler.start()
        monitor_exit = None
        while True:
            code = up.poll()
            if code is not None:
                break
            if (
                monitor_exit is None
                and not any(name == "monitor" and _alive(pid) for pid, name in list(watch.names.items()))
                and "monitor" in watch.names.values()
            ):
                monitor_exit = time.monotonic()
                watch.poll_once()
                window = watch.window()
                busy = _machine_busy_s() - busy0
                varz1 = _http_json(f"{server.monitoring_url}/varz")
            if time.monotonic() - release > args.timeout:
                raise SystemExit("timed out")
            time.sleep(0.1)
        if monitor_exit is None:  # hsx up was done with it between two polls
            monitor_exit = time.monotonic()
            window = watch.window()
            busy = _machine_busy_s() - busy0
            varz1 = _http_json(f"{server.monitoring_url}/varz")
        sampler.stop()
        watch.stop()
        if up.returncode != 0:
            raise SystemExit(f"hsx up exited {up.returncode}; see {workdir}/hsx-up.log")
        final = sampler.call()
        jsz = _http_json(f"{server.monitoring_url}/jsz")
        stored, newest = _newest_mtime(out_dir / JOB)
        store_bytes = _du(workdir / "nats" / "jetstream")
        monitor_s = monitor_exit - release
        stored_s = newest - release_wall
        samples = args.samples
        cpu = {name: round(value, 2) for name, value in sorted(window.items())}
        cpu["status_calls"] = round(sampler.cpu_s, 2)
        cpu["others"] = round(busy - sum(window.values()) - sampler.cpu_s, 2)
        result = {
            "bench": "fleet",
            "config": {
                "samples": samples,
                "tokens": tokens,
                "len": [args.min_len, args.max_len],
                "consumers": args.consumers,
                "uploaders": args.uploaders,
                "token_budget": args.token_budget or "hsx up default",
                "model": MODEL_SHAPE,
                "layers": [1],
                "dtype": "hsx up default",
                "cpu_count": os.cpu_count(),
                "load_before": os.getloadavg(),
            },
            "samples_per_s": round(samples / stored_s, 1),
            "seconds_to_last_stored": round(stored_s, 2),
            "monitor_samples_per_s": round(samples / monitor_s, 1),
            "seconds_to_monitor_done": round(monitor_s, 2),
            "startup_s": round(startup_s, 2),
            "producer_cpu_s": round(producer_cpu_s, 2),
            "producer_cpu_ms_per_sample": round(1000 * producer_cpu_s / samples, 3),
            "cpu_s": cpu,
            "cpu_ms_per_sample": {name: round(1000 * value / samples, 3) for name, value in cpu.items()},
            "cpu_ms_per_sample_hsx": round(
                1000 * sum(v for k, v in window.items() if k not in ("bench",)) / samples, 3
            ),
            "machine_cores_busy": round(busy / monitor_s, 2),
            "status_latency_s": {
                "calls": len(sampler.latencies),
                "median": round(statistics.median(sampler.latencies), 3) if sampler.latencies else None,
                "max": round(max(sampler.latencies), 3) if sampler.latencies else None,
                "all": [round(x, 2) for x in sampler.latencies],
                "failures": sampler.failures[:3],
            },
            "nats": {
                "store_bytes": store_bytes,
                "store_bytes_per_sample": round(store_bytes / samples, 1),
                "stored_messages": jsz.get("messages"),
                "stored_bytes": jsz.get("bytes"),
                **{
                    f"{key}_per_sample": round((varz1[key] - varz0[key]) / samples, 2)
                    for key in ("in_msgs", "in_bytes", "out_msgs", "out_bytes")
                },
            },
            "files_stored": stored,
            "done": bool(final and final.get("done")),
            "dead_letters": final.get("dead_letters") if final else None,
            "wall_s": round(time.monotonic() - wall_started, 1),
        }
        if args.keep:
            result["workdir"] = str(workdir)
        print(json.dumps(result, indent=1), flush=True)
        return 0 if result["done"] and stored == samples else 1
    finally:
        if up is not None and up.poll() is None:
            up.terminate()
            up.wait(120)
        server.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
