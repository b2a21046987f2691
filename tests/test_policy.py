"""The selection policy type: its derived sizes and route, one declaration of each field, and
the package's import rules (an AST scan)."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest
import torch

import pqattn
from pqattn import dispatch, ops
from pqattn.integrations.hf import HFConfig
from pqattn.lab.policies import Policy, from_family, group_select
from pqattn.limits import MAX_COMBOS, MAX_TREE_HEAVY, STATELESS_TREE_MAX_HEAVY
from pqattn.policy import ROUTES, SelectPolicy, select_route

PACKAGE = pathlib.Path(pqattn.__file__).parent
# the policy's own fields (sink and window also size harness settings that select nothing)
POLICY_FIELDS = {f.name for f in dataclasses.fields(SelectPolicy)} - {"sink", "window"}


def test_one_default_policy_everywhere() -> None:
    default = SelectPolicy()
    assert pqattn.PQConfig().policy == default == HFConfig().policy
    assert default.share == "group" and default.group_rule == "max"


def test_sizes_tables_and_rows() -> None:
    head = SelectPolicy(sink=4, window=8, heavy=16, share="head")
    assert (head.row_heavy(4), head.width(4), head.tables(4), head.rows(32, 8)) == (16, 28, 1, 32)
    group = SelectPolicy(sink=4, window=8, heavy=16)
    assert (group.row_heavy(4), group.width(4), group.tables(4), group.rows(32, 8)) == (64, 76, 4, 8)
    assert SelectPolicy(heavy=16, group_budget=2.5).row_heavy(4) == 40
    assert SelectPolicy(heavy=16, group_rule="sum").tables(4) == 1
    assert SelectPolicy(heavy=0).row_heavy(4) == 0


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        (dict(sink=-1), "sink"),
        (dict(heavy=1.5), "heavy"),
        (dict(share="heads"), "share"),
        (dict(group_rule="mean"), "group_rule"),
        (dict(group_budget=0), "group_budget"),
        (dict(rerank=-1), "rerank"),
    ],
)
def test_bad_policies_name_the_field(kw: dict, name: str) -> None:
    with pytest.raises((ValueError, TypeError), match=name):
        SelectPolicy(**kw)
    with pytest.raises((ValueError, TypeError), match=name):
        pqattn.PQConfig(**kw)


def test_routes() -> None:
    small = MAX_COMBOS  # C**M at the histogram's limit: 2 sub-vectors of sqrt(MAX_COMBOS)
    C = round(small**0.5)
    assert select_route(2, C, 8, share="group") == "fine"
    assert select_route(2, C, 8, rerank=2) == "fine"
    assert select_route(2, C, 8, buckets=True) == "buckets"
    assert select_route(2, C, 8, kept_histogram=True) == "hist"
    assert select_route(2, C, STATELESS_TREE_MAX_HEAVY + 1) == "hist"
    assert select_route(2, C, STATELESS_TREE_MAX_HEAVY) == "tree"
    assert select_route(16, 256, MAX_TREE_HEAVY) == "tree"
    assert select_route(16, 256, MAX_TREE_HEAVY + 1) == "fine"
    assert SelectPolicy().route(16, 256, 4) == "fine"
    assert set(dispatch._ROUTE_WORKSPACE) == set(ROUTES)
    assert dispatch.uses_fine(16, 256, "group", 64) and not dispatch.uses_fine(2, C, "head", 8)


def test_functional_heavy_is_per_query_head(device: torch.device) -> None:
    """select_topk and select_oracle count heavy per query head as PQConfig does: a group row
    keeps G x heavy by default, not G times fewer tokens than the per-head call."""
    B, H, Hkv, N, D = 1, 8, 2, 400, 16
    keys, q = torch.randn(B, Hkv, N, D, device=device), torch.randn(B, H, D, device=device)
    book = ops.build_index(keys, subvectors=2, bits=3, init_offset=4, iters=2)
    lengths = torch.tensor([N], device=device)
    sizes = dict(sink=4, window=8, heavy=10, init_offset=4)
    head = ops.select_topk(q, book.centroids, book.codes, lengths, **sizes)
    group = ops.select_topk(q, book.centroids, book.codes, lengths, **sizes, share="group", group_rule="max")
    oracle = ops.select_oracle(q, keys, lengths, **sizes, share="group", group_budget=2)
    assert head.counts.tolist() == [[22] * H]
    assert group.counts.tolist() == [[4 + 4 * 10 + 8] * Hkv]
    assert oracle.counts.tolist() == [[4 + 2 * 10 + 8] * Hkv]


def test_lab_policies_hold_one() -> None:
    p = from_family("pq-M16-b8-group-max-x4-rr2", 0.02)
    assert p.select == group_select("max", 4, rerank=2) and p.family == "pq-M16-b8-group-max-x4-rr2"
    with pytest.raises(ValueError, match="group_budget"):
        Policy("pq", 0.02, select=SelectPolicy(share="group"))
    with pytest.raises(ValueError, match="pq and oracle"):
        Policy("pages", 0.02, select=group_select("max", 1))


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(("pqattn", *parts)).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text())
    return out


def test_policy_fields_are_declared_once() -> None:
    """No class but SelectPolicy declares a field named as one of the policy's (the configs
    extend it; the lab's Policy holds one). SelectParams, a row's resolved launch sizes (its
    heavy is the row's), is not a policy."""
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name not in ("SelectPolicy", "SelectParams"):
                declared = {
                    s.target.id
                    for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                }
                assert not declared & POLICY_FIELDS, (name, node.name, declared & POLICY_FIELDS)


def test_no_private_names_across_modules_and_no_import_circle() -> None:
    """Top-level imports only (imports inside functions are deferred on purpose: the kernels)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, tree in modules.items():
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pqattn"):
                private = [a.name for a in node.names if a.name.startswith("_") and a.name != "__version__"]
                # `_validate` is the package's shared checking module, imported as a module
                assert not [p for p in private if p != "_validate"], (name, node.module, private)
                for a in node.names:  # a submodule, else the module that defines the name
                    sub = f"{node.module}.{a.name}"
                    graph[name].add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in graph.get(n, ()):
            if m not in modules or m == n:
                continue
            assert state.get(m) != 1, f"import circle: {' -> '.join([*path, m])}"
            if m not in state:
                visit(m, [*path, m])
        state[n] = 2

    for n in modules:
        if n not in state:
            visit(n, [n])


def test_a_heavy_beyond_the_token_axis_is_clamped_with_a_warning(device: torch.device) -> None:
    """heavy past N keeps every token of every row, as heavy = N does; the lists are sized by N
    (nothing allocated for the heavy asked), and the call says so."""
    B, H, Hkv, N, D = 1, 4, 2, 64, 16
    keys, q = torch.randn(B, Hkv, N, D, device=device), torch.randn(B, H, D, device=device)
    book = ops.build_index(keys, subvectors=2, bits=3, iters=1)
    lengths = torch.tensor([N], device=device)
    sizes = dict(sink=4, window=8, init_offset=4)
    with pytest.warns(UserWarning, match="heavy: .*1000000000.* 64 "):
        got = ops.select_topk(q, book.centroids, book.codes, lengths, heavy=10**9, **sizes)
    want = ops.select_topk(q, book.centroids, book.codes, lengths, heavy=N, **sizes)
    assert got.positions.shape == (B, H, 4 + N + 8) and torch.equal(got.counts, want.counts)
    assert torch.equal(got.positions.sort(-1).values, want.positions.sort(-1).values)
    with pytest.warns(UserWarning, match="heavy"):
        oracle = ops.select_oracle(q, keys, lengths, heavy=10**9, **sizes)
    assert oracle.counts.tolist() == [[N] * H]
    index = pqattn.PQIndex.build(keys, config=pqattn.PQConfig(subvectors=2, bits=3, heavy=10**9, iters=1))
    with pytest.warns(UserWarning, match="heavy") as caught:
        sel = index.select(q)
    assert len(caught) == 1 and sel.positions.shape == (B, Hkv, 128 + N + 128)
    assert sel.counts.tolist() == [[N] * Hkv]
