"""Device helpers shared by the Triton kernels: uint64 hashes, record access, real-KV fingerprint, ring push.

Hash values travel as ``tl.uint64`` (logical shifts, wrapping multiplies) and are
stored as int64 by bitcast. A real-KV source travels as a pointer to its first row
(any dtype; read as bytes) plus (row stride, page size, bytes per token, bytes to read, rows);
up to ``MAX_REAL_KV_SOURCES`` of them as tuples indexed by a static loop.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcanary.format import CHAIN_HEAD as _CHAIN_HEAD
from kvcanary.format import SPLITMIX_MUL1 as _MUL1
from kvcanary.format import SPLITMIX_MUL2 as _MUL2
from kvcanary.format import VIOLATION_COUNT_LIMIT as _COUNT_LIMIT

SPLITMIX_MUL1 = tl.constexpr(_MUL1)
SPLITMIX_MUL2 = tl.constexpr(_MUL2)
CHAIN_HEAD = tl.constexpr(_CHAIN_HEAD)
INT64_MAX = tl.constexpr(2**63 - 1)
COUNT_LIMIT = tl.constexpr(_COUNT_LIMIT)


@triton.jit
def splitmix64(x):
    x = x ^ (x >> 30)
    x = x * SPLITMIX_MUL1
    x = x ^ (x >> 27)
    x = x * SPLITMIX_MUL2
    return x ^ (x >> 31)


@triton.jit
def as_u64(x):
    return x.to(tl.int64).to(tl.uint64, bitcast=True)


@triton.jit
def as_i64(x):
    return x.to(tl.int64, bitcast=True)


@triton.jit
def mix3(a, b, c):
    # a, b, c: uint64 of one shape
    h = splitmix64(a)
    h = splitmix64(h ^ b)
    return splitmix64(h ^ c)


@triton.jit
def chain_head_like(x):
    # uint64 block of x's shape holding splitmix64(CHAIN_ANCHOR)
    return tl.zeros_like(x).to(tl.uint64, bitcast=True) + CHAIN_HEAD


@triton.jit
def record_ptr(p_buf, b_slot, stride):
    # p_buf: *uint8 canary buffer, b_slot: int64 [...], stride: record bytes -> *int64 [...]
    return (p_buf + b_slot * stride).to(tl.pointer_type(tl.int64))


@triton.jit
def load_record3(p_buf, b_slot, m, stride):
    # (token, position, prev_hash) as uint64 [BLOCK]; masked lanes read as a zero record
    p_rec = record_ptr(p_buf, b_slot, stride)
    b_tok = tl.load(p_rec, mask=m, other=0).to(tl.uint64, bitcast=True)
    b_pos = tl.load(p_rec + 1, mask=m, other=0).to(tl.uint64, bitcast=True)
    b_prev = tl.load(p_rec + 2, mask=m, other=0).to(tl.uint64, bitcast=True)
    return b_tok, b_pos, b_prev


@triton.jit
def source_hash(b_slot, m, p_src, row_stride, page_size, nbpt, nbytes, num_rows, ALIGNED: tl.constexpr):
    # fold of the first nbytes of each slot's KV bytes as little-endian words -> uint64 [BLOCK]
    b_row = b_slot // page_size
    b_col = b_slot - b_row * page_size
    m_in = m & (b_slot >= 0) & (b_row < num_rows)
    p_tok = p_src.to(tl.pointer_type(tl.uint8)) + b_row * row_stride + b_col * nbpt  # [BLOCK] *uint8
    b_acc = tl.zeros_like(b_slot).to(tl.uint64, bitcast=True)
    for k in range(0, nbytes, 8):
        if ALIGNED:
            b_w = tl.load((p_tok + k).to(tl.pointer_type(tl.int64)), mask=m_in, other=0).to(tl.uint64, bitcast=True)
        else:
            b_w = tl.zeros_like(b_acc)
            for j in tl.static_range(8):
                b_byte = tl.load(p_tok + k + j, mask=m_in, other=0).to(tl.uint64)
                b_w = b_w | (b_byte << (8 * j))
        b_acc = splitmix64(b_acc ^ b_w)
    return b_acc


@triton.jit
def slot_fingerprint(b_slot, m, src_ptrs, src_row_stride, src_page_size, src_nbpt, src_nbytes, src_rows,
                     NUM_SOURCES: tl.constexpr, ALIGNED: tl.constexpr):
    # real-KV hash of each slot (SPEC 3.4) -> uint64 [BLOCK]; 0 without sources
    b_fp = tl.zeros_like(b_slot).to(tl.uint64, bitcast=True)
    for k in tl.static_range(NUM_SOURCES):
        b_h = source_hash(b_slot, m, src_ptrs[k], src_row_stride[k], src_page_size[k], src_nbpt[k],
                          src_nbytes[k], src_rows[k], ALIGNED=ALIGNED)
        b_fp = splitmix64(b_fp ^ b_h)
    return b_fp


@triton.jit
def violation_rows(b_tag, b_slot, b_pos, b_tok, b_exp, b_chain, b_aux, b_reason, o_f):
    # int64 [BLOCK] fields (any may be scalar) -> [BLOCK, 8] rows; o_f: arange(0, 8)
    o = o_f[None, :]
    b_row = tl.where(o == 0, b_tag, 0)
    b_row = tl.where(o == 1, b_slot[:, None], b_row)
    b_row = tl.where(o == 2, b_pos[:, None], b_row)
    b_row = tl.where(o == 3, b_tok[:, None], b_row)
    b_row = tl.where(o == 4, b_exp[:, None], b_row)
    b_row = tl.where(o == 5, b_chain[:, None], b_row)
    b_row = tl.where(o == 6, b_aux[:, None], b_row)
    return tl.where(o == 7, b_reason[:, None], b_row)


@triton.jit
def push_violations(m_fail, b_rows, p_ring, p_write_index, ring_capacity):
    # one atomic per block: failing lanes take consecutive ring indices; rows stored below capacity
    b_fail = m_fail.to(tl.int32)
    n_fail = tl.sum(b_fail, axis=0)
    i_base = tl.atomic_add(p_write_index, n_fail, mask=n_fail > 0, sem="relaxed").to(tl.int64)
    # Saturate: every add is followed by a clamp, so the final count is min(total, COUNT_LIMIT) and a
    # racing add starts at most a few blocks' failures above the limit (never near int32 overflow).
    tl.atomic_min(p_write_index, COUNT_LIMIT, mask=n_fail > 0, sem="relaxed")
    b_idx = i_base + (tl.cumsum(b_fail, axis=0) - b_fail).to(tl.int64)
    m_store = m_fail & (b_idx >= 0) & (b_idx < ring_capacity)
    o_f = tl.arange(0, 8)
    tl.store(p_ring + b_idx[:, None] * 8 + o_f[None, :], b_rows, mask=m_store[:, None])
