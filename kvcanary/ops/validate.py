"""Boundary checks shared by every op: metadata only (shape, dtype, device), never a device sync.

Messages read ``kv-canary: <op> <argument> must be <expectation>, got <what>``;
TypeError for dtypes, ValueError for shapes, lengths and values.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from kvcanary.format import MAX_REAL_KV_SOURCES, SPEC_RECORD_BYTES, VIOLATION_COUNT_LIMIT, VIOLATION_WIDTH, RealKvMode

INDEX_DTYPES = (torch.int32, torch.int64)


def fail_type(op: str, name: str, expected: str, got: object) -> TypeError:
    return TypeError(f"kv-canary: {op} {name} must be {expected}, got {got}")


def fail_value(op: str, name: str, expected: str, got: object) -> ValueError:
    return ValueError(f"kv-canary: {op} {name} must be {expected}, got {got}")


BOOLEAN_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                 "off": False}


def parse_bool(name: str, raw: str) -> bool:
    """A boolean environment variable: 1/0/true/false/yes/no/on/off in any case, else ValueError naming it
    (``false`` must never read as enabled because it is not ``0``)."""
    value = BOOLEAN_WORDS.get(raw.strip().lower())
    if value is None:
        raise ValueError(f"kv-canary: {name} must be a boolean (1/0/true/false/yes/no/on/off), got {raw!r}")
    return value


def env_flag(name: str, default: bool) -> bool:
    """The boolean environment variable ``name`` (``parse_bool``), ``default`` when it is unset."""
    raw = os.environ.get(name)
    return default if raw is None else parse_bool(name, raw)


def is_int(x: object) -> bool:
    """A Python int that is not a bool (``True`` is an int to ``isinstance``, never a count or an index)."""
    return isinstance(x, int) and not isinstance(x, bool)


def check_tensor(op: str, name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise fail_type(op, name, "a torch.Tensor", type(t).__name__)
    return t


def check_ndim(op: str, name: str, t: torch.Tensor, ndim: int) -> None:
    check_tensor(op, name, t)
    if t.dim() != ndim:
        raise fail_value(op, name, f"{ndim}-D", f"shape {tuple(t.shape)}")


def check_dtype(op: str, name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype]) -> None:
    if t.dtype not in dtypes:
        expected = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise fail_type(op, name, expected, t.dtype)


def check_vector(op: str, name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype], length: int | None = None,
                 min_length: int | None = None) -> None:
    """1-D tensor of one of dtypes, of exactly `length` (or at least `min_length`) elements."""
    check_ndim(op, name, t, 1)
    check_dtype(op, name, t, dtypes)
    if length is not None and t.shape[0] != length:
        raise fail_value(op, name, f"of length {length}", f"length {t.shape[0]}")
    if min_length is not None and t.shape[0] < min_length:
        raise fail_value(op, name, f"of length >= {min_length}", f"length {t.shape[0]}")


def check_device(op: str, device: torch.device, **tensors: torch.Tensor | None) -> None:
    # is_cpu / is_cuda / get_device() are plain attributes: far cheaper than comparing device objects.
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else -1
    for name, t in tensors.items():
        if t is None:
            continue
        if (t.is_cuda and t.get_device() == index) if cuda else (t.is_cpu if device.type == "cpu" else
                                                                  t.device == device):
            continue
        raise fail_value(op, name, f"on {device}", f"{t.device}")


def check_canary_buffer(op: str, buf: torch.Tensor, name: str = "buf") -> None:
    check_ndim(op, name, buf, 2)
    check_dtype(op, name, buf, (torch.uint8,))
    stride = buf.shape[1]
    if stride < SPEC_RECORD_BYTES or stride % 8:
        raise fail_value(op, name, "a record stride >= 32 and a multiple of 8", f"stride {stride}")
    if not buf.is_contiguous():
        raise fail_value(op, name, "contiguous", f"strides {tuple(buf.stride())}")


def check_ring(op: str, ring, counters: torch.Tensor, device: torch.device) -> None:
    if type(ring).__name__ != "ViolationRing":
        raise fail_type(op, "ring", "a ViolationRing", type(ring).__name__)
    check_ndim(op, "ring.rows", ring.rows, 2)
    check_dtype(op, "ring.rows", ring.rows, (torch.int64,))
    if ring.rows.shape[1] != VIOLATION_WIDTH or not ring.rows.is_contiguous():
        raise fail_value(op, "ring.rows", f"contiguous [capacity, {VIOLATION_WIDTH}]", f"shape {tuple(ring.rows.shape)}")
    check_vector(op, "ring.write_index", check_tensor(op, "ring.write_index", ring.write_index), (torch.int32,),
                 length=1)
    if ring.rows.shape[0] > VIOLATION_COUNT_LIMIT:
        raise fail_value(op, "ring.rows", f"at most {VIOLATION_COUNT_LIMIT} rows", f"{ring.rows.shape[0]}")
    check_ndim(op, "counters", counters, 2)
    check_dtype(op, "counters", counters, (torch.int64,))
    if counters.shape[1] != 2 or not counters.is_contiguous():
        raise fail_value(op, "counters", "contiguous [num_tags, 2]", f"shape {tuple(counters.shape)}")
    check_device(op, device, **{"ring.rows": ring.rows, "ring.write_index": ring.write_index, "counters": counters})


def _check_part(op: str, name: str, t: object, dtype: torch.dtype, length: int | None = None,
                min_length: int | None = None) -> None:
    # (any strides: hand-built non-contiguous outputs are accepted, tests/test_numba_ops.py)
    check_vector(op, name, check_tensor(op, name, t), (dtype,), length=length, min_length=min_length)


def check_entries(op: str, entries, device: torch.device, name: str = "entries") -> None:
    """An ``Entries`` the kernels may index: four int64 columns of one capacity, int64 [1] count and
    requested, int32 [1] enable, all on ``device``. The compiled kernels trust these shapes
    (a short column is written past its end), so they are checked from metadata before every launch."""
    if type(entries).__name__ != "Entries":
        raise fail_type(op, name, "an Entries", type(entries).__name__)
    _check_part(op, f"{name}.slot", entries.slot, torch.int64)
    capacity = entries.slot.shape[0]
    for part in ("position", "prev", "expected_token"):
        _check_part(op, f"{name}.{part}", getattr(entries, part), torch.int64, length=capacity)
    for part, dtype in (("count", torch.int64), ("enable", torch.int32), ("requested", torch.int64)):
        _check_part(op, f"{name}.{part}", getattr(entries, part), dtype, length=1)
    check_device(op, device, **{f"{name}.{part}": getattr(entries, part) for part in
                                ("slot", "position", "prev", "expected_token", "count", "enable", "requested")})


def check_plan(op: str, plan, device: torch.device, name: str = "plan") -> None:
    """A ``Plan``: valid ``entries``, int64 seed_slot [max_batch] and write_offsets [max_batch + 1]."""
    if type(plan).__name__ != "Plan":
        raise fail_type(op, name, "a Plan", type(plan).__name__)
    check_entries(op, plan.entries, device, f"{name}.entries")
    _check_part(op, f"{name}.seed_slot", plan.seed_slot, torch.int64)
    _check_part(op, f"{name}.write_offsets", plan.write_offsets, torch.int64, length=plan.seed_slot.shape[0] + 1)
    check_device(op, device, **{f"{name}.seed_slot": plan.seed_slot, f"{name}.write_offsets": plan.write_offsets})


def check_launch_tag(op: str, tag: int, counters: torch.Tensor) -> None:
    if not is_int(tag) or not 0 <= int(tag) < counters.shape[0]:
        raise fail_value(op, "launch_tag", f"an int in [0, {counters.shape[0]})", repr(tag))


def check_real_kv_source(src) -> None:
    """ValueError for a RealKvSource that SPEC 3.4 rejects."""
    op = "RealKvSource"
    check_tensor(op, "tensor", src.tensor)
    for name in ("page_size", "num_bytes_per_token", "read_bytes"):
        if not isinstance(getattr(src, name), int):
            raise fail_type(op, name, "an int", type(getattr(src, name)).__name__)
    if src.page_size < 1:
        raise fail_value(op, "page_size", ">= 1", src.page_size)
    for name in ("num_bytes_per_token", "read_bytes"):
        v = getattr(src, name)
        if v <= 0 or v % 16:
            raise fail_value(op, name, "a positive multiple of 16", v)
    if src.read_bytes > src.num_bytes_per_token:
        raise fail_value(op, "read_bytes", f"<= num_bytes_per_token ({src.num_bytes_per_token})", src.read_bytes)
    if src.tensor.dim() < 2:
        raise fail_value(op, "tensor", "at least 2-D", f"shape {tuple(src.tensor.shape)}")
    row_stride = src.tensor.stride(0) * src.tensor.element_size()
    if row_stride % 16:
        raise fail_value(op, "tensor", "a row stride that is a multiple of 16 bytes", f"{row_stride} bytes")
    row_bytes = src.tensor[0].numel() * src.tensor.element_size() if src.tensor.shape[0] else 0
    need = src.page_size * src.num_bytes_per_token
    if src.tensor.shape[0] and row_bytes < need:
        raise fail_value(op, "tensor", f"rows of at least page_size * num_bytes_per_token = {need} bytes",
                         f"{row_bytes} bytes")
    # Rows closer than one page apart overlap (a heads-first permute, an expand): slots would share bytes.
    if src.tensor.shape[0] > 1 and row_stride < need:
        raise fail_value(op, "tensor", f"a row stride of at least page_size * num_bytes_per_token = {need} bytes "
                         "(rows must not overlap)", f"{row_stride} bytes")


def check_sources(op: str, sources, mode: int, device: torch.device) -> tuple:
    sources = tuple(sources or ())
    if len(sources) > MAX_REAL_KV_SOURCES:
        raise fail_value(op, "sources", f"at most {MAX_REAL_KV_SOURCES} real-KV sources", len(sources))
    try:
        mode = RealKvMode(mode)
    except ValueError:
        raise fail_value(op, "real_kv_mode", "a RealKvMode (0, 1, 2)", repr(mode)) from None
    for i, s in enumerate(sources):
        if type(s).__name__ != "RealKvSource":
            raise fail_type(op, f"sources[{i}]", "a RealKvSource", type(s).__name__)
        check_device(op, device, **{f"sources[{i}].tensor": s.tensor})
    return sources


def check_write_offsets(op: str, offsets: torch.Tensor, num_requests: int) -> None:
    """Offsets of the requests a write walks: non-negative and non-decreasing.

    Read only where that is free (CPU tensors); on an accelerator reading them would sync with the
    device, and the kernels clamp a negative offset to 0 instead (memory-safe, unspecified result).
    """
    if not offsets.is_cpu or num_requests == 0:
        return
    offs = offsets[:num_requests + 1]
    negative = (offs < 0).nonzero()
    if negative.numel():
        i = int(negative[0, 0])
        raise fail_value(op, "plan.write_offsets", "non-negative", f"{int(offs[i])} at index {i}")
    falling = (offs[1:] < offs[:-1]).nonzero()
    if falling.numel():
        i = int(falling[0, 0]) + 1
        raise fail_value(op, "plan.write_offsets", "non-decreasing",
                         f"{int(offs[i])} after {int(offs[i - 1])} at index {i}")


def check_read_table(op: str, out, rows, prefix, extend, read, clamp_max, limit, fill) -> None:
    """``read_table``'s arguments. Row, prefix and extend values are read only on the CPU (free there); on an
    accelerator that would sync, and the Triton kernel writes nothing for a row outside ``out`` instead."""
    check_ndim(op, "out", out, 2)
    check_dtype(op, "out", out, INDEX_DTYPES)
    check_vector(op, "rows", rows, INDEX_DTYPES)
    bs = rows.shape[0]
    check_vector(op, "prefix", prefix, INDEX_DTYPES, length=bs)
    check_vector(op, "extend", extend, INDEX_DTYPES, length=bs)
    check_vector(op, "read", read, INDEX_DTYPES)
    if out.dtype == torch.int32 and read.dtype != torch.int32:
        raise fail_type(op, "read", "int32 when out is int32 (its slots would not fit)", read.dtype)
    check_device(op, out.device, rows=rows, prefix=prefix, extend=extend, read=read)
    n = read.shape[0]
    if not is_int(clamp_max) or not 0 <= clamp_max < n:
        raise fail_value(op, "clamp_max", f"an int index into read, in [0, {n})", repr(clamp_max))
    if not is_int(limit):
        raise fail_type(op, "limit", "an int", type(limit).__name__)
    info = torch.iinfo(out.dtype)
    if not is_int(fill) or not info.min <= fill <= info.max:
        raise fail_value(op, "fill", f"an int that fits out's {str(out.dtype).replace('torch.', '')}", repr(fill))
    if not rows.is_cpu or bs == 0:
        return
    bad = ((rows < 0) | (rows >= out.shape[0])).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise fail_value(op, "rows", f"rows of out, in [0, {out.shape[0]})", f"{int(rows[i])} at index {i}")
    for name, t in (("prefix", prefix), ("extend", extend)):
        negative = (t < 0).nonzero()
        if negative.numel():
            i = int(negative[0, 0])
            raise fail_value(op, name, "non-negative", f"{int(t[i])} at index {i}")
