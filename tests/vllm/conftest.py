"""vLLM's engine in this process (its engine core and, at TP 1, its worker): the tests reach the live sessions,
start an engine in seconds, and share one tiny random-weight model (kvcanary.integrations.vllm.engine)."""

import gc
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # (read when vllm builds an engine)

pytest.importorskip("vllm")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from kvcanary.integrations.vllm import engine

    return engine.tiny_model(str(tmp_path_factory.mktemp("vllm") / "tiny"))


@pytest.fixture(scope="session")
def prompts():
    """Eight prompts: a 40-token system prompt shared by six (prefix-cache hits), lengths 41 to 110 (chunked prefill
    at 64 tokens a step), one exactly two blocks long and the same again (an exact cached prefix)."""
    system = [(37 * i + 11) % 512 for i in range(40)]
    out = [system + [(13 * k + 5 * i + 7) % 512 for i in range(1 + 14 * k)] for k in range(6)]
    two_blocks = [(401 + 7 * i) % 512 for i in range(64)]
    return out + [two_blocks, list(two_blocks)]


def pytest_runtest_setup(item):
    """vLLM collects the whole heap several times as an engine starts (loading the model, before it freezes its
    heap, after its profiling run) and once it stops (after it unfreezes it): with torch, vLLM and transformers
    imported, about 0.3 s a collection on the 2-core dev machine, ~2 s an engine. vLLM freezes its heap after
    start-up itself (``freeze_gc_heap``: a serving engine's collections scan only what it made since); the same
    before each test, ahead of its fixtures, leaves an engine's start-up collections what the test made. Frozen
    objects are never collected until vLLM unfreezes the heap, at an engine's shutdown, which then collects it whole
    (``cleanup_dist_env_and_memory``): the run's peak memory did not grow (measured, 907 -> 863 MB max RSS)."""
    gc.freeze()
