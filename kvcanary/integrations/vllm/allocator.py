"""vLLM's block pool as the canary's allocator check reads it (docs/allocator.md), where the scheduler shares the
worker's process.

The verify sees an early free only once the freed block is reused, rewritten and read; the allocator check looks
at the bookkeeping itself at the close of a step: vLLM's free block queue, the blocks each request holds
(``req_to_blocks`` of the KV-cache manager) and each block's ``ref_cnt``. Rules: a held block on the free queue
(an early free), a block twice on the queue (a double free), a ``ref_cnt`` that differs from the requests holding
the block, a forward write into a free block, two tokens of a forward writing one slot.

A freed block of vLLM stays in its prefix cache (hashed, on the free queue with ``ref_cnt`` 0) until it is
evicted: a request that hits it takes it off the queue first, so none of the rules meets a cached block that
nobody holds. The scheduler exists in the worker's process with vLLM's one-worker executor (``uni``, the default
without parallelism); a worker of the multiprocess executor has none, and the check is refused there.
"""

from __future__ import annotations

import weakref

import torch

from kvcanary.runtime.allocator import AllocatorSnapshot, BlockTable

_SCHEDULER: list = []  # a weak reference to the newest vLLM scheduler of this process (plugin.py records it)


def note_scheduler(scheduler) -> None:
    _SCHEDULER[:] = [weakref.ref(scheduler)]


def scheduler():
    return _SCHEDULER[0]() if _SCHEDULER else None


class BlockPoolView:
    """The allocator check's provider over the process's scheduler (found at each check: vLLM builds the scheduler
    after the KV cache the canary is built on)."""

    def __init__(self, names, num_blocks: int):
        self.names, self.num_blocks = names, num_blocks

    def __call__(self) -> AllocatorSnapshot | None:
        sched = scheduler()
        if sched is None:
            return None
        pool = sched.kv_cache_manager.block_pool
        managers = sched.kv_cache_manager.coordinator.single_type_managers
        free = torch.tensor([b.block_id for b in pool.free_block_queue.get_all_free_blocks()], dtype=torch.int64)
        held = [(rid, blocks) for rid, blocks in managers[0].req_to_blocks.items() if blocks]
        width = max((len(b) for _, b in held), default=1)
        rows = torch.zeros(max(1, len(held)), width, dtype=torch.int64)
        lens = torch.zeros(max(1, len(held)), dtype=torch.int64)
        holders = torch.zeros(max(1, len(held)), dtype=torch.int64)
        for i, (rid, blocks) in enumerate(held):
            ids = [b.block_id for b in blocks if not b.is_null]
            rows[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
            lens[i], holders[i] = len(ids), self.names.number(rid)
        # the null block (padding) is held by nobody and counted by nobody
        refcounts = torch.tensor([0 if b.is_null else b.ref_cnt for b in pool.blocks], dtype=torch.int64)
        return AllocatorSnapshot(free, (BlockTable(rows, lens, holders),), refcounts)
