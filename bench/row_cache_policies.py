"""Which rows should the host tier's row cache keep? (issue 57: the replacement policy, chosen by
measurement; the trained model on held-out text, CPU.)

The model decodes held-out documents with the cache in host memory (`HFConfig(kv_placement="host")`,
the default policy); every layer's selection lists are recorded at each step. The lists are then
replayed through row caches of several sizes (in list widths L) under each rule, counting a listed
row as a hit when the cache holds it before the step:
  clock:  the host tier's rule (`pqattn.reference.rows`): the victims are the next slots,
          circularly from a hand, that this step does not list; replayed through the reference;
  lru:    the victims are the rows listed longest ago;
  lfu:    the rows listed least often over the last `--window` steps, the oldest first among equals;
  belady: the rows whose next listing is farthest away (it knows the future: the ceiling);
  clock-K: the host tier's rule whose reference bit is "listed in the last K steps": the victims are
          the next slots from the hand not listed in the last K steps, then (when too few) the
          next ones not listed in this step (clock-1 is the host tier's rule, replayed in Python).
Every rule keeps the rows the step lists, so each cache of S >= L rows serves the whole list.

    PYTHONPATH=src python bench/row_cache_policies.py --docs 4 --steps 256 --json OUT.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import statistics
from collections import deque

import torch

import pqattn.integrations.hf as pq_hf
from pqattn import dispatch
from pqattn import reference as ref
from pqattn.lab.corpus import documents, find_corpus
from pqattn.lab.env import environment
from pqattn.lab.tasks import load_model


def record(model_path: str, docs: int, context: int, steps: int) -> tuple[list[list[list[int]]], int]:
    """Each recorded stream's lists: [stream][step] positions, a stream being one (layer, sequence,
    KV head); and the list width."""
    model = load_model(model_path, torch.device("cpu"))
    texts = documents(find_corpus().held_out, context, docs)
    ids = torch.tensor([list(d) for d in texts], dtype=torch.int64)
    streams: dict[tuple, list[list[int]]] = {}
    layers: dict[int, int] = {}
    lookup = dispatch.row_lookup

    def recording(positions, counts, cache, misses, slot_list, **kwargs):
        layer = layers.setdefault(id(cache.slot_of), len(layers))
        for b in range(counts.shape[0]):
            for h in range(counts.shape[1]):
                listed = positions[b, h, : int(counts[b, h])].tolist()
                streams.setdefault((layer, b, h), []).append(listed)
        lookup(positions, counts, cache, misses, slot_list, **kwargs)

    dispatch.row_lookup = recording
    try:
        pq_hf.enable(model, pq_hf.HFConfig(kv_placement="host"))
        decoder = pq_hf.StaticDecoder(model, ids, steps)
        decoder.run()
    finally:
        dispatch.row_lookup = lookup
    width = max(len(lst) for stream in streams.values() for lst in stream)
    return [streams[k] for k in sorted(streams)], width


def clock(stream: list[list[int]], slots: int) -> int:
    """Hits of the host tier's rule (the reference's lookup) over one stream."""
    n = max(max(lst) for lst in stream) + 1
    width = max(len(lst) for lst in stream)
    cache = ref.new_row_cache(1, 1, n, slots, torch.device("cpu"))
    shapes = ((1, 1, width), (1, 1, width), (1, 1))
    misses = ref.Misses(*(torch.zeros(s, dtype=torch.int32) for s in shapes))
    slot_list = torch.empty(1, 1, width, dtype=torch.int32)
    for lst in stream:
        pos = torch.full((1, 1, width), -1, dtype=torch.int32)
        pos[0, 0, : len(lst)] = torch.tensor(lst, dtype=torch.int32)
        ref.lookup_rows(pos, torch.tensor([[len(lst)]]), cache, misses, slot_list)
    lookups, missed = cache.stats[0, 0].tolist()
    return lookups - missed


def clock_window(stream: list[list[int]], slots: int, steps: int) -> int:
    """Hits of clock-`steps` over one stream (the reference's state, kept in Python)."""
    owner, used = [-1] * slots, [-1] * slots
    slot_of: dict[int, int] = {}
    hand = hits = 0
    for step, lst in enumerate(stream):
        missed = []
        for p in lst:
            s = slot_of.get(p)
            if s is not None and owner[s] == p:
                used[s] = step
                hits += 1
            else:
                missed.append(p)
        if not missed:
            continue
        order = [(hand + j) % slots for j in range(slots)]
        cold = [j for j, s in enumerate(order) if used[s] < 0 or step - used[s] >= steps]
        warm = [j for j, s in enumerate(order) if used[s] >= 0 and 0 < step - used[s] < steps]
        taken = (cold + warm)[: len(missed)]
        for p, j in zip(missed, taken, strict=True):
            s = order[j]
            if owner[s] >= 0 and slot_of.get(owner[s]) == s:
                del slot_of[owner[s]]
            owner[s], used[s], slot_of[p] = p, step, s
        hand = (hand + max(taken) + 1) % slots
    return hits


def by_rank(stream: list[list[int]], slots: int, rank) -> int:
    """Hits of a rule that, when rows must go, evicts the resident rows of lowest rank(row, step)
    among those the step does not list."""
    resident: set[int] = set()
    hits = 0
    for t, lst in enumerate(stream):
        listed = set(lst)
        hits += len(listed & resident)
        new = listed - resident
        over = len(resident) + len(new) - slots
        if over > 0:
            candidates = resident - listed
            resident -= set(heapq.nsmallest(over, candidates, key=lambda p: rank(p, t)))
        resident |= new
        rank.update(t, lst)
    return hits


class LastListed:
    """lru's rank: the step a row was last listed."""

    def __init__(self) -> None:
        self.last: dict[int, int] = {}

    def __call__(self, p: int, t: int) -> int:
        return self.last.get(p, -1)

    def update(self, t: int, lst: list[int]) -> None:
        for p in lst:
            self.last[p] = t


class RecentCount(LastListed):
    """lfu's rank: listings over the last `window` steps, then the last listing."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.count: dict[int, int] = {}
        self.recent: deque[list[int]] = deque()

    def __call__(self, p: int, t: int) -> tuple[int, int]:
        return self.count.get(p, 0), self.last.get(p, -1)

    def update(self, t: int, lst: list[int]) -> None:
        super().update(t, lst)
        for p in lst:
            self.count[p] = self.count.get(p, 0) + 1
        self.recent.append(lst)
        if len(self.recent) > self.window:
            for p in self.recent.popleft():
                self.count[p] -= 1


class NextListed:
    """belady's rank: minus the step a row is next listed (never again: the lowest)."""

    def __init__(self, stream: list[list[int]]) -> None:
        self.uses: dict[int, deque[int]] = {}
        for t, lst in enumerate(stream):
            for p in lst:
                self.uses.setdefault(p, deque()).append(t)

    def __call__(self, p: int, t: int) -> float:
        uses = self.uses.get(p)
        while uses and uses[0] <= t:
            uses.popleft()
        return -uses[0] if uses else float("-inf")

    def update(self, t: int, lst: list[int]) -> None:
        """Nothing to learn: the future is known."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/byte-llama-13m")
    parser.add_argument("--docs", type=int, default=4, help="documents decoded together (the batch)")
    parser.add_argument("--context", type=int, default=16384, help="prompt bytes")
    parser.add_argument("--steps", type=int, default=256, help="greedy tokens")
    parser.add_argument("--widths", default="1,2,4", help="row caches, in list widths (comma-separated)")
    parser.add_argument("--window", type=int, default=16, help="lfu's window of steps")
    parser.add_argument("--clock-steps", default="2,4,8", help="clock-K's K (comma-separated: each)")
    parser.add_argument(
        "--lists", default=None, help="save the recorded lists here, or load them when it exists"
    )
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    if args.lists is not None and os.path.exists(args.lists):
        streams, width = torch.load(args.lists)
    else:
        streams, width = record(args.model, args.docs, args.context, args.steps)
        if args.lists is not None:
            torch.save((streams, width), args.lists)
    lookups = sum(len(lst) for stream in streams for lst in stream)
    rules = {
        "clock": lambda s, S: clock(s, S),
        "lru": lambda s, S: by_rank(s, S, LastListed()),
        "lfu": lambda s, S: by_rank(s, S, RecentCount(args.window)),
        "belady": lambda s, S: by_rank(s, S, NextListed(s)),
    }
    for k in (int(x) for x in args.clock_steps.split(",") if x):
        rules[f"clock-{k}"] = lambda s, S, k=k: clock_window(s, S, k)
    rows = []
    for w in (int(x) for x in args.widths.split(",")):
        for name, rule in rules.items():
            hits = [rule(stream, w * width) for stream in streams]
            per_stream = [h / sum(len(lst) for lst in s) for h, s in zip(hits, streams, strict=True)]
            row = {
                "rule": name,
                "widths": w,
                "slots": w * width,
                "hit_rate": sum(hits) / lookups,
                "hit_rate_stream_min": min(per_stream),
                "hit_rate_stream_median": statistics.median(per_stream),
            }
            rows.append(row)
            print(row, flush=True)
    doc = {
        "schema": "row-cache-policies/1",
        "argv": vars(args),
        "environment": environment(torch.device("cpu")),
        "streams": len(streams),
        "list_width": width,
        "lookups": lookups,
        "rows": rows,
    }
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
