import logging, torch, sys
from kvcanary.demo import build_tiny_model, run_workload
logging.getLogger("kvcanary").setLevel(logging.ERROR)
m = build_tiny_model("cuda")
base = run_workload(m, canary=False)
for sg in (False, True):
    for fast in ("1", "0"):
        from kvcanary.ops import triton_ops as T
        T._Launcher.enabled = fast == "1"; T._launchers.clear()
        r = run_workload(m, step_graphs=sg)
        print("step_graphs", sg, "fast", fast, "violations", len(r.violations), "tokens same", r.tokens == base.tokens, r.stats.get("forwards"))
        for line in r.log_lines[:3]: print("   ", line[:300])
