"""Triton kernel of the step snapshot (``kvcanary.ops.snapshot_ops`` has its contract, reference and tensor-op
twin): one launch in place of a ring copy, a clamp per buffer size and a gather per record buffer. Its blocks of
rows past the step's count return at once, so a clean step copies no row and gathers no record; nothing is read
on the host and the grid comes from static sizes (captured with the step's close)."""

from __future__ import annotations

import triton
import triton.language as tl

from kvcanary.ops import triton_ops
from kvcanary.ops.snapshot_ops import record_table

SNAPSHOT_ROWS = 64  # rows per program
ROW_WORDS = 8  # a violation row's fields


@triton.jit
def _snapshot_kernel(p_rows, p_write_index, capacity, p_out_rows, p_rec, p_table, num_records, p_out_rec,
                     rec_rows, rec_words, BLOCK: tl.constexpr, WORDS: tl.constexpr, ROW: tl.constexpr):
    count = tl.minimum(tl.load(p_write_index), capacity)
    r0 = tl.program_id(0).to(tl.int64) * BLOCK
    if r0 < count:
        o_r = r0 + tl.arange(0, BLOCK)
        o_f = tl.arange(0, ROW)
        m_r = o_r < count
        b_row = tl.load(p_rows + o_r[:, None] * ROW + o_f[None, :], mask=m_r[:, None], other=0)
        tl.store(p_out_rows + o_r[:, None] * ROW + o_f[None, :], b_row, mask=m_r[:, None])
        m_k = m_r & (o_r < rec_rows)
        b_slot = tl.load(p_rows + o_r * ROW + 1, mask=m_k, other=0)
        o_w = tl.arange(0, WORDS)
        m_w = m_k[:, None] & (o_w < rec_words)[None, :]
        for k in range(num_records):
            offset, slots, stride = tl.load(p_table + k * 3), tl.load(p_table + k * 3 + 1), tl.load(p_table + k * 3 + 2)
            b_at = tl.minimum(tl.maximum(b_slot, 0), slots - 1)
            b_rec = tl.load(p_rec + offset + b_at[:, None] * stride + o_w[None, :], mask=m_w, other=0)
            tl.store(p_out_rec + (k * rec_rows + o_r[:, None]) * rec_words + o_w[None, :], b_rec, mask=m_w)


def snapshot_rows(*, rows, write_index, out_rows, records, record_at=None, out_records=None) -> None:
    capacity = rows.shape[0]
    has_records = out_records is not None and len(records) > 0
    if record_at is None and has_records:
        record_at = record_table(records, rows.device)
    words = out_records.shape[2] if has_records else 1
    triton_ops._launch(_snapshot_kernel, (triton_ops._cdiv(capacity, SNAPSHOT_ROWS),),
        p_rows=rows, p_write_index=write_index, capacity=capacity, p_out_rows=out_rows,
        p_rec=records[0] if has_records else rows, p_table=record_at if has_records else write_index,
        num_records=len(records) if has_records else 0, p_out_rec=out_records if has_records else out_rows,
        rec_rows=out_records.shape[1] if has_records else 0, rec_words=words,
        BLOCK=SNAPSHOT_ROWS, WORDS=triton.next_power_of_2(words), ROW=ROW_WORDS,
    )
