"""The monitor's views of one reading, as pure functions: the `progress` line's fields, workers by
state (silent ones included), the spool backlog per node, the terminal bar, and the Prometheus
exposition. tests/test_monitor.py checks the same views against a real run."""

import io
import math
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hsx.job import JobSpec
from hsx.monitor.bar import TerminalBar, render_bar
from hsx.monitor.metrics import JobCollector
from hsx.monitor.report import (
    PROGRESS_FIELDS,
    SUMMARY_FIELDS,
    progress_line,
    silent_workers,
    spool_by_node,
    take_reading,
)
from hsx.wire import schemas
from hsx.wire.counts import ProgressCounts, QueueState
from hsx.wire.fold import ProgressFold
from hsx.wire.statusview import status_view

NOW = 1_000_000.0


def _spec(total=4, tokens=40, batches=2):
    return JobSpec(
        job="j",
        model="m",
        model_revision="r",
        layers=[1],
        dtype="bfloat16",
        dest="file:///tmp/x",
        token_budget=64,
        max_seq_len=32,
        dataset="d",
        plan_fingerprint="f",
        total_samples=total,
        total_tokens=tokens,
        total_batches=batches,
        created_at=0.0,
        published=True,
    )


def _beat(instance, *, service="gpu_consumer", node="n1", state="working", age=1.0, **fields):
    return schemas.Heartbeat(
        job="j", service=service, instance=instance, node=node, state=state, sent_at=NOW - age, **fields
    )


def _view(done=False):
    fold = ProgressFold()
    markers = [
        schemas.BatchWritten(
            job="j",
            batch_id="b0",
            consumer="c",
            node="n1",
            sample_indices=[0, 1],
            tokens=20,
            bytes=2000,
            seconds=0.1,
            attempt=2,
        )
    ]
    markers += [
        schemas.FileUploaded(
            job="j",
            node="n1",
            uploader="u",
            sample_index=index,
            key=f"j/00000/{index}.safetensors",
            size=1000,
            tokens=10,
        )
        for index in ([0, 1, 2, 3] if done else [0])
    ]
    if done:
        markers.append(
            schemas.BatchWritten(
                job="j",
                batch_id="b1",
                consumer="c",
                node="n1",
                sample_indices=[2, 3],
                tokens=20,
                bytes=2000,
                seconds=0.1,
                attempt=1,
            )
        )
    for seq, marker in enumerate(markers, start=1):
        fold.apply_marker(marker, seq=seq, planned=True)
    counts = ProgressCounts(samples_uploaded=4 if done else 1, batches_done=2 if done else 1)
    queues = QueueState() if done else QueueState(batches_queued=1, files_queued=1, file_redeliveries=3)
    return status_view(_spec(), fold, queues, counts, job="j")


HEARTBEATS = {
    "gpu-a": _beat("gpu-a", last_batch="b0", detail="", spool_files=2, spool_bytes=2000, age=2.0),
    # Paused: the detail says why; the last batch is a separate field.
    "gpu-b": _beat(
        "gpu-b",
        node="n2",
        state="paused",
        detail="spool holds 9 bytes, high-water mark 1",
        last_batch="b7",
        spool_files=1,
        spool_bytes=9,
        age=1.0,
    ),
    # Killed: its last beat is old.
    "gpu-c": _beat("gpu-c", node="n2", last_batch="b9", spool_files=5, spool_bytes=5000, age=100.0),
    "up-a": _beat("up-a", service="uploader", node="n1", state="idle", spool_files=1, spool_bytes=1000, age=0.5),
    # Stopped cleanly: gone, not silent.
    "up-b": _beat("up-b", service="uploader", node="n1", state="stopping", age=500.0),
}


def _reading(done=False, heartbeats=HEARTBEATS, tokens_per_s=10.0, samples_per_s=0.5):
    return take_reading(
        _view(done), heartbeats, now=NOW, silent_after_s=30.0, tokens_per_s=tokens_per_s, samples_per_s=samples_per_s
    )


def test_progress_line_has_every_documented_field_and_the_reading_in_it():
    line = progress_line(_reading())
    assert tuple(line) == PROGRESS_FIELDS
    assert (line["samples_total"], line["samples_written"], line["samples_uploaded"], line["percent"]) == (
        4,
        2,
        1,
        25.0,
    )
    assert (line["tokens_total"], line["tokens_done"], line["bytes_written"]) == (40, 20, 2000)
    assert line["redeliveries"] == 1 + 3  # the batch's second delivery + file redeliveries pending in JetStream
    # Per node, the newest heartbeat that measured the spool: n1 from the uploader (0.5 s old),
    # n2 from the paused consumer (the silent one's measurement is older).
    assert line["spool_bytes"] == {"n1": 1000, "n2": 9}
    assert line["workers"] == 3 and line["workers_silent"] == 1
    assert line["workers_by_service"] == {"gpu_consumer": 2, "uploader": 1}
    # ETA: the slower of writing 20 tokens at 10/s (2 s) and uploading 3 samples at 0.5/s (6 s).
    assert line["eta_s"] == 6.0 and line["done"] is False


def test_a_nodes_spool_is_its_newest_measurement_not_its_newest_beat():
    # The uploader measured the drained spool after the consumer's last walk; the consumer's beat,
    # sent later, still carries the count of that walk: the node shows the uploader's 0.
    walk, drained = NOW - 3.0, NOW - 1.0
    beats = {
        "gpu-a": _beat("gpu-a", spool_files=24, spool_bytes=24_000, spool_measured_at=walk, age=0.2),
        "up-a": _beat("up-a", service="uploader", spool_files=0, spool_bytes=0, spool_measured_at=drained, age=1.0),
    }
    assert spool_by_node(beats) == {"n1": (0, 0)}
    # A sender from before the field (0): its send time stands for the measurement.
    beats["gpu-a"] = _beat("gpu-a", spool_files=24, spool_bytes=24_000, age=0.2)
    assert spool_by_node(beats) == {"n1": (24, 24_000)}


def test_eta_is_unknown_without_a_rate_and_zero_when_done():
    assert progress_line(_reading(samples_per_s=0.0))["eta_s"] is None
    assert progress_line(_reading(done=True, tokens_per_s=0.0, samples_per_s=0.0))["eta_s"] == 0.0


def test_a_silent_consumer_is_named_with_its_node_and_last_batch_not_its_detail():
    silent = silent_workers(HEARTBEATS, now=NOW, silent_after_s=30.0)
    assert silent == [
        {
            "instance": "gpu-c",
            "service": "gpu_consumer",
            "node": "n2",
            "last_batch": "b9",
            "last_state": "working",
            "silent_s": 100.0,
        }
    ]
    paused_and_killed = {
        **HEARTBEATS,
        "gpu-b": _beat("gpu-b", node="n2", state="paused", detail="spool holds 9 bytes", last_batch="b7", age=60.0),
    }
    named = {w["instance"]: w["last_batch"] for w in silent_workers(paused_and_killed, now=NOW, silent_after_s=30.0)}
    assert named == {"gpu-b": "b7", "gpu-c": "b9"}


def test_bar_is_one_line_with_progress_rate_eta_workers_and_spool():
    line = render_bar(_reading(), job="j", width=300)
    assert line == (
        "j [#####...............]  25.0% 1/4 | ETA 6s | 10 tok/s | workers 2 gpu 1 up (1 silent) "
        "| spool n1 1000 B, n2 9 B | batches 1/2"
    )
    # Narrower: what does not fit is left out whole, and the last column stays free.
    assert (
        render_bar(_reading(), job="j", width=72)
        == "j [#####...............]  25.0% 1/4 | ETA 6s | 10 tok/s | batches 1/2"
    )
    assert len(render_bar(_reading(), job="j", width=20)) == 19


def test_bar_shows_the_summary_when_done():
    line = render_bar(_reading(done=True), job="j", width=300)
    assert line.startswith("j done: 4/4 samples, 40 tokens, 3.9 KiB, 2 batches")
    assert "redeliveries 1" in line and "dead letters 0" in line


def test_terminal_bar_prints_log_lines_above_itself_and_ends_below():
    out = io.StringIO()
    bar = TerminalBar(out)
    bar.draw("first")
    bar.draw("second")
    print("a warning", file=bar.above, flush=True)  # what structlog's PrintLogger does
    bar.finish()
    # Each drawing leaves the cursor at the start of its line ("\r"): another process's line
    # written meanwhile goes over the bar, not after it (tests/test_status_truth.py).
    assert out.getvalue() == "\r\x1b[2Kfirst\r\r\x1b[2Ksecond\r\r\x1b[2Ka warning\nsecond\r\r\x1b[2Ksecond\n"


def _scrape(collector: JobCollector) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_expose_the_reading_with_job_node_service_labels():
    collector = JobCollector("j")
    assert _scrape(collector) == {}  # nothing before the first reading
    reading = _reading(samples_per_s=0.0)
    collector.update(reading)
    samples = _scrape(collector)
    job = (("job", "j"),)

    def value(name, **labels):
        return samples[(name, tuple(sorted({"job": "j", **labels}.items())))]

    assert value("hsx_samples_written_total") == 2 and value("hsx_samples_uploaded_total") == 1
    assert value("hsx_tokens_written_total") == 20 and value("hsx_bytes_uploaded_total") == 1000
    assert value("hsx_batches_done_total") == 1 and value("hsx_job_batches") == 2
    assert value("hsx_batches_pending") == 1 and value("hsx_files_pending") == 1
    assert value("hsx_redeliveries", queue="batches") == 1 and value("hsx_redeliveries", queue="files") == 3
    assert value("hsx_job_done") == 0 and value("hsx_tokens_per_second") == 10.0
    assert math.isnan(value("hsx_eta_seconds"))  # no upload rate yet
    assert value("hsx_workers", service="gpu_consumer", node="n1", state="working") == 1
    assert value("hsx_workers", service="gpu_consumer", node="n2", state="paused") == 1
    assert value("hsx_workers", service="gpu_consumer", node="n2", state="silent") == 1
    assert value("hsx_workers", service="uploader", node="n1", state="idle") == 1
    assert not [key for key in samples if key[0] == "hsx_workers" and ("state", "stopping") in key[1]]
    assert value("hsx_spool_bytes", node="n1") == 1000 and value("hsx_spool_files", node="n2") == 1
    assert ("hsx_job_samples", job) in samples


def test_the_reference_describes_every_progress_field_and_metric():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "reference" / "progress.md").read_text()
    collector = JobCollector("j")
    collector.update(_reading())
    names = {name for name, _labels in _scrape(collector)}
    missing = [f"`{name}`" for name in [*PROGRESS_FIELDS, *SUMMARY_FIELDS, *names] if f"`{name}`" not in doc]
    assert not missing, f"docs/reference/progress.md does not describe {missing}"
