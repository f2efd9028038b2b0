"""Captured HEAD / TAIL launch sequences, checked on CPU with the recording stand-in for CUDA graphs.

``FakeGraphs`` captures by recording the launches of a key's second sighting and replays them
as recorded: bit-exact results show every captured argument is a static buffer (a per-forward
tensor would be read stale on replay, as the planted case shows).
"""

import os

import pytest
import torch

from kvcanary.format import FailReason
from kvcanary.runtime import observer
from kvcanary.runtime.graphs import EagerGraphs, FakeGraphs
from kvcanary.runtime.streams import InlineStreams, RecordingStreams
from tests.toy_engine import ToyEngine


def decode_run(streams, graphs, bug_step=None, snapshot_graphs=None, **kw):
    engine = ToyEngine(check_v=True, real_kv="all", token_history="append", oracle=True, record_stride=48, **kw)
    engine.canary.launcher.streams, engine.canary.launcher.graphs = streams, graphs
    if snapshot_graphs is not None:
        engine.canary.monitor.observer.graphs = snapshot_graphs
    engine.add(1, [5, 6, 7, 8])
    engine.add(2, [9, 10, 11])
    engine.forward([(1, 4), (2, 3)])
    for step in range(7):
        flip = (lambda e: e.k.__setitem__((e.slot(2, 1), 0, 3), -7.0)) if step == bug_step else None
        engine.forward([(1, 1), (2, 1)], corrupt=flip)
    c = engine.canary
    viol = sorted((v.step, v.launch_tag, v.slot, v.fail_reason, v.position) for v in c.flush())
    bufs = [b.clone() for g in c.groups for b in g.bufs.values()]
    return bufs, viol, c.counters.clone(), c.step_tensor.clone()


@pytest.mark.parametrize("bug_step", [None, 5], ids=["clean", "kv-flip-on-replay"])
@pytest.mark.parametrize("swa", [False, True], ids=["full", "swa"])
def test_replayed_launches_match_eager_bit_for_bit(bug_step, swa):
    kw = dict(swa_window=3, swa_slots=40) if swa else {}
    eager = decode_run(InlineStreams(), EagerGraphs(), bug_step, **kw)
    graphs, snap = FakeGraphs(), FakeGraphs()
    replayed = decode_run(RecordingStreams(), graphs, bug_step, snap, **kw)
    # one decode shape: first sighting eager, second captured, the rest replayed (HEAD and TAIL each)
    assert graphs.captures == 2 and graphs.replays == 2 * 6
    # the step snapshot (one observer slot on CPU): 8 steps, captured on the second
    assert snap.captures == 1 and snap.replays == 7
    assert all(torch.equal(a, b) for a, b in zip(eager[0], replayed[0]))
    assert eager[1] == replayed[1] and torch.equal(eager[2], replayed[2]) and torch.equal(eager[3], replayed[3])
    assert bool(eager[1]) == (bug_step is not None)


@pytest.mark.parametrize("bug_step", [None, 5], ids=["clean", "kv-flip-on-replay"])
@pytest.mark.parametrize("swa", [False, True], ids=["full", "swa"])
@pytest.mark.parametrize("combine", [2, 100], ids=["combined-after-2", "apart"])
def test_tail_and_snapshot_replay_apart_then_as_one_sequence(bug_step, swa, combine, monkeypatch):
    # one graphs object for launches and snapshots (as the transformers adapter hands over): a step's TAIL
    # and its snapshot run as two sequences (TAIL captured once per shape, the snapshot once per slot) until
    # the TAIL shape closed COMBINE_SIGHTINGS steps; then both run under one key (one replay per step)
    monkeypatch.setattr(observer, "COMBINE_SIGHTINGS", combine)
    kw = dict(swa_window=3, swa_slots=40) if swa else {}
    eager = decode_run(InlineStreams(), EagerGraphs(), bug_step, **kw)
    graphs = FakeGraphs()
    keys = []
    run = graphs.run
    graphs.run = lambda key, body, seen_as=None: (keys.append(key), run(key, body, seen_as))
    replayed = decode_run(RecordingStreams(), graphs, bug_step, graphs, **kw)
    combined = [k for k in keys if k[0] == "tail" and k[-2:] == ("snapshot", 0)]
    tails = [k for k in keys if k[0] == "tail" and k[-2] != "snapshot"]
    if combine == 2:  # the 8 steps: the first 3 closed apart (one decode shape from the second), then combined
        assert len(combined) == 5 and keys[-1] in combined and len(tails) == 3
        assert graphs.captures == 4  # HEAD; TAIL, the snapshot, TAIL + snapshot
    else:
        assert not combined and len(tails) == 8 and keys[-1] == ("snapshot", 0)
        # HEAD and TAIL: the decode shape captured on its second sighting (step 3); the snapshot on step 2
        assert graphs.captures == 3 and graphs.replays == 2 * 6 + 7
    assert all(torch.equal(a, b) for a, b in zip(eager[0], replayed[0]))
    assert eager[1] == replayed[1] and torch.equal(eager[2], replayed[2]) and torch.equal(eager[3], replayed[3])
    assert bool(eager[1]) == (bug_step is not None)


def test_a_captured_per_forward_tensor_is_caught():
    """Planted: launches read the engine's batch tensors instead of the staged copies. A CUDA graph would
    replay them from the captured step's addresses, freed since (or reused by later batches): the stand-in
    holds them as a CUDA graph does, by address, and the first replay after one was freed raises."""
    engine_streams = RecordingStreams()
    graphs = FakeGraphs()
    engine = ToyEngine(check_v=True, real_kv="all", token_history="append", oracle=True, record_stride=48)
    launcher = engine.canary.launcher
    launcher.streams, launcher.graphs = engine_streams, graphs
    launcher._stage = launcher._direct  # the bug: no staging, per-forward tensors captured
    engine.add(1, [5, 6, 7, 8])
    engine.add(2, [9, 10, 11])
    engine.forward([(1, 4), (2, 3)])
    with pytest.raises(RuntimeError, match="freed since the capture"):
        for _ in range(7):
            engine.forward([(1, 1), (2, 1)])
    assert graphs.captures > 0


def test_shapes_beyond_the_cache_are_dropped_oldest_first():
    graphs = FakeGraphs(max_graphs=2)
    ran = []
    for key in ["a", "a", "b", "b", "c", "c", "a"]:
        graphs.run(key, lambda call, k=key: call(ran.append, k))
    # "a" was seen before: its next sighting is captured again, and "b" (least recent) goes
    assert list(graphs.cache) == ["c", "a"] and graphs.captures == 4
    assert ran == ["a", "a", "b", "b", "c", "c", "a"]


def test_a_capture_pauses_the_cyclic_collector():
    # a collection inside a capture may destroy an unreachable CUDA graph, which invalidates the capture
    import gc

    from kvcanary.runtime.graphs import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError):
        with gc_paused():
            raise ValueError
    assert gc.isenabled()


# (the toy engine runs on the CPU: Triton there only under the interpreter)
@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else []))
@pytest.mark.parametrize("nan_steps", [(), (2, 5)], ids=["clean", "nan-on-capture-and-replay"])
def test_the_nonfinite_check_replays_with_tail_and_finds_what_eager_finds(nan_steps, backend):
    # the non-finite KV check's device pass (tensor ops, or Triton's kernels) joins TAIL's captured sequence (one
    # replay with the snapshot, no launch per source per step); host_ops off: every step takes the device path,
    # as on CUDA
    def run(streams, graphs):
        engine = ToyEngine(check_v=True, real_kv="all", token_history="append", oracle=True, record_stride=48,
                           backend=backend)
        c = engine.canary
        c.use_graphs(graphs, host_ops=False)
        c.launcher.streams = streams
        keys = []
        if isinstance(graphs, FakeGraphs):
            run_ = graphs.run
            graphs.run = lambda key, body, seen_as=None: (keys.append(key), run_(key, body, seen_as))
        engine.add(1, [5, 6, 7, 8])
        engine.add(2, [9, 10, 11])
        engine.forward([(1, 4), (2, 3)])
        for step in range(7):
            # a NaN in request 2's KV written this step (position 3 + step)
            nan = (lambda e, p=3 + step: e.v.__setitem__((e.slot(2, p), 0, 1), float("nan"))) \
                if step in nan_steps else None
            engine.forward([(1, 1), (2, 1)], corrupt=nan)
        viol = sorted((v.step, v.launch_tag, v.slot, v.fail_reason, v.position) for v in c.flush())
        return viol, keys

    eager, _ = run(InlineStreams(), EagerGraphs())
    graphs = FakeGraphs()
    replayed, keys = run(RecordingStreams(), graphs)
    assert replayed == eager
    nonfinite = [v for v in eager if v[3] & int(FailReason.NONFINITE_KV)]
    assert len(nonfinite) == len(nan_steps) and [v[4] for v in nonfinite] == [3 + s for s in nan_steps]
    tails = [k for k in keys if k[0] == "tail"]
    # every TAIL key names the check (it runs inside TAIL's sequence), none runs under a key of its own
    assert tails and all("nonfinite" in k for k in tails) and not any(k[0] == "nonfinite" for k in keys)
    assert graphs.replays >= 2 * 6
