"""The transformers adapter's host index work on the CPU as compiled loops (numba), for the numba backend.

An eager CPU step fills the batch's read table from the engine's read index on the host
(``BatchBuilder._fill_host``). As numpy that is half a dozen array operations over a table of
``batch x width`` cells (cumulative sums, an index grid, a clamp, a gather, a row scatter), about 100 us
of a tiny-model decode step at batch 4 and context 256 (dev CPU, 12ca468, host timers). This loop writes
the same cells in one pass: row ``rows[i]`` of ``out`` (never row 0, the padding row) gets, for every column ``c``,
``read[min(start_i + c, clamp_max)]``, where ``start_i`` is the sum of ``prefix + extend`` over the
requests before ``i``, or ``fill`` where ``start_i + c`` is not below ``limit`` (a read index shorter than
the batch). Rows and the read index are bounds-checked: a value the numpy path would reject is an
``IndexError`` here too, never a write outside the table.

``new_reads_match`` is the shortcut of the new tokens' read check (``BatchBuilder.verify_new_reads``): do
the read table's cells of the new tokens hold their write slots? 1 yes, 0 no, -1 where an index is out
of range or the lengths differ (the numpy expression then decides, as before: it wraps negative
indices and raises on others).
"""

from __future__ import annotations

import numba
import numpy as np

from kvcanary.integrations.hf_batch import NO_LIMIT


@numba.njit(cache=True, nogil=True)
def _read_table(out, rows, prefix, extend, read, clamp_max, limit, fill):  # pragma: no cover (compiled)
    n_rows, width, n_read = out.shape[0], out.shape[1], read.shape[0]
    if clamp_max < 0 or clamp_max >= n_read:
        raise IndexError("kv-canary: read table clamp outside the read index")
    start = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0 or r >= n_rows:
            raise IndexError("kv-canary: read table row outside the table")
        if r == 0:  # (the padding row: never filled)
            start += prefix[i] + extend[i]
            continue
        for c in range(width):
            j = start + c
            if j >= limit:
                out[r, c] = fill
            else:
                out[r, c] = read[min(max(j, 0), clamp_max)]
        start += prefix[i] + extend[i]


@numba.njit(cache=True, nogil=True)
def new_reads_match(rtt, rows, token_req, positions, loc):  # pragma: no cover (compiled)
    n_rows, width, n = rtt.shape[0], rtt.shape[1], loc.shape[0]
    if token_req.shape[0] != n or positions.shape[0] != n:
        return -1
    for t in range(n):
        i = token_req[t]
        if i < 0 or i >= rows.shape[0]:
            return -1
        r, p = rows[i], positions[t]
        if r < 0 or r >= n_rows or p < 0 or p >= width:
            return -1
        if rtt[r, p] != loc[t]:
            return 0
    return 1


def read_table(out: np.ndarray, rows: np.ndarray, prefix: np.ndarray, extend: np.ndarray, read: np.ndarray,
               clamp_max: int, limit: int = NO_LIMIT, fill: int = 0) -> None:
    """Fill ``out`` (int64 ``[num_rows, width]``) as documented above; the other arguments are 1-D int
    arrays (``read`` int32 or int64)."""
    _read_table(out, rows, prefix, extend, read, clamp_max, limit, fill)
