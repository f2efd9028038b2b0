"""What the soak's transformers driver knows about the engine's version: the batching knobs, and the cache shims.

Kept apart so that a port to a newer transformers changes this file alone: the names of the batching knobs
(block size, pool size, token budget, CPU offload, seed). The CPU swap pool for a machine without pinned
memory, and the block the canary reserves (which the run without it gives up too), go through the adapter's
``EngineLayout`` of the cache generation at hand (5.17's blocks, 5.18+'s sectors).
"""

from __future__ import annotations

from collections.abc import Callable

from kvcanary.soak.hf_workload import HfWorkload


def engine_config(w: HfWorkload, device: str) -> dict:
    """``ContinuousBatchingConfig`` keywords of workload ``w``: synchronous, no CUDA graphs (what the
    adapter supports), block sharing off for the sliding-window model (the adapter requires it)."""
    import inspect

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # 5.18+ calls the block a page (block_size still works there, with a deprecation warning per run)
    size = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    cb = {size: w.block_size, "num_blocks": w.num_blocks, "max_batch_tokens": w.max_batch_tokens,
          "max_requests_per_batch": w.max_requests_per_batch, "use_async_batching": False,
          "use_cuda_graph": False, "scheduler_type": "fifo", "allow_block_sharing": w.model != "hybrid"}
    if w.offload_blocks and device != "cpu":
        cb["cpu_offload_space"] = w.offload_blocks * _block_bytes(w) / 2 ** 30
    if w.sampling == "sampled":
        cb["seed"] = w.seed
    return cb


def _block_bytes(w: HfWorkload) -> int:
    from kvcanary.demo import TINY_CONFIG

    c = TINY_CONFIG
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    # K and V of every layer, fp32, plus a little so the engine's rounding down keeps every block
    return 2 * c["num_hidden_layers"] * w.block_size * c["num_key_value_heads"] * head_dim * 4 + 1


def processor_shims(w: HfWorkload, device: str, reserve_padding: bool) -> list[Callable]:
    """Functions to run on each batch processor as the engine creates it (before the canary sees it).

    ``reserve_padding``: the run without the canary takes block 0 out of the free list as the canary does,
    so both runs have the same capacity and make the same scheduling decisions (same tokens)."""
    shims: list[Callable] = []
    if w.offload_blocks and device == "cpu":
        shims.append(lambda bp: _cpu_swap_pool(bp, w.offload_blocks))
    if reserve_padding:
        shims.append(_reserve_block0)
    return shims


def _cpu_swap_pool(bp, blocks: int) -> None:
    """transformers' swap pool is pinned memory, which a CPU-only torch cannot allocate: plain memory, laid out
    by the adapter's view of this cache generation."""
    from kvcanary.integrations.transformers.layouts import layout_of
    from kvcanary.integrations.transformers.reach import reach

    reach(layout_of(bp.cache)).plain_cpu_swap_pool(bp.offloading_manager, blocks)


def _reserve_block0(bp) -> None:
    """What the canary's session does to the pool (keep slot 0 free of real tokens, where that takes a block)."""
    from kvcanary.integrations.transformers.layouts import layout_of

    layout_of(bp.cache).reserve_padding()


def wrap_processors(model, shims: list[Callable]) -> Callable[[], None]:
    """Run ``shims`` on every batch processor ``model`` creates; returns the undo (per instance, as
    ``bugs.plant`` does: wrap before ``attach`` so the canary sees the processor shimmed)."""
    if not shims:
        return lambda: None
    from kvcanary.sim.hf_bugs import on_new_processors

    def shimmed(bp) -> None:
        for shim in shims:
            shim(bp)

    return on_new_processors(model, shimmed, "_kvcanary_soak")
