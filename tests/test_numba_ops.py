"""What the numba backend adds beyond the shared op cases: its cache of numpy views must follow the tensors.

The cross-backend cases (test_ops_cases.py, test_ops_fuzz.py, test_ops_sglang.py) compare every op with
the reference; these check that cached views never keep a tensor alive, never outlive it, and never
write into memory a tensor has left.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvcanary import ops
from kvcanary.format import LaunchTag, RealKvMode
from kvcanary.ops import api

if not api.numba_available():
    pytest.skip("numba is not installed (pip install 'kv-canary[cpu]')", allow_module_level=True)

from kvcanary.ops import numba_ops  # noqa: E402 - only importable with numba


def t(xs):
    return torch.tensor(xs, dtype=torch.int64)


def _write(buf, ring, counters, backend, sources=(), locs=(3, 4), step=5):
    p = ops.Plan.allocate(8, 1)
    ops.plan(req_pool_indices=t([1]), prefix_lens=t([0]), extend_lens=t([len(locs)]),
             req_to_token=torch.arange(16, dtype=torch.int64).reshape(2, 8), out=p, backend=backend)
    ops.write(buf=buf, plan=p, num_requests=1, out_cache_loc=t(list(locs)), input_ids=t([7] * len(locs)),
              positions=t(list(range(len(locs)))), ring=ring, counters=counters, launch_tag=LaunchTag.HEAD_K_FULL,
              sources=sources, real_kv_mode=RealKvMode.ALL if sources else RealKvMode.NONE,
              writer_ids=t([9]), step=t([step]), backend=backend)


def test_cached_views_do_not_keep_tensors_alive():
    kv = torch.randn(4, 8, 16)
    src = ops.RealKvSource(kv, page_size=8, num_bytes_per_token=64, read_bytes=64)
    buf, ring, counters = ops.allocate_canary_buffer(32, 48), ops.ViolationRing.allocate(4), ops.allocate_counters()
    _write(buf, ring, counters, "numba", sources=(src,))
    refs = [weakref.ref(x) for x in (buf, kv, ring.rows, counters)]
    del kv, src, buf, ring, counters
    gc.collect()
    assert [r() for r in refs] == [None] * 4
    # the entries of the dead tensors left with them
    assert all(entry[0]() is not None for views in numba_ops._VIEWS.values() for entry in views.values())


@pytest.mark.parametrize("move", ["set_", "resize_"])
def test_a_buffer_whose_memory_moved_is_read_again(move):
    bufs = {b: ops.allocate_canary_buffer(32, 48) for b in ("reference", "numba")}
    for backend, buf in bufs.items():
        ring, counters = ops.ViolationRing.allocate(4), ops.allocate_counters()
        _write(buf, ring, counters, backend)
        if move == "set_":
            buf.set_(torch.zeros(64, 48, dtype=torch.uint8).untyped_storage(), 0, (64, 48), (48, 1))
        else:
            buf.resize_(64, 48).zero_()  # a larger buffer: new memory, same tensor object
        _write(buf, ring, counters, backend, locs=(5, 6, 40), step=6)
    assert torch.equal(bufs["numba"], bufs["reference"])
    assert bufs["numba"][40].any()


def test_kv_pages_rewritten_between_calls_are_hashed_again():
    kv = torch.randn(4, 8, 16, dtype=torch.float32).to(torch.bfloat16)
    src = ops.RealKvSource(kv, page_size=8, num_bytes_per_token=32, read_bytes=32)
    slots = t([0, 5, 9, 31, 32, -1])
    first = ops.fingerprint(slots, (src,), RealKvMode.ALL, backend="numba")
    kv.add_(1)  # same tensor, same memory, new bytes: a view sees them
    second = ops.fingerprint(slots, (src,), RealKvMode.ALL, backend="numba")
    assert torch.equal(second, ops.fingerprint(slots, (src,), RealKvMode.ALL, backend="reference"))
    assert not torch.equal(first[:4], second[:4]) and torch.equal(first[4:], second[4:])


def test_strided_plan_buffers_fall_back_to_the_same_bits():
    def plan_of(backend):
        base = ops.Plan.allocate(16, 2)
        wide = torch.zeros(32, dtype=torch.int64)
        base.entries.slot = wide[::2]  # a hand-built, non-contiguous output
        ops.plan(req_pool_indices=t([1, 2]), prefix_lens=t([3, 2]), extend_lens=t([1, 1]),
                 req_to_token=torch.arange(24, dtype=torch.int32).reshape(3, 8), out=base, backend=backend)
        return base

    ref, fast = plan_of("reference"), plan_of("numba")
    for name in ("slot", "position", "prev", "expected_token", "count", "enable", "requested"):
        assert torch.equal(getattr(fast.entries, name), getattr(ref.entries, name)), name
    assert torch.equal(fast.write_offsets, ref.write_offsets) and torch.equal(fast.seed_slot, ref.seed_slot)


@pytest.mark.parametrize("offset", [0, 4, 9], ids=lambda o: f"offset-{o}")
@pytest.mark.parametrize("mode", [RealKvMode.PARTIAL, RealKvMode.ALL], ids=lambda m: m.name)
def test_kv_pages_off_an_8_byte_boundary_hash_like_the_reference(offset, mode):
    # Pages starting `offset` bytes into their storage: aligned ones are read as words, others byte by byte.
    g = torch.Generator().manual_seed(offset)
    raw = torch.randint(0, 256, (offset + 5 * 64,), dtype=torch.uint8, generator=g)
    kv = raw[offset:].view(5, 64)  # 5 pages of 2 tokens x 32 bytes
    src = ops.RealKvSource(kv, page_size=2, num_bytes_per_token=32, read_bytes=32)
    slots = t([-1, 0, 1, 2, 5, 9, 10, 1 << 40])
    want = ops.fingerprint(slots, (src, src), mode, backend="reference")
    assert torch.equal(ops.fingerprint(slots, (src, src), mode, backend="numba"), want)
