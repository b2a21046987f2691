"""Registers and stack (spills) per thread of the fine selection's kernels at chosen configs,
compiled for sm_90 without a GPU: `triton.compile` to a cubin, then `cuobjdump
--dump-resource-usage` (both ship with Triton's NVIDIA backend). The integer arguments compile
unspecialised (the device's JIT also specialises 16-divisible values and unit strides, which can
change the layouts and the registers: `bench/score_layout.py` compiles the score launch that way).

At 4 warps a program, a kernel of more than 128 registers a thread fits at most 3 programs on an
SM of 64K registers, and 255 with stack means spills to local memory.

Usage: PYTHONPATH=src python3 bench/kernel_resources.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pqattn.kernels.select import fine

TARGET = GPUTarget("cuda", 90, 32)
POINTERS = {"codes_ptr": "*u8", "len_ptr": "*i64", "pos_ptr": "*i64", "cnt_ptr": "*i64"}


def compile_sm90(kernel, constexprs: dict, num_warps: int = 4, divisible: tuple[str, ...] = ()):
    """`kernel` compiled for sm_90 at `constexprs` (other arguments int32 or int32 pointers, the
    selection's typed ones as they are passed; those named in `divisible` specialised as
    16-divisible, as the device's JIT does for such values)."""
    names = kernel.arg_names
    signature = {
        a: "constexpr" if a in constexprs else POINTERS.get(a, "*i32" if a.endswith("_ptr") else "i32")
        for a in names
    }
    src = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(a),): v for a, v in constexprs.items()},
        attrs={(names.index(a),): [["tt.divisibility", 16]] for a in divisible},
    )
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps})


def resources(kernel, constexprs: dict, num_warps: int = 4) -> dict:
    """{'registers', 'stack'} of `kernel` compiled at `constexprs` (`compile_sm90`)."""
    return cubin_usage(compile_sm90(kernel, constexprs, num_warps).asm["cubin"])


def cuobjdump(cubin: bytes, option: str) -> str:
    """The output of Triton's bundled `cuobjdump OPTION` on a compiled kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    try:
        return subprocess.run([tool, option, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def cubin_usage(cubin: bytes) -> dict:
    """{'registers', 'stack'} per thread of a compiled kernel, by `cuobjdump --dump-resource-usage`."""
    got = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(cubin, "--dump-resource-usage"))
    return {"registers": int(got[1]), "stack": int(got[2])}


def score_config(M: int, C: int, tables: int, block: int) -> dict:
    reg = C <= fine.REG_LUT_MAX_C and tables > 1
    return dict(
        GROUP=tables > 1,
        MAX_RULE=tables > 1,
        TABLES=tables,
        TABLES_P2=triton.next_power_of_2(tables),
        CHUNKS=fine.lut_chunks(M, C, 128 // M),
        M=M,
        C=C,
        NBINS_=fine.NBINS,
        BLOCK=block,
        REG_LUT=reg,
        SUB=max(fine.REG_LUT_SUB, C),
        SAMPLE=0 if reg else fine.sample_size(M, tables),
        LUT_BF16=tables > 1,
    )


def collect_config(tie: int, rank_chunk: int, kth_chunk: int) -> dict:
    return dict(
        WIDTH=2880,
        ENTRIES=128,
        NBINS_=fine.NBINS,
        CAP=fine.BOUNDARY_CAP,
        TIE=tie,
        RANK_CHUNK_=rank_chunk,
        KTH_CHUNK=kth_chunk,
        BLOCK=fine.BLOCK_N,
        FROM_LIST=False,
        TO_LIST=False,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()

    def step(M: int, tables: int) -> int:  # pq_select_fine's memory-path step
        return max(fine.SCORE_ELEMENTS * 4 // (M * max(triton.next_power_of_2(tables), 4)), 16)

    warps = fine.SCORE_WARPS
    cases = [
        ("score", "M16 C256 max x4, 1024 tokens", score_config(16, 256, 4, 1024), 4),
        (
            "score",
            f"M16 C256 max x4, {step(16, 4)} tokens a step, {warps} warps (default)",
            score_config(16, 256, 4, step(16, 4)),
            warps,
        ),
        ("score", "M16 C256 sum, 1024 tokens", score_config(16, 256, 1, 1024), 4),
        (
            "score",
            f"M16 C256 sum, {step(16, 1)} tokens a step, {warps} warps (default)",
            score_config(16, 256, 1, step(16, 1)),
            warps,
        ),
        ("score", "M32 C16 max x4, registers, 128 tokens", score_config(32, 16, 4, 128), 4),
        ("collect", "TIE 256, whole tiles (4096 counts, 256 x 256 rank)", collect_config(256, 256, 4096), 4),
        (
            "collect",
            f"TIE {fine.TIE_TILE}, rank by {fine.RANK_CHUNK}, counts by {fine.KTH_CHUNK} (default)",
            collect_config(fine.TIE_TILE, fine.RANK_CHUNK, fine.KTH_CHUNK),
            4,
        ),
    ]
    kernels = {"score": fine._score_kernel, "collect": fine._collect_kernel}
    rows = []
    for kernel, what, config, num_warps in cases:
        row = {"kernel": kernel, "config": what, "num_warps": num_warps}
        row |= resources(kernels[kernel], config, num_warps)
        rows.append(row)
        print(f"{kernel:8s} {what:60s} registers {row['registers']:4d}  stack {row['stack']:5d} B")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": "sm_90", "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
