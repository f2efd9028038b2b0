"""The step runner's per-step index work on the device as Triton kernels (``tables.py``).

Before the HEAD verify, the runner builds the batch's read table from the engine's read index and,
after the HEAD write, the entries of the new tokens' read check. As tensor ops these are about twenty
small kernels per step (cumulative sums, index grids, clamps, gathers, scatters, the entries' copies
and fills): most of the kernels of a fused steady step's graph, and of its device time. Here each is
one kernel, with the same results cell for cell:

- ``read_table``: the op ``kvcanary.ops.read_table``'s Triton kernel (``ops/triton_read_table.py``, where its
  semantics are stated), called here unvalidated with the runner's limits (``StepTables._read_limits``).
- ``new_read_entries``: entry ``t`` of the first ``min(T, capacity)`` is (``rtt[r, p]``, ``p``,
  ``rtt[r, p - 1]`` or -1 at position 0, ``input_ids[t]``) with ``r = rows[token_req[t]]`` and
  ``p = positions[t]``; ``count``, ``requested`` and ``enable`` as ``ops.fill_entries`` sets them for the
  batch's real tokens: ``extend`` summed over the requests outside row 0. A padding request's tokens (row 0,
  after every real request: a batch padded to its size bucket, ``tables.bucket``) come last; their entries
  are (0, 0, -1, ``input_ids[t]``) past the count, never read: their positions are not read either (the
  engine's input storage past the real tokens holds stale values).

The tensor-op versions (the read table's: the op's torch body) run from ``tables.py`` (the torch backend, and
the check these are held to: tests/test_hf_glue.py); the CPU's eager steps use the op's numpy body there, or its
numba loops (``ops/read_table_ops.py``: ``compiled_loop``, ``compiled_new_reads_match``).
``IndexKernels`` runs each kernel as the runner calls it: on its first eager call in the process (per device
type) also the tensor ops, compared on the host, and the tensor ops from then on, with a warning, where the
kernel fails to compile or launch or gives other cells. The kernels are an optimisation, never a new way to fail
or to report. The verdict is kept for the process, not per runner: transformers makes a new batch processor,
so a new runner, for every ``generate_batch`` call, and a check per runner put its synchronize (a stall of the
engine's async pipeline) and some twenty eager tensor ops into every call.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import _get_current_dispatch_mode

from kvcanary.ops import triton_ops
from kvcanary.ops.triton_read_table import launch as read_table
from kvcanary.runtime.streams import capturing

log = logging.getLogger("kvcanary")

ENTRY_BLOCK = 256  # new tokens per program


@triton.jit(do_not_specialize=["bs", "T", "capacity"])
def _new_reads_kernel(p_rtt, rtt_s0, p_rows, p_extend, bs, p_token_req, p_pos, p_ids, T, capacity, p_slot,
                      p_position, p_prev, p_expected, p_count, p_requested, p_enable, BLOCK_B: tl.constexpr,
                      BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    o = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = o < tl.minimum(T, capacity)
    req = tl.load(p_token_req + o, mask=m, other=0).to(tl.int64)
    row = tl.load(p_rows + req, mask=m, other=0).to(tl.int64)
    real = m & (row != 0)  # (a padding token's position is stale: never read)
    pos = tl.load(p_pos + o, mask=real, other=0).to(tl.int64)
    slot = tl.load(p_rtt + row * rtt_s0 + pos, mask=real, other=0)
    prev = tl.load(p_rtt + row * rtt_s0 + tl.maximum(pos - 1, 0), mask=real, other=0)
    tl.store(p_slot + o, slot, mask=m)
    tl.store(p_position + o, pos, mask=m)
    tl.store(p_prev + o, tl.where(real & (pos > 0), prev, -1), mask=m)
    tl.store(p_expected + o, tl.load(p_ids + o, mask=m, other=0).to(tl.int64), mask=m)
    if pid == 0:
        o_b = tl.arange(0, BLOCK_B)
        m_b = o_b < bs
        ext = tl.load(p_extend + o_b, mask=m_b, other=0).to(tl.int64)
        n = tl.sum(tl.where(tl.load(p_rows + o_b, mask=m_b, other=0) != 0, ext, 0), axis=0)  # the real tokens
        tl.store(p_count, tl.minimum(n, capacity))
        tl.store(p_requested, n)
        tl.store(p_enable, (n <= capacity).to(tl.int32))


def new_read_entries(entries, rtt: torch.Tensor, rows: torch.Tensor, extend: torch.Tensor, token_req: torch.Tensor,
                     positions: torch.Tensor, input_ids: torch.Tensor) -> None:
    """Fill ``entries`` with the new tokens' read cells of ``rtt`` (the module's docstring)."""
    bs, T, capacity = rows.shape[0], positions.shape[0], entries.capacity
    grid = (max(1, -(-min(T, capacity) // ENTRY_BLOCK)),)
    triton_ops._launch(_new_reads_kernel, grid, p_rtt=rtt, rtt_s0=rtt.stride(0), p_rows=rows, p_extend=extend, bs=bs,
                       p_token_req=token_req, p_pos=positions, p_ids=input_ids, T=T, capacity=capacity,
                       p_slot=entries.slot, p_position=entries.position, p_prev=entries.prev,
                       p_expected=entries.expected_token, p_count=entries.count, p_requested=entries.requested,
                       p_enable=entries.enable, BLOCK_B=max(16, triton.next_power_of_2(bs)), BLOCK=ENTRY_BLOCK)


# (device type, kernel name) -> True: held to the tensor ops once in this process; False: failed there
VERDICTS: dict[tuple[str, str], bool] = {}


class IndexKernels:
    """The runner's way to run the kernels above (``StepTables``): ``ok`` until one of them fails, in this
    runner or, on the same device type, in an earlier one of the process (``verdicts``: ``VERDICTS``; tests pass
    their own)."""

    def __init__(self, device: torch.device | str = "cuda", verdicts: dict | None = None):
        self.verdicts = VERDICTS if verdicts is None else verdicts
        self.where = torch.device(device).type
        mine = {n: v for (d, n), v in self.verdicts.items() if d == self.where}
        self.ok = all(mine.values())
        self.checked: set[str] = {n for n, v in mine.items() if v}
        self.read_table, self.new_read_entries = read_table, new_read_entries  # (tests put others in)

    def run(self, name: str, kernel, tensor_ops, outs: tuple) -> None:
        """``kernel()``, which writes ``outs``; ``tensor_ops()`` writes the same cells. The first eager call
        of each ``name`` runs both and compares (one synchronize; not inside a captured step)."""
        check = name not in self.checked and not _inside_capture()
        before = tuple(t.clone() for t in outs) if check else ()
        try:
            kernel()
        except Exception as e:  # (Triton's compilation errors have no common base besides Exception)
            self._give_up(name, f"{name} kernel failed ({type(e).__name__}: {e})")
            tensor_ops()
            return
        if not check:
            return
        got = tuple(t.clone() for t in outs)
        for t, b in zip(outs, before):
            t.copy_(b)
        tensor_ops()
        self.checked.add(name)
        if all(torch.equal(a, b) for a, b in zip(got, outs)):
            self.verdicts.setdefault((self.where, name), True)
        else:
            self._give_up(name, f"{name} kernel gave other cells than the tensor ops")  # (theirs are in place)

    def _give_up(self, name: str, why: str) -> None:
        self.ok = False
        self.verdicts[self.where, name] = False
        log.warning("kv-canary: the adapter's %s; using tensor ops", why)


def _inside_capture() -> bool:
    """A CUDA graph (or the CPU stand-in, a dispatch mode) is recording: no host read of device values."""
    return _get_current_dispatch_mode() is not None or (torch.cuda.is_available() and bool(capturing()))
