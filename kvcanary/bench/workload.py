"""The engine benchmark's workloads: model shapes, the generation to run, the canary's configuration,
and the summary helpers (quantiles, environment) of ``kvcanary.bench.engine``."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import subprocess
import sys

import torch


SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128),
    # Qwen2-0.5B's attention shape (24 layers, 2 KV heads of 64): what hashing every layer costs on a small model
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864),
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
        from kvcanary.bench.varlen_attention import use

        use(model)
    else:
        from kvcanary.integrations.transformers.reach import sdpa_name

        model.set_attn_implementation(sdpa_name())  # (the prefix warns from 5.18 on)
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
        # request i generates ``stagger * i`` tokens more than the first: the batch shrinks by one request every
        # ``stagger`` decode steps at the end, as in serving, where requests finish at different times
        self.stagger = int(getattr(args, "stagger", 0) or 0)
        bs = args.block_size
        longest = self.new_tokens + self.stagger * max(0, args.batch - 1)
        blocks = args.batch * (math.ceil((context + longest + 1) / bs) + 1) + 8
        self.cb = dict(block_size=bs, num_blocks=blocks, max_batch_tokens=args.chunk,
                       max_requests_per_batch=args.batch, use_async_batching=False, use_cuda_graph=False,
                       allow_block_sharing=False, scheduler_type="fifo", safety_margin=0.0,
                       # the cache is sized above (num_blocks); transformers' default share of free memory
                       # (under half) rejects an 8B model at batch 64 x 8K on a 141 GB GPU
                       max_memory_percent=0.9)

        self.canary_config = canary_config(args.canary_option)
        self.attach_options = attach_options(getattr(args, "attach_option", None))

    def max_new_tokens(self, i: int) -> int:
        """Tokens request ``i`` generates."""
        return self.new_tokens + self.stagger * i

    def measured(self, batch: int, tokens: int) -> bool:
        """Steps that count: pure decode steps of the whole batch (with ``stagger``: of the shrinking batch, which
        has fewer requests), or prefill chunks."""
        if self.args.mode == "decode":
            if self.stagger:
                return 0 < batch < self.args.batch and tokens == batch
            return batch == self.args.batch and tokens == batch
        return tokens > batch


def host_part(session, before: dict) -> dict:
    """The canary's host seconds in the step just run, by part: the session's last timing row, less the
    runtime's and launch seconds added since ``before`` (a copy of ``canary.host_times`` taken before it)."""
    t, h = session.timings[-1], session.canary.host_times
    runtime, launch = h["runtime_s"] - before["runtime_s"], h["launch_s"] - before["launch_s"]
    total = t["before_s"] + t["after_s"] + t["update_s"]
    return {"integration_s": total - runtime - launch, "runtime_s": runtime, "launch_s": launch, "total_s": total}


def generated(manager, bp) -> dict:
    """Every request's generated tokens by request id: still active, or finished into the output queue."""
    outputs = {st.request_id: st.generated_tokens for st in list(bp.scheduler.active_requests.values())}
    q = manager.output_router.output_queue
    while not q.empty():
        o = q.get_nowait()
        outputs[o.request_id] = list(o.generated_tokens)
    return outputs


def canary_config(options: list[str] | None):
    """The canary's configuration: ``KV_CANARY_*`` variables, then ``KEY=VALUE`` options (any field: most are
    set in code only, so an option goes in as an argument, never through a variable the config ignores)."""
    from kvcanary.runtime.config import CanaryConfig, ConfigError, _parse

    by_name = {f.name: f for f in dataclasses.fields(CanaryConfig)}
    overrides, raws = {}, {}
    for opt in options or []:
        key, sep, value = opt.partition("=")
        if not sep or key not in by_name:
            raise ValueError(f"kv-canary: bench_engine --canary-option must be KEY=VALUE with KEY a CanaryConfig "
                             f"field ({', '.join(by_name)}), got {opt!r}")
        overrides[key], raws[key] = _parse(by_name[key], value, name=f"--canary-option {key}"), value
    try:
        return CanaryConfig.from_env(dict(os.environ), **overrides)
    except ConfigError as e:
        if e.field not in raws:
            raise
        raise ValueError(f"kv-canary: --canary-option {e.field} must be {e.expectation}, got {raws[e.field]!r}") from None


def attach_options(options: list[str] | None) -> dict:
    """``KEY=VALUE`` adapter options of ``attach`` that switch a mechanism on or off (booleans)."""
    allowed = ("step_graphs", "late_hooks", "fused_steps", "in_graph_waits", "token_history", "bucket_batches")
    out = {}
    for opt in options or []:
        key, sep, value = opt.partition("=")
        if not sep or key not in allowed or value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"kv-canary: bench_engine --attach-option must be KEY=true|false with KEY one of "
                             f"{', '.join(allowed)}, got {opt!r}")
        out[key] = value.lower() in ("true", "1")
    return out


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
