"""Whole-step capture of the transformers adapter's before hook (integrations/hf_graph.py).

On CUDA the real ``torch.cuda.CUDAGraph`` runs; on the CPU ``DispatchGraph`` stands in for it: it
records every op and Triton launch of the capture and replays them into the same tensors, with host
values baked in as a CUDA graph bakes them (the CPU's graphed runs take the torch backend's device path, one
case per test Triton's launches: ``GRAPHED_BACKEND``). A captured step that read anything but static buffers
would then verify stale data, and its results would differ from the eager run's.
"""

import logging

import pytest
import torch

pytest.importorskip("transformers")
triton = pytest.importorskip("triton")

from kvcanary.demo import build_tiny_model, run_workload  # noqa: E402
from kvcanary.integrations.transformers import session as hf_session  # noqa: E402
from kvcanary.runtime.step.graphs import StepGraphs  # noqa: E402
from kvcanary.runtime.graphs import DispatchGraph  # noqa: E402

from conftest import DEVICE, set_device_bounds  # noqa: E402

DEV = str(DEVICE)
logging.getLogger("kvcanary").setLevel(logging.ERROR)
# a Triton case on the CPU: the interpreter
TRITON = pytest.mark.skipif(DEV == "cpu" and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                            reason="Triton on the CPU needs TRITON_INTERPRET=1")
# The graphed runs' backend: Triton on CUDA; on the CPU the torch backend as on an accelerator (no host read:
# ``set_device_bounds``), whose recorded ops replay in seconds where the interpreter's launches take minutes. One
# case of each test below takes Triton on the CPU too.
GRAPHED_BACKEND = "triton" if DEV != "cpu" else "torch"


@pytest.fixture(scope="module")
def llama():
    return build_tiny_model(DEV)


def graphed_run(model, monkeypatch, backend=GRAPHED_BACKEND, **kw):
    """run_workload with step graphs (the CPU stand-in on the CPU); returns the run and its StepGraphs."""
    if backend == "torch" and DEV == "cpu":
        set_device_bounds(monkeypatch)
    made = []
    orig = hf_session.Session._step_runner

    def step_runner(self, graph_type=None):
        r = orig(self, DispatchGraph if self.device.type == "cpu" else None)
        if r.graphs is not None:
            made.append(r.graphs)
        return r

    monkeypatch.setattr(hf_session.Session, "_step_runner", step_runner)
    try:
        run = run_workload(model, backend=backend, **kw)
    finally:
        monkeypatch.setattr(hf_session.Session, "_step_runner", orig)
    return run, made


# The eager run each graphed run is compared with: Triton on CUDA; on the CPU the torch backend, whose records and
# reports are Triton's bit for bit (tests/test_ops_cases.py), in a fraction of the interpreter's time. (numba counts
# the same: its steady step honours StepTables.new_reads_shortcut as the full path does, tests/test_steady_step.py.)
EAGER_BACKEND = "triton" if DEV != "cpu" else "torch"

# decode steps of a steady batch: shapes repeat, so steps are captured and replayed
STEADY = dict(max_new_tokens=16, num_return_sequences=1)


# Each step path with a planted bug (its steps before the bug are clean steps, and the reports after it must be
# the eager ones, line for line: a false report on the fast path fails it too), and a clean run on the fused path,
# the default's steady decode (a heavy extra, -m slow: the fused case's clean steps and the clean fused runs of
# tests/test_hf_async_recorded.py and tests/test_hf_buckets.py hold it in the default run).
@pytest.mark.parametrize("bug,steady,fused,backend", [
    ("new-token-read-index", 0, True, GRAPHED_BACKEND), ("new-token-read-index", 0, False, GRAPHED_BACKEND),
    ("new-token-read-index", None, True, GRAPHED_BACKEND),
    pytest.param("new-token-read-index", 0, True, "triton", marks=TRITON),
    pytest.param(None, 0, True, GRAPHED_BACKEND, marks=pytest.mark.slow)],
    ids=["fused", "graph-per-turn", "default", "fused-triton", "fused-clean"])
def test_captured_steps_report_what_eager_steps_report(llama, monkeypatch, bug, steady, fused, backend):
    from kvcanary.runtime.step import graphs as hf_graph
    from kvcanary.runtime.step.tables import StepTables
    from kvcanary.runtime.step.fused import FusedSteps

    if steady is not None:  # every decode shape takes the graph-per-turn (or fused) path at once
        monkeypatch.setattr(hf_graph, "STEADY_SIGHTINGS", steady)
    fused_steps = []
    fused_step = FusedSteps.step

    def counting_fused(self, e, key, h, run=None):  # a steady step's before and after work as one replay
        fused_steps.append(key)
        return fused_step(self, e, key, h, run)

    monkeypatch.setattr(FusedSteps, "step", counting_fused)
    repeats = []
    fused_repeat = FusedSteps.repeat

    def counting_repeat(self, h):  # a pair met again in the run's shape: its graph found without keys
        batch = fused_repeat(self, h)
        repeats.append(batch is not None)
        return batch

    monkeypatch.setattr(FusedSteps, "repeat", counting_repeat)
    per_turn = []
    run = StepGraphs._run

    def counting(self, e, sightings, h):
        replay = e.graph is not None
        run(self, e, sightings, h)
        per_turn.append(replay and h.packed.data_ptr() != self.s.stage.static.data_ptr())

    monkeypatch.setattr(StepGraphs, "_run", counting)
    inline = StepGraphs._inline

    def inlined(self, e):  # a per-turn graph replayed on the hook's own stream
        per_turn.append(True)
        return inline(self, e)

    monkeypatch.setattr(StepGraphs, "_inline", inlined)

    # the eager CPU path may skip the new tokens' read check where it holds by construction; a captured
    # step always runs it: compare like with like
    monkeypatch.setattr(StepTables, "new_reads_shortcut", False)
    eager = run_workload(llama, backend=EAGER_BACKEND, bug=bug, step_graphs=False, **STEADY)
    graphed, made = graphed_run(llama, monkeypatch, backend, bug=bug, fused_steps=fused, **STEADY)
    assert made and isinstance(made[0], StepGraphs)
    parts = made + [g.fused for g in made if g.fused is not None]
    assert sum(g.replays for g in parts) > 0 and sum(g.captures for g in parts) > 0
    # the default keeps this short run's changing shapes per shape
    assert any(per_turn) == (steady == 0 and not fused)
    assert bool(fused_steps) == (steady == 0 and fused)
    if fused_steps:  # each (turn, slot) pair captured once, then replayed (found by key, or as a repeat)
        f = made[0].fused
        assert f.replays == len(fused_steps) + sum(repeats)
        assert f.captures == len(set(fused_steps)) < f.replays
        assert sum(repeats) > 0
    assert graphed.tokens == eager.tokens
    assert graphed.log_lines == eager.log_lines
    assert [v.block() for v in graphed.violations] == [v.block() for v in eager.violations]
    assert graphed.stats["entries_checked"] == eager.stats["entries_checked"]
    assert (len(graphed.violations) > 0) == (bug is not None)


@pytest.mark.parametrize("bug,backend", [(None, GRAPHED_BACKEND), ("wrong-block", GRAPHED_BACKEND),
                                         pytest.param("wrong-block", "triton", marks=TRITON)],
                         ids=["None", "wrong-block", "wrong-block-triton"])
def test_captured_prefill_chunks_report_what_eager_chunks_report(llama, monkeypatch, bug, backend):
    # prompts longer than the chunk: multi-token steps of one shape recur, are captured (one graph
    # reading a static copy of the staged values) and replayed
    from kvcanary.runtime.step.tables import StepTables

    monkeypatch.setattr(StepTables, "new_reads_shortcut", False)
    g = torch.Generator().manual_seed(5)
    kw = dict(prompts=[torch.randint(5, 200, (48,), generator=g).tolist() for _ in range(4)], max_new_tokens=4,
              num_return_sequences=1, bug=bug)
    eager = run_workload(llama, backend=EAGER_BACKEND, step_graphs=False, **kw)
    replayed = []
    run = StepGraphs._run

    def counting(self, e, sightings, h):
        was = e.graph is not None
        run(self, e, sightings, h)
        replayed.append(was and h.T > h.bs)

    monkeypatch.setattr(StepGraphs, "_run", counting)
    graphed, made = graphed_run(llama, monkeypatch, backend, **kw)
    assert sum(replayed) >= 3  # multi-token steps replayed from their graph
    # the monitor's batches of those steps are assembled only when a report reads them
    reports = [r for g in made for r in g.reports.values()]
    assert reports and any(r._batch is not None for r in reports) == (bug is not None)
    # the readable reports too: their readers come from the batch the monitor kept for the step
    assert [v.block() for v in graphed.violations] == [v.block() for v in eager.violations]
    assert graphed.tokens == eager.tokens
    assert graphed.log_lines == eager.log_lines
    assert graphed.stats["entries_checked"] == eager.stats["entries_checked"]
    assert (len(graphed.violations) > 0) == (bug is not None)


def test_tensors_made_for_the_side_streams_replays_are_handed_to_it(llama, monkeypatch):
    # The step graphs' read tables and the monitor's copies of them are made on the hooks' stream and filled and
    # read by the side stream's replays, which may lag steps behind; so are the staging buffers. Each is handed
    # to the side stream (``ForwardLauncher.hand_over``: CUDA's record_stream) when it is made, so that once
    # dropped (an entry evicted, the buffers outgrown) its memory serves no new tensor under that queued work.
    from kvcanary.runtime.launch import ForwardLauncher

    handed = set()
    orig = ForwardLauncher.hand_over
    monkeypatch.setattr(ForwardLauncher, "hand_over",
                        lambda self, *ts: (handed.update(t.data_ptr() for t in ts), orig(self, *ts))[1])
    made_stages = []
    from kvcanary.runtime.step.runner import StepRunner

    orig_init = StepRunner.__init__

    def init(self, canary, source, *a, **k):
        orig_init(self, canary, source, *a, **k)
        made_stages.append(source.stage)

    monkeypatch.setattr(StepRunner, "__init__", init)
    g = torch.Generator().manual_seed(5)
    kw = dict(prompts=[torch.randint(5, 200, (48,), generator=g).tolist() for _ in range(4)], max_new_tokens=4,
              num_return_sequences=1)
    run, made = graphed_run(llama, monkeypatch, **kw)
    assert run.violations == []
    tables = [e.batch.req_to_token for g in made for e in g.plans.values()]
    reports = [r.req_to_token for g in made for r in g.reports.values()]
    assert tables and reports and made_stages
    buffers = [t for st in made_stages for t in (*st.ring, st.static)]
    assert [all(t.data_ptr() in handed for t in ts) for ts in (tables, reports, buffers)] == [True] * 3


@pytest.mark.skipif(DEV != "cpu", reason="the CPU stand-in")
def test_dispatch_graph_replays_into_the_captured_tensors():
    src, out = torch.arange(4), torch.zeros(4, dtype=torch.int64)
    g = DispatchGraph()
    g.capture_begin()
    torch.add(src, 1, out=out)
    doubled = out * 2  # a temporary the graph owns
    g.capture_end()
    g.replay()  # the capture already ran the work
    assert out.tolist() == [1, 2, 3, 4] and doubled.tolist() == [2, 4, 6, 8]
    src += 10
    g.replay()
    assert out.tolist() == [11, 12, 13, 14] and doubled.tolist() == [22, 24, 26, 28]


@pytest.mark.skipif(DEV != "cpu", reason="the CPU stand-in")
def test_dispatch_graph_refuses_a_host_read_inside_a_capture():
    g = DispatchGraph()
    g.capture_begin()
    try:
        with pytest.raises(RuntimeError, match="host read"):
            int(torch.tensor(3) + 1)
    finally:
        g.capture_end()


def late_drain(monkeypatch) -> None:
    """The observer's late drain as on CUDA (``runtime/observer.py``, its own code), at its latest: ``NUM_SLOTS``
    snapshot slots, each step's close copied into the next one and read only when that slot comes round again
    (``NUM_SLOTS`` steps on: a CUDA event not yet complete when polled), the rest at the run's flush. Each step
    assembles its own batch, as on CUDA (the CPU reuses one per step key: there nothing reads it late)."""
    from kvcanary.runtime import observer as observer_mod
    from kvcanary.runtime.step.tables import StepTables

    cls, orig_init, orig_collect = observer_mod.HostObserver, observer_mod.HostObserver.__init__, \
        observer_mod.HostObserver.collect

    def init(self, ring, watched, **kw):
        orig_init(self, ring, watched, **kw)
        size = self.slots[0].small.numel()
        self.slots = [observer_mod._Slot(ring, size, False, i, self.record_bufs, self.tables)
                      for i in range(observer_mod.NUM_SLOTS)]

    def taken(self, slot, step, host_meta):
        slot.pending = (step, host_meta)
        self.order.append(slot)
        return []

    monkeypatch.setattr(cls, "__init__", init)
    monkeypatch.setattr(cls, "eager_read", property(lambda self: False))
    monkeypatch.setattr(cls, "taken", taken)
    monkeypatch.setattr(cls, "collect", lambda self, block=False: orig_collect(self, True) if block else [])
    monkeypatch.setattr(StepTables, "_cpu_batch", lambda self, h, key: self.assemble(h, key.width))


@pytest.mark.skipif(DEV != "cpu", reason="the CPU stand-in of CUDA's late drain (on CUDA it is the observer's own)")
@pytest.mark.parametrize("bug,backend", [("write-k-only", GRAPHED_BACKEND), ("sliding-v-into-k", GRAPHED_BACKEND),
                                         pytest.param("write-k-only", "triton", marks=TRITON)],
                         ids=["write-k-only", "sliding-v-into-k", "write-k-only-triton"])
def test_a_late_drain_reports_what_the_step_close_reports(llama, monkeypatch, bug, backend):
    # A step's rows decoded steps after its check (CUDA's drain): by then the slot a row names may hold another
    # record, and the sliding group's full->SWA table is another step's. write-k-only: the wrong write's copy (slot
    # 1440, a fork's copy of the written block) is read at steps 2 and 3, then the prefix cache maps its reader back
    # to the original block, frees the copy, and a fork of another request copies its own block over it: decoded
    # from that record, the read named that request as its writer, "a write of position 8 landed in a slot still
    # read as position 4", and lost the flag of a read of a wrong write. sliding-v-into-k: decoded through a later
    # step's table, a read of a sliding slot named no reader. The snapshot keeps each row's record and the table as
    # the step closed them: the reports are the eager close's, line for line. (Triton: the snapshot's rows and
    # records copied by its one-launch pass, ops/triton_snapshot.py.)
    set_device_bounds(monkeypatch)
    model, kw = (llama, {}) if bug == "write-k-only" else (build_tiny_model(DEV, sliding_window=8),
                                                          dict(max_new_tokens=14))
    eager = run_workload(model, bug=bug, backend="torch", **kw)
    late_drain(monkeypatch)
    late, _ = graphed_run(model, monkeypatch, backend, bug=bug, **kw)
    assert [str(v) for v in late.violations] == [str(v) for v in eager.violations]
    reads = [v for v in late.violations if v.reasons == ("verify_real_kv_hash",)]
    assert reads and all(v.written_wrong and v.writer_position is None for v in reads)
    assert all(v.reader_request is not None for v in reads if not v.launch_tag.startswith("SWEEP"))
