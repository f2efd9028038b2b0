"""The allocator check (docs/allocator.md): the torch body writes the scalar reference's ring rows bit for bit;
each rule, planted in the simulated engine, a toy engine or transformers, is reported with its block, the
requests holding it and the step of the free; clean runs report nothing."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from conftest import DEVICE, set_device_bounds
from kvcanary import ops
from kvcanary.ops.allocator_ops import ALLOCATOR_KIND, NO_HOLDER, AllocatorRule
from kvcanary.ops.types import ViolationRing
from kvcanary.runtime import KvCanaryViolationError
from kvcanary.runtime.allocator import CACHE_HOLDER, AllocatorSnapshot, AllocatorViolation, BlockTable
from kvcanary.sim import MATRIX
from kvcanary.sim.engine import SimEngine
from toy_engine import ToyEngine

logging.getLogger("kvcanary").setLevel(logging.ERROR)
MARK = -9  # every ring cell starts here: a row the op must leave keeps it
LIVE, DUP, REF, WRITE, SHARED = (int(r) for r in AllocatorRule)
T = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731


def case(free=(), tables=(), writes=(), writers=None, nb=8, spb=2, refcounts=None):
    tables = [(torch.tensor(b, dtype=torch.int64).view(len(b), -1), T(*lens), T(*holders))
              for b, lens, holders in tables]
    writers = writes if writers is None else writers
    return dict(free=T(*free), tables=tables, write_slots=T(*writes), write_holders=T(*writers), num_blocks=nb,
                slots_per_block=spb, refcounts=None if refcounts is None else T(*refcounts))


def run(c: dict, backend: str, cap: int = 8, w0: int = 0) -> tuple[list[list[int]], int]:
    """The ring ``backend`` leaves, on DEVICE (on CUDA the torch body never reads its count: no early exit)."""
    ring = ViolationRing.allocate(cap, DEVICE)
    ring.rows.fill_(MARK)
    ring.write_index.fill_(w0)
    on = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    ops.check_allocator(ring, on(c["free"]), [tuple(on(x) for x in t) for t in c["tables"]], on(c["write_slots"]),
                        on(c["write_holders"]), num_blocks=c["num_blocks"], slots_per_block=c["slots_per_block"],
                        refcounts=on(c["refcounts"]), backend=backend)
    return ring.rows.tolist(), int(ring.write_index)


K = ALLOCATOR_KIND
# (name, case, the rows found, in order)
HAND = [
    ("live-block-free", case(free=[2, 3], tables=[([[1, 2]], [2], [7])]), [[K, 2, -1, 7, 7, 1, 0, LIVE]]),
    ("entries-past-lens-ignored", case(free=[2, 3], tables=[([[1, 2]], [1], [7])]), []),
    ("free-list-duplicate", case(free=[5, 5, 5]), [[K, 5, -1, NO_HOLDER, NO_HOLDER, 3, 1, DUP]]),
    ("refcount-mismatch", case(tables=[([[1, 4], [4, 0]], [2, 1], [3, 9])], refcounts=[0, 1, 0, 0, 1, 0, 0, 0]),
     [[K, 4, -1, 3, 9, 2, 1, REF]]),
    ("a-counted-block-nobody-maps", case(refcounts=[0, 0, 0, 2, 0, 0, 0, 0]),
     [[K, 3, -1, NO_HOLDER, NO_HOLDER, 0, 2, REF]]),
    ("free-block-write", case(free=[6], writes=[13, 12, 5], writers=[4, 8, 4]), [[K, 6, 12, 4, 8, 2, 0, WRITE]]),
    ("shared-write-slot", case(writes=[9, 3, 9, 9], writers=[1, 2, 5, 6]), [[K, 4, 9, 1, 5, 3, 1, SHARED]]),
    ("slot-0-negative-and-outside-skipped", case(free=[0, -1, 8, 99], writes=[0, 0, -1, -1, 16, 16]), []),
    ("the-prefix-cache-holds-it", case(free=[1], tables=[([[1]], [1], [CACHE_HOLDER]), ([[3, 1]], [2], [6])]),
     [[K, 1, -1, CACHE_HOLDER, 6, 2, 0, LIVE]]),
    ("rules-in-order", case(free=[2, 2, 6], tables=[([[2, 6]], [2], [1])], writes=[12, 12], writers=[1, 3]),
     [[K, 2, -1, 1, 1, 1, 0, LIVE], [K, 6, -1, 1, 1, 1, 0, LIVE], [K, 2, -1, 1, 1, 2, 1, DUP],
      [K, 6, 12, 1, 3, 2, 0, WRITE], [K, 6, 12, 1, 3, 2, 1, SHARED]]),
    ("empty", case(nb=1, spb=1), []),
]


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("name, c, want", HAND, ids=[h[0] for h in HAND])
def test_each_rule_writes_its_hand_derived_row(name, c, want, backend):
    rows, count = run(c, backend)
    assert count == len(want)
    assert rows == want + [[MARK] * 8] * (8 - len(want))


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("cap, w0, stored", [(3, 0, [0, 1, 2]), (3, 2, [2]), (3, 3, []), (3, 7, []), (0, 0, [])])
def test_the_ring_keeps_what_fits_and_counts_every_finding(backend, cap, w0, stored):
    c = HAND[-2][1]  # five findings
    rows, count = run(c, backend, cap=cap, w0=w0)
    assert count == w0 + 5
    want = [[MARK] * 8 for _ in range(cap)]
    for r in stored:
        want[r] = HAND[-2][2][r - w0]
    assert rows == want


def random_case(rng: random.Random) -> tuple[dict, int, int]:
    nb, spb = rng.randint(1, 12), rng.randint(1, 4)
    free = [rng.randint(-2, nb + 1) for _ in range(rng.randint(0, 2 * nb))]
    tables = []
    for _ in range(rng.randint(0, 3)):
        rows, width = rng.randint(0, 4), rng.randint(1, 5)
        blocks = [[rng.randint(-1, nb) for _ in range(width)] for _ in range(rows)]
        tables.append((blocks or [[0] * width][:0], [rng.randint(0, width + 1) for _ in range(rows)],
                       [rng.randint(-1, 9) for _ in range(rows)]))
    tables = [(torch.tensor(b, dtype=torch.int64).view(len(b), -1 if b else 1), T(*n), T(*h)) for b, n, h in tables]
    n = rng.randint(0, 10)
    c = dict(free=T(*free), tables=tables, write_slots=T(*(rng.randint(-1, nb * spb + 1) for _ in range(n))),
             write_holders=T(*(rng.randint(0, 5) for _ in range(n))), num_blocks=nb, slots_per_block=spb,
             refcounts=T(*(rng.randint(0, 3) for _ in range(nb))) if rng.random() < 0.5 else None)
    return c, rng.randint(0, 6), rng.randint(0, 8)


def test_torch_agrees_with_the_reference_on_random_snapshots():
    rng = random.Random(38)
    findings = 0
    for _ in range(300):
        c, cap, w0 = random_case(rng)
        want = run(c, "reference", cap, w0)
        assert run(c, "torch", cap, w0) == want, c
        findings += want[1] - w0
    assert findings > 300  # (the cases find things: every rule, often)


@pytest.mark.parametrize("change, error, match", [
    (dict(free=torch.tensor([1.0])), TypeError, "check_allocator free must be int32 or int64, got torch.float32"),
    (dict(write_holders=T(1, 2)), ValueError, "write_holders must be of length 1, got length 2"),
    (dict(num_blocks=0), ValueError, "num_blocks must be an int >= 1, got 0"),
    (dict(refcounts=T(1)), ValueError, "refcounts must be of length 8, got length 1"),
    (dict(tables=[(T(1), T(1))]), TypeError, r"tables\[0\] must be a \(blocks, lens, holders\) tuple"),
    (dict(tables=[(T(1), T(1), T(1))]), ValueError, r"tables\[0\] blocks must be 2-D, got shape \(1,\)"),
])
def test_bad_arguments_are_refused_before_the_ring_changes(change, error, match):
    c = {**case(free=[2], tables=[([[2]], [1], [4])], writes=[4]), **change}
    ring = ViolationRing.allocate(4)
    with pytest.raises(error, match=match):
        ops.check_allocator(ring, c["free"], c["tables"], c["write_slots"], c["write_holders"],
                            num_blocks=c["num_blocks"], slots_per_block=c["slots_per_block"], refcounts=c["refcounts"])
    assert not ring.rows.any() and int(ring.write_index) == 0


# -- the runtime, on a toy engine (slots are blocks) ------------------------------------------------------------
def toy(refcounts=None, **config) -> tuple[ToyEngine, object]:
    """A toy engine whose every live request's row is a block table; ``refcounts(engine)``: the engine's counts."""
    e = ToyEngine(allocator_check_interval=config.pop("interval", 1), **config)

    def snapshot():
        rids = list(e.reqs)
        blocks = e.rtt[T(*(e.reqs[r]["row"] for r in rids))].to(torch.int64)
        counts = None if refcounts is None else refcounts(e)
        return AllocatorSnapshot(T(*e.free), (BlockTable(blocks, (blocks != 0).sum(1), T(*rids)),), counts)

    return e, e.canary.watch_allocator(snapshot, num_blocks=64, slots_per_block=1)


def allocator_rows(e) -> list[AllocatorViolation]:
    return [v for v in e.canary.flush() if isinstance(v, AllocatorViolation)]


def test_a_clean_toy_run_checks_every_step_and_finds_nothing():
    def owned(e):  # each request's own slots count 1, the slots request 2 shares with request 1 count 2
        counts = torch.zeros(64, dtype=torch.int64)
        for r in e.reqs.values():
            counts[e.rtt[r["row"]].to(torch.int64)] += 1
        counts[0] = 0
        return counts

    e, _ = toy(refcounts=owned)
    e.add(1, [11, 12, 13, 14])
    e.forward([(1, 4)])
    e.add(2, [11, 12, 21], share_from=1, shared=2)
    e.forward([(1, 1), (2, 1)])
    e.forward([(1, 1), (2, 1)])
    assert e.canary.flush() == []
    stats = e.canary.stats()
    assert stats["allocator_checks"] == 3 and stats["allocator_violations"] == 0 and stats["violations"] == 0


def test_an_early_free_nobody_read_is_reported_with_block_holder_and_step():
    e, check = toy()
    e.add(1, [11, 12, 13, 14])
    e.forward([(1, 4)])
    slot = e.slot(1, 1)
    e.free.append(slot)  # planted: freed while request 1's table maps it (the next forward reads it intact)
    check.note_free([slot])
    e.forward([(1, 1)])
    vs = e.canary.flush()
    assert [type(v) for v in vs] == [AllocatorViolation], vs  # no read went wrong: only the allocator check saw it
    v = vs[0]
    assert (v.rule, v.block_id, v.holders, v.free_step, v.step, v.count) == ("live_block_free", slot, (1,), 2, 2, 1)
    assert f"block {slot} is on the free list (freed before the forward of step 2) while request 1's table" in v.block()
    assert v.log_line() == (f"kv_canary violation: launch_tag=ALLOCATOR fail_reason=live_block_free block={slot} "
                            "slot_idx=-1 holders=1 count=1 expected=0 freed_at_step=2")
    assert v.to_dict()["holders"] == [1] and v.reason_label == "live_block_free"


def test_a_double_free_is_a_free_list_duplicate():
    e, check = toy()
    e.add(1, [11, 12])
    e.forward([(1, 2)])
    again = e.free[-1]
    e.free.append(again)  # planted: a free block freed a second time
    check.note_free([again])
    e.forward([(1, 1)])
    (v,) = allocator_rows(e)
    assert (v.rule, v.block_id, v.count, v.expected, v.free_step) == ("free_list_duplicate", again, 2, 1, 2)
    assert f"block {again} is on the free list 2 times (last freed before the forward of step 2)" in v.block()


def test_a_share_without_a_reference_is_a_refcount_mismatch():
    def allocated(e):  # the engine counts the request a slot was allocated to; the share took no reference
        counts = torch.zeros(64, dtype=torch.int64)
        counts[e.rtt[e.reqs[1]["row"]].to(torch.int64)] = 1
        if 2 in e.reqs:
            counts[e.rtt[e.reqs[2]["row"], 2:].to(torch.int64)] = 1
        counts[0] = 0
        return counts

    e, _ = toy(refcounts=allocated)
    e.add(1, [11, 12, 13])
    e.forward([(1, 3)])
    e.add(2, [11, 12, 21], share_from=1, shared=2)
    e.forward([(2, 1)])
    vs = allocator_rows(e)
    assert [(v.rule, v.block_id, v.holders, v.count, v.expected) for v in vs] == [
        ("refcount_mismatch", e.slot(1, p), (1, 2), 2, 1) for p in (0, 1)]
    assert "the engine counts 1 table entry, its tables hold 2 (request 1 and request 2)" in vs[0].block()


def test_a_write_into_a_free_block_and_two_writers_of_one_slot():
    e, _ = toy()
    e.add(1, [11, 12])
    e.add(2, [21, 22])
    e.forward([(1, 2), (2, 2)])
    spare = e.free[-1]

    def stale(batch):  # planted: request 1's second token writes a free slot, request 2's last one request 1's
        batch.out_cache_loc[1] = spare
        batch.out_cache_loc[3] = batch.out_cache_loc[0]
    e.forward([(1, 2), (2, 2)], feed=stale)
    found = {v.rule: v for v in allocator_rows(e)}
    w, s = found["free_block_write"], found["shared_write_slot"]
    assert (w.block_id, w.slot, w.holders, w.free_step) == (spare, spare, (1,), None)
    assert (s.slot, s.holders, s.count) == (e.slot(1, 2), (1, 2), 2)
    assert "the forward writes slot" in w.block() and "is written by 2 tokens of one forward" in s.block()


@pytest.mark.parametrize("interval, checks", [(0, 0), (1, 6), (3, 2), (4, 1)])
def test_the_check_runs_every_interval_steps_and_keeps_replayed_closes_off_its_steps(interval, checks):
    e, _ = toy(interval=interval)
    e.add(1, [11])
    due = []
    for _ in range(6):
        due.append(not e.canary.fusable())  # (a step whose close checks the allocator is never fused)
        e.forward([(1, 1)])
    assert e.canary.stats()["allocator_checks"] == checks
    assert due == [bool(interval) and (s + 1) % interval == 0 for s in range(6)]


def test_raise_mode_raises_on_an_allocator_violation():
    e, check = toy(mode="raise")
    e.add(1, [11, 12])
    e.forward([(1, 2)])
    e.free.append(e.slot(1, 0))
    with pytest.raises(KvCanaryViolationError, match="launch_tag=ALLOCATOR fail_reason=live_block_free"):
        e.forward([(1, 1)])


def test_a_provider_gets_a_clear_error():
    e = ToyEngine(allocator_check_interval=1)
    with pytest.raises(ValueError, match="watch_allocator num_blocks must be an int >= 1, got 0"):
        e.canary.watch_allocator(lambda: None, num_blocks=0, slots_per_block=1)
    with pytest.raises(TypeError, match="watch_allocator provider must be a callable"):
        e.canary.watch_allocator(None, num_blocks=4, slots_per_block=1)
    e.canary.watch_allocator(lambda: None, num_blocks=64, slots_per_block=1)  # None: nothing to check this step
    e.add(1, [11])
    e.forward([(1, 1)])
    assert e.canary.stats()["allocator_checks"] == 0
    e.canary.watch_allocator(lambda: "snapshot", num_blocks=64, slots_per_block=1)
    with pytest.raises(TypeError, match="allocator provider must return an AllocatorSnapshot or None, got str"):
        e.forward([(1, 1)])


# -- the simulated engine ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MATRIX))
def test_clean_sim_runs_check_every_step_and_find_nothing(name):
    e = SimEngine(MATRIX[name])
    r = e.run()
    stats = e.canary.stats()
    assert r.violations == 0 and stats["allocator_checks"] == r.steps > 20 and stats["allocator_violations"] == 0


def sim_bug(bug: str, config: str) -> tuple[SimEngine, list[AllocatorViolation]]:
    e = SimEngine(MATRIX[config].replace(bug=bug))
    e.run()
    return e, [v for v in e.canary.violations if isinstance(v, AllocatorViolation)]


@pytest.mark.parametrize("config", ["base", "paged", "spec"])
def test_sim_early_free_is_reported_at_its_step_before_any_read_goes_wrong(config):
    e, vs = sim_bug("early_free_unread", config)
    planted = e.bugs.first_step
    first = min(e.canary.violations, key=lambda v: v.step)
    assert first.step == planted and all(v.step > planted for v in e.canary.violations if v.launch_tag != "ALLOCATOR")
    live = [v for v in vs if v.rule == "live_block_free" and v.step == planted]
    assert live and all(v.free_step == planted and len(v.holders) == 1 for v in live)
    (rid,) = live[0].holders
    pages = {s // e.cfg.page_size for s in e.sched.requests[rid].slots}
    # its pages (a verify's rejected drafts leave the request's slots at its rollback: not all of them)
    assert {v.block_id for v in live} <= pages if not e.cfg.spec_tokens else {v.block_id for v in live} & pages


def test_sim_write_into_a_free_page_is_reported_with_its_slot_and_writer():
    e, vs = sim_bug("write_into_free", "paged")
    v = vs[0]
    assert (v.rule, v.step) == ("free_block_write", e.bugs.first_step)
    assert v.slot // e.cfg.page_size == v.block_id and len(v.holders) == 1
    assert all(x.step > v.step for x in e.canary.violations if x.launch_tag != "ALLOCATOR")


def test_sim_free_while_cached_names_the_prefix_cache_then_a_double_free():
    e, vs = sim_bug("free_while_cached", "paged")
    first = vs[0]
    assert first.rule == "live_block_free" and CACHE_HOLDER in first.holders and first.free_step == first.step
    assert "the prefix cache" in first.block()
    assert any(v.rule == "free_list_duplicate" and v.free_step is not None for v in vs)


# -- transformers continuous batching ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("transformers")
    from kvcanary.demo import build_tiny_model

    return build_tiny_model()


def hf_run(model, bug=None):
    from kvcanary.demo import run_workload

    return run_workload(model, bug=bug, max_new_tokens=6, num_return_sequences=1, allocator_check_interval=1)


def refused_on_517(model, bug=None, **options) -> bool:
    """On transformers 5.17 (no block pool or ledger) attach refuses the allocator check, before it hooks
    anything (the planted bug is undone with it): True there."""
    from kvcanary.demo import run_workload
    from kvcanary.integrations.transformers.handle import live_handle
    from kvcanary.integrations.transformers.reach import has_block_pool

    if has_block_pool():
        return False
    version = __import__("transformers").__version__
    with pytest.raises(ValueError, match=rf"allocator_check_interval needs transformers >= 5\.18.*got {version}"):
        run_workload(model, bug=bug, max_new_tokens=6, num_return_sequences=1, **options)
    assert live_handle(model) is None and "init_continuous_batching" not in vars(model)
    return True


def test_transformers_clean_run_checks_every_step_and_finds_nothing(llama):
    if refused_on_517(llama, allocator_check_interval=1):
        return
    run = hf_run(llama)
    assert run.violations == [] and run.stats["allocator_checks"] == run.stats["forwards"] > 5


def test_transformers_planted_early_free_is_reported_before_any_read_goes_wrong(llama):
    if refused_on_517(llama, bug="early-free-unread", allocator_check_interval=1):
        return
    run = hf_run(llama, bug="early-free-unread")
    first = min(run.violations, key=lambda v: v.step)
    assert isinstance(first, AllocatorViolation) and first.rule == "live_block_free"
    assert len(first.holders) == 1 and first.free_step == first.step and first.count == 1
    assert all(v.step > first.step for v in run.violations if v.launch_tag != "ALLOCATOR")
    # its next owner then holds it with the first: the engine's ledger counts one reference
    assert any(v.rule == "refcount_mismatch" and v.block_id == first.block_id and v.count == 2 and v.expected == 1
               for v in run.violations if isinstance(v, AllocatorViolation))


def test_transformers_fused_steps_leave_the_checked_steps_unfused(llama, monkeypatch):
    """With the adapter's step graphs (the CPU stand-in) and fused steady steps, a step whose close checks
    the allocator takes the unfused close: every other step is fused, each due step is checked, and the
    planted early free is still reported at its step."""
    set_device_bounds(monkeypatch)  # (the CPU stand-in graphs record the torch backend's device ops)
    if refused_on_517(llama, allocator_check_interval=2):
        return
    from kvcanary.demo import run_workload
    from kvcanary.integrations.transformers import session as hf_session
    from kvcanary.runtime.graphs import DispatchGraph
    from kvcanary.runtime.step import graphs as step_graphs
    from kvcanary.runtime.step.fused import FusedSteps

    monkeypatch.setattr(step_graphs, "STEADY_SIGHTINGS", 0)
    orig = hf_session.Session._step_runner
    monkeypatch.setattr(hf_session.Session, "_step_runner",
                        lambda self, graph_type=None: orig(self, DispatchGraph if self.device.type == "cpu" else None))
    fused, step = [], FusedSteps.step

    def counting(self, *args, **kwargs):  # (the step a fused replay closes)
        fused.append(self.s.canary.step + 1)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(FusedSteps, "step", counting)
    for bug in (None, "early-free-unread"):
        del fused[:]
        run = run_workload(llama, backend="torch", bug=bug, max_new_tokens=12, num_return_sequences=1,
                           allocator_check_interval=2)
        assert fused and all(s % 2 for s in fused)  # (fused steps close unchecked: odd steps only)
        assert run.stats["allocator_checks"] == run.stats["forwards"] // 2
        allocator = [v for v in run.violations if isinstance(v, AllocatorViolation)]
        if bug is None:
            assert run.violations == []
        else:
            assert allocator and allocator[0].rule == "live_block_free" and allocator[0].free_step is not None
