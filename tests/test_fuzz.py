"""kvcanary fuzz: perturbed schedules of clean workloads find nothing; a bug that only some schedules expose is
found with its seeds, and its replay command finds it again; the judge's rules, case by case."""

import json

import pytest

from kvcanary import cli
from kvcanary.fuzz import campaign, run_fuzz
from kvcanary.fuzz.hf_fuzz import ArrivalSchedule, hf_schedules
from kvcanary.fuzz.judge import Run, judge
from kvcanary.fuzz.sim_fuzz import run_sim_schedule, sim_schedules
from kvcanary.soak.sim_workload import make_sim_config

transformers_installed = pytest.mark.skipif(
    __import__("importlib").util.find_spec("transformers") is None, reason="needs the transformers extra")

# A sim workload whose reference schedule runs double_free's mistake harmlessly, and perturbations that expose
# it (kvcanary fuzz --engine sim --workloads 16 --perturbations 6 --bug double_free lists such workloads).
SIM_BUG, SIM_SEED = "double_free", 3
# The same for transformers: an idle cached block whose flip only some schedules leave in the cache to sweep.
HF_BUG, HF_SEED = "flip-idle-cache", 0


# -- perturbations: seeded, varied, and they leave the workload alone -------------------------------------
def test_perturbations_are_fixed_per_seed_and_differ():
    sim = sim_schedules(5, [1, 2, 3, 4, 5, 6])
    assert sim == sim_schedules(5, [1, 2, 3, 4, 5, 6])
    assert len({str(p) for p in sim}) == 6 and [p.seed for p in sim] == [1, 2, 3, 4, 5, 6]
    hf = hf_schedules(5, [1, 2, 3, 4])
    assert hf == hf_schedules(5, [1, 2, 3, 4]) and len({str(p) for p in hf}) == 4
    # every knob moves somewhere in a few draws
    many = sim_schedules(0, list(range(1, 40)))
    assert {p.arrival_mode for p in many} == {"kept", "shifted", "shuffled", "burst"}
    assert any(p.preempt_steps for p in many) and {p.max_running for p in many} >= {1, 8}
    draws = [p for s in range(6) for p in hf_schedules(s, list(range(1, 8)))]
    assert {p.scheduler for p in draws} == {"fifo", "prefill_first"}
    assert any(p.order != tuple(sorted(p.order)) for p in draws) and any(max(p.arrival) > 0 for p in draws)
    assert any(p.max_requests_per_batch == 1 for p in draws) and any(p.offload_blocks for p in draws)


def test_a_perturbed_sim_run_feeds_the_same_requests():
    ref = run_sim_schedule(2, None)
    runs = (run_sim_schedule(2, p) for p in sim_schedules(2, list(range(1, 30))) if p.arrivals and p.preempt_steps)
    run = next(r for r in runs if r.events["forced_preemptions"] > 0)  # (one at a step two requests decode)
    assert run.params["arrivals"] and run.params["num_slots"]
    shared = set(ref.tokens) & set(run.tokens)
    assert shared and all(ref.tokens[k] == run.tokens[k] for k in shared)
    assert not run.failed and judge(ref, run).findings == []


# -- the judge ---------------------------------------------------------------------------------------------
REF = Run(0, tokens={"a": [1, 2, 3], "b": [4, 5]})


@pytest.mark.parametrize("run, findings, benign", [
    (Run(1, tokens={"a": [1, 2, 3], "b": [4, 5]}), [], []),
    (Run(1, tokens={"a": [1, 9, 3], "b": [4, 5]}), ["tokens: 1 requests differ from the reference (first at a@1)"],
     []),
    (Run(1, tokens={"a": [1, 2], "b": [4, 5]}), ["tokens: 1 requests differ from the reference (first at a@2)"], []),
    (Run(1, tokens={"a": [1, 7, 3], "b": [4, 5]}), [], ["a@1 (margin 1.0e-06)"]),
    (Run(1, tokens={"a": [1, 2, 3]}, failed={"b": "boom"}),
     ["failed requests the reference completes: 1 (b: boom)"], []),
    (Run(1, tokens={"a": [1, 2, 3]}), ["requests without an output: 1 (b)"], []),
    (Run(1, tokens={"a": [1, 2, 3]}, aborted=["b"]), [], []),
    (Run(1, tokens={"a": [1, 2, 3], "b": [4, 5]}, violations=3, problems=["health: x"]), ["violations: 3", "health: x"],
     []),
    (Run(1, error="RuntimeError: no blocks"), ["error: RuntimeError: no blocks (the reference ran to the end)"], []),
], ids=["same", "token", "shorter", "near-tie", "new-failure", "missing", "aborted", "violations", "error"])
def test_judge(run, findings, benign):
    # the near-tie oracle calls token 7 after "1" a tie with 2, and nothing else
    tie = lambda key, i, want, got: 1e-6 if (want, got) == (2, 7) else None  # noqa: E731
    v = judge(REF, run, tie)
    assert (v.findings, v.benign, v.engine_failure) == (findings, benign, None)


def test_an_error_the_reference_has_too_is_an_engine_failure():
    ref = Run(0, error="ValueError: x")
    assert judge(ref, ref).engine_failure == "ValueError: x" and judge(ref, ref).findings == []
    v = judge(ref, Run(2, error="ValueError: x", violations=1))
    assert v.findings == ["violations: 1"] and v.engine_failure == "ValueError: x"


# -- sim: clean schedules find nothing; a schedule-dependent bug is found and replays -----------------------
def test_sim_clean_campaign_has_no_finding():
    s = run_fuzz("sim", workloads=6, perturbations=4, seed=0)
    assert s["findings"] == [], s["findings"]
    assert s["ok"] and s["violations"] == 0 and s["runs"] == 30 and s["engine_failures"] == []
    # the schedules did differ: forced and memory-pressure preemptions, prefix hits
    assert s["events"]["forced_preemptions"]["runs"] > 0 and s["events"]["cache_hit_tokens"]["total"] > 0


def test_sim_bug_only_some_schedules_expose_is_found_and_replays(tmp_path, capsys):
    s = run_fuzz("sim", workloads=1, perturbations=4, seed=SIM_SEED, bug=SIM_BUG)
    found = {f["perturbation_seed"]: f for f in s["findings"]}
    assert not s["ok"] and found and 0 not in found  # the reference schedule does not show it
    p, f = min(found.items())
    assert f["workload_seed"] == SIM_SEED and f["features"] == make_sim_config(SIM_SEED)[2]
    assert f["replay"] == f"kvcanary fuzz --engine sim --replay {SIM_SEED}:{p} --bug {SIM_BUG}"
    # the replay command finds it again, alone
    path = tmp_path / "replay.json"
    argv = f["replay"].split()[1:] + ["--json", str(path)]
    assert cli.main(argv) == 1
    r = json.loads(path.read_text())
    assert r["runs"] == 2 and [(x["workload_seed"], x["perturbation_seed"], x["findings"]) for x in r["findings"]] \
        == [(SIM_SEED, p, f["findings"])]
    assert f"FINDING workload {SIM_SEED} perturbation {p}" in capsys.readouterr().out
    # its clean twin: the same schedule without the bug finds nothing
    assert run_fuzz("sim", replay=(SIM_SEED, p))["ok"]


# -- transformers: a clean tiny run, and a planted bug ------------------------------------------------------
@transformers_installed
def test_transformers_clean_runs_have_no_finding():
    from transformers import __version__

    from kvcanary.integrations.transformers.layout import parse_version

    s = run_fuzz("transformers", workloads=2, perturbations=2, seed=0)
    if parse_version(__version__) < (5, 18):
        # transformers 5.17's own bug, which these schedules meet: a forked request (parallel sampling) whose whole
        # prompt is cached blocks keeps one token to prefill, and the scheduler's fork rule then gives it a budget
        # of 0 tokens: a forward of none fails it. The engine fails alike without the canary; nothing is reported.
        assert s["findings"] and s["engine_own_failures"] == len(s["findings"]), s["findings"]
        assert all("cannot reshape tensor of 0 elements" in f["findings"][0] for f in s["findings"]), s["findings"]
        assert s["violations"] == 0 and s["token_mismatches"] == 0 and s["runs"] == 6
        return
    assert s["findings"] == [], s["findings"]
    assert s["ok"] and s["violations"] == 0 and s["token_mismatches"] == 0 and s["runs"] == 6


@transformers_installed
def test_transformers_bug_only_a_perturbed_schedule_exposes_is_found():
    s = run_fuzz("transformers", workloads=1, perturbations=1, seed=HF_SEED, bug=HF_BUG)
    assert [(f["workload_seed"], f["perturbation_seed"]) for f in s["findings"]] == [(HF_SEED, 1)]
    f = s["findings"][0]
    assert f["findings"][0].startswith("violations: ") and f["first_violations"]
    assert f["schedule"] == hf_schedules(HF_SEED, [1])[0].to_dict() | {"model": "llama", "block_size": 4}
    assert f["replay"] == f"kvcanary fuzz --engine transformers --replay {HF_SEED}:1 --bug {HF_BUG}"


@transformers_installed
def test_near_tie_is_the_logit_margin_below_the_tolerance():
    from kvcanary.fuzz import hf_fuzz
    from kvcanary.soak.hf_run import tiny_model

    w = hf_fuzz.fuzz_workload(3)
    model = tiny_model(w.model, "cpu")
    ref = Run(0, tokens={"req_1": [5, 6, 7]})
    margin = hf_fuzz.near_tie(model, w, ref)
    assert margin("req_1", 2, 11, 11) == 0.0  # a token against itself: a tie
    import torch

    logits = hf_fuzz.plain_logits(model, torch.tensor([list(w.prompts[1]) + [5, 6]]))[0, -1]
    top, bottom = int(logits.argmax()), int(logits.argmin())
    assert margin("req_1", 2, top, bottom) is None  # far apart: a real divergence


# -- the arrival schedule shim ------------------------------------------------------------------------------
class _Scheduler:
    def __init__(self):
        self.waiting = []

    def add_waiting_request(self, state):
        self.waiting.append(state.request_id)

    def has_pending_requests(self):
        return bool(self.waiting)


class _State:
    def __init__(self, rid):
        self.request_id = rid


class _Processor:
    """What ArrivalSchedule reaches of a batch processor: a queue drained into the scheduler each step."""

    def __init__(self):
        self.scheduler, self.queue, self.forwards = _Scheduler(), [], 0

    def _update_tp_group_state(self):
        for state in self.queue:
            self.scheduler.add_waiting_request(state)
        self.queue = []
        return False

    def update_batch(self):
        self.forwards += 1


def test_arrival_schedule_hands_requests_over_in_order_at_their_steps():
    bp = _Processor()
    ArrivalSchedule(order=(2, 0, 1), arrival=(2, 0, 0))(bp)
    bp.queue = [_State("req_0"), _State("req_1")]
    bp._update_tp_group_state()
    assert bp.scheduler.waiting == []  # held until every request is queued
    bp.queue = [_State("req_2"), _State("req_0__child#0")]
    bp._update_tp_group_state()
    assert bp.scheduler.waiting == ["req_0__child#0", "req_2", "req_1"]  # forks pass; then order at step 0
    bp.update_batch()
    bp._update_tp_group_state()
    assert "req_0" not in bp.scheduler.waiting  # one forward run: req_0 arrives at 2
    bp.update_batch()
    bp._update_tp_group_state()
    assert bp.scheduler.waiting[-1] == "req_0"
    bp.scheduler.add_waiting_request(_State("req_0"))  # re-queued after a preemption: straight through
    assert bp.scheduler.waiting[-2:] == ["req_0", "req_0"]


def test_arrival_schedule_does_not_idle_when_nothing_is_left_to_run():
    bp = _Processor()
    ArrivalSchedule(order=(0, 1), arrival=(3, 5))(bp)
    bp.queue = [_State("req_0"), _State("req_1")]
    bp._update_tp_group_state()
    assert bp.scheduler.waiting == ["req_0"]  # the earliest arrival, at once
    bp._update_tp_group_state()
    assert bp.scheduler.waiting == ["req_0"]  # still pending: req_1 waits for its step


# -- the command line and the library refuse bad input before any work ----------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--workloads", "0"], "--workloads must be >= 1, got 0"),
    (["--perturbations", "0"], "--perturbations must be >= 1, got 0"),
    (["--seed", "-2"], "--seed must be >= 0, got -2"),
    (["--replay", "3"], "--replay must be WORKLOAD_SEED:PERTURBATION_SEED (e.g. 3:1), got '3'"),
    (["--bug", "nope"], "fuzz bug for engine 'sim' must be one of"),
    (["--json", "/nonexistent-folder/x.json"], "--json must be a path in an existing folder"),
], ids=["workloads", "perturbations", "seed", "replay", "bug", "json"])
def test_bad_arguments_fail_before_any_work(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(campaign, "run_workload", lambda *a, **k: pytest.fail("a workload ran"))
    assert cli.main(["fuzz", *argv]) == 2
    assert message in capsys.readouterr().err


def test_library_arguments_are_checked():
    with pytest.raises(ValueError, match="kv-canary: fuzz engine must be one of"):
        run_fuzz("vllm")
    with pytest.raises(ValueError, match="kv-canary: fuzz perturbations must be an int >= 1, got 0"):
        run_fuzz("sim", perturbations=0)
    with pytest.raises(ValueError, match=r"kv-canary: fuzz replay must be a \(workload seed, perturbation seed\)"):
        run_fuzz("sim", replay=3)

