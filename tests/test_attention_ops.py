"""The attention-metadata pass (kvcanary/ops/attention_ops.py, triton_attention.py, numba_attention.py): the scalar
reference, the tensor ops, the Triton kernels and the numba loop leave the same ring (write index and rows) on small
case tables and seeded random cases.
Masks are built here from the layout's rule written out (a request's causal block, a sliding window), with no
engine; tests/test_write_ops.py has cases on masks transformers builds."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import DEVICE, HAS_TRITON
from kvcanary.format import FailReason
from kvcanary.ops import ViolationRing
from kvcanary.ops.attention_ops import attention_impl, recordable_impl, reference_check_attention, torch_check_attention

MASK, LENGTH = int(FailReason.ATTENTION_MASK), int(FailReason.KEY_LENGTH)
try:
    import numba  # noqa: F401
    HAS_NUMBA = True
except ImportError:  # (the [cpu] extra is not installed: its cases do not run)
    HAS_NUMBA = False
IMPLS = ["torch"] + (["triton"] if HAS_TRITON else []) + (["numba"] if HAS_NUMBA else [])
HOST_IMPLS = ("reference", "numba")  # (their passes run on the host's tensors)
MASK_DTYPES = (torch.bool, torch.float32, torch.bfloat16, torch.float16)


def _layout(rows, prefix, extend, window):
    kept = [(min(p, window) if window else p) if r else 0 for r, p in zip(rows, prefix)]
    nq = [q if r else 0 for r, q in zip(rows, extend)]
    return kept, nq, [k + q if r else 0 for r, k, q in zip(rows, kept, extend)]


def _case(rows, prefix, extend, window=0, dtype=torch.float32, extra_cols=0, slots=True, tag=2):
    """A batch's metadata as a correct engine builds it: ``args`` for the pass, plus the query and key starts."""
    kept, nq, lengths = _layout(rows, prefix, extend, window)
    cu_q, cu_k = [0], [0]
    for q, n in zip(nq, lengths):
        cu_q.append(cu_q[-1] + q)
        cu_k.append(cu_k[-1] + n)
    allowed = torch.zeros(cu_q[-1], cu_k[-1] + extra_cols, dtype=torch.bool)
    for r in range(len(rows)):
        for i in range(nq[r]):  # query i of request r sees its keys up to kept[r] + i, the last window + 1 of them
            lo = max(0, i + kept[r] - window) if window else 0
            allowed[cu_q[r] + i, cu_k[r] + lo:cu_k[r] + i + kept[r] + 1] = True
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    pos = [p + i for r, p, q in zip(rows, prefix, extend) if r for i in range(q)]
    args = dict(req_pool_indices=t(rows), prefix_lens=t(prefix), extend_lens=t(extend), positions=t(pos or [0]),
                request_ids=t([100 + i for i in range(len(rows))]), window=window,
                cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32), mask=_as(allowed, dtype),
                key_slots=t([1000 + c for c in range(allowed.shape[1])]) if slots else None, launch_tag=tag)
    return args, cu_q, cu_k


def _as(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """A bool mask as the dtype's mask: True, or 0 where allowed and the dtype's lowest (additive) where hidden."""
    if dtype == torch.bool:
        return allowed.clone()
    return torch.where(allowed, torch.zeros((), dtype=dtype), torch.tensor(torch.finfo(dtype).min, dtype=dtype))


def _set(mask: torch.Tensor, t: int, c: int, allow: bool, hidden=None) -> None:
    if mask.dtype == torch.bool:
        mask[t, c] = allow
    else:
        mask[t, c] = 0 if allow else (torch.finfo(mask.dtype).min if hidden is None else hidden)


def _ring(impl: str, args: dict, capacity: int = 16) -> tuple:
    """(write index, sorted stored rows) of a fresh ring after the pass of ``impl``."""
    dev = torch.device("cpu") if impl in HOST_IMPLS else DEVICE
    moved = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    ring = ViolationRing.allocate(capacity, dev)
    attention_impl(impl)(**moved, ring=ring)
    n = min(int(ring.write_index[0]), capacity)
    return int(ring.write_index[0]), sorted(map(tuple, ring.rows[:n].tolist()))


def _agree(args: dict, capacity: int = 16) -> tuple:
    want = _ring("reference", args, capacity)
    for impl in IMPLS:
        assert _ring(impl, args, capacity) == want, impl
    return want


TWO = dict(rows=[1, 2], prefix=[3, 2], extend=[2, 1])  # keys [0, 5) and [5, 8); queries rows 0-1 and 2


def test_attention_impl_picks_each_backends_pass():
    assert attention_impl("reference") is reference_check_attention
    assert attention_impl("torch") is torch_check_attention
    # a recorded step takes a pass without host work: the tensor ops, or Triton's launches
    assert recordable_impl("reference") is recordable_impl("numba") is recordable_impl("torch") is torch_check_attention
    if HAS_NUMBA:
        from kvcanary.ops.numba_attention import check_attention

        assert attention_impl("numba") is check_attention
    if HAS_TRITON:
        from kvcanary.ops.triton_attention import check_attention

        assert attention_impl("triton") is recordable_impl("triton") is check_attention


@pytest.mark.parametrize("dtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("window", [0, 2])
def test_metadata_a_correct_engine_builds_is_clean(dtype, window):
    args, _, _ = _case([1, 0, 2, 3], [4, 0, 1, 6], [2, 1, 3, 1], window=window, dtype=dtype, extra_cols=2)
    assert _agree(args) == (0, [])


@pytest.mark.parametrize("dtype", MASK_DTYPES, ids=str)
def test_a_mask_that_shows_another_requests_key_is_named_at_its_first_cell(dtype):
    args, cu_q, _ = _case(**TWO, dtype=dtype)
    _set(args["mask"], cu_q[1], 1, True)  # request 2's query sees request 1's key 1
    _set(args["mask"], cu_q[1], 0, True)  # ... and its key 0, the first cell of the row
    tag = args["launch_tag"]
    assert _agree(args) == (1, [(tag, 1000, 2, 1, 0, 101, 0, MASK)])


def test_a_mask_that_hides_an_own_key_is_named_at_its_first_row():
    args, _, _ = _case(**TWO, dtype=torch.bfloat16)
    _set(args["mask"], 1, 4, False, hidden=float("-inf"))  # request 1's second query loses its own newest key
    _set(args["mask"], 0, 2, False)  # and its first query its key 2: that row comes first
    tag = args["launch_tag"]
    assert _agree(args) == (1, [(tag, 1002, 3, 0, 1, 100, 2, MASK)])


def test_a_key_length_off_by_one_and_a_wrong_start_are_named():
    args, _, _ = _case([1, 2, 3], [3, 2, 0], [2, 1, 1], dtype=torch.bool)
    args["mask"] = None
    cu = args["cu_seqlens_k"]
    cu[2] += 1  # request 2 one key longer, request 3 starting one late (and one shorter)
    tag = args["launch_tag"]
    assert _agree(args) == (2, [(tag, -1, 0, 0, 1, 102, 9, LENGTH), (tag, -1, 2, 4, 3, 101, 5, LENGTH)])
    args["cu_seqlens_k"] = torch.tensor([0, 6, 9, 10], dtype=torch.int32)  # request 1 one longer: 2 starts late
    assert _agree(args) == (3, sorted([(tag, -1, 3, 6, 5, 100, 0, LENGTH), (tag, -1, 2, 3, 3, 101, 6, LENGTH),
                                       (tag, -1, 0, 1, 1, 102, 9, LENGTH)]))


def test_sliding_window_keys_past_the_window_are_mismatches():
    args, cu_q, _ = _case([1, 2], [6, 1], [3, 2], window=3, dtype=torch.float16)
    assert _agree(args) == (0, [])
    _set(args["mask"], cu_q[0] + 2, 0, True)  # the last query sees its oldest kept key: out of the window
    assert _agree(args) == (1, [(args["launch_tag"], 1000, 8, 1, 0, 100, 0, MASK)])


def test_padding_requests_have_no_keys_and_are_not_checked():
    args, _, _ = _case([0, 1, 0, 2, 0], [5, 2, 0, 1, 0], [1, 2, 1, 1, 1], dtype=torch.bool)
    assert _agree(args) == (0, [])
    args["cu_seqlens_k"] = torch.tensor([0, 0, 4, 4, 6, 6], dtype=torch.int32)  # (the pads' own lengths: 0)
    assert _agree(args) == (0, [])
    args["cu_seqlens_k"] = torch.tensor([3, 3, 7, 7, 9, 9], dtype=torch.int32)  # a pad's length is not checked,
    assert _agree(args)[0] == 2  # the real requests' starts are
    short = {**args, "cu_seqlens_k": torch.tensor([0, 0, 4, 4], dtype=torch.int32)}  # fewer entries: last repeats
    assert _agree(short) == (1, [(args["launch_tag"], -1, 1, 0, 2, 103, 4, LENGTH)])


def test_batch_keys_only_leaves_stale_columns_past_the_batchs_keys():
    args, cu_q, cu_k = _case(**TWO, dtype=torch.float32, extra_cols=4, slots=False)
    args["mask"][:, cu_k[-1]:] = 0  # stale cells past the keys: every query would see them
    assert _agree(args)[0] == 2  # (compared, they are reported)
    keys_only = {**args, "batch_keys_only": True}
    assert _agree(keys_only) == (0, [])
    _set(args["mask"], cu_q[1], cu_k[1], False)  # request 2's query loses its first key
    assert _agree(keys_only) == (1, [(args["launch_tag"], -1, 2, 0, 1, 101, 5, MASK)])


def test_a_full_ring_keeps_the_first_rows_and_counts_the_rest():
    args, _, _ = _case([1, 2, 3], [1, 1, 1], [1, 1, 1], dtype=torch.bool)
    args["cu_seqlens_k"][1:] += 1  # three key-length rows
    _set(args["mask"], 0, 3, True)  # and three mask rows
    _set(args["mask"], 1, 0, True)
    _set(args["mask"], 2, 0, True)
    for capacity in (0, 1, 4, 6):
        got = _agree(args, capacity)
        assert got[0] == 6 and len(got[1]) == capacity
    assert {row[7] for row in _agree(args, 3)[1]} == {LENGTH}  # (the key-length rows are pushed first)


def test_missing_or_empty_metadata_pushes_nothing():
    args, _, _ = _case(**TWO)
    _set(args["mask"], 0, 6, True)
    assert _agree({**args, "mask": None})[0] == 0
    assert _agree({**args, "cu_seqlens_k": None})[0] == 1
    assert _agree({**args, "mask": None, "cu_seqlens_k": None}) == (0, [])
    assert _agree({**args, "mask": args["mask"][:0]}) == (0, [])
    assert _agree({**args, "mask": args["mask"][:, :0], "cu_seqlens_k": None}) == (0, [])
    empty = torch.zeros(0, dtype=torch.int64)
    assert _agree({**args, "req_pool_indices": empty, "prefix_lens": empty, "extend_lens": empty,
                   "request_ids": empty}) == (0, [])


def _random_case(rng: random.Random) -> dict:
    n = rng.randint(1, 4)
    rows = [rng.choice([0, 1, 2, 3]) for _ in range(n)]
    args, _, _ = _case(rows, [rng.randint(0, 8) for _ in range(n)], [rng.randint(1, 3) for _ in range(n)],
                       window=rng.choice([0, 0, 3]), dtype=rng.choice(MASK_DTYPES), extra_cols=rng.randint(0, 3),
                       slots=rng.random() < 0.7)
    mask = args["mask"]
    for _ in range(rng.randint(0, 3) if mask.numel() else 0):  # flipped cells
        t, c = rng.randrange(mask.shape[0]), rng.randrange(mask.shape[1])
        _set(mask, t, c, not bool(mask[t, c] if mask.dtype == torch.bool else mask[t, c] == 0))
    cu = args["cu_seqlens_k"]
    if rng.random() < 0.3:
        cu[rng.randrange(cu.shape[0])] += rng.choice([-1, 1])
    if rng.random() < 0.2:
        args["cu_seqlens_k"] = cu[:rng.randint(1, cu.shape[0])]
    if args["key_slots"] is not None and rng.random() < 0.3:
        args["key_slots"] = args["key_slots"][:rng.randint(0, args["key_slots"].shape[0])]
    args["batch_keys_only"] = rng.random() < 0.3
    return args


@pytest.mark.parametrize("seed", range(12))
def test_random_cases_leave_the_same_ring(seed):
    rng = random.Random(seed)
    _agree(_random_case(rng), capacity=rng.choice([1, 3, 16]))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_the_pass_replays_from_a_cuda_graph_with_each_replays_metadata(impl):
    # captured once over static buffers (no host read: a read would fail the capture), each replay compares the
    # metadata the buffers hold then, with the reference's rows
    args, cu_q, cu_k = _case(**TWO, dtype=torch.bfloat16, extra_cols=3)
    static = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    static["batch_keys_only"] = True
    ring = ViolationRing.allocate(8, DEVICE)
    if impl == "numba":  # (CPU tensors only: a device's tensors are refused with a clear error, never read)
        with pytest.raises(ValueError, match="numba backend reads CPU tensors only"):
            attention_impl(impl)(**static, ring=ring)
        return
    attention_impl(impl)(**static, ring=ring)  # (warm-up: compiles the kernels)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention_impl(impl)(**static, ring=ring)
    # none; another request's key, a future key (one row each); a stale column past the keys (not compared)
    faults = [(None, None, 0), (cu_q[1], 1, 1), (0, cu_k[1] - 1, 1), (1, cu_k[-1], 0)]
    for t, c, rows in faults:
        mask = args["mask"].clone()
        if t is not None:
            _set(mask, t, c, True)
        static["mask"].copy_(mask.to(DEVICE))
        ring.reset()
        graph.replay()
        torch.cuda.synchronize()
        want = _ring("reference", {**args, "mask": mask, "batch_keys_only": True}, 8)
        assert want[0] == rows
        n = min(int(ring.write_index[0]), 8)
        assert (int(ring.write_index[0]), sorted(map(tuple, ring.rows[:n].tolist()))) == want


def test_masks_read_as_they_are_agree_with_the_reference():
    # the numba loop reads contiguous bool, float32 and float64 masks in place and converts others (a strided view):
    # -inf as the hidden value, a float64 mask, a bool mask that is a strided view, each with one planted cell
    args, _, _ = _case(**TWO, dtype=torch.float32, extra_cols=2)
    args["mask"][args["mask"] == torch.finfo(torch.float32).min] = float("-inf")
    _set(args["mask"], 0, 6, True)
    assert _agree(args) == (1, [(2, 1006, 3, 1, 0, 100, 6, MASK)])
    args, _, _ = _case(**TWO, dtype=torch.float64)
    _set(args["mask"], 2, 1, True)
    assert _agree(args) == (1, [(2, 1001, 2, 1, 0, 101, 1, MASK)])
    args, _, _ = _case(**TWO, dtype=torch.bool, extra_cols=3)
    wide = torch.zeros(args["mask"].shape[0], 2 * args["mask"].shape[1], dtype=torch.bool)
    wide[:, ::2] = args["mask"]
    args["mask"] = wide[:, ::2]
    _set(args["mask"], 1, 0, False)
    assert _agree(args) == (1, [(2, 1000, 4, 0, 1, 100, 0, MASK)])
