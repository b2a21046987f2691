"""The fine score launch compiled for sm_90 without a GPU, specialised as the device's JIT does
it (codes with a unit last stride, 16-divisible pointers and strides): registers and stack per
thread, warp shuffles in the PTX, and the layout of each LUT load (`tt.load` of bfloat16 in the
TTGIR), and the instructions of its token loop's SASS a lookup. Tells whether a Triton version
spreads a token's lookups over lanes (and sums them by shuffles) or keeps them in one thread.

Usage: PYTHONPATH=src python3 bench/score_layout.py [--tree LABEL] [--json PATH]
(an existing JSON at PATH gets the row appended: run once per source tree)
"""

from __future__ import annotations

import argparse
import json
import os
import re

import triton
from kernel_resources import compile_sm90, cubin_usage, cuobjdump, score_config

from pqattn.kernels.select import fine

# the arguments the device's launch passes 16-divisible at the default shapes
DIVISIBLE = (
    "codes_ptr", "len_ptr", "ws_ptr", "stride_kb", "stride_kh", "stride_kn", "n_codes",
    "ROW_WS", "BOUNDS_AT", "PQ_BINS_AT", "BINS_AT", "SCORES_AT",
)  # fmt: skip


def compile_score(M: int, C: int, tables: int, block: int, num_warps: int) -> dict:
    constexprs = score_config(M, C, tables, block) | {"stride_km": 1}
    compiled = compile_sm90(fine._score_kernel, constexprs, num_warps, DIVISIBLE)
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    layouts = dict(re.findall(r"^(#blocked\d*) = (#ttg\.blocked<.*>)$", ttgir, re.M))
    lut_loads = sorted(
        {layouts[m] for m in re.findall(r"tt\.load .*: tensor<[\dx]+x!tt\.ptr<bf16>, (#blocked\d*)>", ttgir)}
    )
    return (
        cubin_usage(compiled.asm["cubin"])
        | {"shuffles": ptx.count("shfl.sync"), "lut_load_layouts": lut_loads}
        | longest_loop(compiled.asm["cubin"])
    )


def longest_loop(cubin: bytes) -> dict:
    """The SASS of the kernel's longest loop (the body of its longest backward branch): its
    instructions a thread and its 8-byte loads (a code's G = 4 bfloat16 entries: its lookups)."""
    sass = cuobjdump(cubin, "-sass")
    code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    back = [
        (at, int(t, 16)) for at, op in code for t in re.findall(r"\bBRA (0x[0-9a-f]+)", op) if int(t, 16) < at
    ]
    end, start = max(back, key=lambda b: b[0] - b[1])
    body = [op for at, op in code if start <= at <= end]
    loads = sum("LDG.E.64" in op for op in body)
    return {
        "loop_instructions": len(body),
        "loop_lookups": loads,
        "instructions_a_lookup": len(body) / max(loads, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tree", default="", help="a label for the source tree (e.g. its commit)")
    p.add_argument("--json")
    args = p.parse_args()
    block = fine.sample_size(16, 4)
    config = f"M16 C256 max x4, {block} tokens a step, {fine.SCORE_WARPS} warps (default)"
    row = {"tree": args.tree, "config": config}
    row |= compile_score(16, 256, 4, block, fine.SCORE_WARPS)
    print(json.dumps(row, indent=1))
    if args.json:
        out = {"target": "sm_90", "triton": triton.__version__, "rows": []}
        if os.path.exists(args.json):
            with open(args.json) as f:
                out = json.load(f)
        out["rows"].append(row)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
