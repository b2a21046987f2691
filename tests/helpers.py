"""Test helpers: comparisons that report how much mismatched, and brute-force set views."""

from __future__ import annotations

import torch


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float, what: str = ""
) -> None:
    """allclose with a report of how many elements mismatch and the worst one; NaN never passes."""
    a, e = actual.double().cpu(), expected.double().cpu()
    assert a.shape == e.shape, f"{what}: shape {list(a.shape)} != {list(e.shape)}"
    bad = ~((a == e) | ((a - e).abs() <= atol + rtol * e.abs()))
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} elements mismatch (atol={atol}, rtol={rtol}); "
            f"first at {idx}: got {a[idx].item()}, expected {e[idx].item()}; "
            f"max abs err {float((a - e).abs().nan_to_num(float('inf')).max())}"
        )


def rows_as_sets(positions: torch.Tensor, counts: torch.Tensor) -> list[list[set[int]]]:
    """[B][H] sets of the first counts[b, h] positions (asserting no duplicates)."""
    out = []
    for b in range(positions.shape[0]):
        row = []
        for h in range(positions.shape[1]):
            items = positions[b, h, : int(counts[b, h])].tolist()
            assert len(set(items)) == len(items), f"duplicate positions in row ({b}, {h}): {items}"
            row.append(set(items))
        out.append(row)
    return out


def assert_selection_exact(
    pos, cnt, weights, q, centroids, codes, lengths, *, sink, window, heavy, cand_lo, short_threshold
) -> None:
    """A kernel's selection (and dense weights, when given) obeys SPEC §2 against the float64
    reference for the same query."""
    from pqattn import reference as ref
    from pqattn.lab.kernel_checks import selection_problem

    scores = ref.pq_scores(q.double(), centroids.double(), codes)
    want = ref.select_from_scores(scores, lengths, sink=sink, window=window, heavy=heavy, init_offset=cand_lo)
    problem = selection_problem(
        pos,
        cnt,
        scores,
        lengths,
        cand_lo=cand_lo,
        window=window,
        short_threshold=short_threshold,
        ref_sel=want,
    )
    assert problem is None, problem
    if weights is not None:
        assert torch.equal(weights.float(), ref.dense_weights(ref.Selection(pos, cnt), codes.shape[2]))


def assert_index_selection(index, sel, q) -> None:
    """A per-head PQIndex's selection for q obeys SPEC §2 for the index's config, codes and lengths."""
    c = index.config
    assert c.share == "head", "a per-head index"
    assert_selection_exact(
        *sel,
        None,
        q,
        index.centroids,
        index.codes,
        index.lengths,
        sink=c.sink,
        window=c.window,
        heavy=c.heavy,
        cand_lo=max(c.offset, c.sink),
        short_threshold=c.width(),
    )


def count_plan_replays(monkeypatch) -> list[int]:
    """Count the calls of every pqattn.runtime.launch.Plan from now on (in a one-element list)."""
    from pqattn.runtime.launch import Plan

    replays = [0]
    replay = Plan.__call__

    def counted(self, *inputs):
        replays[0] += 1
        return replay(self, *inputs)

    monkeypatch.setattr(Plan, "__call__", counted)
    return replays


def select_hist_launches(monkeypatch, H: int, Hkv: int) -> dict[str, tuple]:
    """The launches pq_select_hist makes on a tiny CPU input (B = 1, N = 64), intercepted, not run:
    kernel name -> (grid, tensors, scalars, kwargs)."""
    from pqattn.kernels.select import hist as select_hist
    from pqattn.reference import SelectParams
    from pqattn.runtime import launch

    launched: dict[str, tuple] = {}
    monkeypatch.setattr(
        launch.Launcher, "__call__", lambda self, *a: launched.setdefault(self.fn.__name__, a)
    )
    B, N, M, C = 1, 64, 2, 4
    select_hist.pq_select_hist(
        torch.randn(B, H, 16),
        torch.randn(B, Hkv, M, C, 8),
        torch.zeros(B, Hkv, N, M, dtype=torch.uint8),
        torch.full((B,), N, dtype=torch.int32),
        SelectParams(sink=2, window=2, heavy=8, cand_lo=2, short_threshold=12, width=12),
        positions=torch.empty(B, H, 12, dtype=torch.int32),
        counts=torch.empty(B, H, dtype=torch.int32),
        workspace=torch.zeros(select_hist.workspace_numel(B * H, M, C), dtype=torch.int32),
        n_tokens=N,
        histogram=torch.zeros(B, Hkv, C**M, dtype=torch.int32),
    )
    return launched


def small_causal_lm(
    kind: str, device: torch.device, *, layers: int = 3, intermediate: int = 128
) -> torch.nn.Module:
    """A small randomly initialised GQA causal LM of transformers' `kind` ("llama", "mistral",
    "qwen2": H=4, Hkv=2, hidden 64, vocab 128), on `device`, in eval mode."""
    import transformers

    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[kind]
    config = getattr(transformers, f"{names}Config")(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=None,  # a random model may greedily emit token 2 and end generation early
    )
    return getattr(transformers, f"{names}ForCausalLM")(config).to(device).eval()
