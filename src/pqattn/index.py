"""`PQIndex`: the per-layer decode state (centroids, codes, lengths) and its operations."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pqattn import _validate as check
from pqattn import dispatch, ops
from pqattn.dispatch import AppendedKey, PQCodebook
from pqattn.policy import SelectPolicy, clamp_row_heavy
from pqattn.reference import Selection, SelectParams
from pqattn.runtime.launch import PlanCache, recording, signature

_MAX_PLANS = 16  # plans an index keeps (the least recently used goes first)
DEFAULT_SAMPLE = 16  # keys per centroid of a euclidean build (docs/kernels/kmeans.md)


_PAGED_RERANK = (
    "block_table: a config that re-ranks reads contiguous keys in PQIndex.select; pass a selection "
    "(select_topk(..., keys=k_cache, block_table=block_table) re-ranks paged keys)"
)


@dataclass(frozen=True)
class PQConfig(SelectPolicy):
    """What to quantize, and what to select (the `SelectPolicy` fields: sink, window, heavy in
    tokens per query head, share, group_rule, group_budget, rerank; their defaults are the
    measured operating point, one selection per KV head by the max of its G heads' PQ scores,
    keeping G per-head heavies).

    subvectors (M) and bits (C = 2**bits centroids per sub-vector) shape the index, M=16 of 8
    bits by default (docs/kernels/select.md, "The defaults"); init_offset (default: sink) is the
    first quantized token; iters / tol / seed drive the k-means build, on a strided sample of
    `sample` keys per centroid (None: 16 for euclidean, every key for ip; 0: every key).
    """

    subvectors: int = 16
    bits: int = 8
    metric: str = "euclidean"
    init_offset: int | None = None
    iters: int = 10
    tol: float = 1e-4
    seed: int = 0
    sample: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check.positive_int("subvectors", self.subvectors)
        check.build_sample(self.sample, self.metric)
        check.bits(self.bits)
        check.metric(self.metric)
        check.non_negative_int("iters", self.iters)
        if self.init_offset is not None:
            check.non_negative_int("init_offset", self.init_offset)
        if not isinstance(self.tol, (int, float)) or self.tol < 0:
            raise ValueError(f"tol: expected a non-negative float, got {self.tol!r}")

    @property
    def offset(self) -> int:
        """The first quantized position (init_offset, or sink when unset)."""
        return self.sink if self.init_offset is None else self.init_offset

    @property
    def keys_per_centroid(self) -> int:
        """The build's sample in keys per centroid (0: every key), `sample` resolved for the metric."""
        if self.sample is not None:
            return self.sample
        return DEFAULT_SAMPLE if self.metric == "euclidean" else 0


class PQIndex:
    """PQ index of one layer's key cache for a batch of sequences.

    Owns centroids [B, Hkv, M, C, dsub(+1)], codes [B, Hkv, capacity, M] uint8, phi [B, Hkv, M]
    (ip only) and lengths [B] (tokens per sequence, ragged allowed). The keys and values
    themselves stay in the caller's cache, [B, Hkv, >= max length, D].

    Typical use::

        index = PQIndex.build(k_prefill, lengths, capacity=max_tokens, config=PQConfig(heavy=256))
        for step in ...:
            index.append(k_new)                 # [B, Hkv, 1, D], written at each sequence's end
            out = index.attend(q, k_cache, v_cache)   # select + sparse attention, [B, H, D]

    The host keeps the longest length, so `append` checks capacity without a device sync. On a
    GPU, `append` is one encode launch that writes codes at each sequence's length and advances
    the lengths, and `select` the selection launches into buffers the index owns (allocated at
    the first call for a head count): the steady state allocates nothing and can be captured in a
    CUDA graph. The Selection that `select` returns is that buffer: it is overwritten by the next
    call. With at most 4096 code combinations the index also keeps, on a GPU, how many candidate
    tokens carry each and the candidates grouped by combination (pqattn.kernels.select.buckets:
    4 bytes per token and KV head), so that `select` reads about `heavy` positions per row
    instead of every code. Change `codes` and `lengths` only through `append`. Tokens appended
    after the grouping are scanned; `append` and `decode_step` regroup (`reindex`) once the
    longest sequence has grown by REINDEX_AFTER tokens since. Replays of a captured graph do not
    run that host check: call `sync_lengths()` (which regroups when due) or `reindex()` between
    replays now and then.

    Eager calls: once a method has run for inputs of some shapes, strides, dtypes and alignment,
    the index keeps its launches as a `pqattn.runtime.launch.Plan` and later calls with inputs of
    that signature replay them (no argument checks beyond the signature, no Triton dispatch).
    """

    # Appended tokens after which the buckets are rebuilt. A rebuild is two passes over the codes
    # (count, place) and the recent tokens cost every selection a scan of their codes; this
    # balances the two (docs/kernels/launch.md).
    REINDEX_AFTER = 2048

    def __init__(
        self,
        config: PQConfig,
        *,
        batch: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        check.positive_int("batch", batch)
        check.positive_int("kv_heads", kv_heads)
        check.positive_int("head_dim", head_dim)
        check.positive_int("capacity", capacity)
        check.subvectors(config.subvectors, head_dim)
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype: expected float32/float64 for the centroids, got {dtype}")
        self.config = config
        self.batch, self.kv_heads, self.head_dim, self.capacity = batch, kv_heads, head_dim, capacity
        self.device = torch.device(device)
        M, C = config.subvectors, 1 << config.bits
        dsub = head_dim // M + (config.metric == "ip")
        self.centroids = torch.zeros((batch, kv_heads, M, C, dsub), dtype=dtype, device=self.device)
        self.codes = torch.zeros((batch, kv_heads, capacity, M), dtype=torch.uint8, device=self.device)
        self.phi = (
            torch.zeros((batch, kv_heads, M), dtype=dtype, device=self.device)
            if config.metric == "ip"
            else None
        )
        self.lengths = torch.zeros((batch,), dtype=torch.int64, device=self.device)
        self._max_length = 0
        # Histogram selection (dispatch.uses_histogram) on the kernel path: the combination counts of
        # the candidate tokens [max(offset, sink), length - window), kept current by `append`.
        self._hist: torch.Tensor | None = None
        # with it, the candidates grouped by combination (order, starts, frozen), the counting
        # cursor that builds them, and the host's longest length when they were built
        self._buckets: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._cursor: torch.Tensor | None = None
        self._bucketed_at = 0
        self._selection: Selection | None = None  # decode-step output buffers (kernel path)
        self._selection_heads = 0  # the query heads they serve
        self._workspace: torch.Tensor | None = None
        self._attn_out: torch.Tensor | None = None  # decode_step output and attention workspace
        self._attn_workspace: torch.Tensor | None = None
        self._attn_layout: tuple[int, int, int, int] | None = None
        # the encode launch's arrival counters per sequence: its last program advances the length
        self._arrivals = torch.zeros((batch,), dtype=torch.int32, device=self.device)
        # recorded launches per (method, input signature): valid while the buffers above are
        self._plans = PlanCache(_MAX_PLANS)
        self._paged_checked: set[tuple] = set()  # signatures of paged caches whose table was checked

    @classmethod
    def build(
        cls,
        keys: torch.Tensor,
        lengths: torch.Tensor | list[int] | None = None,
        *,
        capacity: int | None = None,
        config: PQConfig | None = None,
        head_offset: int = 0,
        total_heads: int | None = None,
    ) -> PQIndex:
        """Index the prefill keys of a batch (k-means per sequence, KV head and sub-vector).

        Args:
            keys: [B, Hkv, N, D] float (the prefill keys; the caller keeps the cache).
            lengths: [B] valid tokens per sequence (tensor or list), None for N each.
            capacity: tokens the index can hold, N by default (give room for the decode steps).
            config: what to quantize and what to select (PQConfig() by default).
            head_offset, total_heads: the keys are KV heads head_offset.. of a cache of
                total_heads (a tensor-parallel rank's share): built as `build_index` builds them.

        Returns:
            the PQIndex.

        Example:
            >>> config = PQConfig(subvectors=4, bits=4, sink=4, window=8, heavy=16, iters=2)
            >>> index = PQIndex.build(torch.randn(1, 2, 256, 16), [200], capacity=260, config=config)
            >>> index.lengths.tolist(), index.codes.shape
            ([200], torch.Size([1, 2, 260, 4]))
        """
        config = config or PQConfig()
        check.key_cache("keys", keys)
        B, _, N, D = keys.shape
        capacity = N if capacity is None else capacity
        check.positive_int("capacity", capacity)
        if capacity < N:
            raise ValueError(f"capacity: expected >= the prefill length N={N}, got {capacity}")
        lens = check.lengths(lengths, B, N, keys.device)
        check.subvectors(config.subvectors, D)
        check.kv_head_share(head_offset, total_heads, keys.shape[1])
        c = config
        built = dispatch.build(
            keys, lens, c.subvectors, c.bits, c.metric, c.offset, c.iters, c.tol, c.seed, c.keys_per_centroid,
            head_offset, total_heads,
        )  # fmt: skip
        return cls._filled(config, built, lens, capacity, D)

    @classmethod
    def from_codebook(
        cls,
        book: PQCodebook,
        lengths: torch.Tensor | list[int] | None = None,
        *,
        capacity: int | None = None,
        config: PQConfig | None = None,
    ) -> PQIndex:
        """An index over a codebook built elsewhere (`build_index`, a saved one).

        Args:
            book: PQCodebook(centroids [B, Hkv, M, C, dsub (+1)], codes [B, Hkv, N, M] uint8, phi
                for ip); the head dim comes from the centroids.
            lengths: [B] valid tokens per sequence, None for N each.
            capacity: tokens the index can hold, N by default.
            config: must match the codebook's M, C and metric.

        Returns:
            the PQIndex.
        """
        config = config or PQConfig()
        B, Hkv, M, C, width = book.centroids.shape
        N = book.codes.shape[2]
        ip = book.phi is not None
        D = M * (width - ip)
        if (M, C, ip) != (config.subvectors, 1 << config.bits, config.metric == "ip"):
            raise ValueError(
                f"book: expected M={config.subvectors}, C={1 << config.bits}, metric={config.metric} "
                f"(config), got M={M}, C={C}, metric={'ip' if ip else 'euclidean'}"
            )
        check.tensor(
            "book.codes", book.codes, shape=(B, Hkv, N, M), dims="[B, Hkv, N, M]", dtypes=(torch.uint8,)
        )
        capacity = N if capacity is None else capacity
        check.positive_int("capacity", capacity)
        if capacity < N:
            raise ValueError(f"capacity: expected >= the codebook's N={N}, got {capacity}")
        lens = check.lengths(lengths, B, N, book.codes.device)
        return cls._filled(config, book, lens, capacity, D)

    @classmethod
    def _filled(
        cls, config: PQConfig, book: PQCodebook, lens: torch.Tensor, capacity: int, head_dim: int
    ) -> PQIndex:
        """A new index holding `book` (validated) for sequences of lengths `lens`."""
        B, Hkv, N = book.codes.shape[:3]
        index = cls(
            config,
            batch=B,
            kv_heads=Hkv,
            head_dim=head_dim,
            capacity=capacity,
            device=book.codes.device,
            dtype=book.centroids.dtype,
        )
        index.centroids.copy_(book.centroids)
        index.codes[:, :, :N].copy_(book.codes)
        if book.phi is not None:
            index.phi.copy_(book.phi)
        index.lengths.copy_(lens)
        index._max_length = int(lens.max()) if B else 0
        index._count_combos()
        return index

    @property
    def _cand_lo(self) -> int:
        return max(self.config.offset, self.config.sink)

    def _count_combos(self) -> None:
        """(Re)count the histogram that the histogram selection reads, on the kernel path."""
        M, C = self.config.subvectors, 1 << self.config.bits
        probe = torch.empty(0, self.head_dim, device=self.device)
        if not (
            dispatch.kernel_path(probe, self.centroids)
            and dispatch.uses_histogram(M, C)
            and self.config.share == "head"
        ):
            return
        self._plans.forget(self._hist, self._cursor, *(self._buckets or ()))
        B, Hkv, P = self.batch, self.kv_heads, C**M
        self._hist = torch.zeros((B, Hkv, P), dtype=torch.int32, device=self.device)
        dispatch.count_combos(
            self.codes, self.lengths, self._hist, C=C, window=self.config.window, cand_lo=self._cand_lo
        )
        self._buckets = (
            torch.empty((B, Hkv, self.capacity), dtype=torch.int32, device=self.device),
            torch.empty((B, Hkv, P + 1), dtype=torch.int32, device=self.device),
            torch.empty((B,), dtype=torch.int32, device=self.device),
        )
        self._cursor = torch.empty((B, Hkv, P), dtype=torch.int32, device=self.device)
        self.reindex()

    def reindex(self, as_of: torch.Tensor | None = None) -> None:
        """Group the candidate tokens by code combination again, for the current codes and lengths.

        In place (a CUDA graph that captured `select` stays valid) and without a host sync; a
        no-op where the index keeps no buckets (CPU, more than 4096 combinations). as_of: [B]
        lengths at most the current ones to group the tokens as of (the later ones are then
        scanned as recently appended: what a selection costs with buckets that old)."""
        if self._buckets is None:
            return
        dispatch.bucket_tokens(
            self.codes,
            self.lengths if as_of is None else as_of,
            *self._buckets,
            self._cursor,
            C=1 << self.config.bits,
            window=self.config.window,
            cand_lo=self._cand_lo,
        )
        self._bucketed_at = self._max_length

    def _reindex_when_due(self) -> None:
        if self._buckets is not None and self._max_length - self._bucketed_at >= self.REINDEX_AFTER:
            self.reindex()

    def append(self, keys: torch.Tensor) -> None:
        """Encode T new keys per sequence at positions lengths[b] .. lengths[b] + T - 1 and
        advance the lengths (on a GPU one launch, no sync).

        Args:
            keys: [B, Hkv, T, D] float.

        Example:
            >>> config = PQConfig(bits=3, iters=1)
            >>> index = PQIndex.build(torch.randn(1, 2, 64, 16), capacity=70, config=config)
            >>> index.append(torch.randn(1, 2, 2, 16))
            >>> index.lengths.tolist()
            [66]
        """
        key = self._plan_key("append", keys)
        plan = self._plans.get(key)
        if plan is None:
            check.tensor(
                "keys",
                keys,
                shape=(self.batch, self.kv_heads, None, self.head_dim),
                dims="[B, Hkv, T, D]",
                dtypes=check.FLOAT_DTYPES,
                device=self.device,
            )
        T = keys.shape[2]
        self._check_room(T, "keys")
        if plan is not None:
            plan(keys)
        elif dispatch.kernel_path(keys, self.centroids):
            with recording() as rec:
                self._encode(keys)
            self._keep(key, rec, keys)
        else:
            new = ops.encode_keys(keys, self.centroids, self.phi, metric=self.config.metric)
            slots = (self.lengths[:, None] + torch.arange(T, device=self.device))[:, None, :, None]
            self.codes.scatter_(2, slots.expand(-1, self.kv_heads, -1, self.config.subvectors), new)
            self.lengths += T
        self._max_length += T
        self._reindex_when_due()

    def truncate(self, lengths: torch.Tensor | list[int]) -> None:
        """Roll the sequences back to `lengths` tokens (rejected speculative tokens, a benchmark that
        replays one step at a fixed N): the tokens past them are forgotten, their codes left to be
        overwritten by the next appends. In place, so captured graphs stay valid; reads the lengths
        on the host (a sync for a device tensor) and regroups the buckets where the index keeps
        them.

        Args:
            lengths: [B] token counts, each at most the sequence's current length.

        Example:
            >>> config = PQConfig(bits=3, iters=1)
            >>> index = PQIndex.build(torch.randn(1, 2, 64, 16), capacity=70, config=config)
            >>> index.append(torch.randn(1, 2, 2, 16))
            >>> index.truncate([64])
            >>> index.lengths.tolist()
            [64]
        """
        lens = check.lengths(lengths, self.batch, self.capacity, self.device)
        current = self.lengths.tolist()
        if any(n > c for n, c in zip(lens.tolist(), current, strict=True)):
            raise ValueError(f"lengths: expected at most the current lengths {current}, got {lens.tolist()}")
        self.lengths.copy_(lens)
        self._max_length = max(lens.tolist(), default=0)
        if self._hist is not None:
            self._hist.zero_()
            dispatch.count_combos(
                self.codes,
                self.lengths,
                self._hist,
                C=1 << self.config.bits,
                window=self.config.window,
                cand_lo=self._cand_lo,
            )
            self.reindex()

    def _check_room(self, T: int, name: str) -> None:
        if self._max_length + T > self.capacity:
            raise ValueError(
                f"{name}: appending T={T} tokens to sequences of up to {self._max_length} tokens needs "
                f"lengths <= capacity={self.capacity}, got {self._max_length + T}"
            )

    def _encode(self, keys: torch.Tensor, kv_cache: tuple | None = None) -> None:
        """The encode launch (kernel path): codes at each length, the histogram, the lengths
        advanced in the same launch, and with kv_cache (k_cache, v_cache, values) the new rows
        stored into the caches."""
        dispatch.encode(
            keys,
            self.centroids,
            self.phi,
            self.codes,
            base=self.lengths,
            hist=self._hist,
            window=self.config.window,
            cand_lo=self._cand_lo,
            kv_cache=kv_cache,
            advance=self._arrivals,
        )

    def _plan_key(self, method: str, *inputs: torch.Tensor, scale: float | None = None) -> tuple:
        """What a method's plan depends on: its inputs' signature, its scalar argument, and which
        tensors the index's public state is (a plan binds them: an attribute given a new tensor
        must not be replayed with the old one)."""
        state = (id(self.centroids), id(self.codes), id(self.phi), id(self.lengths))
        return method, signature(*inputs), scale, state

    def _keep(self, key: tuple, rec, *inputs: torch.Tensor) -> None:
        """Keep the launches recorded for these inputs as a plan, when they make one."""
        owned = (
            self.centroids,
            self.codes,
            self.phi,
            self.lengths,
            self._hist,
            *(self._buckets or ()),
            self._cursor,
            self._arrivals,
            self._workspace,
            self._attn_out,
            self._attn_workspace,
            *(self._selection or ()),
        )
        self._plans.keep(key, rec, inputs, owned)

    def sync_lengths(self) -> None:
        """Refresh the host's longest-length counter from the device (one sync).

        Call it after replaying a CUDA graph that captured `append`: the replays advance the
        device lengths, while the host counter advanced once, at capture.
        """
        self._max_length = int(self.lengths.max()) if self.batch else 0
        self._reindex_when_due()

    def select(
        self, q: torch.Tensor, keys: torch.Tensor | None = None, *, append: torch.Tensor | None = None
    ) -> Selection:
        """PQ top-k selection for one decode query per sequence (SPEC §2; sizes from the config).

        Args:
            q: [B, H, D] float, H a multiple of Hkv, D the index's head dim.
            keys: the key cache [B, Hkv, >= the longest length, D], for a config that re-ranks.
            append: the step's new keys [B, Hkv, 1, D], appended first as `append` does; or a
                key cache [B, Hkv, >= capacity, D] that already holds each sequence's new key at
                row lengths[b] (a cache written before the step, as transformers' static cache
                is). On the fine route (the default policy's) the selection's first launch encodes
                them, one launch fewer than `append` then `select`.

        Returns:
            Selection(positions [B, H, sink + heavy + window] int32, -1 past the count; counts
            [B, H] int32); for share="group" Hkv rows of width `config.width(H // Hkv)`. On the
            kernel path it is a buffer of the index's, overwritten by the next call.

        Example:
            >>> keys = torch.randn(1, 2, 256, 16)
            >>> config = PQConfig(subvectors=4, bits=4, sink=4, window=8, heavy=8, iters=2)
            >>> PQIndex.build(keys, config=config).select(torch.randn(1, 4, 16)).counts.tolist()
            [[28, 28]]
            >>> config = PQConfig(subvectors=4, bits=4, sink=4, window=8, heavy=8, iters=2, share="head")
            >>> PQIndex.build(keys, config=config).select(torch.randn(1, 4, 16)).counts.tolist()
            [[20, 20, 20, 20]]
        """
        return self._select(q, keys, append, None)

    def _select(
        self, q: torch.Tensor, keys: torch.Tensor | None, k_new: torch.Tensor | None, kv_cache: tuple | None
    ) -> Selection:
        """`select`, appending k_new first when given (with kv_cache (k_cache, v_cache, values):
        its rows stored too, as the encode launch of a decode step stores them)."""
        c = self.config
        if c.rerank and keys is None:
            raise ValueError(
                "keys: expected the key cache [B, Hkv, N, D] for a config with rerank >= 1, got None"
            )
        inputs = (q,) if keys is None or not c.rerank else (q, keys)
        if k_new is not None:
            self._check_room(1, "append")
            inputs += (k_new, *(kv_cache or ()))
        key = self._plan_key("select" if k_new is None else "append+select", *inputs)
        plan = self._plans.get(key)
        if plan is not None:
            plan(*inputs)
            if k_new is not None:
                self._max_length += 1
                self._reindex_when_due()
            return self._selection
        check.tensor(
            "q", q, shape=(self.batch, None, self.head_dim), dims="[B, H, D]", dtypes=check.FLOAT_DTYPES
        )
        if k_new is not None and kv_cache is None:  # (decode_step checked its own)
            check.tensor(
                "append",
                k_new,
                shape=(self.batch, self.kv_heads, None, self.head_dim),
                dims="[B, Hkv, 1 or >= capacity, D]",
                dtypes=check.FLOAT_DTYPES,
                device=self.device,
            )
            if 1 < k_new.shape[2] < self.capacity:
                raise ValueError(
                    f"append: expected the new keys [B, Hkv, 1, D] or a key cache [B, Hkv, >= capacity="
                    f"{self.capacity}, D], got {list(k_new.shape)}"
                )
        at_length = k_new is not None and k_new.shape[2] != 1
        keys = keys if c.rerank else None
        longest = self._max_length + (k_new is not None)
        if keys is not None:
            check.tensor(
                "keys",
                keys,
                shape=(self.batch, self.kv_heads, None, self.head_dim),
                dims="[B, Hkv, N, D]",
                dtypes=check.FLOAT_DTYPES,
                device=self.device,
            )
            if keys.shape[2] < longest:
                raise ValueError(
                    f"keys: expected at least {longest} tokens on axis 2 (the longest sequence), "
                    f"got {keys.shape[2]}"
                )
        group = max(1, q.shape[1] // self.kv_heads)
        heavy = clamp_row_heavy(c.row_heavy(group), self.capacity, stacklevel=4)  # select's caller
        width = c.sink + heavy + c.window
        kernel = dispatch.kernel_path(q, self.centroids, heavy, c.share, c.rerank)
        if not kernel:
            if kv_cache is not None:  # a decode step's encode stores its rows (kernel path)
                self._encode(k_new, kv_cache=kv_cache)
                self._max_length += 1
            elif at_length:
                slot = self.lengths.view(-1, 1, 1, 1).expand(self.batch, self.kv_heads, 1, self.head_dim)
                self.append(k_new.gather(2, slot))
            elif k_new is not None:
                self.append(k_new)
            if keys is not None and keys.shape[2] != self.capacity:  # the reference scores every row
                keys = torch.nn.functional.pad(
                    keys[:, :, : self.capacity], (0, 0, 0, self.capacity - keys.shape[2])
                )
            return ops.select_topk(
                q,
                self.centroids,
                self.codes,
                self.lengths,
                sink=c.sink,
                window=c.window,
                heavy=heavy,  # the row's, clamped (a group's row of one budget)
                init_offset=c.offset,
                share=c.share,
                group_rule=c.group_rule,
                group_budget=1.0,
                rerank=c.rerank,
                keys=keys,
            )
        check.score_inputs(q, self.centroids, self.codes)
        if self._selection is None or self._selection_heads != q.shape[1]:
            H, M, C = q.shape[1], c.subvectors, 1 << c.bits
            R = c.rows(H, self.kv_heads)
            self._plans.forget(self._workspace, *(self._selection or ()))
            self._selection = Selection(
                torch.empty(self.batch, R, width, dtype=torch.int32, device=self.device),
                torch.empty(self.batch, R, dtype=torch.int32, device=self.device),
            )
            self._selection_heads = H
            n = dispatch.select_workspace_numel(
                self.batch * R,
                M,
                C,
                self.codes.shape[2],
                heavy,
                kept_histogram=self._hist is not None,
                buckets=self._buckets is not None,
                share=c.share,
                tables=c.tables(H // self.kv_heads),
                rerank=c.rerank,
            )
            self._workspace = torch.zeros(n, dtype=torch.int32, device=self.device)
        # on the fine route the selection's first launch encodes the key, else the encode launch
        appended = None
        if k_new is not None:
            appended = AppendedKey(k_new, self.phi, self._arrivals, kv_cache, at_length)
        with recording() as rec:
            dispatch.select(
                q,
                self.centroids,
                self.codes,
                self.lengths,
                SelectParams.make(
                    sink=c.sink,
                    window=c.window,
                    heavy=heavy,
                    cand_lo=self._cand_lo,
                    short_threshold=width,
                    n_tokens=self.codes.shape[2],
                ),
                out=self._selection,
                workspace=self._workspace,
                histogram=self._hist,
                buckets=self._buckets,
                share=c.share,
                group_rule=c.group_rule,
                rerank=c.rerank,
                keys=keys,
                appended=appended,
            )
        if k_new is not None:
            self._max_length += 1
        self._keep(key, rec, *inputs)
        if k_new is not None:
            self._reindex_when_due()
        return self._selection

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        selection: Selection | None = None,
        *,
        scale: float | None = None,
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sparse attention of q over the selected tokens of the cache (selects first when
        `selection` is None).

        Args:
            q: [B, H, D]. k_cache, v_cache: [B, Hkv, >= the longest length, D], or with
                `block_table` [B, max_blocks] paged caches [num_blocks, P, Hkv, D] (SPEC §8;
                positions stay logical).
            selection: a Selection from `select`, or None. scale: default 1/sqrt(D). The
                selection `select` returned (the index's own buffers) is not read on the host: its
                positions lie in each sequence's tokens, or where the caller moved them within the
                cache (a left-padded batch's); any other selection's values are checked (one host
                sync when a call takes no plan).

        Returns:
            out [B, H, D] in q's dtype; on the kernel path a buffer of the index's, reused by the
            next call (copy it to keep it).
        """
        scale = check.scale(scale)
        if block_table is not None:
            self._check_paged(k_cache, v_cache, block_table)  # once per signature
        elif k_cache.dim() == 4 and k_cache.shape[2] < self._max_length:
            raise ValueError(
                f"k_cache: expected at least {self._max_length} tokens on axis 2 (the longest sequence), "
                f"got {k_cache.shape[2]}"
            )
        inputs = (q, k_cache, v_cache) if selection is None else (q, k_cache, v_cache, *selection)
        inputs += () if block_table is None else (block_table,)
        key = self._plan_key("attend", *inputs, scale=scale)
        plan = self._plans.get(key)
        if plan is not None:
            plan(*inputs)
            return self._attn_out
        with recording() as rec:
            out = self._attend(q, k_cache, v_cache, selection, scale, block_table)
        if self._kernels_only(q, select=selection is None):
            self._keep(key, rec, *inputs)
        return out

    def _kernels_only(self, q: torch.Tensor, select: bool) -> bool:
        """True when every part of an attend ran Triton launches (a plan replays only those)."""
        return dispatch.decode_kernel_path(q) and (
            not select
            or dispatch.kernel_path(
                q,
                self.centroids,
                self.config.row_heavy(max(1, q.shape[1] // self.kv_heads)),
                self.config.share,
                self.config.rerank,
            )
        )

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        selection: Selection | None,
        scale: float | None,
        block_table: torch.Tensor | None = None,
        step: tuple[torch.Tensor, tuple] | None = None,
    ) -> torch.Tensor:
        """Select (appending step = (k_new, kv_cache) first, when given) unless given a
        selection, then attend."""
        if selection is None and block_table is not None and self.config.rerank:
            raise ValueError(_PAGED_RERANK)
        sel = self._select(q, k_cache, *(step or (None, None))) if selection is None else selection
        paged = {} if block_table is None else {"block_table": block_table}
        if not dispatch.decode_kernel_path(q):
            return ops.sparse_decode(q, k_cache, v_cache, sel.positions, sel.counts, scale=scale, **paged)
        # made by the index for these query heads: its values need no host read
        own = sel is self._selection and self._selection_heads == q.shape[1]
        B, H, D = q.shape
        L = sel.positions.shape[-1]
        if self._attn_out is None or self._attn_out.shape != q.shape or self._attn_out.dtype != q.dtype:
            self._plans.forget(self._attn_out)
            self._attn_out = torch.empty_like(q)
        # the kernel leaves its counters at zero, at places that depend on the layout; a group
        # selection (one row per KV head) takes the group kernel
        R = sel.positions.shape[1]
        layout = (B * H, R, L, D)
        if self._attn_workspace is None or self._attn_layout != layout:
            self._plans.forget(self._attn_workspace)
            if R == H:
                need = dispatch.decode_workspace_numel(B * H, L, D)
            else:
                need = dispatch.decode_workspace_numel(B * R, L, D, group=H // R)
            self._attn_workspace = torch.zeros(need, dtype=torch.int32, device=self.device)
            self._attn_layout = layout
        args = (q, k_cache, v_cache, sel.positions, sel.counts)
        buffers = dict(
            out=self._attn_out, workspace=self._attn_workspace, scale=scale, block_table=block_table
        )
        if not own:
            return ops.sparse_decode(*args, **buffers)
        if block_table is None:
            self._check_cache(q, k_cache, v_cache)
        dispatch.sparse_decode(*args, weights=None, dense_weights=False, lse=None, **buffers)
        return self._attn_out

    def _check_cache(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Contiguous caches [B, Hkv, N, D] of the index's B, Hkv and D, and q [B, H, D] (shapes
        only: no value is read)."""
        check.key_cache("k_cache", k_cache)
        shape = (self.batch, self.kv_heads, k_cache.shape[2], self.head_dim)
        check.tensor(
            "k_cache", k_cache, shape=shape, dims="[B, Hkv, N, D] (the index's B, Hkv, D)", device=self.device
        )
        check.tensor(
            "v_cache",
            v_cache,
            shape=shape,
            dims="[B, Hkv, N, D]",
            dtypes=(k_cache.dtype,),
            device=k_cache.device,
        )
        check.query(q, self.batch, self.kv_heads, self.head_dim, k_cache.device)

    def _check_paged(self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor) -> None:
        """Paged caches [num_blocks, P, Hkv, D] and a block table whose blocks hold the capacity,
        checked once per input signature (the values of the table: one host read, then)."""
        seen = signature(k_cache, v_cache, block_table)
        if seen is not None and seen in self._paged_checked:
            return
        _, Hkv, n_tokens, D = check.paged_cache(k_cache, v_cache, block_table, self.batch)
        if (Hkv, D) != (self.kv_heads, self.head_dim):
            raise ValueError(
                f"k_cache: expected Hkv={self.kv_heads}, D={self.head_dim} (the index's), "
                f"got Hkv={Hkv}, D={D}"
            )
        if n_tokens < self.capacity:
            raise ValueError(
                f"block_table: expected blocks for the index's capacity={self.capacity} tokens, got "
                f"{block_table.shape[1]} blocks of {k_cache.shape[1]} = {n_tokens}"
            )
        if seen is not None and len(self._paged_checked) < _MAX_PLANS:
            self._paged_checked.add(seen)

    def decode_step(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        scale: float | None = None,
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step of a layer: store the new key and value, index the key, select, attend.

        Writes k_new / v_new into the caches at position lengths[b] (read on the device: no sync),
        appends the key to the index (lengths += 1), selects for q and attends over the selection
        (the new token is in the window when window >= 1). With CUDA tensors the store, the
        encoding and the length update are one launch, and every step is the same launches on the
        same buffers: capture one call in a CUDA graph and replay it per token (call
        `sync_lengths()` after replays).

        Args:
            q: [B, H, D]. k_new, v_new: [B, Hkv, 1, D].
            k_cache, v_cache: [B, Hkv, >= capacity, D], or with `block_table` [B, max_blocks]
                paged caches [num_blocks, P, Hkv, D] whose blocks hold the capacity (the new rows
                then go in through `pqattn.paged_append`: two launches, capturable).
            scale: default 1/sqrt(D).

        Returns:
            out [B, H, D] in q's dtype (on the kernel path a buffer of the index's).

        Example:
            >>> k_cache, v_cache = torch.randn(1, 2, 80, 16), torch.randn(1, 2, 80, 16)
            >>> config = PQConfig(bits=3, sink=2, window=4, heavy=8, iters=1)
            >>> index = PQIndex.build(k_cache[:, :, :64], capacity=80, config=config)
            >>> out = index.decode_step(torch.randn(1, 4, 16), torch.randn(1, 2, 1, 16),
            ...                         torch.randn(1, 2, 1, 16), k_cache, v_cache)
            >>> out.shape, index.lengths.tolist()
            (torch.Size([1, 4, 16]), [65])
        """
        scale = check.scale(scale)
        kv_shape = (self.batch, self.kv_heads, 1, self.head_dim)
        if block_table is not None:  # paged caches: paged_append at the lengths, append, attend
            for name, t in (("k_new", k_new), ("v_new", v_new)):
                check.tensor(
                    name,
                    t,
                    shape=kv_shape,
                    dims="[B, Hkv, 1, D]",
                    dtypes=check.FLOAT_DTYPES,
                    device=self.device,
                )
            self._check_paged(k_cache, v_cache, block_table)
            self._check_room(1, "k_new")
            if self.config.rerank:  # (refused before anything is written)
                raise ValueError(_PAGED_RERANK)
            ops.paged_append(k_cache, v_cache, block_table, self.lengths, k_new[:, :, 0], v_new[:, :, 0])
            selection = self.select(q, append=k_new)
            return self.attend(q, k_cache, v_cache, selection, scale=scale, block_table=block_table)
        inputs = (q, k_new, v_new, k_cache, v_cache)
        key = self._plan_key("step", *inputs, scale=scale)
        plan = self._plans.get(key)
        if plan is not None:
            self._check_room(1, "k_new")
            plan(*inputs)
            self._max_length += 1
            self._reindex_when_due()
            return self._attn_out
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            check.tensor(
                name, t, shape=kv_shape, dims="[B, Hkv, 1, D]", dtypes=check.FLOAT_DTYPES, device=self.device
            )
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            check.tensor(
                name,
                t,
                shape=(self.batch, self.kv_heads, None, self.head_dim),
                dims="[B, Hkv, Ncache, D]",
                dtypes=check.FLOAT_DTYPES,
                device=self.device,
            )
            if t.shape[2] < self.capacity:
                raise ValueError(
                    f"{name}: expected at least capacity={self.capacity} tokens on axis 2, got {t.shape[2]}"
                )
        self._check_room(1, "k_new")
        if not dispatch.kernel_path(k_new, self.centroids):
            slot = self.lengths.view(-1, 1, 1, 1).long().expand(kv_shape)
            k_cache.scatter_(2, slot, k_new.to(k_cache.dtype))
            v_cache.scatter_(2, slot, v_new.to(v_cache.dtype))
            self.append(k_new)
            return self.attend(q, k_cache, v_cache, scale=scale)
        with recording() as rec:
            out = self._attend(q, k_cache, v_cache, None, scale, step=(k_new, (k_cache, v_cache, v_new)))
        if self._kernels_only(q, select=True):
            self._keep(key, rec, *inputs)
        self._reindex_when_due()
        return out


def decode_step(
    index: PQIndex,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Functional form of `PQIndex.decode_step`: store k_new / v_new in the caches at each
    sequence's length, index the key, select for q, attend.

    Args:
        index: the layer's PQIndex. q: [B, H, D]. k_new, v_new: [B, Hkv, 1, D].
        k_cache, v_cache: [B, Hkv, >= capacity, D]. scale: default 1/sqrt(D).

    Returns:
        out [B, H, D] in q's dtype (on the kernel path, a buffer of the index's: copy to keep).
    """
    return index.decode_step(q, k_new, v_new, k_cache, v_cache, scale=scale)
