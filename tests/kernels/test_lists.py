"""The device check of selection lists against its reference (CPU interpreter; GPU)."""

from __future__ import annotations

import pytest
import torch

from pqattn import reference as ref
from pqattn.kernels.lists import BLOCK, bad_rows


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("L", [7, BLOCK + 5])
def test_bad_rows_flag_what_the_reference_flags(L: int, dtype: torch.dtype, device: torch.device) -> None:
    """Random lists with a bad count, a bad position inside a count (negative, at N, far past it)
    and bad positions past a count (never read: not flagged); positions as a strided view; lists
    longer than a program's step."""
    B, R, N = 3, 5, 1000
    pos = torch.randint(0, N, (B, L, R), dtype=dtype, device=device).transpose(1, 2)  # stride 1 on R
    cnt = torch.randint(0, L + 1, (B, R), dtype=dtype, device=device)
    cnt[0, 0], cnt[0, 1], cnt[0, 2] = L + 1, -1, 0
    cnt[1, :] = L
    pos[1, 0, L - 1] = N
    pos[1, 1, 0] = -1
    pos[1, 2, L // 2] = 1 << 30
    cnt[2, 0] = L // 2
    pos[2, 0, L // 2 :] = -1  # padding past the count
    want = ref.bad_selection_rows(pos, cnt, N)
    assert want.any() and not want.all()
    got = torch.full((B * R,), 7, dtype=torch.int8, device=device)
    bad_rows(pos, cnt, N, out=got)
    assert torch.equal(got.bool(), want), (got, want)
    assert set(got.tolist()) <= {0, 1}
