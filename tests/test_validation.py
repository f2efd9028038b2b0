"""Every boundary check of the ops: the right exception, the exact message, and no state touched.

Calls start from valid arguments and change one thing. Tensors on the ``meta`` device stand in
for a second device (validation reads metadata only, so they never reach a kernel).
"""

from __future__ import annotations

import pytest
import torch

from kvcanary import ops
from kvcanary.format import LaunchTag, RealKvMode
from kvcanary.ops import (Entries, Plan, RealKvSource, ViolationRing, allocate_canary_buffer, allocate_counters,
                          api)

I32, I64 = torch.int32, torch.int64


def t(xs, dtype=I64, device="cpu"):
    return torch.tensor(xs, dtype=dtype, device=device)


def src(**kw):
    args = dict(tensor=torch.zeros(4, 32, dtype=torch.uint8), page_size=1, num_bytes_per_token=32, read_bytes=16)
    args.update(kw)
    return RealKvSource(**args)


def good(op: str) -> dict:
    """Valid keyword arguments of one op (fresh tensors each call)."""
    if op == "scatter":
        return dict(flat_in=t([5, 6, 7]), offsets=t([0, 2, 3]), req_pool_indices=t([1, 3]),
                    pool_out=torch.zeros(4, 8, dtype=I32))
    if op == "fingerprint":
        return dict(slots=t([1, 2]), sources=[src()], real_kv_mode=RealKvMode.ALL)
    if op == "plan":
        return dict(req_pool_indices=t([1, 2]), prefix_lens=t([2, 0]), extend_lens=t([1, 3]),
                    req_to_token=torch.arange(24, dtype=I32).reshape(3, 8), out=Plan.allocate(16, 2))
    if op == "write":
        return dict(buf=allocate_canary_buffer(16, 48), plan=Plan.allocate(8, 2), num_requests=1,
                    out_cache_loc=t([3]), input_ids=t([5]), positions=t([0]), ring=ViolationRing.allocate(4),
                    counters=allocate_counters(), launch_tag=LaunchTag.TAIL_K_FULL)
    if op == "verify":
        e = Entries.allocate(4)
        ops.fill_entries(e, t([1, 2]), t([0, 1]), t([-1, 1]))
        return dict(buf=allocate_canary_buffer(16, 48), entries=e, ring=ViolationRing.allocate(4),
                    counters=allocate_counters(), launch_tag=LaunchTag.HEAD_K_FULL)
    if op == "fill_entries":
        return dict(entries=Entries.allocate(4), slots=t([1]), positions=t([0]), prevs=t([-1]))
    raise KeyError(op)


CALL = {
    "scatter": lambda kw: ops.scatter_req_token_ids(kw.pop("flat_in"), kw.pop("offsets"), kw.pop("req_pool_indices"),
                                                    kw.pop("pool_out"), **kw),
    "fingerprint": lambda kw: ops.fingerprint(kw.pop("slots"), kw.pop("sources"), kw.pop("real_kv_mode"), **kw),
    "plan": lambda kw: ops.plan(**kw),
    "write": lambda kw: ops.write(**kw),
    "verify": lambda kw: ops.verify(**kw),
    "fill_entries": lambda kw: ops.fill_entries(**kw),
}

P = "kv-canary: "
S = P + "scatter_req_token_ids "
CASES = [
    # (id, op, changes, exception, exact message)
    # SPEC 4.1, in its check order: ndim of every argument, then dtypes, then the offsets length.
    ("scatter-flat-2d", "scatter", dict(flat_in=t([[5, 6]])), ValueError, S + "flat_in must be 1-D, got shape (1, 2)"),
    ("scatter-offsets-2d", "scatter", dict(offsets=t([[0, 2, 3]])), ValueError,
     S + "offsets must be 1-D, got shape (1, 3)"),
    ("scatter-rows-0d", "scatter", dict(req_pool_indices=t(1)), ValueError,
     S + "req_pool_indices must be 1-D, got shape ()"),
    ("scatter-pool-1d", "scatter", dict(pool_out=torch.zeros(8, dtype=I32)), ValueError,
     S + "pool_out must be 2-D, got shape (8,)"),
    ("scatter-flat-int32", "scatter", dict(flat_in=t([5, 6, 7], I32)), TypeError,
     S + "flat_in must be int64, got torch.int32"),
    ("scatter-offsets-int32", "scatter", dict(offsets=t([0, 2, 3], I32)), TypeError,
     S + "offsets must be int64, got torch.int32"),
    ("scatter-rows-int32", "scatter", dict(req_pool_indices=t([1, 3], I32)), TypeError,
     S + "req_pool_indices must be int64, got torch.int32"),
    ("scatter-pool-int64", "scatter", dict(pool_out=torch.zeros(4, 8, dtype=I64)), TypeError,
     S + "pool_out must be int32, got torch.int64"),
    ("scatter-offsets-length", "scatter", dict(offsets=t([0, 3])), ValueError,
     S + "offsets length 2 != bs+1 (3)"),
    ("scatter-offsets-length-bs-1", "scatter", dict(offsets=t([0, 1, 2]), req_pool_indices=t([1])), ValueError,
     S + "offsets length 3 != bs+1 (2)"),
    ("scatter-order-ndim-before-dtype", "scatter", dict(flat_in=t([5], I32), pool_out=torch.zeros(8, dtype=I32)),
     ValueError, S + "pool_out must be 2-D, got shape (8,)"),
    ("scatter-order-first-ndim-wins", "scatter", dict(flat_in=t([[5]]), offsets=t([[0]])), ValueError,
     S + "flat_in must be 1-D, got shape (1, 1)"),
    ("scatter-order-dtype-before-length", "scatter", dict(offsets=t([0], I32)), TypeError,
     S + "offsets must be int64, got torch.int32"),
    ("scatter-not-a-tensor", "scatter", dict(flat_in=[5, 6]), TypeError,
     S + "flat_in must be a torch.Tensor, got list"),
    ("scatter-device", "scatter", dict(flat_in=t([5, 6, 7], device="meta")), ValueError,
     S + "flat_in must be on cpu, got meta"),
    ("scatter-backend", "scatter", dict(backend="cuda"), ValueError,
     P + "backend must be one of ('auto', 'reference', 'torch', 'numba', 'triton'), got 'cuda'"),

    ("fingerprint-slots-int32", "fingerprint", dict(slots=t([1], I32)), TypeError,
     P + "fingerprint slots must be int64, got torch.int32"),
    ("fingerprint-slots-2d", "fingerprint", dict(slots=t([[1]])), ValueError,
     P + "fingerprint slots must be 1-D, got shape (1, 1)"),
    ("fingerprint-five-sources", "fingerprint", dict(sources=[src()] * 5), ValueError,
     P + "fingerprint sources must be at most 4 real-KV sources, got 5"),
    ("fingerprint-mode", "fingerprint", dict(real_kv_mode=3), ValueError,
     P + "fingerprint real_kv_mode must be a RealKvMode (0, 1, 2), got 3"),
    ("fingerprint-source-type", "fingerprint", dict(sources=[torch.zeros(4, 32)]), TypeError,
     P + "fingerprint sources[0] must be a RealKvSource, got Tensor"),
    ("fingerprint-source-device", "fingerprint",
     dict(sources=[src(), src(tensor=torch.zeros(4, 32, dtype=torch.uint8, device="meta"))]), ValueError,
     P + "fingerprint sources[1].tensor must be on cpu, got meta"),
    ("fingerprint-backend", "fingerprint", dict(backend="Torch"), ValueError,
     P + "backend must be one of ('auto', 'reference', 'torch', 'numba', 'triton'), got 'Torch'"),

    ("plan-rows-float", "plan", dict(req_pool_indices=torch.ones(2)), TypeError,
     P + "plan req_pool_indices must be int32 or int64, got torch.float32"),
    ("plan-rows-2d", "plan", dict(req_pool_indices=t([[1, 2]])), ValueError,
     P + "plan req_pool_indices must be 1-D, got shape (1, 2)"),
    ("plan-prefix-length", "plan", dict(prefix_lens=t([2, 0, 1])), ValueError,
     P + "plan prefix_lens must be of length 2, got length 3"),
    ("plan-extend-dtype", "plan", dict(extend_lens=t([1, 3], torch.int16)), TypeError,
     P + "plan extend_lens must be int32 or int64, got torch.int16"),
    ("plan-rtt-1d", "plan", dict(req_to_token=t([1, 2])), ValueError,
     P + "plan req_to_token must be 2-D, got shape (2,)"),
    ("plan-rtt-uint8", "plan", dict(req_to_token=torch.zeros(3, 8, dtype=torch.uint8)), TypeError,
     P + "plan req_to_token must be int32 or int64, got torch.uint8"),
    ("plan-out-type", "plan", dict(out=Entries.allocate(4)), TypeError, P + "plan out must be a Plan, got Entries"),
    ("plan-batch-too-big", "plan", dict(req_pool_indices=t([1, 2, 1]), prefix_lens=t([1, 1, 1]),
                                        extend_lens=t([1, 1, 1])), ValueError,
     P + "plan req_pool_indices must be at most the plan's max_batch (2) long, got 3"),
    ("plan-window-negative", "plan", dict(window=-1), ValueError, P + "plan window must be an int >= 0, got -1"),
    ("plan-window-float", "plan", dict(window=2.0), ValueError, P + "plan window must be an int >= 0, got 2.0"),
    ("plan-swa-dtype", "plan", dict(full_to_swa=torch.zeros(4)), TypeError,
     P + "plan full_to_swa must be int32 or int64, got torch.float32"),
    ("plan-tokens-without-lens", "plan", dict(token_table=torch.zeros(3, 8, dtype=I32)), ValueError,
     P + "plan token_valid_lens must be given exactly when token_table is given, got one without the other"),
    ("plan-lens-without-tokens", "plan", dict(token_valid_lens=t([1, 1])), ValueError,
     P + "plan token_valid_lens must be given exactly when token_table is given, got one without the other"),
    ("plan-tokens-int64", "plan", dict(token_table=torch.zeros(3, 8, dtype=I64), token_valid_lens=t([1, 1])),
     TypeError, P + "plan token_table must be int32, got torch.int64"),
    ("plan-tokens-1d", "plan", dict(token_table=torch.zeros(8, dtype=I32), token_valid_lens=t([1, 1])),
     ValueError, P + "plan token_table must be 2-D, got shape (8,)"),
    ("plan-lens-length", "plan", dict(token_table=torch.zeros(3, 8, dtype=I32), token_valid_lens=t([1])),
     ValueError, P + "plan token_valid_lens must be of length 2, got length 1"),
    ("plan-token-offset", "plan", dict(token_offset=2), ValueError, P + "plan token_offset must be 0 or 1, got 2"),
    ("plan-device", "plan", dict(extend_lens=t([1, 3], device="meta")), ValueError,
     P + "plan extend_lens must be on cpu, got meta"),
    ("plan-out-device", "plan", dict(out=Plan.allocate(4, 2, device="meta")), ValueError,
     P + "plan out.entries.slot must be on cpu, got meta"),
    ("plan-backend", "plan", dict(backend=""), ValueError,
     P + "backend must be one of ('auto', 'reference', 'torch', 'numba', 'triton'), got ''"),

    ("write-buf-int8", "write", dict(buf=torch.zeros(16, 48, dtype=torch.int8)), TypeError,
     P + "write buf must be uint8, got torch.int8"),
    ("write-buf-1d", "write", dict(buf=torch.zeros(48, dtype=torch.uint8)), ValueError,
     P + "write buf must be 2-D, got shape (48,)"),
    ("write-stride-24", "write", dict(buf=allocate_canary_buffer(16, 24)), ValueError,
     P + "write buf must be a record stride >= 32 and a multiple of 8, got stride 24"),
    ("write-stride-36", "write", dict(buf=allocate_canary_buffer(16, 36)), ValueError,
     P + "write buf must be a record stride >= 32 and a multiple of 8, got stride 36"),
    ("write-buf-noncontiguous", "write", dict(buf=allocate_canary_buffer(16, 96)[:, :48]), ValueError,
     P + "write buf must be contiguous, got strides (96, 1)"),
    ("write-plan-type", "write", dict(plan={}), TypeError, P + "write plan must be a Plan, got dict"),
    ("write-num-requests-big", "write", dict(num_requests=3), ValueError,
     P + "write num_requests must be an int in [0, 2], got 3"),
    ("write-num-requests-tensor", "write", dict(num_requests=t(1)), ValueError,
     P + "write num_requests must be an int in [0, 2], got tensor(1)"),
    ("write-locs-float", "write", dict(out_cache_loc=torch.ones(1)), TypeError,
     P + "write out_cache_loc must be int32 or int64, got torch.float32"),
    ("write-ids-length", "write", dict(input_ids=t([5, 6])), ValueError,
     P + "write input_ids must be of length 1, got length 2"),
    ("write-positions-length", "write", dict(positions=t([], I32)), ValueError,
     P + "write positions must be of length 1, got length 0"),
    ("write-expected-ids-length", "write", dict(expected_input_ids=t([5, 5])), ValueError,
     P + "write expected_input_ids must be of length 1, got length 2"),
    ("write-expected-positions-dtype", "write", dict(expected_positions=torch.zeros(1)), TypeError,
     P + "write expected_positions must be int32 or int64, got torch.float32"),
    ("write-chain-check-int64", "write", dict(chain_check=t([1])), TypeError,
     P + "write chain_check must be int32, got torch.int64"),
    ("write-chain-check-length", "write", dict(chain_check=t([1, 1], I32)), ValueError,
     P + "write chain_check must be of length 1, got length 2"),
    ("write-writer-ids-int32", "write", dict(writer_ids=t([1], I32)), TypeError,
     P + "write writer_ids must be int64, got torch.int32"),
    ("write-writer-ids-short", "write", dict(writer_ids=t([1]), num_requests=2), ValueError,
     P + "write writer_ids must be of length >= 2, got length 1"),
    ("write-step-length", "write", dict(step=t([1, 2])), ValueError,
     P + "write step must be of length 1, got length 2"),
    ("write-ring-width", "write", dict(ring=ViolationRing(torch.zeros(4, 7, dtype=I64), torch.zeros(1, dtype=I32))),
     ValueError, P + "write ring.rows must be contiguous [capacity, 8], got shape (4, 7)"),
    ("write-ring-1d", "write", dict(ring=ViolationRing(torch.zeros(8, dtype=I64), torch.zeros(1, dtype=I32))),
     ValueError, P + "write ring.rows must be 2-D, got shape (8,)"),
    ("write-ring-noncontiguous", "write",
     dict(ring=ViolationRing(torch.zeros(8, 4, dtype=I64).t(), torch.zeros(1, dtype=I32))), ValueError,
     P + "write ring.rows must be contiguous [capacity, 8], got shape (4, 8)"),
    ("write-ring-rows-device", "write",
     dict(ring=ViolationRing(torch.zeros(4, 8, dtype=I64, device="meta"), torch.zeros(1, dtype=I32))), ValueError,
     P + "write ring.rows must be on cpu, got meta"),
    ("write-counters-1d", "write", dict(counters=torch.zeros(24, dtype=I64)), ValueError,
     P + "write counters must be 2-D, got shape (24,)"),
    ("write-ring-dtype", "write", dict(ring=ViolationRing(torch.zeros(4, 8, dtype=I32), torch.zeros(1, dtype=I32))),
     TypeError, P + "write ring.rows must be int64, got torch.int32"),
    ("write-ring-index-int64", "write", dict(ring=ViolationRing(torch.zeros(4, 8, dtype=I64), t([0]))), TypeError,
     P + "write ring.write_index must be int32, got torch.int64"),
    ("write-counters-shape", "write", dict(counters=torch.zeros(12, 3, dtype=I64)), ValueError,
     P + "write counters must be contiguous [num_tags, 2], got shape (12, 3)"),
    ("write-counters-dtype", "write", dict(counters=torch.zeros(12, 2, dtype=I32)), TypeError,
     P + "write counters must be int64, got torch.int32"),
    ("write-ring-device", "write", dict(counters=torch.zeros(12, 2, dtype=I64, device="meta")), ValueError,
     P + "write counters must be on cpu, got meta"),
    ("write-launch-tag-12", "write", dict(launch_tag=12), ValueError,
     P + "write launch_tag must be an int in [0, 12), got 12"),
    ("write-launch-tag-str", "write", dict(launch_tag="TAIL_K_FULL"), ValueError,
     P + "write launch_tag must be an int in [0, 12), got 'TAIL_K_FULL'"),
    ("write-five-sources", "write", dict(sources=[src()] * 5), ValueError,
     P + "write sources must be at most 4 real-KV sources, got 5"),
    ("write-mode", "write", dict(real_kv_mode=-1), ValueError,
     P + "write real_kv_mode must be a RealKvMode (0, 1, 2), got -1"),
    ("write-locs-device", "write", dict(out_cache_loc=t([3], device="meta")), ValueError,
     P + "write out_cache_loc must be on cpu, got meta"),
    ("write-backend", "write", dict(backend="numpy"), ValueError,
     P + "backend must be one of ('auto', 'reference', 'torch', 'numba', 'triton'), got 'numpy'"),

    ("verify-buf-stride", "verify", dict(buf=allocate_canary_buffer(16, 16)), ValueError,
     P + "verify buf must be a record stride >= 32 and a multiple of 8, got stride 16"),
    ("verify-entries-type", "verify", dict(entries=Plan.allocate(4, 1)), TypeError,
     P + "verify entries must be an Entries, got Plan"),
    ("verify-ring-index-length", "verify",
     dict(ring=ViolationRing(torch.zeros(4, 8, dtype=I64), torch.zeros(2, dtype=I32))), ValueError,
     P + "verify ring.write_index must be of length 1, got length 2"),
    ("verify-ring-too-large", "verify",
     dict(ring=ViolationRing(torch.empty(2**30 + 1, 8, dtype=I64, device="meta"), torch.zeros(1, dtype=I32))),
     ValueError, P + "verify ring.rows must be at most 1073741824 rows, got 1073741825"),
    ("verify-launch-tag", "verify", dict(launch_tag=-1), ValueError,
     P + "verify launch_tag must be an int in [0, 12), got -1"),
    ("verify-source-type", "verify", dict(sources=[None]), TypeError,
     P + "verify sources[0] must be a RealKvSource, got NoneType"),
    ("verify-entries-device", "verify", dict(entries=Entries.allocate(4, device="meta")), ValueError,
     P + "verify entries.slot must be on cpu, got meta"),
    ("verify-backend", "verify", dict(backend=None), ValueError,
     P + "backend must be one of ('auto', 'reference', 'torch', 'numba', 'triton'), got None"),

    ("fill-slots-float", "fill_entries", dict(slots=torch.ones(1)), TypeError,
     P + "fill_entries slots must be int32 or int64, got torch.float32"),
    ("fill-positions-length", "fill_entries", dict(positions=t([0, 1])), ValueError,
     P + "fill_entries positions must be of length 1, got length 2"),
    ("fill-prevs-2d", "fill_entries", dict(prevs=t([[-1]])), ValueError,
     P + "fill_entries prevs must be 1-D, got shape (1, 1)"),
    ("fill-expected-length", "fill_entries", dict(expected_tokens=t([1, 2])), ValueError,
     P + "fill_entries expected_tokens must be of length 1, got length 2"),
]


def _tensors(obj, out):
    """Every tensor reachable from an argument (dataclasses, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors(x, out)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            _tensors(getattr(obj, name), out)
    return out


@pytest.mark.parametrize("name, op, changes, exc, message", CASES, ids=[c[0] for c in CASES])
def test_rejected(name, op, changes, exc, message):
    kw = good(op)
    kw.update(changes)
    tensors = [x for x in _tensors(kw, []) if x.device.type != "meta"]
    before = [x.clone() for x in tensors]
    with pytest.raises(exc) as info:
        CALL[op](dict(kw, backend=kw.get("backend", "torch")) if op != "fill_entries" else dict(kw))
    assert str(info.value) == message
    # Bad input never corrupts state: validation runs before the first write.
    for x, y in zip(tensors, before):
        assert torch.equal(x, y), f"{name}: an argument changed although the call was rejected"


@pytest.mark.parametrize("op", ["scatter", "fingerprint", "plan", "write", "verify", "fill_entries"])
def test_good_arguments_pass(op):
    kw = good(op)
    CALL[op](dict(kw, backend="torch") if op != "fill_entries" else kw)


SOURCE_CASES = [
    ("page-size-0", dict(page_size=0), ValueError, "page_size must be >= 1, got 0"),
    ("page-size-float", dict(page_size=1.0), TypeError, "page_size must be an int, got float"),
    ("nbpt-24", dict(num_bytes_per_token=24), ValueError,
     "num_bytes_per_token must be a positive multiple of 16, got 24"),
    ("nbpt-0", dict(num_bytes_per_token=0), ValueError, "num_bytes_per_token must be a positive multiple of 16, got 0"),
    ("read-bytes-8", dict(read_bytes=8), ValueError, "read_bytes must be a positive multiple of 16, got 8"),
    ("read-bytes-negative", dict(read_bytes=-16), ValueError, "read_bytes must be a positive multiple of 16, got -16"),
    ("read-bytes-over-nbpt", dict(read_bytes=48), ValueError, "read_bytes must be <= num_bytes_per_token (32), got 48"),
    ("tensor-1d", dict(tensor=torch.zeros(64, dtype=torch.uint8)), ValueError,
     "tensor must be at least 2-D, got shape (64,)"),
    ("tensor-list", dict(tensor=[[0] * 32]), TypeError, "tensor must be a torch.Tensor, got list"),
    ("row-stride-40-bytes", dict(tensor=torch.zeros(4, 40, dtype=torch.uint8)[:, :32]), ValueError,
     "tensor must be a row stride that is a multiple of 16 bytes, got 40 bytes"),
    ("row-stride-fp16-20", dict(tensor=torch.zeros(4, 20, dtype=torch.float16)[:, :16]), ValueError,
     "tensor must be a row stride that is a multiple of 16 bytes, got 40 bytes"),
    ("row-narrower-than-page", dict(tensor=torch.zeros(4, 32, dtype=torch.uint8), page_size=2), ValueError,
     "tensor must be rows of at least page_size * num_bytes_per_token = 64 bytes, got 32 bytes"),
    ("row-narrower-3d", dict(tensor=torch.zeros(4, 2, 4, dtype=torch.float32), page_size=2), ValueError,
     "tensor must be rows of at least page_size * num_bytes_per_token = 64 bytes, got 32 bytes"),
]


@pytest.mark.parametrize("name, changes, exc, message", SOURCE_CASES, ids=[c[0] for c in SOURCE_CASES])
def test_real_kv_source_rejected(name, changes, exc, message):
    with pytest.raises(exc) as info:
        src(**changes)
    assert str(info.value) == "kv-canary: RealKvSource " + message


@pytest.mark.parametrize("tensor, page_size, nbpt", [
    (torch.zeros(3, 64, dtype=torch.uint8), 2, 32),  # exactly page_size * nbpt
    (torch.zeros(3, 48, dtype=torch.bfloat16)[:, :32], 2, 32),  # padded rows: 96-byte stride
    (torch.zeros(0, 32, dtype=torch.uint8), 4, 32),  # no rows at all
    (torch.zeros(2, 4, 2, 4, dtype=torch.float32), 2, 64),  # 4-D pages
], ids=["exact-row", "padded-row-stride", "no-rows", "4d-pages"])
def test_real_kv_source_accepted(tensor, page_size, nbpt):
    s = RealKvSource(tensor, page_size=page_size, num_bytes_per_token=nbpt, read_bytes=16)
    assert s.num_slots == tensor.shape[0] * page_size


@pytest.mark.parametrize("backend", ["triton", "numba"])
def test_backend_package_unavailable(monkeypatch, backend):
    monkeypatch.setattr(api, f"{backend}_available", lambda: False)
    with pytest.raises(ValueError) as info:
        ops.fingerprint(t([1]), (), backend=backend)
    assert str(info.value).startswith(f"kv-canary: backend must be importable, got '{backend}' without the {backend} "
                                      "package")


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setattr(api, "triton_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError) as info:
        ops.fingerprint(t([1]), (), backend="triton")
    assert str(info.value) == "kv-canary: backend 'triton' on cpu tensors needs TRITON_INTERPRET=1, got it unset"


def test_auto_backend_on_cpu_is_numba_when_it_imports(monkeypatch):
    monkeypatch.setattr(api, "numba_available", lambda: True)
    assert api.resolve_backend("auto", torch.device("cpu")) == "numba"
    monkeypatch.setattr(api, "numba_available", lambda: False)
    assert api.resolve_backend("auto", torch.device("cpu")) == "torch"
    assert api.resolve_backend("reference", torch.device("cpu")) == "reference"


def test_auto_backend_on_cuda_never_numba(monkeypatch):
    monkeypatch.setattr(api, "numba_available", lambda: True)
    monkeypatch.setattr(api, "triton_available", lambda: False)
    assert api.resolve_backend("auto", torch.device("cuda")) == "torch"


def test_numba_rejects_other_devices(monkeypatch):
    monkeypatch.setattr(api, "numba_available", lambda: True)
    with pytest.raises(ValueError) as info:
        api.resolve_backend("numba", torch.device("cuda"))
    assert str(info.value) == "kv-canary: backend 'numba' must run on cpu tensors, got cuda"


def test_rejected_write_leaves_ring_and_buffer_alone():
    """A call that fails its last check (the launch tag) after a clean call changed nothing more."""
    kw = good("write")
    kw["plan"].write_offsets[1] = 1
    kw["plan"].seed_slot[0] = 5  # a seeded request: the chain-position assert checks it
    ops.write(**dict(kw, positions=t([7])), chain_check=t([1], I32), backend="torch")
    snapshot = [x.clone() for x in (kw["buf"], kw["ring"].rows, kw["ring"].write_index, kw["counters"])]
    with pytest.raises(ValueError):
        ops.write(**dict(kw, launch_tag=99), backend="torch")
    assert int(snapshot[2][0]) == 1
    for x, y in zip((kw["buf"], kw["ring"].rows, kw["ring"].write_index, kw["counters"]), snapshot):
        assert torch.equal(x, y)


def test_ring_allocation_bounds_capacity_by_the_count_limit():
    with pytest.raises(ValueError, match=r"kv-canary: ViolationRing capacity must be in \[0, 1073741824\], got -1"):
        ViolationRing.allocate(-1)
    with pytest.raises(ValueError, match="got 1073741825"):
        ViolationRing.allocate(2**30 + 1)
