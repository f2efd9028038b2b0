"""The paged cache of transformers 5.18 and later (verified on 5.24 and 5.25): one byte tensor in sectors.

``cache.cache_tensor`` holds all KV. It is cut into sectors; each attention type has one allocator
(``cache.cache_allocators[type]``, its ``index`` is the engine group: the row of the read and write
indices) that splits its sectors into blocks, and a block into one K page and one V page of
``page_size`` tokens per layer of that type. The engine's indices address rows of ``[kv_heads,
head_dim]`` over the whole tensor: token ``offset`` of block ``b`` is row ``b * block_physical_stride
+ offset`` for the first layer's K, shifted by ``page_size`` for its V and by ``2 * page_size`` per
further layer (an MLA allocator, 5.25+: one row of both latents per token and layer, no V page).
A canary slot is that index, so one slot space spans every allocator (their sectors are disjoint).

The first two sectors are never allocated: row 0 is the read trash (the canary's padding slot 0,
which no real token can take, so no block is reserved: the base class's ``reserve_padding``), row 1
the sliding group's sentinel, and the second sector's first row the write trash of padding tokens.
"""

from __future__ import annotations

import torch

from kvcanary.integrations.transformers.layout import EngineLayout

__all__ = ["SectorLayout"]

FULL, SLIDING = "full_attention", "sliding_attention"


def _per_token(allocator) -> int:
    """Rows per token and layer: 2 (a K and a V page; 5.18 to 5.24 name no such field), 1 for MLA latents."""
    return getattr(allocator, "rows_per_token", 2)


def _rows(cache, allocator) -> torch.Tensor:
    """The whole cache tensor as one allocator's rows, indexed by the engine's slot: ``[kv_heads, head_dim]`` per
    row, or (an MLA allocator, transformers 5.25+) one row of ``kv_lora_rank + qk_rope_head_dim`` per token and
    layer, its two latents side by side (no K and V pages)."""
    flat = cache.cache_tensor.view(allocator.cache_dtype)
    if _per_token(allocator) == 1:
        width = allocator.row_numel
        return flat[:flat.numel() // width * width].view(-1, width)
    return flat.view(-1, allocator.num_key_value_heads, allocator.head_dim)


def _layer_rows(cache, allocator) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(layer, K rows, V rows) of each layer of one allocator, each indexed by slot (an MLA layer's K and V rows
    are its one latent row: the real-KV hash of either covers both latents)."""
    rows, page = _rows(cache, allocator), allocator.tokens_per_page
    per_token = _per_token(allocator)
    return [(layer, rows[per_token * i * page:], rows[(per_token * i + per_token - 1) * page:])
            for i, layer in enumerate(allocator.layer_indices)]


class SectorLayout(EngineLayout):
    # what build and the hooks read of a PagedAttentionCache with sectors
    FIELDS = ("config", "cache_tensor", "cache_allocators", "layer_to_allocator", "max_tokens_read", "pool",
              "perform_cache_copy", "search_prefix_match")

    @classmethod
    def build(cls, cache) -> SectorLayout:
        allocs = cache.cache_allocators
        if FULL not in allocs:
            raise ValueError("kv-canary: the model needs at least one full-attention layer, got only "
                             f"{sorted(allocs)} layers")
        full, sliding = allocs[FULL], allocs.get(SLIDING)
        if sliding is not None and _per_token(full) != _per_token(sliding):
            raise ValueError("kv-canary: MLA (kv_lora_rank) layers beside sliding-window layers are not supported: "
                             "their rows differ in size, so no one slot space spans both groups")
        strides = [0] * len(allocs)
        for a in allocs.values():
            strides[a.index] = a.block_physical_stride
        full_rows = _layer_rows(cache, full)
        swa_rows = _layer_rows(cache, sliding) if sliding is not None else full_rows
        page = full.tokens_per_page
        keys, values = tuple(k for _, k, _ in full_rows), tuple(v for _, _, v in full_rows)
        swa_keys, swa_values = tuple(k for _, k, _ in swa_rows), tuple(v for _, _, v in swa_rows)
        return cls(cache=cache, block_size=page, num_blocks=max(1, cache.max_tokens_read // page),
                   num_slots=_rows(cache, full).shape[0], full_group=full.index,
                   swa_group=None if sliding is None else sliding.index,
                   window=0 if sliding is None else int(sliding.sliding_window) - 1,
                   write_trash=full.write_trash_index, strides=tuple(strides), k_full=keys[0], v_full=values[0],
                   k_swa=None if sliding is None else swa_keys[0], v_swa=None if sliding is None else swa_values[0],
                   keys=keys, values=values, swa_keys=swa_keys, swa_values=swa_values)

    def _full(self):
        return self.cache.cache_allocators[FULL]

    def _index(self) -> dict[str, int]:
        return {name: a.index for name, a in self.cache.cache_allocators.items()}

    # -- bookkeeping ------------------------------------------------------------------------------------
    def check_fresh(self) -> None:
        allocs = self.cache.cache_allocators.values()
        held = sum(len(a.block_table) for a in allocs)
        cached = sum(len(a.ledger.hash_to_block) for a in allocs)
        if held or cached:
            raise RuntimeError("kv-canary: attach before the paged cache holds KV (its slots have no canary records), "
                               f"got a cache with {held} request tables and {cached} cached blocks; call "
                               "model.destroy_cached_continuous_batching_manager() or attach before the first run")

    def block_table(self, group: int) -> dict[str, list[int]]:
        return next(a for a in self.cache.cache_allocators.values() if a.index == group).block_table

    def request_blocks(self, request_id: str) -> list[tuple[int, list[int]]]:
        return [(a.index, a.block_table.get(request_id, [])) for a in self.cache.cache_allocators.values()]

    def idle_blocks(self) -> list[int]:
        return list(self._full().ledger.cached_blocks)

    def shares_blocks(self) -> bool:
        return bool(self._full().use_block_sharing)

    def install_hooks(self, patcher, session) -> None:
        cache, om, dev = self.cache, session.bp.offloading_manager, session.device
        orig_copy, orig_offload = cache.perform_cache_copy, om._offload_to_cpu
        orig_restore = om.restore_scheduled_requests
        index = self._index()

        def perform_cache_copy(copy_src_and_dst):
            session.runner.join()
            orig_copy(copy_src_and_dst)
            pairs = [(index[name], src, dst) for name, (src, dst) in copy_src_and_dst.items() if len(src)]
            if pairs:
                session._guarded(session._on_copy, self.group_slots([(g, s) for g, s, _ in pairs], dev),
                                 self.group_slots([(g, d) for g, _, d in pairs], dev), sum(len(s) for _, s, _ in pairs))

        def offload_to_cpu(victims, victim_block_tables):
            session.runner.join()
            done = orig_offload(victims, victim_block_tables)
            # (the engine freed the victims' blocks before this call: their tables come as an argument)
            slots = {rid: self.group_slots([(index[n], bl) for n, bl in victim_block_tables[rid].items()], dev)
                     for rid in done}
            session._guarded(session._on_offload, victims, done, slots)
            return done

        def restore_scheduled_requests(requests_in_batch):
            counts = {}
            for fs in requests_in_batch:
                rid = fs.state.request_id
                if fs.state.is_cpu_offloaded and rid in session.saved:
                    counts[rid] = {n: len(ids) for n, ids in om._request_id_to_cpu_blocks.get(rid, {}).items()}
            session.runner.join()
            orig_restore(requests_in_batch)
            if counts:
                allocs = cache.cache_allocators
                slots = {rid: self.group_slots([(index[n], allocs[n].block_table.get(rid, [])[:k])
                                                for n, k in per.items()], dev)
                         for rid, per in counts.items()}
                session._guarded(session._on_restore, slots)

        patcher.set(cache, "perform_cache_copy", perform_cache_copy)
        patcher.set(om, "_offload_to_cpu", offload_to_cpu)
        patcher.set(om, "restore_scheduled_requests", restore_scheduled_requests)
