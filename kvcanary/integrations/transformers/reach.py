"""The engine internals of transformers' paged cache that the planted bugs (``kvcanary/sim/hf_bugs.py``) and the
CPU test set-ups reach, one class per cache generation beside that generation's layout (``reach``).

A layout (``layout.EngineLayout``, ``layouts.py``) describes what the canary guards; its reach adds what a
planted bug breaks (free lists, fork copies, the prefix-cache key) and the plain CPU swap pool that tests and
soak runs give the engine, and reads everything else (block tables, slots, sizes) through the layout. The
attach path never imports this module; a new cache generation adds its layout and its reach here.

The project's demo, benchmarks, soak runs and tests also take their transformers set-up from here: the
version's paged SDPA name (``sdpa_name``), its ``ContinuousBatchingConfig`` (``cb_config``) and ``attach``
with one flat set of keywords (``attach_with``).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

__all__ = ["attach_with", "cb_config", "has_block_pool", "has_mla_paging", "reach", "sdpa_name"]

FULL = "full_attention"


def sdpa_name() -> str:
    """The paged SDPA attention's name for the installed transformers: 5.17 needs ``paged|sdpa``; from 5.18
    plain ``sdpa`` is paged under continuous batching (the prefix logs a FutureWarning)."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    return "sdpa" if hasattr(PagedAttentionCache, "perform_cache_copy") else "paged|sdpa"


def has_block_pool() -> bool:
    """Whether the installed transformers' paged cache is 5.18's, with the block pool and ledger that the options
    of ``layout.POOL_OPTIONS`` (the allocator check, poison on free) read; attach refuses them on 5.17."""
    import transformers

    from kvcanary.integrations.transformers.layout import BLOCK_POOL_SINCE, parse_version

    return parse_version(transformers.__version__) >= BLOCK_POOL_SINCE


def has_mla_paging() -> bool:
    """Whether the installed transformers pages MLA latents (5.25+: an MLA allocator, one latent row per token)."""
    try:
        from transformers.generation.continuous_batching import cache_allocators
    except ImportError:  # (5.17: no allocators)
        return False
    return hasattr(cache_allocators, "MLACacheAllocator")


def cb_config(**kwargs):
    """A ``ContinuousBatchingConfig`` for the installed transformers: ``block_size`` is ``page_size`` from 5.18
    (the old name logs a deprecation warning per config)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if "block_size" in kwargs and hasattr(ContinuousBatchingConfig, "page_size"):
        kwargs["page_size"] = kwargs.pop("block_size")
    return ContinuousBatchingConfig(**kwargs)


def attach_with(model_or_manager, **options):
    """Private: ``attach`` with one flat set of keywords, for the project's demo, benchmarks, soak and tests:
    ``attach``'s own, ``CanaryConfig`` fields (onto ``config`` or the environment's) and ``tuned`` toggles."""
    from kvcanary.integrations.transformers.handle import TUNING_OPTIONS, attach, tuned
    from kvcanary.runtime import CanaryConfig

    tuning = {k: options.pop(k) for k in TUNING_OPTIONS if k in options}
    public = set(inspect.signature(attach).parameters) - {"model_or_manager"}
    config_fields = {f.name for f in dataclasses.fields(CanaryConfig)}
    fields = {k: options.pop(k) for k in list(options) if k in config_fields and k not in public}
    unknown = sorted(set(options) - public)
    if unknown:
        raise TypeError(f"kv-canary: attach got unknown options {unknown}; expected attach's keywords, "
                        f"CanaryConfig fields or {list(TUNING_OPTIONS)}")
    if fields:
        config = options.get("config")
        options["config"] = CanaryConfig.from_env(**fields) if config is None else config.replace(**fields)
    with tuned(**tuning):
        return attach(model_or_manager, **options)


def reach(layout):
    """The reach of an ``EngineLayout`` (by its generation: the 5.18+ sector cache or 5.17's blocks)."""
    from kvcanary.integrations.transformers.cache_sectors import SectorLayout

    return (SectorReach if isinstance(layout, SectorLayout) else BlockReach)(layout)


class _Reach:
    """A layout's bug-facing internals; every other attribute is the layout's."""

    def __init__(self, layout):
        self.lay = layout

    def __getattr__(self, name: str):
        if name == "lay":  # (not yet set: no recursion)
            raise AttributeError(name)
        return getattr(self.lay, name)

    def plain_cpu_swap_pool(self, offloading_manager, blocks: int) -> None:
        """Give the engine's CPU swap pool room for ``blocks`` full-group blocks in plain (unpinned) memory,
        unless it has one: transformers allocates it pinned, which a CPU-only torch cannot (tests, soak)."""
        raise NotImplementedError

    def full_allocator(self):
        """The object holding the full group's ``block_table``, ``get_read_indices``, ``get_write_indices``."""
        raise NotImplementedError

    def kv_writer(self):
        """The object whose ``update(key_states, value_states, layer_idx, ...)`` stores a forward's new K and V of
        each full-attention layer (wrap it per instance to change what a write stores)."""
        raise NotImplementedError

    def wrap_seqlen_k(self, replace) -> None:
        """Per instance: ``replace(n, past_length, query_length)`` gives a request's full-group key length ``n``
        (the engine asks for it just before the request's read indices)."""
        raise NotImplementedError

    def free_now(self, block: int) -> None:
        """Give a full-group block back as the engine frees one, whoever still maps it."""
        raise NotImplementedError

    def zero_pool(self) -> None:
        raise NotImplementedError

    def k_row(self, layer: int, slot: int) -> torch.Tensor:
        """Layer ``layer``'s K of ``slot`` (a view into the cache)."""
        raise NotImplementedError

    def is_free(self, block: int) -> bool:
        raise NotImplementedError

    def hand_out_next(self, block: int, times: int = 1) -> None:
        """Put a full-group block on the free list ``times`` times, where the next allocations take it."""
        raise NotImplementedError

    def take_free(self, block: int) -> None:
        """Remove a full-group block from the free list."""
        raise NotImplementedError

    def wrap_fork_copy(self, replace) -> None:
        """Per instance: ``replace(src_blocks, dst_blocks)`` sees each full-group fork copy first and does it
        (or not) itself when it returns True; otherwise the engine copies."""
        raise NotImplementedError

    def copy_blocks_partly(self, src: list[int], dst: list[int], copy_k: bool, copy_v: bool,
                           layers: int | None) -> None:
        """Copy full-group blocks' K and/or V, of the first ``layers`` layers (all: None)."""
        raise NotImplementedError

    def parentless_prefix_hash(self) -> None:
        """Per instance: the prefix-cache key of a block leaves out its parent block."""
        raise NotImplementedError


class SectorReach(_Reach):
    """transformers 5.18 and later: one byte tensor in sectors, one allocator per attention type."""

    def plain_cpu_swap_pool(self, offloading_manager, blocks: int) -> None:
        from transformers.generation.continuous_batching.cache_allocators import CachePool

        om, c = offloading_manager, self.cache
        if om._cpu_pool is not None:
            return
        sectors = max(1, -(-blocks * self.full_allocator().bytes_per_block // c.bytes_per_sector))
        om._num_cpu_sectors = sectors
        om._cpu_tensor = torch.zeros(sectors * c.bytes_per_sector, dtype=torch.uint8)
        om._cpu_pool = CachePool(sectors, len(c.cache_allocators), num_reserved_sectors=0)
        for name, a in c.cache_allocators.items():
            om._cpu_pool.set_blocks_per_sector(a.index, a.blocks_per_sector)
            om._cpu_views[name] = om._cpu_tensor.view(-1, a.bytes_per_block)

    def full_allocator(self):
        return self.cache.cache_allocators[FULL]

    def kv_writer(self):
        return self.full_allocator()

    def wrap_seqlen_k(self, replace) -> None:
        a = self.full_allocator()
        orig = a.get_seqlen_k
        a.get_seqlen_k = lambda past_length, query_length: replace(orig(past_length, query_length), past_length,
                                                                   query_length)

    def free_now(self, block: int) -> None:
        self.cache.pool.free_blocks(self.full_allocator().index, [block])

    def zero_pool(self) -> None:
        self.cache.cache_tensor.zero_()

    def k_row(self, layer: int, slot: int) -> torch.Tensor:
        from kvcanary.integrations.transformers.cache_sectors import _layer_rows

        a = self.cache.layer_to_allocator[layer]
        return next(k for lay, k, _ in _layer_rows(self.cache, a) if lay == layer)[slot]

    def _free_tree(self):
        return self.cache.pool._free_blocks[self.full_allocator().index]

    def is_free(self, block: int) -> bool:
        trees = self._free_tree()
        return block in trees.trees.get(block // trees.elems_per_tree, ())

    def hand_out_next(self, block: int, times: int = 1) -> None:
        # The pool hands out the last leaves of its first tree (sector) first: the block goes there.
        trees = self._free_tree()
        root = block // trees.elems_per_tree
        leaves = trees.trees.pop(root, [])
        leaves.extend([block] * times)
        trees.trees = {root: leaves, **trees.trees}
        trees._length += times

    def take_free(self, block: int) -> None:
        trees = self._free_tree()
        trees.trees[block // trees.elems_per_tree].remove(block)
        trees._length -= 1

    def wrap_fork_copy(self, replace) -> None:
        cache = self.cache
        orig = cache.perform_cache_copy

        def perform_cache_copy(copy_src_and_dst):
            src, dst = copy_src_and_dst.get(FULL, ((), ()))
            if len(src) and replace(list(src), list(dst)):
                copy_src_and_dst = {n: p for n, p in copy_src_and_dst.items() if n != FULL}
            orig(copy_src_and_dst)

        cache.perform_cache_copy = perform_cache_copy

    def copy_blocks_partly(self, src, dst, copy_k, copy_v, layers) -> None:
        a = self.full_allocator()
        # a block: per layer, its K page then its V page
        view = self.cache.cache_tensor.view(-1, a.bytes_per_block).view(-1, a.pages_per_block, 2, a.bytes_per_page // 2)
        s_, d_ = torch.tensor(src), torch.tensor(dst)
        for i in range(a.pages_per_block if layers is None else min(layers, a.pages_per_block)):
            for kv, on in ((0, copy_k), (1, copy_v)):
                if on:
                    view[d_, i, kv] = view[s_, i, kv]

    def parentless_prefix_hash(self) -> None:
        # The allocators hash blocks with their module's compute_block_hash: swapped for the length of this
        # allocator's two hashing calls only, so other caches keep the engine's key.
        from transformers.generation.continuous_batching.cache_allocators import cache_allocator as mod

        a, engine_hash = self.full_allocator(), mod.compute_block_hash

        def parentless(parent_hash, tokens):
            return engine_hash(None, tokens)

        for name in ("match_prefix_blocks", "mark_complete_blocks"):
            def call(*args, _orig=getattr(a, name), **kwargs):
                mod.compute_block_hash = parentless
                try:
                    return _orig(*args, **kwargs)
                finally:
                    mod.compute_block_hash = engine_hash

            setattr(a, name, call)


class BlockReach(_Reach):
    """transformers 5.17: per-layer K and V tensors and one block manager."""

    def plain_cpu_swap_pool(self, offloading_manager, blocks: int) -> None:
        om, c = offloading_manager, self.cache
        if om._num_cpu_blocks:
            return
        shape = (blocks, c.block_size, c.num_key_value_heads, c.head_dim)
        om._num_cpu_blocks = blocks
        om._cpu_key_cache = [torch.zeros(shape, dtype=c.dtype) for _ in c.key_cache]
        om._cpu_value_cache = [torch.zeros(shape, dtype=c.dtype) for _ in c.key_cache]
        om._gpu_key_views = [k.view(-1, *shape[1:]) for k in c.key_cache]
        om._gpu_value_views = [v.view(-1, *shape[1:]) for v in c.value_cache]
        om._free_cpu_blocks = list(range(blocks))

    def full_allocator(self):
        return self.cache.group_cache_managers[self.full_group]

    def kv_writer(self):
        return self.cache  # (one update for every layer group)

    def wrap_seqlen_k(self, replace) -> None:
        cache = self.cache
        orig = cache.get_seqlens_k  # (one dict of every attention type's length)

        def get_seqlens_k(past_length, query_length):
            lengths = orig(past_length, query_length)
            lengths[FULL] = replace(lengths[FULL], past_length, query_length)
            return lengths

        cache.get_seqlens_k = get_seqlens_k

    def free_now(self, block: int) -> None:
        # (a complete shared block freed through the block manager would stay cached: its content kept, not free;
        # the front of the free list is where the engine's next allocation takes it, as after a real free)
        self.hand_out_next(block)

    def zero_pool(self) -> None:
        for t in (*self.cache.key_cache, *self.cache.value_cache):
            t.zero_()

    def k_row(self, layer: int, slot: int):
        _, j = self.cache.layer_index_to_group_indices[layer]
        return self.cache.key_cache[j][slot]

    def is_free(self, block: int) -> bool:
        return block in self.cache._block_manager._uninit_block_ids

    def hand_out_next(self, block: int, times: int = 1) -> None:
        for _ in range(times):
            self.cache._block_manager._uninit_block_ids.appendleft(block)

    def take_free(self, block: int) -> None:
        self.cache._block_manager._uninit_block_ids.remove(block)

    def wrap_fork_copy(self, replace) -> None:
        cache = self.cache
        orig = cache.copy_cache

        def copy_cache(src, dst):
            if not replace(src, dst):
                orig(src, dst)

        cache.copy_cache = copy_cache

    def copy_blocks_partly(self, src, dst, copy_k, copy_v, layers) -> None:
        s_, d_ = torch.tensor(src), torch.tensor(dst)
        for j, (k, v) in enumerate(zip(self.cache.key_cache, self.cache.value_cache)):
            if layers is not None and j >= layers:
                continue
            for t, on in ((k, copy_k), (v, copy_v)):
                if on:
                    view = t.view(-1, self.block_size, *t.shape[1:])
                    view[d_] = view[s_]

    def parentless_prefix_hash(self) -> None:
        bm = self.cache._block_manager
        orig = bm.compute_hash

        def compute_hash(parent_hash, tokens, group_id):
            return orig(None, tokens, group_id)

        bm.compute_hash = compute_hash
