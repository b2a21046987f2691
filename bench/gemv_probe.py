"""How near its bytes floor a decode step's weight product can run: cuBLAS (`F.linear`) against a
plain Triton GEMV (a program per BLOCK_N outputs over the whole K, or split along K into float32
atomics), best of a small config space, on the Llama-3-8B layer's products of one GPU and of a
rank at 2 and 4 GPUs (bfloat16, M = 1 and 8 tokens; 8 layers of distinct weights a graph replay,
GPU time against the weights' bytes at 4.15 TB/s, the rate the largest product streams at). A
kernel figure for the next GEMV's design, not a path users call.

Usage: PYTHONPATH=src python3 bench/gemv_probe.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pqattn.lab.env import environment
from pqattn.lab.timing import capture, time_graph

LAYERS = 8
READ_GBPS = 4150.0
SHAPES = [  # (outputs, inputs, name)
    (6144, 4096, "qkv"),
    (4096, 4096, "o"),
    (4096, 14336, "down"),
    (3072, 4096, "qkv-tp2"),
    (4096, 2048, "o-tp2"),
    (1536, 4096, "qkv-tp4"),
    (4096, 1024, "o-tp4"),
]


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, k_span,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """y[M, N] = x[M, K] @ w[N, K]^T over the program's BLOCK_N outputs and K span (SPLIT: added
    into a float32 y by atomics)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    start = tl.program_id(1) * k_span
    for k0 in range(start, start + k_span, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
        acc += tl.dot(x, tl.trans(w))
    at = y_ptr + rm[:, None] * N + rn[None, :]
    if SPLIT:
        tl.atomic_add(at, acc, mask=rm[:, None] < M, sem="relaxed")
    else:
        tl.store(at, acc.to(tl.bfloat16), mask=rm[:, None] < M)


def _timed(fn, ws: list[torch.Tensor], dev: torch.device) -> float:
    """GPU us of fn over every weight of `ws`, by graph replay."""

    def step() -> None:
        for w in ws:
            fn(w)

    return time_graph(capture([step], dev, calls=1), dev, repeats=30, calls=1)["median_us"]


def _triton_configs(x: torch.Tensor, ws: list[torch.Tensor], dev: torch.device) -> list[dict]:
    """Every config of the space that fits the shape and the shared memory, timed (each non-split
    one checked against cuBLAS first)."""
    (m, k), n = x.shape, ws[0].shape[0]
    configs = []
    for bn, bk, stages, split in (
        (bn, bk, st, sp) for bn in (16, 32, 64) for bk in (128, 256, 512) for st in (3, 5) for sp in (1, 2, 4)
    ):
        if k % (bk * split) or n % bn:
            continue
        y = torch.zeros(m, n, device=dev, dtype=torch.float32 if split > 1 else torch.bfloat16)
        grid, span, meta = (n // bn, split), k // split, dict(num_warps=4, num_stages=stages)

        def launch(w, y=y, grid=grid, span=span, bn=bn, bk=bk, split=split, meta=meta) -> None:
            if split > 1:
                y.zero_()
            _gemv_kernel[grid](x, w, y, m, n, k, span, 16, bn, bk, split > 1, **meta)

        try:
            launch(ws[0])
        except triton.runtime.errors.OutOfResources:  # (its stages' tiles exceed shared memory)
            continue
        if split == 1:
            torch.testing.assert_close(y.float(), F.linear(x, ws[0]).float(), rtol=2e-2, atol=2e-1)
        us = _timed(launch, ws, dev)
        configs.append({"block_n": bn, "block_k": bk, "stages": stages, "split": split, "us": us})
    return configs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    a = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    for n, k, name in SHAPES:
        ws = [torch.randn(n, k, device=dev).bfloat16() for _ in range(LAYERS)]
        floor = LAYERS * n * k * 2 / (READ_GBPS * 1e3)
        for m in (1, 8):
            x = torch.randn(m, k, device=dev).bfloat16()
            row = {"name": name, "N": n, "K": k, "M": m, "floor_us": floor}
            row["cublas_us"] = _timed(lambda w, x=x: F.linear(x, w), ws, dev)
            row["triton"] = min(_triton_configs(x, ws, dev), key=lambda c: c["us"])
            row["cublas_x"], row["triton_x"] = row["cublas_us"] / floor, row["triton"]["us"] / floor
            rows.append(row)
            t = row["triton"]
            print(
                f"{name:7s} M{m}: floor {floor:6.1f} us, cuBLAS {row['cublas_x']:.2f}x, Triton "
                f"{row['triton_x']:.2f}x ({t['block_n']}/{t['block_k']}/{t['stages']} split {t['split']})",
                flush=True,
            )
        del ws
    if a.json:
        doc = {"env": environment(dev), "read_gbps": READ_GBPS, "layers": LAYERS, "rows": rows}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
