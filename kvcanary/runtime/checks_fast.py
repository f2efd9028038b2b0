"""The CPU's per-forward value checks as one compiled pass (numba), where numba imports.

``check_batch_values`` (checks.py) reads a dozen small tensors and walks the requests in Python: about
75 us of a tiny-model decode step on the dev CPU (batch 4, context 256, host timers, 12ca468), inside a
step whose canary work the goals cap at 15%. ``batch_ok`` answers only "would every check pass?" in one
compiled loop over zero-copy views; where it says no (or cannot say: a flat token history, an
accelerator, no numba) the Python checks run as before and raise their exact error. So it can skip
checks that pass, never one that fails: it is held to the Python checks on the same batches
(tests/test_checks_fast.py).
"""

from __future__ import annotations

import torch

from kvcanary.runtime.batch import ForwardBatch, TokenAppend

_kernel = None  # the compiled pass once built; False where numba does not import


def _compiled():
    global _kernel
    if _kernel is None:
        try:
            import numba
        except Exception:  # (absent, or built for another numpy)
            _kernel = False
        else:
            _kernel = numba.njit(cache=True, nogil=True)(_batch_values_ok)
    return _kernel


def _batch_values_ok(rows, pre, ext, row_limit, cols, n, loc, num_slots, cell_rows, cell_cols, valid_lens,
                     num_rows, max_context):  # pragma: no cover (compiled; checks.py's loop, as a yes or no)
    padding = False
    total = written = 0
    for i in range(rows.shape[0]):
        row, p, e = rows[i], pre[i], ext[i]
        if row < 0 or row >= row_limit or p < 0 or e < 0 or p + e > cols:
            return False
        if (row == 0 and p > 0) or (row != 0 and padding):
            return False
        padding = padding or (row == 0 and e > 0)
        total += e
        if row != 0:
            written += e
    if total != n:
        return False
    for i in range(written):  # (the padding requests' tokens, last, are never written)
        if loc[i] >= num_slots:
            return False
    # (three loops, not one over a tuple: the views' array types may differ, which numba cannot iterate)
    for i in range(cell_rows.shape[0]):
        if cell_rows[i] < 0 or cell_rows[i] >= num_rows:
            return False
    for i in range(cell_cols.shape[0]):
        if cell_cols[i] < 0 or cell_cols[i] >= max_context:
            return False
    for i in range(valid_lens.shape[0]):
        if valid_lens[i] < 0 or valid_lens[i] > max_context:
            return False
    return True


def batch_ok(batch: ForwardBatch, num_rows: int, num_slots: int, max_context: int) -> bool:
    """True only if every check of ``check_batch_values`` passes for ``batch``; False: run them."""
    kernel = _kernel if _kernel is not None else _compiled()
    hist = batch.token_history
    if not kernel or batch.out_cache_loc.device.type != "cpu" or not isinstance(hist, TokenAppend):
        return False
    parts = (batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.out_cache_loc,
             hist.cell_rows, hist.cell_cols, hist.valid_lens)
    if any(t.dtype != torch.int64 or t.dim() != 1 for t in parts):
        return False  # (other dtypes: the Python checks, rather than one compiled variant per dtype)
    rows, pre, ext, loc, cell_rows, cell_cols, valid_lens = (t.numpy() for t in parts)
    table_rows, cols = batch.req_to_token.shape
    return bool(kernel(rows, pre, ext, min(table_rows, num_rows), cols, batch.num_tokens, loc,
                       num_slots, cell_rows, cell_cols, valid_lens, num_rows, max_context))
