"""Task-level quality of sparse decoding on a local causal LM (`pqattn tasks --model PATH`).

Three measurements, on held-out documents of `pqattn.lab.corpus` (byte-level models: one token
per byte, so bits per token are bits per byte):

* positions: dense bits/byte by position bucket at each context (does the model use context?);
* tail: bits/byte of the last `tail_rows` bytes of each document under every selection policy,
  and its gap to dense attention on the same bytes;
* passkey: a line `NAME = VALUE` planted at a random depth of a document that ends with
  `NAME = `, among `passkey_keys - 1` distractor lines of the same form planted at uniform depths
  (their names differ from NAME in `passkey_near` letters, 0 for independent names); a trial is
  right when the model's greedy bytes are VALUE.

Protocol ("teacher-forced decoding"): the first P tokens of a document are prefilled with dense
attention; the last E tokens then go through the model as one chunk in which every query row at
position p attends only to what its policy selects among [0, p] (`Policy`: the exact top-k oracle,
streaming, PQ, pages). PQ indexes each layer's prefill keys and encodes the chunk's keys with
those centroids, as decoding appends them. Each layer's chunk keys and values come from the
sparse layers below, so one chunk computes exactly E decode steps with the true bytes fed back,
and a passkey trial is right under teacher forcing exactly when greedy decoding writes VALUE.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from pqattn import ops
from pqattn import reference as ref
from pqattn.lab import corpus as corpus_mod
from pqattn.lab.env import environment
from pqattn.lab.policies import PQ_GRID, Policy, from_family, policy_grid
from pqattn.lab.train import NAME_LENGTH, NAME_LETTERS, passkey_line, random_name, random_value
from pqattn.runtime.progress import Progress

NAME = "pqattn_task"
LOG2 = math.log(2.0)
POSITION_EDGES = (0, 1024, 2048, 4096, 8192, 16384, 32768)
LUT_DTYPES = ("kernel", "float32", "bfloat16", "float16", "uint8", "uint8-m")
# 8-bit LUTs (a lab measurement, not SPEC): each entry rounded to one of 256 levels from its
# sub-quantizer's minimum, of one scale a table ("uint8": the sum over sub-quantizers exact in
# integers) or of a scale a sub-quantizer ("uint8-m")
LUT_LEVELS = {"uint8": False, "uint8-m": True}


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """What `run_tasks` measures: the contexts and document counts of each part, the policy grid
    (densities, PQ configs as (M, bits), the page size, and further policy families such as
    pq-M16-b8-group-max-x4-rr2 at each density) and its sink, window and PQ build."""

    contexts: tuple[int, ...] = (8192, 16384, 32768)
    position_docs: int = 32
    tail_contexts: tuple[int, ...] = (8192, 16384, 32768)
    tail_docs: int = 64
    tail_rows: int = 128
    passkey_context: int = 32768
    passkey_buckets: int = 5
    passkey_trials: int = 100  # per depth bucket
    passkey_keys: int = 8  # planted lines per document: the queried one and its distractors
    passkey_near: int = 2  # letters in which a distractor's name differs from the queried one's
    densities: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1)
    pq_configs: tuple[tuple[int, int], ...] = PQ_GRID
    page: int = 16
    families: tuple[str, ...] = ()
    sink: int = 64
    window: int = 64
    metric: str = "euclidean"
    iters: int = 10
    seed: int = 0
    batch_tokens: int = 131072  # documents per forward: batch_tokens // context (at least 1)
    # PQ scores as the kernels take them ("kernel": a group's LUT entries rounded to
    # reference.GROUP_LUT_DTYPE, a head's exact, SPEC §2, §7), or every PQ policy's LUT entries
    # rounded to one dtype (a lab measurement; "float32": SPEC §2's sums for groups too)
    lut_dtype: str = "kernel"

    def __post_init__(self) -> None:
        if self.passkey_keys < 1:
            raise ValueError(f"passkey_keys: expected >= 1, got {self.passkey_keys}")
        if not 0 <= self.passkey_near <= NAME_LENGTH:
            raise ValueError(f"passkey_near: expected 0..{NAME_LENGTH}, got {self.passkey_near}")
        if self.lut_dtype not in LUT_DTYPES:
            raise ValueError(f"lut_dtype: expected one of {LUT_DTYPES}, got {self.lut_dtype!r}")
        if self.window < self.page:
            # page bounds are taken over whole pages of the cache: a page holding a token past a
            # query row must lie in that row's window (see PolicyEvaluator)
            raise ValueError(f"window: expected >= page={self.page}, got {self.window}")
        for family in self.families:
            from_family(family, 0.5)  # a name that names no policy fails here, before any work

    def policies(self) -> list[Policy]:
        grid = policy_grid(self.densities, self.pq_configs, self.page)
        return grid + [from_family(f, d) for d in self.densities for f in self.families]

    def batch(self, context: int) -> int:
        return max(1, self.batch_tokens // context)


class _Prefilled:
    """Per document batch: each layer's prefill keys and values, and its PQ codebooks of the
    prefill keys per (layer, M, bits, sample)."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.books: dict[tuple[int, int, int, int], ops.PQCodebook] = {}


class PolicyEvaluator:
    """Runs a model's prefill densely and its chunks under a `Policy` (see the module docstring).

    Registers the attention implementation "pqattn_task" with transformers; any call that is not a
    chunk under a sparse policy runs transformers' SDPA attention with the mask it is given.
    """

    def __init__(self, model, settings: TaskSettings) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register(NAME, _policy_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
        self.model, self.settings = model, settings
        self.policy: Policy | None = None
        self.recording = False
        self.prefilled = _Prefilled()
        self.mass_sum = 0.0
        self.mass_count = 0
        for module in model.modules():
            if getattr(module, "layer_idx", None) is not None and hasattr(module, "scaling"):
                module._pqattn_task = self
        model.set_attn_implementation(NAME)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Dense logits [B, T, V] (float32) of ids [B, T]."""
        self.policy = None
        with torch.no_grad():
            return self.model(ids, use_cache=False).logits.float()

    def prefill(self, ids: torch.Tensor) -> None:
        """Dense prefill of ids [B, P]: keeps every layer's keys and values for the chunks that
        follow, and forgets the previous batch's indexes."""
        self.policy = None
        self.prefilled = _Prefilled()
        self.recording = True
        try:
            with torch.no_grad():
                self.model(ids, use_cache=False)
        finally:
            self.recording = False

    def chunk(self, ids: torch.Tensor, policy: Policy) -> tuple[torch.Tensor, float]:
        """Logits [B, E, V] (float32) of the chunk ids [B, E] after the last prefill, under
        `policy`, and the mean share of the dense attention mass its selections kept (1.0 for
        dense). The prefill's keys and values are left as they were."""
        import transformers

        from pqattn.integrations.hf import cache_kwargs

        cache = transformers.DynamicCache(config=self.model.config)
        for layer, (k, v) in sorted(self.prefilled.kv.items()):
            cache.update(k, v, layer)
        self.policy = policy
        self.mass_sum, self.mass_count = 0.0, 0
        try:
            with torch.no_grad():
                logits = self.model(ids, use_cache=True, **cache_kwargs(self.model, cache)).logits.float()
        finally:
            self.policy = None
        mass = 1.0 if self.mass_count == 0 else self.mass_sum / self.mass_count
        return logits, mass

    def _codebook(self, layer: int, keys: torch.Tensor, prefill: int, policy: Policy) -> ops.PQCodebook:
        s = self.settings
        key = (layer, policy.subvectors, policy.bits, policy.sample)
        book = self.prefilled.books.get(key)
        if book is None:
            book = ops.build_index(
                keys[:, :, :prefill].contiguous(),
                subvectors=policy.subvectors,
                bits=policy.bits,
                metric=s.metric,
                init_offset=s.sink,
                iters=s.iters,
                seed=s.seed,
                sample=policy.sample,
            )
            self.prefilled.books[key] = book
        return book

    def pq_codes(self, layer: int, keys: torch.Tensor, prefill: int, policy: Policy) -> tuple:
        """(the prefill's codebook, the codes of every key [B, Hkv, T, M]): prefill keys carry the
        build's codes, later keys are encoded (appended)."""
        book = self._codebook(layer, keys, prefill, policy)
        new = ops.encode_keys(keys[:, :, prefill:], book.centroids, book.phi, metric=self.settings.metric)
        return book, torch.cat([book.codes, new], dim=2)

    def pq_keys(self, layer: int, keys: torch.Tensor, prefill: int, policy: Policy) -> torch.Tensor:
        """The keys as their PQ reconstruction [B, Hkv, T, D] (float32): <q, k_hat_j> is SPEC §2's
        score s_j."""
        book, codes = self.pq_codes(layer, keys, prefill, policy)
        B, Hkv, T, M = codes.shape
        dsub = keys.shape[-1] // M
        cents = book.centroids[..., :dsub].float()  # [B, Hkv, M, C, dsub]
        idx = codes.long().permute(0, 1, 3, 2)[..., None].expand(B, Hkv, M, T, dsub)
        return cents.gather(3, idx).permute(0, 1, 3, 2, 4).reshape(B, Hkv, T, M * dsub)

    def row_scores(self, layer: int, k: torch.Tensor, prefill: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The current policy's token scores for query rows: q [B, H, R, D] -> [B, H, R, T] over the
        keys k [B, Hkv, T, D] (the first `prefill` indexed by PQ, the rest appended); a group PQ
        policy's group scores [B, Hkv, R, T] under lut_dtype="kernel"."""
        pol = self.policy
        B, Hkv, T, D = k.shape
        if pol.kind in ("oracle", "streaming"):
            keys = k.float()
        elif pol.kind == "pq" and self.settings.lut_dtype == "kernel" and pol.share == "group":
            book, codes = self.pq_codes(layer, k, prefill, pol)
            return rounded_lut_scores(book.centroids, codes, ref.GROUP_LUT_DTYPE, group_rule=pol.group_rule)
        elif pol.kind == "pq" and self.settings.lut_dtype not in ("kernel", "float32"):
            book, codes = self.pq_codes(layer, k, prefill, pol)
            name = self.settings.lut_dtype
            dtype = name if name in LUT_LEVELS else getattr(torch, name)
            return rounded_lut_scores(book.centroids, codes, dtype)
        elif pol.kind == "pq":
            keys = self.pq_keys(layer, k, prefill, pol)
        else:
            # whole pages of the cache: a page holding a token past row p also holds tokens of p's
            # window (window >= page), so it has no candidate of p and its bound is never used
            if pol.page > self.settings.window:
                raise ValueError(
                    f"policy: expected a page of at most window={self.settings.window}, got {pol.page}"
                )
            kmin, kmax = ref.page_bounds(k, torch.full((B,), T, device=k.device), pol.page)
            return lambda q: ref.page_scores(q.float(), kmin, kmax, pol.page, T)

        def scores(q: torch.Tensor) -> torch.Tensor:
            H, R = q.shape[1], q.shape[2]
            qg = q.float().reshape(B, Hkv, H // Hkv, R, D)
            return torch.einsum("bkgrd,bktd->bkgrt", qg, keys).reshape(B, H, R, T)

        return scores

    def row_keep(
        self,
        scores: torch.Tensor,
        lengths: torch.Tensor,
        prefill: int,
        exact: torch.Tensor | None = None,
        kv_heads: int | None = None,
    ) -> torch.Tensor:
        """What the current policy keeps for query rows that see lengths [R] tokens, given their
        scores [B, H, R, T] or a group's [B, Hkv, R, T] (`row_scores`; then with exact), the
        exact scores <q, k> [B, H, R, T] (read by a re-rank), and for a group selection the
        cache's kv_heads: a mask [B, H, R, T] (heavy = round(density * prefill), times the budget
        for a group; SPEC §7)."""
        s, pol = self.settings, self.policy
        B, R, T = scores.shape[0], scores.shape[2], scores.shape[3]
        H = exact.shape[1] if exact is not None else scores.shape[1]
        heavy = pol.selection_heavy(prefill)
        flat_lengths = lengths.repeat(B)  # rows flattened as (b, r)
        if pol.kind == "streaming":
            sel = ref.select_streaming(flat_lengths, H, sink=s.sink, window=s.window + heavy)
            return ref.dense_weights(sel, T).reshape(B, R, H, T).permute(0, 2, 1, 3) > 0
        if pol.share == "group" and kv_heads is None:
            raise ValueError(f"kv_heads: the {pol.family} policy selects per KV head, got None")
        hkv = kv_heads if pol.share == "group" else H
        if scores.shape[1] not in (H, hkv):
            raise ValueError(f"scores: expected {H} heads or {hkv} groups, got {scores.shape[1]}")

        def rows(x: torch.Tensor) -> torch.Tensor:  # [B * R, H or Hkv, T], reduced over groups
            flat = x.permute(0, 2, 1, 3).reshape(B * R, x.shape[1], T)
            reduce = pol.share == "group" and x.shape[1] != hkv
            return ref.group_scores(flat, hkv, pol.group_rule) if reduce else flat

        sizes = dict(sink=s.sink, window=s.window, init_offset=s.sink)
        sel = ref.select_from_scores(rows(scores), flat_lengths, heavy=max(pol.rerank, 1) * heavy, **sizes)
        if pol.rerank:
            if exact is None:
                raise ValueError(f"exact: the {pol.family} policy re-ranks by the exact scores, got None")
            allowed = ref.dense_weights(sel, T) > 0
            sel = ref.select_from_scores(rows(exact), flat_lengths, heavy=heavy, allowed=allowed, **sizes)
        keep = ref.dense_weights(sel, T) > 0  # [B * R, rows, T]
        keep = keep.repeat_interleave(H // keep.shape[1], dim=1)
        return keep.reshape(B, R, H, T).permute(0, 2, 1, 3)

    def sparse_rows(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Attention of the chunk's query rows q [B, H, E, D] over k/v [B, Hkv, T, D] under the
        current policy; returns [B, E, H, D] in q's dtype."""
        B, H, E, D = q.shape
        Hkv, T = k.shape[1], k.shape[2]
        g, prefill = H // Hkv, T - E
        score_rows = self.row_scores(layer, k, prefill)
        kf, vf = eight_bit(k, v) if self.policy.kv8 else (k.float(), v.float())
        out = torch.empty(B, E, H, D, dtype=q.dtype, device=q.device)
        rows = max(1, (1 << 26) // max(1, B * H * T))
        pos = torch.arange(T, device=q.device)
        for r0 in range(0, E, rows):
            R = min(rows, E - r0)
            qr = q[:, :, r0 : r0 + R]
            n = prefill + r0 + 1 + torch.arange(R, device=q.device)  # tokens row r sees
            qg = qr.float().reshape(B, Hkv, g, R, D)
            exact = torch.einsum("bkgrd,bktd->bkgrt", qg, kf).reshape(B, H, R, T)
            keep = self.row_keep(score_rows(qr), n, prefill, exact, Hkv)
            logits = exact * scale
            dense_p = logits.masked_fill(~(pos[None, :] < n[:, None]), float("-inf")).softmax(-1)
            self.mass_sum += float((dense_p * keep).sum(-1).sum())
            self.mass_count += B * H * R
            p = logits.masked_fill(~keep, float("-inf")).softmax(-1).reshape(B, Hkv, g, R, T)
            o = torch.einsum("bkgrt,bktd->bkgrd", p, vf).reshape(B, H, R, D)
            out[:, r0 : r0 + R] = o.transpose(1, 2).to(q.dtype)
        return out


def leveled_lut(lut: torch.Tensor, per_subquantizer: bool, levels: int = 255) -> torch.Tensor:
    """lut [..., M, C] with each entry rounded to one of levels + 1 values, lo + scale *
    round((entry - lo) / scale) with lo its sub-quantizer's minimum and scale that sub-quantizer's
    range over `levels` (per_subquantizer) or the widest of the table's M ranges over `levels`; a
    flat range keeps lo."""
    lo = lut.amin(-1, keepdim=True)
    scale = (lut.amax(-1, keepdim=True) - lo) / levels
    if not per_subquantizer:
        scale = scale.amax(-2, keepdim=True)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return lo + torch.round((lut - lo) / safe) * scale


def rounded_lut_scores(
    centroids: torch.Tensor, codes: torch.Tensor, dtype: torch.dtype | str, group_rule: str | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """PQ scores from LUTs whose entries <q_m, centroid> are rounded to `dtype` (or leveled as the
    LUT_LEVELS name `dtype` says, `leveled_lut`) before the sum over sub-quantizers
    (`reference.pq_scores(lut_dtype=)` for many query rows): centroids [B, Hkv, M, C, dsub(+1)],
    codes [B, Hkv, T, M]; q [B, H, R, D] -> [B, H, R, T] float32, or with a group_rule the group
    scores [B, Hkv, R, T] as `reference.group_pq_scores` takes them (the summed query's LUT for
    "sum", the max of the heads' scores for "max")."""
    B, Hkv, T, M = codes.shape
    cents = centroids.float()

    def scores(q: torch.Tensor) -> torch.Tensor:
        H, R, D = q.shape[1], q.shape[2], q.shape[3]
        qm = q.float().reshape(B, Hkv, H // Hkv, R, M, D // M)
        if group_rule == "sum":
            qm = qm.sum(2, keepdim=True)
        g = qm.shape[2]
        lut = torch.einsum("bkgrmd,bkmcd->bkgrmc", qm, cents[..., : D // M])
        lut = leveled_lut(lut, LUT_LEVELS[dtype]) if isinstance(dtype, str) else lut.to(dtype).float()
        out = torch.zeros(B, Hkv, g, R, T, device=q.device)
        for m in range(M):
            idx = codes[:, :, None, None, :, m].long().expand(B, Hkv, g, R, T)
            out += lut[..., m, :].gather(-1, idx)
        if group_rule is None:
            return out.reshape(B, H, R, T)
        return out.amax(2) if group_rule == "max" else out[:, :, 0]

    return scores


def eight_bit(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [..., D] as the host tier's 8-bit rows give them back (float32)."""
    return ref.decode_rows(ref.encode_rows(k, v, torch.uint8), k.shape[-1])


def _policy_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ev: PolicyEvaluator | None = getattr(module, "_pqattn_task", None)
    if ev is not None and ev.recording:
        ev.prefilled.kv[module.layer_idx] = (key, value)
    if ev is None or ev.policy is None or ev.policy.kind == "dense":
        if ev is not None and ev.policy is not None and ev.policy.kv8:
            key, value = (x.to(key.dtype) for x in eight_bit(key, value))
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else scaling
    return ev.sparse_rows(module.layer_idx, query, key, value, scale), None


# ---- measurements ------------------------------------------------------------------------------


def _ids(docs: Sequence[bytes], device: torch.device) -> torch.Tensor:
    return torch.stack([torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in docs]).long().to(device)


def _nll_bits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Bits per target byte, [B, T] from logits [B, T, V] and targets [B, T]."""
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return nll.reshape(targets.shape) / LOG2


def position_bpb(
    ev: PolicyEvaluator, docs: Sequence[bytes], batch: int, tick: Callable[[int], None] | None = None
) -> list[dict]:
    """Dense bits/byte by position bucket over documents of T + 1 bytes: byte t (1 <= t <= T) is
    predicted from bytes [0, t) and counts in the bucket [lo, hi) of POSITION_EDGES holding t (the
    last bucket also holds t = T). Per bucket: the mean over its bytes, and the standard error of
    the per-document means (documents differ far more than bytes within one)."""
    T = len(docs[0]) - 1
    edges = [e for e in POSITION_EDGES if e < T] + [T]
    t = torch.arange(1, T + 1)
    bucket = torch.bucketize(t, torch.tensor(edges[1:-1]), right=True)
    width = torch.bincount(bucket, minlength=len(edges) - 1).double()
    per_doc = []  # [docs, buckets] mean bits per byte of each document in each bucket
    for i in range(0, len(docs), batch):
        ids = _ids(docs[i : i + batch], ev.device)
        bits = _nll_bits(ev.logits(ids[:, :-1]), ids[:, 1:]).double().cpu()
        sums = torch.zeros(ids.shape[0], len(edges) - 1, dtype=torch.float64).index_add_(1, bucket, bits)
        per_doc.append(sums / width)
        if tick:
            tick(i + ids.shape[0])
    means = torch.cat(per_doc)
    n = means.shape[0]
    se = means.std(0) / math.sqrt(n) if n > 1 else None
    return [
        {
            "context": T,
            "lo": edges[j],
            "hi": edges[j + 1],
            "bpb": float(means[:, j].mean()),
            "se": None if se is None else float(se[j]),
            "bytes": int(width[j]) * n,
        }
        for j in range(len(edges) - 1)
    ]


def tail_bpb(
    ev: PolicyEvaluator,
    docs: Sequence[bytes],
    policies: Sequence[Policy],
    rows: int,
    batch: int,
    tick: Callable[[int], None] | None = None,
) -> list[dict]:
    """Bits/byte of the last `rows` bytes of documents of T + 1 bytes, per policy (the first T - rows
    bytes prefilled densely), with the gap to dense on the same bytes and the attention mass kept.
    Standard errors over documents: `se` of the bits/byte, `gap_se` of the paired gap to dense;
    `doc_bpb` keeps each document's bits/byte, for paired comparisons between policies."""
    T = len(docs[0]) - 1
    per_doc: dict[str, list[float]] = {p.name: [] for p in policies}
    mass = {p.name: 0.0 for p in policies}
    dense_doc: list[float] = []
    for i in range(0, len(docs), batch):
        ids = _ids(docs[i : i + batch], ev.device)
        ev.prefill(ids[:, : T - rows])
        chunk, targets = ids[:, T - rows : T], ids[:, T - rows + 1 :]
        dense_logits, _ = ev.chunk(chunk, Policy("dense"))
        dense_doc += _nll_bits(dense_logits, targets).double().mean(-1).tolist()
        for p in policies:
            plain = p.kind == "dense" and not p.kv8
            logits, kept = (dense_logits, 1.0) if plain else ev.chunk(chunk, p)
            per_doc[p.name] += _nll_bits(logits, targets).double().mean(-1).tolist()
            mass[p.name] += kept * ids.shape[0]
        if tick:
            tick(i + ids.shape[0])
    n_docs = len(dense_doc)
    dense = torch.tensor(dense_doc, dtype=torch.float64)

    def se(x: torch.Tensor) -> float | None:
        return float(x.std() / math.sqrt(n_docs)) if n_docs > 1 else None

    out = []
    for p in policies:
        bpb = torch.tensor(per_doc[p.name], dtype=torch.float64)
        out.append(
            _policy_row(p)
            | {
                "context": T,
                "rows": rows,
                "docs": n_docs,
                "heavy": 0 if p.kind == "dense" else p.heavy(T - rows),
                "bpb": float(bpb.mean()),
                "se": se(bpb),
                "gap": float((bpb - dense).mean()),
                "gap_se": se(bpb - dense),
                "gap_rel": float((bpb - dense).mean() / dense.mean()),
                "mass": mass[p.name] / n_docs,
                "doc_bpb": per_doc[p.name],
            }
        )
    return out


def _policy_row(p: Policy) -> dict:
    return {
        "policy": p.name,
        "family": p.family,
        "kind": p.kind,
        "density": p.density,
        "subvectors": p.subvectors if p.kind == "pq" else None,
        "bits": p.bits if p.kind == "pq" else None,
        "kv8": p.kv8,
    }


def passkey_document(
    filler: bytes,
    length: int,
    depth: float,
    gen: torch.Generator,
    *,
    keys: int = 1,
    near: int = 0,
) -> tuple[bytes, int]:
    """A document of `length` bytes: `filler` with the line `NAME = VALUE` planted at the line
    start nearest below `depth` (a share of the document) and `keys - 1` distractor lines of the
    same form at uniform depths, ending in `NAME = VALUE`; returns it and len(VALUE). A
    distractor's name differs from NAME in `near` random letters (0: an independent name)."""
    name, value = random_name(gen), random_value(gen)
    lines = [(depth, passkey_line(name, value))]
    names = {name}
    while len(lines) < keys:
        other = _near_name(name, near, gen) if near else random_name(gen)
        if other not in names:
            names.add(other)
            lines.append((float(torch.rand((), generator=gen)), passkey_line(other, random_value(gen))))
    query = b"\n" + name + b" = "
    body_len = length - sum(len(line) for _, line in lines) - len(query) - len(value)
    if len(filler) < body_len:
        raise ValueError(f"filler: expected at least {body_len} bytes, got {len(filler)}")
    body = filler[:body_len]
    # the cuts at line starts, planted from the deepest so earlier cuts keep their offsets
    cuts = [(body.rfind(b"\n", 0, max(1, int(d * body_len))) + 1, i) for i, (d, _) in enumerate(lines)]
    for cut, i in sorted(cuts, reverse=True):
        body = body[:cut] + lines[i][1] + body[cut:]
    return body + query + value, len(value)


def _near_name(name: bytes, letters: int, gen: torch.Generator) -> bytes:
    """`name` with `letters` of its positions changed to other letters."""
    out = bytearray(name)
    for i in torch.randperm(len(name), generator=gen)[:letters].tolist():
        shift = int(torch.randint(1, len(NAME_LETTERS), (), generator=gen))
        out[i] = NAME_LETTERS[(NAME_LETTERS.index(out[i]) + shift) % len(NAME_LETTERS)]
    return bytes(out)


def passkey(
    ev: PolicyEvaluator,
    fillers: Sequence[bytes],
    policies: Sequence[Policy],
    *,
    length: int,
    buckets: int,
    trials: int,
    batch: int,
    seed: int,
    keys: int = 1,
    near: int = 0,
    tick: Callable[[int], None] | None = None,
) -> list[dict]:
    """Passkey accuracy per policy and depth bucket (`trials` per bucket) with its binomial
    standard error; the queried line's depth is uniform within its bucket, its distractors'
    (`passkey_document`) anywhere, the filler documents are used in turn."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for b in range(buckets):
        for _ in range(trials):
            depth = (b + float(torch.rand((), generator=gen))) / buckets
            filler = fillers[len(cases) % len(fillers)]
            doc, answer = passkey_document(filler, length, depth, gen, keys=keys, near=near)
            cases.append((b, doc, answer))
    answer = cases[0][2]  # every value has 5 digits
    right = {p.name: torch.zeros(buckets) for p in policies}
    for i in range(0, len(cases), batch):
        part = cases[i : i + batch]
        ids = _ids([c[1] for c in part], ev.device)
        where = torch.tensor([c[0] for c in part])
        ev.prefill(ids[:, : length - answer - 1])
        chunk, targets = ids[:, length - answer - 1 : length - 1], ids[:, length - answer :]
        for p in policies:
            logits, _ = ev.chunk(chunk, p)
            ok = (logits.argmax(-1) == targets).all(-1).cpu().float()
            right[p.name].index_add_(0, where, ok)
        if tick:
            tick(i + len(part))
    rows = []
    for p in policies:
        form = (p, length, keys, near)
        for b in range(buckets):
            rows.append(_passkey_row(*form, b / buckets, (b + 1) / buckets, right[p.name][b], trials))
        rows.append(_passkey_row(*form, 0.0, 1.0, right[p.name].sum(), trials * buckets))
    return rows


def _passkey_row(
    p: Policy, length: int, keys: int, near: int, lo: float, hi: float, right: torch.Tensor, trials: int
) -> dict:
    """One depth span's accuracy and its binomial standard error."""
    acc = float(right) / trials
    return _policy_row(p) | {
        "context": length,
        "keys": keys,
        "near": near,
        "depth_lo": lo,
        "depth_hi": hi,
        "trials": trials,
        "accuracy": acc,
        "se": math.sqrt(acc * (1 - acc) / trials),
    }


def load_model(path: str, device: torch.device):
    """A local causal LM in eval mode: bf16 on CUDA, float32 on the CPU."""
    import os

    import transformers

    if not os.path.isdir(path):
        raise ValueError(
            f"model: expected a folder holding a transformers model, got {path!r} (no such folder)"
        )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    return model.to(device).eval()


def run_tasks(
    model_path: str,
    settings: TaskSettings,
    *,
    device: torch.device,
    corpus: corpus_mod.Corpus | None = None,
    parts: Sequence[str] = ("positions", "passkey", "tail"),
    log: Callable[[str], None] = print,
    on_part: Callable[[dict], None] | None = None,
) -> dict:
    """The measurements of `parts`, in that order, on held-out documents; returns the JSON-ready
    results document (also handed to `on_part` as parts finish, e.g. to save what is done)."""
    import transformers

    s = settings
    corpus = corpus or corpus_mod.find_corpus()
    model = load_model(model_path, device)
    ev = PolicyEvaluator(model, s)
    policies = s.policies()
    doc: dict = {
        "model": model_path,
        "settings": dataclasses.asdict(s),
        "corpus": corpus.summary(),
        "environment": environment(device) | {"transformers": transformers.__version__},
    }
    for part in parts:
        if part == "positions":
            doc["positions"] = []
            for T in s.contexts:
                docs = corpus_mod.documents(corpus.held_out, T + 1, s.position_docs)
                if not docs:
                    log(f"positions: no held-out document of {T + 1} bytes")
                    continue
                with Progress(f"tasks: positions at {T}", len(docs)) as tick:
                    doc["positions"] += position_bpb(ev, docs, s.batch(T), tick)
                log(f"positions at {T}: {len(docs)} documents")
        elif part == "tail":
            doc["tail"] = []
            for T in s.tail_contexts:
                docs = corpus_mod.documents(corpus.held_out, T + 1, s.tail_docs)
                if not docs:
                    log(f"tail: no held-out document of {T + 1} bytes")
                    continue
                with Progress(f"tasks: tail at {T}, {len(policies)} policies", len(docs)) as tick:
                    doc["tail"] += tail_bpb(ev, docs, policies, s.tail_rows, s.batch(T), tick)
                log(f"tail at {T}: {len(docs)} documents, {len(policies)} policies")
                if on_part:
                    on_part(doc)
        elif part == "passkey":
            T = s.passkey_context
            fillers = corpus_mod.documents(corpus.held_out, T, s.passkey_buckets * s.passkey_trials)
            if not fillers:
                raise ValueError(f"corpus: no held-out document of {T} bytes for the passkey task")
            with Progress(f"tasks: passkey at {T}", s.passkey_buckets * s.passkey_trials) as tick:
                doc["passkey"] = passkey(
                    ev,
                    fillers,
                    policies,
                    length=T,
                    buckets=s.passkey_buckets,
                    trials=s.passkey_trials,
                    batch=s.batch(T),
                    seed=s.seed,
                    keys=s.passkey_keys,
                    near=s.passkey_near,
                    tick=tick,
                )
            log(f"passkey at {T}, {s.passkey_keys} keys: {s.passkey_buckets * s.passkey_trials} trials")
        else:
            raise ValueError(f"parts: expected positions, tail or passkey, got {part!r}")
        if on_part:
            on_part(doc)
    return doc


def format_tables(doc: dict) -> str:
    """Position buckets, then tail gap / passkey accuracy / mass per policy."""
    lines = []
    if doc.get("positions"):
        lines.append(f"{'context':>8} {'positions':>13} {'bits/byte':>10}")
        for r in doc["positions"]:
            lines.append(f"{r['context']:>8} {r['lo']:>6}-{r['hi']:<6} {r['bpb']:>10.3f}")
    tail = {(r["context"], r["policy"]): r for r in doc.get("tail", [])}
    keys = {r["policy"]: r for r in doc.get("passkey", []) if r["depth_lo"] == 0.0 and r["depth_hi"] == 1.0}
    contexts = sorted({c for c, _ in tail})
    names = list(dict.fromkeys([p for _, p in tail] + list(keys)))
    if names:
        head = f"{'policy':<22}" + "".join(f" {'gap@' + str(c):>11} {'mass@' + str(c):>11}" for c in contexts)
        lines.append(head + f" {'passkey':>8}")
        for name in names:
            cells = "".join(
                f" {tail[(c, name)]['gap']:>11.4f} {tail[(c, name)]['mass']:>11.3f}"
                if (c, name) in tail
                else " " * 24
                for c in contexts
            )
            acc = f" {keys[name]['accuracy']:>8.3f}" if name in keys else ""
            lines.append(f"{name:<22}{cells}{acc}")
    return "\n".join(lines)
