"""The canary's public entry points under misuse: a clear error, and every buffer and counter as before.

Each case starts from a toy engine that ran one clean forward, makes one mistake, and compares
the canary's whole state (canary buffers, ring, counters, token table, host counters) byte for
byte with a snapshot taken before the call.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kvcanary import Canary, CanaryConfig, ForwardBatch, PoolSpec, RealKvSource, TokenAppend
from kvcanary.runtime import monitor as monitor_mod
from kvcanary.runtime.batch import verified_cells
from toy_engine import ToyEngine


def state(c: Canary) -> dict:
    out = {f"{g.name}_{k}": b.clone() for g in c.groups for k, b in g.bufs.items()}
    out.update(ring=c.ring.rows.clone(), write_index=c.ring.write_index.clone(), counters=c.counters.clone(),
               tokens=c.token_table.clone(), step_tensor=c.step_tensor.clone())
    out["host"] = (c.step, c.monitor.forwards, c.monitor.tokens, dict(c.monitor.sweeps), len(c.violations))
    return out


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for k, a in before.items():
        b = after[k]
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, k


def engine(**kw) -> ToyEngine:
    e = ToyEngine(token_history=kw.pop("token_history", True), **kw)
    e.add(1, [11, 12, 13, 14])
    e.forward([(1, 4)])
    return e


def batch_of(e: ToyEngine, rows, prefix, extend, locs, rtt=None, history=None) -> ForwardBatch:
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    n = len(locs)
    return ForwardBatch(t(rows), t(prefix), t(extend), t([5] * n), t(list(range(n))), t(locs),
                        e.rtt if rtt is None else rtt, request_ids=t(list(range(len(rows)))), token_history=history)


def rejected(e: ToyEngine, call, exc, match: str) -> None:
    before = state(e.canary)
    with pytest.raises(exc, match=match):
        call()
    assert_same(before, state(e.canary))


# -- item 2 and 5: forwards the canary cannot plan exactly --------------------------------------
BAD_BATCHES = [
    ("prefix-wider-than-table", dict(rows=[1], prefix=[30], extend=[4], locs=[40, 41, 42, 43]),
     r"prefix_lens \+ extend_lens must be <= req_to_token columns \(32\), got 30 \+ 4"),
    ("row-past-num-rows", dict(rows=[9], prefix=[0], extend=[1], locs=[40]),
     r"req_pool_indices must be rows in \[0, 8\) .*got 9 at batch index 0"),
    ("negative-row", dict(rows=[-1], prefix=[0], extend=[1], locs=[40]), r"req_pool_indices must be rows in"),
    ("negative-prefix", dict(rows=[1], prefix=[-2], extend=[1], locs=[40]), r"prefix_lens must be >= 0, got -2"),
    ("negative-extend", dict(rows=[1], prefix=[4], extend=[-1], locs=[]), r"extend_lens must be >= 0, got -1"),
    ("extend-sum-short", dict(rows=[1], prefix=[4], extend=[1], locs=[40, 41]),
     r"out_cache_loc must be of length sum\(extend_lens\) = 1, got length 2"),
    ("extend-sum-long", dict(rows=[1, 2], prefix=[4, 0], extend=[1, 3], locs=[40, 41]),
     r"out_cache_loc must be of length sum\(extend_lens\) = 4, got length 2"),
    ("slot-past-pool", dict(rows=[1], prefix=[4], extend=[1], locs=[64]),
     r"out_cache_loc must be slots < num_slots \(64\)"),
    ("row0-with-prefix", dict(rows=[0], prefix=[3], extend=[1], locs=[40]),
     r"req_pool_indices must be free of row 0 .*got row 0 with prefix_lens 3"),
    ("row0-before-real-request", dict(rows=[0, 1], prefix=[0, 4], extend=[2, 1], locs=[40, 41, 42]),
     r"req_pool_indices must be free of row 0 .*got row 1 with prefix_lens 4 at batch index 1"),
]


@pytest.mark.parametrize("name, kw, match", BAD_BATCHES, ids=[c[0] for c in BAD_BATCHES])
def test_bad_batch_rejected_before_anything_changes(name, kw, match):
    e = engine()
    b = batch_of(e, **kw)
    rejected(e, lambda: e.canary.before_forward(b), ValueError, "^kv-canary: forward batch " + match)
    # The canary is still usable: the next correct forward is clean.
    e.forward([(1, 1)])
    assert e.canary.flush() == []


def test_one_d_req_to_token_is_named():
    e = engine()
    b = batch_of(e, [1], [4], [1], [40], rtt=e.rtt[1])
    rejected(e, lambda: e.canary.before_forward(b), ValueError, "kv-canary: forward batch req_to_token must be 2-D")


def test_padding_rows_after_real_requests_are_accepted():
    e = engine()
    e.rtt[1, 4] = 40
    b = batch_of(e, [1, 0, 0], [4, 0, 0], [1, 1, 1], [40, 0, 0])
    b.input_ids[0], b.positions[0] = 99, 4
    e.canary.before_forward(b)
    e.canary.after_forward(b)
    assert e.canary.flush() == []


def test_row_zero_handed_to_a_request_is_an_error_not_false_violations():
    e = ToyEngine(token_history=True)
    e.free_rows.insert(0, 0)  # the engine's bug: its row allocator hands out the padding row
    e.add(1, [11, 12, 13, 14])
    e.add(2, [21, 22])
    with pytest.raises(ValueError, match="row 0 is the padding row"):
        e.forward([(1, 4), (2, 2)])
    assert e.canary.flush() == []


def test_report_path_keeps_violations_when_attribution_fails(monkeypatch, caplog):
    e = engine()
    e.add(2, [21, 22], share_from=1, shared=2)
    e.rtt[e.reqs[2]["row"], 1] = e.slot(1, 3)  # a stale table entry: a real violation
    monkeypatch.setattr(monitor_mod, "verified_cells", lambda *a: [][1])  # attribution blows up
    with caplog.at_level(logging.ERROR, logger="kvcanary"):
        e.forward([(2, 1)])
    assert e.canary.flush() and e.canary.stats()["violations"] == len(e.canary.violations)
    assert "attribution of a violation" in caplog.text


def test_verified_cells_tolerates_rows_and_prefixes_outside_the_table():
    e = engine()
    b = batch_of(e, [1, 9, 1], [40, 2, 2], [0, 0, 0], [])
    cells = verified_cells(b, 0, None)
    assert [c[1] for c in cells] == list(range(32)) + [0, 1]


# -- item 3: lifecycle and real-KV sources --------------------------------------------------------
def test_after_forward_without_before_forward():
    e = engine()
    b = batch_of(e, [1], [4], [1], [40])
    rejected(e, lambda: e.canary.after_forward(b), RuntimeError,
             "kv-canary: after_forward must follow before_forward")
    e.forward([(1, 1)])
    assert e.canary.flush() == []


def test_after_forward_twice_and_before_forward_twice():
    e = engine()
    e.rtt[1, 4] = 40
    b = batch_of(e, [1], [4], [1], [40])
    e.canary.before_forward(b)
    rejected(e, lambda: e.canary.before_forward(b), RuntimeError, "got a second before_forward at step 1")
    e.canary.after_forward(b)
    rejected(e, lambda: e.canary.after_forward(b), RuntimeError, "no forward open at step 2")
    assert e.canary.stats()["forwards"] == 2


def test_failed_before_forward_leaves_no_forward_open():
    e = engine()
    with pytest.raises(ValueError):
        e.canary.before_forward(batch_of(e, [9], [0], [1], [40]))
    with pytest.raises(RuntimeError, match="after_forward must follow"):
        e.canary.after_forward(batch_of(e, [1], [4], [1], [40]))


@pytest.mark.parametrize("make", [
    pytest.param(lambda: torch.zeros(4, 64, 8).permute(1, 0, 2), id="heads-first-permute"),
    pytest.param(lambda: torch.zeros(1, 8).expand(64, 8), id="expand-stride-0"),
])
def test_overlapping_source_rows_rejected(make):
    t = make()
    nbpt = t[0].numel() * 4
    with pytest.raises(ValueError, match="RealKvSource tensor must be a row stride of at least .* "
                                         r"\(rows must not overlap\)"):
        RealKvSource(t, page_size=1, num_bytes_per_token=nbpt, read_bytes=nbpt)


# -- item 4: token appends and record movement ------------------------------------------------------
@pytest.mark.parametrize("field, value, match", [
    ("cell_rows", 100, r"token_history.cell_rows must be values in \[0, 8\), got \[1, 100\]"),
    ("cell_rows", -1, r"token_history.cell_rows must be values in \[0, 8\), got \[-1, 1\]"),
    ("cell_cols", 32, r"token_history.cell_cols must be values in \[0, 32\)"),
    ("valid_lens", 33, r"token_history.valid_lens must be values in \[0, 33\)"),
])
def test_token_append_out_of_range(field, value, match):
    e = engine(token_history="append")
    e.rtt[1, 4] = 40
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    hist = dict(cell_rows=t([1, 1]), cell_cols=t([4, 5]), cell_tokens=t([7, 8]), valid_lens=t([5]))
    hist[field] = hist[field].clone()
    hist[field][-1] = value
    b = batch_of(e, [1], [4], [1], [40], history=TokenAppend(**hist))
    rejected(e, lambda: e.canary.before_forward(b), ValueError, "kv-canary: forward batch " + match)


def slots(*xs, dtype=torch.int64):
    return torch.tensor(xs, dtype=dtype)


@pytest.mark.parametrize("call, exc, match", [
    (lambda c: c.copy_records(slots(1, 2), slots(3, 1000)), ValueError,
     r"copy_records dst_slots must be slots in \[0, 64\), got \[3, 1000\]"),
    (lambda c: c.copy_records(slots(-1), slots(3)), ValueError, r"copy_records src_slots must be slots in"),
    (lambda c: c.copy_records(slots(1, 2), slots(3)), ValueError, "copy_records dst_slots must be of length 2"),
    (lambda c: c.copy_records(slots(1.0, dtype=torch.float32), slots(3)), TypeError,
     "copy_records src_slots must be int32 or int64, got torch.float32"),
    (lambda c: c.copy_records([1], [3]), TypeError, "copy_records src_slots must be a torch.Tensor, got list"),
    (lambda c: c.copy_records(slots(1), slots(3), group="swa"), ValueError, "group must be one of"),
    (lambda c: c.restore_records(c.save_records(slots(1, 2)), slots(3, 1000)), ValueError,
     r"restore_records slots must be slots in \[0, 64\)"),
    (lambda c: c.restore_records(c.save_records(slots(1, 2)), slots(3)), ValueError,
     r"restore_records saved\[\('head', 'k'\)\] must be uint8 records of shape \(1, 48\)"),
    (lambda c: c.restore_records({}, slots(3)), TypeError, "restore_records saved must be the dict save_records"),
    (lambda c: c.save_records(slots(70)), ValueError, r"save_records slots must be slots in \[0, 64\)"),
])
def test_record_movement_validated_before_any_write(call, exc, match):
    e = engine()
    rejected(e, lambda: call(e.canary), exc, "kv-canary: " + match)


def test_record_movement_still_works():
    e = engine()
    src = slots(*[e.slot(1, p) for p in range(4)])
    dst = slots(40, 41, 42, 43, dtype=torch.int32)
    e.canary.copy_records(src, dst)
    saved = e.canary.save_records(dst)
    e.canary.restore_records(saved, slots(50, 51, 52, 53))
    buf = e.canary.groups[0].bufs["tail", "k"]
    assert torch.equal(buf[50:54], buf[src])


# -- item 6: constructors ---------------------------------------------------------------------------
def pool():
    return PoolSpec(64)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: PoolSpec("64"), TypeError, "PoolSpec num_slots must be an int >= 2, got '64'"),
    (lambda: PoolSpec(64.5), TypeError, "PoolSpec num_slots must be an int >= 2, got 64.5"),
    (lambda: PoolSpec(True), TypeError, "PoolSpec num_slots must be an int >= 2, got True"),
    (lambda: PoolSpec(1), ValueError, "PoolSpec num_slots must be an int >= 2, got 1"),
    (lambda: PoolSpec(64, k_sources=5), TypeError, "PoolSpec k_sources must be a tuple of RealKvSource, got int"),
    (lambda: PoolSpec(64, swa=3), TypeError, "PoolSpec swa must be a SwaSpec or None, got int"),
    (lambda: Canary(pool(), max_batch=True, max_tokens=8, max_context=8, num_rows=4), TypeError,
     "Canary max_batch must be an int >= 1, got True"),
    (lambda: Canary(pool(), max_batch=0, max_tokens=8, max_context=8, num_rows=4), ValueError,
     "Canary max_batch must be an int >= 1, got 0"),
    (lambda: Canary(pool(), max_batch=2, max_tokens=8.0, max_context=8, num_rows=4), TypeError,
     "Canary max_tokens must be an int >= 1, got 8.0"),
    (lambda: Canary(64, max_batch=2, max_tokens=8, max_context=8, num_rows=4), TypeError,
     "Canary pool must be a PoolSpec, got int"),
    (lambda: Canary(pool(), {"mode": "raise"}, max_batch=2, max_tokens=8, max_context=8, num_rows=4), TypeError,
     "Canary config must be a CanaryConfig or None, got dict"),
    (lambda: Canary(pool(), max_batch=2, max_tokens=8, max_context=8, num_rows=4, on_violation=42), TypeError,
     "Canary on_violation must be a callable or None, got 42"),
    (lambda: Canary(pool(), max_batch=2, max_tokens=8, max_context=8, num_rows=4, device="cuda:99"), ValueError,
     "Canary device must be an available device, got 'cuda:99'"),
    (lambda: Canary(pool(), max_batch=2, max_tokens=8, max_context=8, num_rows=4, device="gpu"), ValueError,
     "Canary device must be a torch device such as 'cpu' or 'cuda:0', got 'gpu'"),
    (lambda: CanaryConfig(check_v="no"), TypeError, "config check_v must be a bool"),
    (lambda: CanaryConfig(ring_capacity=1.5), TypeError, "config ring_capacity must be an int, got 1.5"),
    (lambda: CanaryConfig(sweep_interval=True), TypeError, "config sweep_interval must be an int, got True"),
    (lambda: CanaryConfig(mode=None), TypeError, "config mode must be a str, got None"),
    (lambda: CanaryConfig(inject_kv_prob="0.5"), TypeError, "config inject_kv_prob must be a number"),
    (lambda: CanaryConfig().replace(real_kv="everything"), ValueError, "config real_kv must be one of"),
], ids=lambda x: None)
def test_constructor_arguments(make, exc, match):
    with pytest.raises(exc, match="^kv-canary: " + match.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_cuda_device_without_cuda_is_named():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="kv-canary: Canary device must be an available device, got 'cuda'"):
        Canary(pool(), max_batch=2, max_tokens=8, max_context=8, num_rows=4, device="cuda")


# -- item 7: sweeps -----------------------------------------------------------------------------------
def cached_triples(e: ToyEngine, rid: int, n: int):
    s = [e.slot(rid, p) for p in range(n)]
    return slots(*s), slots(*range(n)), slots(-1, *s[:-1])


def test_sweep_beyond_capacity_verifies_every_triple():
    e = engine(sweep_capacity=2)
    e.k[e.slot(1, 3), 0, 0] += 1.0  # only the last of four triples is corrupted: in the second chunk
    e.canary.sweep(*cached_triples(e, 1, 4))
    vs = e.canary.flush()
    assert [(v.launch_tag, v.slot) for v in vs] == [("SWEEP_K_FULL", e.slot(1, 3))]
    assert e.canary.stats()["sweeps"] == 1


def test_sweep_violations_reach_flush_without_another_forward():
    e = engine()
    e.k[e.slot(1, 1), 0, 0] += 1.0
    e.canary.sweep(*cached_triples(e, 1, 4))
    assert [v.slot for v in e.canary.flush()] == [e.slot(1, 1)]
    e.forward([(1, 1)])  # and they are not reported twice; the corrupted slot is read again by the forward
    assert all(v.launch_tag != "SWEEP_K_FULL" for v in e.canary.violations[1:])


def test_sweep_arguments_validated():
    e = engine()
    s, p, pr = cached_triples(e, 1, 4)
    rejected(e, lambda: e.canary.sweep(s, p[:3], pr), ValueError, "kv-canary: sweep positions must be of length 4")
    rejected(e, lambda: e.canary.sweep(slots(1, 99), p[:2], pr[:2]), ValueError,
             r"kv-canary: sweep slots must be slots in \[0, 64\)")


def test_metadata_rejected_without_value_checks_leaves_no_forward_open():
    e = engine(value_check="off")
    b = batch_of(e, [1], [4], [1], [40])
    b.req_pool_indices = b.req_pool_indices.to(torch.int16)
    rejected(e, lambda: e.canary.before_forward(b), TypeError,
             "kv-canary: forward batch req_pool_indices must be int32 or int64, got torch.int16")
    with pytest.raises(RuntimeError, match="after_forward must follow"):
        e.canary.after_forward(b)
