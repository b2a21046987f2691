"""The transformers integration on small randomly initialised GQA models (no downloads)."""

from __future__ import annotations

import pytest
import torch
import transformers

import pqattn.integrations.hf as pq_hf

MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


def _model(kind: str, device: torch.device) -> torch.nn.Module:
    config_cls, model_cls = (getattr(transformers, n) for n in MODELS[kind])
    config = config_cls(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    return model_cls(config).to(device).eval()


def _states(model) -> list:
    return [m._pqattn_state for m in model.modules() if hasattr(m, "_pqattn_state")]


@pytest.mark.parametrize("kind", list(MODELS))
def test_greedy_generation_equals_dense_when_heavy_covers_every_token(
    kind: str, device: torch.device
) -> None:
    model = _model(kind, device)
    ids = torch.randint(0, 128, (2, 70), device=device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        dense = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        assert pq_hf.enable(model, pq_hf.HFConfig(heavy=500, sink=4, window=4, bits=3, iters=3)) == [0, 1, 2]
        sparse = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(sparse, dense)
    assert all(s.sparse_steps == 11 for s in _states(model)), "every decode step went through the index"


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_prefill_through_pqattn_dense_attention(kind: str, device: torch.device, monkeypatch) -> None:
    """prefill="pqattn": every sparse layer's prompt goes through pqattn.ops.dense_attention (the
    flash kernel on CUDA fp16/bf16) and generation matches dense; a padded prompt goes to SDPA."""
    calls = []
    dense_attention = pq_hf.ops.dense_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return dense_attention(*args, **kwargs)

    monkeypatch.setattr(pq_hf.ops, "dense_attention", spy)
    model = _model(kind, device)
    ids = torch.randint(0, 128, (2, 70), device=device)
    mask = torch.ones_like(ids)
    cfg = pq_hf.HFConfig(heavy=500, sink=4, window=4, bits=3, iters=3, prefill="pqattn", dense_layers=(2,))
    with torch.no_grad():
        dense = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        pq_hf.enable(model, cfg)
        sparse = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(sparse, dense)
        assert len(calls) == 2 and all(c["causal"] for c in calls), "layers 0 and 1 prefilled by pqattn"
        mask[1, :5] = 0  # left padding: the mask is not the causal one
        pq_hf.enable(model, cfg)
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert len(calls) == 2


def _decode_logits_error(model, ids: torch.Tensor, config: pq_hf.HFConfig | None) -> float:
    """Relative error of one decode step's logits against dense attention."""
    nxt = ids[:, :1]
    with torch.no_grad():
        pq_hf.disable(model)
        dense = model(torch.cat([ids, nxt], 1)).logits[:, -1]
        pq_hf.enable(model, config)
        cache = transformers.DynamicCache(config=model.config)
        model(ids, past_key_values=cache)
        sparse = model(nxt, past_key_values=cache).logits[:, -1]
    assert torch.isfinite(sparse).all()
    return float((sparse - dense).norm() / dense.norm())


def test_sparse_decoding_runs_and_error_shrinks_with_density(device: torch.device) -> None:
    model = _model("llama", device)
    ids = torch.randint(0, 128, (2, 300), device=device)
    kw = dict(sink=4, window=8, bits=4, iters=4)
    sparse = _decode_logits_error(model, ids, pq_hf.HFConfig(heavy_fraction=0.05, **kw))
    dense_ish = _decode_logits_error(model, ids, pq_hf.HFConfig(heavy_fraction=0.9, **kw))
    assert all(s.sparse_steps == 1 for s in _states(model))
    assert dense_ish < sparse < 1.0, (dense_ish, sparse)


def test_dense_layers_stay_dense(device: torch.device) -> None:
    model = _model("qwen2", device)
    ids = torch.randint(0, 128, (1, 40), device=device)
    assert pq_hf.enable(
        model, pq_hf.HFConfig(heavy=8, sink=2, window=2, bits=3, iters=2, dense_layers=(0, 2))
    ) == [1]
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert [s.sparse_steps for s in _states(model)] == [0, 3, 0]


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="heavy / heavy_fraction"):
        pq_hf.HFConfig(heavy=10, heavy_fraction=0.5)
    with pytest.raises(ValueError, match="heavy_fraction"):
        pq_hf.HFConfig(heavy_fraction=1.5)
    with pytest.raises(ValueError, match="prefill"):
        pq_hf.HFConfig(prefill="flash")
    assert pq_hf.HFConfig().heavy_for(10_000) == 1024
    assert pq_hf.HFConfig(heavy_fraction=0.1).heavy_for(10_000) == 1000
