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
    import torch

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


_PLANTERS = {name.replace("-", "_"): globals()[name.replace("-", "_")] for name in BUGS}
