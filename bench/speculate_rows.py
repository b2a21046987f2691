"""Could layer l + 1's rows be fetched while layer l runs? (issue 57, the host tier's overlap;
the trained model on held-out text, CPU.)

A speculative selection for layer l + 1 can start once layer l's input is known: layer l + 1's
own query projection applied to layer l's input (the residual stream before layer l adds its
attention and MLP). Its rows could then cross PCIe while layer l computes. This script measures,
for each decode position of held-out documents and each layer l >= 1, the rows that the real
selection of layer l needs and the row cache of the previous step lacks (the misses a fetch must
bring), and the share of those that the speculative selection of layer l (from layer l - 1's
input) would have brought: the share of the PCIe traffic such a prefetch could hide, and the
extra rows it would fetch. The selection here is the exact top-k by the group max of the heads'
scores (the default policy's rule over exact scores: the PQ scores' stand-in), G x heavy rows a
KV head with heavy = 2% of the position, sink 64 + window 64.

    PYTHONPATH=src python bench/speculate_rows.py --docs 4 --context 8192 --steps 64 --json OUT.json
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pqattn.lab import corpus as corpus_mod
from pqattn.lab.env import environment


def _queries_and_keys(model, hidden: tuple, layer: int, source: int, positions: torch.Tensor):
    """Layer `layer`'s queries [H, T, D] from the residual stream entering layer `source`, and its
    keys [Hkv, N, D] from its own input, both rotated."""
    attn = model.model.layers[layer].self_attn
    norm = model.model.layers[layer].input_layernorm
    D = attn.head_dim
    h_q = norm(hidden[source][0])  # [N, hidden]
    h_k = norm(hidden[layer][0])
    N = h_k.shape[0]
    pos = torch.arange(N)[None]
    cos, sin = model.model.rotary_emb(h_k[None], pos)
    q = attn.q_proj(h_q).view(N, -1, D).transpose(0, 1)[None]
    k = attn.k_proj(h_k).view(N, -1, D).transpose(0, 1)[None]
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q[0][:, positions], k[0]


def _selected(q: torch.Tensor, k: torch.Tensor, p: int, sink: int, window: int, density: float) -> set:
    """Rows (kv head, position) of the exact top-k by the group max among [sink, p - window]."""
    H, Hkv = q.shape[0], k.shape[0]
    G = H // Hkv
    lo, hi = sink, p + 1 - window
    if hi <= lo:
        return set()
    scores = torch.einsum("hd,hnd->hn", q, k.repeat_interleave(G, 0)[:, lo:hi])
    group = scores.view(Hkv, G, -1).amax(1)
    need = min(group.shape[1], G * max(1, round(density * (p + 1))))
    top = group.topk(need, dim=1).indices + lo
    return {(h, int(t)) for h in range(Hkv) for t in top[h].tolist()}


@torch.no_grad()
def measure(model, docs: list[bytes], steps: int, sink: int, window: int, density: float) -> dict:
    layers = len(model.model.layers)
    per_layer = {
        layer: {"needed": 0, "missed": 0, "covered": 0, "speculated": 0, "extra": 0}
        for layer in range(1, layers)
    }
    for doc in docs:
        ids = torch.tensor(list(doc), dtype=torch.long)[None]
        hidden = model(ids, output_hidden_states=True).hidden_states  # [layers + 1] x [1, N, hidden]
        N = ids.shape[1]
        positions = torch.arange(N - steps, N)
        for layer in range(1, layers):
            q, k = _queries_and_keys(model, hidden, layer, layer, positions)
            q_spec, _ = _queries_and_keys(model, hidden, layer, layer - 1, positions)
            previous = None
            for i, p in enumerate(positions.tolist()):
                real = _selected(q[:, i], k, p, sink, window, density)
                spec = _selected(q_spec[:, i], k, p, sink, window, density)
                if previous is not None:
                    missed = real - previous
                    row = per_layer[layer]
                    row["needed"] += len(real)
                    row["missed"] += len(missed)
                    row["covered"] += len(missed & spec)
                    row["speculated"] += len(spec - previous)
                    row["extra"] += len((spec - previous) - real)
                previous = real
    out = []
    for layer, r in per_layer.items():
        out.append(
            r
            | {
                "layer": layer,
                "hit_rate": 1 - r["missed"] / max(1, r["needed"]),
                "misses_covered": r["covered"] / max(1, r["missed"]),
                "extra_per_miss": r["extra"] / max(1, r["missed"]),
            }
        )
    return {"layers": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/byte-llama-13m")
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--context", type=int, default=8192, help="bytes a document")
    parser.add_argument("--steps", type=int, default=64, help="decode positions measured at each end")
    parser.add_argument("--density", type=float, default=0.02)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    corpus = corpus_mod.find_corpus()
    docs = corpus_mod.documents(corpus.held_out, args.context, args.docs)
    doc = {
        "environment": environment(torch.device("cpu")),
        "argv": vars(args),
        "corpus": corpus.summary(),
        "documents": len(docs),
        **measure(model, docs, args.steps, 64, 64, args.density),
    }
    for r in doc["layers"]:
        print(
            f"layer {r['layer']}: hit rate {r['hit_rate']:.3f}, misses the speculation covers "
            f"{r['misses_covered']:.3f}, extra rows a miss {r['extra_per_miss']:.2f}"
        )
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
