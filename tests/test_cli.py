"""The CLI: every subcommand registered, --help without importing torch, errors as exit codes."""

import json
import subprocess
import sys

import pytest
import torch

from kvcanary import cli


def test_help_lists_every_subcommand_and_does_not_import_torch():
    code = ("import sys; from kvcanary import cli\n"
            "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for name in ("bench", "config", "demo", "fuzz", "recall", "selfcheck", "zoo"):
        assert name in out
    assert out.strip().endswith("False")


def test_selfcheck_json_exit_code(capsys):
    assert cli.main(["selfcheck", "--json"]) == 0
    assert '"ok": true' in capsys.readouterr().out


def test_library_errors_become_exit_code_2(capsys):
    assert cli.main(["selfcheck", "--device", "nonsense"]) == 2
    assert "kvcanary selfcheck: error:" in capsys.readouterr().err


# -- every argument is checked before any work starts; failures are non-zero exit codes ------------------
REJECTED = [
    (["bench", "--providers", "nope"], "--providers must be among ['reference', 'torch', 'numba', 'triton'], got 'nope'"),
    (["bench", "--out", "/nonexistent-folder/x.json"], "--out must be a path in an existing folder"),
    (["bench", "--plot", "/nonexistent-folder/x.png"], "--plot must be a path in an existing folder"),
    (["bench", "--canary-option", "real_kv=all"], "--canary-option applies to --engine runs only"),
    (["bench", "--engine", "--timeout", "-5"], "--timeout must be > 0 seconds, got -5.0"),
    (["bench", "--device", "cuda:7"], "--device must be an available device, got 'cuda:7'"),
    (["recall", "--prob", "0"], "--prob must be in (0, 1], got 0.0"),
    (["recall", "--prob", "1.5"], "--prob must be in (0, 1], got 1.5"),
    (["recall", "--kinds", "table,nope"], "--kinds must be comma-separated kinds among"),
    (["demo", "--device", "cuda:7"], "--device must be an available device, got 'cuda:7'"),
    (["demo", "--device", "tpu"], "--device must be cpu or cuda[:N], got 'tpu'"),
    (["demo", "--model", "/nonexistent-model"], "--model must be a local model directory"),
    (["selfcheck", "--device", "cuda:7"], "--device must be an available device"),
    (["zoo", "--seeds", "0"], "--seeds must be >= 1, got 0"),
    (["zoo", "--bug", "nope"], "zoo bug must be one of"),
]


@pytest.mark.parametrize("argv, message", REJECTED, ids=[" ".join(a) for a, _ in REJECTED])
def test_bad_arguments_fail_before_any_work(argv, message, capsys, monkeypatch):
    if torch.cuda.device_count() > 7 and "cuda:7" in argv:
        pytest.skip("this machine has a cuda:7")
    started = []
    import kvcanary.bench.ops as bench
    import kvcanary.bench.suite as bench_suite
    from kvcanary.sim import zoo

    monkeypatch.setattr(bench, "run", lambda *a, **k: started.append(a))
    monkeypatch.setattr(bench_suite, "run_engine", lambda *a, **k: started.append(a))
    monkeypatch.setattr(zoo, "run_sim", lambda *a, **k: started.append(a))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"kvcanary {argv[0]}: error: kv-canary: {message}" in err
    assert started == []


def test_plot_without_matplotlib_fails_before_the_run(capsys, monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.main(["bench", "--plot", str(tmp_path / "x.png")]) == 2
    assert "--plot needs matplotlib, which is not installed" in capsys.readouterr().err


def test_demo_without_transformers_names_the_extra(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    assert cli.main(["demo"]) == 2
    assert "demo needs transformers, which is not installed; install the extra: pip install " \
           "'kv-canary[transformers]'" in capsys.readouterr().err


def test_bench_exits_non_zero_when_a_workload_failed(capsys, monkeypatch):
    import kvcanary.bench.ops as bench

    monkeypatch.setattr(bench, "run", lambda device, providers, workloads: {
        "meta": {}, "results": [{"workload": name, "error": "RuntimeError: boom"} for name in workloads]})
    assert cli.main(["bench", "--device", "cpu", "--providers", "torch"]) == 1
    assert "workload(s) failed" in capsys.readouterr().err


def test_recall_prints_progress(capsys):
    assert cli.main(["recall", "--configs", "base", "--kinds", "table", "--prob", "0.5"]) == 0
    assert "[1/1] base: 1 runs" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("kvcanary 0.")


def test_config_shows_values_and_their_source(capsys, monkeypatch):
    monkeypatch.setenv("KV_CANARY_MODE", "RAISE")
    monkeypatch.setenv("KV_CANARY_NOT_A_FIELD", "1")
    assert cli.main(["config", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["KV_CANARY_MODE"] == {"value": "raise", "source": "environment"}
    assert out["config"]["KV_CANARY_CHECK_V"] == {"value": False, "source": "default"}
    assert any("KV_CANARY_NOT_A_FIELD" in w for w in out["warnings"])
    monkeypatch.setenv("KV_CANARY_MODE", "bogus")
    assert cli.main(["config"]) == 2
    assert "kv-canary: KV_CANARY_MODE must be one of ('none', 'log', 'raise', 'abort'), got 'bogus'" in capsys.readouterr().err
