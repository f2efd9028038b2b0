"""kvcanary soak: seeded clean campaigns report nothing, a planted bug is a finding, workloads are fixed per seed."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from kvcanary import cli
from kvcanary.soak import campaign
from kvcanary.soak.hf_workload import BLOCK_SIZES, FEATURES, HfWorkload, make_hf_workload
from kvcanary.soak.sim_workload import PAGE_SIZES, make_sim_config

transformers_installed = pytest.mark.skipif(
    __import__("importlib").util.find_spec("transformers") is None, reason="needs the transformers extra")

# The CI slice: the first workloads of seed 0, which draw every feature (test_slices_cover_every_feature).
HF_SLICE, SIM_SLICE = 20, 50
SIM_FEATURES = {"sliding-window", "speculative", "chunked-prefill", "offload", "pressure", "backend-torch",
                "backend-numba"} | {f"page-size-{p}" for p in PAGE_SIZES}


# -- the generators: a seed names one workload ------------------------------------------------------------
def _drawn(first: int, n: int) -> str:
    return json.dumps([[make_hf_workload(s).to_dict() for s in range(first, first + n)],
                       [[str(make_sim_config(s)[0]), make_sim_config(s)[1:]] for s in range(first, first + n)]])


def test_generators_are_deterministic_per_seed():
    here = _drawn(0, 40)
    assert here == _drawn(0, 40)
    # another process with another hash seed draws the same workloads
    code = "import sys; sys.path.insert(0, 'tests'); from test_soak import _drawn; print(_drawn(0, 40))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.strip()
    assert out == here
    # and the seeds differ from each other
    assert len({json.dumps(make_hf_workload(s).to_dict()["prompts"]) for s in range(40)}) == 40
    assert len({str(make_sim_config(s)[0]) for s in range(40)}) == 40


def test_slices_cover_every_feature():
    hf = {f for s in range(HF_SLICE) for f in make_hf_workload(s).features}
    assert set(FEATURES) | {f"block-size-{b}" for b in BLOCK_SIZES} <= hf
    sim = {f for s in range(SIM_SLICE) for f in make_sim_config(s)[2]}
    assert SIM_FEATURES <= sim and any(f.startswith("matrix-") for f in sim)


def test_drawn_workloads_are_well_formed():
    for s in range(200):
        w = make_hf_workload(s)
        assert 4 <= w.block_size <= 64 and w.max_batch_tokens >= 4 and all(w.prompts)
        assert all(0 < t < 512 for p in w.prompts for t in p)
        if "exact-cached-prefix" in w.features:
            # a later prompt is exactly whole blocks of the first one
            heads = [p for p in w.prompts[1:] if len(p) % w.block_size == 0 and w.prompts[0][:len(p)] == p]
            assert heads, s
        assert ("sliding-window" in w.features) == (w.model == "hybrid")
        assert not (w.offload_blocks and w.model == "hybrid")


def test_mla_takes_only_the_model_of_some_full_attention_workloads():
    """mla=True (transformers 5.25+) swaps Llama for the MLA model in some workloads (CPU offload among them)
    and changes nothing else of any seed."""
    swapped = []
    for s in range(200):
        plain, w = make_hf_workload(s), make_hf_workload(s, mla=True)
        assert ("mla" in w.features) == (w.model == "mla")
        if w.model == "mla":
            swapped.append(s)
            assert plain.model == "llama"
        assert {**w.to_dict(), "model": None, "features": [f for f in w.features if f != "mla"]} == \
            {**plain.to_dict(), "model": None}
    assert 20 < len(swapped) < 100, len(swapped)
    assert any(s < HF_SLICE for s in swapped)  # the CI slice runs some (where transformers pages latents)
    assert any(make_hf_workload(s).offload_blocks for s in swapped)


# -- the CI slice: clean campaigns find nothing ---------------------------------------------------------
@transformers_installed
def test_transformers_slice_is_clean():
    s = campaign.run_campaign("transformers", HF_SLICE, seed=0)
    assert s["findings"] == [], s["findings"]
    assert s["ok"] and s["violations"] == 0 and s["token_mismatches"] == 0 and s["errors"] == 0
    assert s["workloads"] == HF_SLICE and s["greedy_workloads_compared"] >= HF_SLICE // 3
    # what the features were drawn for happened in the engine
    for event in ("prefix_hits", "fork_block_copies", "soft_resets", "offloaded_requests", "restored_requests",
                  "sweeps"):
        assert s["events"][event]["workloads"] > 0, event
    # and the allocator check ran in every workload (docs/allocator.md), where the engine has a block pool: transformers
    # 5.17 refuses it, and its workloads run without
    from kvcanary.integrations.transformers.reach import has_block_pool

    assert s["events"]["allocator_checks"]["workloads"] == (HF_SLICE if has_block_pool() else 0)
    # and where transformers pages MLA latents, some ran the MLA model, clean like the rest
    from kvcanary.integrations.transformers.reach import has_mla_paging

    assert (s["features"].get("mla", 0) > 0) == has_mla_paging()


def test_sim_slice_is_clean():
    s = campaign.run_campaign("sim", SIM_SLICE, seed=0)
    assert s["findings"] == [], s["findings"]
    assert s["ok"] and s["violations"] == 0 and s["workloads"] == SIM_SLICE
    assert s["events"]["retractions"]["workloads"] > 0 and s["events"]["offloads"]["workloads"] > 0
    assert s["events"]["cache_hit_tokens"]["total"] > 0


@transformers_installed
def test_exact_cached_prefix_prompt_is_not_a_false_alarm():
    """A prompt that is exactly an earlier request's whole-block system prompt: the engine matches all of it
    and computes its last token again into the shared block while the other request reads that slot (the
    same token, position and chain; KV bytes equal up to rounding). Clean: no violation. (The known false
    alarm: one verify_real_kv_hash per run before ops.accept_rewrites, ce1d61c.)"""
    from kvcanary.soak.hf_run import run_hf_workload

    system = tuple((37 * i + 11) % 512 for i in range(8))
    first = system + (1, 2, 3, 4)
    w = HfWorkload(seed=0, model="llama", block_size=4, num_blocks=32, max_batch_tokens=len(first),
                   max_requests_per_batch=8, prompts=(first, system), max_new_tokens=4, num_return_sequences=1,
                   sampling="greedy", offload_blocks=0, canary_options=(("sweep_interval", 4),),
                   features=("exact-cached-prefix", "greedy"))
    out = run_hf_workload(w)
    assert out.events["prefix_hits"] > 0  # the whole system prompt came from the cache
    assert out.findings == [] and out.violations == 0 and out.tokens_match, out.first_violations


class _Handle:  # what run_hf_workload reads of a TransformersHandle
    violations: list = []

    def stats(self):
        return {"violations": 0, "prefix_hits": 1}


@pytest.mark.parametrize("with_canary, finding", [(["req_1: boom"], False), (["req_1: other"], True), ([], True)],
                         ids=["alike", "another-error", "only-without"])
def test_failed_requests_alike_in_both_runs_are_engine_failures(monkeypatch, with_canary, finding):
    """A request the engine fails on its own, alike with and without the canary, is listed apart; a failure
    that differs between the runs is the canary's business: a finding."""
    from kvcanary.soak import hf_run

    def generate(model, w, device, canary, bug, **kwargs):
        return {"req_0": [1, 2]}, (with_canary if canary else ["req_1: boom"]), _Handle()

    monkeypatch.setattr(hf_run, "generate", generate)
    monkeypatch.setattr(hf_run, "tiny_model", lambda kind, device: None)
    out = hf_run.run_hf_workload(make_hf_workload(3))
    assert bool(out.findings) == finding and bool(out.engine_failures) == (not finding)
    s = campaign.summarize("transformers", 3, [out], 1.0)
    assert s["ok"] == (not finding) and len(s["engine_failures"]) == (not finding)
    assert "engine failures alike without the canary" in campaign.format_summary(s)


# -- a campaign can fail ----------------------------------------------------------------------------------
@transformers_installed
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine's own KeyError
def test_a_planted_transformers_bug_is_a_finding():
    s = campaign.run_campaign("transformers", 2, seed=0, bug="early-free")
    assert not s["ok"] and s["violations"] > 0
    f = s["findings"][0]
    assert f["seed"] in (0, 1) and f["features"] == list(make_hf_workload(f["seed"]).features)
    assert f["replay"] == f"kvcanary soak --engine transformers --replay {f['seed']} --bug early-free"
    assert any("violations" in x for x in f["findings"]) and f["first_violations"]


def test_a_planted_sim_bug_is_a_finding_and_a_non_zero_exit(tmp_path, capsys):
    path = tmp_path / "soak.json"
    assert cli.main(["soak", "--engine", "sim", "--workloads", "2", "--seed", "3", "--bug", "wrong_input_ids",
                     "--json", str(path)]) == 1
    s = json.loads(path.read_text())
    assert not s["ok"] and s["planted_bug"] == "wrong_input_ids" and {f["seed"] for f in s["findings"]} == {3, 4}
    assert "FAILED: 2 workloads with findings" in capsys.readouterr().out


def test_replay_runs_one_seed_and_says_what_it_is(tmp_path, capsys):
    path = tmp_path / "replay.json"
    assert cli.main(["soak", "--engine", "sim", "--replay", "7", "--json", str(path)]) == 0
    s = json.loads(path.read_text())
    assert s["workloads"] == 1 and s["seed"] == 7 and s["workload"]["seed"] == 7
    assert s["workload"]["features"] == make_sim_config(7)[2]
    assert "[" in capsys.readouterr().err  # the progress bar


@pytest.mark.parametrize("argv, message", [
    (["--workloads", "0"], "--workloads must be >= 1, got 0"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--engine", "sim", "--bug", "nope"], "soak bug for engine 'sim' must be one of"),
    (["--engine", "sim", "--json", "/nonexistent-folder/x.json"], "--json must be a path in an existing folder"),
], ids=["workloads", "seed", "bug", "json"])
def test_bad_arguments_fail_before_any_work(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(campaign, "run_one", lambda *a, **k: pytest.fail("a workload ran"))
    assert cli.main(["soak", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(getattr(importlib.util.find_spec("vllm"), "origin", None) is not None,
                    reason="vLLM is installed here")
def test_a_vllm_soak_without_vllm_says_where_to_run_it(capsys, monkeypatch):
    monkeypatch.setattr(campaign, "run_one", lambda *a, **k: pytest.fail("a workload ran"))
    assert cli.main(["soak", "--engine", "vllm", "--workloads", "1"]) == 2
    assert "needs vLLM, which is not installed in this environment" in capsys.readouterr().err
    with pytest.raises(ValueError, match="soak bug for engine 'vllm' must be one of"):
        campaign.check_bug("vllm", "nope")


def test_library_arguments_are_checked():
    with pytest.raises(ValueError, match="kv-canary: soak engine must be one of"):
        campaign.run_campaign("sglang", 1)
    with pytest.raises(ValueError, match="kv-canary: soak workloads must be an int >= 1, got 0"):
        campaign.run_campaign("sim", 0)
