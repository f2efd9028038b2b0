"""Planted transformers bugs in what a forward stores and what attention is handed (``hf_bugs`` lists them):
a cache update that writes K and never V, a sliding-window update that copies V into the K cache, an SDPA mask
reset over too few key columns. Planted below kv-canary's hooks on the 5.18+ sector cache's allocators and IO.
"""

from __future__ import annotations

from kvcanary.sim import hf_bugs


def _sector_allocator(lay, kind: str, bug: str):
    """The 5.18+ allocator of ``kind`` whose ``update`` stores a forward's K and V (``ValueError`` elsewhere)."""
    allocators = getattr(lay.cache, "cache_allocators", None)
    if allocators is None or kind not in allocators:
        raise ValueError(f"kv-canary: bug {bug} needs transformers >= 5.18's {kind} allocator, got a cache without "
                         "one")
    return allocators[kind]


def _one_forward(state, write_index) -> bool:
    """True for every layer of the one forward the bug fires in (its write index, one tensor for all layers)."""
    if state.get("forward") is not None:
        return state["forward"] is write_index
    if hf_bugs._once(state):
        state["forward"] = write_index
        return True
    return False


def write_k_only(bp, lay, state) -> None:
    a = _sector_allocator(lay, "full_attention", "write-k-only")
    orig = a.update

    def update(key_states, value_states, layer_idx, read_index, write_index):
        if read_index.numel() == 0 and _one_forward(state, write_index):
            k_cache, _ = a._kv_token_views[layer_idx]
            k_cache.index_copy_(0, write_index, key_states)
            return key_states, value_states  # (V never written)
        return orig(key_states, value_states, layer_idx, read_index, write_index)

    a.update = update


def sliding_v_into_k(bp, lay, state) -> None:
    a = _sector_allocator(lay, "sliding_attention", "sliding-v-into-k")
    orig = a.update

    def update(key_states, value_states, layer_idx, read_index, write_index):
        if read_index.numel() == 0 and _one_forward(state, write_index):
            k_cache, v_cache = a._kv_token_views[layer_idx]
            k_cache.index_copy_(0, write_index, value_states)  # (V where K belongs)
            v_cache.index_copy_(0, write_index, value_states)
            return key_states, value_states
        return orig(key_states, value_states, layer_idx, read_index, write_index)

    a.update = update


def mask_reset_short(bp, lay, state) -> None:
    io = bp.inputs_and_outputs
    if getattr(io, "attention_mask", None) is None or not hasattr(io, "_reset_static_tensors"):
        raise ValueError("kv-canary: bug mask-reset-short needs synchronous inputs with an attention mask (SDPA or "
                         "eager attention), got none")
    orig = io._reset_static_tensors

    def reset(full_reset: bool = False):
        if full_reset or state["warming_up"]:
            return orig(full_reset)
        # the correct reset covers key columns [0, q + kv); this one stops at kv: what the last batch left in
        # the last q columns of the first q rows stays
        q, kv = io.num_q_tokens, io.max_kv_read
        kept = {t: m[:, :, :q, kv:q + kv].clone() for t, m in io.attention_mask.items()}
        orig(full_reset)
        for t, m in io.attention_mask.items():
            m[:, :, :q, kv:q + kv] = kept[t]

    io._reset_static_tensors = reset
