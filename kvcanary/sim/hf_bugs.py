"""Engine bugs planted into transformers continuous batching, for the demo and the tests.

Each bug is a realistic bookkeeping mistake from shared/BUGS.md, planted per instance on the batch
processor transformers creates (below kv-canary's hooks: plant first, then attach). It fires once.
The engine internals each one reaches come from the cache's layout and its reach (``integrations/transformers/reach.py``), so
the same bugs are planted in every paged-cache generation the adapter supports.

Example:
    >>> undo = plant(model, "double-free"); handle = attach(model); ...; handle.detach(); undo()
"""

from __future__ import annotations

import collections
from collections.abc import Callable

BUGS: dict[str, tuple[str, str]] = {
    "double-free": ("A", "a finished request's last block is pushed onto the free list twice, so two later "
                         "allocations get the same block"),
    "early-free": ("A", "a request's first block returns to the free list after its first chunk while its table "
                        "still maps it"),
    "early-free-unread": ("A", "a decoding request's first block goes back to the pool as its batch is prepared, "
                              "while its table still maps it and its forward reads it intact"),
    "wrong-block": ("C", "a request's block table gets another live request's block at index 1"),
    "skip-fork-copy": ("G", "the fork copy of a parent's partial block into a child's block never happens"),
    "flip-kv": ("G", "one byte of layer 0's K of a live token flips inside a forward"),
    "flip-idle-cache": ("G", "one byte of layer 0's K of an idle prefix-cached block flips"),
    "prefix-key-collision": ("F", "the prefix-cache key leaves out the parent block, so equal blocks after "
                                  "different prefixes are shared"),
    "wrong-read-index": ("C", "one request's read index lists another live request's slot for one of its prefix "
                              "positions (its block table is right)"),
    "contiguous-read-index": ("D", "a read index is built as if the request's blocks were contiguous: "
                                   "first block * block size + position"),
    "k-only-fork-copy": ("G", "the fork copy of a parent's partial block copies K but not V"),
    "first-layer-fork-copy": ("G", "the fork copy of a parent's partial block copies the first layer only"),
    "history-short": ("E", "a request's token history loses its newest token while the engine still feeds it "
                           "(the history is one token short of the positions)"),
    "never-written": ("H", "a decode token's KV write goes to the write trash (as for padding), so its slot in a "
                           "fresh block is never written"),
    "write-into-predecessor": ("E", "a decode token's write index is its predecessor's slot (off by one)"),
    "new-token-read-index": ("C", "a decode token's read index cell for its own position lists its predecessor's "
                                  "slot instead of the slot it was just written to"),
    "flip-shared-block": ("G", "one byte of layer 0's K flips in a full prompt block that several live requests "
                               "share (a parent and its forks): each of them reads it in the next forward"),
    "write-k-only": ("G", "the write-only fast path (a batch of fresh prefills, nothing read back) writes each "
                          "layer's K and returns without writing V, for one forward"),
    "mask-reset-short": ("C", "the SDPA mask is reset over too few key columns between batches, so a query may "
                              "attend keys of other requests in the batch (every batch)"),
}

# Bugs of the sliding-window group: planted like those of ``BUGS``, on a hybrid model (full + sliding layers).
SLIDING_BUGS: dict[str, tuple[str, str]] = {
    "sliding-v-into-k": ("G", "a sliding-window layer's write-only branch copies V into the K cache, for one "
                              "forward"),
}


def plant(model, name: str) -> Callable[[], None]:
    """Plant bug ``name`` into every batch processor ``model`` creates; returns the undo function."""
    if name not in BUGS and name not in SLIDING_BUGS:
        raise ValueError(f"kv-canary: bug must be one of {sorted(BUGS) + sorted(SLIDING_BUGS)}, got {name!r}")
    planter = _PLANTERS[name.replace("-", "_")]

    def zeroed(bp, lay, state) -> None:
        _zero_pool(bp)
        planter(bp, lay, state)

    return plant_with(model, zeroed, "_kvcanary_bug")


def plant_with(model, planter: Callable, tag: str) -> Callable[[], None]:
    """Run ``planter(bp, layout, state)`` on every batch processor ``model`` creates (``layout``: the cache's
    layout with the internals a bug reaches; ``state``: the bug's, with ``warming_up`` set during the engine's
    warm-up, which a bug waits out: ``_once``); returns the undo. Tests plant bugs of their own with it."""
    state = {"fired": False, "warming_up": False}

    def planted(bp) -> None:
        planter(bp, _layout(bp), state)
        warmup = getattr(bp, "warmup", None)  # (5.18+: fake requests, then a cache reset that undoes a bug)
        if warmup is not None:
            def quiet_warmup(*args, **kwargs):
                state["warming_up"] = True
                try:
                    return warmup(*args, **kwargs)
                finally:
                    state["warming_up"] = False

            bp.warmup = quiet_warmup

    return on_new_processors(model, planted, tag)


def on_new_processors(model, fn: Callable, tag: str) -> Callable[[], None]:
    """Run ``fn(bp)`` once on every batch processor ``model`` creates (``tag`` marks the ones done: the
    engine reuses a processor across generations); returns the undo. Per instance: nothing of the class."""
    had = "init_continuous_batching" in vars(model)
    orig_init = model.init_continuous_batching

    def init_continuous_batching(*args, **kwargs):
        manager = orig_init(*args, **kwargs)
        orig_create = manager._create_batch_processor

        def create():
            bp = orig_create()
            if not getattr(bp, tag, False):
                setattr(bp, tag, True)
                fn(bp)
            return bp

        manager._create_batch_processor = create
        return manager

    model.init_continuous_batching = init_continuous_batching

    def undo() -> None:
        if had:
            model.init_continuous_batching = orig_init
        else:
            vars(model).pop("init_continuous_batching", None)

    return undo


def _zero_pool(bp) -> None:
    """Zero the paged cache before a planted bug runs. transformers allocates it with ``torch.empty``, and a
    planted bug makes attention read slots nothing wrote: uninitialised bytes that may decode as NaN or
    inf, which the sampler rejects (a device-side assert on CUDA, an error ending the generation loop on
    the CPU) before the canary's work of that step has run. Zeros keep the forward finite, so each run
    shows the canary's report, whatever the allocator left in that memory."""
    _layout(bp).zero_pool()


def _layout(bp):
    """The cache's layout with the internals a bug reaches (``integrations/transformers/reach.py``)."""
    # (not at import time: the CLI reads BUGS without torch)
    from kvcanary.integrations.transformers.layouts import layout_of
    from kvcanary.integrations.transformers.reach import reach

    return reach(layout_of(bp.cache))


def _once(state) -> bool:
    # (never during the engine's warm-up: its cache reset would drop the bug before a real request met it)
    if state["fired"] or state["warming_up"]:
        return False
    state["fired"] = True
    return True


def double_free(bp, lay, state) -> None:
    cache = bp.cache
    orig = cache.free_blocks

    def free_blocks(request_id, *args, **kwargs):
        table = list(lay.block_table(lay.full_group).get(request_id, []))
        orig(request_id, *args, **kwargs)
        if table and lay.is_free(table[-1]) and _once(state):
            lay.take_free(table[-1])
            lay.hand_out_next(table[-1], times=2)

    cache.free_blocks = free_blocks


def early_free(bp, lay, state) -> None:
    orig = bp.update_batch

    def update_batch():
        orig()
        for rid, table in lay.block_table(lay.full_group).items():
            if len(table) >= 2 and _once(state):
                lay.hand_out_next(table[0])
                return

    bp.update_batch = update_batch


def _requests(bp) -> list:
    """The requests of the batch the engine's IO holds now: under async batching (two IO pairs) the current
    pair's host half, which alone keeps them."""
    io = bp.inputs_and_outputs
    if hasattr(io, "io_pairs"):
        return io.io_pairs[io.current_pair].host_io.requests_in_batch
    return io.requests_in_batch


def early_free_unread(bp, lay, state) -> None:
    cm, orig = lay.full_allocator(), bp.prepare_next_batch

    def prepare_next_batch():
        ready = orig()
        for fs in _requests(bp) if ready else ():
            table = cm.block_table.get(fs.state.request_id, [])
            # (after the batch's allocations: nobody takes the block before this forward reads it)
            if fs.query_length == 1 and len(table) >= 2 and _once(state):
                lay.free_now(table[0])
                break
        return ready

    bp.prepare_next_batch = prepare_next_batch


def wrong_block(bp, lay, state) -> None:
    orig = bp.update_batch

    def update_batch():
        orig()
        tables = [t for t in lay.block_table(lay.full_group).values() if len(t) >= 2]
        if len(tables) >= 2 and tables[0][1] != tables[1][1] and _once(state):
            tables[1][1] = tables[0][1]

    bp.update_batch = update_batch


def skip_fork_copy(bp, lay, state) -> None:
    # A zero-filled pool (as engines that profile memory leave it): the skipped copy leaves finite, wrong KV
    # and generation goes on silently instead of sampling from NaN garbage.
    lay.zero_pool()
    lay.wrap_fork_copy(lambda src, dst: _once(state))


def _flip(lay, slot: int) -> None:
    import torch  # not at import time: the CLI reads BUGS for its --help without torch

    lay.k_row(0, slot).view(torch.uint8).view(-1)[1] ^= 0x10


def flip_kv(bp, lay, state) -> None:
    orig = bp._generation_step

    def step(model):
        orig(model)
        for fs in _requests(bp):
            st = fs.state
            table = lay.block_table(lay.full_group).get(st.request_id, [])
            # A token this forward read (in the prefix), not one it wrote.
            if st.position_offset - fs.query_length > 1 and table and _once(state):
                _flip(lay, lay.slot(table[0], 1))
                return

    bp._generation_step = step


def flip_shared_block(bp, lay, state) -> None:
    orig = bp._generation_step

    def step(model):
        orig(model)
        tables = lay.block_table(lay.full_group)
        # full blocks only (a table's last block may be partial): every position of one is read by every holder
        count = collections.Counter(b for t in tables.values() for b in t[:-1])
        if count and count.most_common(1)[0][1] >= 2 and _once(state):
            _flip(lay, lay.slot(count.most_common(1)[0][0], 1))

    bp._generation_step = step


def flip_idle_cache(bp, lay, state) -> None:
    orig = bp.update_batch

    def update_batch():
        orig()
        idle = lay.idle_blocks()
        if idle and _once(state):
            _flip(lay, lay.slot(idle[0], 2))

    bp.update_batch = update_batch


def prefix_key_collision(bp, lay, state) -> None:
    lay.parentless_prefix_hash()


def wrong_read_index(bp, lay, state) -> None:
    cm = lay.full_allocator()
    orig = cm.get_read_indices

    def get_read_indices(request_id, past_length, query_length):
        out = orig(request_id, past_length, query_length)
        if past_length >= 3:
            own = set(cm.block_table[request_id])
            other = next((t for t in cm.block_table.values() if t and not own & set(t)), None)
            if other is not None and _once(state):
                out[1] = lay.slot(other[0], 2)  # another request's position 2, read as our position 1
        return out

    cm.get_read_indices = get_read_indices


def contiguous_read_index(bp, lay, state) -> None:
    cm, B = lay.full_allocator(), lay.block_size
    orig = cm.get_read_indices

    def get_read_indices(request_id, past_length, query_length):
        out = orig(request_id, past_length, query_length)
        table = cm.block_table[request_id]
        n = (past_length - 1) // B + 1 if past_length else 0
        # Planted once the guess lands on another request's block inside the pool (a fork's guess may land on
        # its parent's identical block: harmless; a guess past the pool's end fails the engine's own gather
        # first). That block may hold other positions, or none yet (allocated for this step's chunk).
        root = request_id.split("__child")[0]
        others = {b for rid, t in cm.block_table.items() if rid.split("__child")[0] != root for b in t}
        inside = lay.slot(table[0] + n - 1, B - 1) < lay.values[-1].shape[0]
        if n >= 2 and inside and any(table[0] + i in others for i in range(n)) and _once(state):
            out[:past_length] = [lay.slot(table[0] + p // B, p % B) for p in range(past_length)]
        return out

    cm.get_read_indices = get_read_indices


def _partial_fork_copy(bp, lay, state, copy_k: bool, copy_v: bool, layers: int | None) -> None:
    lay.zero_pool()  # finite wrong KV, as in skip_fork_copy

    def copy(src, dst):
        if not _once(state):
            return False
        lay.copy_blocks_partly(src, dst, copy_k, copy_v, layers)
        return True

    lay.wrap_fork_copy(copy)


def k_only_fork_copy(bp, lay, state) -> None:
    _partial_fork_copy(bp, lay, state, copy_k=True, copy_v=False, layers=None)


def first_layer_fork_copy(bp, lay, state) -> None:
    _partial_fork_copy(bp, lay, state, copy_k=True, copy_v=True, layers=1)


def history_short(bp, lay, state) -> None:
    orig = bp.update_batch
    def update_batch():
        orig()
        for fs in _requests(bp):
            st = fs.state
            if len(st.generated_tokens) >= 2 and st.status != 3 and _once(state):
                del st.generated_tokens[-1]
                return

    bp.update_batch = update_batch


def never_written(bp, lay, state) -> None:
    cm, B = lay.full_allocator(), lay.block_size
    orig = cm.get_write_indices
    seen: set[int] = set()

    def get_write_indices(request_id, past_length, query_length):
        out = orig(request_id, past_length, query_length)
        table = cm.block_table[request_id]
        if query_length == 1 and past_length % B == 0 and table[past_length // B] not in seen:
            st = bp.scheduler.active_requests.get(request_id)
            if st is not None and st.generated_len() + 2 <= st.max_new_tokens and _once(state):
                out[0] = lay.write_trash
        seen.update(table[:(past_length + query_length - 1) // B + 1])
        return out

    cm.get_write_indices = get_write_indices


def write_into_predecessor(bp, lay, state) -> None:
    cm, B = lay.full_allocator(), lay.block_size
    orig = cm.get_write_indices

    def get_write_indices(request_id, past_length, query_length):
        out = orig(request_id, past_length, query_length)
        if query_length == 1 and past_length % B >= 1 and past_length >= 4 and _once(state):
            out[0] -= 1
        return out

    cm.get_write_indices = get_write_indices


def new_token_read_index(bp, lay, state) -> None:
    cm = lay.full_allocator()
    orig = cm.get_read_indices

    def get_read_indices(request_id, past_length, query_length):
        out = orig(request_id, past_length, query_length)
        if query_length == 1 and past_length >= 4 and _once(state):
            out[past_length] = out[past_length - 1]
        return out

    cm.get_read_indices = get_read_indices


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
    if _once(state):
        state["forward"] = write_index
        return True
    return False


def _write_only_store(lay, state, group: str, name: str, store) -> None:
    """Replace group ``group``'s write-only path (a forward that reads no cached KV) in the one forward the bug
    fires in: ``store(k_cache, v_cache, write_index, key_states, value_states)`` writes in place of the engine."""
    a = _sector_allocator(lay, group, name)
    orig = a.update

    def update(key_states, value_states, layer_idx, read_index, write_index):
        if read_index.numel() == 0 and _one_forward(state, write_index):
            store(*a._kv_token_views[layer_idx], write_index, key_states, value_states)
            return key_states, value_states
        return orig(key_states, value_states, layer_idx, read_index, write_index)

    a.update = update


def write_k_only(bp, lay, state) -> None:
    def store(k_cache, v_cache, write_index, k, v):
        k_cache.index_copy_(0, write_index, k)  # (V never written)

    _write_only_store(lay, state, "full_attention", "write-k-only", store)


def sliding_v_into_k(bp, lay, state) -> None:
    def store(k_cache, v_cache, write_index, k, v):
        k_cache.index_copy_(0, write_index, v)  # (V where K belongs)
        v_cache.index_copy_(0, write_index, v)

    _write_only_store(lay, state, "sliding_attention", "sliding-v-into-k", store)


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


_PLANTERS = {name.replace("-", "_"): globals()[name.replace("-", "_")] for name in (*BUGS, *SLIDING_BUGS)}
