"""The host tier's row-cache kernels against their reference (CPU interpreter; GPU, with the host
rows in mapped host memory)."""

from __future__ import annotations

import pytest
import torch

from pqattn import reference as ref
from pqattn.host import mapped_host_empty
from pqattn.kernels.rows import FETCH_BLOCKS, fetch_rows, lookup_block, lookup_rows, lookup_workspace_numel


def _copy(state):
    return type(state)(*(t.clone() for t in state))


def _lists(
    B: int, R: int, L: int, n: torch.Tensor, previous: torch.Tensor | None, keep: float
) -> torch.Tensor:
    """[B, R, L] distinct positions per row below n[b], each row's newest position among them; about
    `keep` of them taken from the previous step's lists (hits)."""
    out = torch.empty(B, R, L, dtype=torch.int32)
    for b in range(B):
        for r in range(R):
            newest = int(n[b]) - 1
            pool = torch.randperm(newest)[: 4 * L]
            if previous is not None:
                old = previous[b, r][previous[b, r] >= 0]
                old = old[torch.randperm(old.numel())[: int(keep * L)]].long()
                pool = torch.cat([old, pool])
            row = [newest]
            for p in pool.tolist():
                if p not in row:
                    row.append(p)
                if len(row) == L:
                    break
            out[b, r] = torch.tensor(row)[torch.randperm(L)]
    return out


@pytest.mark.parametrize(
    "L,S,block,sort,block_rows,int8,programs",
    [
        (24, 40, None, True, FETCH_BLOCKS[0], False, 1000),  # one program a block
        (24, 40, None, False, FETCH_BLOCKS[0], True, 1),
        (300, 500, 128, False, FETCH_BLOCKS[0], False, 5),
        (300, 500, 128, False, FETCH_BLOCKS[1], True, None),
        *((300, 500, 128, True, b, False, None) for b in FETCH_BLOCKS),
        (300, 500, 16, False, FETCH_BLOCKS[1], False, None),  # many chunks of list and slots
        (300, 500, 16, True, FETCH_BLOCKS[1], False, None),
    ],
)
def test_row_cache_steps_match_the_reference(
    L: int,
    S: int,
    block: int | None,
    sort: bool,
    block_rows: int,
    int8: bool,
    programs: int | None,
    device: torch.device,
) -> None:
    """Steps of lookup + fetch over lists that share part of their rows with the previous step's,
    with ragged counts and the newest position listed; lists and slots in one chunk and in many
    (the victims' ranks across chunks, circularly from the hand), misses sorted or in list
    order, each fetch block size: the kernels' state, misses, slot lists, slots and host rows
    equal the reference's, and every listed row sits in its slot. int8: 8-bit host rows,
    dequantized by the fetch and quantized by its store of the new row (bitwise the reference's)."""
    sort_block = (lookup_block(L) if block is None else block) if sort else None
    B, R, N, D = 2, 3, 4 * L + 64, 16
    rows = torch.randn(B, R, N, 2, D) * torch.rand(B, R, N, 2, 1) * 4
    rows[0, 0, 5] = 0.0  # a zero row: scale 0
    if int8:
        rows = ref.encode_rows(rows[..., 0, :], rows[..., 1, :], torch.uint8)
    cache = ref.new_row_cache(B, R, N, S, device)
    k_slots = torch.zeros(B, R, S, D, device=device)
    v_slots = torch.zeros_like(k_slots)
    want = (
        _cpu(cache),
        rows.clone(),
        k_slots.cpu().clone(),
        v_slots.cpu().clone(),
    )  # the reference's, on the CPU
    host = mapped_host_empty(rows.shape, rows.dtype, device)
    host.copy_(rows)
    lengths = torch.tensor([N - 40, N - 7], device=device)
    # the lookup's scratch, reused over the steps as HostCache does; garbage before the first
    workspace = torch.full(
        (lookup_workspace_numel(B * R, L, S, block),), -7, dtype=torch.int32, device=device
    )
    previous = None
    for step in range(4):
        lengths += 1
        pos = _lists(B, R, L, lengths.cpu(), previous, keep=0.6).to(device)
        counts = torch.randint(L // 2, L + 1, (B, R), dtype=torch.int32, device=device)
        counts[:, 0] = L  # the newest position is listed in these rows
        previous = torch.where(torch.arange(L, device=device) < counts[..., None], pos, -1).cpu()
        k_new, v_new = (torch.randn(B, R, 1, D, device=device) for _ in range(2))
        shapes = ((B, R, L), (B, R, L), (B, R))
        got_m = ref.Misses(*(torch.full(s, -5, dtype=torch.int32, device=device) for s in shapes))
        want_m = _copy(got_m)
        got_list = torch.full((B, R, L), -9, dtype=torch.int32, device=device)
        want_list = got_list.clone()
        want_m, want_list = _cpu(want_m), want_list.cpu().clone()
        ref.lookup_rows(pos.cpu(), counts.cpu(), want[0], want_m, want_list, sort_block=sort_block)
        ref.fetch_rows(want[1], k_new.cpu(), v_new.cpu(), lengths.cpu(), want_m, want[2], want[3])
        lookup_rows(pos, counts, cache, got_m, got_list, workspace=workspace, sort=sort, block=block)
        fetch_rows(
            host, k_new, v_new, lengths, got_m, k_slots, v_slots, block_rows=block_rows, programs=programs
        )
        for name, g, w in zip(ref.RowCache._fields, cache, want[0], strict=True):
            assert torch.equal(g.cpu(), w), (step, name)
        assert torch.equal(got_m.count.cpu(), want_m.count)
        assert 0 < int(got_m.count.sum()) < int(counts.sum()) or step == 0  # hits and misses
        live = torch.arange(L) < want_m.count[..., None]
        for g, w in zip(got_m[:2], want_m[:2], strict=True):
            assert torch.equal(torch.where(live, g.cpu(), -1), torch.where(live, w, -1)), step
        assert torch.equal(got_list.cpu(), want_list)
        assert torch.equal(host, want[1])
        assert torch.equal(k_slots.cpu(), want[2]) and torch.equal(v_slots.cpu(), want[3])
        # every listed position is resident: its slot holds its host row
        listed = torch.arange(L, device=device) < counts[..., None]
        slot = got_list.long().clamp(min=0)
        assert bool((got_list[listed] >= 0).all())
        assert torch.equal(cache.owner.gather(2, slot)[listed], pos[listed])
        host_k = ref.decode_rows(host, D)[0].to(device, k_slots.dtype)
        host_k = host_k.gather(2, pos.long().clamp(min=0)[..., None].expand(-1, -1, -1, D))
        assert torch.equal(k_slots.gather(2, slot[..., None].expand(-1, -1, -1, D))[listed], host_k[listed])


def _cpu(state):
    return type(state)(*(t.cpu().clone() for t in state))


def test_lookup_refuses_a_short_workspace(device: torch.device) -> None:
    """A workspace below `lookup_workspace_numel` is refused before any launch, naming the argument."""
    B, R, L, N, S = 1, 2, 40, 200, 80
    cache = ref.new_row_cache(B, R, N, S, device)
    pos = torch.arange(L, dtype=torch.int32, device=device).expand(B, R, L).contiguous()
    counts = torch.full((B, R), L, dtype=torch.int32, device=device)
    shapes = ((B, R, L), (B, R, L), (B, R))
    misses = ref.Misses(*(torch.zeros(s, dtype=torch.int32, device=device) for s in shapes))
    slot_list = torch.empty(B, R, L, dtype=torch.int32, device=device)
    short = torch.zeros(lookup_workspace_numel(B * R, L, S) - 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="workspace: expected at least"):
        lookup_rows(pos, counts, cache, misses, slot_list, workspace=short)
    assert bool((cache.clock == 0).all()), "nothing ran"
