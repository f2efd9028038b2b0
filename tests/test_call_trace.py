"""benchmarks/call_trace.py's accounting off the GPU: the GPU's busy time (a union of intervals, overlaps counted
once) and the work the canary adds under the engine's own kernel names (copies, fills: more launches of a name
that the call without the canary ran too)."""

import pytest
from benchmark_script import load


@pytest.fixture(scope="module")
def call_trace():
    return load("call_trace")


def test_busy_time_counts_overlapping_intervals_once(call_trace):
    # (microseconds in, milliseconds out: [0, 3000] and [2000, 5000] overlap, [7000, 8000] stands apart)
    assert call_trace.busy_ms([(7000, 8000), (0, 3000), (2000, 5000), (1000, 1500)]) == pytest.approx(6.0)
    assert call_trace.busy_ms([]) == 0.0


def test_added_kernels_are_shared_names_launched_more_often(call_trace):
    engine = {"copy": [10, 50.0], "gemm": [100, 900.0], "fill": [4, 8.0]}
    canary = {"copy": [16, 62.0], "gemm": [100, 905.0], "fill": [3, 6.0], "_verify_kernel": [3, 9.0]}
    more = call_trace.added_kernels(engine, canary)
    # the canary's own kernel (a name the engine never ran) is counted elsewhere; equal or fewer launches: not added
    assert more == {"copy": (6, 12.0)}
