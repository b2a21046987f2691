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

from pqattn.integrations import tensor_parallel


def _free_port() -> int:
    """A TCP port free now (the test workers run side by side: no fixed rendezvous port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROOT = pathlib.Path(__file__).resolve().parents[2]


# (backend, ranks): gloo on CPUs; NCCL on as many GPUs where the machine has them
RUNS = [("gloo", 2), ("gloo", 4)] + [("nccl", n) for n in (2, 4) if torch.cuda.device_count() >= n]
# (backend, ranks, the one-shot all-reduce): NCCL runs also with it
GENERATE_RUNS = [(b, n, False) for b, n in RUNS] + [(b, n, True) for b, n in RUNS if b == "nccl"]
needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="tp_plan needs accelerate"
)


def _tiny_llama(path: pathlib.Path) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=512, eos_token_id=None,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def _torchrun(ranks: int, script: pathlib.Path, args: list[str], backend: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    cmd += ["--master-port", str(_free_port()), str(script), *args]
    env = os.environ | {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    if backend == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@needs_accelerate
@pytest.mark.parametrize("backend,ranks,one_shot", GENERATE_RUNS)
def test_ranks_generate_the_single_process_tokens(
    backend: str, ranks: int, one_shot: bool, tmp_path: pathlib.Path, device: torch.device
) -> None:
    """Two and four ranks, float32 with heavy covering every token: the greedy tokens of one
    process, dense and pqattn, through transformers' generate and the static loop (captured on
    GPUs); each rank indexes its own of the 4 KV heads. On GPUs also with the row-parallel sums
    by the one-shot all-reduce."""
    if backend == "gloo" and device.type == "cuda":
        pytest.skip("the CPU run: the GPUs take the NCCL case")
    model = _tiny_llama(tmp_path / "model")
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(0))  # the script's prompt
    on = torch.device("cuda" if backend == "nccl" else "cpu")
    with torch.no_grad():
        model, ids = model.to(on), ids.to(on)
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    out = tmp_path / "tp.json"
    args = ["--model", str(tmp_path / "model"), "--prompt", "70"]
    args += ["--batch", "2", "--new", "8", "--heavy", "500", "--sink", "4", "--window", "4", "--bits", "3"]
    args += ["--subvectors", "2"]
    args += ["--dtype", "float32", "--samples", "2", "--steps", "2", "--profile", "--json", str(out)]
    args += ["--one-shot-all-reduce"] if one_shot else []
    run = _torchrun(ranks, ROOT / "bench" / "tp_generate.py", args, backend)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["world_size"] == ranks
    assert doc["all_reduce"] == ("one-shot" if one_shot else "process-group")
    want_tokens = want[:, 70:].tolist()
    for kind in ("dense", "pqattn"):
        assert doc[kind]["dynamic_tokens"] == want_tokens, kind
        assert doc[kind]["static_tokens"] == want_tokens, kind
    assert doc["pqattn"]["index_kv_heads"] == 4 // ranks
    for kind in ("dense", "pqattn"):  # rank 0's profile of the static loop's steps
        assert doc[kind]["static_profile"]["calls"] == 5 and doc[kind]["static_profile"]["kernels"]


@needs_accelerate
def test_sparse_settings_give_the_one_process_tokens(tmp_path: pathlib.Path) -> None:
    """With a sparse group selection and a re-rank (heavy far below the prompt), two ranks on gloo
    generate what one process of the same script generates: each rank builds its KV heads' index
    as the one process does for them (head_offset / total_heads) and selects over it alike."""
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    docs = []
    for world in (1, 2):
        out = tmp_path / f"tp{world}.json"
        args = ["--model", str(tmp_path / "model"), "--prompt", "120", "--batch", "2", "--new", "8"]
        args += ["--heavy", "12", "--sink", "4", "--window", "8", "--subvectors", "4", "--bits", "3"]
        args += ["--share", "group", "--group-rule", "max", "--rerank", "2"]
        args += ["--dtype", "float32", "--samples", "1", "--steps", "1", "--json", str(out)]
        run = _torchrun(world, ROOT / "bench" / "tp_generate.py", args, "gloo")
        assert run.returncode == 0, run.stderr[-3000:]
        docs.append(json.loads(out.read_text()))
    one, two = docs
    assert two["world_size"] == 2 and two["pqattn"]["index_kv_heads"] == 1
    for loop in ("dynamic_tokens", "static_tokens"):
        assert two["pqattn"][loop] == one["pqattn"][loop], loop
        assert two["dense"][loop] == one["dense"][loop], loop
    assert one["pqattn"]["static_tokens"] != one["dense"]["static_tokens"], "the sparse run must select"


@needs_accelerate
@pytest.mark.parametrize("backend,ranks", RUNS)
def test_row_parallel_sums_replaced_give_transformers_logits(
    backend: str, ranks: int, tmp_path: pathlib.Path, device: torch.device
) -> None:
    """`use_one_shot_all_reduce` on every row-parallel linear (two a layer): the logits of
    transformers' own sums. GPUs: a token's sums by the one-shot kernel (the prompt's past
    max_bytes by NCCL), also replayed from a CUDA graph; CPUs: every sum by gloo's all-reduce."""
    if backend == "gloo" and device.type == "cuda":
        pytest.skip("the CPU run: the GPUs take the NCCL case")
    _tiny_llama(tmp_path / "model")
    out = tmp_path / "sums.json"
    worker = pathlib.Path(__file__).with_name("tp_all_reduce_worker.py")
    run = _torchrun(ranks, worker, [str(tmp_path / "model"), str(out)], backend)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["world_size"] == ranks and doc["changed"] == 4  # o_proj and down_proj of 2 layers
    tol = 0.0 if backend == "gloo" or ranks == 2 else 1e-5  # two addends sum alike in any order
    assert doc["prompt_max_diff"] <= tol and doc["token_max_diff"] <= tol, doc
    if backend == "nccl":
        assert doc["graph_max_diff"] <= 1e-6, doc


@needs_accelerate
@pytest.mark.parametrize(
    "kind,backend,ranks,plan",
    [("llama", b, n, "auto") for b, n in RUNS]
    + [(k, b, n, p) for b, n in RUNS if n == 2 for k, p in (("qwen2", "auto"), ("llama", "gathered"))],
)
def test_ranks_fuse_their_local_projections(
    kind: str, backend: str, ranks: int, plan: str, tmp_path: pathlib.Path, device: torch.device
) -> None:
    """`projections.fuse` on a tensor-parallel model: each rank's colwise q/k/v and gate/up shards
    become views of one local buffer (the parameters stay DTensors, qwen2's biases too), the calls
    take the group's product, the logits stay transformers' own, and unfuse restores each
    parameter's storage and transformers' forward. With gate/up outputs gathered ("colwise_rep",
    the worker's "gathered" plan) the MLP's groups stay unfused."""
    if backend == "gloo" and device.type == "cuda":
        pytest.skip("the CPU run: the GPUs take the NCCL case")
    torch.manual_seed(0)
    config = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=512, eos_token_id=None,
    )  # fmt: skip
    if kind == "llama":
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(tmp_path / "model")
    else:
        transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config)).save_pretrained(tmp_path / "model")
    out = tmp_path / "fused.json"
    worker = pathlib.Path(__file__).with_name("tp_projections_worker.py")
    run = _torchrun(ranks, worker, [str(tmp_path / "model"), str(out), plan], backend)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["world_size"] == ranks
    assert doc["fused"] == (4 if plan == "auto" else 2)  # q/k/v and gate/up of 2 layers
    assert doc["dtensors"] and doc["shared_storage"] and doc["sharded_forward"]
    assert doc["group_products"] == [True]
    assert doc["with_bias"] == (kind == "qwen2") and doc.get("bias_shared_storage", True)
    assert doc["fused_max_diff"] <= 1e-5 and doc["unfused_max_diff"] == 0.0, doc
    assert doc["unfused"] == 0 and doc["own_storage"] and doc["forwards_restored"]


def test_one_shot_all_reduce_refuses_what_it_cannot_serve() -> None:
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    )
    with pytest.raises(ValueError, match="model: no row-parallel"):
        tensor_parallel.use_one_shot_all_reduce(model)
    with pytest.raises(ValueError, match="max_bytes: expected >= 0, got -1"):
        tensor_parallel.use_one_shot_all_reduce(model, max_bytes=-1)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"device: .*expected cuda, got cpu"):
        tensor_parallel.OneShotAllReduce(None, device=cpu, dtype=torch.bfloat16, max_numel=8)
    gpu = torch.device("cuda")
    with pytest.raises(TypeError, match=r"dtype: expected torch\.bfloat16 or torch\.float32"):
        tensor_parallel.OneShotAllReduce(None, device=gpu, dtype=torch.float16, max_numel=8)
    with pytest.raises(ValueError, match="max_numel: expected at least 1, got 0"):
        tensor_parallel.OneShotAllReduce(None, device=gpu, dtype=torch.float32, max_numel=0)
