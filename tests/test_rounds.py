"""A plan published in rounds (--round-rows; producer/rounds.py, producer/publishing.py `Publisher`).

- Read in rounds, a dataset gives exactly the samples, report entries and counts it gives read
  whole (chat rows among token rows, bad rows, cut rows, empty masks set aside), and each round
  starts at a multiple of --round-rows rows.
- Planned in rounds, every sample is in exactly one batch of its own round.
- End to end: workers started before the producer (they read the spec of the first round) finish
  a job of 6 rounds: every sample stored and checked, batches_done == batches_total, the spec
  `published` with its rounds, and the dry run plans the same batches.
- A refusal found in a later round (a row longer than --max-seq-len) stops the producer in one
  line naming the row; what it published runs; the job ends failed with that reason, and workers
  with --until-done exit 65 (JOB_FAILED).
- A producer that dies between rounds leaves the job unpublished; run again, it resumes: no batch
  goes out twice, and the job finishes. A spool file lost meanwhile waits for the samples the
  plan stores after its last round, then is extracted again; a job deleted between rounds stays
  deleted.
"""

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import nats
import nats.js.errors
import numpy as np
import pytest
from conftest import _env, _free_port
from test_e2e_s3 import (
    LAYERS,
    check_ok,
    check_outputs,
    logs_of,
    read_dir_objects,
    spooled,
    start_monitor,
    status,
    wait_until_done,
    wait_until_spooled,
    write_dataset,
)
from test_inputs import CONVERSATIONS, chat_models, chat_tokenizer_files  # noqa: F401 (fixtures)
from test_producer_checks import log_events_of

from hsx.commands.embedded import start_nats_server
from hsx.exitcodes import JOB_FAILED
from hsx.job import JobSpec
from hsx.packing import plan_in_rounds
from hsx.producer import estimate
from hsx.producer.config import BadRowCap
from hsx.producer.inputs import tokenized_rows
from hsx.wire import schemas, topology

ROUND_ROWS = 7


def _mixed_dataset(path: Path) -> None:
    """Token rows and chat rows, a malformed line, rows longer than 24 tokens, all-zero masks."""
    lines = []
    for i in range(40):
        if i % 3 == 1:
            lines.append(json.dumps({"id": f"chat-{i}", "messages": CONVERSATIONS[i % len(CONVERSATIONS)]}))
        elif i in (11, 26):
            lines.append('{"input_ids": [1, 2, ')
        else:
            length = 30 if i % 5 == 0 else 5 + i % 9
            mask = [0] * length if i % 7 == 0 else [i % 2] * length
            lines.append(
                json.dumps(
                    {"id": f"tok-{i}", "input_ids": [(i * 7 + k) % 300 for k in range(length)], "loss_mask": mask}
                )
            )
    path.write_text("\n".join(lines) + "\n")


def _read(path: Path, model: Path, round_rows: int, on_round=None):
    return tokenized_rows(
        path,
        model=str(model),
        vocab_size=512,
        max_seq_len=24,
        on_long="truncate",
        on_bad_row="skip",
        max_bad_rows=BadRowCap(10, percent=True),
        on_empty_mask="skip",
        round_rows=round_rows,
        on_round=on_round,
    )


def _samples(table) -> list[tuple]:
    return [
        (row.source_id, row.where, list(row.input_ids), None if row.loss_mask is None else list(row.loss_mask))
        for row in table
    ]


def test_a_dataset_read_in_rounds_gives_what_it_gives_read_whole(tmp_path, chat_models):  # noqa: F811
    data = tmp_path / "mixed.jsonl"
    _mixed_dataset(data)
    model = chat_models["plain"]
    whole = _read(data, model, 0)
    rounds = []
    parts = _read(data, model, ROUND_ROWS, on_round=rounds.append)
    try:
        assert len(rounds) == 6, [r.first_row for r in rounds]  # 40 rows: 5 of 7, then 5
        assert [r.first_row for r in rounds] == [0, 7, 14, 21, 28, 35]
        assert [r.last for r in rounds] == [False] * 5 + [True]
        assert [r.first_sample for r in rounds] == list(np.cumsum([0] + [len(r.samples) for r in rounds[:-1]]))
        expected = _samples(whole.samples)
        assert _samples(parts.samples) == expected
        assert [s for r in rounds for s in _samples(r.samples)] == expected
        assert parts.long == whole.long and parts.long and any(e.sample_index for e in parts.long)
        assert parts.empty_masks == whole.empty_masks and parts.empty_masks
        assert [e.where for e in parts.bad_rows] == [e.where for e in whole.bad_rows] == [f"{data}:12", f"{data}:27"]
        assert (parts.rows_read, parts.chat_rows) == (whole.rows_read, whole.chat_rows) == (40, 13)
        assert [e for r in rounds for e in r.long] == parts.long
    finally:
        whole.samples.close()
        parts.samples.close()


@pytest.mark.parametrize(("rows", "expected"), [(42, [7] * 6), (7, [7]), (8, [7, 1]), (15, [7, 7, 1])])
def test_rounds_are_cut_at_round_rows_and_the_last_is_never_empty(tmp_path, chat_models, rows, expected):  # noqa: F811
    """A dataset of a multiple of --round-rows rows ends with a full round (issue 35, item 5)."""
    data = tmp_path / "tokens.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [1 + i % 50, 2, 3]}) + "\n" for i in range(rows)))
    rounds = []
    whole = _read(data, chat_models["plain"], ROUND_ROWS, on_round=rounds.append)
    try:
        assert [len(r.samples) for r in rounds] == expected
        assert [r.last for r in rounds] == [False] * (len(expected) - 1) + [True]
        assert len(whole.samples) == rows
    finally:
        whole.samples.close()


def test_a_last_round_of_set_aside_rows_only_is_not_recorded(tmp_path, hsx, tiny_model, job_name, nats_server):
    rows = write_dataset(tmp_path / "data.jsonl", 15, min_len=4, max_len=60, seed=31)
    rows[14] = {"input_ids": list(range(300))}  # longer than --max-seq-len 256: skipped
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = _produce_args(job_name, tiny_model("qwen3"), tmp_path / "data.jsonl", tmp_path / "out")
    check_ok(hsx(*args, "--on-long", "skip"), "hsx produce")
    spec = _spec(nats_server.url, job_name)
    assert spec.published and spec.round_starts == [0, 7] and spec.total_samples == 14 and spec.samples_skipped == 1


def test_planned_in_rounds_every_sample_is_in_one_batch_of_its_round():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 200, size=1000)
    starts = [0, 250, 400, 900]
    batches = plan_in_rounds(lengths, starts, token_budget=512)
    seen = sorted(i for b in batches for i in b.sample_indices)
    assert seen == list(range(1000))
    bounds = [*starts, 1000]
    for batch in batches:
        rounds = {int(np.searchsorted(bounds, i, side="right")) - 1 for i in batch.sample_indices}
        assert len(rounds) == 1, batch
        assert batch.padded_len == max(lengths[i] for i in batch.sample_indices)
        assert batch.padded_len * len(batch.sample_indices) <= 512
    # A round planned alone (as the producer plans each new one) is that round's part of the whole.
    last = plan_in_rounds(lengths, starts[-1:], token_budget=512)
    assert last == batches[len(batches) - len(last) :] and min(min(b.sample_indices) for b in last) == 900
    # Rounds in order: the first batches are all of round 0.
    firsts = [min(b.sample_indices) for b in batches]
    assert all(i < 250 for i in firsts[: sum(1 for b in batches if max(b.sample_indices) < 250)])


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
        "512",
        "--max-seq-len",
        "256",
        "--round-rows",
        str(ROUND_ROWS),
        *extra,
    ]


def _spec(nats_url: str, job: str) -> JobSpec:
    async def read():
        nc = await nats.connect(nats_url)
        try:
            kv = await nc.jetstream().key_value(topology.JOBS_BUCKET)
            return schemas.job_decoder.decode((await kv.get(job)).value)
        finally:
            await nc.close()

    return asyncio.run(read())


def _planned_batches_in_stream(nats_url: str, job: str) -> int:
    async def count():
        nc = await nats.connect(nats_url)
        try:
            info = await nc.jetstream().stream_info(
                topology.BATCHES_STREAM, subjects_filter=topology.batch_subject(job)
            )
            return sum((info.state.subjects or {}).values())
        finally:
            await nc.close()

    return asyncio.run(count())


def _workers(hsx_service, job: str, spool: Path, *extra: str) -> list[subprocess.Popen]:
    consumer = hsx_service("consume", "--job", job, "--device", "cpu", "--spool", str(spool), *extra, name="consume")
    uploader = hsx_service("upload", "--job", job, "--spool", str(spool), *extra, name="upload")
    return [consumer, uploader]


@pytest.mark.faults
def test_workers_started_first_finish_a_job_published_in_rounds(
    tmp_path, hsx, hsx_service, tiny_model, job_name, nats_server
):
    model = tiny_model("qwen3")
    rows = write_dataset(tmp_path / "data.jsonl", 40, min_len=4, max_len=200, seed=11)
    out, spool = tmp_path / "out", tmp_path / "spool"
    args = _produce_args(job_name, model, tmp_path / "data.jsonl", out)
    dry = json.loads(check_ok(hsx(*args, "--dry-run", "--json"), "dry run").stdout)
    # Started before the job exists: they read the first round's spec, and the rounds after it grow it.
    workers = _workers(hsx_service, job_name, spool)
    monitor = start_monitor(hsx_service, job_name, None)
    produced = check_ok(hsx(*args), "hsx produce")
    wait_until_done(monitor, workers)
    spec = _spec(nats_server.url, job_name)
    assert spec.published and spec.round_rows == ROUND_ROWS and not spec.stopped
    assert len(spec.round_starts) == 6 and spec.total_samples == 40, spec
    assert dry["batches"] == spec.total_batches, (dry, spec.total_batches)
    assert [r["round"] for r in log_events_of(produced.stderr, "round_published")] == list(range(6))
    check_outputs(read_dir_objects(out), job=job_name, rows=rows)
    view = status(hsx, job_name, None)
    assert view["done"] and view["plan_complete"] and view["rounds_published"] == 6
    assert view["batches_done"] == view["batches_total"] == spec.total_batches
    assert view["samples_outside_plan"] == 0
    # Every batch of the plan went out once.
    published = log_events_of(produced.stderr, "job_published")
    assert published and published[0]["new"] == spec.total_batches and published[0]["rounds"] == 6, produced.stderr
    for worker in workers:
        worker.terminate()


@pytest.mark.faults
def test_a_refusal_in_a_later_round_stops_the_job_named_and_failed(
    tmp_path, hsx, hsx_service, tiny_model, job_name, nats_server
):
    model = tiny_model("qwen3")
    data = tmp_path / "data.jsonl"
    rows = write_dataset(data, 30, min_len=4, max_len=100, seed=5)
    rows[17]["input_ids"] = list(range(300))  # row 18 (line 18): longer than --max-seq-len 256
    rows[17]["loss_mask"] = [1] * 300
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out, spool = tmp_path / "out", tmp_path / "spool"
    result = hsx(*_produce_args(job_name, model, data, out))
    assert result.returncode == 2, result
    error = result.stderr.strip().splitlines()[-1]
    assert f"{data}:18: 300 tokens is longer than --max-seq-len 256" in error, error
    assert f"job {job_name} stopped after 2 rounds" in error, error
    spec = _spec(nats_server.url, job_name)
    assert not spec.published and len(spec.round_starts) == 2 and spec.total_samples == 14
    assert "longer than --max-seq-len" in spec.stopped
    # What was published runs; then the workers' verdict is failed, naming why.
    workers = _workers(hsx_service, job_name, spool, "--until-done")
    for worker in workers:
        assert worker.wait(timeout=180) == JOB_FAILED, logs_of(*workers)
    view = status(hsx, job_name, None)
    assert view["state"] == "failed" and not view["plan_complete"]
    assert "the producer stopped before publishing the whole plan" in view["failure_reason"]
    assert "longer than --max-seq-len" in view["failure_reason"]
    assert view["samples_uploaded"] == 14
    text = check_ok(hsx("status", "--job", job_name), "status").stdout
    assert "FAILED" in text and "of the 2 rounds the producer has published so far" in text, text


_AFTER_ROUNDS = """
import asyncio, os, sys
import nats
from hsx.producer import rounds
real = rounds.RoundReader.next
seen = []
async def next_then(self):
    if len(seen) == {rounds}:
        {then}
    seen.append(await real(self))
    return seen[-1]
async def wait_for_go():
    while not os.path.exists(os.environ["ROUNDS_GO"]):
        await asyncio.sleep(0.1)
async def delete_the_job():
    nc = await nats.connect(os.environ["HSX_NATS_URL"])
    await (await nc.jetstream().key_value("hsx_jobs")).delete({job!r})
    await nc.close()
rounds.RoundReader.next = next_then
from hsx.cli import main
sys.exit(main(sys.argv[1:]))
"""
# The producer dies between rounds.
_DIE = "raise SystemExit(9)"
# The job is deleted between rounds (as `hsx jobs delete` does first).
_DELETE = "await delete_the_job()"
# The producer waits between rounds until the file named by ROUNDS_GO exists.
_WAIT = "await wait_for_go()"


def _produce_after_rounds(nats_url: str, args: list[str], *, rounds: int, then: str, job: str):
    return subprocess.run(
        [sys.executable, "-c", _AFTER_ROUNDS.format(rounds=rounds, then=then, job=job), *args],
        env=_env(nats_url, None),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def held_producer():
    """Start `hsx produce` held between rounds until a file appears (`_WAIT` and ROUNDS_GO); a
    producer still running at the end of the test (one that failed before letting it go) is killed."""
    started: list[subprocess.Popen] = []

    def start(nats_url: str, args: list[str], *, rounds: int, then: str, job: str, log: Path, go: Path):
        process = subprocess.Popen(
            [sys.executable, "-c", _AFTER_ROUNDS.format(rounds=rounds, then=then, job=job), *args],
            env=_env(nats_url, {"ROUNDS_GO": str(go)}),
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        process.log_path = log
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def _wait_for_log(process: subprocess.Popen, event: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while f'"{event}"' not in Path(process.log_path).read_text(errors="replace"):
        assert process.poll() is None and time.monotonic() < deadline, logs_of(process)
        time.sleep(0.2)


def test_workers_started_while_a_first_run_publishes_its_rounds_serve_the_job_to_its_end(
    tmp_path, hsx, hsx_service, tiny_model, job_name, nats_server, held_producer
):
    """The job's identity (its created_at) is fixed by the first round's spec and every later
    round keeps it: workers that started on round 3's spec take the rounds after it for the same
    job, not for a job deleted and produced again (issue 35, item 0)."""
    model = tiny_model("qwen3")
    rows = write_dataset(tmp_path / "data.jsonl", 40, min_len=4, max_len=200, seed=23)
    out, spool, go = tmp_path / "out", tmp_path / "spool", tmp_path / "go"
    args = _produce_args(job_name, model, tmp_path / "data.jsonl", out)
    producer = held_producer(
        nats_server.url, args, rounds=3, then=_WAIT, job=job_name, log=tmp_path / "produce.log", go=go
    )
    deadline = time.monotonic() + 120
    while not _wait_for_round(nats_server.url, job_name, 3):
        assert producer.poll() is None and time.monotonic() < deadline, logs_of(producer)
        time.sleep(0.2)
    first = _spec(nats_server.url, job_name)
    consumer, uploader = workers = _workers(hsx_service, job_name, spool, "--until-done")
    _wait_for_log(consumer, "consumer_ready")
    _wait_for_log(uploader, "uploader_ready")
    go.touch()
    assert producer.wait(timeout=120) == 0, logs_of(producer)
    final = _spec(nats_server.url, job_name)
    assert final.published and len(final.round_starts) == 6 and final.total_samples == 40
    for worker in workers:
        assert worker.wait(timeout=180) == 0, logs_of(*workers)
    assert final.created_at == first.created_at, (first.created_at, final.created_at)
    check_outputs(read_dir_objects(out), job=job_name, rows=rows)
    view = status(hsx, job_name, None)
    assert view["done"] and view["samples_uploaded"] == 40 and view["samples_outside_plan"] == 0


@pytest.mark.faults
def test_a_rerun_after_a_kill_between_rounds_keeps_the_recorded_rounds_and_ends_done(
    tmp_path, hsx, hsx_service, tiny_model, job_name, nats_server, held_producer
):
    """A rerun resumes from the rounds its spec records and never writes a spec holding fewer:
    workers serving the recorded rounds meanwhile count every sample as planned, and the job ends
    done with no count past its total (issue 35, item 1)."""
    model = tiny_model("qwen3")
    rows = write_dataset(tmp_path / "data.jsonl", 40, min_len=4, max_len=200, seed=29)
    out, spool, go = tmp_path / "out", tmp_path / "spool", tmp_path / "go"
    args = _produce_args(job_name, model, tmp_path / "data.jsonl", out)
    crashed = _produce_after_rounds(nats_server.url, args, rounds=3, then=_DIE, job=job_name)
    assert crashed.returncode == 9, crashed.stderr[-3000:]
    recorded = _spec(nats_server.url, job_name)
    assert len(recorded.round_starts) == 3 and not recorded.published
    workers = _workers(hsx_service, job_name, spool, "--until-done")
    # The rerun stops after reading its first round, before reading the second: meanwhile the
    # workers serve every batch the first run published.
    rerun = held_producer(nats_server.url, args, rounds=1, then=_WAIT, job=job_name, log=tmp_path / "rerun.log", go=go)
    deadline = time.monotonic() + 180
    while True:
        spec = _spec(nats_server.url, job_name)
        assert len(spec.round_starts) >= 3 and spec.total_samples >= recorded.total_samples, spec
        assert spec.created_at == recorded.created_at
        view = status(hsx, job_name, None)
        assert view["batches_done"] <= view["batches_total"] and view["samples_uploaded"] <= view["total_samples"]
        if view["samples_uploaded"] + view["samples_outside_plan"] >= recorded.total_samples:
            break
        assert time.monotonic() < deadline and rerun.poll() is None, logs_of(rerun, *workers)
        time.sleep(0.5)
    assert view["samples_outside_plan"] == 0, view
    go.touch()
    assert rerun.wait(timeout=120) == 0, logs_of(rerun)
    for worker in workers:
        assert worker.wait(timeout=180) == 0, logs_of(*workers)
    check_outputs(read_dir_objects(out), job=job_name, rows=rows)
    view = status(hsx, job_name, None)
    assert view["done"] and view["samples_uploaded"] == 40 and view["samples_outside_plan"] == 0, view
    assert view["batches_done"] == view["batches_total"] == _spec(nats_server.url, job_name).total_batches


@pytest.mark.faults
def test_a_nats_restart_between_rounds_is_ridden_out_by_the_producer(tmp_path, tiny_model, job_name, held_producer):
    """NATS killed while the producer is between rounds and back 8 s later: the producer waits it
    out as the workers do and publishes the whole plan once; no traceback (issue 35, item 2)."""
    store, port = tmp_path / "nats", _free_port()
    server = start_nats_server(store, port=port, log_file=tmp_path / "nats-server.log")
    try:
        write_dataset(tmp_path / "data.jsonl", 40, min_len=4, max_len=200, seed=37)
        go = tmp_path / "go"
        args = _produce_args(job_name, tiny_model("qwen3"), tmp_path / "data.jsonl", tmp_path / "out")
        producer = held_producer(
            server.url, args, rounds=2, then=_WAIT, job=job_name, log=tmp_path / "produce.log", go=go
        )
        deadline = time.monotonic() + 120
        while not _wait_for_round(server.url, job_name, 2):
            assert producer.poll() is None and time.monotonic() < deadline, logs_of(producer)
            time.sleep(0.2)
        server.kill()
        go.touch()
        time.sleep(8.0)  # longer than a request's timeout: the producer's next steps fail and are retried
        server = start_nats_server(store, port=port, log_file=tmp_path / "nats-server.log")
        assert producer.wait(timeout=180) == 0, logs_of(producer)
        text = Path(producer.log_path).read_text()
        assert "Traceback" not in text, text[-3000:]
        assert '"nats_disconnected"' in text and '"nats_reconnected"' in text, text[-3000:]
        spec = _spec(server.url, job_name)
        assert spec.published and len(spec.round_starts) == 6 and not spec.stopped, spec
        assert _planned_batches_in_stream(server.url, job_name) == spec.total_batches
    finally:
        server.stop()


def _wait_for_round(nats_url: str, job: str, rounds: int) -> bool:
    """Whether the job's spec records at least `rounds` rounds."""

    async def read():
        nc = await nats.connect(nats_url)
        try:
            kv = await nc.jetstream().key_value(topology.JOBS_BUCKET)
            try:
                entry = await kv.get(job)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.NotFoundError):
                return False
            return len(schemas.job_decoder.decode(entry.value).round_starts) >= rounds
        except nats.js.errors.BucketNotFoundError:
            return False
        finally:
            await nc.close()

    return asyncio.run(read())


@pytest.mark.faults
def test_a_producer_dead_between_rounds_resumes_without_publishing_twice(
    tmp_path, hsx, hsx_service, tiny_model, job_name, nats_server
):
    model = tiny_model("qwen3")
    rows = write_dataset(tmp_path / "data.jsonl", 40, min_len=4, max_len=200, seed=13)
    out, spool = tmp_path / "out", tmp_path / "spool"
    args = _produce_args(job_name, model, tmp_path / "data.jsonl", out)
    crashed = _produce_after_rounds(nats_server.url, args, rounds=3, then=_DIE, job=job_name)
    assert crashed.returncode == 9, crashed.stderr[-3000:]
    spec = _spec(nats_server.url, job_name)
    assert not spec.published and len(spec.round_starts) == 3 and not spec.stopped
    before = _planned_batches_in_stream(nats_server.url, job_name)
    assert before == spec.total_batches > 0
    check_ok(hsx(*args), "hsx produce, again")
    spec = _spec(nats_server.url, job_name)
    assert spec.published and len(spec.round_starts) == 6 and spec.total_samples == 40
    assert _planned_batches_in_stream(nats_server.url, job_name) == spec.total_batches
    workers = _workers(hsx_service, job_name, spool, "--until-done")
    for worker in workers:
        assert worker.wait(timeout=180) == 0, logs_of(*workers)
    check_outputs(read_dir_objects(out), job=job_name, rows=rows)


def test_a_job_deleted_between_rounds_stays_deleted(tmp_path, tiny_model, job_name, nats_server):
    model = tiny_model("qwen3")
    write_dataset(tmp_path / "data.jsonl", 40, min_len=4, max_len=200, seed=17)
    args = _produce_args(job_name, model, tmp_path / "data.jsonl", tmp_path / "out")
    result = _produce_after_rounds(nats_server.url, args, rounds=2, then=_DELETE, job=job_name)
    assert result.returncode == 2, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert (
        f"job {job_name} was deleted or produced again while its plan was published in rounds (after 2 rounds" in error
    ), error

    async def spec_gone() -> bool:
        nc = await nats.connect(nats_server.url)
        try:
            kv = await nc.jetstream().key_value(topology.JOBS_BUCKET)
            try:
                await kv.get(job_name)
            except nats.js.errors.KeyNotFoundError:
                return True
            return False
        finally:
            await nc.close()

    assert asyncio.run(spec_gone())


@pytest.mark.parametrize("round_rows", [0, 100_000])
def test_a_small_dataset_is_one_plan_whatever_the_round_size(
    tmp_path, hsx, tiny_model, job_name, round_rows, nats_server
):
    model = tiny_model("qwen3")
    write_dataset(tmp_path / "data.jsonl", 12, min_len=4, max_len=60, seed=2)
    args = _produce_args(job_name, model, tmp_path / "data.jsonl", tmp_path / "out")
    args[args.index("--round-rows") + 1] = str(round_rows)
    check_ok(hsx(*args), "hsx produce")
    spec = _spec(nats_server.url, job_name)
    assert spec.published and spec.round_starts == [] and spec.tokenized_object


@pytest.mark.faults
def test_a_spool_file_lost_before_the_plan_is_published_waits_for_the_stored_samples(
    tmp_path, hsx, hsx_service, tiny_model, job_name, nats_server
):
    """The uploader sends a lost file's sample back with its tokens from the job's stored
    samples, which a plan in rounds stores after its last round: until then the event waits
    (`requeue_waits_for_stored_samples`, nothing dead-lettered), and once the plan is published
    the sample is extracted again."""
    model = tiny_model("qwen3")
    rows = write_dataset(tmp_path / "data.jsonl", 40, min_len=4, max_len=120, seed=19)
    out, spool = tmp_path / "out", tmp_path / "spool"
    args = _produce_args(job_name, model, tmp_path / "data.jsonl", out)
    crashed = _produce_after_rounds(nats_server.url, args, rounds=3, then=_DIE, job=job_name)
    assert crashed.returncode == 9, crashed.stderr[-3000:]
    consumer = hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", str(spool), name="consume")
    wait_until_spooled(hsx, consumer, job_name, 21)
    lost = [spooled(spool, job_name, index) for index in (0, 15)]
    for path in lost:
        path.unlink()
    uploader = hsx_service("upload", "--job", job_name, "--spool", str(spool), name="upload")
    log = Path(uploader.log_path)
    deadline = time.monotonic() + 60
    while log.read_text().count('"requeue_waits_for_stored_samples"') < 2:
        assert time.monotonic() < deadline and uploader.poll() is None, logs_of(consumer, uploader)
        time.sleep(0.3)
    assert status(hsx, job_name, None)["dead_letters"] == 0
    check_ok(hsx(*args), "hsx produce, again")
    wait_until_done(start_monitor(hsx_service, job_name, None), [consumer, uploader])
    check_outputs(read_dir_objects(out), job=job_name, rows=rows)
    view = status(hsx, job_name, None)
    assert view["samples_requeued"] == 2 and view["dead_letters"] == 0


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A 256 KiB file system at tmp_path/small (a tmpfs where this process may mount one, else a
    folder whose free space the probe reports as 256 KiB), and a way to give it room."""
    folder = tmp_path / "small"
    folder.mkdir()
    try:
        command = ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)]
        mounted = subprocess.run(command, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        mounted = False
    if not mounted:
        monkeypatch.setattr(estimate, "free_bytes", lambda path: 256 << 10)

    def grow() -> None:
        if mounted:
            subprocess.run(["mount", "-o", "remount,size=8m", str(folder)], check=True)
        else:
            monkeypatch.setattr(estimate, "free_bytes", lambda path: 8 << 20)

    try:
        yield folder, grow
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


def test_no_room_for_a_later_round_stops_the_job_and_a_rerun_with_room_resumes(
    tmp_path, hsx, tiny_model, job_name, nats_server, small_disk
):
    folder, grow = small_disk
    model = tiny_model("qwen3")
    write_dataset(tmp_path / "data.jsonl", 40, min_len=4, max_len=30, seed=23)
    args = _produce_args(job_name, model, tmp_path / "data.jsonl", folder / "out")
    refused = hsx(*args)
    assert refused.returncode == 2, refused
    error = refused.stderr.strip().splitlines()[-1]
    assert "free" in error and f"job {job_name} stopped after" in error, error
    spec = _spec(nats_server.url, job_name)
    assert not spec.published and 1 <= len(spec.round_starts) < 6 and "free" in spec.stopped, spec
    assert f"stopped after {len(spec.round_starts)} rounds" in error
    grow()
    check_ok(hsx(*args), "hsx produce with room")
    spec = _spec(nats_server.url, job_name)
    assert spec.published and len(spec.round_starts) == 6 and spec.total_samples == 40 and not spec.stopped
