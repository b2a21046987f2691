"""`pqattn bench` on toy shapes: every suite runs, the document follows the schema, the math holds."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from pqattn.cli import main
from pqattn.index import PQConfig
from pqattn.kernels import kernel_names
from pqattn.lab import baselines, roofline, suites, timing
from pqattn.lab.bench import (
    Settings,
    format_table,
    idle_before,
    kernel_family,
    plot,
    run_bench,
    run_impl,
    token_rates,
)
from pqattn.lab.schema import validate


@pytest.fixture(scope="module")
def tiny_run() -> tuple[dict, list[int]]:
    """The tiny suites' document, and the row counts of the partial documents passed to on_row
    (each validated when passed)."""
    partial: list[int] = []

    def on_row(doc: dict) -> None:
        validate(doc)
        partial.append(len(doc["results"]))

    doc = run_bench(list(suites.SUITES), size="tiny", device=torch.device("cpu"), profile=True, on_row=on_row)
    return doc, partial


@pytest.fixture(scope="module")
def tiny_doc(tiny_run) -> dict:
    return tiny_run[0]


def test_partial_documents_grow_a_row_at_a_time(tiny_run) -> None:
    doc, partial = tiny_run
    assert partial == list(range(1, len(doc["results"]) + 1))


def test_every_suite_and_impl_is_timed(tiny_doc) -> None:
    validate(tiny_doc)
    seen = {(r["suite"], r["impl"]) for r in tiny_doc["results"]}
    for name, make in suites.SUITES.items():
        for case in make("tiny", torch.device("cpu")):
            for impl in case.impls:
                assert (name, impl.name) in seen
    for r in tiny_doc["results"]:
        assert r["skipped"] is None
        t = r["timings"]
        assert t["graph"] is None and r["graph_error"] == "no CUDA device"
        assert r["primary"] == "pipelined"
        for mode in ("eager", "pipelined"):
            assert t[mode]["median_us"] > 0 and t[mode]["min_us"] <= t[mode]["median_us"]
            assert len(t[mode]["samples_us"]) == t[mode]["repeats"] >= 3
        assert r["profile"]["kernels"], "the CPU profile lists the ops that ran"
        assert "autotuned" not in r, "no autotuner runs on a CPU"


def test_speedups_are_ratios_of_same_mode_medians(tiny_doc) -> None:
    rows = {(r["suite"], r["case"], r["impl"]): r for r in tiny_doc["results"]}
    pq = rows[("decode", "tiny", "pqattn-attn")]
    assert set(pq["vs"]) == {"torch-ref", "sdpa"}
    assert set(rows[("decode", "tiny", "pqattn-step")]["vs"]) == {"sdpa"}  # a whole step vs dense only
    sdpa = rows[("decode", "tiny", "sdpa")]
    want = sdpa["timings"]["eager"]["median_us"] / pq["timings"]["eager"]["median_us"]
    assert pq["vs"]["sdpa"] == {"mode": "eager", "speedup": pytest.approx(want)}
    assert "vs" not in sdpa
    # a model loop also against its baselines' back-to-back steps (as StaticDecoder.run() takes them)
    loop, dense = rows[("generate", "tiny", "pqattn")], rows[("generate", "tiny", "sdpa")]
    want = dense["timings"]["pipelined"]["median_us"] / loop["timings"]["pipelined"]["median_us"]
    assert loop["vs"]["sdpa"]["pipelined_speedup"] == pytest.approx(want)
    assert loop["replay_ms_per_token"] == pytest.approx(loop["timings"]["pipelined"]["median_us"] / 1e3)
    assert loop["timings"]["pipelined"]["calls_per_sample"] >= Settings.for_size("tiny").loop_calls


def test_a_loop_is_timed_back_to_back_within_its_decoders_room() -> None:
    """A model loop's decoder has room for GENERATE_TOKENS steps: the full settings time it in
    fewer, with pipelined samples of loop_calls steps back to back."""
    calls = []

    def step(x: dict) -> None:
        calls.append(1)
        time.sleep(0.002)

    case = suites.Case("generate", "loop", {"B": 1}, lambda seed: {})
    impl = suites.Impl("loop", "pqattn", step, 1, 1, no_graph="replays its own graph")
    row = run_impl(case, impl, [{}], torch.device("cpu"), Settings(), profile=True)
    assert row["timings"]["pipelined"]["calls_per_sample"] >= Settings().loop_calls
    assert len(calls) <= suites.GENERATE_TOKENS


def test_the_estimate_waits_past_a_loops_build_and_capture() -> None:
    """A model loop's first call builds its decoder and the second captures its step: the calls
    per pipelined sample come from a later call's time."""
    calls = []

    def step(x: dict) -> None:
        calls.append(1)
        if len(calls) <= 2:
            time.sleep(0.05)

    case = suites.Case("generate", "slow-start", {"B": 1}, lambda seed: {})
    impl = suites.Impl("loop", "pqattn", step, 1, 1, no_graph="replays its own graph")
    settings = dataclasses.replace(Settings.for_size("tiny"), graph_target_us=1e4)
    row = run_impl(case, impl, [{}], torch.device("cpu"), settings, profile=False)
    assert row["estimate_us"] < 2e4
    assert row["timings"]["pipelined"]["calls_per_sample"] > 1


def test_the_estimate_is_the_fastest_warm_call() -> None:
    """A call the host delays after the warm ones does not set the estimate: the calls per timed
    graph and sample follow it, and a graph of fewer calls carries more of its launch a call."""
    waits = iter([0.04, 0.001, 0.001, 0.03])

    def call() -> None:
        time.sleep(next(waits))

    est = timing.estimate_us(call, torch.device("cpu"), warmup_ms=0.0, min_calls=4)
    assert 1e3 <= est < 1e4


def test_rates_follow_bytes_and_time(tiny_doc) -> None:
    ceil = tiny_doc["ceilings"]
    assert ceil["copy_gbps"] > 0 and ceil["matmul_tflops"] > 0
    for r in tiny_doc["results"]:
        us = r["timings"][r["primary"]]["median_us"]
        assert r["gbps"] == pytest.approx(r["bytes"] / us / 1e3)
        assert r["pct_copy"] == pytest.approx(100 * r["gbps"] / ceil["copy_gbps"])
        assert r["floor_us"] == pytest.approx(roofline.floor_us(r["bytes"], r["flops"], ceil))


def test_table_and_plot(tiny_doc, tmp_path) -> None:
    text = format_table(tiny_doc)
    assert "decode/tiny" in text and "pqattn-step" in text and "sdpa" in text
    assert "profile decode/tiny pqattn-attn" in text
    pytest.importorskip("matplotlib")
    plot(tiny_doc, str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    sweep = []  # the decode rows as an N sweep: drawn as lines in an extra panel
    for n in (100, 200, 400):
        for r in tiny_doc["results"]:
            if r["suite"] == "decode":
                sweep.append({**r, "case": f"{suites.SWEEP}N{n}", "params": {**r["params"], "N": n}})
    plot({**tiny_doc, "results": tiny_doc["results"] + sweep}, str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").stat().st_size > (tmp_path / "b.png").stat().st_size


def test_full_and_quick_suites_hold_the_issue_shapes() -> None:
    meta = torch.device("meta")
    full = {c.name for c in suites.select_suite("full", meta)}
    llm = {"llm-B1-N16K-heavy256", "llm-B1-N32K-heavy128", "llm-B1-N128K-heavy1024"}
    assert "original" in full and llm <= full and len(full) == 1 + len(llm) + 27
    orig = suites.select_suite("full", meta)[0].params
    assert (orig["B"], orig["H"], orig["Hkv"], orig["N"], orig["heavy"]) == (1, 32, 32, 32000, 128)
    decode = [c.name for c in suites.decode_suite("full", meta)]
    assert decode[:3] == ["B1-N32K-heavy128", "B1-N128K-heavy2048", "B8-N32K-heavy1024"]
    assert [c.params["N"] for c in suites.decode_suite("full", meta)[3:]] == [
        n * 1024 for n in (4, 8, 16, 32, 64, 128, 256)
    ]
    assert all(name.startswith(suites.SWEEP) for name in decode[3:])
    builds = suites.build_suite("full", meta)
    assert len(builds) == 9 + 8 and [c.params["sample"] for c in builds[9:]] == [16, 32, 64, 256] * 2
    assert len(suites.prefill_suite("full", meta)) == 5
    gen = suites.generate_suite("quick", meta)[0]
    assert (gen.params["B"], gen.params["context"]) == (1, 32 * 1024) and all(i.no_graph for i in gen.impls)
    names = ["pqattn", "sdpa", "dense-split-k", "pqattn-compiled", "dense-split-k-compiled", "sdpa-compiled"]
    assert [i.name for i in gen.impls] == names
    assert [c.name for c in suites.generate_suite("full", meta)] == [
        "llama8L-B1-32K",
        "llama8L-B8-32K",
        "llama8L-B32-32K",
        "llama8L-B1-128K",
    ]
    host = suites.host_suite("full", meta)
    assert [c.name for c in host] == ["llama8L-B1-32K-host", "llama8L-B1-128K-host"]
    assert [i.name for i in host[0].impls] == ["pqattn-host", "pqattn", "dense-split-k"]
    assert [i.role for i in host[0].impls] == ["pqattn", "baseline", "baseline"]
    step = suites.step_suite("full", meta)
    assert [(c.params["B"], c.params["N"]) for c in step] == [
        (1, 4096), (1, 32768), (1, 131072), (8, 32768), (32, 32768), (1, 524288)
    ]  # fmt: skip
    default = PQConfig()
    for c in step:  # the default policy at 2% per query head, sink 64 + window 64
        p = c.params
        assert (p["M"], p["bits"], p["share"], p["group_rule"]) == (16, 8, default.share, default.group_rule)
        assert (p["sink"], p["window"], p["heavy"]) == (64, 64, round(0.02 * p["N"]))
        assert [i.name for i in c.impls] == ["pqattn-step", "pqattn-append", "sdpa"]
    for name, make in suites.SUITES.items():
        quick = {c.name for c in make("quick", meta)}
        assert quick and quick <= {c.name for c in make("full", meta)}, name


def test_rotation_only_when_inputs_fit_in_l2() -> None:
    case = suites.decode_suite("tiny", torch.device("meta"))[0]
    assert suites.rotation(case, 0) == 1
    touched = suites.touched_bytes(case)
    assert suites.rotation(case, touched // 2) == 1
    assert suites.rotation(case, 10 * touched) == 8
    assert suites.rotation(case, 2 * touched) == 4


def test_timers_count_calls() -> None:
    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    cpu = torch.device("cpu")
    t = timing.time_eager(fns, cpu, repeats=7)
    assert calls == [0, 1, 2, 0, 1, 2, 0] and t["repeats"] == 7
    calls.clear()
    t = timing.time_pipelined(fns, cpu, repeats=2, calls=6)
    assert len(calls) == 12 and t["calls_per_sample"] == 6
    assert timing.host_syncs(fns[0], cpu) is None


def test_summarize() -> None:
    s = timing.summarize([4.0, 1.0, 3.0, 2.0, 5.0])
    assert s["median_us"] == 3.0 and s["min_us"] == 1.0 and s["repeats"] == 5
    assert s["iqr_us"] == pytest.approx(3.0)  # exclusive quartiles 1.5 and 4.5


def test_plain_torch_kmeans_centres_are_member_means() -> None:
    """The baseline must be a real k-means: each returned centre is the mean of its returned members."""
    keys = torch.randn(1, 2, 200, 16)
    centroids, codes = baselines.kmeans_plain_torch(keys, subvectors=2, bits=3, iters=6)
    assert centroids.shape == (1, 2, 2, 8, 8) and codes.shape == (1, 2, 200, 2)
    x = keys.reshape(1, 2, 200, 2, 8)
    for h in range(2):
        for m in range(2):
            for c in range(8):
                members = x[0, h, codes[0, h, :, m] == c, m]
                if len(members):
                    torch.testing.assert_close(centroids[0, h, m, c], members.mean(0), rtol=1e-5, atol=1e-5)


def test_cli_bench_writes_valid_json(tmp_path, capsys) -> None:
    path = tmp_path / "r.json"
    assert (
        main(
            [
                *("bench", "select", "--tiny", "--device", "cpu"),
                *("--case", "tiny$", "--impl", "torch.topk", "--json", str(path)),
            ]
        )
        == 0
    )
    doc = validate(json.loads(path.read_text()))
    assert [r["impl"] for r in doc["results"]] == ["torch.topk"]
    assert doc["environment"]["torch"] == torch.__version__
    assert "select/tiny" in capsys.readouterr().out


def test_cli_bench_bad_arguments(capsys) -> None:
    assert main(["bench", "select", "--tiny", "--device", "cpu", "--case", "nothing-matches"]) == 2
    assert "case:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "nosuch"])


def test_graph_timing_and_sync_detection_on_gpu(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("CUDA graphs and sync detection need a GPU")
    x = [torch.randn(1 << 20, device=device) for _ in range(2)]
    fns = [lambda t=t: t.mul_(1.0) for t in x]
    graph = timing.capture(fns, device, calls=4)
    t = timing.time_graph(graph, device, repeats=5, calls=4)
    assert t["repeats"] == 5 and t["calls_per_sample"] == 4 and 0 < t["min_us"] <= t["median_us"]
    assert timing.host_syncs(fns[0], device) is None
    assert timing.host_syncs(lambda: x[0].sum().item(), device) is not None


def test_sync_free_case_is_graph_timed_on_gpu(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("graph replay needs a GPU")
    doc = run_bench(["decode"], size="tiny", device=device, impls=["sdpa"])
    row = doc["results"][0]
    assert row["graph_error"] is None and row["primary"] == "graph"
    assert row["timings"]["graph"]["median_us"] > 0


def test_autotuned_choice_is_recorded_per_row_on_gpu(device: torch.device, monkeypatch) -> None:
    """A row whose implementation ran an autotuned kernel records the config chosen for its shape;
    baselines record none."""
    if device.type != "cuda":
        pytest.skip("the kernels are autotuned on the GPU only (one forced config under the interpreter)")
    monkeypatch.setenv("PQATTN_AUTOTUNE", "1")
    doc = run_bench(["select"], size="tiny", device=device, impls=["pqattn", "torch.topk"])
    rows = {r["impl"]: r for r in doc["results"]}
    # the tiny case keeps no histogram and asks for heavy 16: the merge tree, whose leaves are tuned
    assert {"TILE", "num_warps"} <= rows["pqattn"]["autotuned"]["pq_select"].keys()
    assert "autotuned" not in rows["torch.topk"]


def test_the_split_k_dense_baseline_decodes_as_sdpa() -> None:
    """The generate bench's flash-decoding stand-in (every cached token up to the step's position
    through the decode kernel's path) gives SDPA's greedy tokens in the static loop, ragged
    prompts included."""
    import transformers

    import pqattn.integrations.hf as pq_hf

    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 60), generator=torch.Generator().manual_seed(1))
    want = pq_hf.generate(model, ids, 8, prompt_lengths=[60, 41])
    model.set_attn_implementation(baselines.register_dense_decode())
    assert torch.equal(pq_hf.generate(model, ids, 8, prompt_lengths=[60, 41]), want)
    counts = next(iter(model.model.layers[0].self_attn._dense_decode_buffers.values()))[0]
    assert counts.tolist() == [67, 48], "the last step reads each row's tokens up to its position"


@pytest.mark.parametrize("route", ["reference", "kernel"])
def test_the_split_k_dense_baseline_attends_up_to_each_position(route: str, request) -> None:
    """A decode step of the stand-in reads each row's tokens 0..position only (random values in
    the later slots of the static cache), and every token without position_ids; on the
    reference and on the group decode kernel."""
    if route == "kernel":
        request.getfixturevalue("kernel_routes")
    B, H, Hkv, S, D = 2, 4, 2, 50, 16
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    at = torch.tensor([[30], [44]])
    out, _ = baselines.dense_decode_attention(torch.nn.Module(), q, k, v, None, scaling=0.25, position_ids=at)
    for b in range(B):
        n = int(at[b]) + 1
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], scale=0.25, enable_gqa=True
        )
        torch.testing.assert_close(out[b : b + 1], want.transpose(1, 2), atol=1e-5, rtol=1e-5)
    every, _ = baselines.dense_decode_attention(torch.nn.Module(), q, k, v, None, scaling=0.25)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(every, want.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_step_suite_times_every_sample_at_n() -> None:
    """The user-path step appends a token a call: the harness rewinds each input set before every
    sample, so that the indexes end a few tokens past N, and back at N when rewound."""
    case = suites.step_suite("tiny", torch.device("cpu"))[0]
    N, B = case.params["N"], case.params["B"]
    inputs = [case.make_inputs(seed) for seed in range(2)]
    for impl in case.impls:
        if impl.rewind is None:
            continue
        row = run_impl(case, impl, inputs, torch.device("cpu"), Settings.for_size("tiny"), profile=False)
        assert row["timings"]["eager"]["repeats"] >= 3
        for x in inputs:
            # the last sample's calls, from N
            assert all(N < n <= N + suites.STEP_ROOM // 4 for n in x["index"].lengths.tolist())
            impl.rewind(x)
            assert x["index"].lengths.tolist() == [N] * B


def test_idle_before_charges_each_gap_to_the_kernel_after_it() -> None:
    # b waits 2 after a; c overlaps b (another stream) and waits for nothing; a again waits 3 after c
    spans = [("c", 4.0, 9.0), ("a", 0.0, 1.0), ("b", 3.0, 6.0), ("a", 12.0, 13.0)]
    assert idle_before(spans) == {"b": 2.0, "a": 3.0}
    assert idle_before([]) == {}


def test_kernel_families_of_a_model_step() -> None:
    names = kernel_names()
    assert {"_score_kernel", "_group_decode_kernel", "_pq_encode_kernel", "_fetch_kernel"} <= names
    family = {
        "_collect_kernel": "attention",
        "pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits>": "attention",
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": "attention",
        "nvjet_sm90_tst_64x8_64x16_2x1_v_bz_splitK_TNT": "weights",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float>": "weights",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n": "weights",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "other",
        "void at::native::index_elementwise_kernel<128, 4>": "other",
    }
    assert {n: kernel_family(n, names) for n in family} == family


def test_token_rates_split_a_profiled_step_by_family() -> None:
    """A model loop's row: its kernels' time by family beside the weights' and the attention's
    bytes at the copy rate, and the GPU's idle time."""
    row = {
        "params": {"B": 4, "weights_bytes": 2_000_000},
        "bytes": 3_000_000,
        "timings": {"eager": {"median_us": 2000.0}, "pipelined": {"median_us": 1000.0}},
        "profile": {
            "gpu_us_per_call": 1600.0,
            "families_us_per_call": {"weights": 1000.0, "attention": 500.0, "other": 100.0},
            "idle_us_per_call": 50.0,
        },
    }
    out = token_rates(row, {"copy_gbps": 1000.0})
    assert (
        out["ms_per_token"] == 2.0
        and out["tokens_per_s"] == 2000.0
        and out["tokens_per_s_pipelined"] == 4000.0
    )
    assert out["latency_over_kernels"] == 1.25
    assert out["breakdown"] == {
        "weights": {"ms": 1.0, "floor_ms": 2.0e-3},
        "attention": {"ms": 0.5, "floor_ms": 1.0e-3},
        "other": {"ms": 0.1, "floor_ms": 0.0},
        "idle": {"ms": 0.05, "floor_ms": 0.0},
    }
    del row["profile"]["families_us_per_call"]
    assert "breakdown" not in token_rates(row, {"copy_gbps": 1000.0}), "no split without the families"
