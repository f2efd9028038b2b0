"""A manager kept between ``generate_batch`` calls (``persistent_manager=True``): one canary session guards every
call, prefix blocks cached by one call are verified when the next one reads them, and KV damaged between calls
is reported."""

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import GenerationConfig  # noqa: E402

from kvcanary.demo import build_tiny_model, demo_prompts  # noqa: E402
from kvcanary.format import FailReason  # noqa: E402
from kvcanary.integrations.transformers import attach  # noqa: E402
from kvcanary.integrations.transformers.layout import ASYNC_SINCE, parse_version  # noqa: E402
from kvcanary.integrations.transformers.reach import cb_config  # noqa: E402

from conftest import DEVICE  # noqa: E402

logging.getLogger("kvcanary").setLevel(logging.ERROR)
EAGER = {"use_cuda_graph": False, "use_async_batching": False}
GRAPHS = {"use_cuda_graph": True, "use_async_batching": False}
ASYNC = {"use_cuda_graph": True, "use_async_batching": True}
# (async batching is refused below ASYNC_SINCE: that refusal has its own test in test_transformers.py)
CONFIGS = [EAGER] + ([GRAPHS] if DEVICE.type == "cuda" else []) + (
    [ASYNC] if DEVICE.type == "cuda" and parse_version(transformers.__version__) >= ASYNC_SINCE else [])


@pytest.fixture(scope="module")
def llama():
    return build_tiny_model(str(DEVICE))


def calls(model, cb: dict, canary: bool, between=None, n: int = 3):
    """``n`` ``generate_batch`` calls on one kept manager (the second with the prompts reversed); ``between(handle)``
    runs after the first. Returns (tokens per call, handle stats after each call, violations after each call)."""
    prompts = demo_prompts(model.config.vocab_size)
    gen = GenerationConfig(max_new_tokens=6, eos_token_id=-1, do_sample=False)
    handle = attach(model, mode="log") if canary else None
    tokens, stats, violations = [], [], []
    try:
        for i in range(n):
            cbc = cb_config(block_size=4, num_blocks=96, max_batch_tokens=16, max_requests_per_batch=16,
                            scheduler_type="fifo", allow_block_sharing=True, **cb)
            out = model.generate_batch(prompts[::-1] if i == 1 else prompts, generation_config=gen,
                                       continuous_batching_config=cbc, persistent_manager=True)
            tokens.append({k: list(v.generated_tokens) for k, v in out.items()})
            if handle is not None:
                stats.append(handle.stats())
                violations.append(list(handle.flush()))
                if i == 0 and between is not None:
                    between(handle)
    finally:
        model.destroy_cached_continuous_batching_manager()
        if handle is not None:
            handle.detach()
    return tokens, stats, violations


@pytest.mark.parametrize("cb", CONFIGS, ids=lambda cb: "+".join(k[4:] for k, v in cb.items() if v) or "eager")
def test_one_session_guards_every_call_of_a_kept_manager(llama, cb):
    base, _, _ = calls(llama, cb, canary=False)
    tokens, stats, violations = calls(llama, cb, canary=True)
    assert violations[-1] == [], [v.block().splitlines()[0] for v in violations[-1][:3]]
    assert tokens == base
    assert [s["sessions"] for s in stats] == [1, 1, 1]
    forwards = [s["hooked_forwards"] for s in stats]
    assert 0 < forwards[0] < forwards[1] < forwards[2]
    # the later calls' prompts begin with blocks the first call cached: their reads are verified records
    hits = [s.get("prefix_hits", 0) for s in stats]
    assert hits[1] > hits[0] and hits[2] > hits[1]


def test_kv_damaged_between_calls_is_reported_when_the_next_call_reads_it(llama):
    damaged = []

    def damage(handle):
        lay = handle.sessions[0].layout
        cached = sorted(lay.idle_blocks())
        assert cached, "the first call left no cached prefix block"
        slots = lay.blocks_to_slots(cached, DEVICE)
        with torch.no_grad():
            lay.keys[0][slots] += 1  # (an engine bug writing cached blocks' KV while no request holds them)
        damaged.extend(slots.tolist())

    _, _, violations = calls(llama, EAGER, canary=True, between=damage, n=2)
    assert violations[0] == []
    bad = [v for v in violations[1] if v.fail_reason & FailReason.VERIFY_REAL_KV_HASH]
    assert bad, "KV damaged between two calls was not reported"
    assert {v.slot for v in bad} <= set(damaged)
