"""ops.read_table: every backend writes the scalar reference's cells bit for bit (hand-made edge cases and a
seeded fuzz), the adapter's numpy host body too, and bad arguments are refused before anything is written."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conftest import DEVICE
from kvcanary import ops
from kvcanary.ops import NO_LIMIT
from kvcanary.ops.read_table_ops import numpy_read_table
from ops_harness import use_backend

MARK = -7  # every cell of out starts here: a cell left alone keeps it, a written one does not
I32, I64 = torch.int32, torch.int64


def case(rows, prefix, extend, read, clamp_max, limit=NO_LIMIT, fill=0, shape=(9, 8), out_dtype=I64,
         read_dtype=I64, index_dtype=I64, strided=False):
    n_rows, width = shape
    if strided:  # every other column of a wider table: out's rows and columns are both strided
        out = torch.full((n_rows, 2 * width), MARK, dtype=out_dtype)[:, ::2]
    else:
        out = torch.full(shape, MARK, dtype=out_dtype)
    return dict(out=out, rows=torch.tensor(rows, dtype=index_dtype), prefix=torch.tensor(prefix, dtype=index_dtype),
                extend=torch.tensor(extend, dtype=index_dtype), read=torch.as_tensor(read).to(read_dtype),
                clamp_max=clamp_max, limit=limit, fill=fill)


def run(c: dict, backend: str) -> torch.Tensor:
    """The table ``backend`` leaves, on the CPU (a fresh copy of the case's out on DEVICE)."""
    out = c["out"].to(DEVICE)
    if c["out"].stride(1) != 1:  # keep the stride pattern on the device
        out = torch.full((out.shape[0], 2 * out.shape[1]), MARK, dtype=out.dtype, device=DEVICE)[:, ::2]
        out.copy_(c["out"].to(DEVICE))
    vecs = [c[k].to(DEVICE) for k in ("rows", "prefix", "extend", "read")]
    ops.read_table(out, *vecs, c["clamp_max"], c["limit"], c["fill"], backend=backend)
    return out.cpu()


def run_numpy(c: dict) -> torch.Tensor:
    out = c["out"].clone()
    numpy_read_table(out.numpy(), *(c[k].numpy() for k in ("rows", "prefix", "extend", "read")), c["clamp_max"],
                     c["limit"], c["fill"])
    return out


READ = 1000 + torch.arange(100)

# (name, case, {row: the cells the row must hold}); rows not listed must keep MARK
HAND = [
    ("padding-rows", case([3, 0, 5, 0], [2, 0, 4, 0], [1, 1, 1, 1], READ, 99, shape=(9, 12)),
     {3: list(range(1000, 1012)), 5: list(range(1004, 1016))}),  # row 5 starts after 3 + 1 slots
    ("short-read", case([1, 2], [3, 2], [1, 1], READ[:20], 4, limit=5, fill=500),
     {1: [1000, 1001, 1002, 1003, 1004, 500, 500, 500], 2: [1004] + [500] * 7}),
    ("clamp-at-the-end", case([1, 2], [6, 0], [2, 3], READ[:10], 9, shape=(3, 6)),
     {1: list(range(1000, 1006)), 2: [1008, 1009, 1009, 1009, 1009, 1009]}),
    ("batch-of-one", case([4], [0], [1], READ[:1], 0, shape=(9, 1)), {4: [1000]}),
    ("empty-batch", case([], [], [], READ, 99), {}),
    ("zero-width", case([1, 2], [1, 1], [1, 1], READ, 99, shape=(9, 0)), {}),
    ("limit-zero", case([2], [5], [1], READ, 99, limit=0, fill=-1, shape=(4, 3)), {2: [-1, -1, -1]}),
    ("int32", case([2, 1], [1, 0], [1, 2], READ, 99, shape=(3, 4), out_dtype=I32, read_dtype=I32, index_dtype=I32),
     {2: [1000, 1001, 1002, 1003], 1: [1002, 1003, 1004, 1005]}),
    ("int32-read-into-int64", case([1], [0], [2], READ[:3], 1, limit=2, fill=2**40, shape=(2, 4), read_dtype=I32),
     {1: [1000, 1001, 2**40, 2**40]}),
    ("strided-out", case([2, 1], [0, 3], [3, 1], READ, 99, shape=(3, 5), strided=True),
     {2: list(range(1000, 1005)), 1: list(range(1003, 1008))}),
    ("wide-rows", case([5, 0, 2], [500, 7, 600], [3, 1, 2], torch.arange(2000), 1999, shape=(6, 700)),
     {5: list(range(0, 700)), 2: list(range(511, 1211))}),  # three blocks of 256 columns per row
    ("wide-short", case([1, 3], [600, 10], [1, 1], torch.arange(2000), 299, limit=300, fill=77, shape=(4, 520)),
     {1: list(range(300)) + [77] * 220, 3: [77] * 520}),
]


@pytest.mark.parametrize("name, c, want", HAND, ids=[h[0] for h in HAND])
def test_the_reference_writes_the_hand_derived_cells(name, c, want):
    got = run(c, "reference")
    for r in range(got.shape[0]):
        expected = want.get(r, [MARK] * got.shape[1])  # (row 0 and unnamed rows keep their cells)
        assert got[r].tolist() == expected, (name, r)
    assert got.dtype == c["out"].dtype


@pytest.mark.parametrize("name, c, want", HAND, ids=[h[0] for h in HAND])
def test_every_backend_writes_the_reference_cells_on_the_edge_cases(fast_backend, name, c, want):
    backend = use_backend(fast_backend)
    want_t = run(c, "reference")
    got = run(c, backend)
    assert got.dtype == want_t.dtype and torch.equal(got, want_t), name
    if c["out"].stride(1) == 1:
        assert torch.equal(run_numpy(c), want_t), name


def random_case(rng: random.Random) -> dict:
    n_rows = rng.randint(1, 12)
    bs = rng.randint(0, 10)
    # distinct rows besides row 0, the padding row, which may come any number of times
    real = rng.sample(range(1, n_rows), min(bs, n_rows - 1)) if n_rows > 1 else []
    rows = real + [0] * (bs - len(real))
    rng.shuffle(rows)
    prefix = [rng.randint(0, 40) for _ in rows]
    extend = [rng.randint(0, 5) for _ in rows]
    total = sum(prefix) + sum(extend)
    width = rng.choice([0, 1, rng.randint(1, 64), rng.randint(200, 600)])
    read_dtype = rng.choice([I32, I64])
    out_dtype = I32 if read_dtype == I32 and rng.random() < 0.3 else I64
    if rng.random() < 0.5:  # a read index listing every slot (and stale ones after)
        n = max(1, total + rng.randint(0, 64))
        clamp_max, limit, fill = n - 1, NO_LIMIT, 0
    else:  # a short one: cells past ``have`` take the fill
        have = rng.randint(0, total)
        n = have + rng.randint(1, 16)
        clamp_max, limit, fill = max(0, have - 1), have, rng.randint(-5, 10**6)
    read = [rng.randint(0, 2**31 - 1) for _ in range(n)]
    return case(rows, prefix, extend, read, clamp_max, limit, fill, shape=(n_rows, width), out_dtype=out_dtype,
                read_dtype=read_dtype, index_dtype=rng.choice([I32, I64]), strided=rng.random() < 0.15)


@pytest.mark.parametrize("chunk", range(4))
def test_every_backend_writes_the_reference_cells_on_random_batches(fast_backend, chunk):
    backend = use_backend(fast_backend)
    rng = random.Random(1000 + chunk)
    written = 0
    for i in range(75):
        c = random_case(rng)
        want = run(c, "reference")
        got = run(c, backend)
        assert got.dtype == want.dtype and torch.equal(got, want), (chunk, i)
        if c["out"].stride(1) == 1:
            assert torch.equal(run_numpy(c), want), (chunk, i)
        written += int((want != MARK).sum())
    assert written > 1000  # (the cases write cells: the comparison can fail)


def test_a_row_named_twice_gets_the_last_requests_cells_on_the_cpu_bodies():
    c = case([1, 1], [0, 2], [2, 1], READ, 99, shape=(2, 3))
    want = [[MARK] * 3, [1002, 1003, 1004]]
    assert run_numpy(c).tolist() == want
    assert run(c, "reference").tolist() == want
    if DEVICE.type == "cpu":
        assert run(c, use_backend("numba")).tolist() == want


def valid() -> dict:
    return case([3, 0, 5], [2, 0, 4], [1, 1, 1], READ, 99)


S = "kv-canary: read_table "
BAD = [
    ("out-dtype", dict(out=torch.zeros(9, 8)), TypeError, S + "out must be int32 or int64, got torch.float32"),
    ("out-ndim", dict(out=torch.zeros(9, dtype=I64)), ValueError, S + r"out must be 2-D, got shape \(9,\)"),
    ("out-not-tensor", dict(out=np.zeros((9, 8), dtype=np.int64)), TypeError, S + "out must be a torch.Tensor"),
    ("rows-dtype", dict(rows=torch.tensor([3.0, 0.0, 5.0])), TypeError, S + "rows must be int32 or int64"),
    ("rows-ndim", dict(rows=torch.tensor([[3, 0, 5]])), ValueError, S + "rows must be 1-D"),
    ("prefix-length", dict(prefix=torch.tensor([2, 0])), ValueError, S + "prefix must be of length 3, got length 2"),
    ("extend-dtype", dict(extend=torch.tensor([1, 1, 1], dtype=torch.int16)), TypeError,
     S + "extend must be int32 or int64, got torch.int16"),
    ("read-wider-than-out", dict(out=torch.zeros(9, 8, dtype=I32)), TypeError,
     S + "read must be int32 when out is int32"),
    ("rows-device", dict(rows=torch.tensor([3, 0, 5], device="meta")), ValueError,
     S + "rows must be on cpu, got meta"),
    ("read-device", dict(read=torch.zeros(100, dtype=I64, device="meta")), ValueError,
     S + "read must be on cpu, got meta"),
    ("clamp-past-read", dict(clamp_max=100), ValueError,
     S + r"clamp_max must be an int index into read, in \[0, 100\)"),
    ("clamp-negative", dict(clamp_max=-1), ValueError, S + "clamp_max must be an int index into read"),
    ("clamp-bool", dict(clamp_max=True), ValueError, S + "clamp_max must be an int index into read, .*got True"),
    ("clamp-empty-read", dict(read=torch.zeros(0, dtype=I64), clamp_max=0), ValueError, S + r"clamp_max .*\[0, 0\)"),
    ("limit-float", dict(limit=3.5), TypeError, S + "limit must be an int, got float"),
    ("fill-too-wide", dict(out=torch.zeros(9, 8, dtype=I32), read=READ.to(I32), fill=2**31), ValueError,
     S + "fill must be an int that fits out's int32, got 2147483648"),
    ("rows-past-out", dict(rows=torch.tensor([3, 9, 5])), ValueError,
     S + r"rows must be rows of out, in \[0, 9\), got 9 at index 1"),
    ("rows-negative", dict(rows=torch.tensor([-1, 0, 5])), ValueError,
     S + "rows must be rows of out.*got -1 at index 0"),
    ("prefix-negative", dict(prefix=torch.tensor([2, 0, -4])), ValueError,
     S + "prefix must be non-negative, got -4 at index 2"),
]


@pytest.mark.parametrize("name, change, exc, message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_argument_is_refused_by_name_before_anything_is_written(name, change, exc, message):
    args = {**valid(), **change}
    out = args["out"]
    before = out.clone() if isinstance(out, torch.Tensor) else out.copy()
    with pytest.raises(exc, match=message):
        ops.read_table(args["out"], args["rows"], args["prefix"], args["extend"], args["read"], args["clamp_max"],
                       args["limit"], args["fill"])
    assert (torch.equal(out, before) if isinstance(out, torch.Tensor) else np.array_equal(out, before)), name


def test_an_unknown_backend_is_refused_before_anything_is_written():
    c = valid()
    before = c["out"].clone()
    with pytest.raises(ValueError, match="kv-canary: backend must be one of"):
        ops.read_table(c["out"], c["rows"], c["prefix"], c["extend"], c["read"], 99, backend="gpu")
    assert torch.equal(c["out"], before)
    ops.read_table(c["out"], c["rows"], c["prefix"], c["extend"], c["read"], 99, backend="reference")
    assert not torch.equal(c["out"], before)  # (the same call with a backend writes: the refusal was the backend)
