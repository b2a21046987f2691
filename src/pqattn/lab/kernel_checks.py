"""The `KernelCheck` of every Triton kernel family, fuzzed by `pqattn check` and by the tests.

A family's check lands together with its kernel in `pqattn/kernels/`.
"""

from __future__ import annotations

from pqattn.lab.check import KernelCheck

CHECKS: list[KernelCheck] = []
