"""Every engine figure of the README in one GPU call: the workload matrix under a time budget.

Runs ``kvcanary.bench.engine`` once per workload (its own process: one model's memory is gone
before the next loads), 1B and 8B, decode batch 1 and 64 at 2K and 8K context, prefill batch 8 x 8K,
and writes the results as one ``matrix.json`` and ``summary.md`` (the README's table).
The total budget is shared among the workloads still to run by weight (the 8B prefill-heavy
decodes cost most); each spends its share on alternating A/B rounds after a fixed minimum.

    python benchmarks/engine_matrix.py --budget-s 420 --out-dir docs/results/matrix   # ~8-9 minutes
    python benchmarks/engine_matrix.py --only 1b-decode-b1-c2k 1b-prefill-b8-c8k --budget-s 120
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcanary.runtime.step.graphs import STEADY_SIGHTINGS  # noqa: E402
from kvcanary.runtime.step.staging import STAGING_TURNS  # noqa: E402

# Each round attaches anew, and a new attach captures a steady decode shape's graphs on its first steps
# (an eager step and a per-shape capture, then one capture per staging turn once the shape is steady):
# decode rounds skip those steps in both runs and time the steady state (the captures' cost is in the
# whole-generation rows)
WARM = ["--skip", str(STEADY_SIGHTINGS + STAGING_TURNS + 2)]
# Steps, not runs, are paired wherever two engines' KV caches fit the GPU (kvcanary/bench/lockstep.py):
# a shared host drifts more between two runs than the canary costs
LOCK = ["--lockstep"]
# name: (size, batch, context, mode, extra bench_engine arguments, budget weight)
MATRIX = {
    "1b-decode-b1-c2k": ("1b", 1, 2048, "decode", ["--steps", "64", *WARM, *LOCK], 1.0),
    "1b-decode-b1-c8k": ("1b", 1, 8192, "decode", ["--steps", "64", *WARM, *LOCK], 1.0),
    "1b-decode-b64-c2k": ("1b", 64, 2048, "decode", ["--steps", "24", *WARM, *LOCK], 1.0),
    "1b-decode-b64-c8k": ("1b", 64, 8192, "decode", ["--steps", "16", *WARM, *LOCK], 1.5),
    "1b-prefill-b8-c8k": ("1b", 8, 8192, "prefill", LOCK, 0.8),
    "8b-decode-b1-c2k": ("8b", 1, 2048, "decode", ["--steps", "48", *WARM, *LOCK], 1.2),
    "8b-decode-b1-c8k": ("8b", 1, 8192, "decode", ["--steps", "48", *WARM, *LOCK], 1.2),
    "8b-decode-b64-c2k": ("8b", 64, 2048, "decode", ["--steps", "16", *WARM, *LOCK], 1.5),
    "8b-prefill-b8-c8k": ("8b", 8, 8192, "prefill", LOCK, 1.2),
    # A/A: both engines bare (--aa), the pairing's own floor on this host, next to the rows it qualifies
    "1b-decode-b1-c2k-aa": ("1b", 1, 2048, "decode", ["--steps", "64", *WARM, *LOCK, "--aa"], 0.8),
    "8b-decode-b1-c2k-aa": ("8b", 1, 2048, "decode", ["--steps", "48", *WARM, *LOCK, "--aa"], 1.0),
    # serving's case: the batch shrinks by one request every second step at the end, so every measured step
    # is a batch whose shape is new or two steps old (no --skip: the steady steps before are not measured)
    "1b-decode-b16-c2k-shrink2": ("1b", 16, 2048, "decode", ["--steps", "24", "--skip", "0", "--stagger", "2",
                                                             *LOCK], 1.0),
    # last: the heaviest (a 19 s prefill per generation), it takes what the others left; two of its KV
    # caches (73 GB each) do not fit one H200, so its runs, not steps, are paired
    "8b-decode-b64-c8k": ("8b", 64, 8192, "decode", ["--steps", "12", *WARM], 3.0),
}
FIXED_S = 25  # per workload, outside the rounds: process start, model build, warm-up, profiled run
# Workloads whose two rounds alone take longer than most shares (H200, measured): one whose share is
# smaller is skipped at once instead of running into its timeout (the 8B batch-64 8K generation prefills
# 64 x 8K tokens, about 19 s, per run)
NEEDS_S = {"8b-decode-b64-c8k": 240}


def run(names: list[str], budget_s: float, out_dir: Path, rounds: int, options: list[str],
        each_dir: Path, deadline_s: float) -> list[dict]:
    """Each workload in its own process; ``options``: more bench_engine arguments (``--canary-option``,
    ``--attach-option``) for every one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    each_dir.mkdir(parents=True, exist_ok=True)
    t_start, results = time.perf_counter(), []
    for i, name in enumerate(names):
        size, batch, ctx, mode, extra, _ = MATRIX[name]
        left = budget_s - (time.perf_counter() - t_start)
        weights = [MATRIX[n][5] for n in names[i:]]
        share = left * MATRIX[name][5] / sum(weights)
        rounds_budget = max(0.0, share - FIXED_S)
        tag = "_aa" if "--aa" in extra else "_shrink" if "--stagger" in extra else ""
        path = each_dir / f"engine_{size}_b{batch}_c{ctx}_{mode}{tag}.json"
        cmd = [sys.executable, "-m", "kvcanary.bench.engine", "--device", "cuda", "--model-size", size,
               "--batch", str(batch), "--context", str(ctx), "--mode", mode, "--json", str(path),
               "--rounds", str(rounds), "--budget-s", f"{rounds_budget:.0f}", *extra, *options]
        t0 = time.perf_counter()
        hard = deadline_s - (t0 - t_start)  # the whole matrix ends by the deadline, whatever the estimates
        if hard < 30:
            results.append({"name": name, "error": f"skipped: {deadline_s:.0f} s deadline reached"})
            print(f"[{i + 1}/{len(names)}] {name}: skipped (deadline)", file=sys.stderr, flush=True)
            continue
        if share < NEEDS_S.get(name, 0):
            results.append({"name": name, "error": f"skipped: needs about {NEEDS_S[name]} s for two rounds, "
                                                   f"its share of the budget is {share:.0f} s"})
            print(f"[{i + 1}/{len(names)}] {name}: {results[-1]['error']}", file=sys.stderr, flush=True)
            continue
        print(f"[{i + 1}/{len(names)}] {name}: share {share:.0f} s ...", file=sys.stderr, flush=True)
        # the checkout first, then whatever the caller put on the path: a carried transformers wheel
        # (benchmarks/gpu_wheels.sh) must reach the workload's process, or it runs the image's release
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                  timeout=min(hard, max(60.0, 3 * share)))
            error = None if path.exists() else (proc.stderr.strip().splitlines() or ["no output"])[-1]
            if proc.returncode and not error:
                error = "tokens differ or violations reported"
        except subprocess.TimeoutExpired:
            error = "timed out"
        row = {"name": name, "error": error, "elapsed_s": round(time.perf_counter() - t0, 1)}
        if path.exists():
            row.update(json.loads(path.read_text()))
        results.append(row)
        print(f"[{i + 1}/{len(names)}] {name}: {error or line(row)} ({row['elapsed_s']} s)", file=sys.stderr,
              flush=True)
    return results


def line(d: dict) -> str:
    p = d.get("canary_host_us_by_part", {})
    ci = d.get("overhead_pct_paired_ci95")
    ci = f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else ""
    return (f"{d['step_without_canary']['median_ms']:.2f} -> {d['step_with_canary']['median_ms']:.2f} ms "
            f"({d.get('overhead_pct', float('nan')):+.2f}%, paired {d.get('overhead_pct_paired') or 0:+.2f}%{ci}), "
            f"host {p.get('total', 0):.0f} us, rounds {d['workload']['rounds']}, "
            f"transformers {d.get('environment', {}).get('transformers', '?')}")


def table(results: list[dict]) -> str:
    # the end-to-end overhead first: what a user of the engine pays
    head = ("| model | workload | end-to-end overhead (pooled / paired) | step without | step with | "
            "tokens/s without / with (whole generation) | canary host per step (integration + runtime + launches) | GPU share | "
            "steps (rounds, pairing) | tokens identical, violations |")
    out = [head, "|" + "---|" * 10]
    for d in results:
        if d.get("error") and "workload" not in d:
            out.append(f"| {d['name']} | failed: {d['error']} |" + " |" * 8)
            continue
        w, g, p = d["workload"], d.get("generation", {}), d.get("canary_host_us_by_part", {})
        # (an A/A row's engines are both bare: no GPU share; rows before 0f8ff13 carried a profiled canary run's)
        gpu = None if w.get("a_a") else (d.get("gpu_time") or {}).get("canary_over_forward")
        wl = f"{w['mode']}, batch {w['batch']}, {w['context'] // 1024}K" + (" (A/A: both bare)" if w.get("a_a") else "")
        if w.get("stagger"):
            wl += f", shrinking by one request every {w['stagger']} steps"
        pairs = f"{w['rounds']} rounds, " + ("steps paired" if w.get("pairing") == "steps" else "runs paired")
        out.append(
            f"| {w['model_size'].upper()} | {wl} | {d['overhead_pct']:+.2f}% / {d.get('overhead_pct_paired') or 0:+.2f}% | "
            f"{d['step_without_canary']['median_ms']:.2f} ms | {d['step_with_canary']['median_ms']:.2f} ms | "
            f"{g.get('tokens_per_s_without') or 0:.0f} / "
            f"{g.get('tokens_per_s_with') or 0:.0f} | {p.get('total', 0):.0f} us ({p.get('integration', 0):.0f} + "
            f"{p.get('runtime', 0):.0f} + {p.get('launch', 0):.0f}) | "
            f"{'n/a' if gpu is None else f'{100 * gpu:.2f}%'} | {d['step_without_canary']['n']} + "
            f"{d['step_with_canary']['n']} ({pairs}) | {d['correctness']['tokens_identical']}, "
            f"{d['correctness']['violations']} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-s", type=float, default=420, help="seconds for the whole matrix (default 420; the "
                    "heaviest workload's two rounds may run past its share)")
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or "engine_matrix", help="result folder")
    ap.add_argument("--only", nargs="+", default=None, choices=sorted(MATRIX), metavar="NAME",
                    help=f"workloads to run (default all: {', '.join(MATRIX)})")
    ap.add_argument("--rounds", type=int, default=2, help="A/B rounds each workload runs at least")
    ap.add_argument("--deadline-s", type=float, default=540,
                    help="hard limit for the whole matrix: a workload still running then is stopped, later ones "
                         "are skipped (default 540, inside a 600 s command limit)")
    ap.add_argument("--canary-option", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--attach-option", action="append", default=[], metavar="KEY=BOOL",
                    help="an adapter mechanism on or off in the runs with the canary, e.g. fused_steps=false")
    ap.add_argument("--keep-each", action="store_true",
                    help="also keep one JSON per workload in OUT_DIR/each (the GPU runner returns at most 8 files)")
    args = ap.parse_args()
    names = args.only or list(MATRIX)
    out_dir = Path(args.out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        each = out_dir / "each" if args.keep_each else Path(tmp)
        options = [a for opt in args.canary_option for a in ("--canary-option", opt)]
        options += [a for opt in args.attach_option for a in ("--attach-option", opt)]
        results = run(names, args.budget_s, out_dir, args.rounds, options, each, args.deadline_s)
    (out_dir / "matrix.json").write_text(json.dumps(results, indent=1) + "\n")
    text = table(results)
    (out_dir / "summary.md").write_text(text + "\n")
    print(text)
    bad = [d["name"] for d in results if d.get("error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
