"""kv-canary on transformers continuous batching: tiny seeded models, clean workloads and planted engine bugs."""

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import GenerationConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.continuous_api import ContinuousMixin  # noqa: E402

from kvcanary import KvCanaryViolationError  # noqa: E402
from kvcanary.demo import build_tiny_model, demo_prompts, run_workload  # noqa: E402
from kvcanary.format import FailReason, oracle_token  # noqa: E402
from kvcanary.sim import hf_bugs  # noqa: E402
from kvcanary.integrations.transformers.layout import ASYNC_SINCE, parse_version  # noqa: E402
from kvcanary.integrations.transformers.layouts import layout_of  # noqa: E402
from kvcanary.integrations.transformers.reach import attach_with, reach  # noqa: E402
from kvcanary.integrations.transformers import SUPPORTED_RANGE, attach, check_version  # noqa: E402
from kvcanary.runtime.report import MISSING_TOKEN  # noqa: E402

from conftest import DEVICE  # noqa: E402

DEV = str(DEVICE)
logging.getLogger("kvcanary").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def llama():
    return build_tiny_model(DEV)


@pytest.fixture(scope="module")
def hybrid():
    # Qwen2 with layer 0 full attention and layer 1 sliding-window attention (window 8).
    return build_tiny_model(DEV, sliding_window=8)


@pytest.fixture(scope="module")
def llama_baseline(llama):
    return run_workload(llama, canary=False)


def rebind(model, init):
    """Install a test wrapper as an instance attribute; the returned undo restores the previous one."""
    had, prev = "init_continuous_batching" in vars(model), vars(model).get("init_continuous_batching")
    model.init_continuous_batching = init

    def undo():
        if had:
            model.init_continuous_batching = prev
        else:
            del model.init_continuous_batching

    return undo


def two_owner(v) -> bool:
    return v.reader_request is not None and v.writer_request not in (None, v.reader_request)


def reason_bits(vs) -> int:
    bits = 0
    for v in vs:
        bits |= v.fail_reason
    return bits


# -- hooks: explicit, per instance, restored exactly ------------------------------------------------
def test_import_and_attach_patch_no_class(llama):
    import kvcanary.integrations.transformers  # noqa: F401

    before = dict(vars(llama))
    handle = attach(llama)
    assert set(vars(llama)) - set(before) == {"init_continuous_batching", "generate_batch"}
    assert type(llama).init_continuous_batching is ContinuousMixin.init_continuous_batching
    assert LlamaForCausalLM.generate_batch is ContinuousMixin.generate_batch
    handle.detach()
    assert vars(llama).keys() == before.keys() and all(vars(llama)[k] is v for k, v in before.items())


def test_hook_runs_and_detach_restores_tokens(llama, llama_baseline):
    undo_probe = []
    orig_init = llama.init_continuous_batching

    def spy(*a, **k):  # an instance attribute that existed before attach must come back as it was
        undo_probe.append(1)
        return orig_init(*a, **k)

    llama.init_continuous_batching = spy
    run = run_workload(llama)
    assert vars(llama)["init_continuous_batching"] is spy and undo_probe
    del llama.init_continuous_batching
    after = run_workload(llama, canary=False)
    assert run.stats["forwards"] > 10 and run.stats["violations"] == 0
    assert run.tokens == llama_baseline.tokens == after.tokens


# -- clean workloads ---------------------------------------------------------------------------------
def test_clean_demo_workload_llama(llama, llama_baseline):
    run = run_workload(llama, check_v=True, real_kv="all")
    s = run.stats
    assert run.violations == [] and s["violations"] == 0
    assert run.tokens == llama_baseline.tokens
    # Prefix sharing (lookups and dedup remaps), forks, chunked prefill and idle-cache sweeps all happened.
    assert s["prefix_hits"] > 0 and s["dedup_remaps"] > 0 and s["fork_block_copies"] > 0 and s["sweeps"] > 0
    assert s["launches"]["HEAD_V_FULL"] == s["launches"]["HEAD_K_FULL"] > 0
    assert s["tokens_protected"] > sum(len(p) for p in demo_prompts(512))


@pytest.mark.parametrize("block_size,sharing", [(8, True), (16, False)], ids=["block8-sharing", "block16-no-sharing"])
def test_clean_block_sizes_and_sharing(llama, block_size, sharing):
    cb = {"block_size": block_size, "num_blocks": 48, "allow_block_sharing": sharing}
    base = run_workload(llama, canary=False, cb=cb)
    run = run_workload(llama, cb=cb)
    assert run.violations == [] and run.tokens == base.tokens
    assert run.stats["fork_block_copies"] > 0 and run.stats["tokens_protected"] > 0


@pytest.mark.parametrize("late", [True, False], ids=["late-hooks", "hooks-before-the-forward"])
def test_late_hooks_run_the_canary_once_the_forward_is_enqueued(llama, llama_baseline, monkeypatch, late):
    # late hooks (the default): each step's canary work runs after the engine enqueued its forward (on a
    # GPU, while the device runs it); late_hooks=False runs it before. Both find the same: nothing, on a
    # clean run, and the planted bug of test_planted_bug_is_reported.
    from kvcanary.integrations.transformers.session import Session

    order = []
    for name in ("_before", "_after"):
        orig = getattr(Session, name)
        monkeypatch.setattr(Session, name, lambda self, orig=orig, name=name: order.append(name) or orig(self))
    orig_forward = type(llama).forward
    monkeypatch.setattr(type(llama), "forward", lambda *a, **k: order.append("forward") or orig_forward(*a, **k))
    run = run_workload(llama, late_hooks=late)
    assert run.violations == [] and run.tokens == llama_baseline.tokens
    steps = [tuple(order[i:i + 3]) for i in range(0, len(order), 3)]
    want = ("forward", "_before", "_after") if late else ("_before", "forward", "_after")
    assert len(steps) > 10 and set(steps) == {want}
    order.clear()
    bug = run_workload(llama, bug="wrong-read-index", late_hooks=late)
    assert bug.violations and {v.launch_tag for v in bug.violations} >= {"HEAD_K_FULL"}


@pytest.mark.parametrize("late", [True, False], ids=["late-hooks", "hooks-before-the-forward"])
def test_timing_records_every_step(llama, late):
    handle = attach_with(llama, timing=True, late_hooks=late)
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1)
    cbc = ContinuousBatchingConfig(block_size=4, num_blocks=64, max_batch_tokens=16, use_async_batching=False,
                                   use_cuda_graph=False)
    llama.generate_batch(demo_prompts(512)[:3], generation_config=gen, continuous_batching_config=cbc)
    rows = handle.sessions[0].timings
    handle.detach()
    assert len(rows) == handle.forwards > 3
    assert all(r["forward_s"] > 0 and r["before_s"] > 0 and r["after_s"] > 0 for r in rows)


def test_stats_keep_their_keys_from_attach_on(llama):
    """A dashboard reading ``handle.stats()`` meets the same keys before, between and after sessions: the
    totals start from every key a session has, at zero."""
    handle = attach(llama, mode="raise")
    gen = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1)
    cbc = ContinuousBatchingConfig(block_size=4, num_blocks=64, max_batch_tokens=16, use_async_batching=False,
                                   use_cuda_graph=False)
    try:  # (detached whatever fails: the model is shared with the tests after this one)
        seen = [handle.stats()]
        assert seen[0]["sessions"] == 0 and seen[0]["forwards"] == 0 and seen[0]["prefix_hits"] == 0
        for prompts in (demo_prompts(512)[:2], demo_prompts(512)[:3]):
            llama.generate_batch(prompts, generation_config=gen, continuous_batching_config=cbc)
            seen.append(handle.stats())
        # (a session's own keys, the handle's two besides: none missing from the zero totals)
        assert set(handle.sessions[-1].stats()) | {"sessions", "hooked_forwards"} == set(seen[0])
    finally:
        handle.detach()
    seen.append(handle.stats())
    assert [list(s) for s in seen] == [list(seen[0])] * 4
    assert [s["sessions"] for s in seen] == [0, 1, 2, 2] and seen[-1]["forwards"] == handle.forwards > 0


def test_token_oracle_drives_generation(llama):
    handle = attach(llama, mode="raise", token_oracle=True)
    prompts = demo_prompts(512)[:4]
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1)
    cbc = ContinuousBatchingConfig(block_size=4, num_blocks=64, max_batch_tokens=16, use_async_batching=False,
                                   use_cuda_graph=False)
    out = llama.generate_batch(prompts, generation_config=gen, continuous_batching_config=cbc)
    ids = handle.sessions[0].ids
    handle.detach()
    assert handle.stats()["violations"] == 0
    for i, p in enumerate(prompts):
        toks = out[f"req_{i}"].generated_tokens
        assert toks == [oracle_token(ids[f"req_{i}"], len(p) + k, 512) for k in range(6)]


def enable_cpu_pool(model, blocks=64):
    """transformers' CPU swap pool needs pinned memory; on a CPU-only machine give it plain tensors."""
    return hf_bugs.on_new_processors(
        model, lambda bp: reach(layout_of(bp.cache)).plain_cpu_swap_pool(bp.offloading_manager, blocks),
        "_kvcanary_test_cpu_pool")


PRESSURE = dict(prompts=[[(11 * k + 3 * i) % 512 for i in range(10 + k)] for k in range(8)], max_new_tokens=24,
                num_return_sequences=1, cb={"num_blocks": 20, "max_batch_tokens": 32})


@pytest.mark.parametrize("pool", [True, False], ids=["cpu-offload", "soft-reset"])
def test_clean_under_memory_pressure(llama, pool):
    undo = enable_cpu_pool(llama) if pool else (lambda: None)
    try:
        base = run_workload(llama, canary=False, **PRESSURE)
        run = run_workload(llama, **PRESSURE)
    finally:
        undo()
    assert run.violations == [] and run.tokens == base.tokens
    if pool:
        assert run.stats["offloaded_requests"] > 0 and run.stats["restored_requests"] > 0
    else:
        assert run.stats["soft_resets"] > 0


def test_clean_sliding_window_hybrid(hybrid):
    base = run_workload(hybrid, canary=False, max_new_tokens=14)
    run = run_workload(hybrid, max_new_tokens=14, check_v=True, real_kv="all")
    assert run.violations == [] and run.tokens == base.tokens
    launches = run.stats["launches"]
    # HEAD_K_FULL also counts the new-token read verifies (skipped on CPU when read cells equal write cells)
    assert launches["HEAD_K_SWA"] == launches["TAIL_V_SWA"] == launches["TAIL_K_FULL"] > 0
    assert launches["HEAD_K_FULL"] >= launches["HEAD_K_SWA"]
    oracle = run_workload(hybrid, max_new_tokens=14, num_return_sequences=1, token_oracle=True)
    assert oracle.violations == []


# -- gates -------------------------------------------------------------------------------------------
def test_version_gate_names_the_range():
    for verified in ("5.17.0", "5.18.0", "5.21.0", "5.24.0", "5.25.0"):
        assert check_version(verified) == verified
    for unverified in ("5.26.0", "5.16.2", "6.0.0"):
        with pytest.raises(RuntimeError, match=SUPPORTED_RANGE.replace(".", r"\.")):
            check_version(unverified)
    assert check_version("4.57.0", allow_unsupported=True) == "4.57.0"


def test_block_pool_options_are_refused_below_5_18_naming_them_and_the_version():
    from kvcanary.runtime import CanaryConfig

    both = CanaryConfig(allocator_check_interval=1, poison_on_free=True)
    with pytest.raises(ValueError, match=r"allocator_check_interval and poison_on_free need transformers >= 5\.18's "
                                         r"block pool and ledger, got 5\.17\.0"):
        check_version("5.17.0", config=both)
    with pytest.raises(ValueError, match=r"^kv-canary: poison_on_free needs transformers >= 5\.18.*got 5\.17\.0"):
        check_version("5.17.0", config=CanaryConfig(poison_on_free=True))
    assert check_version("5.17.0", config=CanaryConfig()) == "5.17.0"
    assert check_version("5.18.0", config=both) == "5.18.0" and check_version("5.24.0", config=both) == "5.24.0"


@pytest.mark.parametrize("generation", ["blocks", "sectors"])
def test_a_paged_cache_without_the_fields_read_is_named_not_an_attribute_error(generation):
    """allow_unsupported_version on a transformers whose paged cache moved a field: the session's layout
    (the cache generation its fields point to: per-layer tensors, or one byte tensor in sectors) says which
    fields are missing and the supported range."""

    class MovedCache:
        config, block_size, num_blocks = None, 16, 8

    if generation == "sectors":
        MovedCache.cache_tensor = torch.zeros(8)
        missing, present = ("cache_allocators", "layer_to_allocator", "max_tokens_read", "perform_cache_copy"), "config"
    else:
        missing = ("layer_index_to_group_indices", "key_cache", "value_cache", "write_trash_index")
        present = "block_size"
    with pytest.raises(RuntimeError) as err:
        layout_of(MovedCache())
    msg = str(err.value)
    for name in missing:
        assert f"'{name}'" in msg
    assert f"'{present}'" not in msg
    assert transformers.__version__ in msg and SUPPORTED_RANGE in msg and "MovedCache" in msg


@pytest.mark.parametrize("case", ["async", "sliding-sharing", "sliding-only"])
def test_unsupported_engine_setups_are_refused(llama, hybrid, case):
    model, cb, options = llama, dict(use_async_batching=False, use_cuda_graph=False), {}
    if case == "async":
        cb["use_async_batching"] = True
        if DEV.startswith("cuda") and parse_version(transformers.__version__) >= ASYNC_SINCE:
            options["token_oracle"] = True  # (async itself is accepted there: work before the forward is not)
    elif case == "sliding-sharing":
        model, cb["allow_block_sharing"] = hybrid, True
    else:
        torch.manual_seed(0)
        model = MistralForCausalLM(MistralConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                 num_key_value_heads=1, intermediate_size=64, vocab_size=64,
                                                 sliding_window=8)).to(DEV)
    handle = attach(model, **options)
    impl = model.config._attn_implementation
    try:
        with pytest.raises(ValueError, match="kv-canary: "):
            model.init_continuous_batching(GenerationConfig(max_new_tokens=2, eos_token_id=-1),
                                           ContinuousBatchingConfig(block_size=4, num_blocks=16, **cb))
    finally:
        handle.detach()
    assert model.config._attn_implementation == impl


def test_attach_refuses_a_cache_that_holds_kv(llama):
    gen = GenerationConfig(max_new_tokens=2, eos_token_id=-1, do_sample=False)
    cbc = ContinuousBatchingConfig(block_size=4, num_blocks=32, max_batch_tokens=16, use_async_batching=False,
                                   use_cuda_graph=False)
    out = llama.generate_batch([[1, 2, 3, 4, 5, 6, 7, 8, 9]], generation_config=gen, continuous_batching_config=cbc,
                               persistent_manager=True)
    assert out["req_0"].error is None
    try:
        with pytest.raises(RuntimeError, match="attach before the paged cache holds KV"):
            attach(llama._cached_continuous_batching_manager)
    finally:
        llama.destroy_cached_continuous_batching_manager()


def test_manager_api(llama):
    gen = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1)
    cbc = ContinuousBatchingConfig(block_size=4, num_blocks=32, max_batch_tokens=8, use_async_batching=False,
                                   use_cuda_graph=False)
    manager = llama.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    handle = attach(manager, mode="raise")
    manager.start()
    rid = manager.add_request([5, 6, 7, 8, 9, 10], max_new_tokens=5)
    result = None
    while result is None or not result.is_finished():
        result = manager.get_result(request_id=rid, timeout=5)
    manager.stop(block=True)
    manager.destroy()
    handle.detach()
    assert len(result.generated_tokens) == 5 and handle.forwards >= 5 and handle.violations == []
    assert "_create_batch_processor" not in vars(manager) and "stop" not in vars(manager)


# -- planted engine bugs ------------------------------------------------------------------------------
def check_double_owner(vs):
    assert any(two_owner(v) and v.fail_reason & (FailReason.VERIFY_CHAIN_HASH | FailReason.VERIFY_POSITION)
               for v in vs)


def check_fork_copy(handle_names, vs):
    tail = [v for v in vs if v.launch_tag == "TAIL_K_FULL"]
    assert tail and all(v.reasons == ("verify_real_kv_hash",) for v in tail)
    assert any("__child#" in handle_names(v.reader_request) for v in tail)


EXPECTED = {
    "double-free": lambda names, vs: check_double_owner(vs),
    "early-free": lambda names, vs: check_double_owner(vs),
    # (read-time checks see it once the block's next owner rewrites it; the allocator check at once:
    # tests/test_allocator.py)
    "early-free-unread": lambda names, vs: check_double_owner(vs),
    "wrong-block": lambda names, vs: check_double_owner(vs),
    "skip-fork-copy": check_fork_copy,
    "flip-kv": lambda names, vs: (vs[0].launch_tag == "TAIL_K_FULL" and vs[0].reasons == ("verify_real_kv_hash",)
                                  and vs[0].reader_request == vs[0].writer_request and vs[0].position == 1)
    or pytest.fail(str(vs[0])),
    "flip-idle-cache": lambda names, vs: ({v.launch_tag for v in vs} == {"SWEEP_K_FULL"}
                                          and reason_bits(vs) == FailReason.VERIFY_REAL_KV_HASH)
    or pytest.fail(str(vs)),
    "prefix-key-collision": lambda names, vs: (vs[0].launch_tag == "HEAD_K_FULL"
                                               and vs[0].reasons == ("verify_chain_hash",) and two_owner(vs[0]))
    or pytest.fail(str(vs[0])),
    "wrong-read-index": lambda names, vs: check_read_index(vs),
    "contiguous-read-index": lambda names, vs: check_read_index(vs, unwritten_ok=True),
    "k-only-fork-copy": lambda names, vs: check_partial_copy(names, vs),
    "first-layer-fork-copy": lambda names, vs: check_partial_copy(names, vs),
    "history-short": lambda names, vs: check_history_short(vs),
    "never-written": lambda names, vs: check_never_written(vs),
    "write-into-predecessor": lambda names, vs: check_write_into_predecessor(vs),
    "new-token-read-index": lambda names, vs: check_new_token_read(vs),
    "flip-shared-block": lambda names, vs: check_shared_block(names, vs),
    "write-k-only": lambda names, vs: check_write_kv(vs, "TAIL_K_FULL", "V of layer 1 (full group)"),
    "mask-reset-short": lambda names, vs: check_mask(vs),
}


def check_shared_block(names, vs):
    # every holder of the shared block reads the flipped slot in the next forward: one TAIL row each, every row
    # naming its own reader and listing them all (a parent and its fork at least)
    first = [v for v in vs if v.step == vs[0].step]
    assert {(v.launch_tag, v.reasons, v.slot) for v in first} == {("TAIL_K_FULL", ("verify_real_kv_hash",),
                                                                   first[0].slot)}, [str(v) for v in first]
    readers = first[0].readers
    assert len(readers) >= 2 and all(v.readers == readers for v in first)
    assert sorted(v.reader_request for v in first) == sorted(readers)
    assert any("__child#" in names(r) for r in readers)
    assert f"read by {len(readers)} requests in this forward" in first[0].block()


# planted through the 5.18+ sector cache's allocators and IO (kvcanary/sim/hf_bugs.py): 5.17 has neither
SECTOR_BUGS = ("write-k-only", "mask-reset-short", "sliding-v-into-k")


def skip_on_517(bug):
    from kvcanary.integrations.transformers.reach import has_block_pool

    if bug in SECTOR_BUGS and not has_block_pool():
        pytest.skip(f"{bug} is planted into transformers >= 5.18's sector cache")


def check_write_kv(vs, tag, source):
    # the write stored other bytes than the layer computed: reported by the write check at the very forward (the
    # first), naming the slot, the layer's cache and the writer, before any read of the slot; the record checks alone
    # never see it (TAIL hashes whatever the slot holds)
    first = vs[0]
    assert first.reasons == ("write_kv",) and first.step == 1 and first.launch_tag == tag, str(first)
    assert first.source == source and first.writer_request is not None and first.reader_request == first.writer_request
    assert f"slot {first.slot} holds other bytes in the {source}" in first.block() and "K without V" in first.block()
    written = [v for v in vs if v.step == first.step]
    assert {v.reasons for v in written} == {("write_kv",)} and len({v.slot for v in written}) == len(written)
    # the wrong writes' slots (and a fork's copies of them) are read later: each read fails under its reader's name,
    # flagged as reading what such a write left (the write check marked the slot's record), and no other row appears
    later = [v for v in vs if v.reasons != ("write_kv",)]
    assert later, [str(v) for v in vs]
    for v in later:  # (a sweep of the prefix cache finds them too: a sweep names no reader)
        assert v.reasons == ("verify_real_kv_hash",) and v.written_wrong, str(v)
        assert v.launch_tag.startswith("SWEEP") or (v.reader_request is not None
                                                    and "a victim of that write" in v.block()), str(v)
    assert any(not v.launch_tag.startswith("SWEEP") for v in later)


def check_mask(vs):
    # the mask lets a query see keys its read index does not give it (another request's): the attention-metadata
    # check names the reading request and the key's slot; no KV is wrong, so no other check fires
    assert {v.reasons for v in vs} == {("attention_mask",)}, [str(v) for v in vs]
    first = vs[0]
    assert first.launch_tag == "HEAD_K_FULL" and first.reader_request is not None and first.stored_token == 1
    # (the key's slot: another request's, or over padded inputs the read index's padding, slot 0)
    assert first.expected_token == 0 and first.slot >= 0 and "a key its read index does not give it" in first.block()


def check_new_token_read(vs):
    # Only this step's read of the new token is wrong (prefix reads are right): the check of the new
    # tokens' read cells, after the HEAD write and before the forward, reports it.
    assert len({(v.step, v.launch_tag) for v in vs}) == 1, [str(v) for v in vs]
    first = vs[0]
    assert first.launch_tag == "HEAD_K_FULL" and first.fail_reason & FailReason.VERIFY_POSITION
    assert first.reader_request == first.writer_request and first.reader_position == first.position + 1
    assert f"reads its own position {first.position}'s slot as position {first.position + 1}" in first.block()


def check_read_index(vs, unwritten_ok=False):
    # The block tables are right; only the read index attention consumes is wrong: the HEAD verify of
    # the slot it lists names the reader and the slot's real owner. (A contiguous guess may also land on
    # another request's block allocated for the same step's chunk, not written yet: then the slot is
    # named as never written. Which one happens depends on the engine's allocation order: 5.17 hands out
    # blocks upward from one free list, 5.24 sectors from the top of its tensor.)
    first = vs[0]
    assert first.launch_tag == "HEAD_K_FULL" and first.fail_reason & FailReason.VERIFY_POSITION, str(first)
    assert first.reader_position != first.position
    if unwritten_ok and first.never_written:
        assert first.reader_request is not None and "was never written" in first.block()
        return
    assert two_owner(first)
    assert "two requests own this slot" in first.block()


def check_partial_copy(names, vs):
    check_fork_copy(names, vs)
    text = vs[0].block()
    assert "K without V" in text and "two requests own" not in text
    assert f"last written by request {vs[0].writer_request} at step {vs[0].writer_step}" in text


def check_history_short(vs):
    # One request's history is short: every violation names that request alone, as reader and writer.
    assert {v.reader_request for v in vs} == {vs[0].reader_request} and vs[0].reader_request is not None
    assert {v.writer_request for v in vs} == {vs[0].reader_request}
    assert {v.reasons for v in vs} == {("verify_token",)}
    assert {v.expected_token for v in vs} == {MISSING_TOKEN}
    assert "token history of the reader is shorter" in vs[0].block()


def check_never_written(vs):
    # the write into the engine's write trash is reported first (the reserved-slot check, docs/slots.md) ...
    assert vs[0].reasons == ("reserved_slot_write",) and vs[0].writer_request is not None, str(vs[0])
    # ... then the read of the slot that write never reached
    first = next(v for v in vs if v.never_written)
    assert first.writer_request is None and first.reader_request is not None, str(first)
    text = first.block()
    assert "was never written" in text and "request 0" not in text and "two requests own" not in text
    assert "a missing KV write, or a wrong table or read-index entry" in text


def check_write_into_predecessor(vs):
    # The misplaced write changes the predecessor's KV in the same forward: the TAIL real-KV row names
    # the writer and what it wrote there, and the next HEAD sees the predecessor's slot holding it.
    tail = next(v for v in vs if v.launch_tag == "TAIL_K_FULL")
    assert tail.step == vs[0].step
    # its own slot was never written: the check of the new token's read cell says so before the forward
    assert vs[0].launch_tag == "HEAD_K_FULL" and vs[0].never_written and vs[0].reader_request == tail.reader_request
    assert tail.launch_tag == "TAIL_K_FULL" and tail.reasons == ("verify_real_kv_hash",), str(tail)
    assert tail.writer_request == tail.reader_request and tail.writer_position == tail.position + 1
    assert tail.writer_step == tail.step
    assert f"a write of position {tail.position + 1} landed in a slot still read as position {tail.position}" \
        in tail.block()
    assert any(v.launch_tag == "HEAD_K_FULL" and v.slot == tail.slot and v.position == tail.position + 1
               and v.reader_position == tail.position for v in vs)


@pytest.mark.parametrize("bug", sorted(hf_bugs.BUGS))
def test_planted_bug_is_reported(llama, bug):
    skip_on_517(bug)
    run = run_workload(llama, bug=bug)
    assert run.violations, f"{bug}: no violation"
    EXPECTED[bug](lambda rid: run.names.get(rid, ""), run.violations)


GRAPHS = {"use_cuda_graph": True}
# bugs of the write-only fast path, which padded inputs never take (the engine pads the keys read too)
WRITE_ONLY_BUGS = {"write-k-only": "padded inputs always read keys back: the engine never takes the write-only path"}


# bugs that change no input of attention over the padded inputs of the engine's CUDA graphs (GRAPHS: its default
# intervals, capped at this workload's 16 batch tokens and the cache's 384 keys read, pad every varlen step to 16
# queries and 384 + 16 keys). mask-reset-short leaves the last batch's cells in key columns [384, 400) of the first
# 16 rows; no batch of this workload has keys there (the most is 331), so every cell it leaves is the reset value and
# each step's mask is the correct one, bit for bit
# (test_with_the_graphs_paddings_the_mask_reset_short_bug_changes_no_mask_cell). PADDED's smaller intervals give
# it real columns to leave stale: test_planted_bug_is_reported_over_padded_inputs_after_warmup reports it.
INERT_WITH_GRAPHS = {"mask-reset-short"}


@pytest.fixture
def engine_padding(monkeypatch):
    return pad_engine(monkeypatch)


def pad_engine(monkeypatch):
    """The engine pads its inputs as it does for its CUDA graphs (static sizes, padding tokens writing the
    write-trash row, length-0 padding sequences) and warms up with fake requests before the first one, on
    any device: its forward then runs eagerly over the padded inputs."""
    runner = pytest.importorskip("transformers.generation.continuous_batching.model_runner",
                                 reason="the engine's model runner (transformers 5.18+)")
    orig = runner.ModelRunner.__init__

    def init(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self.pad_inputs = True

    pads, warmups = [], []
    orig_pad, orig_warm = runner.ModelRunner.maybe_pad_inputs, runner.ModelRunner.run_one_warmup

    def pad(self, num_q_tokens, max_kv_read, use_decode_fast_path):
        out = orig_pad(self, num_q_tokens, max_kv_read, use_decode_fast_path)
        pads.append(((num_q_tokens, max_kv_read), out))
        return out

    def warm(self, *args, **kwargs):
        warmups.append(1)
        return orig_warm(self, *args, **kwargs)

    monkeypatch.setattr(runner.ModelRunner, "__init__", init)
    monkeypatch.setattr(runner.ModelRunner, "maybe_pad_inputs", pad)
    monkeypatch.setattr(runner.ModelRunner, "run_one_warmup", warm)
    return pads, warmups


PADDED = {"q_padding_interval_size": 8, "kv_padding_interval_size": 16}


def test_engine_padded_inputs_and_warmup_are_clean(llama, engine_padding):
    padded = PADDED
    base = run_workload(llama, canary=False, cb=padded)
    pads, warmups = engine_padding
    del pads[:], warmups[:]
    run = run_workload(llama, cb=padded)
    assert run.violations == [] and run.tokens == base.tokens and run.stats["forwards"] > 0
    # the engine really padded (query tokens past the batch's) and warmed up with its fake requests
    assert warmups and any(out[0] > got[0] for got, out in pads), pads[:4]


@pytest.mark.parametrize("bug", sorted(hf_bugs.BUGS))
def test_planted_bug_is_reported_over_padded_inputs_after_warmup(llama, engine_padding, bug):
    # the engine's warm-up runs fake requests first: a bug planted into one of them would vanish in the
    # cache reset after it, so every planted bug must still take effect on a real request, and be reported
    skip_on_517(bug)
    if bug in WRITE_ONLY_BUGS:
        pytest.skip(WRITE_ONLY_BUGS[bug])
    planted = run_workload(llama, bug=bug, cb=PADDED)
    assert planted.violations, f"{bug}: no violation over the engine's padded inputs"
    EXPECTED[bug](lambda rid: planted.names.get(rid, ""), planted.violations)


def test_with_the_graphs_paddings_the_mask_reset_short_bug_changes_no_mask_cell(llama, engine_padding, monkeypatch):
    # the engine's inputs padded as its CUDA graphs pad them (GRAPHS' intervals, on any device): every mask the bug
    # hands attention is the clean run's, cell for cell, so the canary rightly reports nothing (INERT_WITH_GRAPHS)
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    masks, orig = [], ContinuousBatchingIOs.get_model_kwargs

    def kwargs(self, use_padding=False):
        out = orig(self, use_padding)
        masks.append(((self.num_q_tokens, self.max_kv_read), out["attention_mask"].clone()))
        return out

    monkeypatch.setattr(ContinuousBatchingIOs, "get_model_kwargs", kwargs)
    clean = run_workload(llama, canary=False)
    clean_masks = masks[:]
    del masks[:]
    run = run_workload(llama, bug="mask-reset-short")
    assert {shape for shape, _ in clean_masks} == {(16, 384)}  # (the padded sizes the comment above names)
    assert len(masks) == len(clean_masks) > 10
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(masks, clean_masks))
    assert run.violations == [] and run.tokens == clean.tokens and run.stats["attention_checks"] > 0


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the engine's CUDA graphs need CUDA")
def test_engine_cuda_graphs_clean_run_matches_and_reports_nothing(llama):
    base = run_workload(llama, canary=False, cb=GRAPHS)
    run = run_workload(llama, cb=GRAPHS)
    # (one assert each, with what differed: a failure's one-line summary in a GPU log names which it was)
    assert run.violations == [], [v.block().splitlines()[0] for v in run.violations[:3]]
    assert run.stats["forwards"] > 0
    assert run.tokens == base.tokens, _first_difference(run.tokens, base.tokens)
    eager = run_workload(llama, canary=False).tokens
    assert run.tokens == eager, ("graphs against no graphs", _first_difference(run.tokens, eager))


def _first_difference(a: dict, b: dict) -> str:
    """Where two runs' tokens (request id -> tokens) first differ, for an assert's message."""
    for rid in sorted(set(a) | set(b)):
        x, y = a.get(rid), b.get(rid)
        if x != y:
            if x is None or y is None:
                return f"request {rid}: only in one run"
            j = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return f"request {rid}, token {j}: {x[j:j + 3]} vs {y[j:j + 3]}"
    return "no difference"


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the engine's CUDA graphs need CUDA")
@pytest.mark.parametrize("bug", sorted(hf_bugs.BUGS))
def test_planted_bug_is_reported_with_engine_cuda_graphs(llama, bug):
    skip_on_517(bug)
    if bug in WRITE_ONLY_BUGS:
        pytest.skip(WRITE_ONLY_BUGS[bug])
    run = run_workload(llama, bug=bug, cb=GRAPHS)
    if bug in INERT_WITH_GRAPHS:  # the bug changes nothing here: nothing to report, the clean run's tokens
        assert run.violations == [], [v.block().splitlines()[0] for v in run.violations[:3]]
        assert run.tokens == run_workload(llama, canary=False, cb=GRAPHS).tokens
        return
    assert run.violations, f"{bug}: no violation with the engine's CUDA graphs on"
    EXPECTED[bug](lambda rid: run.names.get(rid, ""), run.violations)


def nan_filled_cache(monkeypatch) -> None:
    """transformers' paged cache allocated NaN-filled: 5.17's ``torch.empty`` leaves whatever memory held
    (5.18+ zero their byte tensor, the NaN bytes here stand for an engine that does not)."""
    from transformers.generation.continuous_batching import cache as cb_cache

    class NanAllocator:  # the cache module's torch, with its cache allocation returning NaN-filled memory
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*shape, **kw):
            return torch.full(*shape, float("nan"), **kw) if len(shape) == 1 else torch.empty(*shape, **kw)

        @staticmethod
        def zeros(*shape, **kw):  # (the sector cache's one byte tensor: all-ones bytes are NaN at any width)
            if len(shape) == 1 and kw.get("dtype") == torch.uint8:
                return torch.full(shape, 255, **kw)
            return torch.zeros(*shape, **kw)

    monkeypatch.setattr(cb_cache, "torch", NanAllocator())


def test_a_planted_bug_reports_whatever_the_allocator_left_in_the_pool(llama, monkeypatch):
    """transformers allocates the paged cache with ``torch.empty``; a never-written slot then holds whatever
    was in that memory. With NaNs there, attention's output made the sampler fail before the canary's work
    of that step ran (a device-side assert on CUDA, an error ending the generation loop on the CPU): the
    planted-bug harness zeroes the pool first, so the run is the canary's report, not the allocator's luck."""
    nan_filled_cache(monkeypatch)
    run = run_workload(llama, bug="never-written")
    assert run.violations and all(toks for toks in run.tokens.values())
    check_never_written(run.violations)


def test_check_before_forward_raises_before_a_forward_that_would_fail_on_what_it_reads(llama, monkeypatch):
    """The same NaN-filled pool without the harness's zeroing: by default the sampler fails on the forward's
    NaN output before the canary's report of that step; with ``check_before_forward`` (mode "raise") the
    canary raises the never-written read before the forward runs. (The default run only on the CPU: on
    CUDA the sampler's failure is a device-side assert, which ends the process.)"""
    nan_filled_cache(monkeypatch)
    monkeypatch.setattr(hf_bugs, "_zero_pool", lambda bp: None)
    if DEVICE.type != "cuda":
        late = run_workload(llama, bug="never-written")
        assert not late.violations and not any(late.tokens.values())  # the sampler ended the run first
    with pytest.raises(KvCanaryViolationError) as err:
        run_workload(llama, bug="never-written", mode="raise", check_before_forward=True)
    check_never_written(err.value.violations)


def test_raise_mode_surfaces_the_violation_to_the_caller(llama):
    undo = hf_bugs.plant(llama, "flip-kv")
    handle = attach(llama, mode="raise")
    try:
        with pytest.raises(KvCanaryViolationError, match="verify_real_kv_hash"):
            run_plain(llama)
        assert handle.errors and isinstance(handle.errors[0], KvCanaryViolationError)
    finally:
        handle.detach()
        undo()
    assert "generate_batch" not in vars(llama) and "init_continuous_batching" not in vars(llama)


def test_hook_exception_surfaces_to_the_caller(llama, monkeypatch):
    from kvcanary.integrations.transformers import batch as hf_batch

    def broken(self, copy=True, padded=False):
        raise ZeroDivisionError("adapter bug")

    monkeypatch.setattr(hf_batch.BatchBuilder, "host_part", broken)  # both the eager and the graphed step call it
    handle = attach(llama)
    with pytest.raises(ZeroDivisionError, match="adapter bug"):
        run_plain(llama)
    handle.detach()


def run_plain(model):
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1)
    cbc = ContinuousBatchingConfig(block_size=4, num_blocks=64, max_batch_tokens=16, use_async_batching=False,
                                   use_cuda_graph=False)
    return model.generate_batch(demo_prompts(512), generation_config=gen, continuous_batching_config=cbc)


def plant_local(model, planter):
    """Plant a test-local engine bug (same mechanism as hf_bugs.plant)."""
    orig_init = model.init_continuous_batching
    state = {"fired": False}

    def init(*a, **k):
        manager = orig_init(*a, **k)
        orig_create = manager._create_batch_processor

        def create():
            bp = orig_create()
            if not state.get("bp"):
                state["bp"] = bp
                planter(bp, state)
            return bp

        manager._create_batch_processor = create
        return manager

    return rebind(model, init)


def flip_sliding_kv(bp, state):
    orig, cache = bp._generation_step, bp.cache
    lay = reach(layout_of(cache))
    sliding_layer = lay_types(cache).index("sliding_attention")

    def step(model):
        orig(model)
        for fs in bp.inputs_and_outputs.requests_in_batch:
            st, past = fs.state, fs.state.position_offset - fs.query_length
            table = lay.block_table(lay.swa_group).get(st.request_id, [])
            if past >= 3 and table and not state["fired"]:
                state["fired"] = True
                r = (past - 1) % cache.config.sliding_window
                slot = lay.slot(table[r // lay.block_size], r % lay.block_size, group=lay.swa_group)
                lay.k_row(sliding_layer, slot).view(torch.uint8).view(-1)[1] ^= 0x10
                state["slot"] = slot
                return

    bp._generation_step = step


def lay_types(cache):
    from kvcanary.integrations.transformers.layout import layer_types

    return layer_types(cache.config)


def swap_sliding_blocks(bp, state):
    orig, cache = bp.update_batch, bp.cache
    lay = reach(layout_of(cache))

    def update_batch():
        orig()
        tables = [t for t in lay.block_table(lay.swa_group).values() if len(t) >= 2]
        if tables and not state["fired"]:
            state["fired"] = True
            tables[0][0], tables[0][1] = tables[0][1], tables[0][0]

    bp.update_batch = update_batch


def test_sliding_window_bugs(hybrid):
    state_holder = []
    for planter, tag, bit in ((flip_sliding_kv, "TAIL_K_SWA", FailReason.VERIFY_REAL_KV_HASH),
                              (swap_sliding_blocks, "HEAD_K_SWA", FailReason.VERIFY_POSITION)):
        undo = plant_local(hybrid, planter)
        try:
            run = run_workload(hybrid, max_new_tokens=14)
        finally:
            undo()
        assert run.violations, planter.__name__
        assert {v.launch_tag.endswith("_SWA") for v in run.violations} == {True}, planter.__name__
        first = run.violations[0]
        assert first.launch_tag == tag and first.fail_reason & bit, str(first)
        state_holder.append(first)


def restore_into_wrong_order(bp, state):
    om = bp.offloading_manager
    orig = om.restore_scheduled_requests

    def restore(requests_in_batch):
        for fs in requests_in_batch:
            rid = fs.state.request_id
            cpu = om._request_id_to_cpu_blocks.get(rid)
            # (5.17: a list of CPU blocks; 5.18+: one list per allocator)
            lists = list(cpu.values()) if isinstance(cpu, dict) else [cpu] if cpu else []
            if fs.state.is_cpu_offloaded and any(len(c) >= 2 for c in lists) and not state["fired"]:
                state["fired"] = True
                for c in lists:
                    c.reverse()  # the H2D copy lands each block in another block's place
        orig(requests_in_batch)

    om.restore_scheduled_requests = restore


def test_offload_restore_bug(llama):
    undo_bug = plant_local(llama, restore_into_wrong_order)
    undo_pool = enable_cpu_pool(llama)
    try:
        run = run_workload(llama, **PRESSURE)
    finally:
        undo_pool()
        undo_bug()
    assert run.stats["restored_requests"] > 0 and run.violations
    first = run.violations[0]
    assert first.launch_tag == "TAIL_K_FULL" and first.reasons == ("verify_real_kv_hash",)


def test_long_decode(llama):
    # 120 decode steps of one request: per-request buffers grow with the sequence, not per step.
    prompts = [[(7 * i + 1) % 512 for i in range(9)]]
    base = run_workload(llama, canary=False, prompts=prompts, max_new_tokens=120, num_return_sequences=1)
    run = run_workload(llama, prompts=prompts, max_new_tokens=120, num_return_sequences=1, token_oracle=False)
    assert run.violations == [] and run.tokens == base.tokens and run.stats["forwards"] >= 120


# -- the write and attention-metadata checks (docs/write_check.md) --------------------------------------------
def test_a_sliding_window_write_of_v_into_the_k_cache_is_reported(hybrid):
    skip_on_517("sliding-v-into-k")
    run = run_workload(hybrid, bug="sliding-v-into-k", max_new_tokens=14)
    check_write_kv(run.violations, "TAIL_K_SWA", "K of layer 1 (swa group)")


@pytest.mark.parametrize("bug", ["write-k-only", "mask-reset-short"])
def test_without_the_write_and_attention_checks_the_bugs_go_unseen(llama, bug):
    skip_on_517(bug)
    # the twin of the planted runs: the record checks alone certify the wrong bytes (TAIL hashes what the slot
    # holds) and never look at the mask, so nothing is reported; the checks' own counters say they were off
    run = run_workload(llama, bug=bug, write_check=False, attention_check=False)
    assert run.violations == [] and run.stats["write_check_notes"] == 0 and run.stats["attention_checks"] == 0
    on = run_workload(llama, bug=bug)
    assert on.violations and on.stats["write_check_notes"] > 0 and on.stats["attention_checks"] > 0
