"""Host observations read one step late, so the hot path never waits for the device.

At the end of a step the violation ring and a few small device tensors are
snapshotted on the compute stream (device-to-device, then the ring's write index
is reset), and a side stream copies the small ones into pinned host memory. The
next step reads them once their event has completed. Only when a snapshot shows
violations are its rows copied to the host (a sync, on the rare path). On CPU
everything is read at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcanary.ops.types import ViolationRing

NUM_SLOTS = 3  # snapshots in flight before the oldest must be waited for


@dataclass
class Observation:
    step: int  # host step the snapshot closed
    host_meta: dict  # host-side facts recorded with it (forwards seen, sweeps asked for)
    count: int  # violations found in the step (may exceed rows stored)
    rows: list[list[int]]  # stored violation rows
    values: dict[str, list[int]]  # the small tensors, by name


class _Slot:
    def __init__(self, ring: ViolationRing, watched: dict[str, torch.Tensor], cuda: bool):
        self.rows = torch.empty_like(ring.rows)
        self.index = torch.zeros_like(ring.write_index)
        self.values = {k: torch.empty_like(t) for k, t in watched.items()}
        pin = dict(pin_memory=True) if cuda else {}
        self.host_index = torch.zeros(1, dtype=torch.int32, **pin)
        self.host_values = {k: torch.zeros(t.shape, dtype=t.dtype, **pin) for k, t in watched.items()}
        self.event = torch.cuda.Event() if cuda else None
        self.pending: tuple[int, dict] | None = None


class HostObserver:
    """Snapshots ``ring`` and ``watched`` tensors per step; ``collect`` returns finished ones in order."""

    def __init__(self, ring: ViolationRing, watched: dict[str, torch.Tensor]):
        self.ring = ring
        self.watched = watched
        self.cuda = ring.rows.device.type == "cuda"
        self.slots = [_Slot(ring, watched, self.cuda) for _ in range(NUM_SLOTS if self.cuda else 1)]
        self.side = torch.cuda.Stream(device=ring.rows.device) if self.cuda else None
        self.next = 0
        self.order: list[_Slot] = []

    def snapshot(self, step: int, host_meta: dict) -> list[Observation]:
        """Close a step; returns observations that had to be waited for (or all of them on CPU)."""
        slot = self.slots[self.next]
        self.next = (self.next + 1) % len(self.slots)
        done = self._finish(slot) if slot.pending is not None else []
        slot.rows.copy_(self.ring.rows)
        slot.index.copy_(self.ring.write_index)
        for k, t in self.watched.items():
            slot.values[k].copy_(t)
        self.ring.write_index.zero_()
        slot.pending = (step, dict(host_meta))
        self.order.append(slot)
        if not self.cuda:
            return done + self.collect(block=True)
        main = torch.cuda.current_stream(self.ring.rows.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            slot.host_index.copy_(slot.index, non_blocking=True)
            for k in self.watched:
                slot.host_values[k].copy_(slot.values[k], non_blocking=True)
            slot.event.record(self.side)
        return done

    def collect(self, block: bool = False) -> list[Observation]:
        """Observations whose copies have landed, oldest first; ``block`` waits for all."""
        out = []
        while self.order:
            slot = self.order[0]
            if self.cuda and not block and not slot.event.query():
                break
            out.extend(self._finish(slot))
        return out

    def _finish(self, slot: _Slot) -> list[Observation]:
        if slot.pending is None:
            return []
        if slot.event is not None:
            slot.event.synchronize()
            index, values = slot.host_index, slot.host_values
        else:
            index, values = slot.index, slot.values
        count = int(index[0])
        stored = min(count, self.ring.capacity)
        # Rows cross to the host only when there are some: the rare, slow path.
        rows = slot.rows[:stored].cpu().tolist() if stored else []
        step, meta = slot.pending
        slot.pending = None
        self.order.remove(slot)
        return [Observation(step=step, host_meta=meta, count=count, rows=rows,
                            values={k: v.tolist() for k, v in values.items()})]
