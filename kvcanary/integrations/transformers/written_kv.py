"""The transformers side of the write and attention-metadata checks (docs/write_check.md).

``hook_cache_update``: every attention layer hands the K and V it computed to the paged cache's ``update(key_states,
value_states, layer_idx, ...)`` inside the forward, before any allocator stores them (index-based update, the
decode fast path whose kernel writes through the block table): the hook passes them on to
``canary.write_check.note_layer``. ``check_attention_meta``: before the forward, each attention type's per-request key
lengths and SDPA / eager mask, as the engine's IO holds them, to ``canary.attention_check.check`` on eager steps;
``attention_inputs``: the full-attention group's static buffers and mask width (``BatchBuilder.attention_inputs``),
which the step runner's captured and fused steps check inside their recorded work.
"""

from __future__ import annotations

from kvcanary.integrations.transformers.layout import layer_types
from kvcanary.runtime.batch import ForwardBatch
from kvcanary.runtime.engine import AttentionInputs

TYPES = (("full_attention", "full"), ("sliding_attention", "swa"))


def hook_cache_update(patcher, session) -> None:
    lay, canary, cache = session.layout, session.canary, session.bp.cache
    types = layer_types(cache.config)
    rows = {"full": (lay.keys, lay.values), "swa": (lay.swa_keys, lay.swa_values)}
    named = canary.write_check.name_layers(
        [(g, [i for i, t in enumerate(types) if t == kind], *rows[g]) for kind, g in TYPES
         if g == "full" or (lay.swa_group is not None and len(canary.groups) > 1)])
    if not named:
        return
    orig = cache.update

    def update(key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx in named and not session.closed:  # ([1, heads, tokens, dim] -> [tokens, heads, dim])
            canary.write_check.note_layer(layer_idx, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1))
        return orig(key_states, value_states, layer_idx, *args, **kwargs)

    patcher.set(cache, "update", update)


def mask_width(io) -> int:
    """The widest slice of the mask the engine hands attention this step (its padded key count: a correct mask
    hides the columns past the batch's keys; columns past this one may hold stale values attention never reads)."""
    return int(getattr(io, "max_kv_read", 0)) + int(getattr(io, "num_q_tokens", 0))


def _metadata(io, kind: str):
    """(key lengths, mask buffer) of attention type ``kind`` as ``io`` holds them (no mask on the block-table path)."""
    masks = None if getattr(io, "use_block_table", False) else getattr(io, "attention_mask", None)
    cu = getattr(io, "cumulative_seqlens_k", None)
    return (cu.get(kind) if isinstance(cu, dict) else None), (masks.get(kind) if isinstance(masks, dict) else None)


def attention_inputs(io) -> AttentionInputs | None:
    """The full-attention group's key lengths and mask buffers of ``io`` and this step's mask width (None on the
    block-table path: no mask, never recorded)."""
    if getattr(io, "use_block_table", False):
        return None
    return AttentionInputs(*_metadata(io, "full_attention"), mask_width(io))


def check_attention_meta(session) -> None:
    canary, runner, lay = session.canary, session.runner, session.layout
    # The captured and fused steps (the graphs route, CUDA's default) check the full-attention group's key lengths
    # and mask inside their recorded work (StepRunner.record_attention), from the same buffers: only the eager
    # steps are checked here, every group (a sliding-window model's steps are all eager). docs/write_check.md
    if not canary.attention_check.on or runner.attention_recorded or not isinstance(runner.batch, ForwardBatch):
        return
    io, batch = session.builder.inputs, runner.batch
    width = mask_width(io)
    for kind, group in TYPES:
        index = lay.full_group if group == "full" else lay.swa_group
        if index is None:
            continue
        lens, mask = _metadata(io, kind)
        slots = None
        if mask is not None:
            mask = mask[..., :batch.num_tokens, :min(mask.shape[-1], width)]
            slots = io.read_index_storage[index, :mask.shape[-1]]
        canary.attention_check.check(group, cu_seqlens_k=lens, mask=mask, key_slots=slots, batch=batch)
