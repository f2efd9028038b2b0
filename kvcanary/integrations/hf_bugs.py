"""Engine bugs planted into transformers continuous batching, for the demo and the tests.

Each bug is a realistic bookkeeping mistake from shared/BUGS.md, planted per instance on the batch
processor transformers creates (below kv-canary's hooks: plant first, then attach). It fires once.

Example:
    >>> undo = plant(model, "double-free"); handle = attach(model); ...; handle.detach(); undo()
"""

from __future__ import annotations

from collections.abc import Callable

BUGS: dict[str, tuple[str, str]] = {
    "double-free": ("A", "a finished request's last block is pushed onto the free list twice, so two later "
                         "allocations get the same block"),
    "early-free": ("A", "a request's first block returns to the free list after its first chunk while its table "
                        "still maps it"),
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
}


def plant(model, name: str) -> Callable[[], None]:
    """Plant bug ``name`` into every batch processor ``model`` creates; returns the undo function."""
    if name not in BUGS:
        raise ValueError(f"kv-canary: bug must be one of {sorted(BUGS)}, got {name!r}")
    state = {"fired": False}
    had = "init_continuous_batching" in vars(model)
    orig_init = model.init_continuous_batching

    def init_continuous_batching(*args, **kwargs):
        manager = orig_init(*args, **kwargs)
        orig_create = manager._create_batch_processor

        def create():
            bp = orig_create()
            if not getattr(bp, "_kvcanary_bug", None):
                bp._kvcanary_bug = name
                _zero_pool(bp)
                _PLANTERS[name.replace("-", "_")](bp, state)
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
    for t in (*bp.cache.key_cache, *bp.cache.value_cache):
        t.zero_()


def _once(state) -> bool:
    if state["fired"]:
        return False
    state["fired"] = True
    return True


def double_free(bp, state) -> None:
    cache = bp.cache
    free, orig = cache._block_manager._uninit_block_ids, cache.free_blocks

    def free_blocks(request_id):
        table = list(cache.group_cache_managers[0].block_table.get(request_id, []))
        orig(request_id)
        if table and table[-1] in free and _once(state):
            free.remove(table[-1])
            free.appendleft(table[-1])
            free.appendleft(table[-1])

    cache.free_blocks = free_blocks


def early_free(bp, state) -> None:
    orig, cache = bp.update_batch, bp.cache

    def update_batch():
        orig()
        for rid, table in cache.group_cache_managers[0].block_table.items():
            if len(table) >= 2 and _once(state):
                cache._block_manager._uninit_block_ids.appendleft(table[0])
                return

    bp.update_batch = update_batch


def wrong_block(bp, state) -> None:
    orig, cache = bp.update_batch, bp.cache

    def update_batch():
        orig()
        tables = [t for t in cache.group_cache_managers[0].block_table.values() if len(t) >= 2]
        if len(tables) >= 2 and tables[0][1] != tables[1][1] and _once(state):
            tables[1][1] = tables[0][1]

    bp.update_batch = update_batch


def skip_fork_copy(bp, state) -> None:
    orig, cache = bp.cache.copy_cache, bp.cache
    # A zero-filled pool (as engines that profile memory leave it): the skipped copy leaves finite, wrong KV
    # and generation goes on silently instead of sampling from NaN garbage.
    for t in (*cache.key_cache, *cache.value_cache):
        t.zero_()

    def copy_cache(src, dst):
        if not _once(state):
            orig(src, dst)

    cache.copy_cache = copy_cache


def _flip(cache, slot: int) -> None:
    import torch  # not at import time: the CLI reads BUGS for its --help without torch

    _, j = cache.layer_index_to_group_indices[0]
    cache.key_cache[j][slot].view(torch.uint8).view(-1)[1] ^= 0x10


def flip_kv(bp, state) -> None:
    orig, cache = bp._generation_step, bp.cache

    def step(model):
        orig(model)
        for fs in bp.inputs_and_outputs.requests_in_batch:
            st = fs.state
            table = cache.group_cache_managers[0].block_table.get(st.request_id, [])
            # A token this forward read (in the prefix), not one it wrote.
            if st.position_offset - fs.query_length > 1 and table and _once(state):
                _flip(cache, table[0] * cache.block_size + 1)
                return

    bp._generation_step = step


def flip_idle_cache(bp, state) -> None:
    orig, cache = bp.update_batch, bp.cache

    def update_batch():
        orig()
        idle = list(cache._block_manager._init_block_ids)
        if idle and _once(state):
            _flip(cache, idle[0] * cache.block_size + 2)

    bp.update_batch = update_batch


def prefix_key_collision(bp, state) -> None:
    bm = bp.cache._block_manager
    orig = bm.compute_hash

    def compute_hash(parent_hash, tokens, group_id):
        return orig(None, tokens, group_id)

    bm.compute_hash = compute_hash


def _full_manager(cache):
    return cache.group_cache_managers[0]


def wrong_read_index(bp, state) -> None:
    cm, B = _full_manager(bp.cache), bp.cache.block_size
    orig = cm.get_read_indices

    def get_read_indices(request_id, past_length, query_length):
        out = orig(request_id, past_length, query_length)
        if past_length >= 3:
            own = set(cm.block_table[request_id])
            other = next((t for t in cm.block_table.values() if t and not own & set(t)), None)
            if other is not None and _once(state):
                out[1] = other[0] * B + 2  # another request's position 2, read as our position 1
        return out

    cm.get_read_indices = get_read_indices


def contiguous_read_index(bp, state) -> None:
    cm, B = _full_manager(bp.cache), bp.cache.block_size
    orig = cm.get_read_indices

    def get_read_indices(request_id, past_length, query_length):
        out = orig(request_id, past_length, query_length)
        table = cm.block_table[request_id]
        n = (past_length - 1) // B + 1 if past_length else 0
        # (a fork's guess may land on its parent's identical block: harmless, so wait for one that is not)
        root = request_id.split("__child")[0]
        kin = {b for rid, t in cm.block_table.items() if rid.split("__child")[0] == root for b in t}
        if n >= 2 and any(table[0] + i not in kin for i in range(n)) and _once(state):
            out[:past_length] = range(table[0] * B, table[0] * B + past_length)
        return out

    cm.get_read_indices = get_read_indices


def _partial_fork_copy(bp, state, copy_k: bool, copy_v: bool, layers: int | None) -> None:
    import torch

    orig, cache = bp.cache.copy_cache, bp.cache
    for t in (*cache.key_cache, *cache.value_cache):  # finite wrong KV, as in skip_fork_copy
        t.zero_()

    def copy_cache(src, dst):
        if not _once(state):
            return orig(src, dst)
        s_, d_ = torch.tensor(src), torch.tensor(dst)
        for j, (k, v) in enumerate(zip(cache.key_cache, cache.value_cache)):
            if layers is not None and j >= layers:
                continue
            for t, on in ((k, copy_k), (v, copy_v)):
                if on:
                    view = t.view(-1, cache.block_size, *t.shape[1:])
                    view[d_] = view[s_]

    cache.copy_cache = copy_cache


def k_only_fork_copy(bp, state) -> None:
    _partial_fork_copy(bp, state, copy_k=True, copy_v=False, layers=None)


def first_layer_fork_copy(bp, state) -> None:
    _partial_fork_copy(bp, state, copy_k=True, copy_v=True, layers=1)


def history_short(bp, state) -> None:
    orig = bp.update_batch
    io = bp.inputs_and_outputs

    def update_batch():
        orig()
        for fs in io.requests_in_batch:
            st = fs.state
            if len(st.generated_tokens) >= 2 and st.status != 3 and _once(state):
                del st.generated_tokens[-1]
                return

    bp.update_batch = update_batch


def never_written(bp, state) -> None:
    cache = bp.cache
    cm, B = _full_manager(cache), cache.block_size
    orig = cm.get_write_indices
    seen: set[int] = set()

    def get_write_indices(request_id, past_length, query_length):
        out = orig(request_id, past_length, query_length)
        table = cm.block_table[request_id]
        if query_length == 1 and past_length % B == 0 and table[past_length // B] not in seen:
            st = bp.scheduler.active_requests.get(request_id)
            if st is not None and st.generated_len() + 2 <= st.max_new_tokens and _once(state):
                out[0] = cache.write_trash_index
        seen.update(table[:(past_length + query_length - 1) // B + 1])
        return out

    cm.get_write_indices = get_write_indices


def write_into_predecessor(bp, state) -> None:
    cm, B = _full_manager(bp.cache), bp.cache.block_size
    orig = cm.get_write_indices

    def get_write_indices(request_id, past_length, query_length):
        out = orig(request_id, past_length, query_length)
        if query_length == 1 and past_length % B >= 1 and past_length >= 4 and _once(state):
            out[0] -= 1
        return out

    cm.get_write_indices = get_write_indices


def new_token_read_index(bp, state) -> None:
    cm = _full_manager(bp.cache)
    orig = cm.get_read_indices

    def get_read_indices(request_id, past_length, query_length):
        out = orig(request_id, past_length, query_length)
        if query_length == 1 and past_length >= 4 and _once(state):
            out[past_length] = out[past_length - 1]
        return out

    cm.get_read_indices = get_read_indices


_PLANTERS = {name.replace("-", "_"): globals()[name.replace("-", "_")] for name in BUGS}
