"""Where one whole call's time goes, with the canary and without: a diagnosis beside ``user_cost.py``.

``user_cost.py`` says how much slower a whole ``generate_batch``-style call is with the canary; this says where
the difference lies. After warm-up calls of each arm, two calls per arm (alternating) run under ``torch.profiler``
(CPU and CUDA activity) and the script prints, per call: its seconds, the GPU's busy time (the union of its kernel
and copy intervals: a call whose busy time is far below its length is bound by the host), the host's time in
each CUDA runtime/driver call (synchronizes, graph launches and instantiations, allocations), and for canary
arms the GPU's kernels by total time, the kernels only the canary runs, and the kernels and copies of names the
engine runs too that the canary launches more often (its generic torch work: copies, fills, gathers). Then a
cProfile of the adapter's hooks in one more canary call: who allocates, copies, captures and synchronizes.

    PYTHONPATH=$PWD python3 benchmarks/call_trace.py --model-size 1b --workload prefill

Arms and workloads are ``user_cost.py``'s (``fast``: CUDA graphs and async batching; ``canary_fast``: the same
with ``attach(model)``). The profiler slows every host call a little, alike in both arms.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import user_cost  # noqa: E402

from kvcanary.bench.workload import build_model  # noqa: E402


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """The union's length of (start, end) intervals in microseconds, in milliseconds."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total, end = total + e - s, e
        elif e > end:
            total, end = total + e - end, e
    return total / 1e3


ENGINE_NAMES: set = set()  # kernel names the arms without the canary ran (traced_call): the rest are the canary's
# kernel name -> [launches, us] of the latest call of an arm without the canary: the names that the canary runs more
# often than it are the generic work (copies, fills) it adds
ENGINE_KERNELS: dict = {}


def added_kernels(engine: dict, canary: dict) -> dict:
    """name -> (more launches, more us) for the kernels and copies that both calls ran, the canary's more often:
    the torch copies, fills and gathers the canary adds under the engine's own kernel names."""
    return {name: (n - engine[name][0], us - engine[name][1]) for name, (n, us) in canary.items()
            if name in engine and n > engine[name][0]}


def traced_call(model, arm: str, prompts, new, top: int) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run = user_cost.run_arm(model, arm, prompts, new)
    gpu, api, kernels = [], {}, {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu.append((e.time_range.start, e.time_range.end))
            k = kernels.setdefault(e.name[:70], [0, 0.0])
            k[0], k[1] = k[0] + 1, k[1] + e.time_range.end - e.time_range.start
        elif e.name.startswith("cu"):  # (runtime cuda*, driver cu* calls)
            a = api.setdefault(e.name, [0, 0.0])
            a[0], a[1] = a[0] + 1, a[1] + e.cpu_time_total
    lines = [f"== {arm}: call {run['seconds']:.3f} s, GPU busy {busy_ms(gpu):.1f} ms, {len(gpu)} GPU events, "
             f"violations {run['violations']}"]
    lines += [f"   host {name}: {n} calls, {us / 1e3:.1f} ms" for name, (n, us) in
              sorted(api.items(), key=lambda kv: -kv[1][1])[:top]]
    if not arm.startswith("canary"):
        ENGINE_NAMES.update(kernels)
        ENGINE_KERNELS.clear()
        ENGINE_KERNELS.update(kernels)
    else:
        lines += [f"   GPU {name}: {n}, {us / 1e3:.2f} ms" for name, (n, us) in
                  sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]]
        if ENGINE_KERNELS:  # (an arm without the canary ran first: what only the canary runs, by total time)
            own = {k: v for k, v in kernels.items() if k not in ENGINE_NAMES}
            n_own, us_own = sum(v[0] for v in own.values()), sum(v[1] for v in own.values())
            lines.append(f"   canary-only kernels (names no arm without the canary ran): {n_own}, "
                         f"{us_own / 1e3:.2f} ms")
            lines += [f"     {name}: {n}, {us / 1e3:.2f} ms" for name, (n, us) in
                      sorted(own.items(), key=lambda kv: -kv[1][1])[:top]]
            more = added_kernels(ENGINE_KERNELS, kernels)
            lines.append(f"   shared names run more often (than the last call without the canary): "
                         f"{sum(v[0] for v in more.values())} more, {sum(v[1] for v in more.values()) / 1e3:.2f} ms")
            lines += [f"     {name}: +{n}, {us / 1e3:+.2f} ms" for name, (n, us) in
                      sorted(more.items(), key=lambda kv: -kv[1][0])[:top]]
    return lines


def hook_profile(model, arm: str, prompts, new) -> str:
    """cProfile of the adapter's hooks (the engine thread's canary work) over one call."""
    prof = cProfile.Profile()
    restore = user_cost.wrap_hooks(prof)
    try:
        user_cost.run_arm(model, arm, prompts, new)
    finally:
        restore()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    stats.print_callers("empty|copy_|capture_end|synchronize|replay")
    stats.sort_stats("cumtime").print_stats(30)
    # (paths relative to the checkout or site-packages: the lines name the package, not the machine)
    text = out.getvalue().replace(os.getcwd() + "/", "")
    return "\n".join(line[:170] for line in text.splitlines() if line.strip())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="1b", choices=("1b", "8b"))
    p.add_argument("--workload", default="prefill", choices=("serving", "batch1", "batch1_1k", "batch1_4k", "prefill"))
    p.add_argument("--arms", default="fast,canary_fast")
    p.add_argument("--warmup", type=int, default=2, help="untraced calls of each arm first")
    p.add_argument("--top", type=int, default=12, help="rows per table")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kv-canary: call_trace.py needs a CUDA GPU (the arms run CUDA graphs), got none")
    arms = a.arms.split(",")
    unknown = [x for x in arms if x not in user_cost.ARMS + user_cost.EXTRA_ARMS]
    if unknown:
        raise SystemExit(f"kv-canary: call_trace.py --arms must name user_cost.py's arms, got {unknown}")
    model = build_model(a.model_size, torch.device("cuda"), torch.bfloat16, 4096 + 256)
    prompts, new = user_cost.workload(a.workload)
    for _ in range(a.warmup):
        for arm in arms:
            user_cost.run_arm(model, arm, prompts, new)
    print(f"{a.model_size} {a.workload} on {torch.cuda.get_device_name()}, commit {os.environ.get('KVCANARY_COMMIT')}")
    for arm in arms + arms:  # (twice, alternating: a call's own drift shows)
        print("\n".join(traced_call(model, arm, prompts, new, a.top)), flush=True)
    canary = [x for x in arms if x.startswith("canary")]
    if canary:
        print(hook_profile(model, canary[0], prompts, new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
