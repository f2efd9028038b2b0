"""benchmarks/graph_nodes.py: the calls a captured step replays, counted on the CPU stand-in of a CUDA graph."""

import os

import pytest
from benchmark_script import load as load_script

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the CPU stand-in runs Triton under TRITON_INTERPRET=1")


def load():
    return load_script("graph_nodes")


def test_a_fused_step_replays_a_few_dozen_calls_with_every_check_in_it():
    out = load().measure(max_new_tokens=12)
    assert out["violations"] == 0 and out["fused"] and out["step"]
    for c in out["fused"]:
        # the slot checks are kernels (a launch each; the non-finite check one per float source plus one), not
        # the some 150 tensor ops they were: the whole step stays well under a hundred calls
        assert c["calls"] == c["triton"] + c["aten"] and c["triton"] >= 10 and c["calls"] < 60
