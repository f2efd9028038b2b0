"""The runtime's step runner driven by its second source, the simulated engine (``SimEngine(steps=...)``):
its eager, captured and fused paths (the CPU stand-in of a CUDA graph) report what the plain before/after
hooks report, and leave the same canary records, on clean runs and with planted bugs.

The captured and fused paths replay the torch backend's device ops (as on an accelerator, no host read:
tests/conftest.py ``set_device_bounds``), and in one representative case Triton's launches (on the CPU under
Triton's interpreter: minutes); the plain hooks and the eager path they are compared with run the compiled CPU
backend (numba, else torch), whose records and reports are Triton's and torch's bit for bit
(tests/test_ops_cases.py): seconds. (Not ``stale_table_tail`` across backends: where several tokens of one launch
write the reserved slot 0, which write lands last, and so slot 0's record and the rows that report it, follows
each backend's order of work.)"""

import pytest
import torch

from kvcanary.runtime.engine import StepOptions
from kvcanary.sim.config import SimConfig
from kvcanary.sim.engine import SimEngine, default_canary_config

from kvcanary.ops.api import numba_available

from conftest import set_device_bounds

# the replayed paths' Triton case: the CPU stand-in graphs record Triton launches
INTERPRETED = pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                                 reason="the CPU stand-in graphs record Triton launches: TRITON_INTERPRET=1")
FAST = "numba" if numba_available() else "torch"  # (the plain hooks' and the eager path's backend)

# paged, prefix hits, no CUDA-graph padding of the sim's own (a graph per batch size): a steady decode batch of four
CFG = dict(seed=38, page_size=4, num_slots=512, num_requests=4, max_running=4, max_output=20, max_steps=40,
           graph_sizes=(1, 2, 3, 4))


def flip_live_kv(engine: SimEngine, at_step: int) -> None:
    """Flip one byte of layer 0's K of a running request's first slot before step ``at_step``'s forward."""
    step = engine.step

    def flipping():
        if engine.step_no + 1 == at_step:
            r = next(r for r in engine.sched.running if r.slots)
            slot, ps = r.slots[0], engine.cfg.page_size
            engine.model.k[0][slot // ps, (slot % ps) * (engine.model.k[0].shape[1] // ps)] ^= 0x55
        step()

    engine.step = flipping


def run(steps, bug=None, flip=False, backend=None):
    cfg = SimConfig(bug=bug, **CFG)
    backend = backend or ("torch" if steps in ("captured", "fused") else FAST)
    # (no allocator check: a step it checks closes unfused, and the fused path is under test here)
    e = SimEngine(cfg, default_canary_config(cfg).replace(backend=backend, allocator_check_interval=0), steps=steps)
    if flip:
        flip_live_kv(e, 12)
    result = e.run()
    records = {(g.name, key): buf.clone() for g in e.canary.groups for key, buf in g.bufs.items()}
    return e, result, records


@pytest.fixture
def steady(monkeypatch):
    """Every decode shape takes the graph-per-turn or fused path at once (a short run reaches them)."""
    from kvcanary.runtime.step import graphs

    monkeypatch.setattr(graphs, "STEADY_SIGHTINGS", 0)


CASES = ["clean", "flip-kv", "stale_table_tail"]
REPLAYED = ("eager", "captured", "fused")
# the replayed paths on the torch backend, clean and with a planted bug (its steps before it clean steps); under
# the interpreter, the planted bug with Triton
PATHS = [pytest.param(case, ("eager",), None, id=f"{case}-eager") for case in CASES] + [
    pytest.param(case, REPLAYED, "torch", id=f"{case}-replayed") for case in ("clean", "flip-kv")] + [
    pytest.param("flip-kv", REPLAYED, "triton", id="flip-kv-replayed-triton", marks=INTERPRETED)]


@pytest.mark.parametrize("case,paths,recorded", PATHS)
def test_the_runner_s_paths_report_what_the_plain_hooks_report(steady, monkeypatch, case, paths, recorded):
    if recorded == "torch":
        set_device_bounds(monkeypatch)
    bug, flip = (case, False) if case not in ("clean", "flip-kv") else (None, case == "flip-kv")
    plain, plain_result, plain_records = run(None, bug, flip)
    want = [v.block() for v in plain.canary.violations]
    assert (len(want) > 0) == (case != "clean")  # (the planted bug is found; the clean run is clean)
    runner_want = None
    for steps in paths:
        e, result, records = run(steps, bug, flip, backend=recorded if steps != "eager" else None)
        got = [v.block() for v in e.canary.violations]
        # The runner also checks the cells the forward reads for its own new tokens (the plain hooks check
        # the prefix only): stale zero cells add reserved-slot reads from the step of the first report on
        # (and, the ring holding a step's first rows, change which rows a step keeps). Its three paths
        # agree row for row; with the plain hooks where no such read exists, else from the same step on.
        runner_want = got if runner_want is None else runner_want
        assert got == runner_want, steps
        if any("reserved_slot_read" in v.reasons for v in e.canary.violations):
            assert e.canary.violations[0].step == plain.canary.violations[0].step, steps
        else:
            assert got == want, steps
        assert result.tokens_protected == plain_result.tokens_protected, steps
        assert all(torch.equal(records[k], plain_records[k]) for k in plain_records), steps
        graphs = e.runner.graphs
        if steps == "eager":
            assert graphs is None
            continue
        # the path was taken: graphs captured and replayed (fused: steady decode steps as one replay each)
        assert graphs.captures > 0 and graphs.replays + (graphs.fused.replays if graphs.fused else 0) > 0
        assert (graphs.fused is not None and graphs.fused.replays > 0) == (steps == "fused")


def test_a_source_takes_only_the_configurations_it_describes():
    with pytest.raises(ValueError, match="steps must be one of"):
        SimEngine(SimConfig(**CFG), steps="graphs")
    with pytest.raises(ValueError, match="spec_tokens=0 and swa_window=0"):
        SimEngine(SimConfig(**{**CFG, "spec_tokens": 2}), steps="eager")


def test_step_options_take_the_named_toggles_only():
    opts = StepOptions.of({"fused_steps": False, "token_history": True, "late_hooks": None})
    assert opts == StepOptions(fused_steps=False) and opts.late_hooks


def read_past_the_batch(engine: SimEngine, at_step: int) -> list:
    """At step ``at_step`` the read index lists one cell past the batch's last request's length (its
    table's next cell, as a read of a partial page's unused tail): a read no record check sees, the cells
    of every request being where the read table expects them. Returns [the extra cell's slot, the total,
    the forward's step, whether the fused path took it]."""
    src, seen = engine.source, []
    set_step = src.set_step

    def reading_past(works):
        set_step(works)
        if engine.step_no == at_step:
            io, w = src.inputs, works[-1]
            n = io.true_read_sizes[0]
            io.read_index_storage[0, n] = int(engine.pool.table[w.row, w.start + w.n])
            io.true_read_sizes[0] = n + 1
            seen[:] = [int(io.read_index_storage[0, n]), n, engine.canary.step + 1]

    src.set_step = reading_past
    return seen


@pytest.mark.parametrize("paths", [("eager",), ("captured", "fused")], ids=["eager", "replayed"])
def test_a_read_index_longer_than_the_batch_is_reported_on_every_path(steady, monkeypatch, paths):
    set_device_bounds(monkeypatch)  # (the replayed paths: the torch backend's device ops)
    for steps in paths:
        cfg = SimConfig(**CFG)
        backend = "torch" if steps != "eager" else FAST
        e = SimEngine(cfg, default_canary_config(cfg).replace(backend=backend, allocator_check_interval=0),
                      steps=steps)
        seen = read_past_the_batch(e, 13)
        before = e.runner.before

        def noting_path(late=False):  # (which path the planted step took)
            batch = before(late)
            if len(seen) == 3:  # (set by the planted step's set_step, just before this call)
                seen.append(e.runner.graphs is not None and e.runner.graphs.fused_now)
            return batch

        e.runner.before = noting_path
        e.run()
        slot, total, step, fused = seen
        assert [(v.reasons, v.step, v.slot, v.position, v.expected_aux) for v in e.canary.violations] == [
            (("read_past_length",), step, slot, total, total + 1)], steps
        assert e.canary.violations[0].reader_request is None and e.canary.violations[0].writer_request is None
        assert fused == (steps == "fused")  # (the fused run's planted step was a fused one)


def cuda_like_slots(monkeypatch) -> None:
    """The observer's ``NUM_SLOTS`` snapshot slots as on CUDA (each step's close copies the ring into the next one),
    read at once on the CPU: a recorded step's snapshot copy then goes into its slot, as on CUDA."""
    from kvcanary.runtime import observer as observer_mod

    orig = observer_mod.HostObserver.__init__

    def init(self, ring, watched, **kw):
        orig(self, ring, watched, **kw)
        size = self.slots[0].small.numel()
        self.slots = [observer_mod._Slot(ring, size, False, i, self.record_bufs, self.tables)
                      for i in range(observer_mod.NUM_SLOTS)]

    monkeypatch.setattr(observer_mod.HostObserver, "__init__", init)
    monkeypatch.setattr(observer_mod.HostObserver, "eager_read", property(lambda self: False))


def run_on_streams(steps: str) -> SimEngine:
    """A longer run with a flipped KV byte at step 12, the canary's streams recorded: with a side stream the
    launcher stages its inputs into its one buffer, as on CUDA; no two conflicting accesses left unordered."""
    from kvcanary.runtime.streams import RecordingStreams

    cfg = SimConfig(**{**CFG, "max_output": 30, "max_steps": 80})
    e = SimEngine(cfg, default_canary_config(cfg).replace(backend="torch", allocator_check_interval=0), steps=steps)
    rec = e.canary.launcher.streams = RecordingStreams()
    flip_live_kv(e, 12)
    e.run()
    assert rec.races() == [], steps
    return e


def test_a_captured_step_s_after_work_is_recorded_once_per_key_and_slot_and_replayed(steady, monkeypatch):
    from kvcanary.runtime import observer as observer_mod
    from kvcanary.runtime.graphs import EagerGraphs
    from kvcanary.runtime.step import after as after_mod

    set_device_bounds(monkeypatch)
    cuda_like_slots(monkeypatch)
    monkeypatch.setattr(after_mod, "COMBINE_SIGHTINGS", 4)  # (this short run's keys reach the combined recordings)
    calls = []  # (the recording's key, whether it was kept already, the step it closes)
    orig = after_mod.AfterPlans._replay

    def replay(self, key, body):
        calls.append((key, key in self.plans.entries, self.s.canary.step + 1))
        orig(self, key, body)

    monkeypatch.setattr(after_mod.AfterPlans, "_replay", replay)

    eager = run_on_streams("eager")
    assert calls == []
    e = run_on_streams("captured")
    # the same reports, row for row, as the eager route's: the flipped byte at the same step, in the same slot
    want, got = eager.canary.violations, e.canary.violations
    assert want and [v.block() for v in got] == [v.block() for v in want]
    assert (got[0].step, got[0].slot, got[0].reasons) == (12, want[0].slot, ("verify_real_kv_hash",))
    assert all(torch.equal(buf, e.canary.groups[0].bufs[k]) for k, buf in eager.canary.groups[0].bufs.items())
    a = e.runner.graphs.afters
    # each key recorded once (none dropped: fewer keys than the plans keep), replayed afterwards
    captured = [key for key, kept, _ in calls if not kept]
    assert len(captured) == len(set(captured)) == a.captures <= a.plans.capacity
    assert a.replays == sum(kept for _, kept, _ in calls) > 2 * a.captures
    # keyed by the launcher's key (bs, T, the staged fields: no address), alone, or with a slot
    assert all(len(key) == 5 or key[0] == "snapshot" or len(key[0]) == 5 for key in captured)
    slots = range(observer_mod.NUM_SLOTS)
    assert {("snapshot", i) for i in slots} <= set(captured)  # (TAIL apart: the snapshot copy per slot)
    combined = {key[1] for key in captured if key[0] != "snapshot" and len(key) == 2}
    assert combined == set(slots)  # (a key past COMBINE_SIGHTINGS: TAIL and the copy as one per slot)
    assert any(kept and step == 12 for _, kept, step in calls)  # (the flipped step's TAIL was a replay)
    # the launcher and the observer took no captures of their own: every recording is the runner's
    launcher = e.canary.launcher
    assert type(launcher.graphs) is EagerGraphs and e.canary.monitor.observer.graphs is launcher.graphs
    assert e.canary.monitor.observer.tail_seen == {} and launcher.deferred is None


def test_an_eager_step_of_a_captured_runner_replays_its_after_work_from_the_same_plans(steady, monkeypatch):
    """A step the runner's graphs cannot take (the block-table path, a sliding-window group, the token oracle: here
    every third step) runs the canary's own before hook; with the launcher's inputs staged (as on CUDA) its after work
    comes from the runner's after plans too, behind its HEAD on the side stream, with the eager route's reports."""
    from kvcanary.runtime.step import after as after_mod
    from kvcanary.runtime.step.graphs import StepGraphs

    set_device_bounds(monkeypatch)
    usable = StepGraphs.usable
    monkeypatch.setattr(StepGraphs, "usable", lambda self, io: usable(self, io) and self.s.canary.step % 3 != 1)
    eager_steps, replayed = [], []  # (the steps whose eager after work the plans took; the steps of their replays)
    takes, replay = after_mod.AfterPlans.takes_eager, after_mod.AfterPlans._replay

    def taking(self):
        took = takes(self)
        if took:
            eager_steps.append(self.s.canary.step + 1)
        return took

    def replaying(self, key, body):
        if key in self.plans.entries:
            replayed.append(self.s.canary.step + 1)
        replay(self, key, body)

    monkeypatch.setattr(after_mod.AfterPlans, "takes_eager", taking)
    monkeypatch.setattr(after_mod.AfterPlans, "_replay", replaying)
    eager = run_on_streams("eager")
    e = run_on_streams("captured")
    assert eager.canary.violations and [v.block() for v in e.canary.violations] == [
        v.block() for v in eager.canary.violations]
    assert all(torch.equal(buf, e.canary.groups[0].bufs[k]) for k, buf in eager.canary.groups[0].bufs.items())
    assert len(eager_steps) > 5 and all(step % 3 == 2 for step in eager_steps)  # (every third step: eager)
    assert set(eager_steps) & set(replayed)  # (replayed, not only run at a key's first sighting)


def test_the_runner_s_cuda_route_hands_the_launcher_no_graphs(monkeypatch):
    """On CUDA the runner makes its step graphs and leaves the launcher's and the observer's graphs as the
    canary's config made them (``launch_graphs``: off here): the after work is recorded in the runner's plans."""
    from types import SimpleNamespace

    from kvcanary.runtime.graphs import EagerGraphs
    from kvcanary.runtime.step import runner as runner_mod
    from kvcanary.runtime.streams import RecordingStreams

    e = SimEngine(SimConfig(**CFG), steps="eager")
    c = e.canary
    c.launcher.streams = RecordingStreams()  # (a side stream: the CUDA route's condition)
    made = []
    monkeypatch.setattr(runner_mod, "StepGraphs", lambda runner, graph_type=None: made.append(runner) or "graphs")
    stub = SimpleNamespace(options=StepOptions(), device=torch.device("cuda"), canary=c, carries=False)
    assert runner_mod.StepRunner._step_graphs(stub, None) == "graphs" and made == [stub]
    assert type(c.launcher.graphs) is EagerGraphs and c.monitor.observer.graphs is c.launcher.graphs
