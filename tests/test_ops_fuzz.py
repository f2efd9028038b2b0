"""Property-based fuzz: random engines and raw op inputs, every fast backend against the reference.

Hypothesis draws the structure (sizes, which options, which corruption); a seeded torch
generator fills the bulk bytes. Parallel backends (Triton) get write launches whose requests
do not share slots, the one place where only the serial reference order is defined.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICE, FAST_BACKENDS
from kvcanary import ops
from kvcanary.format import LaunchTag, RealKvMode
from kvcanary.ops import allocate_canary_buffer, allocate_counters
from ops_harness import check, clean_chain, kv_source, poisoned_plan, poisoned_ring
from sim_engine import Config, Script, build_state, replay

BACKENDS = FAST_BACKENDS + ["torch-static"]
# The Triton interpreter is slow on CPU: fewer examples there.
EXAMPLES = {"torch": 60, "torch-static": 40, "numba": 60, "triton": 40}


def fuzz(backend: str, scale: float = 1.0):
    """Hypothesis settings: reproducible (derandomized), no deadline, fewer examples for slow backends."""
    return settings(max_examples=max(5, int(EXAMPLES[backend] * scale)), deadline=None, derandomize=True,
                    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def t(xs, dtype=torch.int64):
    return torch.tensor(xs, dtype=dtype, device=DEVICE)


DTYPES = st.sampled_from([torch.int32, torch.int64])
MODES = st.sampled_from(list(RealKvMode))
SOURCE = st.tuples(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.uint8]),
                   st.integers(1, 4), st.sampled_from([16, 32, 48]), st.sampled_from([16, 32]),
                   st.sampled_from([0, 16]), st.booleans())


def _sources(specs, num_slots, seed):
    out = []
    for i, (dt, ps, nb, rb, pad, d3) in enumerate(specs):
        itemsize = torch.empty(0, dtype=dt).element_size()
        d3 = d3 and nb % itemsize == 0
        out.append(kv_source(num_slots, dtype=dt, page_size=ps, nbpt=nb, read_bytes=min(rb, nb), pad_bytes=pad,
                             device=DEVICE, seed=seed + i, three_d=d3))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_fingerprint_fuzz(backend):
    @fuzz(backend, 0.5)
    @given(specs=st.lists(SOURCE, min_size=0, max_size=4), mode=MODES,
           slots=st.lists(st.integers(-3, 40), max_size=12), seed=st.integers(0, 99))
    def prop(specs, mode, slots, seed):
        def run(state, b):
            state["out"] = ops.fingerprint(t(slots), _sources(specs, 30, seed), mode, backend=b)
        check(dict, run, backend)
    prop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_scatter_fuzz(backend):
    @fuzz(backend, 0.5)
    @given(data=st.data())
    def prop(data):
        bs = data.draw(st.integers(0, 5))
        flat = data.draw(st.lists(st.integers(-(2**40), 2**40), max_size=14))
        offs = data.draw(st.lists(st.integers(-2, 16), min_size=bs + 1, max_size=bs + 1))
        if data.draw(st.booleans()):
            offs = sorted(offs)
        # Requests sharing a row race in a parallel backend; the reference's last writer wins.
        rows = data.draw(st.lists(st.integers(-1, 5), min_size=bs, max_size=bs, unique=backend == "triton"))
        shape = (data.draw(st.integers(0, 5)), data.draw(st.integers(0, 7)))

        def build():
            return {"pool": torch.full(shape, 0x5A5A5A5A, dtype=torch.int32, device=DEVICE)}

        def run(state, b):
            ops.scatter_req_token_ids(t(flat), t(offs), t(rows), state["pool"], backend=b)
        check(build, run, backend)
    prop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_fuzz(backend):
    @fuzz(backend)
    @given(data=st.data())
    def prop(data):
        d = data.draw
        dtype = d(DTYPES)
        num_rows, max_ctx, bs = d(st.integers(1, 5)), d(st.integers(0, 8)), d(st.integers(0, 5))
        rtt = d(st.lists(st.lists(st.integers(-3, 30), min_size=max_ctx, max_size=max_ctx), min_size=num_rows,
                         max_size=num_rows))
        rows = d(st.lists(st.integers(-1, num_rows), min_size=bs, max_size=bs))
        prefix = d(st.lists(st.integers(-2, max_ctx + 2), min_size=bs, max_size=bs))
        extend = d(st.lists(st.integers(-1, 4), min_size=bs, max_size=bs))
        window = d(st.integers(0, 5))
        swa = d(st.none() | st.lists(st.integers(0, 20), max_size=30)) if window else None
        tokens = d(st.none() | st.tuples(st.integers(0, num_rows + 1), st.integers(0, max_ctx + 2)))
        valid = d(st.lists(st.integers(-1, 10), min_size=bs, max_size=bs))
        offset, cap = d(st.integers(0, 1)), d(st.integers(0, 20))

        def build():
            state = {"plan": poisoned_plan(cap, bs + 1, DEVICE), "rtt": t(rtt, dtype).reshape(num_rows, max_ctx)}
            if tokens is not None:
                state["tokens"] = torch.arange(tokens[0] * tokens[1], dtype=torch.int32,
                                               device=DEVICE).reshape(tokens) * 7 - 50
            return state

        def run(state, b):
            ops.plan(req_pool_indices=t(rows, dtype), prefix_lens=t(prefix, dtype), extend_lens=t(extend, dtype),
                     req_to_token=state["rtt"], out=state["plan"], window=window,
                     full_to_swa=None if swa is None else t(swa, dtype), token_table=state.get("tokens"),
                     token_valid_lens=None if tokens is None else t(valid, dtype), token_offset=offset, backend=b)
        check(build, run, backend)
    prop()


def _random_buffer(num_slots, stride, seed, garbage):
    """Clean chains over a shuffled slot order, then ``garbage`` records overwritten with random bytes."""
    g = torch.Generator().manual_seed(seed)
    buf = allocate_canary_buffer(num_slots, stride)
    perm = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()
    for k in range(0, len(perm), 5):
        clean_chain(buf, perm[k:k + 5], torch.randint(0, 50, (5,), generator=g).tolist())
    for s in torch.randint(0, num_slots, (garbage,), generator=g).tolist():
        buf[s] = torch.randint(0, 256, (stride,), dtype=torch.uint8, generator=g)
    return buf.to(DEVICE), perm


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_fuzz(backend):
    _write_fuzz(backend)


@pytest.mark.skipif("triton" not in FAST_BACKENDS, reason="Triton is not installed")
def test_write_fuzz_lane_kernel(monkeypatch):
    # every launch through the lane-per-request kernel (decode shapes take it), two requests a program: the fuzz's
    # up to four requests span programs
    from kvcanary.ops import triton_ops

    monkeypatch.setattr(triton_ops, "WRITE_LANES_MAX_RATIO", 1 << 20)
    monkeypatch.setattr(triton_ops, "WRITE_LANES", 2)
    _write_fuzz("triton")


def _write_fuzz(backend):
    serial = backend != "triton"

    @fuzz(backend)
    @given(data=st.data())
    def prop(data):
        d = data.draw
        dtype, stride, seed = d(DTYPES), d(st.sampled_from([32, 40, 48, 64])), d(st.integers(0, 999))
        num_slots = d(st.integers(1, 24))
        nr = d(st.integers(0, 4))
        lens = d(st.lists(st.integers(0, 4), min_size=nr, max_size=nr))
        n_tok = max(0, sum(lens) + d(st.integers(-2, 2)))
        slot_any = st.integers(-2, num_slots + 1)
        if serial:
            # Shared slots and seeds that an earlier request of the launch writes: serial order decides.
            locs = d(st.lists(slot_any, min_size=n_tok, max_size=n_tok))
            seed_any = st.one_of(slot_any, st.sampled_from(locs)) if locs else slot_any
            seeds = d(st.lists(seed_any, min_size=nr, max_size=nr))
        else:
            seeds = d(st.lists(slot_any, min_size=nr, max_size=nr))
            # Distinct in-range slots that no request seeds from; out-of-range ones store nothing.
            free = [s for s in range(num_slots) if s not in seeds]
            locs = d(st.lists(st.sampled_from(free) if free else st.just(-1), min_size=n_tok, max_size=n_tok,
                              unique=True)) if len(free) >= n_tok else [-1] * n_tok
        # Skipped entries (negative slots) anywhere in a request: no checks, no record, no chain step.
        skips = d(st.lists(st.sampled_from([False, False, False, True]), min_size=n_tok, max_size=n_tok))
        locs = [-1 if skip else loc for loc, skip in zip(locs, skips)]
        ids = d(st.lists(st.integers(-3, 60), min_size=n_tok, max_size=n_tok))
        pos_base = d(st.integers(-1, 8))
        pos = [pos_base + k + d(st.sampled_from([0, 0, 0, 1, -1])) for k in range(n_tok)]
        exp_ids = d(st.none() | st.lists(st.integers(-3, 60), min_size=n_tok, max_size=n_tok))
        exp_pos = d(st.none() | st.just([pos_base + k for k in range(n_tok)]))
        chain = d(st.sampled_from([None, 0, 1]))
        writer, step = d(st.booleans()), d(st.booleans())
        ring_cap, garbage = d(st.integers(0, 6)), d(st.integers(0, 3))
        specs, mode = d(st.lists(SOURCE, max_size=2)), d(MODES)

        def build():
            plan = poisoned_plan(1, 4, DEVICE)
            plan.write_offsets[:nr + 1] = t([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist())
            plan.seed_slot[:nr] = t(seeds)
            return {"buf": _random_buffer(num_slots, stride, seed, garbage)[0], "plan": plan,
                    "ring": poisoned_ring(ring_cap, DEVICE), "counters": allocate_counters(DEVICE),
                    "kv": _sources(specs, num_slots + 3, seed)}

        def run(state, b):
            ops.write(buf=state["buf"], plan=state["plan"], num_requests=nr, out_cache_loc=t(locs, dtype),
                      input_ids=t(ids, dtype), positions=t(pos, dtype), ring=state["ring"],
                      counters=state["counters"], launch_tag=LaunchTag.HEAD_V_FULL, sources=state["kv"],
                      real_kv_mode=mode, expected_input_ids=None if exp_ids is None else t(exp_ids, dtype),
                      expected_positions=None if exp_pos is None else t(exp_pos, dtype),
                      chain_check=None if chain is None else t([chain], torch.int32),
                      writer_ids=t([900 + r for r in range(4)]) if writer else None,
                      step=t([seed]) if step else None, backend=b)
        check(build, run, backend)
    prop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_fuzz(backend):
    @fuzz(backend)
    @given(data=st.data())
    def prop(data):
        d = data.draw
        stride, seed = d(st.sampled_from([32, 48, 56])), d(st.integers(0, 999))
        num_slots, cap = d(st.integers(1, 24)), d(st.integers(0, 10))
        n = d(st.integers(0, 12))
        garbage = d(st.integers(0, 4))
        specs, mode = d(st.lists(SOURCE, max_size=3)), d(MODES)
        count = d(st.none() | st.integers(-1, 14))
        enable = d(st.sampled_from([None, 0]))
        ring_cap, ring_start = d(st.integers(0, 8)), d(st.integers(0, 3))
        buf, perm = _random_buffer(num_slots, stride, seed, garbage)
        # Entries mostly follow the clean chains (positions and predecessors right), some are off.
        entries = []
        for _ in range(n):
            if perm and d(st.integers(0, 3)):
                k = d(st.integers(0, len(perm) - 1))
                slot, p = perm[k], k % 5
                prev = -1 if p == 0 else perm[k - 1]
                entries.append((slot, p + d(st.sampled_from([0, 0, 1])), prev, d(st.integers(-1, 50))))
            else:
                entries.append(tuple(d(st.integers(-2, num_slots + 1)) for _ in range(4)))

        def build():
            ring = poisoned_ring(ring_cap, DEVICE)
            ring.write_index.fill_(ring_start)
            kv = _sources(specs, num_slots, seed)
            b = buf.clone()
            if kv and mode and d(st.booleans()):
                # Store the true fingerprints, so only planted KV flips show.
                b.view(torch.int64)[:, 3] = ops.fingerprint(t(list(range(num_slots))), kv, mode,
                                                            backend="reference")
            return {"buf": b, "plan": poisoned_plan(cap, 1, DEVICE), "ring": ring,
                    "counters": allocate_counters(DEVICE), "kv": kv}

        state0 = build()

        def run(state, b):
            e = state["plan"].entries
            cols = list(zip(*entries)) if entries else [[]] * 4
            ops.fill_entries(e, t(cols[0]), t(cols[1]), t(cols[2]), t(cols[3]))
            if count is not None:
                e.count.fill_(count)
            if enable is not None:
                e.enable.fill_(enable)
            ops.verify(buf=state["buf"], entries=e, ring=state["ring"], counters=state["counters"],
                       launch_tag=LaunchTag.SWEEP_V_SWA, sources=state["kv"], real_kv_mode=mode, backend=b)
        check(lambda: copy.deepcopy(state0), run, backend)
    prop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_fuzz(backend):
    """Random schedules on the scripted engine with random planted bugs, FULL or SWA."""
    @fuzz(backend, 0.5)
    @given(data=st.data())
    def prop(data):
        d = data.draw
        window = d(st.sampled_from([0, 0, 2, 4]))
        specs = d(st.lists(SOURCE, min_size=1, max_size=2))
        cfg = Config(num_slots=48, swa_slots=48 if window else 0, window=window, device=str(DEVICE),
                     index_dtype=d(DTYPES), stride=d(st.sampled_from([32, 48, 64])), mode=d(MODES),
                     sources=tuple((dt, ps, nb, min(rb, nb), pad) for dt, ps, nb, rb, pad, _ in specs),
                     token_offset=d(st.integers(0, 1)), plan_capacity=d(st.sampled_from([6, 96])),
                     ring_capacity=d(st.sampled_from([2, 64])))
        sc = Script(cfg)
        num_req = 0
        for _ in range(d(st.integers(2, 4))):
            if num_req < 3 and d(st.booleans()):
                num_req += 1
                # A later request may start on an earlier one's cached prefix.
                src = d(st.integers(1, num_req - 1)) if num_req > 1 and d(st.booleans()) else None
                shared = d(st.integers(0, len(sc.reqs[src]["slots"]))) if src else 0
                sc.add(num_req, d(st.lists(st.integers(0, 99), min_size=1, max_size=6)), src, shared)
            sched = [(rid, d(st.integers(1, 3))) for rid in range(1, num_req + 1) if d(st.integers(0, 3))]
            if not sched or len(sc.free) - sum(n for _, n in sched) < 2:
                continue
            plant = d(st.sampled_from(["none", "none", "none", "pos", "tok", "swap", "kv"]))
            rid = sched[0][0]
            fw = sc.forward(sched, pad=d(st.integers(0, 1)), bad_pos={rid: 1} if plant == "pos" else None,
                            bad_tok={rid: 3} if plant == "tok" else None)
            n_cached = len(sc.reqs[rid]["slots"])
            if plant == "swap" and n_cached >= 2:
                sc.swap_cells(fw, rid, 0, n_cached - 1)
            if plant == "kv":
                sc.flip_kv(fw, rid, n_cached - 1)
        check(lambda: build_state(cfg), lambda state, b: replay(state, cfg, sc.forwards, b), backend)
    prop()
