"""Argument checks shared by the public API.

Every failure names the argument, what was expected and what was given, so that a caller who
passes a [B, H, N, D] tensor where [B, H, D] was meant learns it from the message alone.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from pqattn.reference.selection import GROUP_RULES, SHARES

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int32, torch.int64)
METRICS = ("euclidean", "ip")


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def tensor(
    name: str,
    t: object,
    *,
    shape: Sequence[int | None] | None = None,
    dims: str | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check `t` is a tensor of the given rank/shape (None = any size), dtype set and device.

    `dims` names the axes for the message, e.g. "[B, H, D]".
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        got = t.shape
        ok = len(got) == len(shape)
        if ok:  # a plain loop: this runs on every decode-path call, generators cost more
            for w, s in zip(shape, got, strict=True):
                if w is not None and w != s:
                    ok = False
                    break
        if not ok:
            shown = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
            label = f" {dims}" if dims else ""
            raise ValueError(f"{name}: expected shape{label} = {shown}, got {list(got)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_dtype_names(dtypes)}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    return t


def same_device(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(
                f"{name}: expected device {ref.device} (the device of {ref_name}), got {t.device}"
            )


def non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected a non-negative int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value}")
    return value


def real(name: str, value: object, expected: str) -> float:
    """value as a float when it is a real number (a bool is not), else a TypeError: `expected`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")
    return float(value)


def scale(value: object) -> float | None:
    """An attention scale: None (1/sqrt(D)) or a finite real number."""
    if value is None:
        return None
    value = real("scale", value, "a finite float or None")
    if not math.isfinite(value):
        raise ValueError(f"scale: expected a finite float or None, got {value}")
    return value


def kv_head_share(head_offset: object, total_heads: object, kv_heads: int) -> None:
    """head_offset / total_heads of keys with kv_heads heads: a share of a larger cache's heads."""
    non_negative_int("head_offset", head_offset)
    if total_heads is None:
        if head_offset:
            raise ValueError(
                f"total_heads: expected the cache's KV heads with head_offset={head_offset}, got None"
            )
        return
    positive_int("total_heads", total_heads)
    if head_offset + kv_heads > total_heads:
        raise ValueError(
            f"head_offset: expected head_offset + Hkv <= total_heads={total_heads}, got "
            f"{head_offset} + {kv_heads}"
        )


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return value


def bits(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"bits: expected an int in 1..8, got {type(value).__name__} {value!r}")
    if not 1 <= value <= 8:
        raise ValueError(f"bits: expected an int in 1..8, got {value}")
    return value


def metric(value: object) -> str:
    if value not in METRICS:
        raise ValueError(f"metric: expected one of {METRICS}, got {value!r}")
    return value  # type: ignore[return-value]


def subvectors(value: object, head_dim: int) -> int:
    positive_int("subvectors", value)
    if head_dim % value:  # type: ignore[operator]
        raise ValueError(
            f"subvectors: head dim D={head_dim} must be divisible by the sub-vector count M, got M={value}"
        )
    return value  # type: ignore[return-value]


def gqa(num_heads: int, kv_heads: int, q_name: str = "q", kv_name: str = "keys") -> int:
    if kv_heads == 0 or num_heads % kv_heads:
        raise ValueError(
            f"{q_name}/{kv_name}: query heads H must be a multiple of key/value heads Hkv, "
            f"got H={num_heads}, Hkv={kv_heads}"
        )
    return num_heads // kv_heads


def lengths(value: object, batch: int, capacity: int, device: torch.device) -> torch.Tensor:
    """Per-sequence token counts as an int64 tensor [B] on `device`; None means all `capacity`.

    Reading the values to check them against `capacity` costs a host sync when they live on a GPU:
    this is called on prefill/build paths only, never per decode step.
    """
    if value is None:
        return torch.full((batch,), capacity, dtype=torch.int64, device=device)
    if isinstance(value, (list, tuple)):
        value = torch.tensor(value, dtype=torch.int64)
    tensor("lengths", value, shape=(batch,), dims="[B]", dtypes=INT_DTYPES)
    host = value.detach().to("cpu")
    if bool((host < 0).any()):
        raise ValueError(f"lengths: expected non-negative token counts, got {host.tolist()}")
    if bool((host > capacity).any()):
        raise ValueError(f"lengths: expected every length <= {capacity} (capacity), got {host.tolist()}")
    return value.to(device=device, dtype=torch.int64)


# ---- the API's composite checks (shared by pqattn.ops, PQIndex and the integrations) ----


def key_cache(name: str, keys: torch.Tensor) -> torch.Tensor:
    """keys [B, Hkv, N, D] of a floating dtype, B >= 1, on a device that holds data."""
    tensor(name, keys, shape=(None,) * 4, dims="[B, Hkv, N, D]", dtypes=FLOAT_DTYPES)
    if keys.shape[0] == 0:
        raise ValueError(f"{name}: expected at least one sequence (B >= 1), got shape {list(keys.shape)}")
    if keys.is_meta:
        raise ValueError(f"{name}: expected a tensor with data (cpu or cuda), got one on the meta device")
    return keys


def paged_cache(
    k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor, batch: int | None
) -> tuple[int, int, int, int]:
    """k, v paged [num_blocks, P, Hkv, D] of one floating dtype and a block table [B, max_blocks]
    of block indices in [0, num_blocks) (SPEC §8). Returns (B, Hkv, N = max_blocks * P, D)."""
    tensor("k", k, shape=(None,) * 4, dims="[num_blocks, P, Hkv, D]", dtypes=FLOAT_DTYPES)
    blocks, P, Hkv, D = k.shape
    tensor("v", v, shape=k.shape, dims="[num_blocks, P, Hkv, D]", dtypes=(k.dtype,), device=k.device)
    tensor("block_table", block_table, shape=(batch, None), dims="[B, max_blocks]", dtypes=INT_DTYPES)
    if block_table.device != k.device:
        raise ValueError(f"block_table: expected device {k.device} (the cache's), got {block_table.device}")
    B, max_blocks = block_table.shape
    if B == 0 or P == 0:
        raise ValueError(f"block_table, k: expected B >= 1 and P >= 1, got B={B}, P={P}")
    if checking_values(block_table):
        bad = (block_table < 0) | (block_table >= blocks)
        if bool(bad.any()):
            at = tuple(bad.nonzero()[0].tolist())
            raise ValueError(
                f"block_table: expected block indices in [0, {blocks}) (num_blocks), "
                f"got {int(block_table[at])} at {at}"
            )
    return B, Hkv, max_blocks * P, D


def checking_values(t: torch.Tensor) -> bool:
    """Whether a validating call reads `t`'s values to check them: always on the CPU; on a GPU (one
    host sync) unless a CUDA graph is being captured, which cannot sync."""
    return not t.is_cuda or not torch.cuda.is_current_stream_capturing()


def length_values(lengths: torch.Tensor, n_tokens: int, name: str = "lengths") -> None:
    if not checking_values(lengths):
        return
    host = lengths.detach().cpu()
    if bool(((host < 0) | (host > n_tokens)).any()):
        raise ValueError(f"{name}: expected token counts in [0, {n_tokens}] (N), got {host.tolist()}")


def start_values(starts: torch.Tensor, counts: torch.Tensor) -> None:
    """starts[b] in [0, counts[b]] (each sequence's first token, at or before its last)."""
    if not checking_values(starts):
        return
    first, last = starts.detach().cpu().long(), counts.detach().cpu().long()
    if bool(((first < 0) | (first > last)).any()):
        raise ValueError(
            f"starts: expected each in [0, counts[b]] (counts {last.tolist()}), got {first.tolist()}"
        )


def selection_values(positions: torch.Tensor, counts: torch.Tensor, n_tokens: int) -> None:
    """counts in [0, L] and the first counts[b, h] positions of each row in [0, N)."""
    if not checking_values(positions):
        return
    L = positions.shape[-1]
    cnt = counts.detach().cpu()
    bad = (cnt < 0) | (cnt > L)
    if bool(bad.any()):
        at = tuple(bad.nonzero()[0].tolist())
        raise ValueError(
            f"counts: expected values in [0, {L}] (L, the positions' width), got {int(cnt[at])} at {at}"
        )
    pos = positions.detach().cpu().long()
    live = torch.arange(L) < cnt[..., None]
    bad = live & ((pos < 0) | (pos >= n_tokens))
    if bool(bad.any()):
        at = tuple(bad.nonzero()[0].tolist())
        raise ValueError(
            f"positions: expected the first counts[b, h] entries of each row in [0, {n_tokens}) (N), "
            f"got {int(pos[at])} at {at}"
        )


def centroids_and_codes(centroids: torch.Tensor, codes: torch.Tensor) -> tuple[int, int, int]:
    """Returns (B, Hkv, M) after checking centroids [B, Hkv, M, C, d] against codes [B, Hkv, N, M]."""
    tensor("centroids", centroids, shape=(None,) * 5, dims="[B, Hkv, M, C, dsub(+1)]", dtypes=FLOAT_DTYPES)
    B, Hkv, M, C, _ = centroids.shape
    if C & (C - 1) or not 2 <= C <= 256:
        raise ValueError(f"centroids: expected C = 2**bits with bits in 1..8 on axis 3, got C={C}")
    tensor("codes", codes, shape=(B, Hkv, None, M), dims="[B, Hkv, N, M]", dtypes=(torch.uint8,))
    same_device("centroids", centroids, codes=codes)
    return B, Hkv, M


def query(q: torch.Tensor, B: int, Hkv: int, D: int | None, device: torch.device) -> int:
    tensor("q", q, shape=(B, None, D), dims="[B, H, D]", dtypes=FLOAT_DTYPES, device=device)
    return gqa(q.shape[1], Hkv)


def batch_lengths(lengths: torch.Tensor, B: int, device: torch.device) -> torch.Tensor:
    return tensor("lengths", lengths, shape=(B,), dims="[B]", dtypes=INT_DTYPES, device=device)


def sizes(sink: int, window: int, heavy: int, init_offset: int) -> None:
    for name, value in (("sink", sink), ("window", window), ("heavy", heavy), ("init_offset", init_offset)):
        non_negative_int(name, value)


def score_inputs(q: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor) -> None:
    B, Hkv, M = centroids_and_codes(centroids, codes)
    query(q, B, Hkv, None, centroids.device)
    D, width = q.shape[-1], centroids.shape[-1]
    if D not in (M * width, M * (width - 1)):  # either may be the wrong one: name both
        dsub = D // M
        raise ValueError(
            f"q / centroids: q's head dim D={D} and the centroids' {width} values per sub-vector "
            f"disagree: expected q with D = M x dsub = {M * width} (or {M * (width - 1)} for an ip "
            f"index), or centroids with last dim dsub={dsub} (or dsub+1={dsub + 1}) for D={D}, M={M}, "
            f"got {width}"
        )
    subvectors(M, D)


def exact_selection_inputs(
    q: torch.Tensor,
    keys: torch.Tensor,
    lengths: torch.Tensor,
    sink: int,
    window: int,
    heavy: int,
    init_offset: int,
) -> None:
    """The checks of a selection that reads the keys themselves (oracle, pages)."""
    key_cache("keys", keys)
    B, Hkv, _, D = keys.shape
    query(q, B, Hkv, D, keys.device)
    batch_lengths(lengths, B, keys.device)
    sizes(sink, window, heavy, init_offset)


def share_options(share: str, group_rule: str, rerank: int, group_budget: float | None = None) -> None:
    """A selection's sharing (SPEC §7): share in SHARES, group_rule in GROUP_RULES,
    rerank a non-negative int, group_budget None or a positive number (heavies per group)."""
    if share not in SHARES:
        raise ValueError(f"share: expected one of {SHARES}, got {share!r}")
    if group_rule not in GROUP_RULES:
        raise ValueError(f"group_rule: expected one of {GROUP_RULES}, got {group_rule!r}")
    if isinstance(rerank, bool) or not isinstance(rerank, int) or rerank < 0:
        raise ValueError(f"rerank: expected a non-negative int, got {rerank!r}")
    if group_budget is not None and (
        isinstance(group_budget, bool)
        or not isinstance(group_budget, (int, float))
        or not 0 < group_budget < math.inf
    ):
        raise ValueError(f"group_budget: expected None or a positive number, got {group_budget!r}")


def build_sample(sample: int | None, metric: str) -> None:
    """A build's sample: None (the metric's default) or keys per centroid >= 0, 0 for ip."""
    if sample is None:
        return
    non_negative_int("sample", sample)
    if sample and metric != "euclidean":
        raise ValueError(f"sample: the {metric!r} metric builds on every key, got sample={sample}")
