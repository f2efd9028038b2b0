"""Fault injection: every kind is detected with its expected reason, recall is 100%, off is a no-op."""

import importlib.util
import logging
import random

import pytest
import torch

from kvcanary import CanaryConfig
from kvcanary.format import FailReason, oracle_token
from kvcanary.runtime.inject import KINDS
from kvcanary.sim.recall import match, phase_of, recall_table, sim_runner

from toy_engine import ToyEngine

BACKEND = "torch" if importlib.util.find_spec("kvcanary.ops.torch_ops") else "reference"
VOCAB = 1000


class Churn:
    """A ToyEngine with a request lifecycle: arrivals (some sharing a cached prefix), chunked
    prefill, decode whose next tokens pass through ``canary.perturb_next_tokens``, finish into
    a prefix cache of idle slots (walked by the sweep), eviction back to the free list."""

    def __init__(self, seed=0, cache_entries=6, **config):
        config.setdefault("backend", BACKEND)
        config.setdefault("warmup_steps", 0)
        config.setdefault("sweep_interval", 3)
        self.e = ToyEngine(num_slots=400, num_rows=9, max_context=40, max_batch=8, max_tokens=64,
                           token_history=True, **config)
        self.canary = self.e.canary
        self.canary.sweep_provider = self.walk
        self.rng = random.Random(seed)
        self.refs = [0] * 400  # holders (running requests, cache entries) per slot
        self.cache: list[tuple[list[int], list[int]]] = []  # (slots, tokens) of finished requests
        self.cache_entries = cache_entries
        self.truth: dict[int, list[int]] = {}  # tokens each request should consume (no swaps)
        self.length: dict[int, int] = {}  # length at which a request finishes
        self.next_rid = 1

    def walk(self):
        """Sweep provider: (slot, position, prev) of every cached slot."""
        seen = {}
        for slots, _ in self.cache:
            for p, s in enumerate(slots):
                seen[s] = (p, slots[p - 1] if p else -1)
        if not seen:
            return None
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        return t(list(seen)), t([v[0] for v in seen.values()]), t([v[1] for v in seen.values()])

    def admit(self):
        e = self.e
        need = sum(self.length[rid] - r["cached"] for rid, r in e.reqs.items())
        while self.cache and len(e.free) < need + 60:
            self.evict()
        while e.free_rows and len(e.free) >= need + 40:
            rid, self.next_rid = self.next_rid, self.next_rid + 1
            shared, prompt = [], []
            if self.cache and self.rng.random() < 0.6:
                slots, tokens = self.rng.choice(self.cache)
                k = self.rng.randint(1, len(slots))
                shared, prompt = slots[:k], tokens[:k]
            prompt = prompt + [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 12))]
            e.add(rid, prompt)
            r = e.reqs[rid]
            if shared:
                e.rtt[r["row"], :len(shared)] = torch.tensor(shared, dtype=torch.int32)
                r["cached"] = len(shared)
                for s in shared:
                    self.refs[s] += 1
            self.truth[rid] = list(prompt)
            self.length[rid] = min(38, len(prompt) + self.rng.randint(1, 16))
            need += self.length[rid] - r["cached"]

    def step(self):
        e = self.e
        self.admit()
        schedule, sampled = [], []
        for rid, r in e.reqs.items():
            P = r["cached"]
            if P < len(self.truth[rid]) and len(r["tokens"]) > P:
                schedule.append((rid, min(self.rng.randint(1, 8), len(r["tokens"]) - P)))  # prefill chunk
            else:
                schedule.append((rid, 1))
                sampled.append(rid)
        if sampled:
            tokens = [oracle_token(rid, len(e.reqs[rid]["tokens"]), VOCAB) for rid in sampled]
            fed = self.canary.perturb_next_tokens(torch.tensor(sampled), torch.tensor(tokens))
            for rid, want, got in zip(sampled, tokens, fed.tolist()):
                e.reqs[rid]["tokens"].append(got)
                self.truth[rid].append(want)
        truth = [t for rid, n in schedule for t in self.truth[rid][e.reqs[rid]["cached"]:][:n]]
        feed = lambda b: setattr(b, "expected_input_ids", torch.tensor(truth))  # noqa: E731
        pre = {rid: e.reqs[rid]["cached"] for rid, _ in schedule}
        e.forward(schedule, feed=feed)
        for rid, n in schedule:
            for p in range(pre[rid], pre[rid] + n):
                self.refs[e.slot(rid, p)] += 1
        for rid in [rid for rid, r in e.reqs.items() if r["cached"] >= self.length[rid]]:
            self.finish(rid)

    def finish(self, rid):
        e = self.e
        r = e.reqs.pop(rid)
        n = r["cached"]
        self.cache.append((e.rtt[r["row"], :n].tolist(), r["tokens"][:n]))
        e.free_rows.append(r["row"])
        while len(self.cache) > self.cache_entries:
            self.evict()

    def evict(self):
        for s in self.cache.pop(0)[0]:
            self.refs[s] -= 1
            if self.refs[s] == 0:
                self.e.free.append(s)

    def run(self, steps):
        self.step()
        self.canary.mark_ready()
        for _ in range(steps - 1):
            self.step()
        return self.canary.flush()


def toy(**kw):
    kw.setdefault("backend", BACKEND)
    kw.setdefault("warmup_steps", 0)
    return ToyEngine(num_slots=128, **kw)


def bits(violations):
    return {(v.launch_tag, v.reason_label) for v in violations}


# -- each kind, alone, on the toy engine ---------------------------------------------------------
@pytest.mark.parametrize("kind, config, tag, reason", [
    ("table", {}, "HEAD_K_FULL", FailReason.VERIFY_CHAIN_HASH),
    ("kv", {}, "TAIL_K_FULL", FailReason.VERIFY_REAL_KV_HASH),
    ("kv", {"check_v": True, "real_kv": "all"}, "TAIL_", FailReason.VERIFY_REAL_KV_HASH),
    ("cached", {"sweep_interval": 2}, "SWEEP_K_FULL", FailReason.VERIFY_REAL_KV_HASH),
    ("after", {}, "TAIL_K_FULL", FailReason.VERIFY_REAL_KV_HASH),
    ("kv", {"swa_window": 3, "swa_slots": 128, "inject_group": "swa"}, "TAIL_K_SWA", FailReason.VERIFY_REAL_KV_HASH),
    ("after", {"swa_window": 3, "swa_slots": 128, "inject_group": "swa"}, "TAIL_K_SWA",
     FailReason.VERIFY_REAL_KV_HASH),
    ("table", {"swa_window": 3, "swa_slots": 128}, "HEAD_K_", FailReason.VERIFY_CHAIN_HASH),
], ids=["table", "kv", "kv-v-all", "cached", "after", "kv-swa", "after-swa", "table-swa"])
def test_each_kind_is_detected_with_its_reason(kind, config, tag, reason, caplog):
    e = toy(token_history=True, oracle=True, **{f"inject_{kind}_prob": 1.0, "inject_seed": 3, **config})
    cache = []
    e.canary.sweep_provider = lambda: (torch.tensor(cache), torch.tensor([0, 1]), torch.tensor([-1, cache[0]]))
    e.add(1, [5, 6, 7, 8])
    e.add(2, [9, 10, 11])
    e.add(3, [1, 2])
    written = {1: [], 2: []}
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        e.forward([(1, 4), (2, 3), (3, 2)])
        cache += [e.slot(3, 0), e.slot(3, 1)]  # request 3 is done: its slots stay only in the cache
        for _ in range(6):
            batch = e.forward([(1, 1), (2, 1)])
            written[1].append(int(batch.out_cache_loc[0]))
            written[2].append(int(batch.out_cache_loc[1]))
    violations = e.canary.flush()
    records = e.canary.injector.records
    assert records and all(r.kind == kind for r in records)
    assert sum("kv_canary injection: kind=" + kind in m for m in caplog.messages) == len(records)
    report = match(records, violations)
    row = report.kinds[kind]
    assert row.touched >= 3 and row.detected == row.touched, report.missed
    assert report.false_positives == []
    for rec, v in report.detections:
        assert v.launch_tag.startswith(tag) and v.fail_reason & reason
    expected_latency = 1 if kind == "after" else 0
    assert set(row.latencies) == {expected_latency}
    # Every perturbation a check read is undone: the engine's table and KV are as it wrote them.
    for rid in (1, 2):
        assert e.rtt[e.reqs[rid]["row"], -6 + e.reqs[rid]["cached"]:e.reqs[rid]["cached"]].tolist() == written[rid]
    unread = {r.slot for r in records if r.end_step is None}
    for rid in (1, 2, 3):
        for p, tok in enumerate(e.reqs[rid]["tokens"][:e.reqs[rid]["cached"]]):
            s = e.slot(rid, p)
            if s not in unread or config.get("inject_group") == "swa":
                assert torch.equal(e.k[s, 0], e.kv_value(tok, p)) and torch.equal(e.v[s, 0], -e.kv_value(tok, p))


def test_next_token_swap_shows_write_token_only():
    churn = Churn(seed=4, inject_swap_prob=0.5, inject_seed=1, sweep_interval=0)
    violations = churn.run(40)
    records = churn.canary.injector.records
    report = match(records, violations)
    assert report.kinds["swap"].touched >= 6
    assert report.kinds["swap"].detected == report.kinds["swap"].touched and report.false_positives == []
    assert {v.reason_label for v in violations} == {"write_token"}
    assert {v.launch_tag for v in violations} == {"HEAD_K_FULL"}
    swapped = {(r.slot, r.position) for r in records if r.read_step is not None}
    assert {(v.slot, v.position) for v in violations} == swapped


# -- long seeded runs ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS + ("all",))
def test_long_seeded_run_has_full_recall_and_no_false_positive(kind):
    probs = {f"inject_{k}_prob": 0.15 for k in (KINDS if kind == "all" else (kind,))}
    churn = Churn(seed=11, inject_seed=7, inject_warmup=3, **probs)
    violations = churn.run(120)
    report = match(churn.canary.injector.records, violations)
    total = report.total
    assert total.touched >= 8, recall_table({kind: report}, markdown=False)
    assert report.missed == [] and total.recall == 1.0
    assert report.false_positives == []
    assert all(r.step > 3 for r in churn.canary.injector.records)  # warm-up respected


def test_seeded_runs_repeat_exactly():
    runs = []
    for _ in range(2):
        churn = Churn(seed=2, inject_seed=5, **{f"inject_{k}_prob": 0.2 for k in KINDS})
        violations = churn.run(40)
        runs.append(([r.log_line() for r in churn.canary.injector.records], [v.log_line() for v in violations]))
    assert runs[0] == runs[1] and runs[0][0]


def test_clean_churn_without_injection_is_silent():
    churn = Churn(seed=11)
    assert churn.run(120) == []
    assert churn.canary.injector is None
    assert churn.canary.stats()["sweeps"] > 0


# -- off means off -------------------------------------------------------------------------------
def _buffers(churn):
    c = churn.canary
    return [b.clone() for g in c.groups for b in g.bufs.values()] + [churn.e.k.clone(), churn.e.rtt.clone()]


@pytest.mark.parametrize("config", [
    {},  # no injector at all
    {"inject_seed": 9, "inject_warmup": 5},  # knobs set, every probability 0
    {**{f"inject_{k}_prob": 1.0 for k in KINDS}, "inject_warmup": 10_000},  # armed, never past warm-up
], ids=["default", "zero-probs", "armed-in-warmup"])
def test_injection_off_leaves_canary_buffers_identical(config):
    plain = Churn(seed=6)
    plain.run(30)
    other = Churn(seed=6, **config)
    other.run(30)
    assert (other.canary.injector is None) == (not CanaryConfig(**config).injecting)
    for a, b in zip(_buffers(plain), _buffers(other)):
        assert torch.equal(a, b)
    assert plain.canary.stats() == other.canary.stats()
    if other.canary.injector is not None:
        assert other.canary.injector.records == []


def test_perturb_next_tokens_is_identity_when_off():
    e = toy()
    tokens = torch.tensor([1, 2, 3])
    assert e.canary.perturb_next_tokens(torch.tensor([1, 2, 3]), tokens) is tokens


# -- configuration errors ------------------------------------------------------------------------
@pytest.mark.parametrize("config, message", [
    ({"inject_kv_prob": 0.5, "real_kv": "none"}, "inject_kv_prob needs real-KV hashing"),
    ({"inject_after_prob": 0.5, "real_kv": "none"}, "inject_after_prob needs real-KV hashing"),
    ({"inject_cached_prob": 0.5, "real_kv": "none", "sweep_interval": 2}, "inject_cached_prob needs real-KV"),
    ({"inject_cached_prob": 0.5}, "inject_cached_prob needs the periodic sweep"),
    ({"inject_swap_prob": 0.5, "input_check": False}, "inject_swap_prob needs the write-input assert"),
    ({"inject_kv_prob": 0.5, "inject_group": "swa"}, "targets inject_group='swa'"),
    ({"inject_table_prob": 0.5, "mode": "none"}, "needs mode 'log' or 'raise'"),
], ids=["kv-no-realkv", "after-no-realkv", "cached-no-realkv", "cached-no-sweep", "swap-no-input-check",
        "no-swa-group", "mode-none"])
def test_prerequisite_off_is_a_configuration_error(config, message):
    with pytest.raises(ValueError, match="kv-canary: .*" + message):
        toy(**config)


def test_kv_flip_without_sources_is_a_configuration_error():
    from kvcanary import Canary, PoolSpec

    with pytest.raises(ValueError, match="kv-canary: inject_kv_prob needs real-KV sources"):
        Canary(PoolSpec(16), CanaryConfig(inject_kv_prob=0.5), max_batch=1, max_tokens=4, max_context=8, num_rows=2)


def test_cached_without_provider_and_swap_without_oracle_fail_at_run_time():
    e = toy(inject_cached_prob=1.0, sweep_interval=1)
    e.add(1, [5, 6, 7])
    with pytest.raises(ValueError, match="kv-canary: inject_cached_prob needs a sweep provider"):
        e.forward([(1, 3)])
    e = toy(inject_swap_prob=1.0)  # no oracle: the batch carries no expected_input_ids
    e.add(1, [5, 6])
    e.add(2, [7, 8])
    e.forward([(1, 2), (2, 2)])
    e.reqs[1]["tokens"] += e.canary.perturb_next_tokens([1, 2], [40, 41])[:1]
    e.reqs[2]["tokens"] += [40]
    with pytest.raises(ValueError, match="kv-canary: inject_swap_prob needs the token oracle"):
        e.forward([(1, 1), (2, 1)])


@pytest.mark.parametrize("spec", ["kv=1.5", "group=both", "warmup=-1", "swap=x", "nope=1", "kv=0.1,seed"])
def test_inject_env_var_is_validated(spec):
    with pytest.raises(ValueError, match="^kv-canary: KV_CANARY_INJECT"):
        CanaryConfig.from_env({"KV_CANARY_INJECT": spec})


def test_inject_env_var_is_read():
    cfg = CanaryConfig.from_env({"KV_CANARY_INJECT": "table=0.25, seed=4,warmup=7,GROUP=swa"})
    assert (cfg.inject_table_prob, cfg.inject_seed, cfg.inject_warmup, cfg.inject_group) == (0.25, 4, 7, "swa")
    assert cfg.injecting and CanaryConfig.sources({"KV_CANARY_INJECT": "kv=0.5"})["inject_kv_prob"] == "environment"
    assert not CanaryConfig.from_env({"KV_CANARY_INJECT": ""}).injecting


# -- the matcher ---------------------------------------------------------------------------------
def test_matcher_flags_unexplained_violations_and_misses():
    e = toy(inject_kv_prob=1.0, inject_warmup=1)
    e.add(1, [5, 6, 7])
    e.forward([(1, 3)])
    e.forward([(1, 1)])
    bug = []

    def corrupt(eng):  # a real bug, on a slot the step's injection did not pick
        bug.append(next(s for s in (eng.slot(1, 0), eng.slot(1, 1)) if s != eng.canary.injector.records[-1].slot))
        eng.k[bug[0], 0, 1] += 1.0

    e.forward([(1, 1)], corrupt=corrupt)
    violations = e.canary.flush()
    records = e.canary.injector.records
    report = match(records, violations)
    assert [v.slot for v in report.false_positives] == bug
    assert report.missed == [] and report.kinds["kv"].detected == 2
    assert phase_of(report.false_positives[0]) == "tail"
    assert match(records, []).missed == [r for r in records if r.read_step is not None]
    assert "| kv |" in recall_table({"kv": report})


# -- the simulated engine ------------------------------------------------------------------------
@pytest.fixture
def sim():
    return pytest.importorskip("kvcanary.sim")


ALL_KINDS = {f"inject_{k}_prob": 0.2 for k in KINDS}


@pytest.mark.parametrize("name", ["base", "swa-chunked", "spec-paged-swa", "pressure-offload",
                                  "pressure-paged-spec"])
def test_sim_every_kind_at_once_full_recall_no_false_positive(sim, name):
    records, violations = sim_runner(sim.MATRIX[name])({"inject_seed": 1, "inject_warmup": 2, **ALL_KINDS})
    report = match(records, violations)
    assert report.total.touched >= 20, recall_table({name: report}, markdown=False)
    assert report.missed == [] and report.false_positives == []
    assert {r.kind for r in records} >= {"table", "kv", "after", "swap"}


@pytest.mark.parametrize("kind, tags, reasons", [
    ("table", {"HEAD_K_FULL", "HEAD_K_SWA"}, FailReason.VERIFY_CHAIN_HASH),
    ("kv", {"TAIL_K_FULL"}, FailReason.VERIFY_REAL_KV_HASH),
    ("cached", {"SWEEP_K_FULL"}, FailReason.VERIFY_REAL_KV_HASH),
    ("after", {"TAIL_K_FULL", "SWEEP_K_FULL"}, FailReason.VERIFY_REAL_KV_HASH),
    ("swap", {"HEAD_K_FULL"}, FailReason.WRITE_TOKEN),
])
def test_sim_each_kind_is_detected_with_its_reason(sim, kind, tags, reasons):
    cfg = sim.MATRIX["pressure-paged-spec"]
    records, violations = sim_runner(cfg)({"inject_seed": 2, "inject_warmup": 2, f"inject_{kind}_prob": 0.4})
    report = match(records, violations)
    assert report.kinds[kind].touched >= 3 and report.missed == [] and report.false_positives == []
    assert {v.launch_tag for _, v in report.detections} <= tags
    assert all(v.fail_reason & reasons for _, v in report.detections)
    if kind == "swap":  # the token swap shows as write_token only: no chain, position or real-KV noise
        assert {v.reason_label for v in violations} == {"write_token"}


def test_sim_swap_warns_when_the_engine_never_samples_through_the_canary(sim, caplog):
    cfg = sim.MATRIX["base"]
    engine = sim.SimEngine(cfg, sim.default_canary_config(cfg).replace(inject_swap_prob=0.5))
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        engine.run()
    assert engine.canary.injector.records == []
    assert any("has not called Canary.perturb_next_tokens" in m for m in caplog.messages)


def test_configuration_doc_lists_every_variable():
    from pathlib import Path

    from kvcanary.runtime.config import env_table

    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    listed = [line.split("`")[1] for line in doc.splitlines() if line.startswith("| `KV_CANARY_")]
    assert listed == [var for var, _, _ in env_table()]  # every variable, once, and no other
