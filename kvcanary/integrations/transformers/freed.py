"""Poison on free (``CanaryConfig.poison_on_free``): the blocks transformers' paged cache frees, poisoned.

Every block the cache gives back goes through ``cache.pool.free_blocks(index, blocks)``: a finished or
evicted request's blocks, evicted prefix-cache blocks, dedup duplicates. The hook notes the full
group's; at the start of the next step (after the scheduler ran, before the forward: an offload has
copied its victims' freed blocks to the CPU by then) the noted blocks that are still free, on the
pool's free list or in a free sector, are poisoned through ``Canary.poison_slots``. A block handed out
again in between belongs to its new owner and is left alone; a block the engine freed while a request
still maps it (a use after free) is poisoned, and that request's next read of it is reported.
"""

from __future__ import annotations


class FreedBlocks:
    """The full group's freed blocks of one session, poisoned at each step's start (``poison``)."""

    def __init__(self, session, pool, allocator):
        self.s, self.pool, self.index = session, pool, allocator.index
        self.noted: set[int] = set()
        index = allocator.index

        def free_blocks(group, block_ids, _orig=pool.free_blocks):
            _orig(group, block_ids)
            if group == index:
                self.noted.update(block_ids)

        session.patcher.set(pool, "free_blocks", free_blocks)

    @classmethod
    def install(cls, session) -> FreedBlocks | None:
        """The hook on the session's cache pool where the canary poisons freed slots, else None."""
        if not session.canary.config.poison_on_free or not session.canary.enabled:
            return None
        lay = session.layout
        allocator = next((a for a in getattr(lay.cache, "cache_allocators", {}).values()
                          if a.index == lay.full_group), None)
        pool = getattr(lay.cache, "pool", None)
        if allocator is None or pool is None or not callable(getattr(pool, "free_blocks", None)):
            return None  # (the 5.17 block manager has no pool: poison is not wired there)
        return cls(session, pool, allocator)

    def poison(self) -> None:
        """Poison the noted blocks nobody holds now (each step's start, on the engine's stream)."""
        if not self.noted:
            return
        trees, sectors = self.pool._free_blocks[self.index], set(self.pool.free_sectors)
        per = trees.elems_per_tree  # (a tree's root is its sector: a sector given back holds no tree)
        blocks = sorted(b for b in self.noted if b // per in sectors or b in trees.trees.get(b // per, ()))
        self.noted.clear()
        if blocks:
            s = self.s
            with s._engine_stream():
                s.canary.poison_slots(s.layout.blocks_to_slots(blocks, s.device))
