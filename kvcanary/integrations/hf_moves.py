"""The transformers session's hooks where the engine moves KV between steps: fork copies, offloads to and
restores from CPU memory, and the idle cached blocks a periodic sweep verifies (``Session`` mixes them in)."""

from __future__ import annotations

import torch

__all__ = ["KvMoves"]


class KvMoves:
    """Needs the session's ``bp``, ``layout``, ``canary``, ``lock``, ``events``, ``saved``, ``block_pos``,
    ``device`` and ``_engine_stream``."""

    def _copy_records(self, src, dst) -> None:
        s, d = self.layout.blocks_to_slots(src, self.device), self.layout.blocks_to_slots(dst, self.device)
        with self.lock, self._engine_stream():
            for g in self.canary.groups:
                self.canary.copy_records(s, d, group=g.name)
        self.events["fork_block_copies"] += len(src)

    def _all_blocks(self, rid: str) -> list[int]:
        return [b for cm in self.bp.cache.group_cache_managers for b in cm.block_table.get(rid, [])]

    def _save(self, blocks: dict[str, list[int]]) -> None:
        with self.lock, self._engine_stream():
            for rid, bl in blocks.items():
                slots = self.layout.blocks_to_slots(bl, self.device)
                self.saved[rid] = [(g.name, self.canary.save_records(slots, group=g.name))
                                   for g in self.canary.groups]
        self.events["offloaded_requests"] += len(blocks)

    def _restore(self, counts: dict[str, list[int]]) -> None:
        cms = self.bp.cache.group_cache_managers
        with self.lock, self._engine_stream():
            for rid, per_group in counts.items():
                blocks = [b for g, n in enumerate(per_group) for b in cms[g].block_table.get(rid, [])[:n]]
                slots = self.layout.blocks_to_slots(blocks, self.device)
                for name, saved in self.saved.pop(rid):
                    self.canary.restore_records(saved, slots, group=name)
        self.events["restored_requests"] += len(counts)

    def _sweep_triples(self):
        """Idle cached blocks (freed, complete, kept for prefix reuse): their slots, positions, predecessors.

        Chains are checked inside a block only (prev 0 = unreachable at a block's first slot): a cached
        block's parent may have been evicted since.
        """
        bm, B = self.bp.cache._block_manager, self.layout.block_size
        blocks = [b for b in bm._init_block_ids if b in self.block_pos]
        if not blocks:
            return None
        slots = self.layout.blocks_to_slots(blocks, self.device)
        offs = torch.arange(B, device=self.device).repeat(len(blocks))
        base = torch.tensor([self.block_pos[b] for b in blocks], dtype=torch.int64).repeat_interleave(B)
        positions = base.to(self.device) + offs
        prevs = torch.where(offs == 0, torch.zeros_like(slots), slots - 1)
        return slots, positions, prevs
