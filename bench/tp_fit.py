"""Scaling of the tensor-parallel loop from `bench/tp_generate.py`'s JSON of 1, 2 and 4 GPUs, and
the fit T(N) = F + W / N + c [N > 1] of pqattn's ms per token: a fixed part F every rank runs
whole, the work W split N ways and the all-reduces' cost c, from the three points (exact). Prints
what F the targets need at the fitted W and c; with --json, writes the same figures.

Usage: python bench/tp_fit.py bench/quality/tp-generate-{1,2,4}gpu-NVIDIA_H100.json [--targets 1.6,2.5]
    [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs=3, help="the 1-, 2- and 4-GPU JSON, in that order")
    p.add_argument("--targets", default="1.6,2.5", help="the speed-ups over one GPU wanted at 2 and 4")
    p.add_argument("--json", help="write the ratios and the fit here")
    args = p.parse_args()
    docs = [json.loads(Path(f).read_text()) for f in args.files]
    if [d["world_size"] for d in docs] != [1, 2, 4]:
        raise SystemExit(f"files: expected world sizes 1, 2, 4, got {[d['world_size'] for d in docs]}")
    need = [float(x) for x in args.targets.split(",")]
    out: dict = {"files": args.files, "targets": need}
    for key in ("static_ms_per_token", "compiled_static_ms_per_token"):
        loop = out[key] = {}
        for kind in ("dense", "pqattn"):
            t1, t2, t4 = (d[kind][key] for d in docs)
            print(f"{kind:6s} {key:28s} {t1:.3f} / {t2:.3f} / {t4:.3f} ms: {t1 / t2:.2f}x / {t1 / t4:.2f}x")
            loop[kind] = {"ms": [t1, t2, t4], "speedup_2": t1 / t2, "speedup_4": t1 / t4}
        t1, t2, t4 = (d["pqattn"][key] for d in docs)
        w = 4 * (t2 - t4)
        f = t1 - w
        c = t2 - f - w / 2
        f2, f4 = t1 / need[0] - w / 2 - c, t1 / need[1] - w / 4 - c
        loop["fit"] = {"F": f, "W": w, "c": c, "F_for_target_2": f2, "F_for_target_4": f4}
        print(
            f"  pqattn fit: F = {f:.2f} ms, W = {w:.2f} ms, c = {c:.2f} ms; "
            f"{need[0]}x at 2 GPUs needs F <= {f2:.2f} ms, {need[1]}x at 4 needs F <= {f4:.2f} ms"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
