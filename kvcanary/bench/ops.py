"""Throughput of the canary ops: verify and write entries/s and effective GB/s.

Workloads are declared once in WORKLOADS; providers (torch, numba, triton) are a separate axis.
Bytes-moved model (per entry, what a kernel must touch at minimum):
  verify: entry (slot, position, prev, expected_token: 32 B) + the slot's record fields 0-3 (32 B)
          + the predecessor's record fields 0-2 (24 B) + real-KV bytes read (16 B in PARTIAL, 0 in NONE)
  write:  inputs (out_cache_loc, input_ids, positions: 24 B) + record stored (stride B)
          + real-KV bytes read (16 B in PARTIAL)
  write_hinted: the same write as TAIL runs it, with the HEAD buffer as ``chain_hint`` (Triton checks
          and copies a request's chain instead of walking it serially); the same bytes model
Results are compared across providers before any number is printed. Bandwidth is reported against
the strongest of several references measured in the same run (``kvcanary.bench.bandwidth``).

    kvcanary bench --device cuda --providers triton torch --out results.json
    python -m kvcanary.bench.ops ...   (the same, from a checkout)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from kvcanary import ops
from kvcanary.ops import api
from kvcanary.format import LaunchTag, RealKvMode

# name: (batch, prefix per request, new tokens per request)
WORKLOADS = {
    "prefill-bs4-8k": (4, 8192, 8192),
    "decode-bs256-ctx4k": (256, 4095, 1),
}
CPU_WORKLOADS = {
    "decode-bs64-ctx1k": (64, 1023, 1),
    "prefill-bs2-2k": (2, 2048, 2048),
}


QUANTILES = (0.2, 0.5, 0.8)
MODES = (RealKvMode.NONE, RealKvMode.PARTIAL)


def bench(fn, device: torch.device, reps: int = 20) -> tuple[float, float, float]:
    """Milliseconds of fn at the 20th, 50th and 80th percentile (CUDA-graph replays on CUDA after
    Triton's warm-up, a plain timer after one warm-up call on CPU)."""
    if device.type == "cuda":
        import triton.testing

        # Replayed from a CUDA graph, as an engine would: the time is the kernels', not Python's launch.
        try:
            return tuple(triton.testing.do_bench_cudagraph(fn, rep=100, quantiles=list(QUANTILES)))
        except RuntimeError:
            return tuple(triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=list(QUANTILES)))
    fn()
    times = []
    for _ in range(max(3, reps // 4)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return tuple(times[min(len(times) - 1, int(q * len(times)))] for q in QUANTILES)


def copy_bandwidth_gbs(device: torch.device) -> float:
    """GB/s of ``torch.Tensor.copy_`` (bytes read + written)."""
    return bandwidth_references(device)["torch_copy"]


def bandwidth_references(device: torch.device) -> dict[str, float]:
    """GB/s of every bandwidth reference (``kvcanary.bench.bandwidth``): copy_, Triton copy, read-only reduction."""
    from kvcanary.bench.bandwidth import references

    return references(device, bench)


class Setup:
    """A pool with clean chains for `bs` requests of prefix P, then a forward of E new tokens each."""

    def __init__(self, bs: int, P: int, E: int, device: torch.device, stride: int = 48):
        g = torch.Generator().manual_seed(0)
        ctx = P + E
        self.num_slots = bs * ctx + 1
        perm = torch.randperm(self.num_slots - 1, generator=g) + 1
        self.rtt = torch.zeros(bs + 1, ctx, dtype=torch.int32)
        self.rtt[1:] = perm.view(bs, ctx).to(torch.int32)
        self.rtt = self.rtt.to(device)
        self.kv = torch.randn(self.num_slots, 64, generator=g).to(torch.bfloat16).to(device)
        self.sources = (ops.RealKvSource(self.kv, 1, 128, 128),)
        # One buffer per real-KV mode: a record written in one mode verifies clean only in that mode
        # (NONE stores hash 0), and a verify that reports every entry times the ring, not the check.
        self.bufs = {mode: ops.allocate_canary_buffer(self.num_slots, stride, device) for mode in MODES}
        self.ring = ops.ViolationRing.allocate(1024, device)
        self.counters = ops.allocate_counters(device)
        self.rows = torch.arange(1, bs + 1, device=device)
        self.bs, self.P, self.E, self.device = bs, P, E, device
        self.plan = ops.Plan.allocate(bs * P, bs, device)
        # Fill the prefix records with a clean chain (one prefill write of P tokens per request).
        for mode in MODES:
            self._write_forward(0, P, mode, "auto")
        ops.plan(req_pool_indices=self.rows, prefix_lens=torch.full((bs,), P, device=device),
                 extend_lens=torch.full((bs,), E, device=device), req_to_token=self.rtt, out=self.plan)
        self.loc, self.ids, self.pos = self._inputs(P, E)
        self.heads: dict | None = None  # HEAD buffers for the hinted TAIL write (write(hint=True))

    def _inputs(self, P, E):
        loc = self.rtt[1:, P:P + E].reshape(-1).to(torch.int64)
        ids = (torch.arange(self.bs * E, device=self.device) * 7919) % 32000
        pos = torch.arange(P, P + E, device=self.device).repeat(self.bs)
        return loc, ids, pos

    def _write_forward(self, P, E, mode, backend):
        plan = ops.Plan.allocate(1, self.bs, self.device)
        ops.plan(req_pool_indices=self.rows, prefix_lens=torch.full((self.bs,), P, device=self.device),
                 extend_lens=torch.full((self.bs,), E, device=self.device), req_to_token=self.rtt, out=plan,
                 backend=backend)
        loc, ids, pos = self._inputs(P, E)
        ops.write(buf=self.bufs[mode], plan=plan, num_requests=self.bs, out_cache_loc=loc, input_ids=ids, positions=pos,
                  ring=self.ring, counters=self.counters, launch_tag=LaunchTag.TAIL_K_FULL, sources=self.sources,
                  real_kv_mode=mode, backend=backend)

    def verify(self, backend, mode=RealKvMode.PARTIAL):
        ops.verify(buf=self.bufs[mode], entries=self.plan.entries, ring=self.ring, counters=self.counters,
                   launch_tag=LaunchTag.TAIL_K_FULL, sources=self.sources, real_kv_mode=mode, backend=backend)

    def write(self, backend, mode=RealKvMode.PARTIAL, hint=False):
        """``hint``: the TAIL write as the runtime makes it, with the HEAD buffer that already holds the
        entries' chain (``self.heads``, made on first use)."""
        if hint and self.heads is None:
            self.heads = {}
            for m in MODES:  # a HEAD buffer: the same entries written into a copy
                self.heads[m] = self.bufs[m].clone()
                ops.write(buf=self.heads[m], plan=self.plan, num_requests=self.bs, out_cache_loc=self.loc,
                          input_ids=self.ids, positions=self.pos, ring=self.ring, counters=self.counters,
                          launch_tag=LaunchTag.HEAD_K_FULL, sources=self.sources, real_kv_mode=m)
        ops.write(buf=self.bufs[mode], plan=self.plan, num_requests=self.bs, out_cache_loc=self.loc, input_ids=self.ids,
                  positions=self.pos, ring=self.ring, counters=self.counters, launch_tag=LaunchTag.TAIL_K_FULL,
                  sources=self.sources, real_kv_mode=mode, backend=backend,
                  chain_hint=self.heads[mode] if hint else None)


def run(device: torch.device, providers: list[str], workloads: dict, progress=None) -> dict:
    """Check, then time every (workload, provider, op, real-KV mode); progress lines go to ``progress``."""
    progress = progress if progress is not None else sys.stderr
    refs = bandwidth_references(device)
    copy_gbs, best_gbs = refs["torch_copy"], max(refs.values())
    print("bandwidth references: " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in refs.items()), file=progress,
          flush=True)
    results = []
    for name, (bs, P, E) in workloads.items():
        try:
            results += _run_workload(device, providers, name, bs, P, E, (copy_gbs, best_gbs), progress)
        except Exception as e:  # one workload's failure must not hide the others' numbers
            print(f"{name}: failed: {type(e).__name__}: {e}", file=progress, flush=True)
            results.append({"workload": name, "error": f"{type(e).__name__}: {e}"})
            if device.type == "cuda":
                raise  # a device fault poisons the context: nothing after it can be trusted
    info = meta(device, copy_gbs)
    info["bandwidth_refs_gb_per_s"] = {k: round(v, 1) for k, v in refs.items()}
    info["best_ref_gb_per_s"] = round(best_gbs, 1)
    return {"meta": info, "results": results}


def _run_workload(device, providers, name, bs, P, E, refs, progress) -> list[dict]:
    copy_gbs, best_gbs = refs
    results = []
    s = Setup(bs, P, E, device)
    n_verify, n_write = bs * P, bs * E
    # Correctness first: clean verify finds nothing, and every provider writes identical bytes.
    # The torch write walks the chain one Python step per token: skip it for long chains on the GPU.
    skip = {p for p in providers if p == "torch" and device.type == "cuda" and E > 64}
    for mode in MODES:
        buf, written = s.bufs[mode], {}
        for p in providers:
            s.verify(p, mode)
            _assert_clean(s, f"{p}: clean verify (real_kv={mode.name.lower()})")
            if p in skip:
                continue
            before = buf.clone()
            s.write(p, mode)
            written[p] = buf.clone()
            if p == "triton":  # the hinted TAIL write stores the same bytes
                buf.copy_(before)
                s.write(p, mode, hint=True)
                assert torch.equal(buf, written[p]), "triton's hinted write stored different records"
            buf.copy_(before)
        ref = written[providers[0]]
        for p in [p for p in providers[1:] if p not in skip]:
            assert torch.equal(written[p], ref), f"{p} wrote different records than {providers[0]}"
    for p in providers:
        for mode in (RealKvMode.NONE, RealKvMode.PARTIAL):
            extra = 16 if mode == RealKvMode.PARTIAL else 0
            q_v = bench(lambda: s.verify(p, mode), device)
            q_w = (float("nan"),) * 3 if p in skip else bench(lambda: s.write(p, mode), device)
            # the TAIL write with its HEAD hint (Triton only: the other backends always walk the chain)
            q_t = bench(lambda: s.write(p, mode, hint=True), device) if p == "triton" else (float("nan"),) * 3
            _assert_clean(s, f"{p}: timed verify and write (real_kv={mode.name.lower()})")
            bytes_v = n_verify * (32 + 32 + 24 + extra)
            bytes_w = n_write * (24 + s.bufs[mode].shape[1] + extra)
            for op, q, n, nbytes in (("verify", q_v, n_verify, bytes_v), ("write", q_w, n_write, bytes_w),
                                     ("write_hinted", q_t, n_write, bytes_w)):
                ms = q[1]
                if ms != ms:
                    continue
                gbs = nbytes / (ms * 1e-3) / 1e9
                results.append({"workload": name, "provider": p, "op": op, "real_kv": mode.name.lower(),
                                "entries": n, "ms": round(ms, 4), "ms_p20": round(q[0], 4),
                                "ms_p80": round(q[2], 4), "entries_per_s": n / (ms * 1e-3),
                                "gb_per_s": round(gbs, 2), "pct_copy_bw": round(100 * gbs / copy_gbs, 1),
                                "pct_best_bw": round(100 * gbs / best_gbs, 1)})
                print(f"{name:22s} {p:7s} {op:6s} real_kv={mode.name.lower():8s} {ms:9.3f} ms "
                      f"{n / (ms * 1e-3) / 1e6:9.1f} M entries/s {gbs:8.1f} GB/s "
                      f"{100 * gbs / best_gbs:5.1f}% of the strongest reference", file=progress, flush=True)
    return results


def _assert_clean(s: Setup, what: str) -> None:
    """Timings are of clean checks only: a run that reports violations times the ring instead."""
    n = int(s.ring.write_index[0])  # syncs
    assert n == 0, f"{what} reported {n} violations"


def meta(device: torch.device, copy_gbs: float) -> dict:
    import subprocess

    info = {"torch": torch.__version__, "device": str(device), "copy_gb_per_s": round(copy_gbs, 1)}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        # KVCANARY_COMMIT names the commit where the checkout carries no (or a stale) .git
        info["commit"] = os.environ.get("KVCANARY_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    return info


def plot(results: dict, path: str) -> None:
    """Bar chart of % of copy bandwidth per workload, provider, op and real-KV mode (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["results"]
    labels = [f"{r['workload']}\n{r['provider']} {r['op']} {r['real_kv']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.6), 4))
    ax.bar(range(len(rows)), [r.get("pct_best_bw", r["pct_copy_bw"]) for r in rows])
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("% of the strongest measured bandwidth reference")
    ax.set_title(f"kv-canary ops on {results['meta'].get('gpu', results['meta']['device'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--providers", nargs="+", default=None, help="default: triton torch on cuda, numba (when it imports) torch on cpu")
    ap.add_argument("--small", action="store_true", help="the CPU-sized workloads")
    ap.add_argument("--workloads", nargs="+", default=None, help="op workloads to run (default: all)")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")


def bench_main(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"kv-canary: bench device must be available, got {device} without a CUDA GPU")
    cpu_fast = ["numba"] if device.type == "cpu" and api.numba_available() else []
    providers = args.providers or (["triton", "torch"] if device.type == "cuda" else cpu_fast + ["torch"])
    workloads = CPU_WORKLOADS if (args.small or device.type == "cpu") else WORKLOADS
    if getattr(args, "workloads", None):
        known = {**WORKLOADS, **CPU_WORKLOADS}
        unknown = [n for n in args.workloads if n not in known]
        if unknown:
            raise ValueError(f"kv-canary: bench workloads must be among {sorted(known)}, got {unknown}")
        workloads = {n: known[n] for n in args.workloads}
    out = run(device, providers, workloads)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    if args.plot:
        plot(out, args.plot)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    out = bench_main(ap.parse_args())
    print(json.dumps(out["meta"]))


if __name__ == "__main__":
    main()
