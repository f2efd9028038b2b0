"""The step snapshot's pass (kvcanary/ops/snapshot_ops.py, triton_snapshot.py): every implementation copies the
rows a step stored and the records their slots held as the scalar reference does, bit for bit, whatever the rows
past the count hold."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import DEVICE, HAS_TRITON
from kvcanary.ops.snapshot_ops import record_table, snapshot_impl

IMPLS = ["torch"] + (["triton"] if HAS_TRITON else [])
WORDS = 6


def _case(rng: random.Random, capacity: int, count: int, rec_rows: int):
    """A ring of ``capacity`` rows with ``count`` stored (slots in and out of the buffers' ranges), three record
    buffers of two sizes laid out as the canary's (int64 views of wider records), poisoned outputs."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    rows = torch.randint(-2**62, 2**62, (capacity, 8), generator=g)
    rows[:, 1] = torch.randint(-5, 60, (capacity,), generator=g)  # (slots below 0 and past every buffer)
    sizes = [40, 40, 17]
    backing = [torch.randint(-2**62, 2**62, (n, 8), generator=g).to(DEVICE) for n in sizes]
    records = [b[:, :WORDS] for b in backing]  # (views: row stride 8, as the canary's record buffers)
    out_rows = torch.full((capacity, 8), 7, dtype=torch.int64)
    out_records = torch.full((len(records), rec_rows, WORDS), 7, dtype=torch.int64)
    write_index = torch.tensor([count], dtype=torch.int64)
    return (rows.to(DEVICE), write_index.to(DEVICE), out_rows.to(DEVICE), records, out_records.to(DEVICE))


def _run(impl: str, case) -> tuple[torch.Tensor, torch.Tensor]:
    rows, write_index, out_rows, records, out_records = (x if isinstance(x, list) else x.clone() for x in case)
    record_at = record_table(records, rows.device) if impl == "triton" else None
    snapshot_impl(impl).snapshot_rows(rows=rows, write_index=write_index, out_rows=out_rows, records=records,
                                      record_at=record_at, out_records=out_records)
    return out_rows.cpu(), out_records.cpu()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("count", [0, 1, 63, 64, 65, 150, 999])  # (999: more than the ring holds)
def test_snapshot_rows_agrees_with_the_reference(impl, count):
    rng = random.Random(count)
    capacity, rec_rows = 150, 100
    case = _case(rng, capacity, count, rec_rows)
    want_rows, want_recs = _run("reference", case)
    got_rows, got_recs = _run(impl, case)
    stored = min(count, capacity)
    assert torch.equal(got_rows[:stored], want_rows[:stored])
    kept = min(stored, rec_rows)
    assert torch.equal(got_recs[:, :kept], want_recs[:, :kept])
    # the reference, written out: each row's slot clamped into each buffer
    rows, records = case[0].cpu(), [r.cpu() for r in case[3]]
    for r in range(kept):
        for k, buf in enumerate(records):
            assert want_recs[k, r].tolist() == buf[min(max(int(rows[r, 1]), 0), buf.shape[0] - 1)].tolist()
    assert torch.equal(want_rows[:stored], rows[:stored])


@pytest.mark.parametrize("impl", IMPLS)
def test_snapshot_rows_without_records_copies_the_rows(impl):
    rows, write_index, out_rows, _, _ = _case(random.Random(5), 80, 70, 16)
    snapshot_impl(impl).snapshot_rows(rows=rows, write_index=write_index, out_rows=out_rows, records=[],
                                      out_records=None)
    assert torch.equal(out_rows[:70].cpu(), rows[:70].cpu())


def test_record_table_refuses_a_buffer_it_cannot_reach_from_the_first():
    a = torch.zeros(4, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="int64 views with contiguous rows"):
        record_table([a[:, :6], torch.zeros(4, 8, dtype=torch.int32)], a.device)
