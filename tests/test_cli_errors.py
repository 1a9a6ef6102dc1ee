"""`hsx produce` on bad input: one line naming the problem, no traceback, non-zero exit.

The real CLI runs as a subprocess against the session's nats-server and a tiny local model. Every
bad input must end in exactly one stderr line, `hsx: error: ...`, that names what is wrong (file
and line or row, field, flag, URL). Good JSONL and Parquet datasets publish, the job spec lands in
the `hsx_jobs` KV bucket, a re-run publishes nothing new, and reusing a job name for a different
dataset is refused.

Each CLI run spends most of its ~3 s importing transformers, so the error cases run concurrently
and are checked one by one as subtests.
"""

import asyncio
import json
import random
import socket
from dataclasses import dataclass
from pathlib import Path

import nats
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

VOCAB = 512  # tests/conftest.py TINY
NUM_LAYERS = 6


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rows(count: int, *, seed: int, low: int = 3, high: int = 40) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        length = rng.randint(low, high)
        ids = [rng.randrange(VOCAB) for _ in range(length)]
        rows.append({"input_ids": ids, "loss_mask": [rng.randint(0, 1) for _ in range(length)]})
    return rows


def _write_jsonl(path: Path, rows: list) -> Path:
    """Rows are dicts (encoded) or str (written as the line, verbatim)."""
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def _write_parquet(path: Path, rows: list[dict]) -> Path:
    table = pa.table(
        {
            "input_ids": pa.array([r["input_ids"] for r in rows], type=pa.list_(pa.int64())),
            "loss_mask": pa.array([r.get("loss_mask") for r in rows], type=pa.list_(pa.int64())),
        }
    )
    pq.write_table(table, path)
    return path


def assert_one_line_error(result, *needles: str) -> str:
    """Non-zero exit, no traceback, one stderr line `hsx: error: ...` holding every needle.

    The error is the last stderr line; anything before it must be a structured log record (the
    producer logs `plan_ready` before it talks to NATS), never a usage dump, warning or trace.
    """
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"exit 0 on bad input\nstdout: {result.stdout}\nstderr: {result.stderr}"
    assert "Traceback" not in output, output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("hsx: error: ")]
    assert len(errors) == 1, f"expected one 'hsx: error:' line, got {len(errors)}:\n{result.stderr}"
    assert lines[-1] == errors[0], f"the error is not the last stderr line:\n{result.stderr}"
    for other in lines[:-1]:
        try:
            record = json.loads(other)
        except json.JSONDecodeError:
            pytest.fail(f"stderr line is neither the error nor a log record: {other!r}\n{result.stderr}")
        assert isinstance(record, dict) and "event" in record and "level" in record, other
    line = errors[0]
    assert len(line) > len("hsx: error: ") + 10, line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


@dataclass
class Case:
    args: dict[str, str]  # produce flags that replace the valid defaults
    needles: tuple[str, ...]
    nats_url: str | None = None


def _produce_args(model: Path, dataset: Path, dest: Path | str, job: str, **overrides: str) -> list[str]:
    """`produce` with a valid flag set; overrides are {"--flag": "value"}."""
    flags = {
        "--job": job,
        "--model": str(model),
        "--dataset": str(dataset),
        "--layers": "1,3",
        "--dest": str(dest),
        "--dtype": "float32",
    }
    flags.update(overrides)
    args = ["produce"]
    for flag, value in flags.items():
        args += [flag, value]
    return args


@pytest.fixture
def good_jsonl(tmp_path) -> Path:
    return _write_jsonl(tmp_path / "good.jsonl", _rows(10, seed=1))


def _error_cases(tmp_path: Path) -> dict[str, Case]:
    rows = _rows(5, seed=2)
    missing = tmp_path / "nowhere" / "missing.jsonl"
    malformed = _write_jsonl(tmp_path / "malformed.jsonl", [rows[0], rows[1], '{"input_ids": [1, 2, 3', rows[3]])
    string_id = _write_jsonl(tmp_path / "string_id.jsonl", [rows[0], {"input_ids": [1, "two", 3]}])
    empty_ids = _write_jsonl(tmp_path / "empty_ids.jsonl", [rows[0], rows[1], rows[2], {"input_ids": []}])
    too_long = _write_jsonl(tmp_path / "too_long.jsonl", [{"input_ids": [1] * 8}, {"input_ids": [2] * 9}])
    mask_mismatch = _write_jsonl(tmp_path / "mask.jsonl", [rows[0], {"input_ids": [1, 2, 3], "loss_mask": [0, 1]}])
    out_of_vocab = _write_jsonl(tmp_path / "vocab.jsonl", [rows[0], rows[1], {"input_ids": [1, VOCAB, 2]}])
    parquet_rows = _rows(6, seed=3)
    parquet_rows[3] = {"input_ids": [], "loss_mask": []}
    bad_parquet = _write_parquet(tmp_path / "bad.parquet", parquet_rows)
    vocab_rows = _rows(6, seed=4)
    vocab_rows[4] = {"input_ids": [5, VOCAB + 7], "loss_mask": [0, 1]}
    vocab_parquet = _write_parquet(tmp_path / "vocab.parquet", vocab_rows)
    dead_url = f"nats://127.0.0.1:{_free_port()}"
    return {
        "missing-dataset": Case({"--dataset": str(missing)}, (str(missing),)),
        "malformed-jsonl": Case({"--dataset": str(malformed)}, (f"{malformed}:3",)),
        "string-token-id": Case({"--dataset": str(string_id)}, (f"{string_id}:2", "input_ids")),
        "empty-input-ids": Case({"--dataset": str(empty_ids)}, (f"{empty_ids}:4", "input_ids", "empty")),
        "longer-than-max-seq-len": Case(
            {"--dataset": str(too_long), "--max-seq-len": "8"}, (f"{too_long}:2", "--max-seq-len 8")
        ),
        "loss-mask-length": Case({"--dataset": str(mask_mismatch)}, (f"{mask_mismatch}:2", "loss_mask")),
        "token-id-outside-vocab": Case(
            {"--dataset": str(out_of_vocab)}, ("vocab.jsonl:3:", f"token id {VOCAB}", f"vocabulary of {VOCAB}")
        ),
        "unknown-layer": Case({"--layers": "1,99"}, ("layer 99", f"{NUM_LAYERS} decoder layers")),
        "duplicate-layer": Case({"--layers": "1,1"}, ("layer 1", "twice")),
        "unreachable-nats": Case({}, (dead_url,), nats_url=dead_url),
        "unsupported-dest-scheme": Case({"--dest": "ftp://x"}, ("ftp",)),
        "invalid-job-name": Case({"--job": "a.b"}, ("a.b", "--job")),
        "parquet-bad-row": Case({"--dataset": str(bad_parquet)}, (str(bad_parquet), "row 3", "input_ids")),
        "parquet-token-id-outside-vocab": Case({"--dataset": str(vocab_parquet)}, ("row 4", str(VOCAB + 7))),
    }


def test_bad_inputs_give_one_line_errors(hsx, tiny_model, job_name, good_jsonl, tmp_path, subtests):
    model = tiny_model("qwen3")
    cases = _error_cases(tmp_path)
    for name, case in cases.items():
        result = hsx(*_produce_args(model, good_jsonl, tmp_path / "out", job_name, **case.args), nats_url=case.nats_url)
        with subtests.test(case=name):
            assert_one_line_error(result, *case.needles)


async def _job_state(url: str, job: str) -> tuple[dict | None, int]:
    """(the job spec as plain JSON from KV, or None; messages stored for the job's batch subject)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        try:
            kv = await js.key_value("hsx_jobs")
            spec = json.loads((await kv.get(job)).value)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError):
            spec = None
        subject = f"hsx.batches.{job}"
        try:
            info = await js.stream_info("HSX_BATCHES", subjects_filter=subject)
            count = (info.state.subjects or {}).get(subject, 0)
        except nats.js.errors.NotFoundError:
            count = 0
        return spec, count
    finally:
        await nc.close()


def _state(nats_server, job):
    return asyncio.run(_job_state(nats_server.url, job))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_good_dataset_publishes_once(fmt, hsx, nats_server, tiny_model, job_name, tmp_path):
    rows = _rows(23, seed=7, low=1, high=64)
    dataset = (
        _write_jsonl(tmp_path / "data.jsonl", rows)
        if fmt == "jsonl"
        else _write_parquet(tmp_path / "data.parquet", rows)
    )
    args = _produce_args(
        tiny_model("qwen3"), dataset, tmp_path / "out", job_name, **{"--token-budget": "128", "--max-seq-len": "64"}
    )
    assert _state(nats_server, job_name) == (None, 0)

    first = hsx(*args)
    assert first.returncode == 0, first.stderr
    assert "Traceback" not in first.stdout + first.stderr
    spec, count = _state(nats_server, job_name)
    assert spec is not None, "no job spec in KV bucket hsx_jobs"
    assert spec["job"] == job_name
    assert spec["total_samples"] == len(rows)
    assert spec["total_tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert spec["layers"] == [1, 3]
    assert spec["published"] is True
    # Budget 128 with rows up to 64 tokens: several batches, one message each.
    assert spec["total_batches"] > 1
    assert count == spec["total_batches"]

    second = hsx(*args)
    assert second.returncode == 0, second.stderr
    assert "Traceback" not in second.stdout + second.stderr
    spec_again, count_again = _state(nats_server, job_name)
    assert count_again == count, "a re-run published batches again"
    assert spec_again["total_samples"] == len(rows)
    assert spec_again["created_at"] == spec["created_at"]


def test_same_job_name_different_dataset_is_refused(hsx, nats_server, tiny_model, job_name, tmp_path):
    model = tiny_model("qwen3")
    first_data = _write_jsonl(tmp_path / "first.jsonl", _rows(6, seed=8))
    other_data = _write_jsonl(tmp_path / "other.jsonl", _rows(7, seed=9))
    first = hsx(*_produce_args(model, first_data, tmp_path / "out", job_name))
    assert first.returncode == 0, first.stderr
    spec, count = _state(nats_server, job_name)
    assert spec["total_samples"] == 6 and count == spec["total_batches"]

    second = hsx(*_produce_args(model, other_data, tmp_path / "out", job_name))
    assert_one_line_error(second, job_name)
    spec_after, count_after = _state(nats_server, job_name)
    assert spec_after == spec, "the refused run changed the job spec"
    assert count_after == count, "the refused run published batches"


@pytest.mark.parametrize("typo", ["s3:/hidden-states/runs", "file//data/out", "s4://hidden-states/runs"])
def test_a_mistyped_dest_is_refused_not_taken_as_a_folder(typo, hsx, nats_server, tiny_model, job_name, good_jsonl):
    """Before, `s3:/b/p` and `file//data/out` were local folders (`./s3:/b/p`, exit 0): now any
    text that looks like a URL and is not s3:// or file:// is one line naming --dest, exit 2,
    and nothing is published or written."""
    before = sorted(Path.cwd().iterdir())  # where the command runs (conftest: a folder of the test's own)
    result = hsx(*_produce_args(tiny_model("qwen3"), good_jsonl, typo, job_name))
    line = assert_one_line_error(result, f"--dest {typo!r}", "did you mean")
    assert result.returncode == 2, line
    assert _state(nats_server, job_name) == (None, 0), "a refused --dest published"
    assert sorted(Path.cwd().iterdir()) == before, "a refused --dest made a folder"


def test_each_dest_form_is_still_taken(hsx, tiny_model, job_name, good_jsonl, tmp_path):
    """s3://bucket/prefix, file:///abs, a relative and an absolute path: planned (--dry-run
    publishes and writes nothing, and needs no bucket)."""
    for dest in ("s3://b/p", (tmp_path / "out").as_uri(), "relative/out", str(tmp_path / "abs")):
        args = _produce_args(tiny_model("qwen3"), good_jsonl, dest, job_name)
        result = hsx(*args, "--dry-run", "--json")
        assert result.returncode == 0, (dest, result.stderr[-2000:])
        assert json.loads(result.stdout.strip().splitlines()[-1])["samples"] == 10, result.stdout


def test_a_published_job_run_again_with_other_settings_names_each_that_differs(
    hsx, nats_server, tiny_model, job_name, good_jsonl, tmp_path
):
    """Same name, same data, other --layers and --dtype: the refusal names those two, with the
    job's value and this run's, and nothing the run shares with the job."""
    model = tiny_model("qwen3")
    first = hsx(*_produce_args(model, good_jsonl, tmp_path / "out", job_name))
    assert first.returncode == 0, first.stderr
    before = _state(nats_server, job_name)

    again = hsx(
        *_produce_args(model, good_jsonl, tmp_path / "out", job_name, **{"--layers": "1,5", "--dtype": "bfloat16"})
    )
    line = assert_one_line_error(
        again,
        f"job {job_name} already exists with a different dataset or settings",
        "--layers 1,3 (this run: 1,5)",
        "--dtype float32 (this run: bfloat16)",
        f"hsx jobs delete {job_name}",
    )
    assert again.returncode == 2, line
    for same in ("--model", "--dest", "--dataset", "--token-budget", "--max-seq-len"):
        assert same not in line, line
    assert _state(nats_server, job_name) == before, "the refused run changed the job"
