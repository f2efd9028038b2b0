"""kv-canary inside vLLM's own engine (V1, CPU): clean runs report nothing and change no token, planted bugs in vLLM's
code are reported with vLLM's request ids. Two engines for the module (each start costs seconds)."""

from __future__ import annotations

import json
import os

import pytest

from kvcanary.integrations.vllm import collect, engine, read_reports
from kvcanary.integrations.vllm.session import SESSIONS, session_of
from kvcanary.vllm_demo import plant


def _runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("reports"))


@pytest.fixture(scope="module")
def tight(model_dir, report_dir):
    """Prefix caching, chunked prefill (64 tokens a step) and a pool of 12 blocks for 8 requests of up to 5 blocks:
    vLLM preempts (by recompute) and evicts cached blocks. The allocator check reads vLLM's block pool every step."""
    with engine.guarded(True, KV_CANARY_VLLM_REPORT_DIR=report_dir, KV_CANARY_MODE="log",
                        KV_CANARY_VLLM_ALLOCATOR_INTERVAL="1"):
        llm = engine.start(model_dir, num_blocks=12, max_num_seqs=6, max_num_batched_tokens=64, max_model_len=256)
        yield llm
        engine.stop(llm)


def _fresh(llm, **tokens):
    # each run starts from an empty prefix cache, so runs with and without the canary schedule alike
    assert llm.reset_prefix_cache()
    return engine.generate(llm, **tokens)


def test_clean_run_with_preemption_prefix_hits_and_chunks_reports_nothing_and_keeps_tokens(tight, prompts):
    session = session_of(_runner(tight))
    assert session is not None and session in SESSIONS
    with engine.guarded(False):
        without = _fresh(tight, prompts=prompts, max_tokens=24)
    steps_before = session.events["steps"]
    assert steps_before == 0  # (the hooks were off: nothing counted)
    guarded = _fresh(tight, prompts=prompts, max_tokens=24)
    report = collect(tight)
    stats = report.stats[0]
    assert report.clean, report.violations[:3]
    assert stats["violations"] == 0 and stats["forwards"] >= stats["steps"] > 0
    # the run had what the test is about: preemption, prefix hits (exact ones too), chunked prefill
    assert stats["preempted"] > 0 and stats["resumed_after_preemption"] > 0
    assert stats["prefix_hits"] >= 5 and stats["chunked_prefill_chunks"] > 0
    assert stats["tokens_protected"] >= sum(len(p) for p in prompts)
    assert stats["allocator_checks"] >= stats["steps"] and stats["allocator_violations"] == 0
    # the write check compared every forward's writes (each fingerprinted head's V at its layer's cache write),
    # forwards split into waves included, and found nothing
    assert stats["write_check_notes"] >= 2 * stats["forwards"] and stats["split_forwards"] > 0
    assert list(guarded.values()) == list(without.values())


def test_each_canary_forward_is_a_host_step_of_vllms_attention_metadata(tight, prompts, monkeypatch):
    """Each canary forward (a whole forward or a wave of it) is a ``runtime.engine.HostStep`` (issue 57): unpacked,
    it holds the lengths and slots vLLM's attention metadata hands the kernels, and the batch the canary checks is
    the runtime's views of it (``StepTables.build``)."""
    from vllm.forward_context import get_forward_context

    session = session_of(_runner(tight))
    build, layer, seen = session.tables.build, session.layout.layer_names[0], []

    def checked(h, key):
        batch = build(h, key)
        ctx = get_forward_context()
        md = ctx.attn_metadata[layer]
        qsl, seq = md.query_start_loc.tolist(), md.seq_lens.tolist()
        slots = (ctx.slot_mapping[layer] if ctx.slot_mapping else md.slot_mapping).tolist()
        p = h.unpack()
        reqs = [row - 1 for row in p.rows.tolist()]
        assert p.extend.tolist() == [qsl[r + 1] - qsl[r] for r in reqs]
        assert p.prefix.tolist() == [seq[r] - qsl[r + 1] + qsl[r] for r in reqs]
        assert batch.out_cache_loc.tolist() == [slots[t] for r in reqs for t in range(qsl[r], qsl[r + 1])]
        assert batch.req_pool_indices.data_ptr() == h.packed.data_ptr() and batch.prefix_lens.equal(p.prefix)
        seen.append(len(reqs) < session.runner.input_batch.num_reqs)
        return batch

    monkeypatch.setattr(session.tables, "build", checked)
    forwards = session.canary.stats()["forwards"]
    _fresh(tight, prompts=prompts, max_tokens=24)
    assert len(seen) == session.canary.stats()["forwards"] - forwards > 0
    assert any(seen)  # (waves among them: a forward's requests split)


def test_a_planted_slot_mapping_bug_is_reported_with_vllm_request_ids(tight, prompts, report_dir):
    with plant("slot-off-by-one"):
        outputs = _fresh(tight, prompts=prompts[:4], max_tokens=6)
    report = collect(tight)
    assert report.violations and report.stats[0]["violations"] > 0
    named = report.requests()
    run_ids = {rid for rid in named if rid.split("-")[0] in outputs}
    assert named and named == run_ids  # every named request is one of this run's (vLLM's internal ids)
    row = report.violations[0]
    assert row["rank"] == 0 and row["reader"] in named and f"('{row['reader']}')" in row["text"]
    # the same rows reached the report directory (what a multiprocess engine or vllm serve leaves)
    on_disk = read_reports(report_dir)
    assert {json.dumps(r, sort_keys=True) for r in report.violations} <= {
        json.dumps(r, sort_keys=True) for r in on_disk.violations}
    assert on_disk.stats and on_disk.stats[0]["pid"] == os.getpid()


def test_a_stale_block_table_entry_is_reported(tight, prompts):
    before = len(collect(tight).violations)
    with plant("stale-block"):
        outputs = _fresh(tight, prompts=prompts[:4], max_tokens=6)
    fresh = collect(tight).violations[before:]
    assert fresh
    # a request read another request's block through its stale entry: the chain or the position breaks there
    readers = {r["reader"] for r in fresh if {"verify_chain_hash", "verify_position"} & set(r["reasons"])}
    assert readers and all(rid.split("-")[0] in outputs for rid in readers)


def test_a_cache_write_that_never_stores_v_is_reported_at_the_forward_that_made_it(tight, prompts):
    """vLLM's CPU cache write stores K and leaves V as it was: the records and the real-KV hash (taken after the
    forward, of whatever the slot holds) would certify the stale V; the write check compares each written slot with
    the V the layer handed to its cache write, and names the layer, the slot and the writer."""
    session = session_of(_runner(tight))
    lay = session.layout
    before = len(collect(tight).violations)
    with plant("v-write-dropped"):
        outputs = _fresh(tight, prompts=prompts[:4], max_tokens=6)
    fresh = collect(tight).violations[before:]
    writes = [r for r in fresh if r["reasons"] == ["write_kv"]]
    assert writes
    # the fingerprinted layers (first and last) and their V, each written slot a row, every writer this run's
    assert {r["layer"] for r in writes} <= {0, len(lay.layer_names) - 1}
    assert all(r["source"].startswith(f"V of layer {r['layer']}") for r in writes)
    assert all(r["writer"].split("-")[0] in outputs and r["reader"] == r["writer"] for r in writes)
    assert len({r["slot"] for r in writes}) == len(writes)
    first = min(r["step"] for r in writes)  # the first forward of the run: each of its prompt tokens' slots
    assert len([r for r in writes if r["step"] == first]) >= min(len(p) for p in prompts[:4])


def test_the_allocator_check_sees_an_early_free_in_vllms_block_pool(tight, prompts):
    """(Last of the tight engine's tests: its block pool is left corrupted.) The scheduler frees a block that a
    running request still holds: the check names the block on the free queue and its holder."""
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = Scheduler.schedule
    freed = []

    def early_free(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        if not freed:
            for rid, blocks in self.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks.items():
                if len(blocks) >= 2 and blocks[0].ref_cnt == 1:
                    self.kv_cache_manager.block_pool.free_blocks([blocks[0]])
                    freed.append((rid, blocks[0].block_id))
                    break
        return out

    before = len(collect(tight).violations)
    Scheduler.schedule = early_free
    try:
        _fresh(tight, prompts=prompts[:3], max_tokens=4)
    finally:
        Scheduler.schedule = schedule
    rows = [r for r in collect(tight).violations[before:] if r["launch_tag"] == "ALLOCATOR"]
    assert freed and rows
    rid, block = freed[0]
    assert any("live_block_free" in r["reasons"] and r["block_id"] == block for r in rows)
    assert any(rid in r["holder_names"] for r in rows)


@pytest.fixture(scope="module")
def no_prefix_cache(model_dir):
    with engine.guarded(True, KV_CANARY_MODE="raise"):
        llm = engine.start(model_dir, num_blocks=64, enable_prefix_caching=False, max_num_batched_tokens=32)
        yield llm
        engine.stop(llm)


def test_clean_run_without_prefix_caching_raises_nothing(no_prefix_cache, prompts):
    out = engine.generate(no_prefix_cache, prompts, max_tokens=12)
    report = collect(no_prefix_cache)
    assert report.clean and len(out) == len(prompts)
    stats = report.stats[0]
    assert stats["prefix_hits"] == 0 and stats["chunked_prefill_chunks"] > 0 and stats["mode"] == "raise"
    assert stats["forwards"] >= 12


def test_mode_raise_stops_the_engine_at_the_first_bad_forward(no_prefix_cache, prompts):
    """(Last of the no-prefix-cache engine's tests: the engine is dead afterwards.)"""
    from kvcanary import KvCanaryViolationError

    session = session_of(_runner(no_prefix_cache))
    with plant("slot-off-by-one"), pytest.raises(Exception) as info:
        engine.generate(no_prefix_cache, prompts[:4], max_tokens=6)
    # in-process the canary's own error reaches the caller (a multiprocess engine core turns it into EngineDeadError)
    assert isinstance(info.value, KvCanaryViolationError), repr(info.value)
    assert session.rows and session.rows[0]["reader"] is not None


@pytest.mark.parametrize("bug", ["slot-off-by-one", "v-write-dropped"])
def test_mode_abort_fails_exactly_the_requests_that_read_wrong_kv(model_dir, prompts, bug):
    """A read of wrong KV fails its reader; a cache write that stored other bytes than its layer computed (the
    write check, one forward's writes here: kvcanary.sim.vllm_bugs) fails its writer, and any request that reads the
    slots it left before that (the write check marks their records). No other request fails."""
    from vllm import SamplingParams

    from kvcanary.sim import vllm_bugs

    with engine.guarded(True, KV_CANARY_MODE="abort"):
        llm = engine.start(model_dir, num_blocks=64, max_num_batched_tokens=64)
        try:
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            with plant(bug) if bug == "slot-off-by-one" else vllm_bugs.plant(bug, llm):
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            report = collect(llm)
        finally:
            engine.stop(llm)
    if bug == "v-write-dropped":
        rows = report.violations
        assert rows and rows[0]["reasons"] == ["write_kv"]
        assert all(r["reasons"] == ["write_kv"] or (r["reasons"] == ["verify_real_kv_hash"] and r["written_wrong"])
                   for r in rows), rows
    failed = {o.request_id for o in outs if o.outputs[0].finish_reason == "error"}
    finished = {o.request_id for o in outs if o.outputs[0].finish_reason == "length"}
    named = {rid.split("-")[0] for rid in report.requests()}
    assert failed and failed == named  # the canary named them, vLLM failed them, no other
    assert finished == {o.request_id for o in outs} - failed and finished  # the others ran to their length
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs if o.request_id in finished)
    assert report.stats[0]["aborted"] == len(failed) and report.stats[0]["aborted_requests"] == len(failed)


def test_lora_requests_share_prefixes_within_an_adapter_and_report_nothing(model_dir):
    """Records carry the adapter (LoRA changes a token's KV): requests of one adapter share cached blocks, requests
    without it compute their own, and nothing is reported."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from kvcanary.sim.vllm_drive import tiny_lora_dir

    prompt = [(7 * i + 3) % 512 for i in range(80)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    adapter = LoRARequest("x", 1, tiny_lora_dir(model_dir))
    with engine.guarded(True):
        llm = engine.start(model_dir, num_blocks=64, enable_lora=True, max_lora_rank=8, max_loras=1)
        try:
            llm.generate([{"prompt_token_ids": prompt}] * 2, params, lora_request=adapter, use_tqdm=False)
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            llm.generate([{"prompt_token_ids": prompt}], params, lora_request=adapter, use_tqdm=False)
            report = collect(llm)
        finally:
            engine.stop(llm)
    assert report.clean, report.violations[:1]
    assert report.stats[0]["prefix_hits"] >= 2
