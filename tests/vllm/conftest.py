"""vLLM's engine in this process (its engine core and, at TP 1, its worker): the tests reach the live sessions,
start an engine in seconds, and share one tiny random-weight model (kvcanary.integrations.vllm.engine)."""

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
