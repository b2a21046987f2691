"""Random row reads from host memory by a GPU kernel: registered pages (cudaHostRegister, the host
tier's memory today) against a CUDA virtual-memory host allocation (cuMemCreate with a host
location, mapped at the driver's recommended granularity). The question: does the GPU's
translation of host addresses, which limits random reads spread over gigabytes, reach further
with the larger mappings? And `registered-thp`: registered pages on 2 MiB transparent huge pages
(advised before the first touch; `anon_huge_bytes_*` in the JSON says what the kernel granted),
for the translation on the host's side.

Beside them, the host tier's own fetch (`kernels.rows.fetch_rows`: persistent programs, one a
multiprocessor by default, or one a block of misses) on the same lists of the registered memory,
writing the slots as a step does.

Each case reads `rows` random 512-byte rows (sorted, as the fetch reads a list's misses) out of
each of 8 spans of `span` bytes (a layer's 8 KV heads at B1), one kernel program per 32 rows,
CUDA events, median of 20 repetitions, each with lists of its own (a repeated list would find its
translations cached).

`--touch STRIDES`: before each gather, a kernel that reads one element every STRIDE bytes of the
layer's spans (its programs all at once), timed apart: whether warming the translations first
lets the gather run at the one-layer rate, and what the warming costs.

Usage (on a GPU): PYTHONPATH=src python bench/host_vmm.py --json OUT.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from pqattn.kernels.rows import fetch_rows
from pqattn.lab.env import environment

ROW = 256  # bf16 elements a row: a KV head's key and value of one position
BLOCK_R = 32
HEADS = 8


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("handle_types", ctypes.c_int),
        ("loc_type", ctypes.c_int),
        ("loc_id", ctypes.c_int),
        ("win32", ctypes.c_void_p),
        ("flags", ctypes.c_uint8 * 8),
    ]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


class _Pointer:
    """An address a Triton launch takes as a bf16 pointer (it reads `data_ptr()` and `dtype`)."""

    dtype = torch.bfloat16

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


def _check(what: str, err: int) -> None:
    if err != 0:
        raise RuntimeError(f"{what} failed: CUresult {err}")


class VmmHost:
    """`size` bytes of host memory from cuMemCreate (location: host), mapped for the current
    device; `cpu_access` says whether the CPU may also touch it through the same address."""

    def __init__(self, size: int, device: int) -> None:
        cu = ctypes.CDLL("libcuda.so.1")
        self.cu = cu
        prop = _Prop(type=1, handle_types=0, loc_type=2, loc_id=0)  # PINNED, HOST
        gran = ctypes.c_size_t()
        _check(
            "cuMemGetAllocationGranularity",
            cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 1),
        )
        self.granularity = gran.value
        self.size = -(-size // gran.value) * gran.value
        handle = ctypes.c_uint64()
        _check(
            "cuMemCreate",
            cu.cuMemCreate(
                ctypes.byref(handle), ctypes.c_size_t(self.size), ctypes.byref(prop), ctypes.c_uint64(0)
            ),
        )
        self.handle = handle
        ptr = ctypes.c_uint64()
        _check(
            "cuMemAddressReserve",
            cu.cuMemAddressReserve(
                ctypes.byref(ptr),
                ctypes.c_size_t(self.size),
                ctypes.c_size_t(gran.value),
                ctypes.c_uint64(0),
                ctypes.c_uint64(0),
            ),
        )
        self.ptr = ptr.value
        _check(
            "cuMemMap",
            cu.cuMemMap(
                ctypes.c_uint64(self.ptr),
                ctypes.c_size_t(self.size),
                ctypes.c_size_t(0),
                handle,
                ctypes.c_uint64(0),
            ),
        )
        dev = _Access(loc_type=1, loc_id=device, flags=3)  # DEVICE, READWRITE
        _check(
            "cuMemSetAccess(device)",
            cu.cuMemSetAccess(
                ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size), ctypes.byref(dev), ctypes.c_size_t(1)
            ),
        )
        host = _Access(loc_type=2, loc_id=0, flags=3)
        self.cpu_access = cu.cuMemSetAccess(
            ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size), ctypes.byref(host), ctypes.c_size_t(1)
        )

    def pointer(self) -> _Pointer:
        return _Pointer(self.ptr)

    def free(self) -> None:
        self.cu.cuMemUnmap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size))
        self.cu.cuMemRelease(self.handle)
        self.cu.cuMemAddressFree(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size))


@triton.jit
def _fill_kernel(dst_ptr, n, BLOCK: tl.constexpr):
    """dst[j] = a hash of j (as bf16 bits; `_expected` gives the same)."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bits = ((j * 40503) & 0x3FFF).to(tl.int16)
    tl.store(dst_ptr + j, bits.to(tl.bfloat16, bitcast=True), mask=j < n)


def _expected(pos: torch.Tensor) -> torch.Tensor:
    j = pos.long()[:, None] * ROW + torch.arange(ROW, device=pos.device)
    return ((j * 40503) & 0x3FFF).to(torch.int16).view(torch.bfloat16)


@triton.jit
def _gather_kernel(src_ptr, pos_ptr, dst_ptr, n, ROW_: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    p = tl.load(pos_ptr + i, mask=live, other=0)
    e = tl.arange(0, ROW_)
    v = tl.load(src_ptr + p[:, None] * ROW_ + e[None, :], mask=live[:, None], other=0.0)
    tl.store(dst_ptr + i[:, None] * ROW_ + e[None, :], v, mask=live[:, None])


@triton.jit
def _touch_kernel(src_ptr, out_ptr, first, n, stride, BLOCK: tl.constexpr):
    """Read src[first + k * stride] for k < n (one element each, BLOCK a program); their sum to out
    so that the loads stay."""
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src_ptr + first + k.to(tl.int64) * stride, mask=k < n, other=0.0)
    tl.atomic_add(out_ptr, tl.sum(v.to(tl.float32), axis=0))


def _time_touched(
    src, pos_sets: list[torch.Tensor], dst: torch.Tensor, span_rows: int, layers: int, stride: int
) -> tuple[float, float]:
    """Median µs of the touch of each set's layer (one element every `stride` bytes of its HEADS
    spans) and of the gather right after it."""
    grid = (triton.cdiv(pos_sets[0].numel(), BLOCK_R),)
    layer_elems = HEADS * span_rows * ROW
    n = layer_elems * 2 // stride
    out = torch.zeros(1, device="cuda")
    marks = []
    for i, pos in enumerate(pos_sets):
        a, m, b = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        a.record()
        first = (i % layers) * layer_elems
        _touch_kernel[(triton.cdiv(n, 256),)](src, out, first, n, stride // 2, BLOCK=256, num_warps=4)
        m.record()
        _gather_kernel[grid](src, pos, dst, pos.numel(), ROW_=ROW, BLOCK=BLOCK_R, num_warps=4)
        b.record()
        marks.append((a, m, b))
    torch.cuda.synchronize()
    touch = statistics.median(a.elapsed_time(m) * 1e3 for a, m, _ in marks[5:])
    return touch, statistics.median(m.elapsed_time(b) * 1e3 for _, m, b in marks[5:])


def _positions(span_rows: int, rows: int, gen: torch.Generator, layer: int = 0) -> torch.Tensor:
    """HEADS lists of `rows` sorted random rows, each in its own span of the layer's HEADS spans
    (global row numbers)."""
    first = layer * HEADS * span_rows
    out = [
        first + h * span_rows + torch.randperm(span_rows, generator=gen)[:rows].sort().values
        for h in range(HEADS)
    ]
    return torch.cat(out).cuda()


REPEATS = 25


def _time(src: torch.Tensor, pos_sets: list[torch.Tensor], dst: torch.Tensor) -> float:
    grid = (triton.cdiv(pos_sets[0].numel(), BLOCK_R),)
    marks = []
    for pos in pos_sets:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        _gather_kernel[grid](src, pos, dst, pos.numel(), ROW_=ROW, BLOCK=BLOCK_R, num_warps=4)
        b.record()
        marks.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in marks[5:])


def _time_fetch(
    host: torch.Tensor, span_rows: int, pos_sets: list[torch.Tensor], programs: int | None
) -> float:
    """fetch_rows of each set of misses [HEADS * rows] (global row numbers, each head's in its
    span) from the registered memory seen as host rows [1, HEADS, span_rows, 2, D / 2]."""
    rows = host[: HEADS * span_rows * ROW].view(torch.bfloat16).view(1, HEADS, span_rows, 2, ROW // 2)
    n = pos_sets[0].numel() // HEADS
    dev = pos_sets[0].device
    slots = torch.arange(n, dtype=torch.int32, device=dev).expand(1, HEADS, n).contiguous()
    count = torch.full((1, HEADS), n, dtype=torch.int32, device=dev)
    heads = torch.arange(HEADS, device=dev)[:, None] * span_rows
    sets = [((pos.view(HEADS, n) - heads).int()[None].contiguous(), slots, count) for pos in pos_sets]
    k_slots = torch.empty(1, HEADS, n, ROW // 2, dtype=torch.bfloat16, device="cuda")
    v_slots = torch.empty_like(k_slots)
    k_new = torch.zeros(1, HEADS, 1, ROW // 2, dtype=torch.bfloat16, device="cuda")
    lengths = torch.tensor([span_rows], device="cuda")  # (the new row lands past every listed one)
    marks = []
    for misses in sets:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fetch_rows(rows, k_new, k_new, lengths, misses, k_slots, v_slots, programs=programs)
        b.record()
        marks.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in marks[5:])


HUGE_PAGE = 2 << 20
KINDS = ("registered", "registered-thp", "vmm-host")


def _huge_page_empty(nbytes: int) -> torch.Tensor:
    """int16 anonymous memory on a 2 MiB boundary advised for transparent huge pages before its
    first touch (the tensor keeps the mapping alive)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(region, dtype=torch.uint8)
    skip = -base.data_ptr() % HUGE_PAGE
    return base[skip : skip + nbytes].view(torch.int16)


def _anon_huge_bytes() -> int:
    """AnonHugePages of /proc/meminfo: the bytes the kernel backs with transparent huge pages."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def _allocate(kind: str, total: int) -> tuple[_Pointer, object]:
    """Host memory of `kind` (one of KINDS) and what frees it, filled by `_fill_kernel`."""
    if kind.startswith("registered"):
        host = (
            _huge_page_empty(total)
            if kind == "registered-thp"
            else torch.empty(total // 2, dtype=torch.int16)
        )
        cudart = torch.cuda.cudart()
        assert int(cudart.cudaHostRegister(host.data_ptr(), total, 1 | 2)) == 0  # portable, mapped
        src, keep = _Pointer(host.data_ptr()), host
    else:
        vmm = VmmHost(total, torch.cuda.current_device())
        src, keep = vmm.pointer(), vmm
    _fill_kernel[(triton.cdiv(total // 2, 4096),)](src, total // 2, BLOCK=4096)
    torch.cuda.synchronize()
    return src, keep


def _release(kind: str, keep) -> None:
    if kind.startswith("registered"):
        torch.cuda.cudart().cudaHostUnregister(keep.data_ptr())
    else:
        keep.free()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spans", default="67108864,268435456", help="bytes per KV head's span")
    p.add_argument("--rows", default="4352,870,218", help="rows read from each span (no hits, 0.8, 0.95)")
    p.add_argument(
        "--total",
        type=int,
        default=0,
        help="bytes of host memory allocated (default: one layer's HEADS spans); repetition i reads "
        "layer i's spans (modulo), as the model's layers read theirs one after the other",
    )
    p.add_argument("--fetch", action="store_true", help="also time fetch_rows (registered memory)")
    p.add_argument("--kinds", default="registered,vmm-host", help=f"host memory kinds, some of {KINDS}")
    p.add_argument(
        "--touch", default="", help="comma-separated bytes: also gather after touching every STRIDE"
    )
    p.add_argument("--json", required=True)
    args = p.parse_args()
    spans = [int(x) for x in args.spans.split(",")]
    total = max(args.total, HEADS * max(spans))
    gen = torch.Generator().manual_seed(0)
    doc = {"env": environment(torch.device("cuda")), "total_bytes": total, "rows": []}
    for kind in args.kinds.split(","):
        if kind not in KINDS:
            raise SystemExit(f"--kinds: expected some of {KINDS}, got {kind!r}")
        src, keep = _allocate(kind, total)
        doc[f"anon_huge_bytes_{kind}"] = _anon_huge_bytes()
        if kind == "vmm-host":
            doc["granularity"] = keep.granularity
            doc["vmm_cpu_access_result"] = keep.cpu_access
        for span in spans:
            layers = total // (HEADS * span)
            for rows in (int(x) for x in args.rows.split(",")):
                span_rows = span // (2 * ROW)
                pos_sets = [_positions(span_rows, rows, gen, i % layers) for i in range(REPEATS)]
                dst = torch.empty(pos_sets[0].numel(), ROW, dtype=torch.bfloat16, device="cuda")
                cases = [("gather", None)]
                if args.fetch and kind.startswith("registered") and layers == 1:
                    cases += [("fetch-per-sm", None), ("fetch-per-block", 1 << 20)]
                cases += [(f"touch-{t}", int(t)) for t in args.touch.split(",") if t]
                for name, programs in cases:
                    touch_us = None
                    if name.startswith("touch"):
                        touch_us, us = _time_touched(src, pos_sets, dst, span_rows, layers, programs)
                    elif name == "gather":
                        us = _time(src, pos_sets, dst)
                    else:
                        us = _time_fetch(keep, span_rows, pos_sets, programs)
                    row = {"memory": kind, "kernel": name, "span_bytes": span, "rows_per_span": rows}
                    row |= {"layers": layers, "us": us, "gbps": pos_sets[0].numel() * ROW * 2 / us / 1e3}
                    if touch_us is not None:
                        row["touch_us"] = touch_us
                    if name == "gather" or touch_us is not None:
                        row["checked"] = torch.equal(
                            dst.view(torch.int16), _expected(pos_sets[-1]).view(torch.int16)
                        )
                    doc["rows"].append(row)
                    print(row, flush=True)
        _release(kind, keep)
        del keep
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
