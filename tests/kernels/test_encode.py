"""The encode launch's decode-step duties: new keys and values into the KV cache at each
sequence's length, and the lengths advanced in the same launch (CPU interpreter; GPU)."""

from __future__ import annotations

import pytest
import torch

from pqattn import reference as ref
from pqattn.kernels.encode import pq_encode
from pqattn.runtime.launch import interpreted


def _to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 as the kernel's cast rounds: to nearest even compiled (as torch), by
    truncation under Triton's interpreter."""
    if interpreted():
        return (x.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("metric", ["euclidean", "ip"])
@pytest.mark.parametrize("T", [1, 3])
def test_encode_stores_the_rows_and_advances_the_lengths(T: int, metric: str, device: torch.device) -> None:
    """Ragged lengths, keys as a strided view (not contiguous in D), float32 keys into a bf16
    cache: the codes, the cache rows (cast) and nothing else, lengths + T, the
    arrival counters back at zero, three appends in a row."""
    B, Hkv, N, D, M, C = 2, 3, 40, 32, 4, 8
    dsub = D // M + (metric == "ip")
    cent = torch.randn(B, Hkv, M, C, dsub, device=device)
    phi = torch.rand(B, Hkv, M, device=device) * 50 if metric == "ip" else None
    codes = torch.zeros(B, Hkv, N, M, dtype=torch.uint8, device=device)
    k_cache = torch.full((B, Hkv, N, D), float("nan"), dtype=torch.bfloat16, device=device)
    v_cache = torch.full((B, Hkv, N, D), float("nan"), dtype=torch.float32, device=device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    lengths = torch.tensor([11, 0], device=device)
    arrivals = torch.zeros(B, dtype=torch.int32, device=device)
    for _ in range(3):
        keys = torch.randn(B, Hkv, D, T, device=device).transpose(2, 3)  # stride 1 on T, not D
        values = torch.randn(B, Hkv, T, D, device=device)
        before = lengths.clone()
        pq_encode(keys, cent, phi, codes, base=lengths, kv_cache=(k_cache, v_cache, values), advance=arrivals)
        want_codes = ref.encode(keys, cent, phi, metric)
        for b, n in enumerate(before.tolist()):
            assert torch.equal(codes[b, :, n : n + T], want_codes[b])
            want_k[b, :, n : n + T] = _to_bf16(keys[b])
            want_v[b, :, n : n + T] = values[b]
        assert torch.equal(lengths, before + T)
        assert torch.equal(arrivals, torch.zeros_like(arrivals))
        assert torch.equal(k_cache.isnan(), want_k.isnan()) and torch.equal(v_cache.isnan(), want_v.isnan())
        assert torch.equal(k_cache.nan_to_num(), want_k.nan_to_num())
        assert torch.equal(v_cache.nan_to_num(), want_v.nan_to_num())


def test_the_cache_and_the_advance_need_a_base(device: torch.device) -> None:
    cent = torch.randn(1, 1, 2, 4, 8, device=device)
    keys = torch.randn(1, 1, 1, 16, device=device)
    codes = torch.zeros(1, 1, 4, 2, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="base"):
        pq_encode(keys, cent, None, codes, advance=torch.zeros(1, dtype=torch.int32, device=device))


def test_rewrites_keep_the_histogram(device: torch.device) -> None:
    """Rows written over the last n_drop rows (row0 = -n_drop: the original's entry point re-sends
    its last rows): int64 codes in a [B, rows, Hkv, M] buffer seen transposed, the candidate
    histogram equal to a recount after every write (ends moving forward and back, T past the
    window, T = 0), the lengths set to lengths - n_drop + T in the launch and nothing else
    written."""
    B, Hkv, N, D, M, C, window, cand_lo = 2, 3, 64, 16, 2, 4, 4, 6
    cent = torch.randn(B, Hkv, M, C, D // M, device=device)
    buf = torch.full((B, N, Hkv, M), -5, dtype=torch.int64, device=device)
    codes = buf.transpose(1, 2)  # [B, Hkv, N, M]
    hist = torch.zeros(B, Hkv, C**M, dtype=torch.int32, device=device)
    lengths = torch.zeros(B, dtype=torch.int64, device=device)
    arrivals = torch.zeros(B, dtype=torch.int32, device=device)
    n = 0
    for T, n_drop in ((20, 0), (1, 0), (1, 1), (0, 3), (5, 2), (window + 3, window), (2, window), (1, 1)):
        keys = torch.randn(B, Hkv, T, D, device=device)
        before = buf.clone()
        pq_encode(
            keys,
            cent,
            None,
            codes,
            base=lengths,
            hist=hist,
            window=window,
            cand_lo=cand_lo,
            advance=arrivals,
            row0=-n_drop,
            n_drop=n_drop,
        )
        row0, n = n - n_drop, n - n_drop + T
        want = before.transpose(1, 2).clone()
        if T:
            want[:, :, row0:n] = ref.encode(keys, cent, None, "euclidean").long()
        assert torch.equal(codes, want), (T, n_drop)
        assert torch.equal(lengths, torch.full_like(lengths, n)) and not arrivals.any()
        _, starts = ref.bucket_candidates(
            codes[:, :, :n].clamp(min=0), lengths, C=C, window=window, cand_lo=cand_lo
        )
        assert torch.equal(hist.long(), starts.diff(dim=-1)), (T, n_drop)
    with pytest.raises(ValueError, match="n_drop"):
        pq_encode(keys, cent, None, codes, base=lengths, hist=hist, window=window, n_drop=window + 1)


def test_encode_reads_the_key_at_each_length_of_a_cache(device: torch.device) -> None:
    """key_at_base: one key per sequence, row base[b] of a key cache (written there first, NaN
    elsewhere): the codes of those rows, the lengths advanced by one."""
    B, Hkv, N, D, M, C = 2, 3, 40, 32, 4, 8
    cent = torch.randn(B, Hkv, M, C, D // M, device=device)
    codes = torch.zeros(B, Hkv, N, M, dtype=torch.uint8, device=device)
    lengths = torch.tensor([11, 0], device=device)
    arrivals = torch.zeros(B, dtype=torch.int32, device=device)
    key_cache = torch.full((B, Hkv, N, D), float("nan"), device=device)
    new = torch.randn(B, Hkv, 1, D, device=device)
    for b, n in enumerate(lengths.tolist()):
        key_cache[b, :, n] = new[b, :, 0]
    pq_encode(key_cache, cent, None, codes, base=lengths, advance=arrivals, key_at_base=True)
    want = ref.encode(new, cent, None)
    assert torch.equal(codes[0, :, 11], want[0, :, 0]) and torch.equal(codes[1, :, 0], want[1, :, 0])
    assert lengths.tolist() == [12, 1] and not arrivals.any()
    with pytest.raises(ValueError, match="key_at_base"):
        pq_encode(key_cache, cent, None, codes, key_at_base=True)
