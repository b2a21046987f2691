"""Fused q/k/v and gate/up projections (`pqattn.integrations.projections`) on small random models."""

from __future__ import annotations

import weakref

import pytest
import torch

import pqattn.integrations.hf as pq_hf
from pqattn.integrations import projections
from tests.helpers import small_causal_lm


def _model(kind: str, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return small_causal_lm(kind, device, layers=2, intermediate=96)


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if n.endswith(("_proj", "lm_head"))}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_fused_model_computes_the_same_logits_and_restores(kind: str, device: torch.device) -> None:
    """Each layer's q/k/v and gate/up become views of one buffer a group (no new parameter, the
    same names, shapes and values), the logits stay those of the separate projections, and the
    group's product is dropped after each forward; unfuse gives every parameter its own storage
    and class back, and the logits again."""
    model = _model(kind, device)
    ids = torch.randint(0, 128, (2, 9), device=device)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(ids).logits
    assert projections.fuse(model) == 4
    assert model.state_dict().keys() == state.keys()
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for group in ((a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)):
            assert all(type(p) is projections.FusedLinear for p in group)
            assert len({_storage(p.weight) for p in group}) == 1
            assert len({id(p._pqattn_group) for p in group}) == 1
        assert type(a.o_proj) is torch.nn.Linear and type(m.down_proj) is torch.nn.Linear
        if kind == "qwen2":
            assert _storage(a.q_proj.bias) == _storage(a.v_proj.bias)
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    group = model.model.layers[0].self_attn.q_proj._pqattn_group
    assert group.x is None and group.out is None, "the product is dropped when the parent returns"
    buffer = weakref.ref(group.weight)
    assert projections.unfuse(model) == 0
    assert buffer() is None, "unfuse frees each group's buffer"
    assert all(type(m) is torch.nn.Linear for m in _linears(model).values())
    storages = [_storage(p) for n, p in model.named_parameters() if "proj" in n]
    assert len(set(storages)) == len(storages), "every parameter its own storage"
    assert not any(m._forward_hooks for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, atol=1e-5, rtol=1e-5)


def test_fusion_nests_and_skips_groups_it_cannot_fuse(device: torch.device) -> None:
    """A second fuse is undone by a second unfuse; a group with a linear subclass, a hook or a
    weight shared with another linear stays as it is (the others fuse)."""
    model = _model("llama", device)
    assert projections.fuse(model) == 4
    assert projections.fuse(model) == 4
    assert projections.unfuse(model) == 4
    assert projections.unfuse(model) == 0
    assert projections.unfuse(model) == 0, "unfusing a model never fused is a no-op"

    class Quantized(torch.nn.Linear):
        pass

    first, second = model.model.layers
    first.self_attn.k_proj.__class__ = Quantized
    first.mlp.up_proj.register_forward_hook(lambda *args: None)
    second.mlp.gate_proj.weight = second.mlp.up_proj.weight  # tied: one parameter, two linears
    ids = torch.randint(0, 128, (1, 7), device=device)
    with torch.no_grad():
        want = model(ids).logits
    assert projections.fuse(model) == 1
    assert type(second.self_attn.q_proj) is projections.FusedLinear
    for kept in (first.self_attn.q_proj, first.mlp.gate_proj, second.mlp.gate_proj, second.mlp.up_proj):
        assert type(kept) is torch.nn.Linear
    assert second.mlp.gate_proj.weight is second.mlp.up_proj.weight
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, atol=1e-5, rtol=1e-5)
    projections.unfuse(model)


def test_a_linear_called_on_another_input_gets_its_own_product(device: torch.device) -> None:
    """The group's product serves the calls on the input it was made from; a call on another
    input (here k on 2x) computes the product for that input."""

    class Parent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(8, 6)
            self.k_proj = torch.nn.Linear(8, 4)
            self.v_proj = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return self.q_proj(x), self.k_proj(2 * x), self.v_proj(x), self.q_proj(x)

    parent = Parent().to(device)
    x = torch.randn(3, 8, device=device)
    with torch.no_grad():
        want = parent(x)
        assert projections.fuse(parent) == 1
        got = parent(x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    projections.unfuse(parent)


def test_with_gradients_each_linear_computes_its_own_product(device: torch.device) -> None:
    """With gradients enabled for the parameters, a fused model's parameters get the gradients of
    the unfused model's (the group's product, made without them, is not used)."""
    model = _model("qwen2", device)
    ids = torch.randint(0, 128, (2, 9), device=device)
    model(ids).logits.square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    projections.fuse(model)
    model(ids).logits.square().mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-5, rtol=1e-4, msg=n)
    projections.unfuse(model)


def test_static_decoder_fuses_until_closed(device: torch.device) -> None:
    """StaticDecoder fuses the projections by default and generates the tokens of the unfused
    loop; close() unfuses and ends the decoder; generate leaves the model unfused."""
    model = _model("llama", device)
    ids = torch.randint(0, 128, (2, 30), device=device)
    pq_hf.enable(model, pq_hf.HFConfig(heavy=500, sink=4, window=4, bits=3, iters=3))
    plain = pq_hf.StaticDecoder(model, ids, 6, fuse_projections=False)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    want = plain.run()
    decoder = pq_hf.StaticDecoder(model, ids, 6)
    assert type(model.model.layers[0].self_attn.q_proj) is projections.FusedLinear
    assert torch.equal(decoder.run(), want)
    decoder.close()
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with pytest.raises(ValueError, match="closed"):
        decoder.step()
    decoder.close()  # closing twice is a no-op
    assert torch.equal(pq_hf.generate(model, ids, 6), want)
    assert not any(type(m) is projections.FusedLinear for m in model.modules())
