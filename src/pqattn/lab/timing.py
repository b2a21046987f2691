"""Wall-clock timing of one call with a device sync, the figure a user's Python loop sees."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_us(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, repeats: int = 20) -> dict:
    """Median / IQR / min microseconds per call of `fn`, synchronizing after every call."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - t0) * 1e6)
    q1, _, q3 = statistics.quantiles(samples, n=4) if len(samples) > 1 else (samples[0],) * 3
    return {
        "median_us": statistics.median(samples),
        "iqr_us": q3 - q1,
        "min_us": min(samples),
        "repeats": repeats,
    }
