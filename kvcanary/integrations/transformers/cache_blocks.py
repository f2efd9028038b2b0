"""The paged cache of transformers 5.17: per-layer K and V tensors and one block manager.

``cache.key_cache[j]`` is ``[(num_blocks + 2) * block_size, kv_heads, head_dim]`` and serves layer j
of every layer group (the groups use disjoint blocks of one shared block space): a slot is
``block_id * block_size + offset``. Slot 0 is the canary's padding slot, so block 0 is kept out of
the engine's free list while attached.
"""

from __future__ import annotations

from kvcanary.integrations.transformers.layout import EngineLayout, layer_types, log

__all__ = ["BlockLayout"]


class BlockLayout(EngineLayout):
    # what build and the hooks read of a 5.17 PagedAttentionCache
    FIELDS = ("config", "layer_index_to_group_indices", "key_cache", "value_cache", "block_size", "num_blocks",
              "write_trash_index")

    @classmethod
    def build(cls, cache) -> BlockLayout:
        types = layer_types(cache.config)
        full_group, j_full = cache.layer_index_to_group_indices[types.index("full_attention")]
        swa_group = k_swa = v_swa = None
        window = 0
        if "sliding_attention" in types:
            swa_group, j_swa = cache.layer_index_to_group_indices[types.index("sliding_attention")]
            k_swa, v_swa = cache.key_cache[j_swa], cache.value_cache[j_swa]
            window = int(cache.config.sliding_window) - 1
        groups = 1 + max(g for g, _ in cache.layer_index_to_group_indices.values())
        keys, values = tuple(cache.key_cache), tuple(cache.value_cache)
        # (the same tensors serve every group: the sliding group's sources are the full group's)
        return cls(cache=cache, block_size=cache.block_size, num_blocks=cache.num_blocks,
                   num_slots=cache.key_cache[j_full].shape[0], full_group=full_group, swa_group=swa_group,
                   window=window, write_trash=cache.write_trash_index, strides=(cache.block_size,) * groups,
                   k_full=cache.key_cache[j_full], v_full=cache.value_cache[j_full], k_swa=k_swa, v_swa=v_swa,
                   keys=keys, values=values, swa_keys=keys, swa_values=values)

    # -- bookkeeping ------------------------------------------------------------------------------------
    def check_fresh(self) -> None:
        cache = self.cache
        held = sum(len(cm.block_table) for cm in cache.group_cache_managers)
        cached = len(cache._block_manager._hash_to_id)
        if held or cached:
            raise RuntimeError("kv-canary: attach before the paged cache holds KV (its slots have no canary records), "
                               f"got a cache with {held} request tables and {cached} cached blocks; call "
                               "model.destroy_cached_continuous_batching_manager() or attach before the first run")

    def reserve_padding(self) -> bool:
        free = self.cache._block_manager._uninit_block_ids
        if free and free[0] == 0:
            free.popleft()
            return True
        if 0 in free:
            free.remove(0)
            return True
        log.warning("kv-canary: block 0 is in use; slot 0 (its first token) is not verified")
        return False

    def release_padding(self, reserved: bool) -> None:
        """Block 0 back on the free list, unless it was never reserved or a table holds it."""
        if not reserved:
            return
        free = self.cache._block_manager._uninit_block_ids
        in_use = any(0 in t for cm in self.cache.group_cache_managers for t in cm.block_table.values())
        if 0 not in free and not in_use:
            free.appendleft(0)

    def block_table(self, group: int) -> dict[str, list[int]]:
        return self.cache.group_cache_managers[group].block_table

    def request_blocks(self, request_id: str) -> list[tuple[int, list[int]]]:
        return [(g, cm.block_table.get(request_id, [])) for g, cm in enumerate(self.cache.group_cache_managers)]

    def idle_blocks(self) -> list[int]:
        return list(self.cache._block_manager._init_block_ids)

    def shares_blocks(self) -> bool:
        return getattr(self.cache.group_cache_managers[self.full_group], "uses_block_sharing", True)

    def install_hooks(self, patcher, session) -> None:
        cache, om, dev = self.cache, session.bp.offloading_manager, session.device
        orig_copy, orig_offload, orig_restore = cache.copy_cache, om._offload_to_cpu, om.restore_scheduled_requests

        def copy_cache(src, dst):
            session.runner.join()
            orig_copy(src, dst)
            # (one block space for every group: a block id names its slots whatever its group)
            session._guarded(session._on_copy, self.blocks_to_slots(src, dev), self.blocks_to_slots(dst, dev),
                             len(src))

        def offload_to_cpu(victims):
            session.runner.join()
            # (before the engine's offload: it frees the victims' blocks, and their tables with them)
            blocks = {st.request_id: self.request_blocks(st.request_id) for st in victims}
            done = orig_offload(victims)
            slots = {rid: self.group_slots(blocks[rid], dev) for rid in done}
            session._guarded(session._on_offload, victims, done, slots)
            return done

        def restore_scheduled_requests(requests_in_batch):
            counts = {}
            for fs in requests_in_batch:
                rid = fs.state.request_id
                if fs.state.is_cpu_offloaded and rid in session.saved:
                    counts[rid] = list(om._request_id_to_group_block_counts.get(rid, []))
            session.runner.join()
            orig_restore(requests_in_batch)
            if counts:
                cms = cache.group_cache_managers
                slots = {rid: self.group_slots([(g, cms[g].block_table.get(rid, [])[:n]) for g, n in enumerate(per)],
                                               dev)
                         for rid, per in counts.items()}
                session._guarded(session._on_restore, slots)

        patcher.set(cache, "copy_cache", copy_cache)
        patcher.set(om, "_offload_to_cpu", offload_to_cpu)
        patcher.set(om, "restore_scheduled_requests", restore_scheduled_requests)
