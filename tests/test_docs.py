"""docs/ is a site of pages a person reads in one sitting, and what points into it is true.

`make docs` (in `make test`) builds the site with `mkdocs build --strict` (mkdocs.yml): a link
between pages, to a heading, or a page left out of the nav fails it, and so does a test a page
cites that does not exist (devkit/mkdocs_hooks.py). What mkdocs cannot see is checked here: the
paths and headings that the source, tests, benchmarks, README, configs and the pages themselves
quote as plain text (`docs/operations/nats.md, "Headers"`); each page's length and mean sentence,
and the whole site's length (devkit/docs.py, which `make docs` runs too); the command reference
against the flags' declarations.
"""

import re
import shutil
import subprocess

import pytest
from conftest import REPO

from devkit import docs as site

DOCS = REPO / "docs"
# A path under docs/, and the heading quoted after it, after a comma or in brackets; a comment may
# break the line between them.
REFERENCE = re.compile(r'\bdocs/((?:[\w-]+/)*[\w.-]+\.md|(?:[\w-]+/)+)(?:,\s*(?:#\s*)?"([^"]+)"|\s*\("([^"]+)"\))?')


def pages() -> list:
    return sorted(DOCS.rglob("*.md"))


def headings(page) -> list[str]:
    found, fenced = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6} (.*)", line)):
            found.append(match.group(1).strip())
    return found


def _plain(text: str) -> str:
    return " ".join(re.sub(r"\n\s*#?\s*", " ", text).replace("`", "").split()).casefold()


def quoting_files() -> list:
    """Every tracked text file: the pages too, where a path written as text (not a link, which
    mkdocs checks) is as likely to rot."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True)
    files = []
    for name in listed.stdout.split():
        path = REPO / name
        if not path.is_file() or path.suffix in {".json", ".jsonl", ".gguf"}:
            continue
        try:
            files.append((name, path.read_text()))
        except UnicodeDecodeError:
            continue
    return files


def test_every_page_reads_in_one_sitting():
    """At most site.PAGE_LIMIT characters a page, site.MEAN_WORDS words a sentence on average, and
    site.TOTAL_LIMIT for the whole site but the benchmark history."""
    assert site.reading_problems() == []
    assert len(site.counted()) > 20  # the walk found the site, not an empty folder


def test_the_reading_checks_can_fail(tmp_path):
    (tmp_path / "long.md").write_text("# Long\n\n" + "A sentence of seven words in it. " * 500)
    (tmp_path / "wordy.md").write_text("# Wordy\n\n" + " ".join(["word"] * 45) + ".\n")
    problems = site.reading_problems(tmp_path)
    assert any("/long.md: 16," in p and "over 15,000" in p for p in problems), problems
    assert any(p.endswith("/wordy.md: 45.0 words a sentence, over 30") for p in problems), problems


def test_sentences_are_counted_in_prose_cells_and_items_not_code():
    text = "# Title\n\nOne two three. Four five, e.g. six.\n\n- an item\n\n| a b | c |\n| --- | --- |\n| d e f | g |\n\n```\nx y z\n```\n"
    assert site.sentences(text) == [3, 4, 2, 2, 1, 3, 1]  # "e.g." ends no sentence


@pytest.mark.parametrize("name,text", quoting_files(), ids=lambda value: value if "\n" not in value else "")
def test_every_reference_to_a_page_names_a_page_and_a_heading_it_has(name, text):
    wrong = []
    for match in REFERENCE.finditer(text):
        target, quoted = DOCS / match.group(1), match.group(2) or match.group(3)
        if not target.exists():
            wrong.append(f"docs/{match.group(1)}: no such page")
        elif quoted and target.is_file():
            said = _plain(quoted)
            if not any(_plain(heading).startswith(said) for heading in headings(target)):
                wrong.append(f'docs/{match.group(1)}: no heading "{quoted}"')
    assert not wrong, f"{name}: {wrong}"


def test_the_references_are_found_where_they_are():
    """The check above reads what it should: the references of the code are many, and one is known."""
    quoted = {(m.group(1), m.group(2)) for _, text in quoting_files() for m in REFERENCE.finditer(text)}
    assert len(quoted) > 40
    assert ("operations/nats.md", "Headers") in quoted  # hsx/wire/headers.py


def test_the_nav_holds_every_page_once():
    """mkdocs --strict fails on a page left out (validation.omitted_files); twice is checked here.
    The dated benchmark pages are out of the nav (`not_in_nav`), behind their history page."""
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M)
    dated = re.compile(r"bench-results/20[^/]*\.md")
    assert sorted(nav) == sorted(
        str(p.relative_to(DOCS)) for p in pages() if not dated.fullmatch(str(p.relative_to(DOCS)))
    )


def test_the_command_reference_is_what_the_flags_declare():
    """docs/reference/commands.md and hsx-*.md are made from the flags' declarations (`make
    reference`, devkit/docs.py); `make docs` runs the same check first."""
    assert site.reference_problems() == []


def test_a_flag_left_out_of_the_reference_fails_the_check_naming_it(tmp_path):
    reference = tmp_path / "reference"
    shutil.copytree(site.REFERENCE, reference)
    page = reference / "hsx-consume.md"
    page.write_text("".join(line for line in page.read_text().splitlines(True) if "`--stall-after" not in line))
    problems = site.reference_problems(reference)
    assert f"{page}: hsx consume --stall-after is declared but not in the reference" in problems, problems
    (reference / "hsx-gone.md").write_text("# hsx gone\n")
    assert f"{reference / 'hsx-gone.md'}: a page of no command" in site.reference_problems(reference)
