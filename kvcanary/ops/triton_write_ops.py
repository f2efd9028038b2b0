"""Triton kernels of the write check (``kvcanary.ops.write_ops`` has their contract, reference and tensor-op twins).

Each pass is one launch. Nothing is read on the host and grids come from static sizes, so both can be captured in
a CUDA graph (the row digest runs inside the engine's forward, which may be one). Both read a block of tokens' words
as one [tokens, words] tile per step and sum the tile's terms: the write digest's terms are independent, so the
loads of a row are issued together and read coalesced (a row's words lie side by side), where a fold over the words
walked one dependent load and splitmix chain per word, one lane per token.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from kvcanary.ops import triton_ops
from kvcanary.ops.snapshot_ops import record_table
from kvcanary.ops.triton_hash import as_i64, push_violations, splitmix64, violation_rows
from kvcanary.ops.write_ops import REAL_KV, WRITE_GAMMA, WRITE_KV

WRITE_KV_C = tl.constexpr(WRITE_KV)
REAL_KV_C = tl.constexpr(REAL_KV)
WRITE_GAMMA_C = tl.constexpr(WRITE_GAMMA)
# tokens and words per tile of the row digest: a decode step's one token fits a program, a prefill's thousands
# spread over many (16 x 64 int64 words: 8 per thread of 4 warps)
HASH_TOKENS = 16
HASH_WORDS = 64
# tokens per program of the check (its "written later" scan compares a block of tokens with every later one) and
# words per tile of a slot's digest: the row digest's tile, since a tile's terms are computed for its masked tokens
# too (one live decode token in a tile of 64 x 32 words cost 25 us a launch on an H100 at 3c29a6f)
CHECK_TOKENS = 16
CHECK_WORDS = 64
# later tokens per step of the check's "written later" scan (a prefill's thousands in fewer, wider steps)
SCAN_TOKENS = 64
# A source's row of the check's table: its byte offset from the first source, row stride, page size, bytes per
# token, slots.
TABLE_COLUMNS = 5
TABLE_COLUMNS_C = tl.constexpr(TABLE_COLUMNS)


@triton.jit
def digest_terms(b_words, o_w, m):
    # uint64 words [T, W] and their indices in the row (int64 [W]) -> each word's term of the write digest, 0 where
    # ~m (write_ops.write_digest: splitmix64(w + (i + 1) * WRITE_GAMMA))
    b_at = (o_w + 1).to(tl.uint64, bitcast=True) * WRITE_GAMMA_C
    return tl.where(m, splitmix64(b_words + b_at[None, :]), 0)


@triton.jit
def _hash_rows_kernel(p_words, n, heads, width, s_t, s_h, s_w, p_out, p_flag, BLOCK_T: tl.constexpr,
                      BLOCK_W: tl.constexpr, HAS_FLAG: tl.constexpr):
    if HAS_FLAG:  # (the caller's "noted" flag: set here, one launch fewer than a fill of its own)
        if tl.program_id(0) == 0:
            tl.store(p_flag, 1)
    o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < n
    p_row = p_words + o_t * s_t  # [BLOCK_T] *int64
    b_acc = tl.zeros([BLOCK_T], tl.int64).to(tl.uint64, bitcast=True)
    for i0 in range(0, heads * width, BLOCK_W):
        o_w = i0 + tl.arange(0, BLOCK_W).to(tl.int64)  # word indices in the row, (h, w) order
        o_h = o_w // width
        m = m_t[:, None] & (o_w < heads * width)[None, :]
        b_w = tl.load(p_row[:, None] + (o_h * s_h + (o_w - o_h * width) * s_w)[None, :], mask=m, other=0)
        b_acc += tl.sum(digest_terms(b_w.to(tl.uint64, bitcast=True), o_w, m), axis=1)
    tl.store(p_out + o_t, as_i64(b_acc), mask=m_t)


@triton.jit
def _check_writes_kernel(p_loc, num_tokens, p_offsets, num_requests, p_pos, p_ids, p_writers, num_slots, p_base,
                         p_table, num_sources, p_expected, exp_stride, p_noted, p_tags, p_layers, p_ring,
                         p_write_index, ring_capacity, p_rec, p_rec_at, HAS_WRITERS: tl.constexpr,
                         MARK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, SCAN: tl.constexpr):
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    n_live = tl.minimum(tl.load(p_offsets + num_requests), num_tokens)
    if t0 < n_live:  # (the grid covers the static token count: blocks past the live tokens do nothing)
        o_t = t0 + tl.arange(0, BLOCK_T)
        m_t = o_t < n_live
        b_slot = tl.load(p_loc + o_t, mask=m_t, other=0).to(tl.int64)
        m_t = m_t & (b_slot >= 1) & (b_slot < num_slots)
        # the last live token written to each slot holds it: earlier ones (a sliding window's ring) are not compared
        b_later = tl.zeros([BLOCK_T], tl.int32)
        for c0 in range(t0, n_live, SCAN):
            o_c = c0 + tl.arange(0, SCAN)
            b_c = tl.load(p_loc + o_c, mask=o_c < n_live, other=-1).to(tl.int64)
            m_same = (b_slot[:, None] == b_c[None, :]) & (o_c[None, :] > o_t[:, None]) & (o_c[None, :] < n_live)
            b_later |= tl.max(m_same.to(tl.int32), axis=1)
        m_t = m_t & (b_later == 0)
        b_first = tl.full([BLOCK_T], -1, tl.int64)  # each token's first source whose bytes differ
        for s in range(num_sources):
            p_row = p_table + s * TABLE_COLUMNS_C
            offset, row_stride, page_size = tl.load(p_row), tl.load(p_row + 1), tl.load(p_row + 2)
            nbpt, src_slots = tl.load(p_row + 3), tl.load(p_row + 4)
            m = m_t & (b_slot < src_slots) & (tl.load(p_noted + s + o_t * 0) != 0) & (b_first < 0)  # [BLOCK_T]
            b_r = b_slot // page_size
            p_tok = (p_base.to(tl.pointer_type(tl.uint8)) + offset + b_r * row_stride
                     + (b_slot - b_r * page_size) * nbpt).to(tl.pointer_type(tl.int64))
            b_acc = tl.zeros([BLOCK_T], tl.int64).to(tl.uint64, bitcast=True)
            for w0 in range(0, nbpt // 8, BLOCK_W):
                o_w = w0 + tl.arange(0, BLOCK_W).to(tl.int64)
                m_w = m[:, None] & (o_w < nbpt // 8)[None, :]
                b_w = tl.load(p_tok[:, None] + o_w[None, :], mask=m_w, other=0).to(tl.uint64, bitcast=True)
                b_acc += tl.sum(digest_terms(b_w, o_w, m_w), axis=1)
            b_exp = tl.load(p_expected + s * exp_stride + o_t, mask=m, other=0)
            b_first = tl.where(m & (as_i64(b_acc) != b_exp), s, b_first)
        m_fail = b_first >= 0
        if tl.sum(m_fail.to(tl.int32), axis=0) > 0:
            b_s = tl.maximum(b_first, 0)
            b_req = tl.full([BLOCK_T], -1, tl.int64)
            if HAS_WRITERS:
                if num_requests > 0:
                    b_r = tl.zeros([BLOCK_T], tl.int64)
                    for j in range(1, num_requests + 1):
                        b_r += (tl.load(p_offsets + j) <= o_t).to(tl.int64)
                    b_req = tl.load(p_writers + tl.minimum(b_r, num_requests - 1), mask=m_fail,
                                    other=-1).to(tl.int64)
            b_row = violation_rows(tl.load(p_tags + b_s, mask=m_fail, other=0)[:, None], b_slot,
                                   tl.load(p_pos + o_t, mask=m_fail, other=0).to(tl.int64),
                                   tl.load(p_ids + o_t, mask=m_fail, other=0).to(tl.int64), b_s,
                                   b_req, tl.load(p_layers + b_s, mask=m_fail, other=0),
                                   tl.full([BLOCK_T], WRITE_KV_C, tl.int64), tl.arange(0, 8))
            push_violations(m_fail, b_row, p_ring, p_write_index, ring_capacity)
            if MARK:  # (write_ops: the slot's record then certifies no bytes; one token per slot: no two lanes meet)
                p_at = p_rec_at + b_s * 3  # (its row of record_table: first element, slots, row stride)
                p_mark = (p_rec + tl.load(p_at, mask=m_fail, other=0)
                          + b_slot * tl.load(p_at + 2, mask=m_fail, other=0) + REAL_KV_C)
                tl.store(p_mark, tl.load(p_mark, mask=m_fail, other=0) ^ 1, mask=m_fail)


def hash_rows(*, words, out, flag=None) -> None:
    n = words.shape[0]
    if not n:
        if flag is not None:
            flag.fill_(1)
        return
    triton_ops._launch(_hash_rows_kernel, (triton_ops._cdiv(n, HASH_TOKENS),),
        p_words=words, n=n, heads=words.shape[1], width=words.shape[2], s_t=words.stride(0), s_h=words.stride(1),
        s_w=words.stride(2), p_out=out, p_flag=out if flag is None else flag, BLOCK_T=HASH_TOKENS,
        BLOCK_W=HASH_WORDS, HAS_FLAG=flag is not None,
    )


def check_writes(*, out_cache_loc, write_offsets, num_requests, positions, input_ids, writer_ids, num_slots, sources,
                 expected, noted, tags, layers, ring, records=None, host_reads=None) -> None:
    n = min(out_cache_loc.shape[0], expected.shape[1])
    if not n or not sources:
        return
    triton_ops._launch(_check_writes_kernel, (triton_ops._cdiv(n, CHECK_TOKENS),),
        p_loc=out_cache_loc, num_tokens=n, p_offsets=write_offsets, num_requests=num_requests, p_pos=positions,
        p_ids=input_ids, p_writers=out_cache_loc if writer_ids is None else writer_ids, num_slots=num_slots,
        p_base=sources[0].tensor, p_table=_table(sources), num_sources=len(sources), p_expected=expected,
        exp_stride=expected.stride(0), p_noted=noted, p_tags=tags, p_layers=layers, p_ring=ring.rows,
        p_write_index=ring.write_index, ring_capacity=ring.capacity,
        p_rec=expected if records is None else records[0],  # (unread without records)
        p_rec_at=layers if records is None else _record_table(records), HAS_WRITERS=writer_ids is not None,
        MARK=records is not None, BLOCK_T=CHECK_TOKENS, BLOCK_W=CHECK_WORDS, SCAN=SCAN_TOKENS,
    )


# the record buffers' (first element, shape, row stride) -> their ``record_table`` (``_record_table``)
_RECORDS: dict = {}


def _record_table(records) -> torch.Tensor:
    """The snapshot's ``record_table`` of the record buffers (each one's first element from the first one's, its
    slots, its row stride), made once per set of buffers: the runtime passes the same ones every step."""
    key = tuple((r.data_ptr(), r.shape[0], r.stride(0)) for r in records)
    known = _RECORDS.get(key)
    if known is None:
        known = record_table(records, records[0].device)
        if len(_RECORDS) >= 64:
            _RECORDS.clear()
        _RECORDS[key] = known
    return known


# the sources' ids -> (weak references to them, their table): the runtime passes the same sources every step, and
# a cache entry keeps no KV pool alive after its engine is gone
_TABLES: dict = {}


def _table(sources) -> torch.Tensor:
    """int64 [k, TABLE_COLUMNS] on the sources' device: byte offsets from the first source's first byte, made once
    per set of sources (a pool's tensors stay put)."""
    key = tuple(map(id, sources))
    known = _TABLES.get(key)
    if known is not None and all(ref() is src for ref, src in zip(known[0], sources)):
        return known[1]
    first = sources[0].tensor.data_ptr()
    rows = [[src.tensor.data_ptr() - first, src.row_stride_bytes, src.page_size, src.num_bytes_per_token,
             src.num_slots] for src in sources]
    table = torch.tensor(rows, dtype=torch.int64, device=sources[0].tensor.device)
    if len(_TABLES) >= 64:
        _TABLES.clear()
    _TABLES[key] = ([weakref.ref(src) for src in sources], table)
    return table
