"""Reference k-means PQ build, encoding and scores vs independent brute-force loops (float64)."""

from __future__ import annotations

import pytest
import torch

from pqattn import reference as ref
from pqattn.reference import pq as ref_pq
from pqattn.reference.pq import augment_ip
from tests.helpers import assert_close


def brute_kmeans(
    points: torch.Tensor, init: torch.Tensor, iters: int, tol: float
) -> tuple[torch.Tensor, list[int]]:
    """Lloyd's algorithm for one group with explicit loops: points [n, d], init [C, d]."""
    pts = points.tolist()
    cents = init.tolist()
    C, d = len(cents), len(cents[0])

    def nearest(p: list[float]) -> tuple[int, float]:
        best, best_d = 0, float("inf")
        for c in range(C):
            dist = sum((p[i] - cents[c][i]) ** 2 for i in range(d))
            if dist < best_d:
                best, best_d = c, dist
        return best, best_d

    for _ in range(iters):
        assign = [nearest(p) for p in pts]
        new = []
        for c in range(C):
            members = [pts[j] for j in range(len(pts)) if assign[j][0] == c]
            new.append([sum(m[i] for m in members) / len(members) for i in range(d)] if members else None)
        # empty clusters take the points farthest from their centres, farthest first
        far = sorted(range(len(pts)), key=lambda j: -assign[j][1])
        rank = 0
        for c in range(C):
            if new[c] is None:
                new[c] = list(pts[far[rank % min(len(pts), C)]])
                rank += 1
        shift = sum((new[c][i] - cents[c][i]) ** 2 for c in range(C) for i in range(d))
        cents = new
        if shift < tol:
            break
    codes = [nearest(p)[0] for p in pts]
    return torch.tensor(cents, dtype=torch.float64), codes


def make_keys(B: int, Hkv: int, N: int, D: int) -> torch.Tensor:
    return torch.randn(B, Hkv, N, D, dtype=torch.float64)


@pytest.mark.parametrize("metric", ["euclidean", "ip"])
@pytest.mark.parametrize(
    ("M", "bits", "init_offset"), [(1, 2, 0), (2, 3, 3), (4, 1, 5)], ids=["M1-b2", "M2-b3", "M4-b1"]
)
def test_build_matches_brute_force(metric: str, M: int, bits: int, init_offset: int) -> None:
    B, Hkv, N, D = 2, 2, 37, 8
    keys = make_keys(B, Hkv, N, D)
    lengths = torch.tensor([37, 23])
    res = ref.build_pq(
        keys,
        lengths,
        subvectors=M,
        bits=bits,
        metric=metric,
        init_offset=init_offset,
        iters=6,
        tol=1e-12,
        seed=3,
    )
    C, dsub = 1 << bits, D // M
    # Recover the init the reference used: same seed, zero iterations.
    init = ref.build_pq(
        keys, lengths, subvectors=M, bits=bits, metric=metric, init_offset=init_offset, iters=0, seed=3
    ).centroids
    for b in range(B):
        n = int(lengths[b])
        for h in range(Hkv):
            for m in range(M):
                pts = keys[b, h, init_offset:n, m * dsub : (m + 1) * dsub]
                if metric == "ip":
                    phi = (pts * pts).sum(-1).max()
                    assert_close(res.phi[b, h, m], phi, atol=1e-12, rtol=0, what="phi")
                    pts = torch.cat([pts, (phi - (pts * pts).sum(-1)).clamp_min(0).sqrt()[:, None]], -1)
                cents, codes = brute_kmeans(pts, init[b, h, m], iters=6, tol=1e-12)
                assert_close(res.centroids[b, h, m], cents, atol=1e-9, rtol=0, what=f"centroids {b},{h},{m}")
                assert res.codes[b, h, init_offset:n, m].tolist() == codes
                assert res.centroids.shape[-2:] == (C, dsub + (metric == "ip"))


def test_objective_decreases_every_iteration() -> None:
    keys = make_keys(2, 3, 400, 16)
    res = ref.build_pq(keys, torch.tensor([400, 250]), subvectors=2, bits=4, init_offset=2, iters=12, tol=0.0)
    obj = res.objective  # [iters + 1, B, Hkv, M]
    assert res.iterations == 12
    steps = obj[1:] - obj[:-1]
    assert (steps <= 1e-9 * obj[:-1]).all(), "k-means objective went up"
    assert (obj[-1] < obj[0]).all(), "k-means did not improve on its init"


def test_deterministic_under_seed(device: torch.device) -> None:
    keys = torch.randn(1, 2, 3000, 8, device=device)
    lengths = torch.tensor([3000], device=device)
    a = ref.build_pq(keys, lengths, subvectors=2, bits=3, seed=11)
    b = ref.build_pq(keys, lengths, subvectors=2, bits=3, seed=11)
    c = ref.build_pq(keys, lengths, subvectors=2, bits=3, seed=12)
    assert torch.equal(a.centroids, b.centroids) and torch.equal(a.codes, b.codes)
    assert not torch.equal(a.centroids, c.centroids)


def test_groups_are_independent_and_ragged() -> None:
    """A batched ragged build equals building each sequence alone on its own tokens."""
    keys = make_keys(3, 2, 90, 8)
    lengths = torch.tensor([90, 41, 66])
    both = ref.build_pq(keys, lengths, subvectors=2, bits=3, init_offset=4, iters=5, tol=1e-6, seed=0)
    inits = ref.build_pq(keys, lengths, subvectors=2, bits=3, init_offset=4, iters=0, seed=0).centroids
    for b in range(3):
        n = int(lengths[b])
        alone = ref.build_pq(
            keys[b : b + 1, :, :n],
            torch.tensor([n]),
            subvectors=2,
            bits=3,
            init_offset=4,
            iters=5,
            tol=1e-6,
            init=inits[b : b + 1],
        )
        assert_close(both.centroids[b], alone.centroids[0], atol=1e-12, rtol=0, what=f"sequence {b}")
        assert torch.equal(both.codes[b, :, :n], alone.codes[0])
        assert (both.codes[b, :, n:] == 0).all() and (both.codes[b, :, :4] == 0).all()


def test_early_stop_on_tol() -> None:
    keys = make_keys(1, 1, 200, 4)
    res = ref.build_pq(keys, torch.tensor([200]), subvectors=1, bits=2, iters=100, tol=1e-3)
    assert 1 <= res.iterations < 100


def test_fewer_points_than_centroids_and_empty_groups() -> None:
    keys = make_keys(2, 1, 10, 4)
    res = ref.build_pq(keys, torch.tensor([7, 2]), subvectors=1, bits=3, init_offset=2, iters=3)
    # sequence 0: 5 points for 8 centroids; every point sits exactly on a centroid
    pts = keys[0, 0, 2:7]
    d = torch.cdist(pts, res.centroids[0, 0, 0]).min(-1).values
    assert_close(d, torch.zeros(5, dtype=torch.float64), atol=1e-12, rtol=0, what="distances")
    # sequence 1: no quantized token at all -> zero centroids, finite everything
    assert (res.centroids[1] == 0).all() and torch.isfinite(res.centroids).all()


def test_ip_augmentation_turns_l2_nearest_into_max_inner_product() -> None:
    x = torch.randn(50, 6, dtype=torch.float64)
    phi = (x * x).sum(-1).max()
    xa = augment_ip(x, phi)
    assert_close((xa * xa).sum(-1), phi.expand(50), atol=1e-10, rtol=0, what="augmented norms")
    for _ in range(20):
        q = torch.randn(6, dtype=torch.float64)
        qa = torch.cat([q, q.new_zeros(1)])
        assert int(((xa - qa) ** 2).sum(-1).argmin()) == int((x @ q).argmax())


def test_ip_codes_pick_max_inner_product_centroids() -> None:
    """ip build: each key's code is the centroid maximising <x_aug, c> - ||c||^2 / 2 (L2-nearest)."""
    keys = make_keys(1, 2, 120, 8)
    res = ref.build_pq(keys, torch.tensor([120]), subvectors=2, bits=3, metric="ip", iters=4)
    for h in range(2):
        for m in range(2):
            x = augment_ip(keys[0, h, :, m * 4 : (m + 1) * 4], res.phi[0, h, m])
            c = res.centroids[0, h, m]
            best = (x @ c.T - 0.5 * (c * c).sum(-1)).argmax(-1)
            assert torch.equal(res.codes[0, h, :, m].long(), best)


@pytest.mark.parametrize("metric", ["euclidean", "ip"])
def test_encode_matches_build_assignment(metric: str) -> None:
    keys = make_keys(2, 2, 64, 8)
    res = ref.build_pq(keys, torch.tensor([64, 64]), subvectors=4, bits=2, metric=metric, iters=3)
    codes = ref.encode(keys, res.centroids, res.phi, metric)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 2, 64, 4)
    assert torch.equal(codes, res.codes)


def test_encode_new_keys_brute_force() -> None:
    cents = torch.randn(1, 1, 2, 4, 3, dtype=torch.float64)
    keys = torch.randn(1, 1, 9, 6, dtype=torch.float64)
    codes = ref.encode(keys, cents)
    for t in range(9):
        for m in range(2):
            d = ((keys[0, 0, t, m * 3 : (m + 1) * 3] - cents[0, 0, m]) ** 2).sum(-1)
            assert int(codes[0, 0, t, m]) == int(d.argmin())


@pytest.mark.parametrize(
    ("H", "Hkv", "M", "aug"), [(4, 2, 2, 0), (3, 3, 1, 1), (8, 2, 4, 0)], ids=["gqa2", "mha-ip", "gqa4"]
)
def test_pq_scores_brute_force(H: int, Hkv: int, M: int, aug: int) -> None:
    B, N, D, C = 2, 13, 8, 4
    dsub = D // M
    q = torch.randn(B, H, D, dtype=torch.float64)
    cents = torch.randn(B, Hkv, M, C, dsub + aug, dtype=torch.float64)
    codes = torch.randint(0, C, (B, Hkv, N, M), dtype=torch.uint8)
    got = ref.pq_scores(q, cents, codes)
    g = H // Hkv
    for b in range(B):
        for h in range(H):
            for j in range(N):
                s = sum(
                    float(
                        q[b, h, m * dsub : (m + 1) * dsub]
                        @ cents[b, h // g, m, int(codes[b, h // g, j, m]), :dsub]
                    )
                    for m in range(M)
                )
                assert abs(float(got[b, h, j]) - s) < 1e-10


def test_pq_scores_rounds_each_lut_entry_to_lut_dtype() -> None:
    """lut_dtype rounds every entry <q_m, centroid> before the sum over sub-quantizers: the score
    is the sum of the rounded entries, not the rounded sum."""
    B, H, Hkv, N, M, C, dsub = 1, 4, 2, 40, 4, 8, 2
    q = torch.randn(B, H, M * dsub, dtype=torch.float64) * 3
    cents = torch.randn(B, Hkv, M, C, dsub, dtype=torch.float64)
    codes = torch.randint(0, C, (B, Hkv, N, M), dtype=torch.uint8)
    got = ref.pq_scores(q, cents, codes, lut_dtype=torch.bfloat16)
    for h in range(H):
        for j in range(N):
            entries = [
                float(q[0, h, m * dsub : (m + 1) * dsub] @ cents[0, h // 2, m, int(codes[0, h // 2, j, m])])
                for m in range(M)
            ]
            want = sum(float(torch.tensor(e, dtype=torch.float64).to(torch.bfloat16)) for e in entries)
            assert float(got[0, h, j]) == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert not torch.equal(got, ref.pq_scores(q, cents, codes))


@pytest.mark.parametrize("rule", ["sum", "max"])
def test_group_pq_scores_round_each_lut_entry(rule: str) -> None:
    """SPEC §7: a group's PQ score sums LUT entries rounded to bfloat16; the sum rule's LUT is the
    summed query's (one table), the max rule's the max over the heads' own tables."""
    B, H, Hkv, N, M, C, dsub = 2, 8, 2, 50, 4, 16, 4
    q = torch.randn(B, H, M * dsub, dtype=torch.float64) * 3
    cents = torch.randn(B, Hkv, M, C, dsub, dtype=torch.float64)
    codes = torch.randint(0, C, (B, Hkv, N, M), dtype=torch.uint8)
    got = ref.group_pq_scores(q, cents, codes, rule)
    assert got.shape == (B, Hkv, N)
    bf16 = ref.GROUP_LUT_DTYPE
    if rule == "sum":
        want = ref.pq_scores(q.reshape(B, Hkv, H // Hkv, -1).sum(2), cents, codes, lut_dtype=bf16)
        per_head_rounding = ref.pq_scores(q, cents, codes, lut_dtype=bf16).reshape(B, Hkv, 4, N).sum(2)
        assert not torch.equal(got, per_head_rounding)  # one rounding of the summed entries
    else:
        want = ref.pq_scores(q, cents, codes, lut_dtype=bf16).reshape(B, Hkv, 4, N).amax(2)
    assert torch.equal(got, want)
    exact = ref.group_scores(ref.pq_scores(q, cents, codes), Hkv, rule)
    assert not torch.equal(got, exact)
    # each of the M entries lies within half a bfloat16 ulp (2^-8 relative) of its exact value
    bound = M * 2.0**-8 * torch.einsum("bkgmd,bkmcd->bkmc", q.reshape(B, Hkv, 4, M, dsub).abs(), cents.abs())
    assert ((got - exact).abs() <= bound.amax((-1, -2))[..., None]).all()
    with pytest.raises(ValueError, match="group_rule"):
        ref.group_pq_scores(q, cents, codes, "mean")


def test_exact_scores_brute_force() -> None:
    q = torch.randn(1, 4, 5, dtype=torch.float64)
    k = torch.randn(1, 2, 7, 5, dtype=torch.float64)
    got = ref.exact_scores(q, k)
    for h in range(4):
        assert_close(got[0, h], k[0, h // 2] @ q[0, h], atol=1e-12, rtol=0, what=f"head {h}")


def test_empty_clusters_are_reseeded_from_farthest_points() -> None:
    """Duplicate initial centres leave clusters empty: they must move onto data points, as the loop does."""
    keys = make_keys(1, 1, 60, 4)
    init = keys[0, 0, :4].clone().expand(1, 1, 1, 4, 4).clone()
    init[..., 1:3, :] = init[..., 0:1, :]  # centres 1 and 2 duplicate centre 0: empty after assignment
    res = ref.build_pq(keys, torch.tensor([60]), subvectors=1, bits=2, iters=3, tol=0.0, init=init)
    cents, codes = brute_kmeans(keys[0, 0], init[0, 0, 0], iters=3, tol=0.0)
    assert_close(res.centroids[0, 0, 0], cents, atol=1e-9, rtol=0, what="centroids")
    assert res.codes[0, 0, :, 0].tolist() == codes
    assert len(set(codes)) == 4, "every cluster should own points after re-seeding"


def test_init_draws_one_point_per_stratum() -> None:
    """C distinct valid points, centre j from stratum j; cycling below C points; fixed by the seed."""
    G, n, d, C = 4, 500, 4, 64
    x = torch.arange(G * n, dtype=torch.float64).reshape(G, n, 1).expand(G, n, d).contiguous()
    n_valid = torch.tensor([500, 70, 10, 0])
    valid = torch.arange(n) < n_valid[:, None]
    init = ref_pq._init_centres(x, valid, n_valid, C, seed=3)
    point = init[..., 0].long() - torch.arange(G)[:, None] * n  # the index each centre came from
    j = torch.arange(C)
    for g in (0, 1):
        nv = int(n_valid[g])
        assert ((point[g] >= j * nv // C) & (point[g] < (j + 1) * nv // C)).all(), "centre j leaves stratum j"
    assert point[0].unique().numel() == C and point[1].unique().numel() == C
    assert torch.equal(point[2], j % 10), "fewer points than C: every point, cycling"
    assert (init[3] == 0).all(), "an empty group's centres are zero"
    assert torch.equal(init, ref_pq._init_centres(x, valid, n_valid, C, seed=3)), "a seed fixes the init"
    assert not torch.equal(init, ref_pq._init_centres(x, valid, n_valid, C, seed=4))


def test_init_picks_are_uniform_within_a_stratum() -> None:
    """Over seeds, groups and strata, every offset inside a 10-point stratum is drawn about as often."""
    picks = torch.cat([ref_pq.init_positions(torch.full((50,), 640), 64, seed) for seed in range(40)])
    offsets = (picks % 10).flatten()
    freq = torch.bincount(offsets, minlength=10).double() / offsets.numel()
    assert (freq - 0.1).abs().max() < 0.01, freq


def test_hash_is_the_same_for_ints_and_tensors(device: torch.device) -> None:
    xs = [0, 1, 2, 12345, (1 << 31) + 7, (1 << 32) - 1]
    got = ref_pq.hash32(torch.tensor(xs, device=device)).tolist()
    assert got == [ref_pq.hash32(v) for v in xs]
    assert all(0 <= v < 1 << 32 for v in got) and len(set(got)) == len(xs)
