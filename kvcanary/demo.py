"""``kvcanary demo``: a tiny model on transformers continuous batching, clean and then with a planted bug.

Everything is local: the default model is a 2-layer Llama-shaped model with seeded random weights
built from a config (no download); ``model_path`` loads a local Hugging Face directory instead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvcanary.ops import numba_cache
from kvcanary.ops.api import numba_available
from kvcanary.integrations.transformers.reach import attach_with, cb_config, sdpa_name

DEFAULT_BUG = "early-free"
TINY_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=512, max_position_embeddings=512)
BLOCK_SIZE = 4


def build_tiny_model(device: str = "cpu", seed: int = 0, sliding_window: int | None = None, mla: bool = False):
    """Llama-shaped model with seeded random weights (Qwen2 with one sliding layer when ``sliding_window``; a
    DeepSeek-V3-shaped model whose layers cache MLA latents when ``mla``: transformers 5.25+ pages those)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if sliding_window:
        cfg = Qwen2Config(**TINY_CONFIG, use_sliding_window=True, sliding_window=sliding_window,
                          max_window_layers=1)
        model = Qwen2ForCausalLM(cfg)
    elif mla:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        # one latent row per token: kv_lora_rank 16 + rope 8 floats (96 bytes, a 16-byte multiple); the
        # latents expand to every head (no grouped KV heads)
        tiny = {**TINY_CONFIG, "num_key_value_heads": TINY_CONFIG["num_attention_heads"]}
        cfg = DeepseekV3Config(**tiny, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
                               v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                               n_group=1, topk_group=1, first_k_dense_replace=1)
        model = DeepseekV3ForCausalLM(cfg)
    else:
        model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG))
    model = model.to(device).eval()
    model.set_attn_implementation(sdpa_name())
    return model


def load_local_model(path: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    model = model.to(device).eval()
    model.set_attn_implementation(sdpa_name())
    return model


def demo_prompts(vocab: int) -> list[list[int]]:
    """A system prompt shared by most requests (prefix sharing), varied lengths (chunked prefill), two
    prompts whose second block is equal after different first blocks, and unrelated short ones."""
    system = [(37 * i + 11) % vocab for i in range(4 * BLOCK_SIZE + 2)]
    questions = [[(13 * k + 5 * i + 7) % vocab for i in range(3 + 2 * k)] for k in range(5)]
    same_block = [(i * 29 + 3) % vocab for i in range(BLOCK_SIZE)]
    pair = [[(100 + i) % vocab for i in range(BLOCK_SIZE)] + same_block + [1, 2, 3],
            [(200 + i) % vocab for i in range(BLOCK_SIZE)] + same_block + [4, 5]]
    short = [[(300 + 3 * i) % vocab for i in range(5)], [(400 + i) % vocab for i in range(7)]]
    return [system + q for q in questions] + pair + short


@dataclass
class RunResult:
    tokens: dict[str, list[int]]
    stats: dict
    violations: list
    seconds: float
    report: list[str] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)  # canary request id -> engine request id


def run_workload(model, *, canary: bool = True, bug: str | None = None, device: str = "cpu",
                 max_new_tokens: int = 10, num_return_sequences: int = 2, prompts=None, cb: dict | None = None,
                 **options) -> RunResult:
    """Run the demo workload once on continuous batching, optionally with the canary and a planted bug."""
    from transformers import GenerationConfig
    from kvcanary.sim.hf_bugs import plant

    vocab = model.config.get_text_config().vocab_size
    prompts = demo_prompts(vocab) if prompts is None else prompts
    sampling = dict(do_sample=True, top_k=1) if num_return_sequences > 1 else dict(do_sample=False)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=-1, num_return_sequences=num_return_sequences,
                           **sampling)
    sliding = getattr(model.config.get_text_config(), "sliding_window", None) is not None
    cb = {"block_size": BLOCK_SIZE, "num_blocks": 96, "max_batch_tokens": 16, "max_requests_per_batch": 16,
          "use_async_batching": False, "use_cuda_graph": False, "scheduler_type": "fifo",
          "allow_block_sharing": not sliding, **(cb or {})}
    cbc = cb_config(**cb)
    undo, handle = plant(model, bug) if bug else None, None
    try:  # (an attach that refuses its options leaves the model without the planted bug too)
        handle = attach_with(model, **{"mode": "log", "sweep_interval": 4, **options}) if canary else None
        t0 = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cbc)
    finally:
        if handle is not None:
            handle.detach()
        if undo is not None:
            undo()
    seconds = time.perf_counter() - t0
    tokens = {rid: list(o.generated_tokens) for rid, o in sorted(out.items())}
    if handle is None:
        return RunResult(tokens, {}, [], seconds)
    violations = handle.violations
    return RunResult(tokens, handle.stats(), violations, seconds,
                     report=[handle.describe(v) for v in most_telling(violations)[:2]],
                     log_lines=[v.log_line() for v in violations],
                     names={i: n for s in handle.sessions for n, i in s.ids.items()})


def most_telling(violations: list) -> list:
    """Distinct violations (one per launch, slot, position and reason), naming two owners of a slot first,
    then the earliest."""
    def key(v):
        two_owners = v.reader_request is not None and v.writer_request not in (None, v.reader_request)
        return (not two_owners, v.step)

    seen, out = set(), []
    for v in sorted(violations, key=key):
        ident = (v.slot, v.position)
        if ident not in seen:
            seen.add(ident)
            out.append(v)
    return out


def run_demo(device: str = "cpu", bug: str = DEFAULT_BUG, model_path: str | None = None) -> dict:
    """Clean run, then the same workload with ``bug`` planted; returns the summary the CLI prints."""
    from kvcanary.sim.hf_bugs import BUGS

    if bug not in BUGS:
        raise ValueError(f"kv-canary: bug must be one of {sorted(BUGS)}, got {bug!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("kv-canary: device 'cuda' needs a CUDA GPU, got none")
    quiet = logging.getLogger("kvcanary")
    level, quiet.level = quiet.level, logging.ERROR  # the demo prints the report itself
    try:
        t0 = time.perf_counter()
        model = load_local_model(model_path, device) if model_path else build_tiny_model(device)
        load_s = time.perf_counter() - t0
        # the canary's CPU backend is numba where it imports: its kernels compile in the first run with the
        # canary unless numba's disk cache holds them (the timing line says so)
        compiles = device == "cpu" and numba_available() and numba_cache.will_compile()
        baseline = run_workload(model, canary=False, device=device)
        clean = run_workload(model, device=device)
        buggy = run_workload(model, bug=bug, device=device)
    finally:
        quiet.setLevel(level)
    return {
        "model": model_path or "tiny Llama (2 layers, hidden 64, seeded random weights)",
        "device": device,
        "model_load_s": round(load_s, 2),
        "numba_compiled": compiles,
        "clean": _summary(clean, baseline),
        "bug": {"name": bug, "class": BUGS[bug][0], "what": BUGS[bug][1], **_summary(buggy, None),
                "report": buggy.report, "log_lines": buggy.log_lines},
    }


def _summary(run: RunResult, baseline: RunResult | None) -> dict:
    s = run.stats
    out = {
        "requests": s.get("requests", 0),
        "forwards": s.get("forwards", 0),
        "tokens_protected": s.get("tokens_protected", 0),
        "entries_verified": s.get("entries_checked", 0),
        "sweeps": s.get("sweeps", 0),
        "prefix_hits": s.get("prefix_hits", 0),
        "dedup_remaps": s.get("dedup_remaps", 0),
        "fork_block_copies": s.get("fork_block_copies", 0),
        "violations": s.get("violations", 0),
        "seconds": round(run.seconds, 2),
    }
    if baseline is not None:
        out["tokens_match_without_canary"] = run.tokens == baseline.tokens
        out["baseline_seconds"] = round(baseline.seconds, 2)
    return out


def format_demo(result: dict) -> str:
    c, b = result["clean"], result["bug"]
    lines = [
        f"kv-canary demo: {result['model']} on transformers continuous batching ({result['device']})",
        "",
        "clean run (prefix sharing, chunked prefill, parallel sampling with forks, block reuse):",
        f"  requests {c['requests']}, forwards {c['forwards']}, tokens protected {c['tokens_protected']}, "
        f"entries verified {c['entries_verified']}, sweeps {c['sweeps']}",
        f"  KV movements followed: prefix hits {c['prefix_hits']}, dedup remaps {c['dedup_remaps']}, "
        f"fork block copies {c['fork_block_copies']}",
        f"  violations: {c['violations']}; tokens identical to a run without the canary: "
        f"{c['tokens_match_without_canary']} ({c['seconds']} s with, {c['baseline_seconds']} s without)",
        *(["  (the time with the canary includes numba compiling its kernels, once: they are cached on disk, and "
           "later runs skip it)"] if result.get("numba_compiled") else []),
        "",
        f"same workload with a planted engine bug '{b['name']}' (class {b['class']}): {b['what']}",
        f"  violations: {b['violations']}",
    ]
    for block in b["report"]:
        lines += ["", block]
    if b["log_lines"]:
        lines += ["", f"log lines ({min(5, len(b['log_lines']))} of {len(b['log_lines'])}):"]
        lines += b["log_lines"][:5]
    return "\n".join(lines)
