"""The latency floor of a chain of dependent launches: what one launch in a CUDA graph costs when
it must see the one before it, with and without programmatic dependent launch (PDL), and what one
dependent global-memory round trip costs inside a program (from L2 and from DRAM).

- Launch chain: L launches of a kernel whose P programs each read a word the launch before wrote
  and write one word, ping-ponging two buffers, captured in one graph; the cost of a launch is
  the slope between two chain lengths. With PDL each launch starts early and waits
  (`griddepcontrol.wait`) before its read, as the selection's launches do.
- Round trip: one warp follows a random cycle of pointers (each load's address is the previous
  load's value) through a buffer that fits in L2 and one far past it; a hop's time is the
  latency of one dependent load.

Usage: PYTHONPATH=src python3 bench/launch_chain.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from pqattn.kernels.pdl import release_next, wait_prior
from pqattn.lab.env import environment, l2_bytes
from pqattn.lab.timing import capture, time_graph

CHAINS = (8, 64)  # launches a graph: the cost of a launch is the slope between the two
HOPS = 4096  # dependent loads a pointer chase (12 replays: 49152 lines, 6 MiB)


@triton.jit
def _hop_kernel(src, dst, PDL: tl.constexpr):
    p = tl.program_id(0)
    wait_prior(PDL)
    x = tl.load(src + p)
    release_next(PDL)
    tl.store(dst + p, x + 1)


@triton.jit
def _chase_kernel(nxt, at, HOPS_: tl.constexpr):
    """HOPS_ dependent loads from where the last call stopped (each replay visits new lines)."""
    i = tl.load(at + tl.arange(0, 1))
    for _ in range(HOPS_):
        i = tl.load(nxt + i)
    tl.store(at + tl.arange(0, 1), i)


def launch_us(programs: int, pdl: bool, device: torch.device) -> dict:
    """GPU time a launch of a chain of dependent launches of `programs` programs."""
    bufs = [torch.zeros(programs, dtype=torch.int32, device=device) for _ in range(2)]
    meta = {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
    per_chain = {}
    for length in CHAINS:

        def chain(length=length):
            for i in range(length):
                _hop_kernel[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], num_warps=4, **meta)

        graph = capture([chain], device, calls=1)
        per_chain[length] = time_graph(graph, device, repeats=50, calls=1)["median_us"]
        del graph
    lo, hi = CHAINS
    return {
        "programs": programs,
        "pdl": pdl,
        "chain_us": per_chain,
        "us_a_launch": (per_chain[hi] - per_chain[lo]) / (hi - lo),
    }


def round_trip_ns(nbytes: int, device: torch.device, g: torch.Generator) -> dict:
    """ns a dependent load over a random cycle through `nbytes` of int64 pointers, one line apart."""
    stride = 16  # int64 words: one 128-byte line a hop
    slots = nbytes // (8 * stride)
    order = torch.randperm(slots, generator=g, device="cpu")
    nxt = torch.zeros(slots * stride, dtype=torch.int64)
    nxt[order * stride] = torch.roll(order, -1) * stride
    nxt = nxt.to(device)
    at = torch.zeros(1, dtype=torch.int64, device=device)
    graph = capture([lambda: _chase_kernel[(1,)](nxt, at, HOPS_=HOPS, num_warps=1)], device, calls=1)
    # a buffer that fits L2 is read once first (its lines then in L2); past L2, every hop a new line
    between = (lambda: nxt.sum()) if nbytes < l2_bytes(device) else None
    us = time_graph(graph, device, repeats=10, calls=1, between=between)["median_us"]
    return {"bytes": nbytes, "hops": HOPS, "ns_a_hop": us * 1e3 / HOPS}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    a = p.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    g = torch.Generator().manual_seed(0)
    launches = [launch_us(programs, pdl, dev) for programs in (sms, 4 * sms) for pdl in (False, True)]
    trips = [round_trip_ns(n, dev, g) for n in (l2_bytes(dev) // 8, 1 << 30)]
    for r in launches:
        pdl = "with PDL" if r["pdl"] else "no PDL"
        print(f"launch chain, {r['programs']} programs, {pdl}: {r['us_a_launch']:.2f} us a launch")
    for r in trips:
        print(f"dependent load over {r['bytes'] / 2**20:.0f} MiB: {r['ns_a_hop']:.0f} ns a hop")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": environment(dev), "launches": launches, "round_trips": trips}, f, indent=1)


if __name__ == "__main__":
    main()
