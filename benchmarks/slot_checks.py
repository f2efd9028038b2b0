"""Host cost of the slot checks (runtime/slots.py) on the CPU: a decode loop on a hand-driven canary.

    PYTHONPATH=. python benchmarks/slot_checks.py [--batch 8] [--context 256] [--steps 400] [--backend auto]

Each configuration runs the same decode steps (``batch`` requests, one token each, ``context`` tokens of
prefix, two float32 real-KV sources of 256 bytes per token); the median host time of
``before_forward`` + ``after_forward`` per step is printed, with each check alone and all of them.
Correctness is checked in the same run: every configuration ends with 0 violations.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcanary import Canary, CanaryConfig, ForwardBatch, PoolSpec, RealKvSource

CONFIGS = {
    "none of them": dict(reserved_check=False, nonfinite_check=False),
    "reserved_check": dict(reserved_check=True, nonfinite_check=False),
    "nonfinite_check": dict(reserved_check=False, nonfinite_check=True),
    "both (defaults)": dict(reserved_check=True, nonfinite_check=True),
}


def run(bs: int, context: int, steps: int, backend: str, **checks) -> tuple[float, int]:
    num_slots = bs * (context + steps) + 16
    k = torch.randn(num_slots, 64)
    v = torch.randn(num_slots, 64)
    src = [RealKvSource(t, page_size=1, num_bytes_per_token=256, read_bytes=256) for t in (k, v)]
    canary = Canary(PoolSpec(num_slots, tuple(src)), CanaryConfig(mode="raise", backend=backend, **checks),
                    max_batch=bs, max_tokens=bs * context, max_context=context + steps, num_rows=bs + 1)
    table = torch.zeros(bs + 1, context + steps, dtype=torch.int64)
    rows = torch.arange(1, bs + 1)
    slots = torch.arange(1, 1 + bs * (context + steps)).view(bs, -1)
    table[1:] = slots
    # prefill
    batch = ForwardBatch(rows, torch.zeros(bs, dtype=torch.int64), torch.full((bs,), context), torch.ones(bs * context,
                         dtype=torch.int64), torch.arange(context).repeat(bs), slots[:, :context].reshape(-1), table)
    canary.before_forward(batch)
    canary.after_forward(batch)
    canary.mark_ready()
    times = []
    for s in range(steps):
        p = context + s
        batch = ForwardBatch(rows, torch.full((bs,), p), torch.ones(bs, dtype=torch.int64),
                             torch.ones(bs, dtype=torch.int64), torch.full((bs,), p), slots[:, p].clone(), table)
        t0 = time.perf_counter()
        canary.before_forward(batch)
        canary.after_forward(batch)
        times.append(time.perf_counter() - t0)
    canary.flush()
    return statistics.median(times[steps // 4:]), canary.stats()["violations"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--backend", default="auto")
    a = ap.parse_args()
    torch.set_num_threads(1)
    run(a.batch, a.context, 20, a.backend)  # warm-up (numba compiles on first use)
    base = None
    print(f"batch {a.batch}, context {a.context}, backend {a.backend}, torch {torch.__version__}")
    for name, checks in CONFIGS.items():
        t, violations = run(a.batch, a.context, a.steps, a.backend, **checks)
        assert violations == 0, (name, violations)
        base = t if base is None else base
        print(f"{name:18s} {t * 1e6:8.1f} us/step  (+{(t - base) * 1e6:6.1f} us)")


if __name__ == "__main__":
    main()
