"""SGLang 0.5.23 compatibility: the edge rules of SPEC 4.2-4.4 that SGLang's reference pins, one named case each.

Every case runs on the scalar reference and on each fast backend (byte for byte, ``ops_harness.check``);
its outcome is then compared with vectors derived by hand from the rule and the SPEC 3.1 hash
(``format.link``), so a reference that drifted from SGLang's rule fails here too.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, FAST_BACKENDS
from kvcanary import ops
from kvcanary.format import CHAIN_HEAD, FailReason, LaunchTag, chain_hashes, link, to_signed
from kvcanary.ops import allocate_canary_buffer, allocate_counters
from ops_harness import SENTINEL, check, clean_chain, poisoned_plan, poisoned_ring, put_record, ring_rows

BACKENDS = FAST_BACKENDS + ["torch-static"]
F = FailReason
TAG = LaunchTag.HEAD_K_FULL
# Request A's clean chain: tokens 11..15 at positions 0..4 in slots 3..7.
A_SLOTS, A_TOKS = [3, 4, 5, 6, 7], [11, 12, 13, 14, 15]
# Slot 0 holds the record of an evicted predecessor (token 9 at position 20).
SLOT0 = (9, 20, 0x1234)


def t(xs, dtype=torch.int64):
    return torch.tensor(xs, dtype=dtype, device=DEVICE)


def _buffer():
    buf = allocate_canary_buffer(24, 48, DEVICE)
    clean_chain(buf, A_SLOTS, A_TOKS)
    put_record(buf, 0, *SLOT0)
    return buf


def _a_hash(*more_tokens: int) -> int:
    """prev_hash a clean continuation of A stores at position 5 + len(more_tokens)."""
    return chain_hashes(A_TOKS + list(more_tokens) + [0])[-1]


def _signed(row):
    return tuple(to_signed(x) for x in row)


# write: dict(seeds, offs, locs, ids, pos, [exp_ids, exp_pos]) -> (records {slot: (token, position, prev_hash)},
# rows in push order, ENTRIES counted); the chain-position assert is armed in every case.
H0 = link(SLOT0[2], SLOT0[0], SLOT0[1])  # link(slot 0's record)
WRITE_CASES = {
    # a skipped slot (< 0) mid-request: no checks (its token and position are wrong), no chain step, not counted
    "skip-slot-mid-request": (
        dict(seeds=[7], offs=[0, 3], locs=[14, -1, 15], ids=[16, 99, 17], pos=[5, 42, 6],
             exp_ids=[16, 0, 17], exp_pos=[5, 0, 6]),
        {14: (16, 5, _a_hash()), 15: (17, 6, _a_hash(16))}, [], 2),
    "skip-slot-first-entry": (
        dict(seeds=[7], offs=[0, 2], locs=[-1, 14], ids=[5, 16], pos=[0, 5]),
        {14: (16, 5, _a_hash())}, [], 1),
    # seed slot 0 is a predecessor like any other: its record is hashed and its position continued
    "seed-0-predecessor": (
        dict(seeds=[0], offs=[0, 2], locs=[14, 15], ids=[1, 2], pos=[21, 23]),
        {14: (1, 21, H0), 15: (2, 23, link(H0, 1, 21))},
        [(TAG, 15, 23, 2, 2, link(H0, 1, 21), 22, F.WRITE_POSITION)], 2),
    # no seed: the chain-position assert has nothing to continue from and checks none of the entries
    "no-seed-no-chain-check": (
        dict(seeds=[-1], offs=[0, 3], locs=[14, 15, 16], ids=[1, 2, 3], pos=[3, 9, 4]),
        dict(zip([14, 15, 16], zip([1, 2, 3], [3, 9, 4], chain_hashes([1, 2, 3], [3, 9, 4])))), [], 3),
    # the write-input assert and the chain-position assert fail on one entry: two rows, input row first
    "input-and-chain-fail-two-rows": (
        dict(seeds=[7], offs=[0, 1], locs=[14], ids=[16], pos=[9], exp_ids=[17], exp_pos=[7]),
        {14: (16, 9, _a_hash())},
        [(TAG, 14, 9, 16, 17, _a_hash(), 7, F.WRITE_TOKEN | F.WRITE_POSITION),
         (TAG, 14, 9, 16, 16, _a_hash(), 5, F.WRITE_POSITION)], 1),
}


def _write_run(c):
    def build():
        plan = poisoned_plan(1, 4, DEVICE)
        plan.write_offsets[:len(c["offs"])] = t(c["offs"])
        plan.seed_slot[:len(c["seeds"])] = t(c["seeds"])
        return {"buf": _buffer(), "plan": plan, "ring": poisoned_ring(8, DEVICE), "counters": allocate_counters(DEVICE)}

    def run(st, b):
        opt = lambda k: t(c[k]) if k in c else None  # noqa: E731
        ops.write(buf=st["buf"], plan=st["plan"], num_requests=len(c["seeds"]), out_cache_loc=t(c["locs"]),
                  input_ids=t(c["ids"]), positions=t(c["pos"]), ring=st["ring"], counters=st["counters"],
                  launch_tag=TAG, expected_input_ids=opt("exp_ids"), expected_positions=opt("exp_pos"),
                  chain_check=t([1], torch.int32), backend=b)
    return build, run


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(WRITE_CASES), ids=str)
def test_write_rule(backend, case):
    c, records, rows, entries = WRITE_CASES[case]
    ref = check(*_write_run(c), backend)
    words = ref["buf"].view(torch.int64)
    before = _buffer().view(torch.int64)
    for slot in range(words.shape[0]):
        if slot in records:
            assert words[slot, :3].tolist() == list(_signed(records[slot])), slot
        else:
            assert torch.equal(words[slot, :4], before[slot, :4]), f"slot {slot} changed"
    assert ring_rows(ref["ring"]) == [_signed(r) for r in rows]
    assert ref["counters"][TAG].tolist() == [1, entries]


# verify: dict(entries (slot, position, prev, expected_token), [enable, check_token]) -> (rows, counters)
H = chain_hashes(A_TOKS)  # prev_hash stored in slots 3..7
VERIFY_CASES = {
    # any negative prev is the chain head: slot 3 (the head) is clean, slot 4 (not the head) is not
    "prev-below-minus-1": (
        dict(entries=[(3, 0, -5, 11), (4, 1, -2, 12)]),
        [(TAG, 4, 1, 12, 12, H[1], CHAIN_HEAD, F.VERIFY_CHAIN_HASH)], [1, 2]),
    # a disabled verify checks nothing but still counts its launch
    "disabled-counts-launch": (
        dict(entries=[(4, 9, 3, 1)], enable=0), [], [1, 0]),
    # check_token off: no token check, EXPECTED_TOKEN reported as -1
    "token-check-off": (
        dict(entries=[(4, 1, 3, 99), (5, 7, 4, 98)], check_token=False),
        [(TAG, 5, 2, 13, -1, H[2], H[2], F.VERIFY_POSITION)], [1, 2]),
    "token-check-on": (
        dict(entries=[(4, 1, 3, 99), (5, 7, 4, 98)]),
        [(TAG, 4, 1, 12, 99, H[1], H[1], F.VERIFY_TOKEN),
         (TAG, 5, 2, 13, 98, H[2], H[2], F.VERIFY_POSITION | F.VERIFY_TOKEN)], [1, 2]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(VERIFY_CASES), ids=str)
def test_verify_rule(backend, case):
    c, rows, counters = VERIFY_CASES[case]

    def build():
        return {"buf": _buffer(), "plan": poisoned_plan(4, 1, DEVICE), "ring": poisoned_ring(8, DEVICE),
                "counters": allocate_counters(DEVICE)}

    def run(st, b):
        e = st["plan"].entries
        cols = list(zip(*c["entries"]))
        ops.fill_entries(e, t(cols[0]), t(cols[1]), t(cols[2]), t(cols[3]))
        e.enable.fill_(c.get("enable", 1))
        ops.verify(buf=st["buf"], entries=e, ring=st["ring"], counters=st["counters"], launch_tag=TAG,
                   check_token=c.get("check_token", True), backend=b)
    ref = check(build, run, backend)
    assert sorted(ring_rows(ref["ring"])) == sorted(_signed(r) for r in rows)
    assert ref["counters"][TAG].tolist() == counters


# plan: a 3-row table; row 1 holds slots 11..18, row 2 slots 21..28.
RTT = [[0] * 8, list(range(11, 19)), list(range(21, 29))]
PLAN_CASES = {
    # a request that writes nothing gets seed -1 (it has no chain to continue)
    "seed-of-request-writing-nothing": (
        dict(rows=[1, 2, 0], prefix=[3, 4, 2], extend=[0, 2, 1], capacity=16, max_batch=3),
        dict(seed=[-1, 24, -1], offsets=[0, 0, 2, 2], requested=7, count=7, enable=1)),
    # an overflowing plan clamps the count to the capacity and stores no entry
    "overflow-stores-no-entry": (
        dict(rows=[1, 2], prefix=[6, 7], extend=[1, 1], capacity=10, max_batch=2),
        dict(seed=[16, 27], offsets=[0, 1, 2], requested=13, count=10, enable=0, untouched=True)),
    # write offsets past the batch read 0
    "offsets-past-batch-zeroed": (
        dict(rows=[2], prefix=[1], extend=[3], capacity=4, max_batch=4),
        dict(seed=[21], offsets=[0, 3, 0, 0, 0], requested=1, count=1, enable=1)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(PLAN_CASES), ids=str)
def test_plan_rule(backend, case):
    c, want = PLAN_CASES[case]
    bs = len(c["rows"])

    def build():
        return {"plan": poisoned_plan(c["capacity"], c["max_batch"], DEVICE), "rtt": t(RTT)}

    def run(st, b):
        ops.plan(req_pool_indices=t(c["rows"]), prefix_lens=t(c["prefix"]), extend_lens=t(c["extend"]),
                 req_to_token=st["rtt"], out=st["plan"], backend=b)
    ref = check(build, run, backend)
    p, e = ref["plan"], ref["plan"].entries
    assert p.seed_slot[:bs].tolist() == want["seed"]
    assert p.write_offsets.tolist() == want["offsets"]
    assert [int(e.requested[0]), int(e.count[0]), int(e.enable[0])] == [want["requested"], want["count"],
                                                                        want["enable"]]
    if want.get("untouched"):
        assert (e.slot == SENTINEL).all() and (e.expected_token == SENTINEL).all()
