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

import weakref

import numpy as np
import torch

from kvcanary.format import ATTRIBUTION_STRIDE, PARTIAL_READ_BYTES, RealKvMode
from kvcanary.ops import numba_kernels as k
from kvcanary.ops import torch_ops
from kvcanary.ops.numba_views import _EMPTY64, _EMPTY_TABLE, _Args, _i64, _np, _np64, _raw, _storage_bytes, _words

__all__ = ["accept_rewrites", "fill_constants", "fingerprint", "head", "head_args", "head_state", "plan",
           "scatter_req_token_ids", "tail", "tail_args", "verify", "write"]

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


def _plan_inputs(a: _Args, req_pool_indices, prefix_lens, extend_lens, req_to_token, full_to_swa, token_table,
                 token_valid_lens, token_offset, window) -> None:
    """The plan kernel's leading arguments, into ``a``."""
    for t in (req_pool_indices, prefix_lens, extend_lens):
        a.i64(t)
    rtt = a.table(req_to_token)
    # An absent translation table is an empty one of the table's dtype: no extra specialisation for it.
    if full_to_swa is None:
        a.add(np.zeros(0, dtype=rtt.dtype))
    else:
        a.table(full_to_swa)
    a.add(full_to_swa is not None)
    has_tokens = token_table is not None
    if has_tokens:
        a.table(token_table, cached=True)
        a.i64(token_valid_lens)
    else:
        a.add(_EMPTY_TABLE, _EMPTY64)
    a.add(has_tokens, int(token_offset), int(window))


def plan(*, req_pool_indices, prefix_lens, extend_lens, req_to_token, out, window=0, full_to_swa=None,
         token_table=None, token_valid_lens=None, token_offset=0) -> None:
    outs = _plan_outputs(out)
    if outs is None:
        # the torch path, with the same bits or the same error
        torch_ops.plan(req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_lens=extend_lens,
                       req_to_token=req_to_token, out=out, window=window, full_to_swa=full_to_swa,
                       token_table=token_table, token_valid_lens=token_valid_lens, token_offset=token_offset)
        return
    a = _Args()
    _plan_inputs(a, req_pool_indices, prefix_lens, extend_lens, req_to_token, full_to_swa, token_table,
                 token_valid_lens, token_offset, window)
    k.plan(*a.call(), *outs)


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


def accept_rewrites(*, head_buf, tail_buf, write_offsets, num_requests, out_cache_loc, sources=(), real_kv_mode=0,
                    rewrites=None) -> None:
    locs = _i64(out_cache_loc)
    # fingerprints of every entry's slot up front (one compiled pass per source), as the write takes them
    fp = _fingerprints(locs, sources, int(real_kv_mode))
    k.accept(_words(head_buf), _words(tail_buf), _np64(write_offsets), int(num_requests), locs, fp,
             _EMPTY64 if rewrites is None else _np(rewrites), rewrites is not None)


# The fused calls' numpy arguments, kept while the tensors behind them stay put. Building them (three
# dozen views, checks and conversions) cost the host 110-130 us per HEAD or TAIL call inside a tiny-model
# step against 25-50 us of compiled work (dev CPU, host timers, d027186), and an engine's steps pass the same
# buffers again and again. Kept only where every argument is a view of its tensor or a cast redone per call
# (``_Args``), and checked per call: the same objects (weak references: the cache keeps no tensor alive), at
# the same addresses, with the same shapes and strides. Per call site and first tensor: an adapter cycles
# through a few batches (one per staging turn and shape).
_PACKS: dict[tuple, tuple] = {}
_MAX_PACKS = 64  # a bound only


def _packed(site: str, tensors: tuple, make):
    """The ``_Args`` that ``make()`` builds for ``tensors`` (None: no compiled call), reused while they are
    unchanged."""
    key = (site, id(tensors[0]))
    hit = _PACKS.get(key)
    if hit is not None and len(hit[0]) == len(tensors):
        for t, (ref, ptr, shape, stride) in zip(tensors, hit[0]):
            if t is None:
                if ref is not None:
                    break
            elif ref is None or ref() is not t or t.data_ptr() != ptr or t.shape != shape or t.stride() != stride:
                break
        else:
            return hit[1]
    args = make()
    if args is not None and args.views:
        if len(_PACKS) >= _MAX_PACKS:
            _PACKS.clear()
        _PACKS[key] = (tuple((None, 0, None, None) if t is None else (weakref.ref(t), t.data_ptr(), t.shape,
                                                                         t.stride()) for t in tensors), args)
    else:
        _PACKS.pop(key, None)
    return args


def _optional64(a: _Args, t) -> None:
    """An optional int64 input: the tensor, or an empty array and False."""
    if t is None:
        a.add(_EMPTY64, False)
    else:
        a.i64(t)
        a.add(True)


def head(plan_kw: dict, verify_kw: dict, write_kw: dict) -> bool:
    """``plan(**plan_kw)``, ``verify(**verify_kw)``, ``write(**write_kw)`` as one compiled call, with
    the same bits; False (nothing done) where the separate ops would not take their compiled path or
    the three do not chain (the verify reads the plan's entries, both HEAD calls have no real-KV hash).

    Inside an engine's step each op call costs tens of microseconds of Python and dispatch against a
    few of kernel: the HEAD sequence pays it once instead of three times.
    """
    a = head_args(plan_kw, verify_kw, write_kw)
    if a is None:
        return False
    k.head(*head_state(a, fill_constants(a, a.call(), verify_kw, write_kw)))
    return True


def fill_constants(a: _Args, args: list, verify_kw: dict, write_kw: dict) -> list:
    """``args`` with the values HEAD and TAIL take from their keyword dicts (the same for every step of a bound
    batch: ``numba_steady``): the verify's token check and tag, the write's request count and tag."""
    args[a.check], args[a.tag] = bool(verify_kw.get("check_token", True)), int(verify_kw["launch_tag"])
    args[a.requests], args[a.write_tag] = int(write_kw["num_requests"]), int(write_kw["launch_tag"])
    return args


def head_state(a: _Args, args: list) -> list:
    """``args`` with HEAD's values read at call time: the chain check's switch and the step."""
    args[a.chain] = a.chain_view is not None and int(a.chain_view[0]) != 0
    args[a.step] = -1 if a.step_view is None else int(a.step_view[0])
    return args


def head_args(plan_kw: dict, verify_kw: dict, write_kw: dict) -> _Args | None:
    """``head``'s kept arguments (its per-call values left to fill: ``check``, ``tag``, ``requests``,
    ``write_tag``, ``chain``, ``step``), or None where ``head`` would return False."""
    out, e = plan_kw["out"], verify_kw["entries"]
    if (e is not out.entries or verify_kw.get("sources") or write_kw.get("sources")
            or int(verify_kw.get("real_kv_mode", 0)) or int(write_kw.get("real_kv_mode", 0))
            or verify_kw["buf"] is not write_kw["buf"]):
        return None
    p, w, buf, ring, counters = plan_kw, write_kw, verify_kw["buf"], verify_kw["ring"], verify_kw["counters"]
    chain_check, step = w.get("chain_check"), w.get("step")
    tensors = (p["req_pool_indices"], p["prefix_lens"], p["extend_lens"], p["req_to_token"], p.get("full_to_swa"),
               p.get("token_table"), p.get("token_valid_lens"), e.slot, e.position, e.prev, e.expected_token,
               e.count, e.enable, e.requested, out.write_offsets, out.seed_slot, buf, ring.rows, ring.write_index,
               counters, w["out_cache_loc"], w["input_ids"], w["positions"], w.get("expected_input_ids"),
               w.get("expected_positions"), chain_check, w.get("writer_ids"), step)

    def make():
        outs = _plan_outputs(out)
        if outs is None:
            return None  # (plan and verify take their torch paths for these)
        a = _Args()
        _plan_inputs(a, p["req_pool_indices"], p["prefix_lens"], p["extend_lens"], p["req_to_token"],
                     p.get("full_to_swa"), p.get("token_table"), p.get("token_valid_lens"), p.get("token_offset", 0),
                     p.get("window", 0))
        a.add(*outs, _words(buf))
        a.check = a.slot()
        a.add(_np(ring.rows), _np(ring.write_index), _np(counters))
        a.tag, a.requests = a.slot(), a.slot()
        for t in (w["out_cache_loc"], w["input_ids"], w["positions"]):
            a.i64(t)
        _optional64(a, w.get("expected_input_ids"))
        _optional64(a, w.get("expected_positions"))
        a.chain = a.slot()
        a.add(buf.shape[1] >= ATTRIBUTION_STRIDE)
        _optional64(a, w.get("writer_ids"))
        a.step, a.write_tag = a.slot(), a.slot()
        a.chain_view = None if chain_check is None else _np(chain_check)
        a.step_view = None if step is None else _np(step)
        return a

    # (token_offset and window are ints the plan reads: the kept arguments hold them)
    return _packed(f"head {int(p.get('token_offset', 0))} {int(p.get('window', 0))}", tensors, make)


def _accepts_with(accept_kw: dict | None, w: dict) -> bool:
    """``accept_rewrites(**accept_kw)`` can run inside the fused TAIL call: it reads the write's entries
    and fingerprints (same buffer, slots, offsets, request count, sources and mode); None: nothing to run."""
    if accept_kw is None:
        return True
    a = accept_kw
    mine, theirs = tuple(a.get("sources", ())), tuple(w.get("sources", ()))
    return (a["tail_buf"] is w["buf"] and a["out_cache_loc"] is w["out_cache_loc"]
            and a["write_offsets"] is w["write_offsets"] and int(a["num_requests"]) == int(w["num_requests"])
            and len(mine) == len(theirs) and all(x is y for x, y in zip(mine, theirs))
            and int(a.get("real_kv_mode", 0)) == int(w.get("real_kv_mode", 0))
            and a["head_buf"].shape == w["buf"].shape)


def tail(verify_kw: dict, write_kw: dict, accept_kw: dict | None = None) -> bool:
    """``accept_rewrites(**accept_kw)`` (when given), ``verify(**verify_kw)``, ``write(**write_kw)``, then
    the write's ``step`` + 1 as one compiled call, with the same bits; False (nothing done) where the
    separate calls would take another path or the write carries the HEAD-only asserts (expected inputs,
    chain positions)."""
    a = tail_args(verify_kw, write_kw, accept_kw)
    if a is None:
        return False
    w, args = write_kw, fill_constants(a, a.call(), verify_kw, write_kw)
    slot, locs = args[a.slots], args[a.locs]
    # the entries' own count bounds the fingerprint pass (the kernel re-reads enable and count itself)
    n = max(0, min(int(a.count[0]), slot.shape[0])) if a.enable[0] else 0
    args[a.verify_fp] = _fingerprints(slot[:n], verify_kw.get("sources", ()), int(verify_kw.get("real_kv_mode", 0)))
    args[a.write_fp] = _fingerprints(locs, w.get("sources", ()), int(w.get("real_kv_mode", 0)))
    args[a.step] = int(a.steps[0])
    k.tail(*args)
    return True


def tail_args(verify_kw: dict, write_kw: dict, accept_kw: dict | None = None) -> _Args | None:
    """``tail``'s kept arguments (its per-call values left to fill: ``check``, ``tag``, ``verify_fp``,
    ``requests``, ``step``, ``write_fp``, ``write_tag``), or None where ``tail`` would return False."""
    e, w = verify_kw["entries"], write_kw
    cap = e.slot.shape[0]
    if (any(t.shape[0] != cap for t in (e.position, e.prev, e.expected_token)) or w.get("expected_input_ids") is not None
            or w.get("expected_positions") is not None or w.get("chain_check") is not None
            or verify_kw["buf"] is not w["buf"] or w.get("step") is None
            or not _accepts_with(accept_kw, w)):
        return None
    ring, counters, buf = verify_kw["ring"], verify_kw["counters"], verify_kw["buf"]
    head_buf = buf if accept_kw is None else accept_kw["head_buf"]
    rewrites = None if accept_kw is None else accept_kw.get("rewrites")
    tensors = (w["out_cache_loc"], w["input_ids"], w["positions"], w.get("writer_ids"), e.slot, e.position, e.prev,
               e.expected_token, e.enable, e.count, ring.rows, ring.write_index, counters, w["write_offsets"],
               w["seed_slot"], buf, w["step"], head_buf, rewrites)

    def make():
        steps = _np(w["step"])
        if steps is None or steps.dtype != np.int64 or steps.shape != (1,):
            return None
        a = _Args()
        a.add(_words(buf))
        a.slots = len(a.items)  # (where the entries' slots are: the fingerprint pass reads them per call)
        for t in (e.slot, e.position, e.prev, e.expected_token):  # (``_np64``: the plan's, int64 by construction)
            a.i64(t)
        a.enable, a.count = _np(e.enable), _np(e.count)
        a.add(a.enable, a.count)
        a.check, a.verify_fp = a.slot(), a.slot()
        a.add(_np(ring.rows), _np(ring.write_index), _np(counters))
        a.tag = a.slot()
        a.i64(w["write_offsets"])
        a.i64(w["seed_slot"])
        a.requests = a.slot()
        a.locs = len(a.items)  # (the write slots, perhaps cast per call: read from the call's arguments)
        for t in (w["out_cache_loc"], w["input_ids"], w["positions"]):
            a.i64(t)
        a.add(buf.shape[1] >= ATTRIBUTION_STRIDE)
        _optional64(a, w.get("writer_ids"))
        a.step, a.write_fp, a.write_tag = a.slot(), a.slot(), a.slot()
        a.add(steps)
        a.steps = steps
        counter = None if rewrites is None else _np(rewrites)
        if rewrites is not None and (counter is None or counter.dtype != np.int64):
            return None
        # (no accept: the TAIL buffer stands in for the HEAD one, an empty counter for the count)
        a.add(_words(head_buf), accept_kw is not None, _EMPTY64 if counter is None else counter, counter is not None)
        return a

    return _packed("tail" if accept_kw is None else "tail accept", tensors, make)
