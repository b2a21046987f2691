"""`pqattn demo`: PQ vs streaming vs oracle selection on the two synthetic caches.

Builds the index over the prefill, runs the decode steps (append the step's key, select, attend)
and reports per method the captured attention mass, the recall of the oracle's heavy tokens, the
output error against dense attention, and the time of one decode step against dense SDPA measured
in the same run. Variants of the config (`variant_configs`: the exact re-rank on top of it, the
coarse per-head index it replaced as the default) run beside it, and pq-host, the config with the
KV cache in host memory (`pqattn.host.HostCache`, SPEC §10): quality and speed, same run.
"""

from __future__ import annotations

import dataclasses
import textwrap
import time

import torch
import torch.nn.functional as F

import pqattn
from pqattn import ops
from pqattn.host import HostCache
from pqattn.index import PQConfig, PQIndex
from pqattn.lab import metrics
from pqattn.lab.env import environment
from pqattn.lab.needles import NeedleSpec, make_needles
from pqattn.lab.policies import per_head
from pqattn.lab.timing import cache_copies, capture, sync, time_eager, time_graph
from pqattn.lab.workload import WorkloadSpec, make_workload

METHODS = ("pq", "streaming", "oracle")
VARIANTS = ("faithful", "coarse")
# the fields that shape an index's codebook: variants equal in them share one build
_BUILD_FIELDS = ("subvectors", "bits", "metric", "init_offset", "iters", "tol", "seed", "sample", "sink")


def variant_configs(config: PQConfig, names: tuple[str, ...] = VARIANTS) -> dict[str, PQConfig]:
    """The variants run beside `config`, by method name: pq-faithful, `config` with the exact
    re-rank of a shortlist of twice its rows (docs/kernels/select.md: the oracle's attention mass
    on both generators); pq-coarse, per-head selection over M=2, 6-bit codes (the fastest index,
    and the default before the fine-code one)."""
    made = {
        "faithful": dataclasses.replace(config, rerank=2),
        "coarse": dataclasses.replace(config, subvectors=2, bits=6, sample=0, share="head", rerank=0),
    }
    unknown = [n for n in names if n not in made]
    if unknown:
        raise ValueError(f"variants: expected names among {VARIANTS}, got {', '.join(unknown)}")
    return {f"pq-{n}": made[n] for n in names}


GENERATORS = ("workload", "needles")


def generator_spec(name: str, spec: WorkloadSpec) -> WorkloadSpec | NeedleSpec:
    """The spec of generator `name` at the shape (tokens, heads, head dim, steps, batch, seed) of `spec`."""
    if name == "workload":
        return spec
    if name == "needles":
        shape = ("tokens", "kv_heads", "group", "head_dim", "steps", "batch", "seed")
        return NeedleSpec(**{k: getattr(spec, k) for k in shape})
    raise ValueError(f"generator: expected one of {GENERATORS}, got {name!r}")


def run_demo(
    spec: WorkloadSpec | NeedleSpec,
    config: PQConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int = 20,
    variants: dict[str, PQConfig] | None = None,
) -> dict:
    """Run the synthetic cache of `spec` (pqattn.lab.workload or pqattn.lab.needles) and return the
    results as a JSON-ready dict; `variants`: more indexes by method name (`variant_configs`),
    each reported beside pq."""
    needles = isinstance(spec, NeedleSpec)
    work = (make_needles(spec) if needles else make_workload(spec)).to(device, dtype)
    N, H = spec.tokens, spec.num_heads
    c = config

    sync(device)
    t0 = time.perf_counter()
    index = PQIndex.build(work.keys[:, :, :N], capacity=N + spec.steps, config=c)  # shows its progress
    sync(device)
    build_ms = (time.perf_counter() - t0) * 1e3
    variants = variants or {}
    host = _host_cache(index, work.keys, work.values, N, spec.steps, H) if c.share == "group" else None
    methods = ("pq", *variants, *(("pq-host",) if host else ()), *METHODS[1:])
    indexes = {"pq": index}
    for name, vc in variants.items():
        if all(getattr(vc, f) == getattr(c, f) for f in _BUILD_FIELDS):  # the same codebook
            book = ops.PQCodebook(
                index.centroids, index.codes[:, :, :N], index.phi if c.metric == "ip" else None
            )
            indexes[name] = PQIndex.from_codebook(book, capacity=N + spec.steps, config=vc)
        else:
            indexes[name] = PQIndex.build(work.keys[:, :, :N], capacity=N + spec.steps, config=vc)

    def select(method: str, q: torch.Tensor, n: int) -> pqattn.Selection:
        """The method's selection, one row per query head (a group selection's rows repeated)."""
        if method in indexes:
            ix = indexes[method]
            return per_head(ix.select(q, work.keys if ix.config.rerank else None), H)
        if method == "streaming":
            return ops.select_streaming(index.lengths, H, sink=c.sink, window=c.window)
        return ops.select_oracle(
            q,
            work.keys[:, :, :n],
            index.lengths,
            sink=c.sink,
            window=c.window,
            heavy=c.heavy,
            init_offset=c.offset,
        )

    def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]

    quality: dict[str, dict[str, list[float]]] = {
        m: {"mass": [], "recall": [], "rel_err": []} for m in methods
    }
    sizes = {}
    for t in range(spec.steps):
        for ix in indexes.values():
            ix.append(work.keys[:, :, N + t : N + t + 1])
        n = N + t + 1
        q = work.queries[t]
        keys, values = work.keys[:, :, :n].float(), work.values[:, :, :n].float()
        reference = ops.dense_attention(q.float()[:, :, None], keys, values)[:, :, 0]
        probs = metrics.attention_probs(q.float(), keys)
        sels = {m: select(m, q, n) for m in methods if m != "pq-host"}
        outs = {}
        if host is not None:  # the host tier's own step: its lists and its output
            new = (work.keys[:, :, n - 1 : n], work.values[:, :, n - 1 : n])
            outs["pq-host"] = host.decode_step(q, *new).clone()
            sels["pq-host"] = per_head(host.selection, H)
        for m, sel in sels.items():
            out = outs.get(m)
            if out is None:
                out = ops.sparse_decode(q, work.keys, work.values, sel.positions, sel.counts)
            quality[m]["mass"].append(float(metrics.captured_mass(probs, sel).mean()))
            recall = metrics.oracle_recall(sel, sels["oracle"], sels["streaming"], n)
            quality[m]["recall"].append(float(recall.mean()))
            quality[m]["rel_err"].append(metrics.relative_error(out, reference))
            sizes[m] = float(sel.counts.float().mean())

    # Timing at the final cache length n, all methods and dense SDPA in this same run, each over
    # its own copies of the cache (CACHE_SETS on a GPU, so that no side finds in L2 what a decode
    # loop reads from memory): eager wall-clock per step with a sync, and on a GPU the GPU time of
    # the step replayed in a graph. The PQ methods run the user's step, PQIndex.decode_step (store,
    # append, select, attend), each sample from n tokens.
    q, n = work.queries[-1], N + spec.steps
    sets = CACHE_SETS if device.type == "cuda" else 1
    caches = cache_copies(work.keys[:, :, :n], work.values[:, :, :n], room=_GRAPH_CALLS, sets=sets)
    k_new, v_new = work.keys[:, :, n - 1 : n], work.values[:, :, n - 1 : n]
    steps, rewinds = {}, {}
    for m in methods:
        if m in indexes:
            ix = indexes[m]
            book = ops.PQCodebook(ix.centroids, ix.codes[:, :, :n], ix.phi)
            copies = [
                PQIndex.from_codebook(book, capacity=n + _GRAPH_CALLS, config=ix.config) for _ in caches
            ]
            steps[m] = [
                lambda c=c, kc=kc, vc=vc: c.decode_step(q, k_new, v_new, kc, vc)
                for c, (kc, vc) in zip(copies, caches, strict=True)
            ]
            rewinds[m] = lambda copies=copies: [c.truncate([n] * c.batch) for c in copies]
        elif m == "pq-host":  # its rows in host memory, one tier per cache copy
            tiers = [_host_cache(index, kc, vc, n, _GRAPH_CALLS, H) for kc, vc in caches]
            steps[m] = [lambda t=t: t.decode_step(q, k_new, v_new) for t in tiers]
            rewinds[m] = lambda tiers=tiers: [t.truncate([n] * t.index.batch) for t in tiers]
        else:
            sel = select(m, q, n)
            steps[m] = [
                lambda kc=kc, vc=vc, sel=sel: ops.sparse_decode(q, kc, vc, sel.positions, sel.counts)
                for kc, vc in caches
            ]
    steps["dense"] = [lambda kc=kc, vc=vc: dense(q, kc[:, :, :n], vc[:, :, :n]) for kc, vc in caches]
    timings = {m: _wall_us(fns, device, repeats, rewinds.get(m)) for m, fns in steps.items()}
    gpu = {m: _graph_us(fns, device, repeats, rewinds.get(m)) for m, fns in steps.items()}
    dense_us, dense_gpu = timings["dense"]["median_us"], gpu["dense"]

    rows = []
    for m in methods:
        qm = quality[m]
        rows.append(
            {
                "method": m,
                "tokens": sizes[m],
                "attention_mass": sum(qm["mass"]) / len(qm["mass"]),
                "oracle_recall": sum(qm["recall"]) / len(qm["recall"]),
                "output_rel_err": sum(qm["rel_err"]) / len(qm["rel_err"]),
                **_step_times(timings[m]["median_us"], gpu[m], dense_us, dense_gpu),
            }
        )
    rows.append(
        {
            "method": "dense",
            "tokens": float(n),
            "attention_mass": 1.0,
            "oracle_recall": 1.0,
            "output_rel_err": 0.0,
            **_step_times(dense_us, dense_gpu, dense_us, dense_gpu),
        }
    )
    return {
        "generator": "needles" if needles else "workload",
        "workload": dataclasses.asdict(spec),
        "config": dataclasses.asdict(config),
        "variants": {name: dataclasses.asdict(vc) for name, vc in variants.items()},
        "dtype": str(dtype).removeprefix("torch."),
        "environment": environment(device),
        "build_ms": build_ms,
        "timing_note": "eager wall-clock per decode step with a device sync"
        + (", and GPU time of the\nstep replayed in a CUDA graph" if device.type == "cuda" else "")
        + " (medians), each over its own copies of the cache; pq = PQIndex.decode_step (store,\nappend, "
        "select, attend), pq-host = HostCache.decode_step (the same with the cache in host memory; the\n"
        "timed step repeats one query, whose rows stay resident), streaming/oracle = pqattn.sparse_decode\n"
        "over their selection, dense = torch SDPA",
        "timings": timings,
        "results": rows,
    }


def _host_cache(
    index: PQIndex, keys: torch.Tensor, values: torch.Tensor, n: int, room: int, heads: int
) -> HostCache:
    """A host tier over index's codebook (its first n tokens) and keys / values [B, Hkv, >= n, D]."""
    book = ops.PQCodebook(index.centroids, index.codes[:, :, :n], index.phi)
    tier = HostCache(
        PQIndex.from_codebook(book, capacity=n + room, config=index.config),
        query_heads=heads,
        dtype=keys.dtype,
    )
    tier.write(keys[:, :, :n], values[:, :, :n])
    return tier


# Steps per captured graph. A graph of one step, replayed between CUDA events, also times the
# host's graph launch whenever the GPU waits for it (docs/lab.md); the bench's graphs hold many
# calls for the same reason.
_GRAPH_CALLS = 20


CACHE_SETS = 8  # copies of the cache a timed step rotates over on a GPU


def _wall_us(fns, device: torch.device, repeats: int, between) -> dict:
    """Eager wall-clock statistics of one step + sync, cycling through the input sets."""
    for fn in fns:
        fn()
    out = time_eager(fns, device, repeats=repeats, between=between)
    del out["samples_us"]
    return out


def _graph_us(fns, device: torch.device, repeats: int, between) -> float | None:
    """GPU time per call of the steps replayed in a CUDA graph of _GRAPH_CALLS calls cycling
    through the input sets (None on a CPU, or when they cannot be captured)."""
    if device.type != "cuda":
        return None
    if between is not None:
        between()
    try:
        graph = capture(fns, device, calls=_GRAPH_CALLS)
    except RuntimeError:
        return None
    timed = time_graph(graph, device, repeats=max(repeats, 20), calls=_GRAPH_CALLS, between=between)
    return timed["median_us"]


def _step_times(eager: float, gpu: float | None, dense: float, dense_gpu: float | None) -> dict:
    return {
        "step_us": eager,
        "speedup_vs_dense": dense / eager,
        "step_gpu_us": gpu,
        "gpu_speedup_vs_dense": None if gpu is None or dense_gpu is None else dense_gpu / gpu,
    }


_DESCRIPTION = {
    "workload": "synthetic LLM-like cache (lab.workload)",
    "needles": "synthetic single-token needles, no sink (lab.needles)",
}


def has_gpu(result: dict) -> bool:
    """True when the result holds GPU (graph) step times (a CUDA run of this version)."""
    return any(r.get("step_gpu_us") is not None for r in result["results"])


def describe(config: dict, group: int) -> str:
    """One line on an index config (a PQConfig as a dict) for queries of `group` heads per KV head."""
    c = PQConfig(**config)
    sample = c.keys_per_centroid
    built = f"on {sample} keys per centroid" if sample else "on every key"
    text = f"M={c.subvectors}, {c.bits} bits, {c.metric}, {built}; "
    if c.share == "group":
        rule = f"{c.group_rule} of its {group} heads' scores"
        text += f"one selection per KV head ({rule}) of {c.row_heavy(group)} rows"
    else:
        text += f"one selection per query head of {c.heavy} rows"
    if c.rerank:
        text += f", exact re-rank of {c.rerank} x as many"
    return text


def format_table(result: dict) -> str:
    w, c, env = result["workload"], result["config"], result["environment"]
    H = w["kv_heads"] * w["group"]
    lines = [
        f"pqattn demo: {_DESCRIPTION[result.get('generator', 'workload')]}, {w['tokens']} tokens + "
        f"{w['steps']} decode steps, "
        f"B={w['batch']} H={H} Hkv={w['kv_heads']} D={w['head_dim']}, {result['dtype']} on "
        f"{env['device']} ({env['device_name']})",
        f"budget: sink {c['sink']} + heavy {c['heavy']} per query head + window {c['window']}; "
        f"index built in {result['build_ms']:.0f} ms",
        f"pq: {describe(c, w['group'])}",
    ]
    lines += [f"{name}: {describe(vc, w['group'])}" for name, vc in result.get("variants", {}).items()]
    lines += [
        "",
        f"{'method':<11} {'tokens':>7} {'attn mass':>10} {'oracle recall':>14} {'out rel err':>12} "
        f"{'step time':>11} {'vs dense':>9}"
        + (f" {'GPU time':>11} {'vs dense':>9}" if has_gpu(result) else ""),
    ]
    for r in result["results"]:
        gpu = ""
        if has_gpu(result):
            us, x = r.get("step_gpu_us"), r.get("gpu_speedup_vs_dense")
            gpu = f" {'-' if us is None else f'{us:.1f}':>8} us {'-' if x is None else f'{x:.2f}x':>9}"
        lines.append(
            f"{r['method']:<11} {r['tokens']:>7.0f} {r['attention_mass']:>10.3f} {r['oracle_recall']:>14.3f} "
            f"{r['output_rel_err']:>12.4f} {r['step_us']:>8.0f} us {r['speedup_vs_dense']:>8.2f}x{gpu}"
        )
    lines += [
        "",
        *textwrap.wrap(
            "attn mass: share of the dense softmax mass on the selected tokens; oracle recall: share of "
            "the exact top-heavy tokens found; out rel err: ||out - dense|| / ||dense||; vs dense: dense "
            f"time over the method's time. step time: {' '.join(result['timing_note'].split())}.",
            100,
        ),
        "",
        *textwrap.wrap(verdict(result), 100),
    ]
    return "\n".join(lines)


def verdict(result: dict) -> str:
    """One line: which PQ methods beat dense on this device, and the attention mass they keep."""
    gpu = has_gpu(result)
    key = "gpu_speedup_vs_dense" if gpu else "speedup_vs_dense"
    pq = [r for r in result["results"] if r["method"].startswith("pq") and r.get(key) is not None]
    faster = [f"{r['method']} ({r[key]:.2f}x, mass {r['attention_mass']:.2f})" for r in pq if r[key] > 1.0]
    slower = [f"{r['method']} ({r[key]:.2f}x)" for r in pq if r[key] <= 1.0]
    where = "GPU time" if gpu else "wall-clock"
    text = f"verdict ({where}, {result['environment']['device_name']}): "
    text += (
        ("faster than dense: " + ", ".join(faster)) if faster else "no PQ method is faster than dense here"
    )
    text += ("; not faster: " + ", ".join(slower)) if slower and faster else ""
    if not gpu:
        text += (
            ". On a CPU pqattn runs its PyTorch reference, not the Triton kernels: these times say "
            "nothing of a GPU's"
        )
    return text + "."
