"""A KV layout that interleaves tokens (vLLM's CPU amx kernel): the canary hashes token-row copies of the
fingerprinted heads, refreshed from the cache after each forward (kvcanary/integrations/vllm/mirror.py)."""

import types

import numpy as np
import pytest
import torch

from kvcanary.integrations.vllm import engine
from kvcanary.integrations.vllm.layout import KvLayout, probe_rows, probe_token_map
from kvcanary.integrations.vllm.mirror import RowMirror

AMX = torch.cpu._is_amx_tile_supported()
needs_amx = pytest.mark.skipif(not AMX, reason="this CPU has no AMX tiles: vLLM never picks its amx kernel here")
BS, HD = 32, 32


def _isas():
    # vec keeps V in rows and K transposed (a map all the same); amx interleaves both, where the CPU has it
    return ["vec", pytest.param("amx", marks=needs_amx)]


@pytest.mark.parametrize("isa", _isas())
def test_the_mirror_holds_each_tokens_values_in_order_as_the_cache_write_stored_them(isa):
    from vllm import _custom_ops as ops

    dtype = torch.bfloat16
    maps = probe_token_map(isa, dtype, BS, HD, "auto")
    assert maps is not None and all(sorted(m.tolist()) == list(range(BS * HD)) for m in maps)
    blocks, heads = 3, 2
    cache = torch.zeros(blocks, heads, BS, 2 * HD, dtype=dtype)
    key_cache, value_cache = cache.view(blocks, heads, 2 * BS, HD).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([BS + 0, BS + 1, BS + 17, 2 * BS + 5, 2 * BS + BS - 1])
    k = torch.randn(len(slots), heads, HD, generator=gen).to(dtype)
    v = torch.randn(len(slots), heads, HD, generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, kv_cache_dtype="auto")
    lay = KvLayout(blocks, BS, heads, HD, ("l0",), (cache,), isa=isa, token_maps=maps)
    picks = [(0, 0, "k"), (0, 1, "k"), (0, 0, "v"), (0, 1, "v")]
    mirror = RowMirror(lay, picks)
    mirror.refresh(torch.tensor([1, 2]))
    for layer, head, kind in picks:
        rows = mirror.rows[(layer, head, kind)].view(blocks * BS, HD)
        want = (k if kind == "k" else v)[:, head]
        assert torch.equal(rows[slots], want), (isa, head, kind)
        assert not rows[:BS].any()  # (block 0 was not refreshed: its copy is untouched)
    # the source addresses slot s as its copy's row s: SPEC 3.4's contiguous bytes
    src = mirror.source((0, 1, "v"))
    assert src.page_size == BS and src.num_bytes_per_token == HD * 2 and src.num_slots == blocks * BS
    # a changed value in the cache (token 17's value 3 of block 1's head-0 K) is that value in the copy after the
    # next refresh of its block, and nothing else is
    region = cache.view(blocks, heads, 2, BS * HD)[1, 0, 0]
    region[int(maps[0][17 * HD + 3])] += 1
    before = mirror.rows[(0, 0, "k")].clone()
    mirror.refresh(torch.tensor([1]))
    after = mirror.rows[(0, 0, "k")]
    assert (after != before).nonzero().tolist() == [[1, 17 * HD + 3]]


def test_a_forwards_blocks_are_those_its_reads_and_writes_name_within_the_pool():
    lay = types.SimpleNamespace(block_size=4, num_blocks=5)
    m = RowMirror.__new__(RowMirror)
    m.layout = lay
    fwd = types.SimpleNamespace(reads=np.array([4, 5, 6, 13, 4], dtype=np.int64), slots=np.array([7, 19, 40, -3]))
    assert m.blocks_of(fwd).tolist() == [1, 3, 4]


def test_no_map_where_the_cache_converts_what_it_stores_or_values_are_not_exact():
    assert probe_token_map("vec", torch.bfloat16, BS, HD, "fp8") is None
    assert probe_token_map("vec", torch.bfloat16, BS, 512, "auto") is None  # (bf16 holds 1 .. 256 exactly)


@needs_amx
def test_on_amx_bf16_is_guarded_through_the_mirror_clean_and_same_tokens(model_dir, prompts):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    assert _get_attn_isa(torch.bfloat16, BS, HD) == "amx" and probe_rows("amx", torch.bfloat16, BS, HD, "auto") == (
        False, False)
    with engine.guarded(False):
        llm = engine.start(model_dir, num_blocks=32, dtype="bfloat16")
        want = engine.generate(llm, prompts, max_tokens=8)
        engine.stop(llm)
    with engine.guarded(True, KV_CANARY_MODE="log"):
        llm = engine.start(model_dir, num_blocks=32, dtype="bfloat16")
        got = engine.generate(llm, prompts, max_tokens=8)
        from kvcanary.integrations.vllm import collect

        report = collect(llm)
        engine.stop(llm)
    assert got == want
    assert report.clean and report.forwards > 0, report.violations[:2]


@needs_amx
@pytest.mark.parametrize("bug, reason", [("v-write-dropped", "write_kv"), ("zero-delivered-block", "verify_real_kv_hash")])
def test_on_amx_wrong_bytes_are_reported_through_the_copies(bug, reason):
    # (a store that never writes V: the write check; KV erased after it was written: the real-KV hash at a later read)
    from kvcanary.sim.vllm_cases import judge

    v = judge(bug, engine={"dtype": "bfloat16"})
    assert v["verdict"] == "harmful" and v["detected"] and v["violations"] > 0, v
    assert any(reason in line for line in v["canary_first"]), v


@needs_amx
def test_on_amx_a_sweep_is_refused_with_the_mirror(model_dir):
    with engine.guarded(True, KV_CANARY_SWEEP_INTERVAL="4"), pytest.raises(
            Exception, match="KV_CANARY_SWEEP_INTERVAL 0 with a layout the canary hashes through token-row copies"):
        engine.start(model_dir, num_blocks=32, dtype="bfloat16")


@needs_amx
def test_on_amx_separate_v_records_are_allowed_and_clean(model_dir, prompts):
    # (the copies hold K in token rows too: K records hash K and V records V, which vec's transposed K refuses)
    from kvcanary.integrations.vllm import collect

    with engine.guarded(True, KV_CANARY_CHECK_V="1"):
        llm = engine.start(model_dir, num_blocks=32, dtype="bfloat16")
        engine.generate(llm, prompts, max_tokens=4)
        report = collect(llm)
        engine.stop(llm)
    assert report.clean and report.forwards > 0, report.violations[:2]
