"""transformers' async batching under the canary (CUDA only: transformers refuses async batching on the CPU).
The step's canary work runs once the forward (and its carry-over of the last forward's tokens) is enqueued
(``runtime/step/carry.py``); the carrying path itself is tested on the CPU through the sim
(tests/test_async_steps.py). Written without a GPU at hand: the integrator runs it on the H200."""

import pytest

pytest.importorskip("transformers")

from conftest import DEVICE  # noqa: E402
from kvcanary.demo import build_tiny_model, run_workload  # noqa: E402

import transformers  # noqa: E402
from kvcanary.integrations.transformers.layout import ASYNC_SINCE, parse_version  # noqa: E402

# (below 5.24 the canary refuses async batching: tests/test_transformers.py)
pytestmark = pytest.mark.skipif(DEVICE.type != "cuda" or parse_version(transformers.__version__) < ASYNC_SINCE,
                                reason="async batching needs CUDA and transformers >= 5.24")

DEV = str(DEVICE)
# the engine's CUDA graphs and async batching; sdpa needs an attention mask, which async batching's default
# resolution refuses, but an explicit use_async_batching=True takes it (a paged attention of the GPU image's)
ASYNC = {"use_cuda_graph": True, "use_async_batching": True}


@pytest.fixture(scope="module")
def llama():
    return build_tiny_model(DEV)


def _summary(run) -> str:
    """A failed clean run in one line: its violations by kind and by step (a GPU log may not come back whole)."""
    import collections

    kinds = collections.Counter((v.launch_tag, v.reasons, v.slot, v.position, v.stored_token) for v in run.violations)
    steps = sorted(collections.Counter(v.step for v in run.violations).items())
    return f"{len(run.violations)} violations; by kind {kinds.most_common(5)}; by step {steps[:20]}; {run.report[:1]}"


def test_async_clean_run_matches_a_canaryless_async_run(llama):
    base = run_workload(llama, canary=False, cb=ASYNC, device=DEV, num_return_sequences=1, max_new_tokens=16)
    run = run_workload(llama, cb=ASYNC, device=DEV, num_return_sequences=1, max_new_tokens=16)
    assert run.violations == [], _summary(run)
    assert run.tokens == base.tokens and run.stats["forwards"] > 0
    assert run.tokens == run_workload(llama, canary=False, device=DEV, num_return_sequences=1,
                                      max_new_tokens=16).tokens  # (greedy: async changes no token)


@pytest.mark.parametrize("bug", ["flip-kv", "wrong-read-index"])
def test_a_planted_bug_is_reported_under_async(llama, bug):
    run = run_workload(llama, bug=bug, cb=ASYNC, device=DEV)
    assert run.violations, f"{bug}: no violation under async batching"


def test_what_must_precede_the_forward_is_refused_under_async(llama):
    with pytest.raises(Exception, match="token_oracle"):
        run_workload(llama, cb=ASYNC, device=DEV, token_oracle=True)


@pytest.fixture
def lagging_side(monkeypatch):
    """The canary's side-stream work made to lag the host by steps (a sleep before each step's work there), as
    it does when the GPU is busy (a 1B model): what the host writes for a later step must wait for it."""
    from gpu_lag import lag_before
    from kvcanary.runtime.step.graphs import StepGraphs

    lag_before(monkeypatch, StepGraphs, "_run")


def test_a_clean_async_run_stays_clean_when_the_side_stream_lags(llama, lagging_side):
    # every step's canary work queued behind milliseconds of other work: whatever the host prepares for later
    # steps (staged values, read tables, the engine's next inputs) must wait for it, or this run reports
    # false violations. (It did not reproduce the static-buffer race seen at 1B serving, which
    # a probe of 1B serving on the H200 checked, docs/benchmarks.md: the tiny model's host waits for the GPU elsewhere.)
    base = run_workload(llama, canary=False, cb=ASYNC, device=DEV, num_return_sequences=1, max_new_tokens=16)
    run = run_workload(llama, cb=ASYNC, device=DEV, num_return_sequences=1, max_new_tokens=16)
    assert run.violations == [], _summary(run)
    assert run.tokens == base.tokens and run.stats["forwards"] > 0
