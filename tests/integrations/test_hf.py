"""The transformers integration on small randomly initialised GQA models (no downloads)."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import transformers

import pqattn.integrations.hf as pq_hf
from pqattn.lab.kernel_checks import group_selection_scores, selection_problem
from pqattn.runtime.launch import PlanCache
from tests.helpers import small_causal_lm

MODELS = ("llama", "mistral", "qwen2")


def _model(kind: str, device: torch.device) -> torch.nn.Module:
    return small_causal_lm(kind, device)


def _states(model) -> list:
    return [m._pqattn_state for m in model.modules() if hasattr(m, "_pqattn_state")]


def _left_padded(first: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of 40 tokens, sequence b left-padded by first[b] (pad token 0), and their mask."""
    ids = torch.randint(1, 128, (len(first), 40), device=device)
    mask = torch.ones_like(ids)
    for b, f in enumerate(first):
        mask[b, :f] = 0
    ids[mask == 0] = 0
    return ids, mask


def _cache_kwargs(cache: str) -> dict:
    """generate's keywords for a "dynamic" or a "static" cache."""
    return {"cache_implementation": "static"} if cache == "static" else {}


def _greedy(model, ids: torch.Tensor, mask: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """model.generate's greedy tokens [B, P + new] and the logits of each new token [B, new, V]."""
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=new, do_sample=False, output_scores=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    return out.sequences, torch.stack(out.scores, dim=1).float()


def _difference(dense: torch.Tensor, sparse: torch.Tensor, new: int) -> str:
    """Where two greedy runs' logits [B, new, V] part: each step's largest logit difference up to
    the first step whose tokens differ, beside dense's margin between its top two there (a
    difference under the margin is a near tie; over it, an error)."""
    part = (dense.argmax(-1) != sparse.argmax(-1)).any(0).nonzero()
    last = int(part[0]) if len(part) else new - 1
    diff = (dense - sparse).abs().amax(dim=(0, 2))[: last + 1]
    top = dense[:, last].topk(2, dim=-1).values
    margins = [f"{m:.1e}" for m in (top[:, 0] - top[:, 1]).tolist()]
    diffs = [f"{d:.1e}" for d in diff.tolist()]
    return f"steps 0..{last}: max |logit difference| {diffs}; dense's top-two margins at {last}: {margins}"


@pytest.mark.parametrize("share,rerank", [("head", 0), ("group", 0), ("group", 2)])
@pytest.mark.parametrize("kind", list(MODELS))
def test_greedy_generation_equals_dense_when_heavy_covers_every_token(
    kind: str, share: str, rerank: int, device: torch.device
) -> None:
    model = _model(kind, device)
    ids = torch.randint(0, 128, (2, 70), device=device)
    mask = torch.ones_like(ids)
    config = pq_hf.HFConfig(
        heavy=500, sink=4, window=4, bits=3, iters=3, share=share, group_rule="max", rerank=rerank
    )
    with torch.no_grad():
        dense, dense_logits = _greedy(model, ids, mask, 12)
        assert pq_hf.enable(model, config) == [0, 1, 2]
        sparse, sparse_logits = _greedy(model, ids, mask, 12)
    assert torch.equal(sparse, dense), _difference(dense_logits, sparse_logits, 12)
    assert all(s.sparse_steps == 11 for s in _states(model)), "every decode step went through the index"


@pytest.mark.parametrize("share", ["head", "group"])
def test_sparse_generation_follows_the_reference_step_by_step(
    share: str, device: torch.device, kernel_routes, monkeypatch
) -> None:
    """Greedy generation with heavy far below the prompt (8 of 128 tokens per query head):
    every decode step of every layer selects as the reference selects over the index's codes
    (score multisets), keeps fewer tokens than the cache holds, and attends as the reference
    attends over that selection; the kernels run (compiled on a GPU, interpreted on a CPU)."""
    from pqattn import reference as ref
    from pqattn.index import PQIndex

    attend = PQIndex.attend
    steps = []

    def checked(index, q, k_cache, v_cache, selection=None, *, scale=None):
        c, H, Hkv = index.config, q.shape[1], index.kv_heads
        positions, counts = (t.clone() for t in selection)
        slack = 0.0
        if share == "group":
            scores, slack = group_selection_scores(q, index.centroids, index.codes, c.group_rule)
        else:
            scores = ref.pq_scores(q.double(), index.centroids.double(), index.codes)
        sizes = dict(sink=c.sink, window=c.window, heavy=c.row_heavy(H // Hkv), init_offset=c.offset)
        want = ref.select_from_scores(scores, index.lengths, **sizes)
        problem = selection_problem(
            positions, counts, scores, index.lengths, cand_lo=max(c.offset, c.sink), window=c.window,
            short_threshold=c.width(H // Hkv), ref_sel=want, slack=slack,
        )  # fmt: skip
        assert problem is None, problem
        assert (counts < index.lengths[:, None]).all(), "the selection is sparse"
        out = attend(index, q, k_cache, v_cache, selection, scale=scale)
        if share == "group":
            positions, counts = (t.repeat_interleave(H // Hkv, 1) for t in (positions, counts))
        expect = ref.sparse_decode(
            q.double(), k_cache.double(), v_cache.double(), positions, counts, scale=scale
        )
        torch.testing.assert_close(out.double(), expect, atol=1e-5, rtol=1e-5)
        steps.append(1)
        return out

    monkeypatch.setattr(PQIndex, "attend", checked)
    model = _model("llama", device)
    ids = torch.randint(0, 128, (2, 128), device=device)
    config = pq_hf.HFConfig(heavy=8, sink=4, window=8, subvectors=4, bits=3, iters=2, share=share)
    with torch.no_grad():
        pq_hf.enable(model, config)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert len(steps) == 3 * 2, "every decode step of every layer went through the index"


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_prefill_through_pqattn_dense_attention(kind: str, device: torch.device, monkeypatch) -> None:
    """prefill="pqattn": every sparse layer's prompt goes through pqattn.ops.dense_attention (the
    flash kernel on CUDA fp16/bf16) and generation matches dense; a prompt whose mask has a hole
    goes to SDPA, builds no index and says so once."""
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
        mask[1, 5] = 0  # a hole: the mask is not the causal one
        pq_hf.enable(model, cfg)
        with pytest.warns(UserWarning, match="padding.*no index is built") as caught:
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert len(calls) == 2
    assert len([w for w in caught if "padding" in str(w.message)]) == 1, "one warning, not one a layer"
    assert caught[0].filename == __file__, "the warning names the caller's line"
    assert all(s.index is None and s.sparse_steps == 0 for s in _states(model)), (
        "no index for a padded prompt"
    )


def _decode_logits_error(model, ids: torch.Tensor, config: pq_hf.HFConfig | None) -> float:
    """Relative error of one decode step's logits against dense attention."""
    nxt = ids[:, :1]
    with torch.no_grad():
        pq_hf.disable(model)
        dense = model(torch.cat([ids, nxt], 1)).logits[:, -1]
        pq_hf.enable(model, config)
        cache = transformers.DynamicCache(config=model.config)
        model(ids, **pq_hf.cache_kwargs(model, cache))
        sparse = model(nxt, **pq_hf.cache_kwargs(model, cache)).logits[:, -1]
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


def _retrieval_model(device: torch.device, alpha: float = 1.0) -> torch.nn.Module:
    """One Llama layer whose attention retrieves by content: q and k read the same 12 directions
    of the embedding (the two fastest rotary pairs are zeroed and rope_theta is huge, so positions
    turn the others by < 1e-5 rad), and two tokens, NEEDLE and QUERY, share those directions but
    differ elsewhere, so the query attends to the needle and itself while their values differ."""
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=1e30,
    )
    model = transformers.LlamaForCausalLM(config).to(device).eval()
    with torch.no_grad():
        w = torch.randn(16, 64, device=device)
        turning = [0, 1, 8, 9]  # the rotary pairs that turn by ~1 and ~2e-4 radian per position
        w[turning] = 0.0
        attn = model.model.layers[0].self_attn
        attn.q_proj.weight.copy_(alpha * w.repeat(4, 1))
        attn.k_proj.weight.copy_(alpha * w.repeat(2, 1))
        attn.o_proj.weight.mul_(8.0)  # the attention output, not the residual, drives the logits
        basis = torch.linalg.qr(w[[i for i in range(16) if i not in turning]].T).Q  # what q, k read
        null = torch.eye(64, device=device) - basis @ basis.T
        shared = basis @ torch.randn(12, device=device)
        emb = model.model.embed_tokens.weight
        for tok in (NEEDLE, QUERY):
            other = null @ torch.randn(64, device=device)
            emb[tok] = 2.0 * shared / shared.norm() + other / other.norm()
    return model


NEEDLE, QUERY = 1, 2


def test_sparse_decoding_retrieves_the_needle(device: torch.device) -> None:
    """A crafted retrieval prompt: one needle among 400 haystack tokens, far from the sink and the
    window. Dense attention depends on it (dropping it moves the logits); PQ sparse decoding with
    heavy=8 (2% of the prompt) must select it and stay close to dense. (With 16 centroids and
    heavy=4 the needle shared a centroid with haystack keys and was missed in ~1 of 20 models.)"""
    model = _retrieval_model(device)
    prompt = torch.randint(10, 128, (1, 400), device=device)
    prompt[0, 150] = NEEDLE
    query = torch.full((1, 1), QUERY, device=device)
    with torch.no_grad():
        pq_hf.disable(model)
        dense = model(torch.cat([prompt, query], 1)).logits[:, -1]
        no_needle = prompt.clone()
        no_needle[0, 150] = 11
        without = model(torch.cat([no_needle, query], 1)).logits[:, -1]
        pq_hf.enable(model, pq_hf.HFConfig(heavy=8, sink=4, window=8, bits=6, iters=8))
        cache = transformers.DynamicCache(config=model.config)
        model(prompt, **pq_hf.cache_kwargs(model, cache))
        sparse = model(query, **pq_hf.cache_kwargs(model, cache)).logits[:, -1]
    assert _states(model)[0].sparse_steps == 1
    needle_effect = float((without - dense).norm() / dense.norm())
    sparse_error = float((sparse - dense).norm() / dense.norm())
    assert needle_effect > 0.05, "the crafted model must depend on the needle"
    assert sparse_error < 0.1 * needle_effect, (sparse_error, needle_effect)


def test_dense_layers_stay_dense(device: torch.device) -> None:
    model = _model("qwen2", device)
    ids = torch.randint(0, 128, (1, 40), device=device)
    assert pq_hf.enable(
        model, pq_hf.HFConfig(heavy=8, sink=2, window=2, bits=3, iters=2, dense_layers=(0, 2))
    ) == [1]
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert [s.sparse_steps for s in _states(model)] == [0, 3, 0]


def test_dense_layers_and_steps_past_capacity_run_the_split_k_kernel(
    kernel_routes, device: torch.device
) -> None:
    """Decode steps of dense_layers and past the capacity attend over every cached token through the
    split-K kernel (no masked SDPA): the dynamic- and static-cache generations equal dense, ragged
    prompts included, and each layer counts the steps it served so."""
    model = _model("llama", device)
    ids = torch.randint(0, 128, (2, 40), device=device)
    mask = torch.ones_like(ids)
    cfg = pq_hf.HFConfig(heavy=500, sink=2, window=2, bits=3, iters=2, capacity=2, dense_layers=(0,))
    with torch.no_grad():
        dense = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        ragged = pq_hf.generate(model, ids, 6, prompt_lengths=[40, 31])
        pq_hf.enable(model, cfg)
        with pytest.warns(UserWarning, match="past HFConfig.capacity"):
            sparse = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(sparse, dense)
        assert [(s.sparse_steps, s.split_k_steps) for s in _states(model)] == [(0, 5), (2, 3), (2, 3)]
        pq_hf.enable(model, cfg)  # (eager steps: each one counted, as a graph's replays are not)
        assert torch.equal(pq_hf.generate(model, ids, 6, prompt_lengths=[40, 31], capture=False), ragged)
    assert [s.split_k_steps for s in _states(model)] == [5, 0, 0], "the static cache has room: sparse"


@pytest.mark.parametrize("cache,first", [("dynamic", [0, 7, 19]), ("static", [3, 7, 19])])
def test_left_padded_prompts_decode_through_the_split_k_kernel(
    cache: str, first: list[int], kernel_routes, device: torch.device, monkeypatch
) -> None:
    """A batch left-padded as generate pads it (a run of masked keys before each sequence's
    tokens; one sequence unpadded, or every one padded) with re-rank, over a dynamic or a static
    cache, builds no index, and every
    decode step of every layer attends over each sequence's run of the step's mask through the
    split-K kernel, from past its padding: the tokens equal transformers' own with that mask. A
    mask with a hole keeps SDPA, and the warning names the route taken."""
    starts = []
    dense_decode = pq_hf.dispatch.dense_decode

    def spy(*args, **kwargs):
        starts.append(None if kwargs.get("starts") is None else kwargs["starts"].tolist())
        return dense_decode(*args, **kwargs)

    monkeypatch.setattr(pq_hf.dispatch, "dense_decode", spy)
    model = _model("llama", device)
    ids, mask = _left_padded(first, device)
    kw = dict(max_new_tokens=6, do_sample=False) | _cache_kwargs(cache)
    cfg = pq_hf.HFConfig(heavy=8, sink=2, window=2, bits=3, iters=2, share="group", rerank=2)
    with torch.no_grad():
        dense = model.generate(ids, attention_mask=mask, **kw)
        pq_hf.enable(model, cfg)
        with pytest.warns(UserWarning, match="padding.*split-K kernel"):
            sparse = model.generate(ids, attention_mask=mask, **kw)
        assert torch.equal(sparse, dense)
        assert all(s.index is None and (s.sparse_steps, s.split_k_steps) == (0, 5) for s in _states(model))
        assert starts == [first] * 15, "every decode step of the 3 layers starts past the padding"
        hole = mask.clone()
        hole[0, 10] = 0
        pq_hf.enable(model, cfg)
        with pytest.warns(UserWarning, match="padding.*run SDPA with the mask"):
            model.generate(ids, attention_mask=hole, **kw)
    assert all(s.split_k_steps == 0 for s in _states(model))


@pytest.mark.parametrize(
    "share,cache,first",
    [
        ("head", "dynamic", [0, 7, 19]),
        ("group", "dynamic", [3, 7, 19]),
        ("head", "static", [3, 7, 19]),
        ("group", "static", [0, 7, 19]),
    ],
)
def test_left_padded_prompts_decode_sparsely(
    share: str, cache: str, first: list[int], kernel_routes, device: torch.device, monkeypatch
) -> None:
    """A left-padded batch (one sequence unpadded, or every one padded: the positions then stop
    short of the prompt's length), over a dynamic or a static cache, is indexed from each
    sequence's first token on, without a warning: with heavy covering every token its greedy tokens
    are transformers' own with the mask, every decode step through the index; with a small heavy,
    every step's selection holds each sequence's first tokens (its sink, not its padding) and last
    ones (its window, the new token included) at the cache's positions, and nothing before its
    first token."""
    model = _model("llama", device)
    ids, mask = _left_padded(first, device)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False) | _cache_kwargs(cache)
    covering = pq_hf.HFConfig(heavy=200, sink=2, window=2, bits=3, iters=2, share=share)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*padding")
        dense = model.generate(ids, **kw)
        pq_hf.enable(model, covering)
        assert torch.equal(model.generate(ids, **kw), dense)
        assert all((s.sparse_steps, s.split_k_steps) == (5, 0) for s in _states(model))
        # the last token is not fed back
        assert _states(model)[0].index.lengths.tolist() == [45 - f for f in first]

        seen, appended = [], []
        attend, select = pq_hf.PQIndex.attend, pq_hf.PQIndex.select

        def attend_spy(index, q, k_cache, v_cache, selection, **kwargs):
            seen.append((selection.positions.clone(), selection.counts.clone()))
            return attend(index, q, k_cache, v_cache, selection, **kwargs)

        def select_spy(index, q, k_cache, append):
            appended.append((k_cache.clone(), append.clone()))
            return select(index, q, k_cache, append=append)

        monkeypatch.setattr(pq_hf.PQIndex, "attend", attend_spy)
        monkeypatch.setattr(pq_hf.PQIndex, "select", select_spy)
        pq_hf.enable(model, pq_hf.HFConfig(heavy=3, sink=2, window=2, bits=3, iters=2, share=share))
        model.generate(ids, **kw)
    assert len(seen) == len(appended) == 15
    for call, ((positions, counts), (k_cache, new_key)) in enumerate(zip(seen, appended, strict=True)):
        n = 41 + call // 3  # the cache's tokens at the step (3 layers a step)
        assert torch.equal(new_key, k_cache[:, :, n - 1 : n]), "the index appends the step's key"
        for b, f in enumerate(first):
            for row, count in zip(positions[b], counts[b].tolist(), strict=True):
                got = set(row[:count].tolist())
                assert {f, f + 1, n - 2, n - 1} <= got, (b, f, n, sorted(got))
                assert min(got) >= f and max(got) < n and len(got) == count


def test_a_sliding_window_shorter_than_the_prompt_keeps_the_split_k_route(
    kernel_routes, device: torch.device
) -> None:
    """A sliding window shorter than the prompt also shows each sequence one run of keys ending at
    the last: that is not left padding to index, and its decode steps attend over each step's
    window through the split-K kernel, giving transformers' tokens."""
    config = transformers.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, sliding_window=16,
    )  # fmt: skip
    model = transformers.MistralForCausalLM(config).to(device).eval()
    ids = torch.randint(1, 128, (2, 40), device=device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        dense = model.generate(ids, **kw)
        pq_hf.enable(model, pq_hf.HFConfig(heavy=200, sink=2, window=2, bits=3, iters=2))
        with pytest.warns(UserWarning, match="padding.*split-K kernel"):
            assert torch.equal(model.generate(ids, **kw), dense)
    assert all(s.index is None and (s.sparse_steps, s.split_k_steps) == (0, 5) for s in _states(model))


@pytest.mark.parametrize("additive", [False, True])
def test_split_k_decode_reads_each_sequences_run_off_the_mask(additive: bool, device: torch.device) -> None:
    """`split_k_decode` with a step's mask: each sequence attends to its run of visible keys (a
    boolean mask, or an additive one with 0 visible), a mask narrower than the cache included;
    a sequence with no visible key gives a zero row."""
    B, H, Hkv, S, D = 3, 4, 2, 50, 8
    q = torch.randn(B, H, 1, D, device=device)
    k, v = torch.randn(B, Hkv, S, D, device=device), torch.randn(B, Hkv, S, D, device=device)
    runs = [(3, 45), (0, 45), (45, 45)]
    visible = torch.zeros(B, 1, 1, 45, dtype=torch.bool, device=device)
    for b, (lo, hi) in enumerate(runs):
        visible[b, ..., lo:hi] = True
    mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min) if additive else visible
    out = pq_hf.split_k_decode(q, k, v, None, None, {}, attention_mask=mask)
    for b, (lo, hi) in enumerate(runs):
        want = torch.zeros(H, D, device=device)
        if hi > lo:
            want = torch.nn.functional.scaled_dot_product_attention(
                q[b], k[b, :, lo:hi], v[b, :, lo:hi], enable_gqa=True
            )[:, 0]
        torch.testing.assert_close(out[b, 0], want, atol=1e-5, rtol=1e-5)


def test_split_k_decode_over_a_growing_cache_keeps_its_buffers(device: torch.device) -> None:
    """A cache that grows a token a step (transformers' dynamic cache): `split_k_decode` keeps one
    set of buffers for the shape and reallocates the workspace only past each 4096 tokens, and
    each step attends over the whole cache."""
    B, H, Hkv, D = 1, 4, 2, 8
    buffers: dict = {}
    workspaces = set()
    q = torch.randn(B, H, 1, D, device=device)
    for S in (5, 6, 4096, 4097):
        k, v = torch.randn(B, Hkv, S, D, device=device), torch.randn(B, Hkv, S, D, device=device)
        out = pq_hf.split_k_decode(q, k, v, None, None, buffers)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        workspaces |= {b[2].data_ptr() for b in buffers.values()}
        assert len(buffers) == 1
    assert len(workspaces) == 2


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("first", [[0, 0], [0, 9]])
def test_decode_steps_replay_their_plans(
    cache: str, first: list[int], kernel_routes, device: torch.device, monkeypatch
) -> None:
    """transformers' generate (a prompt unpadded and one left-padded): no call of the first decode
    step replays a plan; once a layer's select replays its launch plan (no checks, no recording)
    it does at every later step, and over a static cache its attend too; by the last steps every
    layer's do. A dynamic cache changes the key cache's shape every step, so its attends take the
    full path. (On a GPU a layer's first calls can compile and tune kernels, which keeps no plan:
    a plan comes a step or two later than under the interpreter.)"""
    calls: list[tuple[str, bool]] = []
    get = PlanCache.get

    def counting(self, key):
        plan = get(self, key)
        if key is not None and key[0] in ("append+select", "attend"):
            calls.append((key[0], plan is not None))
        return plan

    monkeypatch.setattr(PlanCache, "get", counting)
    model = _model("llama", device)
    pq_hf.enable(model, pq_hf.HFConfig(heavy=6, sink=2, window=2, subvectors=2, bits=3, iters=2))
    ids, mask = _left_padded(first, device)
    new = 8
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **_cache_kwargs(cache))
    layers = len(_states(model))
    assert all(s.sparse_steps == new - 1 for s in _states(model))
    assert [name for name, _ in calls] == ["append+select", "attend"] * layers * (new - 1)
    # hits[i][step]: call i of a step (a layer's select or attend) replayed a plan at that step
    hits = [[hit for _, hit in calls[i :: 2 * layers]] for i in range(2 * layers)]
    for i, steps in enumerate(hits):
        replays = i % 2 == 0 or cache == "static"
        assert not steps[0], calls
        assert steps[-3:] == [replays] * 3, (i, steps)
        assert steps == sorted(steps), (i, steps)  # once a plan replays, it replays at every step


@pytest.mark.parametrize(
    "route,cache,first",
    [
        ("sparse", "dynamic", [0, 0]),
        ("sparse", "dynamic", [0, 9]),
        ("sparse", "static", [0, 9]),
        ("split-k", "dynamic", [0, 0]),
        ("split-k", "dynamic", [0, 9]),
    ],
)
def test_eager_decode_steps_read_nothing_on_the_host(
    route: str, cache: str, first: list[int], kernel_routes, device: torch.device, monkeypatch
) -> None:
    """transformers' generate, each decode step of each layer sparse (a prompt unpadded or left-
    padded) or through the split-K kernel (`dense_layers`): pqattn reads no tensor value on the
    host at a decode step (a host sync on a GPU), over a dynamic cache, whose key cache changes
    shape every step (no plan replays), as over a static one. Two generates of 2 and 6 new
    tokens make as many host reads in pqattn's code (the prefill's)."""
    reads = []

    def counted(name: str):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("pqattn"):
                reads.append(name)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)

    for name in ("cpu", "item", "tolist", "__bool__", "__int__"):
        counted(name)
    model = _model("llama", device)
    layers = tuple(range(len(model.model.layers))) if route == "split-k" else ()
    pq_hf.enable(
        model,
        pq_hf.HFConfig(heavy=6, sink=2, window=2, subvectors=2, bits=3, iters=2, dense_layers=layers),
    )
    ids, mask = _left_padded(first, device)
    made = []
    with torch.no_grad():
        for new in (2, 6):
            reads.clear()
            model.generate(
                ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **_cache_kwargs(cache)
            )
            made.append(list(reads))
    steps = [(s.sparse_steps, s.split_k_steps) for s in _states(model)]
    assert all(step == ((6, 0) if route == "sparse" else (0, 6)) for step in steps), steps  # 1 + 5
    assert made[0] == made[1], made


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="heavy / heavy_fraction"):
        pq_hf.HFConfig(heavy=10, heavy_fraction=0.5)
    with pytest.raises(ValueError, match="heavy_fraction"):
        pq_hf.HFConfig(heavy_fraction=1.5)
    with pytest.raises(
        TypeError, match="heavy_fraction: expected a float in \\(0, 1\\] or None, got str '2%'"
    ):
        pq_hf.HFConfig(heavy_fraction="2%")
    with pytest.raises(ValueError, match="prefill"):
        pq_hf.HFConfig(prefill="flash")
    assert pq_hf.HFConfig().heavy_for(10_000) == pq_hf.PQConfig().heavy
    assert pq_hf.HFConfig(heavy_fraction=0.1).heavy_for(10_000) == 1000
    for kwargs, name in [
        (dict(bits=9), "bits"),
        (dict(bits=0), "bits"),
        (dict(subvectors=0), "subvectors"),
        (dict(metric="cosine"), "metric"),
        (dict(sink=-1), "sink"),
        (dict(heavy=-1), "heavy"),
        (dict(heavy=64, heavy_fraction=0.1), "heavy_fraction"),
        (dict(capacity=0), "capacity"),
        (dict(dense_layers=(1, -2)), "dense_layers"),
        (dict(share="heads"), "share"),
        (dict(group_rule="mean"), "group_rule"),
        (dict(sample=-1), "sample"),
        (dict(sample=8, metric="ip"), "sample"),
    ]:
        with pytest.raises((ValueError, TypeError), match=name):
            pq_hf.HFConfig(**kwargs)


def test_bad_configs_are_refused_at_enable_and_empty_prompts_at_generate() -> None:
    """What the model cannot serve is refused where the user passes it, before any step."""
    model = _model("llama", torch.device("cpu"))  # head dim 16, 3 layers
    with pytest.raises(ValueError, match=r"subvectors: head dim D=16 must be divisible .* got M=3"):
        pq_hf.enable(model, pq_hf.HFConfig(subvectors=3))
    with pytest.raises(
        ValueError, match=r"dense_layers: expected layer indices of the model's 3 .*0\.\.2.*\[5, 99\]"
    ):
        pq_hf.enable(model, pq_hf.HFConfig(dense_layers=(1, 5, 99)))
    assert not _states(model), "nothing switched by a refused config"
    with pytest.raises(
        ValueError, match=r"input_ids: expected at least one prompt of at least one token.*\[1, 0\]"
    ):
        pq_hf.generate(model, torch.zeros(1, 0, dtype=torch.int64), 4)
    with pytest.raises(
        ValueError, match=r"input_ids: expected token ids in \[0, vocab_size=128\), got ids from 0 to 128"
    ):
        pq_hf.generate(model, torch.tensor([[0, 5, 128]]), 4)
    with pytest.raises(ValueError, match="max_new_tokens: expected a positive int, got -1"):
        pq_hf.generate(model, torch.zeros(1, 4, dtype=torch.int64), -1)


def test_decoding_past_the_capacity_warns_once_and_goes_dense(device: torch.device) -> None:
    model = _model("llama", device)
    ids = torch.randint(0, 128, (1, 40), device=device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        dense = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        pq_hf.enable(model, pq_hf.HFConfig(heavy=500, sink=2, window=2, bits=3, iters=2, capacity=2))
        with pytest.warns(UserWarning, match="past HFConfig.capacity") as caught:
            sparse = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert len([w for w in caught if "capacity" in str(w.message)]) == 1, "one warning, not one a layer"
    assert torch.equal(sparse, dense)
    assert all(s.sparse_steps == 2 for s in _states(model)), "the steps within the capacity stay sparse"


@pytest.mark.parametrize("prefill", ["sdpa", "pqattn"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_static_generate_equals_dense(kind: str, prefill: str, device: torch.device) -> None:
    """pq_hf.generate (a StaticCache; captured on CUDA): with heavy covering every token, the
    greedy tokens of the dynamic-cache dense generation, every decode step through the index
    (each reading its new key at the position's slot), and the same loop dense."""
    model = _model(kind, device)
    ids = torch.randint(0, 128, (2, 70), device=device)
    with torch.no_grad():
        dense = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert torch.equal(pq_hf.generate(model, ids, 12), dense)  # the static loop, dense attention
    pq_hf.enable(model, pq_hf.HFConfig(heavy=500, sink=4, window=4, bits=3, iters=3, prefill=prefill))
    assert torch.equal(pq_hf.generate(model, ids, 12), dense)
    for state in _states(model):
        assert state.static and state.index.capacity == 82
        assert state.index.lengths.tolist() == [81, 81]  # the last token is not fed back
    if device.type != "cuda":
        assert all(s.sparse_steps == 11 for s in _states(model))


def test_static_generate_compiled_equals_eager(device: torch.device) -> None:
    """compile=True (the decode step's forward through torch.compile, pqattn's attention eager
    between its graphs): the eager static loop's greedy tokens on a ragged batch, every decode
    step through the index, and the forward compiled into graphs."""
    model = _model("llama", device)
    ids, lengths = _ragged(device)
    pq_hf.enable(model, pq_hf.HFConfig(heavy=500, sink=4, window=4, bits=3, iters=3))
    eager = pq_hf.generate(model, ids, 8, prompt_lengths=lengths)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # a limit below the layer count: each layer's attention forward is a cache entry of its own
    with torch._dynamo.config.patch(recompile_limit=2):
        assert torch.equal(pq_hf.generate(model, ids, 8, prompt_lengths=lengths, compile=True), eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    skipped = [k for k in torch._dynamo.utils.counters["unimplemented"] if "recompile limit" in k]
    assert not skipped, "every layer compiled, none left eager at the recompile limit"
    if device.type != "cuda":
        assert [s.sparse_steps for s in _states(model)] == [14] * 3


def test_static_generate_sparse_and_its_arguments(device: torch.device) -> None:
    """Sparse, the static loop's first layer indexes the keys that the dynamic cache's decode steps
    index for the same tokens (its new keys read at their slots; the first layer's keys do not
    depend on attention); bad arguments are refused."""
    model = _model("llama", device)
    ids = torch.randint(0, 128, (1, 200), device=device)
    pq_hf.enable(model, pq_hf.HFConfig(heavy=16, sink=4, window=8, bits=4, iters=2))
    out = pq_hf.generate(model, ids, 6)
    assert out.shape == (1, 206) and torch.equal(out[:, :200], ids)
    first = _states(model)[0].index
    assert first.lengths.tolist() == [205]
    static_codes = first.codes[:, :, :205].clone()
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():  # the same tokens, teacher-forced through the dynamic cache
        model(out[:, :200], **pq_hf.cache_kwargs(model, cache))
        for t in range(200, 205):
            model(out[:, t : t + 1], **pq_hf.cache_kwargs(model, cache))
    assert torch.equal(_states(model)[0].index.codes[:, :, :205], static_codes)
    with pytest.raises(ValueError, match="max_new_tokens"):
        pq_hf.generate(model, ids, 0)
    with pytest.raises(TypeError, match="input_ids"):
        pq_hf.generate(model, ids.int(), 2)
    if device.type != "cuda":
        with pytest.raises(ValueError, match="capture"):
            pq_hf.generate(model, ids, 2, capture=True)


def test_static_generate_stops_sequences_at_eos(device: torch.device) -> None:
    """With eos_token_id a sequence that emits it keeps emitting it, as transformers pads a
    finished sequence; the others go on."""
    model = _model("llama", device)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3)).to(device)
    free = pq_hf.generate(model, ids, 10)
    eos = int(free[0, 43])  # the first sequence's fourth new token
    got = pq_hf.generate(model, ids, 10, eos_token_id=eos)
    with torch.no_grad():
        want = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, eos_token_id=eos,
            pad_token_id=eos,
        )  # fmt: skip
    width = want.shape[1]
    assert torch.equal(got[:, :width], want)
    assert (got[:, width:] == eos).all() or width == got.shape[1]
    first = int((free[0, 40:] == eos).nonzero()[0])
    assert (got[0, 40 + first :] == eos).all() and torch.equal(got[0, : 40 + first], free[0, : 40 + first])


def _ragged(device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Three right-padded prompts of 70, 45 and 58 tokens (random padding tokens)."""
    gen = torch.Generator().manual_seed(5)
    return torch.randint(0, 128, (3, 70), generator=gen).to(device), [70, 45, 58]


@pytest.mark.parametrize("sparse", [False, True])
def test_static_generate_ragged_batch_equals_each_sequence_alone(sparse: bool, device: torch.device) -> None:
    """A ragged batch (right-padded prompts with their lengths): each sequence's greedy tokens are
    those it gets alone, dense and with pqattn (heavy covering every token); each index holds its
    own sequence's length."""
    model = _model("llama", device)
    if sparse:
        pq_hf.enable(model, pq_hf.HFConfig(heavy=500, sink=4, window=4, bits=3, iters=3))
    ids, lengths = _ragged(device)
    batch = pq_hf.StaticDecoder(model, ids, 9, prompt_lengths=lengths)
    got = batch.run()
    assert torch.equal(got[:, :70], ids)
    for b, n in enumerate(lengths):
        alone = pq_hf.StaticDecoder(model, ids[b : b + 1, :n], 9)
        assert torch.equal(got[b, 70:], alone.run()[0, n:]), f"sequence {b} ({n} tokens)"
        for mine, its in zip(batch.cache.layers, alone.cache.layers, strict=True):  # each row's own slots
            torch.testing.assert_close(
                mine.keys[b, :, : n + 8], its.keys[0, :, : n + 8], atol=1e-4, rtol=1e-4
            )
            torch.testing.assert_close(
                mine.values[b, :, : n + 8], its.values[0, :, : n + 8], atol=1e-4, rtol=1e-4
            )
    if sparse:
        got = pq_hf.generate(model, ids, 9, prompt_lengths=torch.tensor(lengths))
        for state in _states(model):
            assert state.index.lengths.tolist() == [n + 8 for n in lengths]
            assert state.prompt_lengths is None  # set for the prefill only


@pytest.mark.parametrize("sparse", [False, True])
def test_static_decoder_chunked_prefill_equals_one_forward(sparse: bool, device: torch.device) -> None:
    """A prefill in chunks of 16 tokens per sequence (the sequences' last prompt tokens in
    different chunks) gives the tokens of a prefill in one forward; pqattn builds each index once,
    at the last chunk, over the whole prompt."""
    model = _model("llama", device)
    if sparse:
        pq_hf.enable(model, pq_hf.HFConfig(heavy=500, sink=4, window=4, bits=3, iters=3))
    ids, lengths = _ragged(device)
    whole = pq_hf.StaticDecoder(model, ids, 6, prompt_lengths=lengths).run()
    builds = []
    if sparse:
        for state in _states(model):
            state.index = None
    decoder = pq_hf.StaticDecoder(model, ids, 6, prompt_lengths=lengths, prefill_tokens=3 * 16)
    if sparse:
        builds = [s.index for s in _states(model)]
        assert all(i is not None and i.lengths.tolist() == lengths for i in builds)
    assert torch.equal(decoder.run(), whole)


def test_static_decoder_steps_and_arguments(device: torch.device) -> None:
    """Steps one at a time up to max_new_tokens, then refuses; bad prompt lengths are refused."""
    model = _model("llama", device)
    ids, lengths = _ragged(device)
    decoder = pq_hf.StaticDecoder(model, ids, 3, prompt_lengths=lengths)
    assert decoder.steps_left == 2
    decoder.step()
    decoder.step()
    assert decoder.steps_left == 0
    assert torch.equal(decoder.tokens, pq_hf.generate(model, ids, 3, prompt_lengths=lengths)[:, 70:])
    with pytest.raises(ValueError, match="step: all max_new_tokens=3"):
        decoder.step()
    for bad in ([70, 45], [70, 0, 58], [70, 71, 58], [70.0, 45, 58]):
        with pytest.raises(ValueError, match="prompt_lengths"):
            pq_hf.StaticDecoder(model, ids, 3, prompt_lengths=bad)
    with pytest.raises(ValueError, match="prefill_tokens"):
        pq_hf.StaticDecoder(model, ids, 3, prefill_tokens=0)


@pytest.mark.parametrize("kind,prefill", [("llama", "sdpa"), ("qwen2", "pqattn")])
def test_host_tier_generates_the_tokens_of_the_gpu_cache(
    kind: str, prefill: str, device: torch.device
) -> None:
    """kv_placement="host" through StaticDecoder (ragged prompts, a prefill in chunks): the same
    greedy tokens as the cache on the GPU, every decode step sparse, rows fetched and reused, the
    prompts' keys and values in the host rows."""
    model = _model(kind, device)
    P, new = (150, 10) if device.type == "cpu" else (600, 24)
    ids = torch.randint(0, 128, (2, P), device=device)
    lengths = [P, P - 41]
    tokens, states = {}, {}
    for placement in ("gpu", "host"):
        config = pq_hf.HFConfig(
            heavy=8, sink=4, window=4, subvectors=4, bits=4, kv_placement=placement, prefill=prefill
        )
        pq_hf.enable(model, config)
        decoder = pq_hf.StaticDecoder(model, ids, new, prompt_lengths=lengths, prefill_tokens=P)
        tokens[placement] = decoder.run()
        states[placement] = _states(model)
        pq_hf.disable(model)
    assert torch.equal(tokens["host"], tokens["gpu"])
    for state in states["host"]:
        # every decode call is sparse (a captured loop calls the layer twice: eager, capture)
        assert state.sparse_steps == (2 if device.type == "cuda" else new - 1)
        assert state.host.row_cache.stats[..., 0].sum() > 0
        assert 0.0 < state.host.hit_rate() < 1.0
    rows = states["host"][0].host.rows
    assert bool(rows[:, :, :P].abs().sum(-1).gt(0).all()), "the prompt's keys and values are in the host rows"


def test_8_bit_host_tier_generates_from_8_bit_rows(device: torch.device) -> None:
    """host_int8: the layers' host rows are 8-bit (2 * D + 8 bytes a position), the prompt's rows
    decode back close to the keys, and every decode step is sparse over them."""
    model = _model("llama", device)
    P, new = (150, 6) if device.type == "cpu" else (600, 12)
    ids = torch.randint(0, 128, (1, P), device=device)
    config = pq_hf.HFConfig(
        heavy=8, sink=4, window=4, subvectors=4, bits=4, kv_placement="host", host_int8=True
    )
    pq_hf.enable(model, config)
    out = pq_hf.StaticDecoder(model, ids, new, capture=False).run()
    assert out.shape == (1, P + new)
    for state in _states(model):
        rows = state.host.rows
        assert rows.dtype == torch.uint8 and rows.shape[-1] == 2 * 16 + 8
        assert state.sparse_steps == new - 1 and state.host.int8
    pq_hf.disable(model)


def test_host_tier_is_validated_and_needs_the_static_loop(device: torch.device, monkeypatch) -> None:
    for field, value, what in (
        ("share", "head", "share: expected 'group'"),
        ("rerank", 2, "rerank: expected 0"),
        ("dense_layers", (0,), r"dense_layers: expected \(\)"),
        ("kv_placement", "disk", "kv_placement: expected one of"),
        ("host_slots", 0, "host_slots"),
    ):
        kwargs = {"kv_placement": "host", field: value}
        with pytest.raises(ValueError, match=what):
            pq_hf.HFConfig(**kwargs)
    with pytest.raises(ValueError, match="host_int8: expected kv_placement='host', got 'gpu'"):
        pq_hf.HFConfig(host_int8=True)
    model = _model("llama", device)
    pq_hf.enable(model, pq_hf.HFConfig(heavy=8, sink=4, window=4, subvectors=4, kv_placement="host"))
    ids = torch.randint(0, 128, (1, 40), device=device)
    with pytest.raises(ValueError, match="kv_placement: 'host' keeps the cache in a host tier"):
        model.generate(ids, max_new_tokens=2, do_sample=False)
    from pqattn import host

    monkeypatch.setattr(host, "available_host_bytes", lambda: 10_000)
    with pytest.raises(
        ValueError, match=r"input_ids / max_new_tokens: the host tier needs .* the machine has 10000"
    ):
        pq_hf.StaticDecoder(model, ids, 4)


def test_host_row_caches_shrink_to_the_free_gpu_memory(device: torch.device, monkeypatch) -> None:
    """Default row caches that the GPU cannot hold shrink a list width at a time, with a warning;
    explicit host_slots are kept; too little memory even for one width is refused."""
    from pqattn import host

    model = _model("llama", device)
    ids = torch.randint(0, 128, (1, 200), device=device)  # a capacity above 8 list widths

    def build(free: int | None, **kwargs) -> list:
        monkeypatch.setattr(host, "free_gpu_bytes", lambda dev: free)
        config = pq_hf.HFConfig(heavy=8, sink=4, window=4, subvectors=4, kv_placement="host", **kwargs)
        pq_hf.enable(model, config)
        pq_hf.StaticDecoder(model, ids, 4, capture=False)
        states = _states(model)
        pq_hf.disable(model)
        return [s.host for s in states]

    full = build(None)
    L = full[0].list_width
    assert full[0].index.capacity > host.ROW_CACHE_LISTS * L
    assert all(t.slots == host.ROW_CACHE_LISTS * L for t in full)
    two = build(None, host_slots=2 * L)
    fits_two = sum(t.footprint.gpu for t in two) + 1
    with pytest.warns(
        UserWarning, match=f"shrink from the default {host.ROW_CACHE_LISTS} list widths of slots to 2"
    ):
        shrunk = build(fits_two)
    assert all(t.slots == 2 * L for t in shrunk)
    kept = build(10**15, host_slots=3 * L)
    assert all(t.slots == 3 * L for t in kept)
    with (
        pytest.warns(UserWarning, match="list widths of slots to 1"),
        pytest.raises(
            ValueError, match="input_ids / max_new_tokens: the host tier's index and row cache need"
        ),
    ):
        build(1)
