"""Triton kernels of the slot checks (``kvcanary.ops.slot_ops`` has their contract, reference and tensor-op twins).

As tensor ops a check is some 15-45 launches (masks, gathers, a cumsum and a searchsorted for the ring push),
each a host call of 10-40 us on an eager step and a node of every captured one; here the reserved checks are
one launch each and the non-finite check one per float width (a model has one) plus one. Nothing is read on the
host, grids come from static sizes, so every launch can be captured in a CUDA graph. Hits are rare: a block
gathers the rows' other fields only when one of its lanes hit.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from kvcanary.ops import triton_ops
from kvcanary.ops.slot_ops import EXPONENT, NONFINITE, READ, WRITE
from kvcanary.ops.triton_hash import INT64_MAX, push_violations, violation_rows

# (compiled kernels see module globals only as constexpr; the interpreter does not check it)
READ_C, WRITE_C, NONFINITE_C = tl.constexpr(READ), tl.constexpr(WRITE), tl.constexpr(NONFINITE)
RESERVED_BLOCK = 1024
# Persistent programs of the reserved-read pass (a plan's prefix entries: up to a batch times its context).
RESERVED_PROGRAMS = 256
NONFINITE_TOKENS = 4  # tokens per program of the non-finite pass, each read whole in BLOCK_W-word tiles
NONFINITE_WORDS = 256
# A float source's row of the non-finite pass's table: its byte offset from the first source of its width, row
# stride, page size, bytes per token, slots, and index among all sources.
TABLE_COLUMNS = 6
TABLE_COLUMNS_C = tl.constexpr(TABLE_COLUMNS)


@triton.jit
def _request_of(o, p_offsets, num_requests, p_writers, HAS_WRITERS: tl.constexpr):
    # writer id of each token index in o [BLOCK]: requests 1..n starting at or before it, clamped to the last
    b_req = tl.full(o.shape, -1, tl.int64)
    if HAS_WRITERS:
        if num_requests > 0:
            b_r = tl.zeros(o.shape, tl.int64)
            for j in range(1, num_requests + 1):
                b_r += (tl.load(p_offsets + j) <= o).to(tl.int64)
            b_r = tl.minimum(b_r, num_requests - 1)
            b_req = tl.load(p_writers + b_r).to(tl.int64)
    return b_req


@triton.jit
def _reserved_reads_kernel(p_slot, p_pos, p_exp, p_prev, p_count, p_enable, bound, p_mask, mask_len,
                           p_ring, p_write_index, ring_capacity, launch_tag, BLOCK: tl.constexpr):
    i_p = tl.program_id(0).to(tl.int64)
    n_p = tl.num_programs(0).to(tl.int64)
    n = tl.where(tl.load(p_enable) != 0, tl.maximum(tl.minimum(tl.load(p_count), bound), 0), 0)
    o_f = tl.arange(0, 8)
    for b0 in range(i_p * BLOCK, n, n_p * BLOCK):
        o = b0 + tl.arange(0, BLOCK)
        m = o < n
        b_slot = tl.load(p_slot + o, mask=m, other=-1)
        m_in = m & (b_slot >= 0) & (b_slot < mask_len)
        m_hit = m_in & (tl.load(p_mask + b_slot, mask=m_in, other=0) != 0)
        if tl.sum(m_hit.to(tl.int32), axis=0) > 0:
            b_minus = tl.full([BLOCK], -1, tl.int64)
            b_row = violation_rows(launch_tag, b_slot, tl.load(p_pos + o, mask=m_hit, other=0), b_minus,
                                   tl.load(p_exp + o, mask=m_hit, other=0), tl.load(p_prev + o, mask=m_hit, other=0),
                                   b_minus * 0, b_minus * 0 + READ_C, o_f)
            push_violations(m_hit, b_row, p_ring, p_write_index, ring_capacity)


@triton.jit
def _reserved_writes_kernel(p_loc, num_tokens, p_offsets, num_requests, p_pos, p_ids, p_writers, p_mask, mask_len,
                            p_ring, p_write_index, ring_capacity, launch_tag, HAS_WRITERS: tl.constexpr,
                            BLOCK: tl.constexpr):
    i_p = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(p_offsets + num_requests), num_tokens)
    o = i_p * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    b_slot = tl.load(p_loc + o, mask=m, other=-1).to(tl.int64)
    m_in = m & (b_slot >= 0) & (b_slot < mask_len)
    m_hit = m_in & (tl.load(p_mask + b_slot, mask=m_in, other=0) != 0)
    if tl.sum(m_hit.to(tl.int32), axis=0) > 0:
        b_minus = tl.full([BLOCK], -1, tl.int64)
        b_row = violation_rows(launch_tag, b_slot, tl.load(p_pos + o, mask=m_hit, other=0).to(tl.int64),
                               tl.load(p_ids + o, mask=m_hit, other=0).to(tl.int64), b_minus,
                               _request_of(o, p_offsets, num_requests, p_writers, HAS_WRITERS), b_minus,
                               b_minus * 0 + WRITE_C, tl.arange(0, 8))
        push_violations(m_hit, b_row, p_ring, p_write_index, ring_capacity)


@triton.jit
def _nonfinite_kernel(p_loc, num_tokens, p_offsets, num_requests, num_slots, p_base, p_table, p_first, num_sources,
                      EXP: tl.constexpr, WORD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    # program (token block, source of one width): the smallest token * num_sources + source index among the
    # source's live tokens with a word whose exponent bits are all ones, into p_first (atomic min)
    p_row = p_table + tl.program_id(1).to(tl.int64) * TABLE_COLUMNS_C
    offset, row_stride, page_size = tl.load(p_row), tl.load(p_row + 1), tl.load(p_row + 2)
    nbpt, src_slots, s_index = tl.load(p_row + 3), tl.load(p_row + 4), tl.load(p_row + 5)
    o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < tl.minimum(tl.load(p_offsets + num_requests), num_tokens)
    b_slot = tl.load(p_loc + o_t, mask=m_t, other=0).to(tl.int64)
    m_t = m_t & (b_slot >= 1) & (b_slot < num_slots) & (b_slot < src_slots)
    b_row = b_slot // page_size
    p_tok = p_base.to(tl.pointer_type(tl.uint8)) + offset + b_row * row_stride + (b_slot - b_row * page_size) * nbpt
    b_bad = tl.zeros([BLOCK_T], tl.int32)
    o_w = tl.arange(0, BLOCK_W).to(tl.int64) * WORD
    for w0 in range(0, nbpt, BLOCK_W * WORD):
        m = m_t[:, None] & (w0 + o_w[None, :] < nbpt)
        p = p_tok[:, None] + w0 + o_w[None, :]
        # (the word's integer type by its width: a compiled kernel reads no global but a constexpr)
        if WORD == 2:
            b_w = tl.load(p.to(tl.pointer_type(tl.int16)), mask=m, other=0).to(tl.int64)
        elif WORD == 4:
            b_w = tl.load(p.to(tl.pointer_type(tl.int32)), mask=m, other=0).to(tl.int64)
        else:
            b_w = tl.load(p.to(tl.pointer_type(tl.int64)), mask=m, other=0)
        b_bad |= tl.max((m & ((b_w & EXP) == EXP)).to(tl.int32), axis=1)
    i_first = tl.min(tl.where(b_bad != 0, o_t * num_sources + s_index, INT64_MAX), axis=0)
    tl.atomic_min(p_first, i_first, mask=i_first < INT64_MAX, sem="relaxed")


@triton.jit
def _nonfinite_push_kernel(p_first, num_sources, p_tags, p_index, p_loc, p_pos, p_ids, p_offsets, num_requests,
                           p_writers, p_ring, p_write_index, ring_capacity, HAS_WRITERS: tl.constexpr):
    # the row of the first (token, source) found, if any; the scratch is reset for the next forward
    o = tl.arange(0, 2)
    b_first = tl.load(p_first + o * 0)
    m = (o == 0) & (b_first < INT64_MAX)
    b_t = tl.where(m, b_first // num_sources, 0)
    b_s = tl.where(m, b_first % num_sources, 0)
    b_row = violation_rows(tl.load(p_tags + b_s)[:, None], tl.load(p_loc + b_t).to(tl.int64),
                           tl.load(p_pos + b_t).to(tl.int64), tl.load(p_ids + b_t).to(tl.int64),
                           tl.full([2], -1, tl.int64), _request_of(b_t, p_offsets, num_requests, p_writers, HAS_WRITERS),
                           tl.load(p_index + b_s), tl.full([2], NONFINITE_C, tl.int64), tl.arange(0, 8))
    push_violations(m, b_row, p_ring, p_write_index, ring_capacity)
    tl.store(p_first + o, tl.full([2], INT64_MAX, tl.int64), mask=o == 0)


def reserved_reads(*, entries, reserved, ring, launch_tag, bound=None, host_reads=None) -> None:
    n = entries.capacity if bound is None else max(0, min(entries.capacity, bound))
    if not n:
        return
    programs = max(1, min(triton_ops._cdiv(n, RESERVED_BLOCK), RESERVED_PROGRAMS))
    triton_ops._launch(_reserved_reads_kernel, (programs,),
        p_slot=entries.slot, p_pos=entries.position, p_exp=entries.expected_token, p_prev=entries.prev,
        p_count=entries.count, p_enable=entries.enable, bound=n, p_mask=reserved.view(torch.uint8),
        mask_len=reserved.shape[0], p_ring=ring.rows, p_write_index=ring.write_index, ring_capacity=ring.capacity,
        launch_tag=launch_tag, BLOCK=RESERVED_BLOCK,
    )


def reserved_writes(*, out_cache_loc, write_offsets, num_requests, positions, input_ids, writer_ids, reserved, ring,
                    launch_tag, host_reads=None) -> None:
    n = out_cache_loc.shape[0]
    if not n:
        return
    triton_ops._launch(_reserved_writes_kernel, (triton_ops._cdiv(n, RESERVED_BLOCK),),
        p_loc=out_cache_loc, num_tokens=n, p_offsets=write_offsets, num_requests=num_requests, p_pos=positions,
        p_ids=input_ids, p_writers=out_cache_loc if writer_ids is None else writer_ids,
        p_mask=reserved.view(torch.uint8), mask_len=reserved.shape[0], p_ring=ring.rows,
        p_write_index=ring.write_index, ring_capacity=ring.capacity, launch_tag=launch_tag,
        HAS_WRITERS=writer_ids is not None, BLOCK=RESERVED_BLOCK,
    )


def nonfinite(*, out_cache_loc, write_offsets, num_requests, positions, input_ids, writer_ids, num_slots, sources,
              tags, index, ring, scratch, host_reads=None) -> None:
    """``scratch``: int64 [1] holding ``slot_ops.NO_HIT`` (the push kernel leaves it so)."""
    n = out_cache_loc.shape[0]
    if not n or not sources:
        return
    for dtype, first, table in _width_groups(sources):
        # one launch per float width (a model has one): its sources are the grid's second axis
        triton_ops._launch(_nonfinite_kernel, (triton_ops._cdiv(n, NONFINITE_TOKENS), table.shape[0]),
            p_loc=out_cache_loc, num_tokens=n, p_offsets=write_offsets, num_requests=num_requests,
            num_slots=num_slots, p_base=sources[first].tensor, p_table=table, p_first=scratch, num_sources=len(sources),
            EXP=EXPONENT[dtype], WORD=dtype.itemsize, BLOCK_T=NONFINITE_TOKENS, BLOCK_W=NONFINITE_WORDS,
        )
    triton_ops._launch(_nonfinite_push_kernel, (1,),
        p_first=scratch, num_sources=len(sources), p_tags=tags, p_index=index, p_loc=out_cache_loc, p_pos=positions,
        p_ids=input_ids, p_offsets=write_offsets, num_requests=num_requests,
        p_writers=out_cache_loc if writer_ids is None else writer_ids, p_ring=ring.rows,
        p_write_index=ring.write_index, ring_capacity=ring.capacity, HAS_WRITERS=writer_ids is not None,
    )


# the sources' ids -> (weak references to them, their groups): the runtime passes the same sources every step, and
# a cache entry keeps no KV pool alive after its engine is gone
_GROUPS: dict = {}


def _width_groups(sources) -> list:
    """``sources`` grouped by float type: (dtype, the index of its first source, int64 [k, TABLE_COLUMNS] table
    on its device: byte offsets from that source), made once per set of sources (a pool's tensors stay put)."""
    key = tuple(map(id, sources))
    known = _GROUPS.get(key)
    if known is not None and all(ref() is src for ref, src in zip(known[0], sources)):
        return known[1]
    by_type: dict = {}
    for s, src in enumerate(sources):
        by_type.setdefault(src.tensor.dtype, []).append((s, src))
    groups = []
    for dtype, members in by_type.items():
        first = members[0][1].tensor.data_ptr()
        rows = [[src.tensor.data_ptr() - first, src.row_stride_bytes, src.page_size, src.num_bytes_per_token,
                 src.num_slots, s] for s, src in members]
        groups.append((dtype, members[0][0], torch.tensor(rows, dtype=torch.int64, device=members[0][1].tensor.device)))
    if len(_GROUPS) >= 64:
        _GROUPS.clear()
    _GROUPS[key] = ([weakref.ref(src) for src in sources], groups)
    return groups
