"""kvcanary.distributed in one process: records that travel, the arrival check, digests, rank naming."""

from __future__ import annotations

import pytest
import torch

from kvcanary import Canary, CanaryConfig, ForwardBatch, PoolSpec, RealKvSource
from kvcanary.distributed import ArrivalCheck, land_records, pack_records, record_digest, spawn
from kvcanary.distributed.consistency import ConsistencyCheck, compare, violation_digest
from kvcanary.distributed.launch import free_port
from kvcanary.format import RecordField as R, chain_hashes, to_signed
from kvcanary.runtime.report import Violation

TOKENS = [11, 22, 33, 44, 55]
SRC = [5, 6, 7, 8, 9]
DST = [20, 21, 22, 23, 24]


def make(stride: int = 48):
    k = torch.zeros(64, 8, dtype=torch.float32)
    pool = PoolSpec(64, k_sources=(RealKvSource(k, page_size=1, num_bytes_per_token=32, read_bytes=32),))
    canary = Canary(pool, CanaryConfig(mode="log", backend="torch", record_stride=stride), max_batch=4,
                    max_tokens=32, max_context=16, num_rows=4)
    return canary, k, torch.zeros(4, 16, dtype=torch.int32)


def forward(canary, k, table, row, prefix, tokens, slots, rid=7):
    n = len(tokens)
    table[row, prefix:prefix + n] = torch.tensor(slots, dtype=torch.int32)
    t = torch.tensor
    batch = ForwardBatch(t([row]), t([prefix]), t([n]), t(tokens), torch.arange(prefix, prefix + n), t(slots), table,
                         request_ids=t([rid]))
    canary.before_forward(batch)
    k[t(slots)] = torch.randn(n, 8, generator=torch.Generator().manual_seed(prefix + 1))
    canary.after_forward(batch)


@pytest.fixture
def prefilled():
    canary, k, table = make()
    forward(canary, k, table, 1, 0, TOKENS, SRC)
    assert canary.flush() == []
    return canary, k


def arrive(prefilled, kv_order=None, table_slots=None, tokens=None, drop_last=False):
    """Send the prefilled request to a fresh decode canary; returns (decode canary, k, table, check, found)."""
    src, src_k = prefilled
    packet = pack_records(src, torch.tensor(SRC), torch.tensor(tokens or TOKENS), request_id=7)
    dec, k, table = make()
    order = kv_order or list(range(len(SRC)))
    count = len(SRC) - 1 if drop_last else len(SRC)
    k[torch.tensor(DST[:count])] = src_k[torch.tensor([SRC[i] for i in order])][:count]
    land_records(dec, packet, torch.tensor(DST))
    table[1, :len(DST)] = torch.tensor(table_slots or DST, dtype=torch.int32)
    check = ArrivalCheck(dec, instance="decode", rank=1)
    return dec, k, table, check, check.check(packet, table[1], src_rank=0)


def test_records_travel_byte_for_byte_and_the_chain_continues(prefilled):
    src, _ = prefilled
    dec, k, table, check, found = arrive(prefilled)
    assert found == [] and check.total == 0
    for key, buf in dec._group("full").bufs.items():
        assert torch.equal(buf[torch.tensor(DST)], src._group("full").bufs[key][torch.tensor(SRC)]), key
    stored = dec._group("full").bufs["tail", "k"][torch.tensor(DST)].view(torch.int64)[:, R.PREV_HASH].tolist()
    assert stored == [to_signed(h) for h in chain_hashes(TOKENS)]
    # The first decode forward on the decode side reads the landed prefix and extends its chain: clean.
    forward(dec, k, table, 1, len(TOKENS), [66], [25])
    forward(dec, k, table, 1, len(TOKENS) + 1, [77], [26])
    assert dec.flush() == []
    assert dec.stats()["entries_checked"] > 0


@pytest.mark.parametrize("case, kwargs, slots, reason", [
    ("pages_swapped", dict(kv_order=[1, 0, 2, 3, 4]), [20, 21], "verify_real_kv_hash"),
    ("last_page_missing", dict(drop_last=True), [24], "verify_real_kv_hash"),
    ("table_other_slots", dict(table_slots=[20, 21, 23, 22, 24]), [22, 23, 24], "verify_chain_hash"),
    ("tokens_differ", dict(tokens=[11, 22, 99, 44, 55]), [22], "verify_token"),
])
def test_arrival_check_names_the_broken_transfer(prefilled, case, kwargs, slots, reason):
    *_, check, found = arrive(prefilled, **kwargs)
    assert sorted({f.violation.slot for f in found}) == slots
    assert all(reason in f.violation.reasons for f in found)
    lines = sorted(f.log_line() for f in found)
    head = "kv_canary transfer violation: instance=decode rank=1 src_rank=0 request=7 "
    assert all(x.startswith(head) for x in lines)
    assert f"slot_idx={slots[0]} " in "".join(lines)
    assert found[0].to_dict()["rank"] == 1 and check.cost()["checks"] == 1


def test_wrong_arrival_is_reported_again_by_the_first_decode_forward(prefilled):
    dec, k, table, _, found = arrive(prefilled, kv_order=[1, 0, 2, 3, 4])
    assert found
    forward(dec, k, table, 1, len(TOKENS), [66], [25])
    assert {v.slot for v in dec.flush() if "verify_real_kv_hash" in v.reasons} == {20, 21}


def test_landing_refuses_a_mismatched_packet(prefilled):
    src, _ = prefilled
    packet = pack_records(src, torch.tensor(SRC), torch.tensor(TOKENS), request_id=7)
    dec, _, _ = make()
    before = [b.clone() for b in dec._group("full").bufs.values()]
    with pytest.raises(ValueError, match="land_records slots must be 1-D of the packet's length"):
        land_records(dec, packet, torch.tensor(DST[:3]))
    other, _, _ = make(stride=32)
    with pytest.raises(ValueError, match="same canary configuration"):
        land_records(other, packet, torch.tensor(DST))
    with pytest.raises(ValueError, match="pack_records slots and tokens"):
        pack_records(src, torch.tensor(SRC), torch.tensor(TOKENS[:2]), request_id=7)
    assert all(torch.equal(a, b) for a, b in zip(before, dec._group("full").bufs.values()))
    check = ArrivalCheck(dec, rank=1, capacity=3)
    with pytest.raises(ValueError, match=r"packet must hold <= capacity \(3\) positions, got 5"):
        check.check(packet, torch.tensor(DST))
    with pytest.raises(ValueError, match="table_slots must be 1-D with >= 5 entries"):
        ArrivalCheck(dec, rank=1).check(packet, torch.tensor(DST[:4]))


def test_record_digest_sees_records_and_slots_but_not_the_real_kv_hash(prefilled):
    src, _ = prefilled
    buf = src._group("full").bufs["tail", "k"]
    base = record_digest(buf).item()
    for field in (R.REAL_KV_HASH, R.WRITER_ID, R.WRITER_STEP):
        b = buf.clone()
        b.view(torch.int64)[SRC[0], field] += 1
        assert record_digest(b).item() == base, field
    for field in (R.TOKEN, R.POSITION, R.PREV_HASH):
        b = buf.clone()
        b.view(torch.int64)[SRC[0], field] += 1
        assert record_digest(b).item() != base, field
    moved = buf.clone()
    moved[[SRC[0], 40]] = moved[[40, SRC[0]]]
    assert record_digest(moved).item() != base


def test_violation_digest_ignores_order_and_sees_every_field():
    a = Violation.from_row([2, 5, 1, 11, -1, 3, 3, 4], step=3)
    b = Violation.from_row([0, 6, 2, 12, 12, 9, 8, 1], step=4)
    assert violation_digest([a, b]) == violation_digest([b, a]) != violation_digest([a])
    assert violation_digest([Violation.from_row([2, 5, 1, 11, -1, 3, 3, 2], step=3)]) != violation_digest([a])
    assert violation_digest([]) == 0


@pytest.mark.parametrize("rows, named, reference", [
    ([[1, 2], [1, 2], [1, 2]], [], "majority of 3"),
    ([[1, 2], [1, 9], [1, 2]], [(1, ("b",))], "majority of 3"),
    ([[7, 2], [1, 2], [1, 2], [1, 2]], [(0, ("a",))], "majority of 4"),
    ([[1, 2], [5, 3]], [(1, ("a", "b"))], "rank 0 (no majority of 2)"),
    ([[1, 2], [1, 2], [5, 2], [5, 2]], [(2, ("a",)), (3, ("a",))], "rank 0 (no majority of 4)"),
    ([[1, 2], [5, 2], [5, 2], [1, 2]], [(1, ("a",)), (2, ("a",))], "rank 0 (no majority of 4)"),
])
def test_compare_names_the_ranks_off_the_majority(rows, named, reference):
    got = compare(rows, ["a", "b"], step=8)
    assert [(d.rank, d.fields) for d in got] == named
    assert all(d.reference == reference and d.step == 8 for d in got)


def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="backend must be one of"):
        spawn(print, 2, backend="mpi")
    with pytest.raises(ValueError, match="world_size must be an int >= 2"):
        spawn(print, 1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend 'nccl' needs CUDA"):
            spawn(print, 2, backend="nccl")
    with pytest.raises(ValueError, match="interval must be an int >= 0"):
        ConsistencyCheck(None, interval=-1)
    assert 0 < free_port() < 65536


@pytest.mark.parametrize("dtype", [torch.int16, torch.bfloat16, torch.float32, torch.int64, torch.uint8])
def test_kv_travels_as_bytes_that_fill_the_typed_tensor(dtype):
    # NCCL refuses int16 tensors; the transfer sends every KV tensor as its bytes instead.
    from kvcanary.distributed.transfer import wire_bytes

    g = torch.Generator().manual_seed(3)
    sent = torch.randint(-100, 100, (3, 4, 5), generator=g).to(dtype)
    wire = wire_bytes(sent)
    assert wire.dtype == torch.uint8 and wire.numel() == sent.numel() * sent.element_size()
    arrived = torch.empty_like(sent)
    wire_bytes(arrived).copy_(wire)  # what a receive into the view does
    assert torch.equal(arrived, sent)
