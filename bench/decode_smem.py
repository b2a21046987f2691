"""Shared memory per program of the group decode kernel's configs, compiled for sm_90 without a GPU
(`triton.compile`, as bench/kernel_resources.py does): dense (DENSE, contiguous rows) and gathered,
for bfloat16 and float32 caches at D=128 and 256. An H100 / H200 program may take 227 KB; a config
above it cannot launch for such rows.

Usage: PYTHONPATH=src python3 bench/decode_smem.py [--json bench/quality/decode-smem-sm90.json]
"""

from __future__ import annotations

import argparse
import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pqattn.kernels import decode

TARGET = GPUTarget("cuda", 90, 32)
ROWS = (("bf16", 128), ("fp32", 128), ("bf16", 256), ("fp32", 256))


def shared_bytes(config: triton.Config, dtype: str, D: int, dense: bool, starts: bool = False) -> int:
    kernel = decode._group_decode_kernel
    names = kernel.arg_names
    constexprs = dict(
        WIDTH=33280, D=D, GP=16, F32_DOTS=dtype == "fp32", HAS_LSE=False, PAGE=0, DENSE=dense,
        STARTS=starts, UNROLL_MAX=64, UNROLL_BLOCK=16, **config.kwargs,
    )  # fmt: skip
    typed = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
    typed |= {"lse_ptr": "*fp32", "qk_scale": "fp32"}
    signature = {
        a: "constexpr" if a in constexprs else typed.get(a, "*i32" if a.endswith("_ptr") else "i32")
        for a in names
    }
    src = ASTSource(
        fn=kernel, signature=signature, constexprs={(names.index(a),): v for a, v in constexprs.items()}
    )
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(src, target=TARGET, options=options).metadata.shared


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    a = p.parse_args()
    spaces = {
        "DENSE_DECODE_CONFIGS": (decode.DENSE_DECODE_CONFIGS, True),
        "DENSE_WIDE_CONFIGS": (decode.DENSE_WIDE_CONFIGS, True),
        "GROUP_DECODE_CONFIGS": (decode.GROUP_DECODE_CONFIGS, False),
    }
    rows = []
    for space, (configs, dense) in spaces.items():
        for c in configs:
            name = f"L{c.kwargs['BLOCK_L']}-N{c.kwargs['BLOCK_N']}-w{c.num_warps}-s{c.num_stages}"
            row = {"space": space, "config": name}
            row |= {f"{dt}-D{D}": shared_bytes(c, dt, D, dense) for dt, D in ROWS}
            rows.append(row)
            print(
                space, name, " ".join(f"{k} {v // 1024} KB" for k, v in row.items() if "-D" in k), flush=True
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"target": "sm_90", "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
