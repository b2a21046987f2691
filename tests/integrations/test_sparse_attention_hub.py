"""The original's entry point: signature, layouts, the original's short rule, the checker's rules."""

from __future__ import annotations

import pytest
import torch

from pqattn import reference as ref
from pqattn.integrations import sparse_attention_hub as sah
from pqattn.integrations.sparse_attention_hub import codebook_buffer, indexer_next, sparse_attention
from pqattn.lab.kernel_checks import selection_problem
from pqattn.reference import Selection
from pqattn.runtime.launch import Address
from tests.helpers import count_plan_replays


def make_call(
    device,
    *,
    B=1,
    H=8,
    Hkv=4,
    N=400,
    D=32,
    M=2,
    bits=4,
    io=8,
    sink=8,
    window=8,
    heavy=16,
    metric="euclidean",
    fresh=1,
):
    keys = torch.randn(B, Hkv, N, D, device=device)
    lengths = torch.full((B,), N - fresh, device=device)
    book = ref.build_pq(
        keys[:, :, : N - fresh], lengths, subvectors=M, bits=bits, metric=metric, init_offset=io, iters=3
    )
    codebook = book.codes[:, :, io:].long().transpose(1, 2).contiguous()  # [B, n_quantized, Hkv, M]
    phi = book.phi.reshape(-1) if metric == "ip" else None
    query = torch.randn(B, H, 1, D, device=device)
    args = (
        query,
        keys,
        torch.float32,
        sink,
        window,
        heavy,
        M,
        bits,
        3,
        io,
        metric,
        book.centroids,
        codebook,
        phi,
    )
    return args, keys, book


def check_selection(args, sparse_list, sparse_len, weights, codebook) -> None:
    """The outputs of indexer_next(*args) by the checker's rules, against the reference over the
    returned codebook: counts exactly, the heavy part as score multisets, dense weights exactly."""
    query, key, _, sink, window, heavy, M, bits, _, io, _, cent = args[:12]
    B, Hkv, N = key.shape[:3]
    codes = torch.zeros(B, Hkv, N, M, dtype=torch.uint8, device=key.device)
    codes[:, :, io:] = codebook.transpose(1, 2).to(torch.uint8)
    scores = ref.pq_scores(query[:, :, -1].double(), cent.double(), codes)
    lengths = torch.full((B,), N, device=key.device)
    threshold = heavy + io + 1 + 2**bits
    want = ref.select_from_scores(
        scores, lengths, sink=sink, window=window, heavy=heavy, init_offset=io, short_threshold=threshold
    )
    assert torch.equal(sparse_len, want.counts.long())
    problem = selection_problem(
        sparse_list,
        sparse_len,
        scores,
        lengths,
        cand_lo=max(io, sink),
        window=window,
        short_threshold=threshold,
        ref_sel=want,
    )
    assert problem is None, (N, problem)
    assert torch.equal(weights, ref.dense_weights(ref.Selection(sparse_list, sparse_len), N))


@pytest.mark.parametrize("metric", ["euclidean", "ip"])
@pytest.mark.parametrize("fresh", [1, 5])
def test_outputs_follow_the_original_contract(metric: str, fresh: int, device: torch.device) -> None:
    args, keys, _ = make_call(device, metric=metric, fresh=fresh)
    _, _, _, sink, window, heavy, M, bits, _, io, _, cent, codebook, phi = args
    sparse_list, sparse_len, weights, cent_out, codebook_out, phi_out = indexer_next(*args)
    B, H, N = 1, 8, keys.shape[2]
    assert sparse_list.dtype == sparse_len.dtype == torch.int64 and weights.dtype == torch.float32
    # L = sink + heavy + window, widened to the short rule's threshold when that is larger (here 41).
    width = max(sink + heavy + window, min(heavy + io + 1 + 2**bits, N))
    assert sparse_list.shape == (B, H, width) and weights.shape == (B, H, N)
    assert cent_out is cent and phi_out is phi
    # The codebook gains the codes of the keys after init_offset + n_quantized, encoded like the reference.
    assert codebook_out.shape == (B, N - io, 4, M)
    assert torch.equal(codebook_out[:, : codebook.shape[1]], codebook)
    new = ref.encode(keys[:, :, N - fresh :], cent, None if phi is None else phi.reshape(B, 4, M), metric)
    assert torch.equal(codebook_out[:, codebook.shape[1] :].transpose(1, 2), new.long())
    check_selection(args, sparse_list, sparse_len, weights, codebook_out)
    assert (sparse_list[..., :sink] == torch.arange(sink, device=device)).all(), "sink positions come first"


def test_original_short_rule(device: torch.device) -> None:
    """n <= heavy + init_offset + 1 + C keeps every token, even when n > sink + heavy + window."""
    args, keys, _ = make_call(
        device, N=50, io=4, sink=4, window=4, heavy=8, bits=4
    )  # threshold 29 + ... = 29
    args = list(args)
    args[1] = keys[:, :, :29]
    args[12] = args[12][:, : 29 - 4 - 1]
    sparse_list, sparse_len, weights, *_ = indexer_next(*args)
    assert (sparse_len == 29).all() and sparse_list.shape[-1] == 29
    assert (weights == 1).all()


def test_codebook_grows_in_place(device: torch.device) -> None:
    args, keys, _ = make_call(device, N=300, fresh=2)  # 290 keys quantized
    args = list(args)
    args[1] = keys[:, :, :299]
    *_, cb1, _ = indexer_next(*args)
    args[1], args[12] = keys, cb1
    *_, cb2, _ = indexer_next(*args)
    assert cb2.data_ptr() == cb1.data_ptr() and cb2.shape[1] == cb1.shape[1] + 1
    assert cb1.shape[1] == 299 - 8


def test_bad_inputs(device: torch.device) -> None:
    args, _, _ = make_call(device)
    bad = list(args)
    bad[12] = bad[12].int()
    with pytest.raises(TypeError, match="pq_codebook"):
        indexer_next(*bad)
    bad = list(args)
    bad[10] = "ip"
    with pytest.raises(ValueError, match=r"pq_centroids|pq_ip2l2_phi"):
        indexer_next(*bad)


def test_sparse_attention_takes_the_originals_outputs(device: torch.device, kernel_routes) -> None:
    """indexer_next's (sparse_list, sparse_len, weight_list) feed the attention call directly
    (the kernels, against the reference)."""
    args, keys, _ = make_call(device, N=500)
    sparse_list, sparse_len, weight_list, *_ = indexer_next(*args)
    query = args[0][:, :, -1]
    values = torch.randn_like(keys)
    got = sparse_attention(query, keys, values, sparse_list, sparse_len, weight_list)
    want = ref.sparse_decode(query.double(), keys.double(), values.double(), sparse_list, sparse_len)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # a zero weight drops its token, as the original's weight list does
    dropped = weight_list.clone()
    dropped[..., :8] = 0.0
    got = sparse_attention(query, keys, values, sparse_list, sparse_len, dropped)
    keep = torch.where(sparse_list >= 8, sparse_list, -1)
    order = keep.sort(-1, descending=True).values
    want = ref.sparse_decode(query.double(), keys.double(), values.double(), order, (order >= 0).sum(-1))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_sparse_attention_replays_its_launch_and_checks_every_call(
    kernel_routes, device: torch.device, monkeypatch
) -> None:
    """Calls of one signature replay the kept decode launch (new tensors each call, results
    against the reference), and every call still checks the lists' values."""
    replays = count_plan_replays(monkeypatch)
    B, H, Hkv, N, D, L = 2, 8, 4, 300, 32, 24
    for _ in range(4):  # the kernel compiles (tunes), records, then replays
        before = replays[0]
        query = torch.randn(B, H, D, device=device)
        keys, values = torch.randn(B, Hkv, N, D, device=device), torch.randn(B, Hkv, N, D, device=device)
        sparse_list = torch.stack([torch.randperm(N, device=device)[:L] for _ in range(B * H)]).view(B, H, L)
        sparse_len = torch.randint(1, L + 1, (B, H), device=device)
        weights = ref.dense_weights(Selection(sparse_list, sparse_len), N)
        got = sparse_attention(query, keys, values, sparse_list, sparse_len, weights)
        want = ref.sparse_decode(query.double(), keys.double(), values.double(), sparse_list, sparse_len)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert replays[0] == before + 1
    replayed = replays[0]
    sparse_list[1, 2, 0] = N
    sparse_len[1, 2] = L
    with pytest.raises(ValueError, match=r"positions.*\[0, 300\).*got 300"):
        sparse_attention(query, keys, values, sparse_list, sparse_len, weights)
    assert replays[0] == replayed


def test_sparse_attention_trusts_only_indexer_nexts_unchanged_lists(
    kernel_routes, device: torch.device, monkeypatch
) -> None:
    """The lists indexer_next returned skip the value check (no launch, no host read); a copy, a
    cache of fewer tokens than they were selected over, or an in-place change brings it back."""
    checks = []
    validate = sah.ops.validate_selection
    monkeypatch.setattr(sah.ops, "validate_selection", lambda *a: (checks.append(a[2]), validate(*a))[1])
    args, keys, _ = make_call(device, N=500)
    sparse_list, sparse_len, weight_list, *_ = indexer_next(*args)
    query, values = args[0][:, :, -1], torch.randn_like(keys)
    got = sparse_attention(query, keys, values, sparse_list, sparse_len, weight_list)
    want = ref.sparse_decode(query.double(), keys.double(), values.double(), sparse_list, sparse_len)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert checks == []
    sparse_attention(query, keys, values, sparse_list.clone(), sparse_len, weight_list)
    assert checks == [500]
    with pytest.raises(ValueError, match=r"positions.*\[0, 499\)"):  # the window lists token 499
        sparse_attention(query, keys[:, :, :499], values[:, :, :499], sparse_list, sparse_len, weight_list)
    assert checks == [500, 499]
    sparse_list[0, 0, 0] = 500  # an in-place torch op: the version counter moves
    with pytest.raises(ValueError, match=r"positions.*\[0, 500\).*got 500"):
        sparse_attention(query, keys, values, sparse_list, sparse_len, weight_list)
    assert checks == [500, 499, 500]


def test_workspace_follows_the_layout() -> None:
    """The cached workspace is reused while the tree's layout stays (N grows inside a leaf) and
    replaced by a zeroed one when it changes (N crosses a leaf boundary): the kernel's counters
    move with the layout, so stale slots would read as counters."""
    from pqattn.integrations.sparse_attention_hub import _workspace
    from pqattn.kernels.select.tree import SELECT_CONFIGS

    tile = min(c.kwargs["TILE"] for c in SELECT_CONFIGS)
    device = torch.device("cpu")  # the cache's logic; the kernel's side runs in the next test
    a = _workspace(device, 8, 2, 16, tile - 10, 16)
    a.fill_(5)  # as a call leaves its slots
    assert _workspace(device, 8, 2, 16, tile - 9, 16) is a
    b = _workspace(device, 8, 2, 16, tile + 10, 16)
    assert b is not a and not b.any()
    assert _workspace(device, 16, 2, 16, tile + 10, 16) is not b


def test_decode_steps_across_a_leaf_boundary(device: torch.device) -> None:
    """Consecutive calls whose key count crosses the smallest tile (one leaf, then two, then back):
    every call's selection follows the checker's rules."""
    from pqattn.kernels.select.tree import SELECT_CONFIGS

    tile = min(c.kwargs["TILE"] for c in SELECT_CONFIGS)
    args, keys, _ = make_call(device, N=tile + 6, io=8, sink=8, window=8, heavy=16, fresh=10)
    args = list(args)
    full = args[12]  # the codes of keys 8 (init_offset) .. tile - 4
    for n in (tile - 3, tile + 2, tile + 6, tile - 2):
        args[1] = keys[:, :, :n]
        args[12] = full[:, : min(n - 1, tile - 4) - 8]
        sparse_list, sparse_len, weights, _, codebook, _ = indexer_next(*args)
        check_selection(args, sparse_list, sparse_len, weights, codebook)


def _spied(monkeypatch) -> list[str]:
    """The names of the launchers indexer_next calls, appended as it calls them."""
    from pqattn.kernels import encode
    from pqattn.kernels.select import buckets, hist, tree

    calls: list[str] = []

    def spy(module, name: str) -> None:
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    spy(encode, "pq_encode")
    spy(buckets, "bucket_tokens")
    spy(buckets, "pq_select_buckets")
    spy(hist, "pq_select_hist")
    spy(tree, "pq_select")
    return calls


@pytest.mark.parametrize("Hkv", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("metric", ["euclidean", "ip"])
def test_a_decode_loop_selects_from_buckets(
    kernel_routes, metric: str, Hkv: int, device: torch.device, monkeypatch
) -> None:
    """Calls that pass back the returned codebook: from the second one the buffer carries the
    histogram and buckets, and a call is the encode launch and the bucket launch, through keys
    appended one or several at a time, rows re-sent (the original's benchmark: the same codebook
    every call), the candidates' end moving back, and the buckets rebuilt every REINDEX_AFTER
    tokens. A write into the codebook, a re-send of more than `window` rows or other sizes count
    them again. A call of one new key (one or two rows re-sent) is the bucket launch alone, which
    encodes it. Every call's outputs by the checker's rules,
    against the reference, and the kept histogram equal to a recount."""
    from pqattn import PQIndex

    monkeypatch.setattr(PQIndex, "REINDEX_AFTER", 5)
    sink, window, io = 8, 8, 8
    args, keys, _ = make_call(
        device, N=420, H=4, Hkv=Hkv, fresh=40, sink=sink, window=window, io=io, heavy=24, metric=metric
    )
    args = list(args)
    args[1] = keys[:, :, :381]  # 372 rows quantized: one new key
    calls = _spied(monkeypatch)
    out = indexer_next(*args)
    assert calls == ["pq_encode", "pq_select"], "a codebook from elsewhere: no state yet"
    check_selection(args, out[0], out[1], out[2], out[4])
    codebook = out[4]
    counts = ["pq_encode", "bucket_tokens", "pq_select_buckets"]
    keeps = ["pq_encode", "pq_select_buckets"]
    one = ["pq_select_buckets"]  # the key encoded by the selection
    # (tokens, rows of the last codebook passed back, the launchers)
    steps = [
        (385, 0, counts),  # the first call that passes back a codebook of ours
        (386, 0, one),  # one new key
        (389, 0, keeps),  # three
        (389, -1, one),  # the last row re-sent
        (389, -1, one),
        (388, -3, keeps),  # three re-sent, two new: the candidates' end moves back
        (395, 0, counts),  # seven new: REINDEX_AFTER tokens since the last count
        (395, -window, keeps),  # `window` rows re-sent
        (396, -window - 1, counts),  # more than that
        (397, 0, one),
        (396, -2, one),  # two re-sent, one new: the end moves back
    ]
    for n, back, want in steps:
        args[1] = keys[:, :, :n]
        args[12] = codebook[:, : codebook.shape[1] + back]
        calls.clear()
        sparse_list, sparse_len, weights, _, codebook, _ = indexer_next(*args)
        assert calls == want, (n, back)
        check_selection(args, sparse_list, sparse_len, weights, codebook)
        state = codebook._base._pqattn_state
        tokens = codebook._base.transpose(1, 2)[:, :, :n]  # (rows before init_offset: never read)
        _, starts = ref.bucket_candidates(
            tokens, torch.full((1,), n, device=device), C=16, window=window, cand_lo=max(io, sink)
        )
        assert torch.equal(state.hist.long(), starts.diff(dim=-1)), (n, back)
    # an in-place write into the codebook (any view of it) is seen: counted again, and followed
    codebook[0, 30, 0, 0] = (codebook[0, 30, 0, 0] + 1) % 16
    args[12] = codebook[:, :-1]
    calls.clear()
    sparse_list, sparse_len, weights, _, codebook, _ = indexer_next(*args)
    assert calls == counts
    check_selection(args, sparse_list, sparse_len, weights, codebook)
    # other selection sizes (sink: the candidates start elsewhere) count them again too
    args[3] = sink + 3
    calls.clear()
    sparse_list, sparse_len, weights, _, codebook, _ = indexer_next(*args)
    assert calls == counts
    check_selection(args, sparse_list, sparse_len, weights, codebook)


def test_the_state_lives_with_the_returned_view(kernel_routes, device: torch.device, monkeypatch) -> None:
    """Only the returned codebook is kept (its buffer is reachable through it alone): the next
    call still finds the histogram and buckets, and a codebook whose rows start elsewhere (another
    init_offset) is copied instead."""
    import gc

    args, keys, _ = make_call(device, N=300, fresh=3)
    args = list(args)
    args[1] = keys[:, :, :298]
    codebook = indexer_next(*args)[4]
    args[1], args[12] = keys[:, :, :299], codebook
    codebook = indexer_next(*args)[4]  # counts
    gc.collect()
    args[1], args[12] = keys, codebook
    calls = _spied(monkeypatch)
    out = indexer_next(*args)
    assert calls == ["pq_select_buckets"]  # one new key: the selection encodes it
    assert out[4].data_ptr() == codebook.data_ptr()
    check_selection(args, out[0], out[1], out[2], out[4])
    moved = list(args)
    moved[9], moved[12] = 9, out[4][:, 1:]  # init_offset 9: the same rows from token 9
    calls.clear()
    out = indexer_next(*moved)
    assert calls == ["pq_encode", "pq_select"] and out[4].data_ptr() != codebook.data_ptr()
    check_selection(moved, out[0], out[1], out[2], out[4])


def test_importing_the_cli_decorates_no_kernel() -> None:
    """The CLI's parser imports the lab's suites and through them this entry point: none of that
    may import a Triton kernel, since a caller that sets TRITON_INTERPRET for a moment (the CLI's
    own tests do, to check on a CPU) would then have interpreted kernels for the rest of the
    process, on a GPU too."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; from pqattn.cli import main; main(['check', '--kernel', 'nosuch']); "
        "print(sorted(m for m in sys.modules if m.startswith('pqattn.kernels.')))"
    )
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src), TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    # the selection package's records only: no module that decorates a kernel
    assert run.stdout.strip().splitlines()[-1] == "['pqattn.kernels.select']"


def test_the_originals_benchmark_replays_the_kept_launch(
    kernel_routes, device: torch.device, monkeypatch
) -> None:
    """The original's benchmark passes one codebook back every call (its last row re-sent, one
    new key): once a call's signature, N and re-sent rows have come twice in a row, its one
    launch is replayed from a plan on the codebook's state (no launcher's host work), and from the
    call after the first replay with the new addresses alone (no checked path). Each call's
    outputs follow the checker's rules for its own query; a query of other strides, an in-place
    write to the codebook, or a rebuild of the buckets, launches again."""
    args, keys, _ = make_call(device, N=300, fresh=3)
    args = list(args)
    args[1] = keys[:, :, :298]
    codebook = indexer_next(*args)[4]
    args[1], args[12] = keys[:, :, :299], codebook
    codebook = indexer_next(*args)[4]  # the state counts its buckets
    args[1], args[12] = keys, codebook  # from here the same codebook every call
    calls = _spied(monkeypatch)
    checked = []
    monkeypatch.setattr(sah, "codebook_buffer", lambda *a: checked.append(1) or codebook_buffer(*a))
    state = codebook._base._pqattn_state
    for i in range(6):  # 0: no row re-sent yet; 1: the signature of the rest; 2: kept; 3-5: replayed
        args[0] = torch.randn_like(args[0])
        calls.clear()
        checked.clear()
        out = indexer_next(*args)
        assert calls == (["pq_select_buckets"] if i < 3 else []), i
        assert len(checked) == (0 if i > 3 else 1), i  # from the second replay: by addresses
        assert (state.repeat is not None) == (i >= 3)
        check_selection(args, out[0], out[1], out[2], out[4])
    assert state.plan is not None
    # the repeat's inputs by address are the views the checked path passes
    repeat, buf = state.repeat, codebook._base
    call = (*args[:8], args[9], args[11], args[10], args[13])  # _Repeat's order
    sel = Selection(out[0].clone(), out[1].clone())
    for given in repeat.inputs(call, buf, sel, out[2].clone()):
        if isinstance(given, Address):
            assert given.make().data_ptr() == given.ptr
    assert repeat.inputs(call, buf, sel, out[2])[0].make().equal(args[0][:, :, -1])
    codebook[0, 0, 0, 0] = codebook[0, 0, 0, 0]  # an in-place write: counted again, launched again
    calls.clear()
    out = indexer_next(*args)
    assert calls == ["pq_encode", "bucket_tokens", "pq_select_buckets"] and state.repeat is None
    check_selection(args, out[0], out[1], out[2], out[4])
    wide = torch.randn(*args[0].shape[:3], 2 * args[0].shape[3], device=device)
    args[0] = wide[..., ::2]  # other strides: launched again
    calls.clear()
    out = indexer_next(*args)
    assert calls == ["pq_select_buckets"]
    check_selection(args, out[0], out[1], out[2], out[4])
    state.rebuild(codebook._base.transpose(1, 2), 300, state.layout)  # a rebuild drops the plan
    assert state.plan is None
