"""The results document `pqattn bench` writes and `pqattn compare` / `pqattn report` read.

{schema: "pqattn-bench/1", created, argv, size, suites,
 environment: {git_sha, device_name, driver, torch, triton, ...},
 ceilings: {copy_gbps, matmul_tflops, ...}, settings: {...},
 results: [{suite, case, params, impl, role: pqattn|baseline, note, bytes, flops, rotation,
            skipped: null | reason, versus: null | [baselines doing the same work],
            # when not skipped:
            timings: {graph: null | T, eager: T, pipelined: T}, primary: graph|pipelined,
            host_sync: null | message, graph_error: null | message,
            gbps, pct_copy, tflops, pct_matmul, floor_us,
            vs: {baseline: {mode, speedup, pipelined_speedup?}} (pqattn rows), profile: {...} (--profile),
            # model loops (generate, host suites):
            ms_per_token, tokens_per_s, tokens_per_s_pipelined, replay_ms_per_token, kernel_ms_per_token?,
            latency_over_kernels?, breakdown?: {weights|attention|other|idle: {ms, floor_ms}}}]}
T = {median_us, iqr_us, min_us, repeats, samples_us: [...], calls_per_sample?}
profile = {calls, kernels: [{name, launches_per_call, gpu_us_per_call, idle_before_us_per_call}],
           idle_before: [...], families_us_per_call: {weights, attention, other} | null,
           launches_per_call, gpu_us_per_call, idle_us_per_call, cpu_overhead_us}
"""

from __future__ import annotations

import json
import math
from pathlib import Path

BENCH_SCHEMA = "pqattn-bench/1"

_ENV_KEYS = ("git_sha", "device_name", "torch", "triton", "driver")
_ROW_KEYS = ("suite", "case", "params", "impl", "role", "bytes", "flops", "skipped")
_TIMED_KEYS = ("timings", "primary", "gbps", "pct_copy", "tflops", "pct_matmul", "floor_us")
_TIMING_KEYS = ("median_us", "iqr_us", "min_us", "repeats", "samples_us")


def _fail(where: str, msg: str) -> None:
    raise ValueError(f"results: {where}: {msg}")


def _check_timing(where: str, t: object) -> None:
    if not isinstance(t, dict):
        _fail(where, f"expected a timing object, got {type(t).__name__}")
    missing = [k for k in _TIMING_KEYS if k not in t]
    if missing:
        _fail(where, f"missing {missing}")
    samples = t["samples_us"]
    if not isinstance(samples, list) or len(samples) != t["repeats"] or not samples:
        _fail(
            where,
            f"expected {t['repeats']} samples, got "
            f"{len(samples) if isinstance(samples, list) else samples!r}",
        )
    if not all(isinstance(s, int | float) and math.isfinite(s) and s >= 0 for s in samples):
        _fail(where, "samples must be finite non-negative numbers")


def validate(doc: object) -> dict:
    """Raise ValueError naming the first field that does not follow the schema; return the doc."""
    if not isinstance(doc, dict):
        _fail("document", f"expected an object, got {type(doc).__name__}")
    if doc.get("schema") != BENCH_SCHEMA:
        _fail("schema", f"expected {BENCH_SCHEMA!r}, got {doc.get('schema')!r}")
    for key in ("environment", "ceilings", "results"):
        if key not in doc:
            _fail(key, "missing")
    missing = [k for k in _ENV_KEYS if k not in doc["environment"]]
    if missing:
        _fail("environment", f"missing {missing}")
    for key in ("copy_gbps", "matmul_tflops"):
        v = doc["ceilings"].get(key)
        if not isinstance(v, int | float) or not v > 0:
            _fail(f"ceilings.{key}", f"expected a positive number, got {v!r}")
    if not isinstance(doc["results"], list):
        _fail("results", "expected a list")
    seen = set()
    for i, r in enumerate(doc["results"]):
        where = f"results[{i}]"
        missing = [k for k in _ROW_KEYS if k not in r]
        if missing:
            _fail(where, f"missing {missing}")
        key = (r["suite"], r["case"], r["impl"])
        if key in seen:
            _fail(where, f"duplicate case {'/'.join(key)}")
        seen.add(key)
        if r["role"] not in ("pqattn", "baseline"):
            _fail(f"{where}.role", f"expected 'pqattn' or 'baseline', got {r['role']!r}")
        if r["skipped"] is not None:
            continue
        missing = [k for k in _TIMED_KEYS if k not in r]
        if missing:
            _fail(where, f"missing {missing}")
        t = r["timings"]
        for mode in ("eager", "pipelined"):
            _check_timing(f"{where}.timings.{mode}", t.get(mode))
        if t.get("graph") is not None:
            _check_timing(f"{where}.timings.graph", t["graph"])
        if r["primary"] not in ("graph", "pipelined") or t.get(r["primary"]) is None:
            _fail(f"{where}.primary", f"names no timing: {r['primary']!r}")
    return doc


def load(path: str | Path) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"results: cannot read {path}: {e}") from e
    try:
        return validate(doc)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def key(row: dict) -> str:
    return f"{row['suite']}/{row['case']}/{row['impl']}"
