"""The host tier's row cache on the GPU (SPEC §10; reference: `pqattn.reference.rows`).

Two launches per decode step of a layer:
  * `lookup_rows`: one program per (sequence, KV head) reads its selection list in one block (up
    to MAX_BLOCK entries; more in several): hits stamp their slots, the misses are compacted in
    list order (or sorted), the victims are the next unstamped slots from the row's hand, then the maps are
    rewritten and the list of slots written. Each pass is one dependent chain of a few global
    reads for the whole list, so a step costs a few memory latencies. Barriers order a
    program's own global writes before its later reads.
  * `fetch_rows`: persistent programs walk the rows' blocks of misses in row order and read each
    missed row straight from host memory (page-locked and mapped: the kernel's loads cross PCIe,
    a position's key and value as one 2 x D read) into its slot; the step's new key and value
    come from the GPU, and one program of each row also stores them into the host tier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pqattn.runtime.launch import Launcher

MAX_BLOCK = 8192  # list entries or slots a step of the lookup reads at most (a whole list, usually)
# Whether the lookup sorts the misses (the fetch then reads host memory in ascending address order):
# off, since the selection's lists come out nearly ascending and the sort costs more than it saves
# (docs/kernels/host.md).
SORT_MISSES = False
# Missed rows a fetch program copies: the space the tests run, and the one launched (docs/kernels/host.md).
FETCH_BLOCKS = (16, 32, 64)
FETCH_BLOCK = 32
# Persistent fetch programs a multiprocessor: they walk the rows' misses in row order, so that the
# reads in flight span one row's host memory rather than every row's (docs/kernels/host.md).
FETCH_PROGRAMS_PER_SM = 1


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
    BLOCK: tl.constexpr,
    SORT: tl.constexpr,
):
    """Program row = b * R + r: one step of the row cache for list positions[b, r, :counts[b, r]]
    (reference.rows.lookup_rows), in blocks of BLOCK list entries or slots; with SORT each
    block's misses in ascending position order. The row cache's buffers are contiguous; barriers
    order the program's own writes before its later reads."""
    row = tl.program_id(0)
    b = row // R
    r = row % R
    row64 = row.to(tl.int64)
    count = tl.load(cnt_ptr + b.to(tl.int64) * stride_cb + r * stride_cr).to(tl.int32)
    step = tl.load(clock_ptr + row64 * 2)
    hand = tl.load(clock_ptr + row64 * 2 + 1)
    pos_row = pos_ptr + b.to(tl.int64) * stride_pb + r.to(tl.int64) * stride_pr
    map_row = slot_of_ptr + row64 * N
    owner_row = owner_ptr + row64 * S
    used_row = used_ptr + row64 * S
    miss_row = miss_pos_ptr + row64 * L
    victim_row = miss_slot_ptr + row64 * L
    lane = tl.arange(0, BLOCK)

    # 1-2. stamp the hits; the misses, compacted in list order
    n_miss = count * 0
    for start in range(0, L, BLOCK):
        i = start + lane
        live = i < count
        p = tl.load(pos_row + i.to(tl.int64) * stride_pl, mask=live, other=0).to(tl.int32)
        s = tl.load(map_row + p, mask=live, other=-1)
        o = tl.load(owner_row + s, mask=live & (s >= 0), other=-1)
        hit = live & (s >= 0) & (o == p)
        tl.store(used_row + s, step, mask=hit)
        miss = live & ~hit
        n_block = tl.sum(miss.to(tl.int32), axis=0)
        if SORT:
            tl.store(miss_row + n_miss + lane, tl.sort(tl.where(miss, p, 2147483647)), mask=lane < n_block)
        else:
            rank = n_miss + tl.cumsum(miss.to(tl.int32), axis=0) - 1
            tl.store(miss_row + rank, p, mask=miss)
        n_miss += n_block
    tl.debug_barrier()

    # 3. victims: the first n_miss slots, circularly from the hand, that this step has not stamped
    taken = n_miss * 0
    last = taken - 1
    scan = taken
    n_scans = tl.cdiv(S, BLOCK)
    while (taken < n_miss) & (scan < n_scans):
        j = scan * BLOCK + lane
        inside = j < S
        slot = (hand + j) % S
        free = inside & (tl.load(used_row + slot, mask=inside, other=step) < step)
        rank = taken + tl.cumsum(free.to(tl.int32), axis=0) - 1
        take = free & (rank < n_miss)
        tl.store(victim_row + rank, slot, mask=take)
        last = tl.maximum(last, tl.max(tl.where(take, j, -1), axis=0))
        taken += tl.sum(take.to(tl.int32), axis=0)
        scan += 1
    tl.debug_barrier()

    # 4. the victims' old positions unmapped, then the misses mapped
    for start in range(0, n_miss, BLOCK):
        k = start + lane < n_miss
        victim = tl.load(victim_row + start + lane, mask=k, other=0)
        old = tl.load(owner_row + victim, mask=k, other=-1)
        old_slot = tl.load(map_row + old, mask=k & (old >= 0), other=-1)
        tl.store(map_row + old, -1, mask=k & (old >= 0) & (old_slot == victim))
    tl.debug_barrier()
    for start in range(0, n_miss, BLOCK):
        k = start + lane < n_miss
        victim = tl.load(victim_row + start + lane, mask=k, other=0)
        missed = tl.load(miss_row + start + lane, mask=k, other=0)
        tl.store(owner_row + victim, missed, mask=k)
        tl.store(map_row + missed, victim, mask=k)
        tl.store(used_row + victim, step, mask=k)
    tl.debug_barrier()

    # 5. the list of slots
    for start in range(0, L, BLOCK):
        i = start + lane
        live = i < count
        p = tl.load(pos_row + i.to(tl.int64) * stride_pl, mask=live, other=0).to(tl.int32)
        listed = tl.load(map_row + p, mask=live, other=-1)
        tl.store(slots_ptr + row64 * L + i, tl.where(live, listed, -1), mask=i < L)
    tl.store(miss_cnt_ptr + row64, n_miss)
    tl.store(clock_ptr + row64 * 2, step + 1)
    tl.store(clock_ptr + row64 * 2 + 1, tl.where(n_miss > 0, (hand + last + 1) % S, hand))
    tl.store(stats_ptr + row64 * 2, tl.load(stats_ptr + row64 * 2) + count.to(tl.int64))
    tl.store(stats_ptr + row64 * 2 + 1, tl.load(stats_ptr + row64 * 2 + 1) + n_miss.to(tl.int64))


@triton.jit
def _quantized(x, is_key, D: tl.constexpr):
    """reference.rows.quantize of a [2 * D] key-then-value row x (float32): its codes (float32 of
    int8 values), the scale of each element's half, and the two scales."""
    ax = tl.abs(x)
    scale_k = tl.div_rn(tl.max(tl.where(is_key, ax, 0.0), axis=0), 127.0)
    scale_v = tl.div_rn(tl.max(tl.where(is_key, 0.0, ax), axis=0), 127.0)
    scale = tl.where(is_key, scale_k, scale_v)
    safe = tl.where(scale > 0, scale, 1.0)
    q = tl.minimum(tl.maximum(tl.floor(tl.div_rn(x, safe) + 0.5), -127.0), 127.0)
    return tl.where(scale > 0, q, 0.0), scale, scale_k, scale_v


@triton.jit
def _store_scale(ptr, scale):
    """A float32 as 4 little-endian bytes at ptr (uint8)."""
    bits = scale.to(tl.int32, bitcast=True)
    for j in tl.static_range(4):
        tl.store(ptr + j, ((bits >> (8 * j)) & 255).to(tl.uint8))


@triton.jit
def _load_scales(ptr):
    """[BLOCK_R] float32 from 4 little-endian bytes at each of ptr [BLOCK_R] (uint8)."""
    bits = tl.load(ptr).to(tl.int32)
    for j in tl.static_range(1, 4):
        bits = bits | (tl.load(ptr + j).to(tl.int32) << (8 * j))
    return bits.to(tl.float32, bitcast=True)


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
    BR,
    R,
    L,
    S,
    N,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INT8: tl.constexpr,
):
    """Persistent programs over the misses of rows (b * R + r) 0..BR in order: the rows' blocks of
    BLOCK_R misses numbered one after another, program p copies blocks p, p + P, ... (P programs)
    from the host tier into the slots [B, R, S, D] (reference.rows.fetch_rows), a position's key
    and value as one read, so the programs read one row's host memory at a time, not every row's
    at once. Program row % P also stores the step's new key and value at position lengths[b] - 1
    of the host tier. Host rows: [B, R, N, 2, D] of the slots' kind, or with INT8 uint8
    [B, R, N, 2 * D + 8] (int8 codes of the key and value, then their float32 scales),
    dequantized here."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    e = tl.arange(0, 2 * D)  # a host row: the key's D elements, then the value's
    is_key = e < D
    width = 2 * D + 8 if INT8 else 2 * D  # elements of a host row
    base = pid * 0  # the number of the row's first block
    for row in range(0, BR):
        row64 = tl.cast(row, tl.int64)
        b = row64 // R
        r = row64 % R
        n_miss = tl.load(miss_cnt_ptr + row64)
        n_blocks = tl.cdiv(n_miss, BLOCK_R)
        first = base + (pid - base % P + P) % P  # this program's first block number >= base
        if (row % P == pid) | (first < base + n_blocks):
            newest = tl.load(len_ptr + b).to(tl.int32) - 1
            host_row = rows_ptr + row64 * N * width
            k_new = tl.load(k_new_ptr + b * stride_nb + r * stride_nr + e, mask=is_key, other=0.0)
            v_new = tl.load(v_new_ptr + b * stride_vb + r * stride_vr + e - D, mask=~is_key, other=0.0)
            new_at = host_row + newest.to(tl.int64) * width
            if INT8:
                codes, scale, scale_k, scale_v = _quantized(
                    tl.where(is_key, k_new.to(tl.float32), v_new.to(tl.float32)), is_key, D
                )
                new_row = codes * scale  # what a later fetch of it gives
                if row % P == pid:
                    tl.store(new_at + e, codes.to(tl.int8).to(tl.uint8, bitcast=True))
                    _store_scale(new_at + 2 * D, scale_k)
                    _store_scale(new_at + 2 * D + 4, scale_v)
            else:
                new_row = tl.where(
                    is_key, k_new.to(rows_ptr.dtype.element_ty), v_new.to(rows_ptr.dtype.element_ty)
                )
                if row % P == pid:
                    tl.store(new_at + e, new_row)
            for block_no in range(first, base + n_blocks, P):
                i = (block_no - base) * BLOCK_R + tl.arange(0, BLOCK_R)
                live = i < n_miss
                p = tl.load(miss_pos_ptr + row64 * L + i, mask=live, other=0)
                slot = tl.load(miss_slot_ptr + row64 * L + i, mask=live, other=0)
                is_new = (p == newest)[:, None]
                from_host = live & (p != newest)
                at = host_row + p.to(tl.int64) * width
                if INT8:
                    got = tl.load(at[:, None] + e[None, :], mask=from_host[:, None], other=0)
                    got = got.to(tl.int8, bitcast=True).to(tl.float32)
                    got_k = _load_scales(at + 2 * D)
                    got_v = _load_scales(at + 2 * D + 4)
                    kv = got * tl.where(is_key[None, :], got_k[:, None], got_v[:, None])
                else:
                    kv = tl.load(at[:, None] + e[None, :], mask=from_host[:, None], other=0.0)
                kv = tl.where(is_new, new_row[None, :], kv).to(k_slot_ptr.dtype.element_ty)
                dst = (row64 * S + slot.to(tl.int64))[:, None] * D + e[None, :]
                tl.store(k_slot_ptr + dst, kv, mask=live[:, None] & is_key[None, :])
                tl.store(v_slot_ptr + dst - D, kv, mask=live[:, None] & ~is_key[None, :])
        base += n_blocks


def lookup_block(L: int) -> int:
    """The list entries a lookup step reads: the whole list up to MAX_BLOCK."""
    return min(MAX_BLOCK, triton.next_power_of_2(max(L, 128)))


_lookup_launch = Launcher(_lookup_kernel)
_fetch_launch = Launcher(_fetch_kernel)


def lookup_rows(
    positions: torch.Tensor,
    counts: torch.Tensor,
    cache: tuple[torch.Tensor, ...],
    misses: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slot_list: torch.Tensor,
    *,
    sort: bool | None = None,
    block: int | None = None,
) -> None:
    """The row cache's step for lists positions [B, R, L] / counts [B, R] (int32/int64): cache is
    reference.rows.RowCache's (slot_of, owner, last_used, clock, stats), misses its Misses, both
    and slot_list [B, R, L] int32 contiguous. sort: misses in ascending position order within
    each block of list entries rather than in list order (default SORT_MISSES); block: a power
    of two, default `lookup_block(L)`."""
    B, R, L = positions.shape
    slot_of, owner, used, clock, stats = cache
    N, S = slot_of.shape[-1], owner.shape[-1]
    block = lookup_block(L) if block is None else block
    sort = SORT_MISSES if sort is None else sort
    _lookup_launch(
        (B * R,),
        (positions, counts, slot_of, owner, used, clock, stats, *misses, slot_list),
        (*positions.stride(), *counts.stride(), R, L, S, N),
        dict(BLOCK=block, SORT=sort, num_warps=max(4, min(16, block // 256))),
    )


def fetch_rows(
    rows: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    lengths: torch.Tensor,
    misses: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    *,
    block_rows: int = FETCH_BLOCK,
    programs: int | None = None,
) -> None:
    """Store the new rows k_new / v_new [B, R, 1, D] (last dim contiguous) into the host tier rows
    (contiguous; mapped host memory on a GPU): [B, R, N, 2, D], or uint8 [B, R, N, 2 * D + 8]
    for 8-bit rows (reference.rows.encode_rows); copy the missed rows into the slots k_slots /
    v_slots [B, R, S, D] (contiguous); block_rows: one of FETCH_BLOCKS; programs: the persistent
    programs (default FETCH_PROGRAMS_PER_SM a multiprocessor, at most one per block of misses)."""
    B, R, N = rows.shape[:3]
    D = k_slots.shape[-1]
    L, S = misses[0].shape[-1], k_slots.shape[2]
    if programs is None:
        programs = FETCH_PROGRAMS_PER_SM * _multiprocessors(k_slots.device)
    programs = max(1, min(programs, B * R * triton.cdiv(L, block_rows)))
    _fetch_launch(
        (programs,),
        (rows, k_new, v_new, lengths, *misses, k_slots, v_slots),
        (k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), B * R, R, L, S, N),
        dict(D=D, BLOCK_R=block_rows, INT8=rows.dtype == torch.uint8, num_warps=4),
    )


def _multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors (a few on a CPU, where the interpreter runs the programs)."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count
