"""Reference sparse decode and dense attention vs loops in float64 and vs torch SDPA."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pqattn import reference as ref
from tests.helpers import assert_close

# (dtype, atol, rtol) for outputs computed from inputs of that dtype against a float64 loop.
TOLERANCES = [
    pytest.param(torch.float64, 1e-10, 1e-10, id="fp64"),
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 2e-2, 2e-2, id="bf16"),
    pytest.param(torch.float16, 3e-3, 3e-3, id="fp16"),
]


def loop_sparse(q, k, v, positions, counts, weights, scale):
    B, H, D = q.shape
    g = H // k.shape[1]
    out = torch.zeros(B, H, D, dtype=torch.float64)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            c = int(counts[b, h])
            if c == 0:
                continue
            idx = positions[b, h, :c].long()
            kk, vv = k[b, h // g, idx].double(), v[b, h // g, idx].double()
            a = scale * (kk @ q[b, h].double())
            if weights is not None:
                a = a + weights[b, h, :c].double().log()
            p = torch.softmax(a, 0)
            out[b, h] = p @ vv
            lse[b, h] = torch.logsumexp(a, 0)
    return out, lse


@pytest.mark.parametrize(("dtype", "atol", "rtol"), TOLERANCES)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_sparse_decode_matches_loop(dtype: torch.dtype, atol: float, rtol: float, weighted: bool) -> None:
    B, H, Hkv, N, D, L = 2, 6, 3, 57, 16, 11
    q = torch.randn(B, H, D, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, N, D, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, N, D, dtype=torch.float64).to(dtype)
    positions = torch.stack([torch.randperm(N)[:L] for _ in range(B * H)]).reshape(B, H, L).int()
    counts = torch.randint(0, L + 1, (B, H)).int()
    counts[0, 0] = 0
    counts[1, 1] = L
    positions = torch.where(torch.arange(L) < counts[..., None], positions, -1)
    weights = torch.rand(B, H, L, dtype=torch.float64).to(dtype) + 0.1 if weighted else None
    out, lse = ref.sparse_decode(q, k, v, positions, counts, weights, scale=0.3, return_lse=True)
    want, want_lse = loop_sparse(q, k, v, positions, counts, weights, 0.3)
    assert out.dtype == dtype and out.shape == (B, H, D)
    assert_close(out, want, atol=atol, rtol=rtol, what="out")
    assert_close(lse, want_lse, atol=atol, rtol=rtol, what="lse")
    assert (out[0, 0] == 0).all() and lse[0, 0] == float("-inf"), "empty selection must give a zero row"


def test_sparse_decode_default_scale_and_all_tokens_equals_dense() -> None:
    B, H, Hkv, N, D = 2, 4, 2, 40, 32
    q = torch.randn(B, H, D, dtype=torch.float64)
    k = torch.randn(B, Hkv, N, D, dtype=torch.float64)
    v = torch.randn(B, Hkv, N, D, dtype=torch.float64)
    positions = torch.arange(N).expand(B, H, N).flip(-1).int()  # order carries no meaning
    counts = torch.full((B, H), N, dtype=torch.int32)
    out = ref.sparse_decode(q, k, v, positions, counts)
    dense = ref.dense_attention(q[:, :, None], k, v)[:, :, 0]
    assert_close(out, dense, atol=1e-12, rtol=1e-12, what="sparse(all) vs dense")


def test_weights_act_as_log_bias() -> None:
    q = torch.randn(1, 1, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    v = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    pos = torch.arange(5).view(1, 1, 5).int()
    cnt = torch.tensor([[5]], dtype=torch.int32)
    w = torch.tensor([[[1.0, 2.0, 0.5, 1.0, 3.0]]], dtype=torch.float64)
    out = ref.sparse_decode(q, k, v, pos, cnt, w)
    a = (k[0, 0] @ q[0, 0]) / math.sqrt(8)
    p = w[0, 0] * a.exp() / (w[0, 0] * a.exp()).sum()
    assert_close(out[0, 0], p @ v[0, 0], atol=1e-12, rtol=1e-12, what="weighted")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("Sq", "Sk"), [(17, 17), (5, 23), (1, 31)], ids=["Sq=Sk", "Sq<Sk", "decode"])
@pytest.mark.parametrize(("H", "Hkv"), [(4, 4), (6, 2)], ids=["mha", "gqa3"])
def test_dense_attention_matches_sdpa(causal: bool, Sq: int, Sk: int, H: int, Hkv: int) -> None:
    B, D = 2, 16
    q = torch.randn(B, H, Sq, D, dtype=torch.float64)
    k = torch.randn(B, Hkv, Sk, D, dtype=torch.float64)
    v = torch.randn(B, Hkv, Sk, D, dtype=torch.float64)
    out, lse = ref.dense_attention(q, k, v, causal=causal, return_lse=True)
    kk, vv = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    mask = None
    if causal:
        mask = torch.ones(Sq, Sk, dtype=torch.bool).tril(diagonal=Sk - Sq)
    want = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    assert_close(out, want, atol=1e-12, rtol=1e-12, what="out")
    logits = (q @ kk.transpose(-1, -2)) / math.sqrt(D)
    if causal:
        logits = logits.masked_fill(~mask, float("-inf"))
    assert_close(lse, torch.logsumexp(logits, -1), atol=1e-12, rtol=1e-12, what="lse")


def test_dense_causal_rows_without_keys_are_zero() -> None:
    q = torch.randn(1, 1, 6, 4, dtype=torch.float64)
    k = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    out = ref.dense_attention(q, k, k, causal=True)
    assert (out[0, 0, :3] == 0).all() and torch.isfinite(out).all()
    assert (out[0, 0, 3:] != 0).any()


def test_to_pages_is_the_inverse_of_unpage() -> None:
    """A cache laid out in shuffled pages reads back through the block table; the slots past N and
    the blocks no sequence uses hold NaN; too few blocks are refused."""
    B, Hkv, N, D, page = 2, 3, 37, 4, 8
    cache = torch.randn(B, Hkv, N, D)
    table = torch.randperm(B * 5 + 2)[: B * 5].reshape(B, 5).to(torch.int32)
    paged = ref.to_pages(cache, table, B * 5 + 2, page)
    back = ref.unpage(paged, table)
    assert torch.equal(back[:, :, :N], cache) and back[:, :, N:].isnan().all()
    unused = sorted(set(range(B * 5 + 2)) - set(table.reshape(-1).tolist()))
    assert paged[unused].isnan().all()
    with pytest.raises(ValueError, match="block_table"):
        ref.to_pages(cache, table[:, :4], B * 5 + 2, page)
