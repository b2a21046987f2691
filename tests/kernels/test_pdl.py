"""Programmatic dependent launch between the selection's cut and scan: which launches ask for it,
and the order the compiled kernels keep between `griddepcontrol.wait` and their memory accesses
(pqattn.kernels.pdl's contract).

The order is checked in the PTX that Triton compiles for sm_90, in a subprocess without the
interpreter, so it runs on a machine without a GPU. (On the GPU, every selection test runs the
pair with PDL.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pqattn.kernels import pdl
from tests.helpers import select_hist_launches

# Compiles the cut and scan kernels with PDL=True (and False) for sm_90 and reports, per kernel,
# the griddepcontrol instructions and the global memory instructions ahead of the wait.
_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pqattn.kernels import select_hist

def compile_ptx(fn, types, constexprs, num_warps):
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    options = {"num_warps": num_warps, "launch_pdl": constexprs["PDL"]}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

def report(ptx):
    lines = [line.strip() for line in ptx.splitlines()]
    waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    ahead = lines[: waits[0]] if waits else []
    return {
        "waits": len(waits),
        "releases": sum("griddepcontrol.launch_dependents" in line for line in lines),
        "loads_ahead": sum("ld.global" in line for line in ahead),
        "writes_ahead": sum(("st.global" in line) or ("atom." in line) or ("red." in line) for line in ahead),
    }

i32, u8 = "*i32", "*u8"
cut_types = dict(q_ptr="*fp32", cent_ptr="*fp32", len_ptr=i32, hist_ptr=i32, ws_ptr=i32)
scan_types = dict(codes_ptr=u8, len_ptr=i32, hist_ptr=i32, ws_ptr=i32, pos_ptr=i32, cnt_ptr=i32)
scan_types["w_ptr"] = "*fp16"
kernels = {
    "cut": (select_hist._pq_cut_kernel, cut_types, dict(M=2, C=16, P=256, DSUB=16, BLOCK_D=16), 4),
    "scan": (select_hist._pq_scan_kernel, scan_types,
             dict(M=2, C=16, P=256, GP=4, HAS_W=True, CONSUME_HIST=True, TILE=256), 2),
}
out = {}
for name, (fn, types, constexprs, warps) in kernels.items():
    for flag in (True, False):
        out[f"{name}:{flag}"] = report(compile_ptx(fn, types, {**constexprs, "PDL": flag}, warps))
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("kernel", ["cut", "scan"])
def test_each_kernel_waits_once_then_releases(compiled: dict, kernel: str) -> None:
    with_pdl, without = compiled[f"{kernel}:True"], compiled[f"{kernel}:False"]
    assert (with_pdl["waits"], with_pdl["releases"]) == (1, 1)
    assert (without["waits"], without["releases"]) == (0, 0)


@pytest.mark.parametrize("kernel", ["cut", "scan"])
def test_nothing_is_written_before_the_wait(compiled: dict, kernel: str) -> None:
    assert compiled[f"{kernel}:True"]["writes_ahead"] == 0


def test_only_the_scan_reads_before_the_wait(compiled: dict) -> None:
    assert compiled["cut:True"]["loads_ahead"] == 0
    # the scan's length and codes loads overlap the cut launch (M=2: two byte loads per token)
    assert compiled["scan:True"]["loads_ahead"] >= 2


def test_pdl_meta_asks_for_pdl_only_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert pdl.pdl_meta(cpu) == {"PDL": False}
    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    monkeypatch.setattr(pdl, "_supported", lambda device: device.type == "cuda")
    assert pdl.pdl_meta(cpu) == {"PDL": False}
    assert pdl.pdl_meta(cuda) == {"PDL": True, "launch_pdl": True}
    assert pdl.pdl_meta(cuda, early=False) == {"PDL": True, "launch_pdl": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.pdl_meta(cuda) == {"PDL": False}


def test_only_the_scan_is_launched_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cut releases the scan but starts as any launch does (launching it early too made loops
    of selections slower); the scan asks to start early. Launches recorded, not run."""
    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    monkeypatch.setattr(pdl, "_supported", lambda device: True)
    launched = select_hist_launches(monkeypatch, 4, 2)
    cut, scan = launched["_pq_cut_kernel"][3], launched["_pq_scan_kernel"][3]
    assert (cut["PDL"], cut["launch_pdl"]) == (True, False)
    assert (scan["PDL"], scan["launch_pdl"]) == (True, True)
