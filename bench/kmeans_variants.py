"""k-means variants on the quality harness: how the init, the iterations and the handling of empty
clusters move the attention mass that PQ top-k keeps.

Per generator (`pqattn.lab.quality.GENERATORS`) at N tokens: codebooks of M sub-vectors and `bits`
from pqattn's build (stratified init, empty clusters reseeded with the farthest points, early
stop), the same with more iterations and no early stop, and the plain-torch k-means of the lab
(empty clusters keep their centre) from the stratified init and from a random permutation; for
each, the k-means objective and the attention mass of per-head PQ top-k at `density` as a share
of the exact oracle's (sink and window as `pqattn fidelity`). Writes JSON; runs on any device.

    PYTHONPATH=src python bench/kmeans_variants.py --json bench/quality/kmeans-variants-cpu.json
"""

from __future__ import annotations

import argparse
import json

import torch

from pqattn import ops
from pqattn import reference as ref
from pqattn.lab import baselines, metrics, quality
from pqattn.lab.env import environment, resolve_device


def _random_init_kmeans(keys: torch.Tensor, *, subvectors: int, bits: int, iters: int, seed: int):
    """Plain k-means from C points drawn by a random permutation of the tokens (empty clusters keep
    their centre): keys [B, Hkv, N, D] -> (centroids [B, Hkv, M, C, dsub], codes [B, Hkv, N, M])."""
    B, Hkv, N, D = keys.shape
    M, C = subvectors, 2**bits
    dsub = D // M
    x = keys.float().reshape(B, Hkv, N, M, dsub).permute(0, 1, 3, 2, 4).reshape(B * Hkv * M, N, dsub)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pick = torch.stack([torch.randperm(N, generator=gen)[:C] for _ in range(x.shape[0])]).to(x.device)
    centroids = x.gather(1, pick[..., None].expand(-1, C, dsub))
    for _ in range(iters + 1):
        assign = torch.cdist(x, centroids).argmin(-1)
        if _ == iters:
            break
        sums = torch.zeros_like(centroids).scatter_add_(1, assign[..., None].expand(-1, N, dsub), x)
        counts = torch.zeros(x.shape[0], C, device=x.device).scatter_add_(
            1, assign, torch.ones_like(x[..., 0])
        )
        centroids = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], centroids)
    codes = assign.to(torch.uint8).reshape(B, Hkv, M, N).permute(0, 1, 3, 2)
    return centroids.reshape(B, Hkv, M, C, dsub), codes


def _after_sink(book: tuple[torch.Tensor, torch.Tensor], sink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A codebook of the tokens from `sink` on, its codes placed at their absolute positions."""
    centroids, codes = book
    pad = codes.new_zeros(*codes.shape[:2], sink, codes.shape[-1])
    return centroids, torch.cat([pad, codes], dim=2)


def _objective(keys: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor, sink: int) -> float:
    B, Hkv, N, D = keys.shape
    M = codes.shape[-1]
    idx = codes.long().permute(0, 1, 3, 2)[..., None].expand(B, Hkv, M, N, D // M)
    recon = centroids[..., : D // M].gather(3, idx).permute(0, 1, 3, 2, 4).reshape(B, Hkv, N, D)
    tail = keys[:, :, sink:].float()
    return float(((tail - recon[:, :, sink:]) ** 2).sum() / (tail**2).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768, help="cache length N")
    parser.add_argument("--subvectors", type=int, default=2, help="M")
    parser.add_argument("--bits", type=int, default=6, help="bits per code")
    parser.add_argument("--density", type=float, default=0.02, help="heavy / N")
    parser.add_argument("--sink", type=int, default=64, help="sink tokens")
    parser.add_argument("--window", type=int, default=64, help="window tokens")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    device = resolve_device(args.device)
    M, bits, sink, window = args.subvectors, args.bits, args.sink, args.window
    rows = []
    for name, make in quality.GENERATORS.items():
        problem = make(args.tokens, device)
        keys = problem.keys.float()
        B, N = keys.shape[0], keys.shape[2]
        lengths = torch.full((B,), N, device=device)
        heavy = max(1, round(args.density * N))
        variants = {
            "pqattn (10 iters, early stop, reseed)": ops.build_index(
                keys, subvectors=M, bits=bits, init_offset=sink, iters=10
            )[:2],
            "pqattn (25 iters, no early stop, reseed)": ops.build_index(
                keys, subvectors=M, bits=bits, init_offset=sink, iters=25, tol=0.0
            )[:2],
            "plain (10 iters, stratified init, no reseed)": _after_sink(
                baselines.kmeans_plain_torch(keys[:, :, sink:], subvectors=M, bits=bits, iters=10), sink
            ),
            "plain (10 iters, random init, no reseed)": _after_sink(
                _random_init_kmeans(keys[:, :, sink:], subvectors=M, bits=bits, iters=10, seed=0), sink
            ),
        }
        masses: dict[str, float] = {v: 0.0 for v in variants}
        oracle_mass = 0.0
        for q in problem.queries:
            probs = metrics.attention_probs(q.float(), keys)
            oracle = ref.select_oracle(
                q.float(), keys, lengths, sink=sink, window=window, heavy=heavy, init_offset=sink
            )
            oracle_mass += float(metrics.captured_mass(probs, oracle).mean())
            for v, (centroids, codes) in variants.items():
                scores = ref.pq_scores(q.float(), centroids.float(), codes)
                sel = ref.select_from_scores(
                    scores, lengths, sink=sink, window=window, heavy=heavy, init_offset=sink
                )
                masses[v] += float(metrics.captured_mass(probs, sel).mean())
        for v, (centroids, codes) in variants.items():
            rows.append(
                {
                    "problem": name,
                    "tokens_N": N,
                    "variant": v,
                    "mass_share": masses[v] / oracle_mass,
                    "rel_sq_error": _objective(keys, centroids, codes, sink),
                }
            )
            r = rows[-1]
            print(f"{name:9s} {v:46s} mass share {r['mass_share']:.3f}  objective {r['rel_sq_error']:.4f}")
    if args.json:
        doc = {
            "measures": "per-head PQ top-k's attention mass (share of the oracle's), k-means objective",
            "M": M,
            "bits": bits,
            "density": args.density,
            "sink": sink,
            "window": window,
            "environment": environment(device),
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
