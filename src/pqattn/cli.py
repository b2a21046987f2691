"""The `pqattn` command line: the demo, the lab (bench, compare, check, report), and the quality
lab (quality, tasks, train, pareto, fidelity). `pqattn COMMAND --help` says what each shows."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

import torch

import pqattn
from pqattn.index import PQConfig
from pqattn.lab.workload import WorkloadSpec
from pqattn.reference import GROUP_RULES

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


DEMO_CUDA_TOKENS = 32768  # the demo's context on a GPU: long enough that a step reads more than it launches


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from pqattn.lab.demo import VARIANTS

    d, c = WorkloadSpec(), PQConfig()
    p = sub.add_parser(
        "demo",
        formatter_class=_HELP,
        help="PQ vs streaming vs oracle selection on two synthetic caches",
        description="Builds the PQ index over a synthetic cache, runs decode steps and prints per method "
        "(PQ, streaming, the exact top-k oracle, dense): the attention mass kept, the recall of the oracle's "
        "tokens, the output error against dense attention, and the step time against dense SDPA in the "
        "same run (eager, and GPU time by graph replay on a GPU).",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bfloat16 on cuda, float32 on cpu"
    )
    p.add_argument(
        "--tokens",
        type=int,
        help=f"prefill tokens N (default: {DEMO_CUDA_TOKENS} on CUDA, {d.tokens} elsewhere)",
    )
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help="key/value heads Hkv")
    p.add_argument("--group", type=int, default=d.group, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=d.head_dim, help="head dimension D")
    p.add_argument("--steps", type=int, default=d.steps, help="decode steps")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences B")
    p.add_argument("--sink", type=int, default=c.sink, help="always-kept first tokens")
    p.add_argument("--window", type=int, default=c.window, help="always-kept last tokens")
    p.add_argument("--heavy", type=int, default=256, help="tokens chosen by the PQ scores, per query head")
    p.add_argument("--subvectors", type=int, default=c.subvectors, help="sub-vectors per key M")
    p.add_argument("--bits", type=int, default=c.bits, help="bits per code (2**bits centroids)")
    p.add_argument("--metric", default=c.metric, choices=["euclidean", "ip"], help="k-means metric (SPEC §1)")
    p.add_argument("--iters", type=int, default=c.iters, help="k-means iterations")
    p.add_argument(
        "--sample",
        type=int,
        help="k-means keys per centroid (0: every key; default: PQConfig's for the metric)",
    )
    p.add_argument(
        "--share", default=c.share, choices=["head", "group"], help="a selection per query or KV head"
    )
    p.add_argument(
        "--group-rule", default=c.group_rule, choices=GROUP_RULES, help="a group's score (SPEC §7)"
    )
    p.add_argument("--group-budget", type=float, help="a group's rows in per-head heavies (default: G)")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the cache and the k-means init")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per method")
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="indexes run beside the config, comma-separated ('' for none): faithful (the config with an "
        "exact re-rank of twice its rows), coarse (M=2, 6 bits, per-head selection)",
    )
    p.add_argument(
        "--generators",
        default="workload,needles",
        help="synthetic caches, run in turn: workload (LLM-like, pqattn.lab.workload), needles "
        "(single-token needles, no sink, pqattn.lab.needles)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")

    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from pqattn.lab.demo import format_table, generator_spec, run_demo, variant_configs
    from pqattn.lab.env import resolve_device

    device = resolve_device(args.device)
    dtype = (
        DTYPES[args.dtype]
        if args.dtype != "auto"
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    if args.tokens is None:
        args.tokens = DEMO_CUDA_TOKENS if device.type == "cuda" else WorkloadSpec().tokens
    spec = WorkloadSpec(
        tokens=args.tokens,
        kv_heads=args.kv_heads,
        group=args.group,
        head_dim=args.head_dim,
        steps=args.steps,
        batch=args.batch,
        seed=args.seed,
    )
    config = PQConfig(
        subvectors=args.subvectors,
        bits=args.bits,
        metric=args.metric,
        sink=args.sink,
        window=args.window,
        heavy=args.heavy,
        iters=args.iters,
        seed=args.seed,
        sample=args.sample,
        share=args.share,
        group_rule=args.group_rule,
        group_budget=args.group_budget,
    )
    variants = variant_configs(config, tuple(v for v in args.variants.split(",") if v))
    runs = [
        run_demo(
            generator_spec(g, spec),
            config,
            device=device,
            dtype=dtype,
            repeats=args.repeats,
            variants=variants,
        )
        for g in (x for x in args.generators.split(",") if x)
    ]
    if not runs:
        raise ValueError("generators: expected at least one of workload, needles, got none")
    result = runs[0] if len(runs) == 1 else {"runs": runs}
    if args.json == "-":
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    print("\n\n".join(format_table(r) for r in runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"results written to {args.json}")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from pqattn.lab.suites import SUITES

    p = sub.add_parser(
        "bench",
        formatter_class=_HELP,
        help="time suites of cases (graph replay, eager, pipelined) against same-run baselines",
        description="Time every case of the suites: GPU time from CUDA-graph replay, eager wall-clock with a "
        "sync, pipelined wall-clock; achieved GB/s and TFLOP/s against the measured copy bandwidth and "
        "matmul rate; speed-up over the baselines of the same run.",
    )
    p.add_argument("suites", nargs="+", choices=sorted(SUITES), metavar="SUITE", help=", ".join(SUITES))
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a few cases per suite")
    size.add_argument("--tiny", action="store_true", help="toy shapes that run in seconds on a CPU")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--case", metavar="REGEX", help="only cases whose suite/name matches")
    p.add_argument("--impl", action="append", metavar="NAME", help="only these implementations (repeatable)")
    p.add_argument("--profile", action="store_true", help="add a torch.profiler breakdown per case")
    p.add_argument("--json", metavar="PATH", help="write the results document here ('-' for stdout)")
    p.add_argument("--plot", metavar="PNG", help="write a bar chart of the primary times (needs matplotlib)")
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from pqattn.lab.bench import format_table, plot, run_bench
    from pqattn.lab.env import resolve_device

    size = "quick" if args.quick else "tiny" if args.tiny else "full"

    def save(doc: dict) -> None:  # partial results survive an interrupted run
        if args.json and args.json != "-":
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)

    doc = run_bench(
        args.suites,
        size=size,
        device=resolve_device(args.device),
        case_filter=args.case,
        impls=args.impl,
        profile=args.profile,
        argv=sys.argv,
        on_row=save,
    )
    if args.json == "-":
        json.dump(doc, sys.stdout)
        print()
        return 0
    print(format_table(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"results written to {args.json}")
    if args.plot:
        plot(doc, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _add_compare(sub: argparse._SubParsersAction) -> None:
    from pqattn.lab.compare import TIMING_MODES

    p = sub.add_parser(
        "compare",
        formatter_class=_HELP,
        help="compare two bench results (exit 1 on a regression)",
        description="Per case: ratio of medians B/A with a bootstrap 95% CI, Mann-Whitney U p-value, "
        "Cliff's delta, verdict. Exit 1 when a case is slower by more than 3% with p < 0.01.",
    )
    p.add_argument("a", help="baseline results JSON")
    p.add_argument("b", help="candidate results JSON")
    p.add_argument(
        "--timing", default="auto", choices=TIMING_MODES, help="auto: graph when both have it, else eager"
    )
    p.add_argument("--json", metavar="PATH", help="also write the comparison as JSON")
    p.set_defaults(func=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    from pqattn.lab.compare import compare_docs, format_comparison
    from pqattn.lab.schema import load

    result = compare_docs(load(args.a), load(args.b), mode=args.timing)
    print(format_comparison(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if result["regressions"] else 0


def _add_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        formatter_class=_HELP,
        help="fuzz every kernel against its reference over every autotune config",
        description="Correctness fuzz of every Triton kernel against the PyTorch reference on random shapes, "
        "dtypes and options, for every config of its autotune space, with NaN-poisoned outputs. "
        "Exit 1 when any case fails.",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--large", action="store_true", help="large shapes (default on a GPU; slow on a CPU)")
    p.add_argument("--cases", type=int, default=3, help="random cases per config")
    p.add_argument("--kernel", action="append", metavar="NAME", help="only these kernels (repeatable)")
    p.add_argument("--seed", type=int, default=None, help="default: drawn at random and printed")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(func=_run_check)


def _run_check(args: argparse.Namespace) -> int:
    import os
    import random

    from pqattn.lab.check import format_rows, run_checks
    from pqattn.lab.env import resolve_device
    from pqattn.lab.kernel_checks import registered

    device = resolve_device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("device: Triton kernels on a CPU need TRITON_INTERPRET=1 in the environment")
    checks = registered()
    if args.kernel:
        unknown = set(args.kernel) - {c.name for c in checks}
        if unknown:
            raise ValueError(
                f"kernel: expected some of {sorted(c.name for c in checks)}, got {sorted(unknown)}"
            )
        checks = [c for c in checks if c.name in args.kernel]
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    large = args.large or device.type == "cuda"
    rows = run_checks(checks, device=device, large=large, cases=args.cases, seed=seed, log=sys.stderr)
    print(format_rows(rows, device=device, seed=seed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "seed": seed, "large": large, "rows": rows}, f, indent=1)
    return 1 if any(r["failures"] for r in rows) else 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        formatter_class=_HELP,
        help="regenerate the README's headline, docs/results.md, the model cards and the notes' figures "
        "from the results JSON",
        description="Rewrite the generated sections (between their markers) of the README's headline table, "
        "the full results page and every model card under --models, and every figure of the notes tied to "
        "its JSON, from the committed JSON; --check exits 1 when one is out of date. A note citing a file "
        "that does not exist is an error either way.",
    )
    p.add_argument("--results", default="bench/results", help="directory of results JSON")
    p.add_argument("--readme", default="README.md", help="the file whose headline table is rewritten")
    p.add_argument(
        "--page", default="docs/results.md", help="the file whose full results section is rewritten"
    )
    p.add_argument(
        "--models", default="models", help="folder of model folders whose README.md (model card) has markers"
    )
    p.add_argument(
        "--root",
        default=".",
        help="the checkout whose notes (README.md, docs/**/*.md) have their tied figures rewritten and "
        "their citations checked (pqattn.lab.notes)",
    )
    p.add_argument("--check", action="store_true", help="do not write; exit 1 when a file is stale")
    p.set_defaults(func=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from pqattn.lab.notes import update_notes
    from pqattn.lab.report import update_model_cards, update_readme, update_results_page

    notes_current, problems = update_notes(args.root, check=args.check)
    current = {
        args.readme: update_readme(args.readme, args.results, check=args.check),
        args.page: update_results_page(args.page, args.results, check=args.check),
        f"{args.models}/*/README.md": update_model_cards(args.models, args.results, check=args.check),
        "the notes' tied figures": notes_current,
    }
    for line in problems:
        print(line, file=sys.stderr)
    stale = [name for name, ok in current.items() if not ok]
    if args.check and stale:
        print(f"{', '.join(stale)} out of date: run `pqattn report`", file=sys.stderr)
        return 1
    if problems:
        return 1
    if stale:
        print(f"rewrote the generated sections of {', '.join(stale)} from {args.results}")
    fresh = [name for name, ok in current.items() if ok]
    if fresh:
        print(f"up to date with {args.results}: {', '.join(fresh)}")
    return 0


def _add_quality(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quality",
        formatter_class=_HELP,
        help="PQ vs streaming vs oracle selection quality over a sweep of densities",
        description="Captured attention mass, oracle recall and output error vs dense attention, on the "
        "two synthetic caches or on the KV cache of a local transformers model (--model PATH, no download).",
    )
    p.add_argument("--model", help="a local transformers model directory (default: the synthetic caches)")
    p.add_argument("--prompt-tokens", type=int, default=4096, help="random prompt length for --model")
    p.add_argument("--layers", help="comma-separated layer indices for --model (default: all)")
    p.add_argument("--tokens", type=int, default=16384, help="synthetic cache length (no --model)")
    p.add_argument(
        "--generators",
        default="workload,needles",
        help="synthetic caches when there is no --model: workload (pqattn.lab.workload), needles "
        "(pqattn.lab.needles)",
    )
    p.add_argument("--densities", default="0.005,0.01,0.02,0.05,0.1,0.2", help="heavy / N, comma-separated")
    p.add_argument("--sink", type=int, default=16, help="always-kept first tokens")
    p.add_argument("--window", type=int, default=64, help="always-kept last tokens")
    p.add_argument("--subvectors", type=int, default=2, help="sub-vectors per key M of the PQ index")
    p.add_argument("--bits", type=int, default=6, help="bits per code of the PQ index")
    p.add_argument("--metric", choices=["euclidean", "ip"], default="euclidean", help="k-means metric")
    p.add_argument("--iters", type=int, default=10, help="k-means iterations")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--json", metavar="PATH", help="write the rows and their means here")
    p.add_argument("--plot", metavar="PATH", help="PNG of output error vs density")
    p.set_defaults(func=_run_quality)


def _run_quality(args: argparse.Namespace) -> int:
    from pqattn.lab import quality
    from pqattn.lab.env import environment, resolve_device

    device = resolve_device(args.device)
    settings = quality.QualitySettings(
        densities=tuple(float(d) for d in args.densities.split(",")),
        sink=args.sink,
        window=args.window,
        subvectors=args.subvectors,
        bits=args.bits,
        metric=args.metric,
        iters=args.iters,
    )
    if args.model:
        layers = None if args.layers is None else [int(x) for x in args.layers.split(",")]
        problems = quality.model_problems(
            args.model, prompt_tokens=args.prompt_tokens, layers=layers, device=device
        )
        title = f"{args.model}: {len(problems)} layers, {args.prompt_tokens} tokens"
    else:
        names = [g for g in args.generators.split(",") if g]
        unknown = set(names) - set(quality.GENERATORS)
        if unknown or not names:
            raise ValueError(
                f"generators: expected some of {sorted(quality.GENERATORS)}, got {args.generators!r}"
            )
        problems = [quality.GENERATORS[g](args.tokens, device) for g in names]
        title = f"synthetic caches ({', '.join(names)}), {args.tokens} tokens"
    rows = [r for p in problems for r in quality.sweep(p, settings)]
    summary = quality.average(rows, group=args.model)
    print(f"pqattn quality: {title}")
    print(quality.format_table(summary))
    if args.json:
        doc = {
            "source": args.model or args.generators,
            "settings": dataclasses.asdict(settings),
            "environment": environment(device),
            "summary": summary,
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        quality.plot(summary, args.plot, title)
    return 0


def _pairs(text: str, name: str) -> tuple[tuple[int, float], ...]:
    """'2048:0.5,16384:0.5' -> ((2048, 0.5), (16384, 0.5))."""
    try:
        out = tuple((int(a), float(b)) for a, b in (item.split(":") for item in text.split(",")))
    except ValueError:
        raise ValueError(f"{name}: expected CONTEXT:SHARE[,CONTEXT:SHARE...], got {text!r}") from None
    return out


def _add_train(sub: argparse._SubParsersAction) -> None:
    from pqattn.lab.train import ModelSpec, TrainSpec

    m, t = ModelSpec(), TrainSpec()
    p = sub.add_parser(
        "train",
        formatter_class=_HELP,
        help="train the byte-level long-context Llama that the task metrics use as ground truth",
        description="Train transformers' LlamaForCausalLM on the Python sources of the installed packages "
        "(pqattn.lab.corpus), byte tokens, phases of growing context; write bf16 safetensors, config.json "
        "and training.json. Progress is printed while it trains.",
    )
    p.add_argument("--out", required=True, help="output folder of the model")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument(
        "--seed", type=int, default=t.seed, help="seeds the weights, the data order and the plants"
    )
    p.add_argument(
        "--phases",
        default=",".join(f"{c}:{f:g}" for c, f in t.phases),
        help="context:share of the steps, per phase in order",
    )
    p.add_argument("--tokens-per-step", type=int, default=t.tokens_per_step, help="tokens per optimizer step")
    p.add_argument("--lr", type=float, default=t.lr, help="peak learning rate (AdamW, cosine decay)")
    p.add_argument("--warmup-steps", type=int, default=t.warmup_steps, help="linear warm-up steps")
    p.add_argument(
        "--plant-rate", type=float, default=t.plant_rate, help="share of windows with passkey pairs"
    )
    p.add_argument(
        "--budget-s", type=float, default=t.budget_s, help="seconds of training the steps are sized to"
    )
    p.add_argument("--steps", type=int, help="total steps (replays a run; default: sized to --budget-s)")
    p.add_argument("--deadline-s", type=float, help="stop early once training has run this long (recorded)")
    p.add_argument("--log-every", type=int, default=t.log_every, help="steps between progress lines")
    p.add_argument("--layers", type=int, default=m.layers, help="decoder layers")
    p.add_argument("--hidden", type=int, default=m.hidden, help="hidden size")
    p.add_argument("--intermediate", type=int, default=m.intermediate, help="MLP size")
    p.add_argument("--heads", type=int, default=m.heads, help="query heads")
    p.add_argument("--kv-heads", type=int, default=m.kv_heads, help="key/value heads")
    p.add_argument("--head-dim", type=int, default=m.head_dim, help="head dimension")
    p.add_argument("--max-positions", type=int, default=m.max_positions, help="max_position_embeddings")
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from pqattn.lab import corpus, train
    from pqattn.lab.env import resolve_device

    model_spec = train.ModelSpec(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate=args.intermediate,
        max_positions=args.max_positions,
    )
    spec = train.TrainSpec(
        seed=args.seed,
        phases=_pairs(args.phases, "phases"),
        tokens_per_step=args.tokens_per_step,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        plant_rate=args.plant_rate,
        budget_s=args.budget_s,
        steps=args.steps,
        deadline_s=args.deadline_s,
        log_every=args.log_every,
    )
    device = resolve_device(args.device)
    model, record = train.train(model_spec, spec, device=device, corpus=corpus.find_corpus(), log=_log)
    train.save(model, record, args.out)
    print(f"model written to {args.out}")
    return 0


def _log(line: str) -> None:
    print(line, flush=True)


def _add_policy_args(p: argparse.ArgumentParser, density_help: str) -> None:
    """The policy grid's options (pqattn.lab.policies), shared by `tasks` and `pareto`."""
    from pqattn.lab.tasks import TaskSettings

    t = TaskSettings()
    p.add_argument("--densities", default=",".join(f"{d:g}" for d in t.densities), help=density_help)
    p.add_argument(
        "--pq",
        default=",".join(f"{m}x{b}" for m, b in t.pq_configs),
        help="PQ configs as MxBITS, comma-separated",
    )
    p.add_argument("--page", type=int, default=t.page, help="tokens per page of the page policy")
    p.add_argument(
        "--families",
        default="",
        help="further policy families at each density, comma-separated, e.g. "
        "pq-M16-b8-group-max-x4-rr2,oracle-group-max-x1 (group selection, re-rank, sample builds)",
    )
    p.add_argument("--sink", type=int, default=t.sink, help="always-kept first tokens")
    p.add_argument("--window", type=int, default=t.window, help="always-kept last tokens")
    p.add_argument("--iters", type=int, default=t.iters, help="k-means iterations of the PQ builds")


def _add_tasks(sub: argparse._SubParsersAction) -> None:
    from pqattn.lab.tasks import LUT_DTYPES, TaskSettings

    t = TaskSettings()
    p = sub.add_parser(
        "tasks",
        formatter_class=_HELP,
        help="task quality of sparse decoding on a local causal LM: bits/byte and passkey per policy",
        description="On held-out documents of the corpus: dense bits/byte by position bucket, bits/byte of "
        "each document's last bytes under every policy (dense, oracle, streaming, PQ at several code "
        "resolutions, Quest-style pages) at each density, and passkey retrieval accuracy by depth.",
    )
    p.add_argument("--model", required=True, help="a local transformers causal LM folder (no download)")
    p.add_argument(
        "--parts", default="positions,passkey,tail", help="any of positions, passkey, tail, run in that order"
    )
    p.add_argument("--contexts", default=_ints_text(t.contexts), help="contexts of the position buckets")
    p.add_argument("--position-docs", type=int, default=t.position_docs, help="documents per context")
    p.add_argument(
        "--tail-contexts", default=_ints_text(t.tail_contexts), help="contexts of the tail bits/byte"
    )
    p.add_argument("--tail-docs", type=int, default=t.tail_docs, help="documents per tail context")
    p.add_argument("--tail-rows", type=int, default=t.tail_rows, help="decoded bytes at each document's end")
    p.add_argument("--passkey-context", type=int, default=t.passkey_context, help="passkey document length")
    p.add_argument("--passkey-buckets", type=int, default=t.passkey_buckets, help="depth buckets")
    p.add_argument("--passkey-trials", type=int, default=t.passkey_trials, help="trials per depth bucket")
    p.add_argument(
        "--passkey-keys", type=int, default=t.passkey_keys, help="planted lines per document (1 queried)"
    )
    p.add_argument(
        "--passkey-near",
        type=int,
        default=t.passkey_near,
        help="letters in which a distractor's name differs from the queried one's (0: independent names)",
    )
    _add_policy_args(p, "heavy / prefill length")
    p.add_argument(
        "--batch-tokens", type=int, default=t.batch_tokens, help="tokens per forward (documents batched)"
    )
    p.add_argument("--seed", type=int, default=t.seed, help="seeds the passkey trials and the PQ builds")
    p.add_argument(
        "--lut-dtype",
        default=t.lut_dtype,
        choices=LUT_DTYPES,
        help="the dtype PQ scores round each LUT entry to (kernel: as the kernels do, bfloat16 for a "
        "group and float32 per head; float32: SPEC §2's sums everywhere; uint8 / uint8-m: 256 levels "
        "of one scale a table / a sub-quantizer, a lab measurement)",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--json", metavar="PATH", help="write the results document here")
    p.set_defaults(func=_run_tasks)


def _ints_text(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _run_tasks(args: argparse.Namespace) -> int:
    from pqattn.lab import tasks
    from pqattn.lab.env import resolve_device

    settings = tasks.TaskSettings(
        contexts=_ints(args.contexts),
        position_docs=args.position_docs,
        tail_contexts=_ints(args.tail_contexts),
        tail_docs=args.tail_docs,
        tail_rows=args.tail_rows,
        passkey_context=args.passkey_context,
        passkey_buckets=args.passkey_buckets,
        passkey_trials=args.passkey_trials,
        passkey_keys=args.passkey_keys,
        passkey_near=args.passkey_near,
        densities=tuple(float(d) for d in args.densities.split(",")),
        pq_configs=_pq_configs(args.pq),
        page=args.page,
        families=tuple(f for f in args.families.split(",") if f),
        sink=args.sink,
        window=args.window,
        iters=args.iters,
        seed=args.seed,
        batch_tokens=args.batch_tokens,
        lut_dtype=args.lut_dtype,
    )
    parts = [x for x in args.parts.split(",") if x]
    unknown = set(parts) - {"positions", "tail", "passkey"}
    if unknown:
        raise ValueError(f"parts: expected some of positions, tail, passkey, got {sorted(unknown)}")

    def save(doc: dict) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)

    doc = tasks.run_tasks(
        args.model, settings, device=resolve_device(args.device), parts=parts, log=_log, on_part=save
    )
    save(doc)
    print(tasks.format_tables(doc))
    if args.json:
        print(f"results written to {args.json}")
    return 0


def _add_pareto(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pareto",
        formatter_class=_HELP,
        help="quality against measured decode-step time for every policy and density (JSON and a plot)",
        description="Times one decode step of each policy with a kernel (selection + sparse attention) and "
        "dense SDPA in the same run (CUDA-graph replay on a GPU), measures every policy's attention mass on "
        "both synthetic generators, and joins the task figures of a `pqattn tasks` document.",
    )
    p.add_argument("--tasks", metavar="JSON", help="a `pqattn tasks` results document to join")
    p.add_argument("--tokens", type=int, default=32768, help="cache length N of the timing and generators")
    _add_policy_args(p, "heavy / N")
    p.add_argument("--repeats", type=int, default=30, help="timed samples per policy")
    p.add_argument("--times", metavar="JSON", help="take the step times from this earlier --json output")
    p.add_argument("--times-only", action="store_true", help="measure and write the step times only")
    p.add_argument(
        "--quality",
        metavar="JSON",
        help="take the generator quality from this earlier --json output (it does not depend on timing)",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--json", metavar="PATH", help="write the joined rows and the timings here")
    p.add_argument("--plot", metavar="PNG", help="write the Pareto plot here (needs matplotlib)")
    p.set_defaults(func=_run_pareto)


def _pq_configs(text: str) -> tuple[tuple[int, int], ...]:
    try:
        return tuple((int(m), int(b)) for m, b in (item.split("x") for item in text.split(",") if item))
    except ValueError:
        raise ValueError(f"pq: expected MxBITS[,MxBITS...], got {text!r}") from None


def _run_pareto(args: argparse.Namespace) -> int:
    from pqattn.lab import pareto
    from pqattn.lab.env import environment, resolve_device
    from pqattn.lab.policies import from_family, policy_grid

    if args.times_only and not args.json:
        raise ValueError("times-only: expected --json PATH to write the step times to (they are not printed)")
    device = resolve_device(args.device)
    densities = tuple(float(d) for d in args.densities.split(","))
    policies = policy_grid(densities, _pq_configs(args.pq), args.page)
    policies += [from_family(f, d) for d in densities for f in args.families.split(",") if f]
    tasks_doc = None
    if args.tasks:
        with open(args.tasks) as f:
            tasks_doc = json.load(f)
    common = dict(tokens=args.tokens, sink=args.sink, window=args.window, device=device, iters=args.iters)
    if args.times:
        with open(args.times) as f:
            times = json.load(f)["times"]
    else:
        times = pareto.step_times(policies, repeats=args.repeats, **common)
        _log(f"step times at N={args.tokens}: {len(times['rows'])} rows")
    if args.times_only:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"times": times}, f, indent=1)
        return 0
    if args.quality:
        with open(args.quality) as f:
            generators = json.load(f)["generators"]
    else:
        generators = pareto.generator_quality(policies, **common)
        _log(f"generator quality at N={args.tokens}: {len(generators)} rows")
    rows = pareto.combine(policies, times, generators, tasks_doc)
    print(pareto.format_table(rows))
    doc = {
        "rows": rows,
        "times": times,
        "generators": generators,
        "generators_environment": environment(device),
        "tasks": args.tasks,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"results written to {args.json}")
    if args.plot:
        env = times["environment"]
        title = (
            f"pqattn policies: quality vs decode-step time at N={args.tokens} "
            f"(B1 H32 Hkv8 D128 bf16, {env['device_name']}); "
            f"sink {args.sink} + window {args.window}, labels: density; dashed: dense SDPA"
        )
        pareto.plot(rows, args.plot, title)
        print(f"plot written to {args.plot}")
    return 0


def _add_fidelity(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fidelity",
        formatter_class=_HELP,
        help="attention mass as a share of the oracle's beside decode-step time, per selection policy",
        description="Measures, for per-head and group (GQA-shared) PQ selections at fine and coarse codes, "
        "with and without re-ranking, the attention mass kept on both synthetic generators as a share of the "
        "per-head oracle's at the same density, and (on a GPU) the selection and decode-step GPU times "
        "against SDPA in the same run, with the selection's bytes floor.",
    )
    p.add_argument("--density", type=float, default=0.02, help="per-head heavy / N")
    p.add_argument(
        "--policies",
        default="selection",
        help="selection: sharing, group rules, budgets, re-ranking; codes: 4- against 8-bit codes and "
        "builds on a sample against every key; or comma-separated families such as "
        "oracle,pq-M32-b4-rr4,pq-M16-b8-group-max-x4 (the oracle is added when missing)",
    )
    p.add_argument("--tokens", default="32768", help="comma-separated N of the quality measurements")
    p.add_argument(
        "--shapes",
        default="1x32768",
        help="comma-separated BxN of the step timings (eager wall-clock on a CPU)",
    )
    p.add_argument("--sink", type=int, default=64, help="sink tokens")
    p.add_argument("--window", type=int, default=64, help="window tokens")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--json", metavar="PATH", help="write the results document here")
    p.set_defaults(func=_run_fidelity)


def _run_fidelity(args: argparse.Namespace) -> int:
    from pqattn.lab import fidelity
    from pqattn.lab.env import resolve_device

    shapes = [tuple(int(x) for x in item.split("x")) for item in args.shapes.split(",") if item]

    def on_part(doc: dict, part: str) -> None:
        print(f"fidelity: {part} done", file=sys.stderr, flush=True)
        if args.json:  # partial results survive an interrupted run
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)

    doc = fidelity.run(
        density=args.density,
        quality_tokens=[int(n) for n in args.tokens.split(",") if n],
        shapes=shapes,
        sink=args.sink,
        window=args.window,
        device=resolve_device(args.device),
        policies=fidelity.named_policies(args.policies, args.density),
        on_part=on_part,
    )
    print(fidelity.format_table(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"results written to {args.json}")
    return 0


class _HELP(argparse.HelpFormatter):
    """Every subcommand's help shows the default of each option that has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.option_strings
            and "%(default)" not in text
            and action.default not in (None, False, argparse.SUPPRESS)
        ):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    """The `pqattn` parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="pqattn", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pqattn {pqattn.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _add_demo,
        _add_bench,
        _add_compare,
        _add_check,
        _add_report,
        _add_quality,
        _add_tasks,
        _add_train,
        _add_pareto,
        _add_fidelity,
    ):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"pqattn {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
