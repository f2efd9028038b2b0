"""One canary per transformers ``ContinuousBatchProcessor`` (one paged cache), and the hooks that feed it.

Hooks, all instance attributes of the processor's objects (restored by ``close``):
  bp._generation_step(model)        before: build the ForwardBatch, Canary.before_forward; after: after_forward
  model_runner.compute_batch(...)   late hooks (default): both of the above once the forward is enqueued
  bp.update_batch()                 block positions for sweeps, dedup-remap count, history clean-up
  cache.search_prefix_match(...)    prefix hits (counted; the HEAD verify checks what they map)
  fork copies, offloads, restores   copy/save/restore_records (EngineLayout.install_hooks, per cache generation)
  model_runner._sample              token oracle (optional)
  async IO: get_model_kwargs, reset  a pair's H2D waits for its last step's canary work; a reset is waited for
"""

from __future__ import annotations

import collections
import logging
import time

import torch

from kvcanary.format import oracle_token
from kvcanary.integrations.transformers.batch import BatchBuilder
from kvcanary.integrations.transformers.events import EngineAborts, watch_blocks
from kvcanary.integrations.transformers.moves import KvMoves
from kvcanary.integrations.transformers.layout import patcher
from kvcanary.integrations.transformers.layouts import layout_of
from kvcanary.integrations.transformers.written_kv import check_attention_meta, hook_cache_update
from kvcanary.runtime import Canary, PoolSpec, SwaSpec
from kvcanary.runtime.engine import StepOptions
from kvcanary.runtime.step import StepRunner

log = logging.getLogger("kvcanary")


# the engine's KV movements and failures a session counts (stats(): every key from the session's start on)
EVENTS = ("prefix_hits", "fork_block_copies", "dedup_remaps", "soft_resets", "offloaded_requests", "restored_requests",
          "failed_requests")


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
        self.events: collections.Counter = collections.Counter(dict.fromkeys(EVENTS, 0))
        self.block_pos: dict[int, int] = {}
        self.recorded: dict[str, int] = {}  # per request: table entries whose block_pos is recorded
        self.saved: dict[str, list] = {}
        self.timings: list[dict] = []  # per step with timing=True: batch, tokens, host seconds of each part
        self.timing = bool(handle.options.get("timing"))
        self._late = False  # this step's canary work waits for compute_batch (StepRunner.late_step)
        self.closed = False
        self.final_stats: dict | None = None
        self.final_violations: list = []
        self.aborts = EngineAborts(self)  # mode "abort": the canary's on_abort, applied after each update
        self.canary = self._build_canary()
        self.builder = BatchBuilder(self)
        self.runner = self._step_runner()
        self.done = [None, None] if self.builder.carries else None  # async: per pair (compute_batch_done)
        # the engine's step ends in a synchronize of its compute stream (transformers' synchronous inputs and
        # outputs): whatever that stream waited for before the step's forward is complete afterwards (step)
        io = bp.inputs_and_outputs
        self.step_syncs = io.compute_stream is not None and type(io).__name__ == "ContinuousBatchingIOs"
        self.patcher = patcher()
        self._install()
        # the allocator check's snapshots and frees (docs/allocator.md); poison_on_free: the blocks freed
        self.freed = watch_blocks(self)

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
        # the engine's write trash takes padding tokens' KV: no live token may map there (runtime/slots.py)
        pool = PoolSpec(lay.num_slots, k_sources, v_sources, swa=swa,
                        reserved_slots=(lay.write_trash,) if 0 < lay.write_trash < lay.num_slots else ())
        canary = Canary(pool, config, max_batch=max_batch, max_tokens=max_tokens, max_context=max_context,
                        num_rows=2 * max_batch + 1, device=self.device, on_abort=self.aborts.request)
        canary.sweep_provider = self._sweep_triples
        # The adapter's only read of canary records inside a forward (verify_new_reads) runs on the
        # canary's side stream after HEAD, so HEAD may run beside the model's forward.
        canary.head_overlap = True
        # No graph capture or warm-up forward writes KV outside the hooked step: arm the chain assert now.
        canary.mark_ready()
        self.vocab = int(getattr(cache.config, "vocab_size", 0) or 0)
        return canary

    def _step_runner(self, graph_type=None) -> StepRunner:
        """The step runner over this processor's builder (tests pass ``graph_type``, a CPU stand-in, to take the
        captured and fused paths on the CPU)."""
        return StepRunner(self.canary, self.builder, StepOptions.of(self.handle.options), graph_type)

    def _install(self) -> None:
        bp, p = self.bp, self.patcher
        cache, runner = bp.cache, bp.model_runner
        orig_step, orig_update, orig_compute = bp._generation_step, bp.update_batch, runner.compute_batch
        orig_search = cache.search_prefix_match

        def step(model):
            steps = self.runner
            steps.join()
            if self.freed is not None:
                self._guarded(self.freed.poison)
            # the last fused step's position the compute stream now waits for (FusedSteps.join)
            joined = steps.joined() if self.step_syncs else None
            # Late hooks (docs/transformers.md): the step's canary work runs once compute_batch (below) has
            # enqueued the forward, while the device runs it, instead of holding back its launch.
            late = self._late = self._guarded(steps.late_step)
            if not late:
                self._guarded(self._before)
            t0 = time.perf_counter()
            try:
                orig_step(model)
            except BaseException:  # the engine's failure, not the canary's: abandon the step's forward, re-raise
                self._late = False
                self._guarded(self._abandon)
                raise
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
            self._guarded(self._before)  # (with _late still set: the runner knows the step is usable)
            self._late = False
            self._guarded(self._after)
            if self.done is not None:  # async: the pair's next H2D waits for this step's canary work (below)
                self.done[bp.inputs_and_outputs.current_pair] = self.runner.done_event()

        def compute_batch(model, batch_data):
            t0 = time.perf_counter()
            self._ranged("engine_forward", orig_compute, model, batch_data)
            if self._late:
                self.runner.forward_enqueued()  # (async: HEAD reads the ids the forward carried over)
                self._fwd_s = time.perf_counter() - t0  # (the step's timing row is made inside: _after)
                compute_batch_done()

        def update_batch():
            t0 = time.perf_counter()
            snap = self._guarded(self._before_update)
            t1 = time.perf_counter()
            # the update's fork copies and the next batch's inputs come after the last fused step's reads (async:
            # the step after the one updated, whose forward is enqueued already)
            self.runner.join()
            orig_update()
            t2 = time.perf_counter()
            self._guarded(self._after_update, snap)
            self._guarded(self.aborts.apply)
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
        if self.done is not None:  # async: H2D of a pair waits for the canary work of the step that last read it
            aio = bp.inputs_and_outputs
            orig_kwargs, orig_reset = aio.get_model_kwargs, aio.reset

            def get_model_kwargs(*args, **kwargs):
                if self.done[aio.current_pair] is not None:
                    aio.h2d_stream.wait_event(self.done[aio.current_pair])
                return orig_kwargs(*args, **kwargs)

            def reset():  # (a loop's start: its device resets run on this stream, which canary work may hold back)
                orig_reset()
                self.canary.launcher.streams.synchronize()

            p.set(aio, "get_model_kwargs", get_model_kwargs)
            p.set(aio, "reset", reset)
        self.layout.install_hooks(p, self)
        hook_cache_update(p, self)  # the computed K/V of fingerprinted layers (the write check)
        if self.handle.options.get("token_oracle"):
            orig_sample = runner._sample

            def sample(scores, output_ids):
                orig_sample(scores, output_ids)
                forced = self.builder.next_tokens
                if forced is not None and forced.numel():
                    output_ids[0, :forced.numel()].copy_(forced.to(output_ids.device, output_ids.dtype))

            p.set(runner, "_sample", sample)

    # -- per step --------------------------------------------------------------------------------
    def _before(self) -> None:
        t0 = time.perf_counter()
        with self.lock:
            # (with _late still set: the runner knows the step is usable)
            self._ranged("kvcanary_before", self.runner.before, self._late)
            check_attention_meta(self)  # key lengths and mask vs the read index (docs/write_check.md)
        self._before_s = time.perf_counter() - t0

    def _abandon(self) -> None:
        with self.lock:
            self.runner.abandon()

    def _after(self) -> None:
        t0 = time.perf_counter()
        with self.lock:
            self._ranged("kvcanary_after", self.runner.after)
            self.handle.forwards += 1
        after_s = time.perf_counter() - t0
        if self.timing:
            b, pad = self.runner.batch, self.canary.padding_tokens  # (the real batch: padding left out)
            self.timings.append({"batch": b.batch_size - pad, "tokens": b.num_tokens - pad, "before_s": self._before_s,
                                 "forward_s": self._fwd_s, "after_s": after_s, "update_s": 0.0})

    # -- helpers ---------------------------------------------------------------------------------
    def request_id(self, name: str) -> int:
        """Stable int id of an engine request id (first seen = 1); soft resets keep theirs."""
        return self.ids.setdefault(name, len(self.ids) + 1)

    def oracle(self, rid: int, position: int) -> int:
        return oracle_token(rid, position, self.vocab)

    def _engine_stream(self):
        """The canary's work between steps (record copies, saves) on the engine's compute stream."""
        return self.runner.engine_stream()

    def _ranged(self, name: str, fn, *args) -> None:
        """``fn(*args)`` inside the profiler range ``name`` while a profiler records (benchmarks turn timing on),
        else plainly: a context entered for nothing costs the host two Python calls."""
        if self.timing and torch.autograd._profiler_enabled():
            with torch.profiler.record_function(name):
                fn(*args)
        else:
            fn(*args)

    def _guarded(self, fn, *args):
        """Run hook work; an exception is recorded on the handle (the caller sees it) and re-raised in the engine."""
        return self.handle._guarded(fn, *args)

    def close(self) -> None:
        """Final drain, restore this processor's hooks and the reserved block, drop engine references."""
        if self.closed:
            return
        self.closed = True
        try:
            self.runner.join()
            with self.lock:
                self.canary.flush()
        except BaseException as e:
            self.handle._record_error(e)
        self.final_violations = list(self.canary.violations)
        self.final_stats = self.canary.stats()
        self.patcher.restore()
        self.layout.release_padding(self.reserved_block0)
        self.bp = self.canary = self.builder = self.layout = self.runner = None
        self.saved.clear()

    def stats(self) -> dict:
        stats = dict(self.final_stats if self.closed else self.canary.stats())
        stats.update(self.events)
        stats["requests"] = len(self.ids)
        return stats

    @property
    def violations(self) -> list:
        return self.final_violations if self.closed else self.canary.violations

