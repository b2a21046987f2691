"""The command line says what each command shows and what each option does."""

from __future__ import annotations

import argparse

import pytest

import pqattn
from pqattn.cli import build_parser, main


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


def test_version_and_defaults_in_help(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"pqattn {pqattn.__version__}"
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "95% CI" in text and "%%" not in text and "(default: auto)" in text and "(default: None)" not in text
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["demo", "--tokens", "0", "--device", "cpu"],
            "pqattn demo: tokens: expected an integer of at least",
        ),
        (
            ["tasks", "--model", "/nonexistent"],
            "pqattn tasks: model: expected a folder holding a transformers",
        ),
    ],
)
def test_bad_arguments_are_one_line_errors(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
