"""The pytest plugin: tests of an engine with a planted bug fail with the report; clean twins pass."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent

try:
    # The in-process runs below drop every module they imported afterwards (pytester restores sys.modules);
    # numba registers types globally when it first loads these lazily, and a second load raises "duplicate
    # registration". Loaded here, before any run, they stay.
    from numba.core.registry import cpu_target

    cpu_target.target_context.refresh()  # (imports every registry numba loads lazily)
except ImportError:
    pass


def run(pytester: pytest.Pytester, source: str) -> pytest.RunResult:
    pytester.makepyfile(test_engine=source)
    installed = any(ep.name == "kvcanary" for ep in importlib.metadata.entry_points(group="pytest11"))
    # Installed, the entry point loads the plugin; from a checkout, load it by name.
    args = [] if installed else ["-p", "kvcanary.pytest_plugin"]
    return pytester.runpytest(*args, "-p", "no:cacheprovider", "-q")


TOY = '''
import pytest
import torch
from toy_engine import ToyEngine
from kvcanary import PoolSpec, RealKvSource


def prefill_and_share(e, plant):
    e.add(1, [11, 12, 13, 14])
    e.forward([(1, 4)])
    e.add(2, [21, 22], share_from=1, shared=2)
    if plant:
        e.rtt[e.reqs[2]["row"], 1] = e.slot(1, 3)  # a stale table entry
    e.forward([(2, 1)])
'''


def test_watched_engine_canary_fails_on_planted_bug_and_passes_clean(pytester):
    result = run(pytester, TOY + '''
@pytest.mark.parametrize("plant", [False, True], ids=["clean", "planted"])
def test_raise_mode(kv_canary, plant):
    e = ToyEngine(mode="raise")
    kv_canary.watch(e.canary)
    prefill_and_share(e, plant)


@pytest.mark.parametrize("plant", [False, True], ids=["clean", "planted"])
def test_engine_swallows_the_error(kv_canary, plant):
    e = ToyEngine(mode="raise")
    kv_canary.watch(e.canary)
    try:
        prefill_and_share(e, plant)
    except Exception:
        pass  # an engine's catch-all must not hide the violation


def test_log_mode_canary_is_checked_at_the_end(kv_canary):
    e = ToyEngine(mode="log")
    kv_canary.watch(e.canary)
    prefill_and_share(e, True)
''')
    result.assert_outcomes(passed=2, failed=3)
    out = result.stdout.str()
    for name in ("test_raise_mode[planted]", "test_engine_swallows_the_error[planted]",
                 "test_log_mode_canary_is_checked_at_the_end"):
        assert f"FAILED test_engine.py::{name}" in out
    assert "KV-cache violation(s) during the test" in out
    assert "(HEAD_K_FULL): verify_chain_hash" in out
    assert "-> two requests own this slot" in out


def test_factory_and_context_manager(pytester):
    result = run(pytester, TOY + '''
def make(kv_canary):
    k = torch.zeros(64, 1, 8)
    pool = PoolSpec(64, (RealKvSource(k, page_size=1, num_bytes_per_token=32, read_bytes=32),))
    return k, kv_canary(pool, max_batch=4, max_tokens=64, max_context=32, num_rows=8)


@pytest.mark.parametrize("flip", [False, True], ids=["clean", "flipped"])
def test_factory(kv_canary, flip):
    e = ToyEngine()
    e.k, e.canary = make(kv_canary)
    assert e.canary.config.mode == "raise"
    e.add(1, [11, 12, 13])
    e.forward([(1, 3)])
    if flip:
        e.k[e.slot(1, 0), 0, 0] += 1.0  # a KV byte changes after it was written
    e.forward([(1, 1)])


def test_watching_block(kv_canary):
    e = ToyEngine(mode="log")
    with kv_canary.watching(e.canary):
        prefill_and_share(e, True)
    raise AssertionError("not reached: the block's end fails the test")
''')
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    assert "verify_real_kv_hash" in out and "not reached" not in out


def test_entry_point_declared_in_pyproject():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["pytest11"] == {"kvcanary": "kvcanary.pytest_plugin"}


def test_transformers_attach_fails_on_planted_bug_and_passes_clean(pytester):
    pytest.importorskip("transformers")
    result = run(pytester, '''
import pytest
from kvcanary.demo import build_tiny_model, run_workload
from kvcanary.sim import hf_bugs


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("cpu")


@pytest.mark.parametrize("bug", [None, "flip-kv"], ids=["clean", "flip-kv"])
def test_generate(kv_canary, model, bug):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    undo = hf_bugs.plant(model, bug) if bug else None
    try:
        kv_canary.attach(model)
        cbc = ContinuousBatchingConfig(block_size=16, num_blocks=32, max_batch_tokens=16, use_cuda_graph=False)
        model.generate_batch([[5, 6, 7, 8, 9] * 4, [3, 4] * 9], continuous_batching_config=cbc,
                             generation_config=GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1))
    finally:
        if undo is not None:
            undo()
''')
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "FAILED test_engine.py::test_generate[flip-kv]" in out
    assert "verify_real_kv_hash" in out and "KV-cache violation(s) during the test" in out
