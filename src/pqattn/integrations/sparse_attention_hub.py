"""The original's entry point (SPEC §5): `indexer_next` with its signature, layouts and rules.

A sparse-attention-hub PQCache user swaps this function in for the original's: same arguments,
same outputs (sparse_list int64 [B, H, L] as sink, heavy, window positions; sparse_len int64;
dense weight_list; the codebook with the keys since the last call appended), the original's
short-sequence rule n <= heavy + init_offset + 1 + C. On CUDA tensors it is one encode launch
and one selection launch, with no host sync (one launch for a decode loop's call of one new key:
see _select_from_buckets).

The returned codebook is a view of a buffer of ours, [B, init_offset + capacity, Hkv, M] int64,
so that its rows sit at their tokens' positions and later rows have room: passing it back on the
next call appends in place instead of copying the whole codebook (the rows the caller already
holds never change), and a call may also pass back fewer rows than it got (the original's
benchmark re-sends the same codebook: the rows after it are written again). Passing some other
tensor costs one copy into a new buffer. With at most 4096 code combinations (dispatch.uses_histogram)
the buffer also carries, from the first call that passes it back (a decode loop), the candidates'
histogram and buckets of pqattn.kernels.select.buckets: the encode launch keeps the histogram
current and the selection is the bucket launch, which reads about `heavy` positions per row
instead of every code. They are counted again whenever the codebook may have changed outside
these calls (an in-place write to any view of it, seen by its version counter), when the
selection sizes change, or when more than `window` rows are re-sent.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext

import torch

from pqattn import _validate as check
from pqattn import dispatch, ops
from pqattn import reference as ref
from pqattn.index import PQIndex
from pqattn.reference import Selection, SelectParams
from pqattn.runtime.launch import Address, Plan, recording

_GROWTH = 1024  # codebook rows reserved past the current length when a new buffer is made
STATE_ATTRIBUTE = "_pqattn_state"  # the attribute of our codebook buffers that holds their _State

# Static call signatures (everything but N and the codebook's length) whose checks passed, with
# the route they take: (kernels, with the buckets). A decode loop checks its arguments once.
# per checked signature: (kernel path, bucketed, the selection params of a call whose N reaches
# the short-sequence threshold: they do not depend on N there)
_CHECKED: dict[tuple, tuple[bool, bool, SelectParams]] = {}
_MAX_CHECKED = 256


_WORKSPACES: dict[torch.device, tuple[tuple[int, ...], torch.Tensor]] = {}
# The lists indexer_next returned, by id of the positions: weak references to (sparse_list,
# sparse_len), their version counters then, and the N they were selected over. Valid by
# construction, so sparse_attention skips its value check (a launch and a host read) for them
# while neither has been changed in place by a torch op.
_OWN_LISTS: dict[int, tuple[weakref.ref, weakref.ref, int, int, int]] = {}
_MAX_OWN_LISTS = 16


def _workspace(device: torch.device, rows: int, M: int, C: int, N: int, heavy: int) -> torch.Tensor:
    """The stateless selection kernel's zero-filled workspace, kept per device across calls: the
    original's signature has no place for it. The kernel leaves it ready for a call of the same
    layout; the places of its counters depend on the tree over N (a decode loop grows N by one per
    call), so a call of another layout gets a fresh one (once per leaf boundary: every few
    thousand steps). Calls on one device share it, so they must not run concurrently on different
    streams."""
    layout = (rows, M, C, *dispatch.tree_workspace_layout(N, heavy))
    cached = _WORKSPACES.get(device)
    if cached is None or cached[0] != layout:
        numel = dispatch.select_workspace_numel(rows, M, C, N, heavy)
        cached = (layout, torch.zeros(numel, dtype=torch.int32, device=device))
        _WORKSPACES[device] = cached
    return cached[1]


class _State:
    """What a codebook buffer of ours carries: where its codebook starts, and once a call passed
    it back, the candidates' histogram and buckets over its codes (see the module's docstring).

    rows: the codebook rows the histogram counts (-1: none built); version: the buffer's version
    counter after the last call; layout: (window, cand_lo, C, M) of the histogram; lengths [B]:
    init_offset + rows on the device (the selection reads it); frozen_at / bucketed_at: where
    the buckets' candidates end and the token count when they were built. It holds no reference
    to the buffer (the buffer holds it)."""

    def __init__(self, init_offset: int) -> None:
        self.init_offset = init_offset
        self.rows = -1
        self.version = -1
        self.layout: tuple[int, int, int, int] | None = None
        self.hist = self.lengths = self.arrivals = self.cursor = None
        self.buckets: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.frozen_at = self.bucketed_at = 0
        self.workspace_key: tuple[int, int] | None = None
        self.workspace: torch.Tensor | None = None
        # the one-launch decode call kept as a plan (see _bucket_select): (key, plan) and the
        # last such call's key; a rebuild or a new workspace drops the plan
        self.plan: tuple[tuple, Plan] | None = None
        self.last_key: tuple | None = None
        self.last_n = -1  # the token count of the last call
        self.repeat: _Repeat | None = None  # the last call, when it replayed the plan

    def rebuild(self, codes: torch.Tensor, N: int, layout: tuple[int, int, int, int]) -> None:
        """Group the candidates of codes [B, Hkv, capacity, M] (token p at row p) for sequences
        of N tokens, and take the histogram from the groups' sizes."""
        B, Hkv, capacity, M = codes.shape
        window, cand_lo, C, _ = layout
        self.plan = self.repeat = None
        if self.lengths is None:
            self.lengths = torch.empty(B, dtype=torch.int64, device=codes.device)
            self.arrivals = torch.zeros(B, dtype=torch.int32, device=codes.device)
        self.lengths.fill_(N)
        if self.layout != layout:
            dev, P = codes.device, C**M
            self.hist = torch.empty(B, Hkv, P, dtype=torch.int32, device=dev)
            self.cursor = torch.empty(B, Hkv, P, dtype=torch.int32, device=dev)
            self.buckets = (
                torch.empty(B, Hkv, capacity, dtype=torch.int32, device=dev),
                torch.empty(B, Hkv, P + 1, dtype=torch.int32, device=dev),
                torch.empty(B, dtype=torch.int32, device=dev),
            )
            self.layout = layout
        order, starts, frozen = self.buckets
        dispatch.bucket_tokens(
            codes[:, :, :N],
            self.lengths,
            order,
            starts,
            frozen,
            self.cursor,
            C=C,
            window=window,
            cand_lo=cand_lo,
        )
        torch.sub(starts[..., 1:], starts[..., :-1], out=self.hist)
        self.frozen_at = max(N - window, cand_lo)
        self.bucketed_at = N

    def workspace_for(self, rows: int, M: int, C: int, heavy: int) -> torch.Tensor:
        if self.workspace_key != (rows, heavy):
            numel = dispatch.select_workspace_numel(rows, M, C, 0, heavy, kept_histogram=True, buckets=True)
            self.workspace = torch.zeros(numel, dtype=torch.int32, device=self.hist.device)
            self.workspace_key = (rows, heavy)
            self.plan = self.repeat = None
        return self.workspace


class _Repeat:
    """A call that replayed its codebook's kept launch, so that the next call with the same
    arguments replays it with their addresses alone: the same codebook object, unchanged since
    (its buffer's version), and equal shapes, strides, dtypes, devices, options and 16-byte
    alignments of everything the checked path keys its plan by (the original's benchmark re-sends
    one codebook every call). Anything else takes the checked path, which drops this record."""

    __slots__ = ("aligned", "codebook", "key_offset", "props", "q_offset", "rows", "version", "width")

    def __init__(self, args: tuple, codebook: torch.Tensor, version: int, rows: int, width: int) -> None:
        query, key, centroids, phi = args[0], args[1], args[9], _ip_phi(args)
        self.codebook = weakref.ref(codebook)  # (the state must not keep its buffer alive)
        self.version = version
        self.props = _Repeat.properties(*args)
        self.q_offset = (query.shape[2] - 1) * query.stride(2) * query.element_size()
        self.key_offset = (key.shape[2] - 1) * key.stride(2) * key.element_size()
        self.rows, self.width = rows, width
        self.aligned = _Repeat.alignment(self.addresses(query, key, centroids, phi))

    @staticmethod
    def properties(
        query, key, weight_list_dtype, sink, window, heavy, M, bits, init_offset, centroids, metric, phi
    ) -> tuple:
        options = (sink, window, heavy, M, bits, init_offset, metric)
        return (
            query.shape, query.stride(), query.dtype, query.device,
            key.shape, key.stride(), key.dtype, key.device,
            weight_list_dtype, options, tuple(map(type, options)),
            centroids.shape, centroids.stride(), centroids.dtype, centroids.device,
            None if phi is None else (phi.shape, phi.stride(), phi.dtype, phi.device),
            dispatch.KERNEL_DEVICES,
        )  # fmt: skip

    def addresses(self, query, key, centroids, phi) -> tuple[int, ...]:
        """The plan's q (the last query token), new key, centroids and phi addresses."""
        ptrs = (query.data_ptr() + self.q_offset, key.data_ptr() + self.key_offset, centroids.data_ptr())
        return ptrs if phi is None else (*ptrs, phi.data_ptr())

    @staticmethod
    def alignment(ptrs: tuple[int, ...]) -> tuple[bool, ...]:
        return tuple(p & 15 == 0 for p in ptrs)

    def inputs(self, args: tuple, buf: torch.Tensor, out: Selection, weights: torch.Tensor) -> tuple | None:
        """The plan's inputs for `args` (as _bucket_select orders them), the views by address, or
        None when the addresses' alignment differs from the recorded call's."""
        query, key, centroids, phi = args[0], args[1], args[9], _ip_phi(args)
        ptrs = self.addresses(query, key, centroids, phi)
        if _Repeat.alignment(ptrs) != self.aligned:
            return None
        B, Hkv, M = buf.shape[0], buf.shape[2], buf.shape[3]
        q = Address(ptrs[0], lambda: query[:, :, -1])
        codes = Address(buf.data_ptr(), lambda: buf.transpose(1, 2))
        new_key = Address(ptrs[1], lambda: key[:, :, -1:])
        tail = (new_key,) if phi is None else (new_key, Address(ptrs[3], lambda: phi.reshape(B, Hkv, M)))
        return (q, centroids, codes, out.positions, out.counts, weights, *tail)

    def call(self, state: _State, args: tuple, codebook: torch.Tensor) -> tuple | None:
        """The outputs of a repeat of the recorded call, or None when `args` is not one."""
        buf = codebook._base
        if self.codebook() is not codebook or buf._version != self.version:
            return None
        if _Repeat.properties(*args) != self.props:
            return None
        query, weight_list_dtype = args[0], args[2]
        B, H, N = query.shape[0], query.shape[1], args[1].shape[2]
        dev = query.device
        out = Selection(
            torch.empty(B, H, self.width, dtype=torch.int64, device=dev),
            torch.empty(B, H, dtype=torch.int64, device=dev),
        )
        weights = torch.empty(B, H, N, dtype=weight_list_dtype, device=dev)
        inputs = self.inputs(args, buf, out, weights)
        if inputs is None:
            return None
        state.plan[1](*inputs)
        io = state.init_offset
        return out.positions, out.counts, weights, args[9], buf[:, io : io + self.rows], args[11]


def _ip_phi(args: tuple) -> torch.Tensor | None:
    """The call's phi as the kernels read it: the ip metric's, else none."""
    return args[11] if args[10] == "ip" else None


def _repeat_of(codebook: torch.Tensor) -> tuple[_State, _Repeat] | None:
    """The state and repeat record of a codebook of ours whose last call replayed its plan."""
    base = codebook._base
    state = getattr(base, STATE_ATTRIBUTE, None) if base is not None else None
    if state is None or state.repeat is None:
        return None
    return state, state.repeat


def codebook_buffer(codebook: torch.Tensor, init_offset: int, rows: int) -> tuple[torch.Tensor, _State, bool]:
    """(buffer, its state, whether `codebook` came from an earlier call): a buffer of ours
    [B, init_offset + capacity, Hkv, M] int64 whose rows init_offset.. hold `codebook` and that has
    room for `rows` codebook rows; `codebook` itself when it is a view of such a buffer with room."""
    B, n, Hkv, M = codebook.shape
    base = codebook._base
    state = getattr(base, STATE_ATTRIBUTE, None) if base is not None else None
    ours = (
        state is not None
        and state.init_offset == init_offset
        and base.shape[0] == B
        and base.shape[2:] == (Hkv, M)
        and codebook.stride() == base.stride()
        and codebook.storage_offset() == init_offset * Hkv * M
    )
    if ours and init_offset + rows <= base.shape[1]:
        return base, state, True
    buf = torch.empty(B, init_offset + rows + _GROWTH, Hkv, M, dtype=torch.int64, device=codebook.device)
    buf[:, init_offset : init_offset + n].copy_(codebook)
    state = _State(init_offset)
    setattr(buf, STATE_ATTRIBUTE, state)
    return buf, state, ours


def indexer_next(
    query: torch.Tensor,
    key: torch.Tensor,
    weight_list_dtype: torch.dtype,
    sink_size: int,
    window_size: int,
    heavy_size: int,
    pq_group_factor: int,
    pq_bits: int,
    kmeans_iter: int,
    init_offset: int,
    metric: str,
    pq_centroids: torch.Tensor,
    pq_codebook: torch.Tensor,
    pq_ip2l2_phi: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """PQ top-k selection for the last query token, the original's way (SPEC §5): its signature,
    outputs and short-sequence rule (n <= heavy + init_offset + 1 + C keeps every token).

    Args:
        query: [B, H, Sq, D] (the last token selects). key: [B, Hkv, N, D], the whole cache.
        weight_list_dtype: the dtype of the returned dense weights.
        sink_size, window_size, heavy_size: the selection's sizes.
        pq_group_factor, pq_bits: M and bits of the codebook. kmeans_iter: accepted for
            compatibility (the centroids are not retrained at decode). init_offset: the first
            quantized token. metric: "euclidean" or "ip".
        pq_centroids: [B, Hkv, M, C, dsub (+1)].
        pq_codebook: [B, n_quantized, Hkv, M] int64, the codes of tokens init_offset ..
            init_offset + n_quantized; pass back the one returned by the last call (it carries the
            index's buckets, so a decode call is one launch).
        pq_ip2l2_phi: flat [B * Hkv * M] (ip) or None.

    Returns:
        (sparse_list [B, H, L] int64: sink, heavy, window positions, -1 past sparse_len;
        sparse_len [B, H] int64; weight_list [B, H, N]: 1 at the selected positions;
        pq_centroids; pq_codebook [B, N - init_offset, Hkv, M] with the keys since the last call
        appended; pq_ip2l2_phi), L = sink + heavy + window, wider when the short rule keeps more.
    """
    args = (
        query, key, weight_list_dtype, sink_size, window_size, heavy_size, pq_group_factor, pq_bits,
        init_offset, pq_centroids, metric, pq_ip2l2_phi,
    )  # fmt: skip
    try:  # a repeat of the last call, when it replayed the kept launch (_Repeat)
        found = _repeat_of(pq_codebook)
        repeated = None if found is None else found[1].call(found[0], args, pq_codebook)
    except (AttributeError, TypeError):  # not tensors: the checks below say which
        repeated = None
    if repeated is not None:
        return _returned_lists(repeated, key.shape[2])
    try:
        sig = (
            query.shape,
            query.dtype,
            query.device,
            key.shape[:2],
            key.shape[3:],
            key.dtype,
            key.device,
            weight_list_dtype,
            (sink_size, window_size, heavy_size, pq_group_factor, pq_bits, init_offset, metric),
            (type(sink_size), type(window_size), type(heavy_size), type(pq_group_factor), type(pq_bits)),
            type(init_offset),
            pq_centroids.shape,
            pq_centroids.dtype,
            pq_centroids.device,
            pq_codebook.shape[:1],
            pq_codebook.shape[2:],
            pq_codebook.dtype,
            pq_codebook.device,
            None if pq_ip2l2_phi is None else (pq_ip2l2_phi.shape, pq_ip2l2_phi.dtype, pq_ip2l2_phi.device),
            dispatch.KERNEL_DEVICES,
        )
        route = _CHECKED.get(sig)
    except (AttributeError, TypeError):  # not tensors, an unhashable option: the checks say which
        sig, route = None, None
    if route is None:
        route = _check_call(
            query,
            key,
            weight_list_dtype,
            sink_size,
            window_size,
            heavy_size,
            pq_group_factor,
            pq_bits,
            init_offset,
            metric,
            pq_centroids,
            pq_codebook,
            pq_ip2l2_phi,
        )
        route += (_select_params(sink_size, window_size, heavy_size, init_offset, 1 << pq_bits, 1 << 62),)
        if sig is not None:
            if len(_CHECKED) >= _MAX_CHECKED:
                _CHECKED.clear()
            _CHECKED[sig] = route
    kernel, bucketed, long_params = route
    B, H = query.shape[:2]
    Hkv, N = key.shape[1], key.shape[2]
    M, C = pq_group_factor, 1 << pq_bits
    phi = None if pq_ip2l2_phi is None or metric != "ip" else pq_ip2l2_phi.reshape(B, Hkv, M)
    n_quantized = pq_codebook.shape[1]
    rows = N - init_offset
    if rows < n_quantized:
        raise ValueError(
            f"key: expected at least init_offset + n_quantized = {init_offset + n_quantized} tokens, "
            f"got N={N}"
        )
    q = query[:, :, -1]
    threshold = heavy_size + init_offset + 1 + C
    buf, state, looped = codebook_buffer(pq_codebook, init_offset, rows)
    state.repeat = None
    codebook = buf[:, init_offset : init_offset + rows]
    new_keys = key[:, :, init_offset + n_quantized :]
    if kernel:
        new_keys = new_keys if new_keys.stride(-1) == 1 else new_keys.contiguous()
        q = q if q.stride(-1) == 1 else q.contiguous()
        cent = pq_centroids if pq_centroids.stride(-1) == 1 else pq_centroids.contiguous()
        params = long_params
        if threshold > N:  # a short row: the width depends on N
            params = _select_params(sink_size, window_size, heavy_size, init_offset, C, N)
        out = Selection(
            torch.empty(B, H, params.width, dtype=torch.int64, device=query.device),
            torch.empty(B, H, dtype=torch.int64, device=query.device),
        )
        weights = torch.empty(B, H, N, dtype=weight_list_dtype, device=query.device)
        if looped and bucketed:
            # what a kept launch depends on beyond its tensors' addresses; only a call that
            # repeats the last one's N can be replayed (a decode loop's N grows: no key then)
            replay = None
            if sig is not None and state.last_n == N:
                tensors = (q, new_keys, cent) + ((phi,) if phi is not None else ())
                aligned = tuple(t.data_ptr() & 15 == 0 for t in tensors)
                replay = (sig, query.stride(), key.stride(), cent.stride(), aligned)
            state.last_n = N
            replayed = _select_from_buckets(
                state, buf, q, cent, phi, new_keys, n_quantized, N, params, out, weights, replay
            )
            views = query.stride(-1) == key.stride(-1) == pq_centroids.stride(-1) == 1
            if replayed and views and (phi is None or pq_ip2l2_phi.is_contiguous()):
                state.repeat = _Repeat(args, pq_codebook, buf._version, rows, params.width)
        else:
            dispatch.encode(new_keys, cent, phi, buf.transpose(1, 2), row0=init_offset + n_quantized)
            dispatch.select(
                q,
                cent,
                codebook.transpose(1, 2),  # [B, Hkv, rows, M]: row r holds token init_offset + r
                torch.full((B,), N, dtype=torch.int64, device=query.device),
                params,
                out=out,
                workspace=_workspace(query.device, B * H, M, C, N, heavy_size),
                weights=weights,
                code_base=init_offset,
                n_tokens=N,
            )
        return _returned_lists((out.positions, out.counts, weights, pq_centroids, codebook, pq_ip2l2_phi), N)
    codes = codebook.transpose(1, 2)  # [B, Hkv, rows, M] view: code of token init_offset + r
    if new_keys.shape[2]:
        codes[:, :, n_quantized:] = ref.encode(new_keys, pq_centroids, phi, metric).long()
    full_codes = torch.zeros(B, Hkv, N, M, dtype=torch.uint8, device=query.device)
    full_codes[:, :, init_offset:] = codes.to(torch.uint8)
    sel = ref.select_pq(
        q,
        pq_centroids,
        full_codes,
        torch.full((B,), N, dtype=torch.int64, device=query.device),
        sink=sink_size,
        window=window_size,
        heavy=heavy_size,
        init_offset=init_offset,
        short_threshold=threshold,
    )
    weights = ref.dense_weights(sel, N, weight_list_dtype)
    return sel.positions.long(), sel.counts.long(), weights, pq_centroids, codebook, pq_ip2l2_phi


def _select_params(
    sink: int, window: int, heavy: int, init_offset: int, C: int, n_tokens: int
) -> SelectParams:
    """The original's selection sizes (SPEC §5): candidates from max(init_offset, sink), and rows
    of at most heavy + init_offset + 1 + C tokens keep every token."""
    return SelectParams.make(
        sink=sink,
        window=window,
        heavy=heavy,
        cand_lo=max(init_offset, sink),
        short_threshold=heavy + init_offset + 1 + C,
        n_tokens=n_tokens,
    )


def _check_call(
    query: torch.Tensor,
    key: torch.Tensor,
    weight_list_dtype: torch.dtype,
    sink_size: int,
    window_size: int,
    heavy_size: int,
    pq_group_factor: int,
    pq_bits: int,
    init_offset: int,
    metric: str,
    pq_centroids: torch.Tensor,
    pq_codebook: torch.Tensor,
    pq_ip2l2_phi: torch.Tensor | None,
) -> tuple[bool, bool]:
    """indexer_next's argument checks but those of N and the codebook's length; returns the route:
    (the Triton kernels, with the buckets)."""
    check.tensor("query", query, shape=(None,) * 4, dims="[B, H, Sq, D]", dtypes=check.FLOAT_DTYPES)
    B, H, _, D = query.shape
    check.tensor(
        "key",
        key,
        shape=(B, None, None, D),
        dims="[B, Hkv, N, D]",
        dtypes=check.FLOAT_DTYPES,
        device=query.device,
    )
    Hkv = key.shape[1]
    check.gqa(H, Hkv)
    if not isinstance(weight_list_dtype, torch.dtype) or not weight_list_dtype.is_floating_point:
        raise TypeError(f"weight_list_dtype: expected a floating torch.dtype, got {weight_list_dtype!r}")
    M, C = pq_group_factor, 1 << check.bits(pq_bits)
    check.subvectors(M, D)
    check.metric(metric)
    for name, value in (
        ("sink_size", sink_size),
        ("window_size", window_size),
        ("heavy_size", heavy_size),
        ("init_offset", init_offset),
    ):
        check.non_negative_int(name, value)
    dsub = D // M + (metric == "ip")
    check.tensor(
        "pq_centroids",
        pq_centroids,
        shape=(B, Hkv, M, C, dsub),
        dims="[B, Hkv, M, C, dsub(+1)]",
        dtypes=check.FLOAT_DTYPES,
        device=query.device,
    )
    check.tensor(
        "pq_codebook",
        pq_codebook,
        shape=(B, None, Hkv, M),
        dims="[B, n_quantized, Hkv, M]",
        dtypes=(torch.int64,),
        device=query.device,
    )
    if metric == "ip":
        if pq_ip2l2_phi is None:
            raise ValueError("pq_ip2l2_phi: the ip metric needs phi [B * Hkv * M], got None")
        check.tensor(
            "pq_ip2l2_phi",
            pq_ip2l2_phi.reshape(-1),
            shape=(B * Hkv * M,),
            dims="[B * Hkv * M]",
            dtypes=check.FLOAT_DTYPES,
            device=query.device,
        )
    kernel = dispatch.kernel_path(query[:, :, -1], pq_centroids, heavy_size)
    return kernel, kernel and dispatch.uses_histogram(M, C)


def _select_from_buckets(
    state: _State,
    buf: torch.Tensor,
    q: torch.Tensor,
    centroids: torch.Tensor,
    phi: torch.Tensor | None,
    new_keys: torch.Tensor,
    n_quantized: int,
    N: int,
    params: SelectParams,
    out: Selection,
    weights: torch.Tensor,
    replay: tuple | None = None,
) -> bool:
    """The kernel path of a call that passed back a codebook of ours: the new keys' codes (and the
    histogram, and the lengths on the device) in one launch, the bucket selection in another
    (launched early behind it). A decode loop's call (one new key, at most two rows re-sent, no
    rebuild due) is one launch: the bucket selection encodes the key itself
    (pqattn.kernels.select.NewKey). When the state does not describe the codebook it was given (see the
    module's docstring), the codes are written first and the histogram and buckets counted from
    them.

    replay: the call's signature beyond N (shapes, strides, dtypes, options, alignments). The
    one-launch call keeps its launch as a plan on the state when the same signature, N and
    re-sent rows came twice in a row (the original's benchmark re-sends one codebook), and
    replays it from the third call on, skipping the launch's host work. Returns whether it
    replayed."""
    M, C = centroids.shape[2], centroids.shape[3]
    window, cand_lo = params.window, params.cand_lo
    codes = buf.transpose(1, 2)  # [B, Hkv, init_offset + capacity, M]: token p at row p
    layout = (window, cand_lo, C, M)
    n_drop = state.rows - n_quantized  # rows the caller sends again (0 in a decode loop)
    steady = state.layout == layout and state.version == buf._version and 0 <= n_drop <= window
    rebuild = max(N - window, cand_lo) < state.frozen_at or N - state.bucketed_at >= PQIndex.REINDEX_AFTER
    new_key = None
    if steady and not rebuild and new_keys.shape[2] == 1 and n_drop <= min(2, window - 1):
        new_key = dispatch.NewKey(new_keys, phi, N, n_drop)  # a decode loop's call: one launch
    elif steady:
        dispatch.encode(
            new_keys,
            centroids,
            phi,
            codes,
            base=state.lengths,
            hist=state.hist,
            window=window,
            cand_lo=cand_lo,
            advance=state.arrivals,
            row0=-n_drop,
            n_drop=n_drop,
        )
        if rebuild:
            state.rebuild(codes, N, layout)
    else:
        dispatch.encode(new_keys, centroids, phi, codes, row0=state.init_offset + n_quantized)
        state.rebuild(codes, N, layout)
    key = None if new_key is None or replay is None else (replay, N, n_drop)
    replayed = _bucket_select(state, key, q, centroids, codes, params, out, weights, new_key)
    state.rows = N - state.init_offset
    state.version = buf._version
    return replayed


def _bucket_select(
    state: _State,
    key: tuple | None,
    q: torch.Tensor,
    centroids: torch.Tensor,
    codes: torch.Tensor,
    params: SelectParams,
    out: Selection,
    weights: torch.Tensor,
    new_key: dispatch.NewKey | None,
) -> bool:
    """The bucket selection over the state's buckets. A one-launch call with a `key` is replayed
    from the state's plan when the key matches it (returns True), and recorded into one when the
    key also came last time."""
    inputs = (q, centroids, codes, out.positions, out.counts, weights)
    if new_key is not None:
        inputs += (new_key.keys,) if new_key.phi is None else (new_key.keys, new_key.phi)
    if key is not None and state.plan is not None and state.plan[0] == key:
        state.plan[1](*inputs)
        return True
    B, H, _ = q.shape
    M, C = centroids.shape[2], centroids.shape[3]
    workspace = state.workspace_for(B * H, M, C, params.heavy)
    with recording() if key is not None and state.last_key == key else nullcontext() as rec:
        dispatch.select(
            q,
            centroids,
            codes,
            state.lengths,
            params,
            out=out,
            workspace=workspace,
            histogram=state.hist,
            buckets=state.buckets,
            weights=weights,
            after_encode=new_key is None,
            new_key=new_key,
        )
    if rec is not None:
        plan = Plan.build(rec, inputs, (state.lengths, state.hist, *state.buckets, workspace))
        state.plan = None if plan is None else (key, plan)
    state.last_key = key
    return False


def _returned_lists(outputs: tuple, n_tokens: int) -> tuple:
    """indexer_next's outputs, its (sparse_list, sparse_len) recorded as its own over n_tokens."""
    positions, counts = outputs[0], outputs[1]
    if len(_OWN_LISTS) >= _MAX_OWN_LISTS:
        _OWN_LISTS.clear()
    _OWN_LISTS[id(positions)] = (
        weakref.ref(positions), weakref.ref(counts), positions._version, counts._version, n_tokens
    )  # fmt: skip
    return outputs


def _own_lists(positions: torch.Tensor, counts: torch.Tensor, n_tokens: int) -> bool:
    """True when (positions, counts) are lists indexer_next returned over at most n_tokens tokens,
    not changed in place since."""
    own = _OWN_LISTS.get(id(positions))
    return (
        own is not None
        and own[0]() is positions
        and own[1]() is counts
        and own[2] == positions._version
        and own[3] == counts._version
        and own[4] <= n_tokens
    )


def sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sparse_list: torch.Tensor,
    sparse_len: torch.Tensor,
    weight_list: torch.Tensor,
) -> torch.Tensor:
    """The original's sparse attention call (SPEC §5) on pqattn's split-K decode kernel.

    query [B, H, D]; key, value [B, Hkv, N, D]; sparse_list [B, H, L] int64 (first sparse_len valid);
    sparse_len [B, H] int64; weight_list [B, H, N] (dense, by token position; 0 drops a token).
    Returns [B, H, D] in query's dtype. The lists are checked (sparse_len in [0, L], the listed
    positions in [0, N)) with one host read, as the original read the longest list on the host
    (on a GPU one launch flags the bad rows and the host reads a byte a row); none under CUDA
    graph capture, and none for the lists indexer_next returned (valid by construction) over at
    most N tokens while no torch op has changed them in place. On the kernel path the decode
    launch is kept as a plan per signature of the arguments (ops.sparse_decode given its
    buffers), with a workspace kept per device and list shape: calls on one device must not run
    concurrently on different streams.
    """
    kernel = (
        isinstance(query, torch.Tensor)
        and isinstance(sparse_list, torch.Tensor)
        and isinstance(sparse_len, torch.Tensor)
        and isinstance(key, torch.Tensor)
        and query.dim() == 3
        and sparse_list.dim() == 3
        and key.dim() == 4
        and dispatch.decode_kernel_path(query)
    )
    if not kernel:  # the reference path, or arguments whose checks say what is wrong
        return ops.sparse_decode(query, key, value, sparse_list, sparse_len, weight_list, dense_weights=True)
    if not _own_lists(sparse_list, sparse_len, key.shape[2]):
        ops.validate_selection(sparse_list, sparse_len, key.shape[2])
    B, H, D = query.shape
    out = torch.empty(B, H, D, dtype=query.dtype, device=query.device)
    workspace = _decode_workspace(query.device, B * H, sparse_list.shape[2], D)
    return ops.sparse_decode(
        query,
        key,
        value,
        sparse_list,
        sparse_len,
        weight_list,
        dense_weights=True,
        out=out,
        workspace=workspace,
    )


_DECODE_WORKSPACES: dict[tuple[torch.device, int, int, int], torch.Tensor] = {}
_MAX_DECODE_WORKSPACES = 16


def _decode_workspace(device: torch.device, rows: int, width: int, D: int) -> torch.Tensor:
    """sparse_attention's zero-filled decode workspace for (rows, width, D) on `device`; the
    decode kernel leaves it zeroed for the next call."""
    key = (device, rows, width, D)
    workspace = _DECODE_WORKSPACES.get(key)
    if workspace is None:
        if len(_DECODE_WORKSPACES) >= _MAX_DECODE_WORKSPACES:
            _DECODE_WORKSPACES.clear()
        numel = dispatch.decode_workspace_numel(rows, width, D)
        workspace = _DECODE_WORKSPACES[key] = torch.zeros(numel, dtype=torch.int32, device=device)
    return workspace
