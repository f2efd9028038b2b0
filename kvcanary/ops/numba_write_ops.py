"""The write check's passes as compiled CPU loops (``backend="numba"``; contract and reference in ``write_ops``).

As tensor ops a row's digest is a dozen int64 operations over all of its words (a K row of a small model is tens of
words, of a 1B model 128), each a host call: here each pass is one loop over zero-copy numpy views.
"""

from __future__ import annotations

import numba
import numpy as np

from kvcanary.ops import numba_kernels as k
from kvcanary.ops.numba_views import _np, _storage_bytes
from kvcanary.ops.write_ops import REAL_KV, WRITE_GAMMA, WRITE_KV

jit = numba.njit(cache=True, nogil=True)
GAMMA = np.uint64(WRITE_GAMMA)


@jit
def _hash_rows(words, out):
    for i in range(words.shape[0]):
        h = np.uint64(0)
        at = np.uint64(0)
        for a in range(words.shape[1]):
            for b in range(words.shape[2]):
                at += GAMMA  # (word i's offset (i + 1) * WRITE_GAMMA, wrapping as uint64)
                h += k.splitmix(np.uint64(words[i, a, b]) + at)
        out[i] = np.int64(h)


@jit
def _slot_digest(slot, data, words, base, row_stride, page_size, nbpt, num_rows):
    """The write digest of one slot's nbpt // 8 words in one source (storage as words when ``words``, else
    bytes)."""
    row = slot // page_size
    if slot < 0 or row >= num_rows:
        return np.uint64(0)
    h = np.uint64(0)
    at = np.uint64(0)
    if words:
        off = base + row * row_stride + (slot - row * page_size) * (nbpt // 8)
        for w in range(nbpt // 8):
            at += GAMMA
            h += k.splitmix(data[off + w] + at)
    else:
        off = base + row * row_stride + (slot - row * page_size) * nbpt
        for w in range(0, nbpt // 8 * 8, 8):
            x = np.uint64(0)
            for b in range(8):
                x |= np.uint64(data[off + w + b]) << np.uint64(8 * b)
            at += GAMMA
            h += k.splitmix(x + at)
    return h


@jit
def _check(loc, later, offs, nr, poss, ids, writers, has_writers, num_slots, expected, noted, tags, layers, table,
           datas, rows, widx, recs, mark):
    live = min(loc.shape[0], expected.shape[1], offs[nr])
    for t in range(live):
        slot = loc[t]
        if slot < 1 or slot >= num_slots or later[t]:
            continue
        for s in range(table.shape[0]):
            if noted[s] == 0 or slot >= table[s, 5]:
                continue
            h = _slot_digest(slot, datas[s], table[s, 0] != 0, table[s, 1], table[s, 2], table[s, 3], table[s, 4],
                           table[s, 6])
            if np.int64(h) != expected[s, t]:
                req = -1
                if has_writers and nr > 0:
                    r = 0
                    for j in range(1, nr + 1):
                        if offs[j] <= t:
                            r += 1
                    req = writers[min(r, nr - 1)]
                k.push(rows, widx, tags[s], slot, poss[t], ids[t], s, req, layers[s], WRITE_KV)
                if mark:
                    recs[s][slot, REAL_KV] ^= 1  # (write_ops: the record then certifies no bytes)
                break


def hash_rows(*, words, out, flag=None) -> None:
    if words.shape[0]:
        _hash_rows(words.numpy(), out.numpy())
    if flag is not None:
        flag.fill_(1)


def check_writes(*, out_cache_loc, write_offsets, num_requests, positions, input_ids, writer_ids, num_slots, sources,
                 expected, noted, tags, layers, ring, records=None, host_reads=None) -> None:
    if not out_cache_loc.shape[0] or not sources:
        return
    table, datas = _table(sources)
    if table is None:  # (a source off an 8-byte boundary: the tensor ops read its bytes)
        from kvcanary.ops.write_ops import torch_check_writes

        return torch_check_writes(out_cache_loc=out_cache_loc, write_offsets=write_offsets,
                                  num_requests=num_requests, positions=positions, input_ids=input_ids,
                                  writer_ids=writer_ids, num_slots=num_slots, sources=sources, expected=expected,
                                  noted=noted, tags=tags, layers=layers, ring=ring, records=records,
                                  host_reads=host_reads)
    i64 = lambda t: t.numpy().astype(np.int64, copy=False)  # noqa: E731
    writers = i64(writer_ids) if writer_ids is not None else np.zeros(1, dtype=np.int64)
    widx = _np(ring.write_index)  # (the ring's cached views, as the other numba ops take them)
    loc = i64(out_cache_loc)
    live = min(loc.shape[0], expected.shape[1], int(write_offsets[num_requests]))
    # (a tuple of one array type either way: numba compiles one signature)
    unmarked = (np.zeros((1, REAL_KV + 1), np.int64),) * len(datas)
    recs = tuple(r.numpy() for r in records) if records is not None else unmarked
    _check(loc, _written_later(loc[:live]), i64(write_offsets), int(num_requests), i64(positions), i64(input_ids),
           writers, writer_ids is not None, int(num_slots), expected.numpy(), noted.numpy(), tags.numpy(),
           layers.numpy(), table, datas, _np(ring.rows), widx, recs, records is not None)


def _written_later(loc: np.ndarray) -> np.ndarray:
    """bool [n]: a later token of ``loc`` writes the same slot (``write_ops.written_later``)."""
    later = np.zeros(loc.shape[0], dtype=np.bool_)
    if loc.shape[0] > 1:
        idx = np.argsort(loc, kind="stable")
        ordered = loc[idx]
        later[idx[:-1]] = ordered[:-1] == ordered[1:]
    return later


def _table(sources):
    """Per source (as words, base, row stride (in words), page size, bytes per token, slots, rows) and its storage
    as uint64 words; (None, None) when a source does not start on an 8-byte boundary (``_storage_bytes``)."""
    rows, datas = [], []
    for src in sources:
        words, data, base, row_stride, _ = _storage_bytes(src.tensor)
        if not words:
            return None, None
        rows.append([1, base, row_stride, src.page_size, src.num_bytes_per_token, src.num_slots, src.tensor.shape[0]])
        datas.append(data)
    return np.asarray(rows, dtype=np.int64), tuple(datas)
