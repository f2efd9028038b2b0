"""The step snapshot's device pass (runtime/observer.py): a closed step's violation rows, and the records their
slots held, copied aside for a late drain.

``snapshot_rows(rows, write_index, out_rows, records, record_at, out_records)``, with ``count = min(write_index[0],
rows.shape[0])`` the rows the step stored:

- ``out_rows[:count] = rows[:count]``;
- for each of the first ``min(count, out_records.shape[1])`` rows ``r`` and each record buffer ``k``
  (``records[k]``: an int64 view ``[slots_k, >= W]``, ``W = out_records.shape[2]``), ``out_records[k, r] =
  records[k][clamp(rows[r, 1], 0, slots_k - 1), :W]``: the first W words of the record the row's slot held.

Rows past ``count`` of either output are left unspecified (the tensor ops copy them anyway; the kernel leaves
them): a drain reads only the rows the step stored. ``record_at`` is the Triton kernel's table of the buffers
(``record_table``), made once by the caller; the other implementations ignore it.

Implementations: ``reference_snapshot_rows`` (scalar loops, the oracle), ``torch_snapshot_rows`` (tensor ops, any
device: a ring copy, one clamp per buffer size and one gather per buffer, each over every row the outputs hold,
a handful of launches whatever the step found) and ``kvcanary.ops.triton_snapshot`` (one launch, its blocks past
``count`` returning at once: a step with no violation copies nothing). ``snapshot_impl`` picks one for a backend
name.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

NAMES = ("snapshot_rows",)


def snapshot_impl(backend: str):
    """The pass of a resolved backend name: Triton's for "triton", the scalar reference's for "reference"
    (tests), tensor ops otherwise (numba's CPU steps read the ring in place: no snapshot to take)."""
    if backend == "triton":
        return importlib.import_module("kvcanary.ops.triton_snapshot")
    prefix = "reference_" if backend == "reference" else "torch_"
    return SimpleNamespace(**{name: globals()[prefix + name] for name in NAMES})


def record_table(records, device) -> torch.Tensor:
    """int64 ``[k, 3]``: each record buffer's first element from the first buffer's (in int64 elements), its
    slots and its row stride (elements): the Triton kernel reaches every buffer from the first one's pointer."""
    if not records:
        return torch.zeros(0, 3, dtype=torch.int64, device=device)
    first = records[0].data_ptr()
    rows = []
    for r in records:
        if r.dtype != torch.int64 or r.stride(1) != 1 or (r.data_ptr() - first) % 8:
            raise ValueError("kv-canary: snapshot record buffers must be int64 views with contiguous rows, "
                             f"got dtype {r.dtype}, strides {tuple(r.stride())}")
        rows.append([(r.data_ptr() - first) // 8, r.shape[0], r.stride(0)])
    return torch.tensor(rows, dtype=torch.int64, device=device)


# -- scalar reference ---------------------------------------------------------------------------------
def reference_snapshot_rows(*, rows, write_index, out_rows, records, record_at=None, out_records=None) -> None:
    count = min(int(write_index[0]), rows.shape[0])
    for r in range(count):
        out_rows[r] = rows[r]
    if out_records is None or not records:
        return
    width = out_records.shape[2]
    for r in range(min(count, out_records.shape[1])):
        slot = int(rows[r, 1])
        for k, buf in enumerate(records):
            at = min(max(slot, 0), buf.shape[0] - 1)
            out_records[k, r] = buf[at, :width]


# -- tensor ops ---------------------------------------------------------------------------------------
def torch_snapshot_rows(*, rows, write_index, out_rows, records, record_at=None, out_records=None) -> None:
    out_rows.copy_(rows)  # (every row: the count is on the device, and a host read would sync)
    if out_records is None or not records:
        return
    n, width = out_records.shape[1], out_records.shape[2]
    slots = rows[:n, 1]
    index = {}  # one clamp per buffer size
    for k, buf in enumerate(records):
        at = index.get(buf.shape[0])
        if at is None:
            at = index[buf.shape[0]] = slots.clamp(0, buf.shape[0] - 1)
        torch.index_select(buf[:, :width], 0, at, out=out_records[k])
