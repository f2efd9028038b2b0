"""The transformers session's hooks where the engine moves KV between steps: fork copies, offloads to and
restores from CPU memory, the idle cached blocks a periodic sweep verifies, and the update hooks that
record which positions each block holds (``Session`` mixes them in)."""

from __future__ import annotations

from itertools import repeat

import torch

from kvcanary.integrations.transformers.batch import NAME

__all__ = ["KvMoves"]


class KvMoves:
    """Needs the session's ``bp``, ``layout``, ``canary``, ``lock``, ``events``, ``saved``, ``block_pos``,
    ``device`` and ``_engine_stream``."""

    def _on_copy(self, src, dst, blocks: int) -> None:
        """A fork copied the KV of slots ``src`` to ``dst`` (``blocks`` blocks): the records follow."""
        with self.lock, self._engine_stream():
            for g in self.canary.groups:
                self.canary.copy_records(src, dst, group=g.name)
        self.events["fork_block_copies"] += blocks

    def _on_offload(self, victims, done, slots: dict) -> None:
        """The engine moved requests ``done`` (of ``victims``) to CPU memory; ``slots``: each one's slots then."""
        for st in victims:  # offloaded or soft reset: either way its blocks come back elsewhere
            self.recorded.pop(st.request_id, None)
        # Victims that did not fit the CPU pool are soft reset: re-prefilled later from position 0.
        self.events["soft_resets"] += len(victims) - len(done)
        if not slots:
            return
        with self.lock, self._engine_stream():
            for rid, sl in slots.items():
                self.saved[rid] = [(g.name, self.canary.save_records(sl, group=g.name)) for g in self.canary.groups]
        self.events["offloaded_requests"] += len(slots)

    def _on_restore(self, slots: dict) -> None:
        """The engine copied offloaded requests back into the slots ``slots`` (per request, in the saved order)."""
        with self.lock, self._engine_stream():
            for rid, sl in slots.items():
                for name, saved in self.saved.pop(rid):
                    self.canary.restore_records(saved, sl, group=name)
        self.events["restored_requests"] += len(slots)

    def _sweep_triples(self):
        """Idle cached blocks (freed, complete, kept for prefix reuse): their slots, positions, predecessors.

        Chains are checked inside a block only (prev 0 = unreachable at a block's first slot): a cached
        block's parent may have been evicted since.
        """
        B = self.layout.block_size
        blocks = [b for b in self.layout.idle_blocks() if b in self.block_pos]
        if not blocks:
            return None
        slots = self.layout.blocks_to_slots(blocks, self.device)
        offs = torch.arange(B, device=self.device).repeat(len(blocks))
        base = torch.tensor([self.block_pos[b] for b in blocks], dtype=torch.int64).repeat_interleave(B)
        positions = base.to(self.device) + offs
        prevs = torch.where(offs == 0, torch.zeros_like(slots), slots - 1)
        return slots, positions, prevs

    def _before_update(self):
        """Table index of each block (the positions it holds, for later sweeps), recorded once per
        block; and a copy of each request's table: the update may remap entries in place (a block
        completed and shared). Per-request work runs in C loops (``map``): a decode step adds no
        block to most tables, so the Python loop below visits only the tables that grew."""
        io, lay = self.builder.inputs, self.layout  # (async: the pair being updated)
        if not lay.shares_blocks():
            # Without block sharing a freed block is never kept for reuse (no sweep reads its positions)
            # and no table entry is remapped: nothing to record, at no per-request cost.
            return None
        names = list(map(NAME, io.requests_in_batch))
        tables = list(map(lay.block_table(lay.full_group).get, names, repeat((), len(names))))
        lens = list(map(len, tables))
        recorded = self.recorded
        if list(map(recorded.get, names, repeat(0, len(names)))) != lens:
            B = lay.block_size
            for name, table, m in zip(names, tables, lens):
                n = recorded.get(name, 0)
                if n == m:
                    continue
                if n > m:  # the request lost blocks (a soft reset): its table starts again
                    n = 0
                for i in range(n, m):
                    self.block_pos[table[i]] = i * B
                recorded[name] = m
        return names, list(map(list, tables))

    def _after_update(self, snap) -> None:
        if snap is not None:
            names, old = snap
            new = list(map(self.layout.block_table(self.layout.full_group).get, names))
            if new != old:  # (one comparison in C; a finished request's table is gone: None)
                self._remapped(new, old)
        for name in self.builder.forget_finished():
            self.recorded.pop(name, None)

    def _remapped(self, new: list, old: list) -> None:
        """Entries the update changed (a completed block replaced by an identical shared one): the new
        block holds the old one's positions."""
        B = self.layout.block_size
        for cur, was in zip(new, old):
            if _same_start(cur, was):
                continue
            seg = cur[:len(was)]
            self.events["dedup_remaps"] += sum(a != b for a, b in zip(was, seg))
            for i, b in enumerate(seg):
                self.block_pos[b] = i * B


def _same_start(new, old) -> bool:
    """A request's table after the update starts as before it (or the request is gone)."""
    return new is None or new[:len(old)] == old
