"""The NATS names docs/operations/nats.md documents are exactly the ones a running job has.

The table of streams, subjects, consumers and buckets is parsed from the doc, and compared with
what a nats-server of its own reports on its HTTP monitoring port (`-m PORT`, `/jsz`) while a
small job runs with its consumer and uploader bound: the same streams (KV and object store
buckets included, as the streams behind them), the same subjects, the same durable consumers
with the same filters, nothing more.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import urllib.request

import nats
from conftest import REPO
from test_e2e_s3 import produce, start_monitor, wait_until_done, write_dataset

from hsx.commands.embedded import start_nats_server
from hsx.wire import schemas, topology

DOC = REPO / "docs" / "operations" / "nats.md"
COLUMNS = ("what", "kind", "stream", "bucket", "subjects", "durable consumer", "consumer filter")
NODE = "node-a"


def documented_names(*, job: str, node: str, plan: str = "<plan>") -> dict[str, dict]:
    """stream -> {kind, bucket, subjects, consumers: {durable: filter}}, from the doc's table, with
    `<job>`, `<node>` and `<plan>` filled in."""
    lines = DOC.read_text().splitlines()
    header = "| " + " | ".join(COLUMNS) + " |"
    assert header in lines, f"{DOC.name}: no table with the header {header!r}"
    start = lines.index(header) + 2  # past the header and its --- row
    names: dict[str, dict] = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = dict(zip(COLUMNS, (cell.strip() for cell in line.strip().strip("|").split("|")), strict=True))
        quoted = {
            column: [_fill(name, job, node).replace("<plan>", plan) for name in re.findall(r"`([^`]+)`", text)]
            for column, text in cells.items()
        }
        (stream,) = quoted["stream"]
        assert stream not in names, f"{DOC.name}: stream {stream} twice"
        names[stream] = {
            "kind": cells["kind"],
            "bucket": (quoted["bucket"] or [None])[0],
            "subjects": set(quoted["subjects"]),
            "consumers": dict(zip(quoted["durable consumer"], quoted["consumer filter"], strict=True)),
        }
    assert names, f"{DOC.name}: the names table is empty"
    return names


def _plan_tag(url: str, job: str) -> str:
    async def read() -> str:
        nc = await nats.connect(url)
        try:
            entry = await (await nc.jetstream().key_value(topology.JOBS_BUCKET)).get(job)
            return schemas.job_decoder.decode(entry.value).plan_tag
        finally:
            await nc.close()

    return asyncio.run(read())


def _fill(name: str, job: str, node: str) -> str:
    return name.replace("<job>", job).replace("<node>", node)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def jsz(monitoring_url: str) -> list[dict]:
    """Every stream of the server's account, with its config and its consumers (config included)."""
    with urllib.request.urlopen(f"{monitoring_url}/jsz?streams=true&consumers=true&config=true", timeout=5) as reply:
        report = json.loads(reply.read())
    return [stream for account in report.get("account_details") or [] for stream in account.get("stream_detail") or []]


def durables(stream: dict) -> dict[str, dict]:
    """The stream's durable consumers (the ephemeral readers of `hsx monitor` / `hsx status` left out)."""
    return {
        c["config"]["durable_name"]: c for c in stream.get("consumer_detail") or [] if c["config"].get("durable_name")
    }


def test_documented_names_are_exactly_those_of_a_running_job(tmp_path, hsx, hsx_service, tiny_model, job_name):
    port = _free_port()
    server = start_nats_server(tmp_path / "nats", monitoring_port=port, log_file=tmp_path / "nats-server.log")
    try:
        assert server.monitoring_url == f"http://127.0.0.1:{port}"
        env = {"HSX_NATS_URL": server.url}
        write_dataset(tmp_path / "data.jsonl", 12, min_len=4, max_len=64, seed=3)
        produce(
            hsx,
            job=job_name,
            model=tiny_model("qwen3"),
            dataset=tmp_path / "data.jsonl",
            dest=str(tmp_path / "out"),
            token_budget=128,
            max_seq_len=64,
            env=env,
        )
        spool = str(tmp_path / "spool")
        workers = [
            hsx_service(
                "consume",
                "--job",
                job_name,
                "--device",
                "cpu",
                "--spool",
                spool,
                "--node",
                NODE,
                env=env,
                name="consume",
            ),
            hsx_service("upload", "--job", job_name, "--spool", spool, "--node", NODE, env=env, name="upload"),
        ]
        gpu, upload = topology.gpu_durable(job_name), topology.upload_durable(job_name, NODE)

        # Read while both workers run and are bound: each durable has a pull request waiting or
        # a message in a worker's hands.
        deadline = time.monotonic() + 60
        while True:
            assert all(w.poll() is None for w in workers), "a worker exited before the NATS state was read"
            streams = {stream["name"]: stream for stream in jsz(server.monitoring_url)}
            bound = {
                name: consumer
                for stream in streams.values()
                for name, consumer in durables(stream).items()
                if consumer.get("num_waiting", 0) > 0 or consumer.get("num_ack_pending", 0) > 0
            }
            if {gpu, upload} <= set(bound):
                break
            assert time.monotonic() < deadline, f"consumers not bound within 60 s: {sorted(bound)}"
            time.sleep(0.2)

        documented = documented_names(job=job_name, node=NODE, plan=_plan_tag(server.url, job_name))
        assert set(streams) == set(documented), f"streams {sorted(streams)}, documented {sorted(documented)}"
        for name, doc in documented.items():
            config = streams[name]["config"]
            assert set(config["subjects"]) == doc["subjects"], (
                f"{name}: subjects {config['subjects']}, documented {doc['subjects']}"
            )
            consumers = {durable: c["config"].get("filter_subject") for durable, c in durables(streams[name]).items()}
            assert consumers == doc["consumers"], (
                f"{name}: durable consumers {consumers}, documented {doc['consumers']}"
            )
            if doc["bucket"] is not None:
                prefix = {"KV bucket": "KV_", "object store": "OBJ_"}[doc["kind"]]
                assert name == prefix + doc["bucket"], f"{name} is not the stream of {doc['kind']} {doc['bucket']}"
        # The code's own names for the buckets are the documented ones.
        buckets = {doc["kind"]: doc["bucket"] for doc in documented.values() if doc["bucket"]}
        assert buckets == {"KV bucket": topology.JOBS_BUCKET, "object store": topology.DATASETS_BUCKET}

        wait_until_done(start_monitor(hsx_service, job_name, env), workers)
    finally:
        server.stop()
