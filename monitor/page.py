"""What the monitor's web page shows of one job (`hsx monitor --http`), as one JSON-able dict per
reading (`page_data`): the job's state and why, its progress, rates and ETA, the rate history
(`RateHistory`), one row per live or silent worker, the spool of each node, the dead letters and
the command that retries them, and the job's settings with its projected size against the
destination's free space.

Pure functions of their arguments, like monitor/report.py, whose `Reading` it extends: nothing
here knows NATS, HTTP or the browser. Secrets never reach it (the NATS URL is not an argument).
"""

import math
import time
from dataclasses import dataclass

from hsx.job import JobSpec
from hsx.monitor.report import SILENT, Reading, percent_uploaded
from hsx.wire import schemas
from hsx.wire.statusview import DONE, FAILED, GONE, STALLED, WAITING

# The rate history keeps at most this many points: the whole job, at a resolution that halves
# each time it fills (an hour of 5 s readings, then 10 s, ...).
HISTORY_POINTS = 720
# A worker degraded by its own word (monitor/report.py's list, less SILENT).
DEGRADED_STATES = ("paused", "retrying", "disk_full", "refused", "stalled")


class RateHistory:
    """(time, samples written/s, samples uploaded/s, tokens written/s, tokens uploaded/s) per
    reading, the oldest merged pairwise when full, so that the plot covers the whole job."""

    def __init__(self, points: int = HISTORY_POINTS) -> None:
        self.points = points
        self._rows: list[tuple[float, ...]] = []
        self._step = 1  # readings per point
        self._pending: list[tuple[float, ...]] = []

    def add(self, when: float, *rates: float) -> None:
        self._pending.append((when, *rates))
        if len(self._pending) < self._step:
            return
        merged = tuple(
            self._pending[-1][0] if i == 0 else sum(row[i] for row in self._pending) / len(self._pending)
            for i in range(len(self._pending[0]))
        )
        self._pending = []
        self._rows.append(merged)
        if len(self._rows) >= self.points:
            self._rows = [
                (b[0], *((x + y) / 2 for x, y in zip(a[1:], b[1:]))) for a, b in zip(self._rows[::2], self._rows[1::2])
            ]
            self._step *= 2

    def rows(self) -> list[list[float]]:
        return [[round(value, 3) for value in row] for row in self._rows]


@dataclass(frozen=True, kw_only=True)
class Rates:
    """The four rates of the plot, per second, over the monitor's window (monitor/rates.py)."""

    samples_written: float
    samples_uploaded: float
    tokens_written: float
    tokens_uploaded: float


@dataclass(frozen=True, kw_only=True)
class DestinationRoom:
    """A local destination's free bytes (the nearest existing folder of its path); None for S3."""

    measured: str
    free: int


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def state_reason(reading: Reading, *, now: float) -> str:
    """Why the job is in its state, in one line."""
    view = reading.view
    if view.state == DONE:
        return f"every one of its {view.total_samples} samples is in the destination"
    if view.state == FAILED:
        return view.failure_reason or "it cannot finish by itself"
    if view.state == STALLED:
        since = f" for {view.no_worker_alive_s:.0f} s" if view.no_worker_alive_s is not None else ""
        left = view.total_samples - view.samples_uploaded
        return f"no worker alive{since}; {left} samples left: start consumers and uploaders (hsx consume, hsx upload)"
    if view.state == WAITING:
        return "published; no consumer or uploader has started"
    degraded = [
        (service, state)
        for (service, _node, state), count in sorted(reading.workers.items())
        for _ in range(count)
        if state in DEGRADED_STATES
    ]
    parts = [f"{sum(view.workers_alive.values())} workers alive"]
    if degraded:
        parts.append(f"{len(degraded)} cannot make progress ({', '.join(sorted({s for _, s in degraded}))})")
    silent = sum(count for (_s, _n, state), count in reading.workers.items() if state == SILENT)
    if silent:
        parts.append(f"{silent} silent")
    if view.destination_error:
        parts.append(f"destination: {view.destination_error}")
    if not view.plan_complete:
        parts.append("the producer is still publishing the plan")
    return "; ".join(parts)


def _kernels(kernels: schemas.Kernels | None) -> str:
    if kernels is None:
        return ""
    parts = [kernels.attention]
    if kernels.linear_attention:
        parts.append(f"linear {kernels.linear_attention}")
    if kernels.conv1d:
        parts.append(f"conv1d {kernels.conv1d}")
    return ", ".join(parts)


def worker_rows(
    heartbeats: dict[str, schemas.Heartbeat], *, now: float, silent_after_s: float, done: bool
) -> list[dict]:
    """One row per worker that has not said goodbye; once the job is done, the silent ones are
    left out (a worker of a finished job that went away is no problem). Consumers first."""
    rows = []
    for beat in heartbeats.values():
        if beat.state == GONE or beat.service not in ("gpu_consumer", "uploader"):
            continue
        age = max(0.0, now - beat.sent_at)
        silent = age > silent_after_s
        if silent and done:
            continue
        load = beat.load or schemas.WorkerLoad()
        kernels = beat.kernels
        rows.append(
            {
                "instance": beat.instance,
                "service": beat.service,
                "node": beat.node,
                "device": load.device,
                "state": SILENT if silent else beat.state,
                "last_state": beat.state,
                "detail": beat.detail,
                "silent": silent,
                "degraded": not silent and beat.state in DEGRADED_STATES,
                "kernels": _kernels(kernels),
                "compiled": None if kernels is None else kernels.compiled,
                "samples_per_s": None if load.samples_per_s < 0 else round(load.samples_per_s, 2),
                "in_hand": None if load.in_hand < 0 else load.in_hand,
                "last_batch": beat.last_batch,
                "heartbeat_age_s": round(age, 1),
                "busy": None if load.busy < 0 else round(load.busy, 3),
                "gpu_utilization": None if load.gpu_utilization < 0 else load.gpu_utilization,
                "gpu_memory_used": None if load.gpu_memory_used < 0 else load.gpu_memory_used,
                "gpu_memory_total": None if load.gpu_memory_total < 0 else load.gpu_memory_total,
            }
        )
    rows.sort(key=lambda row: (row["service"] != "gpu_consumer", row["node"], row["instance"]))
    return rows


def node_rows(heartbeats: dict[str, schemas.Heartbeat], reading: Reading, files_waiting: dict[str, int]) -> list[dict]:
    """Per node: its spool's files and bytes (monitor/report.py's newest measurement), the free
    bytes of its spool's file system and the consumers' high-water mark, from the newest
    heartbeat that measured each, and the file events waiting for its uploaders."""
    free: dict[str, tuple[float, int]] = {}
    high: dict[str, int] = {}
    for beat in heartbeats.values():
        load = beat.load
        if load is None:
            continue
        if load.spool_free >= 0 and (beat.node not in free or beat.sent_at > free[beat.node][0]):
            free[beat.node] = (beat.sent_at, load.spool_free)
        if load.spool_high_water >= 0:
            high[beat.node] = max(high.get(beat.node, 0), load.spool_high_water)
    nodes = sorted(set(reading.spool) | set(free) | set(high) | set(files_waiting))
    return [
        {
            "node": node,
            "spool_files": reading.spool.get(node, (None, None))[0],
            "spool_bytes": reading.spool.get(node, (None, None))[1],
            "free_bytes": free[node][1] if node in free else None,
            "high_water_bytes": high.get(node),
            "files_waiting": files_waiting.get(node, 0),
        }
        for node in nodes
    ]


def projected_bytes(view) -> int | None:
    """The job's output at the bytes per token written so far; None before anything is written."""
    if view.tokens_written <= 0 or view.bytes_written <= 0:
        return None
    return round(view.bytes_written / view.tokens_written * view.total_tokens)


def page_data(
    reading: Reading,
    *,
    spec: JobSpec,
    heartbeats: dict[str, schemas.Heartbeat],
    rates: Rates,
    history: RateHistory,
    silent_after_s: float,
    batches_in_hand: int | None,
    files_waiting: dict[str, int],
    dead_errors: dict[str, int],
    room: DestinationRoom | None,
    jobs: list[str],
    now: float | None = None,
) -> dict:
    now = time.time() if now is None else now
    view = reading.view
    eta = _finite(reading.eta_s)
    projected = projected_bytes(view)
    still_to_store = None if projected is None else max(0, projected - view.bytes_uploaded)
    return {
        "job": view.job,
        "as_of": view.as_of,
        "state": view.state,
        "reason": state_reason(reading, now=now),
        "done": view.done,
        "failed": view.failed,
        "progress": {
            "percent": round(percent_uploaded(view), 2),
            "samples_total": view.total_samples,
            "samples_written": view.samples_written,
            "samples_uploaded": view.samples_uploaded,
            "tokens_total": view.total_tokens,
            "tokens_written": view.tokens_written,
            "tokens_uploaded": view.tokens_uploaded,
            "bytes_written": view.bytes_written,
            "bytes_uploaded": view.bytes_uploaded,
            "batches_total": view.batches_total,
            "batches_done": view.batches_done,
            "batches_queued": view.batches_queued,
            "batches_in_hand": batches_in_hand,
            "rounds_published": view.rounds_published,
            "plan_complete": view.plan_complete,
            "files_waiting_upload": view.files_waiting_upload,
            "redeliveries": view.batch_redeliveries + view.file_redeliveries,
            "samples_requeued": view.samples_requeued,
            "sums_complete": view.sums_complete,
        },
        "rates": {
            "samples_written_per_s": round(rates.samples_written, 3),
            "samples_uploaded_per_s": round(rates.samples_uploaded, 3),
            "tokens_written_per_s": round(rates.tokens_written, 1),
            "tokens_uploaded_per_s": round(rates.tokens_uploaded, 1),
        },
        "eta_s": None if eta is None else round(eta, 1),
        "projected_end": None if eta is None or view.done else round(now + eta, 1),
        "started_at": view.started_at,
        "finished_at": view.finished_at,
        "elapsed_s": view.elapsed_s,
        "history": history.rows(),
        "workers": worker_rows(heartbeats, now=now, silent_after_s=silent_after_s, done=view.done),
        "nodes": node_rows(heartbeats, reading, files_waiting),
        "destination": {
            "dest": view.dest,
            "error": view.destination_error,
            "refusals": len(view.destination_refusals),
            "projected_bytes": projected,
            "still_to_store_bytes": still_to_store,
            "free_bytes": None if room is None else room.free,
            "measured": None if room is None else room.measured,
            "fits": None if room is None or still_to_store is None else still_to_store <= room.free,
        },
        "dead": {
            "letters": view.dead_letters,
            "samples": len(view.dead_samples),
            "sample_indices": view.dead_samples[:50],
            "errors": [
                {"error": error, "letters": count}
                for error, count in sorted(dead_errors.items(), key=lambda item: -item[1])[:10]
            ],
            "retry": f"hsx dead retry --job {view.job} --all" if view.dead_letters else None,
            "list": f"hsx dead list --job {view.job}",
        },
        "settings": {
            "model": spec.model,
            "layers": [str(layer) for layer in spec.layers],
            "dtype": spec.dtype,
            "dest": spec.dest,
            "token_budget": spec.token_budget,
            "max_seq_len": spec.max_seq_len,
            "plan": spec.plan_tag,
        },
        "jobs": jobs,
    }
