"""Reserved, poisoned and non-finite slots (runtime/slots.py): each check sees the bug it exists for, in a
hand-driven canary, the simulated engine and transformers continuous batching, and clean runs report nothing."""

from __future__ import annotations

import logging

import pytest
import torch

from kvcanary import Canary, CanaryConfig, ForwardBatch, PoolSpec, RealKvSource
from kvcanary.runtime.slots import POISON
from kvcanary.sim import MATRIX
from kvcanary.sim.engine import SimEngine, default_canary_config, run_sim
from kvcanary.sim.zoo import run_verdict

from conftest import set_device_bounds

logging.getLogger("kvcanary").setLevel(logging.ERROR)


class Toy:
    """One request on a pool of one-token pages, driven by hand (docs/runtime.md's example)."""

    def __init__(self, dtype=torch.float32, reserved=(), **cfg):
        self.k = torch.zeros(64, 16 // torch.tensor([], dtype=dtype).element_size() * 2, dtype=dtype)
        nbpt = self.k.shape[1] * self.k.element_size()
        pool = PoolSpec(64, (RealKvSource(self.k, page_size=1, num_bytes_per_token=nbpt, read_bytes=nbpt),),
                        reserved_slots=reserved)
        self.canary = Canary(pool, CanaryConfig(mode="log", **cfg), max_batch=2, max_tokens=16, max_context=16,
                             num_rows=4)
        self.table = torch.zeros(4, 16, dtype=torch.int64)

    def forward(self, prefix, tokens, slots, corrupt=None):
        n = len(tokens)
        self.table[1, prefix:prefix + n] = torch.tensor(slots)
        batch = ForwardBatch(torch.tensor([1]), torch.tensor([prefix]), torch.tensor([n]), torch.tensor(tokens),
                             torch.arange(prefix, prefix + n), torch.tensor(slots), self.table,
                             request_ids=torch.tensor([9]))
        self.canary.before_forward(batch)
        self.k[torch.tensor(slots)] = torch.arange(1, n * self.k.shape[1] + 1).view(n, -1).to(self.k.dtype)
        if corrupt is not None:
            corrupt(self)
        self.canary.after_forward(batch)
        return self.canary.flush()

    def run(self, corrupt_at=None, corrupt=None, cells=None):
        """Prefill 3 tokens, then 3 decodes; ``cells``: {column: slot} set before the last decode."""
        self.forward(0, [11, 12, 13], [5, 6, 7])
        self.canary.mark_ready()
        for i, slot in enumerate((8, 9, 10)):
            if cells and i == 2:
                for col, s in cells.items():
                    self.table[1, col] = s
            self.forward(3 + i, [20 + i], [slot], corrupt if corrupt_at == i else None)
        return self.canary.flush()


def test_clean_toy_reports_nothing_with_every_slot_check_on():
    toy = Toy(reserved=(63,), poison_on_free=True)
    assert toy.run() == [] and toy.canary.stats()["violations"] == 0


def test_a_live_read_of_slot0_is_reported_where_the_ops_alone_see_nothing():
    vs = Toy().run(cells={1: 0})
    assert [(v.reasons, v.slot, v.position, v.reader_request) for v in vs] == [(("reserved_slot_read",), 0, 1, 9)]
    assert "a reserved slot" in vs[0].block() and "was never written" not in vs[0].block()
    # the verify op skips slot 0, and the next position's chain check (its predecessor is 0)
    assert Toy(reserved_check=False).run(cells={1: 0}) == []


def test_a_live_read_of_an_engine_trash_slot_is_reported():
    vs = Toy(reserved=(63,)).run(cells={1: 63})
    assert (("reserved_slot_read",), 63, 1, 9) in [(v.reasons, v.slot, v.position, v.reader_request) for v in vs]


def test_a_live_write_into_a_reserved_slot_is_reported():
    toy = Toy(reserved=(63,))
    toy.forward(0, [11, 12], [5, 6])
    vs = toy.forward(2, [13], [63])
    assert [(v.reasons, v.slot, v.position, v.stored_token, v.writer_request) for v in vs] == [
        (("reserved_slot_write",), 63, 2, 13, 9)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_kv_at_write_names_the_first_writer(dtype, value):
    def corrupt(toy):
        toy.k[9, 1] = value
    vs = Toy(dtype).run(corrupt_at=1, corrupt=corrupt)
    assert [(v.reasons, v.launch_tag, v.slot, v.position, v.stored_token, v.writer_request, v.layer, v.step)
            for v in vs] == [(("nonfinite_kv",), "TAIL_K_FULL", 9, 4, 21, 9, 0, 3)]
    assert "is not finite (NaN/Inf) in K real-KV source 0" in vs[0].block()
    assert Toy(dtype, nonfinite_check=False).run(corrupt_at=1, corrupt=corrupt) == []


def test_nonfinite_check_skips_integer_sources():
    toy = Toy(torch.int32)
    assert toy.canary.slots.float_sources == []
    assert toy.run(corrupt_at=1, corrupt=lambda t: t.k.__setitem__((9, 1), -1)) == []


def test_poisoned_slot_read_is_reported_as_a_use_after_free():
    toy = Toy(poison_on_free=True)
    toy.forward(0, [11, 12, 13], [5, 6, 7])
    assert toy.canary.poison_slots([6, 0]) == 1  # (slot 0 is reserved: left alone)
    assert toy.k[6].view(torch.uint8).view(-1, 2).tolist() == [list(POISON)] * 16 and bool((toy.k[0] == 0).all())
    assert bool(toy.k[6].isnan().all())
    vs = toy.forward(3, [14], [8])  # the request still maps slot 6: a read of a freed slot
    assert [(v.launch_tag, v.reasons, v.slot, v.poisoned) for v in vs] == [
        ("TAIL_K_FULL", ("verify_real_kv_hash",), 6, True)]
    assert "poison pattern of a freed slot" in vs[0].block() and "use after free" in vs[0].block()
    assert toy.canary.stats()["poisoned_slots"] == 1


def test_a_freed_slot_rewritten_after_reuse_is_clean():
    toy = Toy(poison_on_free=True)
    toy.forward(0, [11, 12], [5, 6])
    toy.canary.poison_slots(torch.tensor([7, 8]))
    assert toy.forward(2, [13, 14], [7, 8]) == [] and toy.forward(4, [15], [9]) == []


def test_poison_is_off_by_default_and_bad_slots_change_nothing():
    toy = Toy()
    assert toy.canary.poison_slots([5]) == 0 and bool((toy.k == 0).all())
    toy = Toy(poison_on_free=True)
    with pytest.raises(ValueError, match="poison_slots slots must be slots in"):
        toy.canary.poison_slots([5, 64])
    assert bool((toy.k == 0).all())


def test_pool_spec_refuses_bad_reserved_slots():
    with pytest.raises(ValueError, match="reserved_slots must be a tuple of ints in"):
        PoolSpec(8, reserved_slots=(8,))
    with pytest.raises(ValueError, match="reserved_slots"):
        PoolSpec(8, reserved_slots=(True,))


# -- the simulated engine ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["base", "spec-paged-swa"])
def test_sim_read_slot0_is_reported_where_the_ops_alone_see_nothing(name):
    cfg = MATRIX[name].replace(bug="read_slot0")
    r = run_sim(cfg, stop_after=1)
    assert run_verdict(r) == "detected" and r.reasons == ["reserved_slot_read"]
    assert r.first_detected_step == r.planted_step
    off = run_sim(cfg, default_canary_config(cfg).replace(reserved_check=False))
    assert off.planted_step is not None and off.violations == 0


def test_sim_nan_write_names_layer_request_position_and_step():
    cfg = MATRIX["base"].replace(bug="nan_write")
    e = SimEngine(cfg)
    r = e.run(stop_after=1)
    v = e.canary.violations[0]
    # (the NaN lands after the model's write: the write check also sees bytes other than the layer computed, and marks
    # the slot's record: its later reads fail verify_real_kv_hash)
    assert {"nonfinite_kv", "write_kv"} <= set(r.reasons) <= {"nonfinite_kv", "write_kv", "verify_real_kv_hash"}
    assert v.step == r.planted_step and v.layer == 1 and v.reasons == ("nonfinite_kv",)
    assert v.writer_request is not None and v.position > 0 and v.launch_tag == "TAIL_K_FULL"
    off = run_sim(cfg, default_canary_config(cfg).replace(nonfinite_check=False, write_check=False))
    assert off.planted_step is not None and off.violations == 0


def test_sim_read_of_a_partial_page_tail_is_reported():
    e = SimEngine(MATRIX["paged"].replace(bug="read_partial_tail"))
    r = e.run(stop_after=0)
    assert run_verdict(r) == "detected" and r.first_detected_step == r.planted_step
    first = [v for v in e.canary.violations if v.step == r.planted_step]
    # the tail's cells hold no record of this request: positions past the request's length fail
    assert any(v.launch_tag == "HEAD_K_FULL" and "verify_position" in v.reasons for v in first)
    assert any("write_position" in v.reasons for v in first)


def test_sim_free_while_cached_reads_poison():
    cfg = MATRIX["base"].replace(bug="free_while_cached")
    e = SimEngine(cfg, default_canary_config(cfg).replace(poison_on_free=True))
    e.run(stop_after=2)
    poisoned = [v for v in e.canary.violations if v.poisoned]
    assert poisoned and "use after free" in poisoned[0].block()
    e = SimEngine(cfg)
    e.run(stop_after=2)
    assert e.canary.violations and not any(v.poisoned for v in e.canary.violations)


@pytest.mark.parametrize("name", ["paged", "spec-paged-swa", "pressure-offload"])
def test_sim_clean_with_poison_on_free_reports_nothing(name):
    cfg = MATRIX[name]
    e = SimEngine(cfg, default_canary_config(cfg).replace(poison_on_free=True))
    r = e.run()
    assert r.violations == 0 and r.refused is None and r.finished > 0
    assert e.canary.stats()["poisoned_slots"] > 0


# -- transformers continuous batching ------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("transformers")
    from kvcanary.demo import build_tiny_model

    return build_tiny_model("cpu")


def planted(model, planter):
    """Plant a test-local engine bug on every batch processor (``hf_bugs.plant_with``); returns the undo."""
    from kvcanary.sim.hf_bugs import plant_with

    return plant_with(model, planter, "_test_slots_bug")


def _once(state) -> bool:
    if state["fired"] or state["warming_up"]:
        return False
    state["fired"] = True
    return True


def read_slot0(bp, lay, state):
    cm = lay.full_allocator()
    orig = cm.get_read_indices

    def get_read_indices(request_id, past_length, query_length):
        out = orig(request_id, past_length, query_length)
        if past_length >= 3 and _once(state):
            out[1] = 0  # the read trash: position 1 is read from slot 0
        return out

    cm.get_read_indices = get_read_indices


def read_past_length(bp, lay, state):
    """Once, a decode's key length is taken from its last block's end, not its length: the read index lists
    (and attention reads: its key length follows, the mask is causal from the end) the block's unused tail."""
    cm = lay.full_allocator()
    orig_read, B = cm.get_read_indices, lay.block_size

    def seqlen_k(n, past_length, query_length):  # (asked for each request just before its read indices)
        if query_length == 1 and past_length >= 3 and n % B and _once(state):
            state["tail"] = (past_length, query_length)
            return n + B - n % B
        return n

    def get_read_indices(request_id, past_length, query_length):
        if state.pop("tail", None) == (past_length, query_length):
            n = past_length + query_length
            return orig_read(request_id, n + B - n % B - query_length, query_length)  # the block's whole tail
        return orig_read(request_id, past_length, query_length)

    lay.wrap_seqlen_k(seqlen_k)
    cm.get_read_indices = get_read_indices


def nan_write_at(forward: int):
    """A planter: NaN in the first layer's K of the first token of forward number ``forward`` (from 1)."""
    def plant(bp, lay, state):
        writer = lay.kv_writer()
        orig = writer.update

        def update(key_states, value_states, layer_idx, *args, **kwargs):
            state["layer0"] = state.get("layer0", 0) + (layer_idx == 0)
            if layer_idx == 0 and state["layer0"] == forward and _once(state):
                key_states = key_states.clone()
                key_states[0, 0, 0] = float("nan")
            return orig(key_states, value_states, layer_idx, *args, **kwargs)

        writer.update = update
    return plant


nan_write = nan_write_at(4)
# the ninth forward: a steady decode step of the workload, fused with step graphs
late_nan_write = nan_write_at(9)


def use_after_free(bp, lay, state):
    orig, cache = bp.update_batch, bp.cache

    def update_batch():
        orig()
        for table in lay.block_table(lay.full_group).values():
            if len(table) >= 2 and not bp.scheduler.waiting_requests and _once(state):
                block = table[0]
                cache.pool.free_blocks(lay.full_group, [block])  # freed, still mapped by the request
                # (last in the free order: nobody is handed it soon, so records alone would match). In the tiny
                # cache a sector holds one block: the free block's sector goes back, and the pool takes the last
                # free sector first.
                pool = cache.pool
                pool.try_to_free_sectors()
                trees = pool._free_blocks[lay.full_group]
                root = block // trees.elems_per_tree
                if root in pool.free_sectors:
                    pool.free_sectors.remove(root)
                    pool.free_sectors.insert(0, root)
                return

    bp.update_batch = update_batch


def run(model, planter=None, **options):
    from kvcanary.demo import run_workload

    undo = planted(model, planter) if planter is not None else None
    try:
        return run_workload(model, num_return_sequences=1, max_new_tokens=8, **options)
    finally:
        if undo is not None:
            undo()


def refused_on_517(model, **options) -> bool:
    """On transformers 5.17 (no block pool) attach refuses poison on free, before it hooks anything: True there."""
    from kvcanary.integrations.transformers.handle import live_handle
    from kvcanary.integrations.transformers.reach import has_block_pool

    if has_block_pool():
        return False
    version = __import__("transformers").__version__
    with pytest.raises(ValueError, match=rf"poison_on_free needs transformers >= 5\.18.*got {version}"):
        run(model, **options)
    assert live_handle(model) is None and "init_continuous_batching" not in vars(model)
    return True


def test_transformers_clean_with_every_slot_check_and_poison(llama):
    if refused_on_517(llama, poison_on_free=True):
        assert run(llama).violations == []  # (every slot check but poison)
        return
    r = run(llama, poison_on_free=True)
    assert r.violations == [] and r.stats["poisoned_slots"] > 0


def test_transformers_read_of_slot0_is_reported(llama):
    r = run(llama, read_slot0)
    first = r.violations[0]
    assert first.reasons == ("reserved_slot_read",) and first.slot == 0 and first.position == 1
    assert first.reader_request is not None
    # without the check nothing names the reserved read (what attention then makes of slot 0's bytes is the
    # engine's: 5.17 leaves the pool's memory as the allocator had it, NaN there is reported as nonfinite_kv)
    off = run(llama, read_slot0, reserved_check=False).violations
    assert not [v for v in off if "reserved_slot_read" in v.reasons]
    assert all(v.reasons == ("nonfinite_kv",) for v in off)


def test_transformers_read_past_a_request_length_is_reported(llama):
    r = run(llama, read_past_length)
    first = r.violations[0]
    assert first.reasons == ("read_past_length",) and first.launch_tag == "HEAD_K_FULL"
    assert first.expected_aux > first.position > 0 and first.slot > 0  # listed > the batch's live positions
    assert "read index lists" in first.block()
    # that step's report: the rows the record checks add (the extra cells hold no write of the request) come after
    assert all(v.step >= first.step for v in r.violations)


def test_transformers_nan_write_is_reported_with_its_writer(llama):
    r = run(llama, nan_write)
    first = r.violations[0]
    assert first.reasons == ("nonfinite_kv",) and first.launch_tag == "TAIL_K_FULL" and first.layer == 0
    assert first.writer_request is not None and not first.poisoned


def test_transformers_read_of_a_freed_block_reads_poison(llama):
    if refused_on_517(llama, planter=use_after_free, poison_on_free=True):
        return
    r = run(llama, use_after_free, poison_on_free=True)
    poisoned = [v for v in r.violations if v.poisoned]
    assert poisoned and poisoned[0].reasons == ("verify_real_kv_hash",) and poisoned[0].reader_request is not None
    assert r.violations[0].step == poisoned[0].step  # the first report of the run is the poisoned read
    # without poison the freed block still holds its records and bytes: the read passes unseen
    assert run(llama, use_after_free).violations == []


INTERPRETED = pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton on the CPU needs TRITON_INTERPRET=1")


def stand_in_graphs(monkeypatch) -> list:
    """The adapter's step graphs on the CPU stand-in of a CUDA graph (``DispatchGraph``: it replays the recorded
    ops and launches into the same tensors) from now on; returns the list each runner's graphs are added to."""
    from kvcanary.integrations.transformers import session as hf_session
    from kvcanary.runtime.graphs import DispatchGraph

    orig, made = hf_session.Session._step_runner, []

    def step_runner(self, graph_type=None):
        r = orig(self, DispatchGraph)
        made.append(r.graphs)
        return r

    monkeypatch.setattr(hf_session.Session, "_step_runner", step_runner)
    return made


@INTERPRETED
@pytest.mark.parametrize("planter", ["read_slot0"])  # (a NaN write in a replayed step: the fused test below)
def test_transformers_slot_checks_in_captured_steps_report_what_eager_steps_report(llama, monkeypatch, planter):
    """The slot checks' Triton kernels inside the adapter's captured steps (the CPU stand-in of a CUDA graph: it
    replays the recorded launches into the same tensors) report what eager steps' tensor ops report."""
    from kvcanary.runtime.step.tables import StepTables

    # (the eager CPU path may skip the new tokens' read check where it holds by construction; compare like with like)
    monkeypatch.setattr(StepTables, "new_reads_shortcut", False)
    bug = globals()[planter]
    eager = run(llama, bug, backend="torch", step_graphs=False)
    made = stand_in_graphs(monkeypatch)
    graphed = run(llama, bug, backend="triton")
    assert sum(g.replays for g in made if g is not None) > 0
    assert eager.violations and eager.violations[0].reasons[0] in ("reserved_slot_read", "nonfinite_kv")
    assert [v.block() for v in graphed.violations] == [v.block() for v in eager.violations]
    if planter != "read_slot0":
        # (a read of slot 0 reads whatever its memory holds: 5.17 allocates the pool uninitialised, so until a
        # request writes there it holds what differs between the two runs, and so may the tokens after the read;
        # the reports may not differ)
        assert graphed.tokens == eager.tokens


def test_transformers_nan_written_by_a_fused_step_is_reported(llama, monkeypatch):
    """A fused steady decode step (its before and after work as one graph) runs the non-finite check too: a NaN
    written by such a step is reported as the eager step reports it (the fused graph once lacked the check). (The
    torch backend's device ops, recorded by the CPU stand-in graph; the captured test above takes Triton's.)"""
    from kvcanary.runtime.step import graphs as step_graphs
    from kvcanary.runtime.step.fused import FusedSteps

    set_device_bounds(monkeypatch)

    eager = run(llama, late_nan_write, backend="torch", step_graphs=False)
    monkeypatch.setattr(step_graphs, "STEADY_SIGHTINGS", 0)  # every decode step of the steady batch fused
    fused, step = [], FusedSteps.step
    monkeypatch.setattr(FusedSteps, "step", lambda self, *a: (fused.append(1), step(self, *a))[1])
    stand_in_graphs(monkeypatch)
    graphed = run(llama, late_nan_write, backend="torch", fused_steps=True)
    # (the NaN is planted below the canary's hook on the cache update: the write check reports that the stored K is
    # not what the layer computed, after the non-finite row)
    assert fused and [v.reasons for v in eager.violations] == [("nonfinite_kv",), ("write_kv",)]
    assert [v.block() for v in graphed.violations] == [v.block() for v in eager.violations]
