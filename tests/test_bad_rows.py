"""Bad rows: `--on-bad-row error|skip` and `--max-bad-rows`.

- A JSONL of chat and token rows with malformed ones (bad JSON, an empty conversation, neither ids
  nor a conversation, a ShareGPT row with an unknown role, a role the chat template refuses, ids
  outside the vocabulary): by default `hsx produce` is refused in one line naming the first bad
  row's file:line, and nothing is published (no job spec, no batch); with `--on-bad-row skip`
  every good row is published, each bad row is in the job's report (`<job>/_hsx/report.json`)
  with its reason, and the spec's `rows_bad` and `hsx status` count them; a re-run that would
  not have set them aside is refused.
- `--max-bad-rows 2` with more bad rows refuses the dataset in one line; a percentage the rows
  stay within lets it through.
- A Parquet file's bad row is named by its row index, and the good rows of its batch are kept.
- A re-run's `--max-bad-rows` is checked against the rows the job read, which under
  `--chat-as speculators` are fewer than its samples.
- `SampleTableBuilder.drop` gives up a reserved place; the chat pool hands a bad row back in its
  place, and a worker's answer for it survives pickling.
"""

import json
import pickle

import msgspec
import numpy as np
import pytest
import test_inputs
from test_cli_errors import _produce_args, _state, _write_jsonl, assert_one_line_error
from test_inputs import CHATML, CONVERSATIONS, make_chat_model, published_samples, stored_report

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.producer import chat_pool
from hsx.producer.chat import ChatTokenizer
from hsx.producer.chat_pool import tokenize_chats
from hsx.producer.conventions import parse_chat_as
from hsx.producer.rows import BadRow, ChatRow, DatasetRow
from hsx.storage.tokens import SampleTableBuilder, TokenChunk, TokenRow

VOCAB = 512
chat_tokenizer_files = test_inputs.chat_tokenizer_files  # the fixture: the test tokenizer's files
# ChatML that refuses a role it does not know: "a template that cannot render" the row.
CHATML_STRICT = (
    "{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}{% endfor %}" + CHATML
)


@pytest.fixture(scope="module")
def strict_model(tiny_model, chat_tokenizer_files, tmp_path_factory):
    return make_chat_model(
        tiny_model("qwen3"), chat_tokenizer_files, tmp_path_factory.mktemp("strict") / "model", CHATML_STRICT
    )


def _dataset(tmp_path):
    """(the JSONL, the good rows' ids, {line: (id or None, a word of the reason)} of the bad rows)."""
    lines = [
        {"id": "m0", "messages": CONVERSATIONS[0]},
        {"id": "t1", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]},
        '{"id": "broken", "input_ids": [1, 2',  # 3: bad JSON
        {"id": "m3", "messages": CONVERSATIONS[1]},
        {"id": "e4", "messages": []},  # 5: an empty conversation
        {"id": "n5", "text": "neither ids nor a conversation"},  # 6
        {"id": "s6", "conversations": [{"from": "wizard", "value": "hi"}]},  # 7: ShareGPT, unknown role
        {"id": "w7", "messages": [{"role": "wizard", "content": "hi"}, *CONVERSATIONS[2]]},  # 8: the template refuses
        {"id": "v8", "input_ids": [1, 2, VOCAB + 5]},  # 9: outside the vocabulary
        {"id": "m9", "messages": CONVERSATIONS[2]},
        {"id": "t10", "input_ids": [9, 10, 11]},
    ]
    path = _write_jsonl(tmp_path / "chats.jsonl", lines)
    bad = {3: (None, "JSON"), 5: ("e4", "empty"), 6: ("n5", "neither"), 7: ("s6", ""), 8: ("w7", "wizard")}
    bad[9] = ("v8", "vocabulary")
    return path, ["m0", "t1", "m3", "m9", "t10"], bad


def test_bad_rows_refused_by_default_and_set_aside_with_skip(hsx, nats_server, strict_model, job_name, tmp_path):
    dataset, good_ids, bad = _dataset(tmp_path)
    dest = tmp_path / "out"
    args = _produce_args(strict_model, dataset, dest, job_name, **{"--max-seq-len": "256"})

    refused = hsx(*args)
    assert_one_line_error(refused, f"{dataset}:3:", "not a JSON object", "--on-bad-row skip")
    assert _state(nats_server, job_name) == (None, 0), "a refused dataset published something"

    # Above the cap: refused in one line naming the cap and the first bad row; nothing published.
    capped = hsx(*args, "--on-bad-row", "skip", "--max-bad-rows", "2")
    assert_one_line_error(capped, "--max-bad-rows 2", f"{dataset}:3")
    assert _state(nats_server, job_name) == (None, 0)
    capped = hsx(*args, "--on-bad-row", "skip", "--max-bad-rows", "50%")  # 6 of 11
    assert_one_line_error(capped, "6 of 11 rows", "--max-bad-rows 50%", f"{dataset}:3")
    assert _state(nats_server, job_name) == (None, 0)

    done = hsx(*args, "--on-bad-row", "skip", "--max-bad-rows", "60%")
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"rows_bad": 6' in done.stderr, done.stderr[-3000:]  # produce's summary
    spec, _ = _state(nats_server, job_name)
    assert (spec["rows_bad"], spec["rows_read"], spec["total_samples"]) == (len(bad), 11, len(good_ids))
    published = published_samples(nats_server.url, job_name)
    assert [published[i].source_id for i in sorted(published)] == good_ids

    report = json.loads((dest / job_name / "_hsx" / "report.json").read_text())
    assert report == stored_report(nats_server.url, job_name)
    assert (report["rows_read"], report["rows_bad"], report["on_bad_row"]) == (11, len(bad), "skip")
    assert report["max_bad_rows"] == "60%"
    listed = {int(e["where"].rsplit(":", 1)[1]): e for e in report["bad_rows"]}
    assert sorted(listed) == sorted(bad)
    assert all(e["where"] == f"{dataset}:{line}" for line, e in listed.items())
    for line, (source_id, word) in bad.items():
        assert listed[line]["id"] == source_id and word in listed[line]["reason"] and listed[line]["reason"], listed

    status = json.loads(hsx("status", "--job", job_name, "--json").stdout)
    assert status["rows_bad"] == len(bad) and status["total_samples"] == len(good_ids)
    human = hsx("status", "--job", job_name).stdout
    assert f"bad rows {len(bad)} set aside" in human, human

    # A re-run takes the stored samples: refused when it would not have set those rows aside.
    assert_one_line_error(hsx(*args), job_name, "6 of 11 rows set aside", "--on-bad-row error")
    assert_one_line_error(hsx(*args, "--on-bad-row", "skip", "--max-bad-rows", "5"), "--max-bad-rows 5")
    again = hsx(*args, "--on-bad-row", "skip")
    assert again.returncode == 0 and "samples_from_store" in again.stderr, again.stderr[-3000:]
    assert _state(nats_server, job_name)[0] == spec


def test_parquet_bad_row_is_named_by_its_index(hsx, nats_server, tiny_model, job_name, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = [[1, 2, 3], [4, 5], [], [6, -7], [8, 9, 10], [11, VOCAB]]
    dataset = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int64()))}), dataset)
    args = _produce_args(tiny_model("qwen3"), dataset, tmp_path / "out", job_name)

    assert_one_line_error(hsx(*args), f"{dataset}: row 2:", "input_ids is empty")
    assert _state(nats_server, job_name) == (None, 0)

    done = hsx(*args, "--on-bad-row", "skip")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / job_name / "_hsx" / "report.json").read_text())
    assert [(e["where"], e["id"]) for e in report["bad_rows"][:2]] == [
        (f"{dataset}: row 2", None),
        (f"{dataset}: row 3", None),
    ]
    assert report["bad_rows"][2]["where"] == f"{dataset}: row 5" and "vocabulary" in report["bad_rows"][2]["reason"]
    published = published_samples(nats_server.url, job_name)
    assert sorted((s.source_id, s.input_ids) for s in published.values()) == [
        ("0", [1, 2, 3]),
        ("1", [4, 5]),
        ("4", [8, 9, 10]),
    ]


def test_dropped_place_gets_no_sample():
    builder = SampleTableBuilder()
    builder.add(TokenChunk.from_rows([TokenRow(where="f:1", source_id="a", input_ids=[1, 2], loss_mask=None)]))
    places = [builder.reserve(where=f"f:{n}", source_id=f"c{n}") for n in (2, 3, 4)]
    builder.add_row(TokenRow(where="f:5", source_id="z", input_ids=[9], loss_mask=[1]))
    builder.fill(places[0], [3, 4, 5], [0, 1, 1])
    builder.drop(places[1])
    builder.fill(places[2], [6], None)
    with pytest.raises(IndexError):
        builder.drop(99)
    table = builder.finish()
    assert [(r.where, r.source_id, r.input_ids, r.loss_mask) for r in table] == [
        ("f:1", "a", [1, 2], None),
        ("f:2", "c2", [3, 4, 5], [0, 1, 1]),
        ("f:4", "c4", [6], None),
        ("f:5", "z", [9], [1]),
    ]
    assert table.row_max.tolist() == [2, 5, 6, 9] and np.array_equal(table.lengths, [2, 3, 1, 1])
    table.close()


def test_a_row_making_several_samples_gets_them_in_its_place():
    """`fill_row` with `more` (--chat-as speculators): the samples follow one another in the row's
    place, renamed as the row says, beside dropped places and rows filled out of order."""
    builder = SampleTableBuilder()
    places = [builder.reserve(where=f"f:{n}", source_id=f"c{n}") for n in (1, 2, 3)]
    builder.add_row(TokenRow(where="f:4", source_id="z", input_ids=[9], loss_mask=[1]))
    last = builder.reserve(where="f:5", source_id="c5")

    def row(source_id, ids, *more):
        return TokenRow(where="ignored", source_id=source_id, input_ids=ids, loss_mask=[1] * len(ids), more=more)

    builder.fill_row(last, row("c5#1", [20], row("c5#3", [21, 22])))
    builder.fill_row(places[0], row("c1#1", [10], row("c1#3", [11, 12]), row("c1#5", [13, 14, 15])))
    builder.drop(places[1])
    builder.fill_row(places[2], row("c3", [30]))
    table = builder.finish()
    assert [(r.where, r.source_id, r.input_ids) for r in table] == [
        ("f:1", "c1#1", [10]),
        ("f:1", "c1#3", [11, 12]),
        ("f:1", "c1#5", [13, 14, 15]),
        ("f:3", "c3", [30]),
        ("f:4", "z", [9]),
        ("f:5", "c5#1", [20]),
        ("f:5", "c5#3", [21, 22]),
    ]
    assert table.row_max.tolist() == [10, 12, 15, 30, 9, 20, 22] and table.lengths.tolist() == [1, 2, 3, 1, 1, 1, 2]
    assert all(r.loss_mask == [1] * len(r.input_ids) for r in table)
    table.close()


def test_chat_rows_are_tokenized_as_they_are_read(strict_model, monkeypatch, tmp_path):
    """The producer holds only the chat rows in flight, not the dataset: when each result is
    written into its place, few rows beyond it have been read (a 1M-row dataset stays in bounded
    memory)."""
    from hsx.producer import inputs

    rows, lead = 3 * inputs.POOL_MIN_ROWS, []
    dataset = _write_jsonl(tmp_path / "many.jsonl", [{"messages": CONVERSATIONS[n % 3]} for n in range(rows)])
    fill_row = SampleTableBuilder.fill_row

    def watched(builder, index, row):
        lead.append(builder.rows - index)  # rows read (places taken) beyond the one being filled
        fill_row(builder, index, row)

    monkeypatch.setattr(SampleTableBuilder, "fill_row", watched)
    monkeypatch.setattr(inputs, "tokenize_chats", lambda chat, rows, **_: tokenize_chats(chat, rows, workers=1))
    got = inputs.tokenized_rows(dataset, model=str(strict_model), vocab_size=VOCAB, max_seq_len=256, on_long="error")
    assert len(got.samples) == rows and len(lead) == rows
    # The first chunk of POOL_MIN_ROWS (read to decide on a pool), then one chunk ahead at most.
    assert max(lead) <= inputs.POOL_MIN_ROWS and max(lead[inputs.POOL_MIN_ROWS :]) <= chat_pool.CHUNK_ROWS
    got.samples.close()


def test_chat_pool_hands_bad_rows_back_in_place(strict_model):
    chat = ChatTokenizer.load(str(strict_model), first_chat_row="rows.jsonl:1")
    conversations = [CONVERSATIONS[0], [{"role": "wizard", "content": "hi"}], CONVERSATIONS[1], CONVERSATIONS[2]]
    rows = [ChatRow(where=f"rows.jsonl:{k + 1}", source_id=str(k), messages=m) for k, m in enumerate(conversations)]
    here = list(tokenize_chats(chat, rows, workers=1, chunk_rows=2))
    assert [type(row) for row in here] == [DatasetRow, BadRow, DatasetRow, DatasetRow]
    assert (here[1].where, here[1].source_id) == ("rows.jsonl:2", "1") and "wizard" in here[1].reason
    # What a worker process sends back (pickled: a BadRow itself does not unpickle), in this process.
    chat_pool._worker_chat = chat  # as _init_worker leaves a worker
    try:
        sent = pickle.loads(pickle.dumps(chat_pool._work(rows[:2]) + chat_pool._work(rows[2:])))
    finally:
        chat_pool._worker_chat = None
    assert sent[1] == (here[1].reason, "1")
    # A worker sends tokens as arrays (one buffer each across the pipe), the same values.
    assert all(isinstance(sent[k].input_ids, np.ndarray) for k in (0, 2, 3))
    assert [_plain(sent[k]) for k in (0, 2, 3)] == [_plain(here[k]) for k in (0, 2, 3)]
    # And through real worker processes (spawned, as a large dataset's tokenization runs).
    pooled = list(tokenize_chats(chat, rows, workers=2, chunk_rows=2))
    assert [type(row) for row in pooled] == [DatasetRow, BadRow, DatasetRow, DatasetRow]
    assert (pooled[1].where, pooled[1].source_id, pooled[1].reason) == (here[1].where, "1", here[1].reason)
    assert [_plain(r) for r in pooled if isinstance(r, DatasetRow)] == [
        _plain(r) for r in here if isinstance(r, DatasetRow)
    ]


def _plain(row: DatasetRow) -> tuple:
    """A row's source id, tokens and mask as Python lists, whether they came as lists or arrays."""
    mask = None if row.loss_mask is None else [int(v) for v in row.loss_mask]
    return row.source_id, [int(v) for v in row.input_ids], mask, [_plain(extra) for extra in row.more]


def test_a_rerun_counts_bad_rows_against_rows_read_not_samples(tmp_path):
    """Under `--chat-as speculators` a row makes several samples: the re-run's cap is checked
    against the rows the job read (1 bad of 4 is 25%), not samples plus bad rows (1 of 10)."""
    from hsx.producer.config import ProducerConfig, parse_max_bad_rows
    from hsx.producer.rerun import check_same_inputs as _check_same_inputs
    from hsx.wire.natsconn import NatsSettings

    existing = JobSpec(
        job="j",
        model="m",
        model_revision="",
        layers=[1],
        dtype="bfloat16",
        dest="file:///unused",
        token_budget=4096,
        max_seq_len=4096,
        dataset=str(tmp_path / "rows.jsonl"),
        plan_fingerprint="f" * 64,
        total_samples=9,  # three good rows of three assistant turns each
        total_tokens=900,
        total_batches=1,
        created_at=0.0,
        rows_bad=1,
        rows_read=4,
        chat_convention="speculators",
    )

    def cfg(cap: str) -> ProducerConfig:
        return ProducerConfig(
            nats=NatsSettings(url="nats://unused"),
            job="j",
            model="m",
            dataset=tmp_path / "rows.jsonl",
            layers=(1,),
            dest="file:///unused",
            dtype="bfloat16",
            token_budget=4096,
            max_seq_len=4096,
            chat_as=parse_chat_as("speculators"),
            on_bad_row="skip",
            max_bad_rows=parse_max_bad_rows(cap),
        )

    _check_same_inputs(cfg("25%"), existing)
    with pytest.raises(HsxError, match="1 of 4 rows set aside"):
        _check_same_inputs(cfg("20%"), existing)
    # A spec from before rows_read was recorded: the rows it can count.
    older = msgspec.structs.replace(existing, rows_read=0, total_samples=3)
    with pytest.raises(HsxError, match="1 of 4 rows set aside"):
        _check_same_inputs(cfg("20%"), older)


@pytest.mark.parametrize("nested", ["input_ids", "id", "unknown"])
def test_a_row_nested_past_the_recursion_limit_is_a_bad_row(nested):
    """JSON nested thousands deep (a few KiB of brackets, also in a field hsx does not read) is
    one bad row naming its line, not a RecursionError out of the JSON decoder."""
    from hsx.producer.rows import BadRow
    from hsx.producer.rows.forms import RowForms

    deep = "[" * 5000 + "]" * 5000
    line = json.dumps({"input_ids": [1, 2, 3], "id": "r"})[:-1] + f', "{nested}": {deep}}}'
    with pytest.raises(BadRow) as caught:
        RowForms().from_json(line.encode(), where="data.jsonl:7", default_id="6")
    assert caught.value.where == "data.jsonl:7" and "\n" not in str(caught.value)
