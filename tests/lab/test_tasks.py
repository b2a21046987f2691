"""Task metrics on the committed model (a 2K-context slice on the CPU) and on small random problems."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import transformers

from pqattn import ops
from pqattn import reference as ref
from pqattn.cli import main
from pqattn.lab import metrics, tasks
from pqattn.lab.policies import Policy, from_family, group_select, head_select, per_head, policy_grid
from tests.helpers import assert_close

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "byte-llama-13m"
SETTINGS = tasks.TaskSettings(sink=16, window=16, iters=3)
PREFILL = 2032  # the committed model's chunks: 16 rows after a dense prefill of this many bytes


def _text_ids(batch: int, length: int) -> torch.Tensor:
    """Windows of the package's own sources as byte ids [batch, length]."""
    stream = b"".join(p.read_bytes() for p in sorted((ROOT / "src" / "pqattn").rglob("*.py")))
    step = (len(stream) - length) // batch
    return torch.stack([torch.tensor(list(stream[i * step : i * step + length])) for i in range(batch)])


@pytest.fixture(scope="module")
def committed():
    """The committed model in float32 on the CPU, its SDPA logits on two 2K windows, an evaluator."""
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ids = _text_ids(1, 2048)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        sdpa = model(ids, use_cache=False).logits.float()
    ev = tasks.PolicyEvaluator(model, SETTINGS)
    ev.prefill(ids[:, :PREFILL])
    return ev, ids, sdpa


def test_dense_equals_sdpa_in_one_pass_and_in_chunks(committed) -> None:
    ev, ids, sdpa = committed
    logits, mass = ev.chunk(ids[:, PREFILL:], Policy("dense"))
    assert mass == 1.0
    assert_close(logits, sdpa[:, PREFILL:], atol=1e-4, rtol=1e-4, what="dense chunk after a prefill")
    assert_close(ev.logits(ids[:, :256]), sdpa[:, :256], atol=1e-4, rtol=1e-4, what="dense forward")


@pytest.mark.parametrize(
    "policy",
    [
        Policy("oracle", 1.0),
        Policy("streaming", 1.0),
        Policy("pq", 1.0, subvectors=8, bits=4),
        Policy("pages", 1.0),
    ],
    ids=lambda p: p.name,
)
def test_a_policy_whose_budget_covers_every_token_equals_dense(committed, policy: Policy) -> None:
    ev, ids, sdpa = committed
    logits, mass = ev.chunk(ids[:, PREFILL:], policy)
    assert mass == pytest.approx(1.0, abs=1e-5)
    assert_close(logits, sdpa[:, PREFILL:], atol=2e-4, rtol=2e-4, what=policy.name)


def test_a_sparse_policy_changes_the_logits(committed) -> None:
    """The chunk path is not dense in disguise: a budget of a few tokens moves the logits."""
    ev, ids, sdpa = committed
    logits, mass = ev.chunk(ids[:, PREFILL:], Policy("streaming", 0.001))
    assert mass < 0.99 and (logits - sdpa[:, PREFILL:]).abs().max() > 1e-2


def test_8_bit_rows_move_the_logits_a_little(committed) -> None:
    """kv8 (the host tier's 8-bit rows): dense attention over them differs from dense by a little,
    and a policy whose budget covers every token gives the same logits as dense over them."""
    ev, ids, sdpa = committed
    eight, mass = ev.chunk(ids[:, PREFILL:], Policy("dense", kv8=True))
    assert mass == 1.0
    err = (eight - sdpa[:, PREFILL:]).abs().max()
    assert 1e-4 < err < 0.5, err
    covered, _ = ev.chunk(ids[:, PREFILL:], Policy("oracle", 1.0, kv8=True))
    assert_close(covered, eight, atol=2e-4, rtol=2e-4, what="oracle-kv8@1 against dense-kv8")
    assert from_family("pq-M16-b8-group-max-x4-s16-kv8", 0.02).kv8
    assert Policy("pq", 0.02, subvectors=16, bits=8, kv8=True).name == "pq-M16-b8-kv8@0.02"
    with pytest.raises(ValueError, match="kv8"):
        Policy("pq", 0.02, select=head_select(rerank=2), kv8=True)


def _tiny_evaluator(settings: tasks.TaskSettings) -> tasks.PolicyEvaluator:
    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
    )
    return tasks.PolicyEvaluator(transformers.LlamaForCausalLM(config), settings)


def _as_selection(keep: torch.Tensor) -> ref.Selection:
    """A mask [B, H, T] as a Selection (positions in order, -1 after the count)."""
    counts = keep.sum(-1)
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
    positions = torch.where(torch.arange(keep.shape[-1]) < counts[..., None], order, -1)
    return ref.Selection(positions.to(torch.int32), counts.to(torch.int32))


def _rerank_problem(
    heavy_kept: torch.Tensor,
    pq: torch.Tensor,
    exact: torch.Tensor,
    cand: torch.Tensor,
    rerank: int,
    heavy: int,
) -> str | None:
    """None when heavy_kept [N] is the exact top-`heavy` of some PQ shortlist of the top
    rerank * heavy candidates (ties any; SPEC §7), else what is wrong."""
    want = min(heavy, int(cand.sum()))
    if int(heavy_kept.sum()) != want:
        return f"{int(heavy_kept.sum())} heavy tokens kept, expected {want}"
    ranked = pq[cand].sort(descending=True).values
    cut = ranked[rerank * heavy - 1] if rerank * heavy <= ranked.numel() else float("-inf")
    if (pq[heavy_kept] < cut).any():
        return "a kept token is outside every shortlist"
    must = cand & (pq > cut) & ~heavy_kept  # in every shortlist, left out
    if want and (exact[must] > exact[heavy_kept].min()).any():
        return "a shortlisted token beats a kept one on the exact score"
    return None


@pytest.mark.parametrize(
    "kind,share,rerank",
    [
        ("oracle", "head", 0),
        ("streaming", "head", 0),
        ("pq", "head", 0),
        ("pages", "head", 0),
        ("oracle", "group", 0),
        ("pq", "group", 2),
        ("pq", "head", 3),
    ],
)
def test_chunk_rows_are_decode_steps(kind: str, share: str, rerank: int) -> None:
    """Each query row of a chunk attends as a decode step at its position would: the policy's
    selection over the tokens [0, p] (pqattn.ops; compared as score multisets, ties any; a group
    selection's rows serve each head of the group), then sparse attention over it (SPEC §3); the
    mass kept is metrics.captured_mass."""
    s = tasks.TaskSettings(sink=4, window=8, page=4, iters=3, seed=1)
    ev = _tiny_evaluator(s)
    B, H, Hkv, T, E, D = 2, 4, 2, 300, 6, 16
    q = torch.randn(B, H, E, D)
    k, v = torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    select = group_select("max", 2.0, rerank) if share == "group" else head_select(rerank)
    policy = Policy(kind, 0.05, subvectors=4, bits=3, page=s.page, select=select)
    ev.policy = policy
    ev.prefilled = tasks._Prefilled()
    out = ev.sparse_rows(0, q, k, v, 0.25)
    P = T - E
    heavy = policy.selection_heavy(P)
    book = ops.build_index(k[:, :, :P], subvectors=4, bits=3, init_offset=s.sink, iters=3, seed=1)
    codes = torch.cat([book.codes, ops.encode_keys(k[:, :, P:], book.centroids)], dim=2)
    score_rows = ev.row_scores(0, k, P)
    mass = 0.0
    for r in range(E):
        n = P + r + 1
        lengths = torch.full((B,), n)
        qr, kn, vn = q[:, :, r], k[:, :, :n], v[:, :, :n]
        exact = torch.einsum("bkgrd,bktd->bkgrt", q[:, :, r : r + 1].reshape(B, Hkv, H // Hkv, 1, D), k)
        exact = exact.reshape(B, H, 1, T)
        keep = ev.row_keep(score_rows(q[:, :, r : r + 1]), torch.tensor([n]), P, exact, Hkv)[:, :, 0, :n]
        common = dict(sink=s.sink, window=s.window, heavy=heavy, init_offset=s.sink)
        shared = dict(share=policy.share, group_rule=policy.group_rule)
        if share == "group":  # the functional API's heavy counts tokens per query head
            shared["group_budget"] = policy.budget
            common["heavy"] = policy.heavy(P)
        if kind == "streaming":
            want = ops.select_streaming(lengths, H, sink=s.sink, window=s.window + heavy)
            scores = torch.arange(n, dtype=torch.float64).expand(B, H, n)  # positions must match
        elif kind == "oracle":
            want = ops.select_oracle(qr, kn, lengths, **common, **shared)
            scores = ref.exact_scores(qr, kn)
        elif kind == "pq":
            keys = dict(rerank=rerank, keys=kn) if rerank else {}
            want = ops.select_topk(qr, book.centroids, codes[:, :, :n], lengths, **common, **shared, **keys)
            if rerank:
                scores = ref.exact_scores(qr, kn)
            elif share == "group":  # a group's scores, each head's copy (the max over them below keeps them)
                scores = ref.group_pq_scores(qr, book.centroids, codes[:, :, :n], "max")
                scores = scores.repeat_interleave(H // Hkv, 1)
            else:
                scores = ref.pq_scores(qr, book.centroids, codes[:, :, :n])
        else:
            want = ops.select_pages(qr, kn, lengths, page=s.page, **(common | {"heavy": heavy}))
            scores = ref.page_scores(qr, *ref.page_bounds(kn, lengths, s.page), s.page, n)
        want = per_head(want, H)
        if share == "group":
            scores = ref.group_scores(scores, Hkv, "max").repeat_interleave(H // Hkv, 1)
        wanted = ref.dense_weights(want, n) > 0
        kept = torch.zeros(n, dtype=torch.bool)
        kept[: s.sink] = kept[n - s.window :] = True
        assert (keep[..., kept]).all(), f"row {r}: sink and window kept"
        if rerank:
            # PQ scores tie often (few codes), and the re-rank of a shortlist that ends on a tie
            # may keep either side's tokens (ties any): check that the kept set is a valid one
            if share == "group":
                pq = ref.group_pq_scores(qr, book.centroids, codes[:, :, :n], "max")
                pq = pq.repeat_interleave(H // Hkv, 1)
            else:
                pq = ref.pq_scores(qr, book.centroids, codes[:, :, :n])
            cand = ~kept
            cand[: s.sink] = False
            for b in range(B):
                for h in range(H):
                    problem = _rerank_problem(keep[b, h] & cand, pq[b, h], scores[b, h], cand, rerank, heavy)
                    assert problem is None, f"row {r} ({b}, {h}): {problem}"
        else:
            for b in range(B):
                for h in range(H):
                    got_scores = sorted(scores[b, h][keep[b, h]].tolist())
                    assert got_scores == sorted(scores[b, h][wanted[b, h]].tolist()), f"row {r} ({b}, {h})"
        sel = _as_selection(keep)
        ref_out = ref.sparse_decode(
            qr.double(), kn.double(), vn.double(), sel.positions, sel.counts, scale=0.25
        )
        assert_close(out[:, r], ref_out, atol=1e-5, rtol=1e-5, what=f"row {r}")
        mass += float(metrics.captured_mass(metrics.attention_probs(qr, kn, 0.25), sel).sum())
    assert ev.mass_sum / ev.mass_count == pytest.approx(mass / (B * H * E), abs=1e-5)


def test_pq_keys_score_as_pq_scores() -> None:
    ev = _tiny_evaluator(tasks.TaskSettings(sink=2, window=16, iters=2))
    k = torch.randn(1, 2, 200, 16)
    q = torch.randn(1, 4, 16)
    policy = Policy("pq", 0.1, subvectors=4, bits=4)
    ev.prefilled = tasks._Prefilled()
    approx = ev.pq_keys(0, k, 180, policy)
    book = ev.prefilled.books[(0, 4, 4, 0)]
    codes = torch.cat([book.codes, ops.encode_keys(k[:, :, 180:], book.centroids)], dim=2)
    assert_close(ref.exact_scores(q, approx), ref.pq_scores(q, book.centroids, codes), atol=1e-5, rtol=1e-5)


def _rounded_row_scores(lut_dtype: str) -> tuple:
    """(q [1, 4, 3, 16], the pq policy's row scores under lut_dtype, its codebook, the codes of
    its 200 tokens) for random keys, the first 180 prefilled."""
    ev = _tiny_evaluator(tasks.TaskSettings(sink=2, window=16, iters=2, lut_dtype=lut_dtype))
    k = torch.randn(1, 2, 200, 16) * 4
    q = torch.randn(1, 4, 3, 16) * 4
    ev.policy, ev.prefilled = Policy("pq", 0.1, subvectors=4, bits=4), tasks._Prefilled()
    got = ev.row_scores(0, k, 180)(q)
    book = ev.prefilled.books[(0, 4, 4, 0)]
    codes = torch.cat([book.codes, ops.encode_keys(k[:, :, 180:], book.centroids)], dim=2)
    return q, got, book, codes


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_rounded_lut_scores_as_pq_scores_with_that_lut(dtype: str) -> None:
    """lut_dtype: the pq policies' scores of every query row are reference.pq_scores with each LUT
    entry rounded to that dtype (and differ from the float32 sums)."""
    q, got, book, codes = _rounded_row_scores(dtype)
    # an entry may round the other way where the two float32 products differ in their last bit
    ulp = 2.0 ** -(8 if dtype == "bfloat16" else 11) * float(q.abs().max() * book.centroids.abs().max() * 4)
    for r in range(3):
        want = ref.pq_scores(q[:, :, r], book.centroids, codes, lut_dtype=getattr(torch, dtype))
        assert_close(got[:, :, r], want, atol=2 * ulp, rtol=0, what=f"row {r}")
        assert not torch.equal(got[:, :, r], ref.pq_scores(q[:, :, r], book.centroids, codes))
    with pytest.raises(ValueError, match="lut_dtype: expected one of"):
        tasks.TaskSettings(lut_dtype="int8")


@pytest.mark.parametrize("per_subquantizer", [True, False])
def test_leveled_lut_rounds_each_entry_to_its_subquantizers_levels(per_subquantizer: bool) -> None:
    """Each entry becomes lo + scale * j for an integer j in [0, 255], within half a step of the
    entry, lo its sub-quantizer's minimum (kept exactly) and scale its own range or the table's
    widest over 255; a flat sub-quantizer keeps its entries."""
    lut = torch.randn(2, 3, 4, 64, dtype=torch.float64) * torch.tensor([1.0, 4.0, 0.5, 2.0])[:, None]
    lut[1, 2, 3] = 0.75  # a flat sub-quantizer
    got = tasks.leveled_lut(lut, per_subquantizer)
    lo = lut.amin(-1, keepdim=True)
    scale = (lut.amax(-1, keepdim=True) - lo) / 255
    if not per_subquantizer:
        scale = scale.amax(-2, keepdim=True).expand_as(lo)
    step = torch.where(scale > 0, scale, torch.ones_like(scale))
    j = (got - lo) / step
    assert torch.allclose(j, j.round(), atol=1e-6) and j.min() >= 0 and j.max() <= 255 + 1e-6
    assert ((got - lut).abs() <= step / 2 + 1e-9).all()
    assert torch.equal(got.amin(-1), lut.amin(-1))
    assert torch.equal(got[1, 2, 3], lut[1, 2, 3])
    if per_subquantizer:  # every sub-quantizer spans all 256 levels
        assert torch.allclose(got.amax(-1), lut.amax(-1))
    else:  # one scale a table: narrower sub-quantizers use fewer levels
        assert (j.amax(-1) < 250).any()


def test_a_leveled_lut_scores_as_pq_scores_with_that_lut() -> None:
    """lut_dtype="uint8-m": the pq policies' scores are sums over sub-quantizers of the leveled
    LUT's entries (and differ from the float32 sums)."""
    q, got, book, codes = _rounded_row_scores("uint8-m")
    qm = q.double().reshape(1, 2, 2, 3, 4, 4)
    lut = torch.einsum("bkgrmd,bkmcd->bkgrmc", qm, book.centroids[..., :4].double())
    leveled = tasks.leveled_lut(lut, per_subquantizer=True)
    idx = codes.long().permute(0, 1, 3, 2)[:, :, None, None].expand(1, 2, 2, 3, 4, codes.shape[2])
    want = leveled.gather(-1, idx).sum(4).reshape(1, 4, 3, -1).float()
    # an entry may take the next level where the float32 and float64 products round apart
    step = float(((lut.amax(-1) - lut.amin(-1)) / 255).max())
    assert_close(got, want, atol=1.01 * step, rtol=0)
    exact = torch.stack([ref.pq_scores(q[:, :, r], book.centroids, codes) for r in range(3)], dim=2)
    assert not torch.allclose(got, exact, atol=1e-6, rtol=0)


class _Uniform:
    """An evaluator stand-in whose logits are all equal: 8 bits per byte everywhere."""

    device = torch.device("cpu")

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, 256)


def test_position_buckets() -> None:
    docs = [bytes(range(256)) * 12 + b"x" for _ in range(3)]  # T = 3072
    rows = tasks.position_bpb(_Uniform(), docs, batch=2)
    assert [(r["lo"], r["hi"]) for r in rows] == [(0, 1024), (1024, 2048), (2048, 3072)]
    assert all(r["bpb"] == pytest.approx(8.0) and r["se"] == pytest.approx(0.0) for r in rows)
    assert [r["bytes"] for r in rows] == [3 * 1023, 3 * 1024, 3 * 1025], (
        "byte t in [lo, hi), the last hi included"
    )


def test_passkey_document() -> None:
    gen = torch.Generator().manual_seed(0)
    filler = b"".join(f"line_{i} = f({i})\n".encode() for i in range(400))
    for depth in (0.0, 0.37, 0.99):
        doc, answer = tasks.passkey_document(filler, 2000, depth, gen)
        assert len(doc) == 2000 and answer == 5
        value = doc[-5:]
        name = doc[: -5 - 3].rsplit(b"\n", 1)[1]
        planted = b"\n" + name + b" = " + value + b"\n"
        assert doc.count(planted) == 1 and doc.endswith(b"\n" + name + b" = " + value)
        at = doc.index(planted) + 1
        assert at == 0 + 1 or doc[at - 2 : at - 1] == b"\n", "planted at a line start"
        assert abs(at / 2000 - depth) < 0.05
    with pytest.raises(ValueError, match="filler"):
        tasks.passkey_document(b"short\n", 2000, 0.5, gen)


@pytest.mark.parametrize("near", [0, 2])
def test_passkey_document_with_distractors(near: int) -> None:
    gen = torch.Generator().manual_seed(1)
    filler = b"".join(f"line_{i} = f({i})\n".encode() for i in range(4000))
    for depth in (0.0, 0.5, 0.99):
        doc, answer = tasks.passkey_document(filler, 30000, depth, gen, keys=8, near=near)
        assert len(doc) == 30000 and answer == 5
        value, name = doc[-5:], doc[: -5 - 3].rsplit(b"\n", 1)[1]
        planted = re.findall(rb"\n([A-Z]{8}) = (\d{5})\n", doc)
        assert len(planted) == 8 and len({n for n, _ in planted}) == 8, "eight lines, eight names"
        assert planted.count((name, value)) == 1, "the queried line once"
        at = doc.index(b"\n" + name + b" = " + value + b"\n") + 1
        assert abs(at / 30000 - depth) < 0.02
        for other, _ in planted:
            differ = sum(a != b for a, b in zip(other, name, strict=True))
            assert other == name or (differ == near if near else differ > 0)
    with pytest.raises(ValueError, match="passkey_keys"):
        tasks.TaskSettings(passkey_keys=0)
    with pytest.raises(ValueError, match="passkey_near"):
        tasks.TaskSettings(passkey_near=9)


def test_policy_names_and_grid() -> None:
    grid = policy_grid((0.01, 0.1), ((2, 6), (16, 8)))
    assert [p.name for p in grid[:6]] == [
        "dense",
        "oracle@0.01",
        "streaming@0.01",
        "pq-M2-b6@0.01",
        "pq-M16-b8@0.01",
        "pages-16@0.01",
    ]
    assert len(grid) == 1 + 2 * 5 and Policy("oracle", 0.02).heavy(1000) == 20
    with pytest.raises(ValueError, match="kind"):
        Policy("random", 0.1)
    with pytest.raises(ValueError, match="density"):
        Policy("oracle", 0.0)
    with pytest.raises(ValueError, match="window"):
        tasks.TaskSettings(window=8, page=16)


def test_cli_on_the_committed_model(tmp_path) -> None:
    out = tmp_path / "tasks.json"
    argv = ["tasks", "--model", str(MODEL), "--contexts", "1024", "--position-docs", "1"]
    argv += ["--tail-contexts", "1024", "--tail-docs", "2", "--tail-rows", "8", "--passkey-context", "1024"]
    argv += ["--passkey-buckets", "2", "--passkey-trials", "2", "--passkey-keys", "2"]
    argv += ["--densities", "0.05", "--pq", "2x4"]
    argv += ["--sink", "16", "--window", "16", "--iters", "2", "--device", "cpu", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert [(r["lo"], r["hi"]) for r in doc["positions"]] == [(0, 1024)]
    assert all(0 < r["bpb"] < 8 and math.isfinite(r["bpb"]) for r in doc["positions"])
    names = {"dense", "oracle@0.05", "streaming@0.05", "pq-M2-b4@0.05", "pages-16@0.05"}
    assert {r["policy"] for r in doc["tail"]} == names
    dense = next(r for r in doc["tail"] if r["policy"] == "dense")
    assert dense["gap"] == 0.0 and dense["gap_se"] == 0.0 and dense["mass"] == 1.0
    assert all(r["docs"] == 2 and len(r["doc_bpb"]) == 2 and r["se"] > 0 for r in doc["tail"])
    overall = {r["policy"]: r for r in doc["passkey"] if (r["depth_lo"], r["depth_hi"]) == (0.0, 1.0)}
    assert set(overall) == names and overall["dense"]["trials"] == 4
    assert all(r["keys"] == 2 and r["near"] == 2 and 0 <= r["se"] <= 0.5 for r in overall.values())
    assert overall["dense"]["accuracy"] >= 0.5, "the committed model retrieves at 1K bytes"
    assert doc["corpus"]["digest"] and doc["environment"]["transformers"]
