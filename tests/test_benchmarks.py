"""The benchmark scripts run end to end (--quick) and report what they promise, so they cannot rot.

Sizes and ratios here are sanity bounds, not performance targets: those live in the full runs.
"""

import importlib
import itertools
import json
import os
import shutil

import pytest

pytestmark = pytest.mark.slow


def run_quick(name, tmp_path):
    module = importlib.import_module(f"benchmarks.{name}")
    out = tmp_path / "x.json"
    report = module.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    return report


def test_batching_quick(tmp_path):
    report = run_quick("bench_batching", tmp_path)

    assert report["model"] == "tiny:gemma3"
    assert [row["n"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        for key in ("engine_tps", "raw_tps", "sequential_tps", "engine_vs_raw"):
            assert row[key] > 0


def test_roundtrip_quick(tmp_path):
    report = run_quick("bench_roundtrip", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    assert report["cache_tokens"] == report["history_tokens"] + 1
    rows = {row["variant"]: row for row in report["rows"]}
    assert list(rows) == ["none", "fp16", "q8", "q4"]
    # Sizes follow the format: float32 is twice float16, q8 and q4 add group scales and biases.
    assert rows["none"]["file_bytes"] > rows["fp16"]["file_bytes"] > rows["q8"]["file_bytes"]
    assert rows["q8"]["file_bytes"] > rows["q4"]["file_bytes"]
    assert 0.5 < report["ratios"]["q8_vs_fp16"] < 0.6
    # (q4 is 0.320x a position; a 97-token cache's tokens and metadata add about 0.03)
    assert 0.25 < report["ratios"]["q4_vs_fp16"] < 0.36
    for row in rows.values():
        assert row["save_ms"] > 0 and row["load_ms"] > 0
        assert set(row["fidelity"]) == {"greedy", "random"}
        for f in row["fidelity"].values():
            assert 0 <= f["agreement"] <= 1
            assert f["mean_kl"] >= -1e-6
    # The unquantized trip is bit exact: same distributions after every teacher-forced token.
    for f in rows["none"]["fidelity"].values():
        assert f["agreement"] == 1.0
        assert f["max_abs_logprob_diff"] == 0.0
    assert set(report["targets_met"]) == {"q8_vs_fp16", "q4_vs_fp16", "q8_agreement"}


def test_load_quick(tmp_path):
    report = run_quick("bench_load", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    (row,) = report["rows"]
    assert row["same_cache"] is True  # the new load path rebuilds exactly what the old one did
    paths = {"agentkv", "turns", "perblock", "single", "previous"}
    expected = {f"{p}.{v}" for p in paths for v in ("none", "q8", "q4")} | {"raw.none"}
    assert {k for k, v in row.items() if isinstance(v, dict) and "ms" in v} == expected
    # 4 blocks: one segment, segments of 2 (--blocks-per-turn), a file each; and the tail.
    assert row["files"] == {"agentkv": 2, "turns": 3, "perblock": 5}
    assert row["agentkv.q4"]["mb"] < row["agentkv.q8"]["mb"] < row["agentkv.none"]["mb"]
    assert all(v["ms"] > 0 for v in row.values() if isinstance(v, dict) and "ms" in v)


def test_blocks_quick(tmp_path):
    report = run_quick("bench_blocks", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    assert {(r["kv_bits"], r["history"]) for r in report["rows"]} == {("none", 600), ("q8", 600)}
    for row in report["rows"]:
        assert row["ttft_ms"] > 0 and row["raw_ttft_ms"] > 0 and row["load_ms"] < row["ttft_ms"]
        # The longer turn wrote whole new blocks (about its new tokens' worth) and a tail.
        assert row["block_bytes_written"] > 0 and row["tail_bytes"] > 0
        assert 0.5 < row["blocks_vs_new_tokens"] <= 1.2
        assert row["files_read"] >= 2  # a segment per save that added blocks, and the tail
    shared = report["shared_prompt"]
    assert shared["on"]["cache_sources"] == ["none", "prefix"]
    assert shared["off"]["cache_sources"] == ["none"]
    assert shared["on"]["prefilled_tokens"] < shared["off"]["prefilled_tokens"]
    assert shared["on"]["prompt_tokens"] == shared["off"]["prompt_tokens"]
    assert report["targets_met"]["shared_prefilled_once"] is True
    assert report["open"]["agents"] == 201 and report["open"]["open_many_s"] > 0


def test_stall_quick(tmp_path):
    report = run_quick("bench_stall", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    assert report["import.messages"] == 2_000 and report["import.wall_s"] > 0
    assert report["import.worst_stall_s"] >= 0
    # Its text cannot fit tiny:gemma3's 8K context: refused before it is tokenized.
    assert report["count_tokens.status"] == 400 and report["count_tokens.input_tokens"] is None
    assert report["count_tokens.error"].startswith("prompt is too long: ")
    assert report["count_tokens.pings"] > 0
    assert report["count_tokens.ping_max_ms"] >= report["count_tokens.ping_median_ms"] > 0


def test_event_loop_quick(tmp_path):
    report = run_quick("bench_event_loop", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    assert (report["messages"], report["target_ms"]) == (2_000, 50.0)
    assert report["stream_target_ms"] == 100.0
    kinds = [
        ("history at the limit (stateless)", 400),
        ("history at the limit (named)", 400),
        ("0.2 MB system prompt (stateless)", 400),
        ("0.2 MB system prompt (named)", 400),
        ("history over the limit (stateless)", 413),
        ("0.2 MB user message (stateless)", 400),
    ]
    kinds.append(("turn of a 2,000-message transcript", 400))
    expected = [("baseline (a stream)", None)] + [
        (f"{api} {kind}", status) for api in ("anthropic", "openai") for kind, status in kinds
    ]
    expected += [
        ("anthropic count_tokens of the history at the limit", 200),
        ("agents API: new agent, 0.2 MB system prompt", 201),
    ]
    assert [(row["request"], row.get("status")) for row in report["rows"]] == expected
    for row in report["rows"]:
        assert row["pings"] > 0 and row["worst_ms"] >= row["median_ms"] > 0
        assert row["stream_gaps"] > 0
        assert row["stream_worst_gap_ms"] >= row["stream_median_gap_ms"] > 0


def test_resume_quick(tmp_path):
    report = run_quick("bench_resume", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    assert [row["history"] for row in report["rows"]] == [128, 256]
    for row in report["rows"]:
        assert row["prompt_tokens"] >= row["history"]
        for key in ("reprefill_ttft_s", "hot_ttft_s", "raw_mlx_lm_ttft_s"):
            assert row[key] > 0
        assert set(row["disk"]) == {"none", "q8", "q4"}
        for disk in row["disk"].values():
            assert disk["ttft_s"] > 0 and disk["speedup_vs_reprefill"] > 0 and disk["vs_raw"] > 0
            assert disk["cache_load_s"] < disk["ttft_s"]
        # Quantized files are smaller than the exact one.
        sizes = {name: disk["file_bytes"] for name, disk in row["disk"].items()}
        assert sizes["none"] > sizes["q8"] > sizes["q4"] > 0
    concurrent = report["concurrent"]
    assert concurrent["ratio"] > 0
    assert all(r["saves_in_flight_at_start"] > 0 for r in concurrent["rounds"]["saving"])
    assert all(r["saves_in_flight_at_start"] == 0 for r in concurrent["rounds"]["quiet"])
    assert set(report["targets_met"]) == {"none_vs_raw", "saving_decode_ratio"}


def test_peer_quick(tmp_path):
    report = run_quick("bench_peer", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    assert report["model"] == "tiny:gemma3"
    assert report["agents"] == 2
    phases = ["cold", "hot", "restart", "restart_concurrent"]
    assert list(report["totals"]) == phases
    assert [row["agent"] for row in report["rows"]] == ["agent-0", "agent-1"]
    for row in report["rows"]:
        assert 0 < row["history_tokens"] <= report["history"]
        for phase in phases:
            r = row[phase]
            for server in ("agentkv", "mlx_lm"):
                assert r["ttft_s"][server] > 0
                assert r["total_s"][server] >= r["ttft_s"][server]
                assert r["prompt_tokens"][server] > row["history_tokens"]
            assert r["ttft_ratio"] > 0
        # After each restart agentkv resumed the agent's cache from disk: the whole prompt but
        # the new turn; its first prefill (cold) had nothing cached.
        assert row["cold"]["cached_tokens"]["agentkv"] == 0
        for phase in ("restart", "restart_concurrent"):
            prompt = row[phase]["prompt_tokens"]["agentkv"]
            assert row["history_tokens"] < row[phase]["cached_tokens"]["agentkv"] < prompt
    assert report["agentkv_resumed_from_disk"] is True
    for server in ("agentkv", "mlx_lm"):
        sessions = report["servers"][server]["sessions"]
        assert [s["phase"] for s in sessions] == ["cold", "restart", "restart_concurrent"]
        assert all(s["ready_s"] > 0 and s["stop_s"] > 0 for s in sessions)
    assert set(report["versions"]) >= {"agentkv", "mlx_lm"}


def test_fidelity_quick(tmp_path):
    report = run_quick("bench_fidelity", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    assert report["model"] == "gemma3-270m"
    assert report["sliding_window"] == 512
    assert [row["history"] for row in report["rows"]] == [64, 600]  # 600: past the window
    for row in report["rows"]:
        assert row["continuation"] == 32
        assert list(row["variants"]) == [
            "none",
            "q8",
            "q4",
            "batch-q8",
            "batch-q4",
            "decode-exact",
            "decode-q8",
            "decode-q4",
        ]
        assert row["history_perplexity"] < 50  # a trained model on English prose
        # Resumed after a restart from an exact file: every log-probability is the same.
        exact = row["variants"]["none"]
        assert (exact["agreement"], exact["max_abs_logprob_diff"]) == (1.0, 0.0)
        assert exact["perplexity"] == row["reference_perplexity"]
        assert exact["agreement_95"] == [0.8928, 1.0]  # all of 32 tokens agree
        for v in row["variants"].values():
            low, high = v["agreement_95"]
            assert low <= v["agreement"] <= high
        q8, q4 = row["variants"]["q8"], row["variants"]["q4"]
        assert q8["agreement"] >= 0.9 and 0 < q8["mean_kl"] < q4["mean_kl"]
        sizes = [row["variants"][v]["file_bytes"] for v in ("none", "q8", "q4")]
        assert sizes == sorted(sizes, reverse=True)
        # In the batch: every layer of a q8 or q4 file read packed as stored (q4's newest
        # positions in float), the continuation fed as a prompt: q4 close to the file itself.
        batch_q8, batch_q4 = row["variants"]["batch-q8"], row["variants"]["batch-q4"]
        assert (batch_q8["packed_layers"], batch_q4["packed_layers"]) == (18, 18)
        assert q4["mean_kl"] / 2 < batch_q4["mean_kl"] < 2 * q4["mean_kl"]
        assert batch_q8["agreement"] >= 0.9 and 0 < batch_q8["mean_kl"] < batch_q4["mean_kl"]
        assert batch_q4["batch_token_bytes"] < batch_q8["batch_token_bytes"]
        # Fed a token a step, as generation decodes: the exact batch stays (all but) exact.
        control = row["variants"]["decode-exact"]
        assert control["agreement"] == 1.0 and control["mean_kl"] < 1e-6
        for bits in ("q8", "q4"):
            decoded = row["variants"][f"decode-{bits}"]
            assert decoded["agreement"] >= 0.9 and decoded["mean_kl"] > 0
    assert report["exact_is_identical"] is True
    met = report["targets_met"]
    assert set(met) == {
        "q8_agreement",
        "exact",
        "q4_agreement",
        "batch_q8_agreement",
        "batch_q4_agreement",
        "decode_q8_agreement",
        "decode_q4_agreement",
    }
    assert met["exact"] is True
    # No 4K-token history in --quick: the targets measured there are not judged.
    assert {met[name] for name in met if name not in ("q8_agreement", "exact")} == {None}


def test_mixed_quick(tmp_path):
    report = run_quick("bench_mixed", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    rows = {(r["path"], r["long_history"]): r for r in report["rows"]}
    assert set(rows) == {(p, n) for p in ("agentkv", "padded") for n in (0, 400)}
    # The long agent gets a group of its own; one padded batch pads everyone to it.
    assert rows[("agentkv", 400)]["groups"] == 2 and rows[("padded", 400)]["groups"] == 1
    assert rows[("agentkv", 400)]["held_vs_owned"] < rows[("padded", 400)]["held_vs_owned"]
    assert all(r["short_tps"] > 0 and r["held_vs_owned"] >= 1 for r in rows.values())


def test_budget_quick(tmp_path):
    report = run_quick("bench_budget", tmp_path)

    bounded, unbounded = report["rows"]
    assert bounded["completed"] == bounded["agents"] == unbounded["completed"] == 8
    assert bounded["failed"] == unbounded["failed"] == 0
    assert bounded["max_in_batch"] == 2 < unbounded["max_in_batch"]
    assert bounded["held_under_budget_every_step"] is True


def test_no_max_tokens_quick(tmp_path):
    row = run_quick("bench_no_max_tokens", tmp_path)["row"]

    # 16 turns run to the end of a 128-token context in a budget that holds 4 there.
    assert row["completed"] == row["ran_to_the_context"] == row["agents"] == 16
    assert row["refused"] == row["failed"] == row["waits_with_room"] == 0
    assert row["max_in_batch"] > row["fits_at_full_context"] == 4
    assert row["preemptions"] > 0 and row["under_budget_every_step"] is True
    assert row["in_slots_tokens_per_s"] > 0 and row["vs_slots"] > 0


def test_speculative_quick(tmp_path):
    report = run_quick("bench_speculative", tmp_path)

    rows = {(r["workload"], r["agents"]): r for r in report["rows"]}
    assert sorted(rows) == [("novel", 1), ("novel", 2), ("restating", 1), ("restating", 2)]
    assert all(r["same_tokens"] and r["off_tps"] > 0 and r["lookup_tps"] > 0 for r in rows.values())
    assert all(r["speedup"] == r["lookup_tps"] / r["off_tps"] for r in rows.values())
    assert set(report["targets_met"]) == set(report["targets"])


def test_speculative_quick_with_a_draft_of_the_models_first_layers(tmp_path):
    out = tmp_path / "x.json"
    module = importlib.import_module("benchmarks.bench_speculative")
    report = module.main(["--quick", "--draft-layers", "2", "--out", str(out)])

    assert report["draft_model"] == "tiny:llama, its first 2 layers"
    assert report["command"].endswith("--quick --draft-layers 2 --out " + str(out))
    for row in report["rows"]:
        assert row["same_tokens"] and row["draft_tps"] > 0
        assert row["draft_speedup"] == row["draft_tps"] / row["off_tps"]
        assert 0 <= row["draft_accepted"] <= row["draft_drafted"]
    assert sum(r["draft_drafted"] for r in report["rows"]) > 0


def test_budget_mix_quick(tmp_path):
    out = tmp_path / "x.json"
    report = importlib.import_module("benchmarks.bench_budget").main(
        ["--mix", "--quick", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))

    row = report["rows"]["model"]
    assert row["completed"] == row["agents"] == 9
    assert row["need_long_mb"] > row["need_short_mb"] > 0
    # The budget holds the long agent and two short ones: never more beside it.
    assert row["max_beside_long"] == 2 and row["preemptions"] == 0
    assert row["held_under_budget_every_step"] is True


def test_prefill_quick(tmp_path):
    report = run_quick("bench_prefill", tmp_path)

    before, paced = report["rows"]
    assert before["max_decode_stall"] is None and paced["max_decode_stall"] == 2.0
    for row in report["rows"]:
        assert row["decode_median_ms"] > 0 and row["worst_vs_median"] >= 1
        assert row["prefill_s"] > 0 and row["decoder_tokens_during"] > 0


def test_policies_quick(tmp_path):
    report = run_quick("bench_policies", tmp_path)

    assert [r["policy"] for r in report["rows"]] == ["fair", "latency_first", "throughput_first"]
    for row in report["rows"]:
        assert 0 < row["short_ttft_p50_s"] <= row["short_ttft_p95_s"]
        assert row["aggregate_tps"] > 0


def test_stateless_quick(tmp_path):
    report = run_quick("bench_stateless", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    assert report["failed"] == 0 and report["failures"] == []
    assert [row["requests"] for row in report["rows"]] == [10, 20, 30, 40]
    # The 20 distinct conversations each have an agent; the 20 identical requests share one
    # (one more while two of them are in flight at once).
    assert 21 <= report["rows"][-1]["agents"] <= 20 + report["concurrency"]
    assert report["budgets"].startswith("agentkv: hot tier budget ")
    assert sum(report["cache_sources"].values()) == 40
    assert set(report["levels_off"]) == {"agents", "rss_mb", "disk_mb"}


def test_grammar_quick(tmp_path):
    report = run_quick("bench_grammar", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    assert report["held_tokens"] == [report["tokens"]]  # the schema makes it run to the end
    assert report["compile_ms"] > 0 and report["held_vs_single"] > 0
    assert report["neighbours_vs_free"] > 0 and report["half_vs_free"] > 0


def test_reasoning_quick(tmp_path):
    report = run_quick("bench_reasoning", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    kept, mixed = report["runs"]["kept"]["turns"], report["runs"]["mixed"]["turns"]
    assert len(kept) == len(mixed) == 3 and kept[0]["cached"] == mixed[0]["cached"] == 0
    for earlier, later in itertools.pairwise(kept):  # the whole reply resumed
        assert later["cached"] == earlier["prompt"] + earlier["generated"]
    for earlier, later in itertools.pairwise(mixed):  # from where the reply began
        assert later["cached"] == earlier["prompt"]


def test_batch_kv_quick(tmp_path):
    report = run_quick("bench_batch_kv", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    rows = report["rows"]
    assert list(rows) == ["model", "q8", "q4"]
    for row in rows.values():
        assert row["completed"] == row["agents"] and row["failed"] == 0
        assert row["held_under_budget_every_step"] is True
        # Every agent decodes past its first token: steps that only decoded, timed.
        assert row["decode_steps"] > 0 and row["decode_tokens_per_s"] > 0
        ratio = row["decode_tokens_per_s"] / rows["model"]["decode_tokens_per_s"]
        assert row["decode_tps_vs_model"] == round(ratio, 3)
        assert row["prefill_tokens"] == 256 and row["prefill_s"] > 0
        assert row["prefill_vs_model"] == round(row["prefill_s"] / rows["model"]["prefill_s"], 3)
    # Quantized, an agent sets aside less of the same budget.
    assert rows["q4"]["need_mb"] < rows["q8"]["need_mb"] < rows["model"]["need_mb"]
    # And the hot tier holds the agents' caches as the batch held them: more of them.
    assert rows["model"]["hot_agents"] == report["fits"]
    # (q4's float positions outweigh its smaller words over these short sliding windows.)
    assert rows["q4"]["hot_token_bytes"] < rows["model"]["hot_token_bytes"]
    assert rows["q8"]["hot_token_bytes"] < rows["model"]["hot_token_bytes"]
    assert rows["q8"]["hot_agents"] > rows["model"]["hot_agents"]
    # The capacity baseline: the float32 model cast to float16 fits twice its agents.
    float16 = report["float16"]
    assert float16["failed"] == 0 and float16["completed"] == float16["agents"]
    assert float16["max_in_batch"] == 2 * rows["model"]["max_in_batch"]
    assert float16["hot_agents"] == 2 * rows["model"]["hot_agents"]
    q8_ratio = rows["q8"]["max_in_batch"] / float16["max_in_batch"]
    assert rows["q8"]["agents_vs_float16"] == round(q8_ratio, 3)
    # q8 and q4 on the float16 model: their float positions in float16 cost less than in
    # float32, so the same budgets hold at least as many.
    same = float16["quantized"]
    assert list(same) == ["q8", "q4"]
    for name in ("q8", "q4"):
        assert same[name]["max_in_batch"] >= rows[name]["max_in_batch"]
        assert same[name]["hot_agents"] >= rows[name]["hot_agents"]
        ratio = same[name]["max_in_batch"] / float16["max_in_batch"]
        assert same[name]["agents_vs_float16"] == round(ratio, 3)
    # One attention layer's step, timed per precision (q4 also with its keys expanded).
    steps = report["attention"]["by_precision"]
    assert list(steps) == ["model", "q8", "q4", "q4 keys expanded"]
    assert all(s["ms"] > 0 and s["working_set_mb"] >= 0 for s in steps.values())
    # And its prompt chunk (on this CPU q8 also as its words read by the quantized matmul).
    chunk = report["chunk"]
    assert (chunk["history"], chunk["chunk"]) == (500, 64)
    assert list(chunk["by_precision"]) == ["model", "q8", "q4", "q8 quantized matmul"]
    for row in chunk["by_precision"].values():
        assert row["ms"] > 0 and row["working_set_mb"] >= 0
        assert row["ms_vs_model"] == round(row["ms"] / chunk["by_precision"]["model"]["ms"], 3)


def test_the_timed_chunk_reads_q8_words_expanded_and_through_the_quantized_matmul(monkeypatch):
    """``bench_batch_kv``'s chunk timing takes both q8 paths on a CPU: the ``q8`` row expands
    its keys and values (each of its runs), the ``q8 quantized matmul`` row expands nothing
    (q4's chunk, larger than its key group, is expanded by its own path), and the engine's
    setting is left as it was."""
    from agentkv.engine.attention import words
    from benchmarks import bench_batch_kv

    calls = []
    real = words.expanded
    monkeypatch.setattr(words, "expanded", lambda *a: calls.append(a[-2]) or real(*a))
    before = words.DEVICE.cpu, words.EXPANDED_ROWS
    got = bench_batch_kv.attention_chunk(100, 32, (2, 4, 64))
    assert list(got["by_precision"]) == ["model", "q8", "q4", "q8 quantized matmul"]
    assert calls == [8, 8] * bench_batch_kv.CHUNK_RUNS
    assert (words.DEVICE.cpu, words.EXPANDED_ROWS) == before


def test_scaleout_quick(tmp_path):
    if shutil.which("haproxy") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true, but haproxy is not installed (apt-get install haproxy)")
        pytest.skip("haproxy is not installed (apt-get install haproxy)")
    report = run_quick("bench_scaleout", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    assert [row["workers"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert (row["turns"], row["failed"]) == (8, 0)
        assert row["tokens"] == 8 * report["max_tokens"]  # end tokens banned: every turn full
        assert sum(row["turns_by_worker"].values()) == 8
    assert list(report["rows"][0]["turns_by_worker"]) == ["w1"]
    assert report["two_vs_one"] > 0


def test_ready_quick(tmp_path):
    report = run_quick("bench_ready", tmp_path)

    assert report["model"] == "tiny:llama"
    assert report["ready_s"] > 0 and report["load_s"] > 0
    assert report["ratio"] == report["ready_s"] / report["load_s"]
    assert list(report["steps_s"]) == [
        "imports",
        "resolve",
        "fingerprint",
        "mlx_lm weights",
        "mlx_lm tokenizer",
        "batch probes",
        "grammar index",
        "registry",
    ]
    assert all(v >= 0 for v in report["steps_s"].values())
    assert (tmp_path / "x.png").stat().st_size > 0


def test_fan_out_quick(tmp_path):
    report = run_quick("bench_fan_out", tmp_path)

    runs = {row["run"]: row for row in report["rows"]}
    assert list(runs) == ["not shared", "one after another", "after a restart", "all at once"]
    assert runs["not shared"]["cached_tokens"] == [0] * report["agents"]
    start = report["shared_start_tokens"]
    # Shared: the brief is prefilled twice (the first agent, the one that parts from it), and
    # the others resume it; after a restart its whole blocks come from disk.
    for name in ("one after another", "all at once"):
        assert runs[name]["prefilled_tokens"] < runs["not shared"]["prefilled_tokens"]
        assert sorted(runs[name]["cached_tokens"])[2:] == [start] * (report["agents"] - 2)
    assert min(runs["after a restart"]["cached_tokens"]) >= start // 256 * 256
    assert (tmp_path / "x.png").stat().st_size > 0


def test_gpu_quick(tmp_path):
    """``make bench-gpu``'s quick mode: every part in the summary, each part's JSON with its
    header and the ratios it promises, computed from the rows measured in the run."""
    from benchmarks import bench_gpu
    from benchmarks.gpu_sizes import QUICK

    summary = bench_gpu.main([str(tmp_path), "--quick"])

    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert (summary["mode"], summary["complete"]) == ("quick", True)
    assert {name: part["status"] for name, part in summary["parts"].items()} == {
        "batching": "ok",
        "batch_kv": "ok",
        "mixed": "ok",
        "resume": "ok",
        "prefill": "ok",
        "speculative": "ok",
    }
    names = ["batching", "batch_kv", "mixed", "resume", "prefill", "speculative"]
    reports = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in names}
    for name, report in reports.items():
        assert (report["part"], report["status"], report["cut_short"]) == (name, "ok", False)
        assert (report["date"], report["command"]) == (summary["date"], summary["command"])
        assert report["device"] == summary["device"] and report["device"]["default_device"]
        assert report["model"] == summary["model"]
        assert report["sizes"] == json.loads(json.dumps(QUICK.of(name)))
        assert report["ratios"] == summary["parts"][name]["ratios"]
    model = summary["model"]
    assert (model["model_type"], model["layers"], model["dtype"]) == ("gemma3_text", 5, "float32")
    assert "vocab_note" in model

    batching = reports["batching"]
    assert [row["n"] for row in batching["rows"]] == [1, 2, 4]
    for row in batching["rows"]:
        assert row["engine_vs_raw"] == row["engine_tps"] / row["raw_tps"] > 0
        assert len(row["warm_rounds"]) == 1  # a warm round, then the reported one
    by_n = {str(row["n"]): row["engine_vs_raw"] for row in batching["rows"]}
    assert batching["ratios"] == {"engine_vs_raw": by_n}

    batch_kv = reports["batch_kv"]
    shapes = [(2, 512), (4, 128)]
    rows = {(r["precision"], r["agents"], r["history"]): r for r in batch_kv["rows"]}
    assert list(rows) == [(p, a, h) for p in ("model", "q8", "q4") for a, h in shapes]
    expected = {}
    for agents, history in shapes:
        base = rows[("model", agents, history)]
        for bits in ("q8", "q4"):
            row = rows[(bits, agents, history)]
            assert row["decode_steps"] > 0 and row["kv_held_mb"] < base["kv_held_mb"]
            ratio = row["decode_tps"] / base["decode_tps"]
            expected.setdefault(f"{agents}x{history}", {})[bits] = ratio
    assert batch_kv["ratios"] == {"decode_tps_vs_model": expected}

    mixed = reports["mixed"]
    assert len(mixed["rows"]) == 8  # 2 rounds x 2 paths x alone and beside the long agent
    got = {(r["path"], r["long"]): r for r in mixed["rows"] if r["reported"]}
    assert set(got) == {(p, n) for p in ("agentkv", "padded") for n in (0, 400)}
    assert got[("agentkv", 400)]["groups"] == 2 and got[("padded", 400)]["groups"] == 1
    paths = ("agentkv", "padded")
    assert mixed["ratios"] == {
        "short_vs_alone": {p: got[(p, 400)]["short_tps"] / got[(p, 0)]["short_tps"] for p in paths},
        "agentkv_vs_padded": got[("agentkv", 400)]["short_tps"] / got[("padded", 400)]["short_tps"],
        "held_vs_owned": {p: got[(p, 400)]["held_vs_owned"] for p in paths},
    }
    assert mixed["ratios"]["held_vs_owned"]["agentkv"] < mixed["ratios"]["held_vs_owned"]["padded"]

    (row,) = reports["resume"]["rows"]
    assert (row["kv_bits"], row["history"]) == ("none", 600) and row["vs_raw"] > 0
    assert reports["resume"]["ratios"] == {"disk_vs_raw": {"none": {"600": row["vs_raw"]}}}

    prefill = reports["prefill"]
    before, paced = prefill["rows"]
    assert (before["max_decode_stall"], paced["max_decode_stall"]) == (None, 2.0)
    assert prefill["ratios"] == {
        "worst_gap_vs_median": {
            "BatchGenerator": before["worst_vs_median"],
            "agentkv stall 2": paced["worst_vs_median"],
        },
        "prefill_vs_alone": {
            "BatchGenerator": before["prefill_vs_alone"],
            "agentkv stall 2": paced["prefill_vs_alone"],
        },
    }
    assert before["worst_vs_median"] >= 1 and paced["worst_vs_median"] >= 1

    speculative = reports["speculative"]
    assert [row["n"] for row in speculative["rows"]] == [1, 2]
    for row in speculative["rows"]:
        assert row["same_tokens"] and 0 < row["accepted"] <= row["drafted"]
        assert row["drafts_vs_plain"] == row["drafts_tps"] / row["plain_tps"] > 0
    by_n = {str(row["n"]): row["drafts_vs_plain"] for row in speculative["rows"]}
    assert speculative["ratios"] == {"drafts_vs_plain": by_n}


def test_gpu_records_a_failed_part_and_runs_the_next(tmp_path, monkeypatch):
    from benchmarks import bench_gpu, gpu_parts

    async def broken(ctx):
        ctx.report["rows"] = [{"n": 1}]  # measured before it failed
        raise RuntimeError("out of memory, say")

    monkeypatch.setitem(gpu_parts.PARTS, "batching", broken)
    summary = bench_gpu.main([str(tmp_path), "--quick", "--parts", "batching", "speculative"])

    parts = summary["parts"]
    assert parts["batching"]["status"] == "failed"
    assert parts["batching"]["error"] == "RuntimeError: out of memory, say"
    assert parts["speculative"]["status"] == "ok"
    assert {parts[n]["status"] for n in ("batch_kv", "mixed", "resume", "prefill")} == {
        "not selected"
    }
    report = json.loads((tmp_path / "batching.json").read_text())
    assert (report["status"], report["rows"]) == ("failed", [{"n": 1}])


def test_gpu_skips_the_parts_once_the_budget_is_spent(tmp_path):
    from benchmarks import bench_gpu

    argv = [str(tmp_path), "--quick", "--budget-s", "0", "--parts", "batching", "mixed"]
    summary = bench_gpu.main(argv)

    statuses = {name: part["status"] for name, part in summary["parts"].items()}
    assert statuses["batching"] == statuses["mixed"] == "skipped"
    assert summary["parts"]["mixed"]["reason"] == "budget of 0 s spent"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_images_quick(tmp_path):
    report = run_quick("bench_images", tmp_path)

    images, text = report["rows"]["images"], report["rows"]["text"]
    image_tokens = 2 * 16  # tiny:gemma3-vl's 16 an image
    assert images["prompt"] > text["prompt"] + image_tokens
    # Each follow-up resumes all its history: the images' tokens in memory, then from disk.
    assert images["hot_cached"] - text["hot_cached"] == images["prompt"] - text["prompt"]
    assert images["disk_cached"] - text["disk_cached"] == images["prompt"] - text["prompt"]
    assert report["vision_runs"] == [2] and report["vision_runs_after_restart"] == 0
    ratio = images["hot_ttft_s"] / text["hot_ttft_s"]
    assert report["follow_up_hot_ratio"] == ratio
    beside = report["beside"]  # a turn decoding while another's image is encoded
    assert beside["model"] == "tiny:gemma3-vl" and len(beside["runs"]) == 1
    run = beside["runs"][0]
    assert (
        run["pace_while_encoding"]
        == run["tokens_while_encoding"] * run["alone_tpot_s"] / (run["tower_beside_s"])
    )
    assert run["longest_gap_s"] > 0 and run["tower_alone_s"] > 0


def test_agents_quick(tmp_path):
    report = run_quick("bench_agents", tmp_path)

    assert (tmp_path / "x.png").stat().st_size > 0
    assert report["model"] == "tiny:gemma3" and list(report["servers"]) == ["agentkv", "mlx_lm"]
    w = report["workload"]
    # Per conversation: the opening, a tool round (two requests) and a follow-up; after the
    # restart one more tool round.
    expected = {"steady": w["conversations"] * 4, "restart": w["conversations"] * 2}
    for server in report["servers"].values():
        assert [s["phase"] for s in server["sessions"]] == ["steady", "restart"]
        for phase, count in expected.items():
            requests = server["requests"][phase]
            assert len(requests) == count == server["phases"][phase]["requests"]
            kinds = [r["kind"] for r in requests if r["conversation"] == "conv-0"]
            assert kinds == (
                ["first", "tool_call", "tool_result", "follow_up"]
                if phase == "steady"
                else ["tool_call", "tool_result"]
            )
            for r in requests:
                assert 0 < r["ttft_s"] <= r["total_s"] and r["completion_tokens"] >= 1
                assert r["prompt_tokens"] > w["first"] and r["cached_tokens"] is not None
            summary = server["phases"][phase]
            assert summary["ttft_p50_s"] <= summary["ttft_p90_s"]
            assert 0 <= summary["cached_share"] <= 1 and summary["requests_per_s"] > 0
    # agentkv continued every conversation from its cache on disk after the restart: all but
    # the new user message (the tool call's request) or the reply the client rewrote as a
    # tool call and the tool's result (and the template's tokens around them) cached.
    for r in report["servers"]["agentkv"]["requests"]["restart"]:
        prefilled = r["prompt_tokens"] - r["cached_tokens"]
        assert prefilled < (64 if r["kind"] == "tool_call" else w["tool"] + 128)
    # agentkv splits each turn's time; mlx_lm does not.
    for phase, count in expected.items():
        split = report["servers"]["agentkv"]["phases"][phase]["server_split_s"]
        assert split["turns"] == count and split["prefill_s"] > 0 and split["queue_s"] >= 0
        assert report["servers"]["mlx_lm"]["phases"][phase]["server_split_s"] is None
    assert set(report["ratios"]) == {"mlx_lm"}
