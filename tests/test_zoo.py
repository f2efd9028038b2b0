"""The bug zoo: every planted bug is detected in every configuration where it applies."""

from __future__ import annotations

import json

import pytest

from kvcanary.cli import main
from kvcanary.sim import BUGS, MATRIX, SimConfig
from kvcanary.sim.zoo import format_table, plan_runs, run_verdict, run_zoo

CLASSES = set("ABCDEFGHI")


def test_registry_covers_the_bug_classes_and_the_matrix():
    assert len(BUGS) >= 12
    assert {b.cls for b in BUGS.values()} >= {"A", "B", "C", "D", "E", "G", "H", "I"}
    for bug in BUGS.values():
        assert bug.cls in CLASSES and bug.summary and bug.mechanism and bug.expect
        assert any(bug.applies(cfg) for cfg in MATRIX.values()), f"{bug.name} applies to no matrix config"


def test_bugs_apply_only_where_their_mistake_can_happen():
    runs = plan_runs(clean=False)
    where = {(c.bug, c.name) for c in runs}
    assert ("swa_no_translation", "base") not in where and ("swa_no_translation", "swa-chunked") in where
    assert ("page_edge", "base") not in where and ("page_edge", "paged") in where
    assert ("spec_not_moved", "spec") not in where and ("spec_keep_rejected", "spec") in where
    assert ("loadback_partial", "base") not in where and ("loadback_partial", "pressure-offload") in where


def test_unknown_bug_or_config_is_refused():
    with pytest.raises(ValueError, match="bug must be one of"):
        SimConfig(bug="nope")
    with pytest.raises(ValueError, match="zoo bug"):
        plan_runs(["nope"])
    with pytest.raises(ValueError, match="zoo config"):
        plan_runs(configs=["nope"])


@pytest.mark.parametrize("bug", list(BUGS))
def test_bug_is_detected_in_every_config_where_it_applies(bug):
    report = run_zoo([bug], clean=False, stop_after=2)
    verdicts = {r.config: run_verdict(r) for r in report.runs[bug]}
    assert verdicts and set(verdicts.values()) == {"detected"}, verdicts
    for r in report.runs[bug]:
        assert r.first_detected_step >= r.planted_step


@pytest.mark.parametrize("bug", ["double_free", "release_race"])
def test_a_row_handed_out_twice_is_refused_at_the_forward_that_holds_both_owners(bug):
    from kvcanary.sim.engine import run_sim

    cfg = MATRIX["base"].replace(bug=bug)
    r = run_sim(cfg)
    # the canary refuses the forward (SharedRowError) instead of checking it: no "never written" cascade
    assert r.refused and "must be distinct rows" in r.refused and r.violations == 0
    assert r.first_detected_step == r.planted_step and r.reasons == ["shared_req_row"] and run_verdict(r) == "detected"
    clean = run_sim(MATRIX["base"])
    assert clean.refused is None and run_verdict(clean) == "clean"


def test_cli_zoo_json_and_table(capsys):
    assert main(["zoo", "--bug", "wrong_positions", "--config", "base", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and [row["bug"] for row in out["bugs"]] == ["(clean)", "wrong_positions"]
    assert out["bugs"][1]["reasons"] == ["verify_position", "write_position"]
    assert main(["zoo", "--bug", "match_too_long", "--config", "spec"]) == 0
    captured = capsys.readouterr()
    assert "match_too_long" in captured.out and "detected 1/1" in captured.out and "OK: 2 runs" in captured.out
    assert "[2/2] match_too_long @ spec seed 0: detected" in captured.err


def test_cli_zoo_refuses_an_unknown_bug(capsys):
    assert main(["zoo", "--bug", "nope"]) == 2
    assert "zoo bug must be one of" in capsys.readouterr().err


def test_table_marks_a_miss():
    report = run_zoo(["wrong_input_ids"], configs=["base"], clean=False, stop_after=0)
    r = report.runs["wrong_input_ids"][0]
    report.runs["wrong_input_ids"][0] = type(r)(**{**r.to_dict(), "violations": 0})
    assert not report.ok and "MISSED" in format_table(report) and "FAILED" in format_table(report)


@pytest.mark.slow
def test_zoo_three_seeds():
    """The whole zoo with seeds 0, 1, 2: every bug detected in every run, every clean run clean."""
    report = run_zoo(seeds=3)
    assert report.ok, format_table(report)
