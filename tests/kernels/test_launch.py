"""Launcher: a cached compiled kernel per argument specialisation, launched without Triton's
dispatch; TunedLauncher: the autotuner runs once per key, later calls launch its choice directly."""

from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl

from pqattn.runtime.launch import (
    Launcher,
    Plan,
    TunedLauncher,
    _scalar_specs,
    arg_spec,
    autotuning,
    graph_timing,
    interpreted,
    recording,
)

try:  # Triton's own specialisation of one argument (a private API: the test skips without it)
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
except ImportError:  # pragma: no cover - depends on the Triton version
    native_specialize_impl = None


def _tensor_args() -> list[torch.Tensor]:
    base = [
        torch.zeros(64, dtype=dt)
        for dt in (torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int32)
    ]
    return base + [t[1:] for t in base] + [t[4:] for t in base]


INTS = [-(2**63), -(2**31) - 1, -(2**31), -17, -16, -1, 0, 1, 2, 15, 16, 17, 32, 2**31 - 16, 2**31 - 1]
INTS += [2**31, 2**31 + 16, 2**63 - 16, 2**63, 2**64 - 16, 2**64 - 1]


@pytest.mark.skipif(native_specialize_impl is None, reason="this Triton has no native_specialize_impl")
def test_arg_spec_is_at_least_as_fine_as_tritons_specialisation() -> None:
    """Two arguments with one key must compile to one kernel: equal keys imply equal
    specialisations (the converse need not hold: a finer key only costs a dispatch)."""
    values = [*INTS, True, False, 0.5, 1.0, None, *_tensor_args()]
    spec = [arg_spec(v) for v in values]
    triton_spec = [native_specialize_impl(BaseBackend, v, False, True, True) for v in values]
    for i, j in itertools.combinations(range(len(values)), 2):
        if spec[i] == spec[j]:
            assert triton_spec[i] == triton_spec[j], (values[i], values[j])
    assert len(set(spec)) >= len(set(map(str, triton_spec)))


def test_the_scalars_looked_up_get_their_own_spec() -> None:
    """_scalar_specs (ints looked up once seen) is arg_spec of each scalar, bools, floats and None
    among the ints they equal (True == 1 == 1.0 as dict keys), in either order of first sight."""
    values = [*INTS, True, False, 0.5, 1.0, 16.0, None, 1, 0, 16]
    for order in (values, values[::-1], values):
        assert _scalar_specs(tuple(order)) == [arg_spec(v) for v in order]


def test_arg_spec_refuses_unknown_types() -> None:
    with pytest.raises(TypeError, match="launch argument"):
        arg_spec("16")


@triton.jit
def _affine(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(y_ptr + i, (x * a + n).to(y_ptr.dtype.element_ty), mask=i < n)


def test_launcher_matches_the_jit_launch_for_every_specialisation(device: torch.device) -> None:
    """Lengths 1 (a compiled-in constant), 16 (divisible) and 37, aligned and unaligned pointers,
    two dtypes, each launched several times: the cached launches write what the kernel computes."""
    launch = Launcher(_affine)
    for n, offset, dtype in itertools.product((1, 16, 37), (0, 1), (torch.float32, torch.float16)):
        for a in (0.5, 2.0, 0.5, 2.0, 2):  # repeated scalars take the exact-argument cache
            # small integers times powers of two: exact in every dtype, so the check is exact
            x = torch.randint(-8, 8, (n + offset,), device=device).to(dtype)[offset:]
            y = torch.full((n + offset,), float("nan"), device=device, dtype=dtype)[offset:]
            launch((triton.cdiv(n, 16),), (x, y), (n, a), {"BLOCK": 16})
            torch.testing.assert_close(y, (x.float() * a + n).to(dtype), rtol=0, atol=0)
    if not interpreted():  # one kernel per specialisation (a float or int `a` among them)
        assert len(launch.kernels) == 3 * 2 * 2 * 2


def test_launcher_refuses_missing_constexprs(device: torch.device) -> None:
    if interpreted():
        pytest.skip("the interpreter runs Triton's own launch, which reports this itself")
    x = torch.zeros(4, device=device)
    with pytest.raises(TypeError, match="BLOCK"):
        Launcher(_affine)((1,), (x, x), (4, 1.0), {})


def test_launcher_is_captured_by_a_cuda_graph(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    launch = Launcher(_affine)
    x = torch.randn(40, device=device)
    y = torch.empty_like(x)
    launch((3,), (x, y), (40, 2.0), {"BLOCK": 16})  # compiles; the capture then launches directly
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch((3,), (x, y), (40, 2.0), {"BLOCK": 16})
    x.copy_(torch.randn(40, device=device))
    graph.replay()
    torch.testing.assert_close(y, x * 2.0 + 40)


def test_launch_hooks_see_every_launch(device: torch.device) -> None:
    """A profiler's launch hook sees the Launcher's launches (they take Triton's path then)."""
    if interpreted():
        pytest.skip("the interpreter has no launch hooks")
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    launch = Launcher(_affine)
    x = torch.randn(16, device=device)
    launch((1,), (x, x), (16, 1.0), {"BLOCK": 16})
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch((1,), (x, x), (16, 1.0), {"BLOCK": 16})
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1


class _Recorder:
    """Stands in for a JIT function or an autotuner: records each launch's grid and arguments."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def __getitem__(self, grid):
        return lambda *args, **kw: self.log.append((self.name, grid, args, kw))


class _FakeAutotuner(_Recorder):
    """Times the configs only for a key its cache lacks (its key: the `D` argument), as Triton's
    autotuner does: each timing takes the next of `rounds` (a time per config) when given, else
    configs[pick] is fastest. One config is not timed (no `configs_timings`), as in Triton."""

    def __init__(
        self, configs: list[triton.Config], pick: int, rounds: list[list[float]] | None = None
    ) -> None:
        self.log: list = []
        super().__init__(self.log, "autotuner")
        self.configs, self.pick, self.best_config = configs, pick, None
        self.rounds = list(rounds or [])
        self.cache: dict = {}
        self.configs_timings: dict | None = None
        self.fn = _Recorder(self.log, "kernel")

    def __getitem__(self, grid):
        def run(*args, **kw):
            key = kw.get("D")
            if key not in self.cache:
                if len(self.configs) == 1:
                    self.cache[key] = self.configs[0]
                else:
                    self.log.append(("timed",))
                    times = (
                        self.rounds.pop(0)
                        if self.rounds
                        else [float(i != self.pick) for i in range(len(self.configs))]
                    )
                    self.configs_timings = {c: [t, t, t] for c, t in zip(self.configs, times, strict=True)}
                    self.cache[key] = min(self.configs_timings, key=lambda c: self.configs_timings[c][0])
            self.best_config = self.cache[key]
            self.log.append(("autotuner", grid(self.best_config.kwargs), args, kw))
            return ("compiled", self.best_config)  # what Triton's autotuner returns: the kernel it ran

        return run


class _FakeLauncher:
    """Stands in for TunedLauncher's Launcher: records its launches."""

    def __init__(self, log: list) -> None:
        self.log = log

    def __call__(self, grid, tensors, scalars, kw) -> None:
        self.log.append(("kernel", grid, tensors + scalars, kw))


CONFIGS = [triton.Config({"BLOCK": 16}, num_warps=4), triton.Config({"BLOCK": 64}, num_warps=8, num_stages=2)]


def test_autotunes_once_per_key_then_launches_the_choice() -> None:
    tuner = _FakeAutotuner(CONFIGS, pick=1)
    launch = TunedLauncher(tuner)
    launch.launch = _FakeLauncher(tuner.log)
    x = torch.zeros(3)
    grid = lambda c: (100 // c["BLOCK"], 2)  # noqa: E731
    launch((7, True), grid, (x,), (5,), {"D": 32})
    # the tuning call ends with a launch of the choice (through the Launcher: recordable next time)
    assert [e[0] for e in tuner.log] == ["timed", "autotuner", "kernel"]
    assert tuner.log[-1] == ("kernel", (1, 2), (x, 5), {"D": 32, **CONFIGS[1].all_kwargs()})
    tuner.best_config = None  # the lab resets it before a call and reads it after
    launch((7, True), grid, (x,), (6,), {"D": 32})
    assert [e[0] for e in tuner.log] == ["timed", "autotuner", "kernel", "kernel"]
    _, g, args, kw = tuner.log[-1]
    assert g == (1, 2) and args == (x, 6)
    assert kw == {"D": 32, "BLOCK": 64, "num_warps": 8, "num_ctas": 1, "num_stages": 2}
    assert tuner.best_config is CONFIGS[1]
    launch((8, True), grid, (x,), (6,), {"D": 32})  # another key
    launch((7, True), grid, (x.double(),), (6,), {"D": 32})  # another dtype: the autotuner's key has it
    assert [e[0] for e in tuner.log][4:] == ["timed", "autotuner", "kernel", "timed", "autotuner", "kernel"]


def test_a_key_the_autotuner_cannot_tell_apart_is_timed_afresh() -> None:
    """Two of the caller's keys (a grid of 1 and of 64 rows) with the same kernel arguments in
    the autotuner's key: the second is timed too, and each keeps its own choice."""
    tuner = _FakeAutotuner(CONFIGS, pick=0)
    launch = TunedLauncher(tuner)
    launch.launch = _FakeLauncher(tuner.log)
    x = torch.zeros(3)
    launch((7, 1), lambda c: (1, 1), (x,), (5,), {"D": 32})
    tuner.pick = 1
    launch((7, 64), lambda c: (1, 64), (x,), (5,), {"D": 32})
    assert [e[0] for e in tuner.log].count("timed") == 2
    launch((7, 1), lambda c: (1, 1), (x,), (5,), {"D": 32})
    launch((7, 64), lambda c: (1, 64), (x,), (5,), {"D": 32})
    assert [e[3]["BLOCK"] for e in tuner.log[-2:]] == [16, 64]


def test_rounds_pick_the_lowest_median_not_the_last_round() -> None:
    """Three rounds, each timing both configs: configs[0] wins two rounds (the last among them)
    on outliers, configs[1] has the lower median and is launched."""
    tuner = _FakeAutotuner(CONFIGS, pick=0, rounds=[[1.0, 2.0], [5.0, 2.0], [5.0, 6.0]])
    launch = TunedLauncher(tuner, rounds=3)
    launch.launch = _FakeLauncher(tuner.log)
    x = torch.zeros(3)
    launch((7,), lambda c: (c["BLOCK"],), (x,), (5,), {"D": 32})
    assert [e[0] for e in tuner.log].count("timed") == 3, "every round times afresh"
    assert tuner.log[-1][0] == "kernel" and tuner.log[-1][1] == (64,)
    assert tuner.best_config is CONFIGS[1]
    launch((7,), lambda c: (c["BLOCK"],), (x,), (6,), {"D": 32})
    assert [e[0] for e in tuner.log].count("timed") == 3, "tuned once per key"


def test_one_config_is_launched_untimed() -> None:
    tuner = _FakeAutotuner(CONFIGS[:1], pick=0)
    launch = TunedLauncher(tuner, rounds=4)
    launch.launch = _FakeLauncher(tuner.log)
    launch((7,), lambda c: (1,), (torch.zeros(3),), (5,), {"D": 32})
    assert [e[0] for e in tuner.log] == ["autotuner", "kernel"]
    assert tuner.log[-1][3]["BLOCK"] == 16


def test_rounds_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="rounds: expected at least 1, got 0"):
        TunedLauncher(_FakeAutotuner(CONFIGS, pick=0), rounds=0)


@triton.jit
def _copy_checked(x_ptr, y_ptr, bad_ptr, n, want, BLOCK: tl.constexpr):
    """y = x; counts in bad the elements that differ from `want` (an input read too early)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=want)
    tl.store(y_ptr + i, x, mask=i < n)
    tl.atomic_add(bad_ptr, tl.sum((x != want).to(tl.int32), axis=0))


def _tuned_copy(device: torch.device, rounds: int) -> tuple[triton.runtime.Autotuner, TunedLauncher]:
    """`_copy_checked` autotuned over two configs, timed as the package's kernels are."""
    if device.type != "cuda" or not autotuning():
        pytest.skip("autotuning runs on a GPU")
    autotuned = triton.autotune(
        configs=[triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})],
        key=["n"],
        do_bench=graph_timing(rep=5),
    )(_copy_checked)
    return autotuned, TunedLauncher(autotuned, rounds=rounds)


def test_tuning_by_graph_replay_waits_for_the_inputs(device: torch.device) -> None:
    """The input is written on the caller's stream behind a long kernel when the first call tunes:
    the trials (graph replay on a stream of their own) read it only once written."""
    _, tuned = _tuned_copy(device, rounds=2)
    n = 4096
    x, y = torch.zeros(n, device=device), torch.empty(n, device=device)
    bad = torch.zeros(1, dtype=torch.int32, device=device)
    torch.cuda.synchronize(device)
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time ahead of the write
    x.fill_(7.0)
    tuned((n,), lambda c: (triton.cdiv(n, c["BLOCK"]),), (x, y, bad), (n, 7.0), {})
    torch.cuda.synchronize(device)
    assert bad.item() == 0, "a trial read the input before the caller's stream wrote it"
    torch.testing.assert_close(y, x, rtol=0, atol=0)


class _SlowOwnLaunch:
    """The autotuned kernel, seen through the autotuner: its own launch of the pick (on the
    caller's stream) runs behind a long GPU sleep and is then counted on the device; each trial
    (on a timing stream) first counts in `early` whether that count is behind the launches made."""

    def __init__(self, fn, caller: torch.cuda.Stream, device: torch.device) -> None:
        self.fn, self.caller = fn, caller
        self.done = torch.zeros((), dtype=torch.int32, device=device)
        self.early = torch.zeros((), dtype=torch.int32, device=device)
        self.made = 0

    def run(self, *args, **kwargs):
        if torch.cuda.current_stream() == self.caller:
            torch.cuda._sleep(100_000_000)
            out = self.fn.run(*args, **kwargs)
            self.done += 1
            self.made += 1
            return out
        self.early += self.done != self.made
        return self.fn.run(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.fn, name)


def test_each_tuning_round_waits_for_the_autotuners_own_launch(device: torch.device) -> None:
    """Each round ends with the autotuner launching its pick on the caller's stream; the next
    round's trials (on a timing stream of their own) start only once it has run: a trial beside it
    on the same buffers would, for the decode kernels, leave the arrival counters off count."""
    autotuned, tuned = _tuned_copy(device, rounds=3)
    slow = autotuned.fn = _SlowOwnLaunch(autotuned.fn, torch.cuda.current_stream(device), device)
    n = 4096
    x, y = torch.full((n,), 7.0, device=device), torch.empty(n, device=device)
    bad = torch.zeros(1, dtype=torch.int32, device=device)
    tuned((n,), lambda c: (triton.cdiv(n, c["BLOCK"]),), (x, y, bad), (n, 7.0), {})
    torch.cuda.synchronize(device)
    assert slow.made == 3, "the autotuner launched its pick once a round"
    assert slow.early.item() == 0, "a trial ran before the autotuner's launch of the round before"
    assert bad.item() == 0
    torch.testing.assert_close(y, x, rtol=0, atol=0)


def test_every_autotuner_times_after_the_queued_work() -> None:
    """Every autotuned kernel of the package times its configs with `graph_timing` (which waits
    for the work queued before a trial)."""
    import importlib
    import pkgutil

    import pqattn.kernels as package

    found = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        for name, obj in vars(importlib.import_module(info.name)).items():
            if isinstance(obj, triton.runtime.Autotuner):
                found[f"{info.name}.{name}"] = getattr(obj._do_bench, "waits_for_queued_work", False)
    assert {"flash_forward_autotuned", "pq_select_autotuned", "group_decode_autotuned"} <= {
        k.rsplit(".", 1)[1] for k in found
    }
    assert all(found.values()), [k for k, ok in found.items() if not ok]


def test_an_unrecorded_launch_tags_no_earlier_one() -> None:
    """The tuned call's own launch is not recorded (a first launch compiles): the config is not
    pinned on the launch recorded before it."""
    tuner = _FakeAutotuner(CONFIGS, pick=1)
    tuned = TunedLauncher(tuner)
    tuned.launch = _FakeLauncher([])  # records nothing, as a compiling first launch
    x = torch.zeros(3)
    with recording() as rec:
        rec.add(Launcher(_affine), (1,), (x,), (5,), {}, None)
        tuned((1,), lambda c: (1,), (x,), (5,), {})
    assert rec.launches[0].tuned is None


def test_configs_with_a_pre_hook_are_refused() -> None:
    hooked = [triton.Config({"BLOCK": 16}, pre_hook=lambda nargs: None)]
    with pytest.raises(ValueError, match="pre-hook"):
        TunedLauncher(_FakeAutotuner(hooked, pick=0))


def test_a_plan_replays_its_launches_with_new_inputs(device: torch.device) -> None:
    """Recorded launches replay with the inputs put in place of the recorded ones (compiled: raw
    pointers; interpreter: through the Launcher), the owned buffers bound."""
    launch = Launcher(_affine)
    x0, y = torch.randn(40, device=device), torch.empty(40, device=device)
    launch((3,), (x0, y), (40, 2.0), {"BLOCK": 16})  # compiles, so the next call is recordable
    with recording() as rec:
        launch((3,), (x0, y), (40, 2.0), {"BLOCK": 16})
    plan = Plan.build(rec, (x0,), (y,))
    assert plan is not None
    for _ in range(3):
        x = torch.randn(40, device=device)
        y.fill_(float("nan"))
        plan(x)
        torch.testing.assert_close(y, x * 2.0 + 40, rtol=0, atol=0)
    assert Plan.build(rec, (x0,), ()) is None, "y is neither an input nor owned: a temporary"
    assert Plan.build(None, (x0,), (y,)) is None


def test_recordings_nest_and_an_unrecordable_launch_spoils_one() -> None:
    tuner = _FakeAutotuner(CONFIGS, pick=0)
    tuned = TunedLauncher(tuner)
    tuned.launch = _FakeLauncher([])
    x = torch.zeros(3)
    grid = lambda c: (1,)  # noqa: E731
    with recording() as outer:
        with recording() as inner:
            assert inner is None
        tuned((1,), grid, (x,), (5,), {})  # the autotuner's first run: not a launch to repeat
    assert outer is not None and not outer.complete
    assert Plan.build(outer, (x,), ()) is None


class _FakeCompiled:
    """A compiled kernel whose launcher records its arguments."""

    function, packed_metadata = 77, (4, 1, 0)

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.run = lambda *args: self.calls.append(args)


def test_a_compiled_plan_passes_what_the_launcher_passes(monkeypatch) -> None:
    """The plan's direct launch: the arguments of the Launcher's own launch for the same inputs,
    tensors as their addresses (Triton's launcher takes an int as a pointer), on the stream and
    device current at the call; on another device it goes through the Launcher."""
    from pqattn.runtime import launch as launch_mod

    monkeypatch.setattr(launch_mod, "_INTERPRETED", False)
    monkeypatch.setattr(launch_mod, "hooked", lambda: False)
    monkeypatch.setattr(launch_mod, "current_device", lambda: 0)
    monkeypatch.setattr(launch_mod, "current_stream", lambda device: 1234)
    fake = _FakeCompiled()
    launch = Launcher(_affine)
    compiled = []
    monkeypatch.setattr(
        launch,
        "_compile_and_launch",
        lambda key, *a: (compiled.append(key), launch.kernels.update({key: (fake, (16,))})),
    )
    x0, y = torch.randn(40), torch.empty(40)
    launch((3,), (x0, y), (40, 2.0), {"BLOCK": 16})
    with recording() as rec:
        launch((3,), (x0, y), (40, 2.0), {"BLOCK": 16})
    plan = Plan.build(rec, (x0,), (y,))
    x = torch.randn(40)
    launch((3,), (x, y), (40, 2.0), {"BLOCK": 16})
    plan(x)
    by_launcher, by_plan = fake.calls[-2], fake.calls[-1]
    assert by_plan == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in by_launcher)
    assert by_plan[:4] == (3, 1, 1, 1234) and by_plan[4:6] == (77, (4, 1, 0))
    monkeypatch.setattr(launch_mod, "current_device", lambda: 1)
    plan(x)  # no kernel for device 1 yet: the Launcher compiles it
    assert len(fake.calls) == 3 and len(compiled) == 2


def test_autotuning_is_off_under_the_interpreter_or_when_asked(monkeypatch) -> None:
    from pqattn.runtime import launch as launch_mod

    monkeypatch.setattr(launch_mod, "_INTERPRETED", False)
    for value, on in ((None, True), ("1", True), ("0", False)):
        if value is None:
            monkeypatch.delenv("PQATTN_AUTOTUNE", raising=False)
        else:
            monkeypatch.setenv("PQATTN_AUTOTUNE", value)
        assert autotuning() is on
    monkeypatch.setattr(launch_mod, "_INTERPRETED", True)
    monkeypatch.setenv("PQATTN_AUTOTUNE", "1")
    assert autotuning() is False
