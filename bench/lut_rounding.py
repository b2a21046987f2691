"""The default policy's attention mass with its PQ lookup tables rounded: float32 (SPEC §2's
score) against bfloat16 (SPEC §7's group tables), float16, and 8- or 4-bit entries (each entry
`lo[m] + scale * round((entry - lo[m]) / scale)`, lo[m] the sub-quantizer's minimum): uint8 and
uint4 with one scale a table (its widest sub-quantizer range over 255 or 15 levels: the sum over
sub-quantizers exact in integers), uint8-m with a scale a sub-quantizer (its own range over 255),
on both synthetic generators.

The selection runs the reference path (a CPU) with `pqattn.reference.pq.pq_scores`, which the
group scores call for each query head, replaced by the rounded one: what a score launch reading
such tables would select under the max rule.

Usage: PYTHONPATH=src python3 bench/lut_rounding.py [--tokens 8192,32768,131072]
    [--luts float32,bfloat16,float16,uint8,uint4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from pqattn.lab import fidelity
from pqattn.lab.env import environment
from pqattn.lab.tasks import leveled_lut
from pqattn.reference import pq as ref_pq

POLICY = "pq-M16-b8-group-max-x4-s16"
FLOAT_LUTS = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
LEVELS = {"uint8": 255, "uint4": 15, "uint8-m": 255}
EXACT_SCORES = ref_pq.pq_scores  # (the name the runs below replace)


def rounded_scores(name: str) -> Callable:
    """pq_scores [B, H, N] with every LUT entry rounded as `name` says (the caller's own
    rounding ignored)."""

    def scores(q: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor, **_) -> torch.Tensor:
        if name in FLOAT_LUTS:
            return EXACT_SCORES(q, centroids, codes, lut_dtype=FLOAT_LUTS[name])
        B, H, D = q.shape
        Hkv, M = centroids.shape[1], centroids.shape[2]
        g, dsub = H // Hkv, D // M
        qm = q.to(centroids.dtype).reshape(B, Hkv, g, M, dsub)
        lut = torch.einsum("bkgmd,bkmcd->bkgmc", qm, centroids[..., :dsub])
        lut = leveled_lut(lut, per_subquantizer=name.endswith("-m"), levels=LEVELS[name])
        idx = codes.long().permute(0, 1, 3, 2)[:, :, None].expand(B, Hkv, g, M, codes.shape[2])
        return lut.gather(-1, idx).sum(3).reshape(B, H, -1)

    return scores


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="8192,32768,131072")
    p.add_argument("--luts", default=",".join([*FLOAT_LUTS, *LEVELS]))
    p.add_argument("--json")
    a = p.parse_args()
    rows = []
    try:
        for tokens in (int(t) for t in a.tokens.split(",")):
            for name in a.luts.split(","):
                if name not in FLOAT_LUTS and name not in LEVELS:
                    raise ValueError(f"--luts: expected names of {[*FLOAT_LUTS, *LEVELS]}, got {name!r}")
                ref_pq.pq_scores = rounded_scores(name)
                policies = fidelity.named_policies(POLICY, 0.02)
                cpu = torch.device("cpu")
                got = fidelity.quality_rows(policies, tokens=tokens, sink=64, window=64, device=cpu)
                for r in got:
                    if r["policy"].startswith(POLICY) and not r["yardstick"]:
                        row = {"tokens": tokens, "lut": name, "problem": r["problem"]}
                        rows.append(row | {k: r[k] for k in ("mass", "recall", "rel_err")})
                        print(f"N={tokens} {name} {r['problem']}: mass {r['mass']:.5f}")
    finally:
        ref_pq.pq_scores = EXACT_SCORES
    if a.json:
        with open(a.json, "w") as f:
            doc = {"environment": environment(torch.device("cpu")), "policy": POLICY, "rows": rows}
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
