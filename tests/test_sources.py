"""Input sources: the file formats (producer/sources/, one module each behind a registry) apart
from the row forms (producer/rows/, which know no file type).

- The registry: every suffix a format declares, in any case, reaches that format's module, and a
  folder the datasets folder's; an unknown file type and a missing dataset are one line naming
  the file, also through `read_source`.
- Each row form (token rows with and without a mask or an id, chat rows in `messages`, ShareGPT
  rows in `conversations`, a `--chat-field` column) gives the same rows from JSONL, Parquet and a
  `datasets` save_to_disk folder, each row named the format's way (`file:LINE`, `file: row N`),
  and a bad row of each form is named that way too, the good rows around it kept.
"""

import json
from pathlib import Path

import pytest

from hsx.errors import HsxError
from hsx.producer.rows import BadRow, ChatRow
from hsx.producer.sources import SOURCES, read_source, source_of

# The format each file type is read as: the registry's own declarations are checked against it.
MODULE_OF_SUFFIX = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}
UNKNOWN = "use .jsonl, .parquet or a datasets save_to_disk folder"


def test_each_registered_file_type_is_read_by_its_module(tmp_path):
    registered = {suffix: kind for kind in SOURCES for suffix in kind.suffixes}
    assert set(registered) == set(MODULE_OF_SUFFIX)
    for suffix, module in MODULE_OF_SUFFIX.items():
        for name in (f"data{suffix}", f"DATA{suffix.upper()}"):
            path = tmp_path / name
            path.touch()
            source = source_of(path)
            assert type(source) is registered[suffix]
            assert type(source).__module__ == f"hsx.producer.sources.{module}", name
            assert source.files() == [path]
    folder = tmp_path / "saved.parquet"  # a folder is a datasets folder, whatever its name
    folder.mkdir()
    assert type(source_of(folder)).__module__ == "hsx.producer.sources.datasets_folder"


@pytest.mark.parametrize("name", ["data.csv", "data", "data.jsonl.gz"])
def test_an_unknown_file_type_is_one_error_naming_the_file(name, tmp_path):
    path = tmp_path / name
    path.write_text('{"input_ids": [1]}\n')
    expected = f"dataset {path}: unknown format {path.suffix!r}; {UNKNOWN}"
    for read in (source_of, lambda p: list(read_source(p))):
        with pytest.raises(HsxError) as raised:
            read(path)
        assert str(raised.value) == expected
    with pytest.raises(HsxError) as raised:
        list(read_source(tmp_path / "missing.jsonl"))
    assert str(raised.value) == f"dataset {tmp_path / 'missing.jsonl'} does not exist"


# ---------------------------------------------------------------- each row form from each format

CHAT = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello."}]
SHAREGPT = [{"from": "human", "value": "Say hello."}, {"from": "gpt", "value": "Hello."}]

# form: (rows, read_source's keywords, what row i gives: (id, tokens and mask, or messages), a bad row)
FORMS = {
    "tokens": (
        [
            {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "id": "a"},
            {"input_ids": [8], "loss_mask": None, "id": None},
            {"input_ids": [9, 10], "loss_mask": [1, 1], "id": "c"},
        ],
        {},
        [("a", [5, 6, 7], [0, 1, 1]), ("1", [8], None), ("c", [9, 10], [1, 1])],
        ({"input_ids": [1, 2], "loss_mask": [2, 0], "id": "bad"}, "loss_mask must hold only 0 and 1"),
    ),
    "messages": (
        [
            {"messages": CHAT, "id": "m0"},
            {"messages": CHAT[:1] + [{"role": "assistant", "content": "Hi."}], "id": None},
        ],
        {},
        [("m0", CHAT), ("1", CHAT[:1] + [{"role": "assistant", "content": "Hi."}])],
        (
            {"messages": [{"role": "robot", "content": "beep"}], "id": "bad"},
            "messages[0].role is 'robot'; expected one of system, developer, user, assistant, tool",
        ),
    ),
    "sharegpt": (
        [{"conversations": SHAREGPT, "id": "s0"}],
        {},
        [("s0", CHAT)],
        (
            {"conversations": [{"from": "bard", "value": "x"}], "id": "bad"},
            "conversations[0].from is 'bard'; expected one of human, user, gpt, assistant, system, tool",
        ),
    ),
    "chat_field": (
        [{"dialogue": SHAREGPT, "id": "d0"}, {"dialogue": CHAT, "id": "d1"}],
        {"chat_field": "dialogue"},
        [("d0", CHAT), ("d1", CHAT)],
        ({"dialogue": [], "id": "bad"}, "dialogue is empty"),
    ),
}


def _write(fmt: str, path: Path, rows: list[dict]) -> Path:
    """The rows in one file format; where a row lacks a key the others have, it is null there."""
    if fmt == "jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps({k: v for k, v in row.items() if v is not None}) + "\n" for row in rows))
        return path
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = path.with_suffix(".parquet")
        pq.write_table(pa.Table.from_pylist(rows), path)
        return path
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def _where(fmt: str, path: Path, index: int) -> str:
    return f"{path}:{index + 1}" if fmt == "jsonl" else f"{path}: row {index}"


def _rows_of(items) -> list[tuple]:
    """(where, id, tokens, mask) of each token row and (where, id, messages) of each chat row."""
    out = []
    for item in items:
        if isinstance(item, ChatRow):
            out.append((item.where, item.source_id, item.messages))
            continue
        for k in range(item.rows):
            span = slice(int(item.offsets[k]), int(item.offsets[k + 1]))
            masked = item.has_mask is not None and bool(item.has_mask[k])
            mask = item.masks[span].tolist() if masked else None
            out.append((item.wheres[k].as_py(), item.source_ids[k].as_py(), item.values[span].tolist(), mask))
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "folder"])
@pytest.mark.parametrize("form", list(FORMS))
def test_each_row_form_reads_from_each_format(form, fmt, tmp_path):
    rows, kwargs, gives, (bad_row, reason) = FORMS[form]
    path = _write(fmt, tmp_path / form, rows)
    expected = [(_where(fmt, path, i), *given) for i, given in enumerate(gives)]
    assert _rows_of(read_source(path, **kwargs)) == expected

    # A bad row among them: one error naming it, or with --on-bad-row skip set aside, the rest kept.
    path = _write(fmt, tmp_path / f"{form}_bad", [rows[0], bad_row, *rows[1:]])
    with pytest.raises(BadRow) as raised:
        list(read_source(path, **kwargs))
    assert str(raised.value) == f"{_where(fmt, path, 1)}: {reason}"
    assert raised.value.source_id == "bad"
    set_aside: list[BadRow] = []
    got = _rows_of(read_source(path, on_bad_row=set_aside.append, **kwargs))
    assert [bad.where for bad in set_aside] == [_where(fmt, path, 1)]
    assert [row[0] for row in got] == [_where(fmt, path, i) for i in range(len(rows) + 1) if i != 1]
    assert [row[2:] for row in got] == [given[1:] for given in gives]
