"""Dense flash-attention forward (SPEC §4): prefill, full or causal, GQA, any sequence length.

One program per (query block, row = (b, h)): BLOCK_M query rows stay in registers while the key
and value blocks of their KV head stream past, BLOCK_N rows at a time, with an online softmax in
float32 (exp2 of logits pre-scaled by log2 e) and tensor-core products in the input dtype. A
causal launch is a 1-D grid ordered in groups of `rows_per_group` rows (half the L2): within a
group the query blocks come longest first, so short blocks fill the launch's tail while the
group's keys and values stay in L2. Causal attention is bottom-right aligned (query i sees keys
j <= i + Sk - Sq); the blocks every row of a program sees run unmasked, the diagonal band and the
tail are masked, so lengths need not be block multiples. A row that sees no key is a zero row
with log-sum-exp -inf. The decisions and the variants measured: docs/kernels/attention.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pqattn.runtime import launch
from pqattn.runtime.launch import autotuning, hooked, interpreted


def _set_block_shapes(nargs: dict) -> None:
    """Autotune pre-hook: the descriptors' tile shapes follow the config being run."""
    if nargs["TMA"]:
        D = nargs["D"]
        nargs["q_desc"].block_shape = [1, 1, nargs["BLOCK_M"], D]
        nargs["k_desc"].block_shape = [1, 1, nargs["BLOCK_N"], D]
        nargs["v_desc"].block_shape = [1, 1, nargs["BLOCK_N"], D]


# The autotune space; every config is exercised by the tests (interpreter and GPU) and the
# config chosen per shape is recorded in each bench row (`autotuned`). TMA configs need
# descriptor-compatible tensors (16-byte aligned base and strides); they are pruned otherwise.
ATTENTION_CONFIGS = [
    triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "TMA": tma}, num_warps=w, num_stages=s, pre_hook=_set_block_shapes
    )
    for bm, bn, w, s, tma in (
        (64, 32, 4, 2, False),
        (64, 64, 4, 3, False),
        (128, 64, 8, 3, False),
        (64, 64, 4, 3, True),
        (128, 64, 4, 2, True),
        (128, 128, 8, 3, True),
    )
]
_LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(
    desc, base, stride, b, h, start, n_rows, ROWS: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr
):
    """Rows start..start+ROWS of one head, [ROWS, D]; rows >= n_rows read as zeros."""
    if TMA:
        return desc.load([b, h, start, 0]).reshape(ROWS, D)  # out-of-bounds rows arrive as zeros
    else:
        r = start + tl.arange(0, ROWS)
        return tl.load(
            base + r[:, None] * stride + tl.arange(0, D)[None, :], mask=r[:, None] < n_rows, other=0.0
        )


@triton.jit
def _attend_block(
    q,
    k_desc,
    v_desc,
    k_base,
    v_base,
    stride_ks,
    stride_vs,
    b,
    kvh,
    start_n,
    rows,
    acc,
    l_i,
    m_i,
    qk_scale,
    Sq,
    Sk,
    D: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
):
    """One key/value block of the online softmax; MASK: apply the Sk bound and the causal band.
    m_i is the running maximum of the scaled logits (log2 domain)."""
    k = _load_rows(k_desc, k_base, stride_ks, b, kvh, start_n, Sk, BLOCK_N, D, TMA)
    s = tl.dot(q, tl.trans(k))
    if MASK:
        cols = start_n + tl.arange(0, BLOCK_N)
        visible = cols[None, :] < Sk
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + (Sk - Sq))
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    # rows that see no key yet: no NaN (a block that every row sees whole needs no guard)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if MASK else m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s * qk_scale - m_safe[:, None])
    v = _load_rows(v_desc, v_base, stride_vs, b, kvh, start_n, Sk, BLOCK_N, D, TMA)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _flash_forward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    q_desc,
    k_desc,
    v_desc,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ob,
    stride_oh,
    stride_os,
    H,
    G,
    Sq,
    Sk,
    qk_scale,  # scale * log2(e)
    rows_per_group,
    n_rows,  # B * H
    seq_bucket,  # autotune key only
    rows_bucket,  # autotune key only: B * H rounded up to a power of two (the grid's size)
    tma_ok,  # autotune key only: 1 when the descriptors exist (TMA configs are kept)
    D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_LSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
):
    if CAUSAL:  # 1-D grid in row groups, longest first: the last query block sees the most keys
        n_blocks = tl.cdiv(Sq, BLOCK_M)
        pid = tl.program_id(0)
        group = pid // (rows_per_group * n_blocks)
        group_rows = tl.minimum(rows_per_group, n_rows - group * rows_per_group)
        local = pid - group * rows_per_group * n_blocks
        pid_m = n_blocks - 1 - local // group_rows
        row = group * rows_per_group + local % group_rows
    else:  # (query blocks, rows): faster than the 1-D group mapping for full attention
        pid_m = tl.program_id(0)
        row = tl.program_id(1)
    start_m = pid_m * BLOCK_M
    b = row // H
    h = row % H
    kvh = h // G
    rows = start_m + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    q = _load_rows(
        q_desc,
        q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh,
        stride_qs,
        b,
        h,
        start_m,
        Sq,
        BLOCK_M,
        D,
        TMA,
    )
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kvh * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    # Key blocks before `full_end` are visible to every row of this block and lie inside Sk: no
    # masks there; the blocks from there to `hi` (the diagonal band and the tail) are masked.
    hi = Sk
    full_end = (Sk // BLOCK_N) * BLOCK_N
    if CAUSAL:  # keys past the last row's diagonal are never visible to this block
        hi = tl.minimum(Sk, tl.maximum(start_m + BLOCK_M + Sk - Sq, 0))
        full_end = tl.minimum(full_end, (tl.maximum(start_m + Sk - Sq + 1, 0) // BLOCK_N) * BLOCK_N)
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_block(
            q,
            k_desc,
            v_desc,
            k_base,
            v_base,
            stride_ks,
            stride_vs,
            b,
            kvh,
            start_n,
            rows,
            acc,
            l_i,
            m_i,
            qk_scale,
            Sq,
            Sk,
            D,
            False,
            CAUSAL,
            BLOCK_N,
            TMA,
        )
    for start_n in range(full_end, hi, BLOCK_N):
        acc, l_i, m_i = _attend_block(
            q,
            k_desc,
            v_desc,
            k_base,
            v_base,
            stride_ks,
            stride_vs,
            b,
            kvh,
            start_n,
            rows,
            acc,
            l_i,
            m_i,
            qk_scale,
            Sq,
            Sk,
            D,
            True,
            CAUSAL,
            BLOCK_N,
            TMA,
        )
    inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
    out = acc * inv[:, None]
    tl.store(
        o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + rows[:, None] * stride_os + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=rows[:, None] < Sq,
    )
    if HAS_LSE:
        lse = tl.where(
            l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453, float("-inf")
        )
        tl.store(lse_ptr + row.to(tl.int64) * Sq + rows, lse, mask=rows < Sq)


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    return [c for c in configs if named_args["tma_ok"] or not c.kwargs["TMA"]]


flash_forward_autotuned = triton.autotune(
    configs=ATTENTION_CONFIGS,
    key=["seq_bucket", "rows_bucket", "D", "CAUSAL", "HAS_LSE", "G", "tma_ok"],
    prune_configs_by={"early_config_prune": _prune},
    # timed by graph replay: single timed calls after an L2 flush ranked configs inconsistently
    do_bench=launch.graph_timing(rep=100),
)(_flash_forward_kernel)


@functools.cache
def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 50 << 20  # the interpreter: any size (tests set group_rows to cover groups)
    return torch.cuda.get_device_properties(device).L2_cache_size


def rows_per_group(k: torch.Tensor, n_heads: int, causal: bool) -> int:
    """Rows (b, h) per causal launch group: the power of two nearest to the rows
    whose keys and values fill half the L2 (rows of one kv head share them), so that the group's
    programs read them from L2 while the longest-first order still balances the launch (a small
    last group makes the tail long). Full attention launches rows in order (1)."""
    if not causal:
        return 1
    _, Hkv, Sk, D = k.shape
    kv_bytes = max(2 * Sk * D * k.element_size() * Hkv // n_heads, 1)  # per row
    fit = max(_l2_bytes(k.device) / (2 * kv_bytes), 1.0)
    return 1 << round(math.log2(fit))


def _grid(Sq: int, n_rows: int, block_m: int, causal: bool) -> tuple[int, ...]:
    n_blocks = triton.cdiv(Sq, block_m)
    return (n_blocks * n_rows,) if causal else (n_blocks, n_rows)


def _descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple | None:
    """4-D tensor descriptors of q, k, v (tile shapes set per config), or None when a base or a
    stride is not 16-byte aligned, as TMA requires."""
    for t in (q, k, v):
        if t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1]):
            return None
    return tuple(
        TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 16, t.shape[-1]]) for t in (q, k, v)
    )


@dataclass(frozen=True, slots=True)
class _Repeat:
    """The launch of a call signature whose config is known, replayed without Triton's autotuner
    and JIT dispatch (their argument binding and specialisation dominate a call's host time): the
    compiled kernel, the grid, the scalar arguments and constexprs, and for a TMA
    config the block shapes of its descriptors, made per call around the call's tensors."""

    kernel: object  # triton.compiler.CompiledKernel
    device: int
    grid: tuple[int, int, int]
    scalars: tuple
    constants: tuple
    blocks: tuple[list[int], list[int]] | None  # the q and the k/v descriptors' block shapes
    config: triton.Config
    tuned: bool  # chosen by the autotuner: kept as its best_config (the lab records it)


# By call signature (`_call_key`): the config the autotuner chose on a first call, then the
# _Repeat launch made from it on the second.
_REPEATS: dict[tuple, triton.Config | _Repeat] = {}
_MAX_REPEATS = 256


def _call_key(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    config: triton.Config | None,
    group_rows: int | None,
) -> tuple:
    """Everything a launch derives from its call: shapes, strides, dtypes, the addresses' 16-byte
    alignment (TMA and the kernel's specialisation), the options and the current device."""
    aligned = tuple(t.data_ptr() & 15 == 0 for t in (q, k, v, out))
    lse_key = None if lse is None else (lse.stride(), lse.data_ptr() & 15 == 0)
    return (
        q.shape,
        q.stride(),
        k.shape,
        k.stride(),
        v.stride(),
        out.stride(),
        q.dtype,
        k.dtype,
        v.dtype,
        out.dtype,
        aligned,
        lse_key,
        causal,
        scale,
        type(scale),
        None if config is None else tuple(sorted(config.all_kwargs().items())),
        group_rows,
        launch.current_device(),
    )


def _replay(r: _Repeat, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse) -> None:
    if r.blocks is None:
        descs = (q, k, v)
    else:
        q_block, kv_block = r.blocks
        descs = (
            TensorDescriptor(q, list(q.shape), list(q.stride()), q_block),
            TensorDescriptor(k, list(k.shape), list(k.stride()), kv_block),
            TensorDescriptor(v, list(v.shape), list(v.stride()), kv_block),
        )
    kernel = r.kernel
    kernel.run(
        *r.grid,
        launch.current_stream(r.device),
        kernel.function,
        kernel.packed_metadata,
        None,  # launch metadata: only launch hooks read it (calls under a hook take the JIT path)
        None,
        None,
        q,
        k,
        v,
        out,
        lse if lse is not None else out,
        *descs,
        *r.scalars,
        *r.constants,
    )
    if r.tuned:
        flash_forward_autotuned.best_config = r.config


def flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    out: torch.Tensor,
    causal: bool,
    scale: float | None = None,
    lse: torch.Tensor | None = None,
    config: triton.Config | None = None,
    group_rows: int | None = None,
) -> None:
    """Launch on validated inputs: q [B, H, Sq, D], k/v [B, Hkv, Sk, D] (last dims contiguous, D a
    power of two in 16..256, fp16/bf16/fp32), out like q, lse [B, H, Sq] float32 contiguous or
    None. `config` forces one of ATTENTION_CONFIGS (the first that fits when not `autotuning()`); a TMA config
    needs 16-byte aligned bases and strides. `group_rows` overrides rows_per_group (tests).

    A call repeating an earlier call's signature (shapes, strides, dtypes, alignment, options)
    launches the compiled kernel directly with the config chosen then (`_Repeat`)."""
    direct = not interpreted() and not hooked()
    key = _call_key(q, k, v, out, lse, causal, scale, config, group_rows) if direct else None
    known = _REPEATS.get(key) if direct else None
    if isinstance(known, _Repeat):
        _replay(known, q, k, v, out, lse)
        return
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    descs = _descriptors(q, k, v)
    tuned = config is None and autotuning()
    if config is None:
        if known is not None:  # the autotuner's choice for this signature, on an earlier call
            config = known
        elif not tuned:
            config = next(c for c in ATTENTION_CONFIGS if descs is not None or not c.kwargs["TMA"])
    if config is not None and config.kwargs["TMA"] and descs is None:
        raise ValueError("config: a TMA config needs q, k, v with 16-byte aligned bases and strides")
    scalars = (
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        H,
        H // Hkv,
        Sq,
        Sk,
        scale * _LOG2E,
        min(group_rows or rows_per_group(k, H, causal), B * H),
        B * H,
        triton.next_power_of_2(max(Sq, Sk)),
        triton.next_power_of_2(B * H),
        int(descs is not None),
    )
    meta = dict(D=D, CAUSAL=causal, HAS_LSE=lse is not None)
    if config is None:
        args = (q, k, v, out, lse if lse is not None else out, *(descs or (q, k, v)), *scalars)
        flash_forward_autotuned[lambda c: _grid(Sq, B * H, c["BLOCK_M"], causal)](*args, **meta)
        if direct:
            _remember(key, flash_forward_autotuned.best_config)
        return
    grid = _grid(Sq, B * H, config.kwargs["BLOCK_M"], causal)
    if config.kwargs["TMA"]:
        _set_block_shapes(
            {"q_desc": descs[0], "k_desc": descs[1], "v_desc": descs[2], "D": D, **config.kwargs}
        )
    else:  # the pointers in the descriptors' places: a pointer config reads none (making them costs)
        descs = None
    args = (q, k, v, out, lse if lse is not None else out, *(descs or (q, k, v)), *scalars)
    kernel = _flash_forward_kernel[grid](
        *args, **meta, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages
    )
    if tuned:
        flash_forward_autotuned.best_config = config
    if direct:
        constants = (
            D,
            causal,
            lse is not None,
            config.kwargs["BLOCK_M"],
            config.kwargs["BLOCK_N"],
            config.kwargs["TMA"],
        )
        blocks = None if descs is None else (list(descs[0].block_shape), list(descs[1].block_shape))
        launch.bind_driver()
        device = launch.current_device()
        _remember(key, _Repeat(kernel, device, (*grid, 1, 1)[:3], scalars, constants, blocks, config, tuned))


def _remember(key: tuple, entry: triton.Config | _Repeat) -> None:
    if len(_REPEATS) >= _MAX_REPEATS:  # e.g. a caller whose sequence grows: a new shape per call
        del _REPEATS[next(iter(_REPEATS))]
    _REPEATS[key] = entry
