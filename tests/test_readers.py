"""Every request that read a bad slot is named (issue 56, item 3): a violation row per failing verify entry
names its own reader, rows identical in content (several requests reading one bad slot alike) name one
reader each, the report groups them, and mode "abort" fails each of them and only them."""

from __future__ import annotations

import collections
import json
import logging

import pytest
import torch

from kvcanary import Canary, CanaryConfig, ForwardBatch, PoolSpec, RealKvSource, violations_to_json
from kvcanary.sim.config import SimConfig
from kvcanary.sim.engine import SimEngine, default_canary_config
from kvcanary.sim.zoo import quiet_and_single_threaded

from conftest import set_device_bounds


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_and_single_threaded():
        yield


# -- the runtime: a parent and its forks on a toy pool of one-token pages ---------------------------------
class Forks:
    """A parent on row 1 and forks on rows 2.. that share its prompt's slots (prefix sharing: their table
    cells are the parent's), each decoding on a slot of its own."""

    def __init__(self, mode="abort", forks=4):
        self.aborted = []
        self.k = torch.zeros(64, 8, dtype=torch.float32)
        pool = PoolSpec(num_slots=64, k_sources=(RealKvSource(self.k, page_size=1, num_bytes_per_token=32,
                                                             read_bytes=32),))
        self.canary = Canary(pool, CanaryConfig(mode=mode, health_interval=0), max_batch=8, max_tokens=64,
                             max_context=32, num_rows=8,
                             on_abort=(lambda rid, vs: self.aborted.append((rid, vs))) if mode == "abort" else None)
        self.canary.mark_ready()
        self.table = torch.zeros(8, 32, dtype=torch.int32)
        self.next_slot = 1
        self.lens = {}
        self.prompt = [11, 22, 33, 44]
        self.forward([(100, 1, self.prompt)])  # the parent's prefill: slots 1..4
        for i in range(forks):  # the forks map the parent's prompt slots (no copy: one record, one KV)
            self.table[2 + i, :4] = self.table[1, :4]
            self.lens[200 + i] = (2 + i, 4)
        self.forward([(200 + i, 2 + i, [50 + i]) for i in range(forks)] + [(9, 7, [70, 71])])

    def forward(self, work):
        """``work``: (request id, row, new tokens) per request, appended after what the row holds."""
        rows, prefix, extend, ids, pos, loc, rids = [], [], [], [], [], [], []
        for rid, row, tokens in work:
            p = self.lens.get(rid, (row, 0))[1]
            slots = list(range(self.next_slot, self.next_slot + len(tokens)))
            self.next_slot += len(tokens)
            self.table[row, p:p + len(tokens)] = torch.tensor(slots, dtype=torch.int32)
            rows.append(row), prefix.append(p), extend.append(len(tokens)), rids.append(rid)
            ids += tokens
            pos += range(p, p + len(tokens))
            loc += slots
            self.lens[rid] = (row, p + len(tokens))
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        batch = ForwardBatch(t(rows), t(prefix), t(extend), t(ids), t(pos), t(loc), self.table, request_ids=t(rids))
        self.canary.before_forward(batch)
        self.k[t(loc)] = torch.randn(len(loc), 8)
        self.canary.after_forward(batch)

    def decode(self, rids):
        self.forward([(rid, self.lens[rid][0], [60 + rid % 10]) for rid in rids])


def test_four_forks_reading_a_corrupted_shared_slot_are_each_named_and_aborted():
    f = Forks()
    assert f.aborted == [] and f.canary.violations == []
    f.k[2, 0] += 1.0  # the shared prompt's position 1 (the parent's slot 2) changes under its record
    f.decode([200, 201, 202, 203, 9])  # the forks read it; request 9 does not; the parent is not scheduled
    vs = f.canary.violations
    assert vs and {v.reasons for v in vs} == {("verify_real_kv_hash",)}
    # one TAIL row per fork (the real-KV check): each names its own reader, every row lists all four
    assert {v.launch_tag for v in vs} == {"TAIL_K_FULL"}
    assert sorted(v.reader_request for v in vs) == [200, 201, 202, 203]
    assert all(v.readers == (200, 201, 202, 203) and v.reader_positions == (1,) * 4 for v in vs)
    assert all(v.reader_position == 1 and v.writer_request == 100 for v in vs)
    assert sorted(rid for rid, _ in f.aborted) == [200, 201, 202, 203]  # each of them, and only them
    assert all(v.reader_request == rid for rid, named in f.aborted for v in named)
    assert f.canary.stats()["aborted_requests"] == 4 and f.canary.stats()["abort_unattributed"] == 0


def test_the_report_groups_the_readers_of_one_slot(caplog):
    f = Forks(mode="log")
    f.k[3, 0] += 1.0
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        f.decode([100, 200, 201, 202, 203])  # the parent reads it too: five readers
    vs = f.canary.violations
    assert len(vs) == 5 and {v.readers for v in vs} == {(100, 200, 201, 202, 203)}
    # one readable block for the five identical rows, listing every reader; a log line per row
    blocks = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV canary violation")]
    assert len(blocks) == 1
    assert "read by 5 requests in this forward, each failing this check:" in blocks[0]
    for rid in (100, 200, 201, 202, 203):
        assert f"    request {rid} at position 2" in blocks[0]
    assert sum(r.getMessage().startswith("kv_canary violation:") for r in caplog.records) == 5
    # JSON keeps every field it had and adds the readers
    row = json.loads(violations_to_json(vs))["violations"][0]
    assert row["reader_request"] in (100, 200, 201, 202, 203) and row["readers"] == [100, 200, 201, 202, 203]
    assert row["reader_positions"] == [2] * 5


def test_a_stale_entry_next_to_the_legitimate_owner_names_the_stale_reader_alone():
    f = Forks(forks=2)
    f.table[3, 1] = 60  # fork 201's position 1 maps a slot its parent never wrote there
    f.decode([100, 200, 201])
    assert {v.reader_request for v in f.canary.violations} == {201}
    assert all(v.readers == (201,) for v in f.canary.violations)
    assert [rid for rid, _ in f.aborted] == [201]


# -- the simulated engine: every reader of a corrupted shared slot, on every route ---------------------------
CFG = dict(seed=38, page_size=4, num_slots=512, num_requests=4, max_running=4, max_output=32, max_steps=60,
           graph_sizes=(1, 2, 3, 4))
ROUTES = ["hooks", "eager", "captured", "fused"]  # (the recorded routes: the torch backend's device path)


class SharedFlip(SimEngine):
    """The sim with one byte of layer 0's K flipped, before step ``at``'s forward, in the slot the most running
    requests share (a cached prefix); ``mappers``: the running requests whose slots hold it then, and
    ``read_wrong``: each request that read a K byte of layer 0 unlike its own tokens', with the step."""

    def __init__(self, steps=None, mode="abort", at=6):
        cfg = SimConfig(**CFG)
        config = default_canary_config(cfg).replace(mode=mode, allocator_check_interval=0)
        if steps in ("captured", "fused"):  # (the CPU stand-in graphs record its ops: set_device_bounds)
            config = config.replace(backend="torch")
        super().__init__(cfg, config, **({} if steps is None else {"steps": steps}))
        self.at, self.mappers, self.flipped = at, set(), None
        self.read_wrong: dict[int, int] = {}

    def step(self):
        if self.step_no + 1 == self.at:
            count = collections.Counter(s for r in self.sched.running for s in set(r.slots))
            slot, n = count.most_common(1)[0]
            assert n >= 3, "the workload's requests no longer share a cached prefix"
            ps, words = self.cfg.page_size, self.model.k[0].shape[1] // self.cfg.page_size
            self.model.k[0][slot // ps, (slot % ps) * words] ^= 0x55
            self.flipped, self.mappers = slot, {r.rid for r in self.sched.running if slot in r.slots}
        super().step()


PLAIN: dict = {}  # what the plain hooks named


def readers_seen(e):
    return sorted((v.step, v.launch_tag, v.reader_request, v.readers) for v in e.canary.violations)


@pytest.mark.parametrize("route", ROUTES)
def test_sim_every_reader_of_a_corrupted_shared_slot_is_named_and_aborted_on_every_route(monkeypatch, route):
    set_device_bounds(monkeypatch)
    e = SharedFlip(steps=None if route == "hooks" else route)
    result = e.run()
    vs = e.canary.violations
    first = min(v.step for v in vs)
    at_first = [v for v in vs if v.step == first]
    assert {v.slot for v in at_first} == {e.flipped}
    named = {v.reader_request for v in at_first}
    # every request mapping the slot that read it in that forward is named (the flip's readers: all mappers,
    # the forward being a decode of every running request), each failed once, and nobody else
    assert named == e.mappers and len(named) >= 3
    assert all(set(v.readers) == named for v in at_first)
    # the canary asked the engine to fail exactly those (a request that ended with that forward is left alone)
    assert e.canary.monitor.aborts.aborted == named and e.canary.stats()["aborted_requests"] == len(named)
    failed = {rid for rid, r in e.sched.requests.items() if r.error is not None}
    assert failed <= named and len(failed) == result.failed >= 1
    if "seen" not in PLAIN:  # (the plain hooks' run, once per test process: about a second)
        plain = e
        if route != "hooks":
            plain = SharedFlip()
            plain.run()
        PLAIN["seen"] = readers_seen(plain)
    assert readers_seen(e) == PLAIN["seen"]  # every route names what the plain hooks name


# -- transformers continuous batching: a parent's forks reading a corrupted shared prompt block --------------
@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("transformers")
    from kvcanary.demo import build_tiny_model

    return build_tiny_model("cpu")


def flip_shared_block(seen):
    """A planted bug: once, after a forward, one byte of layer 0's K flips in a prompt block that the most
    requests share (a parent's forks); ``seen``: the requests mapping it then, and the next forward's requests."""
    from kvcanary.sim.hf_bugs import _flip, _once, _requests

    def planter(bp, lay, state):
        orig = bp._generation_step

        def step(model):
            if "slot" in seen and "next" not in seen:
                seen["next"] = {fs.state.request_id for fs in _requests(bp)}
            orig(model)
            tables = lay.block_table(lay.full_group)
            count = collections.Counter(b for t in tables.values() for b in t[:-1])  # (full blocks, all read)
            if count and count.most_common(1)[0][1] >= 3 and _once(state):
                block = count.most_common(1)[0][0]
                seen["slot"] = lay.slot(block, 1)
                seen["mappers"] = {rid for rid, t in tables.items() if block in t[:-1]}
                _flip(lay, seen["slot"])

        bp._generation_step = step

    return planter


def forks_run(llama, steady: bool):
    """The planted bug's run in mode abort (``steady``: the CPU's steady steps on or off); checks who is named
    and failed, and returns what each violation names."""
    from kvcanary.demo import run_workload
    from kvcanary.integrations.transformers.handle import tuned
    from kvcanary.sim.hf_bugs import plant_with

    seen: dict = {}
    undo = plant_with(llama, flip_shared_block(seen), "_test_readers_bug")
    try:
        with tuned(steady_steps=steady):
            run = run_workload(llama, mode="abort", num_return_sequences=4, max_new_tokens=8)
    finally:
        undo()
    vs = run.violations
    assert vs and "slot" in seen, "the planted bug did not fire"
    first = [v for v in vs if v.step == vs[0].step]
    victims = seen["mappers"] & seen["next"]  # every request of the next forward that maps the block reads it
    named = {run.names[v.reader_request] for v in first}
    assert named == victims and len(victims) >= 3, (named, seen)
    assert all({run.names[r] for r in v.readers} == victims for v in first)
    assert {v.slot for v in first} == {seen["slot"]} and {v.reasons for v in first} == {("verify_real_kv_hash",)}
    # mode abort failed each of them and nobody else (the run's failed requests are the engine's outputs' errors)
    assert run.stats["aborted_requests"] == len(victims) == run.stats["failed_requests"]
    return sorted((v.step, v.launch_tag, v.slot, v.reader_request, v.readers) for v in vs), run.tokens


def test_transformers_forks_reading_a_corrupted_shared_block_are_each_named_and_aborted_on_every_route(llama):
    # the steady steps (a step shaped like an earlier one, from its bound plan) and the eager ones name the same
    steady, eager = forks_run(llama, True), forks_run(llama, False)
    assert steady == eager


def test_transformers_forks_are_each_named_on_the_async_step_graphs_and_fused_steps(llama, monkeypatch):
    """The adapter's fast routes (async batching, step graphs, fused steady steps, on the CPU stand-ins of CUDA's
    streams and graphs: tests/hf_async_model.py) name the same readers: every holder of the corrupted block."""
    import transformers

    from kvcanary.integrations.transformers.layout import ASYNC_SINCE, parse_version

    if parse_version(transformers.__version__) < ASYNC_SINCE:
        pytest.skip("async IO needs transformers >= 5.24")
    set_device_bounds(monkeypatch)  # (the stand-in graphs record the torch backend's device ops)
    from hf_async_model import recorded_async

    from kvcanary.demo import run_workload
    from kvcanary.runtime.step import fused, graphs
    from kvcanary.sim.hf_bugs import plant_with

    monkeypatch.setattr(graphs, "STEADY_SIGHTINGS", 2)  # (a short run reaches the per-turn and fused paths)
    replays = []
    orig = fused.FusedSteps._replay
    monkeypatch.setattr(fused.FusedSteps, "_replay", lambda self, *a: (replays.append(1), orig(self, *a))[1])
    seen: dict = {}
    undo = plant_with(llama, flip_shared_block(seen), "_test_readers_async_bug")
    try:
        with recorded_async(monkeypatch):
            run = run_workload(llama, mode="abort", num_return_sequences=4, max_new_tokens=8, backend="torch",
                               device="cpu", cb={"use_cuda_graph": False, "use_async_batching": True})
    finally:
        undo()
    assert replays and "slot" in seen, "the fused path or the planted bug did not run"
    # (async: the two IO pairs' batches hold the block's holders in turns, so they read it over several forwards)
    holders = seen["mappers"]
    vs = [v for v in run.violations if not v.launch_tag.startswith("SWEEP")]  # (a sweep row names no reader)
    assert vs and {v.slot for v in vs} == {seen["slot"]} and len(holders) >= 3 and {run.names[v.reader_request] for v in vs} == holders
    for step in {v.step for v in vs}:  # each forward's rows name each of its readers once, and list them all
        rows = [v for v in vs if v.step == step]
        assert sorted(v.reader_request for v in rows) == sorted(rows[0].readers)
        assert all(v.readers == rows[0].readers for v in rows)
    # every holder failed, nobody else (before the fix of the adapter's abort under async, a failed fork's
    # in-flight update ended the engine's loop: every request failed)
    assert run.stats["aborted_requests"] == run.stats["failed_requests"] == len(holders)
