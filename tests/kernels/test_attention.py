"""The flash-attention forward kernel against the reference: every config, full and causal.

Runs under the Triton interpreter on a CPU (small shapes) and compiled on a GPU (also the
benchmark shapes). Lengths are deliberately not multiples of any block size.
"""

from __future__ import annotations

import types

import pytest
import torch
import triton

from pqattn import ops
from pqattn import reference as ref
from pqattn.kernels import attention
from pqattn.kernels.attention import ATTENTION_CONFIGS, _l2_bytes, flash_forward, rows_per_group

CONFIG_IDS = [
    f"M{c.kwargs['BLOCK_M']}-N{c.kwargs['BLOCK_N']}-w{c.num_warps}-s{c.num_stages}"
    + ("-tma" if c.kwargs["TMA"] else "")
    for c in ATTENTION_CONFIGS
]
ATOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}  # vs float64, outputs of magnitude <= ~1


def _run(device, *, B, H, Hkv, Sq, Sk, D, dtype, causal, config, scale=None, group_rows=None) -> None:
    q = torch.randn(B, H, Sq, D, device=device).to(dtype)
    k = (2 * torch.randn(B, Hkv, Sk, D, device=device)).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, device=device).to(dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, Sq), float("nan"), device=device)
    flash_forward(q, k, v, out=out, causal=causal, scale=scale, lse=lse, config=config, group_rows=group_rows)
    want, want_lse = ref.dense_attention(
        q.double(), k.double(), v.double(), causal=causal, scale=scale, return_lse=True
    )
    assert torch.isfinite(out).all(), "an output element was not written"
    err = float((out.double() - want).abs().max())
    assert err <= ATOL[dtype], f"output differs by {err:.3g}"
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), empty)
    if (~empty).any():
        assert float((lse[~empty].double() - want_lse[~empty]).abs().max()) < 1e-3


@pytest.mark.parametrize("config", ATTENTION_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape",
    [
        dict(B=1, H=2, Hkv=2, Sq=77, Sk=77, D=32),
        dict(B=2, H=4, Hkv=1, Sq=33, Sk=150, D=16),  # GQA 4, Sq < Sk: bottom-right causal
        dict(B=1, H=2, Hkv=1, Sq=70, Sk=40, D=64),  # Sq > Sk: causal rows that see no key
    ],
    ids=["square", "gqa-short-q", "long-q"],
)
def test_every_config(shape: dict, causal: bool, config: triton.Config, device: torch.device) -> None:
    _run(device, **shape, dtype=torch.float16, causal=causal, config=config)


@pytest.mark.parametrize("group_rows", [1, 3, 64])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_launch_groups(group_rows: int, causal: bool, device: torch.device) -> None:
    """A causal launch's row groups (the last one partial: 3 does not divide B * H = 8; 64 is one
    group) cover every (query block, row) once; full attention ignores the group size."""
    _run(
        device,
        B=2,
        H=4,
        Hkv=2,
        Sq=45,
        Sk=45,
        D=16,
        dtype=torch.float16,
        causal=causal,
        config=ATTENTION_CONFIGS[0],
        group_rows=group_rows,
    )


def test_rows_per_group_fits_half_the_l2(device: torch.device) -> None:
    k = torch.empty(1, 8, 4096, 128, dtype=torch.bfloat16, device=device)
    assert rows_per_group(k, 32, causal=False) == 1
    per_row = 2 * 4096 * 128 * 2 * 8 // 32  # key and value bytes of a row (4 rows share a kv head)
    n = rows_per_group(k, 32, causal=True)
    assert n & (n - 1) == 0 and n / 2**0.5 <= _l2_bytes(k.device) / (2 * per_row) <= n * 2**0.5
    huge = torch.empty(1, 1, 1 << 26, 128, dtype=torch.bfloat16, device="meta")
    assert rows_per_group(huge, 1, causal=True) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtypes_and_scale(dtype: torch.dtype, device: torch.device) -> None:
    if dtype == torch.bfloat16 and device.type != "cuda":
        pytest.skip("Triton 3.6's interpreter computes bf16 tl.dot on raw bits (compiled on the GPU)")
    _run(
        device,
        B=1,
        H=2,
        Hkv=1,
        Sq=50,
        Sk=61,
        D=32,
        dtype=dtype,
        causal=True,
        config=ATTENTION_CONFIGS[0],
        scale=0.3,
    )


def test_ops_routes_cuda_fp16_to_the_kernel(device: torch.device) -> None:
    q = torch.randn(1, 4, 40, 64, device=device, dtype=torch.float16)
    k = torch.randn(1, 2, 40, 64, device=device, dtype=torch.float16)
    assert ops.attention_kernel_path(q, k) == (device.type == "cuda")
    assert not ops.attention_kernel_path(q.float(), k.float()), "float32 takes the reference"
    out, lse = ops.dense_attention(q, k, k, causal=True, return_lse=True)
    want, want_lse = ref.dense_attention(q.double(), k.double(), k.double(), causal=True, return_lse=True)
    assert float((out.double() - want).abs().max()) < 3e-3
    assert lse.shape == (1, 4, 40) and float((lse.double() - want_lse).abs().max()) < 1e-3


def test_benchmark_shapes_on_gpu(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("full shapes run compiled on the GPU")
    for config in ATTENTION_CONFIGS:
        _run(device, B=2, H=8, Hkv=8, Sq=512, Sk=512, D=64, dtype=torch.float16, causal=False, config=config)
        _run(
            device, B=1, H=8, Hkv=2, Sq=1000, Sk=1000, D=128, dtype=torch.bfloat16, causal=True, config=config
        )
        _run(
            device, B=1, H=4, Hkv=4, Sq=129, Sk=4097, D=128, dtype=torch.bfloat16, causal=True, config=config
        )


def test_tma_configs_need_aligned_strides(device: torch.device) -> None:
    """A row stride of 33 fp16 elements (66 bytes) cannot be a TMA descriptor: a forced TMA config
    is refused, a pointer config runs."""
    q = torch.randn(1, 2, 40, 33, device=device).to(torch.float16)[..., :32]
    k = torch.randn(1, 2, 40, 32, device=device).to(torch.float16)
    out = torch.empty(1, 2, 40, 32, device=device, dtype=torch.float16)
    tma = next(c for c in ATTENTION_CONFIGS if c.kwargs["TMA"])
    with pytest.raises(ValueError, match="TMA config"):
        flash_forward(q, k, k, out=out, causal=True, config=tma)
    plain = next(c for c in ATTENTION_CONFIGS if not c.kwargs["TMA"])
    flash_forward(q, k, k, out=out, causal=True, config=plain)
    want = ref.dense_attention(q.double(), k.double(), k.double(), causal=True)
    assert float((out.double() - want).abs().max()) <= ATOL[torch.float16]


@pytest.mark.parametrize("config", [None, *ATTENTION_CONFIGS], ids=["autotuned", *CONFIG_IDS])
def test_a_repeated_call_replays_its_launch(config, monkeypatch, device: torch.device) -> None:
    """On a GPU a call that repeats an earlier call's signature launches the compiled kernel it
    remembered, on the new call's tensors (fresh data and addresses each time): after the first
    call with a forced config, after the second with an autotuned one; the JIT is then not
    reached. Under the interpreter nothing is remembered."""
    monkeypatch.setattr(attention, "_REPEATS", {})
    shape = dict(B=2, H=4, Hkv=2, Sq=100, Sk=130, D=64, dtype=torch.float16, causal=True, config=config)
    for _ in range(2):
        _run(device, **shape)
    if device.type != "cuda":
        assert attention._REPEATS == {}
        return
    (entry,) = attention._REPEATS.values()
    assert isinstance(entry, attention._Repeat)
    monkeypatch.setattr(attention, "_flash_forward_kernel", None)  # the JIT path would fail
    monkeypatch.setattr(attention, "flash_forward_autotuned", types.SimpleNamespace(best_config=None))
    for _ in range(2):
        _run(device, **shape)
    if config is None:
        assert attention.flash_forward_autotuned.best_config is entry.config, "the lab reads it"
    with pytest.raises(TypeError, match="subscriptable"):  # another signature: the JIT's
        _run(device, **{**shape, "Sq": 101})
