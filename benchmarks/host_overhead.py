"""Host time the Canary adds per forward, with real kernels and with kernels stubbed out.

The stubbed figure is the runtime's own Python (validation, launch plumbing, snapshot for the
one-step-late drain); the difference to the real figure is the kernels' launch (and, on CPU,
their compute). A decode-like forward: `--batch` requests of `--context` cached tokens, 1 new each.

    python benchmarks/host_overhead.py --device cpu --batch 4 --context 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcanary import Canary, CanaryConfig, ForwardBatch, PoolSpec, RealKvSource  # noqa: E402


class _Stub:
    def __getattr__(self, name):
        return lambda *a, **k: None


def setup(device: torch.device, bs: int, ctx: int, backend: str):
    slots = bs * (ctx + 1) + 1
    kv = torch.zeros(slots, 64, dtype=torch.bfloat16, device=device)
    pool = PoolSpec(slots, (RealKvSource(kv, 1, 128, 128),))
    canary = Canary(pool, CanaryConfig(backend=backend, health_interval=0), max_batch=bs, max_tokens=bs * ctx,
                    max_context=ctx + 1, num_rows=bs + 1, device=device)
    rtt = torch.zeros(bs + 1, ctx + 1, dtype=torch.int32, device=device)
    rtt[1:] = torch.arange(1, slots, device=device, dtype=torch.int32).view(bs, ctx + 1)
    rows = torch.arange(1, bs + 1, device=device)
    prefill = ForwardBatch(rows, torch.zeros(bs, dtype=torch.int64, device=device),
                           torch.full((bs,), ctx, device=device), torch.ones(bs * ctx, dtype=torch.int64, device=device),
                           torch.arange(ctx, device=device).repeat(bs), rtt[1:, :ctx].reshape(-1).long(), rtt,
                           request_ids=rows.clone())
    canary.before_forward(prefill)
    canary.after_forward(prefill)
    decode = ForwardBatch(rows, torch.full((bs,), ctx, device=device), torch.ones(bs, dtype=torch.int64, device=device),
                          torch.ones(bs, dtype=torch.int64, device=device), torch.full((bs,), ctx, device=device),
                          rtt[1:, ctx].long(), rtt, request_ids=rows.clone())
    return canary, decode


def per_forward_us(canary, batch, n: int) -> float:
    sync = torch.cuda.synchronize if batch.out_cache_loc.is_cuda else (lambda: None)
    for _ in range(10):
        canary.before_forward(batch)
        canary.after_forward(batch)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        canary.before_forward(batch)
        canary.after_forward(batch)
    host = (time.perf_counter() - t0) / n * 1e6
    sync()
    return host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    device = torch.device(args.device)
    canary, batch = setup(device, args.batch, args.context, args.backend)
    real = per_forward_us(canary, batch, args.n)
    assert canary.flush() == [], "a clean decode reported violations"
    canary.launcher.impl = _Stub()
    stubbed = per_forward_us(canary, batch, args.n)
    print(json.dumps({"device": str(device), "backend": args.backend, "batch": args.batch, "context": args.context,
                      "host_us_per_forward": round(real, 1), "host_us_per_forward_kernels_stubbed": round(stubbed, 1),
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
