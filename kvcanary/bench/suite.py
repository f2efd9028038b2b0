"""The engine workloads of ``kvcanary bench --engine``: registry, runner, table and plot.

Each workload runs ``kvcanary.bench.engine`` (transformers continuous batching without and with
the canary) in its own process, so one model's memory is gone before the next loads and a
workload that fails or runs out of time does not stop the others.

    kvcanary bench --engine --device cuda --out engine.json --plot overhead.png
    kvcanary bench --engine 1b-decode-b64-c2k 8b-prefill-b8-c8k --device cuda
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time

RANGES = ("kvcanary_before", "kvcanary_after", "engine_forward")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # Triton launches through the driver API
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _load_trace(path: str):
    """(named ranges, launches sorted by time as (ts, correlation), device events by correlation) of a trace."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    launches = sorted((e["ts"], e["args"]["correlation"]) for e in events
                      if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {}))
    # every kernel and copy of a CUDA graph's replay carries the replay's correlation id
    device: dict = {}
    for e in events:
        if e.get("cat") in _DEVICE_CATS and "correlation" in e.get("args", {}):
            device.setdefault(e["args"]["correlation"], []).append(e)
    return [e for e in events if e.get("cat") == "user_annotation"], launches, device


def _inside(ranges, launches, name: str):
    """Per range event called ``name``: the range and the correlation ids of the launches inside it."""
    starts = [t for t, _ in launches]
    for e in ranges:
        if e.get("name") == name:
            i, j = bisect.bisect_left(starts, e["ts"]), bisect.bisect_right(starts, e["ts"] + e["dur"])
            yield e, [c for _, c in launches[i:j]]


def trace_ranges(path: str, names=RANGES) -> dict:
    """Per named profiler range of a chrome trace: device microseconds of the kernels and copies
    launched inside it (matched to their launch by correlation id: all of a graph replay's), host
    microseconds, count.

    The profiler's own per-event device totals were not reliable for these ranges (one H200 run
    counted 2.4x the traced kernel time, another 0.4x); the trace's kernels are the ground truth.
    """
    ranges, launches, device = _load_trace(path)
    out = {n: {"device_us": 0.0, "cpu_us": 0.0, "count": 0} for n in names}
    for n, r in out.items():
        for e, corr in _inside(ranges, launches, n):
            r["device_us"] += sum(k["dur"] for c in corr for k in device.get(c, ()))
            r["cpu_us"] += e["dur"]
            r["count"] += 1
    return out


def trace_kernels(path: str, name: str = "kvcanary_before") -> dict:
    """Device microseconds per kernel (or copy) name launched inside the ranges called ``name``, summed over
    them, and the ranges' count: which of the canary's kernels its device time is made of."""
    ranges, launches, device = _load_trace(path)
    per: dict = {}
    count = 0
    for _, corr in _inside(ranges, launches, name):
        count += 1
        for c in corr:
            for k in device.get(c, ()):
                per[k["name"]] = per.get(k["name"], 0.0) + k["dur"]
    return {"count": count, "device_us": dict(sorted(per.items(), key=lambda kv: -kv[1]))}


def slim_trace(path: str) -> None:
    """Rewrite a (gzipped) chrome trace keeping only what ``trace_ranges`` reads: the named ranges,
    the launches and the device events (a tenth of the size, for keeping traces beside results)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    keep = ("user_annotation", *_LAUNCH_CATS, *_DEVICE_CATS)
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") in keep]
    with opener(path, "wt") as f:
        json.dump(trace, f)


def gpu_time(ranges: dict) -> dict:
    """The canary's device time against the forward's, from ``trace_ranges``."""
    canary = ranges["kvcanary_before"]["device_us"] + ranges["kvcanary_after"]["device_us"]
    fwd = ranges["engine_forward"]["device_us"]
    return {"ranges": ranges, "canary_device_us": canary, "forward_device_us": fwd,
            "canary_over_forward": canary / fwd if fwd else None,
            "note": "device time of the kernels launched inside each range (chrome trace, by correlation id), "
                    "summed over the profiled steps (zero on CPU, where there is no device timeline)"}


# name: (model size, batch, context, mode); the GPU list covers the performance goals.
ENGINE_WORKLOADS = {
    f"{size}-{mode}-b{batch}-c{ctx // 1024}k": (size, batch, ctx, mode)
    for size in ("1b", "8b")
    for (batch, ctx, mode) in ((1, 2048, "decode"), (64, 2048, "decode"), (1, 8192, "decode"),
                               (64, 8192, "decode"), (8, 8192, "prefill"))
}
CPU_ENGINE_WORKLOADS = {
    "tiny-decode-b4-c64": ("tiny", 4, 64, "decode"),
    "tiny-prefill-b4-c256": ("tiny", 4, 256, "prefill"),
}


def run_engine(device: str, names: list[str] | None, timeout_s: float, progress=None,
               canary_options: list[str] | None = None, lockstep: bool = False) -> dict:
    """Run the named workloads (default: all of the device's list); one result row per workload.
    ``canary_options`` (``KEY=VALUE``, CanaryConfig fields) configure the canary of every run;
    ``lockstep`` pairs steps instead of runs (``kvcanary.bench.lockstep``)."""
    progress = progress if progress is not None else sys.stderr
    registry = CPU_ENGINE_WORKLOADS if device == "cpu" else ENGINE_WORKLOADS
    known = {**ENGINE_WORKLOADS, **CPU_ENGINE_WORKLOADS}
    names = names or list(registry)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"kv-canary: bench --engine workloads must be among {sorted(known)}, got {unknown}")
    results = []
    for i, name in enumerate(names, 1):
        size, batch, ctx, mode = known[name]
        print(f"[{i}/{len(names)}] {name} ...", file=progress, flush=True)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "result.json")
            cmd = [sys.executable, "-m", "kvcanary.bench.engine", "--device", device, "--model-size", size,
                   "--batch", str(batch), "--context", str(ctx), "--mode", mode, "--json", path]
            for opt in canary_options or []:
                cmd += ["--canary-option", opt]
            if lockstep:
                cmd.append("--lockstep")
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
                error = None if os.path.exists(path) else (proc.stderr.strip().splitlines() or ["no output"])[-1]
            except subprocess.TimeoutExpired:
                error = f"did not finish within {timeout_s:.0f} s"
            row = {"name": name, "error": error} if error else {"name": name, **_load(path)}
        results.append(row)
        print(f"[{i}/{len(names)}] {name}: {error or summary_line(row)} ({time.perf_counter() - t0:.0f} s)",
              file=progress, flush=True)
    return {"device": device, "results": results}


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def row_of(d: dict) -> dict:
    """The table's fields of one bench_engine result."""
    w, g = d["workload"], d.get("gpu_time") or {}
    return {
        "model": w["model_size"], "mode": w["mode"], "batch": w["batch"], "context": w["context"],
        "step_ms": d["step_without_canary"]["median_ms"], "step_canary_ms": d["step_with_canary"]["median_ms"],
        "canary_host_ms": d["canary_host_time_in_step"]["median_ms"],
        "wall_share_pct": 100 * d["canary_share_of_step"],
        "gpu_share_pct": None if g.get("canary_over_forward") is None else 100 * g["canary_over_forward"],
        "tokens_identical": d["correctness"]["tokens_identical"], "violations": d["correctness"]["violations"],
        "config": ",".join(w.get("canary_options") or []) or "default",
        # end-to-end A/B (results from before the A/B fields carry None)
        "overhead_pct": d.get("overhead_pct"), "overhead_pct_paired": d.get("overhead_pct_paired"),
    }


def summary_line(d: dict) -> str:
    r = row_of(d)
    gpu = "" if r["gpu_share_pct"] is None else f", canary GPU {r['gpu_share_pct']:.2f}% of the forward's"
    ab = "" if r["overhead_pct"] is None else f" ({r['overhead_pct']:+.2f}%)"
    return (f"step {r['step_ms']:.2f} -> {r['step_canary_ms']:.2f} ms{ab}, canary host {r['canary_host_ms']:.2f} ms"
            f"{gpu}, tokens identical {r['tokens_identical']}, violations {r['violations']}")


def table(results: list[dict]) -> str:
    rows = sorted((row_of(d) for d in results if not d.get("error")),
                  key=lambda r: (r["model"], r["mode"], r["context"], r["batch"], r["config"]))
    out = [f"{'model':5s} {'mode':8s} {'batch':>5s} {'context':>7s} {'step ms':>8s} {'+canary ms':>10s} "
           f"{'canary host ms':>14s} {'wall share':>10s} {'GPU share':>9s} {'tokens==':>8s} {'viol':>4s} canary config"]
    for r in rows:
        gpu = "n/a" if r["gpu_share_pct"] is None else f"{r['gpu_share_pct']:.2f}%"
        out.append(f"{r['model']:5s} {r['mode']:8s} {r['batch']:5d} {r['context']:7d} {r['step_ms']:8.2f} "
                   f"{r['step_canary_ms']:10.2f} {r['canary_host_ms']:14.3f} {r['wall_share_pct']:9.2f}% "
                   f"{gpu:>9s} {str(r['tokens_identical']):>8s} {r['violations']:4d} {r['config']}")
    out += [f"{d['name']}: {d['error']}" for d in results if d.get("error")]
    return "\n".join(out)


def plot(results: list[dict], path: str) -> None:
    """Canary share of the step vs batch size, one line per (model, mode, context): wall and GPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row_of(d) for d in results if not d.get("error")]
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = plt.get_cmap("tab10").colors
    for i, key in enumerate(sorted({(r["model"], r["mode"], r["context"]) for r in rows})):
        pts = sorted((r for r in rows if (r["model"], r["mode"], r["context"]) == key), key=lambda r: r["batch"])
        label, c = f"{key[0]} {key[1]} ctx {key[2]}", colors[i % len(colors)]  # one colour per series
        ax.plot([r["batch"] for r in pts], [r["wall_share_pct"] for r in pts], "o-", color=c,
                label=f"{label} (host, of wall step)")
        if all(r["gpu_share_pct"] is not None for r in pts):
            ax.plot([r["batch"] for r in pts], [r["gpu_share_pct"] for r in pts], "x--", color=c,
                    label=f"{label} (GPU, of forward)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("canary share of step (%)")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
