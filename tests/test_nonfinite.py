"""NaN and inf propagate, and never break a selection (docs/SPEC.md §9)."""

from __future__ import annotations

import pytest
import torch

import pqattn
from tests.helpers import rows_as_sets


def _check_valid(sel: pqattn.Selection, lengths: torch.Tensor, sink: int, window: int) -> None:
    """Every row: distinct positions below its length, its sink and window, a count within bounds."""
    sets = rows_as_sets(sel.positions.cpu(), sel.counts.cpu())
    for b, rows in enumerate(sets):
        n = int(lengths[b])
        for row in rows:
            assert all(0 <= p < n for p in row)
            assert set(range(min(sink, n))) <= row and set(range(max(n - window, 0), n)) <= row
            assert len(row) <= sel.positions.shape[-1]


@pytest.mark.parametrize("route", ["reference", "kernels"])
@pytest.mark.parametrize("bits", [3, 8], ids=["histogram", "tree"])
def test_selections_from_non_finite_scores_hold_valid_positions(
    route: str, bits: int, request, device
) -> None:
    if route == "kernels":
        request.getfixturevalue("kernel_routes")
    elif device.type == "cuda":
        pytest.skip("the reference route is the CPU's")
    B, H, Hkv, N, D = 2, 4, 2, 300, 16
    k = torch.randn(B, Hkv, N, D, device=device)
    book = pqattn.build_index(k, subvectors=2, bits=bits, iters=2, init_offset=4)
    lengths = torch.tensor([N, 210], device=device)
    q = torch.randn(B, H, D, device=device)
    q[0, 1, 3] = float("nan")
    q[1, 2, 0] = float("inf")
    kw = dict(sink=4, window=8, heavy=20, init_offset=4)
    _check_valid(pqattn.select_topk(q, book.centroids, book.codes, lengths, **kw), lengths.cpu(), 4, 8)
    bad_keys = k.clone()
    bad_keys[0, 0, 50] = float("nan")
    bad_keys[1, 1, 60] = float("-inf")
    _check_valid(pqattn.select_oracle(q, bad_keys, lengths, **kw), lengths.cpu(), 4, 8)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("route", ["reference", "kernels"])
def test_attention_propagates_what_a_row_reads(route: str, request, device) -> None:
    if route == "kernels":
        request.getfixturevalue("kernel_routes")
    elif device.type == "cuda":
        pytest.skip("the reference route is the CPU's")
    B, H, Hkv, N, D, L = 1, 4, 2, 64, 16, 6
    q = torch.randn(B, H, D, device=device)
    k, v = torch.randn(B, Hkv, N, D, device=device), torch.randn(B, Hkv, N, D, device=device)
    k[0, 0, 10] = float("nan")  # KV head 0: read by query heads 0 and 1
    positions = torch.tensor(
        [[[10, 1, 2, 3, 4, 5]] * 2 + [[0, 1, 2, 3, 4, 5]] * 2], dtype=torch.int32, device=device
    )
    counts = torch.full((B, H), L, dtype=torch.int32, device=device)
    counts[0, 1] = 5  # head 1's entries past 5 are never read, and it does not list token 10 ...
    positions[0, 1] = torch.tensor([1, 2, 3, 4, 5, 10])
    out = pqattn.sparse_decode(q, k, v, positions, counts)
    assert torch.isnan(out[0, 0]).all(), "a row that reads a NaN key is NaN"
    assert torch.isfinite(out[0, 1:]).all(), "... rows that do not read it are not"
    # heads 2 and 3 read KV head 1's tokens 0-5, all positive in channel 0: an inf query entry
    # there gives +inf logits (a non-finite row), a -inf one only -inf logits (a zero row, as an
    # empty selection's: SPEC §9)
    k[0, 1, :6, 0] = k[0, 1, :6, 0].abs() + 0.1
    q[0, 3, 0] = float("inf")
    q[0, 2, 0] = float("-inf")
    out = pqattn.sparse_decode(q, k, v, positions, counts)
    assert not torch.isfinite(out[0, 3]).all()
    assert torch.equal(out[0, 2], torch.zeros_like(out[0, 2]))


def test_dense_attention_propagates_to_every_row_that_sees_it() -> None:
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16)
    k[0, 0, 5] = float("nan")
    out = pqattn.dense_attention(q, k, v, causal=True)
    assert torch.isfinite(out[:, :, :5]).all() and torch.isnan(out[:, :, 5:]).all()
