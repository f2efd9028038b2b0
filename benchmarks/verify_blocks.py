"""Probe of the verify kernel's block shape against SGLang's kernels (benchmarks/sglang_kernels.py's plans).

Each config sets ``kvcanary.ops.triton_ops.VERIFY_SPECULATE_BLOCK`` / ``VERIFY_SPECULATE_WARPS`` (the
one-pass path of plans of at most 64K entries: one block per program) for the run of a workload's verify
(identity checks, then timing). Used to pick those constants; not part of the suite.

    bash benchmarks/sglang_wheels.sh install /tmp/sgl
    PYTHONPATH=/tmp/sgl:$PWD python3 benchmarks/verify_blocks.py --out blocks.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_kernels as sk  # noqa: E402

from kvcanary.ops import triton_ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=["128/2", "64/2", "64/1", "32/1", "16/1", "128/4"], help="BLOCK/WARPS each")
    ap.add_argument("--workloads", nargs="+", default=["prefill-bs4-8k"])
    ap.add_argument("--budget-s", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kv-canary: verify_blocks.py must have a CUDA GPU, got none")
    configs = []
    for c in args.configs:
        try:
            block, warps = (int(x) for x in c.split("/"))
        except ValueError:
            raise SystemExit(f"kv-canary: --configs must be BLOCK/WARPS (e.g. 64/2), got {c!r}") from None
        configs.append((block, warps))
    device, sgl = torch.device("cuda"), sk.import_sglang()
    sk.compile_sglang(sgl)
    run_args = argparse.Namespace(seed=0, no_time=False, budget_s=args.budget_s)
    rows = []
    for block, warps in configs:
        triton_ops.VERIFY_SPECULATE_BLOCK, triton_ops.VERIFY_SPECULATE_WARPS = block, warps
        for name in args.workloads:
            bs, P, E, _ = sk.WORKLOADS[name]
            _, results = sk.run_workload(sgl, name, (bs, P, E, ("verify",)), ["triton"], device, run_args)
            rows += [dict(r, block=block, warps=warps) for r in results]
    print("block/warps workload             op     real_kv graph median per launch; ratio = sglang / ours")
    print("\n".join(f"{r['block']:5d}/{r['warps']:<5d} {sk.fmt_row(r)}" for r in rows))
    # the config with the best geometric mean of its ratios (every workload, mode and launch count)
    score = {c: math.prod(r["ratio"] for r in rows if (r["block"], r["warps"]) == c) for c in configs}
    best = max(configs, key=lambda c: score[c])
    print(f"best: {best[0]}/{best[1]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "best": list(best)}, f, indent=2)


if __name__ == "__main__":
    main()
