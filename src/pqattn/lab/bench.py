"""`pqattn bench`: time every case of the chosen suites, three ways, against same-run baselines.

Per case and implementation: GPU time from CUDA-graph replay (when the calls make no host sync
and can be captured), eager wall-clock per call with a sync, pipelined wall-clock per call; the
achieved GB/s and TFLOP/s as a share of the copy bandwidth and matmul rate measured at the start of
the run; the speed-up of each pqattn implementation over each baseline of the case. `--profile`
adds a torch.profiler breakdown (kernels, launches per call, CPU overhead = wall - GPU, the GPU
idle before each kernel).
"""

from __future__ import annotations

import datetime
import gc
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pqattn.kernels import autotuners, kernel_names
from pqattn.lab import timing
from pqattn.lab.env import environment, l2_bytes
from pqattn.lab.roofline import measure_ceilings, rates
from pqattn.lab.schema import BENCH_SCHEMA
from pqattn.lab.suites import SWEEP, Case, Impl, make_cases, rotation

MODES = ("graph", "eager", "pipelined")
LOOP_SUITES = ("generate", "host")  # a call is a decode step of a model loop


@dataclass(frozen=True)
class Settings:
    """How long to warm up and how many samples to take (per mode, per case and implementation)."""

    warmup_ms: float = 50.0
    target_ms: float = 300.0  # time budget per mode; repeats = clamp(target / estimate, min, max)
    min_repeats: int = 20
    max_repeats: int = 200
    graph_target_us: float = 500.0  # calls per graph replay / pipelined sample: about this long
    # a model loop's steps per pipelined sample at least: back to back, as StaticDecoder.run()
    # takes them (a step and a sync each would time the sync too)
    loop_calls: int = 16

    @staticmethod
    def for_size(size: str) -> Settings:
        if size == "tiny":
            return Settings(
                warmup_ms=0.0, target_ms=5.0, min_repeats=3, max_repeats=5, graph_target_us=50.0, loop_calls=4
            )
        return Settings()


def _config_dict(config) -> dict:
    return {
        **config.kwargs,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "maxnreg": config.maxnreg,
    }


def primary_mode(timings: dict) -> str:
    """The figure that stands for GPU time: graph replay when captured, else pipelined."""
    return "graph" if timings.get("graph") else "pipelined"


# cuBLAS's GEMM / GEMV kernels and their split-K reductions: a model loop's weight reads
_WEIGHT_KERNELS = re.compile(r"nvjet|gemm|gemv|cutlass|cublas|splitKreduce|xmma", re.IGNORECASE)
# torch's SDPA kernels (pqattn's own are named by pqattn.kernels.kernel_names)
_SDPA_KERNELS = re.compile(r"flash|fmha|attention", re.IGNORECASE)
FAMILIES = ("weights", "attention", "other")


def kernel_family(name: str, pqattn_kernels: frozenset[str]) -> str:
    """A profiled GPU kernel's share of a model step: "attention" (pqattn's kernels, SDPA's),
    "weights" (the GEMMs / GEMVs of the weights) or "other" (norms, rotary, residuals, copies)."""
    if name in pqattn_kernels or _SDPA_KERNELS.search(name):
        return "attention"
    if _WEIGHT_KERNELS.search(name):
        return "weights"
    return "other"


def idle_before(spans: Sequence[tuple[str, float, float]]) -> dict[str, float]:
    """Per kernel name, the time the GPU sat idle before its launches began.

    `spans` are (name, start, end) of every kernel in a window, in any order and possibly
    overlapping (streams); a gap is the time from the latest end so far to the next start.
    """
    idle: dict[str, float] = {}
    busy_until = None
    for name, start, end in sorted(spans, key=lambda s: s[1]):
        if busy_until is not None and start > busy_until:
            idle[name] = idle.get(name, 0.0) + start - busy_until
        busy_until = end if busy_until is None else max(busy_until, end)
    return idle


def profile_calls(fns: Sequence, device: torch.device, calls: int = 5) -> dict:
    """torch.profiler over `calls` calls of `fns` (in turn) and one sync: per kernel its launches
    and GPU time per call and the GPU's idle time before it; on a GPU the kernels by family
    (`kernel_family`) and the idle time in all (on a CPU the ops' CPU time instead)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    timing.sync(device)
    with profile(activities=activities) as prof:
        for i in range(calls):
            fns[i % len(fns)]()
        timing.sync(device)
    kernels: dict[str, list[float]] = {}
    idle: dict[str, float] = {}
    if device.type == "cuda":
        spans = [
            (e.name, e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        ]
        for name, start, end in spans:
            kernels.setdefault(name, []).append(end - start)
        idle = idle_before(spans)
        rows = [
            {
                "name": n,
                "launches_per_call": len(t) / calls,
                "gpu_us_per_call": sum(t) / calls,
                "idle_before_us_per_call": idle.get(n, 0.0) / calls,
            }
            for n, t in kernels.items()
        ]
    else:
        rows = [
            {
                "name": a.key,
                "launches_per_call": a.count / calls,
                "cpu_us_per_call": a.self_cpu_time_total / calls,
            }
            for a in prof.key_averages()
        ]
    key = "gpu_us_per_call" if device.type == "cuda" else "cpu_us_per_call"
    rows.sort(key=lambda r: -r[key])
    cuda = device.type == "cuda"
    families = None
    if cuda:
        names = kernel_names()
        families = dict.fromkeys(FAMILIES, 0.0)
        for r in rows:
            families[kernel_family(r["name"], names)] += r["gpu_us_per_call"]
    return {
        "calls": calls,
        "kernels": rows[:12],
        "families_us_per_call": families,
        "idle_before": sorted(rows, key=lambda r: -r["idle_before_us_per_call"])[:12] if cuda else None,
        "launches_per_call": sum(r["launches_per_call"] for r in rows) if cuda else None,
        "gpu_us_per_call": sum(r[key] for r in rows) if cuda else None,
        # the GPU idle between the window's first and last kernel (launch gaps and the waits between calls)
        "idle_us_per_call": sum(idle.values()) / calls if cuda else None,
    }


def run_impl(
    case: Case, impl: Impl, inputs: list[dict], device: torch.device, settings: Settings, *, profile: bool
) -> dict:
    """Time one implementation of one case on its rotating input sets."""
    fns = [lambda x=x: impl.fn(x) for x in inputs]
    between = None if impl.rewind is None else lambda: [impl.rewind(x) for x in inputs]
    # three calls at least: a model loop's first two build its decoder and capture its step
    est = timing.estimate_us(fns[0], device, warmup_ms=settings.warmup_ms, min_calls=3, between=between)
    for fn in fns[1:]:
        fn()
    repeats = int(
        min(settings.max_repeats, max(settings.min_repeats, settings.target_ms * 1e3 / max(est, 1e-3)))
    )
    calls = math.ceil(max(1.0, settings.graph_target_us / max(est, 1e-3)) / len(fns)) * len(fns)
    calls = min(calls, 64 * len(fns))
    if case.suite in LOOP_SUITES:  # its decoder has room for a bounded number of steps
        repeats = settings.min_repeats
        calls = max(calls, math.ceil(settings.loop_calls / len(fns)) * len(fns))

    out: dict = {"repeats_target": repeats, "estimate_us": est}
    timings: dict[str, dict | None] = {"graph": None}
    if between is not None:
        between()
    out["host_sync"] = timing.host_syncs(fns[0], device)
    out["graph_error"] = None
    if device.type != "cuda":
        out["graph_error"] = "no CUDA device"
    elif impl.no_graph is not None:
        out["graph_error"] = "not captured: " + impl.no_graph
    elif out["host_sync"] is not None:
        out["graph_error"] = "not capturable: the call synchronizes with the host"
    else:
        try:
            graph = timing.capture(fns, device, calls=calls)
            timings["graph"] = timing.time_graph(graph, device, repeats=repeats, calls=calls, between=between)
            del graph
        except RuntimeError as e:
            timing.sync(device)
            out["graph_error"] = "capture failed: " + str(e).splitlines()[0]
    timings["eager"] = timing.time_eager(fns, device, repeats=repeats, between=between)
    timings["pipelined"] = timing.time_pipelined(
        fns, device, repeats=max(3, repeats // 4), calls=calls, between=between
    )
    out["timings"] = timings
    if profile:
        if between is not None:
            between()
        prof = profile_calls(fns, device)
        if prof["gpu_us_per_call"] is not None:
            prof["cpu_overhead_us"] = timings["eager"]["median_us"] - prof["gpu_us_per_call"]
        out["profile"] = prof
    return out


def token_rates(row: dict, ceilings: dict) -> dict:
    """A generate row's per-token figures: one call is a decode step of the batch. With a GPU
    profile, its kernels' time by family beside each family's bytes floor (the weights, and the
    rest of the row's bytes for the attention)."""
    latency = row["timings"]["eager"]["median_us"]
    out = {
        "ms_per_token": latency / 1e3,
        "tokens_per_s": row["params"]["B"] * 1e6 / latency,
        "tokens_per_s_pipelined": row["params"]["B"] * 1e6 / row["timings"]["pipelined"]["median_us"],
        # GPU time of a step as StaticDecoder.run() takes them: replays back to back
        "replay_ms_per_token": row["timings"]["pipelined"]["median_us"] / 1e3,
    }
    profile = row.get("profile") or {}
    kernels = profile.get("gpu_us_per_call")
    if kernels:  # the kernels' GPU time of a step against its latency
        out["kernel_ms_per_token"] = kernels / 1e3
        out["latency_over_kernels"] = latency / kernels
    families, weights = profile.get("families_us_per_call"), row["params"].get("weights_bytes")
    if families and weights:
        floors = {"weights": weights, "attention": row["bytes"] - weights, "other": 0}
        out["breakdown"] = {
            f: {"ms": families[f] / 1e3, "floor_ms": floors[f] / (ceilings["copy_gbps"] * 1e6)}
            for f in FAMILIES
        } | {"idle": {"ms": profile["idle_us_per_call"] / 1e3, "floor_ms": 0.0}}
    return out


def _speedups(results: list[dict]) -> None:
    """For each pqattn implementation of a case: baseline time / its time, same mode on both sides.

    Only baselines that do the same work count (`Impl.versus`: a full decode step is held against
    dense attention, not against the reference's attention alone).
    """
    by_case: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        by_case.setdefault((r["suite"], r["case"]), []).append(r)
    for rows in by_case.values():
        timed = [r for r in rows if r.get("timings")]
        for r in timed:
            if r["role"] != "pqattn":
                continue
            vs = {}
            for b in timed:
                if b["role"] != "baseline" or (r.get("versus") is not None and b["impl"] not in r["versus"]):
                    continue
                mode = "graph" if r["timings"]["graph"] and b["timings"]["graph"] else "eager"
                vs[b["impl"]] = {
                    "mode": mode,
                    "speedup": b["timings"][mode]["median_us"] / r["timings"][mode]["median_us"],
                }
                if r["suite"] in LOOP_SUITES:  # model loops, back to back as StaticDecoder.run() runs them
                    pipelined = b["timings"]["pipelined"]["median_us"], r["timings"]["pipelined"]["median_us"]
                    vs[b["impl"]]["pipelined_speedup"] = pipelined[0] / pipelined[1]
            r["vs"] = vs


def run_bench(
    suites: list[str],
    *,
    size: str,
    device: torch.device,
    case_filter: str | None = None,
    impls: list[str] | None = None,
    profile: bool = False,
    argv: Sequence[str] | None = None,
    log=sys.stderr,
    on_row: Callable[[dict], None] | None = None,
) -> dict:
    """Run the suites and return the results document (schema `pqattn-bench/1`). on_row(doc) is
    called after each implementation of each case with the document so far (partial results
    of a run that may be cut short)."""
    import re

    cases = make_cases(suites, size, device)
    if case_filter:
        pattern = re.compile(case_filter)
        cases = [c for c in cases if pattern.search(f"{c.suite}/{c.name}")]
    if not cases:
        raise ValueError(f"case: no case of suites {suites} matches {case_filter!r}")
    settings = Settings.for_size(size)
    ceilings = measure_ceilings(device, small=size == "tiny")
    print(
        f"ceilings: copy {ceilings['copy_gbps']:.0f} GB/s, matmul {ceilings['matmul_tflops']:.1f} TFLOP/s",
        file=log,
    )
    l2 = l2_bytes(device)
    env = environment(device)
    results: list[dict] = []

    def document() -> dict:
        _speedups(results)
        return {
            "schema": BENCH_SCHEMA,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": list(argv) if argv is not None else None,
            "size": size,
            "suites": suites,
            "environment": env,
            "ceilings": ceilings,
            "settings": settings.__dict__,
            "results": results,
        }

    for case in cases:
        rot = rotation(case, l2)
        chosen = [i for i in case.impls if impls is None or i.name in impls]
        inputs = (
            [case.make_inputs(seed) for seed in range(rot)] if any(i.skip is None for i in chosen) else []
        )
        for impl in chosen:
            row = {
                "suite": case.suite,
                "case": case.name,
                "params": case.params,
                "impl": impl.name,
                "role": impl.role,
                "note": impl.note,
                "bytes": impl.bytes,
                "flops": impl.flops,
                "rotation": rot,
                "skipped": impl.skip,
                "versus": impl.versus,
            }
            if impl.skip is None:
                print(f"{case.suite}/{case.name} {impl.name} ...", file=log, flush=True)
                tuners = autotuners()
                for tuner in tuners.values():
                    tuner.best_config = None
                row.update(run_impl(case, impl, inputs, device, settings, profile=profile))
                used = {
                    k: _config_dict(t.best_config) for k, t in tuners.items() if t.best_config is not None
                }
                if used:  # the autotuner's choice for this case, per kernel the implementation ran
                    row["autotuned"] = used
                mode = primary_mode(row["timings"])
                row["primary"] = mode
                row.update(rates(impl.bytes, impl.flops, row["timings"][mode]["median_us"], ceilings))
                if case.suite in LOOP_SUITES:  # model loops: tokens per second
                    row.update(token_rates(row, ceilings))
            results.append(row)
            if on_row is not None:
                on_row(document())
        del inputs
        gc.collect()  # inputs that hold reference cycles (a model and its cache) go now
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return document()


def _us(t: dict | None) -> str:
    return "-" if not t else f"{t['median_us']:.1f}"


def format_table(doc: dict) -> str:
    env, ceil = doc["environment"], doc["ceilings"]
    lines = [
        f"pqattn bench ({doc['size']}) on {env['device_name']}, torch {env['torch']}, "
        f"triton {env['triton']}, "
        f"git {str(env['git_sha'])[:10]}; ceilings: copy {ceil['copy_gbps']:.0f} GB/s, "
        f"matmul {ceil['matmul_tflops']:.1f} TFLOP/s",
        "times in us per call (median); GPU = graph replay, eager = one call + sync, pipe = back-to-back",
        "",
    ]
    head = ("case", "impl", "GPU", "eager", "pipe", "floor", "GB/s", "%copy", "TFLOP/s", "vs baselines")
    rows = [head]
    for r in doc["results"]:
        name = f"{r['suite']}/{r['case']}"
        if r["skipped"]:
            rows.append((name, r["impl"], "skipped", "", "", "", "", "", "", r["skipped"]))
            continue
        t = r["timings"]
        vs = ", ".join(f"{k} {v['speedup']:.2f}x" for k, v in r.get("vs", {}).items())
        rows.append(
            (
                name,
                r["impl"],
                _us(t["graph"]) if t["graph"] else "n/a",
                _us(t["eager"]),
                _us(t["pipelined"]),
                f"{r['floor_us']:.1f}",
                f"{r['gbps']:.0f}",
                f"{r['pct_copy']:.0f}",
                f"{r['tflops']:.1f}",
                vs,
            )
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    notes = sorted({r["graph_error"] for r in doc["results"] if r.get("graph_error")})
    if notes:
        lines.append("")
        lines += [f"GPU n/a: {n}" for n in notes]
    generated = [r for r in doc["results"] if r.get("tokens_per_s")]
    if generated:
        lines += ["", "generate: per decode step of the batch (eager = latency; kernels from the profiler)"]
        for r in generated:
            kernels = r.get("kernel_ms_per_token")
            share = (
                f", kernels {kernels:.2f} ms (latency {r['latency_over_kernels']:.2f}x)" if kernels else ""
            )
            lines.append(
                f"  {r['case']} {r['impl']}: {r['tokens_per_s']:.0f} tokens/s, "
                f"{r['ms_per_token']:.2f} ms/token (back to back {r['replay_ms_per_token']:.2f}){share}"
            )
            if r.get("breakdown"):
                lines.append(
                    "    "
                    + ", ".join(
                        f"{f} {v['ms']:.2f} ms" + (f" (floor {v['floor_ms']:.2f})" if v["floor_ms"] else "")
                        for f, v in r["breakdown"].items()
                    )
                )
    profiled = [r for r in doc["results"] if r.get("profile")]
    for r in profiled:
        p = r["profile"]
        lines.append("")
        head = f"profile {r['suite']}/{r['case']} {r['impl']}:"
        if p["gpu_us_per_call"] is not None:
            head += (
                f" {p['launches_per_call']:.0f} launches/call, GPU {p['gpu_us_per_call']:.1f} us/call, "
                f"CPU overhead {p['cpu_overhead_us']:.1f} us/call"
            )
            if p.get("idle_us_per_call") is not None:
                head += f", GPU idle {p['idle_us_per_call']:.1f} us/call"
        lines.append(head)
        key = "gpu_us_per_call" if p["gpu_us_per_call"] is not None else "cpu_us_per_call"
        for k in p["kernels"][:6]:
            lines.append(f"  {k[key]:9.1f} us  x{k['launches_per_call']:.0f}  {k['name'][:90]}")
        for k in (p.get("idle_before") or [])[:4]:
            lines.append(f"  idle {k['idle_before_us_per_call']:6.1f} us before  {k['name'][:80]}")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    """One horizontal bar chart per suite: the primary time of every implementation, log scale."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("plot: matplotlib is not installed (pip install matplotlib)") from e
    suites = list(dict.fromkeys(r["suite"] for r in doc["results"]))
    sweep = [
        r
        for r in doc["results"]
        if r["suite"] == "decode" and r["case"].startswith(SWEEP) and not r["skipped"]
    ]
    n_ax = len(suites) + bool(sweep)
    fig, axes = plt.subplots(
        n_ax, 1, figsize=(10, 1 + 0.3 * len(doc["results"]) + 4 * bool(sweep)), squeeze=False
    )
    if sweep:
        ax = axes[-1, 0]
        for impl in dict.fromkeys(r["impl"] for r in sweep):
            pts = sorted(
                (r["params"]["N"], r["timings"][r["primary"]]["median_us"])
                for r in sweep
                if r["impl"] == impl
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        p = sweep[0]["params"]
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (tokens in the cache)")
        ax.set_ylabel("us per decode step")
        ax.set_title(
            f"decode step vs N: B{p['B']} H{p['H']} Hkv{p['Hkv']} D{p['D']}, "
            f"sink {p['sink']} + heavy {p['heavy']} + window {p['window']}"
        )
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    for ax, suite in zip(axes[: len(suites), 0], suites, strict=True):
        rows = [
            r
            for r in doc["results"]
            if r["suite"] == suite and not r["skipped"] and not r["case"].startswith(SWEEP)
        ]
        labels = [f"{r['case']} {r['impl']}" for r in rows]
        values = [r["timings"][r["primary"]]["median_us"] for r in rows]
        colors = ["tab:blue" if r["role"] == "pqattn" else "tab:gray" for r in rows]
        ax.barh(labels, values, color=colors)
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_title(f"{suite} (us per call; blue = pqattn, grey = baselines)")
        ax.tick_params(axis="y", labelsize=7)
    env = doc["environment"]
    fig.suptitle(f"{env['device_name']}, torch {env['torch']}, git {str(env['git_sha'])[:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
