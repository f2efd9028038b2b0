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
(``kvcanary.integrations.varlen_attention``) on CUDA and transformers' ``paged|sdpa`` on CPU.
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
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from kvcanary.bench import suite as bench_suite


SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336),
}
VOCAB = 32000


def build_model(size: str, device: torch.device, dtype: torch.dtype, max_len: int, attention: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SIZES[size], vocab_size=VOCAB, max_position_embeddings=max(2048, max_len))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    model.eval()
    if attention == "varlen":
        from kvcanary.integrations.varlen_attention import register

        model.set_attn_implementation(register())
    else:
        model.set_attn_implementation("paged|sdpa")
    return model


class Workload:
    def __init__(self, args, device, context: int | None = None):
        self.args, self.device = args, device
        context = context or args.context
        g = torch.Generator().manual_seed(1)
        self.prompts = [torch.randint(5, VOCAB, (context,), generator=g).tolist() for _ in range(args.batch)]
        # Decode: requests that finish prefill early decode alongside later prefill chunks; generate enough
        # tokens that, once every prompt is prefilled, `steps` more steps decode the whole batch together.
        prefill_steps = math.ceil(args.batch * context / max(1, args.chunk - args.batch)) + 1
        self.new_tokens = prefill_steps + args.skip + args.steps + 2 if args.mode == "decode" else 1
        bs = args.block_size
        blocks = args.batch * (math.ceil((context + self.new_tokens + 1) / bs) + 1) + 8
        self.cb = dict(block_size=bs, num_blocks=blocks, max_batch_tokens=args.chunk,
                       max_requests_per_batch=args.batch, use_async_batching=False, use_cuda_graph=False,
                       allow_block_sharing=False, scheduler_type="fifo", safety_margin=0.0,
                       # the cache is sized above (num_blocks); transformers' default share of free memory
                       # (under half) rejects an 8B model at batch 64 x 8K on a 141 GB GPU
                       max_memory_percent=0.9)

        self.canary_config = canary_config(args.canary_option)

    def measured(self, batch: int, tokens: int) -> bool:
        """Steps that count: pure decode steps of the whole batch, or prefill chunks."""
        if self.args.mode == "decode":
            return batch == self.args.batch and tokens == batch
        return tokens > batch


def canary_config(options: list[str] | None):
    """The canary's configuration: ``KV_CANARY_*`` variables, then ``KEY=VALUE`` options (field names)."""
    from kvcanary.runtime.config import ENV_PREFIX, CanaryConfig

    fields = [f.name for f in dataclasses.fields(CanaryConfig)]
    env = dict(os.environ)
    for opt in options or []:
        key, sep, value = opt.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"kv-canary: bench_engine --canary-option must be KEY=VALUE with KEY a CanaryConfig "
                             f"field ({', '.join(fields)}), got {opt!r}")
        env[ENV_PREFIX + key.upper()] = value
    return CanaryConfig.from_env(env)


def run_once(model, wl: Workload, canary: bool, profile: bool = False, trace: str | None = None) -> dict:
    """One full generation of the workload on this thread; per-step wall times of the measured steps."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvcanary.integrations.transformers import attach

    sync = torch.cuda.synchronize if wl.device.type == "cuda" else (lambda: None)
    gen = GenerationConfig(max_new_tokens=wl.new_tokens, do_sample=False, eos_token_id=-1)
    handle = attach(model, config=wl.canary_config, mode="log", timing=True) if canary else None
    manager = bp = session = None
    steps, canary_s, outputs = [], [], {}
    prof = ranges = None
    canary_memory = None
    if wl.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(wl.device)
    try:
        manager = model.init_continuous_batching(gen, ContinuousBatchingConfig(**wl.cb))
        bp = manager._create_batch_processor()
        manager.batch_processor = bp
        for i, p in enumerate(wl.prompts):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=wl.new_tokens)
        session = handle.sessions[-1] if canary else None
        if session is not None:
            canary_memory = session.canary.memory()
        if profile:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if wl.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=acts)
        n, profiling, profiled = 0, False, 0
        while True:
            sync()
            t0 = time.perf_counter()
            if not bp.prepare_next_batch():
                break
            batch, tokens = len(bp.inputs_and_outputs.requests_in_batch), bp.inputs_and_outputs.total_seqlen_q
            take = wl.measured(batch, tokens) and n >= wl.args.skip
            if take and prof is not None and not profiling and profiled < wl.args.profile_steps:
                prof.__enter__()
                profiling = True
            manager._generation_step()
            bp.update_batch()
            sync()
            dt = time.perf_counter() - t0
            if take:
                steps.append(dt)
                if session is not None:
                    t = session.timings[-1]
                    canary_s.append(t["before_s"] + t["after_s"] + t["update_s"])
            if wl.measured(batch, tokens):
                n += 1
            if profiling and take:
                profiled += 1
                if profiled >= wl.args.profile_steps:
                    prof.__exit__(None, None, None)
                    profiling = False
        if profiling:
            prof.__exit__(None, None, None)
        if prof is not None and not profiled:
            prof = None  # no measured step ran: nothing was profiled
        if prof is not None:
            # The device times come from the exported trace (bench_suite.trace_ranges)
            path = trace or os.path.join(tempfile.mkdtemp(), "trace.json")
            prof.export_chrome_trace(path)
            ranges = bench_suite.trace_ranges(path)
            if not trace:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        for state in list(bp.scheduler.active_requests.values()):
            outputs[state.request_id] = state.generated_tokens
        while not manager.output_router.output_queue.empty():
            out = manager.output_router.output_queue.get_nowait()
            outputs[out.request_id] = list(out.generated_tokens)
        violations = 0
        if handle is not None:
            handle.flush()
            violations = len(handle.violations)
    finally:
        if handle is not None:
            handle.detach()
        # Every reference to the engine (the session holds its batch processor and so its KV cache) goes
        # before the allocator's cache is emptied: transformers sizes the next cache by free memory.
        manager = bp = session = handle = None
        gc.collect()
        if wl.device.type == "cuda":
            torch.cuda.empty_cache()
    peak = torch.cuda.max_memory_allocated(wl.device) if wl.device.type == "cuda" else None
    return {"steps": steps, "canary_s": canary_s, "outputs": outputs, "violations": violations,
            "profile": ranges, "peak_bytes": peak,
            "canary_memory": canary_memory}


def quantiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]  # noqa: E731
    return {"n": len(s), "median_ms": 1e3 * statistics.median(s), "p10_ms": 1e3 * pick(0.1),
            "p90_ms": 1e3 * pick(0.9)}


def environment(device: torch.device) -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        # KVCANARY_COMMIT names the commit where the checkout carries no (or a stale) .git
        info["commit"] = os.environ.get("KVCANARY_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        info["commit"] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["driver"] = getattr(torch.version, "cuda", None)
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--steps", type=int, default=24, help="decode steps per run (decode mode)")
    ap.add_argument("--skip", type=int, default=2, help="measured-kind steps skipped at the start of each run")
    ap.add_argument("--rounds", type=int, default=2, help="alternating (without, with) rounds after warm-up")
    ap.add_argument("--attention", choices=("varlen", "sdpa"), default=None,
                    help="paged attention: varlen (kvcanary.integrations.varlen_attention; default on cuda) or the engine's "
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
    args = ap.parse_args(argv)
    try:
        canary_config(args.canary_option)  # a bad option fails before a model is built
    except ValueError as e:
        ap.error(str(e))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("engine_overhead: --device cuda needs a CUDA GPU")
    args.chunk = args.chunk or (4096 if device.type == "cuda" else 256)
    args.block_size = args.block_size or (256 if device.type == "cuda" else 16)
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    args.attention = args.attention or ("varlen" if device.type == "cuda" else "sdpa")
    if args.attention == "varlen" and device.type == "cuda":
        from kvcanary.integrations.varlen_attention import self_check

        err = self_check(device)
        if err > 0.05:
            raise SystemExit(f"engine_overhead: the varlen attention disagrees with per-request SDPA by {err}")
    model = build_model(args.model_size, device, dtype, args.context + args.steps + 8, args.attention)
    wl = Workload(args, device)
    build_s = time.perf_counter() - t0

    # Warm-up (allocator, kernels) on a short prompt: the kernels do not recompile for other lengths.
    warm = Workload(args, device, min(args.context, args.warmup_context or args.context))
    for c in (False, True):
        t1 = time.perf_counter()
        run_once(model, warm, canary=c)
        print(f"warm-up canary={c}: {time.perf_counter() - t1:.1f} s", file=sys.stderr)
    off, on, canary_s, ok, violations = [], [], [], True, 0
    peaks, canary_memory = {False: 0, True: 0}, None
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        res = {}
        for c in order:
            t1 = time.perf_counter()
            res[c] = run_once(model, wl, canary=c)
            print(f"round {r} canary={c}: {time.perf_counter() - t1:.1f} s, {len(res[c]['steps'])} steps",
                  file=sys.stderr)
        for c in order:
            peaks[c] = max(peaks[c], res[c]["peak_bytes"] or 0)
        canary_memory = res[True]["canary_memory"]
        off += res[False]["steps"]
        on += res[True]["steps"]
        canary_s += res[True]["canary_s"]
        ok &= res[False]["outputs"] == res[True]["outputs"]
        violations += res[True]["violations"]
    profile = None if args.no_profile else run_once(model, wl, canary=True, profile=True, trace=args.trace)["profile"]

    q_off, q_on, q_c = quantiles(off), quantiles(on), quantiles(canary_s)
    result = {
        "workload": {"model_size": args.model_size, **SIZES[args.model_size], "vocab_size": VOCAB,
                     "dtype": str(dtype).replace("torch.", ""), "batch": args.batch, "context": args.context,
                     "mode": args.mode, "max_batch_tokens": args.chunk, "block_size": args.block_size,
                     "rounds": args.rounds,
                     "attention": "paged|kvc_varlen" if args.attention == "varlen" else "paged|sdpa", "cuda_graphs": False,
                     "async_batching": False, "canary_options": args.canary_option,
                     "canary_config": dataclasses.asdict(wl.canary_config)},
        "environment": {**environment(device), "device": str(device)},
        "correctness": {"tokens_identical": ok, "violations": violations},
        "step_without_canary": q_off,
        "step_with_canary": q_on,
        "canary_host_time_in_step": q_c,
        "model_build_s": round(build_s, 1),
        # Peak device memory of a whole generation (model, KV cache, activations, canary), and the
        # canary's own buffers by part (Canary.memory()).
        "peak_memory_mib": {"without_canary": peaks[False] / 2**20, "with_canary": peaks[True] / 2**20}
        if device.type == "cuda" else None,
        "canary_memory_bytes": canary_memory,
    }
    if q_off.get("n") and q_on.get("n"):
        result["step_ratio_with_over_without"] = q_on["median_ms"] / q_off["median_ms"]
        result["canary_share_of_step"] = q_c["median_ms"] / q_on["median_ms"] if q_c.get("n") else None
    if profile:
        result["gpu_time"] = bench_suite.gpu_time(profile)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if ok and violations == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
