"""One builder of selection cases for the three selection kernels' tests (tree, hist, buckets), and
a toy launch of the fine route for tests of its launches and arguments."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pqattn.reference import SelectParams
from tests.helpers import assert_selection_exact


@dataclass
class SelectionCase:
    """Random query, centroids and codes of a shape, the selection's params, and output buffers."""

    q: torch.Tensor  # [B, H, D]
    centroids: torch.Tensor  # [B, Hkv, M, C, D // M]
    codes: torch.Tensor  # [B, Hkv, N, M] uint8
    lengths: torch.Tensor  # [B]
    params: SelectParams
    positions: torch.Tensor  # [B, H, width]
    counts: torch.Tensor  # [B, H]
    weights: torch.Tensor | None  # [B, H, N] dense weights, or None

    @classmethod
    def draw(
        cls,
        device: torch.device,
        *,
        B: int,
        H: int,
        Hkv: int,
        N: int,
        D: int,
        M: int,
        bits: int,
        lengths: list[int],
        sink: int,
        window: int,
        heavy: int,
        init_offset: int,
        q_dtype: torch.dtype = torch.float32,
        weights_dtype: torch.dtype | None = None,
        index_dtype: torch.dtype = torch.int32,
        centroids: torch.Tensor | None = None,
        round_centroids: bool = False,
        equal_centroids: bool = False,
    ) -> SelectionCase:
        """A case under the native rules (short_threshold = sink + heavy + window, cand_lo =
        max(init_offset, sink)). round_centroids: few distinct scores (ties at the cut);
        equal_centroids: one score (every combination ties)."""
        C = 2**bits
        cent = torch.randn(B, Hkv, M, C, D // M, device=device) if centroids is None else centroids.to(device)
        if round_centroids:
            cent = cent.round()
        if equal_centroids:
            cent = cent[:, :, :, :1].expand_as(cent).contiguous()
        params = SelectParams.make(
            sink=sink,
            window=window,
            heavy=heavy,
            cand_lo=max(init_offset, sink),
            short_threshold=sink + heavy + window,
            n_tokens=N,
        )
        return cls(
            q=torch.randn(B, H, D, device=device).to(q_dtype),
            centroids=cent,
            codes=torch.randint(0, C, (B, Hkv, N, M), device=device, dtype=torch.uint8),
            lengths=torch.tensor(lengths, device=device),
            params=params,
            positions=torch.empty(B, H, params.width, dtype=index_dtype, device=device),
            counts=torch.empty(B, H, dtype=index_dtype, device=device),
            weights=None
            if weights_dtype is None
            else torch.empty(B, H, N, dtype=weights_dtype, device=device),
        )

    @property
    def C(self) -> int:
        return self.centroids.shape[3]

    def outputs(self) -> dict:
        """The output buffers, poisoned for a new call, as the launchers' keywords."""
        weights = None if self.weights is None else self.weights.fill_(float("nan"))
        return dict(positions=self.positions.fill_(-7), counts=self.counts.fill_(-7), weights=weights)

    def check(self) -> None:
        """The kernel's outputs obey SPEC §2 against the float64 reference for the case's query."""
        p = self.params
        assert_selection_exact(
            self.positions,
            self.counts,
            self.weights,
            self.q,
            self.centroids,
            self.codes,
            self.lengths,
            sink=p.sink,
            window=p.window,
            heavy=p.heavy,
            cand_lo=p.cand_lo,
            short_threshold=p.short_threshold,
        )


def launch_fine_on_toy_inputs(
    share: str, group_rule: str, tables: int, *, H: int = 4, Hkv: int = 2, append: bool = False
) -> None:
    """`fine.pq_select_fine` on random CPU inputs (B=1, N=256, M=4, C=16, D=32); with `append`
    a new key for the LUT launch to encode."""
    from pqattn.kernels.select import AppendedKey, fine

    B, N, M, C = 1, 256, 4, 16
    R = Hkv if share == "group" else H
    params = SelectParams.make(sink=2, window=2, heavy=8, cand_lo=2, short_threshold=12, n_tokens=N)
    appended = AppendedKey(torch.randn(B, Hkv, 1, 32), None, torch.zeros(B, dtype=torch.int32), None)
    fine.pq_select_fine(
        torch.randn(B, H, 32),
        torch.randn(B, Hkv, M, C, 8),
        torch.zeros(B, Hkv, N, M, dtype=torch.uint8),
        torch.full((B,), N - append, dtype=torch.int64),
        params,
        positions=torch.empty(B, R, params.width, dtype=torch.int32),
        counts=torch.empty(B, R, dtype=torch.int32),
        workspace=torch.zeros(fine.workspace_numel(B * R, max(tables, 1), M, C, N), dtype=torch.int32),
        share=share,
        group_rule=group_rule,
        tables=tables,
        appended=appended if append else None,
    )
