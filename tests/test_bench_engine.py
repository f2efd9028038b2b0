"""The engine benchmark: its varlen attention, one CPU workload end to end, the registry's errors."""

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from kvcanary import cli  # noqa: E402
from kvcanary.bench import suite as bench_suite  # noqa: E402
from kvcanary.bench.engine import build_model, canary_config  # noqa: E402
from kvcanary.integrations.transformers.reach import sdpa_name  # noqa: E402
from kvcanary.bench.varlen_attention import use, varlen  # noqa: E402


def _generate(switch) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = build_model("tiny", torch.device("cpu"), torch.float32, 256)
    switch(model)  # the attention
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 32000, (n,), generator=g).tolist() for n in (30, 50, 70)]
    out = model.generate_batch(
        prompts, generation_config=GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=-1),
        continuous_batching_config=ContinuousBatchingConfig(
            block_size=16, num_blocks=64, max_batch_tokens=64, max_requests_per_batch=3,
            use_async_batching=False, use_cuda_graph=False))
    return {k: v.generated_tokens for k, v in out.items()}


def test_varlen_attention_generates_what_paged_sdpa_generates():
    assert _generate(use) == _generate(lambda model: model.set_attn_implementation(sdpa_name()))


def test_varlen_is_causal_per_request_aligned_to_the_last_keys():
    # One request, one query: it sees every key; a second request's keys never leak into the first.
    q = torch.randn(2, 2, 8)
    k = torch.randn(5, 1, 8)
    v = torch.randn(5, 1, 8)
    cu_q, cu_k = torch.tensor([0, 1, 2]), torch.tensor([0, 3, 5])
    out = varlen(q, k, v, cu_q, cu_k, 1, 3, 0.5)
    alone = varlen(q[:1], k[:3], v[:3], cu_q[:2], cu_k[:2], 1, 3, 0.5)
    assert out.shape == (2, 2, 8) and torch.allclose(out[:1], alone)
    v2 = v.clone()
    v2[3:] += 1.0
    assert torch.allclose(varlen(q, k, v2, cu_q, cu_k, 1, 3, 0.5)[:1], out[:1])


def test_bench_engine_runs_a_cpu_workload_and_reports_correctness(tmp_path, capsys):
    out = tmp_path / "engine.json"
    assert cli.main(["bench", "--engine", "tiny-decode-b4-c64", "--device", "cpu", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert [r["name"] for r in res] == ["tiny-decode-b4-c64"]
    r = res[0]
    assert r["correctness"] == {"tokens_identical": True, "violations": 0}
    assert r["step_with_canary"]["n"] > 0 and r["canary_host_time_in_step"]["median_ms"] > 0
    mem = r["canary_memory_bytes"]
    assert mem["record_bytes_per_slot"] == {"full": 96} and mem["total"] >= mem["canary_buffers"] > 0
    assert r["peak_memory_mib"] is None  # device peaks only on CUDA
    # the profiled run's ranges reach the trace (device time is zero on CPU)
    ranges = r["gpu_time"]["ranges"]
    assert all(ranges[n]["count"] > 0 and ranges[n]["cpu_us"] > 0 for n in bench_suite.RANGES)
    printed = capsys.readouterr().out
    assert "tiny  decode       4      64" in printed and bench_suite.row_of(r)["violations"] == 0
    # the A/B fields: overhead from the same medians, host time split into parts that add up, tokens/s both ways
    ratio = r["step_with_canary"]["median_ms"] / r["step_without_canary"]["median_ms"]
    assert abs(r["overhead_pct"] - 100 * (ratio - 1)) < 1e-9 and r["overhead_pct_paired"] is not None
    parts = r["canary_host_us_by_part"]
    assert parts["runtime"] > 0 and parts["launch"] > 0 and parts["integration"] > 0
    gen = r["generation"]
    assert gen["tokens_per_s_without"] > 0 and gen["tokens_per_s_with"] > 0
    assert {x["canary"] for x in gen["runs"]} == {False, True}
    assert all(x["generated_tokens"] == gen["runs"][0]["generated_tokens"] > 0 for x in gen["runs"])
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import engine_matrix

    row = engine_matrix.table([{"name": "tiny", **r}]).splitlines()[2]
    assert row.startswith("| TINY | decode, batch 4,") and row.endswith("| True, 0 |")
    overhead = row.split(" | ")[2]  # the column right after the workload: the end-to-end overhead
    assert overhead == f"{r['overhead_pct']:+.2f}% / {r['overhead_pct_paired']:+.2f}%"
    # an A/A row (both engines bare) says so, and shows no GPU share of a canary it did not run
    aa = {**r, "workload": {**r["workload"], "a_a": True}, "gpu_time": {"canary_over_forward": 0.03}}
    cells = engine_matrix.table([{"name": "tiny-aa", **aa}]).splitlines()[2].split(" | ")
    assert cells[1].endswith("(A/A: both bare)") and cells[7] == "n/a"
    assert "3.00%" in engine_matrix.table([{"name": "tiny", **r, "gpu_time": {"canary_over_forward": 0.03}}])


def test_bench_engine_rejects_an_unknown_workload(capsys):
    assert cli.main(["bench", "--engine", "no-such-workload", "--device", "cpu"]) == 2
    assert "bench --engine workloads must be among" in capsys.readouterr().err


def test_registry_covers_the_goal_shapes():
    shapes = set(bench_suite.ENGINE_WORKLOADS.values())
    for size in ("1b", "8b"):
        assert {(size, 1, 2048, "decode"), (size, 64, 2048, "decode"), (size, 1, 8192, "decode"),
                (size, 64, 8192, "decode"), (size, 8, 8192, "prefill")} <= shapes


def test_trace_ranges_attribute_kernels_to_the_range_that_launched_them(tmp_path):
    def launch(ts, corr, cat="cuda_runtime"):
        return {"cat": cat, "name": "launch", "ts": ts, "dur": 1, "args": {"correlation": corr}}

    def kernel(ts, corr, dur, cat="kernel"):
        return {"cat": cat, "name": "k", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def rng(name, ts, dur):
        return {"cat": "user_annotation", "name": name, "ts": ts, "dur": dur}

    events = [
        rng("kvcanary_before", 0, 10), launch(2, 1), launch(5, 2, "cuda_driver"),  # Triton: a driver launch
        rng("engine_forward", 10, 100), launch(20, 3), launch(30, 4),
        rng("kvcanary_after", 120, 10), launch(121, 5), launch(140, 6),  # 6: launched after the range
        # kernels run later than their launch, and the GPU-side annotation twin must not count
        kernel(50, 1, 3.0), kernel(60, 2, 4.0, "gpu_memcpy"), kernel(70, 3, 100.0), kernel(200, 4, 50.0),
        kernel(210, 5, 1.0), kernel(220, 6, 1000.0),
        # 5 is a CUDA graph's replay: each of its kernels and copies carries the replay's correlation id
        kernel(211, 5, 1.0), kernel(212, 5, 0.5, "gpu_memcpy"),
        {"cat": "gpu_user_annotation", "name": "kvcanary_before", "ts": 50, "dur": 500},
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    ranges = bench_suite.trace_ranges(str(path))
    assert ranges["kvcanary_before"] == {"device_us": 7.0, "cpu_us": 10, "count": 1}
    assert ranges["engine_forward"]["device_us"] == 150.0
    assert ranges["kvcanary_after"]["device_us"] == 2.5
    g = bench_suite.gpu_time(ranges)
    assert g["canary_device_us"] == 9.5 and g["canary_over_forward"] == 9.5 / 150.0
    # slimming drops the events the split does not read, and the split stays the same
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    trace["traceEvents"] += [{"cat": "cpu_op", "name": "aten::add", "ts": 3, "dur": 1}, {"ph": "M", "name": "meta"}]
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    bench_suite.slim_trace(str(path))
    with gzip.open(path, "rt") as f:
        kept = json.load(f)["traceEvents"]
    assert len(kept) == len(events) - 1 and bench_suite.trace_ranges(str(path)) == ranges


def test_trace_kernels_split_a_range_by_kernel_name(tmp_path):
    def ev(cat, name, ts, dur, corr=None):
        e = {"cat": cat, "name": name, "ts": ts, "dur": dur}
        if corr is not None:
            e["args"] = {"correlation": corr}
        return e

    events = [
        ev("user_annotation", "kvcanary_before", 0, 10), ev("cuda_runtime", "cudaGraphLaunch", 2, 1, 1),
        ev("user_annotation", "kvcanary_before", 100, 10), ev("cuda_driver", "cuLaunchKernel", 101, 1, 2),
        ev("user_annotation", "engine_forward", 20, 50), ev("cuda_runtime", "cudaLaunchKernel", 30, 1, 3),
        # a graph replay (1): three kernels and a copy under one correlation id; a plain launch (2)
        ev("kernel", "_read_table_kernel", 40, 2.0, 1), ev("kernel", "_new_reads_kernel", 43, 3.0, 1),
        ev("kernel", "_read_table_kernel", 47, 2.5, 1), ev("gpu_memcpy", "Memcpy HtoD", 39, 0.5, 1),
        ev("kernel", "_new_reads_kernel", 150, 1.0, 2), ev("kernel", "gemm", 35, 80.0, 3),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    split = bench_suite.trace_kernels(str(path))
    assert split["count"] == 2
    assert split["device_us"] == {"_read_table_kernel": 4.5, "_new_reads_kernel": 4.0, "Memcpy HtoD": 0.5}
    assert list(split["device_us"]) == ["_read_table_kernel", "_new_reads_kernel", "Memcpy HtoD"]  # largest first
    assert bench_suite.trace_kernels(str(path), "engine_forward") == {"count": 1, "device_us": {"gemm": 80.0}}
    assert bench_suite.trace_ranges(str(path))["kvcanary_before"]["device_us"] == 9.0


def test_canary_options_configure_the_canary_over_the_environment(monkeypatch):
    monkeypatch.setenv("KV_CANARY_REAL_KV", "all")
    monkeypatch.setenv("KV_CANARY_SWEEP_INTERVAL", "7")
    cfg = canary_config(["real_kv=none", "check_v=true"])
    assert (cfg.real_kv, cfg.check_v, cfg.sweep_interval) == ("none", True, 7)
    with pytest.raises(ValueError, match="--canary-option must be KEY=VALUE with KEY a CanaryConfig field"):
        canary_config(["realkv=none"])
    with pytest.raises(ValueError, match="got 'check_v'"):
        canary_config(["check_v"])


def test_attach_options_switch_adapter_mechanisms():
    from kvcanary.bench.workload import attach_options

    assert attach_options(["fused_steps=false", "late_hooks=1"]) == {"fused_steps": False, "late_hooks": True}
    assert attach_options(None) == {}
    for bad in (["fused_steps"], ["timing=true"], ["fused_steps=maybe"]):
        with pytest.raises(ValueError, match="--attach-option must be KEY=true\\|false"):
            attach_options(bad)


def test_bench_engine_passes_canary_options_to_every_workload(monkeypatch, capsys):
    commands = []
    def run(cmd, **kw):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "")

    monkeypatch.setattr(bench_suite.subprocess, "run", run)
    out = bench_suite.run_engine("cpu", None, 10, canary_options=["real_kv=all", "check_v=true"])
    assert len(commands) == len(bench_suite.CPU_ENGINE_WORKLOADS) == len(out["results"])
    for cmd in commands:
        assert cmd[-4:] == ["--canary-option", "real_kv=all", "--canary-option", "check_v=true"]
    assert all(r["error"] == "no output" for r in out["results"])  # nothing ran: each row says so
    capsys.readouterr()
    spawned = len(commands)
    assert cli.main(["bench", "--engine", "--device", "cpu", "--canary-option", "real_kv=maybe"]) == 2
    assert "--canary-option real_kv must be one of ('none', 'partial', 'all'), got 'maybe'" in capsys.readouterr().err
    assert len(commands) == spawned  # rejected before any workload process
    bench_suite.run_engine("cpu", ["tiny-decode-b4-c64"], 10, lockstep=True)
    assert commands[-1][-1] == "--lockstep" and "--lockstep" not in commands[0]
    capsys.readouterr()
    assert cli.main(["bench", "--lockstep"]) == 2
    assert "--lockstep applies to --engine runs only" in capsys.readouterr().err


def test_lockstep_pairs_each_canary_step_with_its_twin(tmp_path, capsys):
    from kvcanary.bench import engine

    out = tmp_path / "lock.json"
    rc = engine.main(["--device", "cpu", "--model-size", "tiny", "--batch", "3", "--context", "24", "--steps", "6",
                      "--skip", "1", "--rounds", "2", "--lockstep", "--no-profile", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["workload"]["pairing"] == "steps" and r["workload"]["rounds"] == 2
    assert r["correctness"] == {"tokens_identical": True, "violations": 0} and r["unpaired_steps"] == 0
    # 11 new tokens per request (prefill steps 2 + skip 1 + steps 6 + 2): the prefill samples the first, 10
    # whole-batch decode steps sample the rest, the first skipped: 9 pairs per round, both sides alike
    assert r["step_without_canary"]["n"] == r["step_with_canary"]["n"] == 2 * 9
    parts = r["step_parts_us"]
    assert all(parts[side][k] > 0 for side in ("without", "with") for k in ("prepare", "step", "update"))
    assert len(r["canary_host_time_in_step"]) and r["canary_host_us_by_part"]["total"] > 0
    assert r["generation"]["tokens_per_s_with"] > 0 and r["overhead_pct_paired"] is not None
    assert set(r["gc_ms_in_paired_steps"]) == {"without", "with"}
    capsys.readouterr()


def test_lockstep_summary_pairs_by_step_and_skips_what_does_not_match():
    from kvcanary.bench.lockstep import summarize

    def steps(*rows):  # (batch, tokens, measured, seconds): the three timed parts share it, a tenth collecting
        return [(b, t, m, (s / 2, s / 4, s / 4, s / 10)) for b, t, m, s in rows]

    a = steps((2, 2, True, 1.0), (2, 2, True, 2.0), (2, 2, False, 9.0), (2, 2, True, 4.0), (1, 1, True, 1.0))
    b = steps((2, 2, True, 1.1), (2, 2, True, 2.4), (2, 2, False, 1.0), (2, 9, True, 4.0), (1, 1, True, 1.3))
    out = {"outputs": {"r0": [1, 2, 3]}}
    s = summarize([{"without": {"steps": a, **out}, "with": {"steps": b, **out}}])
    assert s["off"] == [1.0, 2.0, 1.0] and s["on"] == [1.1, 2.4, 1.3]  # the unmeasured step is not timed
    assert s["unpaired"] == 1  # the step whose batches differ
    assert abs(s["paired_pct"] - 20.0) < 1e-9  # ratios 1.1, 1.2, 1.3: median 1.2
    assert s["parts_us"]["with"]["prepare"] == 1e6 * 1.3 / 2  # (halves of 1.1, 2.4, 1.3)
    assert s["gc_ms"] == {"without": 400.0, "with": 480.0}  # a tenth of the paired steps' 4.0 and 4.8 s
    assert abs(s["tokens_per_s"]["without"] - 3 / 17.0) < 1e-12  # every step of a generation counts
    assert s["paired_ci95_pct"] is None  # (three pairs: too few for an interval)
    assert s["unmeasured_extra_ms"] == -8000.0  # the unmeasured step: 1.0 s with against 9.0 s without
    two = summarize([{"without": {"steps": a, **out}, "with": {"steps": b, **out}},
                     {"without": {"steps": b, **out}, "with": {"steps": a, **out}}] * 2)
    assert two["unmeasured_extra_ms"] == 0.0  # the median of -8 s, +8 s, -8 s, +8 s


def test_median_interval_covers_the_median_and_narrows_with_more_draws():
    import random

    from kvcanary.bench.lockstep import median_interval

    rng = random.Random(3)
    assert median_interval([1.0] * 5) is None and median_interval([2.0] * 6) == (2.0, 2.0)
    widths, covered = [], 0
    for n in (30, 300, 3000):
        for _ in range(40):
            xs = [rng.gauss(1.0, 0.1) for _ in range(n)]
            lo, hi = median_interval(xs)
            covered += lo <= 1.0 <= hi  # the true median of the draws' distribution
            assert lo <= sorted(xs)[n // 2] <= hi
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2]
    assert covered >= 0.85 * 120  # about 95% of the intervals hold the true median (120 draws: at least 85%)


def test_engine_matrix_skips_a_workload_its_share_cannot_cover(tmp_path, monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import engine_matrix

    ran = []
    monkeypatch.setattr(engine_matrix.subprocess, "run",
                        lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 1, "", "no output"))
    need = engine_matrix.NEEDS_S["8b-decode-b64-c8k"]
    rows = engine_matrix.run(["8b-decode-b64-c8k"], need - 1, tmp_path, 2, [], tmp_path / "each", 600)
    assert ran == [] and rows[0]["error"].startswith(f"skipped: needs about {need} s for two rounds")
    rows = engine_matrix.run(["8b-decode-b64-c8k"], need + 1, tmp_path, 2, [], tmp_path / "each", 600)
    assert len(ran) == 1 and "--lockstep" not in ran[0]  # (its two caches do not fit one GPU: runs paired)


def test_lockstep_a_a_runs_two_bare_engines(tmp_path, capsys):
    """``--aa``: the second engine stays bare too, so the printed overhead is the method's noise floor."""
    from kvcanary.bench import engine

    out = tmp_path / "aa.json"
    rc = engine.main(["--device", "cpu", "--model-size", "tiny", "--batch", "2", "--context", "16", "--steps", "4",
                      "--skip", "1", "--rounds", "1", "--lockstep", "--aa", "--json", str(out)])
    r = json.loads(out.read_text())
    assert "gpu_time" not in r  # (no profiled canary run: there is no canary to split the GPU time with)
    assert rc == 0 and r["workload"]["a_a"] and r["correctness"] == {"tokens_identical": True, "violations": 0}
    assert r["step_with_canary"]["n"] == r["step_without_canary"]["n"] > 0 and r["overhead_pct_paired"] is not None
    assert r["canary_host_us_by_part"] == {} and r["canary_host_time_in_step"] == {"n": 0}  # no canary ran
    with pytest.raises(SystemExit):
        engine.main(["--device", "cpu", "--aa"])
    assert "--aa applies to --lockstep runs only" in capsys.readouterr().err


def test_warmup_cost_pairs_whole_generations_and_profiles_the_mixed_steps(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import warmup_cost

    from kvcanary.integrations.transformers import session as hf_session
    from kvcanary.runtime.step import fused as hf_fused, graphs as hf_graph
    from kvcanary.runtime import graphs

    hooks = {n: getattr(hf_session.Session, n) for n in ("_before", "_after", "_before_update", "_after_update")}
    captures = {m: m.capture for m in (graphs, hf_graph, hf_fused)}
    try:
        out = tmp_path / "w.json"
        assert warmup_cost.main(["--device", "cpu", "--model-size", "tiny", "--batch", "4", "--context", "40",
                                 "--steps", "4", "--skip", "2", "--rounds", "1", "--show", "3",
                                 "--cprofile-mixed", "2", "--stagger", "1", "--json", str(out)]) == 0
    finally:
        for n, fn in hooks.items():  # (the script wraps the hooks for its profile, and capture to time it)
            setattr(hf_session.Session, n, fn)
        for m, fn in captures.items():
            m.capture = fn
    res = json.loads(out.read_text())
    (r,) = res["rounds"]
    # with --stagger the measured (paired) steps are the shrinking batch's, less --skip
    assert r["paired_steps"] == r["shrinking"]["steps"] - 2 and r["steps"] > r["shrinking"]["steps"]
    assert r["whole_ms_with"] > 0 and r["whole_ms_without"] > 0
    assert r["captures"] == 0  # (the CPU takes no CUDA-graph path)
    # --stagger 1: the last three requests finish one step apart, so the batch shrinks 4 -> 3 -> 2 -> 1
    assert r["shrinking"]["steps"] == 3 and r["shrinking"]["canary_host_ms"] > 0
    err = capsys.readouterr().err
    assert err.count("  step ") == 3 and "canary host" in err
    # (at most the 2 asked for: this tiny generation prefills in one or two chunks)
    assert re.search(r"cProfile over [12] mixed steps", err) and "runner.py" in err


def test_engine_bench_stagger_measures_the_shrinking_batch_steps(tmp_path, capsys):
    from kvcanary.bench import engine

    out = tmp_path / "e.json"
    assert engine.main(["--device", "cpu", "--model-size", "tiny", "--batch", "4", "--context", "40", "--steps", "4",
                        "--skip", "0", "--stagger", "2", "--lockstep", "--rounds", "1", "--no-profile",
                        "--warmup-context", "16", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["workload"]["stagger"] == 2 and r["correctness"] == {"tokens_identical": True, "violations": 0}
    # the last three requests finish two steps apart: batches of 3, 2 and 1 requests, two decode steps each
    assert r["step_with_canary"]["n"] == r["step_without_canary"]["n"] == 6
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import engine_matrix

    row = engine_matrix.table([{"name": "tiny", **r}]).splitlines()[2]
    assert "decode, batch 4, 0K, shrinking by one request every 2 steps" in row
    assert engine_matrix.MATRIX["1b-decode-b16-c2k-shrink2"][4][:6] == ["--steps", "24", "--skip", "0", "--stagger", "2"]


def test_canary_options_reach_fields_set_in_code_only(monkeypatch):
    # reserved_check has no KV_CANARY_* variable: an option routed through the environment was ignored
    monkeypatch.delenv("KV_CANARY_RING_CAPACITY", raising=False)
    cfg = canary_config(["reserved_check=false", "nonfinite_check=off", "ring_capacity=2048"])
    assert (cfg.reserved_check, cfg.nonfinite_check, cfg.ring_capacity) == (False, False, 2048)
    assert canary_config([]).reserved_check is True
    with pytest.raises(ValueError, match="reserved_check must be a boolean"):
        canary_config(["reserved_check=maybe"])
    with pytest.raises(ValueError, match="KEY a CanaryConfig field"):
        canary_config(["no_such_field=1"])
