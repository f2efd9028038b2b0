"""The Canary on a hand-made engine: clean runs stay silent, planted bugs are reported precisely."""

import importlib.util
import json
import logging
from types import SimpleNamespace

import pytest
import torch

from kvcanary import CanaryConfig, KvCanaryHealthError, KvCanaryViolationError, TokenAppend, violations_to_json
from kvcanary.format import FailReason

from toy_engine import ToyEngine

BACKEND = "torch" if importlib.util.find_spec("kvcanary.ops.torch_ops") else "reference"


def engine(**kw):
    kw.setdefault("backend", BACKEND)
    kw.setdefault("warmup_steps", 0)
    return ToyEngine(**kw)


def reasons(violations):
    return {(v.launch_tag, v.fail_reason) for v in violations}


def run_clean_workload(e):
    e.add(1, [5, 6, 7, 8, 9, 10])
    e.forward([(1, 4)])  # prefill chunk
    e.canary.mark_ready()
    e.forward([(1, 2)])  # second chunk
    e.add(2, [5, 6, 7, 8, 9, 10, 11], share_from=1, shared=5)  # prefix sharing
    e.forward([(1, 1), (2, 2)])
    for _ in range(3):
        e.forward([(1, 1), (2, 1)])  # decode
    e.forward([(1, 3)])  # target verify: 3 draft tokens
    return e.canary.flush()


@pytest.mark.parametrize("kw", [
    {},
    {"check_v": True},
    {"token_history": True},
    {"oracle": True},
    {"swa_window": 3, "swa_slots": 64},
    {"swa_window": 3, "swa_slots": 64, "check_v": True, "real_kv": "all"},
    {"record_stride": 32},
    {"record_stride": 64, "real_kv": "none"},
], ids=["k-only", "k+v", "token-history", "oracle", "swa", "swa+v+all", "stride32", "stride64-no-realkv"])
def test_clean_run_reports_nothing(kw):
    e = engine(**kw)
    assert run_clean_workload(e) == []
    stats = e.canary.stats()
    assert stats["violations"] == 0 and stats["forwards"] == 7
    assert stats["entries_checked"] > 0
    assert e.canary.check_health() == []


def test_clean_run_counts_every_launch():
    e = engine(check_v=True)
    run_clean_workload(e)
    launches = e.canary.stats()["launches"]
    # HEAD: one verify + one write per forward; TAIL the same.
    for tag in ("HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL", "TAIL_V_FULL"):
        assert launches[tag] == 14


def test_swapped_table_cell_is_a_chain_violation_with_attribution():
    e = engine()
    e.add(1, [5, 6, 7, 8])
    e.add(2, [9, 9, 9, 9])
    e.forward([(1, 4), (2, 4)])
    victim = e.slot(1, 2)
    e.rtt[e.reqs[2]["row"], 2] = victim  # request 2 now reads request 1's KV at position 2
    e.forward([(1, 1), (2, 1)])
    vs = e.canary.flush()
    assert {v.slot for v in vs} == {victim, e.slot(2, 3)}
    head = [v for v in vs if v.launch_tag == "HEAD_K_FULL" and v.slot == victim][0]
    assert head.reasons == ("verify_chain_hash",) and head.position == 2 and head.stored_token == 7
    assert head.reader_request == 2 and head.reader_position == 2
    assert head.writer_request == 1 and head.writer_step == 1  # forwards count from 1, as violation steps
    assert "two requests own this slot" in head.block()


def test_stale_slot_reused_by_another_request():
    e = engine()
    e.add(1, [1, 2, 3])
    e.forward([(1, 3)])
    stale = e.slot(1, 1)
    e.free.insert(0, stale)  # freed while request 1 still maps it
    e.add(2, [4])
    e.forward([(2, 1)])  # request 2 overwrites the slot
    e.forward([(1, 1)])
    vs = e.canary.flush()
    assert any(v.slot == stale and v.fail_reason & FailReason.VERIFY_POSITION and v.reader_request == 1
               and v.writer_request == 2 for v in vs)


def test_flipped_kv_byte_is_a_real_kv_violation_at_tail():
    e = engine()
    e.add(1, [1, 2, 3, 4])
    e.forward([(1, 4)])
    target = e.slot(1, 1)
    e.forward([(1, 1)], corrupt=lambda eng: eng.k.view(torch.uint8)[target, 0, 5].add_(1))
    vs = e.canary.flush()
    assert reasons(vs) == {("TAIL_K_FULL", int(FailReason.VERIFY_REAL_KV_HASH))}
    assert vs[0].slot == target and vs[0].position == 1


def test_wrong_token_in_history_is_a_token_violation():
    e = engine(token_history=True)
    e.add(1, [1, 2, 3, 4])
    e.forward([(1, 4)])
    e.reqs[1]["tokens"][2] = 99  # the engine's idea of the history diverged from the KV
    e.forward([(1, 1)])
    vs = e.canary.flush()
    assert {(v.launch_tag, v.reasons, v.expected_token, v.stored_token) for v in vs} == {
        ("HEAD_K_FULL", ("verify_token",), 99, 3), ("TAIL_K_FULL", ("verify_token",), 99, 3)}


def _stale_cell_run(token_history):
    e = engine(token_history=token_history)
    e.add(1, [5, 6, 7, 8])
    e.add(2, [9, 9, 9, 9])
    e.forward([(1, 4), (2, 4)])
    e.forward([(1, 1), (2, 1)])
    victim = e.slot(1, 2)
    e.rtt[e.reqs[2]["row"], 2] = victim  # request 2 now reads request 1's KV at position 2
    e.forward([(1, 1), (2, 1)])
    return e.canary.flush(), victim


def test_token_append_reports_what_a_whole_history_reports():
    whole, victim = _stale_cell_run(True)
    append, _ = _stale_cell_run("append")
    key = lambda vs: sorted((v.launch_tag, v.slot, v.position, v.reasons, v.expected_token) for v in vs)  # noqa: E731
    assert key(append) == key(whole)
    token = [v for v in append if v.slot == victim and v.launch_tag == "HEAD_K_FULL"]
    assert token and "verify_token" in token[0].reasons and token[0].expected_token == 9


def test_token_append_only_sends_new_cells_and_a_clean_run_stays_clean():
    e = engine(token_history="append")
    e.add(1, [1, 2, 3, 4])
    e.forward([(1, 4)])
    assert e.sent == {1: 4}
    for _ in range(3):
        e.forward([(1, 1)])
    assert e.sent == {1: 7} and e.canary.flush() == []
    assert e.canary.token_table[e.reqs[1]["row"], :7].tolist() == e.reqs[1]["tokens"][:7]


def test_token_append_with_mismatched_lengths_is_rejected_before_any_launch():
    e = engine(token_history="append")
    e.add(1, [1, 2])
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731

    def bad(batch):
        batch.token_history = TokenAppend(t([1, 1]), t([0]), t([1, 2]), t([2]))

    with pytest.raises(ValueError, match="token_history.cell_cols"):
        e.forward([(1, 2)], feed=bad)


def test_wrong_position_fed_to_the_model():
    e = engine(oracle=True)
    e.add(1, [1, 2, 3, 4])
    e.forward([(1, 3)])
    e.canary.mark_ready()

    def shift(batch):
        batch.positions = batch.positions + 1

    e.forward([(1, 1)], feed=shift)
    vs = e.canary.flush()
    w = [v for v in vs if v.is_write_check]
    # The write-input and chain-position asserts each record a row (SGLang's rule), both expecting position 3.
    assert len(w) == 2 and all(v.reasons == ("write_position",) and v.position == 4 and v.expected_aux == 3
                               for v in w)


def test_chain_position_assert_is_armed_by_mark_ready():
    e = engine()
    e.add(1, [1, 2, 3, 4, 5])
    e.forward([(1, 2)])

    def skip(batch):
        batch.positions = batch.positions + 1

    e.forward([(1, 1)], feed=skip)  # not ready yet: no chain-position assert
    assert not [v for v in e.canary.flush() if v.is_write_check]
    e.canary.mark_ready()

    def jump(batch):
        batch.positions = batch.positions + 5

    e.forward([(1, 1)], feed=jump)
    assert [v.reasons for v in e.canary.flush() if v.is_write_check] == [("write_position",)]


def test_cached_idle_slot_corruption_found_by_sweep():
    e = engine(sweep_interval=1)
    e.add(1, [1, 2, 3, 4])
    e.forward([(1, 4)])
    cached = [e.slot(1, p) for p in range(4)]
    t = lambda x: torch.tensor(x)  # noqa: E731
    e.canary.sweep_provider = lambda: (t(cached), t([0, 1, 2, 3]), t([-1] + cached[:3]))
    e.add(2, [7])
    e.forward([(2, 1)])
    assert e.canary.flush() == []
    e.k.view(torch.uint8)[cached[2], 0, 0] ^= 0xFF
    e.forward([(2, 1)])
    vs = e.canary.flush()
    assert reasons(vs) == {("SWEEP_K_FULL", int(FailReason.VERIFY_REAL_KV_HASH))}
    assert vs[0].slot == cached[2] and vs[0].writer_request == 1


def test_swa_missing_translation_is_caught():
    e = engine(swa_window=2, swa_slots=64)
    e.add(1, [1, 2, 3, 4])
    e.forward([(1, 4)])
    s = e.slot(1, 3)
    e.full_to_swa[s] = e.full_to_swa[e.slot(1, 1)]  # wrong address in the SWA space
    e.forward([(1, 1)])
    vs = e.canary.flush()
    assert vs and all(v.launch_tag.endswith("SWA") for v in vs)


def test_swa_evicted_predecessor_is_not_a_violation():
    e = engine(swa_window=2, swa_slots=64)
    e.add(1, [1, 2, 3, 4, 5])
    e.forward([(1, 4)])
    e.full_to_swa[e.slot(1, 0)] = 0  # evicted: outside every later window
    e.full_to_swa[e.slot(1, 1)] = 0
    e.forward([(1, 1)])
    assert e.canary.flush() == []


def test_mode_raise_and_callback():
    seen = []
    e = engine(mode="raise")
    e.canary.monitor.on_violation = seen.append
    e.add(1, [1, 2, 3])
    e.forward([(1, 3)])
    e.rtt[e.reqs[1]["row"], 0] = e.slot(1, 2)
    with pytest.raises(KvCanaryViolationError) as info:
        e.forward([(1, 1)])
    assert info.value.total == len(seen) >= 1
    assert "kv_canary violation: launch_tag=HEAD_K_FULL" in str(info.value)


def test_mode_none_runs_nothing():
    e = engine(mode="none")
    e.add(1, [1, 2, 3])
    e.forward([(1, 3)])
    e.rtt[e.reqs[1]["row"], 0] = 5
    e.forward([(1, 1)])
    assert e.canary.flush() == [] and int(e.canary.counters.sum()) == 0


def test_a_replayed_close_of_a_disabled_canary_does_nothing():
    # after_replayed is after_forward for an adapter's replayed steps: a disabled canary opened no
    # forward, so it must return as after_forward does, not complain of a close without an open
    e = engine(mode="none")
    e.add(1, [1, 2, 3])
    b = e.forward([(1, 3)])
    e.canary.before_forward(b)
    e.canary.launcher.run_here(e.canary.after_replayed, b, None)
    assert e.canary.step == 0 and e.canary.flush() == []


def test_log_mode_logs_the_structured_line(caplog):
    e = engine()
    e.add(1, [1, 2, 3])
    e.forward([(1, 3)])
    e.k.view(torch.uint8)[e.slot(1, 0), 0, 0] ^= 1
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        e.forward([(1, 1)])
        e.canary.flush()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv_canary violation:")]
    v = e.canary.violations[0]
    assert lines == [v.log_line()]
    assert v.log_line() == (
        f"kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash slot_idx={v.slot} "
        f"position=0 stored_token=1 expected_token=-1 stored_chain_hash=0xde7fae23a9a1b716 "
        f"expected_aux=0xde7fae23a9a1b716")


def test_ring_overflow_reports_true_total(caplog):
    e = engine(ring_capacity=2)
    e.add(1, [1, 2, 3, 4, 5, 6])
    e.forward([(1, 6)])
    e.k.view(torch.uint8)[1:7, 0, 0] ^= 1  # all six slots
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        e.forward([(1, 1)])
        e.canary.flush()
    assert len(e.canary.violations) == 2 and e.canary.stats()["violations"] == 6
    assert any("ring overflow" in r.getMessage() for r in caplog.records)
    doc = json.loads(violations_to_json(e.canary.violations, e.canary.stats()["violations"]))
    assert doc["total"] == 6 and doc["stored"] == 2 and doc["violations"][0]["launch_tag"] == "TAIL_K_FULL"


def test_plan_overflow_skips_verify_and_warns_once(caplog):
    e = engine(plan_capacity=4)
    e.add(1, [1, 2, 3, 4, 5, 6, 7, 8])
    e.forward([(1, 4)])
    e.rtt[e.reqs[1]["row"], 1] = e.slot(1, 3)  # would be caught if verified
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        e.forward([(1, 1)])  # 4 entries: fits, catches
        e.forward([(1, 1)])  # 5 entries: overflow, skipped
        e.forward([(1, 1)])
        e.canary.flush()
    overflow = [r for r in caplog.records if "plan overflow" in r.getMessage()]
    assert len(overflow) == 1 and "5 verify entries" in overflow[0].getMessage()
    assert {v.step for v in e.canary.violations} == {2}


def test_health_fires_when_launches_stop():
    e = engine(health_interval=0)
    e.add(1, [1, 2, 3])
    e.forward([(1, 3)])
    assert e.canary.check_health() == []
    # The engine keeps stepping the host side but the device part no longer runs (e.g. a graph without it).
    b = e.forward([(1, 0)])
    e.canary.host_before(b)
    e.canary.host_after(b)
    e.canary.host_before(b)
    e.canary.host_after(b)
    e.canary.check_health()
    e.canary.device_before = lambda batch: None
    e.canary.device_after = lambda batch: None
    e.forward([(1, 0)])
    problems = e.canary.check_health()
    assert problems and all("ran 0 launches" in p for p in problems)
    assert {p.split()[0] for p in problems} == {"HEAD_K_FULL", "TAIL_K_FULL"}


def test_health_raises_in_raise_mode_and_not_before_warmup():
    e = engine(mode="raise", health_interval=1, warmup_steps=3)
    e.add(1, [1, 2, 3])
    e.canary.device_before = lambda batch: None
    e.canary.device_after = lambda batch: None
    e.forward([(1, 1)])
    e.forward([(1, 1)])  # below warm-up: no check
    with pytest.raises(KvCanaryHealthError):
        e.forward([(1, 1)])
        e.forward([(1, 0)])


def test_health_quiet_when_sweep_off():
    e = engine(sweep_interval=0, health_interval=1)
    e.add(1, [1, 2, 3])
    for n in (3, 1, 1, 1):
        e.forward([(1, n)])
    assert e.canary.monitor.health_problems == []


@pytest.mark.parametrize("field, value, knob", [("max_batch", 1, "max_batch"), ("max_tokens", 2, "max_tokens")])
def test_capacity_errors_name_the_knob(field, value, knob):
    e = ToyEngine(backend=BACKEND, **{field: value})
    e.add(1, [1, 2, 3])
    e.add(2, [1, 2, 3])
    with pytest.raises(ValueError, match=knob):
        e.forward([(1, 3), (2, 3)])


def test_copy_and_restore_records_follow_kv_moves():
    e = engine()
    e.add(1, [1, 2, 3])
    e.forward([(1, 3)])
    src = torch.tensor([e.slot(1, p) for p in range(3)])
    dst = torch.tensor([40, 41, 42])
    saved = e.canary.save_records(src)
    e.k[dst] = e.k[src]
    e.canary.copy_records(src, dst)
    e.rtt[e.reqs[1]["row"], :3] = dst.to(torch.int32)  # the request now lives in the copies
    e.forward([(1, 1)])
    assert e.canary.flush() == []
    e.canary.restore_records(saved, torch.tensor([50, 51, 52]))
    e.k[50:53] = e.k[src]
    e.rtt[e.reqs[1]["row"], :3] = torch.tensor([50, 51, 52], dtype=torch.int32)
    e.forward([(1, 1)])
    assert e.canary.flush() == []


def test_config_from_env_and_errors():
    cfg = CanaryConfig.from_env({"KV_CANARY_MODE": "raise", "KV_CANARY_CHECK_V": "1",
                                 "KV_CANARY_SWEEP_INTERVAL": "8", "KV_CANARY_REAL_KV": "all"})
    assert (cfg.mode, cfg.check_v, cfg.sweep_interval, cfg.real_kv) == ("raise", True, 8, "all")
    with pytest.raises(ValueError, match="KV_CANARY_CHECK_V must be a boolean"):
        CanaryConfig.from_env({"KV_CANARY_CHECK_V": "maybe"})
    with pytest.raises(ValueError, match="KV_CANARY_RING_CAPACITY must be an integer"):
        CanaryConfig.from_env({"KV_CANARY_RING_CAPACITY": "lots"})
    with pytest.raises(ValueError, match="mode must be one of"):
        CanaryConfig(mode="loud")
    with pytest.raises(ValueError, match="record_stride"):
        CanaryConfig(record_stride=36)
    with pytest.raises(ValueError, match="backend"):
        CanaryConfig(backend="cuda")


def test_memory_report_follows_the_documented_formulas():
    e = engine(check_v=True, swa_window=3, swa_slots=40, record_stride=64, plan_capacity=100)
    m = e.canary.memory()
    assert m["record_bytes_per_slot"] == {"full": 4 * 64, "swa": 4 * 64}
    assert m["canary_buffers"] == 4 * 64 * (64 + 40)
    # 32 B per plan entry (full: plan_capacity; SWA: min(plan_capacity, max_batch * window)) + write metadata.
    assert m["plans"] == 32 * (100 + min(100, 4 * 3)) + 2 * (8 * (4 + 1) + 8 * 4)
    assert m["sweep_entries"] == 32 * (64 + 40)
    assert m["token_table"] == 8 * 32 * 4
    assert m["total"] == sum(v for k, v in m.items() if k not in ("total", "record_bytes_per_slot"))


def test_token_failure_names_the_request_that_reads_the_wrong_kv():
    # Request 2 maps request 1's first three slots but its history says position 2 holds 99: the
    # token check fails for request 2 only, although request 1 (first in the batch) maps the slot too.
    e = engine(token_history=True)
    e.add(1, [5, 6, 7, 8])
    e.forward([(1, 4)])
    e.add(2, [5, 6, 99, 8], share_from=1, shared=3)
    e.forward([(1, 1), (2, 1)])
    vs = [v for v in e.canary.flush() if v.launch_tag == "HEAD_K_FULL"]
    assert [(v.reasons, v.slot, v.expected_token) for v in vs] == [(("verify_token",), e.slot(1, 2), 99)]
    assert vs[0].reader_request == 2 and vs[0].reader_position == 2 and vs[0].writer_request == 1
    assert "read by request 2 at position 2" in vs[0].block() and "last written by request 1 at step 1" in vs[0].block()


def replayed_steps(e, fused: list) -> None:
    """An adapter that runs each step's whole canary work after the forward, as one sequence (the
    transformers adapter's fused steady steps): ``device_before``, ``device_after``, ``close_step``,
    wherever ``fusable`` allows; the ordinary hooks otherwise. ``fused`` collects its choices."""
    c = e.canary
    before, after = c.before_forward, c.after_forward
    state = {}

    def on_before(batch):
        state["fuse"] = c.fusable()
        fused.append(state["fuse"])
        if not state["fuse"]:
            before(batch)

    def on_after(batch):
        if not state["fuse"]:
            return after(batch)
        c.check_replayed(batch)
        c.device_before(batch)
        c.device_after(batch)
        c.close_step(batch, launch_s=0.25)  # (the host seconds the adapter says launching took)

    c.before_forward, c.after_forward = on_before, on_after


def replayed_workload(e) -> list:
    e.add(1, [1, 2, 3, 4])
    e.add(2, [7, 8, 9])
    e.forward([(1, 4), (2, 3)])
    target = e.slot(1, 1)
    for step in range(6):
        corrupt = (lambda eng: eng.k.view(torch.uint8)[target, 0, 5].add_(1)) if step == 2 else None
        e.forward([(1, 1), (2, 1)], corrupt=corrupt)
        if step == 4:
            e.rtt[e.reqs[2]["row"], 1] = e.slot(1, 2)  # a stale table entry: the next HEAD reads another's slot
    return e.canary.flush()


def test_a_step_replayed_after_the_forward_reports_what_the_hooks_report():
    plain = engine(token_history="append", check_v=True, real_kv="all")
    expected = replayed_workload(plain)
    e = engine(token_history="append", check_v=True, real_kv="all")
    fused = []
    replayed_steps(e, fused)
    e.canary.host_times = {"runtime_s": 0.0, "launch_s": 0.0}  # (benchmarks: host time split by part)
    got = replayed_workload(e)
    assert all(fused) and len(fused) == 7
    assert e.canary.host_times["launch_s"] == 7 * 0.25 and e.canary.host_times["runtime_s"] > 0
    assert expected and [v.block() for v in got] == [v.block() for v in expected]
    assert e.canary.step == plain.canary.step == 7
    assert e.canary.stats()["entries_checked"] == plain.canary.stats()["entries_checked"]


@pytest.mark.parametrize("why", ["sweep-due", "injecting", "open-forward"])
def test_a_step_is_not_fusable_where_the_runtime_has_work_between_head_and_tail(why):
    kw = {"sweep-due": dict(sweep_interval=2), "injecting": dict(inject_kv_prob=0.5)}.get(why, {})
    e = engine(**kw)
    c = e.canary
    if why == "sweep-due":
        c.sweep_provider = lambda: None
    e.add(1, [1, 2, 3])
    b = e.forward([(1, 3)])
    if why == "sweep-due":  # a sweep runs at the close of every second step: not inside a fused sequence
        assert c.step == 1 and not c.fusable()
        e.forward([(1, 1)])
        assert c.step == 2 and c.fusable()
    elif why == "open-forward":
        assert c.fusable()
        c.before_forward(b)  # (the same batch again: a forward is open until its after_forward)
        assert not c.fusable()
        c.after_forward(b)
        assert c.fusable()
    else:
        assert not c.fusable()


def test_a_slot_fence_asks_cuda_only_while_its_record_may_be_in_flight(monkeypatch):
    """``SlotFence`` (what a fused step's staged-values copy waits on before its turn's buffer is refilled):
    complete once the slot's observation was finished or the slot was taken again, otherwise it
    synchronizes the slot's event."""
    from types import SimpleNamespace

    from kvcanary.runtime import observer

    synced = []
    monkeypatch.setattr(observer, "event_synchronize", synced.append)
    slot = SimpleNamespace(records=3, pending=(7, {}), event="event-of-step-7", known=0)
    fence = observer.SlotFence(slot)
    fence.wait()  # the observation of step 7 is not read yet: its copy may still be in flight
    assert synced == ["event-of-step-7"]
    slot.pending = None  # read (its event synchronized, or found complete)
    fence.wait()
    assert synced == ["event-of-step-7"]
    slot.records, slot.pending = 4, (10, {})  # taken again (which reads step 7 first), step 10 in flight
    fence.wait()
    assert synced == ["event-of-step-7"]
    assert observer.SlotFence(slot).records == 4
    # known complete (a stream that waited for it was synchronized since): no CUDA call although unread
    later = observer.SlotFence(slot)
    later.complete()
    later.wait()
    assert synced == ["event-of-step-7"] and slot.known == 4
    fence.complete()  # an older position known complete says nothing of the newer one
    assert slot.known == 4


def test_reading_a_slot_known_complete_asks_cuda_nothing(monkeypatch):
    """``HostObserver._finish``: a slot whose recorded event a ``SlotFence`` marked complete is read without
    synchronizing it; one recorded again since is synchronized as before."""
    import numpy as np

    from kvcanary.runtime import observer

    synced = []
    monkeypatch.setattr(observer, "event_synchronize", synced.append)
    obs = observer.HostObserver.__new__(observer.HostObserver)
    obs.ring, obs.layout = SimpleNamespace(capacity=4), {}
    slot = SimpleNamespace(records=2, known=0, pending=(5, {}), event="event-of-step-5",
                           host_np=np.array([0, 9], dtype=np.int64))
    obs.order = [slot]
    observer.SlotFence(slot).complete()
    (got,) = obs._finish(slot)
    assert synced == [] and got.step == 5 and got.count == 0 and got.small == [0, 9]
    slot.records, slot.pending, obs.order = 3, (6, {}), [slot]  # recorded again, not known complete
    obs._finish(slot)
    assert synced == ["event-of-step-5"]


def test_check_before_forward_reports_what_the_hooks_report_without_counting_twice():
    plain = engine(token_history="append", check_v=True, real_kv="all")
    expected = replayed_workload(plain)
    early = engine(token_history="append", check_v=True, real_kv="all", check_before_forward=True)
    got = replayed_workload(early)
    # the stale table entry's HEAD rows come before the forward, the flipped byte's TAIL rows at its close:
    # each once, with the same step, reader and writer
    assert expected and sorted(v.block() for v in got) == sorted(v.block() for v in expected)
    assert early.canary.stats()["entries_checked"] == plain.canary.stats()["entries_checked"]


def test_check_before_forward_raises_before_the_engine_runs_the_forward():
    e = engine(mode="raise", check_before_forward=True)
    e.add(1, [1, 2, 3, 4])
    e.add(2, [7, 8, 9])
    e.forward([(1, 4), (2, 3)])
    e.rtt[e.reqs[2]["row"], 1] = e.slot(1, 2)  # a stale table entry: request 2 reads request 1's slot
    ran = []
    with pytest.raises(KvCanaryViolationError) as err:
        e.forward([(1, 1), (2, 1)], corrupt=lambda eng: ran.append(True))  # (corrupt: called by the forward)
    assert not ran and e.canary.step == 1  # the forward never ran, and never closed
    v = err.value.violations[0]
    assert v.step == 2 and v.launch_tag.startswith("HEAD") and v.reader_request == 2
