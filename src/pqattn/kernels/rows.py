"""The host tier's row cache on the GPU (SPEC §10; reference: `pqattn.reference.rows`).

Per decode step of a layer:
  * `lookup_rows`, four launches over (row, chunk) grids, row = (sequence, KV head), each chunk
    LOOKUP_CHUNK list entries or slots, so that a step's gathers run on many SMs (one program a
    row made the lookup one SM's stream of dependent gathers): stamp the hits and count each
    chunk's misses; compact the misses at their rank among the row's, and count each slot chunk's
    unstamped slots; the k-th unstamped slot from the hand takes the k-th miss (maps rewritten);
    the list of slots and the row's clock.
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

# List entries (and slots) a lookup program reads: a row's list and slots are split into chunks of
# this many, so a step's lookups run on many SMs (docs/kernels/host.md).
LOOKUP_CHUNK = 128
# Whether the lookup sorts each chunk's misses (the fetch then reads host memory in ascending address
# order): off, since the selection's lists come out nearly ascending and the sort costs more than it
# saves (docs/kernels/host.md).
SORT_MISSES = False
# Missed rows a fetch program copies: the space the tests run, and the one launched (docs/kernels/host.md).
FETCH_BLOCKS = (16, 32, 64)
FETCH_BLOCK = 32
# Persistent fetch programs a multiprocessor: they walk the rows' misses in row order, so that the
# reads in flight span one row's host memory rather than every row's (docs/kernels/host.md).
FETCH_PROGRAMS_PER_SM = 1


@triton.jit
def _listed(pos_ptr, cnt_ptr, stride_pb, stride_pr, stride_pl, stride_cb, stride_cr, row, c, R,
            CHUNK: tl.constexpr):  # fmt: skip
    """Row row = b * R + r's list entries c * CHUNK.. (i): whether each is listed (live), its position
    (p); and the list's count."""
    b = row // R
    r = row % R
    count = tl.load(cnt_ptr + b.to(tl.int64) * stride_cb + r * stride_cr).to(tl.int32)
    i = c * CHUNK + tl.arange(0, CHUNK)
    live = i < count
    at = pos_ptr + b.to(tl.int64) * stride_pb + r.to(tl.int64) * stride_pr + i.to(tl.int64) * stride_pl
    return i, live, tl.load(at, mask=live, other=0).to(tl.int32), count


@triton.jit
def _hits(slot_of_ptr, owner_ptr, row64, p, live, S, N):
    """The slots of positions p by the map (s), and whether each holds its position (rule 1)."""
    s = tl.load(slot_of_ptr + row64 * N + p, mask=live, other=-1)
    o = tl.load(owner_ptr + row64 * S + s, mask=live & (s >= 0), other=-1)
    return s, live & (s >= 0) & (o == p)


@triton.jit
def _lookup_stamp_kernel(
    pos_ptr, cnt_ptr, slot_of_ptr, owner_ptr, used_ptr, clock_ptr, work_ptr,
    stride_pb, stride_pr, stride_pl, stride_cb, stride_cr, R, S, N, W,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """Program (row, c), rule 1: the hits among list entries c * CHUNK.. stamped with the row's step;
    the chunk's misses counted into work[row, c]."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    row64 = row.to(tl.int64)
    _, live, p, _ = _listed(
        pos_ptr, cnt_ptr, stride_pb, stride_pr, stride_pl, stride_cb, stride_cr, row, c, R, CHUNK
    )
    s, hit = _hits(slot_of_ptr, owner_ptr, row64, p, live, S, N)
    tl.store(used_ptr + row64 * S + s, tl.load(clock_ptr + row64 * 2), mask=hit)
    tl.store(work_ptr + row64 * W + c, tl.sum((live & ~hit).to(tl.int32), axis=0))


@triton.jit
def _lookup_compact_kernel(
    pos_ptr, cnt_ptr, slot_of_ptr, owner_ptr, used_ptr, clock_ptr, work_ptr, miss_pos_ptr,
    stride_pb, stride_pr, stride_pl, stride_cb, stride_cr, R, L, S, N, W, C, CS,
    CHUNK: tl.constexpr, C_POW2: tl.constexpr, SORT: tl.constexpr,
):  # fmt: skip
    """Program (row, c), rule 2 for list chunk c < C: its misses written at their rank among the
    row's (list order, or SORT: ascending within the chunk); rule 3's count for slot chunk c < CS:
    the slots c * CHUNK.. (circularly from the hand) this step has not stamped, into work[row, C + c]."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    row64 = row.to(tl.int64)
    work = work_ptr + row64 * W
    lane = tl.arange(0, CHUNK)
    if c < C:
        _, live, p, _ = _listed(
            pos_ptr, cnt_ptr, stride_pb, stride_pr, stride_pl, stride_cb, stride_cr, row, c, R, CHUNK
        )
        _, hit = _hits(slot_of_ptr, owner_ptr, row64, p, live, S, N)
        ahead = tl.arange(0, C_POW2)
        before = tl.sum(tl.load(work + ahead, mask=ahead < c, other=0), axis=0)
        miss = live & ~hit
        miss_row = miss_pos_ptr + row64 * L + before
        if SORT:
            n_chunk = tl.sum(miss.to(tl.int32), axis=0)
            tl.store(miss_row + lane, tl.sort(tl.where(miss, p, 2147483647)), mask=lane < n_chunk)
        else:
            tl.store(miss_row + tl.cumsum(miss.to(tl.int32), axis=0) - 1, p, mask=miss)
    if c < CS:
        step = tl.load(clock_ptr + row64 * 2)
        hand = tl.load(clock_ptr + row64 * 2 + 1)
        j = c * CHUNK + lane
        inside = j < S
        free = inside & (tl.load(used_ptr + row64 * S + (hand + j) % S, mask=inside, other=step) < step)
        tl.store(work + C + c, tl.sum(free.to(tl.int32), axis=0))


@triton.jit
def _lookup_victims_kernel(
    slot_of_ptr, owner_ptr, used_ptr, clock_ptr, work_ptr, miss_pos_ptr, miss_slot_ptr,
    L, S, N, W, C, CS,
    CHUNK: tl.constexpr, C_POW2: tl.constexpr, CS_POW2: tl.constexpr,
):  # fmt: skip
    """Program (row, c), rules 3-4 over slot chunk c: its unstamped slots take the misses of their
    rank among the row's (circularly from the hand), their old positions unmapped (a victim's old
    position is never listed, so no other program reads or writes its map entry); the program
    that takes the last miss leaves the next hand in work[row, C + CS]."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    row64 = row.to(tl.int64)
    work = work_ptr + row64 * W
    n_miss = tl.sum(tl.load(work + tl.arange(0, C_POW2), mask=tl.arange(0, C_POW2) < C, other=0), axis=0)
    ahead = tl.arange(0, CS_POW2)
    before = tl.sum(tl.load(work + C + ahead, mask=ahead < c, other=0), axis=0)
    if before < n_miss:
        step = tl.load(clock_ptr + row64 * 2)
        hand = tl.load(clock_ptr + row64 * 2 + 1)
        j = c * CHUNK + tl.arange(0, CHUNK)
        inside = j < S
        slot = (hand + j) % S
        used_row = used_ptr + row64 * S
        free = inside & (tl.load(used_row + slot, mask=inside, other=step) < step)
        rank = before + tl.cumsum(free.to(tl.int32), axis=0) - 1
        take = free & (rank < n_miss)
        missed = tl.load(miss_pos_ptr + row64 * L + rank, mask=take, other=0)
        map_row = slot_of_ptr + row64 * N
        owner_row = owner_ptr + row64 * S
        old = tl.load(owner_row + slot, mask=take, other=-1)
        old_slot = tl.load(map_row + old, mask=take & (old >= 0), other=-1)
        tl.store(map_row + old, -1, mask=take & (old >= 0) & (old_slot == slot))
        tl.store(owner_row + slot, missed, mask=take)
        tl.store(map_row + missed, slot, mask=take)
        tl.store(used_row + slot, step, mask=take)
        tl.store(miss_slot_ptr + row64 * L + rank, slot, mask=take)
        tl.store(work + C + CS + tl.zeros_like(j), (hand + j + 1) % S, mask=take & (rank == n_miss - 1))


@triton.jit
def _lookup_list_kernel(
    pos_ptr, cnt_ptr, slot_of_ptr, clock_ptr, stats_ptr, work_ptr, miss_cnt_ptr, slots_ptr,
    stride_pb, stride_pr, stride_pl, stride_cb, stride_cr, R, L, N, W, C, CS,
    CHUNK: tl.constexpr, C_POW2: tl.constexpr,
):  # fmt: skip
    """Program (row, c), rule 5 over list entries c * CHUNK..: their slots by the map (-1 past the
    count); program c = 0 also writes the miss count, the clock (next step, next hand) and stats."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    row64 = row.to(tl.int64)
    i, live, p, count = _listed(
        pos_ptr, cnt_ptr, stride_pb, stride_pr, stride_pl, stride_cb, stride_cr, row, c, R, CHUNK
    )
    listed = tl.load(slot_of_ptr + row64 * N + p, mask=live, other=-1)
    tl.store(slots_ptr + row64 * L + i, tl.where(live, listed, -1), mask=i < L)
    if c == 0:
        work = work_ptr + row64 * W
        chunks = tl.arange(0, C_POW2)
        n_miss = tl.sum(tl.load(work + chunks, mask=chunks < C, other=0), axis=0)
        tl.store(miss_cnt_ptr + row64, n_miss)
        step = tl.load(clock_ptr + row64 * 2)
        hand = tl.load(clock_ptr + row64 * 2 + 1)
        tl.store(clock_ptr + row64 * 2, step + 1)
        tl.store(clock_ptr + row64 * 2 + 1, tl.where(n_miss > 0, tl.load(work + C + CS), hand))
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
    """The list entries (and slots) a lookup program reads: LOOKUP_CHUNK, or the list's power of two
    when shorter."""
    return min(LOOKUP_CHUNK, triton.next_power_of_2(max(L, 16)))


def lookup_workspace_numel(rows: int, L: int, S: int, block: int | None = None) -> int:
    """int32 elements of lookup_rows' workspace for `rows` lists of width L over S slots: per row,
    each list chunk's misses, each slot chunk's free slots and the next hand."""
    block = lookup_block(L) if block is None else block
    return rows * (triton.cdiv(L, block) + triton.cdiv(S, block) + 1)


_stamp_launch = Launcher(_lookup_stamp_kernel)
_compact_launch = Launcher(_lookup_compact_kernel)
_victims_launch = Launcher(_lookup_victims_kernel)
_list_launch = Launcher(_lookup_list_kernel)
_fetch_launch = Launcher(_fetch_kernel)


def lookup_rows(
    positions: torch.Tensor,
    counts: torch.Tensor,
    cache: tuple[torch.Tensor, ...],
    misses: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slot_list: torch.Tensor,
    *,
    workspace: torch.Tensor | None = None,
    sort: bool | None = None,
    block: int | None = None,
) -> None:
    """The row cache's step for lists positions [B, R, L] / counts [B, R] (int32/int64): cache is
    reference.rows.RowCache's (slot_of, owner, last_used, clock, stats), misses its Misses, both
    and slot_list [B, R, L] int32 contiguous. workspace: int32, at least `lookup_workspace_numel`
    elements (allocated when None); sort: misses in ascending position order within each chunk of
    list entries rather than in list order (default SORT_MISSES); block: the chunk, a power of
    two (default `lookup_block(L)`). Four launches over (row, chunk) grids."""
    B, R, L = positions.shape
    slot_of, owner, used, clock, stats = cache
    N, S = slot_of.shape[-1], owner.shape[-1]
    block = lookup_block(L) if block is None else block
    sort = SORT_MISSES if sort is None else sort
    C, CS = triton.cdiv(L, block), triton.cdiv(S, block)
    W = C + CS + 1
    if workspace is None:
        workspace = torch.empty(B * R * W, dtype=torch.int32, device=positions.device)
    elif workspace.numel() < B * R * W:
        raise ValueError(f"workspace: expected at least {B * R * W} int32 elements, got {workspace.numel()}")
    strides = (*positions.stride(), *counts.stride())
    chunk = dict(CHUNK=block, num_warps=max(1, min(8, block // 128)))
    _stamp_launch(
        (B * R, C),
        (positions, counts, slot_of, owner, used, clock, workspace),
        (*strides, R, S, N, W),
        chunk,
    )
    C_POW2, CS_POW2 = triton.next_power_of_2(C), triton.next_power_of_2(CS)
    _compact_launch(
        (B * R, max(C, CS)),
        (positions, counts, slot_of, owner, used, clock, workspace, misses[0]),
        (*strides, R, L, S, N, W, C, CS),
        dict(**chunk, C_POW2=C_POW2, SORT=sort),
    )
    _victims_launch(
        (B * R, CS),
        (slot_of, owner, used, clock, workspace, misses[0], misses[1]),
        (L, S, N, W, C, CS),
        dict(**chunk, C_POW2=C_POW2, CS_POW2=CS_POW2),
    )
    _list_launch(
        (B * R, C),
        (positions, counts, slot_of, clock, stats, workspace, misses[2], slot_list),
        (*strides, R, L, N, W, C, CS),
        dict(**chunk, C_POW2=C_POW2),
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
