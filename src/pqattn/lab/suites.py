"""The benchmark suites: which shapes, which implementations, and what each must move and compute.

Every case draws its own random inputs (one set per rotation slot), lists the implementations to
time on them (pqattn's public functions and the baselines a user would otherwise run), and states
per implementation the fewest bytes it must move (each input it needs read once, each output
written once) and the FLOPs it must do. Shapes come from the issues that set the targets; `quick`
is a subset for a fast look, `tiny` runs in seconds on a CPU (what the tests use).
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

import pqattn.reference as ref
from pqattn import dispatch, ops
from pqattn.index import PQConfig, PQIndex
from pqattn.integrations.sparse_attention_hub import codebook_buffer, indexer_next
from pqattn.lab import baselines
from pqattn.lab.workload import WorkloadSpec, make_workload

if TYPE_CHECKING:
    import transformers

SIZES = ("full", "quick", "tiny")
KiB = 1024


@dataclass
class Impl:
    name: str
    role: str  # "pqattn" (what we ship) or "baseline" (measured in the same run for comparison)
    fn: Callable[[dict], object]  # one call on one input set
    bytes: int
    flops: int
    note: str = ""
    skip: str | None = None  # why it is not run at this shape (e.g. the reference would not fit)
    versus: tuple[str, ...] | None = None  # baselines that do the same work (None: every baseline)
    no_graph: str | None = None  # why the call must not be captured (timed eager and pipelined only)
    # untimed reset of an input set's state between samples (a decode step that appends rolls back)
    rewind: Callable[[dict], None] | None = None


@dataclass
class Case:
    suite: str
    name: str
    params: dict
    make_inputs: Callable[[int], dict]  # seed -> tensors on the device
    impls: list[Impl] = field(default_factory=list)


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _gen(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return 8 * 2**30


def _too_big(need: int, device: torch.device, what: str) -> str | None:
    if need > _free_bytes(device) // 2:
        return f"{what} needs about {need / 2**30:.0f} GiB of temporaries; not run at this shape"
    return None


SWEEP = "sweep-"  # decode cases that vary N only; `pqattn.lab.bench.plot` draws them as lines
KERNEL_NOTE = "the Triton kernel on CUDA (the PyTorch reference on a CPU)"


# ---- select: PQ top-k selection for one decode query per sequence (issue 4) -----------------------


# keys a compat decode loop appends before it starts over (room for them in the case's key tensor)
_LOOP_CALLS = 4096


def _index(x: dict, M: int, bits: int, sink: int, window: int, heavy: int) -> PQIndex:
    """A PQIndex over the case's codebook: what a decode loop selects through."""
    config = PQConfig(subvectors=M, bits=bits, sink=sink, window=window, heavy=heavy, share="head")
    book = ops.PQCodebook(x["centroids"], x["codes"], None)
    return PQIndex.from_codebook(book, x["lengths"], config=config)


def _aged_index(x: dict, M: int, bits: int, sink: int, window: int, heavy: int) -> PQIndex:
    """`_index` with its buckets built REINDEX_AFTER tokens ago (those tokens are scanned)."""
    index = _index(x, M, bits, sink, window, heavy)
    index.reindex(as_of=(index.lengths - PQIndex.REINDEX_AFTER).clamp(min=0))
    return index


def _compat_codebook(x: dict, sink: int) -> torch.Tensor:
    """The compat case's int64 codebook (all but the newest key) as a view of a buffer of
    indexer_next's own, as an earlier call of a decode loop returns it."""
    N = x["codes"].shape[2]
    n_q = N - sink - 1
    book = x["codes"][:, :, sink : sink + n_q].long().transpose(1, 2)
    buf = codebook_buffer(book, sink, n_q + 1)[0]
    return buf[:, sink : sink + n_q]


def _compat_loop(x: dict, sink: int) -> Callable[[], object]:
    """A decode loop through indexer_next: each call one key longer than the last, passed the
    codebook the last one returned; after _LOOP_CALLS calls it starts over from the case's
    codebook (that call counts the buckets again)."""
    N = x["key"].shape[2]
    loop = {"n": N + _LOOP_CALLS, "codebook": None}

    def step() -> object:
        if loop["n"] == N + _LOOP_CALLS:
            loop["n"], loop["codebook"] = N, _compat_codebook(x, sink)
        out = x["compat"](loop["codebook"], loop["n"])
        loop["n"], loop["codebook"] = loop["n"] + 1, out[4]
        return out

    return step


def _aged_compat_codebook(x: dict, sink: int, window: int, bits: int) -> torch.Tensor:
    """`_compat_codebook` after one call counted its buckets, regrouped as they were
    REINDEX_AFTER - 1 tokens ago (those tokens are scanned)."""
    from pqattn.integrations.sparse_attention_hub import STATE_ATTRIBUTE

    codebook = _compat_codebook(x, sink)
    x["compat"](codebook)
    buf = codebook._base
    state = getattr(buf, STATE_ATTRIBUTE)
    cand_lo = state.layout[1]
    aged = state.bucketed_at - (PQIndex.REINDEX_AFTER - 1)
    lengths = torch.full_like(state.lengths, aged)
    codes = buf.transpose(1, 2)[:, :, : state.bucketed_at]
    dispatch.bucket_tokens(
        codes, lengths, *state.buckets, state.cursor, C=2**bits, window=window, cand_lo=cand_lo
    )
    state.frozen_at, state.bucketed_at = max(aged - window, cand_lo), aged
    return codebook


def _selection_buffers(
    B: int, H: int, L: int, M: int, C: int, N: int, heavy: int, device: torch.device
) -> tuple[ref.Selection, torch.Tensor]:
    """Output buffers and zeroed workspace of the selection kernel, allocated once per input set
    (the decode-loop pattern that PQIndex follows)."""
    out = ref.Selection(
        torch.empty(B, H, L, device=device, dtype=torch.int32),
        torch.empty(B, H, device=device, dtype=torch.int32),
    )
    return out, torch.zeros(
        ops.select_workspace_numel(B * H, M, C, N, heavy), device=device, dtype=torch.int32
    )


def _select_case(
    device: torch.device,
    name: str,
    *,
    B: int,
    H: int,
    Hkv: int,
    N: int,
    D: int = 128,
    M: int = 2,
    bits: int = 6,
    sink: int = 128,
    window: int = 128,
    heavy: int = 128,
    q_dtype: torch.dtype = torch.bfloat16,
    compat: bool = False,
    llm: bool = False,
) -> Case:
    """llm: the query, centroids and codes from the demo's LLM-like cache (pqattn.lab.workload,
    the index built by k-means as PQIndex.build does) instead of random ones: its scores are far
    from the random codes' near-normal ones, and the selection's searches take other paths."""
    C, dsub, L = 2**bits, D // M, sink + heavy + window
    params = dict(B=B, H=H, Hkv=Hkv, N=N, D=D, M=M, bits=bits, sink=sink, window=window, heavy=heavy)
    params["q_dtype"] = str(q_dtype).removeprefix("torch.")
    params["inputs"] = "llm-like cache" if llm else "random"
    opts = dict(sink=sink, window=window, heavy=heavy, init_offset=sink)

    def make_inputs(seed: int) -> dict:
        g = _gen(seed, device)
        if llm:
            spec = WorkloadSpec(tokens=N, kv_heads=Hkv, group=H // Hkv, head_dim=D, batch=B, seed=seed)
            work = make_workload(spec).to(device, q_dtype)
            config = PQConfig(
                subvectors=M,
                bits=bits,
                sink=sink,
                window=window,
                heavy=heavy,
                seed=seed,
                sample=0,
                share="head",
            )
            built = PQIndex.build(work.keys[:, :, :N], config=config)
            x = {"q": work.queries[-1].contiguous(), "centroids": built.centroids}
            x["codes"] = built.codes[:, :, :N]
        else:
            x = {
                "q": torch.randn(B, H, D, device=device, generator=g).to(q_dtype),
                "centroids": torch.randn(B, Hkv, M, C, dsub, device=device, generator=g),
                "codes": torch.randint(0, C, (B, Hkv, N, M), device=device, generator=g, dtype=torch.uint8),
            }
        x["lengths"] = torch.full((B,), N, device=device, dtype=torch.int32)
        x["scores"] = torch.randn(B * H, N, device=device, generator=g)
        x["out"], x["workspace"] = _selection_buffers(B, H, L, M, C, N, heavy, device)
        x["index"] = _index(x, M, bits, sink, window, heavy)
        x["index_aged"] = (
            _aged_index(x, M, bits, sink, window, heavy) if device.type == "cuda" else x["index"]
        )
        if compat:  # the original's call: all but the newest key quantized, int64 codebook
            x["query"] = x["q"][:, :, None].float()
            keys = torch.randn(B, Hkv, N + _LOOP_CALLS, D, device=device, generator=g)
            x["key"] = keys[:, :, :N]
            query, cent = x["query"], x["centroids"]
            opts_ = (torch.float32, sink, window, heavy, M, bits, 0, sink, "euclidean")
            x["compat"] = lambda codebook, n=N: indexer_next(
                query, keys[:, :, :n], *opts_, cent, codebook, None
            )
            x["codebook"] = _compat_codebook(x, sink)
            x["codebook_aged"] = (
                _aged_compat_codebook(x, sink, window, bits) if device.type == "cuda" else x["codebook"]
            )
            x["compat_loop"] = _compat_loop(x, sink)
        return x

    select_bytes = (
        B * Hkv * N * M  # codes
        + B * Hkv * M * C * dsub * 4  # centroids
        + B * H * D * _esize(q_dtype)
        + B * H * (L + 1) * 4  # positions + counts
    )
    select_flops = 2 * B * H * M * C * dsub + B * H * N * M  # LUT + score sums
    compat_bytes = B * Hkv * N * M * 8 + B * H * N * 4 + B * H * L * 8  # int64 codes, weights, int64 list
    lut_gather = B * H * N * M * 8 * 3  # the reference's int64 gather index and gathered values
    ref_skip = _too_big(lut_gather, device, "the reference's score gather")
    return Case(
        "select",
        name,
        params,
        make_inputs,
        [
            Impl(
                "pqattn",
                "pqattn",
                lambda x: ops.select_topk(
                    x["q"],
                    x["centroids"],
                    x["codes"],
                    x["lengths"],
                    **opts,
                    out=x["out"],
                    workspace=x["workspace"],
                ),
                select_bytes,
                select_flops,
                note=KERNEL_NOTE,
                skip=None if device.type == "cuda" else ref_skip,
            ),
            Impl(
                "pqattn-index",
                "pqattn",
                lambda x: x["index"].select(x["q"]),
                select_bytes,
                select_flops,
                note="PQIndex.select: the decode loop's call, with the code histogram its appends keep",
                skip=None if device.type == "cuda" else ref_skip,
            ),
            Impl(
                "pqattn-index-aged",
                "pqattn",
                lambda x: x["index_aged"].select(x["q"]),
                select_bytes,
                select_flops,
                note=f"PQIndex.select with the last {PQIndex.REINDEX_AFTER} candidates appended since its "
                "buckets were built, as just before PQIndex rebuilds them: the most it scans (on a CPU, "
                "where the index keeps no buckets, pqattn-index again)",
            ),
            Impl(
                "torch-ref",
                "baseline",
                lambda x: ref.select_pq(x["q"], x["centroids"], x["codes"], x["lengths"], **opts),
                select_bytes,
                select_flops,
                skip=ref_skip,
            ),
            *(
                [
                    Impl(
                        "compat",
                        "pqattn",
                        lambda x: x["compat"](x["codebook"]),
                        compat_bytes,
                        select_flops,
                        note="indexer_next: int64 codebook, encodes the new key, dense float32 weights; "
                        "the codebook an earlier call returned, passed back with the newest key's row to "
                        "write again (the same codebook every call, as the original's benchmark)",
                    ),
                    Impl(
                        "compat-loop",
                        "pqattn",
                        lambda x: x["compat_loop"](),
                        compat_bytes,
                        select_flops,
                        note="compat in a decode loop: each call one key longer than the last and passed "
                        f"the codebook the last returned (from the case's codebook again every {_LOOP_CALLS} "
                        "calls)",
                        no_graph="each call is one key longer than the last (a graph replays one length)",
                    ),
                    Impl(
                        "compat-aged",
                        "pqattn",
                        lambda x: x["compat"](x["codebook_aged"]),
                        compat_bytes,
                        select_flops,
                        note=f"compat with its buckets built {PQIndex.REINDEX_AFTER - 1} calls of one new "
                        "key ago, the most it scans before it rebuilds them (on a CPU, compat again)",
                    ),
                ]
                if compat
                else []
            ),
            Impl(
                "torch.topk",
                "baseline",
                lambda x: torch.topk(x["scores"], heavy, dim=-1),
                B * H * N * 4 + B * H * heavy * 12,
                0,
                note="top-k alone over precomputed float32 scores [B*H, N]",
            ),
        ],
    )


def select_suite(size: str, device: torch.device) -> list[Case]:
    if size == "tiny":
        tiny = dict(B=2, H=4, Hkv=2, N=300, D=32, bits=4, sink=8, window=8, heavy=16)
        return [
            _select_case(device, "tiny", **tiny, compat=True),
            _select_case(device, "tiny-llm", **tiny, llm=True),
        ]
    cases = [
        _select_case(device, "original", B=1, H=32, Hkv=32, N=32000, q_dtype=torch.float32, compat=True),
    ]
    for n, h in ((16, 256), (32, 128), (128, 1024)):  # the demo's LLM-like cache (random: below)
        cases.append(
            _select_case(device, f"llm-B1-N{n}K-heavy{h}", B=1, H=32, Hkv=8, N=n * KiB, heavy=h, llm=True)
        )
    grid = (
        [(1, 32, 128), (8, 128, 1024)]
        if size == "quick"
        else [(b, n, h) for b in (1, 8, 32) for n in (32, 128, 512) for h in (128, 1024, 2048)]
    )
    for b, n, h in grid:
        # the quick suite's B=1 case: the compatible entry point under GQA as well
        compat = size == "quick" and b == 1
        cases.append(
            _select_case(device, f"B{b}-N{n}K-heavy{h}", B=b, H=32, Hkv=8, N=n * KiB, heavy=h, compat=compat)
        )
    return cases


# ---- decode: sparse decode attention vs dense SDPA (issue 5) ---------------------------------------


# The decode suite's paged layout: vLLM's default block size.
PAGE_TOKENS = 16


def _decode_case(
    device: torch.device,
    name: str,
    *,
    B: int,
    H: int,
    Hkv: int,
    N: int,
    D: int = 128,
    sink: int = 128,
    window: int = 128,
    heavy: int = 128,
    M: int = 2,
    bits: int = 6,
    dtype: torch.dtype = torch.bfloat16,
) -> Case:
    L, C, dsub, es = sink + heavy + window, 2**bits, D // M, _esize(dtype)
    params = dict(B=B, H=H, Hkv=Hkv, N=N, D=D, sink=sink, heavy=heavy, window=window, M=M, bits=bits)
    params["dtype"] = str(dtype).removeprefix("torch.")

    def make_inputs(seed: int) -> dict:
        g = _gen(seed, device)
        middle = torch.rand(B, H, N - sink - window, device=device, generator=g).topk(heavy, dim=-1).indices
        positions = torch.cat(
            [
                torch.arange(sink, device=device).expand(B, H, sink),
                middle + sink,
                torch.arange(N - window, N, device=device).expand(B, H, window),
            ],
            dim=-1,
        )
        x = {
            "q": torch.randn(B, H, D, device=device, generator=g).to(dtype),
            "k": torch.randn(B, Hkv, N, D, device=device, generator=g).to(dtype),
            "v": torch.randn(B, Hkv, N, D, device=device, generator=g).to(dtype),
            "positions": positions.to(torch.int32),
            "counts": torch.full((B, H), L, device=device, dtype=torch.int32),
            "centroids": torch.randn(B, Hkv, M, C, dsub, device=device, generator=g),
            "codes": torch.randint(0, C, (B, Hkv, N, M), device=device, generator=g, dtype=torch.uint8),
            "lengths": torch.full((B,), N, device=device, dtype=torch.int32),
            # the decode-loop pattern: buffers and workspaces allocated once (PQIndex does this)
            "out": torch.empty(B, H, D, device=device, dtype=dtype),
            "attn_ws": torch.zeros(ops.decode_workspace_numel(B * H, L, D), device=device, dtype=torch.int32),
        }
        x["index"] = _index(x, M, bits, sink, window, heavy)
        # the same cache in shuffled pages of PAGE_TOKENS behind a block table (SPEC §8)
        blocks = B * -(-N // PAGE_TOKENS)
        x["table"] = torch.randperm(blocks, device=device, generator=g).view(B, -1).to(torch.int32)
        x["k_pages"] = ref.to_pages(x["k"], x["table"], blocks, PAGE_TOKENS)
        x["v_pages"] = ref.to_pages(x["v"], x["table"], blocks, PAGE_TOKENS)
        return x

    def attend(x: dict, positions: torch.Tensor, counts: torch.Tensor, paged: bool = False) -> torch.Tensor:
        k, v, table = (x["k_pages"], x["v_pages"], x["table"]) if paged else (x["k"], x["v"], None)
        return ops.sparse_decode(
            x["q"], k, v, positions, counts, out=x["out"], workspace=x["attn_ws"], block_table=table
        )

    def step(x: dict, paged: bool = False) -> torch.Tensor:
        sel = x["index"].select(x["q"])
        return attend(x, sel.positions, sel.counts, paged)

    qo_bytes = 2 * B * H * D * es
    attn_bytes = B * H * L * (2 * D * es + 4) + qo_bytes
    attn_flops = 4 * B * H * L * D
    select_bytes = B * Hkv * N * M + B * Hkv * M * C * dsub * 4 + B * H * (L + 1) * 4
    select_flops = 2 * B * H * M * C * dsub + B * H * N * M
    dense_bytes = 2 * B * Hkv * N * D * es + qo_bytes
    return Case(
        "decode",
        name,
        params,
        make_inputs,
        [
            Impl(
                "pqattn-attn",
                "pqattn",
                lambda x: attend(x, x["positions"], x["counts"]),
                attn_bytes,
                attn_flops,
                note="sparse attention over a given selection; " + KERNEL_NOTE,
            ),
            Impl(
                "pqattn-step",
                "pqattn",
                step,
                attn_bytes + select_bytes,
                attn_flops + select_flops,
                note="PQIndex.select + sparse attention, Triton kernels on CUDA (one decode step of a layer)",
                versus=("sdpa",),
            ),
            Impl(
                "pqattn-attn-paged",
                "pqattn",
                lambda x: attend(x, x["positions"], x["counts"], paged=True),
                attn_bytes,
                attn_flops,
                note=f"pqattn-attn through a block table (shuffled pages of {PAGE_TOKENS} tokens)",
            ),
            Impl(
                "pqattn-step-paged",
                "pqattn",
                lambda x: step(x, paged=True),
                attn_bytes + select_bytes,
                attn_flops + select_flops,
                note=f"pqattn-step through a block table (shuffled pages of {PAGE_TOKENS} tokens)",
                versus=("sdpa",),
            ),
            Impl(
                "torch-ref",
                "baseline",
                lambda x: ref.sparse_decode(x["q"], x["k"], x["v"], x["positions"], x["counts"]),
                attn_bytes,
                attn_flops,
                note="reference sparse attention over the same selection",
            ),
            Impl(
                "sdpa",
                "baseline",
                lambda x: baselines.sdpa_decode(x["q"], x["k"], x["v"]),
                dense_bytes,
                4 * B * H * N * D,
                note="dense decode over all N tokens, enable_gqa",
            ),
        ],
    )


def decode_suite(size: str, device: torch.device) -> list[Case]:
    if size == "tiny":
        return [
            _decode_case(
                device,
                "tiny",
                B=2,
                H=4,
                Hkv=2,
                N=200,
                D=32,
                sink=8,
                window=8,
                heavy=16,
                bits=4,
                dtype=torch.float32,
            )
        ]
    shapes = [(1, 32, 128), (1, 128, 2048), (8, 32, 1024)]
    if size == "quick":
        shapes = shapes[:2]
    cases = [
        _decode_case(device, f"B{b}-N{n}K-heavy{h}", B=b, H=32, Hkv=8, N=n * KiB, heavy=h)
        for b, n, h in shapes
    ]
    if size == "full":  # step time against N at a fixed budget (the line chart of `plot`)
        cases += [
            _decode_case(device, f"{SWEEP}B1-N{n}K-heavy1024", B=1, H=32, Hkv=8, N=n * KiB, heavy=1024)
            for n in (4, 8, 16, 32, 64, 128, 256)
        ]
    return cases


# ---- step: the layer step users call, PQIndex.decode_step with the default policy (issue 54) --------

# Decode steps an input set's index has room for past N: the harness rewinds every set to N before
# each sample, and one sample advances a set by at most 64 (its graph's or pipeline's calls per set).
STEP_ROOM = 256
STEP_DENSITY = 0.02  # heavy per query head as a share of N


def _step_case(
    device: torch.device,
    name: str,
    *,
    B: int,
    N: int,
    H: int = 32,
    Hkv: int = 8,
    D: int = 128,
    sink: int = 64,
    window: int = 64,
    density: float = STEP_DENSITY,
    dtype: torch.dtype = torch.bfloat16,
    config: PQConfig | None = None,
) -> Case:
    """One decode step of a layer as a user runs it: `PQIndex.decode_step` (store the new K/V row,
    append its key to the index, select, attend) with the default policy at heavy = density x N
    per query head, against SDPA without a mask over the whole cache, and the append alone (which
    must cost the same at every N). The index holds random centroids and codes (the step's work
    does not depend on their values); every sample starts at N tokens (`Impl.rewind`)."""
    heavy = max(1, round(density * N))
    config = config or PQConfig(sink=sink, window=window, heavy=heavy)
    M, C, G = config.subvectors, 1 << config.bits, H // Hkv
    dsub, es, rows = D // M, _esize(dtype), config.width(G)
    R = Hkv if config.share == "group" else H
    params = dict(B=B, H=H, Hkv=Hkv, N=N, D=D, sink=sink, window=window, heavy=heavy, M=M, bits=config.bits)
    params.update(share=config.share, group_rule=config.group_rule, rows=rows, dtype=str(dtype)[6:])
    cap = N + STEP_ROOM

    def make_inputs(seed: int) -> dict:
        g = _gen(seed, device)
        cent = torch.randn(B, Hkv, M, C, dsub, device=device, generator=g)
        codes = torch.randint(0, C, (B, Hkv, N, M), device=device, generator=g, dtype=torch.uint8)
        book = ops.PQCodebook(cent, codes, None)
        x = {
            "index": PQIndex.from_codebook(book, [N] * B, capacity=cap, config=config),
            "k_cache": torch.randn(B, Hkv, cap, D, device=device, generator=g).to(dtype),
            "v_cache": torch.randn(B, Hkv, cap, D, device=device, generator=g).to(dtype),
            "q": torch.randn(B, H, D, device=device, generator=g).to(dtype),
            "k_new": torch.randn(B, Hkv, 1, D, device=device, generator=g).to(dtype),
            "v_new": torch.randn(B, Hkv, 1, D, device=device, generator=g).to(dtype),
        }
        x["k"], x["v"] = x["k_cache"][:, :, :N], x["v_cache"][:, :, :N]  # SDPA's cache: N tokens
        return x

    def step(x: dict) -> torch.Tensor:
        return x["index"].decode_step(x["q"], x["k_new"], x["v_new"], x["k_cache"], x["v_cache"])

    def rewind(x: dict) -> None:
        x["index"].truncate([N] * B)

    qo_bytes = 2 * B * H * D * es
    new_row_bytes = 2 * 2 * B * Hkv * D * es  # the new K/V rows read and stored
    centroid_bytes = B * Hkv * M * C * dsub * 4
    append_bytes = new_row_bytes + centroid_bytes + B * Hkv * M
    select_bytes = B * Hkv * N * M + centroid_bytes + B * R * rows * 4
    attn_bytes = B * R * rows * 2 * D * es + qo_bytes
    step_flops = 2 * B * H * M * C * dsub + 4 * B * H * rows * D
    return Case(
        "step",
        name,
        params,
        make_inputs,
        [
            Impl(
                "pqattn-step",
                "pqattn",
                step,
                append_bytes + select_bytes + attn_bytes,
                step_flops,
                note="PQIndex.decode_step, the default policy: store + append + select + attend "
                "(floor: the codes, the selected rows, the centroids, q and out)",
                versus=("sdpa",),
                rewind=rewind,
            ),
            Impl(
                "pqattn-append",
                "pqattn",
                lambda x: x["index"].append(x["k_new"]),
                append_bytes,
                2 * B * Hkv * C * D,
                note="PQIndex.append of one key per sequence (O(1) in N)",
                versus=(),
                rewind=rewind,
            ),
            Impl(
                "sdpa",
                "baseline",
                lambda x: baselines.sdpa_decode(x["q"], x["k"], x["v"]),
                2 * B * Hkv * N * D * es + qo_bytes,
                4 * B * H * N * D,
                note="dense decode over the whole cache, no mask (enable_gqa)",
            ),
        ],
    )


def step_suite(size: str, device: torch.device) -> list[Case]:
    if size == "tiny":
        tiny = dict(H=4, Hkv=2, D=32, sink=4, window=4, dtype=torch.float32)
        return [_step_case(device, "tiny", B=2, N=400, density=0.05, **tiny)]
    shapes = [(1, 4), (1, 32), (1, 128), (8, 32), (32, 32), (1, 512)]
    if size == "quick":
        shapes = [(1, 32), (8, 32)]
    return [_step_case(device, f"B{b}-N{n}K", B=b, N=n * KiB) for b, n in shapes]


# ---- build: PQ index build after prefill (issue 6) -------------------------------------------------


def _build_case(
    device: torch.device,
    name: str,
    *,
    B: int,
    Hkv: int,
    N: int,
    D: int,
    M: int,
    bits: int,
    iters: int = 10,
    H: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    sample: int = 0,
) -> Case:
    C, es = 2**bits, _esize(dtype)
    params = dict(B=B, Hkv=Hkv, N=N, D=D, M=M, bits=bits, iters=iters, metric="euclidean", H_prefill=H)
    params["sample"] = sample
    params["dtype"] = str(dtype).removeprefix("torch.")

    def make_inputs(seed: int) -> dict:
        g = _gen(seed, device)
        return {
            "keys": torch.randn(B, Hkv, N, D, device=device, generator=g).to(dtype),
            "q": torch.randn(B, H, N, D, device=device, generator=g).to(dtype),
        }

    fit = min(N, sample * C) if sample else N  # the keys k-means runs on
    build_bytes = B * Hkv * N * (D * es + M) + B * Hkv * M * C * (D // M) * 4
    # the distance products alone (with a sample: its Lloyd rounds, then the encode of every key)
    build_flops = iters * 2 * B * Hkv * fit * D * C + (2 * B * Hkv * N * D * C if sample else 0)
    # tol=0: every implementation runs all `iters` rounds, so the timings compare equal work.
    opts = dict(subvectors=M, bits=bits, iters=iters)
    sampled = dict(opts, sample=sample) if sample else opts
    dist_bytes = B * Hkv * M * N * C * 4 * 4
    return Case(
        "build",
        name,
        params,
        make_inputs,
        [
            Impl(
                "pqattn",
                "pqattn",
                lambda x: ops.build_index(x["keys"], tol=0.0, **sampled),
                build_bytes,
                build_flops,
                note="Triton Lloyd loop on CUDA (one launch per iteration, init drawn on the GPU, "
                "no host sync: graph-capturable), the reference on a CPU"
                + (
                    f"; k-means on {sample} strided keys per centre, then every key encoded" if sample else ""
                ),
                skip=None
                if device.type == "cuda"
                else _too_big(dist_bytes, device, "the reference's distance blocks"),
            ),
            Impl(
                "plain-torch",
                "baseline",
                lambda x: baselines.kmeans_plain_torch(x["keys"], **opts),
                build_bytes,
                build_flops,
                note="matmul distances, scatter-add centre update",
                skip=_too_big(dist_bytes, device, "plain-torch distances"),
            ),
            Impl(
                "sdpa-prefill",
                "baseline",
                lambda x: baselines.sdpa_prefill(x["q"], x["keys"], x["keys"], causal=True),
                2 * B * H * N * D * es + 2 * B * Hkv * N * D * es,
                2 * B * H * N * N * D,
                note="causal prefill of the same N at H query heads: the budget the build must fit in",
            ),
        ],
    )


def build_suite(size: str, device: torch.device) -> list[Case]:
    if size == "tiny":
        return [
            _build_case(
                device, "tiny", B=1, Hkv=2, N=300, D=32, M=2, bits=4, iters=3, H=4, dtype=torch.float32
            )
        ]
    grid = [(n, m, b, 0) for n in (8, 32, 128) for m, b in ((2, 6), (4, 8), (16, 8))]
    # the fine codes of the group / re-rank policies, built on a sample (issue 40)
    sampled = ((16, 8, 16), (16, 8, 32), (16, 8, 64), (32, 4, 256))
    grid += [(n, m, b, s) for n in (32, 128) for m, b, s in sampled]
    if size == "quick":
        grid = [(32, 2, 6, 0), (8, 16, 8, 0)]
    cases = []
    for n, m, b, s in grid:
        name = f"N{n}K-M{m}-C{2**b}" + (f"-s{s}" if s else "")
        cases.append(_build_case(device, name, B=1, Hkv=8, N=n * KiB, D=128, M=m, bits=b, sample=s))
    return cases


# ---- prefill: dense attention (issue 7) -------------------------------------------------------------


def _prefill_case(
    device: torch.device,
    name: str,
    *,
    B: int,
    H: int,
    Hkv: int,
    S: int,
    D: int,
    causal: bool,
    dtype: torch.dtype,
) -> Case:
    es = _esize(dtype)
    params = dict(B=B, H=H, Hkv=Hkv, Sq=S, Sk=S, D=D, causal=causal)
    params["dtype"] = str(dtype).removeprefix("torch.")

    def make_inputs(seed: int) -> dict:
        g = _gen(seed, device)
        return {
            "q": torch.randn(B, H, S, D, device=device, generator=g).to(dtype),
            "k": torch.randn(B, Hkv, S, D, device=device, generator=g).to(dtype),
            "v": torch.randn(B, Hkv, S, D, device=device, generator=g).to(dtype),
        }

    pairs = S * (S + 1) // 2 if causal else S * S
    flops = 4 * B * H * pairs * D
    nbytes = 2 * B * H * S * D * es + 2 * B * Hkv * S * D * es
    ref_skip = _too_big(4 * B * H * S * S * 4, device, "the reference's materialized logits")
    return Case(
        "prefill",
        name,
        params,
        make_inputs,
        [
            Impl(
                "pqattn",
                "pqattn",
                lambda x: ops.dense_attention(x["q"], x["k"], x["v"], causal=causal),
                nbytes,
                flops,
                note="the Triton flash-attention kernel on CUDA fp16/bf16 (the PyTorch reference otherwise)",
                skip=None if device.type == "cuda" else ref_skip,
            ),
            Impl(
                "torch-ref",
                "baseline",
                lambda x: ref.dense_attention(x["q"], x["k"], x["v"], causal=causal),
                nbytes,
                flops,
                skip=ref_skip,
            ),
            Impl(
                "sdpa",
                "baseline",
                lambda x: baselines.sdpa_prefill(x["q"], x["k"], x["v"], causal=causal),
                nbytes,
                flops,
            ),
        ],
    )


def prefill_suite(size: str, device: torch.device) -> list[Case]:
    if size == "tiny":
        return [
            _prefill_case(
                device,
                f"tiny-{mode}",
                B=1,
                H=4,
                Hkv=2,
                S=70,
                D=32,
                causal=mode == "causal",
                dtype=torch.float32,
            )
            for mode in ("full", "causal")
        ]
    fp16 = [(1, 8), (16, 8), (16, 32)]
    causal = [4, 16]
    if size == "quick":
        fp16, causal = [(16, 8)], [4]
    cases = [
        _prefill_case(
            device,
            f"fp16-D64-S512-B{b}-H{h}",
            B=b,
            H=h,
            Hkv=h,
            S=512,
            D=64,
            causal=False,
            dtype=torch.float16,
        )
        for b, h in fp16
    ]
    cases += [
        _prefill_case(
            device,
            f"bf16-D128-causal-S{s}K",
            B=1,
            H=32,
            Hkv=32,
            S=s * KiB,
            D=128,
            causal=True,
            dtype=torch.bfloat16,
        )
        for s in causal
    ]
    return cases


# ---- generate: one decode step of a transformers model over a long prompt (issue 8) ---------------

# Llama-3-8B's layer shapes (8 of its 32 layers, a 32000-token vocabulary): the generate benches'
# model, with random weights.
LLAMA3_8B_LAYERS = dict(layers=8, hidden=4096, intermediate=14336, H=32, Hkv=8, vocab=32000)


def llama_config(
    *, layers: int, hidden: int, intermediate: int, H: int, Hkv: int, vocab: int, max_positions: int
) -> transformers.LlamaConfig:
    """A transformers LlamaConfig of these shapes (no download)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=H,
        num_key_value_heads=Hkv,
        max_position_embeddings=max_positions,
    )


class _OneDecoder:
    """A generate case's inputs: the decode loop of one model at a time (the dense and the pqattn
    caches of a B=32 32K batch would not fit together), built at its first step."""

    def __init__(self, build: Callable[[str], object]) -> None:
        self.build, self.kind, self.decoder = build, None, None

    def step(self, kind: str) -> None:
        if kind != self.kind:
            self.decoder = None
            gc.collect()  # the model, its cache and its graph hold each other
            torch._dynamo.reset()  # a compiled loop's cache entries would crowd out the next one's
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.decoder, self.kind = self.build(kind), kind
        if self.decoder.steps_left == 0:
            raise RuntimeError(f"generate: the {kind} decoder generated all its {GENERATE_TOKENS} tokens")
        self.decoder.step()


# Tokens a generate case's decoder has room for: more than a bench run's calls of one implementation.
GENERATE_TOKENS = 512


def _generate_case(
    device: torch.device,
    name: str,
    *,
    layers: int,
    hidden: int,
    intermediate: int,
    H: int,
    Hkv: int,
    vocab: int,
    batch: int,
    context: int,
    density: float = STEP_DENSITY,
    sink: int = 64,
    window: int = 64,
    compiled: bool = False,
    host: bool = False,
) -> Case:
    """A randomly initialised Llama-style model (no download), `batch` prompts of `context` random
    tokens, timed per decode step of the whole batch in the static loop
    (`pqattn.integrations.hf.StaticDecoder`: a StaticCache, the step captured as one CUDA graph on
    a GPU and replayed): SDPA against pqattn (dense prefill, PQ index per layer, sparse decode);
    with `compiled`, also both with the decode forward through torch.compile (compile=True); with
    `host` (the host suite), the loop with the KV cache in host memory (HFConfig(kv_placement=
    "host"), SPEC §10) against the loop with it on the GPU and the dense split-K loop."""
    import transformers

    import pqattn.integrations.hf as pq_hf

    D = hidden // H
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    params = dict(layers=layers, hidden=hidden, H=H, Hkv=Hkv, D=D, vocab=vocab, B=batch, context=context)
    params.update(
        density=density, sink=sink, window=window, dtype=str(dtype).removeprefix("torch."), policy="default"
    )
    cfg = llama_config(
        layers=layers,
        hidden=hidden,
        intermediate=intermediate,
        H=H,
        Hkv=Hkv,
        vocab=vocab,
        max_positions=context + GENERATE_TOKENS,
    )
    n_params = (
        layers * (2 * hidden * hidden + 2 * hidden * Hkv * D + 3 * hidden * intermediate) + 2 * vocab * hidden
    )
    kv_bytes = batch * layers * 2 * Hkv * context * D * _esize(dtype)
    # the default policy's rows per KV head (G x heavy + sink + window) and its codes
    pq_config = pq_hf.HFConfig(heavy_fraction=density, sink=sink, window=window)
    heavy = pq_config.heavy_for(context)
    rows = sink + window + (H // Hkv) * heavy
    sparse_kv_bytes = kv_bytes * rows // context + batch * layers * Hkv * context * pq_config.subvectors

    def make_inputs(seed: int) -> _OneDecoder:
        ids = torch.randint(0, vocab, (batch, context), device=device, generator=_gen(seed, device))

        def build(kind: str) -> object:
            torch.manual_seed(seed)  # the same weights for every kind
            model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
            attention = kind.removesuffix("-compiled")
            if attention == "pqattn":
                pq_hf.enable(model, pq_config)
            elif attention == "pqattn-host":
                pq_hf.enable(model, dataclasses.replace(pq_config, kv_placement="host"))
            else:
                model.set_attn_implementation(
                    baselines.register_dense_decode() if attention == "split" else "sdpa"
                )
            return pq_hf.StaticDecoder(
                model, ids, GENERATE_TOKENS, prefill_tokens=65536, compile=kind.endswith("-compiled")
            )

        return _OneDecoder(build)

    no_graph = "the call replays the decode loop's own CUDA graph of the whole model's step"
    weights = n_params * _esize(dtype)
    params["weights_bytes"] = weights  # the loop's per-step floor by family (lab.bench)

    def loop(name: str, role: str, kind: str, nbytes: int, note: str, versus=None) -> Impl:
        """A step of the decoder `kind` (`_OneDecoder`), timed as one call."""
        step = lambda x, kind=kind: x.step(kind)  # noqa: E731
        return Impl(
            name, role, step, nbytes, 2 * n_params * batch, note=note, versus=versus, no_graph=no_graph
        )

    sparse, dense = weights + sparse_kv_bytes, weights + kv_bytes
    pq_loop = "pqattn.integrations.hf.StaticDecoder: SDPA prefill + PQ index, sparse decode"
    split_k = (
        "the same static loop, decode attention over every token through pqattn.ops.dense_decode "
        "(a flash-decoding stand-in: lab.baselines.dense_decode_attention)"
    )
    if host:
        impls = [
            loop(
                "pqattn-host",
                "pqattn",
                "pqattn-host",
                sparse,
                "StaticDecoder with HFConfig(kv_placement='host'): the KV cache in host memory, the selected "
                "rows fetched into a GPU row cache (the floor counts GPU bytes; the PCIe bytes depend on "
                "the hit rate: bench/host_tier.py)",
                ("pqattn", "dense-split-k"),
            ),
            loop("pqattn", "baseline", "pqattn", sparse, pq_loop),
            loop("dense-split-k", "baseline", "split", dense, split_k),
        ]
    else:
        impls = [
            loop("pqattn", "pqattn", "pqattn", sparse, pq_loop, ("sdpa", "dense-split-k")),
            loop("sdpa", "baseline", "dense", dense, "the same static loop with attn_implementation='sdpa'"),
            loop("dense-split-k", "baseline", "split", dense, split_k),
        ]
    if compiled and not host:
        impls += [
            loop(
                "pqattn-compiled",
                "pqattn",
                "pqattn-compiled",
                sparse,
                "the pqattn loop, its decode forward through torch.compile (StaticDecoder(compile=True))",
                ("dense-split-k-compiled", "sdpa-compiled"),
            ),
            loop(
                "dense-split-k-compiled",
                "baseline",
                "split-compiled",
                dense,
                "the dense split-K loop with the decode forward through torch.compile",
            ),
            loop(
                "sdpa-compiled",
                "baseline",
                "dense-compiled",
                dense,
                "the SDPA loop with the decode forward through torch.compile",
            ),
        ]
    return Case("host" if host else "generate", name, params, make_inputs, impls)


def generate_suite(size: str, device: torch.device) -> list[Case]:
    if size == "tiny":
        tiny = dict(layers=2, hidden=64, intermediate=128, H=4, Hkv=2, vocab=128)
        return [_generate_case(device, "tiny", **tiny, batch=2, context=300, density=0.05, sink=4, window=4)]
    shapes = [(1, 32), (8, 32)] if size == "quick" else [(1, 32), (8, 32), (32, 32), (1, 128)]
    llama = dict(LLAMA3_8B_LAYERS, compiled=True)
    return [
        _generate_case(device, f"llama8L-B{b}-{c}K", **llama, batch=b, context=c * KiB) for b, c in shapes
    ]


def host_suite(size: str, device: torch.device) -> list[Case]:
    """The model loop with the KV cache in host memory against it on the GPU and dense split-K
    (shapes where all fit; the larger ones are bench/host_tier.py's)."""
    if size == "tiny":
        tiny = dict(layers=2, hidden=64, intermediate=128, H=4, Hkv=2, vocab=128)
        case = _generate_case(
            device, "tiny-host", **tiny, batch=2, context=300, density=0.05, sink=4, window=4, host=True
        )
        return [case]
    contexts = [32] if size == "quick" else [32, 128]
    return [
        _generate_case(
            device, f"llama8L-B1-{c}K-host", **LLAMA3_8B_LAYERS, batch=1, context=c * KiB, host=True
        )
        for c in contexts
    ]


SUITES: dict[str, Callable[[str, torch.device], list[Case]]] = {
    "step": step_suite,
    "select": select_suite,
    "decode": decode_suite,
    "build": build_suite,
    "prefill": prefill_suite,
    "generate": generate_suite,
    "host": host_suite,
}


def make_cases(suites: list[str], size: str, device: torch.device) -> list[Case]:
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ValueError(f"suite: expected some of {sorted(SUITES)}, got {unknown}")
    if size not in SIZES:
        raise ValueError(f"size: expected one of {SIZES}, got {size!r}")
    return [case for s in suites for case in SUITES[s](size, device)]


def touched_bytes(case: Case) -> int:
    """Bytes the cheapest pqattn implementation reads per call: what decides input rotation."""
    return min(i.bytes for i in case.impls if i.role == "pqattn")


def rotation(case: Case, l2_bytes: int, *, limit: int = 8) -> int:
    """Input sets to cycle through so that repeated calls do not find their inputs in L2."""
    if l2_bytes <= 0:
        return 1
    return max(1, min(limit, math.ceil(2 * l2_bytes / max(touched_bytes(case), 1))))
