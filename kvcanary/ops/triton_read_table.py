"""``read_table`` as one Triton kernel: the CUDA default, and the transformers adapter's device path.

As tensor ops the read table is seven small kernels per step (a cumulative sum, an index grid, a clamp,
a gather, a select, a row scatter): a large share of a fused steady decode step's graph. Here it is one
launch with the exclusive sum of request lengths computed in each program; the cells are those of
``read_table_ops.reference``. On the CPU it runs under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcanary.ops import triton_ops
from kvcanary.ops.types import NO_LIMIT

READ_BLOCK = 256  # columns of the read table per program


@triton.jit(do_not_specialize=["bs", "clamp_max", "limit", "fill", "width", "n_rows"])
def _read_table_kernel(p_rows, p_prefix, p_extend, bs, p_read, clamp_max, limit, fill, p_out, out_s0, width,
                       n_rows, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr):
    # one program per (request, block of BLOCK columns): a long row is many programs side by side, not one
    # program's loop (at batch 1 and 4K columns the loop ran 16 blocks in turn: 7.9 us on the H200)
    i = tl.program_id(0).to(tl.int64)
    o_b = tl.arange(0, BLOCK_B)
    m_b = o_b < bs
    seen = tl.load(p_prefix + o_b, mask=m_b, other=0).to(tl.int64) + \
        tl.load(p_extend + o_b, mask=m_b, other=0).to(tl.int64)
    start = tl.sum(tl.where(o_b < i, seen, 0), axis=0)  # the requests before this one, back to back
    row = tl.load(p_rows + i).to(tl.int64)
    # row 0 (the padding requests', never read) is not filled; a row outside the table writes nothing: on a
    # GPU the rows are not read on the host (that would sync), so this keeps a bad one inside the table
    cols = tl.where((row > 0) & (row < n_rows), width, 0)
    o_c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = o_c < cols
    idx = start + o_c
    got = tl.load(p_read + tl.minimum(tl.maximum(idx, 0), clamp_max), mask=m & (idx < limit), other=0)
    tl.store(p_out + row * out_s0 + o_c, tl.where(idx < limit, got, fill), mask=m)


def launch(out: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor, extend: torch.Tensor, read: torch.Tensor,
           clamp_max: int, limit: int = NO_LIMIT, fill: int = 0) -> None:
    """The kernel on trusted arguments (the adapter's every-step call): ``out``'s columns and the vectors
    contiguous, on one device."""
    bs = rows.shape[0]
    if bs == 0 or out.shape[1] == 0:
        return
    grid = (bs, triton.cdiv(out.shape[1], READ_BLOCK))
    triton_ops._launch(_read_table_kernel, grid, p_rows=rows, p_prefix=prefix, p_extend=extend, bs=bs, p_read=read,
                       clamp_max=clamp_max, limit=limit, fill=fill, p_out=out, out_s0=out.stride(0),
                       width=out.shape[1], n_rows=out.shape[0], BLOCK_B=max(16, triton.next_power_of_2(bs)),
                       BLOCK=READ_BLOCK)


def read_table(out: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor, extend: torch.Tensor,
               read: torch.Tensor, clamp_max: int, limit: int = NO_LIMIT, fill: int = 0) -> None:
    """The backend's entry on tensors of any strides (the kernel steps one element per column and index)."""
    table = out if out.shape[1] < 2 or out.stride(1) == 1 else out.contiguous()
    launch(table, rows.contiguous(), prefix.contiguous(), extend.contiguous(), read.contiguous(), clamp_max, limit,
           fill)
    if table is not out:
        out.copy_(table)
