"""Argument checks shared by the public API.

Every failure names the argument, what was expected and what was given, so that a caller who
passes a [B, H, N, D] tensor where [B, H, D] was meant learns it from the message alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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


def positive_int(name: str, value: object) -> int:
    non_negative_int(name, value)
    if value == 0:
        raise ValueError(f"{name}: expected a positive int, got 0")
    return value  # type: ignore[return-value]


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
