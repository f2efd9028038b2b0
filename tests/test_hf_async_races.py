"""The orderings async batching needs, planted away on the GPU (CUDA only; transformers >= 5.24).

Each ordering of ``docs/notes/async_batching.md`` section 2.3 has a CPU test on a recording of the streams
(tests/test_async_steps.py, tests/test_hf_async_recorded.py), which lists the unordered pair of accesses. Here
the same plants run on the device, with one stream made to lag (a sleep kernel before its work, as a busy GPU
makes it): the race then happens, and the canary reads the wrong ids. Each plant is paired with the same lag
and the ordering kept: that run is clean. So each ordering is shown to be needed and sufficient on the device
itself, not only in the model of it.

- (a) a late step's side-stream work starts after the forward that carries its ids over (``Carry.forward_
  enqueued`` records ``ready`` after the forward): planted, ``ready`` recorded when the step is prepared,
  before the forward; the compute stream lags before each forward;
- (a') a fused step's graph waits for the forward in its first nodes (``FusedSteps._capture_waiting``):
  planted, the wait nodes left out; the compute stream lags;
- (b) a storage set's next host-to-device rewrite waits for the canary work that read it (``Carry.done_event``):
  planted, no event; the canary's side stream and its staging copy of the step's inputs lag. (With the side
  stream alone lagging the plant stayed clean on the H200: each step's TAIL there is joined by the compute
  stream before the engine records the step's end, which the engine's host waits for before it rewrites the
  set; the staging copy is not on that path.)
"""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from conftest import DEVICE  # noqa: E402
from gpu_lag import lag_before  # noqa: E402
from kvcanary.demo import run_workload  # noqa: E402

import transformers  # noqa: E402
from kvcanary.integrations.transformers.layout import ASYNC_SINCE, parse_version  # noqa: E402
from test_hf_async import ASYNC, DEV, lagging_side, llama  # noqa: E402,F401  (the model and the side lag)

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda" or parse_version(transformers.__version__) < ASYNC_SINCE,
                                reason="async batching needs CUDA and transformers >= 5.24")

RUN = dict(cb=ASYNC, device=DEV, num_return_sequences=1, max_new_tokens=24)


@pytest.fixture(scope="module")
def base(llama):
    """The canary-less async run's tokens (greedy)."""
    return run_workload(llama, canary=False, **RUN).tokens


@pytest.fixture
def steady(monkeypatch):
    """Decode shapes reach the per-turn and fused paths within the short run."""
    from kvcanary.runtime.step import graphs

    monkeypatch.setattr(graphs, "STEADY_SIGHTINGS", 2)


@pytest.fixture
def lagging_compute(monkeypatch):
    """The engine's compute stream lags before each forward (its carry-over of the last step's tokens is the
    forward's first work)."""
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    lag_before(monkeypatch, ModelRunner, "compute_batch", lambda runner: runner.inputs_and_outputs.compute_stream)


@pytest.fixture
def lagging_stage(monkeypatch):
    """The stream the canary's staging copy of a step's inputs runs on lags before it (that copy reads the engine's
    input storage set, which the set's next host-to-device rewrite overwrites)."""
    from kvcanary.runtime.launch import ForwardLauncher

    lag_before(monkeypatch, ForwardLauncher, "_stage")


def _kinds(run) -> str:
    import collections

    return str(collections.Counter(v.reasons for v in run.violations).most_common(4))


def _clean(run, base) -> None:
    assert run.violations == [], _kinds(run)
    assert run.tokens == base and run.stats["forwards"] > 20


@pytest.mark.parametrize("planted", [False, True], ids=["ordered", "planted-ready-before-the-forward"])
def test_a_late_steps_work_starts_after_the_forward_that_carries_its_ids_over(llama, base, monkeypatch,
                                                                               lagging_compute, planted):
    from kvcanary.runtime.step.carry import Carry
    from kvcanary.runtime.streams import record_event

    if planted:
        orig = Carry.late_step

        def late_step(self):
            late = orig(self)
            if self.record_ready:  # recorded now, when the step is prepared: before the forward
                self.record_ready = False
                ev = torch.cuda.Event()
                record_event(ev, self.s.source.inputs.compute_stream)
                self.s.ready = ev
            return late

        monkeypatch.setattr(Carry, "late_step", late_step)
    run = run_workload(llama, fused_steps=False, **RUN)  # (every step captured, none fused: ``ready`` serves all)
    if planted:
        assert run.violations, "HEAD before the carry-over: nothing reported"
        assert run.tokens == base  # (the engine's own work is untouched: the canary read too early)
    else:
        _clean(run, base)


@pytest.mark.parametrize("planted", [False, True], ids=["ordered", "planted-no-wait-nodes"])
def test_a_fused_steps_graph_waits_for_the_forward(llama, base, monkeypatch, steady, lagging_compute, planted):
    from kvcanary.runtime.graphs import capture
    from kvcanary.runtime.step.fused import FusedSteps
    from kvcanary.runtime.streams import record_event

    captured = []
    orig = FusedSteps._capture_waiting

    def capture_waiting(self, graph, body, side):
        captured.append(graph)
        if not planted:
            return orig(self, graph, body, side)
        waits = (torch.cuda.Event(external=True), torch.cuda.Event(external=True))
        for ev in waits:  # (the host records them before each replay; no node waits for them)
            record_event(ev, side)
        capture(graph, body, pool=self.pool)
        return waits

    monkeypatch.setattr(FusedSteps, "_capture_waiting", capture_waiting)
    run = run_workload(llama, **RUN)
    assert captured, "no fused step ran"
    if planted:
        assert run.violations, "a fused step's graph ahead of the forward: nothing reported"
    else:
        _clean(run, base)


@pytest.mark.parametrize("planted", [False, True], ids=["ordered", "planted-no-done-event"])
def test_a_storage_sets_rewrite_waits_for_the_canary_work_that_read_it(llama, base, monkeypatch, steady,
                                                                         lagging_side, lagging_stage, planted):
    from kvcanary.runtime.step.carry import Carry

    if planted:
        monkeypatch.setattr(Carry, "done_event", lambda self: None)
    run = run_workload(llama, **RUN)
    if planted:
        assert run.violations, "the next step's inputs written under the canary's reads: nothing reported"
    else:
        _clean(run, base)
