"""The host tier (SPEC §10) on the user's path, with its kernel figures beside.

Parts (one JSON, each part a key):
  fit:   Llama-3-8B layer shapes, 8 layers, B1 32K and 128K: `pq_hf.StaticDecoder` with
         HFConfig(kv_placement="host") against the same loop with the cache on the GPU (sparse) and
         the dense split-K loop, one model at a time: ms per token (CUDA events around each
         replayed step, median), prefill seconds, greedy tokens compared, hit rate, PCIe bytes per
         token, host and GPU memory. `--fit-overlaps`: the host loop again on lists forced to
         those overlaps (as the large part's `--overlaps`), beside the same GPU-cache loop.
  large: 32 layers, B1 512K and B4 128K, where dense decoding does not fit on one GPU: the host
         tier's caches filled directly (random codes and rows at the context length; a
         2048-token prompt prefilled for real), then ms per token as above. `--overlaps`: the
         same loop again with each layer's heavy rows replaced, after its selection ran, by lists
         that keep that share of the previous step's (the rest fresh, ascending as the
         selection writes them): the step at set hit rates, which random weights (whose
         selections change almost entirely) cannot give.
  fetch: kernel figures of one layer (B1, 8 KV heads, 512K tokens, D 128, bf16): the row lookup
         and the fetch at set hit rates, GB/s of the missed rows, beside a pinned contiguous
         host-to-device copy of the same bytes.
  lookup: kernel figures of the row lookup alone (8 KV heads a sequence, lists of 4352 over 8704
         slots, 512K tokens): µs a step at B1 and B4 and hit rates 0 and 0.8, for each chunk of
         list entries a program reads (LOOKUP_CHUNK's candidates; 8192: one program a row), by
         replaying a CUDA graph of 24 steps over different lists.
  span:  the fetch's GB/s against the span of host memory it reads (random lists), and with the
         rows from cudaHostAlloc instead of registered.
  text:  the project's trained model on held-out Python files (B4, 16K-byte prompts or
         `--text-context`, 256 greedy tokens): the row cache's hit rate with the default slots
         and with slots = the list width (then a hit is a row listed at step t and at step
         t - 1), tokens against the GPU cache;
         `--text-widths 1,2,4`: with each of those row caches instead (in list widths). It also
         runs on a CPU (`--device cpu`: the PyTorch reference of the host tier, the same rule).

Usage (on a GPU):
    PYTHONPATH=src python bench/host_tier.py --parts fit,fetch,text --json OUT.json
    PYTHONPATH=src python bench/host_tier.py --parts large --json OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time

import torch
import transformers
import triton

import pqattn.integrations.hf as pq_hf
from pqattn import PQIndex
from pqattn import reference as ref
from pqattn.dispatch import PQCodebook
from pqattn.host import HostCache, mapped_host_empty
from pqattn.kernels import rows as rows_kernels
from pqattn.kernels.rows import FETCH_BLOCK, FETCH_BLOCKS, FETCH_PROGRAMS_PER_SM, fetch_rows, lookup_rows
from pqattn.lab import baselines
from pqattn.lab.env import environment
from pqattn.lab.suites import LLAMA3_8B_LAYERS, llama_config

HEAVY = 1024  # tokens per query head (the group keeps 4 x 1024 rows per KV head)
PROMPT = 2048  # the real prefill of the large part, before its caches are filled directly
ROW_BYTES = 2 * 128 * 2  # a KV head's key and value of one position, bf16


def _model(layers: int, max_positions: int) -> torch.nn.Module:
    cfg = llama_config(**(LLAMA3_8B_LAYERS | {"layers": layers}), max_positions=max_positions)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    return model


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _states(model) -> list:
    return [m._pqattn_state for m in model.modules() if getattr(m, "_pqattn_state", None) is not None]


def _row_stats(model) -> tuple[int, int]:
    """(lookups, misses) of every layer's row cache so far (one sync)."""
    stats = [s.host.row_cache.stats.sum((0, 1)) for s in _states(model) if s.host is not None]
    total = torch.stack(stats).sum(0).tolist() if stats else [0, 0]
    return int(total[0]), int(total[1])


def _time_steps(decoder, steps: int) -> list[float]:
    """ms of each of `steps` replayed decode steps (after the eager step, the capture and 3 warm)."""
    for _ in range(min(5, decoder.steps_left - steps)):
        decoder.step()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        decoder.step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _seconds(fn, *args):
    """(fn(*args), its wall-clock seconds with the GPU's work included)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _steps_and_rows(model, decoder, steps: int) -> tuple[list[float], int, int]:
    """ms of each timed step (`_time_steps`), and the row caches' lookups and misses over them."""
    before = _row_stats(model)
    times = _time_steps(decoder, steps)
    after = _row_stats(model)
    return times, after[0] - before[0], after[1] - before[1]


def _loop(model, ids, steps: int, placement: str | None, overlaps: tuple[float, ...] = ()) -> dict:
    """Prefill + `steps` timed steps of the static loop; placement None: the dense split-K loop.
    With the host tier, `overlaps`: `steps` more for each, on lists forced to that overlap."""
    if placement is None:
        model.set_attn_implementation(baselines.register_dense_decode())
    else:
        pq_hf.enable(model, pq_hf.HFConfig(heavy=HEAVY, kv_placement=placement))
    per_overlap = steps + 24  # settling, warm-up and timed steps
    new_tokens = steps + 16 + per_overlap * len(overlaps)
    decoder, prefill_s = _seconds(pq_hf.StaticDecoder, model, ids, new_tokens)
    # the forcing goes into the captured graph, off until set
    forced = _ForcedLists(model, ids.shape[1], new_tokens, ids.shape[0]) if overlaps else None
    times, lookups, misses = _steps_and_rows(model, decoder, steps)
    row = {
        "placement": placement or "dense-split-k",
        "prefill_s": prefill_s,
        "ms_per_token": statistics.median(times),
        "ms_iqr": _iqr(times),
        "gpu_peak_bytes": torch.cuda.max_memory_allocated(),
        "tokens": decoder.tokens[:, : decoder.max_new_tokens - decoder.steps_left].tolist(),
    }
    if placement == "host":
        B = ids.shape[0]
        layers = len(_states(model))
        row |= {
            "hit_rate": 1 - misses / lookups,
            "pcie_bytes_per_token": (misses / steps + B * layers * 8) * ROW_BYTES,
            "host_bytes": sum(s.host.footprint.host for s in _states(model)),
            "tier_gpu_bytes": sum(s.host.footprint.gpu for s in _states(model)),
            "row_cache_slots": _states(model)[0].host.slots,
            "list_width": _states(model)[0].host.list_width,
        }
        if forced is not None:
            row["at_overlaps"] = []
            for overlap in overlaps:
                forced.set(overlap)
                for _ in range(8):  # the row caches settle to the lists' overlap
                    decoder.step()
                times, lookups, misses = _steps_and_rows(model, decoder, steps)
                ms, hit = statistics.median(times), 1 - misses / lookups
                row["at_overlaps"].append({"heavy_overlap": overlap, "ms_per_token": ms, "hit_rate": hit})
    del decoder, forced
    pq_hf.disable(model)
    _free()
    return row


def _iqr(xs: list[float]) -> float:
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def _same_prefix(a: list[int], b: list[int]) -> int:
    """Tokens two greedy runs share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def part_fit(steps: int, overlaps: tuple[float, ...]) -> list[dict]:
    rows = []
    for context in (32768, 131072):
        model = _model(8, context + 512)
        ids = torch.randint(
            0, 32000, (1, context), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
        )
        case = {"case": f"llama8L-B1-{context // 1024}K", "B": 1, "context": context, "layers": 8}
        host = _loop(model, ids, steps, "host", overlaps)
        gpu, gpu_again, dense = (_loop(model, ids, steps, p) for p in ("gpu", "gpu", None))
        for r in (host, gpu, dense):
            rows.append(case | {k: v for k, v in r.items() if k != "tokens"})
        n = len(gpu["tokens"][0])
        rows[-3]["tokens_equal_to_gpu"] = f"{_same_prefix(host['tokens'][0][:n], gpu['tokens'][0])}/{n}"
        # the GPU cache against itself: the selection's list order varies from run to run (atomics),
        # which changes the attention's rounding and, on random weights, the greedy tokens
        rows[-2]["tokens_equal_to_a_second_run"] = (
            f"{_same_prefix(gpu_again['tokens'][0], gpu['tokens'][0])}/{n}"
        )
        for r in rows[-3].get("at_overlaps", []):
            r["vs_gpu_sparse"] = gpu["ms_per_token"] / r["ms_per_token"]
        rows[-3]["vs_gpu_sparse"] = gpu["ms_per_token"] / host["ms_per_token"]
        rows[-3]["vs_dense_split_k"] = dense["ms_per_token"] / host["ms_per_token"]
        del model
        _free()
    return rows


def _fill_directly(model, decoder, tokens: int) -> None:
    """Give every layer an index of `tokens` random codes (the prefill's centroids) and host rows
    of random keys and values at those positions, and move the loop to position `tokens`."""
    gen = torch.Generator("cuda").manual_seed(2)
    pairs = torch.randn(1 << 16, 2, 128, device="cuda", generator=gen).to(torch.bfloat16)
    chunk = None  # the rows of `pairs` in the tier's layout
    for state in _states(model):
        old = state.index
        B, Hkv, M = old.batch, old.kv_heads, old.config.subvectors
        codes = torch.randint(
            0, 1 << old.config.bits, (B, Hkv, tokens, M), dtype=torch.uint8, device="cuda", generator=gen
        )
        index = PQIndex.from_codebook(
            PQCodebook(old.centroids, codes, old.phi), [tokens] * B, capacity=old.capacity, config=old.config
        )
        rows = state.host_layer.rows
        if chunk is None:
            chunk = ref.encode_rows(pairs[:, 0], pairs[:, 1], rows.dtype)
        for b in range(B):
            for h in range(Hkv):
                for start in range(0, tokens, chunk.shape[0]):
                    n = min(chunk.shape[0], tokens - start)
                    rows[b, h, start : start + n].copy_(chunk[:n])
        state.host = None
        state.index = None
        gc.collect()
        state.host = HostCache(
            index,
            query_heads=model.config.num_attention_heads,
            dtype=torch.bfloat16,
            rows=rows,
            int8=state.config.host_int8,
        )
        state.index = index
    decoder.position.fill_(tokens)


def _profile(decoder, steps: int = 3) -> list[dict]:
    """GPU time per decode step by kernel (the replayed graph's kernels), the top 12 and the rest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            decoder.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernels.sort(key=lambda e: -e.device_time_total)
    rows = [
        {"kernel": e.key[:80], "us_per_step": e.device_time_total / steps, "calls": e.count} for e in kernels
    ]
    rest = sum(r["us_per_step"] for r in rows[12:])
    return [*rows[:12], {"kernel": "(the rest)", "us_per_step": rest, "calls": 0}]


class _ForcedLists:
    """Each layer's heavy rows, after its selection ran, replaced by step t's row of `lists`
    [T, B, Hkv, heavy] while `on` (a device flag; the graph captures the copy either way): the
    step at a set overlap between consecutive lists."""

    def __init__(self, model, context: int, steps: int, B: int) -> None:
        states = _states(model)
        c = states[0].config
        self.sink, self.window, self.context, self.T = c.sink, c.window, context, steps
        self.heavy = states[0].host.list_width - c.sink - c.window
        self.lists = torch.zeros(steps, B, 8, self.heavy, dtype=torch.int32, device="cuda")
        self.on = torch.zeros((), dtype=torch.bool, device="cuda")
        for state in states:
            index = state.index
            index.select = self._forced(index, index.select)

    def _forced(self, index, select):
        def forced(q: torch.Tensor):
            sel = select(q)
            step = (index.lengths[:1] - self.context - 1).remainder(self.T)
            heavy = sel.positions[:, :, self.sink : self.sink + self.heavy]
            heavy.copy_(torch.where(self.on, self.lists.index_select(0, step)[0], heavy))
            return sel

        return forced

    def set(self, overlap: float | None) -> None:
        """Lists that keep `overlap` of the previous step's positions (None: the selection's own)."""
        self.on.fill_(overlap is not None)
        if overlap is None:
            return
        T, B, Hkv, L = self.lists.shape
        span = self.context - self.window - self.sink  # candidates of every step: never in a window
        for b in range(B):
            self.lists[:, b] = _lists(T, L, span, overlap, Hkv)[:, 0].sort(-1).values + self.sink


def part_large(
    steps: int,
    shapes: list[tuple[int, int]],
    sorts: list[bool],
    int8: bool,
    per_sm: list[int],
    overlaps: list[float | None],
) -> list[dict]:
    rows = []
    per_overlap = steps + 24  # settling, warm-up, timed and profiled steps
    for (B, context), sort, programs in ((x, s, p) for x in shapes for s in sorts for p in per_sm):
        rows_kernels.SORT_MISSES = sort
        rows_kernels.FETCH_PROGRAMS_PER_SM = programs
        model = _model(32, context + 512)
        pq_hf.enable(model, pq_hf.HFConfig(heavy=HEAVY, kv_placement="host", host_int8=int8))
        ids = torch.randint(0, 32000, (B, PROMPT), device="cuda")
        new = context - PROMPT + per_overlap * len(overlaps) + 16
        decoder, setup_s = _seconds(pq_hf.StaticDecoder, model, ids, new)
        _, fill_s = _seconds(_fill_directly, model, decoder, context)
        forced = _ForcedLists(model, context, per_overlap * len(overlaps) + 16, B)
        for overlap in overlaps:
            forced.set(overlap)
            rows.append(
                _large_row(model, decoder, B, context, steps, int8, sort, programs, setup_s, fill_s, overlap)
            )
        del decoder, model, forced
        _free()
    return rows


def _large_row(model, decoder, B, context, steps, int8, sort, programs, setup_s, fill_s, overlap) -> dict:
    for _ in range(8):  # the row caches settle to the lists' overlap
        decoder.step()
    times, lookups, misses = _steps_and_rows(model, decoder, steps)
    ms = statistics.median(times)
    row_bytes = 2 * 128 + 8 if int8 else ROW_BYTES
    states = _states(model)
    kv_dense = B * 32 * 8 * context * ROW_BYTES
    row = {
        "case": f"llama32L-B{B}-{context // 1024}K" + ("-int8" if int8 else ""),
        "B": B,
        "context": context,
        "layers": 32,
        "placement": "host",
        "ms_per_token": ms,
        "ms_iqr": _iqr(times),
        "tokens_per_s": B * 1000 / ms,
        "hit_rate": 1 - misses / lookups,
        "pcie_bytes_per_token": (misses / steps + B * 32 * 8) * row_bytes,
        "host_bytes": sum(s.host.footprint.host for s in states),
        "tier_gpu_bytes": sum(s.host.footprint.gpu for s in states),
        "row_cache_slots": states[0].host.slots,
        "list_width": states[0].host.list_width,
        "gpu_peak_bytes": torch.cuda.max_memory_allocated(),
        "dense_kv_bytes": kv_dense,
        "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "gpu_total_bytes": torch.cuda.get_device_properties(0).total_memory,
        "setup_s": setup_s,
        "fill_s": fill_s,
        "sorted_misses": sort,
        "fetch_programs_per_sm": programs,
        "int8": int8,
        "heavy_overlap": overlap,  # None: the selection's own lists
        "profile": _profile(decoder),
    }
    print({k: v for k, v in row.items() if k != "profile"}, flush=True)
    for k in row["profile"]:
        print(f"   {k['us_per_step']:9.1f} us  {k['calls']:5d}  {k['kernel']}", flush=True)
    return row


def _lists(T: int, L: int, N: int, hit: float, Hkv: int) -> torch.Tensor:
    """[T, 1, Hkv, L] lists: each keeps `hit` of the previous one's positions, the rest fresh."""
    gen = torch.Generator("cuda").manual_seed(3)
    first = [torch.randperm(N, device="cuda", generator=gen)[:L] for _ in range(Hkv)]
    lists = [torch.stack(first)[None]]
    keep = int(hit * L)
    for _ in range(T - 1):
        prev = lists[-1]
        fresh = torch.randint(0, N, (1, Hkv, 4 * L), device="cuda", generator=gen)
        rows = []
        for h in range(Hkv):
            kept = prev[0, h, torch.randperm(L, device="cuda", generator=gen)[:keep]]
            new = fresh[0, h][~torch.isin(fresh[0, h], prev[0, h])].unique()
            new = new[torch.randperm(new.numel(), device="cuda", generator=gen)[: L - keep]]
            rows.append(torch.cat([kept, new]))
        lists.append(torch.stack(rows)[None])
    return torch.stack(lists).int()


def _pinned_copy_us(nbytes: int) -> float:
    """Median µs of a contiguous pinned host-to-device copy of nbytes (the copy engine's floor)."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    marks = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        marks.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in marks)


def part_fetch() -> list[dict]:
    B, Hkv, N, D, L = 1, 8, 1 << 19, 128, 4352
    S = 2 * L
    rows_host = mapped_host_empty((B, Hkv, N, 2, D), torch.bfloat16, torch.device("cuda"))
    rows_host.view(torch.int16).random_()
    k_slots = torch.zeros(B, Hkv, S, D, dtype=torch.bfloat16, device="cuda")
    v_slots = torch.zeros_like(k_slots)
    lengths = torch.tensor([N], device="cuda")
    k_new = torch.randn(B, Hkv, 1, D, device="cuda", dtype=torch.bfloat16)
    counts = torch.full((B, Hkv), L, dtype=torch.int32, device="cuda")
    out = []
    sweep = [(hit, sort, r) for hit in (0.0, 0.8) for sort in (False, True) for r in FETCH_BLOCKS]
    sweep += [(hit, True, FETCH_BLOCK) for hit in (0.5, 0.95)]
    T = 24
    lists = {hit: _lists(T, L, N - 1, hit, Hkv) for hit in (0.0, 0.5, 0.8, 0.95)}
    for hit, ordered, block_rows in sweep:
        cache = ref.new_row_cache(B, Hkv, N, S, torch.device("cuda"))
        shapes = ((B, Hkv, L), (B, Hkv, L), (B, Hkv))
        misses = ref.Misses(*(torch.zeros(s, dtype=torch.int32, device="cuda") for s in shapes))
        slot_list = torch.empty(B, Hkv, L, dtype=torch.int32, device="cuda")
        timed = []
        for rep in range(2):
            for t in range(T):
                marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                marks[0].record()
                lookup_rows(lists[hit][t], counts, cache, misses, slot_list, sort=ordered)
                marks[1].record()
                fetch_rows(rows_host, k_new, k_new, lengths, misses, k_slots, v_slots, block_rows=block_rows)
                marks[2].record()
                if rep == 1 and t > 0:
                    timed.append((marks, misses.count.sum()))
        torch.cuda.synchronize()
        lookup = statistics.median(a.elapsed_time(b) * 1e3 for (a, b, _), _ in timed)
        fetch = statistics.median(b.elapsed_time(c) * 1e3 for (_, b, c), _ in timed)
        missed = statistics.median(int(n) for _, n in timed)
        copy_us = _pinned_copy_us(missed * ROW_BYTES)
        out.append(
            {
                "case": f"rows-B1-N512K-L{L}-hit{int(hit * 100)}"
                + ("-sorted" if ordered else "")
                + f"-R{block_rows}",
                "target_hit_rate": hit,
                "sorted_misses": ordered,
                "block_rows": block_rows,
                "hit_rate": 1 - missed / (Hkv * L),
                "lookup_us": lookup,
                "fetch_us": fetch,
                "missed_bytes": missed * ROW_BYTES,
                "fetch_gbps": missed * ROW_BYTES / fetch / 1e3,
                "pinned_copy_us": copy_us,
                "pinned_copy_gbps": missed * ROW_BYTES / copy_us / 1e3,
                "note": "kernel figures: lookup_rows + fetch_rows on given lists, eager launches, "
                "CUDA events",
            }
        )
        print(out[-1], flush=True)
    return out


def part_lookup() -> list[dict]:
    Hkv, N, L, T = 8, 1 << 19, 4352, 24
    S = 2 * L
    out = []
    for B, hit in ((1, 0.0), (1, 0.8), (4, 0.8)):
        lists = torch.cat([_lists(T, L, N - 1, hit, Hkv) for _ in range(B)], dim=1)  # [T, B, Hkv, L]
        counts = torch.full((B, Hkv), L, dtype=torch.int32, device="cuda")
        shapes = ((B, Hkv, L), (B, Hkv, L), (B, Hkv))
        for chunk in (128, 256, 512, 1024, 2048, 8192):
            cache = ref.new_row_cache(B, Hkv, N, S, torch.device("cuda"))
            misses = ref.Misses(*(torch.zeros(s, dtype=torch.int32, device="cuda") for s in shapes))
            slot_list = torch.empty(B, Hkv, L, dtype=torch.int32, device="cuda")
            work = torch.zeros(
                rows_kernels.lookup_workspace_numel(B * Hkv, L, S, chunk), dtype=torch.int32, device="cuda"
            )

            graph = torch.cuda.CUDAGraph()
            for record in (False, True):  # the first pass compiles
                with torch.cuda.graph(graph) if record else contextlib.nullcontext():
                    for t in range(T):
                        lookup_rows(lists[t], counts, cache, misses, slot_list, workspace=work, block=chunk)
            for _ in range(3):
                graph.replay()
            times = []
            for _ in range(9):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                b.record()
                times.append((a, b))
            torch.cuda.synchronize()
            lookups, missed = cache.stats.sum((0, 1)).tolist()
            out.append(
                {
                    "case": f"lookup-B{B}-N512K-L{L}-hit{int(hit * 100)}-chunk{chunk}",
                    "B": B,
                    "target_hit_rate": hit,
                    "chunk": chunk,
                    "hit_rate": 1 - missed / lookups,
                    "lookup_us": statistics.median(a.elapsed_time(b) * 1e3 for a, b in times) / T,
                    "note": "kernel figures: lookup_rows alone on given lists, a CUDA graph of 24 steps",
                }
            )
            print(out[-1], flush=True)
    return out


def part_span() -> list[dict]:
    """The fetch's rate against the span of host memory it reads and the persistent programs that
    read it (random lists, no sort): B1 over 128K and 512K tokens, B4 over 128K, with 1, 2 and 4
    programs a multiprocessor and one program a block of misses (every block at once); rows
    registered (the tier's way) and, at the default programs, from cudaHostAlloc."""
    D, L, Hkv = 128, 4352, 8
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    makers = {
        "registered": lambda shape: mapped_host_empty(shape, torch.bfloat16, torch.device("cuda")),
        "cudaHostAlloc": lambda shape: torch.empty(shape, dtype=torch.bfloat16, pin_memory=True),
    }
    sweep = [1 * sms, 2 * sms, 4 * sms, None]
    out = []
    for alloc, B, N, program_counts in (
        ("registered", 1, 1 << 17, sweep),
        ("registered", 1, 1 << 19, sweep),
        ("registered", 4, 1 << 17, sweep),
        ("cudaHostAlloc", 1, 1 << 19, [FETCH_PROGRAMS_PER_SM * sms]),
    ):
        rows = makers[alloc]((B, Hkv, N, 2, D))
        rows.view(torch.int16).random_()
        counts = torch.full((B, Hkv), L, dtype=torch.int32, device="cuda")
        k_new = torch.randn(B, Hkv, 1, D, device="cuda", dtype=torch.bfloat16)
        lengths = torch.full((B,), N, device="cuda")
        for hit, programs in ((hit, p) for hit in (0.0, 0.8) for p in program_counts):
            every_block = B * Hkv * triton.cdiv(L, FETCH_BLOCK)
            lists = torch.cat([_lists(24, L, N - 1, hit, Hkv) for _ in range(B)], 1)
            k_slots = torch.zeros(B, Hkv, 2 * L, D, dtype=torch.bfloat16, device="cuda")
            v_slots = torch.zeros_like(k_slots)
            cache = ref.new_row_cache(B, Hkv, N, 2 * L, torch.device("cuda"))
            shapes = ((B, Hkv, L), (B, Hkv, L), (B, Hkv))
            misses = ref.Misses(*(torch.zeros(s, dtype=torch.int32, device="cuda") for s in shapes))
            slot_list = torch.empty(B, Hkv, L, dtype=torch.int32, device="cuda")
            timed = []
            for rep in range(2):
                for t in range(24):
                    lookup_rows(lists[t], counts, cache, misses, slot_list, sort=False)
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    fetch_rows(
                        rows,
                        k_new,
                        k_new,
                        lengths,
                        misses,
                        k_slots,
                        v_slots,
                        programs=programs or every_block,
                    )
                    b.record()
                    if rep and t:
                        timed.append((a, b, misses.count.sum()))
            torch.cuda.synchronize()
            us = statistics.median(a.elapsed_time(b) * 1e3 for a, b, _ in timed)
            missed = statistics.median(int(c) for _, _, c in timed)
            label = f"P{programs}" if programs else "every-block"
            out.append(
                {
                    "case": f"span-{alloc}-B{B}-N{N // 1024}K-hit{int(hit * 100)}-{label}",
                    "span_bytes": rows.numel() * rows.element_size(),
                    "programs": programs or every_block,
                    "fetch_us": us,
                    "missed_bytes": missed * ROW_BYTES,
                    "fetch_gbps": missed * ROW_BYTES / us / 1e3,
                }
            )
            print(out[-1], flush=True)
        del rows
    return out


def part_text(
    model_path: str, widths: list[int] | None, device: torch.device, docs: int, steps: int, context: int
) -> list[dict]:
    """The trained model on held-out text: the GPU cache's tokens, then the host tier's hit rate with
    the default slots and with one list width (or, with `widths`, with each that many list widths)."""
    from pqattn.lab.corpus import documents, find_corpus
    from pqattn.lab.tasks import load_model

    model = load_model(model_path, device)
    corpus = find_corpus()
    texts = documents(corpus.held_out, context, docs)
    ids = torch.tensor([list(d) for d in texts], dtype=torch.int64, device=device)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    width = pq_hf.HFConfig().sink + pq_hf.HFConfig().row_heavy(group) + pq_hf.HFConfig().window
    runs = [("gpu", "gpu", None)]
    if widths is None:
        runs += [("host", "host", None), ("host-slots-L", "host", width)]
    else:
        runs += [(f"host-slots-{w}L", "host", w * width) for w in widths]
    out, tokens = [], {}
    for name, placement, slots in runs:
        config = pq_hf.HFConfig(kv_placement=placement, host_slots=slots)
        pq_hf.enable(model, config)
        decoder = pq_hf.StaticDecoder(model, ids, steps)
        decoder.run()
        tokens[name] = decoder.tokens.tolist()
        case = f"byte-llama-13m-B{docs}-{context // 1024}K"
        row = {"case": case, "run": name, "slots": config.host_slots, "steps": steps, "context": context}
        if placement == "host":
            per_layer = []
            for st in _states(model):
                lookups, misses = st.host.row_cache.stats.sum((0, 1)).tolist()
                per_layer.append(1 - misses / lookups)
            row |= {
                "list_width": width,
                "hit_rate": statistics.fmean(per_layer),
                "hit_rate_per_layer": per_layer,
                "tokens_equal_to_gpu": sum(
                    a == b
                    for x, y in zip(tokens[name], tokens["gpu"], strict=True)
                    for a, b in zip(x, y, strict=True)
                ),
                "tokens": docs * steps,
            }
        out.append(row)
        print(row, flush=True)
        del decoder
        pq_hf.disable(model)
        _free()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--parts", default="fit,fetch,text", help="comma-separated: fit, large, fetch, lookup, span, text"
    )
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per loop")
    parser.add_argument("--large", default="1x524288,4x131072", help="the large part's shapes, BxTOKENS")
    parser.add_argument(
        "--sorts", default="1", help="the large part's lookups: 1 sorts misses, 0 not, 0,1 both"
    )
    parser.add_argument("--int8", action="store_true", help="the large part with 8-bit host rows")
    parser.add_argument(
        "--overlaps",
        default="own",
        help="the large part's heavy lists: own (the selection's), or a share kept from the previous "
        "step's (comma-separated: each, e.g. own,0.5,0.8,0.95)",
    )
    parser.add_argument(
        "--per-sm",
        default=str(FETCH_PROGRAMS_PER_SM),
        help="the large part's persistent fetch programs per multiprocessor (comma-separated: each)",
    )
    parser.add_argument("--model", default="models/byte-llama-13m", help="the text part's trained model")
    parser.add_argument(
        "--text-widths",
        default=None,
        help="the text part's row caches, in list widths (comma-separated: each; default: the "
        "default slots and one width)",
    )
    parser.add_argument("--text-docs", type=int, default=4, help="the text part's documents (its batch)")
    parser.add_argument("--text-steps", type=int, default=256, help="the text part's greedy tokens")
    parser.add_argument("--text-context", type=int, default=16384, help="the text part's prompt bytes")
    parser.add_argument(
        "--fit-overlaps",
        default="",
        help="the fit part's host loop again on lists forced to these overlaps (comma-separated)",
    )
    parser.add_argument("--device", default="cuda", help="the text part's device (the others need CUDA)")
    parser.add_argument("--json", required=True, help="where to write the results")
    args = parser.parse_args()
    doc = {
        "schema": "host-tier/1",
        "argv": vars(args),
        "environment": environment(torch.device(args.device)),
        "parts": {},
    }
    for part in args.parts.split(","):
        if part == "fit":
            overlaps = tuple(float(x) for x in args.fit_overlaps.split(",") if x)
            doc["parts"]["fit"] = part_fit(args.steps, overlaps)
        elif part == "large":
            shapes = [tuple(int(x) for x in s.split("x")) for s in args.large.split(",")]
            sorts = [s == "1" for s in args.sorts.split(",")]
            per_sm = [int(p) for p in args.per_sm.split(",")]
            overlaps = [None if x == "own" else float(x) for x in args.overlaps.split(",")]
            doc["parts"]["large"] = part_large(args.steps, shapes, sorts, args.int8, per_sm, overlaps)
        elif part == "fetch":
            doc["parts"]["fetch"] = part_fetch()
        elif part == "span":
            doc["parts"]["span"] = part_span()
        elif part == "lookup":
            doc["parts"]["lookup"] = part_lookup()
        elif part == "text":
            widths = None if args.text_widths is None else [int(w) for w in args.text_widths.split(",")]
            device = torch.device(args.device)
            doc["parts"]["text"] = part_text(
                args.model, widths, device, args.text_docs, args.text_steps, args.text_context
            )
        else:
            raise SystemExit(f"--parts: expected some of fit, large, fetch, lookup, span, text; got {part!r}")
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    for part, rows in doc["parts"].items():
        for r in rows:
            print(part, {k: v for k, v in r.items() if not isinstance(v, list)})


if __name__ == "__main__":
    main()
