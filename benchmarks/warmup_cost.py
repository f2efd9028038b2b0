"""What a generation pays once: the canary's extra time in the steps the steady rows skip.

The engine matrix pairs steady steps only (decode rows skip each generation's prefill and its first
decode steps, where the batch shape's graphs are captured); its whole-generation tokens/s counts every
step. This script runs the same lockstep pairing (two engines on one model, stepping in turn) and prints,
per round, the extra milliseconds of the with-canary engine in the steps that are not paired (prefill,
the first decode steps) against the paired ones, and how many CUDA-graph captures the canary made and
how long they took on the host.

    python benchmarks/warmup_cost.py --device cuda --model-size 1b --batch 1 --context 2048 --rounds 3
    python benchmarks/warmup_cost.py --device cpu --model-size tiny --batch 2 --context 64 --rounds 1 --steps 8
    python benchmarks/warmup_cost.py --device cuda --model-size 1b --batch 16 --rounds 2 --stagger 2
        # and the paired cost of decode steps while the batch shrinks by one request every 2 steps
    python benchmarks/warmup_cost.py --device cuda --model-size 1b --batch 16 --rounds 2 --stagger 2 \
        --attach-option bucket_batches=false --show 92
        # the same without batch buckets, each step of the last round shown (extra time by part, canary host)
    python benchmarks/warmup_cost.py --device cuda --model-size 1b --batch 64 --rounds 2 --cprofile-mixed 20
        # cProfile of the canary's hooks over the last round's first 20 steps that mix prefill and decode
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # (host_profile's hook wrapper)

import torch  # noqa: E402

from kvcanary.bench import lockstep  # noqa: E402
from kvcanary.bench.lockstep import step_s  # noqa: E402
from kvcanary.bench.workload import Workload, build_model  # noqa: E402


def _timed_captures(stats: dict):
    """Count and time every canary capture: the modules that capture call ``capture`` by name."""
    from kvcanary.runtime.step import fused as hf_fused, graphs as hf_graph
    from kvcanary.runtime import graphs

    orig = graphs.capture

    def capture(graph, body, pool=None):
        t0 = time.perf_counter()
        try:
            return orig(graph, body, pool=pool)
        finally:
            stats["captures"] += 1
            stats["capture_s"] += time.perf_counter() - t0

    for mod in (graphs, hf_graph, hf_fused):
        mod.capture = capture


def _profile_mixed(limit: int, state: dict):
    """cProfile the canary's hooks over the first ``limit`` steps with more new tokens than requests
    (prefill chunks, mixed with decodes) while ``state["on"]``; the profile is ``state["prof"]``."""
    import cProfile

    from host_profile import profile_while

    from kvcanary.integrations.transformers import session as hf_session

    prof = state["prof"] = cProfile.Profile()
    cls = hf_session.Session
    for name in ("_before", "_after", "_before_update", "_after_update"):
        setattr(cls, name, profile_while(getattr(cls, name), prof, lambda: state["now"]))
    before = cls._before

    def decide(self, *args):  # (a step's first hook: whether this step is one to profile)
        io = self.bp.inputs_and_outputs
        state["now"] = state["on"] and state["n"] < limit and io.total_seqlen_q > len(io.requests_in_batch)
        state["n"] += state["now"]
        return before(self, *args)

    cls._before = decide


def _shrinking(a: list, b: list, timings: list, wl) -> dict:
    """The decode steps of a shrinking batch (``wl.measured`` with a stagger: fewer requests than at the start,
    one token each, --skip not applied): their count, the median over them of the with/without step ratio
    less one, and the canary's median host time."""
    idx = [i for i, s in enumerate(a) if wl.measured(s[0], s[1])]
    if not idx:
        return {"steps": 0}
    ratios = [step_s(b[i]) / step_s(a[i]) for i in idx]
    host = [timings[i]["before_s"] + timings[i]["after_s"] + timings[i]["update_s"] for i in idx if i < len(timings)]
    return {"steps": len(idx), "paired_pct": round(100 * (statistics.median(ratios) - 1), 3),
            "canary_host_ms": round(1e3 * statistics.median(host), 4) if host else None,
            "median_step_ms_without": round(1e3 * statistics.median(step_s(a[i]) for i in idx), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-size", choices=("tiny", "1b", "8b"), default="1b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=64, help="paired decode steps per generation")
    ap.add_argument("--skip", type=int, default=18, help="decode steps skipped at the start (as the matrix)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stagger", type=int, default=0, metavar="K",
                    help="request i generates K * i tokens more: at the end the batch shrinks by one request every K "
                         "decode steps (serving's changing batches); those are then the paired steps (less --skip), "
                         "and their paired cost is printed")
    ap.add_argument("--show", type=int, default=0, help="print each of the first N steps of the last round")
    ap.add_argument("--cprofile-mixed", type=int, default=0, metavar="N",
                    help="cProfile the hooks over the last round's first N steps that mix prefill and decode")
    ap.add_argument("--attach-option", action="append", default=[], metavar="KEY=BOOL",
                    help="an attach option of the transformers adapter (e.g. bucket_batches=false), repeatable")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.mode, args.canary_option = "decode", []
    args.chunk, args.block_size = (4096, 256) if cuda else (256, 16)
    model = build_model(args.model_size, device, torch.bfloat16 if cuda else torch.float32,
                        args.context + args.steps + args.skip + 64 + args.stagger * args.batch,
                        "varlen" if cuda else "sdpa")
    wl = Workload(args, device)
    stats = {"captures": 0, "capture_s": 0.0}
    _timed_captures(stats)
    profiling = {"on": False, "now": False, "n": 0}
    if args.cprofile_mixed:
        _profile_mixed(args.cprofile_mixed, profiling)
    # warm-up: Triton kernels compile, the allocator grows (not counted)
    warm_args = argparse.Namespace(**{**vars(args), "context": min(args.context, 256), "steps": 4, "skip": 2,
                                      "stagger": 0})
    lockstep.run_lockstep(model, Workload(warm_args, device), first_canary=False)
    rounds = []
    for r in range(args.rounds):
        stats.update(captures=0, capture_s=0.0)
        profiling["on"] = r == args.rounds - 1
        res = lockstep.run_lockstep(model, wl, first_canary=bool(r % 2))
        a, b = res["without"]["steps"], res["with"]["steps"]
        if [s[:2] for s in a] != [s[:2] for s in b]:
            raise SystemExit("warmup_cost: the two engines scheduled different batches")
        if res["without"]["outputs"] != res["with"]["outputs"] or res["violations"]:
            raise SystemExit(f"warmup_cost: outputs differ or {res['violations']} violations")
        diff = [(step_s(sb) - step_s(sa)) * 1e3 for sa, sb in zip(a, b)]
        taken = [d for d, s in zip(diff, a) if s[2]]
        row = {"round": r, "steps": len(a), "paired_steps": len(taken),
               "extra_ms_unpaired_steps": round(sum(d for d, s in zip(diff, a) if not s[2]), 2),
               "extra_ms_paired_steps": round(sum(taken), 2),
               "median_extra_ms_paired": round(statistics.median(taken), 4) if taken else None,
               "whole_ms_without": round(sum(map(step_s, a)) * 1e3, 1),
               "whole_ms_with": round(sum(map(step_s, b)) * 1e3, 1),
               "captures": stats["captures"], "capture_ms": round(stats["capture_s"] * 1e3, 2)}
        if args.stagger:
            row["shrinking"] = _shrinking(a, b, res["timings"], wl)
        rounds.append(row)
        print(json.dumps(row), file=sys.stderr)
        if r == args.rounds - 1 and args.show:
            host = [t["before_s"] + t["after_s"] + t["update_s"] for t in res["timings"]]
            for i, (sa, d) in enumerate(zip(a[:args.show], diff)):
                h = f", canary host {host[i] * 1e3:6.3f} ms" if i < len(host) else ""
                by_part = " ".join(f"{(y - x) * 1e3:+.3f}" for x, y in zip(sa[3][:3], b[i][3][:3]))
                print(f"  step {i:3d}: batch {sa[0]:3d} tokens {sa[1]:5d} paired {sa[2]!s:5s} "
                      f"without {step_s(sa) * 1e3:8.3f} ms, extra {d:+8.3f} ms ({by_part}){h}", file=sys.stderr)
    if args.cprofile_mixed and profiling["n"]:
        import io
        import pstats

        text = io.StringIO()
        st = pstats.Stats(profiling["prof"], stream=text)
        print(f"cProfile over {profiling['n']} mixed steps (seconds summed over them):", file=text)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
        print(text.getvalue(), file=sys.stderr)
    med = lambda k: statistics.median(x[k] for x in rounds)  # noqa: E731
    out = {"workload": {k: getattr(args, k) for k in ("model_size", "batch", "context", "steps", "skip", "stagger",
                                                     "attach_option")},
           "device": torch.cuda.get_device_name(device) if cuda else "cpu", "rounds": rounds,
           "median_extra_ms_unpaired_steps": med("extra_ms_unpaired_steps"),
           "median_capture_ms": med("capture_ms"), "median_captures": med("captures")}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
