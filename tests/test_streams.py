"""Stream ordering of the canary's side-stream work, checked on CPU with the recording fake.

The fake runs launches at once and records which stream issued each, what it read and wrote, and
the event edges; ``races()`` lists conflicting accesses that nothing orders. The engine here notes
its own accesses: preparing inputs, the forward's KV writes, the host sync on the sampled tokens.
"""

from contextlib import contextmanager, nullcontext

import pytest
import torch

from kvcanary.runtime.streams import InlineStreams, RecordingStreams
from tests.toy_engine import ToyEngine


class DroppingStreams(RecordingStreams):
    """A planted bug: waits of the named stream are silently dropped."""

    def __init__(self, drop: str, names: tuple = ("engine", "canary")):
        super().__init__(names)
        self.drop = drop

    def wait(self, stream, event) -> None:
        if stream.name != self.drop:
            super().wait(stream, event)


def instrument(engine: ToyEngine, streams, host_sync: bool = True) -> None:
    c = engine.canary
    c.launcher.streams = streams
    orig_before, orig_after = c.before_forward, c.after_forward

    def before(batch):
        streams.note("engine_prepare", writes=("engine_inputs",))
        orig_before(batch)

    def after(batch):
        streams.note("engine_forward", reads=("engine_inputs",), writes=("kv",))
        if host_sync:
            streams.synchronize(streams.current())  # the engine reads its sampled tokens
        orig_after(batch)
        streams.note("engine_fork_copy", reads=("kv",), writes=("kv",))

    c.before_forward, c.after_forward = before, after


def run_workload(engine: ToyEngine, bug: bool = False, outside=nullcontext) -> None:
    """Prefill, four decode steps, then a sweep and a record copy outside any step (in ``outside()``)."""
    engine.add(1, [5, 6, 7, 8])
    engine.add(2, [9, 10, 11])
    engine.forward([(1, 4), (2, 3)])
    for step in range(4):
        corrupt = (lambda e: e.k.__setitem__((e.slot(1, 1), 0, 0), 99.0)) if bug and step == 2 else None
        engine.forward([(1, 1), (2, 1)], corrupt=corrupt)
    with outside():
        engine.canary.sweep(torch.tensor([engine.slot(1, 0)]), torch.tensor([0]), torch.tensor([-1]))
        engine.canary.copy_records(torch.tensor([engine.slot(1, 0)]), torch.tensor([60]))


def state(engine: ToyEngine):
    c = engine.canary
    # the last sweep and record copy ran on the side stream: the clones below read after them (without
    # this the clones raced the copy, a flaky mismatch in GPU suite runs)
    c.records_ready()
    bufs = {(g.name, k): b.clone() for g in c.groups for k, b in g.bufs.items()}
    rows = sorted((v.launch_tag, v.slot, v.fail_reason, v.position) for v in c.flush())
    return bufs, rows, c.counters.clone()


def test_detector_sees_an_unordered_pair_and_accepts_an_event_edge():
    s = RecordingStreams()
    s.note("w", writes=("x",))
    with s.use(s.side()):
        s.note("r", reads=("x",))
    assert [(a.op, b.op, res) for a, b, res in s.races()] == [("w", "r", "x")]

    s = RecordingStreams()
    s.note("w", writes=("x",))
    ev = s.record(s.current())
    s.wait(s.side(), ev)
    with s.use(s.side()):
        s.note("r", reads=("x",), atomic=("ring",))
    s.note("a", atomic=("ring",))  # atomic appends commute
    assert s.races() == []
    s.note("snapshot", reads=("ring",))  # a plain read of what the side stream appends to is not ordered
    assert [res for _, _, res in s.races()] == ["ring"]


def test_races_pair_only_the_unseen_tails_and_list_what_every_pair_lists():
    # races() pairs each access with the accesses of other streams its clock has not seen (a stream's tail);
    # random schedules of notes, events, waits and host syncs over four streams list what trying every pair lists
    import random

    raced = 0
    for seed in range(40):
        rnd = random.Random(seed)
        s = RecordingStreams(("engine", "canary", "compute", "h2d"))
        names, events = list(s.streams), []
        for _ in range(rnd.randrange(20, 120)):
            stream = s.streams[rnd.choice(names)]
            roll = rnd.random()
            if roll < 0.6:
                res = [rnd.choice("xyz") for _ in range(rnd.randrange(3))]
                with s.use(stream):
                    s.note("op", reads=res[:1], writes=res[1:2], atomic=res[2:])
            elif roll < 0.75:
                events.append(s.record(stream))
            elif roll < 0.9 and events:
                s.wait(stream, rnd.choice(events))
            else:
                s.synchronize(stream)
        got = [(a.index, b.index, res) for a, b, res in s.races()]
        assert got == [(a.index, b.index, res) for a, b, res in s._all_pairs()], seed
        raced += bool(got)
    assert raced > 10  # (the schedules did race)


def test_host_sync_orders_later_launches():
    s = RecordingStreams()
    with s.use(s.side()):
        s.note("w", writes=("x",))
    s.synchronize(s.side())
    s.note("r", reads=("x",))
    assert s.races() == []


@pytest.mark.parametrize("host_sync", [True, False], ids=["sync-engine", "async-engine"])
@pytest.mark.parametrize("swa", [False, True], ids=["full", "swa"])
def test_side_stream_schedule_has_no_race(swa, host_sync):
    kw = dict(swa_window=3, swa_slots=40) if swa else {}
    engine = ToyEngine(check_v=True, real_kv="all", token_history="append", oracle=True, sweep_interval=2, **kw)
    rec = RecordingStreams()
    instrument(engine, rec, host_sync=host_sync)
    run_workload(engine)
    assert rec.races() == []
    streams = {(a.op, a.stream) for a in rec.log}
    # the schedule really is split: verify/write on the side stream, plan and staging on the engine's
    assert {("head", "canary"), ("tail", "canary"), ("plan", "engine"), ("stage", "engine"),
            ("snapshot", "canary"), ("sweep", "canary")} <= streams


@pytest.mark.parametrize("drop, resource", [("canary", "kv"), ("engine", "kv")],
                         ids=["tail-without-forward-event", "next-forward-without-join"])
def test_planted_missing_wait_is_detected(drop, resource):
    engine = ToyEngine(real_kv="all")
    rec = DroppingStreams(drop)
    instrument(engine, rec, host_sync=False)  # an engine that never waits for its forward on the host
    run_workload(engine)
    races = rec.races()
    assert races, "a dropped wait must leave an unordered pair"
    assert resource in {res for _, _, res in races}
    if drop == "canary":
        # TAIL hashes KV the forward is still writing
        assert any(a.op == "engine_forward" and b.op == "tail" for a, b, _ in races)
    else:
        # the next forward (or a fork copy) writes KV that the previous TAIL still reads
        assert any(a.op.startswith("tail") and b.op.startswith("engine_") for a, b, _ in races)


def instrument_here(engine: ToyEngine, streams) -> None:
    """The transformers adapter's steady decode steps (``StepGraphs._inline`` / ``after``): the canary's
    work runs on the stream the engine prepares its inputs on, the forward on the engine's own compute
    stream, and the launcher's ``follow`` / ``run_here`` order the two with events."""
    c = engine.canary
    c.launcher.streams = streams
    here, compute = streams.current(), streams.streams["compute"]
    orig_before = c.before_forward

    def before(batch):
        streams.note("engine_prepare", writes=("engine_inputs",))
        streams.wait(compute, streams.record(here))  # the engine's own ordering of its forward after its inputs
        c.launcher.follow(compute)
        c.launcher.on_current = True  # as after a replay of the step's graph: every launch stays here
        try:
            orig_before(batch)
        finally:
            c.launcher.on_current = False

    def after(batch):
        with streams.use(compute):
            streams.note("engine_forward", reads=("engine_inputs",), writes=("kv",))
        c.launcher.run_here(c.after_replayed, batch, compute)
        with streams.use(compute):
            streams.note("engine_fork_copy", reads=("kv",), writes=("kv",))

    c.before_forward, c.after_forward = before, after


STREAMS3 = ("engine", "canary", "compute")


def on_compute(streams):
    """Canary calls outside a step go to the engine's compute stream after its inputs, as the adapter's
    ``Session._engine_stream`` does (a fork's record copy follows the fork's KV copy there)."""
    @contextmanager
    def ctx():
        here, compute = streams.current(), streams.streams["compute"]
        streams.wait(compute, streams.record(here))
        with streams.use(compute):
            yield
    return ctx


def test_canary_on_the_engines_input_stream_has_no_race():
    engine = ToyEngine(check_v=True, real_kv="all", token_history="append", oracle=True, sweep_interval=2)
    rec = RecordingStreams(STREAMS3)
    instrument_here(engine, rec)
    run_workload(engine, outside=on_compute(rec))
    assert rec.races() == []
    streams = {(a.op, a.stream) for a in rec.log}
    # the steps' work stays on the input stream; only work outside a step (sweep, record copy) goes aside
    assert {("head", "engine"), ("tail", "engine"), ("snapshot", "engine"), ("engine_forward", "compute")} <= streams
    assert not {("head", "canary"), ("tail", "canary"), ("snapshot", "canary")} & streams


@pytest.mark.parametrize("drop", ["engine", "compute"], ids=["tail-without-forward-event", "next-forward-without-tail"])
def test_planted_missing_wait_on_the_engines_input_stream_is_detected(drop):
    engine = ToyEngine(real_kv="all")
    rec = DroppingStreams(drop, STREAMS3)
    instrument_here(engine, rec)
    run_workload(engine, outside=on_compute(rec))
    races = {(a.op, b.op, res) for a, b, res in rec.races()}
    if drop == "engine":  # TAIL hashes KV the forward is still writing
        assert ("engine_forward", "tail", "kv") in races
    else:  # the next forward (or a fork copy) writes KV that TAIL still reads
        assert any(a.startswith("tail") and b.startswith("engine_") and res == "kv" for a, b, res in races)


@pytest.mark.parametrize("bug", [False, True], ids=["clean", "kv-flip"])
@pytest.mark.parametrize("swa", [False, True], ids=["full", "swa"])
def test_staged_side_stream_path_matches_inline_bit_for_bit(bug, swa):
    kw = dict(swa_window=3, swa_slots=40) if swa else {}
    results = []
    for streams in (InlineStreams(), RecordingStreams()):
        engine = ToyEngine(check_v=True, real_kv="all", token_history="append", oracle=True, record_stride=48, **kw)
        instrument(engine, streams)
        run_workload(engine, bug=bug)
        results.append(state(engine))
    (b0, r0, c0), (b1, r1, c1) = results
    assert r0 == r1 and torch.equal(c0, c1)
    assert all(torch.equal(b0[k], b1[k]) for k in b0)
    assert bool(r0) == bug


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bug", [False, True], ids=["clean", "kv-flip"])
def test_cuda_side_stream_matches_inline_bit_for_bit(backend, bug):
    results = []
    for overlap in (False, True):
        engine = ToyEngine(device="cuda", backend=backend, check_v=True, real_kv="all", token_history="append",
                           oracle=True, swa_window=3, swa_slots=40, overlap=overlap, launch_graphs=True)
        launcher = engine.canary.launcher
        assert (launcher.streams.side() is not None) == overlap
        run_workload(engine, bug=bug)
        # the steady decode shape is captured once per phase and replayed after (HEAD, TAIL: 3 each);
        # inline, the phases launch one by one and only the step's snapshot replays (captured on a
        # stream of its own: the legacy default stream cannot capture)
        assert launcher.graphs.replays >= 6 if overlap else launcher.graphs.replays > 0
        results.append(state(engine))
    (b0, r0, c0), (b1, r1, c1) = results
    assert r0 == r1 and torch.equal(c0, c1)
    assert all(torch.equal(b0[k], b1[k]) for k in b0)
    assert bool(r0) == bug


@pytest.mark.parametrize("head_overlap, ready, race", [(False, False, False), (True, True, False),
                                                        (True, False, True)],
                         ids=["default-joins-after-head", "overlap-with-records-ready", "overlap-without"])
def test_engine_reading_records_after_before_forward(head_overlap, ready, race):
    """An adapter that verifies what HEAD wrote on its own stream (right after before_forward) is
    ordered after the HEAD write: by default, or through records_ready() when HEAD overlaps."""
    engine = ToyEngine(real_kv="all")
    c = engine.canary
    c.head_overlap = head_overlap
    rec = RecordingStreams()
    instrument(engine, rec)
    inner = c.before_forward

    def before(batch):
        inner(batch)
        if ready:
            c.records_ready()
        rec.note("engine_reads_records", reads=("head_bufs",), atomic=("ring", "counters"))

    c.before_forward = before
    run_workload(engine)
    hits = [(a.op, b.op) for a, b, res in rec.races() if res == "head_bufs"]
    assert bool(hits) == race
    if race:
        assert ("head", "engine_reads_records") in hits


def instrument_late(engine: ToyEngine, streams, inline: bool, wait_ready: bool = True, fused: bool = False,
                    join: bool = True) -> None:
    """The transformers adapter's late hooks (``Session._late_step``): the engine enqueues its forward on
    its compute stream first; then the step's canary work runs. HEAD follows the compute stream's
    position before the forward (``ready``) and the inputs' stream: on the inputs' stream itself for a
    steady decode step (``StepGraphs._inline``), on the side stream otherwise (``StepGraphs._general``).
    TAIL follows the forward (``run_here`` / the side stream's hand-over). ``wait_ready=False`` plants the
    missing wait. ``fused``: the whole step on the side stream after the inputs and the forward
    (``FusedSteps.step``; ``wait_ready=False`` drops the wait for the forward), joined by the engine's
    streams before they next touch KV (``FusedSteps.join``; ``join=False`` drops it)."""
    c = engine.canary
    c.launcher.streams = streams
    here, compute, side = streams.current(), streams.streams["compute"], streams.streams["canary"]
    orig_before, orig_after = c.before_forward, c.after_forward
    pending = {}

    def before(batch):
        streams.note("engine_prepare", writes=("engine_inputs",))
        streams.wait(compute, streams.record(here))  # the engine's own ordering of its forward after its inputs
        pending["ready"] = streams.record(compute)  # (Session._late_step: before the forward is enqueued)

    def after(batch):
        with streams.use(compute):
            streams.note("engine_forward", reads=("engine_inputs",), writes=("kv",))
        ready = pending.pop("ready")
        if fused:
            streams.wait(side, streams.record(here))
            if wait_ready:
                streams.wait(side, streams.record(compute))
            c.launcher.on_current = True
            try:
                with streams.use(side):
                    orig_before(batch)
                    c.after_replayed(batch)
            finally:
                c.launcher.on_current = False
            pending["fused"] = streams.record(side)
        elif inline:
            if wait_ready:
                streams.wait(here, ready)
            c.launcher.on_current = True
            try:
                orig_before(batch)
            finally:
                c.launcher.on_current = False
            c.launcher.run_here(c.after_replayed, batch, compute)
        else:
            if wait_ready:
                streams.wait(side, ready)
            orig_before(batch)  # (its side section waits for the inputs' stream)
            streams.wait(compute, streams.record(here))
            with streams.use(compute):
                orig_after(batch)
        streams.synchronize(compute)  # the engine reads its sampled tokens (retrieve_device_outputs)
        if fused and join:  # (FusedSteps.join: before the engine next touches KV or its inputs)
            event = pending.pop("fused")
            streams.wait(compute, event)
            streams.wait(here, event)
        with streams.use(compute):
            streams.note("engine_fork_copy", reads=("kv",), writes=("kv",))

    c.before_forward, c.after_forward = before, after


def late_workload(engine: ToyEngine) -> None:
    """Prefill, decode steps, and between two of them a record copy (a fork) and a save of records (an
    offload: the compute stream joins the save, so only the compute stream is ordered after it)."""
    engine.add(1, [5, 6, 7, 8])
    engine.add(2, [9, 10, 11])
    engine.forward([(1, 4), (2, 3)])
    for step in range(4):
        if step == 2:
            with on_compute(engine.canary.launcher.streams)():
                engine.canary.copy_records(torch.tensor([engine.slot(1, 0)]), torch.tensor([60]))
                engine.canary.save_records(torch.tensor([engine.slot(2, 0)]))
        engine.forward([(1, 1), (2, 1)])


@pytest.mark.parametrize("inline, fused", [(True, False), (False, False), (True, True)],
                         ids=["inline-step", "side-stream-step", "fused-step"])
def test_late_hooks_have_no_race(inline, fused):
    engine = ToyEngine(check_v=True, real_kv="all", token_history="append", oracle=True)
    rec = RecordingStreams(STREAMS3)
    instrument_late(engine, rec, inline, fused=fused)
    late_workload(engine)
    assert rec.races() == []
    ops = [(a.op, a.stream) for a in rec.log]
    # every step's HEAD is issued after its forward (the late order), on the stream the path uses
    heads = [i for i, (op, _) in enumerate(ops) if op == "head"]
    forwards = [i for i, (op, _) in enumerate(ops) if op == "engine_forward"]
    assert len(heads) == len(forwards) == 5 and all(f < h for f, h in zip(forwards, heads))
    assert {s for op, s in ops if op == "head"} == {"engine" if inline and not fused else "canary"}
    assert engine.canary.flush() == []


def test_late_inline_step_without_the_ready_wait_races_the_saved_records():
    # (a side-stream step follows the save on the side stream itself: there the wait is a second guard)
    engine = ToyEngine(real_kv="all")
    rec = RecordingStreams(STREAMS3)
    instrument_late(engine, rec, inline=True, wait_ready=False)
    late_workload(engine)
    races = {(a.op, b.op, res) for a, b, res in rec.races()}
    # the next step's HEAD writes records the save (joined by the compute stream only) still reads
    assert any({a, b} == {"save_records", "head"} for a, b, _ in races)


@pytest.mark.parametrize("wait_ready, join, other", [(False, True, "engine_forward"), (True, False, "engine_fork_copy")],
                         ids=["no-wait-for-the-forward", "no-join"])
def test_fused_step_without_its_waits_races_the_kv_writes(wait_ready, join, other):
    engine = ToyEngine(real_kv="all")
    rec = RecordingStreams(STREAMS3)
    instrument_late(engine, rec, inline=True, wait_ready=wait_ready, fused=True, join=join)
    late_workload(engine)
    races = {(a.op, b.op, res) for a, b, res in rec.races()}
    # TAIL hashes the KV the forward writes, and the fork copy after the step overwrites KV
    assert (other, "tail", "kv") in races or ("tail", other, "kv") in races
