"""``fleet --help`` as a new user reads it: every command shows examples that the parser accepts,
every positional argument says what it is, and ``--version`` answers."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys

import pytest

from fleetctl.cli import _parser
from fleetctl.help import EXAMPLES, commands

PARSER = _parser()
COMMANDS = dict(commands(PARSER))


def test_every_command_has_examples_and_no_example_names_a_command_that_is_gone() -> None:
    assert sorted(set(COMMANDS) - set(EXAMPLES)) == []
    assert sorted(set(EXAMPLES) - set(COMMANDS)) == []
    for name, sub in COMMANDS.items():
        assert sub.epilog and sub.epilog.startswith("examples:"), name


def invocations() -> list[str]:
    """Every ``fleet ...`` command line of every example (pipes, ``&&`` and comments aside)."""
    found = []
    for examples in EXAMPLES.values():
        for line in examples:
            for segment in re.split(r"&&|\|", line.split("#")[0]):
                if segment.strip().startswith("fleet "):
                    found.append(segment.strip())
    return found


@pytest.mark.parametrize("line", invocations())
def test_every_example_is_a_command_line_the_parser_accepts(line: str) -> None:
    try:
        PARSER.parse_args(shlex.split(line)[1:])
    except SystemExit as exc:  # argparse exits on what it refuses
        pytest.fail(f"{line!r} is refused (exit {exc.code})")


def test_every_positional_argument_says_what_it_is() -> None:
    for name, sub in COMMANDS.items():
        for action in sub._actions:
            if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
                assert action.help, f"fleet {name}: {action.dest} has no help"


def test_version_answers() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fleetctl", "--version"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and re.fullmatch(r"fleet \d+\.\d+\.\d+\S*\n", result.stdout), result
