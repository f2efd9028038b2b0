"""One canary per transformers ``ContinuousBatchProcessor`` (one paged cache), and the hooks that feed it.

Hooks, all instance attributes of the processor's objects (restored by ``close``):
  bp._generation_step(model)        before: build the ForwardBatch, Canary.before_forward; after: after_forward
  model_runner.compute_batch(...)   late hooks (default): both of the above once the forward is enqueued
  bp.update_batch()                 block positions for sweeps, dedup-remap count, history clean-up
  cache.search_prefix_match(...)    prefix hits (counted; the HEAD verify checks what they map)
  fork copies, offloads and restores   copy_records / save_records / restore_records (the layout's hooks:
                                    EngineLayout.install_hooks, one set per paged-cache generation)
  model_runner._sample              token oracle (optional)
"""

from __future__ import annotations

import collections
import logging
import time
from contextlib import nullcontext

import torch

from kvcanary.format import oracle_token
from kvcanary.integrations.transformers.allocator import watch_allocator
from kvcanary.integrations.transformers.batch import BatchBuilder
from kvcanary.integrations.transformers.graphs import StepGraphs
from kvcanary.integrations.transformers.moves import KvMoves
from kvcanary.integrations.transformers.layout import Patcher
from kvcanary.integrations.transformers.layouts import layout_of
from kvcanary.runtime import Canary, PoolSpec, SwaSpec
from kvcanary.runtime.graphs import CudaGraphs
from kvcanary.runtime.streams import event_wait, record_event, stream_cache

log = logging.getLogger("kvcanary")
_NO_CONTEXT = nullcontext()  # (reentrant: one serves every hook)


class Session(KvMoves):
    """The canary guarding one batch processor; created when transformers creates the processor."""

    def __init__(self, handle, bp):
        self.handle, self.bp = handle, bp
        self.lock = handle.lock
        cache = bp.cache
        self.layout = lay = layout_of(cache)
        lay.check_fresh()
        self.device = lay.k_full.device
        self.reserved_block0 = lay.reserve_padding()
        self.ids: dict[str, int] = {}
        self.events: collections.Counter = collections.Counter()
        self.block_pos: dict[int, int] = {}
        self.recorded: dict[str, int] = {}  # per request: table entries whose block_pos is recorded
        self.saved: dict[str, list] = {}
        self.timings: list[dict] = []  # per step with timing=True: batch, tokens, host seconds of each part
        self.timing = bool(handle.options.get("timing"))
        self.late_hooks = bool(handle.options.get("late_hooks", True))
        self._late = False  # this step's canary work waits for compute_batch (_late_step)
        self.ready = self._ready_event = None  # CUDA, late: the compute stream before the forward (_late_step)
        self.closed = False
        self._compute = None  # (the engine's compute stream, its raw handle, its stream cache): _engine_stream
        self.engine_calls = 0  # _engine_stream calls so far
        self.final_stats: dict | None = None
        self.final_violations: list = []
        self.canary = self._build_canary()
        self.builder = BatchBuilder(self)
        self.graphs = self._step_graphs()
        self.fused = None if self.graphs is None else self.graphs.fused
        # the engine's step ends in a synchronize of its compute stream (transformers' synchronous inputs and
        # outputs): whatever that stream waited for before the step's forward is complete afterwards (step)
        io = bp.inputs_and_outputs
        self.step_syncs = io.compute_stream is not None and type(io).__name__ == "ContinuousBatchingIOs"
        self.patcher = Patcher()
        self._install()

    # -- set-up ----------------------------------------------------------------------------------
    def _build_canary(self) -> Canary:
        bp, lay, opts = self.bp, self.layout, self.handle.options
        cache = bp.cache
        num_pages = lay.num_blocks * lay.block_size
        max_batch = max(1, int(bp.cb_config.max_requests_per_batch))
        max_tokens = max(1, int(cache.max_batch_tokens))
        # A request may generate past max_position_embeddings, never past the pool: the table is as wide
        # as the pool by default (token table: 4 bytes per cell, (2 * max_batch + 1) x max_context cells).
        max_context = int(opts.get("max_context") or max(1, num_pages))
        config = self.handle.config
        if not config.plan_capacity:
            config = config.replace(plan_capacity=min(max_batch * max_context, 2 * num_pages + max_tokens))
        self.config = config
        # One slot space serves both groups (their blocks are disjoint); each hashes its own layers' KV.
        k_sources, v_sources = lay.real_kv_sources(config.check_v)
        swa = None
        if lay.swa_group is not None:
            self.swa_table = torch.zeros(lay.num_slots, dtype=torch.int64, device=self.device)
            swa = SwaSpec(lay.num_slots, lay.window, self.swa_table, *lay.real_kv_sources(config.check_v, swa=True))
        pool = PoolSpec(lay.num_slots, k_sources, v_sources, swa=swa)
        canary = Canary(pool, config, max_batch=max_batch, max_tokens=max_tokens, max_context=max_context,
                        num_rows=2 * max_batch + 1, device=self.device)
        canary.sweep_provider = self._sweep_triples
        # The adapter's only read of canary records inside a forward (verify_new_reads) runs on the
        # canary's side stream after HEAD, so HEAD may run beside the model's forward.
        canary.head_overlap = True
        # No graph capture or warm-up forward writes KV outside the hooked step: arm the chain assert now.
        canary.mark_ready()
        self.vocab = int(getattr(cache.config, "vocab_size", 0) or 0)
        return canary

    def _step_graphs(self, graph_type=None) -> StepGraphs | None:
        """On CUDA (attach option ``step_graphs``, default on): the before hook's device work replayed
        from a CUDA graph per batch shape, and the after hook's TAIL and snapshot likewise. Tests pass
        ``graph_type`` (a CPU stand-in) to take the same path on the CPU."""
        if not self.handle.options.get("step_graphs", True):
            return None
        if graph_type is not None:
            return StepGraphs(self, graph_type)
        if self.device.type != "cuda":
            return None
        if not self.canary.launcher.streams.overlap:
            return None  # the whole-step graph runs on the side stream: overlap off keeps every launch eager
        graphs = CudaGraphs(self.device, max_graphs=32)
        self.canary.use_graphs(graphs)
        return StepGraphs(self)

    def _install(self) -> None:
        bp, p = self.bp, self.patcher
        cache, runner = bp.cache, bp.model_runner
        orig_step, orig_update, orig_compute = bp._generation_step, bp.update_batch, runner.compute_batch
        orig_search = cache.search_prefix_match

        def step(model):
            self._join()
            # the last fused step's position the compute stream now waits for (FusedSteps.join)
            joined = self.fused.joined if self.fused is not None and self.step_syncs else None
            # Late hooks (docs/transformers.md): the step's canary work runs once compute_batch (below) has
            # enqueued the forward, while the device runs it, instead of holding back its launch.
            late = self._late = self._guarded(self._late_step)
            if not late:
                self._guarded(self._before)
            t0 = time.perf_counter()
            orig_step(model)
            if not late:
                self._fwd_s = time.perf_counter() - t0
                self._guarded(self._after)
            elif self._late:  # (the engine never called compute_batch: the work runs now, after the forward)
                self._fwd_s = time.perf_counter() - t0
                compute_batch_done()
            if joined is not None:
                # the step synchronized the compute stream after its wait: reading that slot asks CUDA nothing
                joined.complete()

        def compute_batch_done():
            self._guarded(self._before)  # (with _late still set: _before_forward knows the step is usable)
            self._late = False
            self._guarded(self._after)

        def compute_batch(model, batch_data):
            t0 = time.perf_counter()
            self._ranged("engine_forward", orig_compute, model, batch_data)
            if self._late:
                self._fwd_s = time.perf_counter() - t0  # (the step's timing row is made inside: _after)
                compute_batch_done()

        def update_batch():
            t0 = time.perf_counter()
            snap = self._guarded(self._before_update)
            t1 = time.perf_counter()
            orig_update()
            t2 = time.perf_counter()
            self._guarded(self._after_update, snap)
            self._join()  # (the next batch's inputs are prepared next: after the last fused step's reads)
            if self.timings:
                self.timings[-1]["update_s"] = t1 - t0 + time.perf_counter() - t2

        def search_prefix_match(request_id, prompt_ids):
            n = orig_search(request_id, prompt_ids)
            if n:
                self.events["prefix_hits"] += 1
            return n

        p.set(bp, "_generation_step", step)
        p.set(runner, "compute_batch", compute_batch)
        p.set(bp, "update_batch", update_batch)
        p.set(cache, "search_prefix_match", search_prefix_match)
        self.layout.install_hooks(p, self)
        watch_allocator(self, p)  # the allocator check's snapshots and frees (docs/allocator.md)
        if self.handle.options.get("token_oracle"):
            orig_sample = runner._sample

            def sample(scores, output_ids):
                orig_sample(scores, output_ids)
                forced = self.builder.next_tokens
                if forced is not None and forced.numel():
                    output_ids[0, :forced.numel()].copy_(forced.to(output_ids.device, output_ids.dtype))

            p.set(runner, "_sample", sample)

    # -- per step --------------------------------------------------------------------------------
    def _late_step(self) -> bool:
        """Whether this step's canary work may wait until its forward is enqueued: HEAD reads canary records
        and the engine's inputs only (never KV), so it precedes nothing in the forward. Not with the token
        oracle (the sampler reads what the before work computes), fault injection or ``late_hooks=False``;
        on CUDA only with step graphs on a usable step (their HEAD runs off the forward's stream, after the
        compute stream's position before the forward: ``ready``)."""
        c = self.canary
        self.ready = None
        if (not self.late_hooks or not c.enabled or self.builder.oracle or c.injector is not None
                or c.config.check_before_forward):  # (that check must precede the forward)
            return False
        io = self.bp.inputs_and_outputs
        if self.graphs is None:
            return io.compute_stream is None  # (the CPU: nothing runs beside anything)
        if not self.graphs.usable(io):
            return False
        stream = io.compute_stream
        # (a step after a fused one is likely fused too, and needs no such event: one CUDA call fewer; if it
        # is not, its HEAD follows the compute stream, forward included, instead of running beside it)
        if stream is not None and c.device.type == "cuda" and not self.graphs.last_fused:
            if self._ready_event is None:
                self._ready_event = torch.cuda.Event()  # (its own: the launcher's per-stream events move on)
            record_event(self._ready_event, stream)
            self.ready = self._ready_event
        return True

    def _before(self) -> None:
        t0 = time.perf_counter()
        with self.lock:
            self._ranged("kvcanary_before", self._before_forward)
        self._before_s = time.perf_counter() - t0

    def _before_forward(self) -> None:
        io = self.bp.inputs_and_outputs
        if self.graphs is not None and self.canary.enabled and (self._late or self.graphs.usable(io)):
            h = self.builder.host_part(copy=False, padded=True)
            self.canary.padding_tokens = h.pad
            self._batch = self.graphs.before(h, self._engine_stream)
        else:
            self.canary.padding_tokens = 0
            with self._engine_stream():
                self._batch = self.builder.build()
                self.canary.before_forward(self._batch, check_now=False)  # (checked below, new reads included)
                if self.canary.enabled:
                    self.builder.verify_new_reads(self._batch)
        if self.canary.config.check_before_forward:  # (the new tokens' read check included)
            with self._engine_stream():
                self.canary.check_reads_now()

    def _after(self) -> None:
        t0 = time.perf_counter()
        with self.lock:
            self._ranged("kvcanary_after", self._after_forward)
            self.handle.forwards += 1
        after_s = time.perf_counter() - t0
        if self.timing:
            b, pad = self._batch, self.canary.padding_tokens  # (the real batch: padding left out)
            self.timings.append({"batch": b.batch_size - pad, "tokens": b.num_tokens - pad, "before_s": self._before_s,
                                 "forward_s": self._fwd_s, "after_s": after_s, "update_s": 0.0})

    def _after_forward(self) -> None:
        if self.graphs is not None and self.graphs.inline:
            self.graphs.after(self._batch)
        else:
            with self._engine_stream():
                self.canary.after_forward(self._batch)

    # -- helpers ---------------------------------------------------------------------------------
    def request_id(self, name: str) -> int:
        """Stable int id of an engine request id (first seen = 1); soft resets keep theirs."""
        rid = self.ids.get(name)
        if rid is None:
            rid = self.ids[name] = len(self.ids) + 1
        return rid

    def oracle(self, rid: int, position: int) -> int:
        return oracle_token(rid, position, self.vocab)

    def _engine_stream(self):
        """On CUDA the engine runs its forward, fork copies and offload copies on its compute stream: the
        canary's kernels go there too (after the default stream's batch preparation), so they are ordered
        with every KV write and read."""
        self.engine_calls += 1  # (a steady decode step's inline replay waits for the compute stream after any)
        self._join()
        stream = self.bp.inputs_and_outputs.compute_stream
        if stream is None:
            return _NO_CONTEXT
        known = self._compute
        if known is None or known[0] is not stream:  # (stream.device builds a torch.device per call)
            known = self._compute = (stream, stream.cuda_stream, stream_cache(stream.device))
        _, handle, cache = known
        current = cache.current()
        if current.cuda_stream == handle:
            return _NO_CONTEXT
        event = self.canary.launcher.streams.record(current)  # a reused event (wait_stream makes one per call)
        if event is None:
            stream.wait_stream(current)
        else:
            event_wait(event, stream)
        return cache.use(stream)

    def _join(self) -> None:
        """The engine's streams wait for the last fused step's canary work (``FusedSteps.join``), if any."""
        if self.fused is not None and self.fused.pending is not None:
            self.fused.join()

    def _ranged(self, name: str, fn, *args) -> None:
        """``fn(*args)`` inside the profiler range ``name`` while a profiler records (ranges are for
        benchmarks, which turn timing on), else plainly: a context entered for nothing costs the host
        two Python calls."""
        if self.timing and torch.autograd._profiler_enabled():
            with torch.profiler.record_function(name):
                fn(*args)
        else:
            fn(*args)

    def _guarded(self, fn, *args):
        """Run hook work; an exception is recorded on the handle (the caller sees it) and re-raised in the engine."""
        try:
            return fn(*args)
        except BaseException as e:
            self.handle._record_error(e)
            raise

    def close(self) -> None:
        """Final drain, restore this processor's hooks and the reserved block, drop engine references."""
        if self.closed:
            return
        self.closed = True
        try:
            self._join()
            with self.lock:
                self.canary.flush()
        except BaseException as e:
            self.handle._record_error(e)
        self.final_violations = list(self.canary.violations)
        self.final_stats = self.canary.stats()
        self.patcher.restore()
        self.layout.release_padding(self.reserved_block0)
        self.bp = self.canary = self.builder = self.layout = None
        self.saved.clear()

    def stats(self) -> dict:
        stats = dict(self.final_stats if self.closed else self.canary.stats())
        stats.update(self.events)
        stats["requests"] = len(self.ids)
        return stats

    @property
    def violations(self) -> list:
        return self.final_violations if self.closed else self.canary.violations

