"""Would a compiled steady host half pay? The adapter's steady decode step reads each request's offset and
newest token in Python (``TokenRows._steady``, ``kvcanary/integrations/transformers/batch.py``). This times that work
as the adapter runs it (``_steady`` itself, on stand-in request states, its staging copy left out) against
its per-request part through the CPython API (``steady.c``, built here with the system's C compiler), with
the host's caches warm and flushed before each step (a sum over a 3M-element list, as
``benchmarks/graph_launch.py`` does), at batch 1 and 64. An experiment for the next lever, not a part of
the package:

    python benchmarks/steady_capi/bench.py
"""

import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvcanary.integrations.transformers.batch import TokenRows  # noqa: E402

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


class State:
    """A stand-in for a transformers request state: the fields the steady step reads, and a few others."""

    def __init__(self, i):
        self.request_id, self.initial_tokens, self.generated_tokens = f"r{i}", list(range(100)), [7] * 5
        self.position_offset, self.status, self.other, self.x = 105, 1, {}, i


class _NoStaging:
    """``Staging.send`` without the copy: the values stay in the kept array."""

    def send(self, parts, copy=True, last=None):
        return None, 0


def make(bs):
    """The adapter's own ``TokenRows`` after a step of ``bs`` stand-in requests, ready for steady steps."""
    states = [State(i) for i in range(bs)]
    rows = TokenRows()
    rows.init_rows(2 * bs + 1)
    names = [s.request_id for s in states]
    rows.last_names, rows.last_rows = names, rows._rows(names)
    rows.last_rids, rows.last_states = list(range(1, bs + 1)), states
    rows.sent.update((n, s.position_offset) for n, s in zip(names, states))  # the rows hold every token so far
    rows.want_history, rows.stage = True, _NoStaging()
    return states, rows


def advance(states):
    for s in states:
        s.position_offset += 1
        s.generated_tokens.append(7)

def run(kind, bs, cold, n=400):
    """Median and 10th percentile microseconds of one step's per-request work (``kind``: py or c)."""
    states, rows = make(bs)
    if kind == "c":  # the same kept values as the adapter's first steady step makes
        words = memoryview(np.zeros(9 * bs, dtype=np.int64)).cast("B").cast("q")
        need = np.array([s.position_offset for s in states], dtype=np.int64)
        at = np.array([len(s.generated_tokens) for s in states], dtype=np.int64)
    junk = list(range(3_000_000)) if cold else None
    ts = []
    for i in range(n):
        advance(states)
        if cold:
            sum(junk)
        t0 = time.perf_counter()
        if kind == "py":
            r = rows._steady(None, states, states, False)
        else:
            r = STEADY_C.steady(states, need, at, words, bs)
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
