"""Token rows of a KV cache, contiguous [B, Hkv, N, D] or paged [num_blocks, P, Hkv, D] behind a
block table [B, max_blocks] (SPEC §8), for the kernels that gather rows (sparse decode, the
re-rank's exact scores). A paged cache's kernels take its strides as (block, head, token): the
same three slots as a contiguous cache's (sequence, head, token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def cache_strides(cache: torch.Tensor, block_table: torch.Tensor | None) -> tuple[int, int, int]:
    """(sequence or block, head, token) strides of a cache [B, Hkv, N, D] or, with a block table,
    of a paged one [num_blocks, P, Hkv, D]."""
    st = cache.stride()
    return (st[0], st[2], st[1]) if block_table is not None else st[:3]


@triton.jit
def cache_base(ptr, b, kvh, stride_b, stride_h, PAGE: tl.constexpr):
    """The rows' base of (sequence b, KV head kvh): in a paged cache (PAGE > 0, its tokens per
    block) every sequence's blocks share the cache, so only the head's offset."""
    return ptr + kvh * stride_h if PAGE else ptr + b.to(tl.int64) * stride_b + kvh * stride_h


@triton.jit
def token_offsets(at, ok, bt_row, stride_b, stride_n, PAGE: tl.constexpr):
    """int64 offsets of tokens `at` (logical positions, masked by ok) from a base of
    `cache_base`: at * the token stride, or block * the block stride + slot * the token stride
    through the sequence's block-table row."""
    if PAGE:
        block = tl.load(bt_row + at // PAGE, mask=ok, other=0).to(tl.int64)
        off = block * stride_b + (at % PAGE) * stride_n
    else:
        off = at * stride_n
    return off


@triton.jit
def kv_offsets(at, ok, bt_row, stride_kb, stride_kn, stride_vb, stride_vn, PAGE: tl.constexpr):
    """`token_offsets` of the keys and of the values, one block-table read for both."""
    if PAGE:
        block = tl.load(bt_row + at // PAGE, mask=ok, other=0).to(tl.int64)
        slot = at % PAGE
        ko = block * stride_kb + slot * stride_kn
        vo = block * stride_vb + slot * stride_vn
    else:
        ko = at * stride_kn
        vo = at * stride_vn
    return ko, vo
