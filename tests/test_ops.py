"""Public functional API: results equal the references, and every bad input is named."""

from __future__ import annotations

import fractions

import pytest
import torch

import pqattn
from pqattn import dispatch, ops
from pqattn import reference as ref
from tests.helpers import assert_close, assert_selection_exact, count_plan_replays


def _inputs(device: torch.device, B: int = 2, H: int = 8, Hkv: int = 2, N: int = 96, D: int = 16):
    keys = torch.randn(B, Hkv, N, D, device=device)
    return torch.randn(B, H, D, device=device), keys, torch.randn_like(keys)


def test_ops_pipeline_equals_reference(device: torch.device) -> None:
    q, k, v = _inputs(device)
    lengths = torch.tensor([96, 70], device=device)
    kw = dict(subvectors=2, bits=3, init_offset=4, iters=4, seed=5)
    book = pqattn.build_index(k, lengths, **kw)
    # CUDA builds with the Triton Lloyd loop (compared to the reference in tests/kernels/test_kmeans.py)
    build = ref.build_pq
    if device.type == "cuda":
        from pqattn.kernels.kmeans import build_pq as build
    want = build(k, lengths, **kw)
    assert torch.equal(book.centroids, want.centroids) and torch.equal(book.codes, want.codes)
    sel = pqattn.select_topk(
        q, book.centroids, book.codes, lengths, sink=4, window=8, heavy=12, init_offset=4
    )
    sel_ref = ref.select_pq(q, book.centroids, book.codes, lengths, sink=4, window=8, heavy=12, init_offset=4)
    assert torch.equal(sel.counts, sel_ref.counts)
    out = pqattn.sparse_decode(q, k, v, sel.positions, sel.counts)
    assert_close(out, ref.sparse_decode(q, k, v, *sel_ref), atol=2e-5, rtol=1e-5, what="sparse_decode")
    w = pqattn.selection_weights(sel, 96)
    assert torch.equal(w.sum(-1).int(), sel.counts)


def test_lengths_as_list_and_default(device: torch.device) -> None:
    _, k, _ = _inputs(device)
    a = pqattn.build_index(k, [96, 96], bits=2, iters=2)
    b = pqattn.build_index(k, None, bits=2, iters=2)
    assert torch.equal(a.codes, b.codes)


def _raises(exc: type[Exception], *needles: str):
    """pytest.raises that also checks the message names the argument and the expected/got values."""
    return pytest.raises(exc, match=".*".join(needles))


class TestValidation:
    def test_build_index(self) -> None:
        q, k, _ = _inputs(torch.device("cpu"))
        with _raises(TypeError, "keys", "torch.Tensor", "list"):
            pqattn.build_index([1, 2])
        with _raises(ValueError, "keys", r"\[B, Hkv, N, D\]", r"\[2, 8, 16\]"):
            pqattn.build_index(q)
        with _raises(TypeError, "keys", "dtype", "int64"):
            pqattn.build_index(k.long())
        with _raises(ValueError, "subvectors", "D=16", "M=3"):
            pqattn.build_index(k, subvectors=3)
        for bad in (0, 9):
            with _raises(ValueError, "bits", "1..8", str(bad)):
                pqattn.build_index(k, bits=bad)
        with _raises(TypeError, "bits"):
            pqattn.build_index(k, bits=2.0)
        with _raises(ValueError, "metric", "cosine"):
            pqattn.build_index(k, metric="cosine")
        with _raises(ValueError, "init_offset", "-1"):
            pqattn.build_index(k, init_offset=-1)
        with _raises(ValueError, "lengths", "<= 96", "97"):
            pqattn.build_index(k, [96, 97])
        with _raises(ValueError, "lengths", "non-negative", "-3"):
            pqattn.build_index(k, [-3, 5])
        with _raises(ValueError, "lengths", r"\[B\]", r"\[3\]"):
            pqattn.build_index(k, [1, 2, 3])
        with _raises(TypeError, "lengths", "dtype", "float32"):
            pqattn.build_index(k, torch.tensor([1.0, 2.0]))
        with _raises(ValueError, "keys", "at least one token", r"\[2, 2, 0, 16\]"):
            pqattn.build_index(k[:, :, :0])
        with _raises(ValueError, "keys", "with data", "meta"):
            pqattn.build_index(k.to("meta"))

    def test_select_topk(self) -> None:
        q, k, _ = _inputs(torch.device("cpu"))
        book = pqattn.build_index(k, bits=2, iters=1)
        lens = torch.tensor([96, 96])
        kw = dict(sink=2, window=2, heavy=4)
        with _raises(ValueError, "H=7", "Hkv=2"):
            pqattn.select_topk(torch.randn(2, 7, 16), book.centroids, book.codes, lens, **kw)
        with _raises(ValueError, "q / centroids", "D=8", "expected q with D = M x dsub = 16"):
            pqattn.select_topk(torch.randn(2, 8, 8), book.centroids, book.codes, lens, **kw)
        with _raises(ValueError, "q", r"\[B, H, D\]", r"\[3, 8, 16\]"):
            pqattn.select_topk(torch.randn(3, 8, 16), book.centroids, book.codes, lens, **kw)
        with _raises(TypeError, "codes", "uint8", "int64"):
            pqattn.select_topk(q, book.centroids, book.codes.long(), lens, **kw)
        with _raises(ValueError, "codes", r"\[B, Hkv, N, M\]"):
            pqattn.select_topk(q, book.centroids, book.codes[..., :1], lens, **kw)
        with _raises(ValueError, "centroids", "C = 2\\*\\*bits", "C=3"):
            pqattn.select_topk(q, book.centroids[..., :3, :], book.codes, lens, **kw)
        with _raises(ValueError, "heavy", "non-negative", "-1"):
            pqattn.select_topk(q, book.centroids, book.codes, lens, sink=2, window=2, heavy=-1)
        with _raises(ValueError, "window", "-4"):
            pqattn.select_topk(q, book.centroids, book.codes, lens, sink=2, window=-4, heavy=1)
        with _raises(ValueError, "lengths", r"\[B\]"):
            pqattn.select_topk(q, book.centroids, book.codes, lens[:1], **kw)
        with _raises(ValueError, "centroids", "dsub=8", "got 5"):
            pqattn.pq_scores(q, book.centroids[..., :5], book.codes)

    def test_scale(self) -> None:
        q, k, v = _inputs(torch.device("cpu"))
        pos = torch.zeros(2, 8, 5, dtype=torch.int32)
        cnt = torch.ones(2, 8, dtype=torch.int32)
        with _raises(TypeError, "scale", "finite float or None", "Tensor"):
            pqattn.sparse_decode(q, k, v, pos, cnt, scale=torch.tensor(0.25))
        with _raises(ValueError, "scale", "finite float or None", "nan"):
            pqattn.sparse_decode(q, k, v, pos, cnt, scale=float("nan"))
        with _raises(ValueError, "scale", "finite float or None", "-inf"):
            pqattn.dense_attention(q[:, :, None], k, v, scale=float("-inf"))
        a = pqattn.sparse_decode(q, k, v, pos, cnt, scale=fractions.Fraction(1, 4))  # any real number
        torch.testing.assert_close(a, pqattn.sparse_decode(q, k, v, pos, cnt, scale=0.25))

    def test_sparse_decode(self) -> None:
        q, k, v = _inputs(torch.device("cpu"))
        pos = torch.zeros(2, 8, 5, dtype=torch.int32)
        cnt = torch.ones(2, 8, dtype=torch.int32)
        with _raises(ValueError, "v", r"\[B, Hkv, N, D\]", r"\[2, 2, 95, 16\]"):
            pqattn.sparse_decode(q, k, v[:, :, :95], pos, cnt)
        with _raises(TypeError, "v", "dtype", "float16"):
            pqattn.sparse_decode(q, k, v.half(), pos, cnt)
        with _raises(ValueError, "positions", r"\[B, H, L\]", r"\[2, 7, 5\]"):
            pqattn.sparse_decode(q, k, v, pos[:, :7], cnt)
        with _raises(TypeError, "positions", "int32/int64", "float32"):
            pqattn.sparse_decode(q, k, v, pos.float(), cnt)
        with _raises(ValueError, "counts", r"\[B, H\]"):
            pqattn.sparse_decode(q, k, v, pos, cnt[:, :3])
        with _raises(ValueError, "weights", r"\[B, H, L\]"):
            pqattn.sparse_decode(q, k, v, pos, cnt, torch.ones(2, 8, 4))
        with _raises(ValueError, "q", r"\[B, H, D\]", r"\[2, 8, 8\]"):
            pqattn.sparse_decode(q[..., :8], k, v, pos, cnt)
        with _raises(ValueError, "H=5", "Hkv=2"):
            pqattn.sparse_decode(q[:, :5], k, v, pos[:, :5], cnt[:, :5])

    def test_dense_attention_and_encode(self) -> None:
        _, k, v = _inputs(torch.device("cpu"))
        with _raises(ValueError, "q", r"\[B, H, Sq, D\]"):
            pqattn.dense_attention(torch.randn(2, 8, 16), k, v)
        with _raises(ValueError, "H=3", "Hkv=2"):
            pqattn.dense_attention(torch.randn(2, 3, 4, 16), k, v)
        book = pqattn.build_index(k, bits=2, iters=1, metric="ip")
        with _raises(ValueError, "phi", "ip", "None"):
            pqattn.encode_keys(k, book.centroids, None, metric="ip")
        with _raises(ValueError, "centroids", r"\[2, 2, 2, \*, 8\]", r"got \[2, 2, 2, 4, 9\]"):
            pqattn.encode_keys(k, book.centroids, book.phi)  # euclidean wants dsub = 8 columns

    def test_streaming(self) -> None:
        with _raises(ValueError, "num_heads", "positive"):
            pqattn.select_streaming(torch.tensor([4]), 0, sink=1, window=1)
        with _raises(TypeError, "lengths", "int32/int64"):
            pqattn.select_streaming(torch.tensor([4.0]), 2, sink=1, window=1)

    def test_pages(self) -> None:
        q, k, _ = _inputs(torch.device("cpu"))
        lens = torch.tensor([96, 96])
        with _raises(ValueError, "page", "positive", "0"):
            pqattn.select_pages(q, k, lens, sink=1, window=1, heavy=4, page=0)
        with _raises(ValueError, "q", r"\[B, H, D\]", r"\[2, 8, 8\]"):
            pqattn.select_pages(q[..., :8], k, lens, sink=1, window=1, heavy=4)
        with _raises(ValueError, "heavy", "-2"):
            pqattn.select_pages(q, k, lens, sink=1, window=1, heavy=-2)
        sel = pqattn.select_pages(q, k, lens, sink=1, window=1, heavy=4)
        want = pqattn.reference.select_pages(q, k, lens, sink=1, window=1, heavy=4)
        assert torch.equal(sel.positions, want.positions) and torch.equal(sel.counts, want.counts)

    def test_empty_batch(self) -> None:
        q, k, v = _inputs(torch.device("cpu"), B=0)
        with _raises(ValueError, "keys", "B >= 1", r"\[0, 2, 96, 16\]"):
            pqattn.build_index(k)
        with _raises(ValueError, "keys", "B >= 1"):
            pqattn.PQIndex.build(k)
        with _raises(ValueError, "k", "B >= 1"):
            pqattn.sparse_decode(
                q, k, v, torch.zeros(0, 8, 4, dtype=torch.int32), torch.zeros(0, 8, dtype=torch.int32)
            )
        with _raises(ValueError, "keys", "B >= 1"):
            pqattn.select_oracle(q, k, torch.zeros(0, dtype=torch.int64), sink=1, window=1, heavy=2)

    def test_selection_values(self) -> None:
        q, k, v = _inputs(torch.device("cpu"))
        pos = torch.randint(0, 96, (2, 8, 5), dtype=torch.int32)
        cnt = torch.full((2, 8), 5, dtype=torch.int32)
        bad = pos.clone()
        bad[1, 3, 2] = 96
        with _raises(ValueError, "positions", r"\[0, 96\)", "got 96", r"\(1, 3, 2\)"):
            pqattn.sparse_decode(q, k, v, bad, cnt)
        bad[1, 3, 2] = -1
        with _raises(ValueError, "positions", "got -1"):
            pqattn.sparse_decode(q, k, v, bad, cnt)
        few = cnt.clone()
        few[1, 3] = 2  # entries past a row's count are never read: -1 padding there is fine
        want = ref.sparse_decode(q, k, v, bad, few)
        assert_close(pqattn.sparse_decode(q, k, v, bad, few), want, atol=0, rtol=0)
        for value in (6, -1):
            few[0, 0] = value
            with _raises(ValueError, "counts", r"\[0, 5\]", f"got {value}"):
                pqattn.sparse_decode(q, k, v, pos, few)
        book = pqattn.build_index(k, bits=2, iters=1)
        for lens in ([97, 5], [5, -2]):
            with _raises(ValueError, "lengths", r"\[0, 96\]", str(lens[0] if lens[0] > 96 else lens[1])):
                pqattn.select_topk(
                    q, book.centroids, book.codes, torch.tensor(lens), sink=1, window=1, heavy=2
                )

    def test_selection_values_on_the_kernel_route(self, kernel_routes, device: torch.device) -> None:
        """The device check flags the rows and the host check names the entry, on the public
        check and inside sparse_decode; padding past a count passes."""
        q, k, v = _inputs(device)
        pos = torch.randint(0, 96, (2, 8, 5), dtype=torch.int64, device=device)
        cnt = torch.full((2, 8), 5, dtype=torch.int64, device=device)
        pqattn.validate_selection(pos, cnt, 96)
        bad = pos.clone()
        bad[1, 3, 2] = 96
        with _raises(ValueError, "positions", r"\[0, 96\)", "got 96", r"\(1, 3, 2\)"):
            pqattn.validate_selection(bad, cnt, 96)
        with _raises(ValueError, "positions", "got 96"):
            pqattn.sparse_decode(q, k, v, bad, cnt)
        few = cnt.clone()
        few[1, 3] = 2
        pqattn.validate_selection(bad, few, 96)
        few[0, 0] = 6
        with _raises(ValueError, "counts", r"\[0, 5\]", "got 6"):
            pqattn.validate_selection(pos, few, 96)
        with _raises(ValueError, "counts", r"\[B, R\]"):
            pqattn.validate_selection(pos, cnt[:1], 96)

    def test_dtypes_of_q_and_the_cache(self) -> None:
        """sparse_decode: q in any floating dtype, k and v of one; dense_attention: one dtype for all."""
        q, k, v = _inputs(torch.device("cpu"))
        pos = torch.randint(0, 96, (2, 8, 5), dtype=torch.int32)
        cnt = torch.full((2, 8), 5, dtype=torch.int32)
        mixed = pqattn.sparse_decode(q.double(), k, v, pos, cnt)
        assert mixed.dtype == torch.float64
        assert_close(
            mixed, ref.sparse_decode(q.double(), k.double(), v.double(), pos, cnt), atol=1e-5, rtol=1e-5
        )
        with _raises(TypeError, "v", "dtype", "float64"):
            pqattn.sparse_decode(q, k, v.double(), pos, cnt)
        with _raises(TypeError, "q", "k's dtype torch.float32", "float64"):
            pqattn.dense_attention(q[:, :, None].double(), k, v)

    def test_index_select_names_the_query(self) -> None:
        _, k, _ = _inputs(torch.device("cpu"))
        index = pqattn.PQIndex.build(
            k, config=pqattn.PQConfig(subvectors=2, bits=2, sink=2, window=2, heavy=4, iters=1, share="head")
        )
        with _raises(ValueError, "q", r"\[B, H, D\]", r"\[2, \*, 16\]", r"\[2, 8, 8\]"):
            index.select(torch.randn(2, 8, 8))

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
    def test_device_mismatch(self) -> None:
        q, k, v = _inputs(torch.device("cpu"))
        pos = torch.zeros(2, 8, 5, dtype=torch.int32)
        cnt = torch.ones(2, 8, dtype=torch.int32)
        with _raises(ValueError, "q", "device", "cuda", "cpu"):
            pqattn.sparse_decode(q, k.cuda(), v.cuda(), pos.cuda(), cnt.cuda())


def test_functional_calls_with_their_buffers_replay_a_plan(kernel_routes, monkeypatch, device) -> None:
    """select_topk and sparse_decode given out and workspace: the second call with tensors of the
    same signature replays the first one's launches on the new tensors; another signature (a wrong
    shape among them) takes the checks again."""
    B, H, Hkv, N, D, M, C = 2, 4, 2, 200, 32, 2, 8
    sink, window, heavy = 4, 8, 16
    L = sink + heavy + window
    book = pqattn.build_index(torch.randn(B, Hkv, N, D, device=device), subvectors=M, bits=3, iters=1)
    lengths = torch.tensor([N, N - 60], device=device)
    k, v = torch.randn(B, Hkv, N, D, device=device), torch.randn(B, Hkv, N, D, device=device)
    sel = pqattn.Selection(
        torch.empty(B, H, L, dtype=torch.int32, device=device),
        torch.empty(B, H, dtype=torch.int32, device=device),
    )
    ws = torch.zeros(ops.select_workspace_numel(B * H, M, C, N, heavy), dtype=torch.int32, device=device)
    out = torch.empty(B, H, D, device=device)
    attn_ws = torch.zeros(ops.decode_workspace_numel(B * H, L, D), dtype=torch.int32, device=device)
    replays = count_plan_replays(monkeypatch)
    for step in range(3):
        before = replays[0]
        q = torch.randn(B, H, D, device=device)
        got = pqattn.select_topk(
            q,
            book.centroids,
            book.codes,
            lengths,
            sink=sink,
            window=window,
            heavy=heavy,
            out=sel,
            workspace=ws,
        )
        assert got is sel
        assert_selection_exact(
            *sel,
            None,
            q,
            book.centroids,
            book.codes,
            lengths,
            sink=sink,
            window=window,
            heavy=heavy,
            cand_lo=sink,
            short_threshold=L,
        )
        res = pqattn.sparse_decode(q, k, v, *sel, out=out, workspace=attn_ws)
        assert res is out
        assert_close(out, ref.sparse_decode(q, k, v, *sel), atol=1e-5, rtol=1e-5)
        if step == 2:  # (the first call may compile: only a later one is sure to record)
            assert replays[0] == before + 2, "select_topk and sparse_decode replay"
    with pytest.raises(ValueError, match="out"):
        pqattn.sparse_decode(q, k, v, *sel, out=out[:, :2], workspace=attn_ws)


def test_build_on_a_sample(device):
    """sample=S: k-means on S * C strided keys per sequence, then every key encoded; a sequence
    with no more keys than that builds on all of them, as without sampling."""
    B, Hkv, N, D, bits, off = 2, 2, 600, 16, 3, 5
    keys = torch.randn(B, Hkv, N, D, device=device)
    lengths = torch.tensor([600, 150], device=device)
    book = ops.build_index(keys, lengths, subvectors=4, bits=bits, init_offset=off, iters=3, sample=4)
    points, counts = dispatch.sampled_keys(keys, lengths, off, 4 * 2**bits)
    assert counts.tolist() == [32, 32]
    assert torch.equal(points[0, :, 1], keys[0, :, off + (1 * 595) // 32])
    assert torch.equal(points[1, :, 31], keys[1, :, off + (31 * 145) // 32])
    want = ref.build_pq(points.double(), counts, subvectors=4, bits=bits, iters=3)
    torch.testing.assert_close(book.centroids.double(), want.centroids, atol=1e-4, rtol=1e-4)
    codes = ref.encode(keys[:, :, off:].double(), want.centroids)
    valid = torch.arange(off, N, device=device)[None, :] < lengths[:, None]
    agree = (book.codes[:, :, off:] == codes).all(-1)[:, :, :][valid[:, None].expand(B, Hkv, -1)]
    assert agree.float().mean() > 0.99  # (float32 ties of near-equidistant centroids aside)
    assert not book.codes[1, :, 150:].any() and not book.codes[:, :, :off].any()
    full = ops.build_index(keys, lengths, subvectors=4, bits=bits, init_offset=off, iters=3)
    small = ops.build_index(keys, lengths, subvectors=4, bits=bits, init_offset=off, iters=3, sample=100)
    assert torch.equal(small.codes, full.codes) and torch.equal(small.centroids, full.centroids)
    with pytest.raises(ValueError, match="sample"):
        ops.build_index(keys, subvectors=4, bits=bits, metric="ip", sample=4)


def test_a_share_of_the_kv_heads_indexes_as_the_whole_cache(device):
    """head_offset / total_heads (a tensor-parallel rank's KV heads): the share's index equals
    those heads of the whole cache's index, on a sample too; bad shares are refused."""
    keys = torch.randn(2, 4, 300, 16, device=device)
    lengths = torch.tensor([300, 220], device=device)
    for sample in (0, 4):
        kw = dict(subvectors=2, bits=3, init_offset=2, iters=3, sample=sample)
        whole = ops.build_index(keys, lengths, **kw)
        share = ops.build_index(keys[:, 2:].contiguous(), lengths, **kw, head_offset=2, total_heads=4)
        torch.testing.assert_close(share.centroids, whole.centroids[:, 2:], atol=1e-5, rtol=1e-5)
        assert (share.codes == whole.codes[:, 2:]).float().mean() > 0.99  # (float32 near-ties aside)
    with _raises(ValueError, "total_heads", "None"):
        ops.build_index(keys, head_offset=1)
    with _raises(ValueError, "head_offset", "total_heads=4", "1 \\+ 4"):
        ops.build_index(keys, head_offset=1, total_heads=4)
