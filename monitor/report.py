"""What the monitor reports each interval, computed from a status view (`hsx.wire.statusview.status_view`)
and the workers' last heartbeats: the progress line, workers by service, node and state, the
spool backlog per node, silent and degraded workers, ETA and the job summary.

Pure functions of their arguments: nothing here knows NATS, terminals or Prometheus. The JSON
line, the terminal bar and /metrics all show one `Reading`, so they cannot disagree.
"""

from dataclasses import dataclass

from hsx.monitor.rates import eta_seconds
from hsx.wire import schemas
from hsx.wire.statusview import StatusView

# The keys of every `progress` line (docs/reference/progress.md describes each one).
PROGRESS_FIELDS = (
    "samples_total",
    "samples_written",
    "samples_uploaded",
    "percent",
    "tokens_total",
    "tokens_done",
    "tokens_uploaded",
    "bytes_written",
    "bytes_uploaded",
    "tokens_per_s",
    "samples_per_s",
    "eta_s",
    "batches_total",
    "batches_done",
    "batches_queued",
    "spool_backlog_files",
    "spool_bytes",
    "redeliveries",
    "samples_requeued",
    "dead_letters",
    "workers",
    "workers_silent",
    "workers_by_service",
    "done",
    "failed",
)
# The keys of the `job_summary` line, logged once when the job is done.
SUMMARY_FIELDS = (
    "samples",
    "tokens",
    "bytes",
    "batches",
    "dest",
    "redeliveries",
    "samples_requeued",
    "dead_letters",
    "monitored_s",
    "elapsed_s",
    "samples_per_s",
    "tokens_per_s",
)

SILENT = "silent"  # the state reported for a worker whose heartbeat stopped
_GONE = "stopping"  # said by a worker on its way out: it is gone, not silent
STALLED = "stalled"  # a GPU consumer whose forward ran past its bound (gpu_consumer/stall.py)
_DEGRADED_STATES = ("paused", "retrying", "disk_full", "refused", STALLED)


@dataclass(frozen=True, kw_only=True)
class Reading:
    """One interval's reading of a job."""

    view: StatusView
    tokens_per_s: float
    samples_per_s: float
    eta_s: float | None  # None while no rate is known
    workers: dict[tuple[str, str, str], int]  # (service, node, state) -> how many; state SILENT when beats stopped
    spool: dict[str, tuple[int, int]]  # node -> (files, bytes) of the job in its spool, as its workers last said


def _is_silent(beat: schemas.Heartbeat, now: float, silent_after_s: float) -> bool:
    return now - beat.sent_at > silent_after_s


def worker_states(
    heartbeats: dict[str, schemas.Heartbeat], *, now: float, silent_after_s: float, done: bool = False
) -> dict[tuple[str, str, str], int]:
    """(service, node, state) -> how many workers; a worker that said goodbye is not counted, nor,
    once the job is done, one that fell silent (it had nothing more to do: no problem)."""
    counts: dict[tuple[str, str, str], int] = {}
    for beat in heartbeats.values():
        if beat.state == _GONE or (done and _is_silent(beat, now, silent_after_s)):
            continue
        state = SILENT if _is_silent(beat, now, silent_after_s) else beat.state
        key = (beat.service, beat.node, state)
        counts[key] = counts.get(key, 0) + 1
    return counts


def spool_by_node(heartbeats: dict[str, schemas.Heartbeat]) -> dict[str, tuple[int, int]]:
    """Per node, the spool usage of the newest measurement among its workers' heartbeats. Every
    worker of a node reads the same spool, so the newest measurement wins, not the newest beat (a
    consumer's count is as of its last walk, which may precede an uploader's deletions reported in
    an earlier beat); a node whose workers have all stopped keeps its last value (files still
    waiting there are exactly what an operator must see)."""
    newest: dict[str, schemas.Heartbeat] = {}
    for beat in heartbeats.values():
        if beat.spool_bytes < 0:  # a producer, or a worker from before heartbeats carried it
            continue
        if beat.node not in newest or _measured_at(beat) > _measured_at(newest[beat.node]):
            newest[beat.node] = beat
    return {node: (beat.spool_files, beat.spool_bytes) for node, beat in sorted(newest.items())}


def _measured_at(beat: schemas.Heartbeat) -> float:
    return beat.spool_measured_at or beat.sent_at  # 0: a sender from before the field


def silent_workers(
    heartbeats: dict[str, schemas.Heartbeat], *, now: float, silent_after_s: float, done: bool = False
) -> list[dict]:
    """Workers whose heartbeat stopped without saying goodbye: killed, hung, or cut off from NATS.
    `last_batch` is the batch a GPU consumer last started (empty for an uploader). None once the
    job is `done`: a worker of a finished job that went away is no problem."""
    if done:
        return []
    return [
        {
            "instance": beat.instance,
            "service": beat.service,
            "node": beat.node,
            "last_batch": beat.last_batch,
            "last_state": beat.state,
            "silent_s": round(now - beat.sent_at, 1),
        }
        for beat in heartbeats.values()
        if beat.state != _GONE and _is_silent(beat, now, silent_after_s)
    ]


def degraded_workers(
    heartbeats: dict[str, schemas.Heartbeat], *, now: float, silent_after_s: float, done: bool = False
) -> list[dict]:
    """Live workers that say they cannot make progress: a consumer paused at the spool's high-water
    mark, waiting for disk space or stuck in a stalled forward, an uploader retrying a failing
    destination or refused by it. None once the job is `done`: nothing is left to make progress on."""
    if done:
        return []
    return [
        {
            "instance": beat.instance,
            "service": beat.service,
            "node": beat.node,
            "state": beat.state,
            "detail": beat.detail,
        }
        for beat in heartbeats.values()
        if beat.state in _DEGRADED_STATES and not _is_silent(beat, now, silent_after_s)
    ]


def stalled_workers(heartbeats: dict[str, schemas.Heartbeat], *, now: float, silent_after_s: float) -> list[dict]:
    """Live GPU consumers whose forward has run past its bound: the batch it is stuck on (released
    to the other consumers) and for how long, as of the consumer's last heartbeat."""
    return [
        {
            "instance": beat.instance,
            "service": beat.service,
            "node": beat.node,
            "batch": beat.last_batch,
            "stalled_s": beat.stalled_s,
            "detail": beat.detail,
        }
        for beat in heartbeats.values()
        if beat.state == STALLED and not _is_silent(beat, now, silent_after_s)
    ]


def eta_to_done(view: StatusView, *, tokens_per_s: float, samples_per_s: float) -> float | None:
    """Seconds until every sample is uploaded at the current rates: the slower of what is left to
    write (tokens, at the write rate) and what is left to upload (samples, at the upload rate)."""
    if view.done:
        return 0.0
    if view.failed:
        return None
    to_write = eta_seconds(view.total_tokens - view.tokens_written, tokens_per_s)
    to_upload = eta_seconds(view.total_samples - view.samples_uploaded, samples_per_s)
    if to_write is None or to_upload is None:
        return None
    return max(to_write, to_upload)


def take_reading(
    view: StatusView,
    heartbeats: dict[str, schemas.Heartbeat],
    *,
    now: float,
    silent_after_s: float,
    tokens_per_s: float,
    samples_per_s: float,
) -> Reading:
    return Reading(
        view=view,
        tokens_per_s=tokens_per_s,
        samples_per_s=samples_per_s,
        eta_s=eta_to_done(view, tokens_per_s=tokens_per_s, samples_per_s=samples_per_s),
        workers=worker_states(heartbeats, now=now, silent_after_s=silent_after_s, done=view.done),
        spool=spool_by_node(heartbeats),
    )


def live_workers_by_service(reading: Reading) -> dict[str, int]:
    counts: dict[str, int] = {}
    for (service, _node, state), count in sorted(reading.workers.items()):
        if state != SILENT:
            counts[service] = counts.get(service, 0) + count
    return counts


def silent_count(reading: Reading) -> int:
    return sum(count for (_service, _node, state), count in reading.workers.items() if state == SILENT)


def percent_uploaded(view: StatusView) -> float:
    total = view.total_samples
    return 100.0 * view.samples_uploaded / total if total else 0.0


def progress_line(reading: Reading) -> dict:
    """The fields of the `progress` line, in PROGRESS_FIELDS order."""
    view = reading.view
    by_service = live_workers_by_service(reading)
    return {
        "samples_total": view.total_samples,
        "samples_written": view.samples_written,
        "samples_uploaded": view.samples_uploaded,
        "percent": round(percent_uploaded(view), 1),
        "tokens_total": view.total_tokens,
        "tokens_done": view.tokens_written,
        "tokens_uploaded": view.tokens_uploaded,
        "bytes_written": view.bytes_written,
        "bytes_uploaded": view.bytes_uploaded,
        "tokens_per_s": round(reading.tokens_per_s, 1),
        "samples_per_s": round(reading.samples_per_s, 2),
        "eta_s": None if reading.eta_s is None else round(reading.eta_s, 1),
        "batches_total": view.batches_total,
        "batches_done": view.batches_done,
        "batches_queued": view.batches_queued,
        "spool_backlog_files": view.files_waiting_upload,
        "spool_bytes": {node: used for node, (_files, used) in reading.spool.items()},
        "redeliveries": view.batch_redeliveries + view.file_redeliveries,
        "samples_requeued": view.samples_requeued,
        "dead_letters": view.dead_letters,
        "workers": sum(by_service.values()),
        "workers_silent": silent_count(reading),
        "workers_by_service": by_service,
        "done": view.done,
        "failed": view.failed,
    }


def summary_line(reading: Reading, *, monitored_s: float, elapsed_s: float | None = None) -> dict:
    """The fields of the `job_summary` line, in SUMMARY_FIELDS order. `elapsed_s`: from the job's
    first `written` marker to its last `uploaded` one (the monitored time when unknown); the rates
    are the averages over it."""
    view = reading.view
    elapsed = monitored_s if elapsed_s is None else elapsed_s
    return {
        "samples": view.samples_uploaded,
        "tokens": view.tokens_uploaded,
        "bytes": view.bytes_uploaded,
        "batches": view.batches_done,
        "dest": view.dest,
        "redeliveries": view.batch_redeliveries + view.file_redeliveries,
        "samples_requeued": view.samples_requeued,
        "dead_letters": view.dead_letters,
        "monitored_s": round(monitored_s, 1),
        "elapsed_s": round(elapsed, 1),
        "samples_per_s": round(view.samples_uploaded / elapsed, 2) if elapsed > 0 else None,
        "tokens_per_s": round(view.tokens_uploaded / elapsed, 1) if elapsed > 0 else None,
    }
