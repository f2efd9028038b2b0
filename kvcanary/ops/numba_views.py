"""Zero-copy numpy views of CPU tensors for the numba backend (``numba_ops.py``), and the argument lists
of its compiled calls (``_Args``).

A view is built from the tensor's data pointer (``_raw``): numpy reads the tensor's memory in place, and
nothing is copied unless a dtype or layout needs converting. Views of long-lived tensors (the canary's
buffers, ring, counters, plan; the KV pages) are kept by tensor (``_cached``), each dropped when its
tensor dies.
"""

from __future__ import annotations

import ctypes
import sys
import weakref

import numpy as np
import torch

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
    if not t.is_cpu:  # (numpy would read a device address as host memory: a crash, not an error)
        raise ValueError(f"kv-canary: the numba backend reads CPU tensors only, got a {t.dtype} tensor of shape "
                         f"{list(t.shape)} on {t.device} (backend 'triton' or 'torch' runs there)")
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


class _Args:
    """A compiled call's argument list as it is built: zero-copy views as they are, int64 copies of int32
    views redone at every ``call`` (their values change), per-call values filled in by position (``slot``).
    ``views``: no argument is a copy made once (kept arguments would go stale: ``_packed``)."""

    def __init__(self):
        self.items, self.casts, self.views = [], [], True

    def add(self, *values) -> None:
        self.items.extend(values)

    def i64(self, t: torch.Tensor) -> None:
        """``_i64(t)``: a view of an int64 tensor, else an int64 copy made at each call."""
        if t.dtype in _NP_DTYPES and t.is_contiguous() and t.dtype != torch.int64:
            self.casts.append((len(self.items), _raw(t)))
            self.items.append(None)
            return
        self.views = self.views and t.dtype == torch.int64 and t.is_contiguous()
        self.items.append(_i64(t))

    def table(self, t: torch.Tensor, cached: bool = False) -> np.ndarray:
        """``_table(t)`` (``_np_table`` where ``cached``): a view in its own dtype, else a copy."""
        self.views = self.views and t.dtype in _NP_DTYPES and t.is_contiguous()
        a = _np_table(t) if cached else _table(t)
        self.items.append(a)
        return a

    def slot(self) -> int:
        self.items.append(None)
        return len(self.items) - 1

    def call(self) -> list:
        items = self.items.copy()
        for i, view in self.casts:
            items[i] = view.astype(np.int64)
        return items
