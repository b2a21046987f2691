"""Tensor parallelism (transformers' tp_plan="auto", torchrun, gloo on CPUs): each rank indexes
its own KV heads and pqattn adds no collective; greedy tokens match one process."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="tp_plan needs accelerate")
def test_two_ranks_generate_the_single_process_tokens(tmp_path: pathlib.Path, device: torch.device) -> None:
    if device.type == "cuda":
        pytest.skip("the CPU (gloo) run; on GPUs `torchrun bench/tp_generate.py` is the run")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "model")
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(0))  # the script's prompt
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517"]
    cmd += [str(ROOT / "bench" / "tp_generate.py"), "--model", str(tmp_path / "model"), "--prompt", "70"]
    cmd += ["--batch", "2", "--new", "8", "--heavy", "500", "--sink", "4", "--window", "4", "--bits", "3"]
    env = os.environ | {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([*cmd, "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 2
    want_tokens = want[:, 70:].tolist()
    for kind in ("dense", "pqattn"):
        assert doc[kind]["dynamic_tokens"] == want_tokens, kind
        assert doc[kind]["static_tokens"] == want_tokens, kind
    assert doc["pqattn"]["index_kv_heads"] == 1  # each rank indexes its own of the 2 KV heads
