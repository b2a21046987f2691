"""Fused PQ top-k selection for one decode query per sequence (SPEC §2).

One launch, grid (B * H, leaves): each row (sequence, query head) is split into leaves of TILE
tokens so that every SM has work even at B = 1, and the leaves of a row are merged by a tree
inside the same launch:
  1. leaf: the lookup table LUT[m, c] = <q_m, centroid[m, c]> of its row (a workspace that stays in
     L1; the leaves of a row write identical values), the scores of its TILE tokens gathered from
     it, mapped to order-preserving uint32 keys and kept in registers; the keys below the row's
     threshold (below) dropped; then at most K_PAD keys that hold the tile's top k (k = heavy, or
     fewer when the tile has fewer candidates): all of them when they fit, else found by a search
     over key values that keeps a bracket of two existing keys and probes inside it, each probe
     one compare and one block reduction (see _top_k);
  2. those (key, position) pairs go to the leaf's slot in the workspace, and an atomic counter of
     the parent node says which child arrived last: that program loads its FAN = TILE / K_PAD
     siblings' slots as one tile and selects again, up to the root (no second launch, no spin);
  3. the root takes exactly the top k and writes sink, heavy and window positions, the count, -1
     padding and (when asked) the 1.0 weights of the heavy part; every leaf writes the 0/1 weights
     of its own tokens.
The row's threshold is a word of the workspace that nodes raise (atomic max) to the smallest of
the keys they pass on whenever they pass on at least k: k keys of the row lie at or above it, so
the row's top k does too, and any node may drop the keys below it. In a launch of many waves the
first wave publishes for the rest (rows vary fastest in the grid for that), and later leaves
mostly find fewer than K_PAD keys left and skip their search.
Ties are broken arbitrarily (SPEC §2 compares score multisets). Every node passes on a superset
of its share of the row's top k, so the merge is exact. No host sync, no allocation: the
workspace is zeroed once by its owner and the kernel resets every counter and threshold it uses,
so the same launch can be replayed from a CUDA graph. Where those words lie depends on the layout
(B * H, M, C, the token axis and heavy): a workspace serves one layout, and one that served
another must be zeroed again.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pqattn.kernels.select.common import (
    load_codes,
    lut_base,
    order_key,
    probe,
    sum_min_max,
    write_lut,
)
from pqattn.limits import MAX_TREE_HEAVY
from pqattn.reference.selection import SelectParams
from pqattn.runtime.launch import Launcher, TunedLauncher, autotuning, graph_timing

# The autotune space: tile (tokens per leaf, candidates per merge) and warps. Every config is
# exercised by the tests and by `pqattn check`. A config serves a heavy size when its tile merges at
# least four children of K_PAD = k_pad(heavy, n_tokens) candidates (which bounds the tree's depth and its
# workspace); only when no config does (heavy > 4096) the largest tile merges two.
# maxnreg: capped at 128 registers the smaller tiles run without spills and four (2048) or two
# (4096, 8192) programs fit on an SM instead of three or one (docs/kernels/select.md).
SELECT_CONFIGS = [
    triton.Config({"TILE": tile}, num_warps=warps, maxnreg=maxnreg)
    for tile, warps, maxnreg in ((2048, 4, 128), (4096, 8, 128), (8192, 8, 128), (16384, 16, None))
]
# The LUTs get a launch of their own when a row has many leaves (each would re-read the
# centroids) or the launch runs in many waves; at one wave the leaves' own LUTs overlap the codes
# load.
LUT_KERNEL_ABOVE = 65536  # tokens per row
LUT_KERNEL_ABOVE_ROW_TOKENS = 1 << 21  # rows x tokens


# Up to these sizes a node's slot holds twice the power of two above heavy. A node may then pass
# on anything between its top `need` and twice as many keys, so its search stops after a few
# probes; the merges get more keys, and the thresholds that nodes publish are lower. The sizes
# where this pays were measured (docs/kernels/select.md).
SLACK_HEAVY_MAX = 512
SLACK_TOKENS_MAX = 1 << 17


def k_pad(heavy: int, n_tokens: int) -> int:
    """Slot width of a tree node: heavy rounded up to a power of two (at least 1), doubled when
    heavy <= SLACK_HEAVY_MAX and n_tokens <= SLACK_TOKENS_MAX."""
    p = 1 << max(heavy - 1, 0).bit_length()
    return 2 * p if heavy <= SLACK_HEAVY_MAX and n_tokens <= SLACK_TOKENS_MAX else p


def _valid_tiles(kp: int) -> list[int]:
    tiles = [c.kwargs["TILE"] for c in SELECT_CONFIGS]
    return [t for t in tiles if t >= 4 * kp] or [t for t in tiles if t >= 2 * kp]


def configs_for(heavy: int, n_tokens: int) -> tuple[triton.Config, ...]:
    """The configs that serve this heavy size over n_tokens (see SELECT_CONFIGS); empty above
    MAX_TREE_HEAVY."""
    return _configs_for_slot(k_pad(heavy, n_tokens))


@functools.cache
def _configs_for_slot(kp: int) -> tuple[triton.Config, ...]:
    tiles = _valid_tiles(kp)
    return tuple(c for c in SELECT_CONFIGS if c.kwargs["TILE"] in tiles)


def tree_nodes(leaves: int, fan: int) -> int:
    """Nodes of the merge tree over `leaves` leaves (the root included)."""
    total, size = 1, leaves
    while size > 1:
        total += size
        size = -(-size // fan)
    return total


# The workspace sizes are recomputed on every call: keep them cheap (bounded: a decode loop
# brings a new n_tokens every step).
@functools.lru_cache(maxsize=256)
def max_tree_nodes(n_tokens: int, heavy: int) -> int:
    """The most tree nodes any config serving `heavy` builds over n_tokens."""
    kp = k_pad(heavy, n_tokens)
    return max(
        tree_nodes(max(-(-n_tokens // c.kwargs["TILE"]), 1), c.kwargs["TILE"] // kp)
        for c in configs_for(heavy, n_tokens)
    )


@functools.lru_cache(maxsize=256)
def workspace_row_words(n_tokens: int, heavy: int) -> int:
    """int32 words per row of the tree workspace: a counter per node, then the slots (keys,
    positions, count). The layout is the same for every config (sized by the largest tree), so the
    autotuner's trial runs of one config never write over another config's counters."""
    return max_tree_nodes(n_tokens, heavy) * (2 * k_pad(heavy, n_tokens) + 2)


def workspace_numel(rows: int, M: int, C: int, n_tokens: int, heavy: int) -> int:
    """int32 elements of the selection workspace: the LUTs (rows * M * C) then the tree rows."""
    return rows * M * C + rows * workspace_row_words(n_tokens, heavy)


@triton.jit
def _scores(code, lut_row, M: tl.constexpr, C: tl.constexpr):
    """Approximate scores from codes [T, M]: sum over m of LUT[m, code[t, m]]."""
    m = tl.arange(0, M)
    return tl.sum(tl.load(lut_row + m[None, :] * C + code), axis=1)


@triton.jit
def _pq_lut_kernel(
    q_ptr,
    cent_ptr,
    ws_ptr,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ck,
    stride_cm,
    stride_cc,
    H,
    G,
    M: tl.constexpr,
    C: tl.constexpr,
    DSUB: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per row: its LUT, for long rows whose many leaves would each re-read the centroids."""
    row = tl.program_id(0)
    b = row // H
    h = row % H
    write_lut(
        q_ptr + b * stride_qb + h * stride_qh,
        cent_ptr + b * stride_cb + (h // G) * stride_ck,
        lut_base(ws_ptr) + row * (M * C),
        stride_cm,
        stride_cc,
        M,
        C,
        DSUB,
        BLOCK_D,
    )


@triton.jit
def _top_k(key, need, cap):
    """(mask, k, kth): a mask of k entries of `key` (0 marks a non-candidate) holding its k largest
    values, with min(need, nonzero keys) <= k <= max(cap, need), and kth the smallest key taken.

    `cap` > need lets a tree node stop early: it may pass on up to cap keys (its slot's width), all
    those at or above some value, which still hold its top `need`; the root asks for exactly need.
    The cut is bracketed by two keys, lo < hi, with the counts of keys at or above each
    (c_lo > cap, c_hi < need). Each step probes one value inside the bracket and counts the keys
    at or above it in one block reduction that also returns the nearest key on either side of the
    probe, so the bracket snaps to keys that exist: ties end the search as soon as one value is
    left, instead of after all 32 bits. The probe interpolates the counts (a step that fails to
    halve the bracket is followed by a bisection), which on score-like data needs 9-12 steps where
    bisecting the bits needed 17-32. Keys equal to the need-th are taken in tile order until need are.
    """
    nz = key != 0
    n_nz, lo, top = sum_min_max(nz.to(tl.int32), tl.where(nz, key, tl.full([], 0xFFFFFFFF, tl.uint32)), key)
    k = tl.minimum(need, n_nz)
    cap = tl.maximum(cap, k)
    aim = (k + cap) // 2
    lo = lo.to(tl.int64)
    hi = top.to(tl.int64) + 1
    c_lo = n_nz
    c_hi = 0
    bisect = False
    go = (k > 0) & (c_lo > cap)
    while go:
        p32 = probe(lo, hi, c_lo, c_hi, aim, bisect)
        # key - probe wraps: keys at or above the probe map to [0, 2^32 - probe), the others above
        # that, so the smallest difference gives the nearest key at or above the probe and the
        # largest the nearest below it (lo < probe is one; zeros only win when nothing else is).
        diff = key - p32
        c, d_min, d_max = sum_min_max((key >= p32).to(tl.int32), diff, diff)
        width = hi - lo
        up = c >= k
        lo = tl.where(up, (p32 + d_min).to(tl.int64), lo)
        c_lo = tl.where(up, c, c_lo)
        hi = tl.where(up, hi, (p32 + d_max).to(tl.int64) + 1)
        c_hi = tl.where(up, c_hi, c)
        bisect = 2 * (hi - lo) > width
        go = (c_lo > cap) & (hi - lo > 1)
    # Here c_lo <= cap (the keys >= lo are a valid answer) or hi == lo + 1 (lo is the need-th key,
    # c_hi keys lie above it and the rest of the k come from its ties).
    res = lo.to(tl.uint32)
    if (c_lo <= cap) | (k == 0):
        take = key >= res
        k = tl.where(k > 0, c_lo, 0)
    else:
        tie = key == res
        tie_rank = tl.cumsum(tie.to(tl.int32), 0) - 1
        take = (key > res) | (tie & (tie_rank < k - c_hi))
    # (a block & a scalar bool: Triton 3.9's interpreter would make it int32)
    return take & ((tl.zeros(key.shape, tl.int32) + k) > 0), k, res


@triton.jit
def _pq_select_kernel(
    q_ptr,
    cent_ptr,
    codes_ptr,
    len_ptr,
    ws_ptr,
    pos_ptr,
    cnt_ptr,
    w_ptr,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ck,
    stride_cm,
    stride_cc,
    stride_kb,
    stride_kk,
    stride_kn,
    stride_km,
    stride_pb,
    stride_ph,
    stride_wb,
    stride_wh,
    H,
    G,
    n_weights,
    sink,
    window,
    heavy,
    cand_lo,
    short_threshold,
    width,
    code_base,
    ws_row,
    n_nodes,
    n_bucket,  # autotune key only: the power of two above the token axis
    M: tl.constexpr,
    C: tl.constexpr,
    DSUB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_W: tl.constexpr,
    K_PAD: tl.constexpr,
    LUT_READY: tl.constexpr,
    TILE: tl.constexpr,
):
    FAN: tl.constexpr = TILE // K_PAD
    row = tl.program_id(0)  # rows vary fastest: see the threshold below
    leaf = tl.program_id(1)
    n_leaves = tl.num_programs(1)
    b = row // H
    h = row % H
    kvh = h // G
    n = tl.load(len_ptr + b).to(tl.int32)
    pos_row = pos_ptr + b * stride_pb + h * stride_ph
    w_row = w_ptr + b * stride_wb + h * stride_wh
    lane = tl.arange(0, TILE)
    offs = leaf * TILE + lane

    if n <= short_threshold:  # short sequence: every token; each leaf writes its part
        tl.store(pos_row + offs, tl.where(offs < n, offs, -1), mask=offs < width)
        if leaf == n_leaves - 1:
            for start in range(n_leaves * TILE, width, TILE):
                tail = start + lane
                tl.store(pos_row + tail, tl.full([TILE], -1, tl.int32), mask=tail < width)
            tl.store(cnt_ptr + b * H + h, n)
        if HAS_W:
            tl.store(
                w_row + offs, tl.where(offs < n, 1.0, 0.0).to(w_ptr.dtype.element_ty), mask=offs < n_weights
            )
    else:
        hi = n - window
        need = tl.minimum(heavy, tl.maximum(hi - cand_lo, 0))
        n_sink = tl.minimum(sink, n)
        win_lo = tl.maximum(hi, n_sink)
        if HAS_W:  # sink and window here; the root adds the heavy part after every leaf is done
            keep = (offs < n_sink) | ((offs >= win_lo) & (offs < n))
            tl.store(w_row + offs, tl.where(keep, 1.0, 0.0).to(w_ptr.dtype.element_ty), mask=offs < n_weights)

        # the tree rows follow the LUTs of all B * H rows
        ws = ws_ptr + tl.num_programs(0) * (M * C) + row.to(tl.int64) * ws_row
        # The row's threshold: the largest key that some node of this row has certified, by taking
        # `need` keys at or above it. Every key of the row's top `need` is at or above it, so a
        # node may drop the keys below it: once a few nodes have published, most leaves keep fewer
        # than K_PAD keys and skip the search. Launching the rows fastest lets the first wave of a
        # large launch publish for all the later ones. It is the row's word 0: counters are indexed
        # by node and node 0 is a leaf, which has none.
        thr = ws.to(tl.pointer_type(tl.uint32), bitcast=True)
        floor = tl.load(thr, cache_modifier=".cg")

        # 1. Leaf: keys of this tile's candidates (0 elsewhere). The codes load is issued first so
        # that it overlaps the LUT's computation.
        cand_hi = tl.where(need > 0, hi, cand_lo)  # no candidates when heavy = 0
        cand = (offs >= cand_lo) & (offs < cand_hi)
        # Row r of the codes holds token code_base + r; only tokens >= cand_lo >= code_base are read.
        codes_row = codes_ptr + b * stride_kb + kvh * stride_kk - code_base * stride_kn
        code = load_codes(codes_row, offs, cand, stride_kn, stride_km, M)
        lut_row = lut_base(ws_ptr) + row * (M * C)
        tile_lo = leaf * TILE
        if (tl.minimum(cand_hi, tile_lo + TILE) > tl.maximum(cand_lo, tile_lo)) & (not LUT_READY):
            write_lut(
                q_ptr + b * stride_qb + h * stride_qh,
                cent_ptr + b * stride_cb + kvh * stride_ck,
                lut_row,
                stride_cm,
                stride_cc,
                M,
                C,
                DSUB,
                BLOCK_D,
            )
            tl.debug_barrier()
        key = tl.where(cand, order_key(_scores(code, lut_row, M, C)), 0)
        pos = offs

        # 2. Merge tree: write this node's top keys to its slot; the last child to arrive merges.
        slot_key = ws + n_nodes  # n_nodes: the largest tree of any config (a fixed layout)
        slot_pos = slot_key + n_nodes * K_PAD
        slot_cnt = slot_pos + n_nodes * K_PAD
        level_off = 0
        level_size = n_leaves
        idx = leaf
        is_root = n_leaves == 1
        active = n_leaves > 1
        while active:
            take, k, kth = _top_k(tl.where(key >= floor, key, 0), need, K_PAD)
            if (k >= need) & (need > 0):
                tl.atomic_max(thr, kth, sem="relaxed")
            rank = tl.cumsum(take.to(tl.int32), 0) - 1
            node = level_off + idx
            tl.store(slot_key + node * K_PAD + rank, key.to(tl.int32, bitcast=True), mask=take)
            tl.store(slot_pos + node * K_PAD + rank, pos, mask=take)
            tl.store(slot_cnt + node, k)
            tl.debug_barrier()  # every thread's slot stores precede the release below
            parent = idx // FAN
            first = level_off + parent * FAN  # slot of the parent's first child
            n_child = tl.minimum(FAN, level_size - parent * FAN)
            level_off += level_size
            level_size = (level_size + FAN - 1) // FAN
            idx = parent
            arrived = tl.atomic_add(ws + level_off + parent, 1, sem="acq_rel")
            last = arrived == n_child - 1
            if last:
                tl.atomic_xchg(ws + level_off + parent, 0)  # ready for the next call
                child = lane // K_PAD
                e = lane % K_PAD
                got = tl.load(slot_cnt + first + child, mask=child < n_child, other=0, cache_modifier=".cg")
                ok = e < got
                key = tl.load(slot_key + first * K_PAD + lane, mask=ok, other=0, cache_modifier=".cg").to(
                    tl.uint32, bitcast=True
                )
                pos = tl.load(slot_pos + first * K_PAD + lane, mask=ok, other=0, cache_modifier=".cg")
                floor = tl.load(thr, cache_modifier=".cg")
            is_root = last & (level_size == 1)
            active = last & (level_size > 1)
        # 3. Root: positions sink | heavy | window, the count, -1 padding, heavy weights.
        if is_root:
            tl.debug_barrier()  # this program's leaf weight stores precede the root's
            take, k, kth = _top_k(tl.where(key >= floor, key, 0), need, need)
            tl.store(thr, 0)  # every other node of the row is done: ready for the next call
            rank = tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(pos_row + n_sink + rank, pos, mask=take)
            if HAS_W:
                tl.store(w_row + pos, tl.full([TILE], 1.0, tl.float32).to(w_ptr.dtype.element_ty), mask=take)
            for start in range(0, n_sink, TILE):
                o = start + lane
                tl.store(pos_row + o, o, mask=o < n_sink)
            n_win = n - win_lo
            for start in range(0, n_win, TILE):
                o = start + lane
                tl.store(pos_row + n_sink + k + o, win_lo + o, mask=o < n_win)
            count = n_sink + k + n_win
            for start in range(count, width, TILE):
                o = start + lane
                tl.store(pos_row + o, tl.full([TILE], -1, tl.int32), mask=o < width)
            tl.store(cnt_ptr + b * H + h, count)


def _prune(configs, named_args, **kwargs):
    tiles = _valid_tiles(kwargs.get("K_PAD", named_args.get("K_PAD", 1)))
    return [c for c in configs if c.kwargs["TILE"] in tiles]


pq_select_autotuned = triton.autotune(
    configs=SELECT_CONFIGS,
    key=["n_bucket", "H", "M", "C", "HAS_W", "K_PAD", "LUT_READY"],
    prune_configs_by={"early_config_prune": _prune},
    # timed by graph replay: single timed calls after an L2 flush ranked configs inconsistently
    do_bench=graph_timing(rep=100),
)(_pq_select_kernel)
_pq_select_tuned = TunedLauncher(pq_select_autotuned)
_pq_select_launch = Launcher(_pq_select_kernel)
_pq_lut_launch = Launcher(_pq_lut_kernel)


def pq_select(
    q: torch.Tensor,
    centroids: torch.Tensor,
    codes: torch.Tensor,
    lengths: torch.Tensor,
    params: SelectParams,
    *,
    positions: torch.Tensor,
    counts: torch.Tensor,
    workspace: torch.Tensor,
    n_tokens: int,
    weights: torch.Tensor | None = None,
    code_base: int = 0,
    config: triton.Config | None = None,
    lut_kernel: bool | None = None,
) -> None:
    """Launch the selection on validated inputs, writing `positions`, `counts` (and `weights`).

    q [B, H, D]; centroids [B, Hkv, M, C, >= dsub] (last dim contiguous); codes: any strides with
    codes[b, kvh, r, m] addressed by `codes.stride()` in the order (B, Hkv, N, M), row r holding
    token code_base + r (needs cand_lo >= code_base); lengths [B] (<= n_tokens); positions
    [B, H, width] int32/int64; counts [B, H] contiguous; workspace: int32, zero-filled once, at
    least workspace_numel(B * H, M, C, n_tokens, heavy) elements (the kernel leaves its counters
    and thresholds at zero, at places that depend on B * H, M, C, n_tokens and heavy: reuse it
    only with the same five); weights [B, H, n_weights] or None. `config` forces one config of
    SELECT_CONFIGS; by default the autotuner picks among configs_for(heavy, n_tokens) (the first
    of them when not `autotuning()`).
    `lut_kernel`: compute the LUTs in a launch of their own (default: when n_tokens >
    LUT_KERNEL_ABOVE or rows * n_tokens > LUT_KERNEL_ABOVE_ROW_TOKENS; see there).
    """
    sink, window, heavy, cand_lo, short_threshold, width = params
    B, H, D = q.shape
    Hkv, M, C = centroids.shape[1], centroids.shape[2], centroids.shape[3]
    dsub = D // M
    kp = k_pad(heavy, n_tokens)
    valid = configs_for(heavy, n_tokens)
    if not valid:
        raise ValueError(f"heavy: expected at most {MAX_TREE_HEAVY} for the selection kernel, got {heavy}")
    if config is not None and config not in valid:
        raise ValueError(
            f"config: TILE={config.kwargs['TILE']} does not serve heavy={heavy} over {n_tokens} tokens "
            "(see configs_for)"
        )
    if config is None and not autotuning():
        config = valid[0]
    rows = B * H
    need = workspace_numel(rows, M, C, n_tokens, heavy)
    if workspace.dtype != torch.int32 or workspace.numel() < need:
        raise ValueError(
            f"workspace: expected int32 with at least {need} elements, got {workspace.dtype} "
            f"with {workspace.numel()}"
        )
    w = weights if weights is not None else counts
    n_bucket = 1 << max(n_tokens - 1, 0).bit_length()
    tensors = (q, centroids, codes, lengths, workspace, positions, counts, w)
    scalars = (
        *q.stride()[:2],
        *centroids.stride()[:4],
        *codes.stride(),
        *positions.stride()[:2],
        *w.stride()[:2],
        H,
        H // Hkv,
        weights.shape[2] if weights is not None else 0,
        sink,
        window,
        heavy,
        cand_lo,
        short_threshold,
        width,
        code_base,
        workspace_row_words(n_tokens, heavy),
        max_tree_nodes(n_tokens, heavy),
        n_bucket,
    )
    if lut_kernel is None:
        lut_kernel = n_tokens > LUT_KERNEL_ABOVE or rows * n_tokens > LUT_KERNEL_ABOVE_ROW_TOKENS
    meta = dict(M=M, C=C, DSUB=dsub, BLOCK_D=min(dsub, 64))
    if lut_kernel:
        _pq_lut_launch((rows,), (q, centroids, workspace), (*scalars[:6], H, H // Hkv), meta)
    meta.update(HAS_W=weights is not None, K_PAD=kp, LUT_READY=lut_kernel)
    n_tok = max(n_tokens, 1)
    if config is None:
        # tuned per token bucket and per grid rows (to a power of two): a row's best tile depends
        # on how many programs the batch puts on the SMs
        key = (n_bucket, H, M, C, weights is not None, kp, lut_kernel, triton.next_power_of_2(rows))
        _pq_select_tuned(key, lambda m: (rows, -(-n_tok // m["TILE"])), tensors, scalars, meta)
    else:
        grid = (rows, -(-n_tok // config.kwargs["TILE"]))
        _pq_select_launch(grid, tensors, scalars, {**meta, **config.all_kwargs()})
