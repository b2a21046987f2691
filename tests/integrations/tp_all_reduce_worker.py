"""One rank of `test_tensor_parallel.py`'s all-reduce tests (run under torchrun): a tiny Llama
loaded with tp_plan="auto"; its logits through transformers' own row-parallel sums, then through
`use_one_shot_all_reduce` (on GPUs: the one-shot kernel for outputs up to MAX_BYTES, the group's
all-reduce past it; on CPUs: max_bytes=0, every sum by the group's all-reduce), eager and, on
GPUs, replayed from a CUDA graph. Rank 0 writes the JSON at argv[2].

Usage: torchrun --nproc-per-node N tests/integrations/tp_all_reduce_worker.py MODEL_DIR OUT.json
"""

from __future__ import annotations

import sys

import torch
from tp_worker import finish, load

from pqattn.integrations import tensor_parallel

MAX_BYTES = 4096  # the prompt's sums (2 x 16 x 64 float32: 8 KiB) past it, a token's (512 B) within


def main() -> None:
    path, out = sys.argv[1], sys.argv[2]
    gpu = torch.cuda.is_available()
    model, ids = load(path)
    with torch.no_grad():
        want_prompt = model(ids, use_cache=False).logits
        want_token = model(ids[:, :1], use_cache=False).logits
        changed = tensor_parallel.use_one_shot_all_reduce(model, max_bytes=MAX_BYTES if gpu else 0)
        got_prompt = model(ids, use_cache=False).logits
        got_token = model(ids[:, :1], use_cache=False).logits
        doc = {
            "world_size": torch.distributed.get_world_size(),
            "changed": changed,
            "prompt_max_diff": (got_prompt - want_prompt).abs().max().item(),
            "token_max_diff": (got_token - want_token).abs().max().item(),
        }
        if gpu:
            static = ids[:, :1].clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                model(static, use_cache=False)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = model(static, use_cache=False).logits
            static.copy_(ids[:, 1:2])
            graph.replay()
            doc["graph_max_diff"] = (replayed - model(ids[:, 1:2], use_cache=False).logits).abs().max().item()
            # a graph alive at destroy_process_group hangs it (pytorch/pytorch#115388)
            graph.reset()
    finish(doc, out)


if __name__ == "__main__":
    main()
