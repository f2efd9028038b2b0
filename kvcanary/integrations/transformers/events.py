"""The engine's request and block events the canary acts on: mode abort, the allocator check, poison on free.

Mode abort (docs/transformers.md, "Mode abort"): the canary names a request while a step's hooks run (its
drain), when the engine has not yet taken that step's outputs: failing it then would leave ``update_batch``
a failed request to update. So ``EngineAborts.request`` only queues it, and ``apply``, run by the session's
``update_batch`` hook after the engine's update, fails each queued request that is still live: its output is
delivered with the error (``FAILED``, the tokens generated so far), and it is cancelled, so the scheduler
frees its blocks before the next batch.

Blocks (transformers 5.18 and later; on 5.17 attach refuses both users, ``layout.POOL_OPTIONS``): every block the
cache gives back goes through ``cache.pool.free_blocks(index, blocks)`` (a finished or evicted request's
blocks, evicted prefix-cache blocks, dedup duplicates), wrapped once by ``watch_blocks`` for two users:

- the allocator check (docs/allocator.md) notes each full-attention free with its step, and reads the
  allocator's state: its free blocks are the leaves of its trees in the pool (a block handed back twice
  shows twice), its live tables ``block_table`` (request id -> block ids), its ledger the reference counts of
  shared blocks (an entry only from two references on; a block one table maps counts 1, a block kept only
  for its cached content 0). A block's slots are the rows ``block * block_physical_stride + offset``;
- poison on free (``CanaryConfig.poison_on_free``): at the start of the next step (after the scheduler ran,
  before the forward: an offload has copied its victims' freed blocks to the CPU by then) the noted blocks
  still free, on the pool's free list or in a free sector, are poisoned through ``Canary.poison_slots``. A
  block handed out again in between belongs to its new owner and is left alone; a block the engine freed
  while a request still maps it (a use after free) is poisoned, and that request's next read is reported.
"""

from __future__ import annotations

import torch

from kvcanary.runtime.abort import KvCanaryAbortError
from kvcanary.runtime.allocator import AllocatorSnapshot, BlockTable

FULL = "full_attention"
_FINISHED = 3  # transformers RequestStatus.FINISHED (as batch._STATUS_FINISHED)


class EngineAborts:
    """The session's abort queue (``Canary(on_abort=self.request)``)."""

    def __init__(self, session):
        self.session = session
        self.pending: dict[int, tuple] = {}

    def request(self, request_id: int, violations: tuple) -> None:
        """The canary's ``on_abort``: queue ``request_id`` (a canary id, ``Session.request_id``)."""
        self.pending[request_id] = violations

    def apply(self) -> None:
        """Fail the queued requests that are still active or waiting (a finished one keeps its output)."""
        if not self.pending:
            return
        with self.session.lock:  # (a drain on another thread, handle.flush, may queue meanwhile)
            pending, self.pending = self.pending, {}
        bp = self.session.bp
        names = {rid: name for name, rid in self.session.ids.items()}
        scheduler = bp.scheduler
        for rid, violations in pending.items():
            name = names.get(rid)
            state = scheduler.active_requests.get(name) or scheduler.waiting_requests.get(name)
            if state is None:  # (finished: finish_request took it off the active requests)
                continue
            bp._handle_request_error(KvCanaryAbortError(rid, violations, name), state)
            # The cancellation path removes it from the queues and frees its blocks (and any offloaded copy)
            # at the start of the next step, before anything is scheduled.
            scheduler.set_request_cancellation(name)
            if getattr(bp, "use_async_batching", False):
                # Async: the other IO pair's batch, already under way, still holds it, and its update after the
                # blocks are freed would mark blocks of a table gone (KeyError, the whole loop ends). A request
                # that ended between scheduling and update is skipped there: its output is delivered already.
                state.status = _FINISHED
            self.session.events["failed_requests"] += 1  # (stats: the requests the engine failed)


def watch_blocks(session) -> FreedBlocks | None:
    """Give ``session``'s canary the full-attention allocator's state and wrap the pool's ``free_blocks``
    once, noting each full-group free for the allocator check and, with poison on free, for ``FreedBlocks``
    (returned, else None). Nothing on a cache without a pool (5.17, where attach refuses both users)."""
    cache = session.bp.cache
    pool = getattr(cache, "pool", None)
    full = getattr(cache, "cache_allocators", {}).get(FULL)
    if pool is None or full is None or not hasattr(pool, "_free_blocks"):
        return None
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

    check = session.canary.watch_allocator(snapshot, num_blocks=num_blocks, slots_per_block=full.block_physical_stride)
    c = session.canary
    on = c.config.poison_on_free and c.enabled and full.index == session.layout.full_group
    freed = FreedBlocks(session, pool, full.index) if on else None
    free_blocks = pool.free_blocks

    def noted_free_blocks(index, block_ids):
        if index == full.index:
            check.note_free(block_ids)
        out = free_blocks(index, block_ids)
        if freed is not None and index == full.index:
            freed.noted.update(block_ids)
        return out

    session.patcher.set(pool, "free_blocks", noted_free_blocks)
    return freed


class FreedBlocks:
    """The full group's freed blocks of one session, poisoned at each step's start (``poison``)."""

    def __init__(self, session, pool, index: int):
        self.s, self.pool, self.index = session, pool, index
        self.noted: set[int] = set()

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
