"""A fused steady step's CUDA calls (integrations/hf_fused.py), on the CPU with recorded stand-ins.

The step's end and its staged values' turn are known through the snapshot slot's event (``SlotFence``):
the step records no event of its own, the engine's streams join the slot's event, and the turn's next
refill asks CUDA nothing once the slot was taken again. Where the close fails before the slot's event is
recorded, the step falls back to events of its own on the side stream.
"""

from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

from kvcanary.integrations import hf_fused, hf_staging
from kvcanary.integrations.hf_fused import FusedSteps
from kvcanary.integrations.hf_staging import Staging
from kvcanary.runtime import observer
from kvcanary.runtime.observer import SlotFence


class Streams:
    """The stream cache's current stream, as ``FusedSteps`` switches it."""

    def __init__(self):
        self.now = "default"

    def current(self):
        return self.now

    def set(self, stream):
        self.now = stream


def fused_step(monkeypatch, fail_close: bool = False):
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

    def replayed_step(batch, s, done, launch_s):
        calls.append(("close", streams.current()))
        if fail_close:
            raise RuntimeError("close failed")
        s.records += 1  # what HostObserver.taken does on CUDA: record the slot's event on the current stream
        s.pending = (7, {})
        calls.append(("record", s.event, streams.current()))

    obs = SimpleNamespace(eager_read=False, slots=[None, slot, None], next=1, take_slot=take_slot)
    canary = SimpleNamespace(monitor=SimpleNamespace(observer=obs), check_replayed=lambda b: None,
                             replayed_step=replayed_step,
                             launcher=SimpleNamespace(streams=SimpleNamespace(side=lambda: "side"),
                                                      restore=lambda state: None))
    session = SimpleNamespace(canary=canary, builder=SimpleNamespace(stage=stage),
                              bp=SimpleNamespace(inputs_and_outputs=SimpleNamespace(compute_stream="compute")))
    fs = FusedSteps.__new__(FusedSteps)
    fs.s, fs.g, fs.cache, fs.pending = session, SimpleNamespace(quiet=1), streams, None
    fs.events, fs.replays = ("inputs", "forward", "done"), 0
    key = ("shape",)
    fs.entries = OrderedDict({key + (1,): SimpleNamespace(replay=lambda: calls.append(("replay", streams.current())),
                                                          state=None)})
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
    # the position joined (the engine's synchronize after its next forward completes it: Session.step)
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


def test_a_fused_step_whose_close_fails_records_events_of_its_own(monkeypatch):
    fs, stage, slot, calls, streams = fused_step(monkeypatch, fail_close=True)
    # the turn's event and the step's end recorded on the side stream after the replay; the streams restored
    assert calls[-2:] == [("record", "turn-0", "side"), ("record", "done", "side")]
    assert streams.current() == "default" and fs.pending == "done" and stage.fences[0] is None
    calls.clear()
    stage.turn = 0
    stage.send([[4, 5, 6]], copy=False)
    assert calls == [("sync", "turn-0")]
