"""Host offload of prefix-cache pages (HiCache-style) and the copy streams that move them.

When the prefix cache evicts an unlocked node and offload is on, its KV bytes are
copied to a host entry and its canary records saved (``Canary.save_records``); the
node stays in the tree, host-only. A later prefix hit loads it back: fresh device
slots, an H2D copy of the bytes, ``Canary.restore_records`` into the new slots.

Copies are modelled on side streams: a copy issued on a ``CopyStream`` runs when the
stream is synchronized (an event wait) or, at the latest, at the end of the step.
The engine waits where a real engine must record and wait on events; planted bugs
skip a wait, so a copy lands after its reader ran.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from kvcanary.sim.model import WORDS


class CopyStream:
    """Copies issued in order; ``synchronize`` runs the pending ones (a wait on their event).

    A copy may come with ``changes()``: whether running it would change its destination's bytes
    (for bookkeeping of planted bugs only: a late copy that changes nothing corrupts nothing).
    """

    def __init__(self):
        self.pending: list[tuple[Callable[[], None], Callable[[], bool] | None]] = []
        self.issued = 0

    def issue(self, copy: Callable[[], None], changes: Callable[[], bool] | None = None) -> None:
        self.pending.append((copy, changes))
        self.issued += 1

    def pending_changes(self) -> bool:
        return any(changes is None or changes() for _, changes in self.pending)

    def synchronize(self) -> None:
        pending, self.pending = self.pending, []
        for copy, _ in pending:
            copy()


class HostEntry:
    """Host copy of a node's tokens: KV bytes per full layer, canary records, original device slots."""

    def __init__(self, kv: list[torch.Tensor], records: dict, src_slots: list[int], corrupt: bool = False):
        self.kv = kv  # per layer and K/V: int64 [n, WORDS] (filled when the D2H copy runs)
        self.records = records  # Canary.save_records output: buffer key -> [n, stride]
        self.src_slots = src_slots  # device slots the copy came from
        self.corrupt = corrupt  # the D2H copy captured bytes other than the offloaded KV (planted bug)

    @property
    def n(self) -> int:
        return len(self.src_slots)

    def split(self, m: int) -> tuple[HostEntry, HostEntry]:
        """Views of tokens [0, m) and [m, n) (a copy still in flight lands in both)."""
        head = HostEntry([t[:m] for t in self.kv], {k: v[:m] for k, v in self.records.items()}, self.src_slots[:m],
                         self.corrupt)
        tail = HostEntry([t[m:] for t in self.kv], {k: v[m:] for k, v in self.records.items()}, self.src_slots[m:],
                         self.corrupt)
        return head, tail


class HostCache:
    """The host tier: capacity accounting, offload of evicted nodes, load-back on a hit.

    Args:
        capacity: host tokens.
        pool: the engine's ``KvPool``; model: its ``MockModel``; canary: its ``Canary``.
        tree: the ``RadixCache`` (host-only leaves are dropped when the host is full).
        bugs: the run's ``BugSwitch``.
    """

    def __init__(self, capacity: int, pool, model, canary, tree, bugs):
        self.capacity = capacity
        self.pool, self.model, self.canary, self.tree, self.bugs = pool, model, canary, tree, bugs
        self.used = 0
        self.d2h = CopyStream()
        self.h2d = CopyStream()
        self.offloads = 0
        self.loadbacks = 0

    def release(self, entry: HostEntry) -> None:
        self.used -= entry.n

    def offload(self, node) -> bool:
        """Tree-eviction callback: keep ``node`` on host and free its device slots; False if no room."""
        slots = list(node.value)
        if node.host is None:
            n = len(slots)
            if self.used + n > self.capacity:
                self.tree.evict_host(self.used + n - self.capacity, keep=node)
            if self.used + n > self.capacity:
                return False
            entry = HostEntry([torch.zeros(n, WORDS, dtype=torch.int64) for _ in range(self.model.num_kv_tensors)],
                              self.canary.save_records(torch.tensor(slots, dtype=torch.int64)), slots)
            self.used += n
            node.host = entry
            self.d2h.issue(lambda: _copy_into(entry.kv, self.model.read(slots)))
            self.offloads += 1
            if self.bugs.on("offload_free_before_copy"):
                # Planted: the device pages are freed before the D2H copy reading them has run.
                offloaded = self.model.read(slots)
                self.d2h.issue(lambda: setattr(entry, "corrupt", not _same(entry.kv, offloaded)))
            else:
                self.d2h.synchronize()
        self.pool.free(slots)
        return True

    def load_back(self, nodes: list) -> list[int] | None:
        """Bring host-only ``nodes`` (a path, top-down) back to fresh device slots; None if no memory.

        Nodes the host tier dropped meanwhile (making room for an offload) end the path.
        """
        nodes = list(itertools.takewhile(lambda n: n.host is not None, nodes))
        total = sum(len(n.key) for n in nodes)
        if not total:
            return None
        slots = self.pool.alloc_run(total)
        if slots is None:
            return None
        off = 0
        for node in nodes:
            entry, n = node.host, len(node.key)
            dst = slots[off:off + n]
            self.canary.restore_records(entry.records, torch.tensor(dst, dtype=torch.int64))
            node.value = dst
            target, count = dst, n
            if self.bugs.on("loadback_wrong_slots"):
                # Planted: the copy goes to the node's old device slots, not the ones just allocated.
                target = entry.src_slots
                if not _same(self.model.read(dst), entry.kv):
                    self.bugs.took_effect("loadback_wrong_slots")
            if n > 1 and self.bugs.on("loadback_partial"):
                # Planted: a short transfer is taken as complete; only the first half arrives.
                count = n // 2
                if not _same(self.model.read(dst[count:]), [x[count:] for x in entry.kv]):
                    self.bugs.took_effect("loadback_partial")
            if entry.corrupt:
                self.bugs.took_effect("offload_free_before_copy")
            self.h2d.issue(lambda e=entry, t=target, c=count: self.model.write(t[:c], [x[:c] for x in e.kv]),
                           lambda e=entry, t=target, c=count: not _same(self.model.read(t[:c]),
                                                                        [x[:c] for x in e.kv]))
            off += n
        self.loadbacks += 1
        return slots


def _copy_into(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src):
        d.copy_(s)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))
