"""PQIndex: build, append, select and attend against the reference functions."""

from __future__ import annotations

import re

import pytest
import torch

import pqattn
from pqattn import PQConfig, PQIndex, ops
from pqattn import reference as ref
from pqattn.index import _MAX_PLANS
from pqattn.lab.kernel_checks import group_selection_scores, selection_problem
from pqattn.runtime.launch import interpreted
from tests.helpers import assert_close, assert_index_selection, count_plan_replays, rows_as_sets

# a small per-head index: M=2 sub-vectors of 2 bits
COARSE = PQConfig(subvectors=2, bits=2, sink=2, window=2, heavy=4, iters=1, share="head")


@pytest.mark.parametrize("metric", ["euclidean", "ip"])
def test_build_append_select_attend(device: torch.device, metric: str) -> None:
    B, H, Hkv, N, D, steps = 3, 8, 2, 120, 16, 5
    cfg = PQConfig(subvectors=4, bits=3, metric=metric, sink=4, window=8, heavy=16, iters=5, share="head")
    k = torch.randn(B, Hkv, N + steps, D, device=device)
    v = torch.randn_like(k)
    lengths = torch.tensor([120, 77, 30], device=device)
    index = PQIndex.build(k[:, :, :N], lengths, capacity=N + steps, config=cfg)
    built = pqattn.build_index(
        k[:, :, :N], lengths, subvectors=4, bits=3, metric=metric, init_offset=4, iters=5
    )
    assert torch.equal(index.centroids, built.centroids)  # (the kernel build vs the reference: test_kmeans)
    assert index.codes.shape == (B, Hkv, N + steps, 4)

    # Ragged append: each sequence's new key lands at its own length.
    cache_k = torch.zeros_like(k)
    cache_v = torch.zeros_like(v)
    for b, n in enumerate(lengths.tolist()):
        cache_k[b, :, :n], cache_v[b, :, :n] = k[b, :, :n], v[b, :, :n]
    for t in range(steps):
        new_k = torch.randn(B, Hkv, 1, D, device=device)
        new_v = torch.randn(B, Hkv, 1, D, device=device)
        for b in range(B):
            n = int(index.lengths[b])
            cache_k[b, :, n], cache_v[b, :, n] = new_k[b, :, 0], new_v[b, :, 0]
        before = index.lengths.clone()
        index.append(new_k)
        assert torch.equal(index.lengths, before + 1)
        want = ref.encode(new_k, index.centroids, index.phi, metric)
        for b in range(B):
            assert torch.equal(index.codes[b, :, int(before[b])], want[b, :, 0])

        q = torch.randn(B, H, D, device=device)
        sel = index.select(q)
        assert_index_selection(index, sel, q)  # (ties at the cut may go either way: SPEC §2)
        sel = ref.Selection(sel.positions.clone(), sel.counts.clone())
        out = index.attend(q, cache_k, cache_v)  # selects again: the same scores, the same set
        assert_close(
            out, ref.sparse_decode(q, cache_k, cache_v, *sel), atol=1e-5, rtol=1e-5, what=f"step {t}"
        )


def test_append_beyond_capacity_is_refused() -> None:
    k = torch.randn(1, 2, 50, 8)
    index = PQIndex.build(k, capacity=52, config=COARSE)
    index.append(torch.randn(1, 2, 2, 8))
    with pytest.raises(ValueError, match=r"keys.*capacity=52.*got 53"):
        index.append(torch.randn(1, 2, 1, 8))


FINE = PQConfig(subvectors=4, bits=3, sink=2, window=2, heavy=4, iters=1)


@pytest.mark.parametrize("config", [COARSE, FINE])
def test_truncate_forgets_the_tokens_past_the_lengths(device: torch.device, config: PQConfig) -> None:
    """Tokens appended and truncated away leave no trace: the next append writes where they were,
    and the selection (and, where kept, the histogram of the candidates) is that of an index that
    never saw them. Ragged lengths; bad lengths refused."""
    k = torch.randn(2, 2, 40, 8, device=device)
    lengths = [40, 33]
    kept = PQIndex.build(k, lengths, capacity=48, config=config)
    detour = PQIndex.build(k, lengths, capacity=48, config=config)
    detour.append(torch.randn(2, 2, 5, 8, device=device))
    detour.truncate(lengths)
    new = torch.randn(2, 2, 2, 8, device=device)
    kept.append(new)
    detour.append(new)
    assert detour.lengths.tolist() == kept.lengths.tolist() == [42, 35]
    q = torch.randn(2, 4, 8, device=device)
    a, b = kept.select(q), detour.select(q)
    assert torch.equal(a.counts, b.counts)
    assert torch.equal(a.positions.sort(-1).values, b.positions.sort(-1).values)
    with pytest.raises(ValueError, match=r"lengths.*at most the current lengths \[42, 35\].*\[43, 35\]"):
        detour.truncate([43, 35])
    with pytest.raises(ValueError, match=r"lengths.*\[B\]"):
        detour.truncate([40])


def test_build_and_append_validation() -> None:
    k = torch.randn(2, 2, 40, 8)
    with pytest.raises(ValueError, match=r"capacity.*N=40.*got 30"):
        PQIndex.build(k, capacity=30)
    with pytest.raises(ValueError, match=r"subvectors.*D=8.*M=3"):
        PQIndex.build(k, config=PQConfig(subvectors=3))
    index = PQIndex.build(k, capacity=64, config=COARSE)
    with pytest.raises(ValueError, match=r"keys.*\[B, Hkv, T, D\].*\[2, 3, 1, 8\]"):
        index.append(torch.randn(2, 3, 1, 8))
    with pytest.raises(ValueError, match=r"k_cache.*at least 40.*got 39"):
        index.attend(torch.randn(2, 4, 8), k[:, :, :39], k[:, :, :39])


@pytest.mark.parametrize(
    ("scale", "exc", "message"),
    [
        ("0.1", TypeError, "scale: expected a finite float or None, got str '0.1'"),
        (True, TypeError, "scale: expected a finite float or None, got bool True"),
        (float("nan"), ValueError, "scale: expected a finite float or None, got nan"),
        (float("inf"), ValueError, "scale: expected a finite float or None, got inf"),
    ],
)
def test_a_bad_scale_is_refused_before_the_step_changes_the_index(scale, exc, message) -> None:
    k = torch.randn(2, 2, 40, 8)
    index = PQIndex.build(k, capacity=64, config=COARSE)
    cache = torch.zeros(2, 2, 64, 8)
    q, k_new = torch.randn(2, 4, 8), torch.randn(2, 2, 1, 8)
    with pytest.raises(exc, match=re.escape(message)):
        index.decode_step(q, k_new, k_new, cache, cache, scale=scale)
    assert index.lengths.tolist() == [40, 40], "nothing appended"
    with pytest.raises(exc, match=re.escape(message)):
        index.attend(q, cache, cache, scale=scale)
    out = index.decode_step(q, k_new, k_new, cache, cache, scale=0.5)  # a finite scale: the step runs
    assert torch.isfinite(out).all() and index.lengths.tolist() == [41, 41]


@pytest.mark.parametrize(
    ("field", "value", "exc"),
    [
        ("bits", 0, ValueError),
        ("bits", 9, ValueError),
        ("metric", "dot", ValueError),
        ("sink", -1, ValueError),
        ("heavy", 1.5, TypeError),
        ("subvectors", 0, ValueError),
        ("tol", -1.0, ValueError),
        ("group_budget", 0, ValueError),
        ("group_budget", float("inf"), ValueError),
        ("group_budget", True, ValueError),
        ("sample", -1, ValueError),
        ("share", "kv", ValueError),
    ],
)
def test_config_validation(field: str, value: object, exc: type[Exception]) -> None:
    with pytest.raises(exc, match=field):
        PQConfig(**{field: value})


def test_default_init_offset_is_sink() -> None:
    assert PQConfig(sink=7).offset == 7 and PQConfig(sink=7, init_offset=3).offset == 3
    assert PQConfig(sink=1, heavy=2, window=3, share="head").width(4) == 6


def test_defaults_are_the_measured_operating_point() -> None:
    """PQConfig() is M=16, 8 bits, built on 16 keys per centroid, one selection per KV head by
    the max of its heads' scores keeping G per-head heavies (docs/kernels/select.md, "The
    defaults"); heavy counts tokens per query head whatever the sharing."""
    c = PQConfig()
    assert (c.subvectors, c.bits, c.share, c.group_rule, c.rerank) == (16, 8, "group", "max", 0)
    assert c.keys_per_centroid == 16 and PQConfig(metric="ip").keys_per_centroid == 0
    assert PQConfig(sample=0).keys_per_centroid == 0
    with pytest.raises(ValueError, match=r"sample.*'ip'.*every key"):
        PQConfig(metric="ip", sample=4)
    c = PQConfig(sink=4, window=8, heavy=10)
    assert [c.row_heavy(g) for g in (1, 4, 8)] == [10, 40, 80]
    assert c.width(4) == 4 + 40 + 8
    assert PQConfig(heavy=10, group_budget=2.5).row_heavy(4) == 25
    assert PQConfig(heavy=1, group_budget=0.1).row_heavy(4) == 1  # never below one row
    assert PQConfig(heavy=0).row_heavy(4) == 0
    assert PQConfig(heavy=10, share="head").row_heavy(4) == 10
    with pytest.raises(ValueError, match="group"):
        c.row_heavy(0)


def test_a_default_group_index_keeps_g_heavies_per_kv_head(device: torch.device, kernel_routes) -> None:
    """The default config's selection (M=4 here, 8 bits: the fine-code kernel route): Hkv rows of
    sink + G x heavy + window, the reference's group-max selection of that budget, whatever G
    the queries bring."""
    B, Hkv, N, D = 1, 2, 300, 32
    config = PQConfig(subvectors=4, sink=4, window=8, heavy=12, iters=2)
    keys = torch.randn(B, Hkv, N, D, device=device)
    index = PQIndex.build(keys, capacity=N, config=config)
    for g in (1, 4):
        q = torch.randn(B, Hkv * g, D, device=device)
        sel = index.select(q)
        assert sel.positions.shape == (B, Hkv, 4 + 12 * g + 8)
        scores, slack = group_selection_scores(q, index.centroids, index.codes, "max")
        want = ref.select_from_scores(scores, index.lengths, sink=4, window=8, heavy=12 * g, init_offset=4)
        problem = selection_problem(
            *sel, scores, index.lengths, cand_lo=4, window=8, short_threshold=4 + 12 * g + 8, ref_sel=want,
            slack=slack,
        )  # fmt: skip
        assert problem is None, problem


def test_public_names() -> None:
    for name in pqattn.__all__:
        assert hasattr(pqattn, name), name


def _step_setup(device, *, B=2, H=8, Hkv=2, N=None, D=64, steps=3, dtype=torch.float32):
    N = N or (200 if device.type == "cpu" else 600)  # (the interpreter's kernels at a small size)
    config = pqattn.PQConfig(subvectors=4, bits=4, sink=4, window=8, heavy=32, iters=3, share="head")
    keys = torch.randn(B, Hkv, N + steps, D, device=device, dtype=dtype)
    values = torch.randn(B, Hkv, N + steps, D, device=device, dtype=dtype)
    lengths = [N, N - 50]
    index = pqattn.PQIndex.build(keys[:, :, :N], lengths, capacity=N + steps, config=config)
    k_cache = torch.zeros(B, Hkv, N + steps, D, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    for b, n in enumerate(lengths):
        k_cache[b, :, :n] = keys[b, :, :n]
        v_cache[b, :, :n] = values[b, :, :n]
    return index, k_cache, v_cache, lengths


def test_decode_step_stores_indexes_selects_attends(device: torch.device, kernel_routes) -> None:
    """The user's step on the kernel route: store, append, select, attend, against the reference."""
    B, H, D, steps = 2, 8, 64, 3
    index, k_cache, v_cache, lengths = _step_setup(device, steps=steps)
    for t in range(steps):
        q = torch.randn(B, H, D, device=device)
        k_new = torch.randn(B, 2, 1, D, device=device)
        v_new = torch.randn(B, 2, 1, D, device=device)
        out = pqattn.decode_step(index, q, k_new, v_new, k_cache, v_cache).clone()
        for b, n in enumerate(lengths):
            assert torch.equal(k_cache[b, :, n + t], k_new[b, :, 0])
            assert torch.equal(v_cache[b, :, n + t], v_new[b, :, 0])
        assert index.lengths.tolist() == [n + t + 1 for n in lengths]
        sel = index.select(q)
        newest = (sel.positions == index.lengths[:, None, None] - 1).any(-1)
        assert newest.all(), "the new token is in the window"
        want = ref.sparse_decode(q.double(), k_cache.double(), v_cache.double(), sel.positions, sel.counts)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_attend_with_selections_of_other_layouts(device: torch.device, kernel_routes) -> None:
    """attend() with given selections of other head counts and widths on one index: the attention
    workspace's counters sit at places that depend on (B * H, L, D), so a workspace left by a wide
    selection of few heads must not serve a narrower one of more heads as it is."""
    index, k_cache, v_cache, lengths = _step_setup(device)
    B, D = 2, 64
    for H, L in ((2, 1024), (8, 128), (4, 256)) if device.type == "cpu" else ((2, 4096), (8, 512), (4, 1024)):
        q = torch.randn(B, H, D, device=device)
        positions = torch.randint(0, min(lengths), (B, H, L), device=device, dtype=torch.int32)
        counts = torch.randint(1, L + 1, (B, H), device=device, dtype=torch.int32)
        positions = torch.where(torch.arange(L, device=device) < counts[..., None], positions, -1)
        out = index.attend(q, k_cache, v_cache, pqattn.Selection(positions, counts))
        want = ref.sparse_decode(q.double(), k_cache.double(), v_cache.double(), positions, counts)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5, msg=f"H={H} L={L}")


def test_attend_trusts_its_own_selection_only(device: torch.device, kernel_routes, monkeypatch) -> None:
    """attend() over the selection select() returned reads none of its values on the host (the
    index made it), over caches of a new length at every call as a growing cache gives them; a
    selection the caller built is checked when no plan replays (an out-of-range position
    refused); caches of another shape are refused naming them."""
    index, k_cache, v_cache, _ = _step_setup(device)
    q = torch.randn(2, 8, 64, device=device)
    reads = []
    flag = pqattn.dispatch.bad_selection_rows
    monkeypatch.setattr(pqattn.dispatch, "bad_selection_rows", lambda *a: reads.append(1) or flag(*a))
    for extra in (0, 1, 2):  # a cache one token longer each call: no plan replays
        k, v = (torch.cat([c, c[:, :, :extra]], dim=2) for c in (k_cache, v_cache))
        sel = index.select(q)
        want = ref.sparse_decode(q.double(), k.double(), v.double(), sel.positions, sel.counts)
        torch.testing.assert_close(index.attend(q, k, v, sel).double(), want, atol=1e-5, rtol=1e-5)
    assert not reads
    positions, counts = sel.positions.clone(), sel.counts.clone()
    positions[0, 0, 0] = k.shape[2]
    with pytest.raises(ValueError, match="positions"):  # (caches of a new signature: no plan)
        index.attend(q, k[:, :, :-1], v[:, :, :-1], pqattn.Selection(positions, counts))
    assert reads
    with pytest.raises(
        ValueError, match=r"v_cache.*\[2, 2, 203, 64\]" if device.type == "cpu" else "v_cache"
    ):
        index.attend(q, k_cache, v_cache[:, :1], index.select(q))
    with pytest.raises(ValueError, match="k_cache"):
        index.attend(q, k_cache[:1], v_cache[:1], index.select(q))


def test_decode_step_refuses_bad_input(device: torch.device) -> None:
    index, k_cache, v_cache, _ = _step_setup(device)
    q = torch.randn(2, 8, 64, device=device)
    k_new = torch.randn(2, 2, 1, 64, device=device)
    with pytest.raises(ValueError, match="k_new"):
        index.decode_step(q, k_new[:, :, :, :32], k_new, k_cache, v_cache)
    with pytest.raises(ValueError, match="v_cache"):
        index.decode_step(q, k_new, k_new, k_cache, v_cache[:, :, :10])


def test_decode_step_in_a_cuda_graph(device: torch.device) -> None:
    """The whole step (store, encode, select, attend) captured once and replayed per token."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    B, H, D, steps = 2, 8, 64, 4
    index, k_cache, v_cache, _ = _step_setup(device, steps=steps + 1)
    shadow, k_shadow, v_shadow, _ = _step_setup(device, steps=steps + 1)
    shadow.codes.copy_(index.codes)
    shadow.centroids.copy_(index.centroids)
    k_shadow.copy_(k_cache)
    v_shadow.copy_(v_cache)
    q = torch.randn(B, H, D, device=device)
    k_new = torch.randn(B, 2, 1, D, device=device)
    v_new = torch.randn(B, 2, 1, D, device=device)
    index.decode_step(q, k_new, v_new, k_cache, v_cache)  # the first token eagerly (the README's pattern)
    shadow.decode_step(q, k_new, v_new, k_shadow, v_shadow)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = index.decode_step(q, k_new, v_new, k_cache, v_cache)
    for _ in range(steps):
        q.normal_()
        k_new.normal_()
        v_new.normal_()
        graph.replay()
        want = shadow.decode_step(q, k_new, v_new, k_shadow, v_shadow)
        torch.cuda.synchronize()
        assert torch.equal(index.lengths, shadow.lengths)
        assert torch.equal(k_cache, k_shadow)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_from_codebook_holds_a_codebook_built_elsewhere(device: torch.device) -> None:
    cfg = PQConfig(subvectors=2, bits=3, sink=2, window=2, heavy=5, iters=2, share="head")
    keys = torch.randn(2, 2, 60, 16, device=device)
    book = pqattn.build_index(
        keys, torch.tensor([60, 41], device=device), subvectors=2, bits=3, iters=2, init_offset=2
    )
    index = PQIndex.from_codebook(book, [60, 41], capacity=64, config=cfg)
    assert index.head_dim == 16 and index.capacity == 64 and index.lengths.tolist() == [60, 41]
    assert torch.equal(index.codes[:, :, :60], book.codes) and torch.equal(index.centroids, book.centroids)
    q = torch.randn(2, 4, 16, device=device)
    want = pqattn.select_topk(
        q, book.centroids, book.codes, index.lengths, sink=2, window=2, heavy=5, init_offset=2
    )
    got = index.select(q)
    assert torch.equal(got.counts, want.counts)
    with pytest.raises(ValueError, match="book: expected M=2, C=16"):
        PQIndex.from_codebook(book, [60, 41], config=PQConfig(subvectors=2, bits=4))
    with pytest.raises(ValueError, match="capacity"):
        PQIndex.from_codebook(book, [60, 41], capacity=10, config=cfg)


@pytest.mark.parametrize("subvectors", [2, 4], ids=["histogram", "tree"])
def test_eager_decode_steps_replay_their_plan(subvectors: int, kernel_routes, monkeypatch, device) -> None:
    """The first step records its launches (store + encode + length update, selection, attention),
    the next ones replay them: each step's caches, lengths and output match the reference. (On a
    GPU a first run warms Triton's caches: a launch that compiles or autotunes is not recorded;
    the interpreter has none to warm.)"""
    B, H, Hkv, N, D, steps = 2, 8, 2, 300 if device.type == "cuda" else 160, 64, 4
    config = pqattn.PQConfig(subvectors=subvectors, bits=4, sink=4, window=8, heavy=32, iters=2, share="head")
    lengths = [N, N - 70]
    for warm in (False,) if interpreted() else (True, False):
        keys = torch.randn(B, Hkv, N + steps, D, device=device)
        index = pqattn.PQIndex.build(keys[:, :, :N], lengths, capacity=N + steps, config=config)
        k_cache = torch.zeros(B, Hkv, N + steps, D, device=device)
        v_cache = torch.zeros_like(k_cache)
        for b, n in enumerate(lengths):
            k_cache[b, :, :n] = keys[b, :, :n]
            v_cache[b, :, :n].normal_()
        replays = count_plan_replays(monkeypatch)
        for t in range(steps):
            q = torch.randn(B, H, D, device=device)
            k_new = torch.randn(B, Hkv, 1, D, device=device)
            v_new = torch.randn(B, Hkv, 1, D, device=device)
            out = index.decode_step(q, k_new, v_new, k_cache, v_cache)
            assert index.lengths.tolist() == [n + t + 1 for n in lengths]
            for b, n in enumerate(lengths):
                assert torch.equal(k_cache[b, :, n + t], k_new[b, :, 0])
                assert torch.equal(v_cache[b, :, n + t], v_new[b, :, 0])
            sel = index._selection  # the step's own (ties at the cut may be broken either way)
            assert_index_selection(index, sel, q)
            new_codes = ref.encode(k_new, index.centroids, None)
            for b, n in enumerate(lengths):
                assert torch.equal(index.codes[b, :, n + t], new_codes[b, :, 0])
            want = ref.sparse_decode(q.double(), k_cache.double(), v_cache.double(), *sel)
            assert_close(out, want, atol=1e-5, rtol=1e-5, what=f"step {t}")
            assert warm or replays[0] == t, "the first step records, the next ones replay"
        assert index._max_length == N + steps


@pytest.mark.parametrize("share", ["group", "head"])
def test_the_fine_route_encodes_the_new_key_in_its_lut_launch(
    share, kernel_routes, monkeypatch, device
) -> None:
    """decode_step and select(append=): on the fine route (a group selection, the default) the
    selection's LUT launch encodes the new key, so no encode launch runs; per head (the tree
    route here) the encode launch does. Either way: the codes are the reference's, the cache rows
    the new ones, the lengths advanced once a step, and select(q, append=k) selects what
    append(k) then select(q) selects, k given as the keys or in a key cache at the lengths."""
    from pqattn.runtime import launch

    B, H, Hkv, N, D, steps = 2, 8, 2, 200, 32, 3
    config = PQConfig(subvectors=4, sink=4, window=8, heavy=12, iters=2, share=share)
    lengths = [N, N - 60]
    keys = torch.randn(B, Hkv, N, D, device=device)
    index, twin = (PQIndex.build(keys, lengths, capacity=N + 2 * steps, config=config) for _ in "ab")
    for name in ("centroids", "codes", "lengths"):
        getattr(twin, name).copy_(getattr(index, name))
    k_cache = torch.zeros(B, Hkv, N + 2 * steps, D, device=device)
    v_cache = torch.zeros_like(k_cache)
    names: list[str] = []
    call = launch.Launcher.__call__

    def named(self, *args):
        names.append(self.fn.__name__)
        return call(self, *args)

    monkeypatch.setattr(launch.Launcher, "__call__", named)
    encodes = share == "head"
    for bad in (torch.randn(B, Hkv, 2, D, device=device), torch.randn(B, Hkv + 1, 1, D, device=device)):
        with pytest.raises(ValueError, match="append: expected"):
            index.select(torch.randn(B, H, D, device=device), append=bad)
    for t in range(2 * steps):
        q, k_new, v_new = torch.randn(B, H, D, device=device), *torch.randn(2, B, Hkv, 1, D, device=device)
        names.clear()
        if t < steps:
            index.decode_step(q, k_new, v_new, k_cache, v_cache)
            for b, n in enumerate(lengths):
                assert torch.equal(k_cache[b, :, n + t], k_new[b, :, 0])
                assert torch.equal(v_cache[b, :, n + t], v_new[b, :, 0])
        elif t % 2:  # the public form, against append then select on the twin
            got = rows_as_sets(*index.select(q, append=k_new))
        else:  # the same with the new key in a key cache at each sequence's length
            for b, n in enumerate(index.lengths.tolist()):
                k_cache[b, :, n] = k_new[b, :, 0]
            got = rows_as_sets(*index.select(q, append=k_cache))
        assert t not in (0, steps) or ("_pq_encode_kernel" in names) == encodes, names  # recording calls
        twin.append(k_new)
        assert torch.equal(twin.lengths, index.lengths) and torch.equal(twin.codes, index.codes)
        for b, n in enumerate(lengths):
            assert torch.equal(index.codes[b, :, n + t], ref.encode(k_new, index.centroids, None)[b, :, 0])
        assert index.lengths.tolist() == [n + t + 1 for n in lengths]
        if t >= steps:
            assert got == rows_as_sets(*twin.select(q))
    assert index._max_length == N + 2 * steps


def _select_attend(index: PQIndex, k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor) -> None:
    sel = index.select(q)
    assert_index_selection(index, sel, q)
    out = index.attend(q, k_cache, v_cache, sel)
    assert_close(out, ref.sparse_decode(q, k_cache, v_cache, *sel), atol=1e-5, rtol=1e-5)


def test_plans_follow_the_buffers_they_write(kernel_routes, monkeypatch, device) -> None:
    """select / append / attend replay per input signature; a call of another head count
    replaces the selection buffers, and the plans that wrote the old ones go; a query that needs a
    copy (not contiguous in D) makes no plan; nor does a plan run once an attribute it bound (the
    centroids) holds another tensor. (On a GPU a first run warms Triton's caches; the interpreter
    has none to warm.)"""
    for warm in (False,) if interpreted() else (True, False):
        index, k_cache, v_cache, lengths = _step_setup(device, steps=4)
        replays = count_plan_replays(monkeypatch)

        D = k_cache.shape[-1]
        for H in (8, 8, 4, 8):
            _select_attend(index, k_cache, v_cache, torch.randn(2, H, D, device=device))
        assert warm or replays[0] == 2, "the second H=8 call replays select and attend; the last rebuilt"
        k_new = torch.randn(2, 2, 1, D, device=device)
        for _ in range(2):
            index.append(k_new)
        assert warm or replays[0] == 3
        assert index.lengths.tolist() == [n + 2 for n in lengths] and index._max_length == max(lengths) + 2
        for _ in range(2):
            _select_attend(index, k_cache, v_cache, torch.randn(2, 8, 2 * D, device=device)[..., ::2])
        assert not any(key[0] == "select" and key[1][0][1][-1] == 2 for key in index._plans)
        index.centroids = -index.centroids  # a new tensor: the plans that bound the old one must not run
        _select_attend(index, k_cache, v_cache, torch.randn(2, 8, D, device=device))


def test_an_index_keeps_a_bounded_number_of_plans(kernel_routes, monkeypatch, device) -> None:
    """A caller whose cache grows passes a new stride every step: each append makes a plan it never
    replays; the index keeps the most recently used ones, so the select plan used every step stays."""
    index, _, _, lengths = _step_setup(device, steps=20)
    replays = count_plan_replays(monkeypatch)
    q = torch.randn(2, 8, 64, device=device)
    replayed = []
    for t in range(20):
        cache = torch.randn(2, 2, 601 + t, 64, device=device)  # like a cache grown by concatenation
        index.append(cache[:, :, -1:])
        new_codes = ref.encode(cache[:, :, -1:], index.centroids, None)
        for b, n in enumerate(lengths):
            assert torch.equal(index.codes[b, :, n + t], new_codes[b, :, 0])
        before = replays[0]
        assert_index_selection(index, index.select(q), q)
        replayed.append(replays[0] - before)
    # (the first select may compile, the second records: from the third on every one replays)
    assert replayed[2:] == [1] * 18, "the select plan survived 20 appends of new signatures"
    assert index.lengths.tolist() == [n + 20 for n in lengths]
    assert len(index._plans) == _MAX_PLANS


@pytest.mark.parametrize("routes", ["kernels", "reference"])
@pytest.mark.parametrize("rule,rerank", [("sum", 0), ("max", 0), ("max", 3)])
def test_group_selection_decode_steps(
    rule: str, rerank: int, routes: str, request, monkeypatch, device
) -> None:
    """share="group": one selection per KV head (Hkv rows, heavy the group's budget) by the group
    score, and attention of each query head over its group's set; the steps replay their plan on
    the kernel routes. Checked against the reference's group scores and per-head attention over
    the repeated selection."""
    if routes == "kernels":
        request.getfixturevalue("kernel_routes")
    B, H, Hkv, N, D, steps = 2, 8, 2, 400, 32, 3
    config = pqattn.PQConfig(
        subvectors=4,
        bits=8,
        sink=4,
        window=8,
        heavy=40,
        iters=2,
        share="group",
        group_rule=rule,
        group_budget=1,
        sample=8,
        rerank=rerank,
    )
    lengths = [N, N - 90]
    keys = torch.randn(B, Hkv, N + steps, D, device=device)
    index = pqattn.PQIndex.build(keys[:, :, :N], lengths, capacity=N + steps, config=config)
    assert index._hist is None  # the group route keeps no combination counts
    k_cache = torch.zeros(B, Hkv, N + steps, D, device=device)
    v_cache = torch.randn_like(k_cache)
    for b, n in enumerate(lengths):
        k_cache[b, :, :n] = keys[b, :, :n]
    replays = count_plan_replays(monkeypatch)
    for t in range(steps):
        q = torch.randn(B, H, D, device=device)
        k_new, v_new = torch.randn(2, B, Hkv, 1, D, device=device)
        out = index.decode_step(q, k_new, v_new, k_cache, v_cache)
        sel = index.select(q, k_cache) if routes == "reference" else index._selection
        assert sel.positions.shape == (B, Hkv, 4 + 40 + 8)
        scores, slack = group_selection_scores(q, index.centroids, index.codes, rule)
        if rerank:  # the exact group scores decide within the shortlist (its own PQ ties aside)
            short = ref.select_from_scores(
                scores, index.lengths, sink=4, window=8, heavy=rerank * 40, init_offset=4, short_threshold=52
            )
            scores = ref.group_scores(ref.exact_scores(q.double(), k_cache.double()), Hkv, rule)
            # (outside the shortlist a score below every other one: finite, so the tolerance stays one)
            outside = ref.dense_weights(short, scores.shape[-1]) == 0
            scores, slack = scores.masked_fill(outside, float(scores.min()) - 1.0), 0.0
        want = ref.select_from_scores(scores, index.lengths, sink=4, window=8, heavy=40, init_offset=4)
        problem = selection_problem(
            *sel, scores, index.lengths, cand_lo=4, window=8, short_threshold=52, ref_sel=want, slack=slack
        )
        assert problem is None, f"step {t}: {problem}"
        g = H // Hkv
        expect = ref.sparse_decode(
            q.double(), k_cache.double(), v_cache.double(), sel.positions.repeat_interleave(g, 1),
            sel.counts.repeat_interleave(g, 1),
        )  # fmt: skip
        assert_close(out, expect, atol=1e-5, rtol=1e-5, what=f"step {t}")
    if routes == "kernels":  # (a first call that compiles is not recorded)
        assert replays[0] >= steps - 2, "the steps replay their plan"


@pytest.mark.parametrize("routes", ["reference", "kernels"])
def test_decode_steps_over_paged_caches(routes: str, device: torch.device, request) -> None:
    """decode_step with a block table (SPEC §8): the paged caches take each step's key and value at
    the sequence's length, and each step selects and attends as the contiguous cache's step does
    (the same codebook); a cache whose blocks cannot hold the capacity is refused."""
    if routes == "kernels":
        request.getfixturevalue("kernel_routes")
    B, H, Hkv, D, steps, P = 2, 8, 2, 64, 3, 16
    index, k_cache, v_cache, lengths = _step_setup(device, steps=steps)
    book = ops.PQCodebook(index.centroids, index.codes[:, :, : max(lengths)], None)
    paged = pqattn.PQIndex.from_codebook(book, lengths, capacity=index.capacity, config=index.config)
    blocks = -(-index.capacity // P)
    table = torch.randperm(B * blocks, device=device).view(B, blocks)  # blocks in any order
    k_paged = ref.to_pages(k_cache, table, B * blocks, P)
    v_paged = ref.to_pages(v_cache, table, B * blocks, P)
    for t in range(steps):
        q = torch.randn(B, H, D, device=device)
        k_new, v_new = (torch.randn(B, Hkv, 1, D, device=device) for _ in range(2))
        want = index.decode_step(q, k_new, v_new, k_cache, v_cache).clone()
        got = paged.decode_step(q, k_new, v_new, k_paged, v_paged, block_table=table).clone()
        assert torch.equal(paged.lengths, index.lengths)
        for b, n in enumerate(lengths):
            rows = ref.unpage(k_paged, table)[b, :, : n + t + 1]
            assert torch.equal(rows, k_cache[b, :, : n + t + 1])
        assert rows_as_sets(*paged.select(q)) == rows_as_sets(*index.select(q))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="block_table: expected blocks for the index's capacity"):
        paged.decode_step(q, k_new, v_new, k_paged, v_paged, block_table=table[:, :2])


@pytest.mark.parametrize("rerank", [0, 2])
def test_group_decode_steps_over_paged_caches(rerank: int, kernel_routes, device: torch.device) -> None:
    """The default policy's route over paged caches: the step's key encoded inside the selection
    (select(append=)), the same selection and output as the contiguous cache's step; a config that
    re-ranks is refused before anything is written (it reads contiguous keys)."""
    B, H, Hkv, N, D, steps, P = 2, 8, 2, 200, 32, 2, 16
    config = PQConfig(subvectors=4, sink=4, window=8, heavy=12, iters=2, rerank=rerank)
    keys = torch.randn(B, Hkv, N + steps, D, device=device)
    values = torch.randn_like(keys)
    lengths = [N, N - 40]
    index, paged = (PQIndex.build(keys[:, :, :N], lengths, capacity=N + steps, config=config) for _ in "ab")
    for name in ("centroids", "codes", "lengths"):
        getattr(paged, name).copy_(getattr(index, name))
    blocks = -(-(N + steps) // P)
    table = torch.randperm(B * blocks, device=device).view(B, blocks)
    k_paged = ref.to_pages(keys, table, B * blocks, P)
    v_paged = ref.to_pages(values, table, B * blocks, P)
    for _step in range(steps):
        q = torch.randn(B, H, D, device=device)
        k_new, v_new = (torch.randn(B, Hkv, 1, D, device=device) for _ in range(2))
        if rerank:
            before = k_paged.clone()
            with pytest.raises(ValueError, match="block_table: a config that re-ranks"):
                paged.decode_step(q, k_new, v_new, k_paged, v_paged, block_table=table)
            assert paged.lengths.tolist() == lengths
            torch.testing.assert_close(
                k_paged, before, rtol=0, atol=0, equal_nan=True
            )  # (NaN: unused blocks)
            return
        want = index.decode_step(q, k_new, v_new, keys, values).clone()
        got = paged.decode_step(q, k_new, v_new, k_paged, v_paged, block_table=table).clone()
        assert torch.equal(paged.lengths, index.lengths) and torch.equal(paged.codes, index.codes)
        assert torch.equal(ref.unpage(k_paged, table)[:, :, : N + steps], keys)
        assert rows_as_sets(*paged._selection) == rows_as_sets(*index._selection)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
