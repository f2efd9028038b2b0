"""The recorded step: one key per step, one cache of plans, two recorders, one close.

Design note. Every forward of an engine source is one *step* of the canary (``StepRunner``): the before work
(plan, HEAD verify and write, the new tokens' read check) and the after work (TAIL verify and write, the step's
close). A step whose buffers and shape match one taken before need not resolve its work again: it can replay a
*recording* of it. So a step goes, per key:

- **eager**: the ``Canary``'s public hooks (``before_forward`` / ``after_forward``) run the work call by call;
- **recorded**: once the key has been seen often enough, a *recorder* keeps what the eager step resolved;
- **replayed**: later steps with the same key run the recording.

- **One key** (``StepKey``), computed once per step by the runner from the source's host part (``HostStep``)
  and inputs: the step's shape (requests, new tokens, token cells, the read table's width rounded up to the
  runner's bucket, whether the forward reads cached KV, whether the read index lists every slot read, the
  block-table path, the attention mask's columns the step's attention-metadata check compares) and the addresses of
  the buffers a recording reads (the engine's four input storages,
  ``Storages``; the staged host part). Every cache of the runner is keyed by it (or by it with one address
  replaced: a static copy of the staged values, a snapshot slot), or by the part of it a recording depends on:
  the after work of a captured step that is not fused (or of an eager step of a captured runner, on CUDA) reads
  only the launcher's staged inputs, laid out by the key's requests and new tokens (and which optional fields
  are staged: the launcher's key), so its recordings are keyed by that, alone or with the snapshot slot
  (``after.AfterPlans``).
- **One cache** (``Plans``): per key a ``Plan`` (the batch its steps share, its recording once made, what the
  launcher's state was after the recorded step's before work), least recently used dropped, and the sightings
  of each shape (a key without the staged buffer's address) that decide when a key is recorded.
- **Two recorders**: CUDA graphs (``graphs.StepGraphs``: the before work per shape; ``after.AfterPlans``: the
  after work of those steps, TAIL and its checks per launcher key and the snapshot copy per slot, or both per
  key and slot once a key keeps coming back; and ``fused.FusedSteps``: a steady decode step's whole work per
  staging turn and snapshot slot; in tests the CPU stand-in ``runtime.graphs.DispatchGraph``), and the CPU's
  bound plan (``steady.SteadyStep``: compiled calls bound to a reused batch, the numba backend). The CPU's eager
  batches (``tables.StepTables``) are the eager stage of the same plans. The launcher records nothing for the
  runner: its own per-shape graphs (``runtime/graphs.py``, ``ForwardLauncher.defer_tail``) serve only the
  config option ``launch_graphs`` of an engine that calls the ``Canary`` itself.
- **One close**: every route ends its step in ``Canary._close``: the eager ``after_forward``, a recording's
  ``close_step`` (a captured step's after plans, a fused step, the CPU's bound plan), or, where the close has
  work of its own (a sweep or allocator check due), ``host_after`` after the recorded ``device_after``; a
  recording that ran a step's before work opens it with ``Canary.open_recorded``. No module here writes a field of the canary's objects
  (tests/test_layers.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

__all__ = ["Plan", "Plans", "StepKey", "Storages", "table_width"]


def table_width(width: int, max_context: int, floor: int) -> int:
    """``width`` rounded up to a power of two of at least ``floor``, never past ``max_context`` (a wider
    batch fails the canary's size check as it is)."""
    return max(width, min(max(floor, 1 << (max(1, width) - 1).bit_length()), max_context))


class StepKey(NamedTuple):
    """What a recording of a step depends on (``StepKey.of``): two steps with equal keys read the same buffers
    with the same shapes. ``shape`` is the key without the staged buffer's address."""

    bs: int  # requests, padding included
    T: int  # new tokens, padding included
    cells: int  # token cells sent (-1: no token history)
    width: int  # the read table's columns, rounded up to the runner's bucket
    no_read: bool  # the forward reads no cached KV (fresh prefills only)
    full_read: bool  # the read index lists every slot the step reads (a shorter one is an engine bug)
    block: bool  # the block-table decode path (never recorded)
    # the attention mask's columns a recorded step's attention-metadata check compares (``StepRunner.mask_cols``):
    # 0 none, n > 0 exactly n (the width the engine hands attention), -n a bucket of n past the step's own keys,
    # whose columns past the batch's keys are not compared
    mask: int
    storages: tuple  # the engine's input storages' addresses (``Storages``: one tuple object per storage set)
    packed: int  # the staged host part's address (the staging turn's buffer)

    @classmethod
    def of(cls, h, storages: tuple, packed: int, group: int, width_step: int, max_context: int,
           mask: int = 0) -> StepKey:
        """The key of host part ``h`` (``runtime.engine.HostStep``) whose inputs have ``storages`` and whose
        staged buffer is at ``packed`` (``Staging.last_ptr``: known without a tensor call); ``mask``: the mask
        columns its attention-metadata check compares (the key's ``mask``)."""
        io = h.io
        return cls(h.bs, h.T, h.cells, table_width(h.width, max_context, width_step), io.max_kv_read == 0,
                   io.true_read_sizes[group] >= h.total, io.use_block_table, mask, storages, packed)

    @property
    def shape(self) -> tuple:
        return self[:-1]


class Storages:
    """The data pointers of the engine's input storages, asked of torch only when a storage tensor is not the one
    seen before (an engine allocates them once): each ``data_ptr`` is a tensor call, tens of microseconds
    together inside the engine's step. Two sets are remembered: an engine that alternates two storage sets
    (async batching, ``carry.py``) asks torch nothing either, and each set keeps its tuple, which a steady run
    compares by identity (``fused.Run``)."""

    def __init__(self):
        self.now = None  # (pointers, input ids, positions, read index, write index) of the last set
        self.other = None  # the same of the other set, if the engine alternates two

    def of(self, io) -> tuple:
        p, a, b, c, d = self.now or (None,) * 5
        if a is not io.input_ids or b is not io.position_ids or c is not io.read_index_storage \
                or d is not io.write_index_storage:
            other = self.other
            self.other = self.now
            if other is not None and other[1] is io.input_ids and other[2] is io.position_ids \
                    and other[3] is io.read_index_storage and other[4] is io.write_index_storage:
                self.now = other
                return other[0]
            a, b, c, d = io.input_ids, io.position_ids, io.read_index_storage, io.write_index_storage
            # (whole storages: a row view per step costs a tensor call)
            p = (a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr())
            self.now = (p, a, b, c, d)
        return p


class Plan:
    """One key's plan: the batch its steps share and, once recorded, its recording: ``graph`` and ``replay``
    (a graph recorder's), ``state`` (``ForwardLauncher.state`` after the recorded step's before work, restored
    at each replay), ``keep`` (what the recording reads that nothing else keeps alive) and ``bound`` (the CPU
    recorder's compiled calls and what they read)."""

    __slots__ = ("batch", "graph", "replay", "state", "keep", "bound")

    def __init__(self, batch):
        self.batch, self.graph, self.replay, self.state, self.keep, self.bound = batch, None, None, None, None, None


class Plans:
    """The runner's plans by key (``StepKey``, or a key derived from it), the least recently used dropped past
    ``capacity``, and the sightings per shape that move a key from eager to recorded (``seen``)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict = OrderedDict()
        self.sightings: dict = {}

    def __len__(self) -> int:
        return len(self.entries)

    def values(self):
        """The plans kept, least recently used first."""
        return self.entries.values()

    def get(self, key):
        """The plan under ``key`` (now the most recently used), or None."""
        plan = self.entries.get(key)
        if plan is not None:
            self.entries.move_to_end(key)
        return plan

    def add(self, key, plan) -> bool:
        """Keep ``plan`` under ``key``; whether an older plan was dropped for it (its recording goes; a batch the
        monitor remembers keeps its tensors)."""
        self.entries[key] = plan
        dropped = False
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
            dropped = True
        return dropped

    def seen(self, shape) -> int:
        """Count a sighting of ``shape``; returns its sightings so far (this one included)."""
        sightings = self.sightings.get(shape, 0) + 1
        if len(self.sightings) > 8 * self.capacity:  # shapes once seen and gone (prefill widths): forget them
            self.sightings.clear()
        self.sightings[shape] = sightings
        return sightings
