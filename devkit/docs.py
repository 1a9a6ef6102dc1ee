"""The docs site's generated command reference and the checks `make docs` runs before mkdocs.

    python -m devkit.docs write    # docs/reference/commands.md and hsx-*.md, from the parser
    python -m devkit.docs check    # the reference is the code's; every page reads in one sitting
    python -m devkit.docs sizes [DOCS]   # characters per section, and each page's mean sentence

The reference is made from what commands/cli.py's `build_parser` declares (each flag's field,
hsx/config/fields.py, recorded by hsx/config/settings.py's Parser): flag, environment variable,
job-file key, default, required. `check` fails when a committed page is not what `write` would
make now, naming each declared flag that a page lacks. What a command does beyond its help is not
known here: the few words per command that are not declarations (its exit codes, where to read
more) are the tables below, and a command without them fails the check.
"""

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
REFERENCE = DOCS / "reference"
# Read in one sitting: about 2,500 words a page; the whole site (without the dated benchmark
# pages, which are kept out of the way) in a few hours.
PAGE_LIMIT = 15_000
TOTAL_LIMIT = 200_000
MEAN_WORDS = 30
HISTORY = "bench-results"  # the benchmark history: dated pages out of the nav, not counted

# ----------------------------------------------------------------------------- the reading checks

_FENCE = re.compile(r"^\s*(```|~~~)")
_ABBREVIATIONS = re.compile(r"\b(e\.g|i\.e|etc|vs|cf|approx)\.", re.IGNORECASE)
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")
_WORD = re.compile(r"[\w][\w'./-]*")


def _prose_units(text: str) -> list[str]:
    """The page's prose as units that end a sentence at their end: paragraphs, list items and
    table cells (a cell is read on its own); code blocks and headings are not prose."""
    units: list[str] = []
    paragraph: list[str] = []
    fenced = False

    def flush() -> None:
        if paragraph:
            units.append(" ".join(paragraph))
            paragraph.clear()

    for line in text.splitlines():
        if _FENCE.match(line):
            flush()
            fenced = not fenced
            continue
        stripped = line.strip()
        if fenced or not stripped or stripped.startswith(("#", "<!--")):
            flush()
            continue
        if stripped.startswith("|"):
            flush()
            cells = [cell.strip() for cell in stripped.strip("|").split("|")]
            if not all(re.fullmatch(r":?-{3,}:?", cell) for cell in cells if cell):
                units.extend(cell for cell in cells if cell)
            continue
        if re.match(r"([-*+]|\d+\.)\s", stripped):  # a list item starts a unit of its own
            flush()
            stripped = re.sub(r"^([-*+]|\d+\.)\s+", "", stripped)
        paragraph.append(stripped)
    flush()
    return units


def _plain(unit: str) -> str:
    unit = re.sub(r"`[^`]*`", "CODE", unit)  # a code span reads as one word
    unit = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", unit)  # a link reads as its text
    unit = re.sub(r"<[^>]+>", " ", unit)  # a tag (<br>) is no word
    return _ABBREVIATIONS.sub(r"\1", unit.replace("**", ""))


def sentences(text: str) -> list[int]:
    """The number of words of each sentence of a page's prose."""
    counts = []
    for unit in _prose_units(text):
        for sentence in _SENTENCE_END.split(_plain(unit)):
            words = len(_WORD.findall(sentence))
            if words:
                counts.append(words)
    return counts


def mean_sentence(text: str) -> float:
    counts = sentences(text)
    return sum(counts) / len(counts) if counts else 0.0


def pages(docs: Path = DOCS) -> list[Path]:
    return sorted(docs.rglob("*.md"))


def counted(docs: Path = DOCS) -> list[Path]:
    """The pages counted against the limits: every page but the benchmark history (its dated pages
    out of the nav, and the page that lists them)."""
    return [page for page in pages(docs) if page.relative_to(docs).parts[0] != HISTORY]


def reading_problems(docs: Path = DOCS) -> list[str]:
    """Each page over PAGE_LIMIT or over MEAN_WORDS a sentence, and the total over TOTAL_LIMIT."""
    problems = []
    for page in counted(docs):
        text, name = page.read_text(), page.relative_to(docs)
        if len(text) > PAGE_LIMIT:
            problems.append(f"docs/{name}: {len(text):,} characters, over {PAGE_LIMIT:,}: split it")
        if mean_sentence(text) > MEAN_WORDS:
            problems.append(f"docs/{name}: {mean_sentence(text):.1f} words a sentence, over {MEAN_WORDS}")
    total = sum(len(page.read_text()) for page in counted(docs))
    if total > TOTAL_LIMIT:
        problems.append(f"docs/ without {HISTORY}/: {total:,} characters, over {TOTAL_LIMIT:,}")
    return problems


def sizes(docs: Path = DOCS) -> str:
    """Characters and pages per section (a folder of docs/, or the top-level pages), then each page
    with its mean sentence length."""
    by_section: dict[str, list[int]] = {}
    lines = []
    for page in pages(docs):
        name, text = page.relative_to(docs), page.read_text()
        section = name.parts[0] if len(name.parts) > 1 else "(top level)"
        by_section.setdefault(section, []).append(len(text))
        lines.append(f"  {str(name):<52} {len(text):>8,}  {mean_sentence(text):5.1f} words a sentence")
    out = [f"{'section':<20} {'characters':>10}  pages"]
    for section, found in sorted(by_section.items(), key=lambda item: -sum(item[1])):
        out.append(f"{section:<20} {sum(found):>10,}  {len(found)}")
    counted_total = sum(len(page.read_text()) for page in counted(docs))
    out.append(f"{'all':<20} {sum(map(sum, by_section.values())):>10,}  {len(lines)}")
    out.append(f"{'all but ' + HISTORY:<20} {counted_total:>10,}  (the limit: {TOTAL_LIMIT:,})")
    return "\n".join(out + ["", *lines])


# ------------------------------------------------------------------------- the command reference

GENERATED = (
    "<!-- Made by `make reference` (devkit/docs.py) from the flags' declarations: edit those, not this page. -->"
)

# What a command exits with, and when: the codes are hsx/exitcodes.py's (checked), the situations
# the commands' own (commands/cli.py, commands/*.py, the services' main modules).
EXIT_CODES: dict[tuple[str, ...], list[tuple[int, str]]] = {
    ("up",): [
        (0, "every sample is in the destination"),
        (65, "the job failed: everything left is dead-lettered, or the destination refuses uploads"),
        (75, "SIGTERM, Ctrl-C or `--timeout`: run the same command to resume"),
        (2, "a bad flag, model, layer, device or dataset"),
        (3, "a consumer's device failed and up could not go on without it"),
        (1, "a crash, or a child that crashed a sixth time (its last error line and log are named)"),
    ],
    ("produce",): [
        (0, "every batch is published (a rerun: nothing new to publish), or `--dry-run` printed its plan"),
        (2, "a bad row, flag, model, layer or destination; no room; another plan's files or job"),
        (75, "SIGTERM or SIGINT; NATS not answering past its retries: run it again, it resumes"),
    ],
    ("consume",): [
        (0, "with `--until-done`: the job is done and this consumer's work settled"),
        (65, "the job failed (everything left is dead-lettered), or it was deleted or produced again"),
        (75, "SIGTERM or SIGINT (without `--until-done` the only way it ends): run it again"),
        (2, "a bad flag, a device torch cannot use, a model refused, no job within `--wait-for-job`"),
        (3, "the device failed (`device_failed`): restart it, on another GPU if it fails again"),
    ],
    ("upload",): [
        (0, "with `--until-done`: the job is done and this uploader's work settled"),
        (65, "the job failed (everything left is dead-lettered), or it was deleted or produced again"),
        (75, "SIGTERM or SIGINT (without `--until-done` the only way it ends): run it again"),
        (2, "a bad flag, no job within `--wait-for-job`"),
    ],
    ("monitor",): [
        (0, "with `--until-done`: the job is done; on a signal after it saw the job done"),
        (65, "with `--until-done`: the job failed (dead letters, or a destination that refuses uploads)"),
        (75, "SIGTERM or SIGINT before the job was done"),
        (2, "a bad flag, a metrics port already in use"),
    ],
    ("status",): [(0, "printed"), (2, "a bad flag, or its events not read within `--timeout`")],
    ("verify",): [(0, "every sample is sound"), (65, "a sample missing, damaged or not this job's")],
    ("index", "build"): [(0, "the index holds every sample of the job"), (65, "the index is incomplete")],
    ("index", "rebuild"): [
        (0, "the index holds every sample of the job"),
        (65, "the index is incomplete"),
        (2, "the folder holds no job bundle"),
    ],
    ("export",): [
        (0, "every sample the trainer can take is written"),
        (65, "a sample missing, damaged or not this job's (the rest are written)"),
        (2, "a bad flag, a job the format cannot take, OUT holding another export"),
    ],
    ("sync",): [
        (0, "`--once`: every file synced"),
        (65, "`--once`: a file failed its retries"),
        (75, "SIGTERM or SIGINT: the file in hand finished (`--every` ends only so)"),
        (2, "a bad flag, PATH or destination"),
    ],
    ("dead", "list"): [(0, "listed"), (2, "a job with neither a spec nor dead letters (a typo)")],
    ("dead", "retry"): [
        (0, "every chosen letter sent back, or skipped as resolved"),
        (65, "a letter refused (not this job's), left in HSX_DEAD"),
        (2, "a job with neither a spec nor dead letters; an unknown sequence"),
    ],
    ("jobs", "list"): [(0, "listed")],
    ("jobs", "delete"): [
        (0, "deleted"),
        (2, "refused: workers alive, or files waiting for upload (without `--force`)"),
    ],
    ("demo", "model"): [
        (0, "written, or a model already there kept"),
        (2, "DIR holds something else; a wheel missing"),
    ],
    ("nats-config",): [
        (0, "written"),
        (2, "a bad flag; files of an earlier run there without `--update` or `--force`"),
    ],
    ("config", "show"): [(0, "printed"), (2, "a setting the command would refuse, named as the command names it")],
    ("config", "example"): [(0, "printed")],
}

# Where a person reads more about a command: a page of the site, relative to docs/reference/.
MORE: dict[str, str] = {
    "up": "[Your first job](../get-started/first-job.md)",
    "produce": "[Plan a big job](../operations/planning.md), [Input, output, layers](data.md)",
    "consume": "[Run on several machines](../operations/multi-node.md)",
    "upload": "[Run on several machines](../operations/multi-node.md)",
    "monitor": "[Monitor a job](../operations/monitoring.md), [Progress fields and metrics](progress.md)",
    "status": "[Monitor a job](../operations/monitoring.md#hsx-status), [its fields](progress.md#hsx-status)",
    "verify": "[Fidelity](../fidelity.md#hsx-verify)",
    "index": "[The index of stored samples](../operations/resume.md#the-index-of-stored-samples)",
    "export": "[Train a drafter](../training.md)",
    "sync": "[Resume and sync](../operations/resume.md#hsx-sync)",
    "dead": "[Dead letters](../operations/monitoring.md#dead-letters)",
    "jobs": "[Re-runs and reusing a name](../operations/planning.md#re-runs-and-reusing-a-name)",
    "demo": "[Your first job](../get-started/first-job.md)",
    "nats-config": "[Secure NATS](../operations/roles.md)",
    "config": "[Configure with a job file](../operations/configuration.md)",
}


@dataclass(frozen=True)
class Row:
    flag: str  # as written in the table: `--format auto\|bar\|json`
    names: tuple[str, ...]  # every option string, or the positional's name
    env: str
    key: str
    default: str
    about: str


def _parser():
    from hsx.commands.cli import build_parser

    return build_parser()


def _leaves(parser) -> dict[tuple[str, ...], object]:
    """Every command `hsx --help` lists that runs (`produce`, `dead list`), with its parser."""
    found: dict[tuple[str, ...], object] = {}

    def walk(node, words):
        if not node.hsx_commands and words:
            found[words] = node
        for name, child in node.hsx_commands.items():
            walk(child, (*words, name))

    walk(parser, ())
    return found


def _cell(text: str) -> str:
    """One table cell of help text: one line, `%` as argparse prints it, <job> shown, not taken as HTML."""
    text = " ".join(str(text).split()).replace("%%", "%").replace("|", "\\|")
    return text.replace("<", "&lt;").replace(">", "&gt;")


def _about(action) -> str:
    """A flag's help without what the table's other columns say: its variable, its default."""
    text = action.help if isinstance(action.help, str) else ""
    variable = getattr(action, "hsx_env", None)
    default = getattr(action, "hsx_default", None)
    said = set()
    if variable:
        said.add(f"env {variable}")
    if default not in (None, "", False, True):
        shown = str(default)
        if isinstance(default, float) and default.is_integer():
            shown = str(int(default))
        said |= {f"default {value}" for value in (shown, f"./{shown}")} | {f"default: {shown}"}

    def without(inner: str) -> str:
        parts = [part for part in re.split(r"(?:, |; )", inner) if part.strip() not in said]
        return ", ".join(parts) if len(parts) != len(re.split(r"(?:, |; )", inner)) else inner

    text = re.sub(r"\(([^()]*)\)", lambda m: f"({without(m.group(1))})" if without(m.group(1)) else "", text)
    text = without(text).replace("  ", " ").strip()
    if action.choices and not all(re.search(rf"\b{re.escape(str(c))}\b", text) for c in action.choices):
        text = f"{text}: " + ", ".join(str(c) for c in action.choices) if text else ", ".join(map(str, action.choices))
    if action.__class__.__name__ == "_AppendAction" and "repeatable" not in text:
        text = f"{text} (repeatable)"
    return _cell(text)


def _default(parser, action) -> str:
    if getattr(action, "hsx_required", False):
        return "**required**"
    for group in getattr(parser, "hsx_one_required", []):
        if action in group:
            others = ", ".join(f"`{a.option_strings[-1]}`" for a in group)
            return f"**one of** {others}"
    value = getattr(action, "hsx_default", None)
    if action.nargs == 0:
        return "off" if value in (False, None) else "on"
    if value is None or value == "":
        return "none"
    return f"`{_cell(value)}`"


def _flag_text(action) -> str:
    flag = max(action.option_strings, key=len)
    if action.choices:  # its values are in the help (`_about`): a `|` in a code span shows its escape
        return f"`{flag}`"
    # The value's name only where it says more than the flag's own name does ([ADDR:]PORT, K).
    if action.nargs == 0 or action.metavar == flag.removeprefix("--").replace("-", "_").upper():
        return f"`{flag}`"
    return f"`{flag} {action.metavar}`"


def rows(parser, words: tuple[str, ...]) -> list[Row]:
    """The table of a command's own flags and arguments (the NATS connection's are shared)."""
    from hsx.config.configfile import place_of

    table, out = words[0], []
    for action in parser.hsx_positionals:
        out.append(
            Row(
                f"`{action.metavar}`",
                (action.metavar,),
                "",
                "argument",
                "**required**" if action.nargs not in ("?", "*", argparse.REMAINDER) else "none",
                _about(action),
            )
        )
    for action in parser.hsx_flags:
        if _is_nats(action) and not (words == ("up",) and "--nats" in action.option_strings):
            continue
        if getattr(action, "hsx_in_file", True):
            place = place_of(table, action.hsx_key, job_key=getattr(action, "hsx_job_key", None))
            key = f"`{place}`"
        else:
            key = "command line only"
        env = getattr(action, "hsx_env", None)
        out.append(
            Row(
                _flag_text(action),
                tuple(action.option_strings),
                f"`{env}`" if env else "",
                key,
                _default(parser, action),
                _about(action),
            )
        )
    return out


def _is_nats(action) -> bool:
    from hsx.commands.cli import NATS_GROUP

    return getattr(action.container, "title", None) == NATS_GROUP


# The variable and the job-file key share a column, one above the other: code in a table keeps
# to one line (docs/css/extra.css), and five columns of it left the help too narrow to read.
HEADER, RULE = "| flag | variable, job file | default | what it sets |", "| --- | --- | --- | --- |"


def _where(env: str, *keys: str) -> str:
    return "<br>".join(part for part in (env, *keys) if part)


def _table(found: list[Row]) -> list[str]:
    return [HEADER, RULE, *(f"| {r.flag} | {_where(r.env, r.key)} | {r.default} | {r.about} |" for r in found)]


def _exit_table(words: tuple[str, ...]) -> list[str]:
    from hsx.exitcodes import ExitCode

    by_code: dict[int, list[str]] = {}
    for code, when in EXIT_CODES[words]:
        by_code.setdefault(code, []).append(when)
    lines = ["| code | when |", "| --- | --- |"]
    for code in sorted(by_code):
        lines.append(f"| {code} `{ExitCode(code).name}` | {'; '.join(by_code[code])} |")
    return lines


def _example(words: tuple[str, ...]) -> list[str]:
    from hsx.commands.pages import PAGES

    about, examples = PAGES[words]
    return [_cell(about), "", "```", *examples, "```"]


WORKERS = ("consume", "upload")  # the spooling workers: the flags they share are listed once


def worker_rows(parser) -> list[Row]:
    """The rows `hsx consume` and `hsx upload` share: the same flag, variable, default and help."""
    consume, upload = (rows(parser.hsx_commands[name], (name,)) for name in WORKERS)
    same = {(r.flag, r.env, r.default, r.about) for r in upload}
    return [row for row in consume if (row.flag, row.env, row.default, row.about) in same]


def _up_default(parser, names: tuple[str, ...]) -> str | None:
    """`hsx up`'s default of the flag named `names`, as its page shows it."""
    return next((row.default for row in rows(parser.hsx_commands["up"], ("up",)) if row.names == names), None)


def command_page(parser, top: str) -> str:
    """docs/reference/hsx-<top>.md: the command, or each of its actions, with a paragraph, an
    example, its flags and its exit codes. `hsx up`'s job flags are `hsx produce`'s: listed with
    up's defaults only."""
    leaves = {words: sub for words, sub in _leaves(parser).items() if words[0] == top}
    single = list(leaves) == [(top,)]
    lines = [f"# hsx {top}", "", GENERATED, ""]
    if not single:
        lines += [*_example((top,)), ""]
    produce = {row.names: row for row in rows(parser.hsx_commands["produce"], ("produce",))}
    for words, sub in leaves.items():
        level, of = ("##", "") if single else ("###", f" of hsx {' '.join(words)}")
        if not single:
            lines += [f"## hsx {' '.join(words)}", ""]
        lines += [*_example(words), ""]
        found = rows(sub, words)
        if top in WORKERS:
            common = {row.names for row in worker_rows(parser)}
            found = [row for row in found if row.names not in common]
        shared = [row for row in found if top == "up" and row.names in produce]
        own = [row for row in found if row not in shared]
        lines += [f"{level} Flags{of}", "", *(_table(own) if own else ["No flags of its own."]), ""]
        if shared:
            other = [row for row in shared if row.default != produce[row.names].default]
            lines += [
                "It takes every job flag of [hsx produce](hsx-produce.md), with these defaults of its own:",
                "",
                "| flag | default in hsx up |",
                "| --- | --- |",
                *(f"| {row.flag} | {row.default} |" for row in other),
                "",
            ]
        if top in WORKERS:
            lines += ["And the [worker flags](commands.md#worker-flags) of `hsx consume` and `hsx upload`.", ""]
        if any(_is_nats(a) for a in sub.hsx_flags):
            lines += ["And the flags and exit codes of the [NATS connection](commands.md#nats-connection).", ""]
        lines += [f"{level} Exit codes{of}", "", *_exit_table(words), ""]
    lines += [f"More: {MORE[top]}.", ""]
    return "\n".join(lines)


def _job_file(parser) -> list[str]:
    """Each table of a job file and its keys, from the places the flags are read from."""
    from hsx.config.settings import file_layout

    layout, _ = file_layout(parser)
    tables: dict[str, list[str]] = {}
    for place, action in layout.items():
        flag = max(action.option_strings, key=len)
        key = place.key if flag == "--" + place.key.replace("_", "-") else f"{place.key} ({flag})"
        tables.setdefault(place.table, []).append(key)
    lines = ["| table | keys |", "| --- | --- |"]
    for table, keys in tables.items():
        if table in ("", "nats", "job"):  # the shared tables; a command's table holds its flags' names
            name = f"`[{table}]`" if table else "top level"
            lines.append(f"| {name} | {_cell(', '.join(keys))} |")
    commands = sorted(table for table in tables if table not in ("", "nats", "job"))
    lines += ["", "Each command's own table: " + ", ".join(f"`[{name}]`" for name in commands) + "."]
    return lines


def commands_page(parser) -> str:
    """docs/reference/commands.md: every command, the global flags, the NATS connection's flags and
    the exit codes."""
    from hsx.exitcodes import MEANING

    leaves = _leaves(parser)
    lines = ["# Commands", "", GENERATED, ""]
    lines += [
        "One page per command: what it does, an example, each flag with its environment variable, its key in a",
        "job file and its default, and the command's exit codes. A setting comes from the flag, else its",
        "variable, else the job file (`--config`), else its default.",
        "",
        "| command | what it does |",
        "| --- | --- |",
    ]
    for name in parser.hsx_commands:
        help_text = next(a.help for a in parser._subparsers._group_actions[0]._choices_actions if a.dest == name)
        lines.append(f"| [`hsx {name}`](hsx-{name}.md) | {_cell(help_text)} |")
    lines += ["", "## Global flags", "", "Given before the command: `hsx --config job.toml consume`.", ""]
    lines += ["| flag | environment | default | what it sets |", "| --- | --- | --- | --- |"]
    for action in parser.hsx_flags:
        env = getattr(action, "hsx_env", None)
        lines.append(
            f"| {_flag_text(action)} | {f'`{env}`' if env else ''} | {_default(parser, action)} | {_about(action)} |"
        )
    lines.append("| `--version` | | | print hsx's version and exit |")
    status = leaves[("status",)]
    nats_rows = [a for a in status.hsx_flags if _is_nats(a)]
    without = sorted(" ".join(w) for w, sub in leaves.items() if not any(_is_nats(a) for a in sub.hsx_flags))
    lines += [
        "",
        "## Worker flags",
        "",
        "`hsx consume` and `hsx upload` both take these.",
        "",
    ]
    lines += [HEADER, RULE]
    for r in worker_rows(parser):
        keys = (r.key, r.key.replace("[consume]", "[upload]")) if "[consume]" in r.key else (r.key,)
        lines.append(f"| {r.flag} | {_where(r.env, *keys)} | {r.default} | {r.about} |")
    lines += ["", "## NATS connection", ""]
    lines += [
        "Every command that talks to NATS takes these; " + ", ".join(f"`{w}`" for w in without) + " do not.",
        "Keep secrets in the environment: flags show in `ps`. No secret is ever printed. Such a command",
        "exits 75 when NATS cannot be reached or does not answer past its retries, 2 when NATS refuses",
        "its credentials.",
        "",
        HEADER,
        RULE,
    ]
    from hsx.config.configfile import place_of

    for action in nats_rows:
        place = place_of("status", action.hsx_key, job_key=None)
        env = getattr(action, "hsx_env", None)
        lines.append(
            f"| {_flag_text(action)} | {_where(f'`{env}`', f'`{place}`')} | {_default(status, action)} | {_about(action)} |"
        )
    lines += ["", "## Job file", ""]
    lines += [
        "`hsx --config job.toml COMMAND` reads a TOML file; `hsx config example` prints every key with its",
        "help and default. A key is the long flag's name, in the table of its command, except what several",
        "commands share: `[nats]` (the connection) and `[job]` (what defines the job). Flags marked",
        '"command line only" on their command\'s page have no key.',
        "",
        *_job_file(parser),
    ]
    lines += ["", "## Exit codes", ""]
    lines += [
        "Every command exits with one of these (`hsx/exitcodes.py`), so that a scheduler tells done from",
        "stopped from failed. Each command's page says when it gives which.",
        "",
        "| code | name | meaning | a scheduler |",
        "| --- | --- | --- | --- |",
    ]
    for code, (meaning, then) in MEANING.items():
        lines.append(f"| {int(code)} | `{code.name}` | {_cell(meaning)} | {_cell(then)} |")
    lines += [
        "",
        "A process killed by a signal it does not handle (SIGKILL: the OOM killer, a scheduler after its",
        "grace period) exits 128 + the signal, 137 for SIGKILL: safe to run again, as every worker acks",
        "only what is durable. What Slurm and Kubernetes do with each code:",
        "[What a scheduler needs from a worker](../operations/multi-node.md#what-a-scheduler-needs-from-a-worker).",
        "",
    ]
    return "\n".join(lines)


def reference_pages(reference: Path = REFERENCE) -> dict[Path, str]:
    """Every page of the command reference, as `write` makes it now."""
    parser = _parser()
    made = {reference / "commands.md": commands_page(parser)}
    for name in parser.hsx_commands:
        made[reference / f"hsx-{name}.md"] = command_page(parser, name)
    return made


def _name(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def reference_problems(reference: Path = REFERENCE) -> list[str]:
    """What differs between the committed reference and the parser: each declared flag a page
    lacks, each command without exit codes or a page, then any other difference."""
    from hsx.exitcodes import ExitCode

    parser = _parser()
    problems = []
    for words in _leaves(parser):
        if words not in EXIT_CODES:
            problems.append(f"hsx {' '.join(words)}: no exit codes in devkit/docs.py EXIT_CODES")
        for code, _ in EXIT_CODES.get(words, []):
            if code not in set(ExitCode):
                problems.append(f"hsx {' '.join(words)}: exit code {code} is not one of hsx/exitcodes.py's")
    for words in EXIT_CODES:
        if words not in _leaves(parser):
            problems.append(f"devkit/docs.py EXIT_CODES names hsx {' '.join(words)}, which hsx does not have")
    for name in parser.hsx_commands:
        if name not in MORE:
            problems.append(f"hsx {name}: no page to read more in devkit/docs.py MORE")
    if problems:
        return problems
    made = reference_pages(reference)
    for path, text in made.items():
        name = _name(path)
        if not path.exists():
            problems.append(f"{name}: missing")
            continue
        committed = path.read_text()
        top = path.stem.removeprefix("hsx-")
        for words, sub in _leaves(parser).items():
            if path.stem != "commands" and words[0] != top:
                continue
            if path.stem == "commands":
                declared = worker_rows(parser) if words == (WORKERS[0],) else []
            else:
                common = {row.names for row in worker_rows(parser)} if words[0] in WORKERS else set()
                if words == ("up",):  # its job flags are produce's: only those of other defaults are listed
                    produce = {row.names: row for row in rows(parser.hsx_commands["produce"], ("produce",))}
                    common = {n for n, row in produce.items() if row.default == _up_default(parser, n)}
                declared = [row for row in rows(sub, words) if row.names not in common]
            for row in declared:
                if row.flag not in committed:
                    problems.append(
                        f"{name}: hsx {' '.join(words)} {row.names[-1]} is declared but not in the reference"
                    )
        if committed != text:
            problems.append(f"{name}: not what the flags declare now")
    stale = sorted(set(reference.glob("hsx-*.md")) - set(made))
    problems += [f"{_name(path)}: a page of no command" for path in stale]
    return problems


def write_reference() -> list[Path]:
    written = []
    for path, text in reference_pages().items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    for path in set(REFERENCE.glob("hsx-*.md")) - set(reference_pages()):
        path.unlink()
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(prog="python -m devkit.docs", description=__doc__.split("\n\n")[0])
    args.add_argument("what", choices=["write", "check", "sizes"])
    args.add_argument("docs", nargs="?", type=Path, default=DOCS, help="sizes: the docs folder (default ./docs)")
    given = args.parse_args(argv)
    if given.what == "write":
        for path in write_reference():
            print(f"wrote {path.relative_to(REPO)}")
        return 0
    if given.what == "sizes":
        print(sizes(given.docs))
        return 0
    problems = reference_problems()
    if problems:
        problems.append("the command reference is not the code's: run make reference")
    problems += reading_problems()
    for problem in problems:
        print(f"docs: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
