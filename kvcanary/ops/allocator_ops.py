"""Allocator invariants of a paged KV pool, checked on the device (``ops.check_allocator``).

Read-time checks see an early free only once the freed block is reused and read; these rules see
the bookkeeping itself, from a snapshot of the engine's allocator and the forward's write slots:

| rule | fires for a block (or slot) where |
|---|---|
| ``live_block_free`` | a live table entry points at a block on the free list |
| ``free_list_duplicate`` | the free list holds the block more than once (a double free) |
| ``refcount_mismatch`` | the engine's reference count differs from the table entries pointing at it |
| ``free_block_write`` | the forward writes a slot of a block on the free list |
| ``shared_write_slot`` | two tokens of the forward write one slot |

Each finding is one row of the canary's violation ring (the same ring, count and overflow rule as
the verify rows, SPEC 3.3), told apart by ``KIND = ALLOCATOR_KIND`` (no launch tag takes it). Columns
(``AllocatorField``): block, slot (-1 for the block rules), the two holders named (the least and the
greatest holder id among the table entries pointing at the block, or the first two writers of a
slot; ``NO_HOLDER`` for none), the count found (table entries, free-list copies, writers), the
count expected, and the rule. Rows come rule by rule in ``AllocatorRule`` order, blocks ascending
within a rule, the shared slots ascending last.

The bodies share one positional signature ``(ring_rows, write_index, free, tables, refcounts, write_slots,
write_holders, num_blocks, slots_per_block)`` and trust their arguments (``check_allocator`` validates):
``reference`` (scalar loops, the oracle) and ``torch_check`` (tensor ops, any device, no host sync: the
rows land in the ring through a prefix sum, so a CUDA check is a few dozen small launches).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from kvcanary.format import VIOLATION_COUNT_LIMIT
from kvcanary.ops import validate as v
from kvcanary.ops.types import ViolationRing

__all__ = ["ALLOCATOR_KIND", "NO_HOLDER", "AllocatorField", "AllocatorRule", "check_allocator", "reference",
           "torch_check"]

# KIND of an allocator row: above every launch tag (0-11), so a reader of the ring tells the two apart.
ALLOCATOR_KIND = 64
# A holder column with nobody to name. Holder ids are >= -1 (-1: an engine's prefix cache, by convention).
NO_HOLDER = -2
_BIG = 1 << 62  # an amin's empty value (holders and slots are far below it)


class AllocatorRule(enum.IntEnum):
    LIVE_BLOCK_FREE = 1
    FREE_LIST_DUPLICATE = 2
    REFCOUNT_MISMATCH = 3
    FREE_BLOCK_WRITE = 4
    SHARED_WRITE_SLOT = 5


class AllocatorField(enum.IntEnum):
    """int64 columns of an allocator row of the violation ring."""

    KIND = 0
    BLOCK = 1
    SLOT = 2
    HOLDER_A = 3
    HOLDER_B = 4
    COUNT = 5
    EXPECTED = 6
    RULE = 7


Table = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (blocks [R, W], lens [R], holders [R])


def check_allocator(ring: ViolationRing, free: torch.Tensor, tables: Sequence[Table], write_slots: torch.Tensor,
                    write_holders: torch.Tensor, *, num_blocks: int, slots_per_block: int,
                    refcounts: torch.Tensor | None = None, backend: str = "auto") -> None:
    """Append a row to ``ring`` for each broken allocator invariant (the module's table of rules).

    Args:
        ring: the violation ring the rows go to (``ViolationRing``).
        free: int32/int64 [F] block ids on the free list, duplicates kept; ids outside ``[0, num_blocks)``
            are ignored (padding of a static buffer).
        tables: ``(blocks, lens, holders)`` triples: int32/int64 [R, W] block ids of each live holder's
            table, int32/int64 [R] its valid entries, int64 [R] holder ids (request ids, -1: a prefix cache).
            Entries past ``lens`` or outside the pool are ignored.
        write_slots: int64 [T] the slots the forward writes (``out_cache_loc``); slots < 1 are skipped.
        write_holders: int64 [T] the request writing each slot.
        num_blocks: blocks of the pool (ids ``[0, num_blocks)``); slots_per_block: slot ``s`` is in block
            ``s // slots_per_block``.
        refcounts: optional int32/int64 [num_blocks], the engine's count of table entries per block
            (``refcount_mismatch`` runs only with it).
        backend: "reference", or any other name for the torch body ("auto", "torch", "numba", "triton").

    Example:
        >>> ring = ViolationRing.allocate(8)
        >>> table = (torch.tensor([[1, 2]]), torch.tensor([2]), torch.tensor([7]))
        >>> check_allocator(ring, torch.tensor([2, 3]), [table], torch.tensor([5]), torch.tensor([7]),
        ...                 num_blocks=4, slots_per_block=2)
        >>> ring.rows[0].tolist()  # block 2 is free while request 7's table maps it
        [64, 2, -1, 7, 7, 1, 0, 1]
    """
    op = "check_allocator"
    if type(ring).__name__ != "ViolationRing":
        raise v.fail_type(op, "ring", "a ViolationRing", type(ring).__name__)
    device = ring.rows.device
    v.check_ring(op, ring, torch.zeros(0, 2, dtype=torch.int64, device=device), device)
    for name, value in (("num_blocks", num_blocks), ("slots_per_block", slots_per_block)):
        if not v.is_int(value) or value < 1:
            raise v.fail_value(op, name, "an int >= 1", repr(value))
    v.check_vector(op, "free", free, v.INDEX_DTYPES)
    v.check_vector(op, "write_slots", write_slots, (torch.int64,))
    v.check_vector(op, "write_holders", write_holders, (torch.int64,), length=write_slots.shape[0])
    if refcounts is not None:
        v.check_vector(op, "refcounts", refcounts, v.INDEX_DTYPES, length=num_blocks)
    v.check_device(op, device, free=free, write_slots=write_slots, write_holders=write_holders, refcounts=refcounts)
    for i, t in enumerate(tables):
        if not isinstance(t, tuple) or len(t) != 3:
            raise v.fail_type(op, f"tables[{i}]", "a (blocks, lens, holders) tuple", type(t).__name__)
        blocks, lens, holders = t
        v.check_ndim(op, f"tables[{i}] blocks", blocks, 2)
        v.check_dtype(op, f"tables[{i}] blocks", blocks, v.INDEX_DTYPES)
        v.check_vector(op, f"tables[{i}] lens", lens, v.INDEX_DTYPES, length=blocks.shape[0])
        v.check_vector(op, f"tables[{i}] holders", holders, (torch.int64,), length=blocks.shape[0])
        v.check_device(op, device, blocks=blocks, lens=lens, holders=holders)
    body = reference if backend == "reference" else torch_check
    body(ring.rows, ring.write_index, free, list(tables), refcounts, write_slots, write_holders, num_blocks,
         slots_per_block)


def reference(ring_rows, write_index, free, tables, refcounts, write_slots, write_holders, num_blocks,
              slots_per_block) -> None:
    nb, spb = num_blocks, slots_per_block
    free_n = [0] * nb
    for b in free.tolist():
        if 0 <= b < nb:
            free_n[b] += 1
    refs, holders_of = [0] * nb, [[] for _ in range(nb)]
    for blocks, lens, holders in tables:
        for row, n, h in zip(blocks.tolist(), lens.tolist(), holders.tolist()):
            for b in row[:max(0, n)]:
                if 0 <= b < nb:
                    refs[b] += 1
                    holders_of[b].append(h)
    writes: dict[int, list[int]] = {}  # slot -> writers, in token order
    for s, h in zip(write_slots.tolist(), write_holders.tolist()):
        if s >= 1 and s // spb < nb:
            writes.setdefault(s, []).append(h)
    written = [[] for _ in range(nb)]  # block -> (slot, writer) in token order
    for s, h in zip(write_slots.tolist(), write_holders.tolist()):
        if s >= 1 and s // spb < nb:
            written[s // spb].append((s, h))
    counts = refcounts.tolist() if refcounts is not None else None

    def span(hs):
        return (min(hs), max(hs)) if hs else (NO_HOLDER, NO_HOLDER)

    R = AllocatorRule
    found = []
    for b in range(nb):
        if free_n[b] and refs[b]:
            found.append([b, -1, *span(holders_of[b]), refs[b], 0, R.LIVE_BLOCK_FREE])
    for b in range(nb):
        if free_n[b] > 1:
            found.append([b, -1, *span(holders_of[b]), free_n[b], 1, R.FREE_LIST_DUPLICATE])
    if counts is not None:
        for b in range(nb):
            if counts[b] != refs[b]:
                found.append([b, -1, *span(holders_of[b]), refs[b], counts[b], R.REFCOUNT_MISMATCH])
    for b in range(nb):
        if free_n[b] and written[b]:
            found.append([b, min(s for s, _ in written[b]), *span([h for _, h in written[b]]), len(written[b]), 0,
                          R.FREE_BLOCK_WRITE])
    for s in sorted(writes):
        if len(writes[s]) > 1:
            found.append([s // spb, s, writes[s][0], writes[s][1], len(writes[s]), 1, R.SHARED_WRITE_SLOT])
    cap, w0 = ring_rows.shape[0], int(write_index[0])
    for k, f in enumerate(found):
        if w0 + k < cap:
            ring_rows[w0 + k] = torch.tensor([ALLOCATOR_KIND, *f], dtype=torch.int64)
    write_index[0] = min(w0 + len(found), VIOLATION_COUNT_LIMIT)


def torch_check(ring_rows, write_index, free, tables, refcounts, write_slots, write_holders, num_blocks,
                slots_per_block) -> None:
    dev, nb, spb, i64 = ring_rows.device, num_blocks, slots_per_block, torch.int64
    # per-block tallies; bin nb collects every ignored entry, so no index needs a mask (and no sync)
    f = free.to(i64)
    f = torch.where((f >= 0) & (f < nb), f, nb)
    free_n = torch.zeros(nb + 1, dtype=i64, device=dev).index_add_(0, f, torch.ones_like(f))[:nb]
    refs = torch.zeros(nb + 1, dtype=i64, device=dev)
    entries = []  # (block index, holder) of every table entry, for the holders named below
    for blocks, lens, holders in tables:
        b = blocks.to(i64)
        cols = torch.arange(b.shape[1], device=dev)
        ok = (cols.unsqueeze(0) < lens.to(i64).unsqueeze(1)) & (b >= 0) & (b < nb)
        idx = torch.where(ok, b, nb).view(-1)
        refs.index_add_(0, idx, torch.ones_like(idx))
        entries.append((idx, holders.unsqueeze(1).expand(b.shape).reshape(-1)))
    refs = refs[:nb]
    s = write_slots
    ws = torch.div(s, spb, rounding_mode="floor")
    wok = (s >= 1) & (ws < nb)
    widx = torch.where(wok, ws, nb)
    wcount = torch.zeros(nb + 1, dtype=i64, device=dev).index_add_(0, widx, torch.ones_like(widx))[:nb]
    # shared slots: a stable sort puts each slot's writers side by side, in token order
    key, order = torch.sort(torch.where(wok, s, _BIG), stable=True)
    first = torch.searchsorted(key, key)
    run = torch.searchsorted(key, key, right=True) - first
    T = key.shape[0]
    shared = (first == torch.arange(T, device=dev)) & (run > 1) & (key < _BIG)
    expected_refs = refcounts.to(i64) if refcounts is not None else refs
    masks = torch.cat([(free_n > 0) & (refs > 0), free_n > 1, expected_refs != refs, (free_n > 0) & (wcount > 0),
                       shared])
    # the k-th finding is the first candidate whose prefix count reaches k + 1 (cum is sorted): only the
    # ring's rows are gathered, never a row per candidate
    cum = torch.cumsum(masks.to(i64), 0)
    found = cum[-1:]
    cap = ring_rows.shape[0]
    if not cap or (not ring_rows.is_cuda and not int(found)):
        # (on the CPU reading the count costs no sync: a clean check, the usual one, stops here)
        write_index.copy_((write_index.to(i64) + found).clamp_(max=VIOLATION_COUNT_LIMIT))
        return
    hmin = torch.full((nb + 1,), _BIG, dtype=i64, device=dev)
    hmax = torch.full((nb + 1,), -_BIG, dtype=i64, device=dev)
    for idx, h in entries:
        hmin.scatter_reduce_(0, idx, h, "amin")
        hmax.scatter_reduce_(0, idx, h, "amax")
    hmin = torch.where(refs > 0, hmin[:nb], NO_HOLDER)
    hmax = torch.where(refs > 0, hmax[:nb], NO_HOLDER)
    wslot = torch.full((nb + 1,), _BIG, dtype=i64, device=dev).scatter_reduce_(0, widx, s, "amin")[:nb]
    wmin = torch.full((nb + 1,), _BIG, dtype=i64, device=dev).scatter_reduce_(0, widx, write_holders, "amin")[:nb]
    wmax = torch.full((nb + 1,), -_BIG, dtype=i64, device=dev).scatter_reduce_(0, widx, write_holders, "amax")[:nb]
    w0 = write_index.to(i64)
    k = torch.arange(cap, device=dev)
    c = torch.searchsorted(cum, k + 1).clamp_(max=cum.numel() - 1)
    rule = torch.div(c, nb, rounding_mode="floor").clamp_(max=4) + 1
    blk = c % nb
    if not T:  # (no write: one dummy slot keeps the gathers below in range; no candidate selects it)
        key, order, run = (torch.full((1,), _BIG, dtype=i64, device=dev), torch.zeros(1, dtype=i64, device=dev),
                           torch.zeros(1, dtype=i64, device=dev))
        write_holders = torch.full((1,), NO_HOLDER, dtype=i64, device=dev)
    last = key.shape[0] - 1
    j = (c - 4 * nb).clamp_(0, last)
    wh = write_holders[order]
    shared_row, write_row = rule == AllocatorRule.SHARED_WRITE_SLOT, rule == AllocatorRule.FREE_BLOCK_WRITE
    by_rule = lambda *cols: torch.stack(cols, 1).gather(1, (rule - 1).unsqueeze(1)).squeeze(1)  # noqa: E731
    zero = torch.zeros(cap, dtype=i64, device=dev)
    row = torch.stack([
        torch.full((cap,), ALLOCATOR_KIND, dtype=i64, device=dev),
        torch.where(shared_row, torch.div(key[j], spb, rounding_mode="floor"), blk),
        torch.where(shared_row, key[j], torch.where(write_row, wslot[blk], -1)),
        torch.where(shared_row, wh[j], torch.where(write_row, wmin[blk], hmin[blk])),
        torch.where(shared_row, wh[(j + 1).clamp_(max=last)], torch.where(write_row, wmax[blk], hmax[blk])),
        by_rule(refs[blk], free_n[blk], refs[blk], wcount[blk], run[j]),
        by_rule(zero, zero + 1, expected_refs[blk], zero, zero + 1),
        rule,
    ], 1)
    # finding k goes to ring row w0 + k while below capacity; the rows (w0 + k) % cap are distinct, so
    # the others rewrite their row's own values and no two writes meet
    dest = (w0 + k) % cap
    keep = (k < found) & (w0 + k < cap)
    ring_rows[dest] = torch.where(keep.unsqueeze(1), row, ring_rows[dest])
    write_index.copy_((w0 + found).clamp_(max=VIOLATION_COUNT_LIMIT))
