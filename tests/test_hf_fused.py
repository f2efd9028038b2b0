"""A fused steady step's CUDA calls (runtime/step/fused.py), on the CPU with recorded stand-ins.

The step's end and its staged values' turn are known through the snapshot slot's event (``SlotFence``):
the step records no event of its own, the engine's streams join the slot's event, and the turn's next
refill asks CUDA nothing once the slot was taken again. Where the close fails before the slot's event is
recorded, the step falls back to events of its own on the side stream.
"""

from types import SimpleNamespace

import pytest
import torch

from kvcanary.runtime.step import fused as hf_fused, staging as hf_staging
from kvcanary.runtime.step.fused import FusedSteps
from kvcanary.runtime.engine import HostStep
from kvcanary.runtime.step.plans import Plans
from kvcanary.runtime.step.staging import Staging
from kvcanary.runtime import observer
from kvcanary.runtime.observer import SlotFence
from kvcanary.runtime.streams import record_event


class Streams:
    """The stream cache's current stream, as ``FusedSteps`` switches it."""

    def __init__(self):
        self.now = "default"

    def current(self):
        return self.now

    def set(self, stream):
        self.now = stream


def fused_step(monkeypatch, fail_close: bool = False, waits=None):
    calls, streams = [], Streams()
    for module in (hf_fused, hf_staging, observer):
        monkeypatch.setattr(module, "record_event", lambda ev, s: calls.append(("record", ev, s)), raising=False)
    monkeypatch.setattr(hf_fused, "event_wait", lambda ev, s: calls.append(("wait", ev, s)))
    monkeypatch.setattr(hf_staging, "event_synchronize", lambda ev: calls.append(("sync", ev)))
    monkeypatch.setattr(observer, "event_synchronize", lambda ev: calls.append(("sync", ev)))

    stage = Staging(torch.device("cpu"))
    stage.send([[0]], copy=False)  # (its buffers, on the CPU)
    # the CUDA half of Staging: host buffers (plain memory here), a turn event per turn
    stage.host = [torch.empty(stage.size, dtype=torch.int64) for _ in range(stage.depth)]
    stage.cuda, stage.stream, stage.events = True, streams, [f"turn-{i}" for i in range(stage.depth)]
    stage.views, stage.turn = {}, 0
    slot = SimpleNamespace(records=4, known=0, pending=None, event="slot-event", key=("snapshot", 1))

    def take_slot():
        return slot, []

    def close_step(batch, s, done, launch_s):
        calls.append(("close", streams.current()))
        if fail_close:
            raise RuntimeError("close failed")
        s.records += 1  # what HostObserver.taken does on CUDA: record the slot's event on the current stream
        s.pending = (7, {})
        calls.append(("record", s.event, streams.current()))

    obs = SimpleNamespace(eager_read=False, slots=[None, slot, None], next=1, take_slot=take_slot)
    canary = SimpleNamespace(monitor=SimpleNamespace(observer=obs), check_replayed=lambda b: None,
                             close_step=close_step,
                             launcher=SimpleNamespace(streams=SimpleNamespace(side=lambda: "side"),
                                                      restore=lambda state: None))
    session = SimpleNamespace(canary=canary, stage=stage,
                              source=SimpleNamespace(inputs=SimpleNamespace(compute_stream="compute")))
    fs = FusedSteps.__new__(FusedSteps)
    fs.s, fs.g, fs.cache, fs.pending = session, SimpleNamespace(quiet=1), streams, None
    fs.events, fs.replays = ("inputs", "forward", "done"), 0

    def replay():
        calls.append(("replay", streams.current()))
    key = ("shape",)
    fs.plans = Plans(4)
    fs.plans.add(key + (1,), SimpleNamespace(replay=replay, state=None, waits=waits))
    e = SimpleNamespace(batch="batch")
    stage.send([[1, 2, 3]], copy=False)  # the host half: its copy is issued by the replay
    assert stage.pending is not None and stage.pending[2] == 0
    calls.clear()
    if fail_close:
        with pytest.raises(RuntimeError, match="close failed"):
            fs.step(e, key, None)
    else:
        assert fs.step(e, key, None) == "batch"
    return fs, stage, slot, calls, streams


def test_a_fused_step_lets_the_slots_event_stand_for_its_end_and_its_staged_values(monkeypatch):
    fs, stage, slot, calls, streams = fused_step(monkeypatch)
    assert calls == [("record", "inputs", "default"), ("wait", "inputs", "side"),
                     ("record", "forward", "compute"), ("wait", "forward", "side"),
                     ("replay", "side"), ("close", "side"), ("record", "slot-event", "side")]
    assert streams.current() == "default" and fs.pending == "slot-event" and stage.pending is None
    fence = stage.fences[0]
    assert isinstance(fence, SlotFence) and fence.slot is slot and fence.records == 5
    calls.clear()
    fs.join()  # the engine's streams wait for the step's end: the slot's event
    assert calls == [("wait", "slot-event", "compute"), ("wait", "slot-event", "default")] and fs.pending is None
    # the position joined (the engine's synchronize after its next forward completes it: StepRunner.joined)
    assert fs.joined.slot is slot and fs.joined.records == fence.records == 5
    # the turn comes round again: while the slot's observation is unread, its event is synchronized ...
    calls.clear()
    stage.turn = 0
    stage.send([[4, 5, 6]], copy=False)
    assert calls == [("sync", "slot-event")]
    # ... unless the position is known complete (the compute stream that waited for it was synchronized) ...
    calls.clear()
    fence.complete()
    stage.turn = 0
    stage.send([[4, 5, 6]], copy=False)
    assert calls == []
    slot.known = 0
    # ... and once the slot was taken again (which reads it first), CUDA is not asked
    calls.clear()
    slot.records += 1
    stage.turn = 0
    stage.send([[4, 5, 6]], copy=False)
    assert calls == []


def test_a_fused_step_whose_graph_waits_for_its_own_events_records_them_only(monkeypatch):
    # the graph's first nodes wait for its two events (captured external waits): the host records them on
    # the inputs' stream and on the compute stream, and makes no wait of its own
    fs, stage, slot, calls, streams = fused_step(monkeypatch, waits=("graph-inputs", "graph-forward"))
    assert calls == [("record", "graph-inputs", "default"), ("record", "graph-forward", "compute"),
                     ("replay", "side"), ("close", "side"), ("record", "slot-event", "side")]
    assert streams.current() == "default" and fs.pending == "slot-event"


def test_a_fused_step_whose_close_fails_records_events_of_its_own(monkeypatch):
    fs, stage, slot, calls, streams = fused_step(monkeypatch, fail_close=True)
    # the turn's event and the step's end recorded on the side stream after the replay; the streams restored
    assert calls[-2:] == [("record", "turn-0", "side"), ("record", "done", "side")]
    assert streams.current() == "default" and fs.pending == "done" and stage.fences[0] is None
    calls.clear()
    stage.turn = 0
    stage.send([[4, 5, 6]], copy=False)
    assert calls == [("sync", "turn-0")]


@pytest.mark.parametrize("cap", [4096, 3000])
def test_a_steady_run_repeats_only_steps_of_its_shape(cap):
    # A repeat skips the graph keys: it must match only a step the keys would give the same graph, i.e. the
    # same batch size and staged values, storages, read-index flavour, a full read index, and a read-table
    # width that rounds to the run's; and it should take every width that does, below the cap.
    from kvcanary.runtime.step.graphs import WIDTH_STEP, StepGraphs
    from kvcanary.runtime.step.plans import StepKey, table_width

    ptrs = (1, 2, 3, 4)
    io = SimpleNamespace(max_kv_read=5, true_read_sizes=[40], use_block_table=False)

    def key(h, storages=ptrs):  # (the step's key as the runner computes it)
        return StepKey.of(h, storages, 0, 0, WIDTH_STEP, cap)

    for width in (1, 300, 512, 513, 1000, 1024, 1025, 2048, 2049, 2999, 3000, 3001, 5000):
        g = StepGraphs.__new__(StepGraphs)
        g.fused = SimpleNamespace(run=None)
        g.s = SimpleNamespace(canary=SimpleNamespace(max_context=cap), group=0)
        h = HostStep(io, [], 2, 2, [0, 0], [1, 1], [1, 2], None, 2, width, 40)
        rounded = table_width(width, cap, WIDTH_STEP)
        run = g.fused.run = g._run_for(h, key(h))
        for w in [w for w in list(range(1, 5200, 7)) + [width - 1, width + 1, 512, 513, 2049, cap, cap + 1] if w > 0]:
            same = table_width(w, cap, WIDTH_STEP) == rounded
            # below the cap exactly the widths that round alike; past it (no rounding) the width alone
            hw = h._replace(width=w)
            assert run.matches(hw, key(hw)) == (same if rounded <= cap else w == width), (width, w)
        assert run.matches(h, key(h))
        assert not run.matches(h, key(h, tuple(list(ptrs))))  # other storages (a new tuple: asked of torch again)
        assert not run.matches(h._replace(bs=3, T=3), key(h._replace(bs=3, T=3)))
        assert not run.matches(h._replace(total=41), key(h._replace(total=41)))  # a read index shorter than the reads
        fresh = h._replace(io=SimpleNamespace(max_kv_read=0, true_read_sizes=[40], use_block_table=False))
        assert not run.matches(fresh, key(fresh))
    # a step whose read index is short is never remembered (its keys tell the general path's graph)
    assert g._run_for(h._replace(total=41), key(h._replace(total=41))) is None


@pytest.mark.gpu
@pytest.mark.parametrize("waiting", [True, False], ids=["in-graph-waits", "no-waits"])
def test_a_graph_that_waits_for_its_events_runs_after_both_streams(waiting):
    # The fused graph's first nodes wait for its two events, recorded by the host on the inputs' stream and
    # the compute stream just before the replay: the replay must read what both streams wrote before those
    # records, however long they take. Without the waits the same replay runs at once and reads stale values.
    fs = FusedSteps.__new__(FusedSteps)
    fs.pool, fs.in_graph_waits = None, True
    here, compute, side = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()
    x, z, y = (torch.zeros(1, device="cuda") for _ in range(3))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        waits = fs._capture_waiting(graph, lambda: y.copy_(x + z), side) if waiting else None
        if not waiting:
            graph.capture_begin()
            y.copy_(x + z)
            graph.capture_end()
    assert (waits is not None) == waiting and fs.in_graph_waits
    for step in range(1, 4):
        torch.cuda.synchronize()
        with torch.cuda.stream(compute):
            torch.cuda._sleep(5_000_000)  # a few milliseconds of the forward
            x.fill_(step)
        torch.cuda._sleep(5_000_000)  # the inputs' stream
        z.fill_(10 * step)
        if waiting:
            record_event(waits[0], here)
            record_event(waits[1], compute)
        with torch.cuda.stream(side):
            graph.replay()
        torch.cuda.synchronize()
        assert (y.item() == 11 * step) == waiting
