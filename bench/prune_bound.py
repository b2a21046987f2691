"""How many of the score kernel's LUT lookups an exact early-termination bound would save (issue 54,
item 3; CPU simulation, the PyTorch reference's tables).

The fine route scores every candidate with all M sub-quantizers (M vector loads of the G tables a
token). A token whose partial score after k sub-quantizers plus the largest entries of the other
M - k tables is below the selection's threshold cannot be selected, so its remaining lookups can
be skipped without changing the selection. This script measures, on the synthetic generators
with the default policy (M=16, 8 bits, group max over G=4 heads, 2% per head, sink 64 + window
64), the share of candidates still alive after k sub-quantizers (in index order and with the
sub-quantizers sorted by the spread of their tables) and the lookups a token that this bound
leaves: the upper limit of the gain, before any cost of the per-step compaction a kernel needs.
It also measures the approximate form: the top f x need candidates by the partial score of the
first k sub-quantizers, finished with the others, against the full score's selection (recall).

    PYTHONPATH=src python bench/prune_bound.py --tokens 32768 --json OUT.json
"""

from __future__ import annotations

import argparse
import json

import torch

import pqattn
from pqattn.lab.env import environment
from pqattn.lab.needles import NeedleSpec, make_needles
from pqattn.lab.workload import WorkloadSpec, make_workload


def _alive(lut: torch.Tensor, codes: torch.Tensor, threshold: torch.Tensor, order: torch.Tensor) -> list:
    """Share of candidates whose bound after k = 0..M sub-quantizers (in `order`) reaches the
    threshold. lut [Hkv, G, M, C], codes [Hkv, n, M], threshold [Hkv]."""
    Hkv, G, M, _ = lut.shape
    per_m = lut.gather(-1, codes.long().permute(0, 2, 1)[:, None].expand(Hkv, G, M, -1))  # [Hkv,G,M,n]
    best = lut.amax(-1)  # [Hkv, G, M]
    partial = torch.zeros(Hkv, G, codes.shape[1], dtype=lut.dtype)
    rest = best.sum(-1)  # [Hkv, G]
    out = [1.0]
    for m in order.tolist():
        partial += per_m[:, :, m]
        rest = rest - best[:, :, m]
        bound = (partial + rest[..., None]).amax(1)  # the group max of each head's bound
        out.append(float((bound >= threshold[:, None]).float().mean()))
    return out


def measure(work, heavy_fraction: float, sink: int, window: int) -> dict:
    keys = work.keys[:, :, : work.spec.tokens]
    N = keys.shape[2]
    config = pqattn.PQConfig(heavy=round(heavy_fraction * N), sink=sink, window=window)
    index = pqattn.PQIndex.build(keys, capacity=N + 1, config=config)
    q = work.queries[0]  # [B, H, D]
    _, H, D = q.shape
    Hkv = keys.shape[1]
    G, M = H // Hkv, config.subvectors
    cent = index.centroids[0, ..., : D // M].float()  # [Hkv, M, C, dsub]
    qm = q[0].float().reshape(Hkv, G, M, D // M)
    lut = torch.einsum("kgmd,kmcd->kgmc", qm, cent)  # [Hkv, G, M, C]
    cand = index.codes[0, :, sink : N - window]  # [Hkv, n, M]
    scores = lut.gather(-1, cand.long().permute(0, 2, 1)[:, None].expand(Hkv, G, M, -1)).sum(2).amax(1)
    need = config.row_heavy(G)
    threshold = scores.topk(need, dim=-1).values[:, -1]  # the need-th best group score a KV head
    spread = (lut.amax(-1) - lut.amin(-1)).mean((0, 1))  # [M]
    orders = {"index": torch.arange(M), "spread": spread.argsort(descending=True)}
    rows = {}
    for name, order in orders.items():
        alive = _alive(lut, cand, threshold, order)
        rows[name] = {"alive_after_k": alive, "lookups_per_token": sum(alive[:-1]), "of": M}
    return {
        "N": N,
        "need": need,
        "candidates": cand.shape[1],
        "orders": rows,
        "shortlists": _shortlists(lut, cand, scores, need, orders["spread"]),
    }


def _shortlists(lut: torch.Tensor, codes: torch.Tensor, scores: torch.Tensor, need: int, order) -> list:
    """An approximate two-pass score: the first k sub-quantizers (in `order`) for every candidate,
    the top f x need by that partial group score finished with the others. Recall of the full
    score's top need, and the lookups a candidate takes (k + (M - k) x f x need / candidates)."""
    Hkv, G, M, _ = lut.shape
    n = codes.shape[1]
    per_m = lut.gather(-1, codes.long().permute(0, 2, 1)[:, None].expand(Hkv, G, M, -1))  # [Hkv,G,M,n]
    want = scores.topk(need, dim=-1).indices  # [Hkv, need]
    out = []
    for k in (4, 8):
        partial = per_m[:, :, order[:k]].sum(2).amax(1)  # [Hkv, n]
        for f in (2, 3, 4):
            short = partial.topk(min(n, f * need), dim=-1).indices
            kept = scores.gather(1, short).topk(need, dim=-1).indices
            got = short.gather(1, kept)
            recall = sum(len(set(got[h].tolist()) & set(want[h].tolist())) for h in range(Hkv)) / (Hkv * need)
            lookups = k + (M - k) * min(n, f * need) / n
            out.append({"k": k, "factor": f, "recall": recall, "lookups_per_token": lookups})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    doc = {"environment": environment(torch.device("cpu")), "argv": vars(args), "generators": {}}
    for name, work in (
        ("workload", make_workload(WorkloadSpec(tokens=args.tokens, steps=1))),
        ("needles", make_needles(NeedleSpec(tokens=args.tokens, steps=1))),
    ):
        doc["generators"][name] = measure(work, 0.02, 64, 64)
        for order, r in doc["generators"][name]["orders"].items():
            alive = " ".join(f"{a:.2f}" for a in r["alive_after_k"][::2])
            print(f"{name:8} {order:6} lookups {r['lookups_per_token']:.2f} of {r['of']}; alive: {alive}")
        for r in doc["generators"][name]["shortlists"]:
            print(
                f"{name:8} shortlist k={r['k']} x{r['factor']}: recall {r['recall']:.3f}, "
                f"lookups {r['lookups_per_token']:.2f}"
            )
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
