"""What an engine provides for one forward, so that the runtime's step runner (``runtime/step``) can take the
step eager, captured or fused (docs/runtime.md, "what an engine sets").

An engine that batches requests into forwards over a paged KV pool is a *source*: an object with the
attributes and methods of ``EngineSource`` below. The transformers adapter is one
(``integrations/transformers/batch.BatchBuilder``), the simulated engine another (``sim/step_source``). vLLM's
adapter (``integrations/vllm/batch.BatchBuilder``) describes each canary forward the same way, a ``HostStep`` made
by ``HostStep.pack`` whose batch ``runtime/step/tables.StepTables`` builds, but drives the ``Canary`` itself: a
vLLM forward may be several canary forwards (its waves, docs/vllm.md).

A source hands the runner three things per forward:

- the **host part** (``HostStep``): a packed int64 device buffer of the batch's rows, prefix and extend
  lengths, request ids, token-table cells and each new token's batch index, staged through the runner's
  ``Staging`` (``source.stage``), with the per-request lists the host keeps. ``HostStep.pack`` makes it
  (every source calls it, or ``pack_kept`` for values it keeps laid out as ``HostLayout`` says) and
  ``HostStep.unpack`` reads it back: the layout lives here alone;
- the **device inputs** (``StepInputs``: ``source.inputs``): the tensors the forward reads its input ids,
  positions, write slots and read slots from, with their true sizes, and the stream the forward runs on;
- the **KV storages**: given once, as the canary's ``PoolSpec``;
- optionally the **attention metadata** (``AttentionInputs``: ``source.attention_inputs(io)``): the key lengths
  and mask the full-attention kernel gets, as static buffers with this step's mask width, which a recorded step's
  attention-metadata check reads by address (``runtime/attention_check.py``).

The runner reads the inputs' storages by address and never writes them: an engine that captures its forward
in a CUDA graph keeps them static, so the runner's captured step reads the same memory each replay (and
could later be enqueued inside the engine's own capture, hooked at the forward's entry and exit).
"""

from __future__ import annotations

import dataclasses
from operator import add
from typing import NamedTuple, Protocol

import numpy as np
import torch

__all__ = ["AttentionInputs", "EngineSource", "HostLayout", "HostParts", "HostStep", "StepInputs", "StepOptions",
           "TokenCells"]


class HostLayout(NamedTuple):
    """Where each part of a packed host step starts in ``HostStep.packed`` (``HostLayout.of``): per request its
    row, prefix length, extend length and request id; with a token history, per request its valid length and
    then the ``cells`` token-table cells as rows, columns and tokens; last each new token's batch index. A
    source that keeps its values in this order between steps (transformers' steady decode steps) writes them at
    these offsets and sends them with ``HostStep.pack_kept``."""

    rows: int
    prefix: int
    extend: int
    rids: int
    valid: int  # (= cell_rows = cell_cols = cell_tokens = token_req without a token history)
    cell_rows: int
    cell_cols: int
    cell_tokens: int
    token_req: int

    @classmethod
    def of(cls, bs: int, cells: int) -> HostLayout:
        """The layout of ``bs`` requests (padding included) and ``cells`` token cells (-1: no token history)."""
        valid = 4 * bs
        rows = valid + bs if cells >= 0 else valid
        k = max(cells, 0)
        return cls(0, bs, 2 * bs, 3 * bs, valid, rows, rows + k, rows + 2 * k, rows + 3 * k)


class HostParts(NamedTuple):
    """``HostStep.unpack``: views of the packed buffer, one per part (the token history's None without one)."""

    rows: torch.Tensor
    prefix: torch.Tensor
    extend: torch.Tensor
    rids: torch.Tensor
    valid: torch.Tensor | None  # each request's valid token-table length
    cell_rows: torch.Tensor | None
    cell_cols: torch.Tensor | None
    cell_tokens: torch.Tensor | None
    token_req: torch.Tensor  # each new token's batch index


class TokenCells(NamedTuple):
    """The token history a source sends with a step (``HostStep.pack``): each request's valid length, and the
    token-table cells its row lacks as rows, columns and tokens (lists of ints, or int64 arrays for long runs)."""

    valid: list
    rows: object
    cols: object
    tokens: object


_IOTA = [np.arange(256, dtype=np.int64)]  # (each new token's batch index where every request has one)


def _iota(n: int) -> np.ndarray:
    if _IOTA[0].shape[0] < n:
        _IOTA[0] = np.arange(max(n, 2 * _IOTA[0].shape[0]), dtype=np.int64)
    return _IOTA[0][:n]


class HostStep(NamedTuple):
    """The host part of one forward (``EngineSource.host_part``): the per-request lists the host keeps and the
    same values packed into one staged int64 device buffer (``pack``; read back as views by ``unpack``, whose
    offsets ``HostLayout`` gives)."""

    io: object  # the step's device inputs (StepInputs)
    reqs: list | None  # the engine's request objects (the source's own: the runner never reads them)
    bs: int  # requests, padding included
    T: int  # new tokens, padding included
    prefix: list[int] | None
    extend: list[int] | None
    rids: list[int] | None
    packed: torch.Tensor  # the staged device buffer, laid out as ``HostLayout.of(bs, cells)`` says
    cells: int  # token-table cells sent (-1: no token history)
    width: int  # max prefix + extend
    total: int  # prefix + new positions over the batch (the read index's expected length)
    pad: int = 0  # padding requests (and tokens) at the end: counted in bs and T, not in prefix, extend, rids

    @property
    def layout(self) -> HostLayout:
        return HostLayout.of(self.bs, self.cells)

    @classmethod
    def pack(cls, stage, io, reqs, rows: list, prefix: list, extend: list, rids: list,
             cells: TokenCells | None = None, pad: int = 0, copy: bool = True) -> HostStep:
        """Stage a step of the requests ``rows``, ``prefix``, ``extend``, ``rids`` (lists of ints, one per
        request) and their ``cells`` (None: no token history) through ``stage`` (the runner's ``Staging``;
        ``copy=False``: its host-to-device copy is left to the caller, ``Staging.copy``). ``pad``: padding
        requests after them, for a decode step padded to its size bucket (SPEC: row 0, prefix 0, one token and id
        0 each; valid length 0 and a cell of token 0 at the padding row's column 0), which every check skips."""
        bs = len(rows)
        T = sum(extend)
        one_each = T == bs and extend.count(1) == bs
        if pad:
            if not one_each:
                raise ValueError(f"kv-canary: only a decode step (one new token per request) is padded, got "
                                 f"{T} new tokens over {bs} requests with pad={pad}")
            z = [0] * pad
            parts = [rows + z + prefix + z + extend + [1] * pad + rids + z]
        else:
            parts = [rows + prefix + extend + rids]
        k = -1
        if cells is not None:
            valid, crows, ccols, ctokens = cells
            k = len(crows) + pad
            if pad:
                parts.append(list(valid) + z + list(crows) + z + list(ccols) + z + list(ctokens) + z)
            elif type(crows) is list and type(ccols) is list and type(ctokens) is list:
                parts.append(valid + crows + ccols + ctokens)
            else:
                parts += [valid, crows, ccols, ctokens]
        # (made on the host: CPU repeat_interleave is slow at small sizes)
        parts.append(_iota(bs + pad) if one_each else np.repeat(_iota(bs), extend))
        packed, _ = stage.send(parts, copy)
        width = max(map(add, prefix, extend), default=0)
        return cls(io, reqs, bs + pad, T + pad, prefix, extend, rids, packed, k, width, sum(prefix) + T, pad)

    @classmethod
    def pack_kept(cls, stage, words: memoryview, io, reqs, prefix: list, extend: list, rids: list, cells: int,
                  width: int, total: int, pad: int = 0, copy: bool = True) -> HostStep:
        """``pack`` for a source that keeps a decode step's values (one new token per request, ``pad`` of them
        padding) in ``words``, laid out as ``HostLayout.of(len(prefix) + pad, cells)`` says, and updates
        them in place between steps; ``width`` and ``total`` as ``pack`` computes them."""
        bp = len(prefix) + pad
        packed, _ = stage.send([words], copy, last=bp)
        return cls(io, reqs, bp, bp, prefix, extend, rids, packed, cells, width, total, pad)

    def unpack(self, packed: torch.Tensor | None = None) -> HostParts:
        """Views of ``packed`` (default: this step's buffer; a copy of it in the same layout) by part."""
        packed = self.packed if packed is None else packed
        bs, lay = self.bs, self.layout
        history = self.cells >= 0
        k = max(self.cells, 0)
        return HostParts(packed[:bs], packed[bs:2 * bs], packed[2 * bs:3 * bs], packed[3 * bs:4 * bs],
                         packed[lay.valid:lay.valid + bs] if history else None,
                         packed[lay.cell_rows:lay.cell_rows + k] if history else None,
                         packed[lay.cell_cols:lay.cell_cols + k] if history else None,
                         packed[lay.cell_tokens:lay.cell_tokens + k] if history else None,
                         packed[lay.token_req:])


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


class AttentionInputs(NamedTuple):
    """The attention metadata the engine hands the full-attention group's kernel for one step
    (``EngineSource.attention_inputs``). The tensors are static buffers of the step's input storage set (the same
    tensor every step the set serves: a recorded step reads them by address); ``width`` is this step's."""

    cu_seqlens_k: torch.Tensor | None  # [>= bs + 1] cumulative key lengths per request (None: none handed over)
    mask: torch.Tensor | None  # [..., >= T, >= width] the SDPA / eager mask buffer, leading dims 1 (None: no mask)
    width: int  # the mask's columns attention gets this step (its rows: the step's tokens)


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

    # optional: the attention metadata of a step of inputs ``io`` (None: none to check; the block-table path). With
    # it, the captured and fused steps check it in their recording (runtime/attention_check.py); without it,
    # only the engine's own calls to ``Canary.check_attention`` on eager steps do
    def attention_inputs(self, io) -> AttentionInputs | None: ...


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
