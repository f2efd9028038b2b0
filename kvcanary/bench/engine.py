"""kv-canary's cost inside a real engine: transformers continuous batching with and without the canary.

A Llama-shaped model with random weights (built from a config, no download) runs the same workload
alternately without and with ``kvcanary.integrations.transformers.attach`` in one process, after a
warm-up round. The engine is driven step by step on this thread (prepare_next_batch, _generation_step,
update_batch), so every step is timed without the background thread's polling. Reported as JSON:

- wall clock per measured engine step (median, p10, p90) without and with the canary, their ratio, and
  the canary's host time inside the step (its before/after hooks plus its update bookkeeping);
- GPU time of the canary's kernels vs the model forward's, from torch.profiler ranges
  (``kvcanary_before`` + ``kvcanary_after`` vs ``engine_forward``) over a profiled canary run;
- correctness in the same run: greedy tokens identical with and without the canary, zero violations.

Engine settings: sync batching, CUDA graphs off, no compile; attention ``paged|kvc_varlen``
(``kvcanary.bench.varlen_attention``) on CUDA and transformers' ``paged|sdpa`` on CPU.
``kvcanary bench --engine`` runs the registered workloads (``kvcanary.bench.suite.ENGINE_WORKLOADS``),
one process each; this module measures one:

    python -m kvcanary.bench.engine --device cuda --model-size 8b --batch 64 --context 8192 --mode decode
    python -m kvcanary.bench.engine --device cpu --model-size tiny --batch 4 --context 64   # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from kvcanary.bench import lockstep
from kvcanary.bench import suite as bench_suite
from kvcanary.bench.workload import (SIZES, VOCAB, Workload, attach_options, build_model, canary_config, environment,
                                     generated, host_part, quantiles)

__all__ = ["SIZES", "VOCAB", "Workload", "build_model", "canary_config", "environment", "main", "quantiles",
           "run_once"]


def run_once(model, wl: Workload, canary: bool, profile: bool = False, trace: str | None = None) -> dict:
    """One full generation of the workload on this thread.

    A step's wall time runs from the start of its ``prepare_next_batch`` to the start of the next
    step's: nothing beyond the engine's own syncs is added, so device work the canary leaves running
    after the engine's sync (TAIL on its side stream) is charged to whichever step it delays. The
    device is synchronized only before the first step and after the last. The whole generation is
    split into phases (set-up, generation loop, collection, teardown) so runs can be compared beyond
    the timed steps.
    """
    from transformers import GenerationConfig
    from kvcanary.integrations.transformers.reach import cb_config

    from kvcanary.integrations.transformers.reach import attach_with

    sync = torch.cuda.synchronize if wl.device.type == "cuda" else (lambda: None)
    gen = GenerationConfig(max_new_tokens=wl.new_tokens, do_sample=False, eos_token_id=-1)
    sync()
    t_start = time.perf_counter()
    handle = attach_with(model, config=wl.canary_config, mode="log", timing=True, **wl.attach_options) if canary else None
    manager = bp = session = None
    steps, parts, outputs, phases = [], [], {}, {}
    prof = ranges = kernels = None
    canary_memory = None
    if wl.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(wl.device)
    try:
        manager = model.init_continuous_batching(gen, cb_config(**wl.cb))
        bp = manager._create_batch_processor()
        manager.batch_processor = bp
        for i, p in enumerate(wl.prompts):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=wl.max_new_tokens(i))
        session = handle.sessions[-1] if canary else None
        if session is not None:
            canary_memory = session.canary.memory()
            session.canary.host_times = {"runtime_s": 0.0, "launch_s": 0.0}
        if profile:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if wl.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=acts)
        sync()
        t_loop = time.perf_counter()
        phases["setup_s"] = t_loop - t_start
        n, profiling, profiled, num_steps = 0, False, 0, 0
        prev = None  # (start, measured, canary host seconds by part) of the previous step
        while True:
            t0 = time.perf_counter()
            if prev is not None and prev[1]:
                steps.append(t0 - prev[0])
                if prev[2] is not None:
                    parts.append(prev[2])
            prev = None
            if not bp.prepare_next_batch():
                break
            num_steps += 1
            batch, tokens = len(bp.inputs_and_outputs.requests_in_batch), bp.inputs_and_outputs.total_seqlen_q
            take = wl.measured(batch, tokens) and n >= wl.args.skip
            if take and prof is not None and not profiling and profiled < wl.args.profile_steps:
                prof.__enter__()
                profiling = True
            timed = take and not profiling  # steps under the profiler are not timed
            before = dict(session.canary.host_times) if session is not None else None
            manager._generation_step()
            bp.update_batch()
            prev = (t0, timed, host_part(session, before) if session is not None else None)
            if wl.measured(batch, tokens):
                n += 1
            if profiling and take:
                profiled += 1
                if profiled >= wl.args.profile_steps:
                    sync()  # the side stream's kernels finish before the profiler stops collecting
                    prof.__exit__(None, None, None)
                    profiling = False
                    break  # a profiled run is for the GPU split only: the rest of the generation is not needed
        sync()
        t_end = time.perf_counter()
        phases["loop_s"] = t_end - t_loop
        phases["steps"] = num_steps
        if profiling:
            prof.__exit__(None, None, None)
        if prof is not None and not profiled:
            prof = None  # no measured step ran: nothing was profiled
        if prof is not None:
            # The device times come from the exported trace (bench_suite.trace_ranges)
            path = trace or os.path.join(tempfile.mkdtemp(), "trace.json")
            prof.export_chrome_trace(path)
            ranges = bench_suite.trace_ranges(path)
            kernels = bench_suite.trace_kernels(path)  # the canary's device time by kernel (fused steps: before)
            if not trace:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        outputs = generated(manager, bp)
        violations = 0
        if handle is not None:
            handle.flush()
            violations = len(handle.violations)
        phases["collect_s"] = time.perf_counter() - t_end
    finally:
        t_down = time.perf_counter()
        if handle is not None:
            handle.detach()
        t_gc = time.perf_counter()
        # Every reference to the engine (the session holds its batch processor and so its KV cache) goes
        # before the allocator's cache is emptied: transformers sizes the next cache by free memory.
        manager = bp = session = handle = None
        gc.collect()
        t_empty = time.perf_counter()
        if wl.device.type == "cuda":
            torch.cuda.empty_cache()
        t_done = time.perf_counter()
        phases.update(teardown_s=t_done - t_down, detach_s=t_gc - t_down, gc_s=t_empty - t_gc,
                      empty_cache_s=t_done - t_empty)
    peak = torch.cuda.max_memory_allocated(wl.device) if wl.device.type == "cuda" else None
    made = sum(len(v) for v in outputs.values())
    phases["generated_tokens"] = made
    phases["tokens_per_s"] = made / phases["loop_s"] if phases.get("loop_s") else None
    return {"steps": steps, "parts": parts, "canary_s": [p["total_s"] for p in parts], "outputs": outputs,
            "violations": violations, "profile": ranges, "kernels": kernels, "peak_bytes": peak,
            "canary_memory": canary_memory, "phases": phases}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--steps", type=int, default=24, help="decode steps per run (decode mode)")
    ap.add_argument("--skip", type=int, default=2, help="measured-kind steps skipped at the start of each run")
    ap.add_argument("--stagger", type=int, default=0, metavar="K",
                    help="decode: request i generates K * i more tokens, so at the end the batch shrinks by one "
                         "request every K steps (as in serving); then those steps are the measured ones")
    ap.add_argument("--rounds", type=int, default=2, help="alternating (without, with) rounds after warm-up, at least")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="after --rounds, keep adding rounds while one more (of the average length) fits in this "
                         "many seconds of rounds (0 = exactly --rounds)")
    ap.add_argument("--lockstep", action="store_true",
                    help="pair steps, not runs: two engines (without and with the canary) on one model step in "
                         "turn and each step is compared with its twin (bench/lockstep.py; twice the KV memory)")
    ap.add_argument("--aa", action="store_true",
                    help="with --lockstep: leave the second engine bare too (an A/A run: the overhead it prints is "
                         "the method's noise floor on this host)")
    ap.add_argument("--max-rounds", type=int, default=40, help="most rounds under --budget-s")
    ap.add_argument("--attention", choices=("varlen", "sdpa"), default=None,
                    help="paged attention: varlen (kvcanary.bench.varlen_attention; default on cuda) or the engine's "
                         "dense paged|sdpa (default on cpu)")
    ap.add_argument("--warmup-context", type=int, default=256,
                    help="prompt length of the warm-up generations (kernels and allocator; 0 = --context)")
    ap.add_argument("--trace", default=None, metavar="PATH", help="chrome trace of the profiled run")
    ap.add_argument("--chunk", type=int, default=0, help="max_batch_tokens (default 4096 on cuda, 256 on cpu)")
    ap.add_argument("--block-size", type=int, default=0, help="default 256 on cuda, 16 on cpu")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled run (GPU time split)")
    ap.add_argument("--profile-steps", type=int, default=8, help="measured steps under the profiler")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the result here")
    ap.add_argument("--canary-option", action="append", default=[], metavar="KEY=VALUE",
                    help="canary configuration for the runs with the canary, a CanaryConfig field each "
                         "(e.g. real_kv=all, check_v=true); repeatable; KV_CANARY_* variables apply first")
    ap.add_argument("--attach-option", action="append", default=[], metavar="KEY=BOOL",
                    help="an adapter mechanism on or off for the runs with the canary (step_graphs, late_hooks, "
                         "fused_steps, in_graph_waits, token_history), e.g. fused_steps=false; repeatable")
    args = ap.parse_args(argv)
    if args.aa and not args.lockstep:
        ap.error("--aa applies to --lockstep runs only")
    try:
        canary_config(args.canary_option)  # a bad option fails before a model is built
        attach_options(args.attach_option)
    except ValueError as e:
        ap.error(str(e))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kvcanary.bench.engine: --device cuda needs a CUDA GPU")
    args.chunk = args.chunk or (4096 if device.type == "cuda" else 256)
    args.block_size = args.block_size or (256 if device.type == "cuda" else 16)
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    args.attention = args.attention or ("varlen" if device.type == "cuda" else "sdpa")
    if args.attention == "varlen" and device.type == "cuda":
        from kvcanary.bench.varlen_attention import self_check

        err = self_check(device)
        if err > 0.05:
            raise SystemExit(f"kvcanary.bench.engine: the varlen attention disagrees with per-request SDPA by {err}")
    model = build_model(args.model_size, device, dtype, args.context + args.steps + 8, args.attention)
    wl = Workload(args, device)
    build_s = time.perf_counter() - t0

    # Warm-up (allocator, kernels) on a short prompt: the kernels do not recompile for other lengths.
    warm = Workload(args, device, min(args.context, args.warmup_context or args.context))
    for c in (False, True):
        t1 = time.perf_counter()
        run_once(model, warm, canary=c)
        print(f"warm-up canary={c}: {time.perf_counter() - t1:.1f} s", file=sys.stderr)
    off, on, parts, ok, violations = [], [], [], True, 0
    peaks, canary_memory = {False: 0, True: 0}, None
    pair_overheads, runs, profile = [], [], None
    t_rounds = time.perf_counter()
    r = 0

    def more_rounds() -> bool:
        if r < args.rounds:
            return True
        if not args.budget_s or r >= args.max_rounds:
            return False
        spent = time.perf_counter() - t_rounds
        return spent + spent / r <= args.budget_s  # another round of the average length still fits

    lock = None
    if args.lockstep:  # two engines stepping in turn, each round's steps paired (bench/lockstep.py)
        lock = []
        while more_rounds():
            t1 = time.perf_counter()
            res = lockstep.run_lockstep(model, wl, first_canary=bool(r % 2), attach_canary=not args.aa)
            lock.append(res)
            parts += res["parts"]
            ok &= res["without"]["outputs"] == res["with"]["outputs"]
            violations += res["violations"]
            print(f"round {r} (lockstep): {time.perf_counter() - t1:.2f} s, {len(res['with']['steps'])} steps",
                  file=sys.stderr)
            r += 1
        paired = lockstep.summarize(lock)
        off, on = paired["off"], paired["on"]
    # Alternating whole generations (A B, then B A, ...): at least --rounds, more while --budget-s lasts.
    while lock is None and more_rounds():
        order = (False, True) if r % 2 == 0 else (True, False)
        res = {}
        for c in order:
            t1 = time.perf_counter()
            res[c] = run_once(model, wl, canary=c)
            ph = res[c]["phases"]
            runs.append({"round": r, "canary": c, "wall_s": round(time.perf_counter() - t1, 3),
                         **{k: round(v, 4) if isinstance(v, float) else v for k, v in ph.items()}})
            print(f"round {r} canary={c}: {time.perf_counter() - t1:.2f} s (set-up {ph['setup_s']:.2f}, loop "
                  f"{ph['loop_s']:.2f}, collect {ph['collect_s']:.2f}, teardown {ph['teardown_s']:.2f}), "
                  f"{len(res[c]['steps'])} timed steps, {ph['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
        for c in order:
            peaks[c] = max(peaks[c], res[c]["peak_bytes"] or 0)
        canary_memory = res[True]["canary_memory"]
        off += res[False]["steps"]
        on += res[True]["steps"]
        parts += res[True]["parts"]
        if res[False]["steps"] and res[True]["steps"]:
            pair_overheads.append(statistics.median(res[True]["steps"]) / statistics.median(res[False]["steps"]) - 1)
        ok &= res[False]["outputs"] == res[True]["outputs"]
        violations += res[True]["violations"]
        r += 1
    if not args.no_profile and not args.aa:  # (an A/A run has no canary to split the GPU time with)
        # last, in a run of its own: the profiler's hooks may slow every later launch in the process
        profiled_run = run_once(model, wl, canary=True, profile=True, trace=args.trace)
        profile, kernels = profiled_run["profile"], profiled_run["kernels"]

    q_off, q_on = quantiles(off), quantiles(on)
    q_c = quantiles([p["total_s"] for p in parts])
    host_parts = {k: 1e6 * statistics.median(p[k] for p in parts) for k in ("integration_s", "runtime_s",
                                                                              "launch_s", "total_s")} if parts else {}
    tps = {c: [x["tokens_per_s"] for x in runs if x["canary"] == c] for c in (False, True)}
    result = {
        "workload": {"model_size": args.model_size, **SIZES[args.model_size], "vocab_size": VOCAB,
                     "dtype": str(dtype).replace("torch.", ""), "batch": args.batch, "context": args.context,
                     "mode": args.mode, "stagger": args.stagger, "max_batch_tokens": args.chunk,
                     "block_size": args.block_size,
                     "rounds": r, "pairing": "steps" if lock is not None else "runs", "a_a": args.aa,
                     "attention": "paged|kvc_varlen" if args.attention == "varlen" else "paged|sdpa", "cuda_graphs": False,
                     "async_batching": False, "canary_options": args.canary_option,
                     "attach_options": args.attach_option,
                     "canary_config": dataclasses.asdict(wl.canary_config)},
        "environment": {**environment(device), "device": str(device)},
        "correctness": {"tokens_identical": ok, "violations": violations},
        "step_without_canary": q_off,
        "step_with_canary": q_on,
        "canary_host_time_in_step": q_c,
        # median host microseconds per measured step: the integration's Python (batch building, update
        # bookkeeping), the runtime's (checks, drain, snapshot) and issuing the device work
        "canary_host_us_by_part": {k[:-2]: round(v, 1) for k, v in host_parts.items()},
        "generation": {"tokens_per_s_without": statistics.median(tps[False]) if tps[False] else None,
                       "tokens_per_s_with": statistics.median(tps[True]) if tps[True] else None,
                       "runs": runs},
        "model_build_s": round(build_s, 1),
        # Peak device memory of a whole generation (model, KV cache, activations, canary), and the
        # canary's own buffers by part (Canary.memory()).
        "peak_memory_mib": {"without_canary": peaks[False] / 2**20, "with_canary": peaks[True] / 2**20}
        if device.type == "cuda" else None,
        "canary_memory_bytes": canary_memory,
    }
    if q_off.get("n") and q_on.get("n"):
        result["step_ratio_with_over_without"] = q_on["median_ms"] / q_off["median_ms"]
        # end to end: pooled medians, and the median over rounds of each round's with/without ratio
        result["overhead_pct"] = 100 * (q_on["median_ms"] / q_off["median_ms"] - 1)
        result["overhead_pct_paired"] = 100 * statistics.median(pair_overheads) if pair_overheads else None
        if lock is not None:  # paired step by step; whole generations as each engine's summed steps
            result["overhead_pct_paired"] = paired["paired_pct"]
            result["overhead_pct_paired_ci95"] = paired["paired_ci95_pct"]
            result["step_parts_us"], result["unpaired_steps"] = paired["parts_us"], paired["unpaired"]
            result["gc_ms_in_paired_steps"] = paired["gc_ms"]
            tps = paired["tokens_per_s"]
            result["generation"].update(tokens_per_s_without=tps["without"], tokens_per_s_with=tps["with"],
                                        unmeasured_extra_ms=paired["unmeasured_extra_ms"])
        result["canary_share_of_step"] = q_c["median_ms"] / q_on["median_ms"] if q_c.get("n") else None
        g = result["generation"]
        if g["tokens_per_s_without"] and g["tokens_per_s_with"]:
            g["overhead_pct"] = 100 * (g["tokens_per_s_without"] / g["tokens_per_s_with"] - 1)
    if profile:
        result["gpu_time"] = bench_suite.gpu_time(profile)
        # device microseconds per profiled step of each kernel the before hook launched (a fused step's
        # whole graph): what the canary's GPU time is made of (the same trace as ``profile``)
        n = max(1, kernels["count"])
        result["gpu_time"]["before_kernels_us_per_step"] = {k: round(v / n, 2) for k, v in kernels["device_us"].items()}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if ok and violations == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
