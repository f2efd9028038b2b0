"""Files and functions of kvcanary that one decode step's canary work passes (the CPU default path: numba).

    PYTHONPATH=$PWD python3 benchmarks/step_trace.py

The 12th step of the demo workload (1 sequence per prompt, 24 new tokens), traced with sys.setprofile
from the session's before hook to the end of its after hook (docs/notes/step_runner.md).
"""
import sys, threading, collections
from kvcanary.demo import build_tiny_model, run_workload
from kvcanary.integrations.transformers import session as S

state = {"n": 0, "on": False}
steps = []
cur = None

def prof(frame, event, arg):
    if state["on"] and event == "call":
        f = frame.f_code.co_filename
        if "/kvcanary/" in f:
            cur[f.split("/kvcanary/")[1]].add(frame.f_code.co_name)
    return None

def wrap(name):
    orig = getattr(S.Session, name)
    def w(self, *a, **k):
        global cur
        if name == "_before":
            state["n"] += 1
            if state["n"] == 12:
                cur = collections.defaultdict(set); state["on"] = True
        try:
            return orig(self, *a, **k)
        finally:
            if name == "_after" and state["on"]:
                state["on"] = False; steps.append(cur)
    setattr(S.Session, name, w)

for n in ("_before", "_after"):
    wrap(n)
threading.setprofile(prof); sys.setprofile(prof)
m = build_tiny_model("cpu")
r = run_workload(m, max_new_tokens=24, num_return_sequences=1)
sys.setprofile(None); threading.setprofile(None)
s = steps[0]
print("files", len(s), "functions", sum(len(v) for v in s.values()))
for f, fns in sorted(s.items()):
    print(f"  {f}: {len(fns)}", sorted(fns) if "-v" in sys.argv else "")
