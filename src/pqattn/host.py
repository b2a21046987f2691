"""`HostCache`: a layer's keys and values in host memory, its PQ index and a row cache on the GPU.

The host tier of SPEC §10. A decode step selects on the GPU as `PQIndex` does, looks the selected
rows up in the row cache, fetches the missing ones from host memory into free slots and attends
over the slots: the same selection and output as with the cache on the GPU, for a GPU footprint
of the index plus `slots` rows per KV head. The row cache's rule and the fetch are
`pqattn.reference.rows`; the kernels `pqattn.kernels.rows`; the design docs/kernels/host.md.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from pqattn import _validate as check
from pqattn import dispatch, ops
from pqattn import reference as ref
from pqattn.index import PQConfig, PQIndex
from pqattn.policy import clamp_row_heavy

ROW_CACHE_LISTS = 8  # default slots per KV head, in selection-list widths (docs/kernels/host.md)


class Footprint(NamedTuple):
    """Bytes a host tier holds: `host` in page-locked host memory, `gpu` on the device."""

    host: int
    gpu: int


def list_width(config: PQConfig, query_heads: int, kv_heads: int, capacity: int) -> int:
    """L, the positions a step lists per KV head: sink + the group's heavy (clamped to the
    capacity) + window."""
    return config.sink + clamp_row_heavy(config.row_heavy(query_heads // kv_heads), capacity) + config.window


def row_cache_slots(width: int, capacity: int, widths: int = ROW_CACHE_LISTS) -> int:
    """The row cache's slots per KV head: `widths` list widths, at most the capacity (a cache of
    every position needs no more)."""
    return min(widths * width, capacity)


def footprint(
    config: PQConfig,
    *,
    batch: int,
    query_heads: int,
    kv_heads: int,
    head_dim: int,
    capacity: int,
    dtype: torch.dtype,
    slots: int | None = None,
    int8: bool = False,
) -> Footprint:
    """The host and GPU bytes of one layer's HostCache (the index's codes and centroids, the row
    cache's slots and maps, its lists), computed before anything is allocated."""
    esize = torch.empty(0, dtype=dtype).element_size()
    rows = batch * kv_heads
    M, C = config.subvectors, 1 << config.bits
    dsub = head_dim // M + (config.metric == "ip")
    L = list_width(config, query_heads, kv_heads, capacity)
    S = row_cache_slots(L, capacity) if slots is None else slots
    index = rows * (capacity * M + M * C * dsub * 4)
    cache = rows * (capacity * 4 + S * (2 * head_dim * esize + 8) + L * 16)
    row_bytes = 2 * head_dim + 8 if int8 else 2 * head_dim * esize
    return Footprint(host=rows * capacity * row_bytes, gpu=index + cache)


def host_rows_shape(batch: int, kv_heads: int, capacity: int, head_dim: int, int8: bool) -> tuple[int, ...]:
    """The host rows' shape: [B, Hkv, capacity, 2, D], or [B, Hkv, capacity, 2 * D + 8] uint8 for
    8-bit rows (`pqattn.reference.encode_rows`)."""
    if int8:
        return (batch, kv_heads, capacity, 2 * head_dim + 8)
    return (batch, kv_heads, capacity, 2, head_dim)


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), None where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 10**7 else f"{n} bytes"


def free_gpu_bytes(device: torch.device) -> int | None:
    """The device's free memory (CUDA), None elsewhere."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def check_fits(need: Footprint, device: torch.device, what: str = "capacity") -> None:
    """Refuse a host tier the machine cannot hold (ValueError naming `what`, with both figures)."""
    host = available_host_bytes()
    if host is not None and need.host > host:
        raise ValueError(
            f"{what}: the host tier needs {_size(need.host)} of page-locked host memory, "
            f"the machine has {_size(host)} available"
        )
    free = free_gpu_bytes(device)
    if free is not None and need.gpu > free:
        raise ValueError(
            f"{what}: the host tier's index and row cache need {_size(need.gpu)} on {device}, "
            f"{_size(free)} are free"
        )


def mapped_host_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host memory that kernels on `device` read and write directly: with CUDA, page-locked and
    mapped (cudaHostRegister of exactly its bytes; the caching host allocator would round a
    block up to a power of two), unregistered when the tensor object goes; elsewhere plain memory."""
    t = torch.empty(shape, dtype=dtype)
    if device.type != "cuda" or t.numel() == 0:
        return t
    cudart = torch.cuda.cudart()
    ptr, size = t.data_ptr(), t.numel() * t.element_size()
    flags = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
    with torch.cuda.device(device):
        err = cudart.cudaHostRegister(ptr, size, flags)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {size / 1e9:.2f} GB of host memory failed: {err}")
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)
    return t


class HostCache:
    """One layer's keys and values in host memory for a batch of sequences, decoded with PQ
    selection over a GPU row cache (SPEC §10).

    Owns `index` (a PQIndex on the GPU: centroids, codes, lengths), `rows` [B, Hkv, capacity, 2, D]
    in host memory (a position's key then value: one contiguous read; page-locked and mapped on a
    CUDA machine) and the row cache on the GPU: `k_slots` / `v_slots` [B, Hkv, slots, D] and its
    maps (`pqattn.reference.RowCache`). Every decode step lists each KV head's sink and window
    rows, so they are never evicted. Selection is one list per KV head (share="group").

    Typical use::

        cache = HostCache.prefill(k, v, lengths, capacity=n + steps, config=PQConfig(), query_heads=H)
        for step in ...:
            out = cache.decode_step(q, k_new, v_new)   # [B, H, D]

    A decode step is launches only (encode, select, row lookup, fetch, attention): no host sync,
    no allocation after the first call, capturable in a CUDA graph (call `index.sync_lengths()`
    after replays, as for PQIndex). `hit_rate()` reads the row cache's counters (one sync).
    """

    def __init__(
        self,
        index: PQIndex,
        *,
        query_heads: int,
        dtype: torch.dtype,
        slots: int | None = None,
        rows: torch.Tensor | None = None,
        int8: bool = False,
    ) -> None:
        """An empty host tier beside `index` (its rows unwritten: `write` them).

        Args:
            index: the layer's PQIndex (the GPU side; its capacity is the host tier's).
            query_heads: H, the query heads per sequence (H % Hkv == 0): sets the list width.
            dtype: the keys' and values' dtype (host rows and slots).
            slots: rows per KV head the row cache holds, at least the list width
                (default `row_cache_slots`: ROW_CACHE_LISTS widths, at most the capacity).
            rows: host memory to use, `host_rows_shape(...)` of `dtype` (uint8 with int8), mapped
                on a CUDA machine (`mapped_host_empty`), instead of allocating it.
            int8: 8-bit host rows (an int8 code per element and a float32 scale per row of a KV
                head, half the bytes of bf16): the attention then reads the dequantized rows
                (`pqattn.reference.quantize`), not the prefill's.
        """
        c = index.config
        if c.share != "group":
            raise ValueError(f"index.config.share: expected 'group' for a host tier, got {c.share!r}")
        check.positive_int("query_heads", query_heads)
        check.gqa(query_heads, index.kv_heads, "query_heads", "index")
        if dtype not in check.FLOAT_DTYPES:
            raise TypeError(f"dtype: expected one of {check.FLOAT_DTYPES}, got {dtype}")
        B, Hkv, D, N = index.batch, index.kv_heads, index.head_dim, index.capacity
        device = index.device
        probe = torch.empty(0, D, device=device)
        self._kernels = dispatch.decode_kernel_path(probe) and dispatch.kernel_path(
            probe, index.centroids, c.row_heavy(query_heads // Hkv), c.share, c.rerank
        )
        if device.type == "cuda" and not self._kernels:
            raise ValueError(
                f"index: the host tier runs its kernels on CUDA (D a power of two in 16..256, a route "
                f"for the policy), got D={D}, {c}"
            )
        self.index, self.query_heads, self.dtype = index, query_heads, dtype
        self.list_width = list_width(c, query_heads, Hkv, N)
        self.slots = row_cache_slots(self.list_width, N) if slots is None else slots
        check.positive_int("slots", self.slots)
        if self.slots < self.list_width:
            raise ValueError(f"slots: expected at least the list width {self.list_width}, got {self.slots}")
        need = footprint(
            c, batch=B, query_heads=query_heads, kv_heads=Hkv, head_dim=D, capacity=N, dtype=dtype,
            slots=self.slots, int8=int8,
        )  # fmt: skip
        shape = host_rows_shape(B, Hkv, N, D, int8)
        rows_dtype = torch.uint8 if int8 else dtype
        if rows is None:
            check_fits(need, device)
            rows = mapped_host_empty(shape, rows_dtype, device)
        else:
            dims = "[B, Hkv, capacity, 2 * D + 8]" if int8 else "[B, Hkv, capacity, 2, D]"
            check.tensor("rows", rows, shape=shape, dims=dims, dtypes=(rows_dtype,))
            if rows.device.type != "cpu" or not rows.is_contiguous():
                raise ValueError(
                    f"rows: expected contiguous host memory, got {rows.device}, strides {rows.stride()}"
                )
        self.footprint = need
        self.int8 = int8
        self.rows = rows
        self.k_slots = torch.zeros((B, Hkv, self.slots, D), dtype=dtype, device=device)
        self.v_slots = torch.zeros_like(self.k_slots)
        self.row_cache = ref.new_row_cache(B, Hkv, N, self.slots, device)
        L = self.list_width
        self.misses = ref.Misses(
            torch.zeros((B, Hkv, L), dtype=torch.int32, device=device),
            torch.zeros((B, Hkv, L), dtype=torch.int32, device=device),
            torch.zeros((B, Hkv), dtype=torch.int32, device=device),
        )
        self.slot_list = torch.full((B, Hkv, L), -1, dtype=torch.int32, device=device)
        self._lookup_workspace = torch.zeros(
            dispatch.row_lookup_workspace_numel(B * Hkv, L, self.slots), dtype=torch.int32, device=device
        )
        self._out: torch.Tensor | None = None
        self._workspace = torch.zeros(
            dispatch.decode_workspace_numel(B * Hkv, L, D, group=query_heads // Hkv),
            dtype=torch.int32,
            device=device,
        )
        self.selection: ref.Selection | None = None  # the last step's lists (the index's buffer)
        self._checked: tuple | None = None  # the input signature decode_step last validated

    @classmethod
    def prefill(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor | list[int] | None = None,
        *,
        query_heads: int,
        capacity: int | None = None,
        config: PQConfig | None = None,
        slots: int | None = None,
        int8: bool = False,
    ) -> HostCache:
        """Index the prefill keys on their device and move keys and values to the host tier.

        Args:
            keys, values: [B, Hkv, N, D] (on the GPU that will decode).
            lengths: [B] valid tokens per sequence, None for N each.
            query_heads: H. capacity: tokens the tier holds (N by default; room for the steps).
            config: the index and selection policy (PQConfig() by default). slots, int8: see
                __init__.

        Returns:
            the HostCache.

        Example:
            >>> config = PQConfig(subvectors=4, bits=4, sink=4, window=4, heavy=8, iters=2)
            >>> k, v = torch.randn(1, 2, 128, 16), torch.randn(1, 2, 128, 16)
            >>> cache = HostCache.prefill(k, v, query_heads=4, capacity=130, config=config)
            >>> cache.rows.shape, cache.list_width, cache.slots
            (torch.Size([1, 2, 130, 2, 16]), 40, 160)
        """
        check.key_cache("keys", keys)
        check.tensor(
            "values",
            values,
            shape=keys.shape,
            dims="[B, Hkv, N, D]",
            dtypes=(keys.dtype,),
            device=keys.device,
        )
        config = config or PQConfig()
        index = PQIndex.build(keys, lengths, capacity=capacity, config=config)
        cache = cls(index, query_heads=query_heads, dtype=keys.dtype, slots=slots, int8=int8)
        cache.write(keys, values)
        return cache

    def write(self, keys: torch.Tensor, values: torch.Tensor, start: int = 0) -> None:
        """Store keys and values [B, Hkv, T, D] at positions start.. of the host tier (a prefill
        chunk; the index is not touched) and empty the row cache, whose rows may be stale."""
        B, Hkv, N = self.rows.shape[:3]
        D = self.index.head_dim
        check.tensor("keys", keys, shape=(B, Hkv, None, D), dims="[B, Hkv, T, D]", dtypes=check.FLOAT_DTYPES)
        check.tensor("values", values, shape=keys.shape, dims="[B, Hkv, T, D]", dtypes=check.FLOAT_DTYPES)
        T = keys.shape[2]
        check.non_negative_int("start", start)
        if start + T > N:
            raise ValueError(f"start: expected start + T <= capacity={N}, got {start} + {T}")
        # one copy per KV head of a sequence: its T rows, encoded where the keys are
        for b in range(B):
            for h in range(Hkv):
                encoded = ref.encode_rows(keys[b, h], values[b, h], self.rows.dtype)
                self.rows[b, h, start : start + T].copy_(encoded)
        self.reset_row_cache()

    def truncate(self, lengths: torch.Tensor | list[int]) -> None:
        """Roll the sequences back to `lengths` tokens (`PQIndex.truncate`): the rows past them leave
        the row cache (their positions will be written again), the others stay resident."""
        self.index.truncate(lengths)
        rc = self.row_cache
        n = self.index.lengths.view(-1, 1, 1)
        positions = torch.arange(rc.slot_of.shape[-1], device=n.device)
        rc.slot_of.masked_fill_(positions >= n, -1)
        gone = rc.owner >= n.to(rc.owner.dtype)
        rc.owner.masked_fill_(gone, -1)
        rc.last_used.masked_fill_(gone, -1)

    def reset_row_cache(self) -> None:
        """Forget every resident row (the counters stay)."""
        rc = self.row_cache
        rc.slot_of.fill_(-1)
        rc.owner.fill_(-1)
        rc.last_used.fill_(-1)
        rc.clock.zero_()

    def hit_rate(self) -> float:
        """Listed rows served from the row cache since the start, over all rows and steps (one
        host sync); nan before the first step."""
        lookups, misses = self.row_cache.stats.sum((0, 1)).tolist()
        return 1.0 - misses / lookups if lookups else float("nan")

    def decode_step(
        self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, *, scale: float | None = None
    ) -> torch.Tensor:
        """One decode step: index the new key, store the new key and value in the host tier (at
        position lengths[b]), select for q, bring the selected rows into the row cache, attend.

        Args:
            q: [B, H, D]. k_new, v_new: [B, Hkv, 1, D]. scale: default 1/sqrt(D).

        Returns:
            out [B, H, D] in q's dtype (a buffer of the cache's, overwritten by the next step).

        Example:
            >>> config = PQConfig(subvectors=4, bits=4, sink=4, window=4, heavy=8, iters=2)
            >>> k, v = torch.randn(1, 2, 128, 16), torch.randn(1, 2, 128, 16)
            >>> cache = HostCache.prefill(k, v, query_heads=4, capacity=130, config=config)
            >>> q, k_new, v_new = torch.randn(1, 4, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
            >>> out = cache.decode_step(q, k_new, v_new)
            >>> out.shape, cache.index.lengths.tolist()
            (torch.Size([1, 4, 16]), [129])
        """
        index = self.index
        signature = (q.shape, q.dtype, q.device, k_new.shape, k_new.dtype, v_new.shape, v_new.dtype, scale)
        if signature != self._checked:
            scale = check.scale(scale)
            B, Hkv, D = index.batch, index.kv_heads, index.head_dim
            check.tensor(
                "q", q, shape=(B, self.query_heads, D), dims="[B, H, D]", dtypes=check.FLOAT_DTYPES,
                device=index.device,
            )  # fmt: skip
            for name, t in (("k_new", k_new), ("v_new", v_new)):
                check.tensor(
                    name, t, shape=(B, Hkv, 1, D), dims="[B, Hkv, 1, D]", dtypes=check.FLOAT_DTYPES,
                    device=index.device,
                )  # fmt: skip
            self._checked = signature
        selection = self.selection = index.select(q, append=k_new)
        dispatch.row_lookup(
            selection.positions, selection.counts, self.row_cache, self.misses, self.slot_list,
            kernel=self._kernels, workspace=self._lookup_workspace,
        )  # fmt: skip
        dispatch.row_fetch(
            self.rows, k_new, v_new, index.lengths, self.misses, self.k_slots, self.v_slots,
            kernel=self._kernels,
        )  # fmt: skip
        if self._out is None or self._out.dtype != q.dtype:
            self._out = torch.empty_like(q)
        return ops.sparse_decode(
            q, self.k_slots, self.v_slots, self.slot_list, selection.counts, scale=scale,
            out=self._out, workspace=self._workspace,
        )  # fmt: skip
