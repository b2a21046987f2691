"""A pytest plugin that checks every eager `PQIndex.select` and `PQIndex.attend` of a test run
against the reference, on the device and without a host sync (a sync would change the timing
a race needs), and reads the results at each test's teardown.

Per call: an appended key advances the length by one and gets the reference's codes; the selection
holds no position outside [0, length) and none twice, and no count past the length; the attention
output equals the reference's over that selection (float64). Calls inside a CUDA graph capture
are not checked. One line per test goes to $PQATTN_CHECK_DIR/attend-check-<pid>.txt: the worst
value of each check and the first call where one went wrong (an output 1e-4 off, or any other
check above zero).

Usage: PYTHONPATH=src:bench PQATTN_CHECK_DIR=DIR python3 -m pytest -p attend_check -n 4
       tests/integrations/test_hf.py
"""

from __future__ import annotations

import os

import torch

from pqattn import reference as ref
from pqattn.index import PQIndex

_select, _attend = PQIndex.select, PQIndex.attend
_checks: list[tuple[int, str, torch.Tensor]] = []  # (select call, check, its value on the device)
_calls = [0]  # the test's select calls so far


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _checked_select(self, q, keys=None, *, append=None):
    if _capturing():
        return _select(self, q, keys, append=append)
    before = self.lengths.clone()
    selection = _select(self, q, keys, append=append)
    _calls[0] += 1
    call, after = _calls[0], self.lengths.clone()
    if append is not None:
        _checks.append((call, "length", (after - before - 1).abs().max()))
        if append.shape[2] == 1 and self.config.metric == "euclidean":
            want = ref.encode(append, self.centroids)[:, :, 0]
            at = before[:, None, None, None].expand(-1, self.kv_heads, 1, self.codes.shape[3])
            _checks.append((call, "codes", (want != self.codes.gather(2, at)[:, :, 0]).sum()))
    positions, counts = selection.positions, selection.counts
    valid = torch.arange(positions.shape[-1], device=positions.device) < counts[..., None]
    outside = valid & ((positions < 0) | (positions >= after[:, None, None]))
    _checks.append((call, "outside", outside.sum()))
    ordered = torch.where(valid, positions, torch.iinfo(positions.dtype).max).sort(-1).values
    _checks.append((call, "twice", ((ordered[..., 1:] == ordered[..., :-1]) & valid[..., 1:]).sum()))
    _checks.append((call, "count", (counts > after[:, None]).sum()))
    return selection


def _checked_attend(self, q, k_cache, v_cache, selection=None, *, scale=None, block_table=None):
    out = _attend(self, q, k_cache, v_cache, selection, scale=scale, block_table=block_table)
    if _capturing() or selection is None or block_table is not None:
        return out
    positions, counts = selection.positions, selection.counts
    if positions.shape[1] != q.shape[1]:  # a group selection: one row per KV head
        g = q.shape[1] // positions.shape[1]
        positions, counts = positions.repeat_interleave(g, 1), counts.repeat_interleave(g, 1)
    want = ref.sparse_decode(
        q.double(), k_cache.double(), v_cache.double(), positions.long().clamp(min=0), counts, scale=scale
    )
    _checks.append((_calls[0], "attend", (out.double() - want).abs().max()))
    return out


PQIndex.select, PQIndex.attend = _checked_select, _checked_attend


def pytest_runtest_teardown(item) -> None:
    if not _checks:
        return
    worst: dict[str, float] = {}
    first: dict[str, tuple[int, float]] = {}
    for call, name, value in _checks:
        v = float(value)
        worst[name] = max(worst.get(name, 0.0), v)
        if v > (1e-4 if name == "attend" else 0) and name not in first:
            first[name] = (call, v)
    path = os.path.join(os.environ.get("PQATTN_CHECK_DIR", "."), f"attend-check-{os.getpid()}.txt")
    with open(path, "a") as f:
        shown = {k: f"{v:.2e}" for k, v in worst.items()}
        f.write(f"{item.nodeid} calls={_calls[0]} worst={shown} first_wrong={first}\n")
    _checks.clear()
    _calls[0] = 0
