"""What the write check costs per engine step, over the fingerprinted layers and over every layer
(``CanaryConfig.write_check_layers``, docs/write_check.md "Cost").

A Llama-shaped model with random weights (``workload.build_model``) generates on transformers continuous batching
with the canary attached, alternately with ``write_check_layers="fingerprinted"`` and ``"all"``; the time spent in
the write check's two passes (``WriteCheck.note_layer`` inside the forward, ``WriteCheck.after`` at TAIL) is
summed per run and divided by its engine steps. On the CPU every op runs as it is called, so that host time is
the whole cost. Reported as JSON: per setting, the medians over rounds of the step time, the write check's time
per step and the sources it notes per step.

    python -m kvcanary.bench.write_check_cost --model-size tiny
    python -m kvcanary.bench.write_check_cost --model-size 0.5b --batch 4 --context 64 --new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

from kvcanary.bench.workload import SIZES, VOCAB, build_model, environment

SETTINGS = ("fingerprinted", "all")


def run_once(model, prompts, new_tokens: int, layers: str, backend: str) -> dict:
    """One generation with the canary: its steps, wall time, and the write check's time and notes."""
    from transformers import GenerationConfig

    from kvcanary.integrations.transformers.reach import attach_with, cb_config
    from kvcanary.runtime.write_check import WriteCheck

    spent = [0.0]
    originals = {name: getattr(WriteCheck, name) for name in ("note_layer", "after")}

    def timed(fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
        return call

    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1)
    cbc = cb_config(block_size=16, num_blocks=8 * len(prompts) * (1 + (len(prompts[0]) + new_tokens) // 16),
                    max_batch_tokens=256, use_async_batching=False, use_cuda_graph=False)
    for name, fn in originals.items():
        setattr(WriteCheck, name, timed(fn))
    try:
        handle = attach_with(model, mode="log", backend=backend, write_check_layers=layers)
        t0 = time.perf_counter()
        model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cbc)
        wall = time.perf_counter() - t0
        stats, violations = handle.stats(), len(handle.violations)
        handle.detach()
    finally:
        for name, fn in originals.items():
            setattr(WriteCheck, name, fn)
    steps = max(1, int(stats["forwards"]))
    return {"steps": steps, "step_ms": 1e3 * wall / steps, "write_check_ms_per_step": 1e3 * spent[0] / steps,
            "notes_per_step": stats["write_check_notes"] / steps, "violations": violations}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each setting, alternating, after a warm-up")
    ap.add_argument("--backend", default="numba", help="the canary's op backend (CanaryConfig.backend)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the result here")
    args = ap.parse_args(argv)
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    device = torch.device("cpu")
    model = build_model(args.model_size, device, torch.float32, args.context + args.new_tokens + 8)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (args.context,), generator=g).tolist() for _ in range(args.batch)]
    for layers in SETTINGS:  # (warm-up: numba's compiled loops, the allocator)
        run_once(model, prompts, 2, layers, args.backend)
    runs = {layers: [] for layers in SETTINGS}
    for _ in range(args.rounds):
        for layers in SETTINGS:
            runs[layers].append(run_once(model, prompts, args.new_tokens, layers, args.backend))
    out = {"workload": {"model_size": args.model_size, **SIZES[args.model_size], "batch": args.batch,
                        "context": args.context, "new_tokens": args.new_tokens, "rounds": args.rounds,
                        "backend": args.backend, "threads": torch.get_num_threads()},
           "environment": environment(device)}
    for layers, rs in runs.items():
        out[layers] = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
