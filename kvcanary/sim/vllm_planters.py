"""How each bug of ``vllm_bugs.BUGS`` is planted: one function per bug, ``(patches, state, target, rank)``.

``target`` is vLLM's ``EngineCore`` for the scheduler-side bugs and a ``GPUModelRunner`` (the CPU runner
subclasses it) for the runner-side ones; ``rank`` is the runner's tensor-parallel rank. Every change goes
through ``patches`` (undone by ``vllm_bugs.plant``) onto the instances of the running engine (a vLLM module's
function for the hashing bugs). A bug fires once (``state.fire``) unless its description says it acts on
every call (the hashing bugs, which count the hashes they changed).
"""

from __future__ import annotations


def _pool(core):
    return core.scheduler.kv_cache_manager.block_pool


def shared_block_double_free(p, st, core, rank) -> None:
    pool = _pool(core)
    orig = pool.free_blocks

    def free_blocks(ordered_blocks):
        blocks = list(ordered_blocks)
        shared = next((b for b in blocks if b.ref_cnt >= 2 and not b.is_null), None)
        if shared is not None and st.fire(f"block {shared.block_id} listed twice in a free (ref_cnt "
                                          f"{shared.ref_cnt})"):
            blocks.insert(blocks.index(shared) + 1, shared)
        return orig(blocks)

    p.set(pool, "free_blocks", free_blocks)


def early_free(p, st, core, rank) -> None:
    kvm = core.scheduler.kv_cache_manager
    orig = kvm.allocate_slots

    def allocate_slots(request, num_new_tokens, *args, **kwargs):
        out = orig(request, num_new_tokens, *args, **kwargs)
        blocks = kvm.coordinator.single_type_managers[0].req_to_blocks.get(request.request_id, [])
        decoding = request.num_computed_tokens >= request.num_prompt_tokens
        if out is not None and decoding and len(blocks) >= 2 and blocks[0].ref_cnt == 1 and st.fire(
                f"block {blocks[0].block_id} of {request.request_id} freed while mapped"):
            kvm.block_pool.free_blocks([blocks[0]])
        return out

    p.set(kvm, "allocate_slots", allocate_slots)


def parentless_block_hash(p, st, core, rank) -> None:
    from vllm.v1.core import kv_cache_utils

    orig = kv_cache_utils.hash_block_tokens

    def hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, extra_keys=None):
        if parent_block_hash:
            st.fired += 1  # (acts on every block after the first)
        return orig(hash_function, None, curr_block_token_ids, extra_keys)

    p.set(kv_cache_utils, "hash_block_tokens", hash_block_tokens)


def lora_salt_collision(p, st, core, rank) -> None:
    from vllm.v1.core import kv_cache_utils

    orig = kv_cache_utils.generate_block_hash_extra_keys

    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
        keys, idx = orig(request, start_token_idx, end_token_idx, start_mm_idx)
        if keys:
            # the bug: both enter the hash as the bare namespace string
            merged = tuple(("namespace", k[1]) if isinstance(k, tuple) and k[:1] in (("lora",), ("cache_salt",))
                           else k for k in keys)
            st.fired += merged != keys
            keys = merged
        return keys, idx

    p.set(kv_cache_utils, "generate_block_hash_extra_keys", generate_block_hash_extra_keys)


def phantom_prefix_hit(p, st, core, rank) -> None:
    pool = _pool(core)

    def _maybe_evict_cached_block(block) -> bool:
        hashes = pool.cached_block_hashes_by_block.pop(block.block_id, set())
        if block.block_hash is None and not hashes:
            return False
        # the bug: the block forgets its hash, the hash table keeps pointing at the block
        st.fired += 1
        st.notes.append(f"block {block.block_id} reused with its hash-table entry left behind")
        block.reset_hash()
        return True

    p.set(pool, "_maybe_evict_cached_block", _maybe_evict_cached_block)


def chunk_skips_a_token(p, st, core, rank) -> None:
    sched = core.scheduler
    orig = sched._update_after_schedule

    def _update_after_schedule(scheduler_output):
        orig(scheduler_output)
        for rid in scheduler_output.num_scheduled_tokens:
            r = sched.requests[rid]
            if 0 < r.num_computed_tokens < r.num_prompt_tokens - 1 and st.fire(
                    f"{rid}: the next chunk starts at {r.num_computed_tokens + 1}, not {r.num_computed_tokens}"):
                r.num_computed_tokens += 1
                return

    p.set(sched, "_update_after_schedule", _update_after_schedule)


# --- runner side -------------------------------------------------------------------------------------------

def _block_size(runner) -> int:
    return runner.input_batch.block_table.block_tables[0].block_size


def stale_inflight_write(p, st, runner, rank) -> None:
    from kvcanary.sim.vllm_oracle import token_elements

    B, caches = _block_size(runner), [c for c in runner.kv_caches if c is not None]
    pending: list = []
    orig_update, orig_forward = runner._update_states, runner._model_forward

    def _update_states(scheduler_output):
        for rid in scheduler_output.finished_req_ids:
            rs = runner.requests.get(rid)
            if rs is None or pending or st.fired:
                continue
            P, blocks = rs.num_computed_tokens, rs.block_ids[0]
            if 0 < P % B and P // B < len(blocks):
                # the in-flight step writes position P: its KV is that of the request's last written token
                idx = token_elements(runner)
                src = blocks[(P - 1) // B], (P - 1) % B
                data = [c.reshape(c.shape[0], -1)[src[0], idx[src[1]]].clone() for c in caches]
                pending.append((blocks[P // B], P % B, data, rid))
        return orig_update(scheduler_output)

    def _model_forward(*args, **kwargs):
        out = orig_forward(*args, **kwargs)
        if pending and not st.fired:
            blk, off, data, rid = pending[0]
            for owner, rs in runner.requests.items():
                ids = rs.block_ids[0]
                # the block belongs to another request now, which has written that offset in an earlier forward
                if owner != rid and blk in ids and ids.index(blk) * B + off < rs.num_computed_tokens and st.fire(
                        f"stale write of {rid} into block {blk} offset {off}, now {owner}'s"):
                    idx = token_elements(runner)
                    for c, d in zip(caches, data):
                        c.reshape(c.shape[0], -1)[blk, idx[off]] = d
                    break
        return out

    p.set(runner, "_update_states", _update_states)
    p.set(runner, "_model_forward", _model_forward)


def _on_slot_mapping(p, runner, edit) -> None:
    """Run ``edit(bt, num_reqs, qsl, positions, slot_mapping)`` after the runner computes group 0's slots."""
    bt = runner.input_batch.block_table.block_tables[0]
    orig = bt.compute_slot_mapping

    def compute_slot_mapping(num_reqs, query_start_loc, positions):
        orig(num_reqs, query_start_loc, positions)
        edit(bt, num_reqs, query_start_loc[: num_reqs + 1].tolist(), positions, bt.slot_mapping.gpu)

    p.set(bt, "compute_slot_mapping", compute_slot_mapping)


def slot_mapping_row_stride(p, st, runner, rank) -> None:
    def edit(bt, num_reqs, qsl, positions, sm):
        B, table = bt.block_size, bt.block_table.np
        narrow = int(bt.num_blocks_per_row[:num_reqs].max()) if num_reqs else 0
        if num_reqs < 2 or st.fired or narrow >= table.shape[1]:
            return
        flat = table.reshape(-1)
        new = {j: int(flat[i * narrow + int(positions[j]) // B]) * B + int(positions[j]) % B
               for i in range(1, num_reqs) for j in range(qsl[i], qsl[i + 1])}
        if any(new[j] != int(sm[j]) for j in new) and st.fire(f"rows 1..{num_reqs - 1} addressed with row width "
                                                              f"{narrow} instead of {table.shape[1]}"):
            for j, s in new.items():
                sm[j] = s

    _on_slot_mapping(p, runner, edit)


def decode_write_prev_block(p, st, runner, rank) -> None:
    def edit(bt, num_reqs, qsl, positions, sm):
        B, table = bt.block_size, bt.block_table.np
        for i in range(num_reqs):
            j = qsl[i]
            pos = int(positions[j]) if qsl[i + 1] - j == 1 else -1
            if pos >= B and pos % B == 0 and st.fire(f"position {pos} of row {i} written into the previous block"):
                sm[j] = int(table[i, pos // B - 1]) * B
                return

    _on_slot_mapping(p, runner, edit)


def tp_rank_slot_shift(p, st, runner, rank) -> None:
    def edit(bt, num_reqs, qsl, positions, sm):
        if rank != 1:
            return
        B = bt.block_size
        for i in range(num_reqs):
            j = qsl[i]
            pos = int(positions[j]) if qsl[i + 1] - j == 1 else -1
            if pos > B and (pos + 1) % B and st.fire(f"rank {rank}: position {pos} of row {i} written one slot on"):
                sm[j] += 1
                return

    _on_slot_mapping(p, runner, edit)


def row_count_not_reset(p, st, runner, rank) -> None:
    bt = runner.input_batch.block_table.block_tables[0]
    orig_add = bt.add_row

    def clear_row(row_idx):
        # the bug: the ids go, the count stays
        n = bt.num_blocks_per_row[row_idx]
        bt.block_table.np[row_idx, :n] = 0

    def add_row(block_ids, row_idx):
        if bt.num_blocks_per_row[row_idx] > 0 and block_ids and st.fire(
                f"row {row_idx} reused with {bt.num_blocks_per_row[row_idx]} stale columns"):
            bt.append_row(block_ids, row_idx)
        else:
            orig_add(block_ids, row_idx)

    p.set(bt, "clear_row", clear_row)
    p.set(bt, "add_row", add_row)


def row_keeps_old_ids(p, st, runner, rank) -> None:
    bt = runner.input_batch.block_table.block_tables[0]

    def clear_row(row_idx):
        if bt.num_blocks_per_row[row_idx]:
            st.fired += 1
            st.notes.append(f"row {row_idx} keeps {bt.num_blocks_per_row[row_idx]} old block ids")

    p.set(bt, "clear_row", clear_row)


def resumed_keeps_old_blocks(p, st, runner, rank) -> None:
    orig = runner._update_states

    def _update_states(scheduler_output):
        data = scheduler_output.scheduled_cached_reqs
        for rid in sorted(data.resumed_req_ids):
            rs = runner.requests.get(rid)
            if rs is not None and any(rs.block_ids[0]) and st.fire(
                    f"{rid} resumed keeping its {len(rs.block_ids[0])} freed blocks {rs.block_ids[0]}"):
                data.resumed_req_ids = set(data.resumed_req_ids) - {rid}
                break
        return orig(scheduler_output)

    p.set(runner, "_update_states", _update_states)


def zero_delivered_block(p, st, runner, rank) -> None:
    B, orig = _block_size(runner), runner._update_states

    def _update_states(scheduler_output):
        for new in scheduler_output.scheduled_new_reqs:
            if new.num_computed_tokens >= B and st.fire(f"block {new.block_ids[0][0]} zeroed after a prefix hit "
                                                        f"delivered it to {new.req_id}"):
                runner._zero_block_ids([new.block_ids[0][0]])
        return orig(scheduler_output)

    p.set(runner, "_update_states", _update_states)


def without_v(store):
    """``store`` (an attention backend's ``do_kv_cache_update``, unbound) as a write path that never writes V: each
    token's K lands, the V half of every block it writes is put back as it was (CPU layout: per block and head,
    the block's K rows, then its V rows)."""
    import torch

    def write_k_only(impl, layer, key, value, kv_cache, slot_mapping):
        nb, heads, B, width = kv_cache.shape
        halves = kv_cache.view(nb, heads, 2 * B, width // 2)
        blocks = torch.unique(slot_mapping[slot_mapping >= 0] // B)
        before = halves[blocks, :, B:].clone()
        store(impl, layer, key, value, kv_cache, slot_mapping)
        halves[blocks, :, B:] = before

    return write_k_only


def v_write_dropped(p, st, runner, rank) -> None:
    from kvcanary.sim.vllm_oracle import attention_layers

    impl = attention_layers(runner)[0].impl
    cls, layers = type(impl), len([c for c in runner.kv_caches if c is not None])
    orig = cls.do_kv_cache_update
    k_only = without_v(orig)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if st.fire(f"a forward's cache writes of {int((slot_mapping >= 0).sum())} tokens stored K and no V"):
            st.memo["left"] = layers  # (every layer's write of that forward)
        if st.memo.get("left", 0) > 0:
            st.memo["left"] -= 1
            return k_only(self, layer, key, value, kv_cache, slot_mapping)
        return orig(self, layer, key, value, kv_cache, slot_mapping)

    p.set(cls, "do_kv_cache_update", do_kv_cache_update)
