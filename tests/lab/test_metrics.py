"""Quality metrics on hand-made cases."""

from __future__ import annotations

import torch

from pqattn.lab import metrics
from pqattn.reference import Selection


def _sel(rows: list[list[int]], width: int = 4) -> Selection:
    pos = torch.full((1, len(rows), width), -1, dtype=torch.int32)
    for h, r in enumerate(rows):
        pos[0, h, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return Selection(pos, torch.tensor([[len(r) for r in rows]], dtype=torch.int32))


def test_captured_mass() -> None:
    probs = torch.tensor([[[0.5, 0.25, 0.125, 0.125], [0.1, 0.2, 0.3, 0.4]]])
    got = metrics.captured_mass(probs, _sel([[0, 2], [3]]))
    assert torch.allclose(got, torch.tensor([[0.625, 0.4]]))


def test_oracle_recall() -> None:
    always = _sel([[0], [0]])
    oracle = _sel([[0, 2, 3], [0]])
    got = metrics.oracle_recall(_sel([[0, 2], [1]]), oracle, always, 4)
    assert torch.allclose(got, torch.tensor([[0.5, 1.0]]))  # head 1: oracle picks nothing beyond sink


def test_relative_error() -> None:
    assert metrics.relative_error(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0])) == 0.0
    assert abs(metrics.relative_error(torch.tensor([0.0, 2.0]), torch.tensor([0.0, 1.0])) - 1.0) < 1e-12
