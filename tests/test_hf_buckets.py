"""Decode batches padded to their size bucket (``bucket_batches``, integrations/hf_batch.py): a batch that
shrinks or grows keeps replaying its bucket's step graphs, and everything the canary reports is what it
reports without padding and without graphs (on the CPU the graph stand-in ``DispatchGraph`` replays)."""

import pytest
import torch

pytest.importorskip("transformers")
triton = pytest.importorskip("triton")

from kvcanary.integrations.transformers.batch import BatchBuilder
from kvcanary.runtime.step.tables import StepTables, bucket  # noqa: E402
from kvcanary.runtime.step.graphs import StepGraphs  # noqa: E402
from kvcanary.demo import run_workload  # noqa: E402

from conftest import DEVICE  # noqa: E402

import test_hf_graphs as graphs  # noqa: E402

# the tiny model fixture and the graphed run (on the CPU: the torch backend's device path, graphs.GRAPHED_BACKEND)
llama, graphed_run = graphs.llama, graphs.graphed_run


def test_bucket_is_the_next_power_of_two_within_the_cap():
    assert [bucket(n, 64) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 64, 64]
    assert [bucket(n, 12) for n in (5, 9, 12, 13)] == [8, 12, 12, 13]  # (never below the batch: no padding)
    assert bucket(0, 8) == 0


def staggered_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(5, vocab, (4 + 5 * i,), generator=g).tolist() for i in range(6)]


@pytest.fixture
def staggered(monkeypatch):
    """Request i generates 3 x i tokens more than request 0: the decode batch shrinks by one request every
    three steps, as requests finish in serving."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    add = ContinuousBatchingManager.add_request

    def add_request(self, input_ids, request_id=None, max_new_tokens=None, **kw):
        return add(self, input_ids, request_id, 4 + 3 * int(request_id.rsplit("_", 1)[1]), **kw)

    monkeypatch.setattr(ContinuousBatchingManager, "add_request", add_request)


# (a padding lane's write trash misused: its reports are the eager run's line for line, so a false report on a
# padded step fails it too; the clean run a heavy extra, -m slow)
@pytest.mark.parametrize("bug", [pytest.param(None, marks=pytest.mark.slow), "never-written"])
def test_a_changing_batch_padded_to_its_bucket_reports_what_eager_steps_report(llama, monkeypatch, staggered, bug):
    # (the CPU's new-reads shortcut off on every route: compare like with like)
    monkeypatch.setattr(StepTables, "new_reads_shortcut", False)
    pads = []
    host_part = BatchBuilder.host_part

    def recording(self, copy=True, padded=False):
        h = host_part(self, copy, padded)
        if padded and h.T == h.bs:  # (a decode step: one new token per request)
            pads.append((h.bs - h.pad, h.pad))
        return h

    monkeypatch.setattr(BatchBuilder, "host_part", recording)
    kw = dict(prompts=staggered_prompts(llama.config.vocab_size), max_new_tokens=12, num_return_sequences=1, bug=bug,
              cb={"max_batch_tokens": 32})
    eager = run_workload(llama, backend=graphs.EAGER_BACKEND, step_graphs=False, **kw)
    runs = {}
    for on in (False, True):
        pads.clear()
        run, made = graphed_run(llama, monkeypatch, bucket_batches=on, **kw)
        parts = made + [g.fused for g in made if g.fused is not None]
        runs[on] = (run, sum(g.replays for g in parts), list(pads))
    for on, (run, replays, padded) in runs.items():
        assert run.tokens == eager.tokens
        assert run.log_lines == eager.log_lines
        assert [v.block() for v in run.violations] == [v.block() for v in eager.violations]
        assert run.stats["entries_checked"] == eager.stats["entries_checked"]
        assert run.stats["tokens_protected"] == eager.stats["tokens_protected"]  # (padding not counted)
        assert (len(run.violations) > 0) == (bug is not None)
        steps = padded  # (decode steps; the cap: the engine's 16 requests per batch)
        assert steps and all(pad == (bucket(bs, 16) - bs if on else 0) for bs, pad in steps)
        assert any(pad for _, pad in steps) == on  # (the batch did change: some steps were padded)
    # the point: a batch that changes inside its bucket keeps its shape, so more of its steps replay a graph
    # (and fewer run eagerly or are captured)
    assert runs[True][1] > runs[False][1]


def test_padding_follows_the_option_and_the_engine_s_batch_cap(llama, monkeypatch):
    made = []
    init = StepGraphs.__init__

    def keep(self, runner, graph_type=None):
        init(self, runner, graph_type)
        made.append(runner.source.pad_cap)

    monkeypatch.setattr(StepGraphs, "__init__", keep)
    kw = dict(prompts=staggered_prompts(llama.config.vocab_size)[:2], max_new_tokens=3, num_return_sequences=1)
    for on in (True, False):
        made.clear()
        graphed_run(llama, monkeypatch, bucket_batches=on, **kw)
        assert made and made == [16 if on else 0] * len(made)


def test_the_cpu_stages_in_one_buffer_unless_step_graphs_replay(llama, monkeypatch):
    # the CPU reads each step's observation when the step closes: one staging buffer serves (a reused batch
    # then serves every step of its shape); the graphs' CPU stand-in keeps every turn, as CUDA does
    from kvcanary.integrations.transformers import session as hf_session
    from kvcanary.runtime.step.staging import STAGING_TURNS

    depths = []
    init = hf_session.Session.__init__

    def keep(self, handle, bp):
        init(self, handle, bp)
        depths.append(self.builder.stage.depth)

    monkeypatch.setattr(hf_session.Session, "__init__", keep)
    kw = dict(prompts=staggered_prompts(llama.config.vocab_size)[:2], max_new_tokens=3, num_return_sequences=1)
    run_workload(llama, backend=graphs.EAGER_BACKEND, **kw)  # (the eager steps: the interpreter not needed)
    graphed_run(llama, monkeypatch, **kw)
    expected = [STAGING_TURNS, STAGING_TURNS] if DEVICE.type == "cuda" else [1, STAGING_TURNS]
    assert depths == expected
