"""The quality/speed Pareto view: every policy's quality beside its measured decode-step time.

Speed: one decode step of a layer as users call it (`PQIndex.decode_step`: store, append,
select, attend; dense: torch SDPA over the whole cache) at B=1, H=32, Hkv=8, D=128, bf16, over
the `pqattn.lab.workload` cache of N tokens, each policy at heavy = round(density * N) per query
head beyond sink and window (a group selection keeps its budget of them per KV head), inputs
rotating over copies of the cache beyond twice the L2. GPU time from CUDA-graph replay on a GPU
(eager wall-clock with a sync on a CPU, marked as such). Policies without a kernel (the exact
oracle, pages) have no step time: they are shown for quality only.

Quality, per policy and density: from a `pqattn tasks` document (bits/byte gap to dense at each
tail context, passkey accuracy, attention mass kept inside the model), and the attention mass on
the two synthetic generators at N tokens (`pqattn.lab.quality.policy_sweep`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pqattn import ops
from pqattn.index import PQConfig, PQIndex
from pqattn.lab import baselines, quality
from pqattn.lab.env import environment
from pqattn.lab.policies import Policy
from pqattn.lab.timing import cache_copies, capture, sync, time_eager, time_graph
from pqattn.lab.workload import WorkloadSpec, make_workload
from pqattn.runtime.launch import autotuning

TIMED_KINDS = ("streaming", "pq")  # the policies with kernels (selection and attention)
GRAPH_CALLS = 16  # steps per captured graph: keeps the host's graph launch out of the GPU time
CACHE_SETS = 8  # copies of the cache the timed calls rotate over on a GPU (far beyond twice the L2)


def _time(fns: Sequence[Callable[[], object]], device: torch.device, repeats: int, between=None) -> dict:
    """{'us': median, 'mode': 'graph' | 'eager'}: GPU time of the calls (cycling through the input
    sets) replayed in a CUDA graph on a GPU, eager wall-clock with a sync on a CPU; `between`
    rewinds the state outside the timed region before each sample."""
    if device.type == "cuda":
        graph = capture(fns, device, calls=GRAPH_CALLS)
        timed = time_graph(graph, device, repeats=repeats, calls=GRAPH_CALLS, between=between)
        return {"us": timed["median_us"], "mode": "graph"}
    fns[0]()
    return {"us": time_eager(fns, device, repeats=repeats, between=between)["median_us"], "mode": "eager"}


def step_times(
    policies: Sequence[Policy],
    *,
    tokens: int,
    sink: int,
    window: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    iters: int = 10,
    repeats: int = 30,
) -> dict:
    """Decode-step times of dense SDPA and of every policy with a kernel, in one run, on the path a
    user calls: `PQIndex.decode_step` (store the new K/V row, append its key, select, attend);
    streaming is sparse attention over sink + window (+ heavy more recent tokens). On a GPU every
    side rotates over CACHE_SETS copies of the cache (and of the index), so none reads from L2 what
    it would read from memory in a decode loop; each sample starts at N tokens."""
    work = make_workload(WorkloadSpec(tokens=tokens, steps=1)).to(device, dtype)
    k, v, q = work.keys[:, :, :tokens], work.values[:, :, :tokens], work.queries[0]
    B, Hkv, N, D = k.shape
    H = q.shape[1]
    capacity = N + GRAPH_CALLS
    sets = CACHE_SETS if device.type == "cuda" else 1
    caches = cache_copies(k, v, room=GRAPH_CALLS, sets=sets)
    k_new, v_new = k[:, :, -1:].clone(), v[:, :, -1:].clone()  # a key and value of the cache's kind
    lengths = torch.full((B,), N, device=device, dtype=torch.int64)
    rows = [{"policy": "dense", "family": "dense", "density": 1.0, "kernel": "torch SDPA"}]
    dense = [lambda kc=kc, vc=vc: baselines.sdpa_decode(q, kc[:, :, :N], vc[:, :, :N]) for kc, vc in caches]
    rows[0] |= _time(dense, device, repeats)
    books: dict[tuple[int, int, int], ops.PQCodebook] = {}
    for p in policies:
        if p.kind == "dense":
            continue
        row = {"policy": p.name, "family": p.family, "density": p.density, "heavy": p.heavy(N)}
        if p.kind not in TIMED_KINDS:
            rows.append(row | {"kernel": None, "us": None, "mode": None})
            continue
        heavy = p.heavy(N)
        between = None
        if p.kind == "streaming":
            sel = ops.select_streaming(lengths, H, sink=sink, window=window + heavy)
            out = torch.empty_like(q)
            ws = torch.zeros(
                ops.decode_workspace_numel(B * H, sel.positions.shape[-1], D),
                dtype=torch.int32,
                device=device,
            )
            fns = [
                lambda kc=kc, vc=vc, sel=sel, out=out, ws=ws: ops.sparse_decode(
                    q, kc, vc, sel.positions, sel.counts, out=out, workspace=ws
                )
                for kc, vc in caches
            ]
            kernel = "pqattn sparse_decode" if ops.decode_kernel_path(q) else "reference"
        else:
            key = (p.subvectors, p.bits, p.sample)
            if key not in books:
                books[key] = ops.build_index(
                    k, subvectors=p.subvectors, bits=p.bits, init_offset=sink, iters=iters, sample=p.sample
                )
            config = PQConfig(
                subvectors=p.subvectors,
                bits=p.bits,
                sink=sink,
                window=window,
                heavy=heavy,
                init_offset=sink,
                sample=p.sample,
                share=p.share,
                group_rule=p.group_rule,
                group_budget=p.budget,
                rerank=p.rerank,
            )
            indexes = [
                PQIndex.from_codebook(books[key], lengths, capacity=capacity, config=config) for _ in caches
            ]
            fns = [
                lambda index=index, kc=kc, vc=vc: index.decode_step(q, k_new, v_new, kc, vc)
                for index, (kc, vc) in zip(indexes, caches, strict=True)
            ]

            def between(indexes=indexes):
                for index in indexes:
                    index.truncate([N] * B)

            row_heavy = config.row_heavy(H // Hkv)
            on_kernels = ops.kernel_path(q, indexes[0].centroids, row_heavy, p.share, p.rerank)
            on_kernels = on_kernels and ops.decode_kernel_path(q)
            kernel = "pqattn PQIndex.decode_step" if on_kernels else "reference"
        for fn in fns:
            fn()
        if between is not None:
            between()
        sync(device)
        rows.append(row | {"kernel": kernel} | _time(fns, device, repeats, between))
    dense_us = rows[0]["us"]
    for r in rows:
        r["speedup_vs_dense"] = None if r["us"] is None else dense_us / r["us"]
    return {
        "shape": {"B": B, "H": H, "Hkv": Hkv, "D": D, "N": N, "dtype": str(dtype).removeprefix("torch.")},
        "sink": sink,
        "window": window,
        "measures": "one decode step of a layer as users call it: PQIndex.decode_step (store + append + "
        "select + attend; streaming: sparse attention over its rows), dense: SDPA over the cache; "
        f"inputs rotating over {sets} copies of the cache",
        "cache_sets": sets,
        "autotune": autotuning(),
        "environment": environment(device),
        "rows": rows,
    }


def generator_quality(
    policies: Sequence[Policy], *, tokens: int, sink: int, window: int, device: torch.device, iters: int = 10
) -> list[dict]:
    """Attention mass, oracle recall and output error of every non-dense policy on both generators."""
    rows = []
    for make in quality.GENERATORS.values():
        problem = make(tokens, device)
        rows += quality.policy_sweep(
            problem, [p for p in policies if p.kind != "dense"], sink=sink, window=window, iters=iters
        )
    return rows


def combine(
    policies: Sequence[Policy], times: dict, generators: list[dict], tasks_doc: dict | None
) -> list[dict]:
    """One row per policy: its step time and every quality figure measured for it."""
    by_time = {r["policy"]: r for r in times["rows"]}
    out = []
    for p in policies:
        t = by_time.get(p.name, {})
        row = {
            "policy": p.name,
            "family": p.family,
            "kind": p.kind,
            "density": p.density,
            "step_us": t.get("us"),
            "timing": t.get("mode"),
            "kernel": t.get("kernel"),
            "speedup_vs_dense": t.get("speedup_vs_dense"),
        }
        for g in generators:
            if g["policy"] == p.name:
                row[f"mass_{g['problem']}"] = g["mass"]
                row[f"recall_{g['problem']}"] = g["recall"]
        if p.kind == "dense":
            row |= {f"mass_{name}": 1.0 for name in quality.GENERATORS}
        if tasks_doc:
            for r in tasks_doc.get("tail", []):
                if r["policy"] == p.name:
                    row[f"bpb_gap_{r['context']}"] = r["gap"]
                    row[f"model_mass_{r['context']}"] = r["mass"]
                    if "gap_se" in r:
                        row[f"se_bpb_gap_{r['context']}"] = r["gap_se"]
            for r in tasks_doc.get("passkey", []):
                if r["policy"] == p.name and r["depth_lo"] == 0.0 and r["depth_hi"] == 1.0:
                    row[f"passkey_{r['context']}"] = r["accuracy"]
                    if "se" in r:
                        row[f"se_passkey_{r['context']}"] = r["se"]
        out.append(row)
    return out


def _panels(rows: list[dict]) -> list[tuple[str, str]]:
    """(key, label) of the quality figures the rows hold, in plotting order."""
    keys = sorted({k for r in rows for k in r})
    gaps = [k for k in keys if k.startswith("bpb_gap_")]
    passkeys = [k for k in keys if k.startswith("passkey_")]
    panels = []
    if gaps:
        k = max(gaps, key=lambda x: int(x.rsplit("_", 1)[1]))
        panels.append((k, f"bits/byte gap to dense, {k.rsplit('_', 1)[1]}-byte context (lower is better)"))
    if passkeys:
        k = passkeys[0]
        panels.append((k, f"passkey accuracy, {k.rsplit('_', 1)[1]}-byte context"))
    panels += [(f"mass_{g}", f"attention mass kept, {g} generator") for g in quality.GENERATORS]
    return panels


def plot(rows: list[dict], path: str, title: str) -> None:
    """One panel per quality figure against the step time; policies without a kernel sit in a
    'no kernel' band at the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(rows)
    timed = [r["step_us"] for r in rows if r["step_us"] is not None]
    lo, hi = min(timed), max(timed)
    band = hi * 2.2  # x of the quality-only policies
    families = list(dict.fromkeys(r["family"] for r in rows))
    colors = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
    cols = 2 if len(panels) > 1 else 1
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.0 * cols, 4.2 * nrows + 0.8), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    gpu = all(r["timing"] in (None, "graph") for r in rows)
    for ax, (key, label) in zip(axes.flat, panels, strict=False):
        for fam in families:
            pts = sorted(
                (r["step_us"] if r["step_us"] is not None else band, r[key], r["density"])
                for r in rows
                if r["family"] == fam and r.get(key) is not None
            )
            if not pts:
                continue
            xs = [p[0] for p in pts]
            ax.plot(xs, [p[1] for p in pts], marker="o", ms=4, lw=1, color=colors[fam], label=fam)
            for x, y, d in pts:
                if fam != "dense":
                    ax.annotate(f"{d:g}", (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
        dense_us = next((r["step_us"] for r in rows if r["kind"] == "dense"), None)
        if dense_us is not None:
            ax.axvline(dense_us, color="C0", ls="--", lw=0.8)
        ax.axvspan(hi * 1.6, band * 1.4, color="0.92")
        ax.text(band, ax.get_ylim()[0], "no kernel", fontsize=7, ha="center", va="bottom")
        ax.set_xscale("log")
        ax.set_xlim(lo / 1.5, band * 1.4)
        ax.set_xlabel(
            "decode step GPU time, graph replay (us)" if gpu else "decode step wall-clock, eager (us)"
        )
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[f], marker="o", lw=1, label=f) for f in families]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(families), 6), fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(rows: list[dict]) -> str:
    panels = [k for k, _ in _panels(rows)]
    head = f"{'policy':<22} {'step us':>9} {'vs dense':>9}" + "".join(f" {k:>16}" for k in panels)
    lines = [head]
    for r in rows:
        us = "-" if r["step_us"] is None else f"{r['step_us']:.1f}"
        x = "-" if r["speedup_vs_dense"] is None else f"{r['speedup_vs_dense']:.2f}x"
        cells = "".join(
            f" {'-' if r.get(k) is None else format(r[k], '.4f' if 'gap' in k else '.3f'):>16}"
            for k in panels
        )
        lines.append(f"{r['policy']:<22} {us:>9} {x:>9}{cells}")
    return "\n".join(lines)
