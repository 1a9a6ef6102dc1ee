"""`hsx --help` says where to start; every command's --help has a paragraph on what it does and
an example, lists its required flags in a group of their own and the NATS connection's last."""

import re

import pytest

from hsx.commands.cli import NATS_GROUP, build_parser
from hsx.config.settings import REQUIRED_GROUP


def _parsers() -> dict[str, object]:
    """Every command and action `hsx --help` lists ("dead", "dead list"), with its parser."""
    found = {}

    def walk(parser, words):
        for name, child in getattr(parser, "hsx_commands", {}).items():
            found[" ".join([*words, name])] = child
            walk(child, [*words, name])

    walk(build_parser(), [])
    return found


PARSERS = _parsers()


def _sections(text: str) -> list[str]:
    """The titles of a help's groups, in order ("options", "NATS connection (...)"), not the epilog's
    (the examples, the exit codes)."""
    epilog = ("example", "exit codes")
    return [title for title in re.findall(r"^(\S[^\n]*):\n  ", text, re.MULTILINE) if not title.startswith(epilog)]


def test_hsx_help_says_where_to_start():
    text = build_parser().format_help()
    assert "hsx up" in text
    order = [text.index(f"hsx {command}", text.index("a cluster")) for command in ("produce", "consume", "monitor")]
    assert order == sorted(order)
    assert text.index("hsx upload") < text.index("hsx monitor", text.index("a cluster"))


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_each_command_says_what_it_does_and_shows_an_example(command):
    text = PARSERS[command].format_help()
    usage_end = text.index("\n\n")
    paragraph = text[usage_end + 2 :].split("\n\n")[0]
    assert len(paragraph.split()) >= 8 and not paragraph.rstrip().endswith(":"), paragraph
    example = re.search(r"^examples?:\n((?:  hsx .*\n?)+)", text, re.MULTILINE)
    assert example, f"hsx {command} --help has no example"
    for line in example.group(1).splitlines():
        assert line.strip().startswith(f"hsx {command.split()[0]}") or "hsx --config" in line, line


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_required_flags_are_listed_as_required_and_nats_last(command):
    parser = PARSERS[command]
    text = parser.format_help()
    required = {group.title: group for group in parser._action_groups}[REQUIRED_GROUP]
    in_required = {flag for action in required._group_actions for flag in action.option_strings}
    must = {flag for action in parser.hsx_flags if action.hsx_required for flag in action.option_strings}
    one_of = {flag for group in parser.hsx_one_required for action in group for flag in action.option_strings}
    assert in_required == must | one_of
    if must | one_of:
        assert REQUIRED_GROUP in _sections(text)
    sections = _sections(text)
    if any(NATS_GROUP in title for title in sections):
        assert sections[-1] == NATS_GROUP, sections
        nats = {group.title: group for group in parser._action_groups}[NATS_GROUP]
        assert "--nats" in {flag for action in nats._group_actions for flag in action.option_strings}
        assert not any(
            flag.startswith("--nats") for action in parser._optionals._group_actions for flag in action.option_strings
        )


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_the_usage_line_shows_required_flags_bare_and_the_others_in_brackets(command):
    parser = PARSERS[command]
    usage = " ".join(parser.format_usage().split())
    for action in parser.hsx_flags:
        flag = action.option_strings[-1]
        one_of = any(action in group for group in parser.hsx_one_required)
        if action.hsx_required:
            assert f" {flag} " in usage and f"[{flag} " not in usage, (flag, usage)
        elif not one_of:
            assert f"[{flag}" in usage, (flag, usage)
    for group in parser.hsx_one_required:  # one of them is required: argparse's (a | b)
        assert re.search(r"\(" + re.escape(group[0].option_strings[-1]), usage), usage
    # Formatting leaves the flags as `resolve` needs them: not required by argparse itself.
    assert not any(action.required for action in parser.hsx_flags)


def test_device_defaults_differ_between_up_and_consume_and_say_so():
    up, consume = PARSERS["up"].format_help(), PARSERS["consume"].format_help()
    flat = " ".join(up.split()), " ".join(consume.split())
    assert (
        "auto (default: cuda when torch sees a GPU, else cpu; hsx consume's default is cuda, its first GPU)" in flat[0]
    )
    assert "default cuda; hsx up's default is auto" in flat[1]
