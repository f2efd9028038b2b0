"""Mode "abort" (issue 38): the requests that read wrong KV (or wrote wrong inputs) are failed through the
engine's own error path, once each; the others finish with the tokens of a bug-free run."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from kvcanary import Canary, CanaryConfig, ForwardBatch, KvCanaryAbortError, PoolSpec, RealKvSource
from kvcanary.sim import MATRIX, SimEngine
from kvcanary.sim.engine import default_canary_config
from kvcanary.sim.model import kv_words
from kvcanary.sim.workload import Workload
from kvcanary.sim.zoo import quiet_and_single_threaded


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_and_single_threaded():
        yield


# -- the runtime: a toy engine of one-token pages ------------------------------------------------------
class Toy:
    """Requests on rows of a 64-slot pool; ``forward`` runs them as one batch (tests/test_runtime.py's way)."""

    def __init__(self, on_abort=None, mode="abort", **config):
        self.k = torch.zeros(64, 8, dtype=torch.float32)
        pool = PoolSpec(num_slots=64, k_sources=(RealKvSource(self.k, page_size=1, num_bytes_per_token=32,
                                                             read_bytes=32),))
        self.canary = Canary(pool, CanaryConfig(mode=mode, health_interval=0, **config), max_batch=4, max_tokens=64,
                             max_context=32, num_rows=8, on_abort=on_abort)
        self.canary.mark_ready()
        self.table = torch.zeros(8, 32, dtype=torch.int32)
        self.next_slot = 1

    def forward(self, work, bad_input=None, stale=()):
        """``work``: (request id, row, prefix, tokens) per request; ``bad_input``: a request id whose first input
        token is not the one its history expects (a write-input violation); ``stale``: request ids whose new
        token's table cell is a stale 0 (they write into slot 0)."""
        rows, prefix, extend, ids, pos, loc, rids, exp = [], [], [], [], [], [], [], []
        for rid, row, p, tokens in work:
            slots = [0] * len(tokens) if rid in stale else list(range(self.next_slot, self.next_slot + len(tokens)))
            self.next_slot += len(tokens) * (rid not in stale)
            self.table[row, p:p + len(tokens)] = torch.tensor(slots, dtype=torch.int32)
            rows.append(row), prefix.append(p), extend.append(len(tokens)), rids.append(rid)
            ids += tokens
            exp += [t + 1 if rid == bad_input and i == 0 else t for i, t in enumerate(tokens)]
            pos += range(p, p + len(tokens))
            loc += slots
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        batch = ForwardBatch(t(rows), t(prefix), t(extend), t(ids), t(pos), t(loc), self.table, request_ids=t(rids),
                             expected_input_ids=t(exp), expected_positions=t(pos))
        self.canary.before_forward(batch)
        self.k[t(loc)] = torch.randn(len(loc), 8)
        self.canary.after_forward(batch)


def test_abort_needs_the_engines_handler_at_construction():
    with pytest.raises(ValueError, match="on_abort must be a callable in mode 'abort'.*got None"):
        Toy(on_abort=None)
    with pytest.raises(TypeError, match="on_abort must be a callable or None, got 3"):
        Toy(on_abort=3, mode="log")
    assert CanaryConfig.from_env({"KV_CANARY_MODE": "abort"}).mode == "abort"
    Toy(on_abort=None, mode="log")  # other modes never call it


def test_a_stale_entry_aborts_its_reader_once_and_serving_goes_on(caplog):
    calls = []
    toy = Toy(on_abort=lambda rid, vs: calls.append((rid, vs)))
    toy.forward([(7, 1, 0, [11, 22, 33]), (8, 2, 0, [44, 55, 66])])
    toy.forward([(7, 1, 3, [34]), (8, 2, 3, [67])])
    assert calls == [] and toy.canary.stats()["aborted_requests"] == 0
    toy.table[1, 1] = toy.table[2, 1]  # a stale table entry: request 7 reads request 8's position 1
    toy.forward([(7, 1, 4, [35]), (8, 2, 4, [68])])
    assert [rid for rid, _ in calls] == [7]
    vs = calls[0][1]
    assert vs and all(v.reader_request == 7 for v in vs) and "verify_chain_hash" in vs[0].reasons
    # The reader's next forward reads the same wrong KV: reported again, not aborted again.
    before = toy.canary.monitor.total_violations
    toy.forward([(7, 1, 5, [36]), (8, 2, 5, [69])])
    assert toy.canary.monitor.total_violations > before and len(calls) == 1
    s = toy.canary.stats()
    assert s["aborted_requests"] == 1 and s["aborts_by_reason"]["verify_chain_hash"] == 1
    assert s["abort_unattributed"] == 0 and s["abort_handler_errors"] == 0
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        assert toy.canary.check_health() == []
    assert "1 request(s) aborted since the last check (1 in all)" in caplog.text
    assert "aborted_requests=1" in toy.canary.monitor.stats_line()


def test_a_wrong_input_aborts_its_writer():
    calls = []
    toy = Toy(on_abort=lambda rid, vs: calls.append((rid, vs)))
    toy.forward([(7, 1, 0, [11, 22]), (8, 2, 0, [44, 55])], bad_input=8)
    assert [rid for rid, _ in calls] == [8]
    assert all(v.is_write_check and v.writer_request == 8 for v in calls[0][1])
    assert toy.canary.stats()["aborts_by_reason"] == {"write_token": 1}


def test_a_write_row_whose_record_was_replaced_names_its_writer_from_the_batch():
    calls = []
    # (stale zero cells read slot 0: the reserved-slot check, off here, would report them first)
    toy = Toy(on_abort=lambda rid, vs: calls.append((rid, vs)), reserved_check=False)
    toy.forward([(7, 1, 0, [11, 22, 33]), (8, 2, 0, [44, 55, 66, 77, 88])])
    toy.forward([(7, 1, 3, [34])], stale={7})  # request 7's table cells from position 3 on are stale zeros
    toy.forward([(7, 1, 4, [35]), (8, 2, 5, [99])], stale={7, 8})
    assert calls == []  # (each chain still continues the record it was written after)
    # Request 7 continues from slot 0, which request 8 rewrote last step: its write of position 5 fails the
    # chain-position assert, and request 8's later write of position 6 in the same forward replaces the record.
    toy.forward([(7, 1, 5, [36]), (8, 2, 6, [98])], stale={7, 8})
    rows = [v for v in toy.canary.violations if v.is_write_check]
    assert [(v.slot, v.position, v.writer_request) for v in rows] == [(0, 5, 7)]
    assert [rid for rid, _ in calls] == [7]


def test_a_failing_handler_is_a_health_problem_not_an_error():
    def handler(rid, vs):
        raise RuntimeError("engine gone")

    toy = Toy(on_abort=handler)
    toy.forward([(7, 1, 0, [11, 22, 33])])
    toy.table[1, 1] = 40  # a slot no forward wrote
    toy.forward([(7, 1, 3, [34])])  # does not raise
    assert toy.canary.stats()["abort_handler_errors"] == 1
    assert any("abort handler failed for request 7 (RuntimeError: engine gone)" in p
               for p in toy.canary.check_health())


def test_the_abort_error_names_the_request_and_the_first_violation():
    toy = Toy(on_abort=lambda rid, vs: errors.append(KvCanaryAbortError(rid, vs, name="req_3")))
    errors = []
    toy.forward([(7, 1, 0, [11, 22, 33])])
    toy.table[1, 2] = 40
    toy.forward([(7, 1, 3, [34])])
    assert str(errors[0]).startswith("kv-canary: request 7 ('req_3') aborted: ")
    assert "of the KV it read; first: kv_canary violation: launch_tag=HEAD_K_FULL" in str(errors[0])


# -- the simulated engine --------------------------------------------------------------------------
class OracleEngine(SimEngine):
    """The sim with ground truth: which live requests read KV bytes that are not their tokens' (after each
    forward's writes, as attention reads them), and which were fed an input that is not their token.
    Client aborts are dropped from the workload, so every request the canary leaves alone finishes."""

    def __init__(self, cfg, mode="abort"):
        super().__init__(cfg, default_canary_config(cfg).replace(mode=mode))
        self.workload = Workload([dataclasses.replace(s, abort_at=None) for s in self.workload.specs], cfg.vocab)
        self.read_wrong: dict[int, int] = {}  # request id -> step of its first wrong read
        self.fed_wrong: dict[int, int] = {}
        self._works = []
        model_forward = self.model.forward

        def forward(*args, **kwargs):  # (the model's keywords: its write-check note)
            model_forward(*args, **kwargs)
            self._check_reads()

        self.model.forward = forward

    def forward(self, works):
        self._works = works
        for w in works:
            r = w.req
            if not r.released and any(t != r.truth(p) for t, p in zip(w.input_ids, w.positions)):
                self.fed_wrong.setdefault(r.rid, self.step_no)
        return super().forward(works)

    def _check_reads(self):
        k0 = self.model.k[0].view(-1, 4)  # (layer 0's K: tag 0 in kv_words)
        for w in self._works:
            r, p = w.req, w.start
            if p == 0 or r.released:  # (a finished request's in-flight forward: its output is complete)
                continue
            slots = self.pool.table[w.row, :p].to(torch.int64)
            want = kv_words(torch.tensor([r.truth(i) for i in range(p)]), torch.arange(p), 0)
            if bool((k0[slots] != want).any()):
                self.read_wrong.setdefault(r.rid, self.step_no)

    def failed(self) -> dict[int, int]:
        return {rid: r.done_step for rid, r in self.sched.requests.items() if r.error is not None}


@pytest.mark.parametrize("config", ["base", "paged"])
def test_sim_planted_bug_aborts_exactly_the_readers_of_wrong_kv(config):
    cfg = MATRIX[config]
    clean = OracleEngine(cfg)
    result = clean.run()
    assert result.violations == 0 and result.failed == 0 and clean.canary.stats()["aborted_requests"] == 0
    assert clean.read_wrong == {} and result.finished == cfg.num_requests
    bug = OracleEngine(cfg.replace(bug="match_too_long"))
    result = bug.run()
    assert result.violations > 0 and bug.read_wrong
    # Exactly the readers, each failed at the step of its first wrong read (a CPU canary drains at once).
    assert bug.failed() == bug.read_wrong
    assert bug.canary.stats()["aborted_requests"] == len(bug.read_wrong) == result.failed
    assert {v.reader_request for v in bug.canary.violations} == set(bug.read_wrong)
    for rid, r in bug.sched.requests.items():
        if rid in bug.read_wrong:
            assert r.error.startswith(f"kv-canary: request {rid} aborted")
        else:
            assert r.error is None and r.tokens == clean.sched.requests[rid].tokens


def test_sim_wrong_inputs_abort_exactly_their_writers():
    cfg = MATRIX["base"].replace(bug="wrong_input_ids")
    bug = OracleEngine(cfg)
    result = bug.run()
    assert bug.fed_wrong and bug.failed() == bug.fed_wrong
    # The canary also names requests whose in-flight forward ran after they finished: asked, left alone.
    s = bug.canary.stats()
    assert set(s["aborts_by_reason"]) == {"write_token"}
    assert s["aborted_requests"] >= result.failed == len(bug.fed_wrong)
    clean = OracleEngine(cfg.replace(bug=None))
    clean.run()
    for rid, r in bug.sched.requests.items():
        if rid not in bug.fed_wrong:
            assert r.error is None and r.tokens == clean.sched.requests[rid].tokens
    assert result.finished + result.failed == cfg.num_requests


# -- transformers continuous batching -----------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("transformers")
    from kvcanary.demo import build_tiny_model

    return build_tiny_model("cpu")


def generate(model, bug=None, canary=True):
    """The demo prompts, 8 greedy tokens each; returns (outputs by engine id, the handle or None)."""
    from transformers import GenerationConfig

    from kvcanary.demo import demo_prompts
    from kvcanary.integrations.transformers import attach
    from kvcanary.sim.hf_bugs import plant
    from kvcanary.integrations.transformers.reach import cb_config

    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1)
    cbc = cb_config(block_size=4, num_blocks=96, max_batch_tokens=16, max_requests_per_batch=16,
                    use_async_batching=False, use_cuda_graph=False, scheduler_type="fifo")
    undo = plant(model, bug) if bug else None
    handle = attach(model, mode="abort", sweep_interval=4) if canary else None
    try:
        logging.getLogger("transformers").disabled = True  # (it logs each failed request as an error)
        out = model.generate_batch(demo_prompts(512), generation_config=gen, continuous_batching_config=cbc)
    finally:
        logging.getLogger("transformers").disabled = False
        if handle is not None:
            handle.detach()
        if undo is not None:
            undo()
    return out, handle


@pytest.fixture(scope="module")
def bare_tokens(llama):
    out, _ = generate(llama, canary=False)
    assert all(o.error is None for o in out.values())
    return {k: o.generated_tokens for k, o in out.items()}


def test_transformers_clean_run_aborts_nothing(llama, bare_tokens):
    out, handle = generate(llama)
    s = handle.stats()
    assert s["violations"] == 0 and s["aborted_requests"] == 0 and s.get("failed_requests", 0) == 0
    assert {k: o.generated_tokens for k, o in out.items()} == bare_tokens


@pytest.mark.parametrize("bug", ["wrong-read-index", "early-free"])
def test_transformers_abort_fails_the_reader_the_others_finish(llama, bare_tokens, bug):
    from transformers.generation.continuous_batching.requests import RequestStatus

    out, handle = generate(llama, bug=bug)
    failed = {k for k, o in out.items() if o.error is not None}
    names = {i: n for s in handle.sessions for n, i in s.ids.items()}
    readers = {names[v.reader_request] for v in handle.violations if v.reader_request is not None}
    s = handle.stats()
    assert s["violations"] > 0 and failed and failed == readers
    assert s["aborted_requests"] == s["failed_requests"] == len(failed)
    for k, o in out.items():
        if k in failed:
            assert o.status == RequestStatus.FAILED and o.error.startswith("kv-canary: request ")
            assert f"({k!r}) aborted: " in o.error
            # cut short; what it emitted before the bad read is the bug-free run's
            assert len(o.generated_tokens) < len(bare_tokens[k])
            assert o.generated_tokens[:-1] == bare_tokens[k][:len(o.generated_tokens) - 1]
        else:
            assert o.generated_tokens == bare_tokens[k]
