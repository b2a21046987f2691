"""Several runs of `bench/tp_generate.py` (one device call) gathered into one JSON, with each run's
speed-up over the call's one-GPU run and rank 0's all-reduce time a step, from the compiled
pqattn loop's profile (`--profile`).

Usage: python bench/tp_runs.py 1gpu=tp-1gpu.json 2gpu-oneshot=tp-2gpu-oneshot.json ...
    --what "what the call ran" --command "the tp_generate command" --json OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LOOPS = ("static_ms_per_token", "compiled_static_ms_per_token")


def all_reduce_us(doc: dict) -> float:
    """Rank 0's all-reduce kernels a step (NCCL's or the one-shot kernel) in the compiled pqattn loop."""
    kernels = doc["pqattn"]["compiled_static_profile"]["kernels"]
    return sum(k["gpu_us_per_call"] for k in kernels if "allreduce" in k["name"].lower().replace("_", ""))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+", metavar="TAG=PATH", help="one run per tag; one of them on one GPU")
    p.add_argument("--what", required=True)
    p.add_argument("--command", required=True)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    runs = {}
    for item in args.runs:
        tag, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"runs: expected TAG=PATH, got {item!r}")
        runs[tag] = json.loads(Path(path).read_text())
    ones = [tag for tag, doc in runs.items() if doc["world_size"] == 1]
    if len(ones) != 1:
        raise SystemExit(f"runs: expected exactly one run on one GPU, got {len(ones)}")
    base = runs[ones[0]]
    summary = {}
    for tag, doc in runs.items():
        speedup = {
            kind: {loop: base[kind][loop] / doc[kind][loop] for loop in LOOPS} for kind in ("dense", "pqattn")
        }
        row = summary[tag] = {
            "world_size": doc["world_size"],
            "all_reduce_us": all_reduce_us(doc),
            "speedup_vs_1gpu": speedup,
        }
        print(
            f"{tag:16s} pqattn compiled {doc['pqattn']['compiled_static_ms_per_token']:.3f} ms "
            f"({speedup['pqattn']['compiled_static_ms_per_token']:.2f}x one GPU), "
            f"eager {doc['pqattn']['static_ms_per_token']:.3f} "
            f"({speedup['pqattn']['static_ms_per_token']:.2f}x), all-reduce {row['all_reduce_us']:.0f} us"
        )
    out = {"what": args.what, "command": args.command, "runs": runs, "summary": summary}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
