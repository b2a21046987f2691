"""Three ways to time one operation, as METHOD.md asks for hot paths.

* **graph**: GPU time per call from CUDA-graph replay, timed with CUDA events. One graph holds
  `calls` back-to-back calls (cycling through the rotating input sets), so launch gaps shrink to
  what the GPU itself needs; a sample is one replay divided by `calls`.
* **eager**: wall-clock of one Python call followed by a device sync: what a user's loop that
  reads the result every step sees (launch overhead and host syncs included).
* **pipelined**: wall-clock of `calls` eager calls issued back to back, then one sync, divided by
  `calls`: the per-call cost when the CPU can run ahead of the GPU.

Every mode warms up first, takes many samples and reports median, IQR and min; the samples are
kept so that `pqattn compare` can test a difference for significance.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(samples: Sequence[float], **extra: object) -> dict:
    """median / IQR / min of per-call microseconds, with the samples themselves."""
    if len(samples) > 1:
        q1, _, q3 = statistics.quantiles(samples, n=4)
    else:
        q1 = q3 = samples[0]
    return {
        "median_us": statistics.median(samples),
        "iqr_us": q3 - q1,
        "min_us": min(samples),
        "repeats": len(samples),
        **extra,
        "samples_us": [round(s, 4) for s in samples],
    }


def wall_us(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, repeats: int = 20) -> dict:
    """Eager wall-clock statistics of `fn` without the samples (the demo's step times)."""
    for _ in range(warmup):
        fn()
    out = time_eager([fn], device, repeats=repeats)
    del out["samples_us"]
    return out


Between = Callable[[], object] | None  # untimed work before each sample (a state reset)


def cache_copies(
    k: torch.Tensor, v: torch.Tensor, *, room: int, sets: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`sets` copies of the cache k, v [B, Hkv, n, D], each with room for `room` more rows: the
    rotating input sets of a timed decode step."""
    B, Hkv, n, D = k.shape
    out = []
    for _ in range(sets):
        kc, vc = k.new_zeros(B, Hkv, n + room, D), v.new_zeros(B, Hkv, n + room, D)
        kc[:, :, :n], vc[:, :, :n] = k, v
        out.append((kc, vc))
    return out


def time_eager(
    fns: Sequence[Callable[[], object]], device: torch.device, *, repeats: int, between: Between = None
) -> dict:
    """One call + sync per sample; `fns` are the same operation on the rotating input sets."""
    samples = []
    sync(device)
    for i in range(repeats):
        fn = fns[i % len(fns)]
        if between is not None:
            between()
            sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - t0) * 1e6)
    return summarize(samples)


def time_pipelined(
    fns: Sequence[Callable[[], object]],
    device: torch.device,
    *,
    repeats: int,
    calls: int,
    between: Between = None,
) -> dict:
    """`calls` calls back to back, then one sync, per sample."""
    samples = []
    sync(device)
    for _ in range(repeats):
        if between is not None:
            between()
            sync(device)
        t0 = time.perf_counter()
        for i in range(calls):
            fns[i % len(fns)]()
        sync(device)
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
    return summarize(samples, calls_per_sample=calls)


def host_syncs(fn: Callable[[], object], device: torch.device) -> str | None:
    """None when one call of `fn` makes no host synchronisation, else the error torch raised.

    Uses torch's sync debug mode, which flags .item(), .cpu(), nonzero() and device-to-host copies.
    """
    if device.type != "cuda":
        return None
    sync(device)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as e:
        return str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        sync(device)
    return None


def capture(fns: Sequence[Callable[[], object]], device: torch.device, *, calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` calls cycling through `fns` (raises when the calls cannot be captured)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
        for fn in fns:
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    sync(device)
    return graph


def time_graph(
    graph: torch.cuda.CUDAGraph, device: torch.device, *, repeats: int, calls: int, between: Between = None
) -> dict:
    """GPU time per call from replays of `graph` (holding `calls` calls), CUDA events around each
    (`between` runs outside them, before each replay)."""
    if between is not None:
        between()
    graph.replay()
    sync(device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)
    ]
    for start, end in events:
        if between is not None:
            between()
        start.record()
        graph.replay()
        end.record()
    sync(device)
    samples = [start.elapsed_time(end) * 1e3 / calls for start, end in events]
    return summarize(samples, calls_per_sample=calls)


def estimate_us(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup_ms: float,
    min_calls: int = 2,
    between: Between = None,
) -> float:
    """Warm `fn` up for about `warmup_ms` (at least `min_calls` calls); returns the fastest call's
    time, us: the calls that compile, build or capture run longer, and so does a call the host
    delays, which would size the timed graphs and samples smaller from run to run."""
    deadline = time.perf_counter() + warmup_ms / 1e3
    best = math.inf
    n = 0
    while n < min_calls or time.perf_counter() < deadline:
        if between is not None:
            between()
            sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, (time.perf_counter() - t0) * 1e6)
        n += 1
    return best
