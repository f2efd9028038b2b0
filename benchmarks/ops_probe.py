"""Run the op benchmark's set-up and ops step by step, syncing after each, to find a faulting launch.

Diagnostic for the decode-like op benchmark (docs/benchmarks.md, "The decode benchmark's fault"): the set-up chain
write, the plan, then verify and write per backend and real-KV mode, each ``--repeat`` times as
the benchmark's timing does. Prints "ok STEP" or "FAIL STEP ..." and exits 1 at the first failure.

    CUDA_LAUNCH_BLOCKING=1 python benchmarks/ops_probe.py 256 4095 1 --repeat 6
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcanary.bench import ops as bench  # noqa: E402
from kvcanary.format import RealKvMode  # noqa: E402


def step(name: str, fn, repeat: int = 1) -> None:
    try:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    except Exception as e:  # report which step faulted, then stop: the context is poisoned
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        sys.exit(1)
    print(f"ok {name}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("batch", type=int)
    ap.add_argument("prefix", type=int)
    ap.add_argument("new", type=int)
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--backends", nargs="+", default=["triton", "torch"])
    args = ap.parse_args()
    device = torch.device("cuda")
    holder = {}
    step("set-up (chain write and plan)", lambda: holder.update(s=bench.Setup(args.batch, args.prefix, args.new,
                                                                                device)))
    s = holder["s"]
    for backend in args.backends:
        for mode in (RealKvMode.NONE, RealKvMode.PARTIAL):
            step(f"{backend} verify {mode.name}", lambda: s.verify(backend, mode), args.repeat)
            step(f"{backend} write {mode.name}", lambda: s.write(backend, mode), args.repeat)
    # Each mode verifies its own records, so a clean run ends with an empty ring.
    print("ring index", int(s.ring.write_index[0]))


if __name__ == "__main__":
    main()
