"""How transformers' paged continuous-batching cache maps onto the canary: the interface the adapter uses.

A canary slot is one physical row of the engine's KV storage, the index its read and write indices
hold. ``EngineLayout`` is the interface; one subclass per generation of transformers' paged cache
implements it, and ``layouts.layout_of`` picks the one whose fields the cache has:

- ``cache_blocks.BlockLayout`` (transformers 5.17): per-layer K and V tensors and one block
  manager; slot = ``block_id * block_size + offset``.
- ``cache_sectors.SectorLayout`` (transformers 5.18 and later, verified to 5.25): one byte tensor
  in sectors, one allocator per attention type; slot = ``block_id * block_stride + offset``, where a
  block's stride spans the K and V pages of every layer of its attention type.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvcanary.ops.types import RealKvSource
from kvcanary.runtime.batch import layer_sources
from kvcanary.runtime.patch import Patcher
from kvcanary.runtime.step.carry import early_work

log = logging.getLogger("kvcanary")

# (first, first unsupported) minor versions the hooks were verified on: 5.17 (the GPU image's) to 5.25 (the newest
# release); 5.17, 5.18, 5.21, 5.23, 5.24 and 5.25 passed the adapter's tests. Later releases are refused unless
# allow_unsupported_version.
_RANGES = (((5, 17), (5, 26)),)
SUPPORTED_RANGE = " or ".join(f">={a[0]}.{a[1]},<{b[0]}.{b[1]}" for a, b in _RANGES)
# async batching's IO as 5.24 has it (docs/notes/async_batching.md; its instances' io_pairs, current_pair, h2d_stream)
_ASYNC_IO = ("get_cb_kwargs", "carry_over_tokens", "swap_io_pairs", "get_model_kwargs")
# CanaryConfig fields that read 5.18's block pool and its allocators' ledger (5.17's block manager has neither)
POOL_OPTIONS = ("allocator_check_interval", "poison_on_free")
BLOCK_POOL_SINCE = (5, 18)  # the first release with that pool and ledger
ASYNC_SINCE = (5, 24)  # 5.17 has the same async IO names, but reported false reserved-slot writes there


def patcher() -> Patcher:
    """A ``Patcher`` whose errors name the transformers versions the hooks were verified on."""
    return Patcher(f"transformers {SUPPORTED_RANGE}")


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string; missing or non-numeric parts read 0 (``"5.25.0.dev0"`` -> (5, 25))."""
    return tuple(int("".join(ch for ch in piece if ch.isdigit()) or "0") for piece in (text.split(".") + ["0"])[:2])


def check_version(version: str | None = None, allow_unsupported: bool = False, config=None) -> str:
    """The installed transformers version; raises unless it is in ``SUPPORTED_RANGE``, and a ``ValueError``
    naming the ``POOL_OPTIONS`` that ``config`` (a ``CanaryConfig``) turns on below 5.18."""
    if version is None:
        import transformers

        version = transformers.__version__
    if not any(lo <= parse_version(version) < hi for lo, hi in _RANGES) and not allow_unsupported:
        raise RuntimeError(f"kv-canary: transformers must be {SUPPORTED_RANGE} (the continuous-batching internals "
                           f"the integration hooks were verified there), got {version}; pass "
                           "allow_unsupported_version=True to try anyway")
    on = " and ".join(name for name in POOL_OPTIONS if config is not None and getattr(config, name))
    if on and parse_version(version) < BLOCK_POOL_SINCE:
        raise ValueError(f"kv-canary: {on} need{'' if ' and ' in on else 's'} transformers >= 5.18's block pool "
                         f"and ledger, got {version}; turn it off on this version (docs/transformers.md, "
                         "\"Two paged-cache generations\")")
    return version


def layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:
        kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
        types = [kind] * config.num_hidden_layers
    return list(types)


def check_engine(config, cb_config, *, token_oracle: bool, device=None, canary=None) -> None:
    """Raise ``ValueError`` for engine set-ups the integration does not support (before anything runs)."""
    if getattr(cb_config, "use_async_batching", False):
        import transformers
        from transformers.generation.continuous_batching import input_outputs

        aio, version = getattr(input_outputs, "ContinuousBatchingAsyncIOs", None), transformers.__version__
        early = early_work(token_oracle, canary is not None and canary.check_before_forward,
                           canary is not None and canary.injecting)
        if aio is None or not all(hasattr(aio, n) for n in _ASYNC_IO) or getattr(device, "type", None) != "cuda" \
                or early or parse_version(version) < ASYNC_SINCE:
            raise ValueError(f"kv-canary: async batching needs transformers >= 5.24's async IO on CUDA and no work "
                             f"before the forward, got transformers {version} on device {device}"
                             f"{', ' if early else ''}{' and '.join(early)}; pass "
                             "ContinuousBatchingConfig(use_async_batching=False) (docs/transformers.md, async)")
    # CUDA graphs are accepted: the engine replays its forward inside compute_batch, which the canary's
    # hooks wrap (its own work runs after the replay is enqueued, never inside the capture); the warm-up's
    # fake requests write blocks that the cache's reset frees before any request, and padding tokens write
    # the engine's write-trash row, which no request reads.
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
    """Where the canary looks in one paged cache, and the engine calls that move KV between steps.

    The fields describe the slot space; the methods below them are what each cache generation
    implements (``cache_blocks``, ``cache_sectors``). Engine groups are the indices of the
    engine's read and write index rows (``io.read_index_storage[g]``).
    """

    cache: object
    block_size: int  # tokens of one block (of one layer)
    num_blocks: int  # the token capacity in blocks (the canary's table width)
    num_slots: int
    full_group: int
    swa_group: int | None
    window: int  # canary SWA window: the engine's sliding_window - 1 past tokens are read
    write_trash: int
    strides: tuple[int, ...]  # per engine group: the slot distance from one block id to the next
    k_full: torch.Tensor
    v_full: torch.Tensor
    k_swa: torch.Tensor | None
    v_swa: torch.Tensor | None
    keys: tuple[torch.Tensor, ...] = ()  # per layer of the full group: its K rows, one per slot
    values: tuple[torch.Tensor, ...] = ()
    swa_keys: tuple[torch.Tensor, ...] = ()  # per sliding layer: its K rows, one per slot
    swa_values: tuple[torch.Tensor, ...] = ()

    def real_kv_sources(self, check_v: bool,
                        swa: bool = False) -> tuple[tuple[RealKvSource, ...], tuple[RealKvSource, ...]]:
        """(K sources, V sources) of one group's real-KV hash (``runtime.batch.layer_sources``)."""
        keys, values = (self.swa_keys, self.swa_values) if swa else (self.keys, self.values)
        return layer_sources(keys, values, check_v)

    def slot(self, block: int, offset: int, group: int | None = None) -> int:
        """The slot of token ``offset`` of block ``block`` (of the full group unless ``group``)."""
        return block * self.strides[self.full_group if group is None else group] + offset

    def blocks_to_slots(self, blocks: list[int], device, group: int | None = None) -> torch.Tensor:
        """int64 slots of whole blocks of one group (the full group unless ``group``), block-major."""
        stride = self.strides[self.full_group if group is None else group]
        b = torch.as_tensor(blocks, dtype=torch.int64).view(-1, 1)
        return (b * stride + torch.arange(self.block_size)).view(-1).to(device)

    def group_slots(self, group_blocks, device) -> torch.Tensor:
        """Slots of ``[(group, blocks), ...]`` in that order (one request's blocks of every group)."""
        parts = [self.blocks_to_slots(bl, device, g) for g, bl in group_blocks if len(bl)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)

    # -- what each cache generation implements ------------------------------------------------------------
    def check_fresh(self) -> None:
        """RuntimeError unless the cache holds no KV yet (its slots would have no canary records)."""
        raise NotImplementedError

    def reserve_padding(self) -> bool:
        """Keep slot 0 (the canary's padding slot) from ever holding a real token; True if this took a block
        (by default nothing: a cache whose slot 0 no block can take)."""
        return False

    def release_padding(self, reserved: bool) -> None:
        """Undo ``reserve_padding`` (detach)."""

    def block_table(self, group: int) -> dict[str, list[int]]:
        """The engine's live block tables of one group (request id -> block ids), updated in place."""
        raise NotImplementedError

    def request_blocks(self, request_id: str) -> list[tuple[int, list[int]]]:
        """``[(group, blocks), ...]`` of one request, every group."""
        raise NotImplementedError

    def idle_blocks(self) -> list[int]:
        """Full-group blocks no request holds, kept for prefix reuse (a sweep verifies them)."""
        raise NotImplementedError

    def shares_blocks(self) -> bool:
        """Whether full-group blocks may be shared (dedup remaps, idle cached blocks)."""
        raise NotImplementedError

    def install_hooks(self, patcher: Patcher, session) -> None:
        """Hook the engine calls that move KV between steps: fork copies (``session._on_copy(src_slots,
        dst_slots, blocks)``), offloads to CPU memory (``session._on_offload(victims, done, slots)``) and
        restores (``session._on_restore(slots)``), each after the engine's own work."""
        raise NotImplementedError
