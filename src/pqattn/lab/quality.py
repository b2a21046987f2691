"""What sparse selection costs in quality: PQ vs streaming vs oracle over a sweep of densities.

A problem is a key/value cache and decode queries that attend to all of it. For each density d
the heavy budget is round(d * N) tokens beyond sink and window; the three methods spend the same
number of tokens (streaming puts its heavy budget into a wider window). Per method and density:
captured attention mass, recall of the oracle's heavy tokens, and the output's relative error
against dense attention, averaged over queries (and over layers for a model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from pqattn import ops
from pqattn.lab import metrics
from pqattn.lab import policies as policies_mod
from pqattn.lab.policies import Policy
from pqattn.reference import Selection

METHODS = ("pq", "streaming", "oracle")


@dataclasses.dataclass
class Problem:
    name: str
    keys: torch.Tensor  # [B, Hkv, N, D]
    values: torch.Tensor  # [B, Hkv, N, D]
    queries: torch.Tensor  # [T, B, H, D], each attending to all N tokens


@dataclasses.dataclass(frozen=True)
class QualitySettings:
    densities: tuple[float, ...] = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
    sink: int = 16
    window: int = 64
    subvectors: int = 2
    bits: int = 6
    metric: str = "euclidean"
    iters: int = 10


def workload_problem(tokens: int = 16384, device: str | torch.device = "cpu") -> Problem:
    """The demo's synthetic LLM-like cache; its decode queries attend to the whole cache."""
    from pqattn.lab.workload import WorkloadSpec, make_workload

    work = make_workload(WorkloadSpec(tokens=tokens)).to(device, torch.float32)
    return Problem("workload", work.keys, work.values, work.queries)


def needles_problem(tokens: int = 16384, device: str | torch.device = "cpu") -> Problem:
    """The second generator's cache (`pqattn.lab.needles`: single-token needles, no sink)."""
    from pqattn.lab.needles import NeedleSpec, make_needles

    work = make_needles(NeedleSpec(tokens=tokens)).to(device, torch.float32)
    return Problem("needles", work.keys, work.values, work.queries)


GENERATORS = {"workload": workload_problem, "needles": needles_problem}


def policy_sweep(
    problem: Problem,
    policies: Sequence[Policy],
    *,
    sink: int,
    window: int,
    metric: str = "euclidean",
    iters: int = 10,
) -> list[dict]:
    """One row per non-dense policy: tokens, mass, recall (of the oracle's heavy tokens at the
    policy's density), rel_err (means over the problem's queries). Every query sees all N tokens;
    PQ indexes the cache from `sink` on (one build per M, bits and sample)."""
    B, _, N, _ = problem.keys.shape
    H = problem.queries.shape[2]
    lengths = torch.full((B,), N, device=problem.keys.device)
    books = {
        (m, b, smp): ops.build_index(
            problem.keys,
            lengths,
            subvectors=m,
            bits=b,
            metric=metric,
            init_offset=sink,
            iters=iters,
            sample=smp,
        )
        for m, b, smp in dict.fromkeys((p.subvectors, p.bits, p.sample) for p in policies if p.kind == "pq")
    }
    keys, values = problem.keys.float(), problem.values.float()
    kept = ops.select_streaming(lengths, H, sink=sink, window=window)
    sums = {p.name: {"mass": 0.0, "recall": 0.0, "rel_err": 0.0, "tokens": 0.0} for p in policies}
    for q in problem.queries:
        qf = q.float()
        probs = metrics.attention_probs(qf, keys)
        dense = ops.dense_attention(qf[:, :, None], keys, values)[:, :, 0]
        oracles: dict[float, Selection] = {}
        for p in policies:
            book = books.get((p.subvectors, p.bits, p.sample)) if p.kind == "pq" else None
            sel = policies_mod.per_head(
                policies_mod.select(
                    p, q, problem.keys, lengths, sink=sink, window=window, n_tokens=N, book=book
                ),
                H,
            )
            if p.density not in oracles:
                oracles[p.density] = policies_mod.select(
                    Policy("oracle", p.density), qf, keys, lengths, sink=sink, window=window, n_tokens=N
                )
            out = ops.sparse_decode(qf, keys, values, sel.positions, sel.counts)
            acc = sums[p.name]
            acc["mass"] += float(metrics.captured_mass(probs, sel).mean())
            acc["recall"] += float(metrics.oracle_recall(sel, oracles[p.density], kept, N).mean())
            acc["rel_err"] += metrics.relative_error(out, dense)
            acc["tokens"] += float(sel.counts.float().mean())
    T = len(problem.queries)
    return [
        {"problem": problem.name, "policy": p.name, "family": p.family, "kind": p.kind, "density": p.density}
        | {"heavy": p.heavy(N), "selection_heavy": p.selection_heavy(N)}
        | {k: v / T for k, v in sums[p.name].items()}
        for p in policies
    ]


def sweep(problem: Problem, settings: QualitySettings) -> list[dict]:
    """One row per (density, method) of METHODS: heavy, tokens, mass, recall, rel_err (means over
    queries); pq at the settings' M and bits."""
    s = settings
    policies = [
        p
        for d in s.densities
        for p in (
            Policy("pq", d, subvectors=s.subvectors, bits=s.bits),
            Policy("streaming", d),
            Policy("oracle", d),
        )
    ]
    rows = policy_sweep(problem, policies, sink=s.sink, window=s.window, metric=s.metric, iters=s.iters)
    return [
        {"problem": r["problem"], "density": r["density"], "heavy": r["heavy"], "method": r["kind"]}
        | {k: r[k] for k in ("mass", "recall", "rel_err", "tokens")}
        for r in rows
    ]


def model_problems(
    path: str, *, prompt_tokens: int, layers: Sequence[int] | None, device: str | torch.device, seed: int = 0
) -> list[Problem]:
    """Per layer of a local transformers model: its KV cache after a random-token prompt and the
    query of one decode step (captured through a recording attention implementation)."""
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from pqattn.integrations.hf import cache_kwargs

    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).to(device).eval()
    captured: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def record(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if query.shape[2] == 1 and getattr(module, "layer_idx", None) is not None:
            captured[module.layer_idx] = (query[:, :, 0].detach(), key.detach(), value.detach())
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    transformers.AttentionInterface.register("pqattn_record", record)
    ALL_MASK_ATTENTION_FUNCTIONS.register("pqattn_record", sdpa_mask)
    model.set_attn_implementation("pqattn_record")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_tokens + 1), generator=gen).to(device)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :-1], **cache_kwargs(model, cache))
        model(ids[:, -1:], **cache_kwargs(model, cache))
    chosen = sorted(captured) if layers is None else list(layers)
    missing = [layer for layer in chosen if layer not in captured]
    if missing:
        raise ValueError(f"layers: expected indices in {sorted(captured)}, got {missing}")
    return [
        Problem(f"layer{layer}", captured[layer][1], captured[layer][2], captured[layer][0][None])
        for layer in chosen
    ]


def average(rows: list[dict], group: str | None = None) -> list[dict]:
    """Mean over problems per (density, method), and per `group` (e.g. the generator) when given:
    each row of the result carries that group's name under the key "source"."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        src = r["problem"] if group is None else group
        groups.setdefault((src, r["density"], r["method"]), []).append(r)
    return [
        {"source": src, "density": d, "method": m, "heavy": g[0]["heavy"], "problems": len(g)}
        | {k: sum(r[k] for r in g) / len(g) for k in ("tokens", "mass", "recall", "rel_err")}
        for (src, d, m), g in groups.items()
    ]


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'source':<10} {'density':>8} {'method':<10} {'tokens':>8} {'mass':>7} {'recall':>7} {'rel err':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r['source'][-10:]:<10} {r['density']:>8.3f} {r['method']:<10} {r['tokens']:>8.0f} "
            f"{r['mass']:>7.3f} {r['recall']:>7.3f} {r['rel_err']:>8.4f}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    """Output relative error vs density per method and source (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    sources = list(dict.fromkeys(r["source"] for r in rows))
    styles = ["-", "--", ":", "-."]
    for i, src in enumerate(sources):
        for j, m in enumerate(METHODS):
            pts = sorted(
                (r["density"], r["rel_err"]) for r in rows if r["method"] == m and r["source"] == src
            )
            label = m if len(sources) == 1 else f"{m}, {src}"
            ax.plot(
                [p[0] for p in pts],
                [max(p[1], 1e-6) for p in pts],
                marker="o",
                ls=styles[i % len(styles)],
                color=f"C{j}",
                label=label,
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("heavy density (share of the cache)")
    ax.set_ylabel("output relative error vs dense")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
