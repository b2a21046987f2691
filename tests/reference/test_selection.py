"""Reference selection vs a brute-force selection written with loops; properties of every selection."""

from __future__ import annotations

import pytest
import torch

from pqattn import reference as ref
from tests.helpers import rows_as_sets


def brute_select(
    scores: list[float], n: int, sink: int, window: int, heavy: int, init_offset: int, threshold: int
) -> tuple[set[int], set[int], list[float]]:
    """(always-kept set, heavy set, sorted heavy scores) for one row, by the native rules."""
    if n <= threshold:
        return set(range(n)), set(), []
    kept = set(range(min(sink, n))) | set(range(n - min(window, n), n))
    cands = [p for p in range(n) if p >= init_offset and p >= sink and p < n - window]
    cands.sort(key=lambda p: -scores[p])
    chosen = cands[:heavy]
    return kept, set(chosen), sorted(scores[p] for p in chosen)


def check_against_brute(
    sel: ref.Selection,
    scores: torch.Tensor,
    lengths: torch.Tensor,
    sink: int,
    window: int,
    heavy: int,
    io: int,
    threshold: int | None = None,
) -> None:
    B, H, _ = scores.shape
    threshold = sink + heavy + window if threshold is None else threshold
    sets = rows_as_sets(sel.positions, sel.counts)
    for b in range(B):
        n = int(lengths[b])
        for h in range(H):
            row = scores[b, h].tolist()
            kept, heavy_set, heavy_scores = brute_select(row, n, sink, window, heavy, io, threshold)
            got = sets[b][h]
            assert kept <= got, f"row ({b},{h}) misses always-kept tokens {sorted(kept - got)}"
            extra = got - kept
            # Ties may be broken either way: compare the heavy part as a multiset of scores.
            assert sorted(row[p] for p in extra) == heavy_scores, f"row ({b},{h}) heavy part differs"
            assert len(got) == len(kept) + len(heavy_set) == int(sel.counts[b, h])


def check_properties(sel: ref.Selection, lengths: torch.Tensor, width: int) -> None:
    B, H, L = sel.positions.shape
    assert width == L
    assert sel.positions.dtype == torch.int32 and sel.counts.dtype == torch.int32
    for b in range(B):
        n = int(lengths[b])
        for h in range(H):
            c = int(sel.counts[b, h])
            row = sel.positions[b, h]
            assert 0 <= c <= min(n, L)
            assert ((row[:c] >= 0) & (row[:c] < n)).all(), "position out of range"
            assert (row[c:] == -1).all(), "padding must be -1"
            assert len(set(row[:c].tolist())) == c, "duplicate positions"


CASES = [
    # B, H, N, lengths, sink, window, heavy, init_offset
    pytest.param(1, 2, 50, [50], 4, 6, 8, 4, id="basic"),
    pytest.param(3, 4, 61, [61, 30, 17], 3, 5, 7, 3, id="ragged"),
    pytest.param(2, 2, 40, [40, 40], 4, 4, 100, 4, id="heavy-exceeds-candidates"),
    pytest.param(2, 3, 33, [33, 12], 2, 3, 4, 7, id="init-offset-after-sink"),
    pytest.param(2, 2, 30, [30, 9], 5, 2, 3, 0, id="init-offset-before-sink"),
    pytest.param(2, 2, 20, [20, 15], 0, 0, 6, 0, id="no-sink-no-window"),
    pytest.param(2, 1, 25, [25, 0], 2, 2, 3, 2, id="empty-sequence"),
]


@pytest.mark.parametrize(("B", "H", "N", "lengths", "sink", "window", "heavy", "io"), CASES)
def test_select_from_scores(
    B: int, H: int, N: int, lengths: list[int], sink: int, window: int, heavy: int, io: int
) -> None:
    scores = torch.randn(B, H, N, dtype=torch.float64)
    lens = torch.tensor(lengths)
    sel = ref.select_from_scores(scores, lens, sink=sink, window=window, heavy=heavy, init_offset=io)
    check_properties(sel, lens, sink + heavy + window)
    check_against_brute(sel, scores, lens, sink, window, heavy, io)


def test_ties_are_compared_as_score_multisets() -> None:
    scores = torch.randint(0, 3, (2, 3, 80)).double()  # massive ties
    lens = torch.tensor([80, 57])
    sel = ref.select_from_scores(scores, lens, sink=4, window=4, heavy=10, init_offset=4)
    check_against_brute(sel, scores, lens, 4, 4, 10, 4)


def test_short_sequences_select_everything() -> None:
    scores = torch.randn(3, 2, 40)
    lens = torch.tensor([14, 15, 16])  # sink + heavy + window = 15
    sel = ref.select_from_scores(scores, lens, sink=4, window=4, heavy=7, init_offset=8)
    sets = rows_as_sets(sel.positions, sel.counts)
    assert sets[0][0] == set(range(14)) and sets[1][1] == set(range(15))
    # at 16 tokens the general rule applies: [4, 8) is below init_offset and never selected
    assert sets[2][0] == set(range(4)) | set(range(8, 16))


def test_original_short_rule_widens_the_list() -> None:
    scores = torch.randn(2, 2, 60)
    lens = torch.tensor([40, 60])
    threshold = 5 + 4 + 1 + 32  # heavy + init_offset + 1 + C
    sel = ref.select_from_scores(
        scores, lens, sink=4, window=3, heavy=5, init_offset=4, short_threshold=threshold
    )
    check_properties(sel, lens, threshold)
    check_against_brute(sel, scores, lens, 4, 3, 5, 4, threshold)
    assert int(sel.counts[0, 0]) == 40 and int(sel.counts[1, 0]) == 12


def test_select_pq_uses_pq_scores_with_gqa() -> None:
    B, H, Hkv, N, D, M, C = 2, 6, 2, 70, 8, 2, 8
    q = torch.randn(B, H, D)
    cents = torch.randn(B, Hkv, M, C, D // M)
    codes = torch.randint(0, C, (B, Hkv, N, M), dtype=torch.uint8)
    lens = torch.tensor([70, 44])
    sel = ref.select_pq(q, cents, codes, lens, sink=2, window=3, heavy=9, init_offset=2)
    scores = ref.pq_scores(q, cents, codes)
    check_against_brute(sel, scores, lens, 2, 3, 9, 2)


def test_oracle_uses_exact_scores() -> None:
    q = torch.randn(1, 4, 16, dtype=torch.float64)
    k = torch.randn(1, 2, 90, 16, dtype=torch.float64)
    lens = torch.tensor([90])
    sel = ref.select_oracle(q, k, lens, sink=3, window=3, heavy=10, init_offset=3)
    check_against_brute(sel, ref.exact_scores(q, k), lens, 3, 3, 10, 3)


@pytest.mark.parametrize("lengths", [[100, 7, 0, 12]], ids=["long-short-empty-mid"])
def test_streaming(lengths: list[int]) -> None:
    lens = torch.tensor(lengths)
    sel = ref.select_streaming(lens, 3, sink=4, window=8)
    check_properties(sel, lens, 12)
    sets = rows_as_sets(sel.positions, sel.counts)
    for b, n in enumerate(lengths):
        want = set(range(min(4, n))) | set(range(max(n - 8, 0), n))
        assert all(s == want for s in sets[b])


def test_dense_weights_match_selection() -> None:
    scores = torch.randn(2, 3, 50)
    lens = torch.tensor([50, 21])
    sel = ref.select_from_scores(scores, lens, sink=2, window=2, heavy=5)
    w = ref.dense_weights(sel, 50)
    assert w.shape == (2, 3, 50) and set(w.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(w.sum(-1).int(), sel.counts)
    for b, row in enumerate(rows_as_sets(sel.positions, sel.counts)):
        for h, s in enumerate(row):
            assert set(w[b, h].nonzero().flatten().tolist()) == s


def brute_page_bound(q: torch.Tensor, page_keys: torch.Tensor) -> float:
    """sum_d max(q_d * min_d, q_d * max_d) over a page's keys [P, D], by loops."""
    total = 0.0
    for d in range(q.shape[0]):
        lo, hi = float(page_keys[:, d].min()), float(page_keys[:, d].max())
        total += max(float(q[d]) * lo, float(q[d]) * hi)
    return total


@pytest.mark.parametrize("page", [1, 4, 16])
def test_page_selection_takes_whole_pages_in_bound_order(page: int) -> None:
    """Quest-style pages (SPEC §7): each page's bound is the loop-computed one, bounds every <q, k>
    of the page, and the heavy part is the top-heavy candidates by their page's bound."""
    B, H, Hkv, N, D = 2, 4, 2, 150, 8
    q = torch.randn(B, H, D, dtype=torch.float64)
    keys = torch.randn(B, Hkv, N, D, dtype=torch.float64)
    lengths = torch.tensor([N, 97])
    sink, window, heavy = 3, 5, 20
    kmin, kmax = ref.page_bounds(keys, lengths, page)
    scores = ref.page_scores(q, kmin, kmax, page, N)
    for b in range(B):
        n = int(lengths[b])
        for h in range(H):
            kv = h // (H // Hkv)
            for start in range(0, n, page):
                stop = min(start + page, n)
                want = brute_page_bound(q[b, h], keys[b, kv, start:stop])
                assert abs(float(scores[b, h, start]) - want) < 1e-9
                exact = (keys[b, kv, start:stop] @ q[b, h]).max()
                assert float(exact) <= want + 1e-9, "a page bound must bound every <q, k> of the page"
    sel = ref.select_pages(
        q, keys, lengths, sink=sink, window=window, heavy=heavy, page=page, init_offset=sink
    )
    check_against_brute(sel, scores, lengths, sink, window, heavy, sink)


def test_page_bounds_ignore_tokens_past_the_length() -> None:
    keys = torch.randn(1, 1, 32, 4, dtype=torch.float64)
    keys[0, 0, 20:] = 1e6  # past lengths: must not move any bound
    _, kmax = ref.page_bounds(keys, torch.tensor([20]), 16)
    assert torch.equal(kmax[0, 0, 1], keys[0, 0, 16:20].amax(0))
    short = ref.page_bounds(keys, torch.tensor([16]), 16)
    assert torch.isinf(short[1][0, 0, 1]).all() and (short[1][0, 0, 1] < 0).all()
    scores = ref.page_scores(torch.randn(1, 1, 4, dtype=torch.float64), *short, 16, 32)
    assert torch.isneginf(scores[0, 0, 16:]).all(), "a page with no token scores -inf"
