"""Files and functions of kvcanary that one decode step's canary work passes (the CPU default path: numba).

    PYTHONPATH=$PWD python3 benchmarks/step_trace.py [-v] [--step N]

Steps 12 and 13 of the demo workload (1 sequence per prompt, 24 new tokens; the demo sweeps every 4th step, so
step 12's close sweeps and step 13 is a steady one), or step N, each traced with sys.setprofile from the session's
before hook to the end of its after hook; for each, which path its before / after work took: "steady" (the CPU's
bound steady step, runtime/step/steady.py) or "eager" (docs/notes/step_runner.md). -v lists the functions.
"""
import argparse, sys, threading, collections
from kvcanary.demo import build_tiny_model, run_workload
from kvcanary.integrations.transformers import session as S

ap = argparse.ArgumentParser()
ap.add_argument("-v", action="store_true", help="list the functions of each file")
ap.add_argument("--step", type=int, action="append", help="the step(s) to trace (default 12 and 13)")
args = ap.parse_args()
wanted = set(args.step or (12, 13))
state = {"n": 0, "on": False, "taken": 0}
steps = {}
cur = None


def prof(frame, event, arg):
    if state["on"] and event == "call":
        f = frame.f_code.co_filename
        if "/kvcanary/" in f:
            cur[f.split("/kvcanary/")[1]].add(frame.f_code.co_name)
    return None


def taken(session):
    steady = session.runner.steady
    return (-1, -1) if steady is None else (steady.taken, steady.closed)


def wrap(name):
    orig = getattr(S.Session, name)

    def w(self, *a, **k):
        global cur
        if name == "_before":
            state["n"] += 1
            if state["n"] in wanted:
                state["taken"] = taken(self)
                cur = collections.defaultdict(set)
                state["on"] = True
        try:
            return orig(self, *a, **k)
        finally:
            if name == "_after" and state["on"]:
                state["on"] = False
                now, was = taken(self), state["taken"]
                steps[state["n"]] = (cur, "/".join("steady" if a > b else "eager" for a, b in zip(now, was)))
    setattr(S.Session, name, w)


for n in ("_before", "_after"):
    wrap(n)
threading.setprofile(prof); sys.setprofile(prof)
m = build_tiny_model("cpu")
r = run_workload(m, max_new_tokens=24, num_return_sequences=1)
sys.setprofile(None); threading.setprofile(None)
for n, (s, path) in sorted(steps.items()):
    print(f"step {n} ({path}): files {len(s)} functions {sum(len(v) for v in s.values())}")
    for f, fns in sorted(s.items()):
        print(f"  {f}: {len(fns)}" + (f" ({', '.join(sorted(fns))})" if args.v else ""))
