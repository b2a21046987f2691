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
its key, hooks). Every autotuner of the package times its configs with `graph_timing`.

`Plan` goes one step further for a caller that repeats the same launches on the same buffers (a
decode loop): the launches made inside `recording()` are replayed with new input tensors put in
place of the recorded ones, every other argument bound once, pointers passed as integers (Triton's
launcher asks the driver about every tensor it is given).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import triton
from triton.runtime.driver import driver

# Triton reads TRITON_INTERPRET when a kernel is decorated, so the mode is fixed at import.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def interpreted() -> bool:
    return _INTERPRETED


def autotuning() -> bool:
    """False under the interpreter, or with the environment variable PQATTN_AUTOTUNE=0 (quick
    test runs on a GPU): the launchers then take the first config of their space that fits the
    call instead of timing them all (every config is correct; the tests run each one)."""
    return not _INTERPRETED and os.environ.get("PQATTN_AUTOTUNE", "1") != "0"


def arg_spec(arg: object) -> object:
    """What a compiled kernel depends on in one runtime argument (a hashable key, at least as fine
    as Triton's specialisation of it)."""
    if type(arg) is int:  # most arguments: strides and sizes (bool, a subclass, goes below)
        return arg == 1, arg & 15 == 0, -(2**31) <= arg < 2**31, -(2**63) <= arg < 2**63
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    if isinstance(arg, bool) or arg is None or isinstance(arg, float):
        return type(arg)
    if isinstance(arg, int):
        return arg == 1, arg & 15 == 0, -(2**31) <= arg < 2**31, -(2**63) <= arg < 2**63
    raise TypeError(f"launch argument: expected a tensor, int, float, bool or None, got {type(arg).__name__}")


_INT_SPECS: dict[int, object] = {}  # arg_spec of the ints seen (most scalars repeat across calls)
_MAX_INT_SPECS = 1 << 16


def _scalar_specs(scalars: tuple) -> list:
    """[arg_spec(a) for a in scalars], the ints' looked up (a decode loop's calls differ from the
    last in a few sizes only, and a lookup costs less than classifying every scalar again)."""
    get = _INT_SPECS.get
    specs = [get(a) if type(a) is int else arg_spec(a) for a in scalars]
    if None in specs:
        if len(_INT_SPECS) >= _MAX_INT_SPECS:
            _INT_SPECS.clear()
        for i, spec in enumerate(specs):
            if spec is None:
                specs[i] = _INT_SPECS[scalars[i]] = arg_spec(scalars[i])
    return specs


def current_device() -> int:
    return driver.active.get_current_device()


def current_stream(device: int) -> int:
    return driver.active.get_current_stream(device)


def bind_driver() -> None:
    """Bind the two driver calls of a launch once (each lookup through `driver.active` costs)."""
    global current_device, current_stream
    current_device = driver.active.get_current_device
    current_stream = driver.active.get_current_stream


def hooked() -> bool:
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
        if interpreted() or hooked():
            if _recording is not None:
                _recording.add(self, grid, tensors, scalars, kwargs, None, hooked=not interpreted())
            self.fn[grid](*tensors, *scalars, **kwargs)
            return
        device = current_device()
        # arg_spec of the tensors, inline (a call per tensor costs); either key below only picks
        # the compiled kernel, the launch passes this call's own arguments
        head = (device, *[(t.dtype, t.data_ptr() & 15 == 0) for t in tensors], *kwargs.items())
        exact = (head, scalars, *map(type, scalars))  # the types: True == 1 == 1.0 in a tuple
        entry = self.recent.get(exact)
        if entry is None:
            key = (head, *_scalar_specs(scalars))
            entry = self.kernels.get(key)
            if entry is None:
                if _recording is not None:
                    _recording.complete = False  # a first call: the next one is recorded
                self._compile_and_launch(key, grid, tensors, scalars, kwargs)
                return
            if len(self.recent) >= self.RECENT:
                self.recent.clear()
            self.recent[exact] = entry
        if _recording is not None:
            _recording.add(self, grid, tensors, scalars, kwargs, (device, entry))
        kernel, constants = entry
        grid = (*grid, 1, 1)
        # The tensors themselves, for Triton's check that each address is device memory (passing
        # their addresses, as a Plan does, saved too little to matter: docs/kernels/launch.md).
        kernel.run(
            grid[0],
            grid[1],
            grid[2],
            current_stream(device),
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
        bind_driver()
        self.kernels[key] = (kernel, tuple(kwargs[n] for n in constexprs))


def graph_timing(rep: int) -> Callable[[Callable[[], None], tuple], list[float]]:
    """A `do_bench` for `triton.autotune`: each config timed by CUDA graph replay (rep ms), which
    runs on a stream of its own, after the device has finished the work queued before it.

    Without that wait a trial runs beside the caller's queued work on the same buffers: beside the
    launch the autotuner makes with its pick after each tuning (on the caller's stream), a trial of
    a kernel with arrival counters (the decode kernels) leaves them off count, and the kernel's
    later calls combine stale partials; and a trial can read an input before it is written.
    """

    def timing(fn: Callable[[], None], quantiles: tuple) -> list[float]:
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=rep, quantiles=quantiles)

    timing.waits_for_queued_work = True  # what the tests look for on every autotuner
    return timing


class TunedLauncher:
    """Wraps a `triton.autotune`d kernel whose configs have no pre-hook.

    key: what the choice depends on (the autotuner's key values and whatever else the caller
    tunes by, e.g. the grid's rows; the tensors' dtypes and the device are added here); each new
    key is timed afresh, whatever the autotuner's own cache holds. grid: config kwargs -> launch
    grid; tensors and scalars as for Launcher. The autotuner's `best_config` is kept current, so
    the lab still records the config each call ran.

    rounds: how many times the autotuner times every config, the rounds interleaved; the config
    with the lowest median over them wins: one round of microsecond kernels, timed one config
    after another, can rank them by a passing disturbance rather than by the config.
    """

    def __init__(self, autotuned: triton.runtime.Autotuner, rounds: int = 1) -> None:
        if any(c.pre_hook is not None for c in autotuned.configs):
            raise ValueError("autotuned: configs with a pre-hook must run through the autotuner")
        if rounds < 1:
            raise ValueError(f"rounds: expected at least 1, got {rounds}")
        self.autotuned = autotuned
        self.rounds = rounds
        self.launch = Launcher(autotuned.fn)
        self.chosen: dict[tuple, tuple[triton.Config, dict]] = {}

    def __call__(
        self, key: tuple, grid: Callable[[dict], tuple], tensors: tuple, scalars: tuple, meta: dict
    ) -> None:
        full_key = (*key, tensors[0].device, *(t.dtype for t in tensors))
        chosen = self.chosen.get(full_key)
        if chosen is None:
            if _recording is not None:
                _recording.complete = False  # the autotuner's trials are not a launch to repeat
            config = self._tune(grid, tensors, scalars, meta)
            chosen = self.chosen[full_key] = (config, config.all_kwargs())
        config, kwargs = chosen
        self.autotuned.best_config = config
        before = len(_recording.launches) if _recording is not None else 0
        self.launch(grid(config.kwargs), tensors, scalars, {**meta, **kwargs})
        if _recording is not None and len(_recording.launches) > before:  # (a first launch compiles)
            _recording.launches[-1].tuned = (self.autotuned, config)

    def _tune(
        self, grid: Callable[[dict], tuple], tensors: tuple, scalars: tuple, meta: dict
    ) -> triton.Config:
        """The config with the lowest median time over the rounds. Each round clears the
        autotuner's cache: the caller's key decides, and Triton's autotuner keys on kernel
        arguments only, which need not tell two of the caller's keys apart (a grid of other rows)."""
        times: dict[triton.Config, list[float]] = {}
        for _ in range(self.rounds):
            self.autotuned.cache.clear()
            self.autotuned.configs_timings = None
            self.autotuned[grid](*tensors, *scalars, **meta)
            if self.autotuned.configs_timings is None:  # a single config: nothing was timed
                return self.autotuned.best_config
            for config, t in self.autotuned.configs_timings.items():
                times.setdefault(config, []).append(t[0] if isinstance(t, list) else t)
        return min(times, key=lambda c: statistics.median(times[c]))


@dataclass(slots=True)
class _Launch:
    """One recorded launch: the Launcher call, and the compiled kernel it ran, (device, (kernel,
    constants)), None under the interpreter or a launch hook."""

    launcher: Launcher
    grid: tuple
    tensors: tuple
    scalars: tuple
    kwargs: dict
    compiled: tuple | None
    tuned: tuple | None = None  # (autotuner, config) when a TunedLauncher chose the config


class Recording:
    """The Launcher launches made inside `recording()`. `complete` is False when one of them could
    not be recorded as a plain launch (a compilation, an autotuning, a launch hook)."""

    def __init__(self) -> None:
        self.launches: list[_Launch] = []
        self.complete = True

    def add(self, launcher, grid, tensors, scalars, kwargs, compiled, hooked: bool = False) -> None:
        if hooked:
            self.complete = False
        self.launches.append(_Launch(launcher, grid, tensors, scalars, kwargs, compiled))


_recording: Recording | None = None


@contextmanager
def recording() -> Iterator[Recording | None]:
    """Record the Launcher launches made in the block. Inside another recording it yields None
    and the outer recording gets the launches."""
    global _recording
    if _recording is not None:
        yield None
        return
    _recording = Recording()
    try:
        yield _recording
    finally:
        _recording = None


@contextmanager
def unrecorded() -> Iterator[None]:
    """Launches in the block stay out of any recording: checks a call runs before its work, which
    a plan of that work must not replay."""
    global _recording
    outer, _recording = _recording, None
    try:
        yield
    finally:
        _recording = outer


def signature(*tensors: torch.Tensor) -> tuple | None:
    """What a Plan's launches depend on in its input tensors: shape, strides, dtype, device, and
    whether the address is 16-byte aligned (part of a compiled kernel's specialisation). None
    when one of them is not a tensor (no plan: the caller's checks report it)."""
    try:
        return tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15 == 0) for t in tensors)
    except (AttributeError, TypeError):
        return None


class Address:
    """A Plan input given by its address: a bound launch reads only `data_ptr()`, so the caller
    need not make the tensor view; a launch through its Launcher (the interpreter, a hook, a
    recording, another device) gets `make()`'s tensor, which must start at `ptr`."""

    __slots__ = ("make", "ptr")

    def __init__(self, ptr: int, make: Callable[[], torch.Tensor]) -> None:
        self.ptr = ptr
        self.make = make

    def data_ptr(self) -> int:
        return self.ptr


def _substituted(tensors: tuple, slots: tuple, inputs: tuple) -> tuple:
    out = list(tensors)
    for i, j in slots:
        out[i] = inputs[j]
    return tuple(out)


class Plan:
    """Recorded launches replayed with new inputs.

    `Plan.build(rec, inputs, owned)` accepts a complete recording in which every tensor argument
    is one of `inputs` (replaced on each call, by position) or one of `owned` (buffers that keep
    their storage for the plan's life: the plan holds them); any other tensor (a temporary the
    recorded call made, e.g. a contiguous copy) means no plan, since replaying would read a stale
    copy. The scalar arguments are replayed as recorded, so the caller keys its plans by
    everything they derive from: `signature(*inputs)` and its own state.

    A call launches each kernel with its bound arguments and the inputs' addresses on the current
    stream (so it can be captured in a CUDA graph). Under the interpreter, while a launch hook is
    installed (a profiler) or while recording (so that an outer recording sees the launches), it
    replays through the Launcher calls instead.
    """

    def __init__(self, launches: list[tuple], owned: tuple) -> None:
        self._launches = launches
        self._owned = owned  # the bound buffers: kept alive

    def holds(self, buffer: torch.Tensor) -> bool:
        """True when the launches read or write `buffer` (an owned tensor given to build)."""
        return any(t is buffer for t in self._owned)

    @classmethod
    def build(
        cls, rec: Recording | None, inputs: Sequence[torch.Tensor], owned: Sequence[torch.Tensor | None]
    ) -> Plan | None:
        if rec is None or not rec.complete or not rec.launches:
            return None
        input_ids = {id(t): i for i, t in enumerate(inputs)}
        owned_ids = {id(t): t for t in owned if t is not None}
        used: dict[int, torch.Tensor] = {}
        launches = []
        for r in rec.launches:
            slots = []
            for i, t in enumerate(r.tensors):
                if id(t) in input_ids:
                    slots.append((i, input_ids[id(t)]))
                elif id(t) in owned_ids:
                    used[id(t)] = t
                else:
                    return None
            # the recorded inputs are not kept (a plan must not hold the caller's KV cache alive)
            kept = replace(r, tensors=tuple(None if id(t) in input_ids else t for t in r.tensors))
            bound = None
            if r.compiled is not None:
                device, (kernel, constants) = r.compiled
                ptrs = [t.data_ptr() for t in r.tensors]
                grid = (*r.grid, 1, 1)
                head = (grid[0], grid[1], grid[2])
                tail = (kernel.function, kernel.packed_metadata, None, None, None)
                bound = (kernel.run, device, head, tail, [*ptrs, *r.scalars, *constants])
            launches.append((kept, tuple(slots), bound))
        return cls(launches, tuple(used.values()))

    def __call__(self, *inputs: torch.Tensor | Address) -> None:
        slow = interpreted() or _recording is not None or hooked()
        tensors = None  # the inputs as tensors, made for the first launch through its Launcher
        for r, slots, bound in self._launches:
            if r.tuned is not None:
                r.tuned[0].best_config = r.tuned[1]  # as TunedLauncher does: the lab reads it
            # (a bound kernel is loaded on the recorded device only)
            if slow or bound is None or current_device() != bound[1]:
                if tensors is None:
                    tensors = tuple(t.make() if isinstance(t, Address) else t for t in inputs)
                r.launcher(r.grid, _substituted(r.tensors, slots, tensors), r.scalars, r.kwargs)
                continue
            run, device, head, tail, args = bound
            if slots:
                args = args.copy()
                for i, j in slots:
                    args[i] = inputs[j].data_ptr()
            run(*head, current_stream(device), *tail, *args)


class PlanCache:
    """Plans by key, at most `size`, the least recently used dropped first (a caller whose inputs
    change signature every call, e.g. a cache that grows, would otherwise keep one per call)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._plans: dict[tuple, Plan] = {}

    @staticmethod
    def key(name: str, tensors: Sequence[torch.Tensor], *args: object) -> tuple | None:
        """The key of a call by its name, every tensor's signature and its other arguments (their
        values and types); None when an argument is not a tensor (no plan)."""
        sig = signature(*tensors)
        return None if sig is None else (name, sig, args, tuple(map(type, args)))

    def get(self, key: tuple | None) -> Plan | None:
        plan = None if key is None else self._plans.pop(key, None)
        if plan is not None:  # the most recently used last
            self._plans[key] = plan
        return plan

    def keep(
        self,
        key: tuple | None,
        rec: Recording,
        inputs: Sequence[torch.Tensor],
        owned: Sequence[torch.Tensor | None] = (),
    ) -> None:
        """Keep the launches recorded for these inputs as a plan under `key`, when they make one."""
        plan = None if key is None else Plan.build(rec, inputs, owned)
        if plan is not None:
            if len(self._plans) >= self.size:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan

    def forget(self, *buffers: torch.Tensor | None) -> None:
        """Drop the plans that use these buffers (about to be replaced: replays would use the old)."""
        old = [b for b in buffers if b is not None]
        if old:
            self._plans = {k: p for k, p in self._plans.items() if not any(p.holds(b) for b in old)}

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)

    def __iter__(self) -> Iterator[tuple]:
        """The keys, the least recently used first."""
        return iter(self._plans)
