"""Radix prefix cache over token ids (SGLang's RadixCache, page granular).

Each node holds a run of tokens (a whole number of pages) and the device slots of
their KV, or only a host copy once offloaded (``value`` None, ``host`` set). A
request matches its longest cached prefix, holds a lock reference on the deepest
node it uses (locks count along the path to the root), and inserts its sequence
when it finishes or after a prefill. Unlocked nodes are evicted least recently
used first, leaves first, when the pool runs short.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field


class Node:
    __slots__ = ("key", "value", "host", "children", "parent", "lock_ref", "last_access", "start")

    def __init__(self, key: tuple[int, ...] = (), value: list[int] | None = None, parent: Node | None = None,
                 start: int = 0):
        self.key = key
        self.value = value  # device slots, one per token; None when only the host copy exists
        self.host = None  # host copy (kvcanary.sim.offload.HostEntry) or None
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.start = start  # sequence position of key[0]

    @property
    def on_device(self) -> bool:
        return self.value is not None

    def has_device_child(self) -> bool:
        return any(c.value is not None for c in self.children.values())

    def __repr__(self) -> str:
        where = "dev" if self.on_device else "host"
        return f"Node(start={self.start}, len={len(self.key)}, {where}, lock={self.lock_ref})"


@dataclass
class Match:
    """Result of ``RadixCache.match_prefix``.

    device_len tokens are on device (``slots``, ending at ``last_node``); ``host_nodes``
    continue the match with host-only nodes that a load-back would bring back.
    """

    slots: list[int]
    last_node: Node
    host_nodes: list[Node] = field(default_factory=list)

    @property
    def device_len(self) -> int:
        return len(self.slots)

    @property
    def host_len(self) -> int:
        return sum(len(n.key) for n in self.host_nodes)


class RadixCache:
    """Prefix cache.

    Args:
        page_size: keys are matched and stored in whole pages.
        free_slots: called with the device slots of an evicted node.
        free_host: called with the host entry of a node dropped from the cache.
        bugs: the run's ``BugSwitch`` (planted bugs consult it).
    """

    def __init__(self, page_size: int, free_slots: Callable[[list[int]], None],
                 free_host: Callable[[object], None] | None = None, bugs=None):
        self.page_size = page_size
        self.free_slots = free_slots
        self.free_host = free_host or (lambda entry: None)
        self.bugs = bugs
        self.root = Node(value=[])
        self.root.lock_ref = 1
        self.clock = 0
        self.evicted_pages = 0

    # -- lookups -------------------------------------------------------------------------------
    def _match_len(self, node_key: tuple[int, ...], key: tuple[int, ...], for_match: bool = False) -> int:
        """Leading tokens of ``node_key`` and ``key`` that agree, in whole pages."""
        ps = self.page_size
        n = min(len(node_key), len(key))
        i = 0
        while i + ps <= n and node_key[i:i + ps] == key[i:i + ps]:
            i += ps
        # Planted: the page where the keys first differ is counted as matching.
        if for_match and i + ps <= n and self.bugs is not None and self.bugs.hit("match_too_long"):
            i += ps
        return i

    def match_prefix(self, key) -> Match:
        """Longest cached prefix of ``key`` (truncated to whole pages); splits a node matched part-way."""
        ps = self.page_size
        key = tuple(key[:len(key) // ps * ps])
        self.clock += 1
        node, i = self.root, 0
        slots: list[int] = []
        last = self.root
        host_nodes: list[Node] = []
        while i < len(key):
            child = node.children.get(key[i:i + ps])
            if child is None:
                break
            m = self._match_len(child.key, key[i:], for_match=True)
            if m == 0:
                break
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = self.clock
            if child.on_device and not host_nodes:
                slots.extend(child.value)
                last = child
            elif child.on_device:
                break
            else:
                host_nodes.append(child)
            node, i = child, i + m
        return Match(slots, last, host_nodes)

    def insert(self, key, value) -> int:
        """Insert ``key`` -> ``value`` (whole pages); returns how many leading tokens were already on device.

        The caller frees its own slots for that already-present range (they are duplicates).
        Host-only nodes on the path adopt the new device slots.
        """
        ps = self.page_size
        n = min(len(key), len(value)) // ps * ps
        key, value = tuple(key[:n]), list(value[:n])
        self.clock += 1
        node, i, present, counting = self.root, 0, 0, True
        while i < n:
            child = node.children.get(key[i:i + ps])
            if child is None:
                new = Node(key[i:], value[i:], node, start=i)
                new.last_access = self.clock
                node.children[new.key[:ps]] = new
                return present
            m = self._match_len(child.key, key[i:])
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = self.clock
            if child.on_device and counting:
                present += m
            else:
                counting = False
                if not child.on_device:
                    child.value = value[i:i + m]
            node, i = child, i + m
        return present

    def _split(self, child: Node, m: int) -> Node:
        """Cut ``child`` after m tokens; returns the new upper node."""
        ps = self.page_size
        parent = child.parent
        mid = Node(child.key[:m], None if child.value is None else child.value[:m], parent, child.start)
        if child.host is not None:
            mid.host, child.host = child.host.split(m)
        mid.lock_ref, mid.last_access = child.lock_ref, child.last_access
        child.key = child.key[m:]
        child.value = None if child.value is None else child.value[m:]
        child.start += m
        child.parent = mid
        mid.children[child.key[:ps]] = child
        parent.children[mid.key[:ps]] = mid
        return mid

    # -- locks ---------------------------------------------------------------------------------
    def lock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            node.lock_ref -= 1
            node = node.parent

    # -- eviction ------------------------------------------------------------------------------
    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def evictable_pages(self) -> int:
        return sum(len(n.key) for n in self.nodes() if n.on_device and n.lock_ref <= 0) // self.page_size

    def device_pages(self) -> int:
        return sum(len(n.key) for n in self.nodes() if n.on_device) // self.page_size

    def evict(self, num_pages: int, offload: Callable[[Node], bool] | None = None) -> int:
        """Free at least ``num_pages`` pages of unlocked device nodes, least recently used leaves first.

        With ``offload``, a node it accepts keeps its place as a host-only node (``offload``
        copied it and freed its device slots); otherwise the node and its host-only subtree go.
        Returns the pages freed.
        """
        heap = [(n.last_access, id(n), n) for n in self.nodes()
                if n.on_device and n.lock_ref <= 0 and not n.has_device_child()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            pages = len(node.key) // self.page_size
            if offload is not None and offload(node):
                node.value = None
            else:
                self.free_slots(node.value)
                self._drop(node)
            freed += pages
            self.evicted_pages += pages
            parent = node.parent
            if (parent is not None and parent is not self.root and parent.on_device and parent.lock_ref <= 0
                    and not parent.has_device_child()):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def evict_host(self, num_tokens: int, keep: Node | None = None) -> int:
        """Drop host-only leaves (least recently used first) until ``num_tokens`` host tokens are freed."""
        heap = [(n.last_access, id(n), n) for n in self.nodes()
                if not n.on_device and not n.children and n is not keep]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            freed += len(node.key)
            parent = node.parent
            self._drop(node)
            if parent is not self.root and not parent.on_device and not parent.children and parent is not keep:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _drop(self, node: Node) -> None:
        """Remove ``node`` and its (host-only) subtree from the tree, releasing host copies."""
        node.parent.children.pop(node.key[:self.page_size], None)
        stack = [node]
        while stack:
            n = stack.pop()
            if n.host is not None:
                self.free_host(n.host)
                n.host = None
            stack.extend(n.children.values())

    # -- sweep ---------------------------------------------------------------------------------
    def device_triples(self) -> tuple[list[int], list[int], list[int]]:
        """(slot, position, prev_slot) of every device-resident cached token (prev -1 at position 0)."""
        slots, positions, prevs = [], [], []
        stack = [(c, -1) for c in self.root.children.values()]
        while stack:
            node, prev = stack.pop()
            if not node.on_device:
                continue
            for j, slot in enumerate(node.value):
                slots.append(slot)
                positions.append(node.start + j)
                prevs.append(prev)
                prev = slot
            stack.extend((c, prev) for c in node.children.values())
        return slots, positions, prevs
