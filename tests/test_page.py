"""What the monitor's page shows, from its pure parts (monitor/page.py) and the heartbeat's `load`
(hsx/wire/load.py, schemas.WorkerLoad): the rate history covers the whole job in bounded points,
workers are marked silent and degraded and left out once gone, each node's free disk and
high-water mark come from its newest measurement, heartbeats from workers older than `load`
still decode, and a port the page cannot listen on is one line naming it (an IPv6 address in
brackets). The page in a browser is tests/test_web.py."""

import asyncio
import re
import socket

import msgspec
import pytest

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.monitor.page import HISTORY_POINTS, RateHistory, node_rows, worker_rows
from hsx.monitor.report import take_reading
from hsx.monitor.web import WebServer
from hsx.wire import schemas
from hsx.wire.counts import ProgressCounts, QueueState
from hsx.wire.fold import ProgressFold
from hsx.wire.load import RecentRate
from hsx.wire.statusview import status_view

NOW = 1_800_000_000.0


def beat(instance: str, service: str, node: str, state: str, age: float, load=None, **fields) -> schemas.Heartbeat:
    return schemas.Heartbeat(
        job="j", service=service, instance=instance, node=node, state=state, sent_at=NOW - age, load=load, **fields
    )


def test_the_rate_history_covers_the_whole_job_in_bounded_points():
    history = RateHistory()
    for i in range(5 * HISTORY_POINTS):
        history.add(NOW + 5 * i, 2.0, 1.0, 900.0, 800.0)
    rows = history.rows()
    assert HISTORY_POINTS // 2 <= len(rows) < HISTORY_POINTS
    assert rows[0][0] < NOW + 5 * 2 * 5 and rows[-1][0] <= NOW + 5 * (5 * HISTORY_POINTS - 1)
    assert all(row[1:] == [2.0, 1.0, 900.0, 800.0] for row in rows)  # merged readings keep their mean
    assert [row[0] for row in rows] == sorted(row[0] for row in rows)


def test_workers_are_marked_silent_and_degraded_and_the_gone_left_out():
    load = schemas.WorkerLoad(
        device="cuda:0",
        samples_per_s=3.5,
        in_hand=2,
        busy=0.25,
        gpu_utilization=31.0,
        gpu_memory_used=10 << 30,
        gpu_memory_total=80 << 30,
    )
    beats = {
        b.instance: b
        for b in (
            beat("a-1", "gpu_consumer", "a", "working", 1, load, kernels=schemas.Kernels(attention="sdpa")),
            beat("a-2", "gpu_consumer", "a", "paused", 2, detail="spool holds 9 bytes, high-water mark 1"),
            beat("b-1", "uploader", "b", "working", 45),
            beat("b-2", "uploader", "b", "stopping", 1),
            beat("p-1", "producer", "a", "working", 1),
        )
    }
    rows = {row["instance"]: row for row in worker_rows(beats, now=NOW, silent_after_s=30, done=False)}
    assert set(rows) == {"a-1", "a-2", "b-1"}
    assert rows["a-1"]["state"] == "working" and not rows["a-1"]["silent"] and not rows["a-1"]["degraded"]
    assert (rows["a-1"]["device"], rows["a-1"]["busy"], rows["a-1"]["gpu_utilization"]) == ("cuda:0", 0.25, 31.0)
    assert rows["a-1"]["kernels"] == "sdpa" and rows["a-1"]["compiled"] is False
    assert rows["a-2"]["degraded"] and rows["a-2"]["detail"].startswith("spool holds")
    assert rows["a-2"]["busy"] is None and rows["a-2"]["gpu_memory_used"] is None  # an older sender: no load
    assert rows["b-1"]["silent"] and rows["b-1"]["state"] == "silent" and rows["b-1"]["last_state"] == "working"
    # Once done, a worker that went away is no problem: not shown.
    assert {row["instance"] for row in worker_rows(beats, now=NOW, silent_after_s=30, done=True)} == {"a-1", "a-2"}


def test_each_node_shows_its_newest_free_disk_and_the_high_water_mark():
    beats = {
        b.instance: b
        for b in (
            beat(
                "a-1",
                "gpu_consumer",
                "a",
                "working",
                9,
                schemas.WorkerLoad(spool_free=100, spool_high_water=50),
                spool_files=3,
                spool_bytes=30,
            ),
            beat(
                "a-2", "uploader", "a", "working", 1, schemas.WorkerLoad(spool_free=90), spool_files=2, spool_bytes=20
            ),
            beat("b-1", "uploader", "b", "idle", 1),
        )
    }
    spec = JobSpec(
        job="j", model="m", model_revision="", layers=[1], dtype="bfloat16", dest="file:///tmp/x",
        token_budget=8, max_seq_len=8, dataset="d", plan_fingerprint="a" * 64, total_samples=4,
        total_tokens=16, total_batches=1, created_at=NOW, published=True,
    )  # fmt: skip
    fold = ProgressFold(job="j", heartbeats=beats)
    view = status_view(spec, fold, QueueState(), ProgressCounts(), job="j", now=NOW)
    reading = take_reading(view, beats, now=NOW, silent_after_s=30, tokens_per_s=0, samples_per_s=0)
    nodes = {row["node"]: row for row in node_rows(beats, reading, {"b": 4})}
    assert nodes["a"] == {
        "node": "a",
        "spool_files": 2,
        "spool_bytes": 20,
        "free_bytes": 90,
        "high_water_bytes": 50,
        "files_waiting": 0,
    }
    assert nodes["b"]["free_bytes"] is None and nodes["b"]["files_waiting"] == 4


def test_a_heartbeat_without_load_decodes_and_a_load_out_of_range_does_not():
    old = b'{"type":"heartbeat.v1","job":"j","service":"uploader","instance":"n-1","node":"n","state":"idle"}'
    assert schemas.event_decoder.decode(old).load is None
    new = schemas.encode(beat("n-1", "uploader", "n", "idle", 0, schemas.WorkerLoad(samples_per_s=2.0, in_hand=3)))
    assert schemas.event_decoder.decode(new).load.in_hand == 3
    bad = new.replace(b'"in_hand":3', b'"in_hand":3,"busy":2.0')
    with pytest.raises(msgspec.ValidationError):
        schemas.event_decoder.decode(bad)


def test_a_workers_rate_is_its_samples_over_the_last_minute():
    rate = RecentRate(window_s=60)
    start = rate._started
    for second in range(0, 120, 10):
        rate.add(5, now=start + second)
    # Seen from 119 s: the additions at 60, 70, ..., 110 s are within the last 60 s, 6 of 5 samples.
    assert rate.per_second(now=start + 119) == pytest.approx(30 / 60)
    assert RecentRate().per_second() == 0.0


@pytest.mark.parametrize("addr", ["127.0.0.1", "::1"])
def test_a_page_port_it_cannot_listen_on_is_one_line_naming_it(addr):
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        taken = socket.socket(family)
    except OSError:
        pytest.skip(f"no {family.name} on this machine")
    with taken:
        taken.bind((addr, 0))
        taken.listen()
        port = taken.getsockname()[1]
        where = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
        server = WebServer(job="j", interval_s=1.0, silent_after_s=30.0)
        with pytest.raises(HsxError, match=rf"^--http {re.escape(where)}: cannot listen"):
            asyncio.run(server.start(addr, port))
