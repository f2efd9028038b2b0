"""The replay thread (runtime/replayer.py): jobs issued on the helper, in order, each replay after the
records it follows and before its own; ``wait`` returns only once they were issued; errors reach the
engine's thread; close stops it. A snapshot slot is read only after the helper issued what it copies
(``HostObserver.before_read``)."""

import threading

import pytest
import torch

from kvcanary.ops.types import ViolationRing
from kvcanary.runtime.graphs import eager
from kvcanary.runtime.observer import HostObserver
from kvcanary.runtime.replayer import GraphReplayer, ReplayError


def recording_replayer():
    calls = []

    def record(event, stream):
        calls.append(("record", event, stream, threading.current_thread().name))

    def setup():
        calls.append(("setup", threading.current_thread().name))

    return GraphReplayer(record, setup, name="helper"), calls


def replay_of(calls, name, gate=None):
    def replay():
        if gate is not None:
            assert gate.wait(5), "the test never opened the gate"
        calls.append(("replay", name, threading.current_thread().name))
    return replay


def test_jobs_run_on_the_helper_in_order_each_replay_between_its_records():
    r, calls = recording_replayer()
    try:
        for i in range(3):
            r.submit(replay_of(calls, f"graph-{i}"), f"event-{i}", "side", ((f"waited-{i}", "compute"),))
        r.wait()
        assert calls == [("setup", "helper")] + [c for i in range(3) for c in (
            ("record", f"waited-{i}", "compute", "helper"), ("replay", f"graph-{i}", "helper"),
            ("record", f"event-{i}", "side", "helper"))]
        assert r.jobs == 3 and not r.busy
    finally:
        r.close()


def test_wait_returns_only_once_the_job_was_issued():
    r, calls = recording_replayer()
    gate = threading.Event()
    try:
        r.submit(replay_of(calls, "slow", gate), "its-event", "side")
        assert r.busy  # the helper is inside the replay
        threading.Timer(0.2, gate.set).start()
        r.wait()
        assert calls[-2:] == [("replay", "slow", "helper"), ("record", "its-event", "side", "helper")]
        # a second submit while one is in flight waits for it: at most one job queued
        gate2 = threading.Event()
        r.submit(replay_of(calls, "first", gate2), "e1", "side")
        threading.Timer(0.2, gate2.set).start()
        r.submit(replay_of(calls, "second"), "e2", "side")
        assert ("record", "e1", "side", "helper") in calls  # issued before the second was queued
        r.wait()
        assert calls[-2:] == [("replay", "second", "helper"), ("record", "e2", "side", "helper")]
    finally:
        gate.set()
        r.close()


def test_a_failed_replay_is_raised_on_the_engines_thread_and_skips_its_event():
    r, calls = recording_replayer()
    try:
        def broken():
            raise RuntimeError("launch failed")

        r.submit(broken, "never-recorded", "side")
        with pytest.raises(ReplayError, match="launch failed") as info:
            r.wait()
        assert isinstance(info.value.__cause__, RuntimeError)
        assert ("record", "never-recorded", "side", "helper") not in calls
        # reported once; the thread goes on with the next job
        r.submit(replay_of(calls, "next"), "next-event", "side")
        r.wait()
        assert calls[-1] == ("record", "next-event", "side", "helper")
    finally:
        r.close()


def test_a_failed_setup_is_raised_at_the_first_submit_and_leaves_nothing_locked():
    def setup():
        raise ValueError("no such device")

    r, ran = GraphReplayer(lambda event, stream: None, setup), []
    try:
        with pytest.raises(ReplayError, match="no such device"):
            r.submit(lambda: ran.append(1), "e", "side")  # (raises here if the helper already failed ...)
            r.wait()  # (... else here: the helper skipped the job)
        assert ran == [] and not r.busy
        r.wait()  # returns at once: the error was reported
    finally:
        r.close()


def test_close_issues_what_was_queued_stops_the_thread_and_refuses_more():
    r, calls = recording_replayer()
    gate = threading.Event()
    r.submit(replay_of(calls, "last", gate), "last-event", "side")
    helper = r._thread
    threading.Timer(0.1, gate.set).start()
    r.close()
    assert calls[-1] == ("record", "last-event", "side", "helper")
    assert not helper.is_alive()
    r.close()  # idempotent
    with pytest.raises(ReplayError, match="closed"):
        r.submit(lambda: None, "e", "side")


def test_the_observer_asks_before_reading_a_slot():
    obs = HostObserver(ViolationRing.allocate(4), {"counter": torch.zeros(2, dtype=torch.int64)})
    asked = []
    obs.before_read = lambda: asked.append(len(obs.order))
    slot, done = obs.take_slot()
    assert done == [] and asked == []  # nothing pending in the slot: nothing to read
    obs._copy(slot, eager)
    out = obs.taken(slot, 5, {"forwards": 1})  # (the CPU reads at once: collect, then the slot)
    assert [o.step for o in out] == [5] and asked and asked[0] == 1
    asked.clear()
    assert obs.collect(block=True) == [] and asked == []  # nothing in flight: no wait for the helper
