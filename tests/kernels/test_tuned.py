"""TunedLauncher: the autotuner runs once per key, later calls launch its choice directly."""

from __future__ import annotations

import pytest
import torch
import triton

from pqattn.kernels.tuned import TunedLauncher


class _Recorder:
    """Stands in for a JIT function or an autotuner: records each launch's grid and arguments."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def __getitem__(self, grid):
        return lambda *args, **kw: self.log.append((self.name, grid, args, kw))


class _FakeAutotuner(_Recorder):
    def __init__(self, configs: list[triton.Config], pick: int) -> None:
        self.log: list = []
        super().__init__(self.log, "autotuner")
        self.configs, self.pick, self.best_config = configs, pick, None
        self.fn = _Recorder(self.log, "kernel")

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.best_config = self.configs[self.pick]
            self.log.append(("autotuner", grid(self.best_config.kwargs), args, kw))

        return run


CONFIGS = [triton.Config({"BLOCK": 16}, num_warps=4), triton.Config({"BLOCK": 64}, num_warps=8, num_stages=2)]


def test_autotunes_once_per_key_then_launches_the_choice() -> None:
    tuner = _FakeAutotuner(CONFIGS, pick=1)
    launch = TunedLauncher(tuner)
    x = torch.zeros(3)
    grid = lambda c: (100 // c["BLOCK"], 2)  # noqa: E731
    launch((7, True), grid, (x, 5), {"D": 32})
    tuner.best_config = None  # the lab resets it before a call and reads it after
    launch((7, True), grid, (x, 6), {"D": 32})
    assert [e[0] for e in tuner.log] == ["autotuner", "kernel"]
    _, g, args, kw = tuner.log[1]
    assert g == (1, 2) and args == (x, 6)
    assert kw == {"D": 32, "BLOCK": 64, "num_warps": 8, "num_ctas": 1, "num_stages": 2}
    assert tuner.best_config is CONFIGS[1]
    launch((8, True), grid, (x, 6), {"D": 32})  # another key
    launch((7, True), grid, (x.double(), 6), {"D": 32})  # another dtype: the autotuner's key has it
    assert [e[0] for e in tuner.log] == ["autotuner", "kernel", "autotuner", "autotuner"]


def test_configs_with_a_pre_hook_are_refused() -> None:
    hooked = [triton.Config({"BLOCK": 16}, pre_hook=lambda nargs: None)]
    with pytest.raises(ValueError, match="pre-hook"):
        TunedLauncher(_FakeAutotuner(hooked, pick=0))
