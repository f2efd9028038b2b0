"""The write check over every attention layer (``CanaryConfig.write_check_layers="all"``, docs/write_check.md): a
V write skipped in one middle layer, which no fingerprinted layer covers, is missed by default and reported with
"all", naming the layer and the slot, in transformers continuous batching and in the simulated engine; clean runs
with "all" report nothing."""

from __future__ import annotations

import pytest
import torch

from kvcanary.sim.config import SimConfig
from kvcanary.sim.engine import SimEngine, default_canary_config
from kvcanary.sim.model import WORDS

transformers = pytest.importorskip("transformers")

LAYERS = 4  # (layer 0's K and layer 3's V fingerprinted: layer 2 is no real-KV source)
MIDDLE = LAYERS // 2


@pytest.fixture(scope="module")
def llama4():
    from kvcanary.demo import TINY_CONFIG
    from kvcanary.integrations.transformers.reach import sdpa_name

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_CONFIG, "num_hidden_layers": LAYERS}))
    model.eval().set_attn_implementation(sdpa_name())
    return model


def skip_middle_v(bp, lay, state) -> None:
    """Layer MIDDLE's write-only path (fresh prefills) stores K and returns without writing V, for one forward."""
    from kvcanary.sim import hf_bugs

    a = lay.cache.cache_allocators["full_attention"]
    orig = a.update

    def update(key_states, value_states, layer_idx, read_index, write_index):
        if layer_idx == MIDDLE and read_index.numel() == 0 and hf_bugs._one_forward(state, write_index):
            a._kv_token_views[layer_idx][0].index_copy_(0, write_index, key_states)
            return key_states, value_states  # (V never written)
        return orig(key_states, value_states, layer_idx, read_index, write_index)

    a.update = update


def run_hf(model, planted: bool, **options):
    from kvcanary.demo import run_workload
    from kvcanary.integrations.transformers.reach import has_block_pool
    from kvcanary.sim import hf_bugs

    if planted and not has_block_pool():
        pytest.skip("the planted write is transformers >= 5.18's sector allocator")
    undo = hf_bugs.plant_with(model, skip_middle_v, "_kvcanary_test_bug") if planted else None
    try:
        return run_workload(model, max_new_tokens=4, num_return_sequences=1, **options)
    finally:
        if undo is not None:
            undo()


def written_wrong_reads(vs) -> list:
    """The rows after the write_kv rows: reads of the slots the wrong write left (the write check marked their
    records), each flagged so; any other row fails."""
    later = [v for v in vs if v.reasons != ("write_kv",)]
    assert all(v.reasons == ("verify_real_kv_hash",) and v.written_wrong for v in later), [str(v) for v in later]
    return later


def test_hf_a_middle_layers_skipped_v_write_is_missed_by_default_and_reported_with_all(llama4):
    assert run_hf(llama4, True).violations == []
    run = run_hf(llama4, True, write_check_layers="all")
    vs = [v for v in run.violations if v.reasons == ("write_kv",)]
    assert written_wrong_reads(run.violations)  # (later reads of the slots: their readers named)
    assert vs and {(v.reasons, v.step, v.launch_tag, v.layer, v.source) for v in vs} == {
        (("write_kv",), 1, "TAIL_V_FULL", MIDDLE, f"V of layer {MIDDLE} (full group)")}, [str(v) for v in vs]
    assert len({v.slot for v in vs}) == len(vs) and all(v.slot > 0 for v in vs)
    assert f"slot {vs[0].slot} holds other bytes in the V of layer {MIDDLE} (full group)" in vs[0].block()


def test_hf_a_clean_run_with_all_reports_nothing_and_notes_every_layer(llama4):
    run = run_hf(llama4, False, write_check_layers="all")
    base = run_hf(llama4, False)
    assert run.violations == [] and run.tokens == base.tokens
    # every forward notes each layer's K and V: 2 * LAYERS sources, against the 2 fingerprinted ones
    assert run.stats["write_check_notes"] == LAYERS * base.stats["write_check_notes"] > 0


# (layers 0, 2, 5, 7 fingerprinted); a steady decode batch of four (the recorded paths replay its steps)
SIM = dict(num_layers=8, seed=38, page_size=4, num_slots=512, num_requests=4, max_running=4, max_output=16,
           max_steps=40, graph_sizes=(1, 2, 3, 4))


def device_bounds(monkeypatch) -> None:
    """The torch backend as on an accelerator (work sized by static bounds, no host read): what the CPU stand-in
    graphs of the step runner's recorded paths can record, in seconds (tests/test_hf_attention_graphs.py)."""
    from kvcanary.ops import attention_ops, slot_ops, torch_ops, write_ops

    for module in (torch_ops, write_ops, slot_ops, attention_ops):
        monkeypatch.setattr(module, "_host_reads", lambda device: False)


def run_sim(layers: str, plant_at: int | None, steps: str | None = None):
    cfg = SimConfig(**SIM)
    eng = SimEngine(cfg, default_canary_config(cfg).replace(write_check_layers=layers), steps=steps)
    model, orig, fired = eng.model, eng.model.forward, []
    assert 4 not in model.fingerprinted()

    def forward(out_cache_loc, input_ids, positions, swa_loc=None, note=None):
        v = model.v[4].view(-1, WORDS)
        before = v.clone()
        orig(out_cache_loc, input_ids, positions, swa_loc, note)
        if plant_at is not None and eng.step_no >= plant_at and not fired:
            fired.append((eng.step_no, out_cache_loc.clone()))
            v.copy_(before)  # (layer 4's V write never happened)

    model.forward = forward
    result = eng.run()
    return eng, result, fired


@pytest.mark.parametrize("steps", [None, "captured"])  # (the plain hooks; the step runner's replayed graphs)
def test_sim_a_middle_layers_skipped_v_write_is_missed_by_default_and_reported_with_all(steps, monkeypatch):
    if steps:
        device_bounds(monkeypatch)
    _, result, fired = run_sim("fingerprinted", 12, steps)  # (a decode step of the steady batch: replayed)
    assert fired and result.violations == 0
    eng, result, fired = run_sim("all", 12, steps)
    vs = [v for v in eng.canary.violations if v.reasons == ("write_kv",)]
    assert written_wrong_reads(eng.canary.violations)
    step, loc = fired[0]
    written = {s for s in loc.tolist() if s > 0}
    assert vs and {(v.reasons, v.layer, v.source) for v in vs} == {(("write_kv",), 4, "V of layer 4 (full group)")}
    assert {v.slot for v in vs} <= written and {v.step for v in vs} == {step}  # (reported at the forward)


@pytest.mark.parametrize("steps", [None, "captured"])
def test_sim_a_clean_run_with_all_reports_nothing(steps, monkeypatch):
    if steps:
        device_bounds(monkeypatch)
    eng, result, _ = run_sim("all", None, steps)
    assert result.violations == 0 and result.finished > 0
    assert len(eng.canary.write_check.sources) == 16  # (8 fingerprinted: layers 0, 2, 5, 7, K and V; 8 more)
