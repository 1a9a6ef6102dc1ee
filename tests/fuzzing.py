"""Strategies for the fuzz tests (tests/test_fuzz_*.py): hostile variants of real messages.

Each starts from a message as hsx itself makes it (its constructors and encoders), as a JSON tree,
and mutates it: a field's value replaced by another type, a huge or negative number, unicode
(path separators, `..`, NUL, subject wildcards), a very long string or list; a field dropped or
added; the tag changed; or the bytes themselves cut, spliced or replaced (truncated JSON, not
JSON, nesting past the recursion limit). Every run draws the same cases (`FUZZ`: derandomized,
no example database), so a `make test` is deterministic; `counted` records how many cases each
test ran, which the suite's summary prints (`fuzz cases run per type`, tests/conftest.py).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# An integer literal past Python's limit on int <-> str conversion (4300 digits): json.loads and
# int() raise ValueError for it, not their usual error.
BIG_DIGITS = "9" * 5000
# Nesting past Python's recursion limit (1000): decoders that recurse raise RecursionError.
DEEP_ARRAY = "[" * 3000 + "]" * 3000
DEEP_OBJECT = '{"a":' * 3000 + "1" + "}" * 3000

# Raw JSON text put in place of a value (json.dumps cannot write these).
RAW_VALUES = (
    BIG_DIGITS,
    "-" + BIG_DIGITS,
    "1e999",
    "-1e999",
    "NaN",
    "Infinity",
    "1.0e-400",
    DEEP_ARRAY,
    DEEP_OBJECT,
    "18446744073709551616",  # 2^64
    "-9223372036854775809",  # -2^63 - 1
)


class Raw:
    """A value written into the JSON as this text, verbatim."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'...' if len(self.text) > 40 else ''})"


FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)

NAMED_TEXT = (
    "",
    " ",
    ".",
    "..",
    "../..",
    "../../etc/passwd",
    "/",
    "/etc/passwd",
    "a/b",
    "a\\b",
    "\x00",
    "a\x00b",
    "*",
    ">",
    "a.b",
    "a.*",
    "a.>",
    "a b",
    "\n",
    "\u202e",
    "ﬀ",
    "é",
    "日本",
    "0" * 12,
    "f" * 64,
    "-1",
    "1e999",
    "NaN",
    "file:///etc",
    "file:///a/%2E%2E/b",
    "file:///a%00b",
    "file://host/x",
    "s3://b/../x",
    "s3://[x/y",
    "s3://b]/p",
    "s3://",
    "hsx.events.>",
    "$JS.API.STREAM.PURGE.HSX_BATCHES",
)
HOSTILE_TEXT = st.one_of(
    st.sampled_from(NAMED_TEXT),
    st.text(max_size=40),
    st.text(alphabet="./\\*> \x00-_aZ09%[]:@\n\u00e9", max_size=40),
    st.builds(lambda s, n: s * n, st.sampled_from(["a", "../", "é", "*", "0"]), st.integers(300, 70_000)),
)
HOSTILE_NUMBER = st.one_of(
    st.sampled_from(
        [
            -1,
            0,
            1,
            2**31 - 1,
            2**31,
            2**53 + 1,
            2**63 - 1,
            2**63,
            2**64 - 1,
            2**64,
            -(2**63),
            -(2**63) - 1,
            10**400,
            1e308,
            -1e308,
            0.5,
            -0.0,
            1e-300,
        ]
    ),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
)
_SCALAR = st.one_of(HOSTILE_TEXT, HOSTILE_NUMBER, st.none(), st.booleans(), st.sampled_from(RAW_VALUES).map(Raw))
HOSTILE_VALUE = st.one_of(
    _SCALAR,
    st.lists(_SCALAR, max_size=5),
    st.dictionaries(st.text(max_size=8), _SCALAR, max_size=3),
    st.integers(1000, 100_000).map(lambda n: [0] * n),  # a very long list
    st.builds(dict),
    st.builds(list),
)


def dumps(tree: object) -> bytes:
    """`tree` as JSON bytes, `Raw` values written verbatim."""
    raws: dict[str, str] = {}

    def swap(node: object) -> object:
        if isinstance(node, Raw):
            key = f"\ue000{len(raws)}\ue000"
            raws[key] = node.text
            return key
        if isinstance(node, dict):
            return {k: swap(v) for k, v in node.items()}
        if isinstance(node, list):
            return [swap(v) if isinstance(v, Raw | dict | list) else v for v in node]
        return node

    text = json.dumps(swap(tree), ensure_ascii=False)
    for key, raw in raws.items():
        text = text.replace(json.dumps(key, ensure_ascii=False), raw)
    return text.encode("utf-8", "surrogatepass")


def _paths(node: object, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices from the root) to a value in the tree, the root's own `()`
    included."""
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node[:8]):  # long lists: their first elements stand for the rest
            found += _paths(value, (*prefix, i))
    return found


def _at(tree: object, path: tuple) -> object:
    for key in path:
        tree = tree[key]
    return tree


def _like(value: object) -> st.SearchStrategy:
    """Hostile values of the same kind as `value` (a string for a string, ...), and of any kind."""
    if isinstance(value, bool):
        same = st.one_of(st.booleans(), HOSTILE_NUMBER)
    elif isinstance(value, int | float):
        same = HOSTILE_NUMBER
    elif isinstance(value, str):
        same = HOSTILE_TEXT
    elif isinstance(value, list):
        same = st.one_of(
            st.builds(list),
            # Longer, up to some 100,000 elements (a list made long before is not multiplied again).
            st.builds(lambda n: value * n, st.integers(2, max(2, 100_000 // len(value)))) if value else st.just([None]),
            st.lists(_SCALAR, min_size=1, max_size=5).map(lambda extra: [*value, *extra]),
            st.just(value[::-1]),
        )
    else:
        same = HOSTILE_VALUE
    return st.one_of(same, HOSTILE_VALUE)


def _fresh(value: object) -> object:
    """A copy of a drawn value's containers (never a strategy's or the tree's own, which a later
    mutation would change in place); cheaper than deepcopy for the long lists."""
    if isinstance(value, dict):
        return {key: _fresh(item) for key, item in value.items()}
    if isinstance(value, list):
        return [item if not isinstance(item, dict | list) else _fresh(item) for item in value]
    return value


@st.composite
def _mutate_once(draw, tree: object, focus: tuple, tags: tuple[str, ...]) -> object:
    paths = [path for path in _paths(tree) if path[: len(focus)] == focus]
    if not paths:  # an earlier mutation dropped the focus
        return tree
    path = draw(st.sampled_from(paths))
    target = _at(tree, path)
    ops = ["replace", "replace", "replace"] if path else []
    if isinstance(target, dict):
        ops += ["add", "tag"]
    if isinstance(target, dict | list) and target:
        ops += ["drop"]
    if not ops:
        return tree
    op = draw(st.sampled_from(ops))
    if op == "replace":
        value = _fresh(draw(_like(target)))
        if path:
            _at(tree, path[:-1])[path[-1]] = value
        return tree
    if op == "drop":
        keys = list(target) if isinstance(target, dict) else list(range(min(len(target), 8)))
        del target[draw(st.sampled_from(keys))]
    elif op == "add":
        key = draw(st.one_of(st.sampled_from(["zz", "type", "job", "__proto__", ""]), HOSTILE_TEXT))
        target[key] = _fresh(draw(HOSTILE_VALUE))
    else:
        target["type"] = _fresh(draw(st.one_of(st.sampled_from(tags), HOSTILE_TEXT, HOSTILE_VALUE)))
    return tree


TAGS = (
    "sample.v1",
    "batch.v1",
    "file.v1",
    "file.v2",
    "file.v3",
    "job.v1",
    "job.v2",
    "written.v1",
    "uploaded.v1",
    "requeued.v1",
    "kernels.v1",
    "heartbeat.v1",
    "dead.v1",
    "progress.v1",
    "epoch.v1",
    "epoch.v2",
)


@st.composite
def raw_bytes(draw, data: bytes) -> bytes:
    """`data` cut, spliced, flipped or replaced: what a payload that is not the JSON of a message
    looks like."""
    op = draw(st.sampled_from(["truncate", "binary", "flip", "splice", "nest", "bom", "empty"]))
    if op == "truncate":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if op == "binary":
        return draw(st.binary(max_size=200))
    if op == "flip":
        at = draw(st.integers(0, max(0, len(data) - 1)))
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :] if data else b"\xff"
    if op == "splice":
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.binary(min_size=1, max_size=20)) + data[at:]
    if op == "nest":  # the whole message, or an unknown field of it, nested past the recursion limit
        depth = draw(st.sampled_from([900, 1000, 3000, 50_000]))
        if draw(st.booleans()) or not data.startswith(b"{"):
            return b"[" * depth + data + b"]" * depth
        return nested_unknown_field(data, depth)
    if op == "bom":
        return b"\xef\xbb\xbf" + data
    return b""


@st.composite
def mutated(draw, message: object, *, focus: tuple = (), tags: tuple[str, ...] = TAGS) -> bytes:
    """The JSON of `message` (a JSON tree: `msgspec.to_builtins` of a real message) with one to
    three mutations at or below `focus`, or its bytes mangled."""
    if draw(st.integers(0, 5)) == 0:
        return draw(raw_bytes(dumps(message)))
    tree = copy.deepcopy(message)
    for _ in range(draw(st.integers(1, 3))):
        tree = draw(_mutate_once(tree, focus, tags))
    return dumps(tree)


def nested_unknown_field(data: bytes, depth: int = 1000) -> bytes:
    """The message `data` (a JSON object) with an unknown field nested `depth` deep first: msgspec
    skips an unknown field by recursing, and raised RecursionError past Python's limit (1000)."""
    return b'{"zz":' + b'{"a":' * depth + b"1" + b"}" * depth + b"," + data[1:]


class Cases:
    """How many cases each fuzzed type ran in this test (`record` hands them to the suite's summary
    through pytest's user properties)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __call__(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def record(self, record_property: Callable[[str, object], None]) -> None:
        for kind, count in self.counts.items():
            record_property(f"fuzz_cases:{kind}", count)
