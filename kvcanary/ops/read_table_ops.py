"""The read table: rows of a req_to_token table from an engine's flat read index (``ops.read_table``).

An engine that lists, request after request, the slots its attention reads (transformers' read index:
positions ``[0, prefix + extend)`` of each request back to back) says where each request's KV is read
from; the canary verifies those addresses, so the transformers adapter rebuilds its req_to_token rows
from that list every step. Row ``rows[i]`` of ``out`` gets, for every column ``c < out.shape[1]``,
``read[min(start_i + c, clamp_max)]``, where ``start_i`` is the sum of ``prefix + extend`` over the
requests before ``i``; a cell whose ``start_i + c`` is not below ``limit`` gets ``fill`` instead (a read
index shorter than the batch: the adapter fills an out-of-range slot, which verifies as a never-written
record). Row 0, the padding row, is never filled: its cells keep their values, as do rows no request
names and nothing else of ``out`` changes. Cells past a request's length hold the next requests' slots
(or the clamped last one): a consumer never reads them.

The bodies share one positional signature ``(out, rows, prefix, extend, read, clamp_max, limit, fill)``
and trust their arguments (``validate.check_read_table`` is the public entry's check; the adapter calls
them unvalidated, every decode step): ``reference`` (scalar loops, the oracle), ``torch_read_table``
(tensor ops, any device), ``numpy_read_table`` (numpy arrays: the CPU's host path without numba) and
``numba_read_table`` (one compiled loop, ``compiled_loop``; numba is imported on first use: it is optional
and this module is imported with the adapter). The Triton kernel is in ``triton_read_table.py``. A row
named by two requests gets one request's cells: the last one's in the reference, numpy and numba; on
torch and Triton unspecified.

``compiled_new_reads_match`` compiles a sibling loop for the new tokens' read check's shortcut on the CPU (the
step runner's ``StepTables.verify_new_reads``): do the table's cells of the new tokens hold their write slots?
1 yes, 0 no, -1 where an index is out of range or the lengths differ (the numpy expression then decides, as
before: it wraps negative indices and raises on others).

As numpy the read table is half a dozen array operations over ``batch x width`` cells: about 100 us of a
tiny-model decode step at batch 4 and context 256 on the dev CPU (12ca468, host timers), against 17 us
for the compiled loop, which is why the CPU's host path has both.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvcanary.ops.numba_views import _i64, _raw
from kvcanary.ops.types import NO_LIMIT

__all__ = ["NO_LIMIT", "compiled_loop", "compiled_new_reads_match", "numba_read_table", "numpy_read_table", "reference",
           "torch_read_table"]


def reference(out: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor, extend: torch.Tensor,
              read: torch.Tensor, clamp_max: int, limit: int = NO_LIMIT, fill: int = 0) -> None:
    width = out.shape[1]
    if rows.shape[0] == 0 or width == 0:
        return
    slots = read.tolist()
    start = 0
    for row, p, e in zip(rows.tolist(), prefix.tolist(), extend.tolist()):
        if row != 0:
            cells = [fill if start + c >= limit else slots[min(max(start + c, 0), clamp_max)] for c in range(width)]
            out[row] = torch.tensor(cells, dtype=out.dtype, device=out.device)
        start += p + e


def torch_read_table(out: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor, extend: torch.Tensor,
                     read: torch.Tensor, clamp_max: int, limit: int = NO_LIMIT, fill: int = 0,
                     cols: torch.Tensor | None = None) -> None:
    """``cols``: an int64 ``arange`` of at least ``out.shape[1]`` on ``out``'s device that the caller keeps
    (one kernel fewer per call; the adapter's steps are captured in CUDA graphs with it)."""
    width = out.shape[1]
    if rows.shape[0] == 0 or width == 0:
        return
    seen = prefix + extend
    cols = torch.arange(width, dtype=torch.int64, device=out.device) if cols is None else cols[:width]
    idx = (torch.cumsum(seen, 0) - seen).unsqueeze(1) + cols
    flat = idx.view(-1)
    # (in place where idx is not needed afterwards: one allocation fewer on the every-step path)
    flat = flat.clamp_(max=clamp_max) if limit == NO_LIMIT else flat.clamp(max=clamp_max)
    cells = read.index_select(0, flat).view(idx.shape)
    if limit != NO_LIMIT:
        # (in out's dtype first: a fill beyond an int32 read index's range must not wrap)
        cells = torch.where(idx < limit, cells.to(out.dtype), fill)
    out[rows] = torch.where((rows == 0).unsqueeze(1), out[0], cells)


def numpy_read_table(out: np.ndarray, rows: np.ndarray, prefix: np.ndarray, extend: np.ndarray, read: np.ndarray,
                     clamp_max: int, limit: int = NO_LIMIT, fill: int = 0) -> None:
    """The same cells on numpy arrays (views of the adapter's tensors: on the CPU each tensor op costs the
    host microseconds, a numpy operation on a view far less)."""
    width = out.shape[1]
    if rows.shape[0] == 0 or width == 0:
        return
    seen = prefix + extend
    idx = (np.cumsum(seen) - seen)[:, None] + np.arange(width)
    cells = read[np.minimum(idx, clamp_max)]
    if limit != NO_LIMIT:
        cells = np.where(idx < limit, cells.astype(out.dtype, copy=False), fill)
    out[rows] = np.where((rows == 0)[:, None], out[0], cells)


@functools.lru_cache(maxsize=None)
def compiled_loop():
    """The loop compiled by numba (``numba_steady.read_table``), on numpy arrays (``out`` 2-D int32/int64, the
    others 1-D int arrays): rows and the clamp are bounds-checked before the first cell is written (an
    IndexError: the adapter calls it unvalidated, every decode step). Cached on disk like the other kernels."""
    from kvcanary.ops.numba_steady import read_table

    return read_table


@functools.lru_cache(maxsize=None)
def compiled_new_reads_match():
    """The new tokens' read-check shortcut compiled by numba (``numba_steady.new_reads_match``; the module's
    docstring)."""
    from kvcanary.ops.numba_steady import new_reads_match

    return new_reads_match


def numba_read_table(out: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor, extend: torch.Tensor,
                     read: torch.Tensor, clamp_max: int, limit: int = NO_LIMIT, fill: int = 0) -> None:
    """The numba backend's entry on CPU tensors of any strides: zero-copy views where they are contiguous."""
    if rows.shape[0] == 0 or out.shape[1] == 0:
        return
    table = out if out.is_contiguous() else out.contiguous()
    read_c = read.contiguous()  # (kept alive while its view is read)
    compiled_loop()(_raw(table), _i64(rows), _i64(prefix), _i64(extend), _raw(read_c), clamp_max, limit, fill)
    if table is not out:
        out.copy_(table)
