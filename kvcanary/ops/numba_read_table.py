"""``read_table`` as one compiled loop (numba): the CPU default, and the adapter's host path where numba imports.

As numpy the read table is half a dozen array operations over ``batch x width`` cells (cumulative sums, an
index grid, a clamp, a gather, a row scatter): about 100 us of a tiny-model decode step at batch 4 and
context 256 on the dev CPU (12ca468, host timers), against 17 us for this single pass. The cells are those
of ``read_table_ops.reference``. Rows and the clamp are bounds-checked inside the loop: a value the numpy path
would reject is an ``IndexError`` here too, raised before any cell is written, never a write outside the
table (the adapter calls ``host_read_table`` unvalidated).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from kvcanary.ops.numba_views import _i64, _raw
from kvcanary.ops.types import NO_LIMIT


@numba.njit(cache=True, nogil=True)
def _read_table(out, rows, prefix, extend, read, clamp_max, limit, fill):  # pragma: no cover (compiled)
    n_rows, width, n_read = out.shape[0], out.shape[1], read.shape[0]
    if clamp_max < 0 or clamp_max >= n_read:
        raise IndexError("kv-canary: read table clamp outside the read index")
    for i in range(rows.shape[0]):  # (all rows checked first: a refused call writes nothing)
        if rows[i] < 0 or rows[i] >= n_rows:
            raise IndexError("kv-canary: read table row outside the table")
    start = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        if r != 0:  # (row 0, the padding row: never filled)
            for c in range(width):
                j = start + c
                out[r, c] = fill if j >= limit else read[min(max(j, 0), clamp_max)]
        start += prefix[i] + extend[i]


def host_read_table(out: np.ndarray, rows: np.ndarray, prefix: np.ndarray, extend: np.ndarray, read: np.ndarray,
                    clamp_max: int, limit: int = NO_LIMIT, fill: int = 0) -> None:
    """On numpy arrays: ``out`` 2-D int32/int64, the others 1-D int arrays (the adapter's reused views)."""
    _read_table(out, rows, prefix, extend, read, clamp_max, limit, fill)


def read_table(out: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor, extend: torch.Tensor,
               read: torch.Tensor, clamp_max: int, limit: int = NO_LIMIT, fill: int = 0) -> None:
    """The backend's entry on CPU tensors of any strides: zero-copy views where they are contiguous."""
    if rows.shape[0] == 0 or out.shape[1] == 0:
        return
    table = out if out.is_contiguous() else out.contiguous()
    read_c = read.contiguous()  # (kept alive while its view is read)
    host_read_table(_raw(table), _i64(rows), _i64(prefix), _i64(extend), _raw(read_c), clamp_max, limit, fill)
    if table is not out:
        out.copy_(table)
