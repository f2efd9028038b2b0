"""The canary under transformers' async batching, in one GPU call (issue 36; docs/notes/async_batching.md):
a tiny Llama's workload with the engine's CUDA graphs and async batching on, with and without the canary.
Prints the violations of the canary's run, whether its greedy tokens equal the canary-less run's (and the
synchronous run's), and tokens/s of each arm (best of ``--rounds``).

    PYTHONPATH=$PWD python benchmarks/async_check.py [--requests 64 --new-tokens 64 --rounds 3]
"""

from __future__ import annotations

import argparse
import json

import torch

from kvcanary.demo import build_tiny_model, run_workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("async_check: async batching needs CUDA (transformers refuses it on the CPU)")
    model = build_tiny_model(args.device)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 48, (args.requests,), generator=gen)]
    cb = {"use_cuda_graph": True, "max_batch_tokens": 256, "max_requests_per_batch": 32, "num_blocks": 1024}
    arms = {"async": dict(canary=False, cb={**cb, "use_async_batching": True}),
            "async+canary": dict(canary=True, cb={**cb, "use_async_batching": True}),
            "sync": dict(canary=False, cb=cb)}
    out, tokens = {}, {}
    for name, kw in arms.items():
        best = None
        for _ in range(args.rounds):
            r = run_workload(model, device=args.device, prompts=prompts, max_new_tokens=args.new_tokens,
                             num_return_sequences=1, **kw)
            tps = sum(map(len, r.tokens.values())) / r.seconds
            best = tps if best is None else max(best, tps)
            tokens[name] = r.tokens
            if kw["canary"]:
                out["violations"] = len(r.violations)
                out["report"] = r.report
                out["forwards"] = r.stats.get("forwards")
        out[f"{name}_tokens_per_s"] = round(best, 1)
    out["tokens_equal_async"] = tokens["async+canary"] == tokens["async"]
    out["tokens_equal_sync"] = tokens["async+canary"] == tokens["sync"]
    out["canary_cost"] = round(1 - out["async+canary_tokens_per_s"] / out["async_tokens_per_s"], 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
