"""The command line says what each command shows and what each option does."""

from __future__ import annotations

import argparse

from pqattn.cli import build_parser


def test_every_command_and_option_is_described() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) >= {
        "demo",
        "bench",
        "compare",
        "check",
        "report",
        "quality",
        "tasks",
        "train",
        "pareto",
    }
    for name, command in sub.choices.items():
        assert command.description, f"pqattn {name} --help has no description"
        bare = [a.option_strings or [a.dest] for a in command._actions if a.dest != "help" and not a.help]
        assert not bare, f"pqattn {name}: options without a help text: {bare}"
