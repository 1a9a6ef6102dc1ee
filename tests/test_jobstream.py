"""Training while a job extracts: `JobStream` (hsx/storage/reader.py) over a real job, its
batching and dealing (hsx/storage/streambatches.py) on their own.

- Streams started before the producer each get every sample of the plan once in the first
  epoch, as the files it reads equal what HiddenStateDataset reads from the finished job; two
  ranks get disjoint batches that cover the plan, the same number each; a later epoch has the
  same samples in another order.
- A trainer process killed mid-epoch and started again from the state it saved with its last
  batch sees every sample exactly once, in the very batches a second, uninterrupted trainer of
  another name sees; neither leaves a consumer on the server.
- A job with a dead-lettered batch ends the first epoch with those samples reported missing; a
  replay from a saved state stops where the first reading stopped, even after they are retried.
- The batcher keeps every batch within its budget and every sample once, whatever the pool;
  dealing gives every rank the same count, each batch to one rank, for any count of batches.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import nats
import nats.js.errors
import numpy as np
import pytest
import torch
from conftest import REPO, _env
from nats.js.api import AckPolicy
from test_e2e_s3 import LAYERS, logs_of, read_dir_objects, start_monitor, wait_until_done, write_dataset
from test_exhausted import FAST, _batch_of, _block_sample_path

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.storage.reader import HiddenStateDataset, JobStream
from hsx.storage.streambatches import LandingBatcher, deal, shuffled_batches, split_to_rounds
from hsx.wire import schemas, topology
from hsx.wire.counts import last_sequence
from hsx.wire.landed import EpochEnd, Landed, LandingFeed
from hsx.wire.natsconn import NatsSettings, close_connection, connect

BUDGET = 256
STREAM_TIMEOUT_S = 240.0


def _produce_args(job: str, model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "produce",
        "--job",
        job,
        "--model",
        str(model),
        "--dataset",
        str(data),
        "--layers",
        ",".join(map(str, LAYERS)),
        "--dest",
        str(out),
        "--dtype",
        "float32",
        "--token-budget",
        "256",
        "--max-seq-len",
        "128",
        *extra,
    ]


def _workers(hsx_service, job: str, spool: Path, *extra: str) -> list[subprocess.Popen]:
    consumer = hsx_service("consume", "--job", job, "--device", "cpu", "--spool", str(spool), *extra, name="consume")
    uploader = hsx_service("upload", "--job", job, "--spool", str(spool), name="upload")
    return [consumer, uploader]


class _Reading:
    """One stream's epoch, iterated on a thread of its own: the batches, or the error."""

    def __init__(self, stream: JobStream) -> None:
        self.stream, self.batches, self.error = stream, [], None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for batch in self.stream:
                self.batches.append(batch)
        except BaseException as exc:  # the test raises it
            self.error = exc

    def result(self, timeout: float = STREAM_TIMEOUT_S) -> list[dict]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"stream {self.stream.name} still reading after {timeout:.0f} s"
        if self.error is not None:
            raise self.error
        return self.batches


def _samples_of(batches: list[dict]) -> list[int]:
    return [i for batch in batches for i in batch["sample_index"].tolist()]


def _padded_tokens(batch: dict) -> int:
    lengths = np.diff(batch["cu_seqlens"].numpy())
    return int(len(lengths) * lengths.max())


def test_streams_started_before_the_producer_get_each_sample_once(
    tmp_path, hsx, hsx_service, tiny_model, job_name, nats_server
):
    model = tiny_model("qwen3")
    rows = write_dataset(tmp_path / "data.jsonl", 48, min_len=4, max_len=120, seed=21)
    out, spool = tmp_path / "out", tmp_path / "spool"
    url = f"file://{out}/{job_name}"

    def stream(**kwargs) -> JobStream:
        return JobStream(url, nats=nats_server.url, token_budget=BUDGET, shuffle_buffer=8, concat_layers=True, **kwargs)

    whole = stream(name="whole")
    ranks = [stream(name="ddp", num_replicas=2, rank=r) for r in range(2)]
    readings = [_Reading(s) for s in (whole, *ranks)]
    time.sleep(1.0)  # they wait for a job that does not exist yet
    assert all(r.thread.is_alive() and not r.batches for r in readings)
    workers = _workers(hsx_service, job_name, spool)
    monitor = start_monitor(hsx_service, job_name, None)
    assert hsx(*_produce_args(job_name, model, tmp_path / "data.jsonl", out)).returncode == 0
    wait_until_done(monitor, workers)
    batches = readings[0].result()
    seen = _samples_of(batches)
    assert sorted(seen) == list(range(len(rows))), seen
    assert whole.first_epoch is not None and whole.first_epoch.done and whole.missing == []
    assert all(_padded_tokens(b) <= BUDGET for b in batches)
    # The items are the files, as the reader of the finished job reads them.
    finished = HiddenStateDataset(url, concat_layers=True)
    by_index = {finished.sample_indices[i]: finished[i] for i in range(len(finished))}
    for batch in batches:
        starts = batch["cu_seqlens"].tolist()
        for k, index in enumerate(batch["sample_index"].tolist()):
            item = by_index[index]
            assert torch.equal(batch["hidden_states"][starts[k] : starts[k + 1]], item["hidden_states"])
            assert torch.equal(batch["input_ids"][starts[k] : starts[k + 1]], item["input_ids"])
            assert torch.equal(batch["loss_mask"][starts[k] : starts[k + 1]], item["loss_mask"].to(torch.int64))
            assert item["input_ids"].tolist() == rows[index]["input_ids"]
    # Two ranks: disjoint, together the plan, the same number of batches each.
    per_rank = [readings[1 + r].result() for r in range(2)]
    rank_samples = [_samples_of(b) for b in per_rank]
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    assert not set(rank_samples[0]) & set(rank_samples[1])
    assert sorted(rank_samples[0] + rank_samples[1]) == list(range(len(rows)))
    assert ranks[0].state_dict()["taken"] == len(per_rank[0])
    # A later epoch: the same samples, drawn again, from the end the first epoch recorded.
    whole.set_epoch(1)
    again = _samples_of(list(whole))
    assert sorted(again) == list(range(len(rows))) and again != seen
    assert all(_padded_tokens(b) <= BUDGET for b in list(whole))


def _trainer(tmp_path: Path, nats_url: str, url: str, journal: Path, name: str, *extra: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}-{journal.stem}-{time.monotonic_ns()}.log", "wb")
    process = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests" / "stream_trainer.py"),
            url,
            str(journal),
            "--nats",
            nats_url,
            "--name",
            name,
            *extra,
        ],
        env=_env(nats_url, None),
        stdout=subprocess.PIPE,
        stderr=log,
    )
    process.log_path = Path(log.name)
    return process


def _journal(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _events_consumers(nats_url: str) -> list:
    """Every consumer's info on the events stream."""

    async def read() -> list:
        nc = await nats.connect(nats_url)
        try:
            return await nc.jetstream().consumers_info(topology.EVENTS_STREAM)
        finally:
            await nc.close()

    return asyncio.run(read())


def _trainers_left_nothing_behind(nats_url: str, *, stopped: list[str], killed: list[str]) -> None:
    """No trainer made a durable consumer or acks anything; a trainer that stopped removed its
    consumer (one killed while its feed read may leave one, which the server removes by itself
    once inactive)."""
    left = {}
    for info in _events_consumers(nats_url):
        if info.config.durable_name:
            assert not info.config.durable_name.startswith("hsx-stream"), info.config
            continue
        assert info.config.ack_policy == AckPolicy.NONE and info.config.inactive_threshold, info.config
        left.setdefault(info.config.description, []).append(info.name)
    for name in stopped:
        assert f"hsx stream {name}: reads the markers, acks nothing" not in left, left
    for name in killed:
        assert len(left.get(f"hsx stream {name}: reads the markers, acks nothing", [])) <= 1, left


@pytest.mark.faults
def test_a_trainer_killed_mid_epoch_resumes_from_its_state_exactly_once(
    tmp_path, hsx, hsx_service, tiny_model, job_name, nats_server
):
    model = tiny_model("qwen3")
    rows = write_dataset(tmp_path / "data.jsonl", 60, min_len=4, max_len=120, seed=8)
    out, spool = tmp_path / "out", tmp_path / "spool"
    url = f"file://{out}/{job_name}"
    killed_journal, other_journal = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    slow = ("--seconds-per-batch", "0.2")
    killed = _trainer(tmp_path, nats_server.url, url, killed_journal, "trainer-a", "--pause-after", "4", *slow)
    other = _trainer(tmp_path, nats_server.url, url, other_journal, "trainer-b", *slow)
    workers = _workers(hsx_service, job_name, spool)
    assert hsx(*_produce_args(job_name, model, tmp_path / "data.jsonl", out)).returncode == 0
    lines = iter(killed.stdout.readline, b"")  # log lines may come first
    assert any(line.strip() == b"paused" for line in lines), logs_of(killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    before = _journal(killed_journal)
    assert len(before) == 4
    restarted = _trainer(tmp_path, nats_server.url, url, killed_journal, "trainer-a", *slow)
    for trainer in (restarted, other):
        try:
            code = trainer.wait(timeout=STREAM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"trainer still running\n{logs_of(trainer, *workers)}")
        assert code == 0, logs_of(trainer)
        assert json.loads(trainer.stdout.read().decode().strip().splitlines()[-1]) == {
            "missing": [],
            "missing_count": 0,
        }
    resumed, uninterrupted = _journal(killed_journal), _journal(other_journal)
    assert len(resumed) > len(before)
    samples = [i for line in resumed for i in line["samples"]]
    assert sorted(samples) == list(range(len(rows))), samples
    # The very batches the trainer of another name saw, which the kill did not disturb.
    assert [line["samples"] for line in resumed] == [line["samples"] for line in uninterrupted]
    assert resumed[-1]["state"]["taken"] == len(resumed)
    # Neither left a consumer on the server: nothing of theirs outlives them.
    _trainers_left_nothing_behind(nats_server.url, stopped=["trainer-b"], killed=["trainer-a"])
    for worker in workers:
        worker.terminate()
    assert len([k for k in read_dir_objects(out) if k.endswith(".safetensors")]) == len(rows)


@pytest.mark.faults
def test_a_dead_lettered_batch_ends_the_epoch_with_its_samples_reported(
    tmp_path, hsx, hsx_service, tiny_model, job_name, nats_server
):
    model = tiny_model("qwen3")
    write_dataset(tmp_path / "data.jsonl", 24, min_len=8, max_len=40, seed=7)
    out, spool = tmp_path / "out", tmp_path / "spool"
    url = f"file://{out}/{job_name}"
    args = _produce_args(job_name, model, tmp_path / "data.jsonl", out)
    args[args.index("--token-budget") + 1] = "96"
    args[args.index("--max-seq-len") + 1] = "64"
    assert hsx(*args).returncode == 0
    bad = _batch_of(nats_server.url, job_name, 5)
    blocker = _block_sample_path(spool, out, job_name, 5)
    workers = _workers(hsx_service, job_name, spool, *FAST)

    def rank(r: int, name: str = "dead", replicas: int = 2) -> JobStream:
        return JobStream(
            url, nats=nats_server.url, name=name, token_budget=BUDGET, shuffle_buffer=0, num_replicas=replicas, rank=r
        )

    stream = rank(0)
    first = _Reading(stream).result()
    seen = _samples_of(first)
    end = stream.first_epoch
    assert end is not None and not end.done and "dead-lettered" in end.reason
    assert stream.missing == bad and stream.missing_count == len(bad)
    state = stream.state_dict()
    # Retried and uploaded after rank 0 ended its epoch: rank 1 of the same stream, started only
    # now, ends the epoch where rank 0 did (the end is recorded once for the stream), so the two
    # ranks take every sample that had landed then exactly once, in as many batches each (issue
    # 35, item 3); a replay from the saved state stops there too; a stream of another name reads
    # the whole plan.
    blocker.joinpath("in-the-way").unlink()
    blocker.rmdir()
    assert hsx("dead", "retry", "--job", job_name, "--all").returncode == 0
    fresh = rank(0, name="dead-fresh", replicas=1)
    assert sorted(_samples_of(_Reading(fresh).result())) == list(range(24)), logs_of(*workers)
    assert fresh.first_epoch.done and fresh.missing == []
    late = rank(1)
    second = _Reading(late).result()
    assert late.first_epoch == end and len(second) == len(first), (late.first_epoch, end)
    assert sorted(seen + _samples_of(second)) == sorted(set(range(24)) - set(bad)), (seen, bad)
    replay = rank(0)
    state["taken"] = 0
    replay.load_state_dict(state)
    assert _samples_of(_Reading(replay).result()) == seen
    for worker in workers:
        worker.terminate()


def test_a_job_deleted_under_a_stream_stops_it_in_one_line(tmp_path, hsx, tiny_model, job_name, nats_server):
    write_dataset(tmp_path / "data.jsonl", 8, min_len=4, max_len=20, seed=2)
    out = tmp_path / "out"
    assert hsx(*_produce_args(job_name, tiny_model("qwen3"), tmp_path / "data.jsonl", out)).returncode == 0
    url = f"file://{out}/{job_name}"
    stream = JobStream(url, nats=nats_server.url, name="orphan", token_budget=BUDGET)
    reading = _Reading(stream)  # no worker: nothing lands, the stream waits
    time.sleep(1.0)
    assert reading.thread.is_alive()
    assert hsx("jobs", "delete", job_name, "--force").returncode == 0
    with pytest.raises(HsxError, match=f"stream orphan: job {job_name} was deleted"):
        reading.result(timeout=30)
    # A state saved before the deletion does not resume the job of the name produced again, even
    # with the same plan: its samples land anew, in another order.
    state = stream.state_dict()
    args = _produce_args(job_name, tiny_model("qwen3"), tmp_path / "data.jsonl", out)
    args[args.index("--max-seq-len") + 1] = "64"
    assert hsx(*args).returncode == 0
    again = JobStream(url, nats=nats_server.url, name="orphan", token_budget=BUDGET)
    again.load_state_dict(state)
    with pytest.raises(HsxError, match="the job was deleted and produced again"):
        _Reading(again).result(timeout=30)


def _settings_of(server: str | NatsSettings) -> NatsSettings:
    return server if isinstance(server, NatsSettings) else NatsSettings(url=server)


async def _land(nc, spec: JobSpec, indices) -> int:
    """`uploaded` markers of `indices` as the uploader stores them (no files), once each; the
    stream sequence of the job's last marker once the stream holds them all."""
    js, job, indices = nc.jetstream(), spec.job, list(indices)
    markers = topology.marker_filter(job, "uploaded")
    before = await js.stream_info(topology.EVENTS_STREAM, subjects_filter=markers)
    held = sum((before.state.subjects or {}).values())
    for i in indices:
        event = schemas.FileUploaded(
            job=job, node="n", uploader="u", sample_index=i, key=f"{job}/{i}", size=1, tokens=10, plan=spec.plan_tag
        )
        subject = topology.uploaded_subject(job, spec.plan_tag, i)
        await nc.publish(subject, schemas.encode(event), headers=topology.ONCE_HEADERS)
    await nc.flush()
    for _ in range(100):  # published without waiting for each: until the stream holds them all
        info = await js.stream_info(topology.EVENTS_STREAM, subjects_filter=markers)
        if sum((info.state.subjects or {}).values()) == held + len(indices):
            break
        await asyncio.sleep(0.1)
    return await last_sequence(js, topology.EVENTS_STREAM, markers)


def _fake_job(
    server: str | NatsSettings, job: str, count: int, *, landed=None, published: bool = True
) -> tuple[JobSpec, int]:
    """A job's spec of `count` samples and the `uploaded` markers of `landed` (default: all) as the
    uploader stores them (no files): the spec and the stream sequence of the last marker. Not
    `published`: the producer has not recorded the whole plan yet, so the job is not over."""

    async def make() -> tuple[JobSpec, int]:
        nc = await connect(_settings_of(server), name="test-fake-job")
        try:
            js = nc.jetstream()
            kv = await topology.ensure_topology(js)
            spec = JobSpec(
                job=job,
                model="m",
                model_revision="r",
                layers=[1],
                dtype="bfloat16",
                dest="file:///nowhere",
                token_budget=BUDGET,
                max_seq_len=BUDGET,
                dataset="d.jsonl",
                plan_fingerprint="f" * 64,
                total_samples=count,
                total_tokens=count * 10,
                total_batches=1,
                created_at=time.time(),
                published=published,
            )
            await kv.put(job, schemas.encode(spec))
            return spec, await _land(nc, spec, range(count) if landed is None else landed)
        finally:
            await close_connection(nc)

    return asyncio.run(make())


def _finish_fake_job(server: str | NatsSettings, spec: JobSpec, indices) -> int:
    """Land the markers of `indices`, then record the plan published: the job is done once all
    landed. The stream sequence of the last marker."""

    async def finish() -> int:
        nc = await connect(_settings_of(server), name="test-fake-job")
        try:
            last = await _land(nc, spec, indices)
            kv = await nc.jetstream().key_value(topology.JOBS_BUCKET)
            await kv.put(spec.job, schemas.encode(msgspec.structs.replace(spec, published=True)))
            return last
        finally:
            await close_connection(nc)

    return asyncio.run(finish())


def _marker_sequences(server: str | NatsSettings, job: str) -> list[int]:
    """The stream sequence of each of the job's `uploaded` markers, in order."""

    async def read() -> list[int]:
        nc = await connect(_settings_of(server), name="test-markers")
        try:
            js, seqs = nc.jetstream(), [0]
            while True:
                try:
                    msg = await js.get_msg(
                        topology.EVENTS_STREAM, seqs[-1] + 1, subject=topology.marker_filter(job, "uploaded"), next=True
                    )
                except nats.js.errors.NotFoundError:
                    return seqs[1:]
                seqs.append(msg.seq)
        finally:
            await close_connection(nc)

    return asyncio.run(read())


def _end_record(spec: JobSpec, stream: str, **fields) -> schemas.EpochEndRecord:
    """An epoch-end record of `stream` of the job, every field public: what anyone can write."""
    given = {"job": spec.job, "plan": spec.plan_tag, "stream": stream, "created_at": spec.created_at}
    return schemas.EpochEndRecord(**{**given, "total_samples": spec.total_samples, **fields})


def _publish_records(server: str | NatsSettings, *records: schemas.EpochEndRecord) -> None:
    async def publish() -> None:
        nc = await connect(_settings_of(server), name="test-records")
        try:
            js = nc.jetstream()
            for record in records:
                await js.publish(
                    topology.epoch_end_subject(record.job, record.plan, record.stream), schemas.encode(record)
                )
        finally:
            await close_connection(nc)

    asyncio.run(publish())


def _records_on(server: str | NatsSettings, spec: JobSpec, stream: str) -> list[schemas.EpochEndRecord]:
    """Every record on `stream`'s subject, in order."""

    async def read() -> list[schemas.EpochEndRecord]:
        nc = await connect(_settings_of(server), name="test-records")
        try:
            js, seq, found = nc.jetstream(), 0, []
            subject = topology.epoch_end_subject(spec.job, spec.plan_tag, stream)
            while True:
                try:
                    msg = await js.get_msg(topology.EVENTS_STREAM, seq + 1, subject=subject, next=True)
                except nats.js.errors.NotFoundError:
                    return found
                seq = msg.seq
                found.append(schemas.epoch_end_decoder.decode(msg.data))
        finally:
            await close_connection(nc)

    return asyncio.run(read())


class _Following:
    """A `LandingFeed` of the job (no end known), iterated on a thread of its own."""

    def __init__(self, server: str | NatsSettings, spec: JobSpec, name: str) -> None:
        settings = _settings_of(server)
        self.feed = LandingFeed(
            settings, spec.job, name=name, plan=spec.plan_tag, created_at=spec.created_at, check_s=0.2
        ).start()
        self.taken, self.error = [], None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for item in self.feed:
                self.taken.append(item)
        except BaseException as exc:  # the test raises it
            self.error = exc

    def result(self, timeout: float = 60.0) -> tuple[list[int], EpochEnd]:
        """The indices of the samples handed over, and the end."""
        self.thread.join(timeout)
        try:
            assert not self.thread.is_alive(), f"feed still reading after {timeout:.0f} s: {self.taken}"
            if self.error is not None:
                raise self.error
        finally:
            self.feed.close()
        assert self.taken and isinstance(self.taken[-1], EpochEnd), self.taken
        return [landed.index for landed in self.taken[:-1]], self.taken[-1]


def _refused(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.getMessage().startswith("epoch_end_refused")]


def _wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.05)


def test_a_forged_epoch_end_cuts_no_epoch_and_shadows_no_real_one(nats_server, job_name, caplog):
    """The forgery: a record of the stream with every field public (job, plan, stream name,
    production), its end at the 2nd of 8 markers, published after all 8 landed. Every rank of the
    stream reads the 8 samples and the job's real end, which the first rank to find the job over
    recorded; the next rank records nothing more."""
    caplog.set_level("WARNING", logger="hsx.stream")
    spec, last = _fake_job(nats_server.url, job_name, 8)
    seqs = _marker_sequences(nats_server.url, job_name)
    forged = _end_record(spec, "ddp", end_seq=seqs[1], done=True)
    _publish_records(nats_server.url, forged)
    real = EpochEnd(end_seq=last, done=True, total_samples=8)
    for rank in range(2):
        indices, end = _Following(nats_server.url, spec, "ddp").result()
        assert indices == list(range(8)) and end == real, (rank, indices, end)
    assert _records_on(nats_server.url, spec, "ddp") == [forged, _end_record(spec, "ddp", end_seq=last, done=True)]
    refused = _refused(caplog)
    assert len(refused) == 2 and all("written after a marker its end leaves out" in line for line in refused), refused


def test_an_early_or_stale_epoch_end_is_refused_and_the_job_ends_the_epoch(nats_server, job_name, caplog):
    """While the job runs (5 of 8 samples landed, the plan not all published), two records: one
    written just after the 5th marker that says the job is done, and one of another production
    of the job. Neither ends the epoch; the job's own end does, once it is over."""
    caplog.set_level("WARNING", logger="hsx.stream")
    spec, fifth = _fake_job(nats_server.url, job_name, 8, landed=range(5), published=False)
    early = _end_record(spec, "early", end_seq=fifth, done=True)
    stale = _end_record(spec, "early", end_seq=fifth, done=False, missing_count=3, created_at=spec.created_at - 60)
    _publish_records(nats_server.url, early, stale)
    following = _Following(nats_server.url, spec, "early")
    _wait_for(lambda: len(_refused(caplog)) == 2, "both records refused")
    assert following.thread.is_alive() and following.feed.fetched == 5  # the job runs: no end yet
    refused = _refused(caplog)
    assert any("5 samples landed by its end and 0 missing, not the plan's 8" in line for line in refused), refused
    assert any("of another production of the job" in line for line in refused), refused
    last = _finish_fake_job(nats_server.url, spec, range(5, 8))
    indices, end = following.result()
    assert indices == list(range(8)) and end == EpochEnd(end_seq=last, done=True, total_samples=8), (indices, end)


def test_an_early_record_consistent_with_the_stream_is_believed_only_once_the_job_is_over(nats_server, job_name):
    """What the checks cannot refuse (permissions must: docs/reliability/index.md): a record
    written while the job runs that agrees with the stream then (5 landed, 3 missing). The stream
    reads nothing past its end while the job runs, and ends there only once the job is over."""
    spec, fifth = _fake_job(nats_server.url, job_name, 8, landed=range(5), published=False)
    early = _end_record(spec, "early", end_seq=fifth, done=False, missing_count=3, reason="forged")
    _publish_records(nats_server.url, early)
    following = _Following(nats_server.url, spec, "early")
    _wait_for(lambda: following.feed.fetched == 5, "the markers up to the record's end read")
    _finish_fake_job(nats_server.url, spec, range(5, 8))
    indices, end = following.result()
    assert indices == list(range(5)) and end == EpochEnd(
        end_seq=fifth, done=False, total_samples=8, reason="forged", missing_count=3
    ), (indices, end)


def test_a_trainer_that_takes_nothing_holds_the_markers_back_not_memory(nats_server, job_name):
    count = 6000
    spec, last = _fake_job(nats_server.url, job_name, count)
    end = EpochEnd(end_seq=last, done=True, total_samples=count)
    settings = NatsSettings(url=nats_server.url)
    feed = LandingFeed(
        settings, job_name, name="slow", plan=spec.plan_tag, created_at=spec.created_at, end=end, queue_markers=2048
    ).start()
    try:
        time.sleep(2.0)  # the trainer takes nothing: what it has no room for stays on the server
        assert 0 < feed.fetched <= 2048 + 1024, feed.fetched
        taken = list(feed)
    finally:
        feed.close()
    assert taken[-1] == end
    assert [landed.index for landed in taken[:-1]] == list(range(count))  # each once, in stream order


def test_a_state_resumes_only_its_own_stream(nats_server, tmp_path):
    url = f"file://{tmp_path}/job-x"
    stream = JobStream(url, nats=nats_server.url, name="a", token_budget=BUDGET)
    state = stream.state_dict()
    for other in (
        JobStream(url, nats=nats_server.url, name="b", token_budget=BUDGET),
        JobStream(url, nats=nats_server.url, name="a", token_budget=BUDGET * 2),
        JobStream(url, nats=nats_server.url, name="a", token_budget=BUDGET, seed=1),
    ):
        with pytest.raises(HsxError, match="a state resumes only the stream that saved it"):
            other.load_state_dict(state)
    with pytest.raises(HsxError, match="num_replicas 2 needs a token_budget"):
        JobStream(url, nats=nats_server.url, num_replicas=2, rank=1)
    with pytest.raises(HsxError, match="rank 2 is not one of num_replicas 2"):
        JobStream(url, nats=nats_server.url, num_replicas=2, rank=2, token_budget=BUDGET)
    with pytest.raises(HsxError, match="invalid stream name"):
        JobStream(url, nats=nats_server.url, name="a b")


# ---------------------------------------------------------------- batching and dealing alone


def _landed(lengths) -> list[Landed]:
    return [Landed(index=i, tokens=int(n)) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("pool", [0, 1, 7, 64, 1000])
@pytest.mark.parametrize("max_batch_size", [None, 5])
def test_the_batcher_keeps_the_budget_and_every_sample_once(pool, max_batch_size):
    lengths = np.random.default_rng(pool).integers(1, 300, size=500)
    cutter = LandingBatcher(token_budget=512, max_batch_size=max_batch_size, shuffle_pool=pool, seed=3)
    batches = [b for s in _landed(lengths) for b in cutter.push(s)] + cutter.finish()
    assert sorted(s.index for b in batches for s in b) == list(range(500))
    for batch in batches:
        assert batch and len(batch) * max(s.tokens for s in batch) <= 512
        assert max_batch_size is None or len(batch) <= max_batch_size
    # The same order and seed cut the same batches: what lets a rank or a restart agree.
    again = LandingBatcher(token_budget=512, max_batch_size=max_batch_size, shuffle_pool=pool, seed=3)
    assert [b for s in _landed(lengths) for b in again.push(s)] + again.finish() == batches
    if pool >= 64:  # the pool mixes the landing order
        firsts = [b[0].index for b in batches]
        assert firsts != sorted(firsts)
        padded = sum(len(b) * max(s.tokens for s in b) for b in batches)
        assert lengths.sum() / padded > 0.85


def test_items_without_a_budget_leave_one_by_one():
    cutter = LandingBatcher(token_budget=None, shuffle_pool=4, seed=0)
    batches = [b for s in _landed([3] * 10) for b in cutter.push(s)] + cutter.finish()
    assert all(len(b) == 1 for b in batches) and sorted(b[0].index for b in batches) == list(range(10))
    with pytest.raises(HsxError, match="more than the token budget"):
        LandingBatcher(token_budget=10).push(Landed(index=4, tokens=11))


@pytest.mark.parametrize("count", [0, 1, 2, 3, 5, 8, 9, 17, 100])
@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4, 8])
def test_dealing_gives_every_rank_the_same_count_and_each_sample_once(count, num_replicas):
    rng = np.random.default_rng(count * 10 + num_replicas)
    batches, index = [], 0
    for _ in range(count):
        size = int(rng.integers(1, 6))
        batches.append([Landed(index=index + k, tokens=10) for k in range(size)])
        index += size
    per_rank = [list(deal(iter(batches), num_replicas=num_replicas, rank=r)) for r in range(num_replicas)]
    assert len({len(mine) for mine in per_rank}) == 1, [len(m) for m in per_rank]
    everything = [s.index for mine in per_rank for b in mine for s in b]
    assert sorted(everything) == list(range(index))
    if index >= 2 * num_replicas:  # enough samples: no rank is left an empty batch
        assert all(b for mine in per_rank for b in mine)
    # A rank's batches before the held tail are the batches as cut, in order.
    whole = [b for b in deal(iter(batches), num_replicas=1, rank=0)]
    assert whole == batches


def test_splitting_to_rounds_keeps_each_part_of_a_batch():
    batches = [[Landed(i, 5) for i in range(4)], [Landed(4, 5)]]
    assert split_to_rounds(batches, 3) == [[Landed(0, 5), Landed(1, 5)], [Landed(2, 5), Landed(3, 5)], [Landed(4, 5)]]
    assert split_to_rounds([[Landed(0, 5)]], 3) == [[Landed(0, 5)], [], []]


def test_a_later_epoch_draws_every_sample_again_from_seed_and_epoch():
    lengths = np.random.default_rng(0).integers(1, 100, size=300)
    indices = np.arange(1000, 1300)

    def draw(epoch: int, budget: int | None = 256) -> list[list[Landed]]:
        return list(shuffled_batches(indices, lengths, token_budget=budget, max_batch_size=None, seed=1, epoch=epoch))

    one = draw(1)
    assert sorted(s.index for b in one for s in b) == list(range(1000, 1300))
    assert all(s.tokens == lengths[s.index - 1000] for b in one for s in b)
    assert one == draw(1) and one != draw(2)
    assert all(len(b) * max(s.tokens for s in b) <= 256 for b in one)
    items = draw(1, None)
    assert all(len(b) == 1 for b in items) and sorted(b[0].index for b in items) == list(range(1000, 1300))
