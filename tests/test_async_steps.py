"""The step runner under async batching's carry-over (``runtime/step/carry.py``), driven by the simulated engine's
carrying source (``SimEngine(steps=..., carry=True)``: two input storage sets, the ids carried over inside the
forward, the host's ids and token history one step behind), through the eager, captured and fused paths on
the CPU stand-in graph. Planted variants (test-only monkeypatches) show what each part of the design guards.
The captured and fused paths replay the torch backend's device ops (as on an accelerator: no host read), one
representative case Triton's launches (on the CPU under Triton's interpreter); the eager path runs the compiled CPU
backend (numba, else torch). Every backend's records are the others' bit for bit (tests/test_ops_*)."""

import pytest
import torch

from kvcanary.format import RecordField as R
from kvcanary.runtime.step import carry as carry_mod
from kvcanary.runtime.step.fused import FusedSteps
from kvcanary.runtime.step.plans import Storages
from kvcanary.sim import step_source
from kvcanary.sim.config import SimConfig
from kvcanary.sim.engine import SimEngine, default_canary_config

from kvcanary.ops.api import numba_available

# the recorded paths run the torch backend as on an accelerator (tests/conftest.py ``device_bounds``), the eager path
# the compiled CPU backend (numba, else torch); ``TRITON`` runs a representative case with Triton's launches
pytestmark = pytest.mark.usefixtures("device_bounds")
FAST = "numba" if numba_available() else "torch"
TRITON = pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                            reason="the CPU stand-in graphs record Triton launches under TRITON_INTERPRET=1")

# a steady decode batch of four (as tests/test_step_runner.py), short
CFG = dict(seed=38, page_size=4, num_slots=512, num_requests=4, max_running=4, max_output=16, max_steps=30,
           graph_sizes=(1, 2, 3, 4))
PATHS = ("eager", "captured", "fused")


@pytest.fixture
def steady(monkeypatch):
    """Every decode shape takes the graph-per-turn or fused path at once (a short run reaches them)."""
    from kvcanary.runtime.step import graphs

    monkeypatch.setattr(graphs, "STEADY_SIGHTINGS", 0)


def engine(steps, carry=True, cfg=None, backend=None, **canary):
    cfg = SimConfig(**{**CFG, **(cfg or {})})
    # (no allocator check: a step it checks closes unfused, and the fused path is under test here)
    backend = backend or (FAST if steps == "eager" else "torch")
    config = default_canary_config(cfg).replace(backend=backend, allocator_check_interval=0, **canary)
    return SimEngine(cfg, config, steps=steps, carry=carry)


def stored_tokens_match(e: SimEngine) -> list:
    """After each step: the running requests' positions whose HEAD or TAIL record holds another token than the
    one sampled (the request's token at that position). Returns the list the checks append mismatches to."""
    bad, step = [], e.step
    g = e.canary.groups[0]

    def checking():
        step()
        for r in e.sched.running:
            slots = torch.tensor(r.slots, dtype=torch.int64)
            want = torch.tensor(r.tokens[:len(r.slots)], dtype=torch.int64)
            for phase in ("head", "tail"):
                got = g.bufs[phase, "k"].view(torch.int64)[slots][:, R.TOKEN]
                bad.extend((phase, r.rid, p) for p in torch.nonzero(got != want).flatten().tolist())

    e.step = checking
    return bad


@pytest.mark.parametrize("steps, backend", [(p, None) for p in PATHS] + [
    pytest.param("fused", "triton", marks=TRITON, id="fused-triton")])
def test_carried_steps_run_clean_and_store_the_sampled_tokens(steady, steps, backend):
    e = engine(steps, backend=backend)
    bad = stored_tokens_match(e)
    result = e.run()
    assert e.source.carries_done > 20  # (the forwards carried ids over: the path under test was taken)
    assert [v.block() for v in e.canary.violations] == [] and not bad
    # the same records as the synchronous source's run of the same path
    sync = engine(steps, carry=False, backend=backend)
    sync_result = sync.run()
    assert result.tokens_protected == sync_result.tokens_protected
    for key, buf in e.canary.groups[0].bufs.items():
        assert torch.equal(buf, sync.canary.groups[0].bufs[key]), key
    graphs = e.runner.graphs
    if steps != "eager":  # graphs captured for both storage sets and replayed
        assert graphs.captures > 0 and graphs.replays + (graphs.fused.replays if graphs.fused else 0) > 0
        sets = {p[0] for p in (e.runner.storages.now, e.runner.storages.other) if p is not None}
        assert len(sets) == 2


# The planted variants: on the eager path (numba) and on the fused one under the interpreter, the replayed path's
# representative (the captured one: a heavy extra, -m slow; its clean carried runs stay in the default run above)
PLANTED_PATHS = ("eager", pytest.param("captured", marks=pytest.mark.slow), "fused")


@pytest.mark.parametrize("steps", PLANTED_PATHS)
def test_head_before_the_forward_reads_the_host_ids_and_is_reported(steady, steps, monkeypatch):
    # planted: the step's before work at the pre-forward point (the synchronous order): HEAD records the
    # host's placeholder ids (the previous position's token), not the carried ones
    monkeypatch.setattr(carry_mod.Carry, "late_step", lambda self: False)
    e = engine(steps)
    e.run()
    reasons = {r for v in e.canary.violations for r in v.reasons}
    assert "verify_token" in reasons, steps


@pytest.mark.parametrize("steps", ("captured", "fused"))
def test_graphs_keyed_without_the_storage_set_are_reported(steps, monkeypatch):
    # planted: step graphs keyed as if one storage set served every step: a replay reads the other set's ids.
    # (Not steady: a per-turn graph's key holds its staging turn, and with an even number of turns each turn
    # serves one storage set only, which hides the missing address; the shape graphs read one static copy.)
    one_set = (1, 2, 3, 4)
    monkeypatch.setattr(Storages, "of", lambda self, io: one_set)
    e = engine(steps)
    e.run()
    assert e.canary.violations, steps


@pytest.mark.parametrize("steps", PLANTED_PATHS)
def test_a_carried_cell_sent_at_prepare_time_is_reported_deferred_it_is_not(steady, steps, monkeypatch):
    # planted: the carried request's newest cell sent from the host when the step is prepared (it has no
    # token yet there: MISSING_TOKEN); the deferral (history_need) is the clean runs above
    monkeypatch.setattr(step_source, "history_need", lambda need, carried: need)
    e = engine(steps)
    e.run()
    missing = [v for v in e.canary.violations if v.expected_token == -2]
    assert missing and all("verify_token" in v.reasons for v in missing), steps


def test_fused_steps_repeat_across_alternating_storage_sets(steady, monkeypatch):
    longer = dict(max_output=40, max_steps=60)  # (runs of one read-table width long enough to repeat)
    repeats = {}
    for carry in (False, True):
        e = engine("fused", carry, longer)
        e.run()
        repeats[carry] = e.runner.graphs.fused.repeats
        assert not e.canary.violations
    assert repeats[True] == repeats[False] > 0  # as many repeats as the one storage set's run
    # planted: one steady run kept (the other storage set's forgotten): every step starts a run again
    monkeypatch.setattr(FusedSteps, "select", lambda self, ptrs: None)
    e = engine("fused", True, longer)
    e.run()
    assert e.runner.graphs.fused.repeats == 0 and not e.canary.violations


@pytest.mark.parametrize("canary, what", [(dict(check_before_forward=True), "check_before_forward"),
                                          (dict(inject_kv_prob=0.5), "fault injection")])
def test_what_must_precede_the_forward_is_refused(canary, what):
    with pytest.raises(ValueError, match=f"carries input ids over .* got {what}"):
        engine("eager", **canary)
    with pytest.raises(ValueError, match="not None with carry=True"):
        SimEngine(SimConfig(**CFG), carry=True)


def recorded(monkeypatch, *extra: str, cfg: dict | None = None):
    """An engine whose canary runs on the recording streams: the hooks' stream ``engine``, the side stream
    ``canary``, the engine's compute stream ``compute`` (and ``extra`` ones), with ``engine_stream``, the late
    steps' ``ready`` and the forward's KV writes modelled as on CUDA. Returns (engine, streams); an ordered run's
    ``races()`` is empty, the canary's own launches included."""
    from hf_async_model import runner_streams
    from kvcanary.runtime.streams import RecordingStreams

    rec = RecordingStreams(("engine", "canary", "compute", *extra))
    compute = rec.streams["compute"]
    runner_streams(monkeypatch, rec)
    orig_model = SimEngine.run_model

    def run_model(self, batch):  # the forward's KV writes, on the compute stream
        with rec.use(compute):
            rec.note("engine_forward", writes=("kv",))
        return orig_model(self, batch)

    monkeypatch.setattr(SimEngine, "run_model", run_model)
    e = engine("captured", cfg=cfg)
    for io in e.source.pairs:
        io.compute_stream = compute
    e.canary.launcher.streams = rec
    return e, rec


@pytest.mark.parametrize("drop", [False, True], ids=["ordered", "planted-dropped-wait"])
def test_the_static_staged_buffer_is_refilled_after_the_side_streams_last_read(monkeypatch, drop):
    # Under async batching the host prepares step N+1 while step N's canary work may still be queued on the
    # side stream, and the step's close orders the engine's compute stream after that work, not the stream the
    # hooks run on. A multi-token step's captured work reads its staged values from one static buffer, which
    # the next such step refills from the hook's stream: that refill must wait for the side stream.
    from kvcanary.runtime.launch import ForwardLauncher

    e, rec = recorded(monkeypatch)
    if drop:
        orig = ForwardLauncher.follow
        monkeypatch.setattr(ForwardLauncher, "follow",
                            lambda self, other: None if other is rec.side() else orig(self, other))
    e.run()
    assert not e.canary.violations
    reads = [a for a in rec.log if a.op == "step_reads" and "staged_static" in a.reads]
    assert len(reads) > 1 and {a.stream for a in reads} == {"canary"}  # (the path under test ran, on the side)
    races = [(a.op, b.op, res) for a, b, res in rec.races()]
    assert set(races) == ({("step_reads", "stage_static", "staged_static")} if drop else set()), races


@pytest.mark.parametrize("wait", [True, False], ids=["ordered", "planted-dropped-wait"])
def test_a_storage_sets_next_rewrite_waits_for_the_canary_work_that_read_it(monkeypatch, wait):
    # The engine rewrites a storage set's inputs for step N+2 (its host-to-device copy) while step N+1 runs; the
    # canary's late work of step N, which reads that set, may still be queued on the side stream. The rewrite
    # must wait for the set's done event (Carry.done_event; transformers: the H2D stream waits for it).
    from kvcanary.sim.carry_source import CarrySource

    orig_set = CarrySource.set_step

    def set_step(self, works):  # the rewrite on an "h2d" stream, after the set's done event; the forward after it
        pair = 1 - self.current
        if wait:
            rec.wait(rec.streams["h2d"], self.done[pair])
        with rec.use(rec.streams["h2d"]):
            rec.note("h2d", writes=(("inputs", self.pairs[pair].input_ids.data_ptr()),))
        orig_set(self, works)
        rec.wait(rec.streams["compute"], rec.record(rec.streams["h2d"]))

    monkeypatch.setattr(CarrySource, "set_step", set_step)
    e, rec = recorded(monkeypatch, "h2d")
    e.run()
    assert not e.canary.violations
    races = {(a.op, b.op, res[0]) for a, b, res in rec.races()}
    # (both of the step's reads of the set: its staging copy of the inputs and the graph's own)
    assert races == (set() if wait else {("step_reads", "h2d", "inputs"), ("stage", "h2d", "inputs")}), races


@pytest.mark.parametrize("early", [False, True], ids=["ordered", "planted-ready-before-the-forward"])
def test_a_late_steps_work_starts_after_the_forward_that_carries_its_ids_over(monkeypatch, early):
    # The forward itself writes the carried ids into the storage set (on the compute stream); the step's canary
    # work reads them, so its side stream must start after the forward: ``ready`` is recorded once the forward
    # is enqueued (Carry.forward_enqueued), not when the step is prepared (planted race (a)).
    from kvcanary.sim.carry_source import CarrySource

    orig_inputs = CarrySource.forward_inputs

    def forward_inputs(self, n):  # the carry-over, noted on the compute stream
        with rec.use(rec.streams["compute"]):
            rec.note("carry_over", writes=(("inputs", self.inputs.input_ids.data_ptr()),))
        return orig_inputs(self, n)

    monkeypatch.setattr(CarrySource, "forward_inputs", forward_inputs)
    e, rec = recorded(monkeypatch)
    if early:
        orig_late = carry_mod.Carry.late_step

        def late_step(self):
            late = orig_late(self)
            self.s.ready = rec.record(rec.streams["compute"])  # (before the forward is enqueued)
            return late

        monkeypatch.setattr(carry_mod.Carry, "late_step", late_step)
        monkeypatch.setattr(carry_mod.Carry, "forward_enqueued", lambda self: None)
    e.run()
    assert not e.canary.violations  # (the CPU runs each call at once: only the recorded order can be wrong)
    races = {(a.op, b.op, res[0]) for a, b, res in rec.races()}
    assert races == ({("carry_over", "step_reads", "inputs"), ("carry_over", "stage", "inputs")} if early
                     else set()), races


def test_an_async_run_with_offload_moves_has_no_unordered_access(monkeypatch):
    # prefix pages evicted to the host and loaded back (the canary's save_records / restore_records) between
    # async steps whose canary work lags on the side stream: every access the recording sees is ordered
    e, rec = recorded(monkeypatch, cfg=dict(offload=True, num_slots=96, num_requests=8, max_output=24, max_steps=120))
    e.run()
    ops = {a.op for a in rec.log}
    assert {"save_records", "restore_records", "step_reads", "tail"} <= ops  # (the moves ran, beside late steps)
    assert rec.races() == [] and not e.canary.violations


@pytest.mark.parametrize("on_side,joined", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["ordered", "side-stream-alone", "close-join-alone", "planted-neither"])
def test_a_record_move_between_async_steps_follows_the_last_steps_canary_work(monkeypatch, on_side, joined):
    # A fork's record copy comes at the engine's update, after the next forward and its late canary work are
    # enqueued (transformers' async batching): it must follow that work, which reads and writes the same records
    # (race (c)). Two things order it, each enough alone: the move runs on the side stream itself, after that
    # work; and each step's close makes the engine's stream wait for the side stream. Planted: neither.
    from kvcanary.runtime.launch import ForwardLauncher

    orig_step = SimEngine.step
    moves = []

    def step(self):  # then a fork's record copy (a running request's slots onto themselves: nothing changes)
        orig_step(self)
        running = [r for r in self.sched.running if len(r.slots) > 1]
        if not running:
            return
        slots = torch.tensor(running[0].slots, dtype=torch.int64)
        launcher = self.canary.launcher
        with self.runner.engine_stream():
            launcher.on_current = not on_side  # (side() then stays on the current stream)
            try:
                self.canary.copy_records(slots, slots)
            finally:
                launcher.on_current = False
        moves.append(len(slots))

    monkeypatch.setattr(SimEngine, "step", step)
    e, rec = recorded(monkeypatch)
    if not joined:
        monkeypatch.setattr(ForwardLauncher, "join", lambda self: None)
    e.run()
    assert moves and not e.canary.violations
    races = {(a.op, b.op) for a, b, _ in rec.races()}
    moved = {pair for pair in races if "copy_records" in pair}
    if on_side and joined:
        assert races == set(), races
    # (without the close's join the next forward's KV writes race TAIL's reads too: not this test's point)
    assert bool(moved) == (not on_side and not joined), moved
    if moved:
        assert {"head", "tail"} <= {a for a, _ in moved}, moved
