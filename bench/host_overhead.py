"""Host (Python) time of eager calls, with and without launch plans, on any machine.

Each Triton launch is replaced by a stand-in compiled kernel whose launch does nothing, so what is
timed is the Python between the call and the driver: argument checks, buffer management, the
launchers' argument handling, a plan's replay. The driver's own launch (a few microseconds per
kernel on a GPU host) and the GPU work come on top; `pqattn bench select decode` on a GPU
measures those end to end. The functional calls are given their output and workspace buffers.
Shapes: the decode suite's N=32K case (B=1, H=32, Hkv=8, D=128, M=2, bits 6). The original's
entry point (`indexer_next`, which keeps no plans) is timed twice: passed the same codebook
every call, as the original's benchmark does (the select suite's `compat`), and in a decode
loop, each call one key longer than the last and passed the codebook the last returned.

Usage: PYTHONPATH=src python3 bench/host_overhead.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import torch

import pqattn
from pqattn import dispatch, ops
from pqattn.integrations.sparse_attention_hub import codebook_buffer, indexer_next
from pqattn.runtime import launch


class _IdleKernel:
    """A compiled kernel whose launch does nothing."""

    function, packed_metadata = 0, (4, 1, 0)

    def run(self, *args) -> None:
        pass


def _stub_launches() -> None:
    """Run the kernel paths on CPU tensors with idle launches (the launchers' own code unchanged)."""
    idle = _IdleKernel()

    def compile_idle(self, key, grid, tensors, scalars, kwargs) -> None:
        names = self.fn.arg_names[len(tensors) + len(scalars) :]
        self.kernels[key] = (idle, tuple(kwargs[n] for n in names))

    def first_config(self, key, grid, tensors, scalars, meta) -> None:
        config = self.autotuned.configs[0]
        self.autotuned.best_config = config
        self.launch(grid(config.kwargs), tensors, scalars, {**meta, **config.all_kwargs()})

    dispatch.KERNEL_DEVICES = ("cuda", "cpu")
    launch._INTERPRETED = False
    launch.hooked = lambda: False
    launch.current_device = lambda: 0
    launch.current_stream = lambda device: 0
    launch.Launcher._compile_and_launch = compile_idle
    launch.TunedLauncher.__call__ = first_config


def _median_us(fn: Callable[[], object], calls: int = 2000, samples: int = 7) -> float:
    fn()
    fn()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(times)[len(times) // 2]


def _compat_calls(
    index: pqattn.PQIndex, q: torch.Tensor, k_cache: torch.Tensor, steps: int
) -> dict[str, Callable[[], None]]:
    """indexer_next over the index's codes as the original's int64 codebook (float32 query):
    the same codebook every call, and a decode loop of up to `steps` calls (then it starts over)."""
    c = index.config
    B, Hkv, N, M = index.codes.shape
    io, n_q = c.offset, N - c.offset - 1
    query = q[:, :, None].float()
    keys = torch.randn(B, Hkv, N + steps, index.head_dim, dtype=k_cache.dtype)
    opts = (torch.float32, c.sink, c.window, c.heavy, M, c.bits, 0, io, c.metric, index.centroids)

    def codebook() -> torch.Tensor:
        book = index.codes[:, :, io : io + n_q].long().transpose(1, 2)
        return codebook_buffer(book, io, n_q + 1)[0][:, io : io + n_q]

    same = codebook()
    loop = {"n": N, "codebook": codebook()}

    def decode_loop() -> None:
        if loop["n"] == N + steps:
            loop["n"], loop["codebook"] = N, codebook()
        out = indexer_next(query, keys[:, :, : loop["n"]], *opts, loop["codebook"], None)
        loop["n"], loop["codebook"] = loop["n"] + 1, out[4]

    return {
        "indexer_next": lambda: indexer_next(query, keys[:, :, :N], *opts, same, None),
        "indexer_next loop": decode_loop,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    _stub_launches()
    B, H, Hkv, N, D = 1, 32, 8, 32768, 128
    config = pqattn.PQConfig(subvectors=2, bits=6, sink=128, window=128, heavy=128, share="head")
    book = ops.PQCodebook(
        torch.randn(B, Hkv, 2, 64, D // 2), torch.randint(0, 64, (B, Hkv, N - 64, 2), dtype=torch.uint8), None
    )
    index = pqattn.PQIndex.from_codebook(book, [N - 64], capacity=N, config=config)
    q = torch.randn(B, H, D, dtype=torch.bfloat16)
    k_cache = torch.zeros(B, Hkv, N, D, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k_new = torch.randn(B, Hkv, 1, D, dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)

    def rewound(fn: Callable[[], object]) -> Callable[[], None]:
        def call() -> None:
            index._max_length = 0  # the lengths themselves are never read on the host
            fn()

        return call

    sel = index.select(q)
    sel.positions.fill_(0)  # (the idle launches wrote nothing: a valid selection for the checks)
    sel.counts.zero_()
    c = config
    out_sel = pqattn.Selection(torch.empty_like(sel.positions), torch.empty_like(sel.counts))
    select_ws = torch.zeros(ops.select_workspace_numel(B * H, 2, 64, N, c.heavy), dtype=torch.int32)
    out = torch.empty_like(q)
    attn_ws = torch.zeros(ops.decode_workspace_numel(B * H, c.width(), D), dtype=torch.int32)
    compat = _compat_calls(index, q, k_cache, steps=2000 * 7 + 2)
    calls = {
        "PQIndex.select": lambda: index.select(q),
        "PQIndex.attend": lambda: index.attend(q, k_cache, v_cache, sel),
        "PQIndex.append": rewound(lambda: index.append(k_new)),
        "PQIndex.decode_step": rewound(lambda: index.decode_step(q, k_new, v_new, k_cache, v_cache)),
        "select_topk": lambda: pqattn.select_topk(
            q,
            index.centroids,
            index.codes,
            index.lengths,
            sink=c.sink,
            window=c.window,
            heavy=c.heavy,
            init_offset=c.offset,
            out=out_sel,
            workspace=select_ws,
        ),
        "sparse_decode": lambda: pqattn.sparse_decode(q, k_cache, v_cache, *sel, out=out, workspace=attn_ws),
        **compat,
    }
    rows = {name: {"plans_us": _median_us(fn)} for name, fn in calls.items()}
    build = launch.Plan.build
    launch.Plan.build = classmethod(lambda cls, *a: None)
    index._plans.clear()
    dispatch.PLANS.clear()
    for name, fn in calls.items():
        rows[name]["no_plans_us"] = _median_us(fn)
    launch.Plan.build = build
    print(f"{'call':20s} {'no plans':>10s} {'plans':>8s}  (host us per call, launches idle)")
    for name, r in rows.items():
        print(f"{name:20s} {r['no_plans_us']:10.1f} {r['plans_us']:8.1f}")
    if args.json:
        env = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor()}
        with open(args.json, "w") as f:
            json.dump({"environment": env, "shape": [B, H, Hkv, N, D], "calls": rows}, f, indent=1)


if __name__ == "__main__":
    main()
