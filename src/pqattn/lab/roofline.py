"""The two ceilings every case is held against, measured once per run on the device itself.

* copy bandwidth: a large device-to-device copy, counting bytes read plus bytes written;
* matmul rate: a large bf16 (GPU) / float32 (CPU) matrix product through torch.

A case's floor is max(bytes / bandwidth, flops / rate): no implementation runs much faster.
"""

from __future__ import annotations

import statistics
import time

import torch

from pqattn.lab.timing import sync


def _median_us(fn, device: torch.device, repeats: int) -> float:
    fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def copy_gbps(device: torch.device, copy_bytes: int, repeats: int = 20) -> float:
    """GB/s (read + write) of a device-to-device copy of `copy_bytes` bytes of float32 elements
    (a copy of 1-byte elements runs well below the memory's rate on Hopper)."""
    src = torch.randn(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * copy_bytes / _median_us(lambda: dst.copy_(src), device, repeats=repeats) / 1e3


def measure_ceilings(device: torch.device, *, small: bool = False) -> dict:
    """Copy bandwidth (GB/s, read + write) and matmul rate (TFLOP/s) of `device`."""
    gpu = device.type == "cuda"
    copy_bytes = (2**30 if gpu else 2**26) // (16 if small else 1)
    copy = copy_gbps(device, copy_bytes, repeats=5 if small else 20)

    n = (8192 if gpu else 1024) // (4 if small else 1)
    dtype = torch.bfloat16 if gpu else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_us = _median_us(lambda: a @ b, device, repeats=5 if small else 20)
    return {
        "copy_gbps": copy,
        "matmul_tflops": 2 * n**3 / mm_us / 1e6,
        "copy_bytes": copy_bytes,
        "matmul_n": n,
        "matmul_dtype": str(dtype).removeprefix("torch."),
    }


def floor_us(bytes_moved: int, flops: int, ceilings: dict) -> float:
    """Lower bound on the time of a case from its bytes and FLOPs."""
    return max(bytes_moved / (ceilings["copy_gbps"] * 1e3), flops / (ceilings["matmul_tflops"] * 1e6))


def rates(bytes_moved: int, flops: int, time_us: float, ceilings: dict) -> dict:
    """Achieved GB/s and TFLOP/s and their share of the measured ceilings."""
    gbps = bytes_moved / time_us / 1e3
    tflops = flops / time_us / 1e6
    return {
        "gbps": gbps,
        "pct_copy": 100.0 * gbps / ceilings["copy_gbps"],
        "tflops": tflops,
        "pct_matmul": 100.0 * tflops / ceilings["matmul_tflops"],
        "floor_us": floor_us(bytes_moved, flops, ceilings),
    }
