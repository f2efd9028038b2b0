"""Compiled CPU implementation of every op (``backend="numba"``): same keyword signatures as ``reference``.

The vectorised torch path spends its time in hundreds of small tensor ops per forward (64-bit
hashing emulated on int64 tensors, chains stepped one token at a time); here each op is one
compiled loop over zero-copy numpy views of the CPU tensors (``numba_kernels.py``), so a
launch costs its Python (views, dispatch: 15-30 us on the dev CPU) plus the work itself.

Compile cost: the kernels are compiled on first use and cached on disk (numba's ``cache=True``,
next to this file or in the user's cache directory), so only a fresh install pays it, once.
Arguments are normalised before the call (index vectors to contiguous int64, absent optionals to
empty arrays) so each kernel has one or two type specialisations rather than one per dtype mix.
"""

from __future__ import annotations

import ctypes
import sys
import weakref

import numpy as np
import torch

from kvcanary.format import ATTRIBUTION_STRIDE, PARTIAL_READ_BYTES, RealKvMode
from kvcanary.ops import numba_kernels as k
from kvcanary.ops import torch_ops

__all__ = ["fingerprint", "head", "plan", "scatter_req_token_ids", "tail", "verify", "write"]

_EMPTY64 = np.zeros(0, dtype=np.int64)
_EMPTY_TABLE = np.zeros((0, 0), dtype=np.int32)


# One ctypes type spanning any address: numpy reads ``count`` items from it. A type sized per tensor
# would cost ~15 us to create for every new size, and ctypes keeps each one for the process's life.
_ADDRESS_SPACE = ctypes.c_char * (1 << 47)
_NP_DTYPES = {torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32), torch.uint8: np.dtype(np.uint8)}


def _raw(t: torch.Tensor) -> np.ndarray:
    """numpy view of a contiguous int64/int32/uint8 CPU tensor, built from its data pointer.

    Unlike ``Tensor.numpy()`` it neither marks the storage non-resizable (an engine may still resize
    its buffers) nor holds a reference to the tensor: the caller keeps the tensor alive while the view
    is used (an argument of the op, or a ``_cached`` entry checked before every use).
    """
    dtype, n = _NP_DTYPES[t.dtype], t.numel()
    if n == 0:
        return np.empty(tuple(t.shape), dtype=dtype)
    a = np.frombuffer(_ADDRESS_SPACE.from_address(t.data_ptr()), dtype=dtype, count=n)
    return a if t.dim() == 1 else a.reshape(tuple(t.shape))


def _i64(t: torch.Tensor) -> np.ndarray:
    """A contiguous int64 array of t for reading: a view when t already is one, else a converted copy
    (a fresh tensor that only the returned array owns)."""
    if t.dtype in _NP_DTYPES and t.is_contiguous():
        a = _raw(t)
        return a if a.dtype == np.int64 else a.astype(np.int64)
    return t.detach().to(torch.int64).contiguous().numpy()


def _table(t: torch.Tensor) -> np.ndarray:
    """A 2-D index table in its own dtype (int32 or int64): converting a whole table per call would copy it."""
    if t.dtype in _NP_DTYPES and t.is_contiguous():
        return _raw(t)
    return t.detach().to(torch.int64).contiguous().numpy()


# numpy views of long-lived tensors (the canary's buffers, ring, counters, plan; the KV pages), by role
# and id. Building a view costs about as much as a small kernel, and a forward makes dozens of calls on
# the same buffers. A view does not own its memory (``_raw``), so the cache must never outlive a
# tensor: an entry goes when its tensor dies (weak reference callback), and the data pointer and shape
# catch a tensor whose memory moved in place (resize_, set_) before a view is reused.
_VIEWS: dict[str, dict[int, tuple]] = {"np": {}, "words": {}, "bytes": {}}
_MAX_VIEWS = 4096  # a safety bound only: entries leave with their tensors
_NP_VIEWS = _VIEWS["np"]


def _cached(t: torch.Tensor, role: str, make):
    views = _VIEWS[role]
    hit = views.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == t.data_ptr() and hit[2] == t.shape:
        return hit[3]
    value = make(t)
    if len(views) >= _MAX_VIEWS:
        views.clear()
    key = id(t)

    def forget(ref, views=views, key=key):
        if views.get(key, (None,))[0] is ref:
            del views[key]

    views[key] = (weakref.ref(t, forget), t.data_ptr(), t.shape, value)
    return value


def _np(t: torch.Tensor) -> np.ndarray:
    """The writable numpy view of a long-lived contiguous tensor, or None when it cannot have one."""
    # ``_cached``'s hit test repeated here: a forward makes dozens of these calls, one call level fewer each.
    hit = _NP_VIEWS.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == t.data_ptr() and hit[2] == t.shape:
        return hit[3]
    return _cached(t, "np", _view_or_none)


def _view_or_none(t: torch.Tensor):
    return _raw(t) if t.dtype in _NP_DTYPES and t.is_contiguous() else None


def _np64(t: torch.Tensor) -> np.ndarray:
    """``_i64`` of a long-lived tensor that is only read (plan entries): its cached view when it has one."""
    a = _np(t)
    return a if a is not None and a.dtype == np.int64 else _i64(t)


def _np_table(t: torch.Tensor) -> np.ndarray:
    """``_table`` of a long-lived table (the expected tokens): its cached view when it has one."""
    a = _np(t)
    return a if a is not None else _table(t)


def _as_words(buf: torch.Tensor) -> np.ndarray:
    return _raw(buf).view(np.int64)  # validated: uint8, contiguous, stride a multiple of 8


def _words(buf: torch.Tensor) -> np.ndarray:
    """A canary buffer (uint8 [num_slots, stride], contiguous) as int64 [num_slots, stride // 8] record words."""
    return _cached(buf, "words", _as_words)


def _storage_bytes(t: torch.Tensor) -> tuple:
    """(as words?, the whole storage as uint64 words or bytes, t's offset and row stride in those units,
    the unit's bytes): any dtype, bf16 included, no copy."""
    return _cached(t, "bytes", _as_bytes)


def _as_bytes(t: torch.Tensor) -> tuple:
    """The storage's bytes and where t's rows are in them, as uint64 words when t starts on an 8-byte
    boundary (row strides and token sizes are multiples of 16, so every token does too)."""
    storage = t.untyped_storage()
    n, base, row_stride = storage.nbytes(), t.storage_offset() * t.element_size(), t.stride(0) * t.element_size()
    words = sys.byteorder == "little" and base % 8 == 0 and storage.data_ptr() % 8 == 0
    dtype, unit = (np.uint64, 8) if words else (np.uint8, 1)
    data = np.frombuffer(_ADDRESS_SPACE.from_address(storage.data_ptr()), dtype=dtype, count=n // unit) if n else \
        np.empty(0, dtype=dtype)
    return words, data, base // unit, row_stride // unit, unit


def _fingerprints(slots: np.ndarray, sources, real_kv_mode: int) -> np.ndarray:
    """int64 real-KV hash of each slot (SPEC 3.4), source by source like the reference."""
    acc = np.zeros(slots.shape[0], dtype=np.int64)
    if real_kv_mode == RealKvMode.NONE or not sources or not slots.shape[0]:
        return acc
    for src in sources:
        num_bytes = PARTIAL_READ_BYTES if real_kv_mode == RealKvMode.PARTIAL else src.read_bytes
        words, data, base, row_stride, unit = _storage_bytes(src.tensor)
        mix = k.mix_source_words if words else k.mix_source
        ps = src.page_size
        shift = ps.bit_length() - 1 if ps & (ps - 1) == 0 else -1
        mix(acc, slots, data, base, row_stride, ps, shift, src.num_bytes_per_token // unit, src.tensor.shape[0],
            num_bytes // unit)
    return acc


def fingerprint(*, slots, sources, real_kv_mode) -> torch.Tensor:
    return torch.from_numpy(_fingerprints(_i64(slots), sources, int(real_kv_mode)))


def scatter_req_token_ids(flat_in, offsets, req_pool_indices, pool_out) -> None:
    if not pool_out.is_contiguous():  # written in place through a numpy view
        torch_ops.scatter_req_token_ids(flat_in, offsets, req_pool_indices, pool_out)
        return
    k.scatter(_i64(flat_in), _i64(offsets), _i64(req_pool_indices), _raw(pool_out))


def _plan_outputs(out) -> list | None:
    """The plan's entry fields, write offsets and seed slots, then its enable flag, as writable numpy
    views; None for hand-built buffers numpy cannot write in place or entry fields of different
    lengths (the kernels do not bounds-check)."""
    e = out.entries
    outs = [_np(t) for t in (e.slot, e.position, e.prev, e.expected_token, e.count, e.enable, e.requested,
                             out.write_offsets, out.seed_slot)]
    enable, cap = outs[5], e.slot.shape[0]
    if (enable is None or enable.dtype != np.int32
            or not all(a is not None and a.dtype == np.int64 for i, a in enumerate(outs) if i != 5)
            or any(a.shape[0] != cap for a in outs[1:4])):
        return None
    return outs


def _plan_inputs(req_pool_indices, prefix_lens, extend_lens, req_to_token, full_to_swa, token_table,
                 token_valid_lens, token_offset, window) -> tuple:
    """The plan kernel's leading arguments."""
    rtt = _table(req_to_token)
    # An absent translation table is an empty one of the table's dtype: no extra specialisation for it.
    table = np.zeros(0, dtype=rtt.dtype) if full_to_swa is None else _table(full_to_swa)
    has_tokens = token_table is not None
    return (_i64(req_pool_indices), _i64(prefix_lens), _i64(extend_lens), rtt, table, full_to_swa is not None,
            _np_table(token_table) if has_tokens else _EMPTY_TABLE, _i64(token_valid_lens) if has_tokens else _EMPTY64,
            has_tokens, int(token_offset), int(window))


def plan(*, req_pool_indices, prefix_lens, extend_lens, req_to_token, out, window=0, full_to_swa=None,
         token_table=None, token_valid_lens=None, token_offset=0) -> None:
    outs = _plan_outputs(out)
    if outs is None:
        # the torch path, with the same bits or the same error
        torch_ops.plan(req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_lens=extend_lens,
                       req_to_token=req_to_token, out=out, window=window, full_to_swa=full_to_swa,
                       token_table=token_table, token_valid_lens=token_valid_lens, token_offset=token_offset)
        return
    k.plan(*_plan_inputs(req_pool_indices, prefix_lens, extend_lens, req_to_token, full_to_swa, token_table,
                         token_valid_lens, token_offset, window), *outs)


def verify(*, buf, entries, ring, counters, launch_tag, sources=(), real_kv_mode=0, check_token=True) -> None:
    cap = entries.slot.shape[0]
    if any(t.shape[0] != cap for t in (entries.position, entries.prev, entries.expected_token)):
        # Entry fields of different lengths: the kernel does not bounds-check; the torch path raises.
        torch_ops.verify(buf=buf, entries=entries, ring=ring, counters=counters, launch_tag=launch_tag,
                         sources=sources, real_kv_mode=real_kv_mode, check_token=check_token)
        return
    enable, count, slot = _np(entries.enable), _np(entries.count), _np64(entries.slot)
    # The entries' own count bounds the fingerprint pass; the kernel re-reads enable and count itself.
    n = max(0, min(int(count[0]), slot.shape[0])) if enable[0] else 0
    k.verify(_words(buf), slot, _np64(entries.position), _np64(entries.prev), _np64(entries.expected_token),
             enable, count, bool(check_token), _fingerprints(slot[:n], sources, int(real_kv_mode)), _np(ring.rows),
             _np(ring.write_index), _np(counters), int(launch_tag))


def write(*, buf, write_offsets, seed_slot, num_requests, out_cache_loc, input_ids, positions, ring, counters,
          launch_tag, sources=(), real_kv_mode=0, expected_input_ids=None, expected_positions=None,
          chain_check=None, writer_ids=None, step=None, chain_hint=None) -> None:
    locs = _i64(out_cache_loc)
    # Real-KV hashes of every entry's slot up front (one compiled pass per source); unused for skipped entries.
    fp = _fingerprints(locs, sources, int(real_kv_mode))
    k.write(_words(buf), _np64(write_offsets), _np64(seed_slot), int(num_requests), locs, _i64(input_ids),
            _i64(positions),
            _EMPTY64 if expected_input_ids is None else _i64(expected_input_ids), expected_input_ids is not None,
            _EMPTY64 if expected_positions is None else _i64(expected_positions), expected_positions is not None,
            chain_check is not None and int(_np(chain_check)[0]) != 0, buf.shape[1] >= ATTRIBUTION_STRIDE,
            _EMPTY64 if writer_ids is None else _i64(writer_ids), writer_ids is not None,
            -1 if step is None else int(_np(step)[0]), fp, _np(ring.rows), _np(ring.write_index), _np(counters),
            int(launch_tag))


def head(plan_kw: dict, verify_kw: dict, write_kw: dict) -> bool:
    """``plan(**plan_kw)``, ``verify(**verify_kw)``, ``write(**write_kw)`` as one compiled call, with
    the same bits; False (nothing done) where the separate ops would not take their compiled path or
    the three do not chain (the verify reads the plan's entries, both HEAD calls have no real-KV hash).

    Inside an engine's step each op call costs tens of microseconds of Python and dispatch against a
    few of kernel: the HEAD sequence pays it once instead of three times.
    """
    out, e = plan_kw["out"], verify_kw["entries"]
    if (e is not out.entries or verify_kw.get("sources") or write_kw.get("sources")
            or int(verify_kw.get("real_kv_mode", 0)) or int(write_kw.get("real_kv_mode", 0))
            or verify_kw["buf"] is not write_kw["buf"]):
        return False
    outs = _plan_outputs(out)
    if outs is None:
        return False  # (plan and verify take their torch paths for these)
    p = plan_kw
    inputs = _plan_inputs(p["req_pool_indices"], p["prefix_lens"], p["extend_lens"], p["req_to_token"],
                          p.get("full_to_swa"), p.get("token_table"), p.get("token_valid_lens"),
                          p.get("token_offset", 0), p.get("window", 0))
    buf, w = verify_kw["buf"], write_kw
    exp_ids, exp_pos, writers, step = (w.get("expected_input_ids"), w.get("expected_positions"), w.get("writer_ids"),
                                       w.get("step"))
    chain_check = w.get("chain_check")
    ring, counters = verify_kw["ring"], verify_kw["counters"]
    k.head(*inputs, *outs, _words(buf), bool(verify_kw.get("check_token", True)),
           _np(ring.rows), _np(ring.write_index), _np(counters), int(verify_kw["launch_tag"]),
           int(w["num_requests"]), _i64(w["out_cache_loc"]), _i64(w["input_ids"]), _i64(w["positions"]),
           _EMPTY64 if exp_ids is None else _i64(exp_ids), exp_ids is not None,
           _EMPTY64 if exp_pos is None else _i64(exp_pos), exp_pos is not None,
           chain_check is not None and int(_np(chain_check)[0]) != 0, buf.shape[1] >= ATTRIBUTION_STRIDE,
           _EMPTY64 if writers is None else _i64(writers), writers is not None,
           -1 if step is None else int(_np(step)[0]), int(w["launch_tag"]))
    return True


def tail(verify_kw: dict, write_kw: dict) -> bool:
    """``verify(**verify_kw)``, ``write(**write_kw)``, then the write's ``step`` + 1 as one compiled call,
    with the same bits; False (nothing done) where the separate calls would take another path or the
    write carries the HEAD-only asserts (expected inputs, chain positions)."""
    e, w = verify_kw["entries"], write_kw
    cap = e.slot.shape[0]
    if (any(t.shape[0] != cap for t in (e.position, e.prev, e.expected_token)) or w.get("expected_input_ids") is not None
            or w.get("expected_positions") is not None or w.get("chain_check") is not None
            or verify_kw["buf"] is not w["buf"] or w.get("step") is None):
        return False
    steps = _np(w["step"])
    if steps is None or steps.dtype != np.int64 or steps.shape != (1,):
        return False
    enable, count, slot = _np(e.enable), _np(e.count), _np64(e.slot)
    n = max(0, min(int(count[0]), slot.shape[0])) if enable[0] else 0
    locs = _i64(w["out_cache_loc"])
    ring, counters, writers = verify_kw["ring"], verify_kw["counters"], w.get("writer_ids")
    buf = verify_kw["buf"]
    k.tail(_words(buf), slot, _np64(e.position), _np64(e.prev), _np64(e.expected_token), enable, count,
           bool(verify_kw.get("check_token", True)),
           _fingerprints(slot[:n], verify_kw.get("sources", ()), int(verify_kw.get("real_kv_mode", 0))),
           _np(ring.rows), _np(ring.write_index), _np(counters), int(verify_kw["launch_tag"]),
           _np64(w["write_offsets"]), _np64(w["seed_slot"]), int(w["num_requests"]), locs, _i64(w["input_ids"]),
           _i64(w["positions"]), buf.shape[1] >= ATTRIBUTION_STRIDE, _EMPTY64 if writers is None else _i64(writers),
           writers is not None, int(steps[0]),
           _fingerprints(locs, w.get("sources", ()), int(w.get("real_kv_mode", 0))), int(w["launch_tag"]), steps)
    return True
