"""numba's first compile says so: a module's kernels are cold until their first call fills numba's disk cache,
and the notice is printed once per process, only while they are cold."""

import importlib
import sys

import pytest

pytest.importorskip("numba")

from kvcanary.ops import numba_cache  # noqa: E402

SOURCE = "import numba\n\n\n@numba.njit(cache=True)\ndef twice(x):\n    return 2 * x\n"


@pytest.fixture
def kernel_module(tmp_path, monkeypatch):
    (tmp_path / "cold_kernels.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cold_kernels", raising=False)
    return importlib.import_module("cold_kernels")


def test_kernels_are_cold_until_their_first_call_is_cached(kernel_module, monkeypatch, capsys):
    ns = vars(kernel_module)
    assert numba_cache.cold(ns)
    monkeypatch.setattr(numba_cache, "_announced", False)
    numba_cache.announce(ns)
    numba_cache.announce(ns)
    assert capsys.readouterr().err == numba_cache.NOTICE + "\n"  # (once)
    assert kernel_module.twice(21) == 42
    assert not numba_cache.cold(ns)
    monkeypatch.setattr(numba_cache, "_announced", False)
    numba_cache.announce(ns)
    assert capsys.readouterr().err == ""  # warm: nothing to say


def test_a_module_without_kernels_is_never_cold():
    assert not numba_cache.cold({"__name__": "empty"})


def test_the_demo_s_timing_line_explains_a_first_compile():
    from kvcanary.demo import format_demo

    clean = dict(requests=1, forwards=2, tokens_protected=3, entries_verified=4, sweeps=0, prefix_hits=0,
                 dedup_remaps=0, fork_block_copies=0, violations=0, tokens_match_without_canary=True, seconds=44.0,
                 baseline_seconds=3.0)
    result = dict(model="m", device="cpu", clean=clean, bug=dict(name="b", **{"class": "A"}, what="w", violations=1,
                                                                  report=[], log_lines=[]))
    lines = format_demo({**result, "numba_compiled": True}).splitlines()
    at = next(i for i, x in enumerate(lines) if "44.0 s with, 3.0 s without" in x)
    assert "numba compiling its kernels, once" in lines[at + 1]
    assert "numba" not in format_demo({**result, "numba_compiled": False})
