"""Programmatic dependent launch (PDL): the selection's second launch behind its first, and the
bucket selection and the fine route's LUT launch behind the encode launch.

The selection is two launches of a few microseconds each, the cut (one program per query row)
and the scan (many programs over the tokens), so the gap between them (the scan's launch and
ramp-up after the cut drains) is a visible share of it. On Hopper and later a launch made with
the programmatic-stream-serialization attribute (Triton's `launch_pdl` option) may start before
the launch ahead of it in the stream has finished, once every program of that one has executed
`griddepcontrol.launch_dependents` (`release_next`); its programs then block in
`griddepcontrol.wait` (`wait_prior`) until that launch has completed and its writes are
visible. A launch whose predecessor never releases (any kernel but the cut, the scan and the
encode) starts when that one completes, as without the attribute.

The contract of a kernel compiled with the `PDL` constexpr:
- a kernel that is launched early (the scan, the bucket selection, the fine LUT) has every program call
  `wait_prior` unconditionally, before reading anything the launch ahead of it may write; a
  kernel with a launch behind it that may start early (the cut, the scan, the encode) has every
  program call `release_next` (the scan after its wait, the others at once: they are never
  launched early). A launch therefore completes only after the one ahead of it has, and the
  launches keep the order they have without PDL;
- before `wait_prior`, a program reads only what the launch ahead of it never writes and what
  was written two or more launches back: the scan reads the codes and the lengths there, which
  the cut never writes, so those loads overlap the cut. A program may write there only memory
  that no launch that can be in flight reads or writes: the bucket selection launched behind
  the encode (the original's entry point, `pq_select_buckets(after_encode=True)`) writes its
  row's LUT and the zeros of its dense weights before it waits, while the encode runs.

The scan is launched early behind the cut, the bucket selection and the fine LUT (which reads
the query and centroids and writes its own workspace rows after its wait) behind the encode; the
cut, the attention and the encoding are not (measured: docs/kernels/launch.md), nor is a fine LUT
launch that encodes a decode step's key itself (`pqattn.kernels.select.AppendedKey`: it reads
that key, which the launch ahead of it writes).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pqattn.runtime.launch import interpreted

# PQATTN_PDL=0 launches every kernel without it (the same kernels: for comparisons).
ENABLED = os.environ.get("PQATTN_PDL", "1") != "0"


@functools.cache
def _supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_meta(device: torch.device, *, early: bool = True) -> dict:
    """The `PDL` constexpr of a launch on `device` and, when `early`, the launch option that lets
    it start before the launch ahead of it has finished."""
    if ENABLED and not interpreted() and _supported(device):
        return {"PDL": True, "launch_pdl": early}
    return {"PDL": False}


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """Block until the launch ahead of this one has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """Let the next launch start once every program of this one has called this."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
