"""accept_rewrites: every fast backend against the reference, byte for byte, and what the op must leave alone.

A slot this forward rewrote with the record it already holds (HEAD == TAIL in token, position and
chain) takes its real-KV hash from its current bytes; every other slot keeps its stored hash, so a
rewrite with another record or a byte change with no write is still reported by the TAIL verify.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICE, FAST_BACKENDS
from kvcanary import ops
from kvcanary.format import FailReason, LaunchTag, RealKvMode
from kvcanary.ops import allocate_canary_buffer, allocate_counters
from ops_harness import (SENTINEL, as_bytes, check, clean_chain, flatten, flip_kv_byte, kv_source, poisoned_plan,
                         poisoned_ring, put_record, reasons, use_backend)

BACKENDS = FAST_BACKENDS + ["torch-static"]
EXAMPLES = {"torch": 40, "torch-static": 25, "numba": 40, "triton": 15}
NUM_SLOTS = 40
SOURCE_SPECS = [(torch.float16, 1, 32, 32, 0), (torch.bfloat16, 4, 48, 16, 16), (torch.float32, 2, 64, 64, 0),
                (torch.uint8, 8, 16, 16, 0)]


def t(xs, dtype=torch.int64):
    return torch.tensor(xs, dtype=dtype, device=DEVICE)


def _sources(n: int, seed: int = 0) -> list:
    return [kv_source(NUM_SLOTS, dtype=dt, page_size=ps, nbpt=nb, read_bytes=rb, pad_bytes=pad, device=DEVICE,
                      seed=seed + i) for i, (dt, ps, nb, rb, pad) in enumerate(SOURCE_SPECS[:n])]


def _buffers(seed: int, changed: list[int], stride: int = 48):
    """A TAIL buffer of random records and its HEAD twin, with ``changed`` slots rewritten in HEAD by
    another token, position or chain (cycling), as a HEAD write of other records leaves them."""
    g = torch.Generator().manual_seed(seed)
    tail = allocate_canary_buffer(NUM_SLOTS, stride, DEVICE)
    words = torch.randint(-2**62, 2**62, (NUM_SLOTS, stride // 8), generator=g).to(DEVICE)
    tail.view(torch.int64).copy_(words)
    head = tail.clone()
    head.view(torch.int64)[:, 3:] = SENTINEL  # HEAD stores no real-KV hash; attribution is not compared
    for k, s in enumerate(changed):
        head.view(torch.int64)[s, k % 3] += 1
    return head, tail


def _case(backend, *, seed, changed, locs, offs, nr, n_src, mode, count=True, dtype=torch.int64, stride=48):
    def build():
        head, tail = _buffers(seed, changed, stride)
        plan = poisoned_plan(8, 6, DEVICE)
        plan.write_offsets[:len(offs)] = t(offs)
        return {"head": head, "tail": tail, "plan": plan, "kv": _sources(n_src, seed),
                "rewrites": t([5]) if count else None}

    def run(st_, b):
        ops.accept_rewrites(head_buf=st_["head"], tail_buf=st_["tail"], plan=st_["plan"], num_requests=nr,
                            out_cache_loc=t(locs, dtype), sources=st_["kv"], real_kv_mode=mode,
                            rewrites=st_["rewrites"], backend=b)
    return check(build, run, backend)


CASES = {
    # name: (changed slots, out_cache_loc, write_offsets, num_requests)
    "decode-three": ([5], [4, 5, 6], [0, 1, 2, 3], 3),
    "duplicates-same": ([], [7, 7, 9, 7], [0, 4], 1),
    "duplicates-changed": ([7], [7, 8, 7], [0, 2, 3], 2),
    "slot-0-and-negative": ([], [0, -1, 3, 0, -5, 2], [0, 3, 6], 2),
    "past-the-buffer": ([], [39, 40, 1 << 40, 1], [0, 4], 1),
    "entries-past-the-requests": ([], [3, 4, 5, 6, 7], [0, 1, 3], 2),
    "no-request": ([], [3, 4], [0, 2], 0),
    "empty-loc": ([], [], [0, 0], 1),
    "requests-without-writes": ([2], [2, 3, 11], [0, 0, 2, 2, 3], 4),
    # SWA: full slots translated through a table, 0 = evicted (the launcher passes the translated list)
    "swa-translated": ([12], [0, 12, 13, 0, 14], [0, 2, 5], 2),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(RealKvMode), ids=lambda m: m.name)
@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_cases(backend, case, mode):
    changed, locs, offs, nr = CASES[case]
    for n_src in (1, 4):
        ref = _case(backend, seed=len(case), changed=changed, locs=locs, offs=offs, nr=nr, n_src=n_src, mode=mode)
        # the count: entries in the requests' ranges whose slot is in [1, num_slots) and unchanged
        live = [s for s in locs[max(offs[0], 0):offs[nr]] if 1 <= s < NUM_SLOTS] if nr else []
        assert int(ref["rewrites"][0]) == 5 + sum(s not in changed for s in live)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stride", [32, 64])
def test_other_strides_int32_slots_and_no_counter(backend, stride):
    _case(backend, seed=3, changed=[4], locs=[4, 5, 0, 6], offs=[0, 2, 4], nr=2, n_src=2, mode=RealKvMode.ALL,
          count=False, dtype=torch.int32, stride=stride)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fuzz(backend):
    slots = st.integers(-2, NUM_SLOTS + 1)

    @settings(max_examples=EXAMPLES[backend], deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(locs=st.lists(slots, max_size=14), changed=st.lists(st.integers(1, NUM_SLOTS - 1), max_size=6),
           cuts=st.lists(st.integers(0, 16), min_size=1, max_size=5), mode=st.sampled_from(list(RealKvMode)),
           n_src=st.integers(0, 4), seed=st.integers(0, 99), count=st.booleans(),
           dtype=st.sampled_from([torch.int32, torch.int64]))
    def run(locs, changed, cuts, mode, n_src, seed, count, dtype):
        offs = [0] + sorted(cuts)
        _case(backend, seed=seed, changed=changed, locs=locs, offs=offs, nr=len(offs) - 1, n_src=n_src, mode=mode,
              count=count, dtype=dtype)
    run()


# What the op accepts and what it leaves for the TAIL verify to report.

def _forward(backend, plant: str):
    """Slots 1-4 hold a clean chain of tokens 10-13; the forward's TAIL verifies all four. ``plant``:
    clean (no write), idempotent (slot 4 rewritten with its record and new bytes), other-token (slot 4
    rewritten with another token and new bytes), flip (slot 4's bytes change with no write)."""
    b = use_backend(backend)
    src = _sources(1)[0]
    head, tail = (allocate_canary_buffer(8, 48, DEVICE) for _ in range(2))
    for buf in (head, tail):
        clean_chain(buf, [1, 2, 3, 4], [10, 11, 12, 13])
    fps = ops.fingerprint(t([1, 2, 3, 4]), [src], RealKvMode.ALL, backend=b)
    tail.view(torch.int64)[1:5, 3] = fps
    plan = ops.Plan.allocate(8, 2, DEVICE)
    ops.fill_entries(plan.entries, t([1, 2, 3, 4]), t([0, 1, 2, 3]), t([-1, 1, 2, 3]))
    plan.write_offsets[:2] = t([0, 1 if plant in ("idempotent", "other-token") else 0])
    if plant == "other-token":
        put_record(head, 4, 99, 3, int(head.view(torch.int64)[4, 2]))
    if plant != "clean":
        flip_kv_byte(src, 4, 3)
    ring, counters, rewrites = ops.ViolationRing.allocate(8, DEVICE), allocate_counters(DEVICE), t([0])
    ops.accept_rewrites(head_buf=head, tail_buf=tail, plan=plan, num_requests=1, out_cache_loc=t([4]),
                        sources=[src], real_kv_mode=RealKvMode.ALL, rewrites=rewrites, backend=b)
    ops.verify(buf=tail, entries=plan.entries, ring=ring, counters=counters, launch_tag=LaunchTag.TAIL_K_FULL,
               sources=[src], real_kv_mode=RealKvMode.ALL, backend=b)
    return reasons(ring), int(rewrites[0])


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
@pytest.mark.parametrize("plant,found,accepted", [
    ("clean", set(), 0),
    ("idempotent", set(), 1),
    ("other-token", {(LaunchTag.TAIL_K_FULL, FailReason.VERIFY_REAL_KV_HASH)}, 0),
    ("flip", {(LaunchTag.TAIL_K_FULL, FailReason.VERIFY_REAL_KV_HASH)}, 0),
])
def test_accepts_only_an_identical_rewrite(backend, plant, found, accepted):
    assert _forward(backend, plant) == (found, accepted)


REJECTED = {
    # name: (changes to a good call, exception, message)
    "head-dtype": (dict(head=torch.int64), TypeError, "kv-canary: accept_rewrites head_buf must be uint8, got torch.int64"),
    "head-shape": (dict(head_rows=9), ValueError,
                   "kv-canary: accept_rewrites head_buf must be of tail_buf's shape (8, 48), got shape (9, 48)"),
    "num-requests-bool": (dict(nr=True), ValueError,
                          "kv-canary: accept_rewrites num_requests must be an int in [0, 2], got True"),
    "num-requests-too-many": (dict(nr=3), ValueError,
                              "kv-canary: accept_rewrites num_requests must be an int in [0, 2], got 3"),
    "rewrites-int32": (dict(rewrites=torch.int32), TypeError,
                       "kv-canary: accept_rewrites rewrites must be int64, got torch.int32"),
    "loc-2d": (dict(loc2d=True), ValueError, "kv-canary: accept_rewrites out_cache_loc must be 1-D, got shape (1, 2)"),
    "decreasing-offsets": (dict(offs=[0, 2, 1]), ValueError,
                           "kv-canary: accept_rewrites plan.write_offsets must be non-decreasing, got 1 after 2 "
                           "at index 2"),
    "mode": (dict(mode=7), ValueError, "kv-canary: accept_rewrites real_kv_mode must be a RealKvMode (0, 1, 2), got 7"),
}


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
@pytest.mark.parametrize("case", list(REJECTED), ids=str)
def test_rejected_call_changes_nothing(backend, case):
    changes, exc, message = REJECTED[case]
    if "offs" in changes and DEVICE.type != "cpu":
        pytest.skip("offset values are checked for host plans only (reading a device plan would sync)")
    head, tail = _buffers(1, [2], 48)
    tail, head = tail[:8].clone(), head[:8].clone()
    if "head" in changes:
        head = torch.zeros(8, 6, dtype=changes["head"], device=DEVICE)
    if "head_rows" in changes:
        head = torch.zeros(changes["head_rows"], 48, dtype=torch.uint8, device=DEVICE)
    plan = poisoned_plan(4, 2, DEVICE)
    plan.write_offsets[:3] = t(changes.get("offs", [0, 1, 2]))
    state = {"head": head, "tail": tail, "plan": plan, "rewrites": t([0], changes.get("rewrites", torch.int64))}
    before = copy.deepcopy(state)
    loc = t([[2, 3]]) if changes.get("loc2d") else t([2, 3])
    with pytest.raises(exc) as info:
        ops.accept_rewrites(head_buf=head, tail_buf=tail, plan=plan, num_requests=changes.get("nr", 2),
                            out_cache_loc=loc, sources=_sources(1), real_kv_mode=changes.get("mode", RealKvMode.ALL),
                            rewrites=state["rewrites"], backend=use_backend(backend))
    assert str(info.value) == message
    for name, a in flatten(before).items():
        assert torch.equal(as_bytes(a), as_bytes(flatten(state)[name])), name


@pytest.mark.skipif("triton" not in FAST_BACKENDS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_triton_new_batch_sizes_do_not_recompile(monkeypatch, dtype):
    from test_triton_ops import _specialization

    from kvcanary.ops import triton_kernels

    jit_fn, seen = triton_kernels._accept_kernel, set()

    class Recorder:
        def __getitem__(self, grid):
            def launch(**kwargs):
                seen.add(_specialization(jit_fn, kwargs))
                return jit_fn[grid](**kwargs)
            return launch

    monkeypatch.setattr(triton_kernels, "_accept_kernel", Recorder())
    head, tail = _buffers(0, [3])
    plan, rewrites = ops.Plan.allocate(8, 40, DEVICE), t([0])
    for bs, extend in ((2, 1), (3, 5), (17, 1), (33, 1), (5, 7)):
        plan.write_offsets[:bs + 1] = torch.arange(bs + 1) * extend
        loc = (torch.arange(bs * extend, device=DEVICE) % (NUM_SLOTS - 1) + 1).to(dtype)
        ops.accept_rewrites(head_buf=head, tail_buf=tail, plan=plan, num_requests=bs, out_cache_loc=loc,
                            sources=_sources(2), real_kv_mode=RealKvMode.PARTIAL, rewrites=rewrites, backend="triton")
    assert len(seen) == 1, seen
    assert int(rewrites[0]) > 0


@pytest.mark.gpu
def test_torch_path_replays_in_a_cuda_graph():
    """No host sync: the torch path captures into a CUDA graph and a replay gives the reference's bytes."""
    head, tail = _buffers(4, [6, 9])
    kv = _sources(2, 4)
    plan = ops.Plan.allocate(8, 3, DEVICE)
    plan.write_offsets[:4] = t([0, 2, 3, 6])
    loc, rewrites = t([5, 6, 0, 7, 9, 7]), t([0])
    start = (tail.clone(), rewrites.clone())

    def step(backend):
        ops.accept_rewrites(head_buf=head, tail_buf=tail, plan=plan, num_requests=3, out_cache_loc=loc, sources=kv,
                            real_kv_mode=RealKvMode.ALL, rewrites=rewrites, backend=backend)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step("torch")  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step("torch")
    tail.copy_(start[0]), rewrites.copy_(start[1])
    flip_kv_byte(kv[0], 5)  # the replay reads the bytes as they are now
    graph.replay()
    torch.cuda.synchronize()
    got = (tail.clone(), rewrites.clone())
    tail.copy_(start[0]), rewrites.copy_(start[1])
    step("reference")
    assert torch.equal(got[0], tail) and torch.equal(got[1], rewrites) and int(rewrites[0]) == 3
