"""Token rows of a KV layout that interleaves tokens: what the real-KV hash reads where vLLM's kernel keeps none.

A ``RealKvSource`` addresses one token's bytes as one contiguous row (SPEC 3.4). vLLM's CPU ``amx`` kernel (bf16 on a
CPU with AMX tiles, a block size that is a multiple of 32) stores neither K nor V that way: K in pairs of values
across 16 tokens, V in single values across 2 tokens (``layout.probe_token_map`` finds where each value goes). The
canary cannot hash such bytes in place, so ``RowMirror`` keeps, per fingerprinted head, a copy of the cache's bytes
rearranged one token per row, and the session refreshes it from the engine's cache after each model forward,
before the canary's after work: the only work that reads KV bytes (TAIL hashes the slots the forward read and
wrote, the write check compares the written ones; HEAD and the checks before the forward read records only). The
refresh covers every block the forward's read index or slot mapping names, so every slot the canary hashes holds,
in the copy, the bytes the engine's cache holds at that moment, in the token's own value order: a corrupt byte in
the cache is one in the copy at the next forward that reads its slot. The canary never writes the copy. What
reads slots outside a forward's blocks (the prefix-cache sweep) would see stale rows: it is refused with a copy.
The cost: one gather per fingerprinted head of the forward's blocks (bit-exact, through an integer view).
"""

from __future__ import annotations

import numpy as np
import torch

from kvcanary.ops.types import RealKvSource

KINDS = ("k", "v")
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class RowMirror:
    """The token-row copies of the fingerprinted heads of one vLLM worker's cache (``layout.KvLayout`` with
    ``token_maps``), the real-KV sources over them, and their refresh."""

    def __init__(self, layout, picks):
        """``picks``: ``(layer, head, kind)`` of each real-KV source (``KvLayout.real_kv_picks``, K then V buffers)."""
        self.layout = layout
        bs, hd = layout.block_size, layout.head_size
        self.rows: dict[tuple[int, int, str], torch.Tensor] = {}
        self.sources: dict[tuple[int, int, str], RealKvSource] = {}
        for pick in picks:
            if pick in self.rows:
                continue
            t = layout.caches[pick[0]]
            rows = torch.zeros(layout.num_blocks, bs * hd, dtype=t.dtype, device=t.device)
            nbpt = hd * t.element_size()
            self.rows[pick] = rows
            self.sources[pick] = RealKvSource(rows, page_size=bs, num_bytes_per_token=nbpt, read_bytes=nbpt)

    def source(self, pick: tuple[int, int, str]) -> RealKvSource:
        return self.sources[pick]

    def blocks_of(self, fwd) -> torch.Tensor:
        """int64: the blocks of ``fwd`` (``batch.Forward``) whose slots the canary hashes: those its read index and
        its slot mapping name (ids outside the pool left out: the canary reports such a slot by its own checks)."""
        bs, nb = self.layout.block_size, self.layout.num_blocks
        blocks = np.unique(np.concatenate([fwd.reads, fwd.slots]) // bs)
        return torch.from_numpy(blocks[(blocks >= 0) & (blocks < nb)])

    def refresh(self, blocks: torch.Tensor) -> None:
        """Copy the engine's bytes of ``blocks`` into the token rows, for every fingerprinted head."""
        if blocks.numel() == 0:
            return
        lay = self.layout
        span = lay.block_size * lay.head_size
        per_block = lay.num_kv_heads * 2 * span  # (elements of one block of one layer: each head's K span, V span)
        for (layer, head, kind), rows in self.rows.items():
            # (an integer view of the element size: the bytes move as they are, NaN payloads included)
            bits = BITS[rows.element_size()]
            flat = lay.caches[layer].view(-1).view(bits)
            at = blocks * per_block + (2 * head + KINDS.index(kind)) * span
            where = (at[:, None] + lay.token_maps[KINDS.index(kind)][None, :]).view(-1)
            rows.view(bits).index_copy_(0, blocks, flat.index_select(0, where).view(-1, span))
