"""Case tables: every op on awkward inputs, each fast backend against the scalar reference, byte for byte.

Outputs start poisoned (0x5A...) so a backend that leaves a cell unwritten differs from the
reference, which writes it. ``torch-static`` runs the torch path with static shapes (the code
a CUDA graph captures) on CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import DEVICE, FAST_BACKENDS
from kvcanary import ops
from kvcanary.format import VIOLATION_COUNT_LIMIT, CHAIN_HEAD, FailReason, LaunchTag, RealKvMode, link, to_signed
from kvcanary.ops import ViolationRing, allocate_canary_buffer, allocate_counters
from ops_harness import (SENTINEL, SENTINEL32, as_bytes, check, clean_chain, flatten, flip_kv_byte, kv_source,
                         poisoned_plan, poisoned_ring, put_record, reasons, ring_rows, use_backend)
from sim_engine import Config, Script, build_state, replay

BACKENDS = FAST_BACKENDS + ["torch-static"]
F = FailReason
I64 = torch.int64


def t(xs, dtype=I64):
    return torch.tensor(xs, dtype=dtype, device=DEVICE)


# fingerprint

SOURCE_SETS = {
    "fp16-page1": [(torch.float16, 1, 32, 32, 0, False)],
    "bf16-page4-read16of48": [(torch.bfloat16, 4, 48, 16, 0, False)],
    "fp32-page2-3d": [(torch.float32, 2, 64, 64, 0, True)],
    "u8-padded-row-stride": [(torch.uint8, 3, 16, 16, 32, False)],
    "four-mixed": [(torch.float16, 1, 32, 32, 0, False), (torch.bfloat16, 4, 16, 16, 16, False),
                   (torch.float32, 2, 32, 16, 0, True), (torch.uint8, 8, 16, 16, 0, False)],
}
FP_SLOTS = [-9, -1, 0, 1, 2, 3, 4, 5, 7, 8, 15, 16, 22, 23, 24, 25, 1 << 40]


def _sources(spec, num_slots=24):
    return [kv_source(num_slots, dtype=dt, page_size=ps, nbpt=nb, read_bytes=rb, pad_bytes=pad, device=DEVICE,
                      seed=i, three_d=d3) for i, (dt, ps, nb, rb, pad, d3) in enumerate(spec)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(RealKvMode), ids=lambda m: m.name)
@pytest.mark.parametrize("spec", list(SOURCE_SETS), ids=str)
def test_fingerprint(backend, mode, spec):
    def build():
        return {"kv": _sources(SOURCE_SETS[spec]), "out": torch.empty(0)}

    def run(st, b):
        st["out"] = ops.fingerprint(t(FP_SLOTS), st["kv"], mode, backend=b)
    ref = check(build, run, backend)
    assert (ref["out"] == 0).all() == (mode == RealKvMode.NONE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fingerprint_empty_slots_and_no_sources(backend):
    def run(st, b):
        st["a"] = ops.fingerprint(t([]), _sources(SOURCE_SETS["fp16-page1"]), RealKvMode.ALL, backend=b)
        st["b"] = ops.fingerprint(t([1, 2]), (), RealKvMode.ALL, backend=b)
    ref = check(lambda: {}, run, backend)
    assert ref["a"].shape == (0,) and ref["b"].tolist() == [0, 0]


# scatter_req_token_ids

SCATTER_CASES = {
    # name: (flat, offsets, rows)
    "empty-batch": ([1, 2], [0], []),
    "empty-flat": ([], [0, 0], [1]),
    "one-row": ([7, 8, 9], [0, 3], [2]),
    "truncated-to-width": (list(range(100, 110)), [0, 10], [1]),
    "row-0": ([5, 6], [0, 2], [0]),
    "duplicate-row-last-wins": ([1, 2, 3, 4, 5], [0, 3, 5], [2, 2]),
    "duplicate-row-shorter-later": ([1, 2, 3, 4, 5, 6, 7], [0, 5, 7], [1, 1]),
    "row-out-of-range": ([1, 2, 3, 4], [0, 2, 4], [-1, 4]),
    "negative-span": ([1, 2, 3], [2, 0, 3], [1, 2]),
    "span-past-flat": ([1, 2, 3], [1, 9, 12], [1, 2]),
    "negative-start": ([1, 2, 3], [-2, 2, 3], [1, 3]),
    "int32-wrap": ([2**31, -(2**31) - 1, 2**40 + 5], [0, 3], [3]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(SCATTER_CASES), ids=str)
def test_scatter(backend, case):
    flat, offs, rows = SCATTER_CASES[case]
    if backend == "triton" and case.startswith("duplicate-row"):
        pytest.skip("requests sharing a row race in a parallel backend (the reference's last writer wins)")

    def build():
        return {"pool": torch.full((4, 6), SENTINEL32, dtype=torch.int32, device=DEVICE)}

    def run(st, b):
        ops.scatter_req_token_ids(t(flat), t(offs), t(rows), st["pool"], backend=b)
    check(build, run, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scatter_noncontiguous_pool(backend):
    def build():
        return {"pool": torch.full((6, 4), SENTINEL32, dtype=torch.int32, device=DEVICE).t()}

    def run(st, b):
        ops.scatter_req_token_ids(t([1, 2, 3, 4, 5, 6, 7]), t([0, 4, 7]), t([1, 3]), st["pool"], backend=b)
    ref = check(build, run, backend)
    assert ref["pool"][1].tolist() == [1, 2, 3, 4, SENTINEL32, SENTINEL32]


# plan

RTT = [[0] * 10,
       [11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
       [21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
       [31, 32, 0, 34, -3, 36, 37, 38, 39, 99]]
SWA = [0] * 11 + [0, 0, 3, 4, 5, 6, 7, 8, 9, 10] + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20] + [1, 2, 3, 4]
TOKENS = [[r * 100 + c for c in range(11)] for r in range(3)]  # 3 rows only: row 3 reads no tokens

PLAN_CASES = {
    # name: dict(rows, prefix, extend, **plan kwargs)
    "empty-batch": dict(rows=[], prefix=[], extend=[]),
    "padding-row-0": dict(rows=[1, 0, 2], prefix=[3, 5, 2], extend=[1, 1, 2]),
    "prefix-0": dict(rows=[1, 2], prefix=[0, 0], extend=[4, 3]),
    "prefix-1-position-0": dict(rows=[1], prefix=[1], extend=[1]),
    "prefix-past-max-ctx": dict(rows=[2], prefix=[14], extend=[1]),
    "negative-prefix-and-extend": dict(rows=[1, 2], prefix=[-2, 3], extend=[-1, 0]),
    "row-out-of-range": dict(rows=[5, -1, 1], prefix=[3, 3, 2], extend=[2, 2, 1]),
    "odd-slots-negative-and-0": dict(rows=[3], prefix=[10], extend=[1]),
    "window-below-prefix": dict(rows=[1, 2], prefix=[7, 4], extend=[1, 1], window=3, full_to_swa=SWA),
    "window-equals-prefix": dict(rows=[1], prefix=[4], extend=[1], window=4, full_to_swa=SWA),
    "window-above-prefix": dict(rows=[1], prefix=[4], extend=[1], window=9, full_to_swa=SWA),
    "window-1": dict(rows=[1, 2], prefix=[5, 1], extend=[1, 1], window=1, full_to_swa=SWA),
    "swa-evicted-predecessor": dict(rows=[1, 3], prefix=[6, 10], extend=[1, 1], window=4, full_to_swa=SWA),
    "swa-short-table": dict(rows=[3], prefix=[10], extend=[1], window=5, full_to_swa=SWA[:25]),
    "swa-empty-table": dict(rows=[1], prefix=[5], extend=[1], window=2, full_to_swa=[]),
    "overflow": dict(rows=[1, 2], prefix=[6, 7], extend=[1, 1], capacity=10),
    "exactly-full": dict(rows=[1, 2], prefix=[6, 4], extend=[1, 1], capacity=10),
    "capacity-0": dict(rows=[1], prefix=[2], extend=[1], capacity=0),
    "tokens-offset-0": dict(rows=[1, 2], prefix=[5, 3], extend=[1, 1], tokens=[4, 9]),
    "tokens-offset-1": dict(rows=[1, 2], prefix=[5, 3], extend=[1, 1], tokens=[6, 3], token_offset=1),
    "tokens-valid-0": dict(rows=[1], prefix=[5], extend=[1], tokens=[0]),
    "tokens-row-missing": dict(rows=[3, 1], prefix=[4, 10], extend=[1, 1], tokens=[10, 20], token_offset=1),
}


def _plan_run(case, dtype):
    c = dict(PLAN_CASES[case])
    cap, bs = c.pop("capacity", 64), len(c["rows"])

    def build():
        st = {"plan": poisoned_plan(cap, max(bs, 1) + 1, DEVICE), "rtt": t(RTT, dtype)}
        if "tokens" in c:
            st["tokens"] = t(TOKENS, torch.int32)
        return st

    def run(st, b):
        ops.plan(req_pool_indices=t(c["rows"], dtype), prefix_lens=t(c["prefix"], dtype),
                 extend_lens=t(c["extend"], dtype), req_to_token=st["rtt"], out=st["plan"],
                 window=c.get("window", 0),
                 full_to_swa=t(c["full_to_swa"], dtype) if "full_to_swa" in c else None,
                 token_table=st.get("tokens"),
                 token_valid_lens=t(c["tokens"], dtype) if "tokens" in c else None,
                 token_offset=c.get("token_offset", 0), backend=b)
    return build, run


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("case", list(PLAN_CASES), ids=str)
def test_plan(backend, dtype, case):
    build, run = _plan_run(case, dtype)
    ref = check(build, run, backend)
    e = ref["plan"].entries
    bs = len(PLAN_CASES[case]["rows"])
    # Offsets past the batch read 0 (SGLang zeroes them).
    assert (ref["plan"].write_offsets[bs + 1:] == 0).all()
    if case == "overflow":
        # SGLang: the count is clamped to the capacity and no entry is stored; ours also keeps the request.
        assert (int(e.requested[0]), int(e.count[0]), int(e.enable[0])) == (13, 10, 0)
        assert (e.slot == SENTINEL).all() and (e.prev == SENTINEL).all()
    if case == "exactly-full":
        assert (int(e.requested[0]), int(e.count[0]), int(e.enable[0])) == (10, 10, 1)
    if case == "swa-evicted-predecessor":
        # Row 1, P=6, W=4: positions 2..5; position 2's predecessor (full slot 12) is evicted.
        assert e.prev[:4].tolist() == [0, 3, 4, 5]
    if case == "padding-row-0":
        assert ref["plan"].write_offsets[:4].tolist() == [0, 1, 1, 3]
        assert ref["plan"].seed_slot[:3].tolist() == [13, -1, 22]


# write

# Clean chains in the buffer: request A at slots 3..7 (tokens 11..15), B at slots 10..12.
A_SLOTS, A_TOKS = [3, 4, 5, 6, 7], [11, 12, 13, 14, 15]
B_SLOTS, B_TOKS = [10, 11, 12], [21, 22, 23]

WRITE_CASES = {
    # name: dict(seeds, offs, locs, ids, pos, [exp_ids, exp_pos, chain, ring, nr, sources, stride, writer, step])
    "no-requests": dict(seeds=[], offs=[0], locs=[1], ids=[1], pos=[0]),
    "chain-head": dict(seeds=[-1], offs=[0, 3], locs=[14, 15, 16], ids=[1, 2, 3], pos=[0, 1, 2]),
    "seeded-two-requests": dict(seeds=[7, 12], offs=[0, 2, 3], locs=[14, 15, 16], ids=[16, 17, 24], pos=[5, 6, 3]),
    "seed-slot-0": dict(seeds=[0], offs=[0, 2], locs=[14, 15], ids=[1, 2], pos=[9, 10]),
    "seed-past-buffer": dict(seeds=[999], offs=[0, 2], locs=[14, 15], ids=[1, 2], pos=[9, 11]),
    "empty-request-between": dict(seeds=[7, 5, 12], offs=[0, 1, 1, 2], locs=[14, 15], ids=[16, 24], pos=[5, 3]),
    "skip-negative-and-out-of-range-slots": dict(seeds=[-1], offs=[0, 4], locs=[-1, 14, 99, 15],
                                                 ids=[1, 2, 3, 4], pos=[0, 1, 2, 3]),
    "padding-slot-0": dict(seeds=[-1], offs=[0, 2], locs=[0, 0], ids=[5, 6], pos=[0, 1]),
    "offsets-past-tokens": dict(seeds=[-1, 7], offs=[0, 2, 9], locs=[14, 15, 16], ids=[1, 2, 16], pos=[0, 1, 5]),
    "trailing-padding-tokens": dict(seeds=[7], offs=[0, 1], locs=[14, 0, 0], ids=[16, 0, 0], pos=[5, 0, 0]),
    "write-assert-token": dict(seeds=[7], offs=[0, 2], locs=[14, 15], ids=[16, 99], pos=[5, 6],
                               exp_ids=[16, 17], exp_pos=[5, 6]),
    "write-assert-position": dict(seeds=[7], offs=[0, 2], locs=[14, 15], ids=[16, 17], pos=[5, 8],
                                  exp_ids=[16, 17], exp_pos=[5, 6]),
    "write-assert-both": dict(seeds=[7], offs=[0, 2], locs=[14, 15], ids=[16, 99], pos=[5, 8],
                              exp_ids=[16, 17], exp_pos=[5, 6]),
    "chain-position-gap": dict(seeds=[7, -1], offs=[0, 2, 4], locs=[14, 15, 16, 17], ids=[1, 2, 3, 4],
                               pos=[5, 8, 0, 2]),
    "chain-position-gap-flag-off": dict(seeds=[7, -1], offs=[0, 2, 4], locs=[14, 15, 16, 17], ids=[1, 2, 3, 4],
                                        pos=[5, 8, 0, 2], chain=0),
    "chain-position-gap-no-flag": dict(seeds=[7, -1], offs=[0, 2, 4], locs=[14, 15, 16, 17], ids=[1, 2, 3, 4],
                                       pos=[5, 8, 0, 2], chain=None),
    "chain-and-assert-position": dict(seeds=[7], offs=[0, 2], locs=[14, 15], ids=[16, 17], pos=[7, 9],
                                      exp_ids=[16, 99], exp_pos=[5, 6]),
    "chain-gap-with-token-assert": dict(seeds=[7], offs=[0, 1], locs=[14], ids=[16], pos=[9],
                                        exp_ids=[17]),
    "position-int64-max": dict(seeds=[-1], offs=[0, 2], locs=[14, 15], ids=[1, 2],
                               pos=[2**63 - 1, -(2**63)]),
    "ring-overflow": dict(seeds=[-1, -1], offs=[0, 3, 6], locs=[14, 15, 16, 17, 18, 19], ids=[1, 2, 3, 4, 5, 6],
                          pos=[3, 4, 5, 6, 7, 8], exp_pos=[0] * 6, ring=2),
    "ring-capacity-0": dict(seeds=[-1], offs=[0, 2], locs=[14, 15], ids=[1, 2], pos=[4, 5], ring=0),
    "real-kv-partial": dict(seeds=[7], offs=[0, 2], locs=[14, 15], ids=[16, 17], pos=[5, 6], sources=1,
                            mode=RealKvMode.PARTIAL),
    "real-kv-all-4-sources": dict(seeds=[7], offs=[0, 2], locs=[14, 23], ids=[16, 17], pos=[5, 6], sources=4,
                                  mode=RealKvMode.ALL),
    "attribution-stride-32": dict(seeds=[7], offs=[0, 1], locs=[14], ids=[16], pos=[5], stride=32),
    "attribution-stride-48": dict(seeds=[7, -1], offs=[0, 1, 2], locs=[14, 15], ids=[16, 1], pos=[5, 0]),
    "attribution-stride-64": dict(seeds=[7, -1], offs=[0, 1, 2], locs=[14, 15], ids=[16, 1], pos=[5, 0], stride=64),
    "attribution-no-ids-no-step": dict(seeds=[7], offs=[0, 1], locs=[14], ids=[16], pos=[5], writer=False,
                                       step=False),
    "int32-indices": dict(seeds=[7], offs=[0, 2], locs=[14, 15], ids=[2**31 - 1, -5], pos=[5, 6], dtype=torch.int32,
                          exp_ids=[2**31 - 1, 4], exp_pos=[5, 6]),
    # Serial semantics a parallel backend does not promise (requests of one launch sharing slots).
    "same-slot-in-one-request": dict(seeds=[-1], offs=[0, 3], locs=[14, 14, 15], ids=[1, 2, 3], pos=[0, 1, 2]),
    "same-slot-across-requests": dict(seeds=[-1, -1], offs=[0, 2, 4], locs=[14, 15, 15, 14], ids=[1, 2, 3, 4],
                                      pos=[0, 1, 0, 1], serial=True),
    "seed-written-by-earlier-request": dict(seeds=[-1, 15, 17], offs=[0, 3, 5, 6], locs=[14, 15, 16, 17, 18, 19],
                                            ids=[1, 2, 3, 4, 5, 6], pos=[0, 1, 2, 2, 3, 4], serial=True),
    "seed-overwritten-later": dict(seeds=[7, -1], offs=[0, 1, 3], locs=[14, 7, 15], ids=[16, 1, 2],
                                   pos=[5, 0, 1], serial=True),
}


def _base_buffer(stride):
    buf = allocate_canary_buffer(24, stride, DEVICE)
    # Bytes past the SPEC fields carry a pattern an op must not disturb.
    buf.view(torch.int64)[:, 4:] = SENTINEL
    clean_chain(buf, A_SLOTS, A_TOKS)
    clean_chain(buf, B_SLOTS, B_TOKS)
    return buf


def _write_run(case):
    c = WRITE_CASES[case]
    dtype, nr, stride = c.get("dtype", I64), c.get("nr", len(c["seeds"])), c.get("stride", 48)
    n_src = c.get("sources", 0)

    def build():
        plan = poisoned_plan(4, 4, DEVICE)
        plan.write_offsets[:len(c["offs"])] = t(c["offs"])
        plan.seed_slot[:len(c["seeds"])] = t(c["seeds"])
        return {"buf": _base_buffer(stride), "plan": plan, "ring": poisoned_ring(c.get("ring", 8), DEVICE),
                "counters": allocate_counters(DEVICE),
                "kv": _sources(SOURCE_SETS["four-mixed"])[:n_src] if n_src else []}

    def run(st, b):
        opt = lambda k, dt=dtype: t(c[k], dt) if c.get(k) is not None else None  # noqa: E731
        chain = c.get("chain", 1)
        ops.write(buf=st["buf"], plan=st["plan"], num_requests=nr, out_cache_loc=t(c["locs"], dtype),
                  input_ids=t(c["ids"], dtype), positions=t(c["pos"], dtype), ring=st["ring"],
                  counters=st["counters"], launch_tag=LaunchTag.TAIL_V_SWA, sources=st["kv"],
                  real_kv_mode=c.get("mode", RealKvMode.NONE), expected_input_ids=opt("exp_ids"),
                  expected_positions=opt("exp_pos"),
                  chain_check=None if chain is None else t([chain], torch.int32),
                  writer_ids=t([500 + r for r in range(4)]) if c.get("writer", True) else None,
                  step=t([77]) if c.get("step", True) else None, backend=b)
    return build, run


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(WRITE_CASES), ids=str)
def test_write(backend, case):
    if WRITE_CASES[case].get("serial") and backend == "triton":
        pytest.skip("requests of one launch sharing slots race in a parallel backend")
    build, run = _write_run(case)
    ref = check(build, run, backend)
    words = ref["buf"].view(torch.int64)
    stride = WRITE_CASES[case].get("stride", 48)
    if stride == 64:
        assert (words[:, 6:] == SENTINEL).all()
    if case == "seeded-two-requests":
        # Continuing a clean chain: the new records link onto the seeds' records.
        assert words[14, 2] == to_signed(clean_chain(torch.zeros(8, 48, dtype=torch.uint8), A_SLOTS, A_TOKS))
        assert words[14, 4:6].tolist() == [500, 77] and words[16, 4:6].tolist() == [501, 77]
        assert int(ref["ring"].write_index[0]) == 0
    if case == "ring-overflow":
        assert int(ref["ring"].write_index[0]) == 6 and ref["ring"].rows[:, 1].tolist() == [14, 15]
    if case == "chain-position-gap":
        # Only the seeded request is checked (SGLang): slot 15 jumps 5 -> 8; the unseeded one is not.
        assert reasons(ref["ring"]) == {(LaunchTag.TAIL_V_SWA, F.WRITE_POSITION)}
        assert [r[1] for r in ring_rows(ref["ring"])] == [15]
    if case == "chain-position-gap-flag-off":
        assert int(ref["ring"].write_index[0]) == 0
    if case == "attribution-stride-32":
        assert words.shape[1] == 4
    if case == "attribution-no-ids-no-step":
        assert words[14, 4:6].tolist() == [-1, -1]


# verify

VERIFY_CASES = {
    # name: dict(entries (slot, position, prev, expected_token), [plant, enable, count, ring, sources, mode])
    "clean-chains": dict(entries=[(3, 0, -1, 11), (4, 1, 3, 12), (7, 4, 6, -1), (10, 0, -1, 21), (12, 2, 11, 23)]),
    "slot-0-skipped": dict(entries=[(0, 5, 9, 7), (3, 0, -1, 11)]),
    "prev-0-unreachable": dict(entries=[(5, 2, 0, -1)]),
    "prev-out-of-range": dict(entries=[(5, 2, 99, -1), (5, 2, -4, -1)]),
    "slot-out-of-range": dict(entries=[(99, 0, -1, -1), (-2, 0, -1, -1)]),
    "wrong-position": dict(entries=[(4, 2, 3, 12)]),
    "wrong-token": dict(entries=[(4, 1, 3, 99), (5, 2, 4, -1)]),
    "wrong-predecessor": dict(entries=[(5, 2, 3, 13), (11, 1, 4, 22)]),
    "everything-wrong": dict(entries=[(5, 7, 10, 1)], sources=1, mode=RealKvMode.PARTIAL),
    "real-kv-clean": dict(entries=[(3, 0, -1, 11), (4, 1, 3, 12)], sources=4, mode=RealKvMode.ALL, store_kv=True),
    "real-kv-flipped": dict(entries=[(3, 0, -1, 11), (4, 1, 3, 12)], sources=4, mode=RealKvMode.ALL, store_kv=True,
                            flip=4),
    "real-kv-flip-outside-partial": dict(entries=[(4, 1, 3, 12)], sources=1, mode=RealKvMode.PARTIAL,
                                         store_kv=True, flip=4, flip_byte=20),
    "disabled": dict(entries=[(5, 9, 3, 1)], enable=0),
    "count-below-capacity": dict(entries=[(5, 9, 4, 1), (6, 9, 5, 1)], count=1),
    "count-0": dict(entries=[(5, 9, 3, 1)], count=0),
    "ring-overflow": dict(entries=[(4, 9, 3, -1), (5, 9, 4, -1), (6, 9, 5, -1), (7, 9, 6, -1)], ring=3),
    "ring-already-full": dict(entries=[(4, 9, 3, -1), (5, 9, 4, -1)], ring=2, prefill_ring=5),
    # the count saturates at VIOLATION_COUNT_LIMIT instead of wrapping negative (a wrapped count indexed
    # before the ring: an illegal memory access on the GPU)
    "saturating-count": dict(entries=[(4, 9, 3, -1), (5, 9, 4, -1), (6, 9, 5, -1)], ring=2,
                            prefill_ring=VIOLATION_COUNT_LIMIT - 2),
    "saturated-count": dict(entries=[(4, 9, 3, -1), (5, 9, 4, -1)], ring=2, prefill_ring=VIOLATION_COUNT_LIMIT),
}


def _verify_run(case, stride=48):
    c = VERIFY_CASES[case]
    cap = 6
    n_src = c.get("sources", 0)

    def build():
        buf = _base_buffer(stride)
        kv = _sources(SOURCE_SETS["four-mixed"])[:n_src] if n_src else []
        if c.get("store_kv"):
            fp = ops.fingerprint(t(A_SLOTS), kv, c["mode"], backend="reference")
            buf.view(torch.int64)[A_SLOTS, 3] = fp
        if "flip" in c:
            flip_kv_byte(kv[0], c["flip"], byte=c.get("flip_byte", 0))
        plan = poisoned_plan(cap, 1, DEVICE)
        ring = poisoned_ring(c.get("ring", 8), DEVICE)
        ring.write_index.fill_(c.get("prefill_ring", 0))
        return {"buf": buf, "plan": plan, "ring": ring, "counters": allocate_counters(DEVICE), "kv": kv}

    def run(st, b):
        e = st["plan"].entries
        cols = list(zip(*c["entries"]))
        ops.fill_entries(e, t(cols[0]), t(cols[1]), t(cols[2]), t(cols[3]))
        if "count" in c:
            e.count.fill_(c["count"])
        e.enable.fill_(c.get("enable", 1))
        ops.verify(buf=st["buf"], entries=e, ring=st["ring"], counters=st["counters"],
                   launch_tag=LaunchTag.SWEEP_K_FULL, sources=st["kv"], real_kv_mode=c.get("mode", RealKvMode.NONE),
                   backend=b)
    return build, run


VERIFY_EXPECT = {
    "clean-chains": set(),
    "slot-0-skipped": set(),
    "prev-0-unreachable": set(),
    "prev-out-of-range": {F.VERIFY_CHAIN_HASH},
    "slot-out-of-range": {F.VERIFY_CHAIN_HASH},
    "wrong-position": {F.VERIFY_POSITION},
    "wrong-token": {F.VERIFY_TOKEN},
    "wrong-predecessor": {F.VERIFY_CHAIN_HASH},
    "everything-wrong": {F.VERIFY_CHAIN_HASH | F.VERIFY_POSITION | F.VERIFY_TOKEN | F.VERIFY_REAL_KV_HASH},
    "real-kv-clean": set(),
    "real-kv-flipped": {F.VERIFY_REAL_KV_HASH},
    "real-kv-flip-outside-partial": set(),
    "disabled": set(),
    "count-below-capacity": {F.VERIFY_POSITION | F.VERIFY_TOKEN},
    "count-0": set(),
    "ring-overflow": {F.VERIFY_POSITION},
    "ring-already-full": None,  # rows stay poisoned: every push lands past capacity
    "saturating-count": None,
    "saturated-count": None,
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(VERIFY_CASES), ids=str)
def test_verify(backend, case):
    build, run = _verify_run(case)
    ref = check(build, run, backend)
    if VERIFY_EXPECT[case] is not None:
        assert {r for _, r in reasons(ref["ring"])} == VERIFY_EXPECT[case]
    counters = ref["counters"][LaunchTag.SWEEP_K_FULL].tolist()
    c = VERIFY_CASES[case]
    expected_entries = 0 if c.get("enable", 1) == 0 else c.get("count", len(c["entries"]))
    # A disabled launch still counts as run (SGLang).
    assert counters == [1, expected_entries]
    if case == "ring-overflow":
        assert int(ref["ring"].write_index[0]) == 4 and ref["ring"].rows[:, 1].tolist() == [4, 5, 6]
    if case == "ring-already-full":
        assert int(ref["ring"].write_index[0]) == 7 and (ref["ring"].rows == SENTINEL).all()
    if case in ("saturating-count", "saturated-count"):
        assert int(ref["ring"].write_index[0]) == VIOLATION_COUNT_LIMIT and (ref["ring"].rows == SENTINEL).all()
    if case == "wrong-predecessor":
        row = ring_rows(ref["ring"])[0]
        assert row[5] != row[6]  # stored vs expected prev hash


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_verify_never_reads_slot_0s_record(backend):
    # Slot 0 is reserved (SPEC): when requests of one launch write it, which write lands last depends on the
    # backend, so its record is unspecified (docs/ops.md, "Edge-case semantics"). No verify may read it: an
    # entry naming slot 0 is skipped, a prev of 0 leaves the chain unchecked. Same ring and counters whatever
    # slot 0 holds.
    entries = [(0, 5, 9, 7), (5, 2, 0, -1), (3, 0, -1, 11), (0, 1, 0, -1)]
    got = []
    for garbage in (0, 0x1234_5678_9ABC_DEF, -1):
        buf = _base_buffer(48)
        buf.view(torch.int64)[0, :] = garbage
        ring, counters, plan = poisoned_ring(8, DEVICE), allocate_counters(DEVICE), poisoned_plan(6, 1, DEVICE)
        cols = list(zip(*entries))
        ops.fill_entries(plan.entries, t(cols[0]), t(cols[1]), t(cols[2]), t(cols[3]))
        plan.entries.enable.fill_(1)
        ops.verify(buf=buf, entries=plan.entries, ring=ring, counters=counters, launch_tag=LaunchTag.SWEEP_K_FULL,
                   backend=use_backend(backend))
        got.append((int(ring.write_index[0]), counters.tolist()))
    assert got[0] == (0, got[0][1]) and got[0][1][LaunchTag.SWEEP_K_FULL] == [1, len(entries)]
    assert got[1] == got[0] and got[2] == got[0]


@pytest.mark.skipif("triton" not in FAST_BACKENDS, reason="Triton is not installed")
@pytest.mark.parametrize("lanes", [64, 2, 0], ids=["lanes64", "lanes2", "block"])
@pytest.mark.parametrize("case", [c for c in WRITE_CASES if not WRITE_CASES[c].get("serial")], ids=str)
def test_write_triton_lane_kernel(case, lanes, monkeypatch):
    # decode-shaped writes (an entry per request) take the lane-per-request kernel; here every case does,
    # several entries per request included, and with two lanes a program: several programs per launch.
    # lanes 0: every case through the block kernel, decode-shaped ones too (WRITE_LANES_MAX_RATIO = 0)
    from kvcanary.ops import triton_ops

    picked = []
    real = triton_ops._launch
    monkeypatch.setattr(triton_ops, "_launch", lambda fn, grid, **kw: (picked.append(fn), real(fn, grid, **kw)))
    monkeypatch.setattr(triton_ops, "WRITE_LANES_MAX_RATIO", 1 << 20 if lanes else 0)
    monkeypatch.setattr(triton_ops, "WRITE_LANES", lanes or 64)
    build, run = _write_run(case)
    check(build, run, "triton")
    want = triton_ops.lanes._write_lanes_kernel if lanes else triton_ops.k._write_kernel
    assert picked and set(picked) == {want}


@pytest.mark.skipif("triton" not in FAST_BACKENDS, reason="Triton is not installed")
@pytest.mark.parametrize("case", list(VERIFY_CASES), ids=str)
def test_verify_triton_looping_pass(case, monkeypatch):
    # test_verify's six-entry plans take the one-pass kernel (entries loaded before the count is known);
    # plans too large for it take the looping one, here forced on the same cases
    from kvcanary.ops import triton_ops

    assert triton_ops.verify_in_one_pass(6, 2)
    monkeypatch.setattr(triton_ops, "VERIFY_SPECULATE_ENTRIES", 0)
    assert not triton_ops.verify_in_one_pass(6, 2)
    build, run = _verify_run(case)
    check(build, run, "triton")


@pytest.mark.skipif("triton" not in FAST_BACKENDS, reason="Triton is not installed")
@pytest.mark.parametrize("case", list(VERIFY_CASES), ids=str)
def test_verify_triton_one_pass_over_several_programs(case, monkeypatch):
    # the one-pass kernel's own block: a small one spreads the six entries over two programs of four
    from kvcanary.ops import triton_ops

    monkeypatch.setattr(triton_ops, "VERIFY_SPECULATE_BLOCK", 4)
    monkeypatch.setattr(triton_ops, "VERIFY_SPECULATE_WARPS", 1)
    assert triton_ops._verify_shape(6, torch.device("cpu")) == (2, 4, 1, True)
    assert triton_ops._verify_shape(9, torch.device("cpu"))[3] is False  # over two programs' blocks: looping
    build, run = _verify_run(case)
    check(build, run, "triton")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stride", [32, 64])
def test_verify_other_strides(backend, stride):
    build, run = _verify_run("everything-wrong", stride)
    check(build, run, backend)


# Multi-step scenarios on the scripted engine: clean chains verify clean; each planted bug is seen.

HEAD, TAIL = LaunchTag.HEAD_K_FULL, LaunchTag.TAIL_K_FULL


def _scenario(plant: str, window: int, **cfg_kw):
    cfg = Config(window=window, swa_slots=40 if window else 0, device=str(DEVICE), **cfg_kw)
    sc = Script(cfg)
    sc.add(1, [5, 6, 7, 8, 9, 10, 11])
    sc.add(2, [1, 2, 3])
    sc.forward([(1, 4), (2, 3)], pad=1)  # prefill (request 1 chunked)
    sc.forward([(1, 3), (2, 1)], bad_pos={1: 1} if plant == "wrong-position" else None,
               bad_tok={2: 5} if plant == "wrong-token" else None)  # second chunk + decode
    fw = sc.forward([(1, 1), (2, 1)])  # decode
    if plant == "swapped-cell":
        sc.swap_cells(fw, 1, 1, 3)
    if plant == "flipped-kv":
        sc.flip_kv(fw, 2, 1)
    sc.forward([(1, 2), (2, 1)], pad=2)  # target verify (2 drafts) + decode
    return cfg, sc


SCENARIO_EXPECT = {
    # plant: (launch tag, reason) pairs that must show up in the FULL group
    "clean": set(),
    "swapped-cell": {(HEAD, F.VERIFY_CHAIN_HASH), (HEAD, F.VERIFY_CHAIN_HASH | F.VERIFY_POSITION | F.VERIFY_TOKEN),
                     (TAIL, F.VERIFY_CHAIN_HASH)},
    "wrong-position": {(HEAD, F.WRITE_POSITION), (TAIL, F.WRITE_POSITION), (HEAD, F.VERIFY_POSITION)},
    "wrong-token": {(HEAD, F.WRITE_TOKEN), (TAIL, F.WRITE_TOKEN), (HEAD, F.VERIFY_TOKEN)},
    "flipped-kv": {(TAIL, F.VERIFY_REAL_KV_HASH)},
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [0, 3], ids=["full", "swa-3"])
@pytest.mark.parametrize("plant", list(SCENARIO_EXPECT), ids=str)
def test_scenario(backend, window, plant):
    cfg, sc = _scenario(plant, window)
    ref = check(lambda: build_state(cfg), lambda st, b: replay(st, cfg, sc.forwards, b), backend)
    got = {(tag, r) for tag, r in reasons(ref["ring"]) if tag in (HEAD, TAIL)}
    assert SCENARIO_EXPECT[plant] <= got
    if plant == "clean":
        assert int(ref["ring"].write_index[0]) == 0
    if plant == "flipped-kv":
        assert got == {(TAIL, F.VERIFY_REAL_KV_HASH)}
        # Seen by the TAIL verify of the forward it happened in and of the next one.
        assert [r[1] for r in ring_rows(ref["ring"])] == [sc.slot(2, 1)] * 2


SCENARIO_VARIANTS = {
    "i32-tables-stride-32-partial": dict(index_dtype=torch.int32, stride=32, mode=RealKvMode.PARTIAL),
    "stride-64-mode-none": dict(stride=64, mode=RealKvMode.NONE),
    "draft-token-offset-1": dict(token_offset=1),
    "pages-4-bf16-fp32-sources": dict(sources=((torch.bfloat16, 4, 32, 16, 0), (torch.float32, 2, 64, 64, 32))),
    "no-token-checks-no-asserts": dict(token_checks=False, write_assert=False, chain_check=False),
    "plan-overflow": dict(plan_capacity=5),
    "ring-overflow": dict(ring_capacity=3),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("plant", ["clean", "swapped-cell"])
@pytest.mark.parametrize("variant", list(SCENARIO_VARIANTS), ids=str)
def test_scenario_variants(backend, variant, plant):
    if backend == "triton" and plant == "clean" and DEVICE.type == "cpu":
        pytest.skip("the interpreter is slow; test_scenario runs Triton's clean twins")
    cfg, sc = _scenario(plant, 3, **SCENARIO_VARIANTS[variant])
    ref = check(lambda: build_state(cfg), lambda st, b: replay(st, cfg, sc.forwards, b), backend)
    if plant == "clean":
        assert int(ref["ring"].write_index[0]) == 0
    elif variant != "plan-overflow":
        assert any(r & F.VERIFY_CHAIN_HASH for _, r in reasons(ref["ring"]))
    if variant == "plan-overflow":
        assert int(ref["plan_full"].entries.enable[0]) == 0 and int(ref["ring"].write_index[0]) == 0


def test_clean_chain_matches_spec_vector():
    buf = allocate_canary_buffer(8, 48)
    assert clean_chain(buf, [1, 2, 3], [11, 22, 33]) == link(0x5782FFC5B5D6409B, 33, 2)
    assert buf.view(torch.int64)[1, 2] == to_signed(CHAIN_HEAD)
    put_record(buf, 4, 1, 2, 3)
    assert buf.view(torch.int64)[4, :4].tolist() == [1, 2, 3, 0]


@pytest.mark.gpu
def test_torch_ops_replay_in_cuda_graph():
    """The torch path never syncs: plan, verify and write capture into one CUDA graph and replay exactly."""
    cfg = Config(device="cuda", window=3, swa_slots=40)
    sc = Script(cfg)
    sc.add(1, [5, 6, 7, 8, 9, 10, 11])
    sc.add(2, [1, 2, 3])
    sc.forward([(1, 4), (2, 3)], pad=1)
    sc.forward([(1, 2), (2, 1)])
    state = build_state(cfg)
    replay(state, cfg, sc.forwards, "torch")
    fw = sc.forward([(1, 1), (2, 1)], pad=1)
    for row, p, s in fw.rtt_writes:
        state["rtt"][row, p] = s
    idx = lambda xs: torch.tensor(xs, dtype=cfg.index_dtype, device="cuda")  # noqa: E731
    args = dict(rows=idx(fw.rows), prefix=idx(fw.prefix), extend=idx(fw.extend), locs=idx(fw.locs), ids=idx(fw.ids),
                pos=idx(fw.pos), exp_pos=idx(fw.expected_pos), writer=idx(fw.writer_ids).long())

    def step(st, backend):
        plan = st["plan_full"]
        ops.plan(req_pool_indices=args["rows"], prefix_lens=args["prefix"], extend_lens=args["extend"],
                 req_to_token=st["rtt"], out=plan, backend=backend)
        ops.verify(buf=st["tail_full"], entries=plan.entries, ring=st["ring"], counters=st["counters"],
                   launch_tag=LaunchTag.TAIL_K_FULL, sources=st["kv"], real_kv_mode=RealKvMode.ALL, backend=backend)
        ops.write(buf=st["tail_full"], plan=plan, num_requests=len(fw.rows), out_cache_loc=args["locs"],
                  input_ids=args["ids"], positions=args["pos"], ring=st["ring"], counters=st["counters"],
                  launch_tag=LaunchTag.TAIL_K_FULL, sources=st["kv"], real_kv_mode=RealKvMode.ALL,
                  expected_positions=args["exp_pos"], chain_check=st["chain_check"], writer_ids=args["writer"],
                  step=st["step"], backend=backend)

    start = copy.deepcopy(state)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(copy.deepcopy(state), "torch")  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(state, "torch")
    for plant in (None, "position"):
        for a, b in zip(_tensors_of(state), _tensors_of(start)):
            a.copy_(b)
        expected = copy.deepcopy(start)
        if plant:
            # The captured graph reads the inputs' memory: a planted bug changes what it finds.
            args["pos"][0] += 1
        graph.replay()
        step(expected, "reference")
        torch.cuda.synchronize()
        for a, b in zip(_tensors_of(expected), _tensors_of(state)):
            assert torch.equal(as_bytes(a), as_bytes(b)), plant
        assert (int(state["ring"].write_index[0]) > 0) == (plant is not None)


def _tensors_of(state):
    out = []
    for v in flatten(state).values():
        out += [v.rows, v.write_index] if isinstance(v, ViolationRing) else [v]
    return out


# Rejected calls change nothing: the error comes before any buffer, ring or counter is touched.

REJECTED_WRITES = {
    # name: (changes to a good call, exception, message)
    "negative-write-offset": (dict(offs=[0, -1, 2]), ValueError,
                              "kv-canary: write plan.write_offsets must be non-negative, got -1 at index 1"),
    "decreasing-write-offsets": (dict(offs=[0, 2, 1]), ValueError,
                                 "kv-canary: write plan.write_offsets must be non-decreasing, got 1 after 2 at index 2"),
    "num-requests-bool": (dict(nr=True), ValueError, "kv-canary: write num_requests must be an int in [0, 4], got True"),
    "launch-tag-bool": (dict(tag=True), ValueError, "kv-canary: write launch_tag must be an int in [0, 12), got True"),
}


def _rejected_state():
    plan = poisoned_plan(4, 4, DEVICE)
    plan.seed_slot[:2] = t([7, -1])
    return {"buf": _base_buffer(48), "plan": plan, "ring": poisoned_ring(4, DEVICE), "counters": allocate_counters(DEVICE)}


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
@pytest.mark.parametrize("case", list(REJECTED_WRITES), ids=str)
def test_rejected_write_changes_nothing(backend, case):
    changes, exc, message = REJECTED_WRITES[case]
    if "offs" in changes and torch.device(DEVICE).type != "cpu":
        pytest.skip("offset values are checked for host plans only (reading a device plan would sync)")
    st = _rejected_state()
    st["plan"].write_offsets[:3] = t(changes.get("offs", [0, 1, 2]))
    before = copy.deepcopy(st)
    with pytest.raises(exc) as info:
        ops.write(buf=st["buf"], plan=st["plan"], num_requests=changes.get("nr", 2), out_cache_loc=t([14, 15]),
                  input_ids=t([1, 2]), positions=t([5, 0]), ring=st["ring"], counters=st["counters"],
                  launch_tag=changes.get("tag", LaunchTag.HEAD_K_FULL), chain_check=t([1], torch.int32),
                  backend=use_backend(backend))
    assert str(info.value) == message
    for name, a in flatten(before).items():
        b = flatten(st)[name]
        for x, y in ((a.rows, b.rows), (a.write_index, b.write_index)) if isinstance(a, ViolationRing) else ((a, b),):
            assert torch.equal(as_bytes(x), as_bytes(y)), name


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_rejected_verify_changes_nothing(backend):
    st = _rejected_state()
    ops.fill_entries(st["plan"].entries, t([4]), t([9]), t([3]))
    before = copy.deepcopy(st)
    with pytest.raises(TypeError, match="kv-canary: verify check_token must be a bool, got int"):
        ops.verify(buf=st["buf"], entries=st["plan"].entries, ring=st["ring"], counters=st["counters"],
                   launch_tag=LaunchTag.HEAD_K_FULL, check_token=0, backend=use_backend(backend))
    assert torch.equal(st["counters"], before["counters"]) and torch.equal(st["ring"].rows, before["ring"].rows)
    assert int(st["ring"].write_index[0]) == 0 and torch.equal(st["buf"], before["buf"])
