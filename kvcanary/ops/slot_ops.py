"""The slot checks' device passes (runtime/slots.py, docs/slots.md): reserved reads, reserved writes, non-finite KV.

Each has three implementations with one keyword signature that agree bit for bit on the ring's rows (as a
multiset: the Triton kernels append with one atomic per block, so rows of several blocks may land in either
order) and on its write index: ``reference_*`` (scalar loops, the oracle), ``torch_*`` (tensor ops, any
device) and ``kvcanary.ops.triton_slots`` (a kernel or two per check, the CUDA path: as tensor ops a check
is some 15-45 launches, each a host call on every eager step and a node of every captured one).
``slot_impl`` picks one for a backend name. Arguments are the canary's own buffers, checked once by the
runtime (no validation here).

Rows (docs/slots.md): reserved read ``[tag, slot, position, -1, expected_token, prev, 0, RESERVED_SLOT_READ]``;
reserved write ``[tag, slot, position, token, -1, request, -1, RESERVED_SLOT_WRITE]``; non-finite
``[source's tag, slot, position, token, -1, request, source's index, NONFINITE_KV]``, one per call, for the first
live token (then source) whose written bytes hold a NaN or Inf.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

from kvcanary.format import FailReason
from kvcanary.ops.reference import _push_violation
from kvcanary.ops.torch_ops import _host_reads, _push

READ, WRITE, NONFINITE = (int(FailReason.RESERVED_SLOT_READ), int(FailReason.RESERVED_SLOT_WRITE),
                          int(FailReason.NONFINITE_KV))
# exponent bits of each float width, read on a same-width integer view (bfloat16 is told apart below)
EXPONENT = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80, torch.float32: 0x7F800000,
            torch.float64: 0x7FF0000000000000}
INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}
NAMES = ("reserved_reads", "reserved_writes", "nonfinite")
NO_HIT = 2**63 - 1  # the non-finite check's scratch between forwards (Triton's first-hit index): nothing found


def slot_impl(backend: str):
    """The three checks of a resolved backend name: Triton's for "triton", the scalar reference's for
    "reference" (tests), tensor ops otherwise (numba has no kernels of its own for them: its CPU runs take
    the runtime's numpy shortcut first)."""
    if backend == "triton":
        return importlib.import_module("kvcanary.ops.triton_slots")
    prefix = "reference_" if backend == "reference" else "torch_"
    return SimpleNamespace(**{name: globals()[prefix + name] for name in NAMES})


# -- scalar reference ---------------------------------------------------------------------------------
def _request_of(i: int, write_offsets, num_requests: int, writer_ids) -> int:
    """The writer id of token ``i``: its request is the number of requests 1..n whose start is <= i (the
    last for tokens past the batch's), -1 without ids or requests."""
    if writer_ids is None or num_requests == 0:
        return -1
    r = sum(1 for j in range(1, num_requests + 1) if int(write_offsets[j]) <= i)
    return int(writer_ids[min(r, num_requests - 1)])


def _reserved(reserved, slot: int) -> bool:
    return 0 <= slot < reserved.shape[0] and bool(reserved[slot])


def reference_reserved_reads(*, entries, reserved, ring, launch_tag, bound=None, host_reads=None) -> None:
    n = entries.capacity if bound is None else max(0, min(entries.capacity, bound))
    if int(entries.enable[0]) == 0:
        return
    for i in range(min(n, max(0, int(entries.count[0])))):
        slot = int(entries.slot[i])
        if _reserved(reserved, slot):
            _push_violation(ring, [launch_tag, slot, int(entries.position[i]), -1, int(entries.expected_token[i]),
                                   int(entries.prev[i]), 0, READ])


def reference_reserved_writes(*, out_cache_loc, write_offsets, num_requests, positions, input_ids, writer_ids,
                              reserved, ring, launch_tag, host_reads=None) -> None:
    live = min(out_cache_loc.shape[0], int(write_offsets[num_requests]))
    for i in range(live):
        slot = int(out_cache_loc[i])
        if _reserved(reserved, slot):
            _push_violation(ring, [launch_tag, slot, int(positions[i]), int(input_ids[i]), -1,
                                   _request_of(i, write_offsets, num_requests, writer_ids), -1, WRITE])


def _bad_words(src, slot: int) -> bool:
    """Whether ``slot``'s bytes in ``src`` hold a word whose exponent bits are all ones (a slot outside the
    source: no)."""
    row, col = divmod(slot, src.page_size)
    if row >= src.tensor.shape[0]:
        return False
    nbpt, dtype = src.num_bytes_per_token, src.tensor.dtype
    data = src.byte_rows()[row, col * nbpt:(col + 1) * nbpt].cpu()
    exp = EXPONENT[dtype]
    return any((int.from_bytes(bytes(data[k:k + dtype.itemsize].tolist()), "little") & exp) == exp
               for k in range(0, nbpt, dtype.itemsize))


def reference_nonfinite(*, out_cache_loc, write_offsets, num_requests, positions, input_ids, writer_ids, num_slots,
                        sources, tags, index, ring, scratch=None, host_reads=None) -> None:
    live = min(out_cache_loc.shape[0], int(write_offsets[num_requests]))
    for t in range(live):
        slot = int(out_cache_loc[t])
        if not 1 <= slot < num_slots:
            continue
        for s, src in enumerate(sources):
            if _bad_words(src, slot):
                _push_violation(ring, [int(tags[s]), slot, int(positions[t]), int(input_ids[t]), -1,
                                       _request_of(t, write_offsets, num_requests, writer_ids), int(index[s]),
                                       NONFINITE])
                return


# -- tensor ops ---------------------------------------------------------------------------------------
def _is_reserved(reserved: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    inside = (slot >= 0) & (slot < reserved.shape[0])
    return inside & reserved[slot.clamp(0, reserved.shape[0] - 1)]


def _live_tokens(loc, write_offsets, num_requests: int, host: bool) -> int:
    """Tokens to look at: all of them on an accelerator (masked on the device), the live ones on the CPU."""
    return min(loc.shape[0], int(write_offsets[num_requests])) if host else loc.shape[0]


def _request_ids(i: torch.Tensor, write_offsets, num_requests: int, writer_ids) -> torch.Tensor:
    """The request id of each token index in ``i`` (-1 without ids)."""
    offs = write_offsets[1:num_requests + 1]
    if writer_ids is None or offs.shape[0] == 0:
        return torch.full_like(i, -1)
    return writer_ids[torch.searchsorted(offs, i, right=True).clamp(max=offs.shape[0] - 1)].long()


def torch_reserved_reads(*, entries, reserved, ring, launch_tag, bound=None, host_reads=None) -> None:
    host = _host_reads(reserved.device) if host_reads is None else host_reads
    n = entries.capacity if bound is None else max(0, min(entries.capacity, bound))
    if host:  # (the count is free to read there)
        n = min(n, max(0, int(entries.count[0])))
    if not n:
        return
    slot = entries.slot[:n]
    hit = (torch.arange(n, device=slot.device) < entries.count) & (entries.enable != 0) & _is_reserved(reserved, slot)

    def rows(i):  # (only the rows that can land in the ring: _push)
        minus = torch.full_like(i, -1)
        return torch.stack([torch.full_like(i, launch_tag), slot[i], entries.position[i], minus,
                            entries.expected_token[i], entries.prev[i], torch.zeros_like(i),
                            torch.where(hit[i], READ, 0)], 1)
    _push(ring, rows, hit, host_reads=host)


def torch_reserved_writes(*, out_cache_loc, write_offsets, num_requests, positions, input_ids, writer_ids,
                          reserved, ring, launch_tag, host_reads=None) -> None:
    host = _host_reads(reserved.device) if host_reads is None else host_reads
    n = _live_tokens(out_cache_loc, write_offsets, num_requests, host)
    if not n:
        return
    slot = out_cache_loc[:n].long()
    hit = (torch.arange(n, device=slot.device) < write_offsets[num_requests]) & _is_reserved(reserved, slot)

    def rows(i):  # (only the rows that can land in the ring: _push)
        minus = torch.full_like(i, -1)
        return torch.stack([torch.full_like(i, launch_tag), slot[i], positions[i].long(), input_ids[i].long(),
                            minus, _request_ids(i, write_offsets, num_requests, writer_ids), minus,
                            torch.where(hit[i], WRITE, 0)], 1)
    _push(ring, rows, hit, host_reads=host)


def byte_cells(src, slots: torch.Tensor):
    """(rows, cols) index tensors of ``slots``' bytes in ``src.byte_rows()``: [n, 1] and [n, nbpt]."""
    nbpt = src.num_bytes_per_token
    rows = torch.div(slots, src.page_size, rounding_mode="floor")
    cols = (slots % src.page_size) * nbpt
    return rows[:, None], cols[:, None] + torch.arange(nbpt, device=slots.device)


def _finite(src, slot: torch.Tensor) -> torch.Tensor:
    """bool [n]: every element of each slot's KV in ``src`` is finite (a slot outside it counts as finite)."""
    inside = slot < src.num_slots
    rows, cols = byte_cells(src, torch.where(inside, slot, 0))
    dtype = src.tensor.dtype
    exp = EXPONENT[dtype]
    words = src.byte_rows()[rows, cols].view(INT_VIEW[dtype.itemsize])
    return ~((words & exp) == exp).any(1) | ~inside


def torch_nonfinite(*, out_cache_loc, write_offsets, num_requests, positions, input_ids, writer_ids, num_slots,
                    sources, tags, index, ring, scratch=None, host_reads=None) -> None:
    host = _host_reads(out_cache_loc.device) if host_reads is None else host_reads
    n = _live_tokens(out_cache_loc, write_offsets, num_requests, host)
    if not n or not sources:
        return
    slot = out_cache_loc[:n].long()
    live = ((torch.arange(n, device=slot.device) < write_offsets[num_requests]) & (slot >= 1) & (slot < num_slots))
    bad = torch.stack([live & ~_finite(src, slot) for src in sources], 1)  # [n, S]
    flat = bad.view(-1)
    first = flat.to(torch.int8).argmax()  # the first token, then its first source
    # (1-element index tensors: a 0-d tensor index is read on the host, a sync no capture allows)
    t, s = (first // bad.shape[1]).view(1), (first % bad.shape[1]).view(1)
    found = flat.any().view(1)
    row = torch.stack([tags[s], slot[t], positions[:n].long()[t], input_ids[:n].long()[t], torch.full_like(t, -1),
                       _request_ids(t, write_offsets, num_requests, writer_ids), index[s],
                       torch.where(found, NONFINITE, 0)], 1)
    _push(ring, row, found, host_reads=host)
