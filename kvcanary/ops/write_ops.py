"""The write check's device passes (runtime/write_check.py, docs/write_check.md): hash what a layer computed, and
compare it with what the slots it was written to hold.

Two passes, each with one keyword signature in every implementation, agreeing bit for bit (the ring's rows as a
multiset: the Triton kernel appends with one atomic per block, so rows of several blocks may land in either order):

- ``hash_rows(words, out)``: ``out[i]`` = the write digest of row ``i`` of ``words``, an int64 view ``[n, H, W]`` of
  the K (or V) the layer handed to its cache update, words in (h, w) order: the bytes its token's slot must hold.
  The write digest of words ``w_0 .. w_{m-1}`` (little-endian 8-byte words) is ``sum_i splitmix64(w_i + (i + 1) *
  WRITE_GAMMA) mod 2^64`` (``write_digest``). It is the check's own: compared only with the digest of the slot's
  bytes in the same forward, never stored in a record, so it need not be SPEC 3.4's fold, and unlike that fold
  (each word waits for the one before) its terms are independent: a kernel loads a token's words as one tile and
  sums them, where the fold walked them one dependent load and multiply chain at a time (about 13 us for one
  decode token's 128 words on an H100). One word changed always changes it (splitmix64 is a bijection); words
  swapped or moved change it through their index. Any strides: the engine's K is usually a transposed view, read
  where it lies. ``flag`` (optional, a one-element int32 tensor): set to 1 with the hashes (the write check's
  "noted" flag, in the same launch inside the engine's forward).
- ``check_writes(...)``: for each live written token (index below ``write_offsets[num_requests]``) whose slot is in
  ``[1, num_slots)`` and is the last live token of the forward written to that slot (a sliding-window cache is a
  ring: a long prefill writes one slot several times, and the last write is what stays, as in the records), and
  each source ``s`` whose layer was noted this forward (``noted[s] != 0``), the write digest of the
  slot's ``num_bytes_per_token`` bytes in the source against ``expected[s, token]``; a token whose bytes differ in
  some source pushes one row, for its first such source:
  ``[tags[s], slot, position, token, s, writer request (-1 without ids), layers[s], WRITE_KV]``.
  With ``records`` (per source, the int64 word view ``[slots, stride / 8]`` of the TAIL record buffer whose
  REAL_KV_HASH covers it), that row's slot also gets bit 0 of its REAL_KV_HASH in ``records[s]`` flipped: TAIL
  stored the hash of the bytes the slot holds, so the record then matches no read of those bytes, and every later
  reader of the slot (the writer's next steps, a request sharing the block, a fork) fails ``verify_real_kv_hash``
  under its own name, until a write of the slot stores a new record. (Once per slot and pass: one token per slot
  is compared.)

Implementations: ``reference_*`` (scalar loops, the oracle), ``torch_*`` (tensor ops, any device), ``numba_*`` (the
CPU backend's compiled loops, ``numba_write_ops``) and ``kvcanary.ops.triton_write_ops`` (one kernel per pass, the
CUDA path). ``write_impl`` picks one for a backend name. Arguments are the canary's own buffers, checked once by the
runtime (no validation here).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

from kvcanary.format import MASK64, FailReason, RecordField, splitmix64, to_signed
from kvcanary.ops.reference import _push_violation, _slot_words
from kvcanary.ops.slot_ops import _live_tokens, _request_ids, _request_of
from kvcanary.ops.torch_hash import splitmix64 as torch_splitmix64
from kvcanary.ops.torch_ops import _host_reads, _push

WRITE_KV = int(FailReason.WRITE_KV)
REAL_KV = int(RecordField.REAL_KV_HASH)  # the record column a wrong write marks (``records``)
NAMES = ("hash_rows", "check_writes")
WRITE_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's own increment (the golden ratio's 64 fraction bits): word i's offset


def write_digest(words) -> int:
    """The write digest (uint64) of little-endian 8-byte words given as ints: ``sum_i splitmix64(w_i + (i + 1) *
    WRITE_GAMMA) mod 2^64``, the scalar definition every implementation agrees with."""
    acc = 0
    for i, w in enumerate(words):
        acc += splitmix64((w + (i + 1) * WRITE_GAMMA) & MASK64)
    return acc & MASK64


def write_impl(backend: str):
    """The two passes of a resolved backend name: Triton's for "triton", numba's for "numba", the scalar
    reference's for "reference" (tests), tensor ops otherwise."""
    if backend == "triton":
        return importlib.import_module("kvcanary.ops.triton_write_ops")
    if backend == "numba":
        return importlib.import_module("kvcanary.ops.numba_write_ops")
    prefix = "reference_" if backend == "reference" else "torch_"
    return SimpleNamespace(**{name: globals()[prefix + name] for name in NAMES})


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """int64 ``[n, H, W]`` words of ``rows`` (``[n, ...]``, any dtype): each row's bytes in its elements' order,
    its last dimension read in place where it is contiguous and a whole number of words (else a copy)."""
    if rows.shape[0] == 0 or rows.numel() == 0:
        return torch.zeros(rows.shape[0], 1, 0, dtype=torch.int64, device=rows.device)
    x = rows.reshape(rows.shape[0], 1, -1) if rows.dim() < 3 else rows.reshape(rows.shape[0], -1, rows.shape[-1])
    if x.shape[-1] * x.element_size() % 8:
        x = x.reshape(x.shape[0], 1, -1)
    try:
        return x.view(torch.int64)
    except RuntimeError:  # (strides that no int64 view can take: a transposed last dimension, an odd offset)
        return x.contiguous().view(torch.int64)


def written_later(slot: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """bool [n]: a later live token of the forward writes the same slot (a stable sort: no host read)."""
    n = slot.shape[0]
    key = torch.where(live, slot, -1 - torch.arange(n, device=slot.device))  # (dead tokens never match)
    ordered, idx = torch.sort(key, stable=True)
    later = torch.zeros(n, dtype=torch.bool, device=slot.device)
    if n > 1:
        later[idx[:-1]] = ordered[:-1] == ordered[1:]
    return later & live


# -- scalar reference ---------------------------------------------------------------------------------
def reference_hash_rows(*, words, out, flag=None) -> None:
    for i in range(words.shape[0]):
        out[i] = to_signed(write_digest([w & MASK64 for w in words[i].reshape(-1).tolist()]))
    if flag is not None:
        flag[0] = 1


def reference_check_writes(*, out_cache_loc, write_offsets, num_requests, positions, input_ids, writer_ids, num_slots,
                           sources, expected, noted, tags, layers, ring, records=None, host_reads=None) -> None:
    live = min(out_cache_loc.shape[0], expected.shape[1], int(write_offsets[num_requests]))
    loc = out_cache_loc[:live].tolist()
    for t in range(live):
        slot = loc[t]
        if not 1 <= slot < num_slots or slot in loc[t + 1:]:
            continue
        for s, src in enumerate(sources):
            if int(noted[s]) == 0 or slot >= src.num_slots:
                continue
            words = _slot_words(src, slot, src.num_bytes_per_token // 8 * 8)
            if to_signed(write_digest(words)) != int(expected[s, t]):
                _push_violation(ring, [int(tags[s]), slot, int(positions[t]), int(input_ids[t]), s,
                                       _request_of(t, write_offsets, num_requests, writer_ids), int(layers[s]),
                                       WRITE_KV])
                if records is not None:
                    records[s][slot, REAL_KV] = int(records[s][slot, REAL_KV]) ^ 1
                break


# -- tensor ops ---------------------------------------------------------------------------------------
def torch_hash_rows(*, words, out, flag=None) -> None:
    n = words.shape[0]
    if flag is not None:
        flag.fill_(1)
    if not n:
        return
    out[:n].copy_(torch_digest(words.reshape(n, -1)))


def torch_digest(flat: torch.Tensor) -> torch.Tensor:
    """int64 [n]: the write digest of each row of int64 words ``[n, m]`` (int64 addition and multiplication wrap
    modulo 2^64 like uint64; a sum of wrapped terms is the same in any order)."""
    offsets = torch.arange(1, flat.shape[1] + 1, dtype=torch.int64, device=flat.device) * to_signed(WRITE_GAMMA)
    return torch_splitmix64(flat + offsets).sum(1)


def torch_slot_digest(src, slots: torch.Tensor) -> torch.Tensor:
    """int64 [n]: the write digest of each slot's num_bytes_per_token // 8 words in one source (``slots`` inside
    it); 0s for a source without rows (none of its slots is compared)."""
    if src.tensor.shape[0] == 0:
        return torch.zeros_like(slots)
    row = torch.div(slots, src.page_size, rounding_mode="floor")
    base = (slots - row * src.page_size) * src.num_bytes_per_token
    o_byte = torch.arange(src.num_bytes_per_token // 8 * 8, device=slots.device)
    # (gathered bytes are contiguous per slot: 8 of them view as one little-endian word)
    data = src.byte_rows()[row[:, None], base[:, None] + o_byte].contiguous()
    return torch_digest(data.view(torch.int64))


def torch_check_writes(*, out_cache_loc, write_offsets, num_requests, positions, input_ids, writer_ids, num_slots,
                       sources, expected, noted, tags, layers, ring, records=None, host_reads=None) -> None:
    host = _host_reads(out_cache_loc.device) if host_reads is None else host_reads
    n = min(_live_tokens(out_cache_loc, write_offsets, num_requests, host), expected.shape[1])
    if not n or not sources:
        return
    slot = out_cache_loc[:n].long()
    live = (torch.arange(n, device=slot.device) < write_offsets[num_requests]) & (slot >= 1) & (slot < num_slots)
    live &= ~written_later(slot, live)
    bad = []
    for s, src in enumerate(sources):
        inside = live & (slot < src.num_slots) & (noted[s] != 0)
        h = torch_slot_digest(src, torch.where(inside, slot, 0))
        bad.append(inside & (h != expected[s, :n]))
    bad = torch.stack(bad, 1)  # [n, S]
    hit = bad.any(1)
    first = bad.to(torch.int8).argmax(1)  # each token's first source whose bytes differ

    def rows(i):  # (only the rows that can land in the ring: _push)
        s = first[i]
        return torch.stack([tags[s], slot[i], positions[i].long(), input_ids[i].long(), s,
                            _request_ids(i, write_offsets, num_requests, writer_ids), layers[s],
                            torch.where(hit[i], WRITE_KV, 0)], 1)
    _push(ring, rows, hit, host_reads=host)
    if records is not None:
        mark_records(records, slot, hit, first)


def mark_records(records, slot: torch.Tensor, hit: torch.Tensor, first: torch.Tensor) -> None:
    """Flip bit 0 of REAL_KV_HASH at ``slot[i]`` in ``records[first[i]]`` for each ``hit[i]`` (distinct slots, all
    >= 1): each distinct buffer once, the misses aimed at slot 0 with nothing flipped (no host read)."""
    for buf in {id(b): b for b in records}.values():
        mine = torch.zeros_like(hit)
        for s, b in enumerate(records):
            if b is buf:
                mine |= first == s
        mine &= hit
        at = torch.where(mine, slot, 0)
        col = buf[:, REAL_KV]
        col.index_put_((at,), col[at] ^ mine.to(torch.int64))
