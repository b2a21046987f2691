"""Launch Triton kernels without Triton's per-call dispatch.

`kernel[grid](*args, **meta)` runs JITFunction.run on every call: it binds and specialises each
argument, formats the options into the cache key, builds launch metadata and calls the launch
hooks. For the selection kernel (45 arguments) that is tens of microseconds of host time per call,
more than the kernel's own GPU time on the decode path. `Launcher` takes that path once per
*specialisation* and keeps the compiled kernel; later calls with the same specialisation launch it
directly, as JITFunction.run would (same launcher, current device and stream).

A compiled kernel is specialised on (Triton 3.6): each tensor's dtype and whether its address is
16-byte aligned; each int's width (i32, i64, u64), whether it is 1 (compiled in as a constant) and
whether it is divisible by 16; the constexpr values and the compile options. `arg_spec` maps an
argument to at least that information, so calls that share a key share the compiled kernel Triton
would pick for each of them (the tests check the key against Triton's own specialisation). While a
launch hook is installed (a profiler), and under the interpreter, every call takes Triton's path.

`TunedLauncher` adds an autotuner in front: it tunes once per key, then launches the chosen config
through a Launcher (Triton's autotuner costs tens of microseconds more per call: argument dicts,
its key, hooks).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
from triton.runtime.driver import driver

# Triton reads TRITON_INTERPRET when a kernel is decorated, so the mode is fixed at import.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def interpreted() -> bool:
    return _INTERPRETED


def arg_spec(arg: object) -> object:
    """What a compiled kernel depends on in one runtime argument (a hashable key, at least as fine
    as Triton's specialisation of it)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    if isinstance(arg, bool) or arg is None or isinstance(arg, float):
        return type(arg)
    if isinstance(arg, int):
        return arg == 1, arg & 15 == 0, -(2**31) <= arg < 2**31, -(2**63) <= arg < 2**63
    raise TypeError(f"launch argument: expected a tensor, int, float, bool or None, got {type(arg).__name__}")


def _current_device() -> int:
    return driver.active.get_current_device()


def _current_stream(device: int) -> int:
    return driver.active.get_current_stream(device)


def _bind_driver() -> None:
    """Bind the two driver calls of a launch once (each lookup through `driver.active` costs)."""
    global _current_device, _current_stream
    _current_device = driver.active.get_current_device
    _current_stream = driver.active.get_current_stream


def _hooked() -> bool:
    """True while a launch hook is installed (Triton keeps them in possibly empty HookChains)."""
    runtime = triton.knobs.runtime
    return any(bool(getattr(h, "calls", h)) for h in (runtime.launch_enter_hook, runtime.launch_exit_hook))


class Launcher:
    """Launches one @triton.jit kernel whose parameters are its tensors, then its other runtime
    arguments (ints, floats, bools, None), then its constexprs.

    __call__(grid, tensors, scalars, kwargs): kwargs name every constexpr parameter and may add
    compile options (num_warps, num_stages, maxnreg, ...).

    Two caches: `kernels` maps the specialisation key to the compiled kernel; `recent` maps the
    exact scalars (with the tensors' specialisation) to it, so that the usual call, which repeats
    the scalars of an earlier one, costs one tuple hash instead of classifying every scalar.
    """

    RECENT = 1024  # exact-argument entries kept before `recent` starts over

    def __init__(self, fn: triton.JITFunction) -> None:
        self.fn = fn
        self.kernels: dict[tuple, tuple] = {}
        self.recent: dict[tuple, tuple] = {}

    def __call__(self, grid: tuple[int, ...], tensors: tuple, scalars: tuple, kwargs: dict) -> None:
        if interpreted() or _hooked():
            self.fn[grid](*tensors, *scalars, **kwargs)
            return
        device = _current_device()
        # arg_spec of the tensors, inline (a call per tensor costs); either key below only picks
        # the compiled kernel, the launch passes this call's own arguments
        head = (device, *[(t.dtype, t.data_ptr() & 15 == 0) for t in tensors], *kwargs.items())
        exact = (head, scalars, *map(type, scalars))  # the types: True == 1 == 1.0 in a tuple
        entry = self.recent.get(exact)
        if entry is None:
            key = (head, *map(arg_spec, scalars))
            entry = self.kernels.get(key)
            if entry is None:
                self._compile_and_launch(key, grid, tensors, scalars, kwargs)
                return
            if len(self.recent) >= self.RECENT:
                self.recent.clear()
            self.recent[exact] = entry
        kernel, constants = entry
        grid = (*grid, 1, 1)
        kernel.run(
            grid[0],
            grid[1],
            grid[2],
            _current_stream(device),
            kernel.function,
            kernel.packed_metadata,
            None,  # launch metadata: only launch hooks read it
            None,
            None,
            *tensors,
            *scalars,
            *constants,
        )

    def _compile_and_launch(
        self, key: tuple, grid: tuple, tensors: tuple, scalars: tuple, kwargs: dict
    ) -> None:
        if any(isinstance(a, torch.Tensor) for a in scalars):
            raise TypeError(f"{self.fn.__name__}: a tensor among the scalars (tensors come first)")
        constexprs = tuple(self.fn.arg_names[len(tensors) + len(scalars) :])
        missing = [n for n in constexprs if n not in kwargs]
        if missing:
            raise TypeError(f"{self.fn.__name__}: constexpr parameters {missing} not given")
        kernel = self.fn[grid](*tensors, *scalars, **kwargs)  # compiles when Triton has no such kernel
        _bind_driver()
        self.kernels[key] = (kernel, tuple(kwargs[n] for n in constexprs))


class TunedLauncher:
    """Wraps a `triton.autotune`d kernel whose configs have no pre-hook.

    key: the autotuner's key values (the tensors' dtypes and the device are added here, as the
    autotuner adds the dtypes to its own key); grid: config kwargs -> launch grid; tensors and
    scalars as for Launcher. The autotuner's `best_config` is kept current, so the lab still
    records the config each call ran.
    """

    def __init__(self, autotuned: triton.runtime.Autotuner) -> None:
        if any(c.pre_hook is not None for c in autotuned.configs):
            raise ValueError("autotuned: configs with a pre-hook must run through the autotuner")
        self.autotuned = autotuned
        self.launch = Launcher(autotuned.fn)
        self.chosen: dict[tuple, tuple[triton.Config, dict]] = {}

    def __call__(
        self, key: tuple, grid: Callable[[dict], tuple], tensors: tuple, scalars: tuple, meta: dict
    ) -> None:
        full_key = (*key, tensors[0].device, *(t.dtype for t in tensors))
        chosen = self.chosen.get(full_key)
        if chosen is None:
            self.autotuned[grid](*tensors, *scalars, **meta)
            config = self.autotuned.best_config
            self.chosen[full_key] = (config, config.all_kwargs())
            return
        config, kwargs = chosen
        self.autotuned.best_config = config
        self.launch(grid(config.kwargs), tensors, scalars, {**meta, **kwargs})
