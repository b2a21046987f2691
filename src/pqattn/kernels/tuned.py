"""Autotune once per key, then launch the chosen config without the autotuner.

Triton's autotuner costs tens of microseconds of host time on every call (argument dicts, its
key, hooks) on top of the JIT's own dispatch; on the decode path, where a kernel runs for a few
microseconds, that is a large share of an eager call. The first call with a key goes through the
autotuner, which benchmarks the configs; later calls with the same key launch its choice on the
kernel directly. The autotuner's `best_config` is kept current, so the lab still records the
config each call ran.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton


class TunedLauncher:
    """Wraps a `triton.autotune`d kernel whose configs have no pre-hook.

    key: the autotuner's key values (the tensors' dtypes and the device are added here, as the
    autotuner adds the dtypes to its own key); grid: config kwargs -> launch grid.
    """

    def __init__(self, autotuned: triton.runtime.Autotuner) -> None:
        if any(c.pre_hook is not None for c in autotuned.configs):
            raise ValueError("autotuned: configs with a pre-hook must run through the autotuner")
        self.autotuned = autotuned
        self.chosen: dict[tuple, triton.Config] = {}

    def __call__(self, key: tuple, grid: Callable[[dict], tuple], args: tuple, meta: dict) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        full_key = (*key, tensors[0].device, *(a.dtype for a in tensors))
        config = self.chosen.get(full_key)
        if config is None:
            self.autotuned[grid](*args, **meta)
            self.chosen[full_key] = self.autotuned.best_config
            return
        self.autotuned.best_config = config
        self.autotuned.fn[grid(config.kwargs)](*args, **meta, **config.all_kwargs())
