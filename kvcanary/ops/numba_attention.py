"""The attention-metadata check's pass as one compiled CPU loop (``backend="numba"``; the contract, the scalar
reference and the tensor-op twin are in ``attention_ops``).

As tensor ops the pass is some 35 small operations a forward, each a host call: on the CPU about 0.7 ms of every
decode step of a tiny model, more than the rest of the canary's step. Here it is one loop over zero-copy numpy
views that walks the reference's order (key lengths request by request, then each request's first differing mask
cell), so the ring gets the reference's rows in the reference's order. It runs where its inputs are (the host) and
is not recordable: a step whose work is recorded takes the tensor-op twin (``runtime/attention_check.py``).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from kvcanary.ops import numba_kernels as k
from kvcanary.ops.attention_ops import LENGTH_BAD, MASK_BAD, allowed_of
from kvcanary.ops.numba_views import _i64, _np, _raw

jit = numba.njit(cache=True, nogil=True)


@jit
def _check(rows, prefix, extend, pos, ids, window, cu, mask, lowest, slots, cols_bound, tag, ring_rows, widx):
    bs = rows.shape[0]
    kept = np.zeros(bs, np.int64)
    length = np.zeros(bs, np.int64)
    nq = np.zeros(bs, np.int64)
    for r in range(bs):
        if rows[r] != 0:
            kept[r] = min(prefix[r], window) if window else prefix[r]
            length[r] = kept[r] + extend[r]
            nq[r] = extend[r]
    n = cu.shape[0]
    if n:  # (empty: no key lengths handed over)
        k0 = 0
        for r in range(bs):
            start = cu[min(r, n - 1)]
            got = cu[min(r + 1, n - 1)] - start
            if rows[r] != 0 and (got != length[r] or start != k0):
                k.push(ring_rows, widx, tag, -1, prefix[r], got, length[r], ids[r], start, LENGTH_BAD)
            k0 += length[r]
    T, K = mask.shape
    if not T or not K:
        return
    cols = K
    if cols_bound:  # (batch_keys_only: the columns before the batch's last key)
        total = 0
        for r in range(bs):
            total += length[r]
        cols = min(K, total)
    k0 = 0
    q0 = 0
    for r in range(bs):
        found = False
        ft, fc, fwant = 0, 0, False
        if rows[r] != 0:
            for i in range(nq[r]):
                t = q0 + i
                if t >= T:
                    break
                lim = i + kept[r]
                for c in range(cols):
                    j = c - k0
                    want = j >= 0 and j < length[r] and j <= lim and (window == 0 or j > lim - (window + 1))
                    if (mask[t, c] > lowest) != want:  # (attends: above the dtype's lowest; a bool mask: True)
                        found, ft, fc, fwant = True, t, c, want
                        break
                if found:
                    break
        if found:
            slot = slots[fc] if fc < slots.shape[0] else -1
            p = pos[min(ft, pos.shape[0] - 1)]
            k.push(ring_rows, widx, tag, slot, p, 0 if fwant else 1, 1 if fwant else 0, ids[r], fc, MASK_BAD)
        k0 += length[r]
        q0 += nq[r]


_NONE = np.zeros(0, np.int64)
_NO_MASK = np.zeros((0, 0), np.bool_)
# masks read where they are (a prefill's mask is queries x keys cells: no converted copy), each cell compared with
# a value above which it lets attention see its key (``attention_ops.allowed_of``): a bool's True (as uint8, above
# 0.5), a float's anything above the dtype's lowest. Per dtype: the integer dtype of its size (``_raw`` views those)
# and the numpy dtype its bytes are read as
_IN_PLACE = {torch.bool: (torch.uint8, np.uint8, 0.5),
             torch.float32: (torch.int32, np.float32, float(torch.finfo(torch.float32).min)),
             torch.float64: (torch.int64, np.float64, float(torch.finfo(torch.float64).min))}


def _cells(mask):
    """(cells, the value above which a cell attends) of ``mask``: the engine's buffer viewed in place where it is
    contiguous and numpy reads its dtype (``numba_views._raw``: unlike ``Tensor.numpy`` it leaves the engine's storage
    resizable), else which cells attend as a fresh bool copy (bfloat16, float16, a strided slice)."""
    how = _IN_PLACE.get(mask.dtype)
    if how is not None and mask.is_contiguous():
        as_int, np_dtype, lowest = how
        return _raw(mask.view(as_int)).view(np_dtype), lowest
    return allowed_of(mask).contiguous().numpy(), 0.5


def check_attention(*, req_pool_indices, prefix_lens, extend_lens, positions, request_ids, window, cu_seqlens_k,
                    mask, key_slots, launch_tag, ring, host_reads=None, batch_keys_only: bool = False) -> None:
    if not req_pool_indices.shape[0]:
        return
    i64 = lambda t: _i64(t).reshape(-1)  # noqa: E731
    rows = i64(req_pool_indices)
    ids = i64(request_ids) if request_ids is not None else rows
    cu = i64(cu_seqlens_k) if cu_seqlens_k is not None else _NONE
    cells, lowest = _cells(mask) if mask is not None and mask.numel() else (_NO_MASK, 0.5)
    slots = i64(key_slots) if key_slots is not None else _NONE
    pos = i64(positions)
    _check(rows, i64(prefix_lens), i64(extend_lens), pos if pos.shape[0] else np.zeros(1, np.int64), ids,
           int(window or 0), cu, cells, lowest, slots, bool(batch_keys_only), int(launch_tag), _np(ring.rows),
           _np(ring.write_index))  # (the ring's cached views, as the other numba ops take them)
