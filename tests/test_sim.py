"""The simulated engine: allocator, radix cache, KV pool and scheduler units, determinism, clean fuzz."""

from __future__ import annotations

import pytest

from kvcanary.format import oracle_token
from kvcanary.ops.api import numba_available
from kvcanary.sim import MATRIX, SimConfig, SimEngine, run_sim
from kvcanary.sim.engine import default_canary_config
from kvcanary.sim.allocator import PageAllocator, RowAllocator
from kvcanary.sim.bugs import BugSwitch
from kvcanary.sim.kvpool import KvPool
from kvcanary.sim.radix import RadixCache
from kvcanary.sim.request import Request, State
from kvcanary.sim.zoo import quiet_and_single_threaded

# Small workloads keep the clean fuzz inside CI's budget: 7 configurations x 29 seeds = 203 runs.
FUZZ_SEEDS = 29
SMALL = dict(num_requests=8, max_output=12, max_steps=80)
# The clean fuzz's backend: the compiled CPU one (numba, else torch), about four times less host time a run than
# the sim's torch default (measured on the 2-core dev CPU); its records and reports are torch's bit for bit
# (tests/test_ops_cases.py), and the torch backend's clean runs stay in the configuration runs above and below.
FUZZ_BACKEND = "numba" if numba_available() else "torch"


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_and_single_threaded():
        yield


# -- allocator ------------------------------------------------------------------------------------
def test_page_allocator_hands_out_lowest_pages_and_never_page_zero():
    a = PageAllocator(16, 4)
    assert a.free_pages == 3  # page 0 (slots 0..3) is reserved
    assert a.alloc(2) == [1, 2]
    assert a.alloc(2) is None and a.free_pages == 1  # short: nothing taken
    a.free([2, 0])
    assert a.alloc(2) == [2, 3]
    assert a.page_slots(1) == [4, 5, 6, 7]
    assert a.pages_of([5, 6, 9, 0, 1]) == [1, 2]


def test_page_allocator_double_free_hands_a_page_out_twice():
    a = PageAllocator(8, 1)
    pages = a.alloc(7)
    assert pages == list(range(1, 8)) and a.alloc(1) is None
    a.free([3])
    a.free([3])
    assert a.alloc(2) == [3, 3]


def test_allocators_reject_bad_sizes():
    with pytest.raises(ValueError, match="page_size"):
        PageAllocator(10, 4)
    with pytest.raises(ValueError, match="num_rows"):
        RowAllocator(1)


def test_row_allocator_skips_the_padding_row():
    rows = RowAllocator(3)
    assert [rows.alloc(), rows.alloc(), rows.alloc()] == [1, 2, None]
    rows.free(0)
    rows.free(2)
    assert rows.free_list() == [2]


# -- radix cache ----------------------------------------------------------------------------------
class _Freed(list):
    def __call__(self, slots):
        self.extend(slots)


def _tree(page_size=1, bug=None):
    freed = _Freed()
    return RadixCache(page_size, freed, bugs=BugSwitch(bug)), freed


def test_radix_match_splits_a_node_matched_part_way():
    tree, _ = _tree()
    assert tree.insert([1, 2, 3, 4], [11, 12, 13, 14]) == 0
    m = tree.match_prefix([1, 2, 9])
    assert m.slots == [11, 12] and m.last_node.key == (1, 2)
    assert [c.key for c in m.last_node.children.values()] == [(3, 4)]
    assert tree.match_prefix([7]).slots == [] and tree.match_prefix([7]).last_node is tree.root


def test_radix_insert_reports_the_already_cached_prefix():
    tree, _ = _tree()
    tree.insert([1, 2, 3, 4], [11, 12, 13, 14])
    assert tree.insert([1, 2, 3, 4], [21, 22, 23, 24]) == 4  # all duplicates: the caller frees its copies
    assert tree.insert([1, 2, 5], [21, 22, 25]) == 2
    assert tree.match_prefix([1, 2, 5]).slots == [11, 12, 25]


def test_radix_is_page_granular():
    tree, _ = _tree(page_size=2)
    tree.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14])  # the half page [5] is not cached
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).slots == [10, 11, 12, 13]
    assert tree.match_prefix([1, 2, 3, 9]).slots == [10, 11]  # page (3, 9) differs from (3, 4)
    assert tree.match_prefix([1]).slots == []


def test_radix_evicts_least_recently_used_leaves_first():
    tree, freed = _tree()
    tree.insert([1, 2, 3, 4], [11, 12, 13, 14])
    tree.insert([1, 2, 5, 6], [11, 12, 15, 16])
    tree.insert([7, 8], [17, 18])
    tree.match_prefix([1, 2, 3, 4])  # touch: (3, 4) is now the most recent
    assert tree.evict(2) == 2 and freed == [15, 16]  # the older leaf; (1, 2) still has a child
    assert tree.evict(2) == 2 and freed[2:] == [17, 18]
    assert tree.evict(4) == 4 and sorted(freed[4:]) == [11, 12, 13, 14]
    assert tree.device_pages() == 0


def test_radix_locked_prefix_is_not_evicted():
    tree, freed = _tree()
    tree.insert([1, 2, 3], [11, 12, 13])
    tree.insert([4, 5], [14, 15])
    node = tree.match_prefix([1, 2, 3]).last_node
    tree.lock(node)
    assert tree.evictable_pages() == 2
    tree.evict(10)
    assert freed == [14, 15] and tree.match_prefix([1, 2, 3]).slots == [11, 12, 13]
    tree.unlock(node)
    assert tree.evictable_pages() == 3


def test_radix_device_triples_chain_positions_and_predecessors():
    tree, _ = _tree()
    tree.insert([1, 2, 3], [11, 12, 13])
    tree.insert([1, 2, 4], [11, 12, 14])
    triples = sorted(zip(*tree.device_triples()))
    assert triples == [(11, 0, -1), (12, 1, 11), (13, 2, 12), (14, 2, 12)]


def test_radix_match_too_long_bug_takes_the_first_differing_token():
    tree, _ = _tree(bug="match_too_long")
    tree.insert([1, 2, 3, 4], [11, 12, 13, 14])
    m = tree.match_prefix([1, 2, 9, 9])  # differs inside the node at position 2
    assert m.slots == [11, 12, 13] and tree.bugs.first_step == 0
    assert tree.insert([1, 2, 5], [11, 12, 15]) == 2  # insert stays exact


# -- KV pool --------------------------------------------------------------------------------------
def _pool(bug=None, **kw):
    cfg = SimConfig(num_slots=64, max_context=32, max_running=2, bug=bug, **kw)
    pool = KvPool(cfg, BugSwitch(bug))
    req = Request(1, [5, 6, 7], 4)
    req.row = pool.alloc_row()
    return pool, req


def test_pool_reserves_whole_pages_in_the_row():
    pool, req = _pool(page_size=4)
    assert pool.extend(req, 2) == [4, 5]
    assert pool.table[req.row, :4].tolist() == [4, 5, 6, 7]  # the whole page is reserved in the row
    assert pool.extend(req, 3) == [6, 7, 8]  # the rest of the page, then a new page
    assert pool.table[req.row, 4:8].tolist() == [8, 9, 10, 11]
    pool.free_tail(req.slots[5:], 5)  # positions >= 5 live in page 2: it stays reserved
    assert pool.pages.free_list() == list(range(3, 16))
    pool.free(req.slots)
    assert pool.pages.free_list() == list(range(1, 16))


def test_pool_stale_table_tail_bug_leaves_the_page_tail_unwritten():
    pool, req = _pool(bug="stale_table_tail", page_size=4)
    pool.table[req.row] = 99  # the previous occupant's ids
    pool.extend(req, 2)
    assert pool.table[req.row, :4].tolist() == [4, 5, 99, 99]
    assert pool.extend(req, 1) == [99]  # the next decode takes a stale slot


def test_pool_swa_translation_and_window_eviction():
    pool, req = _pool(swa_window=2)
    slots = pool.extend(req, 5)
    swa = pool.swa_of(slots)
    assert all(s > 0 for s in swa) and len(set(swa)) == 5
    pool.evict_window(req)  # kv_len 5, window 2: positions 0..2 lose their SWA slots
    assert pool.swa_of(slots) == [0, 0, 0] + swa[3:]
    assert sorted(pool.swa.free_list()[:3]) == sorted(swa[:3])
    pool.free(slots)
    assert pool.swa_of(slots) == [0] * 5


# -- the engine -----------------------------------------------------------------------------------
def _outputs_match_oracle(engine: SimEngine) -> bool:
    for r in engine.sched.requests.values():
        if r.state is State.FINISHED:
            n = len(r.prompt)
            want = [oracle_token(r.rid, p, r.vocab) for p in range(n, n + r.max_new)]
            if r.tokens[n:n + r.max_new] != want:
                return False
    return True


def test_engine_is_deterministic_for_a_seed():
    cfg = MATRIX["spec-paged-swa"].replace(seed=5, **SMALL)
    a, b = SimEngine(cfg), SimEngine(cfg)
    ra, rb = a.run(), b.run()
    assert {**ra.to_dict(), "wall_s": 0} == {**rb.to_dict(), "wall_s": 0}
    assert [r.tokens for r in a.sched.requests.values()] == [r.tokens for r in b.sched.requests.values()]
    assert a.canary.stats()["entries_checked"] == b.canary.stats()["entries_checked"]


@pytest.mark.parametrize("name", list(MATRIX))
def test_clean_run_exercises_its_features_and_reports_nothing(name):
    cfg = MATRIX[name]
    engine = SimEngine(cfg)
    result = engine.run()
    assert result.violations == 0 and not result.health_problems
    assert result.finished + result.aborted == cfg.num_requests
    assert _outputs_match_oracle(engine)
    stats = engine.canary.stats()
    assert stats["sweeps"] > 0 and stats["entries_checked"] > stats["tokens_protected"]
    assert result.cache_hit_tokens > 0
    if cfg.swa_window:
        assert stats["launches"].get("HEAD_K_SWA", 0) > 0 and stats["launches"].get("SWEEP_K_SWA", 0) > 0
    if cfg.spec_tokens:
        assert 0 < engine.spec.accepted < engine.spec.proposed
    if cfg.offload:
        assert result.offloads > 0 and result.loadbacks > 0
    if cfg.num_slots < 512:
        assert engine.tree.evicted_pages > 0
    if cfg.num_slots < 512 and cfg.spec_tokens:
        assert result.retractions > 0  # verify needs 1 + drafts slots per request (and scratch pages)


def test_retracted_requests_are_readmitted_and_finish_with_oracle_outputs():
    engine = SimEngine(MATRIX["pressure-paged-spec"])
    result = engine.run()
    retracted = [r for r in engine.sched.requests.values() if r.retractions]
    assert result.retractions > 0 and retracted
    assert all(r.state in (State.FINISHED, State.ABORTED) for r in retracted)
    assert any(r.state is State.FINISHED for r in retracted)
    assert _outputs_match_oracle(engine) and result.violations == 0


def test_every_request_row_and_page_comes_back():
    engine = SimEngine(MATRIX["pressure-offload"].replace(seed=2, **SMALL))
    engine.run()
    assert engine.pool.rows.free_list() == list(range(1, engine.cfg.num_rows))
    held = engine.tree.device_pages()
    assert engine.pool.pages.free_pages + held == engine.pool.pages.num_pages - 1
    assert sorted(set(engine.pool.pages.free_list())) == engine.pool.pages.free_list()  # no double free


@pytest.mark.parametrize("name", list(MATRIX))
def test_clean_fuzz(name):
    """FUZZ_SEEDS small seeded workloads per configuration (203 in all): zero violations."""
    bad = []
    for seed in range(100, 100 + FUZZ_SEEDS):
        cfg = MATRIX[name].replace(seed=seed, **SMALL)
        r = run_sim(cfg, default_canary_config(cfg).replace(backend=FUZZ_BACKEND))
        if r.violations or r.health_problems:
            bad.append((seed, r.violations, r.reasons, r.launch_tags))
    assert not bad


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MATRIX))
def test_clean_fuzz_full_size(name):
    """50 full-size workloads per configuration (350 in all): zero violations."""
    bad = []
    for seed in range(1000, 1050):
        r = run_sim(MATRIX[name].replace(seed=seed))
        if r.violations or r.health_problems:
            bad.append((seed, r.violations, r.reasons, r.launch_tags))
    assert not bad
