"""Triton kernels of the canary ops; host launchers live in ``triton_ops``.

Grids come from static shapes only (batch size, plan capacity); every count the
work depends on (plan entries, write offsets, enable flags) is read on device.
Per-step lengths are excluded from specialisation so a new batch never recompiles.
"""

from __future__ import annotations

import triton
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

# Per-step inputs: their lengths and base addresses change between forwards.
_STEP_POINTERS = ["p_flat", "p_offsets", "p_rows", "p_prefix", "p_extend", "p_valid", "p_loc", "p_ids",
                  "p_pos", "p_exp_ids", "p_exp_pos", "p_writer_ids", "p_slots", "p_out"]


def _jit(*lengths: str):
    def wrap(fn):
        names = set(fn.__code__.co_varnames[:fn.__code__.co_argcount])
        return triton.jit(fn, do_not_specialize=[n for n in lengths if n in names],
                          do_not_specialize_on_alignment=[n for n in _STEP_POINTERS if n in names])
    return wrap


@_jit("flat_len")
def _scatter_kernel(p_flat, flat_len, p_offsets, p_rows, p_pool, pool_rows, pool_cols, pool_s0, pool_s1,
                    BLOCK: tl.constexpr):
    i_r = tl.program_id(0).to(tl.int64)
    i_row = tl.load(p_rows + i_r)
    i_start = tl.load(p_offsets + i_r)
    n = tl.minimum(tl.load(p_offsets + i_r + 1) - i_start, pool_cols)
    n = tl.where((i_row >= 0) & (i_row < pool_rows), n, 0)
    for j0 in range(0, n, BLOCK):
        o_j = j0 + tl.arange(0, BLOCK)  # [BLOCK]
        o_src = i_start + o_j
        m = (o_j < n) & (o_src >= 0) & (o_src < flat_len)
        b_tok = tl.load(p_flat + o_src, mask=m)
        tl.store(p_pool + i_row * pool_s0 + o_j * pool_s1, b_tok.to(tl.int32), mask=m)


@_jit("n")
def _fingerprint_kernel(p_slots, n, p_out, src_ptrs, src_row_stride, src_page_size, src_nbpt, src_nbytes, src_rows,
                        NUM_SOURCES: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    o = i_b * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    m = o < n
    b_slot = tl.load(p_slots + o, mask=m, other=0)
    b_fp = slot_fingerprint(b_slot, m, src_ptrs, src_row_stride, src_page_size, src_nbpt, src_nbytes, src_rows,
                            NUM_SOURCES=NUM_SOURCES, ALIGNED=ALIGNED)
    tl.store(p_out + o, as_i64(b_fp), mask=m)


@triton.jit
def _translate(b_x, m, p_swa, swa_len, HAS_SWA: tl.constexpr):
    # full -> SWA slot; values outside the table pass through
    if HAS_SWA:
        m_t = m & (b_x >= 0) & (b_x < swa_len)
        b_x = tl.where(m_t, tl.load(p_swa + b_x, mask=m_t, other=0).to(tl.int64), b_x)
    return b_x


@triton.jit
def _request_plan(o_r, m_r, p_rows, p_prefix, p_extend, num_rows, max_ctx, window):
    # per request: (row, real_row, P, first verified position, entries, write length)
    b_row = tl.load(p_rows + o_r, mask=m_r, other=0).to(tl.int64)
    b_p = tl.minimum(tl.load(p_prefix + o_r, mask=m_r, other=0).to(tl.int64), max_ctx)
    b_ext = tl.load(p_extend + o_r, mask=m_r, other=0).to(tl.int64)
    m_real = m_r & (b_row != 0) & (b_row >= 0) & (b_row < num_rows)
    b_start = tl.where(window > 0, tl.maximum(b_p - window, 0), 0)
    b_n = tl.where(m_real & (b_p > b_start), b_p - b_start, 0)
    b_w = tl.where(m_r & (b_row != 0) & (b_ext > 0), b_ext, 0)
    return b_row, m_real, b_p, b_start, b_n, b_w


@_jit("bs")
def _plan_kernel(p_rows, p_prefix, p_extend, bs, p_rtt, rtt_s0, rtt_s1, num_rows, max_ctx, window, p_swa, swa_len,
                 p_tokens, tok_s0, tok_s1, tok_rows, tok_cols, p_valid, token_offset,
                 p_slot, p_position, p_prev, p_expected, p_count, p_enable, p_requested, capacity,
                 p_write_offsets, offsets_len, p_seed,
                 HAS_SWA: tl.constexpr, HAS_TOKENS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr):
    # program (i_r, i_j) stores blocks i_j, i_j + SPLIT, ... of request i_r's entries
    i_r = tl.program_id(0).to(tl.int64)
    i_j = tl.program_id(1).to(tl.int64)
    n_split = tl.num_programs(1).to(tl.int64)
    # entries of requests before this one and of all requests, write lengths up to and including this one
    n_before = i_r * 0
    n_total = i_r * 0
    w_through = i_r * 0
    for b0 in range(0, bs, BLOCK_B):
        o_b = b0 + tl.arange(0, BLOCK_B)  # [BLOCK_B]
        m_b = o_b < bs
        _, _, _, _, b_n, b_w = _request_plan(o_b, m_b, p_rows, p_prefix, p_extend, num_rows, max_ctx, window)
        n_before += tl.sum(tl.where(o_b < i_r, b_n, 0), axis=0)
        n_total += tl.sum(b_n, axis=0)
        w_through += tl.sum(tl.where(o_b <= i_r, b_w, 0), axis=0)
    m_r = i_r < bs
    i_row, m_real, i_p, i_start, n_r, i_w = _request_plan(i_r, m_r, p_rows, p_prefix, p_extend, num_rows, max_ctx,
                                                          window)
    p_row = p_rtt + i_row * rtt_s0
    if i_j == 0:
        if i_r == 0:
            tl.store(p_requested, n_total)
            tl.store(p_count, tl.minimum(n_total, capacity))
            tl.store(p_enable, (n_total <= capacity).to(tl.int32))
            tl.store(p_write_offsets, i_r * 0)
            # offsets past the batch read 0
            for z0 in range(bs + 1, offsets_len, BLOCK):
                o_z = z0 + tl.arange(0, BLOCK)  # [BLOCK]
                tl.store(p_write_offsets + o_z, tl.zeros_like(o_z).to(tl.int64), mask=o_z < offsets_len)
        tl.store(p_write_offsets + i_r + 1, w_through, mask=m_r)
        # a request that writes nothing has no chain to continue
        m_seed = m_real & (i_w > 0) & (i_p > 0)
        i_seed = tl.load(p_row + (i_p - 1) * rtt_s1, mask=m_seed, other=0).to(tl.int64)
        i_seed = tl.where(m_seed, _translate(i_seed, m_seed, p_swa, swa_len, HAS_SWA=HAS_SWA), -1)
        tl.store(p_seed + i_r, i_seed, mask=m_r)
    if HAS_TOKENS:
        i_valid = tl.load(p_valid + i_r, mask=m_r, other=0).to(tl.int64)
        # a row past the token table has no expected tokens: fold that into the column bound
        i_tok_cols = tl.where(i_row < tok_rows, tok_cols, 0)
    # an overflowing plan stores no entry
    n_store = tl.where(n_total <= capacity, n_r, 0)
    for j0 in range(i_j * BLOCK, n_store, n_split * BLOCK):
        o_j = j0 + tl.arange(0, BLOCK)  # [BLOCK]
        m = o_j < n_store
        o_p = i_start + o_j
        b_slot = tl.load(p_row + o_p * rtt_s1, mask=m, other=0).to(tl.int64)
        b_slot = _translate(b_slot, m, p_swa, swa_len, HAS_SWA=HAS_SWA)
        m_prev = m & (o_p > 0)
        b_prev = tl.load(p_row + (o_p - 1) * rtt_s1, mask=m_prev, other=0).to(tl.int64)
        b_prev = tl.where(m_prev, _translate(b_prev, m_prev, p_swa, swa_len, HAS_SWA=HAS_SWA), -1)
        b_exp = tl.full([BLOCK], -1, tl.int64)
        if HAS_TOKENS:
            o_q = o_p + token_offset
            m_q = m & (o_q >= 0) & (o_q < i_valid) & (o_q < i_tok_cols)
            b_tok = tl.load(p_tokens + i_row * tok_s0 + o_q * tok_s1, mask=m_q, other=0).to(tl.int64)
            b_exp = tl.where(m_q, b_tok, b_exp)
        o_e = n_before + o_j
        tl.store(p_slot + o_e, b_slot, mask=m)
        tl.store(p_position + o_e, o_p, mask=m)
        tl.store(p_prev + o_e, b_prev, mask=m)
        tl.store(p_expected + o_e, b_exp, mask=m)


@triton.jit
def _entry_inputs(p_loc, p_ids, p_pos, p_exp_ids, p_exp_pos, i, m, HAS_EXP_IDS: tl.constexpr,
                  HAS_EXP_POS: tl.constexpr):
    # write entry i's (slot, token, position, expected token, expected position) as int64 scalars; the
    # expectations are the inputs themselves where not given; m False: slot -1 (no entry)
    i_slot = tl.load(p_loc + i, mask=m, other=-1).to(tl.int64)
    i_tok = tl.load(p_ids + i, mask=m, other=0).to(tl.int64)
    i_pos = tl.load(p_pos + i, mask=m, other=0).to(tl.int64)
    e_tok = i_tok
    e_pos = i_pos
    if HAS_EXP_IDS:
        e_tok = tl.load(p_exp_ids + i, mask=m, other=0).to(tl.int64)
    if HAS_EXP_POS:
        e_pos = tl.load(p_exp_pos + i, mask=m, other=0).to(tl.int64)
    return i_slot, i_tok, i_pos, e_tok, e_pos


@_jit("num_requests", "num_tokens")
def _write_kernel(p_buf, stride, num_slots, p_write_offsets, p_seed, num_requests, p_loc, p_ids, p_pos, num_tokens,
                  p_ring, p_write_index, ring_capacity, p_counters, launch_tag,
                  src_ptrs, src_row_stride, src_page_size, src_nbpt, src_nbytes, src_rows,
                  p_exp_ids, p_exp_pos, p_chain_check, p_writer_ids, p_step, p_hint,
                  NUM_SOURCES: tl.constexpr, ALIGNED: tl.constexpr, HAS_EXP_IDS: tl.constexpr,
                  HAS_EXP_POS: tl.constexpr, HAS_CHAIN_CHECK: tl.constexpr, ATTRIBUTION: tl.constexpr,
                  HAS_WRITER_IDS: tl.constexpr, HAS_STEP: tl.constexpr, HAS_HINT: tl.constexpr,
                  BLOCK: tl.constexpr):
    i_r = tl.program_id(0).to(tl.int64)
    i_tag = tl.full((), launch_tag, tl.int64)
    if i_r == 0:
        tl.atomic_add(p_counters + i_tag * 2, 1, sem="relaxed")
    m_r = i_r < num_requests
    # offsets are validated on the host where that is free; elsewhere a negative one must not read out of bounds
    i_start = tl.maximum(tl.load(p_write_offsets + i_r, mask=m_r, other=0), 0)
    i_end = tl.minimum(tl.load(p_write_offsets + i_r + 1, mask=m_r, other=0), num_tokens)
    # the serial walk's first entry (it starts at i_start whenever it runs: a hint is taken whole or not at
    # all), loaded before any store so that the loads overlap the seed's (a decode write is one such entry)
    n_slot, n_tok, n_pos, n_etok, n_epos = _entry_inputs(p_loc, p_ids, p_pos, p_exp_ids, p_exp_pos, i_start,
                                                         i_start < i_end, HAS_EXP_IDS, HAS_EXP_POS)
    # the chain starts from the seed record, read before this request stores anything; any slot of the
    # buffer (slot 0 included) is a predecessor, anything else is the chain head
    i_seed = tl.load(p_seed + i_r, mask=m_r, other=-1)
    m_seed = m_r & (i_seed >= 0) & (i_seed < num_slots)
    s_tok, s_pos, s_prev = load_record3(p_buf, i_seed, m_seed, stride)
    running = tl.where(m_seed, mix3(s_prev, s_tok, s_pos), chain_head_like(s_tok))
    prev_pos = as_i64(s_pos)
    if HAS_CHAIN_CHECK:
        # only a seeded request has a position to continue from
        armed = (tl.load(p_chain_check) != 0) & m_seed
    # order-free fields first: real-KV hash and attribution depend on the slot and request only
    if ATTRIBUTION:
        i_writer = tl.full((), -1, tl.int64)
        if HAS_WRITER_IDS:
            i_writer = tl.load(p_writer_ids + i_r, mask=m_r, other=-1)
        i_step = tl.full((), -1, tl.int64)
        if HAS_STEP:
            i_step = tl.load(p_step)
    n_live = i_r * 0
    for j0 in range(i_start, i_end, BLOCK):
        o = j0 + tl.arange(0, BLOCK)  # [BLOCK]
        m = o < i_end
        b_slot = tl.load(p_loc + o, mask=m, other=-1).to(tl.int64)
        n_live += tl.sum((b_slot >= 0).to(tl.int64), axis=0)
        m_in = m & (b_slot >= 0) & (b_slot < num_slots)
        b_fp = slot_fingerprint(b_slot, m_in, src_ptrs, src_row_stride, src_page_size, src_nbpt, src_nbytes,
                                src_rows, NUM_SOURCES=NUM_SOURCES, ALIGNED=ALIGNED)
        p_rec = record_ptr(p_buf, b_slot, stride)
        tl.store(p_rec + 3, as_i64(b_fp), mask=m_in)
        if ATTRIBUTION:
            tl.store(p_rec + 4, tl.zeros_like(b_slot) + i_writer, mask=m_in)
            tl.store(p_rec + 5, tl.zeros_like(b_slot) + i_step, mask=m_in)
    # entries with a negative slot are skipped altogether and not counted
    tl.atomic_add(p_counters + i_tag * 2 + 1, n_live, mask=n_live > 0, sem="relaxed")
    # A hint (the HEAD buffer, for a TAIL write; never with the HEAD-only asserts, whose rows come in chain
    # order) replaces the serial walk when it holds, at every entry's slot, exactly the record the walk
    # would store: the entry's token and position, and the link of the entry before (the running seed
    # for the first). Then, by induction, each stored chain hash is the walk's, and the records are
    # copied in parallel blocks; any other request walks its chain. The stored bytes are the same.
    i_walk = i_start
    if HAS_HINT:
        n_bad = i_r * 0
        for j0 in range(i_start, i_end, BLOCK):
            o = j0 + tl.arange(0, BLOCK)  # [BLOCK]
            m = o < i_end
            b_slot = tl.load(p_loc + o, mask=m, other=-1).to(tl.int64)
            b_tok = tl.load(p_ids + o, mask=m, other=0).to(tl.int64)
            b_pos = tl.load(p_pos + o, mask=m, other=0).to(tl.int64)
            m_in = m & (b_slot >= 0) & (b_slot < num_slots)
            h_tok, h_pos, h_prev = load_record3(p_hint, b_slot, m_in, stride)
            m_link = m & (o > i_start)
            q_slot = tl.load(p_loc + o - 1, mask=m_link, other=-1).to(tl.int64)
            q_tok = tl.load(p_ids + o - 1, mask=m_link, other=0).to(tl.int64)
            q_pos = tl.load(p_pos + o - 1, mask=m_link, other=0).to(tl.int64)
            m_q = m_link & (q_slot >= 0) & (q_slot < num_slots)
            _, _, q_prev = load_record3(p_hint, q_slot, m_q, stride)
            b_want = tl.where(m_link, mix3(q_prev, as_u64(q_tok), as_u64(q_pos)), running)
            m_ok = m_in & (as_i64(h_tok) == b_tok) & (as_i64(h_pos) == b_pos) & (h_prev == b_want)
            n_bad += tl.sum((m & ~m_ok).to(tl.int64), axis=0)
        i_copy = tl.where(n_bad == 0, i_end, i_start)
        for j0 in range(i_start, i_copy, BLOCK):
            o = j0 + tl.arange(0, BLOCK)  # [BLOCK]
            m = o < i_end
            b_slot = tl.load(p_loc + o, mask=m, other=0).to(tl.int64)
            p_rec = record_ptr(p_buf, b_slot, stride)
            tl.store(p_rec, tl.load(p_ids + o, mask=m, other=0).to(tl.int64), mask=m)
            tl.store(p_rec + 1, tl.load(p_pos + o, mask=m, other=0).to(tl.int64), mask=m)
            tl.store(p_rec + 2, tl.load(record_ptr(p_hint, b_slot, stride) + 2, mask=m, other=0), mask=m)
        i_walk = i_copy
    # the serial chain: live entries in order, each stores the running hash it extends. An entry's inputs are
    # loaded one entry ahead (_entry_inputs), so their loads overlap the hash before them instead of adding
    # a round trip to every link of the chain (the walk is the whole prefill write's time).
    o_f = tl.arange(0, 8)
    for i in range(i_walk, i_end):
        i_slot, i_tok, i_pos, exp_tok, exp_pos = n_slot, n_tok, n_pos, n_etok, n_epos
        n_slot, n_tok, n_pos, n_etok, n_epos = _entry_inputs(p_loc, p_ids, p_pos, p_exp_ids, p_exp_pos, i + 1,
                                                             i + 1 < i_end, HAS_EXP_IDS, HAS_EXP_POS)
        if i_slot >= 0:
            reason = i_slot * 0
            if HAS_EXP_IDS:
                reason = tl.where(i_tok != exp_tok, reason | 8, reason)
            if HAS_EXP_POS:
                reason = tl.where(i_pos != exp_pos, reason | 16, reason)
            # the write-input row, then the chain-position row: two rows when both fail
            if reason != 0:
                b_row = violation_rows(i_tag, i_slot[None], i_pos[None], i_tok[None], exp_tok[None],
                                       as_i64(running)[None], exp_pos[None], reason[None], o_f)
                push_violations(tl.full([1], 1, tl.int1), b_row, p_ring, p_write_index, ring_capacity)
            if HAS_CHAIN_CHECK:
                # prev_pos + 1 overflowing int64 never equals a position
                if armed & ((i_pos != prev_pos + 1) | (prev_pos == INT64_MAX)):
                    b_row = violation_rows(i_tag, i_slot[None], i_pos[None], i_tok[None], i_tok[None],
                                           as_i64(running)[None], (prev_pos + 1)[None], (i_slot * 0 + 16)[None], o_f)
                    push_violations(tl.full([1], 1, tl.int1), b_row, p_ring, p_write_index, ring_capacity)
            m_in = i_slot < num_slots
            p_rec = record_ptr(p_buf, i_slot, stride)
            tl.store(p_rec, i_tok, mask=m_in)
            tl.store(p_rec + 1, i_pos, mask=m_in)
            tl.store(p_rec + 2, as_i64(running), mask=m_in)
            running = mix3(running, as_u64(i_tok), as_u64(i_pos))
            prev_pos = i_pos


@triton.jit
def _verify_block(p_buf, stride, num_slots, m, b_slot, b_prev, b_exp, b_position, p_ring, p_write_index,
                  ring_capacity, i_tag, o_f, src_ptrs, src_row_stride, src_page_size, src_nbpt, src_nbytes, src_rows,
                  NUM_SOURCES: tl.constexpr, ALIGNED: tl.constexpr):
    # one block of entries whose inputs are loaded; lanes outside m are ignored whatever they hold
    m = m & (b_slot != 0)
    m_in = m & (b_slot >= 0) & (b_slot < num_slots)
    b_tok, b_pos, b_hash = load_record3(p_buf, b_slot, m_in, stride)
    b_real = tl.load(record_ptr(p_buf, b_slot, stride) + 3, mask=m_in, other=0).to(tl.uint64, bitcast=True)
    m_link = m & (b_prev > 0) & (b_prev < num_slots)
    l_tok, l_pos, l_hash = load_record3(p_buf, b_prev, m_link, stride)
    b_want = tl.where(b_prev < 0, chain_head_like(b_hash), mix3(l_hash, l_tok, l_pos))
    m_chain = (b_prev != 0) & (b_hash != b_want)
    # the sources may cover slots the canary buffer does not
    b_fp = slot_fingerprint(b_slot, m, src_ptrs, src_row_stride, src_page_size, src_nbpt, src_nbytes,
                            src_rows, NUM_SOURCES=NUM_SOURCES, ALIGNED=ALIGNED)
    b_reason = tl.where(m_chain, 1, 0).to(tl.int64)
    b_reason |= tl.where(as_i64(b_pos) != b_position, 2, 0)
    b_reason |= tl.where(b_real != b_fp, 4, 0)
    b_reason |= tl.where((b_exp != -1) & (as_i64(b_tok) != b_exp), 32, 0)
    m_fail = m & (b_reason != 0)
    # A clean block (the rule) skips building rows and the ring's prefix sum: on a launch that is a few
    # microseconds long, those shuffles and selects are a visible share.
    if tl.max(m_fail.to(tl.int32), axis=0) > 0:
        b_aux = tl.where(m_chain, b_want, b_hash)
        b_row = violation_rows(i_tag, b_slot, as_i64(b_pos), as_i64(b_tok), b_exp, as_i64(b_hash),
                               as_i64(b_aux), b_reason, o_f)
        push_violations(m_fail, b_row, p_ring, p_write_index, ring_capacity)


@triton.jit
def _entry_block(p_slot, p_prev, p_expected, p_position, o, m, CHECK_TOKEN: tl.constexpr, BLOCK: tl.constexpr):
    b_slot = tl.load(p_slot + o, mask=m, other=0)
    b_prev = tl.load(p_prev + o, mask=m, other=0)
    if CHECK_TOKEN:
        b_exp = tl.load(p_expected + o, mask=m, other=-1)
    else:
        b_exp = tl.full([BLOCK], -1, tl.int64)
    b_position = tl.load(p_position + o, mask=m, other=0)
    return b_slot, b_prev, b_exp, b_position


@_jit()
def _verify_kernel(p_buf, stride, num_slots, p_slot, p_position, p_prev, p_expected, p_count, p_enable, capacity,
                   p_ring, p_write_index, ring_capacity, p_counters, launch_tag,
                   src_ptrs, src_row_stride, src_page_size, src_nbpt, src_nbytes, src_rows,
                   NUM_SOURCES: tl.constexpr, ALIGNED: tl.constexpr, CHECK_TOKEN: tl.constexpr,
                   SPECULATE: tl.constexpr, BLOCK: tl.constexpr):
    i_p = tl.program_id(0).to(tl.int64)
    n_p = tl.num_programs(0).to(tl.int64)
    i_tag = tl.full((), launch_tag, tl.int64)
    o_f = tl.arange(0, 8)
    if SPECULATE:
        # One block per program, loaded up to the capacity before the count is known: the entry loads
        # then travel with the count's instead of after it (one memory round trip fewer per launch).
        o = i_p * BLOCK + tl.arange(0, BLOCK)
        b_slot, b_prev, b_exp, b_position = _entry_block(p_slot, p_prev, p_expected, p_position, o, o < capacity,
                                                         CHECK_TOKEN=CHECK_TOKEN, BLOCK=BLOCK)
    m_on = tl.load(p_enable) != 0
    n = tl.where(m_on, tl.maximum(tl.minimum(tl.load(p_count), capacity), 0), 0)
    if i_p == 0:
        # a disabled launch still ran
        tl.atomic_add(p_counters + i_tag * 2, 1, sem="relaxed")
        tl.atomic_add(p_counters + i_tag * 2 + 1, n, mask=n > 0, sem="relaxed")
    if SPECULATE:
        _verify_block(p_buf, stride, num_slots, o < n, b_slot, b_prev, b_exp, b_position, p_ring, p_write_index,
                      ring_capacity, i_tag, o_f, src_ptrs, src_row_stride, src_page_size, src_nbpt, src_nbytes,
                      src_rows, NUM_SOURCES=NUM_SOURCES, ALIGNED=ALIGNED)
    else:
        for b0 in range(i_p * BLOCK, n, n_p * BLOCK):
            o = b0 + tl.arange(0, BLOCK)  # [BLOCK]
            m = o < n
            b_slot, b_prev, b_exp, b_position = _entry_block(p_slot, p_prev, p_expected, p_position, o, m,
                                                             CHECK_TOKEN=CHECK_TOKEN, BLOCK=BLOCK)
            _verify_block(p_buf, stride, num_slots, m, b_slot, b_prev, b_exp, b_position, p_ring, p_write_index,
                          ring_capacity, i_tag, o_f, src_ptrs, src_row_stride, src_page_size, src_nbpt, src_nbytes,
                          src_rows, NUM_SOURCES=NUM_SOURCES, ALIGNED=ALIGNED)


@_jit("num_requests", "num_tokens")
def _accept_kernel(p_head, p_tail, stride, num_slots, p_write_offsets, num_requests, p_loc, num_tokens, p_rewrites,
                   src_ptrs, src_row_stride, src_page_size, src_nbpt, src_nbytes, src_rows,
                   NUM_SOURCES: tl.constexpr, ALIGNED: tl.constexpr, HAS_REWRITES: tl.constexpr,
                   BLOCK: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    # the requests' write ranges back to back: [offsets[0], offsets[num_requests]) (no request: empty)
    i_start = tl.maximum(tl.load(p_write_offsets), 0)
    i_end = tl.minimum(tl.load(p_write_offsets + num_requests), num_tokens)
    o = i_b * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    m = (o >= i_start) & (o < i_end)
    b_slot = tl.load(p_loc + o, mask=m, other=0).to(tl.int64)
    m = m & (b_slot >= 1) & (b_slot < num_slots)
    h_tok, h_pos, h_prev = load_record3(p_head, b_slot, m, stride)
    t_tok, t_pos, t_prev = load_record3(p_tail, b_slot, m, stride)
    m_same = m & (h_tok == t_tok) & (h_pos == t_pos) & (h_prev == t_prev)
    # duplicates of a slot store the same hash: their order cannot matter
    b_fp = slot_fingerprint(b_slot, m_same, src_ptrs, src_row_stride, src_page_size, src_nbpt, src_nbytes,
                            src_rows, NUM_SOURCES=NUM_SOURCES, ALIGNED=ALIGNED)
    tl.store(record_ptr(p_tail, b_slot, stride) + 3, as_i64(b_fp), mask=m_same)
    if HAS_REWRITES:
        n_same = tl.sum(m_same.to(tl.int64), axis=0)
        tl.atomic_add(p_rewrites, n_same, mask=n_same > 0, sem="relaxed")
