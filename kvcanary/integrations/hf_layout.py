"""How transformers' paged continuous-batching cache maps onto the canary, and what it cannot map.

A canary slot is a physical row of the engine's KV tensors: ``block_id * block_size + offset``
(``cache.key_cache[j]`` is ``[(num_blocks + 2) * block_size, kv_heads, head_dim]``). Slot 0 is
the canary's padding slot, so block 0 is kept out of the engine's free list while attached.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch

from kvcanary.ops.types import RealKvSource

log = logging.getLogger("kvcanary")

SUPPORTED_RANGE = ">=5.17,<5.18"
_MIN, _MAX_EXCLUSIVE = (5, 17), (5, 18)
# what EngineLayout.from_cache reads of a PagedAttentionCache
_CACHE_FIELDS = ("config", "layer_index_to_group_indices", "key_cache", "value_cache", "block_size", "num_blocks",
                "write_trash_index")


def parse_version(text: str) -> tuple[int, int]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts + [0] * (2 - len(parts)))


def check_version(version: str | None = None, allow_unsupported: bool = False) -> str:
    """The installed transformers version; raises unless it is in ``SUPPORTED_RANGE``."""
    if version is None:
        import transformers

        version = transformers.__version__
    if not _MIN <= parse_version(version) < _MAX_EXCLUSIVE and not allow_unsupported:
        raise RuntimeError(f"kv-canary: transformers must be {SUPPORTED_RANGE} (the continuous-batching internals "
                           f"the integration hooks were verified there), got {version}; pass "
                           "allow_unsupported_version=True to try anyway")
    return version


class Patcher:
    """Per-instance rebinding with an exact undo: restores a pre-existing instance attribute, else deletes ours."""

    def __init__(self):
        self._undo: list[tuple[object, str, bool, object]] = []

    def set(self, obj, name: str, value) -> None:
        if not callable(getattr(obj, name, None)):
            raise RuntimeError(f"kv-canary: {type(obj).__name__}.{name} must be a method to hook, got "
                               f"{type(getattr(obj, name, None)).__name__} (transformers {SUPPORTED_RANGE} expected)")
        had = name in vars(obj)
        self._undo.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, value)

    def patched(self, obj, name: str) -> bool:
        return any(o is obj and n == name for o, n, _, _ in self._undo)

    def restore(self) -> None:
        for obj, name, had, old in reversed(self._undo):
            if had:
                setattr(obj, name, old)
            else:
                vars(obj).pop(name, None)
        self._undo.clear()


def layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:
        kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
        types = [kind] * config.num_hidden_layers
    return list(types)


def check_engine(config, cb_config, *, token_oracle: bool) -> None:
    """Raise ``ValueError`` for engine set-ups the integration does not support (before anything runs)."""
    if getattr(cb_config, "use_async_batching", False):
        raise ValueError("kv-canary: continuous batching must run synchronously, got use_async_batching=True; pass "
                         "ContinuousBatchingConfig(use_async_batching=False) (async batching prepares step N+1 "
                         "before step N's tokens are known)")
    if any(getattr(cb_config, "cuda_graph_booleans", (False, False))):
        raise ValueError("kv-canary: CUDA graphs must be off, got use_cuda_graph="
                         f"{cb_config.use_cuda_graph}; pass ContinuousBatchingConfig(use_cuda_graph=False) (graph "
                         "warm-up writes KV outside the hooked step)")
    compiled = cb_config.varlen_compile_config is not None or cb_config.decode_compile_config is not None
    if token_oracle and compiled:
        raise ValueError("kv-canary: token_oracle needs an uncompiled sampler, got a compile config; pass "
                         "ContinuousBatchingConfig(default_compile_level=0) or token_oracle=False")
    types = layer_types(config)
    kinds = set(types)
    if not kinds <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"kv-canary: layer types must be full_attention or sliding_attention, got {sorted(kinds)}")
    if "full_attention" not in kinds:
        raise ValueError("kv-canary: the model needs at least one full-attention layer, got only sliding-window "
                         "layers (sliding-only models such as Mistral with sliding_window are not supported: the "
                         "canary anchors the sliding group on the full group's slots)")
    if "sliding_attention" in kinds:
        window = getattr(config, "sliding_window", None) or 0
        if window < 2:
            raise ValueError(f"kv-canary: sliding_window must be >= 2, got {window}")
        if cb_config.allow_block_sharing:
            raise ValueError("kv-canary: sliding-window models need ContinuousBatchingConfig(allow_block_sharing="
                             "False), got True (transformers then shares full-attention blocks between requests "
                             "whose sliding-window blocks differ, which one full->SWA table cannot describe)")


@dataclass
class EngineLayout:
    """Where the canary looks in one ``PagedAttentionCache``."""

    block_size: int
    num_blocks: int
    num_slots: int
    full_group: int
    swa_group: int | None
    window: int  # canary SWA window: the engine's sliding_window - 1 past tokens are read
    write_trash: int
    k_full: torch.Tensor
    v_full: torch.Tensor
    k_swa: torch.Tensor | None
    v_swa: torch.Tensor | None
    keys: tuple[torch.Tensor, ...] = ()  # cache.key_cache: entry j serves layer j of every group
    values: tuple[torch.Tensor, ...] = ()

    @classmethod
    def from_cache(cls, cache) -> EngineLayout:
        # (with allow_unsupported_version a later transformers may have rebuilt its paged cache: say what is
        # missing here, once, instead of an AttributeError from the engine's loop)
        missing = [name for name in _CACHE_FIELDS if not hasattr(cache, name)]
        if missing:
            version = getattr(sys.modules.get("transformers"), "__version__", "unknown")
            raise RuntimeError(f"kv-canary: transformers {version}'s {type(cache).__name__} lacks {missing}, which "
                               f"the integration reads (supported: transformers {SUPPORTED_RANGE})")
        types = layer_types(cache.config)
        full_layer = types.index("full_attention")
        full_group, j_full = cache.layer_index_to_group_indices[full_layer]
        swa_group = k_swa = v_swa = None
        window = 0
        if "sliding_attention" in types:
            swa_layer = types.index("sliding_attention")
            swa_group, j_swa = cache.layer_index_to_group_indices[swa_layer]
            k_swa, v_swa = cache.key_cache[j_swa], cache.value_cache[j_swa]
            window = int(cache.config.sliding_window) - 1
        return cls(block_size=cache.block_size, num_blocks=cache.num_blocks,
                   num_slots=cache.key_cache[j_full].shape[0], full_group=full_group, swa_group=swa_group,
                   window=window, write_trash=cache.write_trash_index, k_full=cache.key_cache[j_full],
                   v_full=cache.value_cache[j_full], k_swa=k_swa, v_swa=v_swa, keys=tuple(cache.key_cache),
                   values=tuple(cache.value_cache))

    def real_kv_sources(self, check_v: bool) -> tuple[tuple[RealKvSource, ...], tuple[RealKvSource, ...]]:
        """(K buffer sources, V buffer sources) of the real-KV hash: more than one layer, K and V.

        A slot's bytes live in ``keys[j]`` / ``values[j]`` for every layer j of its group (the same
        tensors serve every group). Without V buffers the K record hashes the first layer's K and
        the last layer's V (2 sources: each source is a few more tensor ops per launch on the CPU),
        so a copy that skips V, skips K, or moves only the first or only the last layer changes the
        hash. With V buffers, K records hash the K of up to 4 layers (first, last and evenly spaced
        between) and V records the V of the same layers.
        """
        n = len(self.keys)
        if check_v:
            layers = sorted({round(i * (n - 1) / 3) for i in range(4)}) if n > 1 else [0]
            return (tuple(s for j in layers for s in kv_sources(self.keys[j])),
                    tuple(s for j in layers for s in kv_sources(self.values[j])))
        return kv_sources(self.keys[0]) + kv_sources(self.values[n - 1]), ()

    def blocks_to_slots(self, blocks: list[int], device) -> torch.Tensor:
        """int64 slots of whole blocks, block-major."""
        b = torch.as_tensor(blocks, dtype=torch.int64).view(-1, 1)
        return (b * self.block_size + torch.arange(self.block_size)).view(-1).to(device)


def kv_sources(tensor: torch.Tensor | None) -> tuple[RealKvSource, ...]:
    """One real-KV source over a cache tensor (one slot per row), or none when its rows are not 16-byte multiples."""
    if tensor is None:
        return ()
    rows = tensor.view(tensor.shape[0], -1)
    nbpt = rows.shape[1] * rows.element_size()
    if nbpt % 16:
        return ()
    return (RealKvSource(rows, page_size=1, num_bytes_per_token=nbpt, read_bytes=nbpt),)


def check_fresh(cache) -> None:
    """RuntimeError unless the cache holds no KV yet (its slots would have no canary records)."""
    held = sum(len(cm.block_table) for cm in cache.group_cache_managers)
    cached = len(cache._block_manager._hash_to_id)
    if held or cached:
        raise RuntimeError("kv-canary: attach before the paged cache holds KV (its slots have no canary records), "
                           f"got a cache with {held} request tables and {cached} cached blocks; call "
                           "model.destroy_cached_continuous_batching_manager() or attach before the first run")


def reserve_block0(cache) -> bool:
    """Keep block 0 out of the free list: its first slot is the canary's padding slot 0."""
    free = cache._block_manager._uninit_block_ids
    if free and free[0] == 0:
        free.popleft()
        return True
    if 0 in free:
        free.remove(0)
        return True
    log.warning("kv-canary: block 0 is in use; slot 0 (its first token) is not verified")
    return False


def release_block0(cache, reserved: bool) -> None:
    """Block 0 back on the free list (detach), unless it was never reserved or a table holds it."""
    if not reserved:
        return
    free = cache._block_manager._uninit_block_ids
    in_use = any(0 in t for cm in cache.group_cache_managers for t in cm.block_table.values())
    if 0 not in free and not in_use:
        free.appendleft(0)


def fill_swa_table(lay, table, io, prefix_t, extend_t, width: int, T: int, out_cache_loc, arange) -> None:
    """Synthetic full->SWA table ``table`` of a step, from the read and write indices of both groups
    (``BatchBuilder.build``; ``arange(n)``: the builder's cached index row).

    The sliding group's read index lists, per request, the rolling-buffer slots of its last
    ``c = min(prefix, W - 1)`` positions (then a sentinel per new token); the full group's read
    index the full slots of the same positions. Each such full slot maps to the sliding slot the
    forward reads, except positions this forward overwrites (``p < prefix + extend - W``), which
    map to 0 = evicted (their HEAD verify ran before the write; TAIL would see the new token).
    New tokens map their full write slot to their sliding write slot (0 for the write trash).
    """
    W = lay.window + 1
    table.zero_()
    if width:
        g, sg = lay.full_group, lay.swa_group
        c = prefix_t.clamp(max=lay.window)
        k = arange(width)  # [bs, width] grid of window cells; k >= c are not read
        full_start = torch.cumsum(prefix_t + extend_t, 0) - extend_t - c  # first window position, full read
        swa_start = torch.cumsum(c + extend_t, 0) - extend_t - c
        fr, sr = io.read_index_storage[g], io.read_index_storage[sg]
        full = fr.index_select(0, (full_start.unsqueeze(1) + k).view(-1).clamp_(max=fr.shape[0] - 1))
        swa = sr.index_select(0, (swa_start.unsqueeze(1) + k).view(-1).clamp_(max=sr.shape[0] - 1))
        p = (prefix_t - c).unsqueeze(1) + k
        keep = (p >= (prefix_t + extend_t - W).unsqueeze(1)).view(-1)
        inside = (k < c.unsqueeze(1)).view(-1)
        # Cells outside the window go to slot 0 (padding, never a real slot), cleared again below.
        table[torch.where(inside, full, 0)] = torch.where(keep, swa, 0)
        table[0] = 0
    if T:
        swa_w = io.write_index_storage[lay.swa_group, :T]
        table[out_cache_loc] = torch.where(swa_w == lay.write_trash, torch.zeros_like(swa_w), swa_w)
