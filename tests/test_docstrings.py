"""The Examples in the public docstrings run and print what they show."""

from __future__ import annotations

import doctest

import pytest

import pqattn.index
import pqattn.integrations.hf
import pqattn.ops


@pytest.mark.parametrize(
    "module", [pqattn.ops, pqattn.index, pqattn.integrations.hf], ids=lambda m: m.__name__
)
def test_examples(module) -> None:
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
