"""Triton kernels of the attention-metadata check (``kvcanary.ops.attention_ops`` has the contract, the scalar
reference and the tensor-op twin).

As tensor ops the pass and its two ring pushes are some 60-80 small launches, each a node of the step's recorded
work that the engine's next forward waits for. Here it is three launches, each capturable (grids from static
shapes, nothing read on the host):

1. ``_attention_layout_kernel`` (one program): each request's key and query starts (running sums over the batch,
   a block of requests at a time), its kept prefix, a per-request "first mismatch" cell reset to ``NO_MISMATCH``;
   then the key-length compare, pushing KEY_LENGTH rows in request order.
2. ``_attention_mask_kernel`` over (query-row block, column block) tiles of the mask: each live row finds its
   request (a binary search in the query starts), compares its cells with the layout's rule and, where some
   differ, takes the atomic min of ``row * keys + column`` of its first one into its request's cell: the
   request's first mismatching query, then column, whatever order the tiles run in.
3. ``_attention_push_kernel`` (one program): one ATTENTION_MASK row per request whose cell was set, in request
   order, after the key-length rows (the order the other implementations push in, so a ring that overflows keeps
   the same rows).

The scratch ``layout`` is int64 ``[4, bs + 1]``: key starts (``[bs]`` = the batch's keys), query starts (``[bs]``
= its live query rows), kept prefixes, first mismatches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcanary.ops import triton_ops
from kvcanary.ops.attention_ops import LENGTH_BAD, MASK_BAD, torch_check_attention
from kvcanary.ops.triton_hash import INT64_MAX, push_violations, violation_rows

LENGTH_BAD_C = tl.constexpr(LENGTH_BAD)
MASK_BAD_C = tl.constexpr(MASK_BAD)
NO_MISMATCH = INT64_MAX  # a request's first-mismatch cell while none was found
REQUEST_BLOCK = 128  # requests per step of the layout and push programs
MASK_ROWS = 16  # query rows per tile (fewer for a smaller mask: a decode step's one row per request)
MASK_COLS = 128  # key columns per tile
# mask dtypes the kernel reads (bool as bytes); others take the tensor ops
_FLOAT_MASKS = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["window", "tag"])
def _attention_layout_kernel(p_rows, p_prefix, p_extend, p_ids, bs, window, p_cu, n_cu, p_lay, lay_stride, tag,
                             p_ring, p_write_index, ring_capacity, HAS_CU: tl.constexpr, BLOCK: tl.constexpr):
    k0 = tl.program_id(0).to(tl.int64) * 0  # keys, query rows of the requests before the block
    q0 = tl.program_id(0).to(tl.int64) * 0
    o_f = tl.arange(0, 8)
    b_tag = (tl.zeros([BLOCK], tl.int64) + tag)[:, None]
    for b0 in range(0, bs, BLOCK):
        o_b = b0 + tl.arange(0, BLOCK)
        m_b = o_b < bs
        b_real = m_b & (tl.load(p_rows + o_b, mask=m_b, other=0) != 0)
        b_prefix = tl.load(p_prefix + o_b, mask=m_b, other=0).to(tl.int64)
        b_extend = tl.load(p_extend + o_b, mask=m_b, other=0).to(tl.int64)
        # kept prefix: all of it, or its last `window` positions in a sliding-window group
        b_window = tl.zeros([BLOCK], tl.int64) + window
        b_kept = tl.where(b_real, tl.where(b_window > 0, tl.minimum(b_prefix, b_window), b_prefix), 0)
        b_len = tl.where(b_real, b_kept + b_extend, 0)
        b_nq = tl.where(b_real, b_extend, 0)
        b_kstart = k0 + tl.cumsum(b_len, axis=0) - b_len
        b_qstart = q0 + tl.cumsum(b_nq, axis=0) - b_nq
        tl.store(p_lay + o_b, b_kstart, mask=m_b)
        tl.store(p_lay + lay_stride + o_b, b_qstart, mask=m_b)
        tl.store(p_lay + 2 * lay_stride + o_b, b_kept, mask=m_b)
        tl.store(p_lay + 3 * lay_stride + o_b, tl.full([BLOCK], NO_MISMATCH, tl.int64), mask=m_b)
        if HAS_CU:
            # an engine that lists fewer sequences: its last offset repeats
            b_start = tl.load(p_cu + tl.minimum(o_b, n_cu - 1), mask=m_b, other=0).to(tl.int64)
            b_got = tl.load(p_cu + tl.minimum(o_b + 1, n_cu - 1), mask=m_b, other=0).to(tl.int64) - b_start
            m_bad = b_real & ((b_got != b_len) | (b_start != b_kstart))
            b_id = tl.load(p_ids + o_b, mask=m_bad, other=0).to(tl.int64)
            b_row = violation_rows(b_tag, tl.full([BLOCK], -1, tl.int64), b_prefix, b_got, b_len, b_id,
                                   b_start, tl.full([BLOCK], LENGTH_BAD_C, tl.int64), o_f)
            push_violations(m_bad, b_row, p_ring, p_write_index, ring_capacity)
        k0 += tl.sum(b_len, axis=0)
        q0 += tl.sum(b_nq, axis=0)
    tl.store(p_lay + bs, k0)
    tl.store(p_lay + lay_stride + bs, q0)


@triton.jit
def _allowed(b_cell, IS_BOOL: tl.constexpr, LOWEST: tl.constexpr):
    # which cells let attention see the key (attention_ops.allowed_of): True, or above the dtype's lowest
    if IS_BOOL:
        return b_cell != 0
    return b_cell.to(tl.float32) > LOWEST


@triton.jit(do_not_specialize=["window"])
def _attention_mask_kernel(p_mask, num_rows, num_cols, s_t, s_c, p_lay, lay_stride, bs, search_steps, window,
                           IS_BOOL: tl.constexpr, LOWEST: tl.constexpr, BATCH_KEYS_ONLY: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    o_c = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    m_t = (o_t < num_rows) & (o_t < tl.load(p_lay + lay_stride + bs))  # the batch's live query rows
    if tl.sum(m_t.to(tl.int32), axis=0) > 0:
        # each row's request: how many requests end at or before it (query starts [1, bs] are non-decreasing;
        # a padding request, with no rows, is never the one found)
        b_lo = tl.zeros([BLOCK_T], tl.int64)
        b_hi = tl.zeros([BLOCK_T], tl.int64) + bs
        for _ in range(search_steps):
            m_go = b_lo < b_hi
            b_mid = (b_lo + b_hi) // 2
            m_le = tl.load(p_lay + lay_stride + 1 + b_mid, mask=m_t & m_go, other=0) <= o_t
            b_lo = tl.where(m_go & m_le, b_mid + 1, b_lo)
            b_hi = tl.where(m_go & ~m_le, b_mid, b_hi)
        b_r = tl.minimum(b_lo, bs - 1)
        b_kstart = tl.load(p_lay + b_r, mask=m_t, other=0)
        b_len = tl.load(p_lay + b_r + 1, mask=m_t, other=0) - b_kstart
        b_lim = o_t - tl.load(p_lay + lay_stride + b_r, mask=m_t, other=0) \
            + tl.load(p_lay + 2 * lay_stride + b_r, mask=m_t, other=0)  # query index + kept prefix
        b_j = o_c[None, :] - b_kstart[:, None]  # [BLOCK_T, BLOCK_K] key index in the row's request
        m_want = (b_j >= 0) & (b_j < b_len[:, None]) & (b_j <= b_lim[:, None])
        b_window = tl.zeros([BLOCK_T], tl.int64) + window
        m_want = m_want & ((b_window[:, None] == 0) | (b_j > (b_lim - b_window - 1)[:, None]))
        m_c = o_c < num_cols
        if BATCH_KEYS_ONLY:  # (the bound on the device: a recorded step replays it for each step's batch)
            m_c = m_c & (o_c < tl.load(p_lay + bs))
        m = m_t[:, None] & m_c[None, :]
        b_cell = tl.load(p_mask + o_t[:, None] * s_t + o_c[None, :] * s_c, mask=m, other=0)
        m_diff = m & (_allowed(b_cell, IS_BOOL, LOWEST) != m_want)
        b_first = tl.min(tl.where(m_diff, o_c[None, :], num_cols), axis=1)  # each row's first differing column
        m_hit = b_first < num_cols
        tl.atomic_min(p_lay + 3 * lay_stride + b_r, o_t * num_cols + b_first, mask=m_hit, sem="relaxed")


@triton.jit(do_not_specialize=["tag"])
def _attention_push_kernel(p_lay, lay_stride, bs, num_cols, p_ids, p_mask, s_t, s_c, p_slots, n_slots, p_pos, n_pos,
                           tag, p_ring, p_write_index, ring_capacity, IS_BOOL: tl.constexpr, LOWEST: tl.constexpr,
                           BLOCK: tl.constexpr):
    o_f = tl.arange(0, 8)
    b_tag = (tl.zeros([BLOCK], tl.int64) + tag)[:, None]
    for b0 in range(0, bs, BLOCK):
        o_b = b0 + tl.arange(0, BLOCK)
        m_b = o_b < bs
        b_first = tl.load(p_lay + 3 * lay_stride + o_b, mask=m_b, other=NO_MISMATCH)
        m_hit = m_b & (b_first != NO_MISMATCH)
        b_first = tl.where(m_hit, b_first, 0)
        b_t = b_first // num_cols
        b_c = b_first - b_t * num_cols
        b_seen = _allowed(tl.load(p_mask + b_t * s_t + b_c * s_c, mask=m_hit, other=0), IS_BOOL, LOWEST)
        b_seen = b_seen.to(tl.int64)
        b_slot = tl.load(p_slots + b_c, mask=m_hit & (b_c < n_slots), other=-1).to(tl.int64)
        b_pos = tl.load(p_pos + tl.minimum(b_t, n_pos - 1), mask=m_hit, other=0).to(tl.int64)
        b_id = tl.load(p_ids + o_b, mask=m_hit, other=0).to(tl.int64)
        b_row = violation_rows(b_tag, b_slot, b_pos, b_seen, 1 - b_seen, b_id, b_c,
                               tl.full([BLOCK], MASK_BAD_C, tl.int64), o_f)
        push_violations(m_hit, b_row, p_ring, p_write_index, ring_capacity)


def check_attention(*, req_pool_indices, prefix_lens, extend_lens, positions, request_ids, window, cu_seqlens_k,
                    mask, key_slots, launch_tag, ring, host_reads=None, batch_keys_only: bool = False) -> None:
    """``attention_ops``' pass in at most three launches (``host_reads`` is unused: nothing is read on the host).
    A mask of another dtype than bool, float16, bfloat16 or float32 takes the tensor ops."""
    bs = req_pool_indices.shape[0]
    if not bs:
        return
    if mask is not None and mask.dtype != torch.bool and mask.dtype not in _FLOAT_MASKS:
        torch_check_attention(req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_lens=extend_lens,
                              positions=positions, request_ids=request_ids, window=window, cu_seqlens_k=cu_seqlens_k,
                              mask=mask, key_slots=key_slots, launch_tag=launch_tag, ring=ring,
                              host_reads=host_reads, batch_keys_only=batch_keys_only)
        return
    has_mask = mask is not None and mask.shape[0] > 0 and mask.shape[1] > 0
    if cu_seqlens_k is None and not has_mask:
        return
    flat = triton_ops._flat
    rows = flat(req_pool_indices)
    ids = rows if request_ids is None else flat(request_ids)
    cu = None if cu_seqlens_k is None else flat(cu_seqlens_k.reshape(-1))
    if cu is not None and not cu.shape[0]:
        raise ValueError(f"kv-canary: check_attention cu_seqlens_k must hold at least one offset, got shape "
                         f"{tuple(cu_seqlens_k.shape)}")
    layout = torch.empty(4, bs + 1, dtype=torch.int64, device=rows.device)
    ring_args = dict(p_ring=ring.rows, p_write_index=ring.write_index, ring_capacity=ring.capacity)
    triton_ops._launch(_attention_layout_kernel, (1,),
        p_rows=rows, p_prefix=flat(prefix_lens), p_extend=flat(extend_lens), p_ids=ids, bs=bs, window=int(window),
        p_cu=rows if cu is None else cu, n_cu=0 if cu is None else cu.shape[0], p_lay=layout, lay_stride=bs + 1,
        tag=int(launch_tag), **ring_args, HAS_CU=cu is not None, BLOCK=REQUEST_BLOCK,
    )
    if not has_mask:
        return
    num_rows, num_cols = mask.shape
    cells = mask.view(torch.uint8) if mask.dtype == torch.bool else mask  # (bool read as bytes, in place)
    is_bool = mask.dtype == torch.bool
    lowest = 0.0 if is_bool else float(torch.finfo(mask.dtype).min)
    block_t = min(MASK_ROWS, triton.next_power_of_2(num_rows))
    grid = (triton_ops._cdiv(num_rows, block_t), triton_ops._cdiv(num_cols, MASK_COLS))
    triton_ops._launch(_attention_mask_kernel, grid,
        p_mask=cells, num_rows=num_rows, num_cols=num_cols, s_t=cells.stride(0), s_c=cells.stride(1), p_lay=layout,
        lay_stride=bs + 1, bs=bs, search_steps=bs.bit_length(), window=int(window), IS_BOOL=is_bool, LOWEST=lowest,
        BATCH_KEYS_ONLY=bool(batch_keys_only), BLOCK_T=block_t, BLOCK_K=MASK_COLS,
    )
    pos = flat(positions.reshape(-1))
    slots = None if key_slots is None else flat(key_slots.reshape(-1))
    triton_ops._launch(_attention_push_kernel, (1,),
        p_lay=layout, lay_stride=bs + 1, bs=bs, num_cols=num_cols, p_ids=ids, p_mask=cells, s_t=cells.stride(0),
        s_c=cells.stride(1), p_slots=rows if slots is None else slots, n_slots=0 if slots is None else slots.shape[0],
        p_pos=pos, n_pos=pos.shape[0], tag=int(launch_tag), **ring_args, IS_BOOL=is_bool, LOWEST=lowest,
        BLOCK=REQUEST_BLOCK,
    )
