"""The canary's cost inside vLLM (CPU build): an engine's throughput with the canary against the same engine
without it, side by side in one process (docs/benchmarks.md, "vLLM on the CPU").

    VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_cost.py \
        --model 0.5b --rounds 5 --json vllm-cost-0.5b.json

Two engines of the same settings live in the process: one started before the canary's vLLM plugin is
installed (its model runner has no canary session), one after. Each round runs the same serving workload
(``LLM.generate``: N prompts of distinct random tokens, greedy, a fixed number of output tokens) once on each,
the order alternating between rounds, each run after a prefix-cache reset, so load from other processes on a
shared machine falls on both arms alike. Throughput = generated tokens / wall seconds of ``generate``. Before
any number is printed the run checks that both arms generated the same tokens and the canary reported no
violation. Reported: each arm's median (min, max), the median of the per-round ratios and their range.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MODELS = {
    # vocab 512, head_dim 32: the tests' tiny Llama (about 0.4 M parameters)
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048),
    # about 0.53 B parameters, Llama-shaped (bf16: about 1 GB of weights)
    "0.5b": dict(vocab_size=32000, hidden_size=1536, intermediate_size=4608, num_hidden_layers=16,
                 num_attention_heads=24, num_key_value_heads=4, max_position_embeddings=2048),
}


def parameters(cfg: dict) -> int:
    h, i, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    return layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + 2 * v * h + h


def workload(n: int, prompt_len: int, vocab: int, round_: int) -> list[dict]:
    rng = random.Random(f"vllm-cost-{round_}")
    return [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(prompt_len)]} for _ in range(n)]


def run(llm, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    out = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, [list(o.outputs[0].token_ids) for o in out]


def profile(llm, prompts, max_tokens: int) -> dict:
    """One run of ``llm`` with the canary's per-step hooks timed: the session's step start and end, and its guard of
    each forward less the forward it guards (the engine's). Returns the wall time and the canary's share of it."""
    from kvcanary.integrations.vllm.session import Session

    spent = {"begin_step": 0.0, "guard_forward": 0.0, "end_step": 0.0}
    calls = {"forwards": 0}
    orig = {name: getattr(Session, name) for name in spent}

    def timed(name):
        def call(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig[name](self, *args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return call

    def guard_forward(self, forward, runner, args, kwargs):
        inner = [0.0]

        def engine_forward(*a, **k):
            t0 = time.perf_counter()
            try:
                return forward(*a, **k)
            finally:
                inner[0] += time.perf_counter() - t0

        t0 = time.perf_counter()
        try:
            return orig["guard_forward"](self, engine_forward, runner, args, kwargs)
        finally:
            spent["guard_forward"] += time.perf_counter() - t0 - inner[0]
            calls["forwards"] += 1

    Session.begin_step, Session.end_step = timed("begin_step"), timed("end_step")
    Session.guard_forward = guard_forward
    try:
        dt, _ = run(llm, prompts, max_tokens)
    finally:
        for name, fn in orig.items():
            setattr(Session, name, fn)
    canary = sum(spent.values())
    return {"wall_s": round(dt, 3), "canary_s": round(canary, 3), "canary_share": round(canary / dt, 4),
            "forwards": calls["forwards"], "canary_ms_per_forward": round(1e3 * canary / max(1, calls["forwards"]), 3),
            "by_hook_s": {k: round(v, 3) for k, v in spent.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=128, help="KV blocks of 32 tokens per engine")
    ap.add_argument("--profile", action="store_true",
                    help="after the rounds, time the canary's hooks in one run of its engine: the canary's share")
    ap.add_argument("--dtype", default=None,
                    help="the engines' dtype (default: the project's, float16; bfloat16 on a CPU with AMX takes vLLM's "
                         "amx kernel, which the canary hashes through token-row copies)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from kvcanary.integrations.vllm import collect, engine
    from kvcanary.sim.vllm_drive import make_llm, tiny_model_dir

    dtype = args.dtype or engine.DTYPE

    cfg = MODELS[args.model]
    model_dir = tiny_model_dir(cfg)
    # (the CPU backend checks the memory the fraction gives against the weights: 0.5 B of bf16 needs about 1 GB)
    settings = dict(num_gpu_blocks_override=args.blocks, max_num_seqs=args.requests, gpu_memory_utilization=0.25,
                    max_num_batched_tokens=max(256, args.prompt_len * args.requests),
                    max_model_len=min(2048, (args.blocks - 1) * 32), dtype=dtype)
    t0 = time.perf_counter()
    with engine.guarded(False):
        engines = {"without": make_llm(model_dir, **settings)}
    hooks = engine.guarded(True, KV_CANARY_MODE="log")
    hooks.__enter__()  # (for the rest of the run: the canary's engine steps through the hooks)
    engines["with"] = make_llm(model_dir, **settings)
    start_s = time.perf_counter() - t0
    # warm-up: one run each (first-call costs of both engines and of the canary's kernels)
    for llm in engines.values():
        run(llm, workload(args.requests, args.prompt_len, cfg["vocab_size"], -1), args.max_tokens)
    times: dict[str, list[float]] = {"without": [], "with": []}
    tokens_equal = True
    for r in range(args.rounds):
        print(f"vllm_cost: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        prompts = workload(args.requests, args.prompt_len, cfg["vocab_size"], r)
        order = ("without", "with") if r % 2 == 0 else ("with", "without")
        got = {}
        for arm in order:
            dt, got[arm] = run(engines[arm], prompts, args.max_tokens)
            times[arm].append(dt)
        tokens_equal &= got["with"] == got["without"]
    report = collect(engines["with"])
    violations = len(report.violations)
    if not tokens_equal or violations:
        raise SystemExit(f"vllm_cost: not clean (tokens equal {tokens_equal}, violations {violations}): no numbers")
    gen = args.requests * args.max_tokens
    tput = {arm: [gen / t for t in ts] for arm, ts in times.items()}
    ratios = [w / wo for w, wo in zip(tput["with"], tput["without"])]
    out = {
        "model": args.model, "parameters": parameters(cfg), "dtype": dtype, "rounds": args.rounds,
        "requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "throughput_tok_s": {arm: {"median": round(statistics.median(v), 2), "min": round(min(v), 2),
                                   "max": round(max(v), 2), "all": [round(x, 2) for x in v]} for arm, v in tput.items()},
        "ratio_with_over_without": {"median": round(statistics.median(ratios), 4), "min": round(min(ratios), 4),
                                    "max": round(max(ratios), 4), "all": [round(x, 4) for x in ratios]},
        "tokens_identical": tokens_equal, "violations": violations, "engine_start_s": round(start_s, 1),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "vllm": __import__("vllm").__version__, "torch": __import__("torch").__version__},
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "canary_stats": report.stats if hasattr(report, "stats") else None,
    }
    from kvcanary.integrations.vllm.session import session_of
    from kvcanary.sim.vllm_drive import runner_of

    session = session_of(runner_of(engines["with"]))
    out["attention_isa"] = session.layout.isa if session is not None else None
    out["token_row_copies"] = session is not None and session.mirror is not None
    if args.profile:
        out["profile"] = profile(engines["with"], workload(args.requests, args.prompt_len, cfg["vocab_size"], -2),
                                 args.max_tokens)
    text = json.dumps(out, indent=2, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
