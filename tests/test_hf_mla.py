"""MLA models (DeepSeek-style compressed latents) on transformers 5.25+'s paged cache: one latent row per token and
layer is a canary slot; clean runs report nothing, every planted bug that an MLA cache can have is reported, and a
damaged latent is found in the layer it sits in."""

import logging

import pytest
import torch

pytest.importorskip("transformers.generation.continuous_batching.cache_allocators.compressed_latents",
                    reason="MLA paged caches (transformers 5.25+)")

from kvcanary.demo import build_tiny_model, run_workload  # noqa: E402
from kvcanary.format import FailReason  # noqa: E402
from kvcanary.sim import hf_bugs  # noqa: E402

from conftest import DEVICE  # noqa: E402
from test_transformers import EXPECTED, _first_difference  # noqa: E402

logging.getLogger("kvcanary").setLevel(logging.ERROR)
# An MLA row holds both latents: there is no V page whose copy a fork could skip.
NO_V_PAGE = {"k-only-fork-copy", "write-k-only"}


@pytest.fixture(scope="module")
def mla():
    return build_tiny_model(str(DEVICE), mla=True)


@pytest.fixture(scope="module")
def mla_baseline(mla):
    return run_workload(mla, canary=False)


def test_mla_layout_slots_are_latent_rows(mla):
    seen = {}

    def look(bp, lay, state):
        seen["lay"], seen["full"] = lay, bp.cache.cache_allocators["full_attention"]

    undo = hf_bugs.plant_with(mla, look, "_test_mla_layout")
    try:
        run_workload(mla, canary=False, max_new_tokens=1, num_return_sequences=1)
    finally:
        undo()
    lay, full, cfg = seen["lay"], seen["full"], mla.config
    assert [k.shape[1] for k in lay.keys] == [cfg.kv_lora_rank + cfg.qk_rope_head_dim] * cfg.num_hidden_layers
    # layer j's rows are the engine's own latent rows of that layer (K and V: the one row of both latents)
    for j, layer in enumerate(full.layer_indices):
        latent, _ = full._latent_token_views[layer]
        assert lay.keys[j].data_ptr() == latent.data_ptr() == lay.values[j].data_ptr()
    assert lay.num_slots == full.cache_tensor.shape[0]


def test_mla_clean_run_matches_and_reports_nothing(mla, mla_baseline):
    run = run_workload(mla)
    assert run.violations == [], [v.block().splitlines()[0] for v in run.violations[:3]]
    assert run.stats["forwards"] > 0 and run.stats["prefix_hits"] > 0
    assert run.tokens == mla_baseline.tokens, _first_difference(run.tokens, mla_baseline.tokens)


@pytest.mark.parametrize("bug", sorted(set(hf_bugs.BUGS) - NO_V_PAGE))
def test_planted_bug_is_reported_on_an_mla_cache(mla, bug):
    run = run_workload(mla, bug=bug)
    assert run.violations, f"{bug}: no violation on an MLA cache"
    EXPECTED[bug](lambda rid: run.names.get(rid, ""), run.violations)


def test_a_damaged_latent_of_the_last_layer_is_reported(mla):
    damaged = []

    def damage(bp, lay, state):  # after an update: the first live request's first token, last layer's latent
        orig = bp.update_batch

        def update():
            orig()
            table = lay.block_table(lay.full_group)
            if table and not damaged and not state["warming_up"]:
                slot = lay.slot(next(iter(table.values()))[0], 0)
                with torch.no_grad():
                    lay.values[-1][slot, 0] += 1
                damaged.append(slot)

        bp.update_batch = update

    undo = hf_bugs.plant_with(mla, damage, "_test_mla_damage")
    try:
        run = run_workload(mla)
    finally:
        undo()
    assert damaged
    bad = [v for v in run.violations if v.fail_reason & FailReason.VERIFY_REAL_KV_HASH]
    assert bad and {v.slot for v in bad} == set(damaged), [str(v) for v in run.violations[:3]]
