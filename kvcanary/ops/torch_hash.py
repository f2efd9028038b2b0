"""uint64 hashes of SPEC 3.1 and 3.4 on int64 tensors, plus the gathers the torch ops share.

int64 multiplication wraps modulo 2^64 like uint64, so only right shifts need care:
an arithmetic shift followed by a mask is the logical shift of the same bit pattern.
"""

from __future__ import annotations

import torch

from kvcanary.format import CHAIN_HEAD, PARTIAL_READ_BYTES, SPLITMIX_MUL1, SPLITMIX_MUL2, RealKvMode, to_signed

MUL1 = to_signed(SPLITMIX_MUL1)
MUL2 = to_signed(SPLITMIX_MUL2)
HEAD = to_signed(CHAIN_HEAD)
INT64_MAX = (1 << 63) - 1


def shr(x: torch.Tensor, k: int) -> torch.Tensor:
    # Mask off the sign bits an arithmetic shift drags in.
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x ^ shr(x, 30)
    x = x * MUL1
    x = x ^ shr(x, 27)
    x = x * MUL2
    return x ^ shr(x, 31)


def mix3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)


def gather_rows(t: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor | slice) -> torch.Tensor:
    """``t[rows, cols]`` as int64 with out-of-range rows (and int cols) reading as 0; never an index error."""
    if isinstance(cols, slice):
        width = len(range(*cols.indices(t.shape[1])))
        out_shape = (*rows.shape, width)
        ok = (rows >= 0) & (rows < t.shape[0])
        if t.shape[0] == 0 or width == 0:
            return torch.zeros(out_shape, dtype=torch.int64, device=rows.device)
        vals = t[torch.where(ok, rows, 0), cols].long()
        return torch.where(ok[..., None], vals, 0)
    ok = (rows >= 0) & (rows < t.shape[0]) & (cols >= 0) & (cols < t.shape[1])
    if t.numel() == 0:
        return torch.zeros(torch.broadcast_shapes(rows.shape, cols.shape), dtype=torch.int64, device=rows.device)
    vals = t[torch.where(ok, rows, 0), torch.where(ok, cols, 0)].long()
    return torch.where(ok, vals, 0)


def source_hash(src, slots: torch.Tensor, num_bytes: int) -> torch.Tensor:
    """Per-slot hash of one RealKvSource over its first num_bytes bytes; 0 for a slot outside the source."""
    acc = torch.zeros_like(slots)
    if src.tensor.shape[0] == 0 or slots.numel() == 0:
        return acc
    row = torch.div(slots, src.page_size, rounding_mode="floor")
    ok = (slots >= 0) & (row < src.tensor.shape[0])
    row = torch.where(ok, row, 0)
    base = torch.where(ok, slots - row * src.page_size, 0) * src.num_bytes_per_token
    byte_rows = src.byte_rows()
    o_byte = torch.arange(8, device=slots.device)
    for k in range(0, num_bytes, 8):
        # Gathered bytes are contiguous, so 8 of them view as one little-endian word.
        word = byte_rows[row[:, None], base[:, None] + (k + o_byte)].view(torch.int64)[:, 0]
        acc = splitmix64(acc ^ word)
    return torch.where(ok, acc, 0)


def fingerprint(*, slots: torch.Tensor, sources, real_kv_mode: int) -> torch.Tensor:
    """int64 [n] real-KV hash of each slot (SPEC 3.4); 0 in mode NONE or without sources."""
    slots = slots.long()
    acc = torch.zeros_like(slots)
    if real_kv_mode == RealKvMode.NONE or not sources:
        return acc
    for src in sources:
        num_bytes = PARTIAL_READ_BYTES if real_kv_mode == RealKvMode.PARTIAL else src.read_bytes
        acc = splitmix64(acc ^ source_hash(src, slots, num_bytes))
    return acc


def count_le(cum: torch.Tensor, start, count: int) -> torch.Tensor:
    """For v in [start, start + count): how many values of the non-decreasing ``cum`` are <= v.

    The same as ``searchsorted(cum, start + arange(count), right=True)``, built from index_add and
    cumsum, which stay on one thread for small inputs: CPU searchsorted goes parallel at a few
    hundred elements and can stall for milliseconds when the other cores are busy.
    """
    idx = (cum - start).clamp(0, count)
    hits = torch.zeros(count + 1, dtype=torch.int64, device=cum.device)
    hits.index_add_(0, idx, torch.ones_like(idx))
    return torch.cumsum(hits[:count], 0)
