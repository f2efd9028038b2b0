"""The attention-metadata check on the recorded step routes (runtime/step, docs/write_check.md): a captured
multi-token step, a captured per-turn steady decode step and a fused steady decode step check the engine's mask
and key lengths inside their recorded work, and report what the eager route reports.

On the CPU the stand-in graph ``DispatchGraph`` takes the captured and fused routes (its replays run the recorded
tensor ops into the same tensors, host values baked in); the torch backend keeps the runs to seconds. A fault is
planted into the engine's metadata after transformers built it (``prepare_batch_tensors``), on the steps of one
kind: a query shown the batch's last key (another request's), or the first request's key length one too long.
The last test (marked ``gpu``) takes CUDA's real graph route with the planted bug ``mask-reset-short``.
"""

import logging

import pytest
import torch

pytest.importorskip("transformers")

from kvcanary.demo import build_tiny_model, run_workload  # noqa: E402
from kvcanary.integrations.transformers import session as hf_session  # noqa: E402
from kvcanary.runtime.graphs import DispatchGraph  # noqa: E402
from kvcanary.runtime.step import graphs as step_graphs  # noqa: E402
from kvcanary.runtime.step.fused import FusedSteps  # noqa: E402
from kvcanary.runtime.step.graphs import StepGraphs  # noqa: E402
from kvcanary.runtime.step.tables import StepTables  # noqa: E402

logging.getLogger("kvcanary").setLevel(logging.ERROR)

FULL = "full_attention"


@pytest.fixture(scope="module")
def llama():
    return build_tiny_model("cpu")


pytestmark = pytest.mark.usefixtures("device_bounds")  # (tests/conftest.py: the torch backend's device path)


def _io_class():
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    return ContinuousBatchingIOs


def plant(monkeypatch, fault: str, when):
    """After transformers builds each step's inputs, ``fault`` ("mask" or "length") on the steps ``when(io, nreq)``
    names (``nreq``: the step's requests). Returns the planted steps as (index counting prepared steps: the
    canary's step, the first request's engine id) (``clear()`` starts a new run's list and count)."""
    io_cls = _io_class()
    orig = io_cls.prepare_batch_tensors
    count = [0]

    class Planted(list):
        def clear(self):
            super().clear()
            count[0] = 0

    planted = Planted()

    def prepare(self, requests_in_batch, *args, **kwargs):
        orig(self, requests_in_batch, *args, **kwargs)
        count[0] += 1
        nreq = len(requests_in_batch)
        if self.use_block_table or self.attention_mask is None or nreq < 2 or not when(self, nreq):
            return
        cu = self.cumulative_seqlens_k[FULL]
        if fault == "mask":
            total = int(cu[nreq])  # the batch's keys: the last one is the last request's
            self.attention_mask[FULL][0, 0, 0, total - 1] = 0  # (the first request's first query sees it)
        else:
            cu[1:nreq + 1] += 1  # the first request's key length one too long (the others' starts follow)
        planted.append((count[0], requests_in_batch[0].state.request_id))

    monkeypatch.setattr(io_cls, "prepare_batch_tensors", prepare)
    return planted


def routes(monkeypatch):
    """The canary steps each recorded route ran (``{"multi": [...], "per_turn": [...], "fused": [...],
    "recorded": [...]}``): a multi-token step replayed from its graph, a per-turn graph replayed inline, a fused
    step replayed (captured at its first sighting), any step of the unfused route whose work ran from a graph
    (captured, then replayed: a CUDA capture runs nothing, its first replay everything)."""
    seen = {"multi": [], "per_turn": [], "fused": [], "recorded": []}
    run, inline, launch = StepGraphs._run, StepGraphs._inline, FusedSteps._launch

    def counting_run(self, e, sightings, h):
        if e.graph is not None or sightings > step_graphs.EAGER_SIGHTINGS:
            seen["recorded"].append(self.s.canary.step)
        if e.graph is not None and h.T > h.bs:
            seen["multi"].append(self.s.canary.step)
        return run(self, e, sightings, h)

    def counting_inline(self, e):
        seen["per_turn"].append(self.s.canary.step)
        seen["recorded"].append(self.s.canary.step)
        return inline(self, e)

    def counting_launch(self, e, f, slot, obs):
        seen["fused"].append(self.s.canary.step)
        return launch(self, e, f, slot, obs)

    monkeypatch.setattr(StepGraphs, "_run", counting_run)
    monkeypatch.setattr(StepGraphs, "_inline", counting_inline)
    monkeypatch.setattr(FusedSteps, "_launch", counting_launch)
    return seen


def graphed(monkeypatch, model, **kw):
    """run_workload on the recorded routes (the stand-in graph)."""
    orig = hf_session.Session._step_runner
    monkeypatch.setattr(hf_session.Session, "_step_runner", lambda self, graph_type=None: orig(self, DispatchGraph))
    try:
        return run_workload(model, backend="torch", **kw)
    finally:
        monkeypatch.setattr(hf_session.Session, "_step_runner", orig)


def rows(run) -> list:
    """The attention-metadata reports: (step, reading request, position, reason)."""
    return [(v.step, v.reader_request, v.reader_position, v.reasons) for v in run.violations
            if set(v.reasons) & {"attention_mask", "key_length"}]


# decode steps of a steady batch (three requests prefilled in one step: each staging turn's graph is replayed), and
# prompts longer than a chunk (recurring multi-token shapes)
DECODE = dict(prompts=[[(7 * k + 3 * i + 5) % 200 for i in range(5)] for k in range(3)], max_new_tokens=16,
              num_return_sequences=1)
PREFILL = dict(max_new_tokens=3, num_return_sequences=1)


def _prefill_prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(5, 200, (48,), generator=g).tolist() for _ in range(4)]


@pytest.mark.parametrize("fault", [None, "mask", "length"])
@pytest.mark.parametrize("route", ["multi", "per_turn", "fused"])
def test_recorded_steps_check_the_attention_metadata_as_eager_steps_do(llama, monkeypatch, route, fault):
    monkeypatch.setattr(StepTables, "new_reads_shortcut", False)  # (a captured step always runs that check)
    if route == "multi":
        kw = dict(prompts=_prefill_prompts(), **PREFILL)
        when = lambda io, nreq: io.num_q_tokens > nreq  # noqa: E731  (multi-token steps)
    else:  # every decode shape takes the per-turn (or fused) path at once
        monkeypatch.setattr(step_graphs, "STEADY_SIGHTINGS", 0)
        kw = dict(fused_steps=route == "fused", **DECODE)
        when = lambda io, nreq: io.num_q_tokens == nreq  # noqa: E731  (decode steps)
    planted = plant(monkeypatch, fault, when) if fault else []
    eager = run_workload(llama, backend="torch", step_graphs=False, **kw)
    eager_planted = list(planted)
    planted.clear()
    seen = routes(monkeypatch)
    rec = graphed(monkeypatch, llama, **kw)
    assert planted == eager_planted  # (the same steps of the same workload)
    assert seen[route], f"no step took the {route} route"
    assert rec.tokens == eager.tokens
    assert rec.stats["attention_checks"] == eager.stats["attention_checks"] > 0
    got, want = rows(rec), rows(eager)
    assert got == want
    assert [v.block() for v in rec.violations] == [v.block() for v in eager.violations]
    if fault is None:
        assert rec.violations == [] and eager.violations == []
        return
    reason = "attention_mask" if fault == "mask" else "key_length"
    assert got and {r[3] for r in got} == {(reason,)}
    # the faults the recorded route itself reported (the step it ran is the step the report names)
    on_route = {r[0] for r in got} & {s + 1 for s in seen[route]}
    assert on_route, (got, seen[route])
    # each report names a reading request of the faulted step's batch: a mask fault the first request (its first
    # query sees the key), a key-length fault the first request (its length) and those after it (their starts)
    first = dict(planted)
    assert all(r[0] in first for r in got)
    if fault == "mask":
        assert all(rec.names[r[1]] == first[r[0]] for r in got)
    else:
        assert {rec.names[r[1]] for r in got} > set(first.values())


def test_the_recorded_check_stays_off_with_the_attention_check_off(llama, monkeypatch):
    monkeypatch.setattr(step_graphs, "STEADY_SIGHTINGS", 0)
    plant(monkeypatch, "mask", lambda io, nreq: io.num_q_tokens == nreq)
    seen = routes(monkeypatch)
    rec = graphed(monkeypatch, llama, attention_check=False, **DECODE)
    assert seen["fused"] and rec.violations == [] and rec.stats["attention_checks"] == 0


def test_a_wider_padded_mask_is_keyed_by_its_width_and_the_columns_past_the_keys_are_checked(llama, monkeypatch):
    # With its own CUDA graphs the engine pads the keys it hands attention (pad_to_interval): the recorded check
    # compares that width exactly (the step key holds it), so a key shown past the batch's keys is reported too;
    # past that width nothing is compared (stale cells attention never reads)
    from kvcanary.runtime.step.runner import StepRunner

    io_cls = _io_class()
    orig = io_cls.prepare_batch_tensors
    state = {"steps": 0}

    def prepare(self, requests_in_batch, *args, **kwargs):
        orig(self, requests_in_batch, *args, **kwargs)
        state["steps"] += 1
        self.max_kv_read += 8  # (8 key columns past the step's keys, as the engine's own interval padding adds)
        mask = self.attention_mask[FULL]
        width = self.max_kv_read + self.num_q_tokens
        mask[0, 0, :, width:] = 0  # stale cells past the handed width: never read, never reported
        if state["steps"] > 6 and self.num_q_tokens == len(requests_in_batch) >= 2:
            mask[0, 0, 0, width - 1] = 0  # a padding column shown to the first query: reported

    monkeypatch.setattr(io_cls, "prepare_batch_tensors", prepare)
    monkeypatch.setattr(step_graphs, "STEADY_SIGHTINGS", 0)
    keys = []
    key_of = StepRunner.key_of

    def spy(self, h, recorded=False):
        k = key_of(self, h, recorded)
        if recorded:
            keys.append(k.mask)
        return k

    monkeypatch.setattr(StepRunner, "key_of", spy)
    seen = routes(monkeypatch)
    eager = run_workload(llama, backend="torch", step_graphs=False, **DECODE)
    state["steps"] = 0
    rec = graphed(monkeypatch, llama, **DECODE)
    assert seen["fused"] and keys and all(k > 0 for k in keys)  # (exact widths: the engine's padded ones)
    got = rows(rec)
    assert got == rows(eager) and got and {r[3] for r in got} == {("attention_mask",)}


def _planted_mask_bug(monkeypatch, model, graph_type, **options):
    """The planted bug ``mask-reset-short`` (kvcanary/sim/hf_bugs.py) eager and on the recorded routes (every
    decode shape fused at once; ``graph_type``: the graphs, None for CUDA's own): both runs' attention reports and
    the recorded route's steps."""
    monkeypatch.setattr(StepTables, "new_reads_shortcut", False)
    monkeypatch.setattr(step_graphs, "STEADY_SIGHTINGS", 0)
    kw = dict(bug="mask-reset-short", **options)
    eager = run_workload(model, step_graphs=False, **kw)
    seen = routes(monkeypatch)
    orig = hf_session.Session._step_runner
    monkeypatch.setattr(hf_session.Session, "_step_runner", lambda self, _=None: orig(self, graph_type))
    try:
        rec = run_workload(model, **kw)
    finally:
        monkeypatch.setattr(hf_session.Session, "_step_runner", orig)
    return eager, rec, seen


def _assert_reported_on_a_recorded_step(eager, rec, seen):
    got = rows(rec)
    assert got and got == rows(eager)
    assert {r[3] for r in got} == {("attention_mask",)}
    recorded = {s + 1 for s in seen["fused"] + seen["recorded"]}  # (a report names the step that ran)
    assert {r[0] for r in got} & recorded, (got, seen)


def test_the_planted_mask_bug_is_reported_on_a_recorded_step(llama, monkeypatch):
    # the SDPA mask reset over too few columns (a stale cell shows a query another request's key): the recorded
    # route reports it as the eager route does, at a step it replayed
    eager, rec, seen = _planted_mask_bug(monkeypatch, llama, DispatchGraph, backend="torch")
    _assert_reported_on_a_recorded_step(eager, rec, seen)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the real CUDA-graph route needs CUDA")
def test_gpu_the_planted_mask_bug_is_reported_on_the_cuda_graph_route(monkeypatch):
    # CUDA's default routes (step graphs, late hooks, fused steady decode steps: real CUDA graphs; the default
    # backend) with the planted mask bug: the report the eager route gives, at a step a CUDA graph ran
    model = build_tiny_model("cuda")
    eager, rec, seen = _planted_mask_bug(monkeypatch, model, None)
    assert seen["fused"] or seen["recorded"]
    _assert_reported_on_a_recorded_step(eager, rec, seen)
