"""The `KernelCheck` of every Triton kernel family, fuzzed by `pqattn check` and by the tests.

A family's check lands together with its kernel in `pqattn/kernels/`. The comparison functions
are the acceptance rules of docs/SPEC.md in code: selections as sets (sink/window exactly, the heavy
part as a multiset of float64 reference scores, ties broken any way), codes by distance.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton

import pqattn.reference as ref
from pqattn.lab.check import KernelCheck

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _pick(gen: torch.Generator, options: list | tuple):
    return options[int(torch.randint(len(options), (1,), generator=gen))]


def _int(gen: torch.Generator, lo: int, hi: int) -> int:
    """Uniform in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


# ---- selection ---------------------------------------------------------------------------------


def group_selection_scores(
    q: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor, rule: str
) -> tuple[torch.Tensor, float]:
    """(the float64 group PQ scores [B, Hkv, N] of `ref.group_pq_scores`, their slack) for a
    group selection's check. A LUT entry whose float32 product lies within its rounding error of
    a bfloat16 rounding midpoint may round to either neighbour in a kernel; the slack is the
    largest sum over a token's codes of those entries' two roundings' gap (0 for almost every
    call), which `selection_problem` allows beside its float64 tolerance."""
    scores = ref.group_pq_scores(q.double(), centroids.double(), codes, rule)
    B, H, D = q.shape
    Hkv, M = centroids.shape[1], centroids.shape[2]
    qm = q.double().reshape(B, Hkv, H // Hkv, M, D // M)
    cents = centroids.double()[..., : D // M]
    if rule == "sum":
        qm, q_abs = qm.sum(2, keepdim=True), qm.abs().sum(2, keepdim=True)
    else:
        q_abs = qm.abs()
    lut = torch.einsum("bkgmd,bkmcd->bkgmc", qm, cents)
    # float32's error bound for the summed query and the dot product of D / M terms
    terms = D // M + (H // Hkv if rule == "sum" else 0) + 2
    err = terms * 2.0**-24 * torch.einsum("bkgmd,bkmcd->bkgmc", q_abs, cents.abs())
    dtype = ref.GROUP_LUT_DTYPE
    gap = ((lut + err).to(dtype).double() - (lut - err).to(dtype).double()).amax(2)  # [B, Hkv, M, C]
    per_token = gap.gather(-1, codes.long().permute(0, 1, 3, 2)).sum(2)  # [B, Hkv, N]
    return scores, float(per_token.max()) if per_token.numel() else 0.0


def selection_problem(
    sel_positions, sel_counts, scores, lengths, *, cand_lo, window, short_threshold, ref_sel, slack=0.0
):
    """None when a selection obeys SPEC §2 against the reference selection, else what is wrong.

    scores: float64 reference scores [B, H, N]; ref_sel: the reference Selection for the same call;
    slack: how far the kernel's scores may lie from `scores` (`group_selection_scores`): a
    selection by scores within slack of them lies within 2 x slack of the true top-k.
    """
    B, H, N = scores.shape
    counts, want = sel_counts.long(), ref_sel.counts.long()
    if not torch.equal(counts, want):
        i = (counts != want).nonzero()[0].tolist()
        return f"count at {i}: got {int(counts[tuple(i)])}, expected {int(want[tuple(i)])}"
    L = sel_positions.shape[-1]
    pos = sel_positions.long()
    valid = torch.arange(L, device=pos.device) < counts[..., None]
    if not (pos[~valid] == -1).all():
        return "padding past the count is not -1"
    if not ((pos[valid] >= 0) & (pos[valid] < N)).all():
        return "a position is out of range"
    mask = torch.zeros(B, H, N + 1, dtype=torch.int32, device=pos.device)
    mask.scatter_add_(-1, torch.where(valid, pos, N), torch.ones_like(pos, dtype=torch.int32))
    mask = mask[..., :N]
    if (mask > 1).any():
        return "duplicate positions"
    ref_mask = torch.zeros(B, H, N + 1, dtype=torch.int32, device=pos.device)
    ref_valid = torch.arange(ref_sel.positions.shape[-1], device=pos.device) < want[..., None]
    ref_mask.scatter_(-1, torch.where(ref_valid, ref_sel.positions.long(), N), 1)
    ref_mask = ref_mask[..., :N]
    n = lengths.long().to(pos.device)[:, None, None]
    p = torch.arange(N, device=pos.device)
    cand = (p >= cand_lo) & (p < n - window) & (n > short_threshold)
    if not torch.equal(mask * ~cand, ref_mask * ~cand):
        return "sink / window / short-sequence positions differ from the reference"
    got = scores.masked_fill(~(cand & (mask > 0)), float("-inf")).sort(-1, descending=True).values
    exp = scores.masked_fill(~(cand & (ref_mask > 0)), float("-inf")).sort(-1, descending=True).values
    finite = torch.isfinite(exp)
    if not torch.equal(finite, torch.isfinite(got)):
        return "heavy part has the wrong size"
    tol = 1e-5 * float(scores.abs().max()) + 1e-6 + 2 * slack if scores.numel() else 0.0
    err = (got[finite] - exp[finite]).abs()
    if err.numel() and float(err.max()) > tol:
        return f"heavy scores differ from the true top-k by up to {float(err.max()):.3g} (tol {tol:.3g})"
    return None


def _draw_select(gen: torch.Generator, device: torch.device, large: bool) -> dict:
    if large:
        B, Hkv, g, D = _pick(gen, [1, 2, 4]), 8, 4, _pick(gen, [64, 128, 256])
        N = _pick(gen, [4096, 40_000, 200_000])
        heavy, sink, window = _pick(gen, [128, 1024, 2048, 8192]), 128, 128
        M, bits = _pick(gen, [1, 2, 4, 8, 16]), _int(gen, 4, 8)
    else:
        B, Hkv, g, D = _int(gen, 1, 3), _int(gen, 1, 2), _pick(gen, [1, 2, 4]), _pick(gen, [32, 64])
        N = _int(gen, 1, 300) if _int(gen, 0, 2) else _int(gen, 2000, 5000)  # sometimes several leaves
        heavy, sink, window = _int(gen, 0, 40), _int(gen, 0, 12), _int(gen, 0, 12)
        M, bits = _pick(gen, [1, 2, 4, 8, 16]), _int(gen, 1, 8)
    while D // M < 2:
        M //= 2
    C = 2**bits
    init_offset = _int(gen, 0, 2 * sink + 2)
    compat = bool(_int(gen, 0, 1))
    threshold = heavy + init_offset + 1 + C if compat else sink + heavy + window
    ip = bool(_int(gen, 0, 1))
    dsub = D // M
    # Few distinct centroid values make many exactly equal scores: ties must be handled.
    cent = torch.randn(B, Hkv, M, C, dsub + ip, generator=gen)
    if _int(gen, 0, 2) == 0:
        cent = cent.round()
    lengths = torch.randint(0, N + 1, (B,), generator=gen)
    lengths[0] = N
    codes = torch.randint(0, C, (B, Hkv, N, M), generator=gen, dtype=torch.uint8)
    # The original's layout: int64 codebook [B, N - init_offset, Hkv, M] starting at init_offset.
    code_base = init_offset if compat else 0
    kernel_codes = codes.long().transpose(1, 2).contiguous().transpose(1, 2) if compat else codes
    return {
        "q": torch.randn(B, Hkv * g, D, generator=gen).to(_pick(gen, _FLOATS)).to(device),
        "centroids": cent.to(device),
        "codes": codes.to(device),
        "kernel_codes": kernel_codes[:, :, code_base:].to(device),
        "code_base": code_base,
        "lengths": lengths.to(torch.int32 if _int(gen, 0, 1) else torch.int64).to(device),
        "opts": dict(sink=sink, window=window, heavy=heavy, cand_lo=max(init_offset, sink)),
        "short_threshold": threshold,
        "width": ref.selection_width(sink, window, heavy, min(threshold, N)),
        "weights_dtype": _pick(gen, [None, *_FLOATS]),
        "lut_kernel": bool(_int(gen, 0, 1)),
        "desc": f"B{B} H{Hkv * g} Hkv{Hkv} N{N} D{D} M{M} C{C} heavy{heavy} sink{sink} window{window} "
        f"io{init_offset} {'compat' if compat else 'native'}",
    }


def _select_outputs(case: dict) -> tuple:
    """Positions, counts and (when the case asks) dense weights for a selection kernel to fill."""
    q = case["q"]
    B, H, _ = q.shape
    positions = torch.empty(B, H, case["width"], dtype=torch.int32, device=q.device)
    counts = torch.empty(B, H, dtype=torch.int32, device=q.device)
    w = None
    if case["weights_dtype"] is not None:
        w = torch.empty(B, H, case["codes"].shape[2], dtype=case["weights_dtype"], device=q.device)
    return positions, counts, w


def _params(case: dict) -> ref.SelectParams:
    o = case["opts"]
    return ref.SelectParams(
        o["sink"], o["window"], o["heavy"], o["cand_lo"], case["short_threshold"], case["width"]
    )


def _run_select(case: dict, config: dict) -> tuple:
    from pqattn.kernels.select.tree import pq_select, workspace_numel

    q, cent = case["q"], case["centroids"]
    B, H, _ = q.shape
    M, C, N = cent.shape[2], cent.shape[3], case["codes"].shape[2]
    positions, counts, w = _select_outputs(case)
    heavy = case["opts"]["heavy"]
    workspace = torch.zeros(workspace_numel(B * H, M, C, N, heavy), dtype=torch.int32, device=q.device)
    pq_select(
        q,
        cent,
        case["kernel_codes"],
        case["lengths"],
        _params(case),
        positions=positions,
        counts=counts,
        workspace=workspace,
        n_tokens=N,
        weights=w,
        code_base=case["code_base"],
        config=triton.Config(
            {"TILE": config["TILE"]}, num_warps=config["num_warps"], maxnreg=config["maxnreg"]
        ),
        lut_kernel=case["lut_kernel"],
    )
    return positions, counts, w


def _reference_from_scores(case: dict, scores: torch.Tensor) -> ref.Selection:
    o = case["opts"]
    return ref.select_from_scores(
        scores,
        case["lengths"],
        sink=o["sink"],
        window=o["window"],
        heavy=o["heavy"],
        init_offset=o["cand_lo"],
        short_threshold=case["short_threshold"],
    )


def _reference_select(case: dict) -> tuple:
    scores = ref.pq_scores(case["q"].double(), case["centroids"].double(), case["codes"])
    return scores, _reference_from_scores(case, scores)


def _case_problem(case: dict, positions, counts, scores, sel, slack: float = 0.0) -> str | None:
    """`selection_problem` of a drawn selection case's output."""
    return selection_problem(
        positions,
        counts,
        scores,
        case["lengths"],
        cand_lo=case["opts"]["cand_lo"],
        window=case["opts"]["window"],
        short_threshold=case["short_threshold"],
        ref_sel=sel,
        slack=slack,
    )


def _compare_select(case: dict, out: tuple, want: tuple) -> str | None:
    positions, counts, w = out
    scores, sel = want
    problem = _case_problem(case, positions, counts, scores, sel)
    if problem is None and w is not None:
        dense = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        ok = torch.arange(positions.shape[-1], device=w.device) < counts[..., None].long()
        dense.scatter_add_(-1, torch.where(ok, positions.long(), 0), ok.float())
        if not torch.equal(w.float(), dense.clamp_max(1)):
            return "dense weights differ from the selected positions"
    return problem


def _draw_select_fine(gen: torch.Generator, device: torch.device, large: bool) -> dict:
    """A selection case (`_draw_select`) for the fine route, whose configs pick the share and rule."""
    case = _draw_select(gen, device, large)
    case["weights_dtype"] = None  # (the dispatch layer fills dense weights from the lists)
    return case


def _run_select_fine(case: dict, config: dict) -> tuple:
    from pqattn.kernels.select import fine
    from pqattn.policy import lookup_tables

    q, cent = case["q"], case["centroids"]
    B, H, _ = q.shape
    Hkv, M, C, N = cent.shape[1], cent.shape[2], cent.shape[3], case["codes"].shape[2]
    R = Hkv if config["share"] == "group" else H
    tables = lookup_tables(config["share"], config["rule"], H // Hkv)
    positions = torch.empty(B, R, case["width"], dtype=torch.int32, device=q.device)
    counts = torch.empty(B, R, dtype=torch.int32, device=q.device)
    workspace = torch.zeros(fine.workspace_numel(B * R, tables, M, C, N), dtype=torch.int32, device=q.device)
    fine.pq_select_fine(
        q,
        cent,
        case["kernel_codes"],
        case["lengths"],
        _params(case),
        positions=positions,
        counts=counts,
        workspace=workspace,
        share=config["share"],
        group_rule=config["rule"],
        tables=tables,
        n_tokens=N,
        code_base=case["code_base"],
    )
    return positions, counts, config


def _reference_select_fine(case: dict) -> Callable[[str, str], tuple]:
    """(share, rule) -> the reference scores, their slack and selection: the compare asks for the
    one its output's config ran."""

    def reference(share: str, rule: str) -> tuple:
        if share == "head":
            return *_reference_select(case), 0.0
        scores, slack = group_selection_scores(case["q"], case["centroids"], case["codes"], rule)
        return scores, _reference_from_scores(case, scores), slack

    return reference


def _compare_select_fine(case: dict, out: tuple, want: Callable[[str, str], tuple]) -> str | None:
    positions, counts, config = out
    scores, sel, slack = want(config["share"], config["rule"])
    return _case_problem(case, positions, counts, scores, sel, slack)


def _select_fits(case: dict, config: dict) -> bool:
    from pqattn.kernels.select.tree import configs_for

    return config["TILE"] in [
        c.kwargs["TILE"] for c in configs_for(case["opts"]["heavy"], case["codes"].shape[2])
    ]


def _run_select_hist(case: dict, config: dict) -> tuple:
    """The histogram selection; `lut_kernel` picks a counted histogram (PQIndex) over none."""
    from pqattn.kernels.select.hist import count_combos, pq_select_hist, workspace_numel

    q, cent = case["q"], case["centroids"]
    B, H, _ = q.shape
    Hkv, M, C, N = cent.shape[1], cent.shape[2], cent.shape[3], case["codes"].shape[2]
    o = case["opts"]
    positions, counts, w = _select_outputs(case)
    workspace = torch.zeros(workspace_numel(B * H, M, C), dtype=torch.int32, device=q.device)
    hist = None
    if case["lut_kernel"]:
        hist = torch.zeros(B, Hkv, C**M, dtype=torch.int32, device=q.device)
        count_combos(
            case["kernel_codes"],
            case["lengths"],
            hist,
            C=C,
            window=o["window"],
            cand_lo=o["cand_lo"],
            code_base=case["code_base"],
        )
    pq_select_hist(
        q,
        cent,
        case["kernel_codes"],
        case["lengths"],
        _params(case),
        positions=positions,
        counts=counts,
        workspace=workspace,
        n_tokens=N,
        histogram=hist,
        weights=w,
        code_base=case["code_base"],
        config=triton.Config({"TILE": config["TILE"]}, num_warps=config["num_warps"]),
    )
    return positions, counts, w


def _select_hist_fits(case: dict, config: dict) -> bool:
    from pqattn.limits import MAX_COMBOS

    cent = case["centroids"]
    return cent.shape[3] ** cent.shape[2] <= MAX_COMBOS


def _select_hist_configs() -> list[dict]:
    from pqattn.kernels.select.hist import SCAN_CONFIGS

    return [{**c.kwargs, "num_warps": c.num_warps} for c in SCAN_CONFIGS]


def _run_select_buckets(case: dict, config: dict) -> tuple:
    """The bucket selection (PQIndex, and indexer_next with the original's dense weights):
    histogram for the lengths, buckets for a quarter less (the rest scanned as recent tokens)."""
    from pqattn.kernels.select.buckets import bucket_tokens, pq_select_buckets, workspace_numel
    from pqattn.kernels.select.hist import count_combos

    q, cent, codes, lengths = case["q"], case["centroids"], case["codes"], case["lengths"]
    B, H, _ = q.shape
    Hkv, M, C, N = cent.shape[1], cent.shape[2], cent.shape[3], codes.shape[2]
    o = case["opts"]
    positions, counts, weights = _select_outputs(case)
    dev = q.device
    workspace = torch.zeros(workspace_numel(B * H, M, C, o["heavy"]), dtype=torch.int32, device=dev)
    hist = torch.zeros(B, Hkv, C**M, dtype=torch.int32, device=dev)
    count_combos(codes, lengths, hist, C=C, window=o["window"], cand_lo=o["cand_lo"])
    buckets = (
        torch.empty(B, Hkv, N, dtype=torch.int32, device=dev),
        torch.empty(B, Hkv, C**M + 1, dtype=torch.int32, device=dev),
        torch.empty(B, dtype=torch.int32, device=dev),
    )
    cursor = torch.empty(B, Hkv, C**M, dtype=torch.int32, device=dev)
    bucket_tokens(
        codes, lengths - lengths // 4, *buckets, cursor, C=C, window=o["window"], cand_lo=o["cand_lo"]
    )
    pq_select_buckets(
        q,
        cent,
        codes,
        lengths,
        _params(case),
        positions=positions,
        counts=counts,
        workspace=workspace,
        histogram=hist,
        buckets=buckets,
        weights=weights,
        config=triton.Config(
            {"CHUNK": config["CHUNK"], "LATE_RUNS": config["LATE_RUNS"]},
            num_warps=config["num_warps"],
            num_stages=1,
            maxnreg=config["maxnreg"],
        ),
    )
    return positions, counts, weights


def _select_buckets_configs() -> list[dict]:
    from pqattn.kernels.select.buckets import BUCKET_CONFIGS

    return [{**c.kwargs, "num_warps": c.num_warps, "maxnreg": c.maxnreg} for c in BUCKET_CONFIGS]


def _select_configs() -> list[dict]:
    from pqattn.kernels.select.tree import SELECT_CONFIGS

    return [{**c.kwargs, "num_warps": c.num_warps, "maxnreg": c.maxnreg} for c in SELECT_CONFIGS]


# ---- encoding ----------------------------------------------------------------------------------


def _draw_encode(gen: torch.Generator, device: torch.device, large: bool) -> dict:
    B, Hkv = (_int(gen, 1, 4), 8) if large else (_int(gen, 1, 2), _int(gen, 1, 3))
    D = _pick(gen, [64, 128, 256] if large else [16, 32, 64])
    M = _pick(gen, [m for m in (1, 2, 4, 8, 16) if D // m >= 2])
    C, T, ip = 2 ** _int(gen, 1, 8), _int(gen, 1, 64 if large else 5), bool(_int(gen, 0, 1))
    dsub = D // M
    keys = torch.randn(B, Hkv, T, D, generator=gen)
    cent = torch.randn(B, Hkv, M, C, dsub + ip, generator=gen)
    phi = (keys.reshape(B, Hkv, T, M, dsub) ** 2).sum(-1).amax(2) * 1.1 if ip else None
    N = T + _int(gen, 0, 7)
    lengths = torch.randint(0, N - T + 1, (B,), generator=gen)
    return {
        "keys": keys.to(_pick(gen, _FLOATS)).to(device),
        "centroids": cent.to(device),
        "phi": phi.to(device) if ip else None,
        "lengths": lengths.to(device),
        "N": N,
        "metric": "ip" if ip else "euclidean",
        "desc": f"B{B} Hkv{Hkv} T{T} D{D} M{M} C{C} {'ip' if ip else 'l2'}",
    }


def _run_encode(case: dict, config: dict) -> torch.Tensor:
    from pqattn.kernels.encode import pq_encode

    B, Hkv, _, _ = case["keys"].shape
    M = case["centroids"].shape[2]
    if config["layout"] == "native":
        out = torch.empty(B, Hkv, case["N"], M, dtype=torch.uint8, device=case["keys"].device)
    else:  # the original's int64 codebook [B, N, Hkv, M], written through strides
        out = torch.empty(B, case["N"], Hkv, M, dtype=torch.int64, device=case["keys"].device).transpose(1, 2)
    pq_encode(case["keys"], case["centroids"], case["phi"], out, base=case["lengths"])
    return out


def _code_distances(case: dict) -> torch.Tensor:
    """Squared distances [B, Hkv, T, M, C] in float64, augmented for ip."""
    keys, cent = case["keys"].double(), case["centroids"].double()
    B, Hkv, T, D = keys.shape
    M = cent.shape[2]
    x = keys.reshape(B, Hkv, T, M, D // M).permute(0, 1, 3, 2, 4)
    if case["metric"] == "ip":
        x = ref.pq.augment_ip(x, case["phi"].double())
    d = ((x[:, :, :, :, None, :] - cent[:, :, :, None]) ** 2).sum(-1)  # [B, Hkv, M, T, C]
    return d.permute(0, 1, 3, 2, 4)


def _compare_encode(case: dict, out: torch.Tensor, dist: torch.Tensor) -> str | None:
    B, Hkv, T, M, C = dist.shape
    rows = case["lengths"].long()[:, None] + torch.arange(T, device=out.device)  # [B, T]
    codes = out.long().gather(2, rows[:, None, :, None].expand(B, Hkv, T, M))
    if (codes >= C).any():
        return "a code was not written (or is out of range)"
    chosen = dist.gather(-1, codes[..., None])[..., 0]
    best = dist.min(-1).values
    tol = 1e-4 * (1 + best.abs())
    if not (chosen <= best + tol).all():
        return f"a code is not the nearest centroid (excess {float((chosen - best).max()):.3g})"
    return None


# ---- index build (k-means) ---------------------------------------------------------------------


def _draw_build(gen: torch.Generator, device: torch.device, large: bool) -> dict:
    B, Hkv = _int(gen, 1, 2), (_pick(gen, [2, 8]) if large else _int(gen, 1, 2))
    D = _pick(gen, [64, 128, 256] if large else [16, 32, 66])
    M = _pick(gen, [m for m in (1, 2, 4, 8, 16) if D % m == 0 and D // m >= 2])
    bits = _int(gen, 1, 8 if large else 5)
    N, init_offset = _int(gen, 2000, 9000) if large else _int(gen, 40, 300), _int(gen, 0, 3)
    lengths = torch.randint(init_offset, N + 1, (B,), generator=gen)
    keys = torch.randn(B, Hkv, N, D, generator=gen)
    keys[..., :3] *= 6.0  # a few large channels, like LLM keys
    keys = keys.to(_pick(gen, _FLOATS))
    for b in range(B):
        keys[b, :, int(lengths[b]) :] = float("nan")  # past a sequence's length: never read
    metric = _pick(gen, ["euclidean", "ip"])
    kw = dict(subvectors=M, bits=bits, metric=metric, init_offset=init_offset, iters=_int(gen, 1, 4), tol=0.0)
    return {
        "keys": keys.to(device),
        "lengths": lengths.to(device),
        "kw": {**kw, "seed": _int(gen, 0, 2**20)},
        "desc": f"B{B} Hkv{Hkv} N{N} D{D} M{M} C{2**bits} {keys.dtype} {metric} lengths {lengths.tolist()}",
    }


def _run_build(case: dict, config: dict) -> ref.pq.KMeansResult:
    from pqattn.kernels.kmeans import build_pq

    cfg = triton.Config(
        {"BLOCK_N": config["BLOCK_N"]}, num_warps=config["num_warps"], num_stages=config["num_stages"]
    )
    return build_pq(case["keys"], case["lengths"], config=cfg, **case["kw"])


def _reference_index_build(case: dict) -> ref.pq.KMeansResult:
    return ref.pq.build_pq(case["keys"].nan_to_num().double(), case["lengths"], **case["kw"])


def _compare_build(case: dict, out: ref.pq.KMeansResult, want: ref.pq.KMeansResult) -> str | None:
    """Rules that hold whichever way float32 rounding breaks a near-tie (a near-tie may send a
    build down another, equally valid path, so centres are not compared one to one): codes in
    range, zero outside [init_offset, length); every code the nearest of the returned centres;
    the last objective their sum of squared distances; the objective never rising over the
    iterations; the final objective within 2% of the float64 reference's (issue 6's rule)."""
    kw, lengths = case["kw"], case["lengths"]
    B, Hkv, N, _ = case["keys"].shape
    M, C = kw["subvectors"], 2 ** kw["bits"]
    x, valid = ref.pq._group_points(case["keys"].nan_to_num().double(), lengths, M, kw["init_offset"])
    cent = out.centroids.double().reshape(B * Hkv * M, C, -1)
    if out.phi is not None:
        x = ref.pq.augment_ip(x, out.phi.double().reshape(-1))
    if not torch.isfinite(cent).all():
        return "a centre is not finite"
    codes = out.codes.long()
    outside = torch.ones(B, N, dtype=torch.bool, device=codes.device)
    outside[:, kw["init_offset"] :] = ~valid.reshape(B, Hkv, M, -1)[:, 0, 0]
    if (codes >= C).any() or (codes[outside[:, None, :, None].expand_as(codes)] != 0).any():
        return "a code is out of range, or not 0 outside [init_offset, length)"
    idx = codes[:, :, kw["init_offset"] :].permute(0, 1, 3, 2).reshape(B * Hkv * M, -1)
    dist = (x * x).sum(-1)[..., None] - 2 * x @ cent.transpose(1, 2) + (cent * cent).sum(-1)[:, None, :]
    chosen, best = dist.gather(-1, idx[..., None])[..., 0], dist.min(-1).values
    scale = (x * x).sum(-1) + (cent * cent).sum(-1).amax(-1, keepdim=True)
    if ((chosen - best > 1e-5 * scale) & valid).any():
        excess = float(((chosen - best) / scale).max())
        return f"a code is not its point's nearest centre (excess {excess:.3g} of |x|^2 + |c|^2)"
    objective = out.objective.double().reshape(out.objective.shape[0], -1)
    total = (chosen * valid).sum(1)
    slack = 1e-5 * (scale * valid).sum(1) + 1e-9
    if out.phi is not None:
        # The build's augmented coordinate e = sqrt(phi - |x|^2) in float32: phi - |x|^2 is off by
        # up to 2 d ulp(phi), which moves e by up to the root of that near e = 0 (a point of the
        # largest norm) and by that over 2e elsewhere, and a squared distance (e - c)^2 by
        # de (2 |e - c| + de). Seen: seed 1475546710, d = 33, phi = 324.5, 0.069 off in 709.5.
        e = x[..., -1]
        off = 2 * (x.shape[-1] - 1) * torch.finfo(torch.float32).eps * out.phi.double().reshape(-1, 1)
        de = torch.minimum(off.sqrt(), off / (2 * e).clamp_min(1e-30))
        c_last = cent[..., -1].gather(1, idx)
        slack = slack + (de * (2 * (e - c_last).abs() + de) * valid).sum(1)
    if ((objective[-1] - total).abs() > slack).any():
        return "the last objective is not the sum of the squared distances to the returned centres"
    if (objective[1:] > objective[:-1] + slack).any():
        return "the objective rose over an iteration"
    want_final = want.objective[-1].reshape(-1)
    if (objective[-1] > 1.02 * want_final + slack).any():
        got, ref_total = float(objective[-1].sum()), float(want_final.sum())
        return f"final objective {got:.6g} > 1.02 x the reference's {ref_total:.6g}"
    return None


def _build_configs() -> list[dict]:
    from pqattn.kernels.kmeans import KMEANS_CONFIGS

    return [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in KMEANS_CONFIGS]


# ---- sparse decode attention -------------------------------------------------------------------

# Output tolerance per dtype of q/k/v (the kernel accumulates in float32; the reference in float64):
# atol + rtol * |expected|. bfloat16 outputs round to 2^-8 relative, and its products' operands
# too, so its errors grow with the output (1.5 ulps seen at |out| = 2.5; 4 ulps allowed).
DECODE_ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
DECODE_RTOL = {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 2.0**-6}


def draw_decode(gen: torch.Generator, device: torch.device, large: bool) -> dict:
    """A random sparse decode problem: ragged counts (some 0, some full), -1 padding, GQA."""
    if large:
        B, Hkv, g, D = _pick(gen, [1, 2, 8]), 8, 4, _pick(gen, [64, 128, 256])
        N, L = _pick(gen, [4096, 32768, 131072]), _pick(gen, [384, 1280, 2304])
    else:
        B, Hkv, g, D = _int(gen, 1, 3), _int(gen, 1, 2), _pick(gen, [1, 2, 4]), _pick(gen, [16, 32, 64])
        N, L = _int(gen, 1, 400), _int(gen, 1, 150)
    L = min(L, N)
    H = Hkv * g
    dtype = _pick(gen, _FLOATS)
    counts = torch.randint(0, L + 1, (B, H), generator=gen)
    counts.view(-1)[0] = L
    if B * H > 1:
        counts.view(-1)[-1] = 0
    positions = torch.rand(B, H, N, generator=gen).argsort(-1)[..., :L]
    positions = torch.where(torch.arange(L) < counts[..., None], positions, -1)
    weights_kind = _pick(gen, ["none", "entry", "dense"])
    weights = None
    if weights_kind == "entry":
        weights = torch.rand(B, H, L, generator=gen) + 0.05
    elif weights_kind == "dense":
        weights = (torch.rand(B, H, N, generator=gen) + 0.05) * (torch.rand(B, H, N, generator=gen) > 0.2)
    scale = None if _int(gen, 0, 1) else 0.5 / math.sqrt(D)
    k = torch.randn(B, Hkv, N, D, generator=gen) * _pick(gen, [1.0, 4.0])
    return {
        "q": torch.randn(B, H, D, generator=gen).to(dtype).to(device),
        "k": k.to(dtype).to(device),
        "v": torch.randn(B, Hkv, N, D, generator=gen).to(dtype).to(device),
        "positions": positions.to(_pick(gen, [torch.int32, torch.int64])).to(device),
        "counts": counts.to(torch.int32).to(device),
        "weights": None if weights is None else weights.to(_pick(gen, _FLOATS)).to(device),
        "dense": weights_kind == "dense",
        "scale": scale,
        "desc": f"B{B} H{H} Hkv{Hkv} N{N} L{L} D{D} {str(dtype).removeprefix('torch.')} w={weights_kind}",
    }


def run_decode(case: dict, config: dict) -> tuple:
    from pqattn.kernels.decode import sparse_decode, workspace_numel

    q = case["q"]
    B, H, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B * H, dtype=torch.float32, device=q.device)
    ws = torch.zeros(
        workspace_numel(B * H, case["positions"].shape[-1], D), dtype=torch.int32, device=q.device
    )
    for _ in range(2):  # the second call reuses the workspace: the kernel must leave it reusable
        sparse_decode(
            q,
            case["k"],
            case["v"],
            case["positions"],
            case["counts"],
            out=out,
            workspace=ws,
            weights=case["weights"],
            dense_weights=case["dense"],
            lse=lse,
            scale=case["scale"],
            config=triton.Config(
                {"BLOCK_L": config["BLOCK_L"], "BLOCK_N": config["BLOCK_N"]}, num_warps=config["num_warps"]
            ),
        )
    return out, lse.view(B, H)


def reference_decode(case: dict) -> tuple:
    w = case["weights"]
    if w is not None:
        w = w.double()
        if case["dense"]:
            w = w.gather(-1, case["positions"].long().clamp_min(0))
    return ref.sparse_decode(
        case["q"].double(),
        case["k"].double(),
        case["v"].double(),
        case["positions"],
        case["counts"],
        w,
        scale=case["scale"],
        return_lse=True,
    )


def compare_decode(case: dict, out: tuple, want: tuple) -> str | None:
    got, lse = out
    exp, exp_lse = want
    atol, rtol = DECODE_ATOL[case["q"].dtype], DECODE_RTOL[case["q"].dtype]
    err = (got.double() - exp).abs()
    if not torch.isfinite(got).all():
        return "non-finite output (an unwritten or NaN element)"
    if bool((err > atol + rtol * exp.abs()).any()):
        return f"output differs by up to {float(err.max()):.3g} (atol {atol:g}, rtol {rtol:g})"
    empty = torch.isinf(exp_lse)
    if not torch.equal(torch.isinf(lse), empty):
        return "log-sum-exp of empty rows is not -inf (or a non-empty row's is)"
    lerr = (lse[~empty].double() - exp_lse[~empty]).abs()
    if lerr.numel() and float(lerr.max()) > 1e-4 * (1 + float(exp_lse[~empty].abs().max())):
        return f"log-sum-exp differs by up to {float(lerr.max()):.3g}"
    return None


def _decode_configs() -> list[dict]:
    from pqattn.kernels.decode import DECODE_CONFIGS

    return [{**c.kwargs, "num_warps": c.num_warps} for c in DECODE_CONFIGS]


# ---- dense flash attention ---------------------------------------------------------------------

ATTENTION_ATOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def draw_attention(gen: torch.Generator, device: torch.device, large: bool) -> dict:
    """Random prefill attention: any lengths (Sq <= Sk or not), GQA, full or causal, lse."""
    if large:
        B, Hkv, g, D = _pick(gen, [1, 2]), _pick(gen, [2, 8]), _pick(gen, [1, 4]), _pick(gen, [64, 128])
        Sq, Sk = _int(gen, 1, 3000), _int(gen, 1, 3000)
        dtype = _pick(gen, [torch.float16, torch.bfloat16])
    else:  # fp16 only: Triton 3.6's interpreter computes bf16 tl.dot on raw bits
        B, Hkv, g, D = _int(gen, 1, 2), _int(gen, 1, 2), _pick(gen, [1, 2]), _pick(gen, [16, 32])
        Sq, Sk = _int(gen, 1, 150), _int(gen, 1, 150)
        dtype = torch.float16
    causal = bool(_int(gen, 0, 1))
    return {
        "q": torch.randn(B, Hkv * g, Sq, D, generator=gen).to(dtype).to(device),
        "k": (2 * torch.randn(B, Hkv, Sk, D, generator=gen)).to(dtype).to(device),
        "v": torch.randn(B, Hkv, Sk, D, generator=gen).to(dtype).to(device),
        "causal": causal,
        "scale": None if _int(gen, 0, 1) else 0.7 / math.sqrt(D),
        "desc": f"B{B} H{Hkv * g} Hkv{Hkv} Sq{Sq} Sk{Sk} D{D} {str(dtype).removeprefix('torch.')} "
        f"{'causal' if causal else 'full'}",
    }


def run_attention(case: dict, config: dict) -> tuple:
    from pqattn.kernels.attention import flash_forward

    q = case["q"]
    B, H, Sq, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    cfg = triton.Config(
        {"BLOCK_M": config["BLOCK_M"], "BLOCK_N": config["BLOCK_N"], "TMA": config["TMA"]},
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    flash_forward(
        q, case["k"], case["v"], out=out, causal=case["causal"], scale=case["scale"], lse=lse, config=cfg
    )
    return out, lse


def reference_attention(case: dict) -> tuple:
    return ref.dense_attention(
        case["q"].double(),
        case["k"].double(),
        case["v"].double(),
        causal=case["causal"],
        scale=case["scale"],
        return_lse=True,
    )


def compare_attention(case: dict, out: tuple, want: tuple) -> str | None:
    got, lse = out
    exp, exp_lse = want
    if not torch.isfinite(got).all():
        return "non-finite output (an unwritten or NaN element)"
    atol = ATTENTION_ATOL[case["q"].dtype]
    err = float((got.double() - exp).abs().max()) if got.numel() else 0.0
    if err > atol:
        return f"output differs by up to {err:.3g} (atol {atol:g})"
    empty = torch.isinf(exp_lse)
    if not torch.equal(torch.isinf(lse), empty):
        return "log-sum-exp of rows that see no key is not -inf (or a row's that does is)"
    if (~empty).any() and float((lse[~empty].double() - exp_lse[~empty]).abs().max()) > 2e-3:
        return "log-sum-exp differs"
    return None


def _attention_configs() -> list[dict]:
    from pqattn.kernels.attention import ATTENTION_CONFIGS

    return [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in ATTENTION_CONFIGS]


CHECKS: list[KernelCheck] = [
    KernelCheck(
        "pq_select",
        _select_configs,
        _draw_select,
        _run_select,
        _reference_select,
        _compare_select,
        _select_fits,
    ),
    KernelCheck(
        "pq_select_fine",
        lambda: [
            {"share": "head", "rule": "sum"},
            {"share": "group", "rule": "sum"},
            {"share": "group", "rule": "max"},
        ],
        _draw_select_fine,
        _run_select_fine,
        _reference_select_fine,
        _compare_select_fine,
    ),
    KernelCheck(
        "pq_select_hist",
        _select_hist_configs,
        _draw_select,
        _run_select_hist,
        _reference_select,
        _compare_select,
        _select_hist_fits,
    ),
    KernelCheck(
        "pq_select_buckets",
        _select_buckets_configs,
        _draw_select,
        _run_select_buckets,
        _reference_select,
        _compare_select,
        _select_hist_fits,
    ),
    KernelCheck(
        "pq_encode",
        lambda: [{"layout": "native"}, {"layout": "compat"}],
        _draw_encode,
        _run_encode,
        _code_distances,
        _compare_encode,
    ),
    KernelCheck(
        "kmeans_build", _build_configs, _draw_build, _run_build, _reference_index_build, _compare_build
    ),
    KernelCheck("sparse_decode", _decode_configs, draw_decode, run_decode, reference_decode, compare_decode),
    KernelCheck(
        "flash_attention",
        _attention_configs,
        draw_attention,
        run_attention,
        reference_attention,
        compare_attention,
    ),
]


def registered() -> list[KernelCheck]:
    """The checks of every kernel family (each arrives with its kernel)."""
    return list(CHECKS)
