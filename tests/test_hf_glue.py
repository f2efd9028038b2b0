"""The adapter's read table and new-token read entries as Triton kernels (runtime/step/kernels.py) give
what the tensor ops and the numpy host path give, cell for cell (Triton under the interpreter on the CPU)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from kvcanary import ops  # noqa: E402
from kvcanary.runtime.step.tables import StepTables, new_read_ops  # noqa: E402

from conftest import DEVICE  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE.type == "cpu" and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton on the CPU needs TRITON_INTERPRET=1")
NUM_SLOTS = 500


def builder(glue: bool, verdicts: dict | None = None) -> StepTables:
    from kvcanary.runtime.step import kernels as hf_glue

    b = StepTables.__new__(StepTables)
    b.num_rows, b.device, b.warned_read_size = 9, DEVICE, False
    b.group, b.num_slots, b.block_size = 0, NUM_SLOTS, 4
    b.iota = torch.arange(4, device=DEVICE)
    if glue:
        # (the kernels alone, no check against the ops, unless the test passes its verdicts)
        b.glue = hf_glue.IndexKernels(DEVICE, {(DEVICE.type, "read table"): True,
                                               (DEVICE.type, "new tokens' read entries"): True}
                                      if verdicts is None else verdicts)
    return b


def case(seed: int, bs: int, short: int = 0):
    """A batch of ``bs`` requests in distinct rows, their lengths, and a read index listing ``short`` slots
    fewer than they read (the rest of its storage holds stale slots)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(9, generator=g)[:bs]
    prefix = torch.randint(0, 40, (bs,), generator=g)
    extend = torch.randint(1, 5, (bs,), generator=g)
    total = int((prefix + extend).sum())
    storage = torch.randint(0, NUM_SLOTS, (1, total + 64), generator=g)
    io = SimpleNamespace(use_block_table=False, max_kv_read=1, read_index_storage=storage.to(DEVICE),
                         true_read_sizes=[total - short])
    packed = torch.cat([rows, prefix, extend]).to(DEVICE)
    return io, packed[:bs], packed[bs:2 * bs], packed[2 * bs:], total


@pytest.mark.parametrize("seed,bs,short", [(0, 1, 0), (1, 5, 0), (2, 9, 0), (3, 6, 7), (4, 3, 1)])
@pytest.mark.parametrize("width", [1, 37, 300])
def test_read_table_kernel_fills_what_tensor_ops_and_numpy_fill(seed, bs, short, width):
    io, rows, prefix, extend, total = case(seed, bs, short)
    tables = []
    for glue in (False, True):
        rtt = torch.full((9, width), -5, dtype=torch.int64, device=DEVICE)
        builder(glue)._read_table(io, rows, prefix, extend, width, total, out=rtt, host=False)
        tables.append(rtt.cpu())
    host = torch.full((9, width), -5, dtype=torch.int64)
    views = SimpleNamespace(rows=rows.cpu().numpy(), prefix=prefix.cpu().numpy(), extend=extend.cpu().numpy(),
                            rtt=host.numpy(), read=io.read_index_storage[0].cpu().numpy())
    builder(False)._fill_host(views, io, total)
    assert torch.equal(tables[0], tables[1]) and torch.equal(tables[0], host)
    # (the check can fail: the untouched rows kept their marker, the request rows got slots, short ones the fill)
    untouched = sorted(set(range(9)) - set(rows.tolist()) | {0})  # (row 0, the padding row, is never filled)
    assert all((tables[1][r] == -5).all() for r in untouched)
    assert ((tables[1] == NUM_SLOTS).any().item()) == (short > 0 and width > 1)


@pytest.mark.parametrize("capacity", [64, 5])
@pytest.mark.parametrize("pad", [0, 2])
def test_new_read_entries_kernel_fills_what_fill_entries_fills(capacity, pad):
    # ``pad`` padding requests at the batch's end (row 0, one token each, as a batch padded to its bucket):
    # their positions are stale values far outside the table, which neither path may read
    g = torch.Generator().manual_seed(7)
    rtt = torch.randint(0, NUM_SLOTS, (9, 50), generator=g).to(DEVICE)
    rows = torch.tensor([4, 3, 7] + [0] * pad, device=DEVICE)
    extend = torch.tensor([3, 2, 3] + [1] * pad, device=DEVICE)
    token_req = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2] + list(range(3, 3 + pad)), device=DEVICE)
    positions = torch.tensor([0, 1, 2, 13, 14, 47, 48, 49] + [10**6] * pad, dtype=torch.int32, device=DEVICE)
    n = 8 + pad
    input_ids = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32).to(DEVICE)
    got = []
    for glue in (False, True):
        b = builder(glue)
        b.new_reads = ops.Entries.allocate(capacity, DEVICE)
        # the entries start dirty: whatever a step leaves past the count is never read, the rest must agree
        for t in (b.new_reads.slot, b.new_reads.position, b.new_reads.prev, b.new_reads.expected_token):
            t.fill_(-9)
        if glue:
            b.glue.new_read_entries(b.new_reads, rtt, rows, extend, token_req, positions, input_ids)
        else:
            new_read_ops(b.new_reads, rtt, rows, extend, token_req, positions, input_ids)
        e = b.new_reads
        got.append([t.cpu() for t in (e.slot, e.position, e.prev, e.expected_token, e.count, e.requested, e.enable)])
    for a, b in zip(*got):
        assert torch.equal(a, b)
    slot, position, prev, expected, count, requested, enable = got[1]
    k = min(8, capacity)  # (the real tokens: the padding's are past the count)
    assert count.item() == k and requested.item() == 8 and enable.item() == int(8 <= capacity)
    assert slot[:k].tolist() == [int(rtt[rows[r], p]) for r, p in zip(token_req.tolist()[:k], positions.tolist()[:k])]
    assert prev[:k].tolist() == [-1 if p == 0 else int(rtt[rows[r], p - 1]) for r, p in
                                 zip(token_req.tolist()[:k], positions.tolist()[:k])]
    assert np.array_equal(expected[:k].numpy(), input_ids[:k].cpu().numpy())
    if pad and capacity >= n:  # a padding token's entry reads no cell
        assert slot[8:n].tolist() == [0] * pad and position[8:n].tolist() == [0] * pad
        assert prev[8:n].tolist() == [-1] * pad


@pytest.mark.parametrize("fault", ["raises", "wrong-cells", None])
def test_a_kernel_is_checked_once_against_the_tensor_ops_and_given_up_if_it_fails(caplog, fault):
    # The first eager call of each kernel also runs the tensor ops and compares; a kernel that raises or
    # gives other cells leaves the tensor ops in charge (their cells in place) with one warning.
    from kvcanary.runtime.step import kernels as hf_glue

    io, rows, prefix, extend, total = case(5, 4, short=2)
    want = torch.full((9, 40), -5, dtype=torch.int64, device=DEVICE)
    builder(False)._read_table(io, rows, prefix, extend, 40, total, out=want, host=False)
    verdicts = {}
    b = builder(True, verdicts)
    calls = []

    def kernel(out, *args):
        calls.append(1)
        if fault == "raises":
            raise RuntimeError("no such kernel on this Triton")
        hf_glue.read_table(out, *args)
        if fault == "wrong-cells":
            out[rows[0], 0] += 1

    b.glue.read_table = kernel
    for step in range(3):
        got = torch.full((9, 40), -5, dtype=torch.int64, device=DEVICE)
        with caplog.at_level("WARNING", logger="kvcanary"):
            b._read_table(io, rows, prefix, extend, 40, total, out=got, host=False)
        assert torch.equal(got, want), step
    assert b.glue.ok == (fault is None) and len(calls) == (1 if fault else 3)
    warned = [r.getMessage() for r in caplog.records if "tensor ops" in r.getMessage()]
    assert warned == ({"raises": ["kv-canary: the adapter's read table kernel failed (RuntimeError: no such kernel "
                                  "on this Triton); using tensor ops"],
                       "wrong-cells": ["kv-canary: the adapter's read table kernel gave other cells than the "
                                       "tensor ops; using tensor ops"], None: []}[fault])
    # The verdict outlives the runner (transformers makes one per call): the next one neither checks again
    # (no synchronize, no tensor ops) nor, after a failure, tries the kernel again.
    assert verdicts == {(DEVICE.type, "read table"): fault is None}
    later = builder(True, verdicts)
    later.glue.read_table, ops_calls, calls[:] = kernel, [], []
    tensor_ops = later._read_table_ops
    later._read_table_ops = lambda *a: (ops_calls.append(1), tensor_ops(*a))[1]
    got = torch.full((9, 40), -5, dtype=torch.int64, device=DEVICE)
    later._read_table(io, rows, prefix, extend, 40, total, out=got, host=False)
    assert torch.equal(got, want) and later.glue.ok == (fault is None)
    assert (len(calls), len(ops_calls)) == ((1, 0) if fault is None else (0, 1))
