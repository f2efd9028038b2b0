"""How many device calls a captured step replays: the transformers adapter's step graphs on the CPU stand-in.

``DispatchGraph`` (kvcanary/runtime/graphs.py) records every aten op and Triton launch of a capture, as a CUDA
graph records its nodes. This runs the demo's tiny model through the adapter with step graphs and fused steps
on that stand-in (Triton under the interpreter) and prints, per kept graph, the calls it replays: a count that
needs no GPU and does not drift with a shared host, the nodes a CUDA graph of the same step would hold.

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/graph_nodes.py [--max-new-tokens 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def count(calls: list) -> dict:
    """{"calls", "triton", "aten"} of a stand-in graph's recorded calls."""
    launches = sum(1 for c in calls if getattr(c[0], "__name__", "") == "_launch")
    return {"calls": len(calls), "triton": launches, "aten": len(calls) - launches}


def measure(max_new_tokens: int = 16) -> dict:
    """Per kind of graph (fused steps, step graphs), the counts of each kept graph of one run."""
    from kvcanary.demo import build_tiny_model, run_workload
    from kvcanary.integrations.transformers import session as hf_session
    from kvcanary.runtime.graphs import DispatchGraph
    from kvcanary.runtime.step import graphs as step_graphs

    made, orig, steady = [], hf_session.Session._step_runner, step_graphs.STEADY_SIGHTINGS

    def step_runner(self, graph_type=None):
        r = orig(self, DispatchGraph)
        made.append(r.graphs)
        return r

    hf_session.Session._step_runner = step_runner
    step_graphs.STEADY_SIGHTINGS = 0  # every steady decode step fused at once (a short run)
    try:
        run = run_workload(build_tiny_model("cpu"), backend="triton", fused_steps=True, num_return_sequences=1,
                           max_new_tokens=max_new_tokens)
    finally:
        hf_session.Session._step_runner, step_graphs.STEADY_SIGHTINGS = orig, steady
    out = {"fused": [], "step": [], "violations": len(run.violations)}
    for g in filter(None, made):
        if g.fused is not None:
            out["fused"] += [count(f.graph.calls) for f in g.fused.plans.values()]
        out["step"] += [count(e.graph.calls) for e in g.plans.values() if e.graph is not None]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--json", help="write the counts here too")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("kv-canary: graph_nodes runs the CPU stand-in, Triton under the interpreter: set "
                         "TRITON_INTERPRET=1, got it unset")
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    out = measure(args.max_new_tokens)
    for kind in ("fused", "step"):
        for i, c in enumerate(out[kind]):
            print(f"{kind} graph {i}: {c['calls']} calls ({c['triton']} Triton launches, {c['aten']} aten ops)")
    print(f"violations: {out['violations']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
