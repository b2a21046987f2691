"""The default policy's attention mass with its PQ lookup tables rounded, before building it:
float32 (SPEC §2's score) against bfloat16 and float16 entries, on both synthetic generators.

The selection runs the reference path (a CPU), its `pq_scores` called with `lut_dtype` (each LUT
entry <q_m, centroid> rounded to that dtype before the sum over sub-quantizers): what a score
launch reading half-width tables would select under the max rule (one table per query head).

Usage: PYTHONPATH=src python3 bench/lut_rounding.py [--tokens 8192,32768,131072] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from pqattn import reference as ref
from pqattn.lab import fidelity
from pqattn.lab.env import environment
from pqattn.reference import selection as ref_selection

POLICY = "pq-M16-b8-group-max-x4-s16"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="8192,32768,131072")
    p.add_argument("--json")
    a = p.parse_args()
    rows = []
    for tokens in (int(t) for t in a.tokens.split(",")):
        for name, dtype in (("float32", None), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
            ref_selection.pq_scores = functools.partial(ref.pq_scores, lut_dtype=dtype)
            policies = fidelity.named_policies(POLICY, 0.02)
            cpu = torch.device("cpu")
            got = fidelity.quality_rows(policies, tokens=tokens, sink=64, window=64, device=cpu)
            for r in got:
                if r["policy"].startswith(POLICY) and not r["yardstick"]:
                    row = {"tokens": tokens, "lut": name, "problem": r["problem"]}
                    rows.append(row | {k: r[k] for k in ("mass", "recall", "rel_err")})
                    print(f"N={tokens} {name} {r['problem']}: mass {r['mass']:.5f}, error {r['rel_err']:.5f}")
    ref_selection.pq_scores = ref.pq_scores
    if a.json:
        with open(a.json, "w") as f:
            doc = {"environment": environment(torch.device("cpu")), "policy": POLICY, "rows": rows}
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
