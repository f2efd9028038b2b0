"""The slot checks' device passes (kvcanary/ops/slot_ops.py, triton_slots.py): reference, tensor ops and Triton
agree on the ring's rows (as a multiset: Triton appends with an atomic per block) and its write index, on seeded
random cases with reserved slots, padding, overflowing rings and planted NaN / Inf of every float width."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import DEVICE, HAS_TRITON
from kvcanary.format import FailReason
from kvcanary.ops import Entries, RealKvSource, ViolationRing
from kvcanary.ops.slot_ops import NO_HIT, slot_impl

IMPLS = ["torch"] + (["triton"] if HAS_TRITON else [])
NUM_SLOTS = 96
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _ring(capacity: int) -> ViolationRing:
    return ViolationRing.allocate(capacity, DEVICE)


def _rows(ring: ViolationRing) -> tuple:
    n = min(int(ring.write_index[0]), ring.capacity)
    return int(ring.write_index[0]), sorted(map(tuple, ring.rows[:n].tolist()))


def _same(backend: str, call, fresh) -> None:
    """``call(impl, args)`` on fresh arguments for the reference and ``backend``: the same rows and count; where
    the ring overflowed, the same count and rows the reference could have stored (any subset of its rows)."""
    want_args, got_args = fresh(), fresh()
    call(slot_impl("reference"), want_args)
    call(slot_impl(backend), got_args)
    (want_n, want), (got_n, got) = _rows(want_args["ring"]), _rows(got_args["ring"])
    assert got_n == want_n
    if want_n <= want_args["ring"].capacity:
        assert got == want
    else:  # (which rows land first is the atomics' order on a GPU)
        full = _rows_unbounded(call, fresh)
        assert all(row in full for row in got) and len(got) == len(want)


def _rows_unbounded(call, fresh) -> list:
    args = fresh()
    args["ring"] = _ring(4096)
    call(slot_impl("reference"), args)
    return _rows(args["ring"])[1]


def _reserved_mask(rng: random.Random) -> torch.Tensor:
    mask = torch.zeros(NUM_SLOTS, dtype=torch.bool)
    mask[[0, *rng.sample(range(1, NUM_SLOTS), 6)]] = True
    return mask.to(DEVICE)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", range(6))
def test_reserved_reads_agree(impl, seed):
    rng = random.Random(seed)
    cap = rng.choice([1, 7, 40, 300])
    count = rng.randint(-1, cap + 2) if seed else cap
    bound = rng.choice([None, rng.randint(0, cap + 3)])
    mask = _reserved_mask(rng)
    slot = [rng.choice([-3, 0, NUM_SLOTS, NUM_SLOTS + 5, *range(1, NUM_SLOTS)]) for _ in range(cap)]

    def fresh():
        e = Entries.allocate(cap, DEVICE)
        e.slot.copy_(torch.tensor(slot))
        e.position.copy_(torch.randint(0, 1000, (cap,), generator=torch.Generator().manual_seed(seed)))
        e.prev.copy_(e.slot - 1)
        e.expected_token.copy_(e.position * 7 - 3)
        e.count.fill_(min(count, cap))
        e.enable.fill_(0 if seed == 5 else 1)
        return dict(entries=e, reserved=mask, ring=_ring(rng.choice([2, 64]) if seed % 2 else 64),
                    launch_tag=3, bound=bound)

    _same(impl, lambda m, a: m.reserved_reads(**a), fresh)
    if seed == 0:  # every reserved slot among the reads is reported, the padding slot 0 included
        args = fresh()
        slot_impl(impl).reserved_reads(**args)
        hits = sum(1 for s in slot[:bound if bound is not None else cap] if 0 <= s < NUM_SLOTS and mask[s])
        assert int(args["ring"].write_index[0]) == hits > 0


def _write_batch(rng: random.Random, n: int, requests: int):
    cuts = sorted(rng.sample(range(1, n), requests - 1)) if requests > 1 else []
    live = rng.randint(cuts[-1] if cuts else 0, n)
    offsets = [0, *cuts, live] + [0] * 3
    return torch.tensor(offsets, device=DEVICE)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", range(6))
def test_reserved_writes_agree(impl, seed):
    rng = random.Random(100 + seed)
    n, requests = rng.choice([(5, 1), (40, 3), (1100, 4)])
    offsets = _write_batch(rng, n, requests)
    mask = _reserved_mask(rng)
    loc = torch.tensor([rng.choice([-1, 0, *range(1, NUM_SLOTS), NUM_SLOTS + 2]) for _ in range(n)], device=DEVICE)
    ids = None if seed == 3 else torch.tensor([rng.randint(0, 9999) for _ in range(requests)], device=DEVICE)

    def fresh():
        return dict(out_cache_loc=loc, write_offsets=offsets, num_requests=requests,
                    positions=torch.arange(n, device=DEVICE, dtype=torch.int32) + 5,
                    input_ids=torch.arange(n, device=DEVICE) * 3, writer_ids=ids, reserved=mask,
                    ring=_ring(3 if seed == 4 else 256), launch_tag=1)

    _same(impl, lambda m, a: m.reserved_writes(**a), fresh)


def _float_source(dtype, page_size: int, seed: int, width: int = 64) -> RealKvSource:
    g = torch.Generator().manual_seed(seed)
    rows = -(-NUM_SLOTS // page_size)
    t = torch.randn(rows, page_size * width, generator=g).to(dtype)
    nbpt = width * t.element_size()
    return RealKvSource(t.to(DEVICE), page_size=page_size, num_bytes_per_token=nbpt, read_bytes=nbpt)


def _plant(src: RealKvSource, slot: int, word: int, value: float) -> None:
    row, col = divmod(slot, src.page_size)
    width = src.num_bytes_per_token // src.tensor.element_size()
    src.tensor[row, col * width + word] = value


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", ["clean", "one", "several", "outside", "padding", "no_ids"])
def test_nonfinite_agrees(impl, dtype, case):
    rng = random.Random(hash((str(dtype), case)) % 1000)
    n, requests = 24, 3
    offsets = _write_batch(rng, n, requests)
    live = int(offsets[requests])
    loc = torch.tensor(rng.sample(range(1, NUM_SLOTS), n), device=DEVICE)
    # (a second width beside the first: the Triton pass launches once per width, over a table of its sources)
    other = torch.float16 if case in ("one", "several") else dtype
    sources = [_float_source(dtype, 1, 1), _float_source(other, 4, 2), _float_source(dtype, 2, 3)]
    ids = None if case == "no_ids" else torch.tensor([11, 22, 33], device=DEVICE)
    if case in ("one", "no_ids"):
        _plant(sources[1 if case == "one" else 2], int(loc[live // 2]), 5, float("inf"))
    elif case == "several":  # the first token wins, then its first source
        for s, t, v in ((1, 2, float("nan")), (0, 2, float("-inf")), (0, 9, float("nan"))):
            _plant(sources[s], int(loc[min(t, live - 1)]), 0, v)
    elif case == "outside":  # not live, or a slot the sources or the pool cannot hold: not looked at
        _plant(sources[0], int(loc[-1]), 3, float("nan")) if live < n else None
        loc = loc.clone()
        loc[0] = NUM_SLOTS + 7
    elif case == "padding":
        loc = loc.clone()
        loc[: live // 2] = 0
        _plant(sources[0], 0, 1, float("nan"))

    def fresh():
        return dict(out_cache_loc=loc, write_offsets=offsets, num_requests=requests,
                    positions=torch.arange(n, device=DEVICE) + 100, input_ids=torch.arange(n, device=DEVICE) * 5,
                    writer_ids=ids, num_slots=NUM_SLOTS, sources=sources, tags=torch.tensor([7, 9, 8], device=DEVICE),
                    index=torch.tensor([0, 15, 3], device=DEVICE), ring=_ring(8),
                    scratch=torch.full((1,), NO_HIT, dtype=torch.int64, device=DEVICE))

    _same(impl, lambda m, a: m.nonfinite(**a), fresh)
    args = fresh()
    slot_impl(impl).nonfinite(**args)
    found = int(args["ring"].write_index[0])
    assert found == (1 if case in ("one", "several", "no_ids") else 0)
    if found:
        row = args["ring"].rows[0].tolist()
        assert row[7] == int(FailReason.NONFINITE_KV) and row[5] == (-1 if ids is None else row[5])
        assert row[0] == {"one": 9, "several": 7, "no_ids": 8}[case]  # the source's tag
    assert int(args["scratch"][0]) == NO_HIT  # (the next forward starts clean)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_the_triton_pass_keeps_no_kv_pool_alive():
    # The Triton pass keeps a table per set of sources between forwards; an engine made per call (transformers'
    # generate_batch) must not leave its KV pool held by it once the engine is gone.
    import gc
    import weakref

    sources = [_float_source(torch.float16, 1, 1), _float_source(torch.float16, 4, 2)]
    pool = weakref.ref(sources[0].tensor)
    n = 4
    slot_impl("triton").nonfinite(
        out_cache_loc=torch.arange(1, n + 1, device=DEVICE), write_offsets=torch.tensor([0, n], device=DEVICE),
        num_requests=1, positions=torch.arange(n, device=DEVICE), input_ids=torch.arange(n, device=DEVICE),
        writer_ids=None, num_slots=NUM_SLOTS, sources=sources, tags=torch.tensor([7, 9], device=DEVICE),
        index=torch.tensor([0, 1], device=DEVICE), ring=_ring(8),
        scratch=torch.full((1,), NO_HIT, dtype=torch.int64, device=DEVICE))
    del sources
    gc.collect()
    assert pool() is None
