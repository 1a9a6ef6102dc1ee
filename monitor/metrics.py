"""Prometheus /metrics for the job a monitor follows (`hsx monitor --metrics-port PORT`).

A collector on a private registry exposes the monitor's latest reading; nothing is counted here.
Totals that only grow (samples, tokens and bytes written and uploaded, batches done, samples
requeued) are counters; the rest are gauges. Readings from JetStream that can go down (a
redelivered message acked, a dead letter retried) are gauges even where they look like counts.
docs/reference/progress.md lists every metric.
"""

import math
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hsx.errors import HsxError
from hsx.monitor.report import Reading

# name (without _total), help, field of the status view
_COUNTERS = (
    ("hsx_samples_written", "Distinct samples written to a spool", "samples_written"),
    ("hsx_samples_uploaded", "Distinct samples stored in the destination", "samples_uploaded"),
    ("hsx_tokens_written", "Tokens of the batches written", "tokens_written"),
    ("hsx_tokens_uploaded", "Tokens of the samples stored in the destination", "tokens_uploaded"),
    ("hsx_bytes_written", "Bytes of the sample files written", "bytes_written"),
    ("hsx_bytes_uploaded", "Bytes of the sample files stored in the destination", "bytes_uploaded"),
    ("hsx_batches_done", "Distinct batches written and announced", "batches_done"),
    ("hsx_samples_requeued", "Samples sent back for extraction after their spool file was lost", "samples_requeued"),
)
_GAUGES = (
    ("hsx_job_samples", "Samples in the job", "total_samples"),
    ("hsx_job_tokens", "Tokens in the job", "total_tokens"),
    ("hsx_job_batches", "Batches in the job's plan", "batches_total"),
    ("hsx_batches_pending", "Batch descriptors still in the work queue (JetStream)", "batches_queued"),
    ("hsx_files_pending", "File-ready events waiting for an uploader (JetStream)", "files_waiting_upload"),
    ("hsx_dead_letters", "Dead letters stored for the job (JetStream)", "dead_letters"),
    ("hsx_progress_timestamp_seconds", "Unix time before which the reading holds every marker", "as_of"),
)


class JobCollector(Collector):
    """Yields the latest reading's metrics on each scrape (from the HTTP server's thread)."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.reading: Reading | None = None  # replaced whole, never mutated: safe to read from a scrape

    def update(self, reading: Reading) -> None:
        self.reading = reading

    def collect(self) -> Iterator[Metric]:
        reading = self.reading
        if reading is None:  # before the job spec is known
            return
        view, job = reading.view, [self.job]

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, documentation, labels=["job"])
            family.add_metric(job, value)
            return family

        for name, documentation, field in _COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=["job"])
            family.add_metric(job, getattr(view, field))
            yield family
        for name, documentation, field in _GAUGES:
            yield gauge(name, documentation, getattr(view, field))

        redeliveries = GaugeMetricFamily(
            "hsx_redeliveries", "Deliveries beyond the first, of batches and of file events", labels=["job", "queue"]
        )
        redeliveries.add_metric([self.job, "batches"], view.batch_redeliveries)
        redeliveries.add_metric([self.job, "files"], view.file_redeliveries)
        yield redeliveries
        yield gauge("hsx_dead_samples", "Samples in dead letters and not in the destination", len(view.dead_samples))
        yield gauge("hsx_tokens_per_second", "Tokens written per second (60 s window)", reading.tokens_per_s)
        yield gauge("hsx_samples_per_second", "Samples uploaded per second (60 s window)", reading.samples_per_s)
        yield gauge(
            "hsx_eta_seconds",
            "Seconds until every sample is uploaded at the current rates (NaN: unknown)",
            math.nan if reading.eta_s is None else reading.eta_s,
        )
        yield gauge("hsx_job_done", "1 when every sample is in the destination and nothing is queued", int(view.done))
        yield gauge(
            "hsx_job_failed",
            "1 when the job cannot finish by itself: every missing sample is dead-lettered, "
            "or the destination refuses uploads",
            int(view.failed),
        )

        workers = GaugeMetricFamily(
            "hsx_workers",
            "Workers by service, node and last heartbeat state (silent: heartbeat stopped)",
            labels=["job", "service", "node", "state"],
        )
        for (service, node, state), count in sorted(reading.workers.items()):
            workers.add_metric([self.job, service, node, state], count)
        yield workers

        spool_files = GaugeMetricFamily("hsx_spool_files", "The job's files in a node's spool", labels=["job", "node"])
        spool_bytes = GaugeMetricFamily(
            "hsx_spool_bytes", "Bytes of the job's files in a node's spool", labels=["job", "node"]
        )
        for node, (files, used) in reading.spool.items():
            spool_files.add_metric([self.job, node], files)
            spool_bytes.add_metric([self.job, node], used)
        yield spool_files
        yield spool_bytes


def serve_metrics(collector: JobCollector, *, host: str, port: int) -> WSGIServer:
    """Serve /metrics from a private registry (the process's default one would add the client
    library's own metrics under names no hsx dashboard expects). Stop it with `server.shutdown()`."""
    registry = CollectorRegistry()
    registry.register(collector)
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise HsxError(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    return server
