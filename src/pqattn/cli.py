"""The `pqattn` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch

from pqattn.index import PQConfig
from pqattn.lab.workload import WorkloadSpec

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _add_demo(sub: argparse._SubParsersAction) -> None:
    d, c = WorkloadSpec(), PQConfig()
    p = sub.add_parser("demo", help="PQ vs streaming vs oracle selection on a synthetic LLM-like cache")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bfloat16 on cuda, float32 on cpu"
    )
    p.add_argument("--tokens", type=int, default=d.tokens, help="prefill tokens N")
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--group", type=int, default=d.group, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--steps", type=int, default=d.steps, help="decode steps")
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--sink", type=int, default=c.sink)
    p.add_argument("--window", type=int, default=c.window)
    p.add_argument("--heavy", type=int, default=256)
    p.add_argument("--subvectors", type=int, default=c.subvectors, help="M")
    p.add_argument("--bits", type=int, default=c.bits)
    p.add_argument("--metric", default=c.metric, choices=["euclidean", "ip"])
    p.add_argument("--iters", type=int, default=c.iters, help="k-means iterations")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--repeats", type=int, default=20, help="timed calls per method")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")


def _run_demo(args: argparse.Namespace) -> int:
    from pqattn.lab.demo import format_table, resolve_device, run_demo

    device = resolve_device(args.device)
    dtype = (
        DTYPES[args.dtype]
        if args.dtype != "auto"
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    spec = WorkloadSpec(
        tokens=args.tokens,
        kv_heads=args.kv_heads,
        group=args.group,
        head_dim=args.head_dim,
        steps=args.steps,
        batch=args.batch,
        seed=args.seed,
    )
    config = PQConfig(
        subvectors=args.subvectors,
        bits=args.bits,
        metric=args.metric,
        sink=args.sink,
        window=args.window,
        heavy=args.heavy,
        iters=args.iters,
        seed=args.seed,
    )
    result = run_demo(spec, config, device=device, dtype=dtype, repeats=args.repeats)
    if args.json == "-":
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"results written to {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pqattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    args = parser.parse_args(argv)
    try:
        return _run_demo(args)
    except (ValueError, TypeError) as e:
        print(f"pqattn {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
