"""Value checks of selection lists on the device (SPEC §3's input rules).

A validating eager call must read a list's values on the host. Copying the lists there costs
their bytes and a host loop; this launch flags each row whose count lies outside [0, L] or whose
first `count` positions leave [0, N), so that the host reads one byte per row. The reference is
`pqattn._validate.selection_values`, which also names the first bad entry.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pqattn.runtime.launch import Launcher

BLOCK = 1024  # list entries a step of a row's program reads


@triton.jit
def _bad_rows_kernel(
    pos_ptr,
    cnt_ptr,
    bad_ptr,
    stride_pb,
    stride_pr,
    stride_pl,
    stride_cb,
    stride_cr,
    R,
    L,
    n_tokens,
    BLOCK_: tl.constexpr,
):
    """Program row = b * R + r: bad[row] = 1 when counts[b, r] is outside [0, L] or one of the
    row's first counts[b, r] positions is outside [0, n_tokens), else 0."""
    row = tl.program_id(0)
    b = row // R
    r = row % R
    cnt = tl.load(cnt_ptr + b.to(tl.int64) * stride_cb + r * stride_cr).to(tl.int64)
    bad = ((cnt < 0) | (cnt > L)).to(tl.int32)
    live_n = tl.minimum(tl.maximum(cnt, 0), L).to(tl.int32)
    pos_row = pos_ptr + b.to(tl.int64) * stride_pb + r * stride_pr
    for start in range(0, live_n, BLOCK_):
        i = start + tl.arange(0, BLOCK_)
        live = i < live_n
        p = tl.load(pos_row + i.to(tl.int64) * stride_pl, mask=live, other=0).to(tl.int64)
        bad = tl.maximum(bad, tl.max((live & ((p < 0) | (p >= n_tokens))).to(tl.int32), axis=0))
    tl.store(bad_ptr + row, bad.to(tl.int8))


_bad_rows_launch = Launcher(_bad_rows_kernel)


def bad_rows(positions: torch.Tensor, counts: torch.Tensor, n_tokens: int, *, out: torch.Tensor) -> None:
    """out [B * R] int8: 1 for each row of positions [B, R, L] / counts [B, R] (int32 or int64,
    one device) that breaks the list rules over n_tokens, else 0."""
    B, R, L = positions.shape
    _bad_rows_launch(
        (B * R,),
        (positions, counts, out),
        (*positions.stride(), *counts.stride(), R, L, n_tokens),
        dict(BLOCK_=BLOCK, num_warps=4),
    )
