"""Allocator invariants, checked on the device at a step's close (docs/allocator.md).

Read-time checks catch an early free only once the freed block is reused and read. This check looks
at the allocator itself: an engine hands the canary a provider of ``AllocatorSnapshot`` (its free
blocks, its live block tables, optionally its reference counts) with ``Canary.watch_allocator``, and
every ``allocator_check_interval`` steps the step's close runs ``ops.check_allocator`` over it and
the forward's write slots (``ForwardBatch.out_cache_loc``). Findings are rows of the canary's own
violation ring, so they are drained, counted, logged and raised like every other violation, one step
late on CUDA with no host sync on the step. The engine tells the checker when it frees blocks
(``AllocatorCheck.note_free``, a host call) so that a report names the step of the free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvcanary.ops.allocator_ops import ALLOCATOR_KIND, NO_HOLDER, AllocatorField as A, AllocatorRule, check_allocator
from kvcanary.ops.validate import is_int
from kvcanary.runtime.report import Violation

__all__ = ["CACHE_HOLDER", "AllocatorCheck", "AllocatorSnapshot", "AllocatorViolation", "BlockTable"]

# The holder id of an engine's prefix cache (its pages are a table of their own; reports name it so).
CACHE_HOLDER = -1
RULES = {int(r): r.name.lower() for r in AllocatorRule}


class BlockTable(NamedTuple):
    """Live block tables: ``blocks`` int32/int64 [R, W] (one row per holder), ``lens`` int32/int64 [R] valid
    entries of each row, ``holders`` int64 [R] the holder of each row (request ids; ``CACHE_HOLDER``)."""

    blocks: torch.Tensor
    lens: torch.Tensor
    holders: torch.Tensor


@dataclass(frozen=True)
class AllocatorSnapshot:
    """What a provider returns: ``free`` int32/int64 [F] the block ids on the free list (duplicates kept:
    they are double frees), ``tables`` the live block tables, ``refcounts`` optional int32/int64
    [num_blocks] the engine's count of table entries per block. Tensors on the CPU or the canary's device."""

    free: torch.Tensor
    tables: tuple[BlockTable, ...]
    refcounts: torch.Tensor | None = None


AllocatorProvider = Callable[[], "AllocatorSnapshot | None"]


@dataclass(frozen=True)
class AllocatorViolation(Violation):
    """A broken allocator invariant (``launch_tag`` "ALLOCATOR", ``reasons`` the rule's name).

    ``block_id`` is the block, ``slot`` the slot written (-1 for the block rules), ``holders`` the
    requests named (at most two: the least and greatest id among the table entries on the block, or
    a slot's first two writers; ``CACHE_HOLDER`` is the prefix cache), ``count`` what was found (table
    entries, free-list copies, tokens writing) against ``expected``, and ``free_step`` the step whose
    forward followed the block's last free before the check (a free between the forwards of steps N and
    N + 1 is N + 1; None: the engine did not say, or never freed it)."""

    rule: str = ""
    block_id: int = -1
    holders: tuple[int, ...] = ()
    count: int = 0
    expected: int = 0
    free_step: int | None = None

    def log_line(self) -> str:
        freed = "" if self.free_step is None else f" freed_at_step={self.free_step}"
        return (f"kv_canary violation: launch_tag=ALLOCATOR fail_reason={self.rule} block={self.block_id} "
                f"slot_idx={self.slot} holders={','.join(map(str, self.holders)) or '-'} count={self.count} "
                f"expected={self.expected}{freed}")

    def to_dict(self) -> dict:
        return {**super().to_dict(), "holders": list(self.holders)}

    def block(self, name_of=None) -> str:  # (``name_of``: Violation.block's; a holder is named by its int)
        who, b = _names(self.holders), self.block_id
        freed = "" if self.free_step is None else f" (freed before the forward of step {self.free_step})"
        lines = [f"KV canary allocator violation at step {self.step}: {self.rule}"]
        if self.rule == "live_block_free":
            lines += [f"  block {b} is on the free list{freed} while {who}'s table maps it ({self.count} "
                      f"{_entries(self.count)})",
                      "  -> an early free: the block went back while a live holder still maps it; its next "
                      "allocation gives it a second owner"]
        elif self.rule == "free_list_duplicate":
            lines += [f"  block {b} is on the free list {self.count} times{freed.replace('(freed', '(last freed')}",
                      "  -> a double free: two later allocations get the same block"]
        elif self.rule == "refcount_mismatch":
            lines += [f"  block {b}: the engine counts {self.expected} {_entries(self.expected)}, its tables hold "
                      f"{self.count}" + (f" ({who})" if self.holders else ""),
                      "  -> a reference taken or dropped without its table entry: fewer counted than held is an "
                      "early free waiting to happen, more is a leak"]
        elif self.rule == "free_block_write":
            lines += [f"  the forward writes slot {self.slot} of block {b}, which is on the free list{freed}; "
                      f"written by {who}",
                      "  -> a write index into a released block: its next owner's KV and this write overwrite "
                      "each other"]
        else:
            lines += [f"  slot {self.slot} (block {b}) is written by {self.count} tokens of one forward: {who}",
                      "  -> two writers of one slot: a double allocation or a stale write index; one write is "
                      "lost"]
        return "\n".join(lines)


def _entries(n: int) -> str:
    return "table entry" if n == 1 else "table entries"


def _names(holders: tuple[int, ...]) -> str:
    names = ["the prefix cache" if h == CACHE_HOLDER else f"request {h}" for h in holders]
    return " and ".join(names) if names else "nobody"


class AllocatorCheck:
    """The canary's allocator check (``Canary.allocator``); idle until ``Canary.watch_allocator``."""

    def __init__(self, canary):
        self.canary = canary
        self.provider: AllocatorProvider | None = None
        self.num_blocks = self.slots_per_block = 0
        self.checks = 0  # checks run
        self.found = 0  # allocator rows drained (rows past the ring's capacity are counted as violations only)
        # per block, the last two steps it was freed at (0: none), newest first: a report drained a few
        # steps after its check names the free before the check
        self._freed = np.zeros((0, 2), dtype=np.int64)

    def watch(self, provider: AllocatorProvider, num_blocks: int, slots_per_block: int) -> AllocatorCheck:
        if not callable(provider):
            raise TypeError(f"kv-canary: watch_allocator provider must be a callable returning an AllocatorSnapshot "
                            f"or None, got {provider!r}")
        for name, value in (("num_blocks", num_blocks), ("slots_per_block", slots_per_block)):
            if not is_int(value) or value < 1:
                raise ValueError(f"kv-canary: watch_allocator {name} must be an int >= 1, got {value!r}")
        self.provider, self.num_blocks, self.slots_per_block = provider, num_blocks, slots_per_block
        self._freed = np.zeros((num_blocks, 2), dtype=np.int64)
        return self

    def note_free(self, blocks) -> None:
        """The engine put ``blocks`` (ids, a list or a 1-D CPU tensor) back on its free list now: reports name
        this step (the forward the free precedes, or the open one). Ids outside the pool are ignored."""
        if self.provider is None:
            return
        ids = np.asarray(blocks, dtype=np.int64).reshape(-1)
        ids = ids[(ids >= 0) & (ids < self.num_blocks)]
        if ids.size:
            self._freed[ids, 1] = self._freed[ids, 0]
            self._freed[ids, 0] = self.canary.step + 1

    def due(self, step: int) -> bool:
        every = self.canary.config.allocator_check_interval
        return self.provider is not None and bool(every) and step % every == 0

    def run(self, batch) -> None:
        """Check the provider's snapshot and ``batch``'s writes into the ring (on the current stream)."""
        snap = self.provider()
        if snap is None:
            return
        if not isinstance(snap, AllocatorSnapshot):
            raise TypeError(f"kv-canary: allocator provider must return an AllocatorSnapshot or None, got "
                            f"{type(snap).__name__}")
        c = self.canary
        c.launcher.streams.note("allocator_check", reads=("ring",), writes=("ring",))
        slots, holders = self._writes(batch)
        tables = [tuple(self._on(t) for t in table) for table in snap.tables]
        check_allocator(c.ring, self._on(snap.free), tables, slots, holders, num_blocks=self.num_blocks,
                        slots_per_block=self.slots_per_block,
                        refcounts=None if snap.refcounts is None else self._on(snap.refcounts),
                        backend="reference" if c.config.backend == "reference" else "torch")
        self.checks += 1

    def _writes(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's write slot (-1 for padding requests' tokens: row 0 writes nothing real) and request."""
        loc = batch.out_cache_loc.to(torch.int64)
        bs, n = batch.req_pool_indices.shape[0], loc.shape[0]
        owner = torch.repeat_interleave(torch.arange(bs, device=loc.device), batch.extend_lens.to(torch.int64),
                                        output_size=n)
        ids = batch.request_ids if batch.request_ids is not None else batch.req_pool_indices
        slots = torch.where(batch.req_pool_indices[owner] != 0, loc, -1)
        return slots, ids.to(torch.int64)[owner]

    def _on(self, t: torch.Tensor) -> torch.Tensor:
        device = self.canary.device
        if not isinstance(t, torch.Tensor) or t.device == device:
            return t  # (the op names a non-tensor)
        if device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)  # (pageable memory would sync the stream)
        return t.to(device)

    def decode(self, row: list[int], step: int) -> AllocatorViolation:
        """The ``AllocatorViolation`` of an allocator row of the ring, found at ``step``."""
        self.found += 1
        block, rule = int(row[A.BLOCK]), RULES.get(int(row[A.RULE]), f"unknown_{row[A.RULE]}")
        holders = tuple(dict.fromkeys(h for h in (row[A.HOLDER_A], row[A.HOLDER_B]) if h != NO_HOLDER))
        free_step = None
        if rule != "refcount_mismatch" and rule != "shared_write_slot" and 0 <= block < self.num_blocks:
            free_step = next((int(s) for s in self._freed[block] if 0 < s <= step), None)
        count, expected = int(row[A.COUNT]), int(row[A.EXPECTED])
        # (the Violation fields a verify row fills: the counts stand in the token columns, as in the ring)
        return AllocatorViolation(step=step, launch_tag="ALLOCATOR", fail_reason=0, reasons=(rule,),
                                  slot=int(row[A.SLOT]), position=-1, stored_token=count, expected_token=expected,
                                  stored_chain_hash=0, expected_aux=0, rule=rule, block_id=block, holders=holders,
                                  count=count, expected=expected, free_step=free_step)

    def stats(self) -> dict:
        return {"allocator_checks": self.checks, "allocator_violations": self.found}


def is_allocator_row(row: list[int]) -> bool:
    return row[A.KIND] == ALLOCATOR_KIND
