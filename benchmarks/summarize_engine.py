"""Table (and, with matplotlib, a PNG plot) of engine_overhead.py results.

    python benchmarks/summarize_engine.py out/engine_*.json [--plot out/overhead.png]
"""

from __future__ import annotations

import argparse
import json


def load(paths: list[str]) -> list[dict]:
    rows = []
    for p in paths:
        try:
            with open(p) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            print(f"skipped {p}: {e}")
            continue
        w, g = d["workload"], d.get("gpu_time") or {}
        rows.append({
            "model": w["model_size"], "mode": w["mode"], "batch": w["batch"], "context": w["context"],
            "step_ms": d["step_without_canary"]["median_ms"], "step_canary_ms": d["step_with_canary"]["median_ms"],
            "canary_host_ms": d["canary_host_time_in_step"]["median_ms"],
            "wall_share_pct": 100 * d["canary_share_of_step"],
            "gpu_share_pct": None if g.get("canary_over_forward") is None else 100 * g["canary_over_forward"],
            "tokens_identical": d["correctness"]["tokens_identical"], "violations": d["correctness"]["violations"],
        })
    return sorted(rows, key=lambda r: (r["model"], r["mode"], r["context"], r["batch"]))


def table(rows: list[dict]) -> str:
    head = (f"{'model':5s} {'mode':8s} {'batch':>5s} {'context':>7s} {'step ms':>8s} {'+canary ms':>10s} "
            f"{'canary host ms':>14s} {'wall share':>10s} {'GPU share':>9s} {'tokens==':>8s} {'viol':>4s}")
    out = [head]
    for r in rows:
        gpu = "n/a" if r["gpu_share_pct"] is None else f"{r['gpu_share_pct']:.2f}%"
        out.append(f"{r['model']:5s} {r['mode']:8s} {r['batch']:5d} {r['context']:7d} {r['step_ms']:8.2f} "
                   f"{r['step_canary_ms']:10.2f} {r['canary_host_ms']:14.3f} {r['wall_share_pct']:9.2f}% "
                   f"{gpu:>9s} {str(r['tokens_identical']):>8s} {r['violations']:4d}")
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (model, mode, ctx) in sorted({(r["model"], r["mode"], r["context"]) for r in rows}):
        pts = [r for r in rows if (r["model"], r["mode"], r["context"]) == (model, mode, ctx)]
        ax.plot([r["batch"] for r in pts], [r["wall_share_pct"] for r in pts], "o-",
                label=f"{model} {mode} ctx {ctx} (wall)")
        if all(r["gpu_share_pct"] is not None for r in pts):
            ax.plot([r["batch"] for r in pts], [r["gpu_share_pct"] for r in pts], "x--",
                    label=f"{model} {mode} ctx {ctx} (GPU)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("canary share of step (%)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    args = ap.parse_args()
    rows = load(args.paths)
    print(table(rows))
    if args.plot:
        try:
            plot(rows, args.plot)
        except ImportError:
            print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
