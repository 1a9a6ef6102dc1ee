"""Samples with nothing to train on (`--on-empty-mask keep|skip|error`), and produce's input edges.

- A JSONL of chat and token rows, three of whose samples have an all-zero loss mask (a chat row
  with no assistant turn, a token row whose own mask is all 0, a token row whose supervised
  tokens `--on-long truncate` cuts away), beside a token row without a mask (trained on whole,
  not one of them): by default (`keep`) every sample is published, and the three are counted in
  the job's report (`empty_masks`: where, id, sample index, reason; `samples_empty_mask`), in
  produce's log and in the job spec; `skip` leaves them out (dense indices) and lists them;
  `error` refuses the dataset in one line naming the first one's file:line, nothing published.
- A JSONL starting with a UTF-8 byte order mark is read like one without.
- An S3 command does not log botocore's "Found credentials in environment variables.".
"""

import json
import subprocess
import sys

import test_inputs
from test_cli_errors import _produce_args, _state, _write_jsonl, assert_one_line_error
from test_inputs import CHATML, CONVERSATIONS, make_chat_model, published_samples, stored_report

MAX_LEN = 128
chat_tokenizer_files = test_inputs.chat_tokenizer_files  # the fixture: the test tokenizer's files


def _dataset(tmp_path):
    """(the JSONL, every row's id in order, {line: id} of the rows whose samples have nothing to train on)."""
    long_ids = [(3 * k) % 400 + 1 for k in range(MAX_LEN + 20)]
    rows = [
        {"id": "m0", "messages": CONVERSATIONS[0]},
        {"id": "u1", "messages": [{"role": "system", "content": "You count."}, {"role": "user", "content": "Hi"}]},
        {"id": "z2", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 0, 0]},
        {"id": "a3", "input_ids": [9, 10, 11]},  # no mask: every token trained on
        {"id": "m4", "messages": CONVERSATIONS[1]},
        # Supervised only after MAX_LEN: --on-long truncate leaves it nothing.
        {"id": "c5", "input_ids": long_ids, "loss_mask": [0] * MAX_LEN + [1] * 20},
        {"id": "t6", "input_ids": [12, 13, 14], "loss_mask": [0, 1, 1]},
    ]
    path = _write_jsonl(tmp_path / "rows.jsonl", rows)
    return path, [row["id"] for row in rows], {2: "u1", 3: "z2", 6: "c5"}


def _model(tiny_model, chat_tokenizer_files, tmp_path):
    return make_chat_model(tiny_model("qwen3"), chat_tokenizer_files, tmp_path / "model", CHATML)


def _args(model, dataset, dest, job, *extra):
    flags = {"--max-seq-len": str(MAX_LEN), "--token-budget": "512", "--on-long": "truncate"}
    return [*_produce_args(model, dataset, dest, job, **flags), *extra]


def _log_events(stderr: str, name: str) -> list[dict]:
    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    return [event for event in events if event.get("event") == name]


def test_empty_masks_kept_by_default_and_counted(
    hsx, nats_server, tiny_model, chat_tokenizer_files, job_name, tmp_path
):
    dataset, ids, empty = _dataset(tmp_path)
    dest = tmp_path / "out"
    model = _model(tiny_model, chat_tokenizer_files, tmp_path)
    done = hsx(*_args(model, dataset, dest, job_name))
    assert done.returncode == 0, done.stderr[-3000:]

    published = published_samples(nats_server.url, job_name)
    assert [published[i].source_id for i in sorted(published)] == ids, "keep publishes every sample"
    report = json.loads((dest / job_name / "_hsx" / "report.json").read_text())
    assert report == stored_report(nats_server.url, job_name)
    assert (report["on_empty_mask"], report["samples_empty_mask"]) == ("keep", len(empty)), report
    listed = report["empty_masks"]
    assert [(e["where"], e["id"]) for e in listed] == [(f"{dataset}:{line}", i) for line, i in empty.items()]
    assert [e["sample_index"] for e in listed] == [ids.index(i) for i in empty.values()]
    assert "--on-long truncate" in listed[2]["reason"] and "all 0" in listed[0]["reason"], listed
    for entry in listed:  # what was published for them really has nothing to train on
        assert not any(published[entry["sample_index"]].mask()), entry
    assert published[ids.index("a3")].mask() is None, "the row without a mask is not one of them"

    warned = _log_events(done.stderr, "samples_without_supervised_tokens")
    assert warned and warned[0]["samples"] == len(empty) and warned[0]["first"] == f"{dataset}:2", done.stderr
    assert warned[0]["level"] == "warning" and "--on-empty-mask skip" in warned[0]["hint"], warned
    summary = _log_events(done.stderr, "job_published")
    assert summary and summary[0]["samples_empty_mask"] == len(empty) and summary[0]["seconds"] > 0, summary
    spec, _ = _state(nats_server, job_name)
    assert (spec["samples_empty_mask"], spec["on_empty_mask"], spec["total_samples"]) == (len(empty), "keep", 7)

    # A re-run that would have set them aside is refused: the stored samples were made with keep.
    again = hsx(*_args(model, dataset, dest, job_name, "--on-empty-mask", "skip"))
    assert_one_line_error(again, job_name, "--on-empty-mask keep", "--on-empty-mask skip")


def test_skip_leaves_them_out_and_lists_them(hsx, nats_server, tiny_model, chat_tokenizer_files, job_name, tmp_path):
    dataset, ids, empty = _dataset(tmp_path)
    dest = tmp_path / "out"
    model = _model(tiny_model, chat_tokenizer_files, tmp_path)
    done = hsx(*_args(model, dataset, dest, job_name, "--on-empty-mask", "skip"))
    assert done.returncode == 0, done.stderr[-3000:]

    kept = [i for i in ids if i not in empty.values()]
    published = published_samples(nats_server.url, job_name)
    assert sorted(published) == list(range(len(kept))), "sample indices are not 0..N-1"
    assert [published[i].source_id for i in sorted(published)] == kept
    report = stored_report(nats_server.url, job_name)
    assert (report["on_empty_mask"], report["samples_empty_mask"]) == ("skip", len(empty)), report
    assert [(e["where"], e["id"], e["sample_index"]) for e in report["empty_masks"]] == [
        (f"{dataset}:{line}", i, None) for line, i in empty.items()
    ]
    # The truncated row was left out: the report gives it no sample index.
    (cut,) = [e for e in report["long_rows"] if e["source_id"] == "c5"]
    assert cut["action"] == "truncated" and cut["sample_index"] is None, report["long_rows"]
    spec, _ = _state(nats_server, job_name)
    assert (spec["samples_empty_mask"], spec["on_empty_mask"], spec["total_samples"]) == (3, "skip", len(kept))


def test_error_refuses_naming_the_first_with_nothing_published(
    hsx, nats_server, tiny_model, chat_tokenizer_files, job_name, tmp_path
):
    dataset, _ids, _empty = _dataset(tmp_path)
    model = _model(tiny_model, chat_tokenizer_files, tmp_path)
    refused = hsx(*_args(model, dataset, tmp_path / "out", job_name, "--on-empty-mask", "error"))
    assert_one_line_error(refused, f"{dataset}:2:", "'u1'", "nothing to train on", "3 such samples")
    assert _state(nats_server, job_name) == (None, 0), "a refused dataset published something"


def test_utf8_bom_is_accepted(hsx, nats_server, tiny_model, job_name, tmp_path):
    rows = [{"id": "b0", "input_ids": [1, 2, 3]}, {"id": "b1", "input_ids": [4, 5]}]
    dataset = tmp_path / "bom.jsonl"
    dataset.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(row) for row in rows).encode() + b"\n")
    done = hsx(*_produce_args(tiny_model("qwen3"), dataset, tmp_path / "out", job_name))
    assert done.returncode == 0, done.stderr[-3000:]
    published = published_samples(nats_server.url, job_name)
    assert sorted((s.source_id, s.input_ids) for s in published.values()) == [("b0", [1, 2, 3]), ("b1", [4, 5])]


def test_s3_command_does_not_log_found_credentials(s3_env, tmp_path):
    bucket, _env = s3_env
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"x" * 100)
    result = subprocess.run(
        [sys.executable, "-m", "hsx.cli", "sync", str(folder), "--dest", f"s3://{bucket}/ckpt", "--once"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert '"event"' in result.stderr, "sync logged nothing: the check below would prove nothing"
    assert "Found credentials" not in result.stderr, result.stderr
