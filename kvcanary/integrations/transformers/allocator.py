"""The paged cache's full-attention allocator as the canary's allocator check sees it (docs/allocator.md).

transformers 5.18 and later: the allocator's free blocks are the leaves of its trees in the cache pool
(a block handed back twice shows twice), its live tables are ``block_table`` (request id -> block ids)
and its ledger keeps the reference counts of shared blocks (an entry only from two references on; a
block one table maps counts 1, a block kept only for its cached content 0). A block's slots are the
rows ``block * block_physical_stride + offset``, the canary's slot space. The pool's ``free_blocks``
is wrapped so that every free is noted with its step.
"""

from __future__ import annotations

import torch

from kvcanary.runtime.allocator import AllocatorSnapshot, BlockTable

FULL = "full_attention"


def watch_allocator(session, patcher) -> None:
    """Give ``session``'s canary the full-attention allocator's state (a sector cache only; 5.17's block
    manager is left unchecked) and note its frees; ``patcher`` undoes the wrap on detach."""
    cache = session.bp.cache
    pool = getattr(cache, "pool", None)
    full = getattr(cache, "cache_allocators", {}).get(FULL)
    if pool is None or full is None or not hasattr(pool, "_free_blocks"):
        return
    num_blocks = (pool.num_sectors + pool.num_reserved_sectors) * full.blocks_per_sector

    def snapshot() -> AllocatorSnapshot:
        # (read each time: a cache reset gives the pool new trees)
        trees = pool._free_blocks[full.index].trees
        free = torch.tensor([b for leaves in trees.values() for b in leaves], dtype=torch.int64)
        names = list(full.block_table)
        width = max((len(full.block_table[n]) for n in names), default=0)
        blocks = torch.full((len(names), width), -1, dtype=torch.int64)
        for i, n in enumerate(names):
            row = full.block_table[n]
            blocks[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
        lens = torch.tensor([len(full.block_table[n]) for n in names], dtype=torch.int64)
        holders = torch.tensor([session.request_id(n) for n in names], dtype=torch.int64)
        # the ledger's counts: 1 where a table maps a block and the ledger keeps no count, 0 for cached blocks
        counts = torch.zeros(num_blocks, dtype=torch.int64)
        held = blocks[(blocks >= 0) & (blocks < num_blocks)]
        counts[held] = 1
        ledger = full.ledger
        for b, n in ledger.shared_ref_counts.items():
            counts[b] = n
        counts[list(ledger.cached_blocks)] = 0
        return AllocatorSnapshot(free, (BlockTable(blocks, lens, holders),), refcounts=counts)

    check = session.canary.watch_allocator(snapshot, num_blocks=num_blocks,
                                           slots_per_block=full.block_physical_stride)
    free_blocks = pool.free_blocks

    def noted_free_blocks(index, block_ids):
        if index == full.index:
            check.note_free(block_ids)
        return free_blocks(index, block_ids)

    patcher.set(pool, "free_blocks", noted_free_blocks)
