"""The step runner's host index work on the CPU as compiled loops (numba), for the numba backend.

An eager CPU step fills the batch's read table from the engine's read index on the host
(``StepTables._fill_host``) with ``kvcanary.ops.read_table``'s compiled loop (``read_table`` here:
``ops/read_table_ops.compiled_loop``, unvalidated; rows and the clamp are bounds-checked inside the loop).

``new_reads_match`` is the shortcut of the new tokens' read check (``StepTables.verify_new_reads``): do
the read table's cells of the new tokens hold their write slots? 1 yes, 0 no, -1 where an index is out
of range or the lengths differ (the numpy expression then decides, as before: it wraps negative
indices and raises on others).
"""

from __future__ import annotations

import numba

from kvcanary.ops.read_table_ops import compiled_loop

__all__ = ["new_reads_match", "read_table"]

read_table = compiled_loop()  # (the module imports numba anyway: the backend is numba)


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

