"""`pqattn compare A.json B.json`: did anything get faster or slower between two bench runs?

Rows are matched by suite/case/implementation. For each, on the chosen timing mode: ratio of
medians B / A with a bootstrap 95% CI, Mann-Whitney U p-value, Cliff's delta and a verdict. The
gate fails (exit 1) when any row is slower by more than 3% with p < 0.01.
"""

from __future__ import annotations

from pqattn.lab.schema import key
from pqattn.lab.stats import ALPHA, REGRESSION, compare_samples

TIMING_MODES = ("auto", "graph", "eager", "pipelined")


def _mode(ra: dict, rb: dict, mode: str) -> str | None:
    ta, tb = ra["timings"], rb["timings"]
    if mode == "auto":
        return "graph" if ta.get("graph") and tb.get("graph") else "eager"
    return mode if ta.get(mode) and tb.get(mode) else None


def compare_docs(a: dict, b: dict, *, mode: str = "auto") -> dict:
    """Compare validated results documents A (baseline) and B (candidate)."""
    if mode not in TIMING_MODES:
        raise ValueError(f"timing: expected one of {TIMING_MODES}, got {mode!r}")
    rows_a = {key(r): r for r in a["results"] if r["skipped"] is None}
    rows_b = {key(r): r for r in b["results"] if r["skipped"] is None}
    rows = []
    for k in rows_a.keys() & rows_b.keys():
        m = _mode(rows_a[k], rows_b[k], mode)
        if m is None:
            rows.append({"key": k, "mode": mode, "missing": f"no {mode} timing on both sides"})
            continue
        c = compare_samples(rows_a[k]["timings"][m]["samples_us"], rows_b[k]["timings"][m]["samples_us"])
        rows.append({"key": k, "mode": m, **c.as_dict()})
    order = {k: i for i, k in enumerate([key(r) for r in a["results"]])}
    rows.sort(key=lambda r: order[r["key"]])
    env_a, env_b = a["environment"], b["environment"]
    warnings = [
        f"{field} differs: {_shown(env_a.get(field))} vs {_shown(env_b.get(field))}"
        for field in ("device_name", "driver", "torch", "triton")
        if _shown(env_a.get(field)) != _shown(env_b.get(field))
    ]
    return {
        "rows": rows,
        "only_a": sorted(rows_a.keys() - rows_b.keys()),
        "only_b": sorted(rows_b.keys() - rows_a.keys()),
        "warnings": warnings,
        "git": [env_a.get("git_sha"), env_b.get("git_sha")],
        "regressions": [r["key"] for r in rows if r.get("regression")],
    }


def format_comparison(result: dict) -> str:
    ga, gb = (str(g)[:10] for g in result["git"])
    lines = [f"A = {ga}, B = {gb}; ratio = median B / median A (< 1: B faster)"]
    lines += [f"warning: {w}" for w in result["warnings"]]
    head = ("case", "mode", "A us", "B us", "ratio", "95% CI", "p", "delta", "verdict")
    table = [head]
    for r in result["rows"]:
        if "missing" in r:
            table.append((r["key"], r["mode"], "", "", "", "", "", "", r["missing"]))
            continue
        verdict = r["verdict"] + (" REGRESSION" if r["regression"] else "")
        table.append(
            (
                r["key"],
                r["mode"],
                f"{r['median_a']:.2f}",
                f"{r['median_b']:.2f}",
                f"{r['ratio']:.3f}",
                f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]",
                f"{r['p_value']:.2g}",
                f"{r['cliffs_delta']:+.2f}",
                verdict,
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table]
    for side, keys in (("A", result["only_a"]), ("B", result["only_b"])):
        if keys:
            lines.append(f"only in {side}: {', '.join(keys)}")
    n = len(result["regressions"])
    lines.append(
        f"{n} regression(s) (slower by > {REGRESSION:.0%} with p < {ALPHA})" if n else "no regression"
    )
    return "\n".join(lines)


def _shown(value: object) -> object:
    """An environment field as compared and printed: the driver's first line (nvidia-smi prints a
    line per GPU)."""
    return value.splitlines()[0] if isinstance(value, str) and value else value
