"""Clean edges (docs/reliability/faults-processes.md): a status that cannot read its events in time says so in one
line; a service stopped while NATS is down exits 0 without a traceback; events are kept as long
as the job (no age limit) while heartbeats stay one per worker and no rollup erases anything; the stdlib logging of the
libraries underneath comes out in hsx's JSON stream, and an exception keeps its traceback; an
uploader stopped with uploads in hand while NATS is down leaves them to their redelivery in one
line each, without a traceback."""

import asyncio
import json
import signal
import subprocess
import sys
import time

import msgspec
import nats
import nats.js.errors
import pytest
from conftest import REPO, _free_port
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from test_chaos import log_events, stoppable_s3, wait_for  # noqa: F401 (stoppable_s3: a fixture)
from test_e2e_s3 import logs_of, produce, write_dataset
from test_nats_names import documented_names

from hsx.commands.embedded import start_nats_server
from hsx.exitcodes import DONE, STOPPED
from hsx.wire import schemas, topology
from hsx.wire.events import EventPublisher
from hsx.wire.jobs import last_heartbeats

DAY = 24 * 3600.0
ROLLUP_NOT_PERMITTED = 10111  # JetStream's error code for a rollup on a stream that allows none


def _spec_json(job: str) -> bytes:
    return msgspec.json.encode(
        {
            "type": "job.v1",
            "job": job,
            "model": "m",
            "model_revision": "local",
            "layers": [1],
            "dtype": "bfloat16",
            "dest": "file:///nonexistent",
            "token_budget": 64,
            "max_seq_len": 32,
            "dataset": "d",
            "plan_fingerprint": "ab" * 32,
            "total_samples": 20_000,
            "total_tokens": 160_000,
            "total_batches": 10_000,
            "created_at": 0.0,
            "published": True,
        }
    )


def test_status_past_its_timeout_prints_one_line_and_no_traceback(hsx, nats_server, job_name):
    async def setup() -> None:
        nc = await nats.connect(nats_server.url)
        kv = await topology.ensure_topology(nc.jetstream())
        await kv.put(job_name, _spec_json(job_name))
        await nc.drain()

    asyncio.run(setup())
    # A reading of a job's counts takes some thirty requests: far more than 1 ms.
    result = hsx("status", "--job", job_name, "--timeout", "0.001")
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hsx: error:") and "did not answer within 0.001 s" in lines[0], lines
    assert "--timeout" in lines[0]


def test_services_stopped_while_nats_is_down_exit_0_without_a_traceback(
    tmp_path, hsx, hsx_service, tiny_model, job_name
):
    store, port = tmp_path / "nats", _free_port()
    server = start_nats_server(store, port=port, log_file=tmp_path / "nats-server.log")
    try:
        env = {"HSX_NATS_URL": server.url}
        write_dataset(tmp_path / "data.jsonl", 6, min_len=4, max_len=12, seed=5)
        produce(
            hsx,
            job=job_name,
            model=tiny_model("qwen3"),
            dataset=tmp_path / "data.jsonl",
            dest=str(tmp_path / "out"),
            token_budget=64,
            max_seq_len=16,
            env=env,
        )
        spool = str(tmp_path / "spool")
        services = [
            hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", spool, env=env, name="consume"),
            hsx_service("upload", "--job", job_name, "--spool", spool, env=env, name="upload"),
            hsx_service("monitor", "--job", job_name, "--interval", "0.5", env=env, name="monitor"),
        ]
        monitor = services[2]
        # Each in its steady state (the job done, workers idle), not still starting up.
        wait_for(
            lambda: log_events(monitor, "job_summary"), timeout=60, what="job done", procs=services, alive=services
        )
        server.stop()
        wait_for(
            lambda: all(log_events(proc, "nats_disconnected") for proc in services),
            timeout=20,
            what="every service saw NATS go",
            procs=services,
            alive=services,
        )
        signalled = time.monotonic()
        for proc in services:
            proc.send_signal(signal.SIGTERM)
        took = {}
        while len(took) < len(services):
            for proc in services:
                if proc.args[3] not in took and proc.poll() is not None:
                    took[proc.args[3]] = round(time.monotonic() - signalled, 1)
            running = [proc for proc in services if proc.poll() is None]
            assert not running or time.monotonic() - signalled < 30, (
                f"{running[0].args[3]} did not stop within 30 s of SIGTERM\n{logs_of(running[0])}"
            )
            time.sleep(0.05)
        print(f"\nEDGES stopped_while_nats_down: seconds from SIGTERM to exit {took}")
        for proc in services:
            text = proc.log_path.read_text()
            # Stopped before told the job is done: the workers; the monitor saw it done.
            expected = DONE if proc.args[3] == "monitor" else STOPPED
            assert proc.returncode == expected and "ConnectionReconnectingError" not in text, (
                f"{proc.args[3]} exited {proc.returncode}\n{logs_of(proc)}"
            )
            # No traceback printed on the way out: every line is one of the log stream's JSON lines.
            raw = [line for line in text.splitlines() if not line.startswith("{")]
            assert not raw, f"{proc.args[3]} printed lines outside its JSON log:\n" + "\n".join(raw[-40:])
    finally:
        server.stop()


def test_streams_of_an_older_hsx_are_updated_in_place_and_no_rollup_erases_anything(tmp_path, job_name):
    """An existing HSX_EVENTS (30 days, rollups allowed for the heartbeats it held) and HSX_DEAD
    (90 days) are updated in place: no age limit, no rollups, nothing lost. HSX_STATE is made and
    keeps one heartbeat per worker without any header; a `Nats-Rollup` publish on either stream is
    refused; the heartbeats an older hsx left in HSX_EVENTS are not read. The docs say the same."""
    server = start_nats_server(tmp_path / "nats", log_file=tmp_path / "nats-server.log")

    async def run() -> None:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        # The streams as an earlier hsx created them.
        for name, subject, age, rollup in (
            (topology.EVENTS_STREAM, "hsx.events.>", 30 * DAY, True),
            (topology.DEAD_STREAM, "hsx.dead.>", 90 * DAY, False),
        ):
            await js.add_stream(
                StreamConfig(
                    name=name,
                    subjects=[subject],
                    retention=RetentionPolicy.LIMITS,
                    storage=StorageType.FILE,
                    max_age=age,
                    allow_rollup_hdrs=rollup,
                )
            )
        events = EventPublisher(nc, js, job_name)
        early = schemas.FileUploaded(job=job_name, node="n", uploader="u", sample_index=0, key="k", size=1, tokens=1)
        await events.emit(early)
        # An older hsx's last heartbeat, on its subject of HSX_EVENTS, rolled up as it sent them.
        old = schemas.Heartbeat(
            job=job_name, service="uploader", instance="node-0-100", node="node-0", state="idle", sent_at=time.time()
        )
        old_subject = f"hsx.events.{job_name}.heartbeat.node-0-100"
        await js.publish(old_subject, schemas.encode(old), headers={"Nats-Rollup": "sub"})

        await topology.ensure_topology(js)
        for name in (topology.EVENTS_STREAM, topology.DEAD_STREAM):
            info = await js.stream_info(name)
            assert not info.config.max_age, f"{name} still drops messages after {info.config.max_age} s"
        info = await js.stream_info(topology.EVENTS_STREAM)
        assert not info.config.allow_rollup_hdrs and info.state.messages == 2, info
        state = await js.stream_info(topology.STATE_STREAM)
        assert state.config.max_msgs_per_subject == 1 and not state.config.allow_rollup_hdrs, state.config

        # A rollup is refused by the server on both streams, a marker's subject and a heartbeat's.
        for subject in (
            topology.event_subject(job_name, "uploaded"),
            topology.heartbeat_subject(job_name, "uploader", "node-1-101"),
        ):
            for value in ("all", "sub"):
                with pytest.raises(nats.js.errors.APIError) as refused:
                    await js.publish(subject, schemas.encode(early), headers={"Nats-Rollup": value})
                assert refused.value.err_code == ROLLUP_NOT_PERMITTED, refused.value
        assert (await js.stream_info(topology.EVENTS_STREAM)).state.messages == 2

        for beat in range(25):
            for instance in ("node-1-101", "node-1-102"):
                await events.heartbeat(
                    service="uploader", instance=instance, node="node-1", state="idle", detail=f"beat {beat}"
                )
            await events.emit(msgspec.structs.replace(early, sample_index=beat + 1))
        # Heartbeats are sent without an ack; a stream stores what one connection sends in order,
        # so once a later message of HSX_STATE is acked every beat before it is stored.
        await js.publish(f"hsx.state.{job_name}.fence", b"")
        info = await js.stream_info(topology.EVENTS_STREAM, subjects_filter=f"hsx.events.{job_name}.>")
        assert info.state.subjects == {topology.event_subject(job_name, "uploaded"): 26, old_subject: 1}, (
            info.state.subjects
        )
        info = await js.stream_info(topology.STATE_STREAM, subjects_filter=topology.heartbeats_subject_all(job_name))
        assert info.state.subjects == {
            topology.heartbeat_subject(job_name, "uploader", "node-1-101"): 1,
            topology.heartbeat_subject(job_name, "uploader", "node-1-102"): 1,
        }, info.state.subjects
        last = await js.get_last_msg(
            topology.STATE_STREAM, topology.heartbeat_subject(job_name, "uploader", "node-1-102")
        )
        assert schemas.event_decoder.decode(last.data).detail == "beat 24"
        beats = await last_heartbeats(js, job_name)
        assert [(beat.instance, beat.detail) for beat in beats] == [
            ("node-1-101", "beat 24"),
            ("node-1-102", "beat 24"),
        ]
        await nc.drain()

    try:
        asyncio.run(run())
    finally:
        server.stop()
    names = documented_names(job="j", node="n")
    for stream in (topology.EVENTS_STREAM, topology.DEAD_STREAM):
        kind = names[stream]["kind"]
        assert "days" not in kind and "no age limit" in kind, f"docs/operations/nats.md: {stream}: {kind}"
    for stream in (topology.EVENTS_STREAM, topology.STATE_STREAM):
        assert "no rollups" in names[stream]["kind"], f"docs/operations/nats.md: {stream}: {names[stream]['kind']}"
    readme = (REPO / "README.md").read_text()
    assert "| Limits, 30 days |" not in readme and "| Limits, 90 days |" not in readme


LOGGING_SCRIPT = """
import logging, sys, warnings
import structlog
from hsx.logs import configure_logging
from hsx.model.modelinfo import load_model_info

configure_logging(json=True, level="info")
structlog.contextvars.bind_contextvars(job="jlog")
log = structlog.get_logger("hsx.test")
log.info("own_event", answer=42)
logging.getLogger("nats.aio.client").warning("nats says %s", "hello")
logging.getLogger("botocore.credentials").debug("below the level")
try:
    1 / 0
except ZeroDivisionError:
    log.warning("own_failure", exc_info=True)
    logging.getLogger("botocore.endpoint").error("library failure", exc_info=True)
load_model_info(sys.argv[1])  # imports transformers, as the producer does
from transformers.utils import logging as transformers_logging
transformers_logging.get_logger("transformers.modeling_utils").warning("transformers says hello")
warnings.warn("a python warning")
"""


def test_library_logging_comes_out_as_json_lines_with_tracebacks(tiny_model):
    result = subprocess.run(
        [sys.executable, "-c", LOGGING_SCRIPT, str(tiny_model("qwen3"))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    records = []
    for line in result.stderr.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\n{result.stderr}") from None
    by_event = {record["event"]: record for record in records}
    own, nats_line = by_event["own_event"], by_event["nats says hello"]
    assert set(nats_line) == set(own) - {"answer"}, (own, nats_line)
    assert nats_line["level"] == "warning" and nats_line["logger"] == "nats.aio.client" and nats_line["job"] == "jlog"
    assert own["logger"] == "hsx.test" and "below the level" not in result.stderr
    for event in ("own_failure", "library failure"):
        trace = by_event[event].get("exception", "")
        assert trace.startswith("Traceback") and "ZeroDivisionError: division by zero" in trace, by_event[event]
    assert by_event["transformers says hello"]["logger"] == "transformers.modeling_utils"
    assert any("a python warning" in record["event"] and record["logger"] == "py.warnings" for record in records), (
        records
    )


def test_an_uploader_stopped_with_uploads_in_hand_while_nats_is_down_exits_0_without_a_traceback(
    tmp_path, hsx, hsx_service, tiny_model, job_name, request
):
    """Its uploads wait out an S3 outage while NATS goes away too; S3 comes back, so the uploads
    are stored and their reports wait for NATS; then SIGTERM: each event in hand is left to its
    redelivery with one line, no traceback from the NATS client."""
    s3, bucket, _ = request.getfixturevalue("stoppable_s3")
    store, port = tmp_path / "nats", _free_port()
    server = start_nats_server(store, port=port, log_file=tmp_path / "nats-server.log")
    try:
        env = {"HSX_NATS_URL": server.url}
        write_dataset(tmp_path / "data.jsonl", 6, min_len=4, max_len=12, seed=7)
        produce(
            hsx,
            job=job_name,
            model=tiny_model("qwen3"),
            dataset=tmp_path / "data.jsonl",
            dest=f"s3://{bucket}/prefix",
            token_budget=32,
            max_seq_len=16,
            env=env,
        )
        spool = str(tmp_path / "spool")
        consumer = hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", spool, env=env)
        wait_for(
            lambda: len(list((tmp_path / "spool").rglob("*.safetensors"))) == 6,
            timeout=60,
            what="every file spooled",
            procs=[consumer],
            alive=[consumer],
        )
        s3.stop()
        uploader = hsx_service("upload", "--job", job_name, "--spool", spool, env=env, name="upload")
        wait_for(
            lambda: log_events(uploader, "destination_unreachable"),
            timeout=60,
            what="uploads waiting out the S3 outage",
            procs=[uploader],
            alive=[uploader],
        )
        server.stop()
        wait_for(
            lambda: log_events(uploader, "nats_disconnected"),
            timeout=20,
            what="the uploader seeing NATS go",
            procs=[uploader],
            alive=[uploader],
        )
        s3.start()
        wait_for(
            lambda: [r for r in log_events(uploader, "nats_retry") if r["what"] == "report_uploaded"],
            timeout=60,
            what="stored uploads waiting for NATS to report them",
            procs=[uploader],
            alive=[uploader],
        )
        uploader.send_signal(signal.SIGTERM)
        assert uploader.wait(timeout=30) == STOPPED, logs_of(uploader)
        text = uploader.log_path.read_text()
        raw = [line for line in text.splitlines() if not line.startswith("{")]
        assert not raw, "printed lines outside its JSON log:\n" + "\n".join(raw[-40:])
        traced = [line for line in text.splitlines() if '"exception"' in line]
        assert not traced, "a traceback in the log:\n" + "\n".join(traced[:3])
        assert log_events(uploader, "file_left_unacked"), logs_of(uploader)
    finally:
        server.stop()
