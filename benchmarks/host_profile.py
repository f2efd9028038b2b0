"""Where the canary's host time goes inside one transformers continuous-batching generation.

Runs the engine benchmark's workload once with the canary under cProfile (enabled only inside the
canary's hooks) and prints the hottest functions. A development tool; the numbers the README reports
come from ``kvcanary.bench.engine``.

    python benchmarks/host_profile.py --device cuda --size 1b --batch 64 --context 2048
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import pstats
import statistics
import types

import torch

from kvcanary.bench import engine as bench_engine
from kvcanary.bench.workload import Workload, build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--sort", default="tottime", help="pstats sort key (tottime, cumulative, ...)")
    ap.add_argument("--no-cprofile", action="store_true", help="host times only (no profiler overhead)")
    ap.add_argument("--no-step-graphs", action="store_true", help="attach with step_graphs=False")
    a = ap.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    args = types.SimpleNamespace(batch=a.batch, context=a.context, mode=a.mode, steps=a.steps, skip=2,
                                 chunk=4096 if cuda else 256, block_size=256 if cuda else 16,
                                 canary_option=[], rounds=1)
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    model = build_model(a.size, dev, torch.bfloat16 if cuda else torch.float32, a.context + a.steps + 8,
                        "varlen" if cuda else "sdpa")
    wl = Workload(args, dev)
    for c in (True, False, True):
        bench_engine.run_once(model, wl, canary=c)
    from kvcanary.integrations import hf_session

    if a.no_step_graphs:
        hf_session.Session._step_graphs = lambda self: None
    prof = cProfile.Profile()
    originals = {n: getattr(hf_session.Session, n) for n in ("_before", "_after", "_before_update", "_after_update")}

    def wrap(f):
        def hooked(*x, **k):
            prof.enable()
            try:
                return f(*x, **k)
            finally:
                prof.disable()
        return hooked

    if not a.no_cprofile:
        for n, f in originals.items():
            setattr(hf_session.Session, n, wrap(f))
    try:
        r = bench_engine.run_once(model, wl, canary=True)
    finally:
        for n, f in originals.items():
            setattr(hf_session.Session, n, f)
    off = bench_engine.run_once(model, wl, canary=False)
    print(f"violations {r['violations']}, tokens identical {r['outputs'] == off['outputs']}")
    print(f"steps {len(r['steps'])}: median step {1e3 * statistics.median(r['steps']):.2f} ms with, "
          f"{1e3 * statistics.median(off['steps']):.2f} ms without; canary host "
          + ", ".join(f"{k[:-2]} {1e6 * statistics.median(p[k] for p in r['parts']):.0f} us" for k in r["parts"][0]))
    if not a.no_cprofile:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(a.sort).print_stats(a.top)
        print(s.getvalue())


if __name__ == "__main__":
    main()
