"""benchmarks/user_cost.py off the GPU: a whole-call smoke run of the tiny model on the CPU, and ``--pool``, which
joins the per-round ratios of several calls (the host drifts between calls: one call's rounds are few)."""

import json

import pytest
from benchmark_script import load


@pytest.fixture(scope="module")
def user_cost():
    return load("user_cost")


def _result(tmp_path, name, model, ratios):
    path = tmp_path / name
    path.write_text(json.dumps({"model_size": model, "workloads": {
        w: {"canary_fast_over_fast": {"values": r}} for w, r in ratios.items()}}))
    return str(path)


def test_pool_joins_the_rounds_of_every_call(user_cost, tmp_path):
    a = _result(tmp_path, "a.json", "1b", {"prefill": [1.0, 0.9, 0.8, 1.1], "serving": [0.97, float("nan")]})
    b = _result(tmp_path, "b.json", "1b", {"prefill": [0.95, 0.85, 0.99, 1.02], "serving": [0.99, 0.98]})
    out = user_cost.pool([a, b])
    assert out["prefill"]["n"] == 8 and out["prefill"]["median"] == pytest.approx(0.97)
    assert out["prefill"]["median_ci95"] == (0.8, 1.1)  # (eight rounds: the interval is the whole range)
    assert out["serving"]["values"] == [0.97, 0.99, 0.98] and out["serving"]["median_ci95"] is None


def test_pool_refuses_mixed_models_and_files_without_rounds(user_cost, tmp_path):
    a = _result(tmp_path, "a.json", "1b", {"prefill": [1.0]})
    b = _result(tmp_path, "b.json", "8b", {"prefill": [1.0]})
    with pytest.raises(ValueError, match="one model size, got \\['1b', '8b'\\]"):
        user_cost.pool([a, b])
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"model_size": "1b", "workloads": {"prefill": {"canary_fast_over_fast": {"median": 1}}}}))
    with pytest.raises(ValueError, match="per-round values of canary_fast_over_fast for workload 'prefill'"):
        user_cost.pool([a, str(old)])


def test_a_cpu_call_times_both_arms_and_keeps_its_rounds(user_cost, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "uc.json"
    assert user_cost.main(["--model-size", "tiny", "--device", "cpu", "--arms", "sync,canary", "--workloads", "batch1",
                           "--rounds", "2", "--json", str(out)]) == 0
    w = json.loads(out.read_text())["workloads"]["batch1"]
    ratio = w["canary_over_sync"]
    assert ratio["n"] == 2 and len(ratio["values"]) == 2 and ratio["median_ci95"] is None
    assert w["tokens_identical_canary_vs_sync"] is True and w["violations"] == 0
