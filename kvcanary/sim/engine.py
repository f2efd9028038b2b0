"""The simulated engine: wires pool, prefix cache, scheduler, model and canary, and runs steps.

The canary is driven only through its public runtime API: a ``PoolSpec`` (the mock
model's KV tensors as real-KV sources, the SWA group with the live full->SWA table),
one ``ForwardBatch`` per forward between ``before_forward`` and ``after_forward``,
token histories and expected inputs from the token oracle, a sweep provider over
the prefix cache, ``copy_records`` for KV moves and ``save_records`` /
``restore_records`` for offload. With ``steps`` the runtime's step runner takes each forward
instead, from the engine's inputs (``step_source.py``): the second source of its protocol.
"""

from __future__ import annotations

import time

import torch

from kvcanary.runtime import (Canary, CanaryConfig, ForwardBatch, ForwardMode, PoolSpec, SharedRowError, SwaSpec,
                              TokenHistory)
from kvcanary.runtime.abort import KvCanaryAbortError
from kvcanary.runtime.engine import StepOptions
from kvcanary.runtime.graphs import DispatchGraph
from kvcanary.runtime.step import StepRunner
from kvcanary.runtime.allocator import CACHE_HOLDER, AllocatorSnapshot, BlockTable
from kvcanary.sim.bugs import BugSwitch
from kvcanary.sim.cache import CacheManager
from kvcanary.sim.config import SimConfig, SimResult  # noqa: F401  (SimResult: the zoo imports it here)
from kvcanary.sim.kvpool import KvPool
from kvcanary.sim.model import WORDS, MockModel
from kvcanary.sim.offload import HostCache
from kvcanary.sim.radix import RadixCache
from kvcanary.sim.scheduler import Scheduler, Work
from kvcanary.sim.spec import Speculator
from kvcanary.sim.carry_source import CarrySource
from kvcanary.sim.step_source import SimSource
from kvcanary.sim.workload import make_workload

STEP_PATHS = (None, "eager", "captured", "fused")  # SimEngine's steps: the plain hooks, or the step runner's paths


def default_canary_config(cfg: SimConfig) -> CanaryConfig:
    """The canary knobs the sim runs with: torch backend, log mode, K real-KV hash, token and input checks, the
    allocator check every step."""
    return CanaryConfig(mode="log", backend="torch", real_kv="partial", sweep_interval=cfg.sweep_interval,
                        report_blocks=0, health_interval=10, ring_capacity=32, allocator_check_interval=1)


class SimEngine:
    """A deterministic SGLang-style engine over ``cfg``; ``run()`` plays its workload.

    Args:
        cfg: the engine, workload and planted bug.
        canary_config: canary knobs (default ``default_canary_config(cfg)``).
        steps: None (the plain ``before_forward`` / ``after_forward`` hooks) or how the runtime's step runner
            takes each forward (``step_source.SimSource``): "eager", "captured" (a graph per batch shape) or
            "fused" (steady decode steps as one graph), the graphs being the CPU stand-in ``DispatchGraph``.
        carry: (with ``steps``) forwards alternate two input storage sets and carry the last forward's sampled
            tokens into their input ids, as async batching does (``carry_source.CarrySource``).
    """

    def __init__(self, cfg: SimConfig, canary_config: CanaryConfig | None = None, steps: str | None = None,
                 carry: bool = False):
        if steps not in STEP_PATHS or (carry and steps is None):
            raise ValueError(f"kv-canary: SimEngine steps must be one of {list(STEP_PATHS)} (not None with carry=True),"
                             f" got steps={steps!r}, carry={carry}")
        if steps is not None and (cfg.spec_tokens or cfg.swa_window):
            raise ValueError(f"kv-canary: SimEngine steps={steps!r} needs spec_tokens=0 and swa_window=0 (the step "
                             f"source describes neither), got spec_tokens={cfg.spec_tokens}, "
                             f"swa_window={cfg.swa_window}")
        self.cfg = cfg
        self.bugs = BugSwitch(cfg.bug)
        self.workload = make_workload(cfg)
        self.pool = pool = KvPool(cfg, self.bugs)
        self.model = MockModel(cfg.num_slots, cfg.page_size, cfg.num_layers, cfg.num_slots if cfg.swa_window else 0,
                               cfg.vocab)
        self.host: HostCache | None = None
        self.tree = RadixCache(cfg.page_size, pool.free, lambda e: self.host.release(e) if self.host else None,
                               self.bugs)
        swa = None
        if cfg.swa_window:
            k_swa, v_swa = self.model.swa_sources()
            swa = SwaSpec(cfg.num_slots, cfg.swa_window, pool.full_to_swa, k_swa, v_swa)
        spec = PoolSpec(cfg.num_slots, self.model.k_sources(), self.model.v_sources(), swa=swa)
        self.max_batch = max(max(cfg.graph_sizes), 2 * cfg.max_running)
        self.per_decode = cfg.tokens_per_decode
        max_tokens = (cfg.chunk_size or cfg.prefill_budget) + cfg.max_context + self.max_batch * self.per_decode
        self.canary = Canary(spec, canary_config or default_canary_config(cfg), max_batch=self.max_batch,
                             max_tokens=max_tokens, max_context=cfg.max_context, num_rows=cfg.num_rows,
                             on_abort=self.fail_request)
        self.in_flight: set[int] = set()  # request ids of the forward under way (an abort defers their release)
        self.canary.sweep_provider = self.sweep_triples
        # the write check: which sources hold each layer's K and V (the SWA layer is layer num_layers)
        m = self.model
        self.canary.write_check.name_layers([("full", list(range(len(m.k))), m.k, m.v)] + (
            [("swa", [len(m.k)], [m.swa_k], [m.swa_v])] if swa is not None else []))
        # the full pool's pages, the live requests' rows and the prefix cache's pages (docs/allocator.md)
        pool.pages.on_free = self.canary.watch_allocator(self.allocator_snapshot, num_blocks=pool.pages.num_pages,
                                                         slots_per_block=cfg.page_size).note_free
        self.canary.mark_ready()
        self.source = self.runner = None
        if steps is not None:
            self.source = (CarrySource if carry else SimSource)(self)
            self.runner = StepRunner(self.canary, self.source, StepOptions(step_graphs=steps != "eager",
                                                                           fused_steps=steps == "fused"),
                                     graph_type=None if steps == "eager" else DispatchGraph)
        if cfg.offload:
            self.host = HostCache(cfg.host_slots, pool, self.model, self.canary, self.tree, self.bugs)
        self.cache = CacheManager(pool, self.tree, self.host, self.bugs)
        self.spec = Speculator(cfg, pool, self.model, self.canary, self.bugs) if cfg.spec_tokens else None
        self.sched = Scheduler(cfg, pool, self.tree, self.cache, self.model, self.spec, self.bugs)
        # Static input buffers of the padded decode/verify forward (a CUDA graph replays from these).
        graph_tokens = max(cfg.graph_sizes) * self.per_decode
        self.graph_loc = torch.zeros(graph_tokens, dtype=torch.int64)
        self.step_no = 0
        self.nan_written = False  # (the planted nan_write fires once)
        if self.canary.config.poison_on_free:
            pool.freed = []  # the engine tells the canary which slots it frees (poison_slots, forward's end)
        self.refusal: tuple[int, SharedRowError] | None = None  # (the refused forward's step, the error)

    # -- running -------------------------------------------------------------------------------
    def run(self, stop_after: int | None = None) -> SimResult:
        """Play the workload until every request is done or ``max_steps``; returns the result.

        ``stop_after``: stop that many steps after the canary's first violation (a bug run has made its point).
        """
        t0 = time.perf_counter()
        while self.step_no < self.cfg.max_steps and self.refusal is None:
            self.step()
            if not self.sched.busy and self.step_no > self.workload.last_arrival:
                break
            vs = self.canary.violations
            if stop_after is not None and vs and self.canary.step - vs[0].step >= stop_after:
                break
        self.canary.flush()
        return self.result(time.perf_counter() - t0)

    def step(self) -> None:
        """One scheduler iteration and (if there is work) one forward."""
        self.step_no += 1
        self.bugs.step = self.canary.step + 1
        sched = self.sched
        sched.arrive(self.workload.arrivals(self.step_no))
        decode = sched.schedule_decode()
        sched.process_results(self.step_no, self.workload.aborts(self.step_no), {w.req.rid for w in decode})
        works = sched.schedule_prefill() + decode
        sched.finish_early(decode)
        if not works:
            sched.complete([])
            return
        self.forward(works)
        if self.refusal is None:
            sched.complete(works)
        self.in_flight = set()

    def fail_request(self, request_id: int, violations) -> None:
        """The canary's ``on_abort`` (mode "abort"): fail the request through the scheduler's release path. Called
        while a forward is open or closing (the drain), its release waits for that forward to complete; a
        request that already ended is left alone."""
        r = self.sched.requests.get(request_id)
        if r is not None:
            self.sched.fail(r, self.step_no, self.in_flight, str(KvCanaryAbortError(request_id, violations)))

    def forward(self, works: list[Work]) -> ForwardBatch:
        if self.runner is not None:
            return self.run_step(works)
        batch = self.build_batch(works)
        self.in_flight = {w.req.rid for w in works}
        try:
            self.canary.before_forward(batch)
        except SharedRowError as e:
            # the canary's report of a request row handed to two requests (a double free of the row):
            # nothing ran, and the engine stops as it would on the error
            self.refusal = (self.canary.step + 1, e)
            return batch
        self.run_model(batch)
        self._nan_write(works)
        self.canary.after_forward(batch)
        self.end_step()
        return batch

    def run_step(self, works: list[Work]) -> ForwardBatch:
        """``forward`` through the step runner: its canary work before the forward, or (late) after it."""
        runner = self.runner
        self.source.set_step(works)
        self.in_flight = {w.req.rid for w in works}
        late = runner.late_step()
        batch = None
        try:
            if not late:
                batch = runner.before()
            self.run_model(self.source.forward_inputs(sum(w.n for w in works)))
            self._nan_write(works)
            runner.forward_enqueued()
            if late:
                batch = runner.before(late=True)
        except SharedRowError as e:
            self.refusal = (self.canary.step + 1, e)  # (as forward)
            return batch
        runner.after()
        if runner.carries:
            self.source.done[self.source.current] = runner.done_event()
        self.end_step()
        return batch

    def run_model(self, batch) -> None:
        """The model's forward over ``batch``'s new tokens (the KV writes)."""
        if self.host is not None and self.host.h2d.pending:
            if not self.bugs.on("loadback_no_wait"):
                self.host.h2d.synchronize()  # the forward waits on the load-back event
            elif self.host.h2d.pending_changes():
                self.bugs.took_effect("loadback_no_wait")  # Planted: it reads the pages before the copy landed.
        loc = batch.out_cache_loc
        swa_loc = None
        if self.pool.full_to_swa is not None:
            swa_loc = self.pool.full_to_swa[loc.clamp(min=0)]
            if bool((swa_loc != loc).any()) and self.bugs.hit("swa_no_translation"):
                swa_loc = loc  # Planted: the SWA layer indexes its cache with full-pool slot ids.
        self.model.forward(loc, batch.input_ids, batch.positions, swa_loc, note=self.canary.write_check.note_layer)

    def end_step(self) -> None:
        """After the canary's after-forward work: the sliding window's sweep, the host copies' landing, then
        the poison of the slots freed meanwhile."""
        if self.pool.window and self.canary.step % self.cfg.sweep_interval == 0:
            self.sweep_swa()
        if self.host is not None:
            # End of step: copies still in flight on the side streams land now.
            self.host.d2h.synchronize()
            self.host.h2d.synchronize()
        if self.pool.freed:
            # after the copies landed (an offload's D2H copy reads slots freed before it ran)
            self.canary.poison_slots(self.pool.take_freed())

    def _nan_write(self, works: list[Work]) -> None:
        decode = [w for w in works if w.kind != "prefill"]
        if decode and not self.nan_written and self.bugs.hit("nan_write"):
            # Planted: one layer's K of a decode token comes out NaN.
            self.nan_written = True
            self.model.k[-1].view(-1, WORDS)[decode[0].slots[0]] = 0x7FF8000000000000

    # -- the forward's description -------------------------------------------------------------
    def build_batch(self, works: list[Work]) -> ForwardBatch:
        rows, prefix, extend, ids, pos, loc, rids = [], [], [], [], [], [], []
        hist, offsets, exp_ids, exp_pos = [], [0], [], []
        for w in works:
            r = w.req
            rows.append(w.row)
            prefix.append(self._planted_prefix(w))
            extend.append(w.n)
            ids += w.input_ids
            pos += w.positions
            loc += w.slots
            rids.append(r.rid)
            hist += r.tokens
            offsets.append(len(hist))
            expected = list(range(w.start, w.start + w.n))
            exp_pos += expected
            exp_ids += [r.truth(w.start)] + w.drafts if w.kind == "verify" else [r.truth(p) for p in expected]
        decode_only = all(w.kind != "prefill" for w in works)
        if decode_only:
            loc = self._graph_pad(loc, len(works))
            pad = len(loc) - len(ids)
            bs = pad // self.per_decode
            rows += [0] * bs
            prefix += [0] * bs
            extend += [self.per_decode] * bs
            rids += [-1] * bs
            offsets += [len(hist)] * bs
            ids += [0] * pad
            pos += [0] * pad
            exp_ids += [0] * pad
            exp_pos += [0] * pad
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        mode = ForwardMode.EXTEND
        if decode_only:
            mode = ForwardMode.TARGET_VERIFY if self.spec is not None else ForwardMode.DECODE
        return ForwardBatch(t(rows), t(prefix), t(extend), t(ids), t(pos), t(loc), self.pool.table,
                            request_ids=t(rids), token_history=TokenHistory(t(hist), t(offsets)),
                            expected_input_ids=t(exp_ids), expected_positions=t(exp_pos), mode=mode)

    def _planted_prefix(self, w: Work) -> int:
        """``w.start``, unless a planted bug reports another prefix length or clears a cell the work reads."""
        ps, end = self.pool.ps, w.start + w.n
        if w.kind != "prefill" and w.start >= 4 and not self.pool.table[w.row, w.start // 2] == 0 and \
                self.bugs.on("read_slot0") and self.bugs.first_step is None:
            self.bugs.took_effect("read_slot0")  # Planted: a cleanup zeroes a live prefix cell.
            self.pool.table[w.row, w.start // 2] = 0
        if w.kind == "decode" and end % ps and -(-end // ps) * ps <= self.cfg.max_context and \
                self.bugs.hit("read_partial_tail"):
            return -(-end // ps) * ps - w.n  # Planted: the key length ends at the last page's end.
        return w.start

    def _graph_pad(self, loc: list[int], bs: int) -> list[int]:
        """Pad a decode/verify batch to the next graph size through the static out_cache_loc buffer."""
        size = min(g for g in self.cfg.graph_sizes if g >= bs) if bs <= max(self.cfg.graph_sizes) else bs
        total = size * self.per_decode
        if total > self.graph_loc.shape[0]:
            return loc
        n = len(loc)
        self.graph_loc[:n] = torch.tensor(loc, dtype=torch.int64)
        stale = self.graph_loc[n:total]
        if not (bool((stale != 0).any()) and self.bugs.on("padding_write")):
            stale.zero_()  # padding tokens write slot 0; the planted bug keeps the last replay's slot ids
        elif self._holds_live_kv(set(stale.tolist()) - set(loc)):
            self.bugs.took_effect("padding_write")
        return self.graph_loc[:total].tolist()

    def _holds_live_kv(self, slots: set[int]) -> bool:
        """Whether any of ``slots`` holds KV someone will read (cached, or a running request's)."""
        live = set(self.tree.device_triples()[0])
        for r in self.sched.running:
            live.update(r.slots)
        return bool(slots & live)

    def sweep_triples(self):
        """The canary's sweep provider: (slot, position, prev_slot) of every device-resident cached token."""
        slots, positions, prevs = self.tree.device_triples()
        if not slots:
            return None
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        return t(slots), t(positions), t(prevs)

    def allocator_snapshot(self) -> AllocatorSnapshot:
        """The canary's allocator provider: the free pages (a double free shows twice), each live request's
        pages through its req_to_token row (one entry per position), the prefix cache's pages."""
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        live = [r for r in self.sched.requests.values() if r.row and not r.freed]
        rows, ps = t([r.row for r in live]), self.cfg.page_size
        tables = [BlockTable(self.pool.table[rows] // ps, t([r.kv_len for r in live]), t([r.rid for r in live]))]
        cached = self.tree.device_triples()[0]
        if cached:
            tables.append(BlockTable(t([cached]) // ps, t([len(cached)]), t([CACHE_HOLDER])))
        return AllocatorSnapshot(t(self.pool.pages.free_list()), tuple(tables))

    def sweep_swa(self) -> None:
        """Sweep the SWA slots the prefix cache still holds (translated; an evicted predecessor skips the chain)."""
        slots, positions, prevs = self.tree.device_triples()
        if not slots:
            return
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        table = self.pool.full_to_swa
        swa = table[t(slots)]
        prev = t(prevs)
        swa_prev = torch.where(prev > 0, table[prev.clamp(min=0)], prev)
        live = swa > 0
        if bool(live.any()):
            self.canary.sweep(swa[live], t(positions)[live], swa_prev[live], group="swa")

    # -- results -------------------------------------------------------------------------------
    def result(self, wall_s: float = 0.0) -> SimResult:
        vs = self.canary.violations
        stats = self.canary.stats()
        reasons = sorted({label for v in vs for label in v.reasons})
        tags = sorted({v.launch_tag for v in vs})
        first = min(vs, key=lambda v: v.step) if vs else None
        first_step = first.step if first else None
        first_report = f"{first.launch_tag} {first.reason_label}" if first else None
        refused = None
        if self.refusal is not None:
            step, err = self.refusal
            refused = str(err)
            reasons.append("shared_req_row")
            if first_step is None or step < first_step:
                first_step, first_report = step, "HEAD shared_req_row"
        return SimResult(
            config=self.cfg.name, features=self.cfg.features(), seed=self.cfg.seed, bug=self.cfg.bug,
            steps=self.canary.step, planted_step=self.bugs.first_step, bug_hits=self.bugs.hits,
            violations=self.canary.monitor.total_violations,
            first_detected_step=first_step, first_report=first_report, reasons=reasons, launch_tags=tags,
            finished=self.sched.finished, aborted=self.sched.aborted, retractions=self.sched.retractions,
            cache_hit_tokens=self.cache.hit_tokens, offloads=self.host.offloads if self.host else 0,
            loadbacks=self.host.loadbacks if self.host else 0, tokens_protected=stats["tokens_protected"],
            wall_s=round(wall_s, 3), health_problems=list(self.canary.monitor.health_problems), refused=refused,
            failed=self.sched.failed)


def run_sim(cfg: SimConfig, canary_config: CanaryConfig | None = None, stop_after: int | None = None) -> SimResult:
    """Run ``cfg`` once and return its ``SimResult`` (``stop_after``: see ``SimEngine.run``)."""
    return SimEngine(cfg, canary_config).run(stop_after)
