"""What an engine provides for one forward, so that the runtime's step runner (``runtime/step``) can take the
step eager, captured or fused (docs/runtime.md, "what an engine sets").

An engine that batches requests into forwards over a paged KV pool is a *source*: an object with the
attributes and methods of ``EngineSource`` below. The transformers adapter is one
(``integrations/transformers/batch.BatchBuilder``), the simulated engine another (``sim/step_source``).

A source hands the runner three things per forward:

- the **host part** (``HostStep``): a packed int64 device buffer of the batch's rows, prefix and extend
  lengths, request ids, token-table cells and each new token's batch index, staged through the runner's
  ``Staging`` (``source.stage``), with the per-request lists the host keeps;
- the **device inputs** (``StepInputs``: ``source.inputs``): the tensors the forward reads its input ids,
  positions, write slots and read slots from, with their true sizes, and the stream the forward runs on;
- the **KV storages**: given once, as the canary's ``PoolSpec``.

The runner reads the inputs' storages by address and never writes them: an engine that captures its forward
in a CUDA graph keeps them static, so the runner's captured step reads the same memory each replay (and
could later be enqueued inside the engine's own capture, hooked at the forward's entry and exit).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import torch

__all__ = ["EngineSource", "HostStep", "StepInputs", "StepOptions"]


class HostStep(NamedTuple):
    """The host part of one forward (``EngineSource.host_part``)."""

    io: object  # the step's device inputs (StepInputs)
    reqs: list | None  # the engine's request objects (the source's own: the runner never reads them)
    bs: int
    T: int  # new tokens
    prefix: list[int] | None
    extend: list[int] | None
    rids: list[int] | None
    packed: torch.Tensor  # the staged device buffer: rows, prefix, extend, ids, token cells, token batch index
    n: int  # per-request values staged (4 x bs)
    small: int  # values before each new token's batch index
    width: int  # max prefix + extend
    total: int  # prefix + new positions over the batch (the read index's expected length)
    pad: int = 0  # padding requests (and tokens) at the end: counted in bs and T, not in prefix, extend, rids


class StepInputs(Protocol):
    """The device inputs of one forward, as the engine's forward reads them (names as transformers' IO object
    has them; storages are per layer group: row ``g`` serves group ``g``)."""

    input_ids: torch.Tensor  # [>= T] the new tokens' ids (under ``EngineSource.carries``: final after the forward)
    position_ids: torch.Tensor  # [>= T] their positions
    write_index_storage: torch.Tensor  # [groups, >= T] the slot each new token's KV is written to
    read_index_storage: torch.Tensor  # [groups, >= total] per request, the slots of positions [0, prefix + extend)
    true_read_sizes: list  # per group, the read index's listed cells
    max_kv_read: int  # 0: the forward reads no cached KV (fresh prefills only)
    use_block_table: bool  # the decode fast path: the forward reads and writes through ``block_table``
    block_table: torch.Tensor | None  # [groups, >= bs, blocks] on that path
    compute_stream: object  # the CUDA stream the forward runs on (None: the current stream; the CPU)


class EngineSource(Protocol):
    """An engine's side of the step runner (``runtime.step.StepRunner``)."""

    group: int  # the full-attention layer group whose indices the runner reads
    block_size: int  # slots per block (the block-table fast path)
    num_slots: int  # the pool's slots (an out-of-range cell: a read index listing fewer slots than read)
    windowed: bool  # a sliding-window group exists (its table is filled by ``finish``; steps stay eager)
    oracle: bool  # the token oracle runs (the sampler reads what the before work computes: eager steps)
    # the forward rewrites some input ids on the device (async batching's carry-over): read them after it. The
    # runner then takes every step late, and the engine calls its ``forward_enqueued`` and ``done_event``
    # (runtime/step/carry.py); optional, False if absent
    carries: bool
    stage: object  # set by the runner: the ``Staging`` that ``host_part`` sends its values through
    pad_cap: int  # set by the runner: decode batches padded to their size bucket up to this (0: none)

    @property
    def inputs(self) -> StepInputs: ...  # the device inputs of the step being prepared

    def host_part(self, copy: bool = True, padded: bool = False) -> HostStep: ...

    def finish(self, batch, h: HostStep, arange) -> None: ...  # an eager step's extras (oracle, window table)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the runner takes steps (the transformers adapter's private ``tuned`` toggles): each path gives the
    same reports and records.

    step_graphs: replay each batch shape's canary launches from CUDA graphs (a stand-in graph type on the CPU);
    late_hooks: a step's canary work runs once the engine has enqueued the forward; fused_steps: a steady decode
    step's canary work as one graph replayed after the forward; in_graph_waits: that graph waits for the engine's
    events itself; bucket_batches: decode batches padded to size buckets; steady_steps: on the CPU (numba), a
    decode step shaped like one taken before runs from the plan bound to it (``runtime/step/steady.py``).
    """

    step_graphs: bool = True
    late_hooks: bool = True
    fused_steps: bool = True
    in_graph_waits: bool = True
    bucket_batches: bool = True
    steady_steps: bool = True

    @classmethod
    def of(cls, options: dict) -> StepOptions:
        """The options named in ``options`` (others ignored), the rest at their defaults."""
        return cls(**{f.name: bool(options[f.name]) for f in dataclasses.fields(cls)
                      if options.get(f.name) is not None})

    # the toggles each one builds on: set False, they leave it without effect
    NEEDS = {"fused_steps": ("step_graphs", "late_hooks"), "in_graph_waits": ("step_graphs", "fused_steps"),
             "bucket_batches": ("step_graphs",)}

    @classmethod
    def ineffective(cls, options: dict, early: str | None = None) -> dict[str, str]:
        """``{name: why}`` for each toggle ``options`` sets True that takes no effect: one it builds on is set
        False, or (late_hooks) ``early`` names what runs a step's hooks before the forward."""
        why = {}
        if options.get("late_hooks") is True and early:
            why["late_hooks"] = f"with {early} (the hooks run before the forward)"
        for name, required in cls.NEEDS.items():
            off = [r for r in required if options.get(r) is False]
            if options.get(name) is True and off:
                why[name] = f"with {off[0]}=False"
        return why
