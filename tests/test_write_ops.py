"""The write check's passes (kvcanary/ops/write_ops.py, numba_write_ops.py, triton_write_ops.py) and the attention-
metadata pass (ops/attention_ops.py): every implementation agrees with the scalar reference bit for bit (ring rows as
a multiset: Triton appends with one atomic per block), on case tables and seeded random cases."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import DEVICE, HAS_TRITON
from kvcanary.format import MASK64, FailReason, splitmix64, to_signed
from kvcanary.ops import RealKvSource, ViolationRing
from kvcanary.ops.api import numba_available
from kvcanary.ops.attention_ops import reference_check_attention, torch_check_attention
from kvcanary.ops.write_ops import as_words, write_impl

IMPLS = ["torch"] + (["numba"] if numba_available() and DEVICE.type == "cpu" else []) + \
    (["triton"] if HAS_TRITON else [])
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _rows(ring: ViolationRing) -> tuple:
    n = min(int(ring.write_index[0]), ring.capacity)
    return int(ring.write_index[0]), sorted(map(tuple, ring.rows[:n].tolist()))


def _digest(row: torch.Tensor) -> int:
    """The write digest of a row's bytes, written out: word i (little-endian) gives splitmix64(w + (i + 1) *
    0x9E3779B97F4A7C15), the terms summed modulo 2^64."""
    data = row.contiguous().view(torch.uint8).reshape(-1).cpu().tolist()
    acc = 0
    for k in range(0, len(data), 8):
        word = int.from_bytes(bytes(data[k:k + 8]), "little")
        acc += splitmix64((word + (k // 8 + 1) * 0x9E3779B97F4A7C15) & MASK64)
    return to_signed(acc & MASK64)


@pytest.mark.parametrize("impl", ["reference", *IMPLS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [0, 1, 7, 65], ids=lambda n: f"{n}tok")
@pytest.mark.parametrize("dim", [8, 96])  # (3 x 96 elements: several tiles of words a row in the Triton kernel)
def test_hash_rows_is_the_write_digest_of_each_row_read_where_it_lies(impl, dtype, tokens, dim):
    torch.manual_seed(tokens)
    k = torch.randn(1, 3, tokens, dim, device=DEVICE).to(dtype)  # [1, heads, tokens, dim]: the engine's layout
    rows = k[0].transpose(0, 1)  # [tokens, heads, dim], a strided view
    out = torch.full((tokens + 3,), 77, dtype=torch.int64, device=DEVICE)  # (poisoned: unwritten cells stay 77)
    write_impl(impl).hash_rows(words=as_words(rows), out=out)
    assert out.tolist() == [_digest(rows[i]) for i in range(tokens)] + [77] * 3
    # with a flag (the write check's noted flag, set in the same launch): the same hashes, the flag 1, its
    # neighbours untouched, rows or none
    flags = torch.tensor([5, 0, 5], dtype=torch.int32, device=DEVICE)
    again = torch.full_like(out, 77)
    write_impl(impl).hash_rows(words=as_words(rows), out=again, flag=flags[1:2])
    assert again.tolist() == out.tolist() and flags.tolist() == [5, 1, 5]


def test_the_write_digest_changes_with_any_one_word_and_with_words_swapped():
    from kvcanary.ops.write_ops import write_digest

    rng = random.Random(3)
    for _ in range(50):
        words = [rng.getrandbits(64) for _ in range(rng.randint(2, 40))]
        base = write_digest(words)
        i, j = rng.sample(range(len(words)), 2)
        changed = list(words)
        changed[i] ^= 1 << rng.randrange(64)
        swapped = list(words)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        assert write_digest(changed) != base
        assert words[i] == words[j] or write_digest(swapped) != base
    # zeros, and words shifted by one place (a row written one word off), are not the row
    words = [rng.getrandbits(64) for _ in range(16)]
    assert write_digest([0] * 16) != write_digest(words) != write_digest([0] + words[:-1])


def _pool(rng: random.Random, dtype, num_slots=48, page_size=1, dim=16):
    """Two sources (K and V of one layer) over a pool of pages of ``dim`` elements a token, random bytes."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k = torch.randn(num_slots // page_size, page_size * dim, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(num_slots // page_size, page_size * dim, generator=g).to(dtype).to(DEVICE)
    nbpt = dim * k.element_size()
    return k, v, [RealKvSource(t, page_size=page_size, num_bytes_per_token=nbpt, read_bytes=nbpt) for t in (k, v)]


def _case(rng: random.Random, dtype, page_size=1, num_slots=48, max_len=5, max_pad=3, min_requests=0):
    """A forward's write into a pool: each token's computed K/V rows, the cache after the writes (some planted
    wrong: V never written, V into K, a short row, another slot), and the pass's other arguments."""
    dim = rng.choice([16, 160])  # (160: a token's words span several tiles of the Triton kernels)
    k_cache, v_cache, sources = _pool(rng, dtype, num_slots, page_size, dim)
    n_req = rng.randint(min_requests, 4)
    lens = [rng.randint(0, max_len) for _ in range(n_req)]
    live = sum(lens)
    pad = rng.randint(0, max_pad)
    n = live + pad
    slots = rng.sample(range(1, num_slots), live) + [0] * pad
    if live >= 2 and rng.random() < 0.5:
        slots[rng.randrange(live - 1)] = slots[live - 1]  # (a ring: one slot written twice, the last one stays)
    if live >= 2 and rng.random() < 0.5:
        slots[0] = slots[live - 1]  # (the same, the two writes often in different blocks of tokens)
    if live and rng.random() < 0.3:
        slots[rng.randrange(live)] = rng.choice([0, -1, num_slots + 5])  # (slots the check skips)
    comp_k = torch.randn(n, dim).to(dtype).to(DEVICE)
    comp_v = torch.randn(n, dim).to(dtype).to(DEVICE)
    kr, vr = k_cache.view(-1, dim), v_cache.view(-1, dim)
    for t in range(n):
        s = slots[t]
        if not 0 <= s < num_slots:
            continue
        bug = rng.random()
        kr[s] = comp_v[t] if bug < 0.1 else comp_k[t]  # V into K
        if bug > 0.9:
            continue  # V never written
        vr[s] = comp_v[t]
        if 0.8 < bug <= 0.9:
            vr[s, dim // 2:] = 0  # a write that lands short
    expected = torch.full((2, n + 2), 5, dtype=torch.int64, device=DEVICE)
    ref = write_impl("reference")
    ref.hash_rows(words=as_words(comp_k), out=expected[0])
    ref.hash_rows(words=as_words(comp_v), out=expected[1])
    offs = [0]
    for n_t in lens:
        offs.append(offs[-1] + n_t)
    offs += [0] * (6 - len(offs))
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731
    noted = [1, 1] if rng.random() < 0.8 else [1, 0]
    writers = t([rng.randrange(100) for _ in range(n_req)]) if n_req and rng.random() < 0.7 else None
    return dict(out_cache_loc=t(slots), write_offsets=t(offs), num_requests=n_req, positions=t(list(range(n))),
                input_ids=t([rng.randrange(500) for _ in range(n)]), writer_ids=writers, num_slots=num_slots,
                sources=sources, expected=expected, noted=torch.tensor(noted, dtype=torch.int32, device=DEVICE),
                tags=t([2, 3]), layers=t([4, 9]))


def _records(args, seed: int) -> tuple[list[torch.Tensor], list[int]]:
    """Two random TAIL record buffers (K's, V's) over the case's slots, and which one covers each source (K and V
    alternate, as the runtime lays its sources out)."""
    g = torch.Generator().manual_seed(seed)
    bufs = [torch.randint(-2**62, 2**62, (args["num_slots"], 8), generator=g).to(DEVICE) for _ in range(2)]
    return bufs, [s % 2 for s in range(len(args["sources"]))]


def _check_both(impl, args, seed, capacity=64):
    """(rows, record buffers after) of the reference and of ``impl`` on one case, each with its own copies of the
    record buffers (one buffer per K / V, shared by the sources it covers, as the runtime hands them)."""
    bufs, which = _records(args, seed)
    out = []
    for name in ("reference", impl):
        mine = [b.clone() for b in bufs]
        ring = ViolationRing.allocate(capacity, DEVICE)
        write_impl(name).check_writes(**args, ring=ring, records=[mine[w] for w in which])
        out.append((_rows(ring), [b.cpu() for b in mine]))
    return out, bufs


def _assert_agrees(impl, args, seed, capacity):
    """``impl``'s check reports the reference's rows, without record buffers and with them (and marks the same
    records)."""
    want, got = ViolationRing.allocate(capacity, DEVICE), ViolationRing.allocate(capacity, DEVICE)
    write_impl("reference").check_writes(**args, ring=want)
    write_impl(impl).check_writes(**args, ring=got)
    assert _rows(got) == _rows(want)
    # with the record buffers: the same rows, and the same records marked
    (ref_rows, ref_bufs), (rows, bufs) = _check_both(impl, args, seed, capacity=capacity)[0]
    assert rows == ref_rows == _rows(want)
    assert all(torch.equal(a, b) for a, b in zip(bufs, ref_bufs))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(8))
def test_check_writes_agrees_with_the_reference(impl, page_size, seed):
    rng = random.Random(seed * 10 + page_size)
    dtype = DTYPES[seed % len(DTYPES)]
    _assert_agrees(impl, _case(rng, dtype, page_size), seed, capacity=64)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", range(4))
def test_check_writes_over_many_tokens_and_padding_agrees_with_the_reference(impl, seed):
    # up to 80 live tokens and 60 padding ones: several of the Triton kernel's blocks of tokens, blocks past the
    # live tokens (they return at once), a slot written in one block and again in a later one
    rng = random.Random(1000 + seed)
    args = _case(rng, DTYPES[seed % len(DTYPES)], page_size=1 + 3 * (seed % 2), num_slots=128, max_len=20,
                 max_pad=60, min_requests=3)
    assert int(args["write_offsets"][args["num_requests"]]) > 16  # (live tokens over several blocks of 16)
    _assert_agrees(impl, args, seed, capacity=256)


def test_check_writes_names_the_write_that_went_wrong():
    k, v, sources = _pool(random.Random(0), torch.float16, 16)
    comp = torch.randn(3, 2, 16).to(torch.float16).to(DEVICE)  # [tokens, K / V, 16]
    loc = torch.tensor([3, 5, 7], device=DEVICE)
    k[loc], v[loc] = comp[:, 0], comp[:, 1]
    v[5] = 0  # token 1: V never written
    k[7] = comp[2, 1]  # token 2: V into K
    expected = torch.zeros(2, 4, dtype=torch.int64, device=DEVICE)
    for s in range(2):
        write_impl("reference").hash_rows(words=as_words(comp[:, s]), out=expected[s])
    ring = ViolationRing.allocate(8, DEVICE)
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731
    write_impl("reference").check_writes(
        out_cache_loc=loc, write_offsets=t([0, 1, 3]), num_requests=2, positions=t([10, 4, 5]),
        input_ids=t([11, 12, 13]), writer_ids=t([41, 42]), num_slots=16, sources=sources, expected=expected,
        noted=torch.ones(2, dtype=torch.int32, device=DEVICE), tags=t([2, 3]), layers=t([0, 1]), ring=ring)
    bit = int(FailReason.WRITE_KV)
    # [tag, slot, position, token, source, writer, layer, reason]: V of token 1, K of token 2 (its first source)
    assert _rows(ring) == (2, [(2, 7, 5, 13, 0, 42, 0, bit), (3, 5, 4, 12, 1, 42, 1, bit)])


# -- the attention-metadata pass ----------------------------------------------------------------------------
def _build_mask(cu_q, cu_k, window, T, K, dtype=torch.float32):
    """The mask as transformers builds it (``build_attention_mask``: causal blocks, a sliding window), in a buffer
    whose other cells are the dtype's lowest."""
    from transformers.generation.continuous_batching.utils import build_attention_mask

    mask = torch.full((1, 1, T, K), torch.finfo(dtype).min, dtype=dtype)
    build_attention_mask(mask, cu_q, cu_k, sliding_window=window + 1 if window else 1)
    return mask[0, 0]


def _attention_case(rng, window):
    n = rng.randint(1, 4)
    prefix = [rng.randint(0, 9) for _ in range(n)]
    extend = [rng.randint(1, 4) for _ in range(n)]
    rows = list(range(1, n + 1))
    pad = rng.randint(0, 2)
    rows, prefix, extend = rows + [0] * pad, prefix + [0] * pad, extend + [1] * pad
    kept = [min(p, window) if window else p for p in prefix]
    cu_q, cu_k = [0], [0]
    for r in range(n):
        cu_q.append(cu_q[-1] + extend[r])
        cu_k.append(cu_k[-1] + kept[r] + extend[r])
    T, K = sum(extend), cu_k[-1] + rng.randint(0, 3)
    pos = [p + i for p, q in zip(prefix, extend) for i in range(q)]
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    args = dict(req_pool_indices=t(rows), prefix_lens=t(prefix), extend_lens=t(extend), positions=t(pos),
                request_ids=t([100 + r for r in rows]), window=window,
                cu_seqlens_k=torch.tensor(cu_k + [cu_k[-1]] * pad, dtype=torch.int32),
                mask=_build_mask(cu_q, cu_k, window, T, K), key_slots=t(rng.sample(range(1, 200), K)),
                launch_tag=0)
    return args, cu_q, cu_k


def _attention_rows(fn, args) -> tuple:
    ring = ViolationRing.allocate(32)
    fn(**args, ring=ring)
    return _rows(ring)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("seed", range(6))
def test_attention_metadata_as_transformers_builds_it_is_clean_and_a_planted_fault_is_named(window, seed):
    pytest.importorskip("transformers")
    rng = random.Random(seed)
    args, cu_q, cu_k = _attention_case(rng, window)
    assert _attention_rows(reference_check_attention, args) == (0, [])
    assert _attention_rows(torch_check_attention, args) == (0, [])
    n = len(cu_q) - 1
    r = rng.randrange(n)
    mask = args["mask"].clone()
    t = cu_q[r]  # the request's first query row
    other = cu_k[(r + 1) % n] if n > 1 and cu_k[(r + 1) % n] < mask.shape[1] else mask.shape[1] - 1
    mask[t, other] = 0  # a stale cell: the query may attend a key that is not its own
    faulty = {**args, "mask": mask}
    want = _attention_rows(reference_check_attention, faulty)
    assert want == _attention_rows(torch_check_attention, faulty)
    if other not in range(cu_k[r], cu_k[r + 1]):  # (a column of its own block stays allowed: no row)
        bit = int(FailReason.ATTENTION_MASK)
        assert want[0] == 1 and want[1][0][5] == 100 + r + 1 and want[1][0][7] == bit and want[1][0][3] == 1
    lens = args["cu_seqlens_k"].clone()
    lens[1:] += 1  # the first request's key length one too long
    short = {**args, "cu_seqlens_k": lens, "mask": None}
    want = _attention_rows(reference_check_attention, short)
    assert want == _attention_rows(torch_check_attention, short)
    assert want[0] >= 1 and want[1][0][7] == int(FailReason.KEY_LENGTH)


def test_a_mask_that_hides_a_requests_own_key_is_named():
    pytest.importorskip("transformers")
    args, cu_q, cu_k = _attention_case(random.Random(3), 0)
    mask = args["mask"].clone()
    mask[cu_q[1] - 1, cu_k[0]] = torch.finfo(mask.dtype).min  # the first request's last query loses key 0
    rows = _attention_rows(reference_check_attention, {**args, "mask": mask})
    assert rows == _attention_rows(torch_check_attention, {**args, "mask": mask})
    assert rows[0] == 1 and rows[1][0][3:5] == (0, 1) and rows[1][0][6] == 0


@pytest.mark.parametrize("seed", range(4))
def test_batch_keys_only_compares_the_columns_before_the_batchs_last_key(seed):
    # a recorded step's mask slice is a bucket wider than the keys the engine hands attention: with
    # batch_keys_only the columns past the batch's keys (stale cells attention never reads) are not compared, the
    # columns before them as without it; the two implementations agree
    pytest.importorskip("transformers")
    rng = random.Random(seed)
    args, cu_q, cu_k = _attention_case(rng, 0)
    keys = cu_k[-1]
    bucket = torch.full((args["mask"].shape[0], keys + 5), torch.finfo(torch.float32).min)
    bucket[:, :args["mask"].shape[1]] = args["mask"]
    bucket[:, keys:] = 0  # stale cells past the keys: every query would see them
    wide = {**args, "mask": bucket, "key_slots": None}
    assert _attention_rows(reference_check_attention, wide)[0] > 0  # (compared, they are reported)
    for fn in (reference_check_attention, torch_check_attention):
        assert _attention_rows(fn, {**wide, "batch_keys_only": True}) == (0, [])
    r = rng.randrange(len(cu_q) - 1)
    bucket[cu_q[r], cu_k[r]] = torch.finfo(torch.float32).min  # the request's first query loses its first key
    want = _attention_rows(reference_check_attention, {**wide, "batch_keys_only": True})
    assert want == _attention_rows(torch_check_attention, {**wide, "batch_keys_only": True})
    assert want[0] == 1 and want[1][0][5] == int(args["request_ids"][r]) and want[1][0][6] == cu_k[r]


def _all_layers_case(rng: random.Random, layers: int = 6, page: int = 2):
    """``write_check_layers="all"``'s sources: every layer's K and V rows as views running to the end of one shared
    tensor (transformers' sector cache: a block spans every layer's K and V pages, slot = block * stride +
    offset), the first layer's K the fingerprinted template the others are laid out by (``_layer_source``)."""
    from kvcanary.runtime.batch import row_sources
    from kvcanary.runtime.write_check import _layer_source

    stride, blocks = 2 * layers * page, 6
    flat = torch.randn(blocks * stride, 2, 8).to(torch.float16).to(DEVICE)
    views = [flat[j * page:] for j in range(2 * layers)]  # (layer i: K = views[2i], V = views[2i + 1])
    template = row_sources(views[0])[0]
    sources = [template] + [_layer_source(t, views[0], template, "test") for t in views[1:]]
    slots = [b * stride + o for b in range(blocks) for o in range(page)]
    n = rng.randint(8, len(slots))
    loc = rng.sample(slots[1:], n - 1) + [0]  # (a padding token last)
    comp = torch.randn(2 * layers, n, 2, 8).to(torch.float16).to(DEVICE)
    for j, view in enumerate(views):
        for t, s in enumerate(loc):
            if s < view.shape[0] and rng.random() > 0.08 * (j >= 2):  # (some writes past the template skipped)
                view[s] = comp[(j + (rng.random() < 0.05)) % (2 * layers), t]  # (a few land in the next cache)
    expected = torch.zeros(2 * layers, n + 1, dtype=torch.int64, device=DEVICE)
    for j in range(2 * layers):
        write_impl("reference").hash_rows(words=as_words(comp[j]), out=expected[j])
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731
    return dict(out_cache_loc=t(loc), write_offsets=t([0, n - 1]), num_requests=1, positions=t(list(range(n))),
                input_ids=t([rng.randrange(500) for _ in range(n)]), writer_ids=t([7]), num_slots=blocks * stride,
                sources=sources, expected=expected,
                noted=torch.tensor([int(rng.random() < 0.9) for _ in sources], dtype=torch.int32, device=DEVICE),
                tags=t([2 + j % 2 for j in range(2 * layers)]), layers=t([j // 2 for j in range(2 * layers)]))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", range(3))
def test_check_writes_over_every_layers_sources_agrees_with_the_reference(impl, seed):
    args = _all_layers_case(random.Random(seed))
    want, got = ViolationRing.allocate(256, DEVICE), ViolationRing.allocate(256, DEVICE)
    write_impl("reference").check_writes(**args, ring=want)
    write_impl(impl).check_writes(**args, ring=got)
    assert _rows(got) == _rows(want) and int(want.write_index[0]) > 0
    assert {r[4] for r in _rows(want)[1]} - {0, 1}  # (sources past the fingerprinted ones found faults)
    (ref_rows, ref_bufs), (rows, bufs) = _check_both(impl, args, seed, capacity=256)[0]
    assert rows == ref_rows == _rows(want)
    assert all(torch.equal(a, b) for a, b in zip(bufs, ref_bufs))


@pytest.mark.parametrize("impl", ["reference", *IMPLS])
def test_a_wrong_write_marks_exactly_its_slots_record_so_no_later_read_matches(impl):
    # each reported slot's record (the one covering its first wrong source) has bit 0 of its real-KV hash flipped,
    # nothing else changes; a slot reported in both K and V marks one record (the row's); clean slots stay as they were
    found = 0
    for seed in range(6):
        args = _case(random.Random(seed), torch.float16)
        (_, _), (rows, bufs) = _check_both(impl, args, seed)[0]
        before, which = _records(args, seed)
        want = [b.cpu().clone() for b in before]
        for row in rows[1]:
            slot, s = row[1], row[4]
            want[which[s]][slot, 3] ^= 1
        assert all(torch.equal(a, b) for a, b in zip(bufs, want))
        marked = sum(int((a != b.cpu()).sum()) for a, b in zip(bufs, before))
        assert marked == rows[0] == len({r[1] for r in rows[1]})  # (one cell per reported slot)
        found += marked
    assert found >= 3  # (the cases plant wrong writes)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_source_without_rows_is_skipped_and_the_others_compared(impl):
    # (a group's pool may hold no rows yet for one source: its slots are outside it, nothing of it is read)
    empty = RealKvSource(torch.zeros(0, 16, dtype=torch.float16, device=DEVICE), page_size=1, num_bytes_per_token=32,
                         read_bytes=32)
    rng = random.Random(9)
    _, _, (full, _) = _pool(rng, torch.float16)
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731
    args = dict(out_cache_loc=t([1, 2]), write_offsets=t([0, 2]), num_requests=1, positions=t([0, 1]),
                input_ids=t([5, 6]), writer_ids=None, num_slots=8, sources=[empty, full],
                expected=torch.zeros(2, 4, dtype=torch.int64, device=DEVICE),
                noted=torch.tensor([1, 1], dtype=torch.int32, device=DEVICE), tags=t([1, 2]), layers=t([0, 3]))
    want, got = ViolationRing.allocate(16, DEVICE), ViolationRing.allocate(16, DEVICE)
    write_impl("reference").check_writes(**args, ring=want)
    write_impl(impl).check_writes(**args, ring=got)
    assert _rows(got) == _rows(want) and _rows(want)[0] == 2  # (both tokens, from the source with rows)
