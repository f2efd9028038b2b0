"""Would a compiled steady host half pay? The adapter's steady decode step reads each request's offset and
newest token in Python (``TokenRows._steady``, ``kvcanary/integrations/hf_tokens.py``); this times that
per-request work as Python (the same operations, on stand-in request states) against the same work through
the CPython API (``steady.c``, built here with the system's C compiler), with the host's caches warm and
flushed before each step (a sum over a 3M-element list, as ``benchmarks/graph_launch.py`` does), at batch 1
and 64. An experiment for the next lever, not a part of the package:

    python benchmarks/steady_capi/bench.py
"""

import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from array import array
from operator import add, attrgetter, getitem, sub

import numpy as np

STEADY_C = None  # the compiled module (build)


def build():
    """Compile steady.c into a temporary folder and import it."""
    out = tempfile.mkdtemp(prefix="steady_c_")
    so = os.path.join(out, "steady_c" + sysconfig.get_config_var("EXT_SUFFIX"))
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-I" + sysconfig.get_paths()["include"],
                    os.path.join(here, "steady.c"), "-o", so], check=True)
    sys.path.insert(0, out)
    import steady_c
    return steady_c


STATE_OFFSET, _S_GENERATED = attrgetter("position_offset"), attrgetter("generated_tokens")


class State:
    """A stand-in for a transformers request state: the fields the steady step reads, and a few others."""

    def __init__(self, i):
        self.request_id, self.initial_tokens, self.generated_tokens = f"r{i}", list(range(100)), [7] * 5
        self.position_offset, self.status, self.other, self.x = 105, 1, {}, i


class St:
    """The kept values of a steady run (``_Steady`` in hf_tokens.py)."""


def make(bs):
    states = [State(i) for i in range(bs)]
    st = St()
    st.need, st.ones, st.at = [s.position_offset for s in states], [1] * bs, [5] * bs
    st.prefix, st.ends, st.width, st.total = st.need, array("q", st.need), 0, 0
    st.values = np.zeros(9 * bs, dtype=np.int64)
    st.words = memoryview(st.values).cast("B").cast("q")
    return states, st


def py_step(states, st, bs):
    """The Python steady half's per-request work (as in ``TokenRows._steady`` with a token history)."""
    offsets = list(map(STATE_OFFSET, states))
    if list(map(sub, offsets, st.need)) != st.ones:
        return None
    words = st.words
    at = st.at
    try:
        tokens = list(map(getitem, map(_S_GENERATED, states), at))
    except IndexError:
        return None
    words[7 * bs:8 * bs] = array("q", tokens)
    st.at = list(map(add, at, st.ones))
    ends = array("q", offsets)
    prefix, positions = st.prefix, st.ends
    st.width += 1
    st.total += bs
    words[bs:2 * bs] = positions
    words[4 * bs:5 * bs] = ends
    words[6 * bs:7 * bs] = positions
    st.prefix = st.need = offsets
    st.ends = ends
    return prefix

def advance(states):
    for s in states:
        s.position_offset += 1
        s.generated_tokens.append(7)

def run(kind, bs, cold, n=400):
    """Median and 10th percentile microseconds of one step's per-request work (``kind``: py or c)."""
    states, st = make(bs)
    if kind == "c":
        need = np.array(st.need, dtype=np.int64); at = np.array(st.at, dtype=np.int64)
    junk = list(range(3_000_000)) if cold else None
    ts = []
    for i in range(n):
        advance(states)
        if cold:
            sum(junk)
        t0 = time.perf_counter()
        if kind == "py":
            r = py_step(states, st, bs)
        else:
            r = STEADY_C.steady(states, need, at, st.words, bs)
        ts.append(time.perf_counter() - t0)
        assert r is not None and r is not False
    ts = ts[20:]
    return statistics.median(ts) * 1e6, sorted(ts)[len(ts) // 10] * 1e6

def main():
    global STEADY_C
    STEADY_C = build()
    for bs in (1, 64):
        for cold in (False, True):
            for kind in ("py", "c"):
                med, p10 = run(kind, bs, cold)
                print(f"bs {bs:3d} {'cold' if cold else 'warm'} {kind:3s}: median {med:6.1f} us, p10 {p10:6.1f} us")


if __name__ == "__main__":
    main()
