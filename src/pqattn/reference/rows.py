"""The host tier's row cache (SPEC §10): which selected rows are resident on the GPU, which slots the
missing ones take, and the fetch that fills them.

State of one layer, per row r = (b, KV head), over a token axis of N positions and S slots:
  slot_of [B, Hkv, N] int32   the slot holding position p, or -1;
  owner [B, Hkv, S] int32     the position a slot holds, or -1;
  last_used [B, Hkv, S] int32 the step that last listed the slot's position (-1: never);
  clock [B, Hkv, 2] int32     (this row's step, the replacement hand: the next slot to consider);
  stats [B, Hkv, 2] int64     positions looked up and missed, summed over the steps.

A step of row r with selection list P (its first `count` positions, distinct):
  1. hits: p with owner[slot_of[p]] == p; their slots are stamped last_used = step;
  2. misses: the others, in list order, or (the kernel's way) ascending within each block of
     `sort_block` list entries, so that the fetch reads host memory in ascending address order;
  3. victims: the first len(misses) slots not stamped in this step, in circular order from the hand
     (CLOCK with this step's selection as the reference bit: a listed row is never evicted, so sink
     and window rows, listed every step, stay); the hand moves past the last victim;
  4. the i-th miss takes the i-th victim (the victim's old position unmapped);
  5. slot list: slot_of[p] for each listed p, in list order, -1 past the count.
Since S >= L (the list width), there are always enough victims. The replacement rule changes which
rows are fetched, never the rows attended.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class RowCache(NamedTuple):
    slot_of: torch.Tensor  # [B, Hkv, N] int32
    owner: torch.Tensor  # [B, Hkv, S] int32
    last_used: torch.Tensor  # [B, Hkv, S] int32
    clock: torch.Tensor  # [B, Hkv, 2] int32: step, hand
    stats: torch.Tensor  # [B, Hkv, 2] int64: lookups, misses


class Misses(NamedTuple):
    positions: torch.Tensor  # [B, Hkv, L] int32 in list order, the first `count` valid
    slots: torch.Tensor  # [B, Hkv, L] int32, the slot each miss takes
    count: torch.Tensor  # [B, Hkv] int32


def new_row_cache(batch: int, kv_heads: int, n_tokens: int, slots: int, device: torch.device) -> RowCache:
    """An empty row cache: no position resident, every slot free, the steps at 0."""
    shape = (batch, kv_heads)
    return RowCache(
        torch.full((*shape, n_tokens), -1, dtype=torch.int32, device=device),
        torch.full((*shape, slots), -1, dtype=torch.int32, device=device),
        torch.full((*shape, slots), -1, dtype=torch.int32, device=device),
        torch.zeros((*shape, 2), dtype=torch.int32, device=device),
        torch.zeros((*shape, 2), dtype=torch.int64, device=device),
    )


def lookup_rows(
    positions: torch.Tensor,
    counts: torch.Tensor,
    cache: RowCache,
    misses: Misses,
    slot_list: torch.Tensor,
    *,
    sort_block: int | None = None,
) -> None:
    """One step of the row cache (the module's rules 1-5), in place.

    Args:
        positions: [B, Hkv, L] int32/int64 selection lists (a group selection), distinct positions.
        counts: [B, Hkv] listed positions per row.
        cache: the layer's RowCache (updated). misses: written (positions in list order, their slots,
            the count). slot_list: [B, Hkv, L] int32, written. sort_block: None (misses in list
            order) or the list entries within which the misses are sorted.
    """
    B, R = counts.shape
    S = cache.owner.shape[-1]
    for b in range(B):
        for r in range(R):
            step, hand = (int(x) for x in cache.clock[b, r])
            slot_of, owner, used = cache.slot_of[b, r], cache.owner[b, r], cache.last_used[b, r]
            p = positions[b, r, : int(counts[b, r])].long()
            s = slot_of[p].long()
            hit = (s >= 0) & (owner[s.clamp(min=0)].long() == p)
            used[s[hit]] = step
            missed = p[~hit]
            if sort_block is not None:
                block = torch.arange(p.numel(), device=p.device)[~hit] // sort_block
                missed = missed[torch.argsort(block * (1 << 32) + missed, stable=True)]
            order = (hand + torch.arange(S, device=p.device)) % S
            free = (used[order] < step).nonzero().flatten()
            n = missed.numel()
            victims = order[free[:n]]
            if n:
                hand = (hand + int(free[n - 1]) + 1) % S
            old = owner[victims].long()
            unmap = (old >= 0) & (slot_of[old.clamp(min=0)].long() == victims)
            slot_of[old[unmap]] = -1
            owner[victims] = missed.to(torch.int32)
            slot_of[missed] = victims.to(torch.int32)
            used[victims] = step
            misses.positions[b, r, :n] = missed.to(torch.int32)
            misses.slots[b, r, :n] = victims.to(torch.int32)
            misses.count[b, r] = n
            slot_list[b, r] = -1
            slot_list[b, r, : p.numel()] = slot_of[p]
            cache.clock[b, r, 0], cache.clock[b, r, 1] = step + 1, hand
            cache.stats[b, r, 0] += p.numel()
            cache.stats[b, r, 1] += n


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit rows: x [..., D] -> (q [..., D] int8, scale [...] float32) with scale = max|x| / 127 and
    q = floor(x / scale + 1/2) (0 where the row is 0), so that x ~ q * scale."""
    x = x.float()
    scale = x.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.floor(x / safe[..., None] + 0.5).clamp(-127, 127)
    return torch.where(scale[..., None] > 0, q, 0.0).to(torch.int8), scale


def encode_rows(keys: torch.Tensor, values: torch.Tensor, rows_dtype: torch.dtype) -> torch.Tensor:
    """Host rows of keys and values [..., D]: [..., 2, D] of rows_dtype (key then value), or for
    rows_dtype uint8 the 8-bit layout [..., 2 * D + 8]: the key's and the value's int8 codes, then
    their float32 scales (little-endian bytes)."""
    if rows_dtype != torch.uint8:
        return torch.stack((keys, values), dim=-2).to(rows_dtype)
    (qk, sk), (qv, sv) = quantize(keys), quantize(values)
    scales = torch.stack((sk, sv), dim=-1).contiguous().view(torch.uint8)  # [..., 8]
    return torch.cat((qk.view(torch.uint8), qv.view(torch.uint8), scales), dim=-1)


def decode_rows(rows: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) [..., D] of host rows (`encode_rows`'s layouts; 8-bit rows dequantized to
    float32)."""
    if rows.dtype != torch.uint8:
        return rows[..., 0, :], rows[..., 1, :]
    D = head_dim
    codes = rows[..., : 2 * D].contiguous().view(torch.int8).float()
    scales = rows[..., 2 * D : 2 * D + 8].contiguous().view(torch.float32)  # [..., 2]
    return codes[..., :D] * scales[..., :1], codes[..., D:] * scales[..., 1:]


def fetch_rows(
    rows: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    lengths: torch.Tensor,
    misses: Misses,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
) -> None:
    """Store the step's new rows in the host tier and fill the missed slots, in place.

    Args:
        rows: the host tier, [B, Hkv, N, 2, D] (key then value of a position: one contiguous row)
            or uint8 [B, Hkv, N, 2 * D + 8] (8-bit rows, `encode_rows`).
        k_new, v_new: [B, Hkv, 1, D] the step's new key and value, at position lengths[b] - 1.
        lengths: [B] tokens per sequence, the new one included.
        misses: from `lookup_rows`. k_slots, v_slots: [B, Hkv, S, D] the row cache's rows.
    """
    B, R = misses.count.shape
    D = k_slots.shape[-1]
    for b in range(B):
        at = int(lengths[b]) - 1
        rows[b, :, at] = encode_rows(k_new[b, :, 0], v_new[b, :, 0], rows.dtype)
        for r in range(R):
            n = int(misses.count[b, r])
            p = misses.positions[b, r, :n].long()
            s = misses.slots[b, r, :n].long()
            k, v = decode_rows(rows[b, r, p], D)
            k_slots[b, r, s] = k.to(k_slots.dtype)
            v_slots[b, r, s] = v.to(v_slots.dtype)
