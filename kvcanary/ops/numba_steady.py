"""The compiled CPU backend's steady step: one decode step's HEAD and TAIL calls bound once to their arrays.

An engine's steady decode steps pass the same tensors again and again (the canary's buffers, the engine's
input storages, one reused batch), so everything the per-call ops resolve on every call (validation, numpy
views, argument lists, the real-KV sources' storages) is resolved here once, when the runtime binds a plan
(``SteadyCalls``, built by ``runtime/step/steady.py``). Per step: ``before`` (the batch's value checks, the
read table, the token cells, then ``numba_kernels.head``, then the slot and new-read checks) and ``after``
(``numba_kernels.tail`` with the real-KV fingerprints). The records, ring rows and counters are those of the
per-call ops (``numba_ops.head`` / ``tail`` build the same argument lists: ``head_args`` / ``tail_args``).

The index loops below are also the runtime's compiled value checks (``checks.batch_ok``) and the read table's
host path (``read_table_ops.compiled_loop``, ``compiled_new_reads_match``): one definition each.
"""

from __future__ import annotations

import numba
import numpy as np

from kvcanary.format import PARTIAL_READ_BYTES, RealKvMode
from kvcanary.ops import numba_cache, numba_kernels as k
from kvcanary.ops.numba_ops import fill_constants, head_args, tail_args
from kvcanary.ops.numba_views import _np, _storage_bytes

__all__ = ["FALLBACK", "NEW_READS", "RESERVED", "SteadyCalls", "batch_values_ok", "new_reads_match", "read_table"]

jit = numba.njit(cache=True, nogil=True)
NO_LIMIT = (1 << 63) - 1  # (ops.types.NO_LIMIT as a literal: numba's cache keys on this file)
# ``SteadyCalls.before``'s outcomes besides 0 (clean): nothing done (a check the full path reports, or raises,
# failed); HEAD done, a reserved slot among its reads or writes; HEAD done, the new reads' shortcut failed
FALLBACK, RESERVED, NEW_READS = -1, 1, 2


@jit
def read_table_fits(out, rows, read, clamp_max):
    if clamp_max < 0 or clamp_max >= read.shape[0]:
        return False
    for i in range(rows.shape[0]):
        if rows[i] < 0 or rows[i] >= out.shape[0]:
            return False
    return True


@jit
def fill_read_table(out, rows, prefix, extend, read, clamp_max, limit, fill):
    start = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        if r != 0:  # (row 0, the padding row: never filled)
            for c in range(out.shape[1]):
                j = start + c
                out[r, c] = fill if j >= limit else read[min(max(j, 0), clamp_max)]
        start += prefix[i] + extend[i]


@jit
def read_table(out, rows, prefix, extend, read, clamp_max, limit=NO_LIMIT, fill=0):
    """``read_table_ops``' loop: every bound checked before the first cell is written (an IndexError)."""
    if clamp_max < 0 or clamp_max >= read.shape[0]:
        raise IndexError("kv-canary: read table clamp outside the read index")
    if not read_table_fits(out, rows, read, clamp_max):
        raise IndexError("kv-canary: read table row outside the table")
    fill_read_table(out, rows, prefix, extend, read, clamp_max, limit, fill)


@jit
def new_reads_match(rtt, rows, token_req, positions, loc):
    """1: every new token's read cell holds its write slot; 0: one does not; -1: an index out of range."""
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


TOKEN_MAX = 2**31 - 1  # the canary's token table is int32: token ids in [0, TOKEN_MAX] (runtime/checks.py)
MISSING_TOKEN = -2  # (runtime.report.MISSING_TOKEN, which ops cannot import: tests/test_abandon.py pins them equal)


@jit
def batch_values_ok(rows, pre, ext, row_limit, cols, n, loc, num_slots, cell_rows, cell_cols, valid_lens, num_rows,
                    max_context, ids, cell_tokens, missing):
    """``checks.check_batch_values``' checks as a yes or no (no: the Python checks raise their error). ``ids``: the
    input ids, ``cell_tokens``: the token history's cells (``missing``: the one negative value they may hold)."""
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
        if loc[i] >= num_slots or ids[i] < 0 or ids[i] > TOKEN_MAX:
            return False
    for i in range(cell_tokens.shape[0]):
        if (cell_tokens[i] < 0 and cell_tokens[i] != missing) or cell_tokens[i] > TOKEN_MAX:
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


@jit
def _rows_distinct(rows):
    for i in range(rows.shape[0]):
        for j in range(i):
            if rows[i] != 0 and rows[i] == rows[j]:
                return False
    return True


@jit
def _any_reserved(mask, slots):
    for s in slots:
        if 0 <= s < mask.shape[0] and mask[s]:
            return True
    return False


@jit
def _prepare(rows, prefix, extend, loc, cell_rows, cell_cols, cell_tokens, valid, has_cells, rtt, read, clamp_max,
             num_rows, num_slots, max_context, tokens, ids, missing):
    """The checks of an eager step's build and ``host_before`` (False: nothing written), then the read table and
    the token table's new cells (``launch._refill_tokens``)."""
    if not (read_table_fits(rtt, rows, read, clamp_max) and _rows_distinct(rows)
            and batch_values_ok(rows, prefix, extend, min(rtt.shape[0], num_rows), rtt.shape[1], loc.shape[0], loc,
                                num_slots, cell_rows, cell_cols, valid, num_rows, max_context, ids, cell_tokens,
                                missing)):
        return False
    fill_read_table(rtt, rows, prefix, extend, read, clamp_max, NO_LIMIT, 0)
    if has_cells:
        for i in range(cell_rows.shape[0]):
            tokens[cell_rows[i], cell_cols[i]] = np.int32(cell_tokens[i])  # (wraps as numpy's assignment does)
    return True


@jit
def _after_head(rtt, rows, token_req, positions, loc, slot, count, offs, nr, mask, has_mask):
    """``slots.SlotChecks.before``'s and the new reads' shortcut tests (``StepTables.verify_new_reads``)."""
    if has_mask and (_any_reserved(mask, slot[:max(0, min(count[0], slot.shape[0]))])
                     or _any_reserved(mask, loc[:max(0, offs[nr])])):
        return RESERVED
    if new_reads_match(rtt, rows, token_req, positions, loc) != 1 or (has_mask and _any_reserved(mask, loc)):
        return NEW_READS
    return 0


class SteadyCalls:
    """One batch's HEAD and TAIL calls with every argument bound (``bind``); None from ``bind`` where a call
    would take another path (an argument that is not a zero-copy int64 view, a per-call op's own fallback)."""

    @classmethod
    def bind(cls, *, batch, read, clamp_max: int, tokens, has_cells: bool, reserved, num_rows: int, num_slots: int,
             max_context: int, head_kw: tuple, tail_kw: tuple, sources, real_kv_mode: int) -> SteadyCalls | None:
        """``batch``: the reused ``ForwardBatch`` (its tensors and ``token_history``); ``read``: the engine's read
        index; ``tokens``: the canary's token table; ``reserved``: its reserved-slot mask (or None);
        ``head_kw`` / ``tail_kw``: the launcher's fused calls' keyword dicts (``numba_ops.head`` / ``tail``);
        ``sources``, ``real_kv_mode``: the TAIL's real-KV fingerprint."""
        self = cls()
        self.keep = (batch, read)  # (the views below read their memory: ``numba_views._raw``)
        h, t = head_args(*head_kw), tail_args(*tail_kw)
        hist = batch.token_history
        parts = [batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.out_cache_loc, batch.token_req,
                 batch.positions, read] + ([hist.cell_rows, hist.cell_cols, hist.cell_tokens, hist.valid_lens]
                                           if has_cells else [])
        views = [_np(x) for x in parts] + [_np(batch.input_ids), _np(batch.req_to_token), _np(tokens)]
        if (h is None or t is None or not h.views or not t.views or views[-2].dtype != np.int64
                or any(v is None or v.dtype not in (np.int32, np.int64) for v in views)):
            return None
        rows, prefix, extend, loc, token_req, positions = views[:6]
        cells = views[7:11] if has_cells else [np.zeros(0, dtype=np.int64)] * 4
        self.prepare = (rows, prefix, extend, loc, *cells[:3], cells[3], has_cells, views[-2], views[6], clamp_max,
                        num_rows, num_slots, max_context, views[-1], views[-3], MISSING_TOKEN)
        e, offs = head_kw[0]["out"].entries, _np(head_kw[0]["out"].write_offsets)
        mask = np.zeros(0, dtype=np.bool_) if reserved is None else reserved.numpy()
        self.after_head = (views[-2], rows, token_req, positions, loc, _np(e.slot), _np(e.count), offs, rows.shape[0],
                           mask, reserved is not None)
        self.head, self.head_at = fill_constants(h, h.call(), head_kw[1], head_kw[2]), h
        self.tail, self.tail_at = fill_constants(t, t.call(), tail_kw[0], tail_kw[1]), t
        # the real-KV sources' storages, resolved once (``numba_ops._fingerprints``' loop, bound)
        self.sources = [(src.tensor, src.tensor.data_ptr()) for src in sources]
        self.mixes = []
        for src in sources if real_kv_mode != RealKvMode.NONE else ():
            num_bytes = PARTIAL_READ_BYTES if real_kv_mode == RealKvMode.PARTIAL else src.read_bytes
            words, data, base, row_stride, unit = _storage_bytes(src.tensor)
            ps = src.page_size
            self.mixes.append((k.mix_source_words if words else k.mix_source, data, base, row_stride, ps,
                               ps.bit_length() - 1 if ps & (ps - 1) == 0 else -1, src.num_bytes_per_token // unit,
                               src.tensor.shape[0], num_bytes // unit))
        return self

    def before(self) -> int:
        """The step's HEAD: 0 (clean), ``FALLBACK`` (nothing done), ``RESERVED`` or ``NEW_READS`` (HEAD done:
        the caller runs those checks' full paths, which report)."""
        if not _prepare(*self.prepare):
            return FALLBACK
        a, args = self.head_at, self.head.copy()
        for i, view in a.casts:  # (int32 inputs: int64 copies of this step's values, as ``_Args.call`` makes)
            args[i] = view.astype(np.int64)
        # (``numba_ops.head_state``'s two values, set here: a steady step calls into no other module)
        args[a.chain] = a.chain_view is not None and int(a.chain_view[0]) != 0
        args[a.step] = -1 if a.step_view is None else int(a.step_view[0])
        k.head(*args)
        return _after_head(*self.after_head)

    def after(self) -> bool:
        """The step's TAIL (accept, verify, write, step + 1); False, nothing done, where a real-KV source's
        storage moved since ``bind``."""
        for tensor, ptr in self.sources:
            if tensor.data_ptr() != ptr:
                return False
        a, args = self.tail_at, self.tail.copy()
        for i, view in a.casts:
            args[i] = view.astype(np.int64)
        slot, locs = args[a.slots], args[a.locs]
        n = max(0, min(int(a.count[0]), slot.shape[0])) if a.enable[0] else 0
        # one fingerprint pass over the verify's slots and the write's (each slot's hash is its own)
        cells = np.concatenate((slot[:n], locs))
        acc = np.zeros(cells.shape[0], dtype=np.int64)
        if cells.shape[0]:
            for mix, *where in self.mixes:
                mix(acc, cells, *where)
        args[a.verify_fp], args[a.write_fp], args[a.step] = acc[:n], acc[n:], int(a.steps[0])
        k.tail(*args)
        return True


# a kernel above compiles at its first call unless numba's disk cache holds it: say so once (numba_cache.py)
numba_cache.announce(globals())
