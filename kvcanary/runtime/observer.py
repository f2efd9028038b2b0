"""Host observations read one step late, so the hot path never waits for the device.

At the end of a step the violation ring and a few small device tensors are
snapshotted on the stream the step's TAIL ran on (device-to-device, then the ring's
write index is reset), and the small ones are copied into pinned host memory behind
it. The next step reads them once their event has completed. Only when a snapshot shows
violations are its rows copied to the host (a sync, on the rare path). On CPU
everything is read at once.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvcanary.ops.snapshot_ops import record_table, snapshot_impl
from kvcanary.ops.types import ViolationRing
from kvcanary.runtime.graphs import EagerGraphs, eager
from kvcanary.runtime.streams import event_query, event_synchronize, record_event, stream_cache

NUM_SLOTS = 3  # snapshots in flight before the oldest must be waited for
# A deferred TAIL sequence joins the snapshot's captured sequence once its shape has closed this many steps:
# combined, a step costs one host call fewer, but each shape is captured once per snapshot slot (three
# captures of some 3 ms each on the H200); apart, TAIL is captured once per shape and the snapshot once per
# slot. Shapes that come and go (prefill chunks, a batch that shrinks as requests finish) stay apart.
COMBINE_SIGHTINGS = 32
# A snapshot keeps, for its first this many rows, the record each row's slot holds in each attributable buffer
# (``HostObserver(records=...)``): a late drain decodes a row steps after its check, when the slot may hold
# another record (a freed block reused, a fork's block copied over it), and the report's writer, and whether it
# reads a write the write check found wrong, are those of the record the check saw. Rows past it are attributed
# from the buffer as it is when they are decoded.
RECORD_ROWS = 4096
RECORD_WORDS = 6  # TOKEN, POSITION, PREV_HASH, REAL_KV_HASH, WRITER_ID, WRITER_STEP (format.RecordField)


class Observation(NamedTuple):
    """One closed step as the host read it: violations found, the rows kept, the small tensors. A tuple: the
    CPU's steady step (``runtime/step/steady.py``) makes one per step without a call into this module."""

    step: int  # host step the snapshot closed
    host_meta: dict  # host-side facts recorded with it (forwards seen, sweeps asked for)
    count: int  # violations found in the step (may exceed rows stored)
    rows: list  # stored violation rows
    small: list  # the watched tensors, flattened (values unflattens them by layout)
    layout: dict
    # per attributable buffer (its key in ``HostObserver(records=...)``): the first RECORD_WORDS words of the record
    # each stored row's slot held when the step closed (None: read the buffers themselves, as the CPU's step
    # close does at once)
    records: dict | None = None
    # per group with a full->SWA table (``HostObserver(tables=...)``): the table as the step closed it, on the host
    # (None: read the group's table itself)
    tables: dict | None = None

    @property
    def values(self) -> dict[str, list]:
        """The small tensors by name, as ``tolist`` gives them (made per use: most steps never need them)."""
        small = self.small
        return {k: _unflatten(small[at:at + n], shape) for k, (at, n, shape) in self.layout.items()}


class _Slot:
    def __init__(self, ring: ViolationRing, size: int, cuda: bool, index: int, records: dict | None = None,
                 tables: dict | None = None):
        self.rows = torch.empty_like(ring.rows)
        n = min(ring.capacity, RECORD_ROWS)
        device = ring.rows.device
        # the records gathered at the rows' slots, one [n, RECORD_WORDS] block per attributable buffer (``closed``:
        # views of one tensor, the snapshot pass's one output)
        self.closed_all = torch.zeros(len(records or {}), n, RECORD_WORDS, dtype=torch.int64, device=device)
        self.closed = {k: self.closed_all[i] for i, k in enumerate(records or {})}
        self.tables = {k: torch.zeros_like(t) for k, t in (tables or {}).items()}
        # the ring's write index, then every watched tensor flattened: one gather, one host copy
        self.small = torch.zeros(size, dtype=torch.int64, device=ring.rows.device)
        self.host_small = torch.zeros(size, dtype=torch.int64, pin_memory=True) if cuda else None
        self.host_np = self.host_small.numpy() if cuda else None  # read without a tensor call
        self.event = torch.cuda.Event() if cuda else None
        self.pending: tuple[int, dict] | None = None
        self.records = 0  # events recorded (taken): a SlotFence names one of them
        self.known = 0  # the last of them known complete without asking CUDA (SlotFence.complete)
        self.key = ("snapshot", index)  # its captured sequence's key (graphs.run)


class SlotFence:
    """The stream position of a slot's event as ``taken`` recorded it: known complete, with no CUDA call,
    once that observation was finished (its event synchronized or found complete) or the slot was taken
    again (``take_slot`` finishes it first). Work issued on the same stream before that record (a fused
    step's staged-values copy) is complete then too (``Staging.copied``)."""

    __slots__ = ("slot", "records")

    def __init__(self, slot: _Slot):
        self.slot, self.records = slot, slot.records

    def wait(self) -> None:
        """Block until the position is complete (a CUDA call only while it may not be)."""
        slot = self.slot
        if slot.records == self.records and slot.pending is not None and slot.known < self.records:
            event_synchronize(slot.event)

    def complete(self) -> None:
        """The caller knows the position complete (a stream that waited for it was synchronized since): reading
        the slot's observation then asks CUDA nothing."""
        slot = self.slot
        slot.known = max(slot.known, self.records)


class HostObserver:
    """Snapshots ``ring`` and ``watched`` tensors per step; ``collect`` returns finished ones in order."""

    def __init__(self, ring: ViolationRing, watched: dict[str, torch.Tensor], records: dict | None = None,
                 tables: dict | None = None, backend: str = "torch"):
        """``records``: canary buffers (any keys) whose records a late drain reports from as they were at the
        step's close (``RECORD_ROWS``); every buffer needs ``RECORD_WORDS`` words a record. ``tables``: tensors
        (any keys: the groups' full->SWA tables, refilled every step) a late drain reads as the step closed them
        (one copy a step each, read on the host only for a step with violations). ``backend``: the resolved
        backend whose snapshot pass copies the rows and records (``ops.snapshot_ops``)."""
        self.ring = ring
        self.tables = dict(tables or {})
        self.record_bufs = {k: b.view(torch.int64)[:, :RECORD_WORDS] for k, b in (records or {}).items()}
        self.snapshot_rows = snapshot_impl(backend).snapshot_rows
        self.record_list = list(self.record_bufs.values())
        self.record_at = record_table(self.record_list, ring.rows.device) if backend == "triton" else None
        self.cuda = ring.rows.device.type == "cuda"
        self.parts = [ring.write_index] + [t.view(-1) for t in watched.values()]  # views: read at snapshot time
        self.layout, at = {}, 1
        for k, t in watched.items():
            self.layout[k] = (at, t.numel(), t.shape)
            at += t.numel()
        self.slots = [_Slot(ring, at, self.cuda, i, self.record_bufs, self.tables)
                      for i in range(NUM_SLOTS if self.cuda else 1)]
        self.streams = stream_cache(ring.rows.device) if self.cuda else None
        self.next = 0
        self.order: list[_Slot] = []
        self.graphs = EagerGraphs()  # the Canary hands over its launcher's
        self.tail_seen: dict = {}  # steps closed per deferred TAIL key (COMBINE_SIGHTINGS)
        self._host_parts = None  # CPU: numpy views of parts (_read_now)

    def snapshot(self, step: int, host_meta: dict, before=None) -> list[Observation]:
        """Close a step; returns observations that had to be waited for (or all of them on CPU).

        ``before``: a deferred launch sequence ``(key, body)`` (the step's TAIL) to run first; where
        graphs are on, it and the snapshot are captured and replayed as one sequence.
        """
        if self.eager_read:  # (tests replay the snapshot through FakeGraphs)
            if before is not None:
                before[1](eager)
            return [self._read_now(step, host_meta)]
        slot, done = self.take_slot()
        # static buffers only: replayed as one captured sequence where graphs are on (runtime/graphs.py)
        key = slot.key
        seen = 0
        if before is not None:
            seen = self.tail_seen.get(before[0], 0) + 1
            if len(self.tail_seen) > 256:  # (shapes once seen and gone: forget them)
                self.tail_seen.clear()
            self.tail_seen[before[0]] = seen
        if seen > COMBINE_SIGHTINGS:
            key0, body = before

            def both(call):
                body(call)
                self.copy_into(slot, call)
            self.graphs.run(key0 + key, both, seen_as=key0)  # (TAIL ran before: its kernels are compiled)
        else:
            if before is not None:
                self.graphs.run(*before)
            self.graphs.run(key, lambda call: self.copy_into(slot, call))
        return done + self.taken(slot, step, host_meta)

    @property
    def eager_read(self) -> bool:
        """The CPU without captured sequences: a step's close reads the ring in place (no slots)."""
        return not self.cuda and type(self.graphs) is EagerGraphs

    def take_slot(self) -> tuple[_Slot, list[Observation]]:
        """The slot the next snapshot copies into, and the observation it held (finished first: the
        copy overwrites it). ``copy_into`` it, then ``taken``."""
        slot = self.slots[self.next]
        self.next = (self.next + 1) % len(self.slots)
        return slot, (self._finish(slot) if slot.pending is not None else [])

    def taken(self, slot: _Slot, step: int, host_meta: dict) -> list[Observation]:
        """The snapshot copy into ``slot`` was issued on the current stream (``take_slot``)."""
        slot.pending = (step, host_meta)
        self.order.append(slot)
        if not self.cuda:
            return self.collect(block=True)
        slot.records += 1
        record_event(slot.event, self.streams.current())  # after the copy into pinned memory (copy_into)
        return []

    def _read_now(self, step: int, host_meta: dict) -> Observation:
        """On the CPU nothing runs ahead of the host: read the ring and the watched tensors in place
        (no copy of the whole ring), then reset the ring's write index."""
        if self._host_parts is None:
            # numpy views of the canary's own tensors, made once: inside the engine's step a tensor call
            # costs tens of microseconds (cold caches after the forward), numpy reads far less
            self._host_parts = [t.numpy() for t in self.parts]
        small = np.concatenate(self._host_parts).tolist()
        count = small[0]
        stored = min(count, self.ring.capacity)
        rows = self.ring.rows[:stored].tolist() if stored else []
        self._host_parts[0][0] = 0  # the ring's write index
        return Observation(step, dict(host_meta), count, rows, small, self.layout)

    def copy_into(self, slot: _Slot, call) -> None:
        """The step's snapshot copy into ``slot`` (``take_slot``), its launches through ``call`` (eager, or a
        recorder's: the step recorders capture it with their own work)."""
        # the stored rows and their slots' records (one launch with Triton, on the stream the step's TAIL ran on)
        call(self.snapshot_rows, rows=self.ring.rows, write_index=self.ring.write_index, out_rows=slot.rows,
             records=self.record_list, record_at=self.record_at, out_records=slot.closed_all if slot.closed else None)
        for k, table in self.tables.items():
            call(slot.tables[k].copy_, table)
        call(torch.cat, self.parts, out=slot.small)
        call(self.ring.write_index.zero_)
        if self.cuda:
            # on the stream that takes the snapshot (the canary's side stream when it overlaps), into
            # pinned memory: a graph replays it to the same host address, one host call fewer per step
            call(slot.host_small.copy_, slot.small, non_blocking=True)

    def collect(self, block: bool = False) -> list[Observation]:
        """Observations whose copies have landed, oldest first; ``block`` waits for all."""
        out = []
        while self.order:
            slot = self.order[0]
            landed = self.cuda and event_query(slot.event)
            if self.cuda and not block and not landed:
                break
            out.extend(self._finish(slot, landed))
        return out

    def _finish(self, slot: _Slot, landed: bool = False) -> list[Observation]:
        if slot.pending is None:
            return []
        if slot.event is not None:
            if not landed and slot.known < slot.records:
                event_synchronize(slot.event)
            small = slot.host_np.tolist()
        else:
            small = slot.small.tolist()
        count = small[0]
        stored = min(count, self.ring.capacity)
        # Rows cross to the host only when there are some: the rare, slow path.
        rows = slot.rows[:stored].cpu().tolist() if stored else []
        records = {k: r[:stored].cpu().tolist() for k, r in slot.closed.items()} if stored and slot.closed else None
        # (read now: the next copy into this slot is issued once the caller has it)
        tables = {k: t.to("cpu", copy=True) for k, t in slot.tables.items()} if stored and slot.tables else None
        step, meta = slot.pending
        slot.pending = None
        self.order.remove(slot)
        return [Observation(step, meta, count, rows, small, self.layout, records, tables)]


def _unflatten(flat: list[int], shape: torch.Size):
    """The nested lists ``tensor.tolist()`` would give for ``shape``."""
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_unflatten(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
