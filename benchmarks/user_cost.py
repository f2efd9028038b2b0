"""What a user pays for the canary: whole generations through transformers' public API, against the
engine's fastest configuration.

The arms (``--arms``) run the same workload through transformers' serving API in one process, alternating
in rounds (the arm order rotates each round so drift in the host or the GPU falls on every arm alike):

- ``fast``: the engine's fastest configuration (CUDA graphs and async batching on), no canary; ``canary_fast``:
  the same with ``attach(model)`` (docs/transformers.md "Async batching");
- ``sync``: CUDA graphs and async batching off, no canary; ``canary``: the same with ``attach(model)``;
- ``graphs``: CUDA graphs on, async batching off, no canary; ``canary_graphs``: the same with ``attach(model)``;
  ``canary_graphs_noslots``: with the slot checks off too (``reserved_check``, ``nonfinite_check``: docs/slots.md);
  ``canary_graphs_poison``: with the debug ``poison_on_free`` on; ``canary_fast_nochecks``: ``canary_fast`` with the
  write and attention-metadata checks off (``write_check``, ``attention_check``: docs/write_check.md), their cost's twin.

Each call is timed whole (the engine's set-up and graph captures included: that is what a user's call costs).
Reported per workload: tokens/s per arm (median over rounds), the canary arms' ratios with their spread over
rounds, whether greedy tokens are identical (canary against sync: the same batches; fast against sync: graphs
pad batches, so rounding may differ), and the canary's violations. Where the time goes: ``call_trace.py``.

    PYTHONPATH=$PWD python3 benchmarks/user_cost.py --model-size 1b --rounds 3 --json out.json

Workloads: ``serving`` (32 requests, prompts of 144-512 tokens beginning with one of 8 shared system
prefixes, 8..128 new tokens each, so they finish at different times), ``batch1`` (one 512-token prompt,
128 new tokens), ``prefill`` (8 prompts of 4,096 tokens, 1 new token).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcanary.bench.workload import VOCAB, build_model  # noqa: E402

ARMS = ("fast", "sync", "canary", "graphs", "canary_graphs")
EXTRA_ARMS = ("canary_graphs_noslots", "canary_graphs_poison", "canary_fast", "canary_fast_nochecks")
CANARY_GRAPH_ARMS = ("canary_graphs",) + EXTRA_ARMS  # (graphs on, the canary attached)
BLOCK = 32
# batch 1 at longer prompts: the prompt length changes the canary's share (its read checks grow with the context)
BATCH1_LONG = {"batch1_1k": (1024, 256), "batch1_4k": (4096, 256)}
TUNING: dict[str, bool] = {}  # --tuning: the adapter's private step-path toggles, for a diagnosis
DELS: list[tuple[float, float]] = []  # --timers: (start, seconds) of each batch processor's __del__


def watch_processor_del() -> None:
    """Time transformers' batch-processor finalizer (a gc.collect and an empty_cache): where it runs inside a
    timed call, that call pays it (both arms should, in the engine's stop)."""
    from transformers.generation.continuous_batching import continuous_api

    cls = continuous_api.ContinuousBatchProcessor
    orig = cls.__del__

    def timed_del(self):
        t = time.perf_counter()
        try:
            orig(self)
        finally:
            DELS.append((t, time.perf_counter() - t))

    cls.__del__ = timed_del


def watch_sessions() -> None:
    """Time each canary session's set-up and close (host seconds) and keep its step-graph counts, on the session."""
    from kvcanary.integrations.transformers.session import Session

    init, close = Session.__init__, Session.close

    def timed_init(self, *args, **kwargs):
        t = time.perf_counter()
        init(self, *args, **kwargs)
        self.setup_s, self.close_s, self.finalizer_in_close_s = time.perf_counter() - t, 0.0, 0.0

    def timed_close(self):
        if self.closed:
            return
        g = self.runner.graphs
        t = time.perf_counter()
        close(self)
        spent = time.perf_counter() - t
        # the close drops the session's reference to the engine's batch processor, often its last: the engine's own
        # finalizer (a gc.collect and an empty_cache, 150-200 ms on the H100's host) then runs inside the close, as
        # it runs inside the call without the canary; it is the engine's, not the canary's (watch_processor_del)
        self.finalizer_in_close_s = sum(d for start, d in DELS if t <= start <= t + spent)
        self.close_s = spent - self.finalizer_in_close_s
        self.graph_counts = {} if g is None else {"captures": g.captures, "replays": g.replays}

    Session.__init__, Session.close = timed_init, timed_close


def profile_hooks(out: str) -> None:
    """cProfile the adapter's before, after and update hooks (in the engine's thread) into ``out``."""
    import atexit
    import cProfile
    import pstats

    prof = cProfile.Profile()
    wrap_hooks(prof, timing_only=True)  # (the timers run only)

    def dump():
        if not prof.getstats():  # (no timers run reached a hook: a failed run, or no canary arm)
            return
        with open(out, "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
            pstats.Stats(prof, stream=f).sort_stats("cumtime").print_stats(60)

    atexit.register(dump)


def wrap_hooks(prof, timing_only: bool = False):
    """Run ``prof`` (a cProfile.Profile) inside the adapter's before, after and update hooks (``timing_only``: of
    sessions with the private ``timing`` toggle on); returns a function that puts the hooks back."""
    from kvcanary.integrations.transformers import session

    saved = {}
    for name in ("_before", "_after", "_before_update", "_after_update"):
        orig = saved[name] = getattr(session.Session, name)

        def hooked(self, *args, _orig=orig):
            if timing_only and not self.timing:
                return _orig(self, *args)
            prof.enable()
            try:
                return _orig(self, *args)
            finally:
                prof.disable()

        setattr(session.Session, name, hooked)
    return lambda: [setattr(session.Session, n, f) for n, f in saved.items()]


def workload(name: str, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompts, new tokens per request) of a named workload, seeded."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(5, VOCAB, (n,), generator=g).tolist()

    if name == "serving":
        systems = [rand(128) for _ in range(8)]
        prompts, new = [], []
        for i in range(32):
            length = 144 + int(torch.randint(0, 512 - 144 + 1, (1,), generator=g))
            prompts.append(systems[i % 8] + rand(length - 128))
            new.append(8 + (i * 120) // 31)
        return prompts, new
    if name == "batch1":
        return [rand(512)], [128]
    if name in BATCH1_LONG:  # batch 1 at a longer prompt: (prompt tokens, new tokens)
        prompt, new = BATCH1_LONG[name]
        return [rand(prompt)], [new]
    if name == "prefill":
        return [rand(4096) for _ in range(8)], [1] * 8
    raise ValueError(f"kv-canary: workload must be serving, batch1, {', '.join(BATCH1_LONG)} or prefill, "
                     f"got {name!r}")


def run_arm(model, arm: str, prompts, new_tokens, timers: bool = False) -> dict:
    """One whole generation; returns seconds, generated tokens per request, violations (``timers``: and the
    adapter's per-step host times, its private ``timing`` toggle on)."""
    from transformers import GenerationConfig
    from kvcanary.integrations.transformers.reach import cb_config

    fast = arm in ("fast", "canary_fast", "canary_fast_nochecks")
    graphs = fast or arm in ("graphs",) + CANARY_GRAPH_ARMS
    longest = max(len(p) + n for p, n in zip(prompts, new_tokens))
    blocks = len(prompts) * (longest // BLOCK + 2) + 16
    cbc = cb_config(block_size=BLOCK, num_blocks=blocks, max_batch_tokens=1024,
                                   use_cuda_graph=graphs, use_async_batching=fast, scheduler_type="fifo")
    gen = GenerationConfig(max_new_tokens=max(new_tokens), eos_token_id=-1, do_sample=False)
    handle = None
    if arm in ("canary",) + CANARY_GRAPH_ARMS:
        from kvcanary import CanaryConfig
        from kvcanary.integrations.transformers import attach

        fields = {"canary_graphs_noslots": dict(reserved_check=False, nonfinite_check=False),
                  "canary_graphs_poison": dict(poison_on_free=True),
                  "canary_fast_nochecks": dict(write_check=False, attention_check=False)}.get(arm)
        from kvcanary.integrations.transformers.handle import tuned

        with tuned(**{**TUNING, **({"timing": True} if timers else {})}):
            handle = attach(model, None if fields is None else CanaryConfig.from_env(**fields), mode="log")
    _sync()
    t0 = time.perf_counter()
    try:
        # the serving API: each request its own budget, so they finish at different times; warm-up (graph
        # captures at the largest sizes) is part of the call, as in generate_batch
        results = {}
        with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cbc,
                                                       block=True, timeout=60) as manager:
            for i, (prompt, n) in enumerate(zip(prompts, new_tokens)):
                manager.add_request(prompt, request_id=f"r{i:03d}", max_new_tokens=n)
            while len(results) < len(prompts):
                r = manager.get_result(timeout=5)
                if r is not None and r.error is not None:
                    raise RuntimeError(f"kv-canary: request {r.request_id} failed in arm {arm}: {r.error}")
                if r is not None and r.is_finished():
                    results[r.request_id] = r
                elif r is None and not manager.is_running():
                    raise RuntimeError(f"kv-canary: the engine stopped with {len(results)} of {len(prompts)} done")
        _sync()
        t1 = time.perf_counter()
        seconds = t1 - t0
    finally:
        violations = len(handle.violations) if handle is not None else 0
        steps = [t for session in handle.sessions for t in session.timings] if handle is not None else []
        sessions = [] if handle is None else handle.sessions
        if handle is not None:
            handle.detach()
    out = results
    tokens = [list(o.generated_tokens) for _, o in sorted(out.items())]
    del out
    gc.collect()
    once = [{"setup_s": s.setup_s, "close_s": s.close_s, "finalizer_in_close_s": s.finalizer_in_close_s,
             **getattr(s, "graph_counts", {})} for s in sessions
            if hasattr(s, "setup_s")]  # (watch_sessions: --timers)
    dels = sum(d for t, d in DELS if t0 <= t <= t1)  # (the processor finalizer's seconds inside the call)
    return {"seconds": seconds, "tokens": tokens, "violations": violations, "steps": steps, "sessions": once,
            "finalizer_s": dels}


def host_split(run: dict) -> dict:
    """The canary's host time per step of a ``timers`` run, decode steps (one token per request) apart from the
    rest: medians of its before, after and update parts, their sum, and the steps' count (microseconds)."""
    out = {}
    for kind, keep in (("decode", lambda t: t["tokens"] == t["batch"]), ("other", lambda t: t["tokens"] != t["batch"])):
        steps = [t for t in run["steps"] if keep(t)]
        if steps:
            part = {k: statistics.median(t[k] for t in steps) * 1e6 for k in ("before_s", "after_s", "update_s")}
            total = statistics.median((t["before_s"] + t["after_s"] + t["update_s"]) for t in steps) * 1e6
            out[kind] = {"steps": len(steps), "total_us": total, **{k.replace("_s", "_us"): v for k, v in part.items()}}
    # the call's canary host time in all: set-up and close once per session (the engine makes one per call),
    # every step's parts summed; against the call's extra seconds it says what host time leaves unexplained
    steps_s = sum(t["before_s"] + t["after_s"] + t["update_s"] for t in run["steps"])
    out["call"] = {"seconds": run["seconds"], "steps_ms": steps_s * 1e3,
                   "setup_ms": sum(s["setup_s"] for s in run["sessions"]) * 1e3,
                   "close_ms": sum(s["close_s"] for s in run["sessions"]) * 1e3,
                   "engine_finalizer_in_close_ms": sum(s["finalizer_in_close_s"] for s in run["sessions"]) * 1e3,
                   "captures": sum(s.get("captures", 0) for s in run["sessions"]),
                   "replays": sum(s.get("replays", 0) for s in run["sessions"])}
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def spread(xs: list[float]) -> dict:
    """Median, range and count of per-round values, the values themselves (``--pool`` joins calls' rounds) and a
    distribution-free ~95% interval for the median (None below six values; with eight it is the whole range)."""
    from kvcanary.bench.lockstep import median_interval

    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "values": list(xs),
            "median_ci95": median_interval(xs)}


def pool(paths: list[str], key: str = "canary_fast_over_fast") -> dict:
    """Per workload: the rounds of every file's ``key`` (its per-round values) joined, as ``spread`` gives them.
    Files of different models, or a workload whose values a file lacks (written before they were kept), raise."""
    files = []
    for path in paths:
        with open(path) as f:
            files.append(json.load(f))
    models = {d.get("model_size") for d in files}
    if len(models) != 1:
        raise ValueError(f"kv-canary: --pool expects files of one model size, got {sorted(map(str, models))}")
    out = {}
    for name in files[0]["workloads"]:
        values = []
        for path, d in zip(paths, files):
            w = d["workloads"].get(name, {}).get(key)
            if w is None or "values" not in w:
                raise ValueError(f"kv-canary: --pool needs per-round values of {key} for workload {name!r} in every "
                                 f"file, got none in {path}")
            values += [v for v in w["values"] if v == v]  # (an arm that did not run: nan)
        if values:
            out[name] = spread(values)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-size", default="1b", choices=("tiny", "1b", "8b"))
    p.add_argument("--workloads", default="serving,batch1,prefill")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=400.0, help="stop starting rounds after this many seconds")
    p.add_argument("--json", default=None)
    p.add_argument("--arms", default=",".join(ARMS), help="a subset for a CPU smoke run: sync,canary")
    p.add_argument("--device", default="cuda")
    p.add_argument("--timers", action="store_true", help="after the rounds, one more run per canary arm with the "
                   "adapter's step timers on (not in the ratios): its host time per step")
    p.add_argument("--profile-hooks", default=None, help="with --timers: cProfile the adapter's hooks in the "
                   "timers runs into this file")
    p.add_argument("--pool", nargs="+", default=None, metavar="JSON", help="run nothing: join the canary_fast/fast "
                   "rounds of these result files (one model) and print their median with its interval")
    p.add_argument("--tuning", default="", help="private step-path toggles for a diagnosis: fused_steps=0,...")
    a = p.parse_args(argv)
    if a.pool:
        try:
            pooled = pool(a.pool)
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"kv-canary: user_cost.py --pool: {e}") from None
        for name, v in pooled.items():
            ci = v["median_ci95"]
            print(f"[{name}] canary_fast/fast over {v['n']} rounds: median {v['median']:.3f}x, range "
                  f"[{v['min']:.3f}, {v['max']:.3f}], ~95% interval of the median "
                  + ("n/a (under six rounds)" if ci is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]"), file=sys.stderr)
        print(json.dumps(pooled, indent=1))
        return 0
    for item in filter(None, a.tuning.split(",")):
        key, _, value = item.partition("=")
        TUNING[key] = value not in ("0", "false", "False")
    arms = tuple(a.arms.split(","))
    if a.timers:
        watch_processor_del()
        watch_sessions()
        if a.profile_hooks:
            profile_hooks(a.profile_hooks)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kv-canary: user_cost.py needs a CUDA GPU for --device cuda (the fast path is CUDA graphs)")
    import transformers

    start = time.perf_counter()
    model = build_model(a.model_size, torch.device(a.device), torch.bfloat16 if a.device == "cuda" else torch.float32, 4096 + 256)
    result = {"model_size": a.model_size, "transformers": transformers.__version__, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "commit": os.environ.get("KVCANARY_COMMIT"), "workloads": {}}
    for name in a.workloads.split(","):
        prompts, new = workload(name)
        for arm in arms:  # warm-up: kernels, allocator, autotuning
            t = time.perf_counter()
            run_arm(model, arm, prompts, new)
            # (a line per warm-up: a call cut by its time limit still says how far it got)
            print(f"[{name}] warm-up {arm}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        runs = {arm: [] for arm in arms}
        for r in range(a.rounds):
            if r and time.perf_counter() - start > a.budget_s:
                break
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            for arm in order:
                runs[arm].append(run_arm(model, arm, prompts, new))
            print(f"[{name}] round {r + 1}: " + ", ".join(
                f"{arm} {runs[arm][-1]['seconds']:.2f} s" + (f" (finalizer {runs[arm][-1]['finalizer_s'] * 1e3:.0f} ms)"
                                                            if a.timers else "") for arm in arms),
                file=sys.stderr, flush=True)
        ntok = sum(len(t) for t in runs[arms[0]][0]["tokens"])  # (every arm generates as many: eos is off)
        tps = {arm: [ntok / x["seconds"] for x in runs[arm]] for arm in arms}
        tps.update({arm: [float("nan")] for arm in ARMS + EXTRA_ARMS if arm not in arms})
        runs.update({arm: [] for arm in ARMS + EXTRA_ARMS if arm not in arms})
        first = lambda arm: runs[arm][0]["tokens"] if runs[arm] else None  # noqa: E731
        result["workloads"][name] = {
            "requests": len(prompts), "generated_tokens": ntok,
            "tokens_per_s": {arm: spread(v) for arm, v in tps.items()},
            "canary_over_fast": spread([c / f for c, f in zip(tps["canary"], tps["fast"])]),
            "canary_over_sync": spread([c / s for c, s in zip(tps["canary"], tps["sync"])]),
            "fast_over_sync": spread([f / s for f, s in zip(tps["fast"], tps["sync"])]),
            "canary_graphs_over_fast": spread([c / f for c, f in zip(tps["canary_graphs"], tps["fast"])]),
            "canary_graphs_over_graphs": spread([c / g for c, g in zip(tps["canary_graphs"], tps["graphs"])]),
            "graphs_over_fast": spread([g / f for g, f in zip(tps["graphs"], tps["fast"])]),
            "canary_graphs_noslots_over_fast": spread([c / f for c, f in zip(tps["canary_graphs_noslots"], tps["fast"])]),
            "canary_fast_over_fast": spread([c / f for c, f in zip(tps["canary_fast"], tps["fast"])]),
            # the write and attention-metadata checks' share: the canary with them over the canary without them
            "canary_fast_over_nochecks": spread([c / n for c, n in zip(tps["canary_fast"], tps["canary_fast_nochecks"])]),
            # per round, the faster canary configuration over the engine's fastest one (graphs+async or none)
            "best_canary_over_best": spread([max(cf, c) / max(f, s) for cf, c, f, s in zip(
                tps["canary_fast"], tps["canary"], tps["fast"], tps["sync"])]) if {"canary_fast", "canary", "fast", "sync"} <= set(arms) else None,
            "tokens_identical_canary_fast_vs_fast": all(x["tokens"] == first("fast") for x in runs["canary_fast"]),
            "tokens_identical_canary_fast_vs_graphs": all(x["tokens"] == runs["graphs"][0]["tokens"]
                                                          for x in runs["canary_fast"]) if runs["graphs"] else None,
            "canary_graphs_poison_over_graphs": spread([c / g for c, g in zip(tps["canary_graphs_poison"], tps["graphs"])]),
            "tokens_identical_canary_graphs_vs_graphs": all(x["tokens"] == runs["graphs"][0]["tokens"]
                                                            for x in runs["canary_graphs"]) if runs["graphs"] else None,
            "tokens_identical_canary_vs_sync": all(x["tokens"] == first("sync") for x in runs["canary"]),
            # the engine's own run-to-run determinism, the yardstick for the two comparisons above
            "tokens_identical_sync_vs_sync": all(x["tokens"] == first("sync") for x in runs["sync"]),
            "tokens_identical_fast_vs_sync": all(x["tokens"] == first("sync") for x in runs["fast"]),
            "tokens_identical_fast_vs_fast": all(x["tokens"] == first("fast") for x in runs["fast"]),
            "violations": sum(x["violations"] for arm in ("canary",) + CANARY_GRAPH_ARMS for x in runs[arm]),
        }
        w = result["workloads"][name]
        if a.timers:
            w["canary_host_per_step"] = {}
            for arm in (x for x in arms if x in ("canary",) + CANARY_GRAPH_ARMS):
                split = w["canary_host_per_step"][arm] = host_split(run_arm(model, arm, prompts, new, timers=True))
                call = split["call"]
                print(f"[{name}] {arm} canary host per step (us): " + "; ".join(
                    f"{kind} x{v['steps']}: {v['total_us']:.0f} (before {v['before_us']:.0f}, after {v['after_us']:.0f}, "
                    f"update {v['update_us']:.0f})" for kind, v in split.items() if kind != "call")
                    + f"; call {call['seconds']:.3f} s: steps {call['steps_ms']:.1f} ms, set-up {call['setup_ms']:.1f} ms, "
                    f"close {call['close_ms']:.1f} ms (+ the engine's finalizer {call['engine_finalizer_in_close_ms']:.0f} ms), captures {call['captures']}, replays {call['replays']}",
                    file=sys.stderr, flush=True)
        if runs["canary_fast"]:
            print(f"[{name}] tok/s fast {w['tokens_per_s']['fast']['median']:.0f}, canary_fast "
                  f"{w['tokens_per_s']['canary_fast']['median']:.0f}: {w['canary_fast_over_fast']['median']:.3f}x "
                  f"[{w['canary_fast_over_fast']['min']:.3f}, {w['canary_fast_over_fast']['max']:.3f}]; identical to "
                  f"fast {w['tokens_identical_canary_fast_vs_fast']}; violations {w['violations']}",
                  file=sys.stderr, flush=True)
        if runs["canary_fast_nochecks"]:
            v = w["canary_fast_over_nochecks"]
            print(f"[{name}] canary_fast over canary_fast_nochecks (the write and attention checks' share): "
                  f"{v['median']:.3f}x [{v['min']:.3f}, {v['max']:.3f}]", file=sys.stderr, flush=True)
        print(f"[{name}] tok/s fast {w['tokens_per_s']['fast']['median']:.0f}, sync "
              f"{w['tokens_per_s']['sync']['median']:.0f}, canary {w['tokens_per_s']['canary']['median']:.0f}; "
              f"canary/fast {w['canary_over_fast']['median']:.3f}x; canary+graphs/fast "
              f"{w['canary_graphs_over_fast']['median']:.3f}x; identical {w['tokens_identical_canary_vs_sync']}; "
              f"violations {w['violations']}", file=sys.stderr, flush=True)
        if w["best_canary_over_best"] is not None:
            b = w["best_canary_over_best"]
            print(f"[{name}] best canary / best engine {b['median']:.3f}x [{b['min']:.3f}, {b['max']:.3f}]",
                  file=sys.stderr, flush=True)
    text = json.dumps(result, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
