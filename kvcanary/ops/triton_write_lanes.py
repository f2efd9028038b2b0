"""The write op's kernel for decode-shaped launches: one lane per request (``triton_ops.write`` picks it).

``triton_kernels._write_kernel`` gives each request a program of ``WRITE_BLOCK`` lanes: a long prefill
request's real-KV hashes and hinted copies run in parallel blocks, and its chain walks serially. A decode
step writes one entry per request, so there nearly every lane of those programs is masked off, and each
program still pays its block reductions (cross-warp) and two atomics. Here a program's lanes are requests:
they walk their chains side by side, entry k of every request in iteration k, so a decode write is one
iteration over ``LANES`` requests per program. The stored bytes, counters and violation rows are the other
kernel's for any launch (each request's rows keep their order; rows of different requests are pushed in
any order by both kernels); only its speed depends on the shape, which is why the launcher picks by shape.

A chain hint (the HEAD buffer for a TAIL write) is not needed here: it replaces the serial walk of a long
request, and the walk of one entry costs what checking the hint would.
"""

from __future__ import annotations

import triton.language as tl

from kvcanary.ops.triton_hash import (
    INT64_MAX,
    as_i64,
    as_u64,
    chain_head_like,
    load_record3,
    mix3,
    push_violations,
    record_ptr,
    slot_fingerprint,
    violation_rows,
)
from kvcanary.ops.triton_kernels import _jit


@_jit("num_requests", "num_tokens")
def _write_lanes_kernel(p_buf, stride, num_slots, p_write_offsets, p_seed, num_requests, p_loc, p_ids, p_pos,
                        num_tokens, p_ring, p_write_index, ring_capacity, p_counters, launch_tag,
                        src_ptrs, src_row_stride, src_page_size, src_nbpt, src_nbytes, src_rows,
                        p_exp_ids, p_exp_pos, p_chain_check, p_writer_ids, p_step,
                        NUM_SOURCES: tl.constexpr, ALIGNED: tl.constexpr, HAS_EXP_IDS: tl.constexpr,
                        HAS_EXP_POS: tl.constexpr, HAS_CHAIN_CHECK: tl.constexpr, ATTRIBUTION: tl.constexpr,
                        HAS_WRITER_IDS: tl.constexpr, HAS_STEP: tl.constexpr, LANES: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    i_tag = tl.full((), launch_tag, tl.int64)
    if i_b == 0:
        tl.atomic_add(p_counters + i_tag * 2, 1, sem="relaxed")
    o_r = i_b * LANES + tl.arange(0, LANES)  # [LANES] requests
    m_r = o_r < num_requests
    # a negative start reads nothing out of bounds; an end past the tokens stops at them
    b_start = tl.maximum(tl.load(p_write_offsets + o_r, mask=m_r, other=0), 0)
    b_end = tl.minimum(tl.load(p_write_offsets + o_r + 1, mask=m_r, other=0), num_tokens)
    # each chain starts from its seed record, read before any lane stores (as each program of the other kernel
    # reads its seed before storing): any slot of the buffer is a predecessor, anything else is the chain head
    b_seed = tl.load(p_seed + o_r, mask=m_r, other=-1)
    m_seed = m_r & (b_seed >= 0) & (b_seed < num_slots)
    s_tok, s_pos, s_prev = load_record3(p_buf, b_seed, m_seed, stride)
    b_running = tl.where(m_seed, mix3(s_prev, s_tok, s_pos), chain_head_like(s_tok))
    b_prev_pos = as_i64(s_pos)
    if HAS_CHAIN_CHECK:
        # only a seeded request has a position to continue from (the flag broadcast first: the interpreter's
        # scalar-bool & vector-bool yields int32 data, which it then refuses as a mask)
        m_armed = m_seed & ((b_seed * 0 + tl.load(p_chain_check)) != 0)
    if ATTRIBUTION:
        b_writer = tl.full([LANES], -1, tl.int64)
        if HAS_WRITER_IDS:
            b_writer = tl.load(p_writer_ids + o_r, mask=m_r, other=-1).to(tl.int64)
        i_step = tl.full((), -1, tl.int64)
        if HAS_STEP:
            i_step = tl.load(p_step)
    o_f = tl.arange(0, 8)
    b_live = tl.zeros([LANES], tl.int64)
    n_iter = tl.max(b_end - b_start, axis=0)
    for k in range(0, n_iter):
        b_i = b_start + k
        m = m_r & (b_i < b_end)
        b_slot = tl.load(p_loc + b_i, mask=m, other=-1).to(tl.int64)
        b_tok = tl.load(p_ids + b_i, mask=m, other=0).to(tl.int64)
        b_pos = tl.load(p_pos + b_i, mask=m, other=0).to(tl.int64)
        m_live = b_slot >= 0  # entries with a negative slot are skipped altogether: no check, no record, no link
        b_live += m_live.to(tl.int64)
        m_in = m_live & (b_slot < num_slots)
        p_rec = record_ptr(p_buf, b_slot, stride)
        b_fp = slot_fingerprint(b_slot, m_in, src_ptrs, src_row_stride, src_page_size, src_nbpt, src_nbytes,
                                src_rows, NUM_SOURCES=NUM_SOURCES, ALIGNED=ALIGNED)
        tl.store(p_rec + 3, as_i64(b_fp), mask=m_in)
        if ATTRIBUTION:
            tl.store(p_rec + 4, b_writer, mask=m_in)
            tl.store(p_rec + 5, tl.zeros_like(b_slot) + i_step, mask=m_in)
        # the write-input row, then the chain-position row (per request in that order, as the serial walk)
        if HAS_EXP_IDS or HAS_EXP_POS:
            b_reason = tl.zeros_like(b_slot)
            b_exp_tok = b_tok
            b_exp_pos = b_pos
            if HAS_EXP_IDS:
                b_exp_tok = tl.load(p_exp_ids + b_i, mask=m, other=0).to(tl.int64)
                b_reason = tl.where(b_tok != b_exp_tok, b_reason | 8, b_reason)
            if HAS_EXP_POS:
                b_exp_pos = tl.load(p_exp_pos + b_i, mask=m, other=0).to(tl.int64)
                b_reason = tl.where(b_pos != b_exp_pos, b_reason | 16, b_reason)
            m_fail = m_live & (b_reason != 0)
            if tl.max(m_fail.to(tl.int32), axis=0) > 0:  # (a clean block pushes nothing: no reductions)
                b_rows = violation_rows(i_tag, b_slot, b_pos, b_tok, b_exp_tok, as_i64(b_running), b_exp_pos,
                                        b_reason, o_f)
                push_violations(m_fail, b_rows, p_ring, p_write_index, ring_capacity)
        if HAS_CHAIN_CHECK:
            # prev_pos + 1 overflowing int64 never equals a position
            m_gap = m_live & m_armed & ((b_pos != b_prev_pos + 1) | (b_prev_pos == INT64_MAX))
            if tl.max(m_gap.to(tl.int32), axis=0) > 0:
                b_rows = violation_rows(i_tag, b_slot, b_pos, b_tok, b_tok, as_i64(b_running), b_prev_pos + 1,
                                        tl.zeros_like(b_slot) + 16, o_f)
                push_violations(m_gap, b_rows, p_ring, p_write_index, ring_capacity)
        tl.store(p_rec, b_tok, mask=m_in)
        tl.store(p_rec + 1, b_pos, mask=m_in)
        tl.store(p_rec + 2, as_i64(b_running), mask=m_in)
        b_running = tl.where(m_live, mix3(b_running, as_u64(b_tok), as_u64(b_pos)), b_running)
        b_prev_pos = tl.where(m_live, b_pos, b_prev_pos)
    n_live = tl.sum(b_live, axis=0)
    tl.atomic_add(p_counters + i_tag * 2 + 1, n_live, mask=n_live > 0, sem="relaxed")
