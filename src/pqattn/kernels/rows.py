"""The host tier's row cache on the GPU (SPEC §10; reference: `pqattn.reference.rows`).

Two launches per decode step of a layer:
  * `lookup_rows`: one program per (sequence, KV head) holds its whole selection list (width L) in
    registers: hits stamp their slots, the misses are sorted by position, the victims are the next
    unstamped slots from the row's hand (a scan in blocks of BLOCK_S), then the maps are rewritten
    and the list of slots written. Barriers order a program's own global writes and reads.
  * `fetch_rows`: a grid over (row, block of BLOCK_R misses) reads each missed row straight from
    host memory (pinned and mapped: the kernel's loads cross PCIe, one 2 x D row per position, in
    ascending address order within a row) into its slot; the step's new key and value come from
    the GPU, and the first block of each row also stores them into the host tier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pqattn.runtime.launch import Launcher

BLOCK_S = 1024  # slots a step of the victim scan reads
BLOCK_R = 16  # missed rows a fetch program copies


@triton.jit
def _lookup_kernel(
    pos_ptr,
    cnt_ptr,
    slot_of_ptr,
    owner_ptr,
    used_ptr,
    clock_ptr,
    stats_ptr,
    miss_pos_ptr,
    miss_slot_ptr,
    miss_cnt_ptr,
    slots_ptr,
    stride_pb,
    stride_pr,
    stride_pl,
    stride_cb,
    stride_cr,
    R,
    L,
    S,
    N,
    BLOCK_L: tl.constexpr,
    BLOCK_S_: tl.constexpr,
):
    """Program row = b * R + r: one step of the row cache for list positions[b, r, :counts[b, r]]
    (reference.rows.lookup_rows). The row cache's buffers are contiguous."""
    row = tl.program_id(0)
    b = row // R
    r = row % R
    row64 = row.to(tl.int64)
    count = tl.load(cnt_ptr + b.to(tl.int64) * stride_cb + r * stride_cr).to(tl.int32)
    step = tl.load(clock_ptr + row64 * 2)
    hand = tl.load(clock_ptr + row64 * 2 + 1)
    map_row = slot_of_ptr + row64 * N
    owner_row = owner_ptr + row64 * S
    used_row = used_ptr + row64 * S

    i = tl.arange(0, BLOCK_L)
    live = i < count
    pos_row = pos_ptr + b.to(tl.int64) * stride_pb + r.to(tl.int64) * stride_pr
    p = tl.load(pos_row + i.to(tl.int64) * stride_pl, mask=live, other=0).to(tl.int32)
    s = tl.load(map_row + p, mask=live, other=-1)
    o = tl.load(owner_row + s, mask=live & (s >= 0), other=-1)
    hit = live & (s >= 0) & (o == p)
    tl.store(used_row + s, step, mask=hit)
    miss = live & ~hit
    n_miss = tl.sum(miss.to(tl.int32), axis=0)
    missed = tl.sort(tl.where(miss, p, 2147483647))
    tl.debug_barrier()

    # victims: the first n_miss slots, circularly from the hand, that this step has not stamped
    taken = n_miss * 0
    last = taken - 1
    scan = taken
    n_scans = tl.cdiv(S, BLOCK_S_)
    while (taken < n_miss) & (scan < n_scans):
        j = scan * BLOCK_S_ + tl.arange(0, BLOCK_S_)
        inside = j < S
        slot = (hand + j) % S
        free = inside & (tl.load(used_row + slot, mask=inside, other=step) < step)
        rank = taken + tl.cumsum(free.to(tl.int32), axis=0) - 1
        take = free & (rank < n_miss)
        tl.store(miss_slot_ptr + row64 * L + rank, slot, mask=take)
        last = tl.maximum(last, tl.max(tl.where(take, j, -1), axis=0))
        taken += tl.sum(take.to(tl.int32), axis=0)
        scan += 1
    tl.debug_barrier()

    k = i < n_miss  # the sorted misses
    victim = tl.load(miss_slot_ptr + row64 * L + i, mask=k, other=0)
    old = tl.load(owner_row + victim, mask=k, other=-1)
    old_slot = tl.load(map_row + old, mask=k & (old >= 0), other=-1)
    tl.store(map_row + old, -1, mask=k & (old >= 0) & (old_slot == victim))
    tl.debug_barrier()
    tl.store(owner_row + victim, missed, mask=k)
    tl.store(map_row + missed, victim, mask=k)
    tl.store(used_row + victim, step, mask=k)
    tl.store(miss_pos_ptr + row64 * L + i, missed, mask=k)
    tl.debug_barrier()
    listed = tl.load(map_row + p, mask=live, other=-1)
    tl.store(slots_ptr + row64 * L + i, tl.where(live, listed, -1), mask=i < L)
    tl.store(miss_cnt_ptr + row64, n_miss)
    tl.store(clock_ptr + row64 * 2, step + 1)
    tl.store(clock_ptr + row64 * 2 + 1, tl.where(n_miss > 0, (hand + last + 1) % S, hand))
    tl.store(stats_ptr + row64 * 2, tl.load(stats_ptr + row64 * 2) + count.to(tl.int64))
    tl.store(stats_ptr + row64 * 2 + 1, tl.load(stats_ptr + row64 * 2 + 1) + n_miss.to(tl.int64))


@triton.jit
def _fetch_kernel(
    rows_ptr,
    k_new_ptr,
    v_new_ptr,
    len_ptr,
    miss_pos_ptr,
    miss_slot_ptr,
    miss_cnt_ptr,
    k_slot_ptr,
    v_slot_ptr,
    stride_nb,
    stride_nr,
    stride_vb,
    stride_vr,
    R,
    L,
    S,
    N,
    D: tl.constexpr,
    BLOCK_R_: tl.constexpr,
):
    """Program (row = b * R + r, block): copy misses block * BLOCK_R.. of the row from the host tier
    rows [B, R, N, 2, D] into the slots [B, R, S, D] (reference.rows.fetch_rows); block 0 also
    stores the step's new key and value at position lengths[b] - 1 of the host tier."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    b = row // R
    r = row % R
    row64 = row.to(tl.int64)
    newest = tl.load(len_ptr + b).to(tl.int32) - 1
    d = tl.arange(0, D)
    host_row = rows_ptr + row64 * N * 2 * D
    k_new = tl.load(k_new_ptr + b.to(tl.int64) * stride_nb + r * stride_nr + d)
    v_new = tl.load(v_new_ptr + b.to(tl.int64) * stride_vb + r * stride_vr + d)
    k_new = k_new.to(rows_ptr.dtype.element_ty)
    v_new = v_new.to(rows_ptr.dtype.element_ty)
    if block == 0:
        tl.store(host_row + newest.to(tl.int64) * 2 * D + d, k_new)
        tl.store(host_row + newest.to(tl.int64) * 2 * D + D + d, v_new)
    n_miss = tl.load(miss_cnt_ptr + row64)
    i = block * BLOCK_R_ + tl.arange(0, BLOCK_R_)
    live = i < n_miss
    p = tl.load(miss_pos_ptr + row64 * L + i, mask=live, other=0)
    slot = tl.load(miss_slot_ptr + row64 * L + i, mask=live, other=0)
    is_new = (p == newest)[:, None]
    from_host = live[:, None] & ~is_new
    src = host_row + p.to(tl.int64)[:, None] * 2 * D + d[None, :]
    k = tl.where(is_new, k_new[None, :], tl.load(src, mask=from_host, other=0.0))
    v = tl.where(is_new, v_new[None, :], tl.load(src + D, mask=from_host, other=0.0))
    dst = (row64 * S + slot.to(tl.int64))[:, None] * D + d[None, :]
    tl.store(k_slot_ptr + dst, k.to(k_slot_ptr.dtype.element_ty), mask=live[:, None])
    tl.store(v_slot_ptr + dst, v.to(v_slot_ptr.dtype.element_ty), mask=live[:, None])


_lookup_launch = Launcher(_lookup_kernel)
_fetch_launch = Launcher(_fetch_kernel)


def lookup_rows(
    positions: torch.Tensor,
    counts: torch.Tensor,
    cache: tuple[torch.Tensor, ...],
    misses: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slot_list: torch.Tensor,
) -> None:
    """The row cache's step for lists positions [B, R, L] / counts [B, R] (int32/int64): cache is
    reference.rows.RowCache's (slot_of, owner, last_used, clock, stats), misses its Misses, both
    and slot_list [B, R, L] int32 contiguous."""
    B, R, L = positions.shape
    slot_of, owner, used, clock, stats = cache
    N, S = slot_of.shape[-1], owner.shape[-1]
    block_l = triton.next_power_of_2(max(L, 16))
    _lookup_launch(
        (B * R,),
        (positions, counts, slot_of, owner, used, clock, stats, *misses, slot_list),
        (*positions.stride(), *counts.stride(), R, L, S, N),
        dict(BLOCK_L=block_l, BLOCK_S_=BLOCK_S, num_warps=8 if block_l >= 4096 else 4),
    )


def fetch_rows(
    rows: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    lengths: torch.Tensor,
    misses: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
) -> None:
    """Store the new rows k_new / v_new [B, R, 1, D] (last dim contiguous) into the host tier rows
    [B, R, N, 2, D] (contiguous; pinned host memory on a GPU) and copy the missed rows into the
    slots k_slots / v_slots [B, R, S, D] (contiguous)."""
    B, R, N, _, D = rows.shape
    L, S = misses[0].shape[-1], k_slots.shape[2]
    _fetch_launch(
        (B * R, triton.cdiv(L, BLOCK_R)),
        (rows, k_new, v_new, lengths, *misses, k_slots, v_slots),
        (k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), R, L, S, N),
        dict(D=D, BLOCK_R_=BLOCK_R, num_warps=4),
    )
