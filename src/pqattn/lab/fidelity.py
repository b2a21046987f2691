"""Fidelity at speed: the attention mass a policy keeps, as a share of the per-head oracle's at
the same density, beside its decode-step time against SDPA, in one run.

Quality: `pqattn.lab.quality.policy_sweep` on both synthetic generators at each N (B=1, H=32,
Hkv=8, D=128), every policy at heavy = density * N per head (a group policy keeps `budget` times
that per KV head). Speed: one decode step of a layer (selection into kept buffers + sparse
attention) over the `workload` cache, bf16, GPU time by CUDA-graph replay, beside SDPA over the
whole cache and the selection alone; the codes' bytes floor of the selection at the measured copy
bandwidth. The oracle has no kernel: it shows quality only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pqattn import ops
from pqattn.lab import baselines, quality
from pqattn.lab.env import environment
from pqattn.lab.policies import Policy, from_family, group_select, head_select, yardsticks
from pqattn.lab.roofline import copy_gbps
from pqattn.lab.timing import capture, sync, time_graph, wall_us
from pqattn.lab.workload import WorkloadSpec, make_workload
from pqattn.policy import lookup_tables
from pqattn.runtime.launch import autotuning

GRAPH_CALLS = 20


def default_policies(density: float = 0.02) -> list[Policy]:
    """The per-head oracle (the yardstick), the default coarse PQ, fine PQ per head, and group
    selections (sum and max rules, budgets of 1, 2 and 4 heavies), with and without re-ranking."""
    pol = [
        Policy("oracle", density),
        Policy("oracle", density, select=group_select("sum", 1)),
        Policy("oracle", density, select=group_select("sum", 2)),
        Policy("pq", density, subvectors=2, bits=6),
        Policy("pq", density, subvectors=16, bits=8),
    ]
    for m in (8, 16):
        for rule in ("sum", "max"):
            for budget in (1, 2, 4):
                pol.append(Policy("pq", density, subvectors=m, bits=8, select=group_select(rule, budget)))
    pol += [
        Policy("pq", density, subvectors=16, bits=8, select=head_select(4)),
        Policy("pq", density, subvectors=16, bits=8, select=group_select("sum", 2, rerank=4)),
        Policy("pq", density, subvectors=16, bits=8, select=group_select("max", 2, rerank=4)),
    ]
    return pol


def code_policies(density: float = 0.02) -> list[Policy]:
    """The code resolutions and builds compared at equal code bytes: 4-bit codes (whose 16-entry
    LUT rows a warp gathers from one or two cache lines) against 8-bit ones, and the index built
    on 16 to 256 keys per centroid against every key; group max at 4 heavies and per head."""
    pol = [Policy("oracle", density)]
    for m, b in ((16, 8), (32, 4), (16, 4)):
        pol.append(Policy("pq", density, subvectors=m, bits=b))
        pol.append(Policy("pq", density, subvectors=m, bits=b, select=group_select("max", 4)))
    for smp in (16, 32, 64, 256):
        pol.append(Policy("pq", density, subvectors=16, bits=8, sample=smp))
        pol.append(Policy("pq", density, subvectors=16, bits=8, select=group_select("max", 4), sample=smp))
    return pol


def named_policies(names: str, density: float) -> list[Policy]:
    """`selection` (default_policies), `codes` (code_policies), or comma-separated families, the
    per-head oracle first (every mass share is relative to it)."""
    if names == "selection":
        return default_policies(density)
    if names == "codes":
        return code_policies(density)
    pol = [from_family(f.strip(), density) for f in names.split(",") if f.strip()]
    oracle = Policy("oracle", density)
    return pol if oracle in pol else [oracle, *pol]


def quality_rows(
    policies: Sequence[Policy], *, tokens: int, sink: int, window: int, device: torch.device
) -> list:
    """policy_sweep on both generators, each row with mass_share = mass / the per-head oracle's at
    its density, and the equal-bytes shares (`policies.yardsticks`): mass / the exact top-k by its
    group rule at its budget (share_equal_rows), mass / the per-head exact top-k at its tokens per
    head (share_equal_tokens). The yardsticks are swept with the policies."""
    named = {p.name: p for p in policies}
    sticks = {p.name: yardsticks(p) for p in policies if p.kind in ("pq", "oracle")}
    swept = list(dict.fromkeys([*policies, *(y for ys in sticks.values() for y in ys.values())]))
    rows = []
    for make in quality.GENERATORS.values():
        problem = make(tokens, device)
        got = quality.policy_sweep(problem, swept, sink=sink, window=window)
        mass = {r["policy"]: r["mass"] for r in got}
        oracle = {r["density"]: r["mass"] for r in got if r["family"] == "oracle"}
        for r in got:
            r["tokens_N"] = tokens
            r["mass_share"] = r["mass"] / oracle[r["density"]] if r["density"] in oracle else None
            ys = sticks.get(r["policy"], {})
            for key in ("rows", "tokens"):
                r[f"share_equal_{key}"] = r["mass"] / mass[ys[key].name] if key in ys else None
            r["yardstick"] = r["policy"] not in named
        rows += got
    return rows


def build_rows(policies: Sequence[Policy], *, tokens: int, sink: int, device: torch.device) -> list[dict]:
    """The k-means objective of each index the PQ policies use, on both generators: the squared
    error of every quantized key against its reconstruction, relative to the keys' energy."""
    rows = []
    configs = dict.fromkeys((p.subvectors, p.bits, p.sample) for p in policies if p.kind == "pq")
    for name, make in quality.GENERATORS.items():
        keys = make(tokens, device).keys.float()
        B, Hkv, N, D = keys.shape
        for m, b, smp in configs:
            book = ops.build_index(keys, subvectors=m, bits=b, init_offset=sink, iters=10, sample=smp)
            idx = book.codes.long().permute(0, 1, 3, 2)[..., None].expand(B, Hkv, m, N, D // m)
            parts = book.centroids[..., : D // m].gather(3, idx)  # [B, Hkv, M, N, dsub]
            recon = parts.permute(0, 1, 3, 2, 4).reshape(B, Hkv, N, D)[:, :, sink:]
            tail = keys[:, :, sink:]
            err = float(((tail - recon) ** 2).sum() / (tail**2).sum())
            rows.append(
                {"problem": name, "tokens_N": tokens, "M": m, "bits": b, "sample": smp, "rel_sq_error": err}
            )
    return rows


def _graph_us(fn, device: torch.device, repeats: int) -> float:
    """GPU time of fn from CUDA-graph replay; on a CPU eager wall-clock (the rows say which)."""
    fn()
    sync(device)
    if device.type != "cuda":
        return wall_us(fn, device, warmup=0, repeats=repeats)["median_us"]  # (warmed by the call above)
    graph = capture([fn], device, calls=GRAPH_CALLS)
    return time_graph(graph, device, repeats=repeats, calls=GRAPH_CALLS)["median_us"]


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy of `nbytes` (read + write counted): the
    generate and step suites' ceiling (`lab.roofline.copy_gbps`)."""
    return copy_gbps(device, nbytes // 2) * 1e9


def step_rows(
    policies: Sequence[Policy],
    *,
    batch: int,
    tokens: int,
    sink: int,
    window: int,
    device: torch.device,
    bandwidth: float,
    repeats: int = 30,
) -> list[dict]:
    """GPU time of SDPA and of each kernel policy's selection and step at one shape."""
    work = make_workload(WorkloadSpec(tokens=tokens, steps=1, batch=batch)).to(device, torch.bfloat16)
    k, v, q = work.keys[:, :, :tokens], work.values[:, :, :tokens], work.queries[0]
    B, Hkv, N, D = k.shape
    H = q.shape[1]
    lengths = torch.full((B,), N, device=device, dtype=torch.int64)
    shape = {"B": B, "H": H, "Hkv": Hkv, "D": D, "N": N}
    dense_us = _graph_us(lambda: baselines.sdpa_decode(q, k, v), device, repeats)
    rows = [shape | {"policy": "dense", "step_us": dense_us, "kernel": "torch SDPA"}]
    books: dict[tuple[int, int, int], ops.PQCodebook] = {}
    for p in policies:
        if p.kind != "pq":
            continue
        key = (p.subvectors, p.bits, p.sample)
        if key not in books:
            books[key] = ops.build_index(
                k, subvectors=p.subvectors, bits=p.bits, init_offset=sink, iters=10, sample=p.sample
            )
        book = books[key]
        heavy = p.selection_heavy(N)
        if not ops.kernel_path(q, book.centroids, heavy, p.share, p.rerank):
            continue
        rows_per_b = Hkv if p.share == "group" else H
        tables = lookup_tables(p.share, p.group_rule, H // Hkv)
        args = (q, book.centroids, book.codes, lengths)
        kw = dict(sink=sink, window=window, heavy=p.heavy(N), init_offset=sink, share=p.share)
        kw |= dict(group_rule=p.group_rule, group_budget=p.budget)
        kw |= dict(rerank=p.rerank, keys=k if p.rerank else None)
        sel = ops.select_topk(*args, **kw)
        ws_sel = torch.zeros(
            ops.select_workspace_numel(
                B * rows_per_b,
                p.subvectors,
                2**p.bits,
                N,
                heavy,
                share=p.share,
                tables=tables,
                rerank=p.rerank,
            ),
            dtype=torch.int32,
            device=device,
        )
        L = sel.positions.shape[-1]
        group = H // Hkv if p.share == "group" else 0
        ws_dec = torch.zeros(
            ops.decode_workspace_numel(B * rows_per_b, L, D, group=group), dtype=torch.int32, device=device
        )
        out = torch.empty_like(q)

        def select(sel=sel, ws=ws_sel, args=args, kw=kw):
            ops.select_topk(*args, **kw, out=sel, workspace=ws)

        def step(sel=sel, select=select, ws=ws_dec, out=out):
            select()
            ops.sparse_decode(q, k, v, sel.positions, sel.counts, out=out, workspace=ws)

        select_us = _graph_us(select, device, repeats)
        step_us = _graph_us(step, device, repeats)
        codes_bytes = book.codes.numel() * (H // Hkv if p.share == "head" else 1)
        rerank_bytes = B * rows_per_b * p.rerank * heavy * (D * k.element_size() + 8)  # the shortlist's keys
        floor_us = (
            (codes_bytes + rerank_bytes + B * rows_per_b * (L * 4 + p.subvectors * 2**p.bits * 4))
            / bandwidth
            * 1e6
        )
        rows.append(
            shape
            | {
                "policy": p.name,
                "family": p.family,
                "heavy": heavy,
                "route": "fine"
                if ops.uses_fine(p.subvectors, 2**p.bits, p.share, heavy, p.rerank)
                else "coarse",
                "select_us": select_us,
                "step_us": step_us,
                "speedup_vs_dense": dense_us / step_us,
                "select_floor_us": floor_us,
                "kernel": "pqattn select_topk + sparse_decode",
            }
        )
    return rows


def run(
    *,
    density: float,
    quality_tokens: Sequence[int],
    shapes: Sequence[tuple[int, int]],
    sink: int,
    window: int,
    device: torch.device,
    policies: Sequence[Policy] | None = None,
    repeats: int = 30,
    on_part: Callable[[dict, str], None] | None = None,
) -> dict:
    """The fidelity document: quality rows per N, step rows per (B, N) shape (`repeats` timed
    samples each). on_part(doc, part) is called after each N and each shape, with the document
    so far (for progress and partial results)."""
    on_part = on_part or (lambda doc, part: None)
    policies = list(policies or default_policies(density))
    doc = {
        "measures": "attention mass (share of the per-head oracle's) and one decode step of a layer",
        "density": density,
        "sink": sink,
        "window": window,
        "autotune": autotuning(),
        "environment": environment(device),
        "quality": [],
        "steps": [],
    }
    doc["builds"] = []
    for n in quality_tokens:
        doc["quality"] += quality_rows(policies, tokens=n, sink=sink, window=window, device=device)
        doc["builds"] += build_rows(policies, tokens=n, sink=sink, device=device)
        on_part(doc, f"quality N={n}")
    doc["timing"] = "graph" if device.type == "cuda" else "eager"
    if shapes:
        doc["copy_bandwidth_GBps"] = copy_bandwidth(device) / 1e9
        for b, n in shapes:
            doc["steps"] += step_rows(
                policies,
                batch=b,
                tokens=n,
                sink=sink,
                window=window,
                device=device,
                bandwidth=doc["copy_bandwidth_GBps"] * 1e9,
                repeats=repeats,
            )
            on_part(doc, f"steps {b}x{n}")
    return doc


def format_table(doc: dict) -> str:
    """Quality (mass share per generator and N) and speed (per shape) as text tables."""
    lines = [
        "policy | N | generator | tokens/head | mass share of oracle | of exact, equal rows | "
        "of exact, equal tokens/head",
        "--- | --- | --- | --- | --- | --- | ---",
    ]

    def share(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for r in doc["quality"]:
        lines.append(
            f"{r['policy']} | {r['tokens_N']} | {r['problem']} | {r['tokens']:.0f} | "
            f"{share(r['mass_share'])} | {share(r.get('share_equal_rows'))} | "
            f"{share(r.get('share_equal_tokens'))}"
        )
    lines += ["", "index | N | generator | relative squared error", "--- | --- | --- | ---"]
    for r in doc.get("builds", []):
        smp = f", sample {r['sample']}" if r["sample"] else ""
        lines.append(
            f"M{r['M']} b{r['bits']}{smp} | {r['tokens_N']} | {r['problem']} | {r['rel_sq_error']:.4f}"
        )
    lines += [
        "",
        "policy | B | N | select us | floor us | step us | vs SDPA",
        "--- | --- | --- | --- | --- | --- | ---",
    ]
    for r in doc["steps"]:
        if r["policy"] == "dense":
            lines.append(f"dense SDPA | {r['B']} | {r['N']} | - | - | {r['step_us']:.1f} | 1.00")
        else:
            lines.append(
                f"{r['policy']} | {r['B']} | {r['N']} | {r['select_us']:.1f} | {r['select_floor_us']:.1f} | "
                f"{r['step_us']:.1f} | {r['speedup_vs_dense']:.2f}"
            )
    return "\n".join(lines)
