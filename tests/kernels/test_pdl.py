"""Programmatic dependent launch between the selection's cut and scan, and between the encode
launch and the bucket selection behind it: which launches ask for it, and the order the compiled
kernels keep between `griddepcontrol.wait` and their memory accesses (pqattn.kernels.pdl's
contract).

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
from tests.kernels.selection_case import launch_fine_on_toy_inputs

# Compiles the cut and scan kernels with PDL=True (and False) for sm_90 and reports, per kernel,
# the griddepcontrol instructions and the global memory instructions ahead of the wait.
_COMPILE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pqattn.kernels import encode
from pqattn.kernels.select import buckets as select_buckets
from pqattn.kernels.select import fine as select_fine
from pqattn.kernels.select import hist as select_hist

def compile_ptx(fn, types, constexprs, num_warps):
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    options = {"num_warps": num_warps, "launch_pdl": constexprs["PDL"]}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

def pointer_params(lines, reg):
    # the parameters (by index) that register `reg` is computed from
    defs = {}
    for line in lines:
        m = re.match(r"([a-z][\w.]*)\s+(%\w+),\s*(.*);", line)
        if m and not m.group(1).startswith(("st.", "ld.global")):
            param = re.search(r"_param_(\d+)\]", m.group(3))
            defs[m.group(2)] = int(param.group(1)) if param else re.findall(r"%\w+", m.group(3))
    seen, todo, params = set(), [reg], set()
    while todo:
        r = todo.pop()
        if r in seen or r not in defs:
            continue
        seen.add(r)
        if not isinstance(defs[r], int):
            todo.extend(defs[r])
        else:
            params.add(defs[r])
    return params

def atomic(line):
    return re.match(r"(@!?%\w+\s+)?(atom|red)\.", line) is not None

def report(ptx, pointers):
    lines = [line.strip() for line in ptx.splitlines()]
    waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    ahead = lines[: waits[0]] if waits else []
    loads = [re.search(r"\[\s*(%\w+)", line).group(1) for line in ahead if "ld.global" in line]
    read = set().union(*(pointer_params(ahead, r) for r in loads))
    return {
        "load_params_ahead": sorted(read & pointers),
        "waits": len(waits),
        "releases": sum("griddepcontrol.launch_dependents" in line for line in lines),
        "loads_ahead": sum("ld.global" in line for line in ahead),
        "writes_ahead": sum(("st.global" in line) or atomic(line) for line in ahead),
        "atomics_ahead": sum(atomic(line) for line in ahead),
    }

i32, u8 = "*i32", "*u8"
cut_types = dict(q_ptr="*fp32", cent_ptr="*fp32", len_ptr=i32, hist_ptr=i32, ws_ptr=i32)
scan_types = dict(codes_ptr=u8, len_ptr=i32, hist_ptr=i32, ws_ptr=i32, pos_ptr=i32, cnt_ptr=i32)
scan_types["w_ptr"] = "*fp16"
bucket_types = dict(q_ptr="*fp32", cent_ptr="*fp32", codes_ptr="*i64", len_ptr="*i64", hist_ptr=i32,
                    order_ptr=i32, starts_ptr=i32, frozen_ptr=i32, ws_ptr=i32, pos_ptr="*i64",
                    cnt_ptr="*i64", w_ptr="*fp32", x_ptr="*fp32", phi_ptr="*fp32")
encode_types = dict(k_ptr="*fp32", cent_ptr="*fp32", phi_ptr="*fp32", base_ptr="*i64", out_ptr="*i64",
                    hist_ptr=i32, kc_ptr="*fp32", vc_ptr="*fp32", vn_ptr="*fp32", arrive_ptr=i32)
lut_types = dict(q_ptr="*fp32", cent_ptr="*fp32", ws_ptr=i32, k_ptr="*fp32", phi_ptr="*fp32", codes_ptr=u8,
                 len_ptr="*i64", arrive_ptr=i32, kc_ptr="*bf16", vc_ptr="*bf16", vn_ptr="*fp32")
lut_meta = dict(GROUP=True, SUM_RULE=False, M=4, C=16, DSUB=8, CHUNKS=1, TABLES_P2=4, LUT_BF16=True, IP=False,
                KEY_AT_LENGTH=False)
kernels = {
    "lut": (select_fine._lut_kernel, lut_types, dict(lut_meta, ENCODE=False, STORE_KV=False), 4),
    "lut-encode": (select_fine._lut_kernel, lut_types, dict(lut_meta, ENCODE=True, STORE_KV=True), 4),
    "cut": (select_hist._pq_cut_kernel, cut_types, dict(M=2, C=16, P=256, DSUB=16, BLOCK_D=16), 4),
    "scan": (select_hist._pq_scan_kernel, scan_types,
             dict(M=2, C=16, P=256, GP=4, HAS_W=True, CONSUME_HIST=True, TILE=256), 2),
    "bucket": (select_buckets._pq_bucket_select_kernel, bucket_types,
               dict(M=2, C=16, BITS=4, P=256, DSUB=16, BLOCK_D=16, CHUNK=1024, LATE_RUNS=False,
                    HAS_W=True, ZERO_PROGS=0, ENCODE=False, IP=False), 4),
    "encode": (encode._pq_encode_kernel, encode_types,
               dict(M=2, M_PER=2, C=16, DSUB=16, BLOCK_D=16, IP=False, HAS_BASE=True, HAS_HIST=True, P=256,
                    STORE_KV=False, ADVANCE=True, KEY_AT_BASE=False), 4),
}
out = {}
for name, (fn, types, constexprs, warps) in kernels.items():
    for flag in (True, False):
        pointers = {i for i, n in enumerate(fn.arg_names) if types.get(n, "").startswith("*")}
        out[f"{name}:{flag}"] = report(compile_ptx(fn, types, {**constexprs, "PDL": flag}, warps), pointers)
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


def test_the_encode_releases_the_bucket_selection_behind_it(compiled: dict) -> None:
    """The encode launch releases at once and never waits (it starts as any launch does); the
    bucket selection waits once, and ahead of the wait reads only through its first two pointers,
    the query and the centroids (its LUT's operands), and makes no atomic update (it writes its
    LUT and the weights' zeros, which no launch in flight touches)."""
    assert (compiled["encode:True"]["waits"], compiled["encode:True"]["releases"]) == (0, 1)
    assert (compiled["encode:False"]["waits"], compiled["encode:False"]["releases"]) == (0, 0)
    bucket = compiled["bucket:True"]
    assert (bucket["waits"], bucket["releases"]) == (1, 0)
    assert bucket["loads_ahead"] >= 1 and bucket["load_params_ahead"] == [0, 1]
    assert bucket["atomics_ahead"] == 0
    assert compiled["bucket:False"]["waits"] == 0
    # the scan's loads ahead of its wait: the codes and the lengths (params 0 and 1)
    assert compiled["scan:True"]["load_params_ahead"] == [0, 1]


def test_the_fine_lut_reads_only_its_operands_before_the_wait(compiled: dict) -> None:
    """The fine route's LUT launch may start behind the encode (or any releasing launch): ahead of
    its one wait it reads only the query and the centroids (params 0 and 1), which no releasing
    launch writes, and writes nothing; it releases nothing."""
    lut = compiled["lut:True"]
    assert (lut["waits"], lut["releases"]) == (1, 0)
    assert lut["loads_ahead"] >= 2 and lut["load_params_ahead"] == [0, 1]
    assert lut["writes_ahead"] == 0
    assert compiled["lut:False"]["waits"] == 0
    # encoding the step's key it is not launched early (below) and writes nothing before its wait
    encoding = compiled["lut-encode:True"]
    assert (encoding["waits"], encoding["releases"], encoding["writes_ahead"]) == (1, 0, 0)


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


def _launches_on_hopper(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
    """PDL as on a Hopper GPU, and the launches recorded (kernel name, launch options), not run."""
    from pqattn.runtime import launch

    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    monkeypatch.setattr(pdl, "_supported", lambda device: True)
    launched: list[tuple[str, dict]] = []
    monkeypatch.setattr(
        launch.Launcher, "__call__", lambda self, *a: launched.append((self.fn.__name__, a[3]))
    )
    return launched


def test_the_bucket_selection_starts_early_only_behind_the_encode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The encode launch releases but starts as any launch does; the bucket selection asks to start
    early when its caller launched the encode right before it (the original's entry point), and
    not otherwise (PQIndex.select may follow anything). Launches recorded, not run."""
    from pqattn.kernels.encode import pq_encode
    from pqattn.kernels.select.buckets import pq_select_buckets, workspace_numel
    from pqattn.reference import SelectParams

    launched = _launches_on_hopper(monkeypatch)
    B, H, Hkv, N, M, C = 1, 4, 2, 64, 2, 4
    cent = torch.randn(B, Hkv, M, C, 8)
    codes = torch.zeros(B, Hkv, N, M, dtype=torch.uint8)
    lengths = torch.full((B,), N, dtype=torch.int64)
    pq_encode(torch.randn(B, Hkv, 1, 16), cent, None, codes, base=lengths)
    for after_encode in (True, False):
        pq_select_buckets(
            torch.randn(B, H, 16),
            cent,
            codes,
            lengths,
            SelectParams(sink=2, window=2, heavy=8, cand_lo=2, short_threshold=12, width=12),
            positions=torch.empty(B, H, 12, dtype=torch.int64),
            counts=torch.empty(B, H, dtype=torch.int64),
            workspace=torch.zeros(workspace_numel(B * H, M, C, 8), dtype=torch.int32),
            histogram=torch.zeros(B, Hkv, C**M, dtype=torch.int32),
            buckets=(torch.zeros(B, Hkv, N, dtype=torch.int32),) * 2 + (torch.zeros(B, dtype=torch.int32),),
            after_encode=after_encode,
        )
    (enc, enc_kw), (early, early_kw), (plain, plain_kw) = launched
    assert (enc, early, plain) == (
        "_pq_encode_kernel",
        "_pq_bucket_select_kernel",
        "_pq_bucket_select_kernel",
    )
    assert (enc_kw["PDL"], enc_kw["launch_pdl"]) == (True, False)
    assert (early_kw["PDL"], early_kw["launch_pdl"]) == (True, True)
    assert plain_kw["PDL"] is False and "launch_pdl" not in plain_kw


def test_only_the_fine_lut_is_launched_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Of the fine route's launches the LUT asks to start early (behind the encode of a decode
    step); the score and collect launches start as any launch does. Launches recorded, not run."""
    launched = _launches_on_hopper(monkeypatch)
    launch_fine_on_toy_inputs("group", "max", 2)
    kinds = {name: kw for name, kw in launched}
    assert set(kinds) == {"_lut_kernel", "_score_kernel", "_collect_kernel"}
    assert (kinds["_lut_kernel"]["PDL"], kinds["_lut_kernel"]["launch_pdl"]) == (True, True)
    assert "launch_pdl" not in kinds["_score_kernel"] and "launch_pdl" not in kinds["_collect_kernel"]


def test_the_fine_lut_encoding_the_new_key_is_not_launched_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an AppendedKey the LUT launch reads the step's new key, which the launch ahead of it
    (the key's projection) writes: it starts as any launch does."""
    launched = _launches_on_hopper(monkeypatch)
    launch_fine_on_toy_inputs("group", "max", 2, append=True)
    kinds = {name: kw for name, kw in launched}
    assert kinds["_lut_kernel"]["ENCODE"] and (
        kinds["_lut_kernel"]["PDL"],
        kinds["_lut_kernel"]["launch_pdl"],
    ) == (
        True,
        False,
    )
