"""A small vLLM engine for the tests, the demo and the benchmarks: no download, seconds to start.

``tiny_model(directory)`` saves a Llama-shaped model with seeded random weights (``save_pretrained``; head_dim 32,
the CPU attention backend's smallest); ``start(directory, ...)`` builds ``vllm.LLM`` on it with the arguments a
cheap CPU run needs (no tokenizer, eager mode, a KV pool of a given number of blocks). ``guarded(True/False)``
turns the canary's hooks on or off in this process for the engines started afterwards, and ``generate`` runs
token-id prompts greedily and returns each request's output tokens by request id.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os

TINY_CONFIG = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   intermediate_size=256, vocab_size=512, max_position_embeddings=1024)
BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
# float16, not bfloat16: on a CPU with AMX tiles vLLM runs bf16 attention with its "amx" kernel, whose KV layout
# interleaves tokens (the canary hashes token-row copies there: ``mirror.RowMirror``), elsewhere with "vec"; float16
# takes "vec" on every x86 CPU, so the tests and campaigns run one path and give the same results on any host
# (tests/vllm/test_vllm_mirror.py runs bf16 on the amx kernel where the CPU has it)
DTYPE = "float16"


def tiny_model(directory: str, seed: int = 0, **overrides) -> str:
    """Save (once: an existing model there is kept) the tiny random-weight Llama to ``directory``; returns it."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, **overrides})).to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def kv_bytes(model_dir: str, num_blocks: int, block_size: int = BLOCK_SIZE, tp: int = 1) -> int:
    """``kv_cache_memory_bytes`` that gives the model ``num_blocks`` KV blocks (per TP rank: its heads)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = 2 * cfg["num_hidden_layers"] * (cfg["num_key_value_heads"] // tp) * head_dim * block_size * 2
    return num_blocks * per_block


def start(model_dir: str, *, num_blocks: int = 256, max_num_seqs: int = 8, max_num_batched_tokens: int = 128,
          max_model_len: int = 512, enable_prefix_caching: bool = True, tp: int = 1, dtype: str = DTYPE, **kwargs):
    """A ``vllm.LLM`` on ``model_dir`` (``DTYPE``, no tokenizer, eager, ``num_blocks`` KV blocks of 32 tokens)."""
    from vllm import LLM

    with _scannable_llvmlite():
        return LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype, block_size=BLOCK_SIZE,
               max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
               kv_cache_memory_bytes=kv_bytes(model_dir, num_blocks, tp=tp), enable_prefix_caching=enable_prefix_caching,
                   enforce_eager=True, tensor_parallel_size=tp, seed=0, **kwargs)


class _LibProxy:
    """Forwards every attribute to llvmlite's ``ffi.lib``, and has an ordinary ``__dict__``."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        return getattr(self._lib, name)


@contextlib.contextmanager
def _scannable_llvmlite():
    """vLLM 0.32's worker start scans every module's globals and calls ``vars(value).get(...)`` on them; llvmlite's
    ``ffi.lib`` answers ``vars`` with a function wrapper, so the second engine started in a process that imported
    numba (the canary's CPU backend, after the first engine) fails with "'_lib_fn_wrapper' object has no attribute
    'get'". Engines in processes of their own (``vllm serve``, the multiprocess engine core) never meet it: this
    stand-in is for engines started one after another in one process (tests, the demo, benchmarks)."""
    import sys

    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = getattr(ffi, "lib", None)
    if lib is None or isinstance(vars(lib), dict):
        yield
        return
    ffi.lib = _LibProxy(lib)
    try:
        yield
    finally:
        ffi.lib = lib


def stop(llm) -> None:
    """Shut an engine down now (workers, in-process runner) rather than at garbage collection."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate(llm, prompts: list[list[int]], max_tokens: int = 8) -> dict[str, list[int]]:
    """Greedy outputs of token-id prompts: {request id: output token ids}."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {o.request_id: list(o.outputs[0].token_ids) for o in outs}


@contextlib.contextmanager
def guarded(on: bool = True, **variables: str):
    """The canary's hooks on (``KV_CANARY_VLLM=1`` and ``register``) or off in this process, with ``KV_CANARY_*``
    ``variables`` set, for the engines started and the steps run inside the block; restored after it."""
    from kvcanary.integrations.vllm import plugin

    saved = {k: os.environ.get(k) for k in [plugin.ENABLE_VARIABLE, *variables]}
    was = plugin.installed()
    os.environ[plugin.ENABLE_VARIABLE] = "1" if on else "0"
    os.environ.update(variables)
    try:
        if on:
            plugin.register()
        else:
            plugin.unregister()
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if was and not plugin.installed():
            os.environ[plugin.ENABLE_VARIABLE] = "1"
            plugin.register()
            if saved[plugin.ENABLE_VARIABLE] is None:
                os.environ.pop(plugin.ENABLE_VARIABLE)
            else:
                os.environ[plugin.ENABLE_VARIABLE] = saved[plugin.ENABLE_VARIABLE]
        elif not was and plugin.installed():
            plugin.unregister()
