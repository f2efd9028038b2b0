"""An engine forward that raises between the hooks (issue 56, item 4): the canary's forward is abandoned
(``Canary.abandon_forward``; the transformers adapter does it around the engine's step), the canary stays
usable, and the KV the failed forward never wrote is reported when it is read."""

from __future__ import annotations

import time

import pytest
import torch

from kvcanary import Canary, CanaryConfig, ForwardBatch, KvCanaryViolationError, PoolSpec, RealKvSource
from kvcanary.sim.zoo import quiet_and_single_threaded

from conftest import set_device_bounds


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_and_single_threaded():
        yield


class Toy:
    """One request per row on a 64-slot pool of one-token pages; ``forward(..., fail=True)``: the engine's forward
    raises after ``before_forward`` (its KV is never written)."""

    def __init__(self, mode="raise", **config):
        self.k = torch.zeros(64, 8, dtype=torch.float32)
        pool = PoolSpec(num_slots=64, k_sources=(RealKvSource(self.k, page_size=1, num_bytes_per_token=32,
                                                             read_bytes=32),))
        self.aborted = []
        self.canary = Canary(pool, CanaryConfig(mode=mode, health_interval=0, **config), max_batch=4, max_tokens=64,
                             max_context=32, num_rows=8,
                             on_abort=(lambda rid, vs: self.aborted.append(rid)) if mode == "abort" else None)
        self.canary.mark_ready()
        self.table = torch.zeros(8, 32, dtype=torch.int32)

    def batch(self, work):
        rows, prefix, extend, ids, pos, loc, rids = [], [], [], [], [], [], []
        for rid, row, p, tokens, slots in work:
            self.table[row, p:p + len(tokens)] = torch.tensor(slots, dtype=torch.int32)
            rows.append(row), prefix.append(p), extend.append(len(tokens)), rids.append(rid)
            ids += tokens
            pos += range(p, p + len(tokens))
            loc += slots
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        return ForwardBatch(t(rows), t(prefix), t(extend), t(ids), t(pos), t(loc), self.table, request_ids=t(rids))

    def forward(self, work, fail=False):
        batch = self.batch(work)
        self.canary.before_forward(batch)
        try:
            if fail:
                raise RuntimeError("engine: out of memory")  # before the forward wrote any KV
            self.k[batch.out_cache_loc] = torch.randn(batch.num_tokens, 8)
        except RuntimeError:
            self.canary.abandon_forward()
            raise
        self.canary.after_forward(batch)


def test_a_failed_forward_is_abandoned_and_the_canary_goes_on():
    toy = Toy()
    toy.forward([(7, 1, 0, [11, 22, 33], [1, 2, 3])])
    stats = toy.canary.stats()
    with pytest.raises(RuntimeError, match="out of memory"):
        toy.forward([(7, 1, 3, [44], [4])], fail=True)
    assert toy.canary._open is None and toy.canary.step == 1 and toy.canary.stats()["forwards"] == stats["forwards"]
    with pytest.raises(RuntimeError, match="after_forward must follow before_forward"):
        toy.canary.after_forward(toy.batch([(7, 1, 3, [44], [4])]))
    toy.canary.abandon_forward()  # (nothing open: nothing to do)
    toy.forward([(7, 1, 3, [44], [4])])  # the engine's retry: a new forward, clean
    toy.forward([(7, 1, 4, [55], [5])])
    assert toy.canary.flush() == [] and toy.canary.step == 3


@pytest.mark.parametrize("check_before_forward", [False, True])
def test_kv_the_failed_forward_never_wrote_is_reported_when_read(check_before_forward):
    toy = Toy(mode="abort", check_before_forward=check_before_forward)
    toy.forward([(7, 1, 0, [11, 22, 33], [1, 2, 3]), (8, 2, 0, [5, 6], [9, 10])])
    with pytest.raises(RuntimeError):
        toy.forward([(7, 1, 3, [44], [4]), (8, 2, 2, [7], [11])], fail=True)
    # the engine's bookkeeping moved on as if the forward had run: request 7 reads position 3 (slot 4), never
    # written; HEAD's records of slot 4 were taken back, so HEAD reports it before the forward, TAIL after it
    toy.forward([(7, 1, 4, [55], [5]), (8, 2, 2, [7], [11])])
    vs = toy.canary.violations
    reads = [v for v in vs if not v.is_write_check]
    assert {(v.launch_tag, v.slot, v.reader_request) for v in reads} == {("HEAD_K_FULL", 4, 7), ("TAIL_K_FULL", 4, 7)}
    assert all(v.never_written for v in reads) and toy.aborted == [7]
    # and the chain-position assert of request 7's next write: position 4 after an empty record of position 3
    assert [(v.reasons, v.slot, v.writer_request) for v in vs if v.is_write_check] == [(("write_position",), 5, 7)]


def test_what_head_found_in_the_failed_forward_is_reported_as_its_own():
    toy = Toy()
    toy.forward([(7, 1, 0, [11, 22, 33], [1, 2, 3])])
    toy.table[1, 1] = 40  # a stale entry: the failed forward read a slot no forward wrote
    with pytest.raises(KvCanaryViolationError) as err:  # (mode raise: the canary's report, the engine's error chained)
        toy.forward([(7, 1, 3, [44], [4])], fail=True)
    assert isinstance(err.value.__context__, RuntimeError)
    # (slot 40 never written; slot 3's predecessor in the reader's table is now slot 40)
    assert {(v.step, v.slot, v.reader_request) for v in err.value.violations} == {(2, 40, 7), (2, 3, 7)}
    assert toy.canary._open is None and toy.canary.step == 1
    toy.table[1, 1] = 2
    toy.forward([(7, 1, 3, [44], [4])])
    assert toy.canary.flush() == err.value.violations  # (nothing reported twice)


def test_a_check_before_forward_raise_takes_head_writes_back_too():
    toy = Toy(check_before_forward=True)
    toy.forward([(7, 1, 0, [11, 22, 33], [1, 2, 3])])
    toy.table[1, 1] = 40
    with pytest.raises(KvCanaryViolationError):
        toy.forward([(7, 1, 3, [44], [4])])  # raised before the forward: it never ran
    g = toy.canary.groups[0]
    assert torch.equal(g.bufs["head", "k"][4], g.bufs["tail", "k"][4]) and not g.bufs["head", "k"][4].any()


# -- transformers: the adapter abandons the step's forward when the engine's step raises ------------------------
@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("transformers")
    from kvcanary.demo import build_tiny_model

    return build_tiny_model("cpu")


def serve(manager, prompt):
    """One request through a started manager; its result once finished (or failed)."""
    rid = manager.add_request(prompt, max_new_tokens=5)
    result = None
    while result is None or not result.is_finished():
        result = manager.get_result(request_id=rid, timeout=0.2)  # (polled: the loop may have ended)
        if result is None and not manager.is_running():
            return None
    return result


@pytest.mark.parametrize("late_hooks", [True, False], ids=["late-hooks", "hooks-before-the-forward"])
@pytest.mark.parametrize("steady", [True, False], ids=["steady-steps", "eager-steps"])
def test_transformers_engine_failure_leaves_the_canary_usable(llama, late_hooks, steady):
    import logging

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvcanary.integrations.transformers import attach
    from kvcanary.integrations.transformers.handle import tuned

    gen = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1)
    cbc = ContinuousBatchingConfig(block_size=4, num_blocks=32, max_batch_tokens=8, use_async_batching=False,
                                   use_cuda_graph=False)
    manager = llama.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    with tuned(late_hooks=late_hooks, steady_steps=steady):
        handle = attach(manager, mode="raise")
    calls = {"n": 0}
    forward = llama.forward

    def failing(*args, **kwargs):  # the engine's forward fails once, in a decode step (KV of a prompt written)
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("engine: CUDA out of memory (planted)")
        return forward(*args, **kwargs)

    llama.forward = failing
    logging.getLogger("transformers").disabled = True  # (it logs the failed loop as an error)
    try:
        manager.start()
        first = serve(manager, [5, 6, 7, 8, 9, 10])
        while manager.is_running():  # the engine's loop ends on its error (its batch processor is kept)
            time.sleep(0.01)
        assert calls["n"] >= 4 and (first is None or first.error is not None)
        session = handle.sessions[-1]
        assert not session.closed and session.canary._open is None  # abandoned, not left open
        manager.start()  # the engine serves on: its batch processor, and the canary's session, are reused
        second = serve(manager, [11, 12, 13, 14, 15, 16, 17])
        manager.stop(block=True)
        assert len(handle.sessions) == 1 and session.closed
    finally:
        llama.forward = forward
        logging.getLogger("transformers").disabled = False
        manager.destroy()
        handle.detach()  # (raises any hook error: "a second before_forward" before the fix)
    assert second is not None and second.error is None and len(second.generated_tokens) == 5
    assert handle.violations == [] and handle.errors == []


# -- the simulated engine: its forward fails once and is retried, on every route -----------------------------
SIM = dict(seed=38, page_size=4, num_slots=512, num_requests=3, max_running=3, max_output=10, max_steps=40,
           graph_sizes=(1, 2, 3, 4))
ROUTES = ["hooks", "eager", "eager-early", "captured-early", "fused"]  # (recorded: the torch device path)


class PlantedFailure(RuntimeError):
    pass


def sim_run(route: str, fail_at: int | None):
    """The sim on ``route`` (``-early``: the runner's before work ahead of the forward); its model's forward
    raises once, at forward ``fail_at``, before writing KV, and the engine retries the same batch."""
    import dataclasses

    from kvcanary.sim.config import SimConfig
    from kvcanary.sim.engine import SimEngine, default_canary_config

    steps = route.removesuffix("-early")
    cfg = SimConfig(**SIM)
    config = default_canary_config(cfg).replace(allocator_check_interval=0, mode="raise")
    if steps in ("captured", "fused"):
        config = config.replace(backend="torch")  # (the CPU stand-in graphs record its ops: set_device_bounds)
    e = SimEngine(cfg, config, **({} if steps == "hooks" else {"steps": steps}))
    if route.endswith("-early"):
        e.runner.options = dataclasses.replace(e.runner.options, late_hooks=False)
    calls = {"n": 0, "open": []}
    model_forward, engine_forward = e.model.forward, e.forward

    def forward(*args, **kwargs):  # (the model's keywords: its write-check note)
        calls["n"] += 1
        if calls["n"] == fail_at:
            calls["open"].append(e.canary._open is not None)
            raise PlantedFailure("the engine's forward failed")
        model_forward(*args, **kwargs)

    def retrying(works):
        try:
            return engine_forward(works)
        except PlantedFailure:
            if e.runner is not None:
                e.runner.abandon()
            else:
                e.canary.abandon_forward()
            return engine_forward(works)

    e.model.forward, e.forward = forward, retrying
    e.run()
    tokens = {rid: list(r.tokens) for rid, r in e.sched.requests.items()}
    return e, tokens, calls["open"]


@pytest.mark.parametrize("route", ROUTES)
def test_sim_a_failed_forward_is_abandoned_and_retried_cleanly_on_every_route(monkeypatch, route):
    set_device_bounds(monkeypatch)
    clean, tokens, _ = sim_run(route, None)
    failed, failed_tokens, was_open = sim_run(route, 8)
    assert was_open == [route in ("hooks", "eager-early", "captured-early")]  # (late: nothing ran before it)
    assert failed.canary.violations == [] and failed_tokens == tokens
    assert failed.canary.step == clean.canary.step and failed.canary.stats()["forwards"] == clean.canary.stats()["forwards"]


# -- token ids the int32 token table cannot hold: refused before any state changes ------------------------------
def test_missing_token_is_the_same_in_ops_and_runtime():
    pytest.importorskip("numba")
    from kvcanary.ops import numba_steady
    from kvcanary.runtime import checks
    from kvcanary.runtime.report import MISSING_TOKEN

    assert numba_steady.MISSING_TOKEN == MISSING_TOKEN and numba_steady.TOKEN_MAX == checks.TOKEN_MAX == 2**31 - 1


@pytest.mark.parametrize("where", ["input_ids", "history"])
@pytest.mark.parametrize("token", [2**31, 2**40, -1])
def test_a_token_id_outside_the_token_table_is_refused_before_anything_changes(where, token):
    from kvcanary.runtime.batch import TokenHistory

    toy = Toy()
    toy.forward([(7, 1, 0, [11, 22, 33], [1, 2, 3])])
    records = {key: buf.clone() for key, buf in toy.canary.groups[0].bufs.items()}
    table = toy.canary.token_table.clone()
    ids = [11, 22, 33, token if where == "input_ids" else 44]
    batch = toy.batch([(7, 1, 3, ids[3:], [4])])
    batch = type(batch)(**{**batch.__dict__, "token_history": TokenHistory(
        torch.tensor(ids[:3] + [token if where == "history" else 44]), torch.tensor([0, 4]))})
    name, at = ("input_ids", 0) if where == "input_ids" else ("token_history.flat", 3)
    with pytest.raises(ValueError, match=rf"kv-canary: forward batch {name} must be token ids.* in \[0, 2\^31 - 1 = "
                                         rf"2147483647\] \(the canary's token table is int32\), got {token} at index "
                                         rf"{at}$"):
        toy.canary.before_forward(batch)
    assert toy.canary._open is None and toy.canary.step == 1 and torch.equal(toy.canary.token_table, table)
    assert all(torch.equal(buf, records[key]) for key, buf in toy.canary.groups[0].bufs.items())
    toy.forward([(7, 1, 3, [44], [4])])  # the canary goes on
    assert toy.canary.flush() == []


def test_a_token_id_outside_the_token_table_is_refused_on_the_steady_route():
    """The CPU's steady steps run their value checks in their own compiled pass (runtime/step/steady.py): an input
    id the token table cannot hold sends the step to the full path, which refuses it; nothing changes."""
    pytest.importorskip("numba")
    from kvcanary.sim.config import SimConfig
    from kvcanary.sim.engine import SimEngine, default_canary_config

    cfg = SimConfig(**SIM)
    e = SimEngine(cfg, default_canary_config(cfg).replace(allocator_check_interval=0, backend="numba"), steps="eager")
    set_step, seen = e.source.set_step, {}

    def planted(works):
        set_step(works)
        if e.runner.steady.taken >= 3 and "records" not in seen:  # (steady steps under way)
            seen["records"] = {k: b.clone() for k, b in e.canary.groups[0].bufs.items()}
            seen["step"], seen["taken"] = e.canary.step, e.runner.steady.taken
            e.source.inputs.input_ids[0] = 2**31

    e.source.set_step = planted
    with pytest.raises(ValueError, match=r"forward batch input_ids must be token ids .*got 2147483648 at index 0"):
        e.run()
    assert e.canary._open is None and e.canary.step == seen["step"] and e.runner.steady.taken == seen["taken"]
    assert all(torch.equal(b, seen["records"][k]) for k, b in e.canary.groups[0].bufs.items())
    assert e.canary.flush() == []
