"""The original's entry point (SPEC §5): `indexer_next` with its signature, layouts and rules.

A sparse-attention-hub PQCache user swaps this function in for the original's: same arguments,
same outputs (sparse_list int64 [B, H, L] as sink, heavy, window positions; sparse_len int64;
dense weight_list; the codebook with the keys since the last call appended), the original's
short-sequence rule n <= heavy + init_offset + 1 + C. On CUDA tensors it is one encode launch
and one selection launch, with no host sync.

The returned codebook shares storage with a buffer that has room for later keys: passing it back
on the next call appends in place instead of copying the whole codebook (the rows the caller
already holds never change). Passing some other tensor costs one copy into a new buffer.
"""

from __future__ import annotations

import torch

from pqattn import _validate as check
from pqattn import ops
from pqattn import reference as ref
from pqattn.reference import Selection

_GROWTH = 1024  # codebook rows reserved past the current length when a new buffer is made


_WORKSPACES: dict[torch.device, tuple[tuple[int, ...], torch.Tensor]] = {}


def _workspace(device: torch.device, rows: int, M: int, C: int, N: int, heavy: int) -> torch.Tensor:
    """The selection kernel's zero-filled workspace, kept per device across calls: the original's
    signature has no place for it. The kernel leaves it ready for a call of the same layout; the
    places of its counters depend on the tree over N (a decode loop grows N by one per call), so a
    call of another layout gets a fresh one (once per leaf boundary: every few thousand steps).
    Calls on one device share it, so they must not run concurrently on different streams."""
    from pqattn.kernels.select import k_pad, max_tree_nodes

    layout = (rows, M, C, max_tree_nodes(N, heavy), k_pad(heavy, N))
    cached = _WORKSPACES.get(device)
    if cached is None or cached[0] != layout:
        numel = ops.select_workspace_numel(rows, M, C, N, heavy)
        cached = (layout, torch.zeros(numel, dtype=torch.int32, device=device))
        _WORKSPACES[device] = cached
    return cached[1]


def _grown_codebook(codebook: torch.Tensor, rows: int) -> torch.Tensor:
    """A [B, rows, Hkv, M] int64 view whose first rows are `codebook`, in place when it has room."""
    B, n, Hkv, M = codebook.shape
    row = Hkv * M
    cap = codebook.stride(0) // row if row else 0
    in_place = (
        codebook.stride()[1:] == (row, M, 1)
        and codebook.storage_offset() == 0
        and cap >= rows
        and codebook.untyped_storage().nbytes() >= ((B - 1) * cap + rows) * row * 8
    )
    if in_place:
        return codebook.as_strided((B, rows, Hkv, M), codebook.stride())
    cap = rows + _GROWTH
    buf = torch.empty(B, cap, Hkv, M, dtype=torch.int64, device=codebook.device)
    buf[:, :n].copy_(codebook)
    return buf[:, :rows]


def indexer_next(
    query: torch.Tensor,
    key: torch.Tensor,
    weight_list_dtype: torch.dtype,
    sink_size: int,
    window_size: int,
    heavy_size: int,
    pq_group_factor: int,
    pq_bits: int,
    kmeans_iter: int,
    init_offset: int,
    metric: str,
    pq_centroids: torch.Tensor,
    pq_codebook: torch.Tensor,
    pq_ip2l2_phi: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """PQ top-k selection for the last query token, the original's way (SPEC §5).

    query [B, H, Sq, D]; key [B, Hkv, N, D]; pq_centroids [B, Hkv, M, C, dsub(+1)];
    pq_codebook [B, n_quantized, Hkv, M] int64 (tokens init_offset .. init_offset + n_quantized);
    pq_ip2l2_phi flat [B * Hkv * M] (ip) or None. kmeans_iter is accepted for compatibility (the
    centroids are not retrained at decode).
    Returns (sparse_list [B, H, L] int64, sparse_len [B, H] int64, weight_list [B, H, N],
    pq_centroids, pq_codebook [B, N - init_offset, Hkv, M], pq_ip2l2_phi), L = sink + heavy +
    window (wider when the short-sequence rule keeps more tokens); entries past sparse_len are -1.
    """
    check.tensor("query", query, shape=(None,) * 4, dims="[B, H, Sq, D]", dtypes=check.FLOAT_DTYPES)
    B, H, _, D = query.shape
    check.tensor(
        "key",
        key,
        shape=(B, None, None, D),
        dims="[B, Hkv, N, D]",
        dtypes=check.FLOAT_DTYPES,
        device=query.device,
    )
    Hkv, N = key.shape[1], key.shape[2]
    check.gqa(H, Hkv)
    M, C = pq_group_factor, 1 << pq_bits
    check.subvectors(M, D)
    check.bits(pq_bits)
    check.metric(metric)
    for name, value in (
        ("sink_size", sink_size),
        ("window_size", window_size),
        ("heavy_size", heavy_size),
        ("init_offset", init_offset),
    ):
        check.non_negative_int(name, value)
    dsub = D // M + (metric == "ip")
    check.tensor(
        "pq_centroids",
        pq_centroids,
        shape=(B, Hkv, M, C, dsub),
        dims="[B, Hkv, M, C, dsub(+1)]",
        dtypes=check.FLOAT_DTYPES,
        device=query.device,
    )
    check.tensor(
        "pq_codebook",
        pq_codebook,
        shape=(B, None, Hkv, M),
        dims="[B, n_quantized, Hkv, M]",
        dtypes=(torch.int64,),
        device=query.device,
    )
    phi = None
    if metric == "ip":
        if pq_ip2l2_phi is None:
            raise ValueError("pq_ip2l2_phi: the ip metric needs phi [B * Hkv * M], got None")
        check.tensor(
            "pq_ip2l2_phi",
            pq_ip2l2_phi.reshape(-1),
            shape=(B * Hkv * M,),
            dims="[B * Hkv * M]",
            dtypes=check.FLOAT_DTYPES,
            device=query.device,
        )
        phi = pq_ip2l2_phi.reshape(B, Hkv, M)
    n_quantized = pq_codebook.shape[1]
    rows = N - init_offset
    if rows < n_quantized:
        raise ValueError(
            f"key: expected at least init_offset + n_quantized = {init_offset + n_quantized} tokens, "
            f"got N={N}"
        )
    q = query[:, :, -1]
    threshold = heavy_size + init_offset + 1 + C
    codebook = _grown_codebook(pq_codebook, rows)
    new_keys = key[:, :, init_offset + n_quantized :]
    codes = codebook.transpose(1, 2)  # [B, Hkv, rows, M] view: code of token init_offset + r
    lengths = torch.full((B,), N, dtype=torch.int64, device=query.device)
    if ops.kernel_path(q, pq_centroids, heavy_size):
        from pqattn.kernels.encode import pq_encode

        pq_encode(
            new_keys if new_keys.stride(-1) == 1 else new_keys.contiguous(),
            pq_centroids,
            phi,
            codes[:, :, n_quantized:],
        )
        width = ref.selection_width(sink_size, window_size, heavy_size, min(threshold, N))
        out = Selection(
            torch.empty(B, H, width, dtype=torch.int64, device=query.device),
            torch.empty(B, H, dtype=torch.int64, device=query.device),
        )
        weights = torch.empty(B, H, N, dtype=weight_list_dtype, device=query.device)
        ops._select_kernel(
            q,
            pq_centroids,
            codes,
            lengths,
            sink=sink_size,
            window=window_size,
            heavy=heavy_size,
            cand_lo=max(init_offset, sink_size),
            short_threshold=threshold,
            out=out,
            workspace=_workspace(query.device, B * H, M, C, N, heavy_size),
            weights=weights,
            code_base=init_offset,
            n_tokens=N,
        )
        return out.positions, out.counts, weights, pq_centroids, codebook, pq_ip2l2_phi
    if new_keys.shape[2]:
        codes[:, :, n_quantized:] = ref.encode(new_keys, pq_centroids, phi, metric).long()
    full_codes = torch.zeros(B, Hkv, N, M, dtype=torch.uint8, device=query.device)
    full_codes[:, :, init_offset:] = codes.to(torch.uint8)
    sel = ref.select_pq(
        q,
        pq_centroids,
        full_codes,
        lengths,
        sink=sink_size,
        window=window_size,
        heavy=heavy_size,
        init_offset=init_offset,
        short_threshold=threshold,
    )
    weights = ref.dense_weights(sel, N, weight_list_dtype)
    return sel.positions.long(), sel.counts.long(), weights, pq_centroids, codebook, pq_ip2l2_phi


def sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sparse_list: torch.Tensor,
    sparse_len: torch.Tensor,
    weight_list: torch.Tensor,
) -> torch.Tensor:
    """The original's sparse attention call (SPEC §5) on pqattn's split-K decode kernel.

    query [B, H, D]; key, value [B, Hkv, N, D]; sparse_list [B, H, L] int64 (first sparse_len valid);
    sparse_len [B, H] int64; weight_list [B, H, N] (dense, by token position; 0 drops a token).
    Returns [B, H, D] in query's dtype. No host sync (the original read the longest list on the host).
    """
    return ops.sparse_decode(query, key, value, sparse_list, sparse_len, weight_list, dense_weights=True)
