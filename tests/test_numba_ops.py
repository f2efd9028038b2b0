"""What the numba backend adds beyond the shared op cases: its cache of numpy views must follow the tensors.

The cross-backend cases (test_ops_cases.py, test_ops_fuzz.py, test_ops_sglang.py) compare every op with
the reference; these check that cached views never keep a tensor alive, never outlive it, and never
write into memory a tensor has left.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from kvcanary import ops
from kvcanary.format import LaunchTag, RealKvMode
from kvcanary.ops import api

if not api.numba_available():
    pytest.skip("numba is not installed (pip install 'kv-canary[cpu]')", allow_module_level=True)

from kvcanary.ops import numba_ops, numba_views  # noqa: E402 - only importable with numba


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
    assert all(entry[0]() is not None for views in numba_views._VIEWS.values() for entry in views.values())


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


def _toy_run(fused: bool, bug: str | None, monkeypatch):
    from kvcanary.runtime.launch import ForwardLauncher
    from tests.toy_engine import ToyEngine

    calls = []
    orig = ForwardLauncher._fused

    def fused_phase(self, phase, *lead):
        done = orig(self, phase, *lead) if fused else False
        calls.append(done)
        return done

    monkeypatch.setattr(ForwardLauncher, "_fused", fused_phase)
    feed = None
    if bug == "input":  # an engine that feeds another token than it meant (write-input assert)
        feed = lambda b: b.input_ids.__setitem__(0, 999)  # noqa: E731
    engine = ToyEngine(backend="numba", real_kv="all", token_history="append", oracle=True, record_stride=48)
    engine.add(1, [5, 6, 7, 8])
    engine.add(2, [9, 10, 11])
    engine.forward([(1, 4), (2, 3)])
    engine.add(3, [5, 13], share_from=1, shared=1)  # (once request 1 has slots: slot 0 is reserved)
    for step in range(6):
        corrupt = None
        if bug == "table" and step == 3:  # a stale table cell: request 2 reads request 1's slot
            corrupt = None
            engine.rtt[engine.reqs[2]["row"], 1] = engine.slot(1, 1)
        if bug == "kv" and step == 2:
            corrupt = lambda e: e.k.__setitem__((e.slot(2, 1), 0, 0), 42.0)  # noqa: E731
        engine.forward([(1, 1), (2, 1), (3, 1)], corrupt=corrupt, feed=feed if step == 4 else None)
    c = engine.canary
    rows = sorted(v.log_line() for v in c.flush())
    bufs = [b.clone() for g in c.groups for b in g.bufs.values()]
    return calls, rows, bufs, c.counters.clone()


@pytest.mark.parametrize("bug", [None, "table", "kv", "input"])
def test_fused_head_and_tail_match_the_separate_calls_bit_for_bit(bug, monkeypatch):
    # plan + HEAD verify + HEAD write, and TAIL verify + write + step, each one compiled call: same
    # records, violations and counters as the ops one by one
    calls, rows, bufs, counters = _toy_run(True, bug, monkeypatch)
    calls0, rows0, bufs0, counters0 = _toy_run(False, bug, monkeypatch)
    assert all(calls) and len(calls) == 2 * 7 and not any(calls0)
    assert rows == rows0 and bool(rows) == (bug is not None)
    assert all(torch.equal(a, b) for a, b in zip(bufs, bufs0)) and torch.equal(counters, counters0)


def test_fused_calls_keep_their_arguments_only_while_every_tensor_stays_put():
    # numba_ops._packed: the numpy arguments of a fused call are rebuilt when a tensor is another object,
    # moved, resized or restrided, and never kept where one of them is a copy made once (stale values)
    made = []

    def make_for(*ts):
        def make():
            made.append(1)
            args = numba_views._Args()
            for t in ts:
                args.i64(t)
            return args
        return make

    pack = numba_ops._packed
    a, b = torch.arange(6), torch.zeros(3, dtype=torch.int64)
    first = pack("test", (a, b, None), make_for(a, b))
    assert pack("test", (a, b, None), make_for(a, b)) is first and len(made) == 1
    a[0] = 7  # the kept arguments are views: they read the tensor's values as they are now
    assert first.call()[0][0] == 7
    pack("test", (torch.arange(6), b, None), make_for(a, b))  # another object, same values
    assert len(made) == 2
    pack("test", (a, b, b), make_for(a, b))  # a tensor where there was None
    pack("test", (a, b, None), make_for(a, b))
    assert len(made) == 4
    a.resize_(8)  # resized in place: same object, another shape (and maybe address)
    pack("test", (a, b, None), make_for(a, b))
    assert len(made) == 5
    a.set_(a.untyped_storage(), 0, (4,), (2,))  # restrided in place: now a copy, made anew every call
    pack("test", (a, b, None), make_for(a, b))
    pack("test", (a, b, None), make_for(a, b))
    assert len(made) == 7
    c = torch.arange(3, dtype=torch.int32)  # an int32 view: kept, its int64 copy made at each call
    kept = pack("test", (c, b, None), make_for(c, b))
    assert pack("test", (c, b, None), make_for(c, b)) is kept and len(made) == 8
    c[1] = 40
    got = kept.call()[0]
    assert got.dtype == np.int64 and got.tolist() == [0, 40, 2]
    assert not make_for(a, b)().views and make_for(c, b)().views  # (what decided the two cases above)


def test_a_device_tensor_is_refused_with_a_clear_error_not_read_as_host_memory():
    # numpy views are built from the data pointer: a CUDA tensor's address read as host memory crashed the process
    # (seen on a GPU with the attention pass); a tensor off the CPU is refused before any view is made
    from kvcanary.ops.numba_views import _i64, _raw

    meta = torch.zeros(4, dtype=torch.int64, device="meta")
    for view in (_raw, _i64):
        with pytest.raises(ValueError, match="numba backend reads CPU tensors only.*meta"):
            view(meta)
    assert _raw(torch.arange(4)).tolist() == [0, 1, 2, 3]  # (CPU tensors still read in place)
