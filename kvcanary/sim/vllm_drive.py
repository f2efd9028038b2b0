"""Drive vLLM's offline engine request by request: the planted-bug runs and the soak's workloads.

``LLM.generate`` submits every prompt at once; a bookkeeping bug often needs requests that arrive while
others run (a prefix hit on a running request's blocks, a finish that frees blocks a newcomer takes). The
driver adds each request at the engine step its arrival names and steps vLLM's ``LLMEngine`` until every
request finished. Nothing here imports vLLM at import time (the project's main environment has none).

Example:
    >>> llm = make_llm(tiny_model_dir(), num_gpu_blocks_override=24)
    >>> out = drive(llm, [Arrival("a", [1, 2, 3], 8), Arrival("b", [1, 2, 3, 4], 8, step=2)])
    >>> sorted(out)
    ['a', 'b']
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

# head_dim 32: the CPU attention backend's smallest head size
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048)
BLOCK = 32  # the CPU attention backend needs a multiple of 32


@dataclass(frozen=True)
class Arrival:
    """One request: its id, prompt tokens, tokens to generate, the engine step it arrives at, its cache salt
    and LoRA adapter."""

    rid: str
    prompt: tuple[int, ...] | list[int]
    max_tokens: int
    step: int = 0
    cache_salt: str | None = None
    lora: tuple[str, int, str] | None = None  # (name, id, adapter directory)


def tiny_model_dir(config: dict | None = None, seed: int = 0, root: str | None = None) -> str:
    """A Llama with seeded random weights saved (bf16) for vLLM to load, built once per config and seed."""
    cfg = {**TINY, **(config or {})}
    tag = "-".join(f"{k[:3]}{v}" for k, v in sorted(cfg.items())) + f"-s{seed}"
    path = os.path.join(root or os.path.join(tempfile.gettempdir(), "kvcanary-vllm-models"), tag)
    if not os.path.exists(os.path.join(path, "config.json")):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**cfg, torch_dtype="bfloat16")).to(torch.bfloat16)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(path) if os.path.isdir(os.path.dirname(path)) else None)
        model.save_pretrained(tmp)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.rename(tmp, path)
        except OSError:  # another process saved it first
            pass
    return path


def make_llm(model_dir: str, **engine_kwargs):
    """vLLM's ``LLM`` on the CPU, engine core in this process, small pool; ``engine_kwargs`` override."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    from kvcanary.integrations.vllm.engine import DTYPE, _scannable_llvmlite

    # (vLLM caches its environment once an engine is up; a later engine of other settings, e.g. the threads
    # each tensor-parallel rank binds, must read it again)
    from vllm import envs

    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    kw = dict(model=model_dir, skip_tokenizer_init=True, dtype=DTYPE, block_size=BLOCK, max_model_len=512,
              enforce_eager=True, gpu_memory_utilization=0.05, num_gpu_blocks_override=32, max_num_seqs=8,
              max_num_batched_tokens=256, enable_prefix_caching=True, seed=0)
    kw.update(engine_kwargs)
    if "max_model_len" not in engine_kwargs:  # vLLM refuses a pool smaller than one longest request
        kw["max_model_len"] = min(kw["max_model_len"], (kw["num_gpu_blocks_override"] - 1) * kw["block_size"])
    with _scannable_llvmlite():  # (a second engine in a process where numba runs: the integration's stand-in)
        return LLM(**kw)


def engine_core(llm):
    """The in-process ``EngineCore`` (scheduler, KV-cache manager, executor)."""
    return llm.llm_engine.engine_core.engine_core


def runner_of(llm):
    """The model runner of an in-process, single-worker engine (tensor parallelism 1)."""
    return engine_core(llm).model_executor.driver_worker.worker.model_runner


def drive(llm, arrivals: list[Arrival], max_steps: int = 10_000, greedy: bool = True, seed: int = 0) -> dict:
    """Run ``arrivals`` on ``llm`` (each added at its ``step``); returns ``{rid: generated token ids}``."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    pending = sorted(arrivals, key=lambda a: a.step)
    out: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            prompt = {"prompt_token_ids": list(a.prompt)}
            if a.cache_salt is not None:
                prompt["cache_salt"] = a.cache_salt
            sp = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, detokenize=False,
                                **({"temperature": 0.0} if greedy else {"temperature": 1.0, "seed": seed}))
            lora = None
            if a.lora is not None:
                from vllm.lora.request import LoRARequest

                lora = LoRARequest(*a.lora)
            engine.add_request(a.rid, prompt, sp, lora_request=lora)
        if engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
        step += 1
        if step > max_steps:
            raise RuntimeError(f"kv-canary: the vLLM run did not finish in {max_steps} engine steps")
    return out


def tiny_lora_dir(model_dir: str, rank: int = 8, seed: int = 1) -> str:
    """A LoRA adapter (PEFT layout) of seeded random weights on ``model_dir``'s K and V projections, built once."""
    import json

    path = os.path.join(os.path.dirname(model_dir), os.path.basename(model_dir) + f"-lora-r{rank}-s{seed}")
    if os.path.exists(os.path.join(path, "adapter_config.json")):
        return path
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    hidden = cfg["hidden_size"]
    kv = cfg["num_key_value_heads"] * hidden // cfg["num_attention_heads"]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj in ("k_proj", "v_proj"):
            stem = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.5
            tensors[f"{stem}.lora_B.weight"] = torch.randn(kv, rank, generator=g) * 0.5
    tmp = tempfile.mkdtemp(dir=os.path.dirname(model_dir))
    save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"))
    with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
        json.dump({"r": rank, "lora_alpha": 2 * rank, "target_modules": ["k_proj", "v_proj"], "peft_type": "LORA",
                   "bias": "none", "base_model_name_or_path": model_dir, "task_type": "CAUSAL_LM"}, f)
    try:
        os.rename(tmp, path)
    except OSError:
        pass
    return path
