"""The allocator check's cost per step (docs/allocator.md): host time of each check (the engine's snapshot, then
the op's launches) against the host time of the whole step, on the simulated engine and a tiny transformers run.

    PYTHONPATH=$PWD python3 benchmarks/allocator_cost.py [--device cuda] [--rounds 3]

Each run has the check on every step (allocator_check_interval=1). ``AllocatorCheck.run`` is timed around its
two parts: the provider's snapshot and the op (``check_allocator``, launches only on CUDA: no sync). A step is
timed from one check to the next (the engine's scheduling, forward and canary work included). On CUDA the op's
device time is taken with events around it as well (read at the end). Medians over the rounds' steps; the
run is checked clean (0 violations) before anything is printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

from kvcanary.runtime import allocator as alloc_mod
from kvcanary.runtime.allocator import AllocatorCheck

logging.getLogger("kvcanary").setLevel(logging.ERROR)


class Timed:
    """Patches ``AllocatorCheck.run`` and the op it calls to record host seconds (and CUDA event pairs)."""

    def __init__(self):
        self.snap, self.op, self.step, self.events = [], [], [], []
        self._last = None

    def __enter__(self):
        orig_run, orig_op, timed = AllocatorCheck.run, alloc_mod.check_allocator, self

        def op(ring, *args, **kwargs):
            t0 = time.perf_counter()
            if ring.rows.is_cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                orig_op(ring, *args, **kwargs)
                b.record()
                timed.events.append((a, b))
            else:
                orig_op(ring, *args, **kwargs)
            timed.op.append(time.perf_counter() - t0)

        def run(check, batch):
            t0 = time.perf_counter()
            if timed._last is not None:
                timed.step.append(t0 - timed._last)
            timed._last = t0
            provider = check.provider

            def snapshot():
                t = time.perf_counter()
                out = provider()
                timed.snap.append(time.perf_counter() - t)
                return out
            check.provider = snapshot
            try:
                orig_run(check, batch)
            finally:
                check.provider = provider

        self._undo = (orig_run, orig_op)
        AllocatorCheck.run, alloc_mod.check_allocator = run, op
        return self

    def __exit__(self, *exc):
        AllocatorCheck.run, alloc_mod.check_allocator = self._undo

    def summary(self) -> dict:
        us = lambda xs: round(1e6 * statistics.median(xs), 1) if xs else None  # noqa: E731
        out = {"checks": len(self.op), "snapshot_us": us(self.snap), "op_us": us(self.op),
               "check_us": us([a + b for a, b in zip(self.snap, self.op)]), "step_us": us(self.step)}
        if self.events:
            torch.cuda.synchronize()
            out["op_device_us"] = us([a.elapsed_time(b) / 1e3 for a, b in self.events])
        if out["check_us"] and out["step_us"]:
            out["share_of_step"] = round(out["check_us"] / out["step_us"], 4)
        return out


def sim(config: str, device: str) -> dict:
    from kvcanary.sim import MATRIX
    from kvcanary.sim.engine import SimEngine

    with Timed() as t:
        e = SimEngine(MATRIX[config])
        r = e.run()
    assert r.violations == 0 and e.canary.stats()["allocator_checks"] == r.steps, r
    return {"engine": f"sim {config}", "steps": r.steps, **t.summary()}


def hf(device: str) -> dict:
    from kvcanary.demo import build_tiny_model, run_workload

    model = build_tiny_model(device)
    with Timed() as t:
        run = run_workload(model, device=device, max_new_tokens=24, num_return_sequences=1,
                           allocator_check_interval=1)
    assert run.violations == [] and run.stats["allocator_checks"] == run.stats["forwards"], run.stats
    return {"engine": "transformers tiny llama, demo workload", "steps": run.stats["forwards"], **t.summary()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for _ in range(args.rounds):
        rows += [sim("base", args.device), sim("paged", args.device), sim("pressure-paged-spec", args.device),
                 hf(args.device)]
    merged = {}
    for r in rows:
        merged.setdefault(r["engine"], []).append(r)
    out = [{k: (statistics.median(x[k] for x in rs) if isinstance(rs[0][k], (int, float)) else rs[0][k])
            for k in rs[0]} for rs in merged.values()]
    print(json.dumps({"torch": torch.__version__, "device": args.device, "rounds": args.rounds, "results": out},
                     indent=1))


if __name__ == "__main__":
    main()
