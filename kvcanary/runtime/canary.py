"""The ``Canary``: guards an engine forward by forward (SPEC section 5).

Per forward: ``before_forward`` (expected-token refill, plan, HEAD verify of the prefix, HEAD write of the new
tokens), the engine's forward, then ``after_forward`` (TAIL verify with real-KV hash, TAIL write, periodic sweep,
then the host side: drain, health, stats). ``device_before`` / ``device_after`` touch static buffers only and
never sync: an engine that runs CUDA graphs captures them and calls ``host_before`` / ``host_after`` around
each replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvcanary import ops
from kvcanary.ops import validate as v
from kvcanary.format import RealKvMode, launch_tag
from kvcanary.runtime.abandon import abandon
from kvcanary.runtime.abort import AbortHandler, check_abort_handler
from kvcanary.runtime.allocator import AllocatorCheck, AllocatorProvider
from kvcanary.runtime.batch import ForwardBatch, PoolSpec, check_distinct_rows
from kvcanary.runtime.checks import canary_device, check_batch, check_batch_sizes, check_batch_values, check_canary_args
from kvcanary.runtime.config import CanaryConfig
from kvcanary.runtime.inject import Injector
from kvcanary.runtime.launch import ForwardLauncher
from kvcanary.runtime.monitor import Monitor
from kvcanary.runtime.moves import RecordMoves
from kvcanary.runtime.report import Violation, memory_bytes
from kvcanary.runtime.slots import SlotChecks
from kvcanary.runtime.write_check import AttentionCheck, WriteCheck

SweepProvider = Callable[[], "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None"]  # (slots, positions, prevs)


class _Group:
    """One address space (FULL or SWA) with its canary buffers and static plan."""

    def __init__(self, name, num_slots, window, table, k_sources, v_sources, cfg, real_kv_mode, plan_capacity,
                 sweep_capacity, max_batch, device):
        self.name, self.num_slots, self.window, self.table = name, num_slots, window, table
        self.sources = {kv: v.check_sources("Canary", srcs, real_kv_mode, device)
                        for kv, srcs in (("k", k_sources), ("v", v_sources))}
        self.kvs = ("k", "v") if cfg.check_v else ("k",)
        self.bufs = {(phase, kv): ops.allocate_canary_buffer(num_slots, cfg.record_stride, device)
                     for phase in ("head", "tail") for kv in self.kvs}
        self.plan = ops.Plan.allocate(plan_capacity, max_batch, device)
        self.sweep_entries = ops.Entries.allocate(sweep_capacity or num_slots, device)
        self._tags = {(p, kv): int(launch_tag(p, kv, name)) for p in ("head", "tail", "sweep") for kv in ("k", "v")}

    def tag(self, phase: str, kv: str) -> int:  # (the launch tag of a phase's op on one of K / V)
        return self._tags[phase, kv]


class Canary(RecordMoves):
    """KV-cache sanitizer state for one engine: canary buffers, ring, counters, static plans.

    Args:
        pool: the engine's KV pool (slot count, real-KV sources, optional SWA group).
        config: knobs (default ``CanaryConfig.from_env()``).
        max_batch: most requests in one forward.
        max_tokens: most tokens one forward writes.
        max_context: columns of the engine's req_to_token table.
        num_rows: rows of the engine's req_to_token table (for the expected-token table).
        device: where the engine's KV lives.
        on_violation: optional callback called with each ``Violation``.
        on_abort: the engine's error path for one request, ``on_abort(request_id, violations)``: required in
            mode "abort" (``ValueError`` without it), else never called (docs/runtime.md, "Mode abort").

    Example:
        >>> canary = Canary(pool, max_batch=8, max_tokens=256, max_context=512, num_rows=9)
        >>> canary.before_forward(batch); engine_forward(batch); canary.after_forward(batch)
    """

    def __init__(self, pool: PoolSpec, config: CanaryConfig | None = None, *, max_batch: int, max_tokens: int,
                 max_context: int, num_rows: int, device: torch.device | str = "cpu",
                 on_violation: Callable[[Violation], None] | None = None, on_abort: AbortHandler | None = None):
        check_canary_args(pool, config, on_violation, max_batch=max_batch, max_tokens=max_tokens,
                          max_context=max_context, num_rows=num_rows)
        self.config = cfg = config if config is not None else CanaryConfig.from_env()
        check_abort_handler(cfg.mode, on_abort)
        self.device, self.pool = canary_device(device), pool
        self.max_batch, self.max_tokens, self.max_context, self.num_rows = max_batch, max_tokens, max_context, num_rows
        self.enabled = cfg.mode != "none"
        self.real_kv_mode = RealKvMode[cfg.real_kv.upper()]
        plan_capacity = cfg.plan_capacity or max_batch * max_context
        self.groups = [_Group("full", pool.num_slots, 0, None, pool.k_sources, pool.v_sources, cfg,
                              self.real_kv_mode, plan_capacity, cfg.sweep_capacity, max_batch, self.device)]
        if pool.swa is not None:
            s = pool.swa
            self.groups.append(_Group("swa", s.num_slots, s.window, s.full_to_swa, s.k_sources, s.v_sources, cfg,
                                      self.real_kv_mode, min(plan_capacity, max_batch * s.window), cfg.sweep_capacity, max_batch,
                                      self.device))
        self.ring = ops.ViolationRing.allocate(cfg.ring_capacity, self.device)
        self.counters = ops.allocate_counters(self.device)
        self.token_table = torch.zeros(num_rows, max_context, dtype=torch.int32, device=self.device)
        self._valid_lens = torch.zeros(max_batch, dtype=torch.int64, device=self.device)
        self.step_tensor = torch.zeros(1, dtype=torch.int64, device=self.device)
        # idempotent rewrites accepted at TAIL (ops.accept_rewrites); stats read it one step late
        self.rewrites = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.chain_check = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.sweep_provider: SweepProvider | None = None
        self.step = 0
        self._open: ForwardBatch | None = None  # the forward between before_forward and after_forward
        self._sweeps_unsnapshotted = False  # sweep rows in the ring that no step close has taken yet
        self._check_values = cfg.value_check == "always" or (cfg.value_check == "auto" and self.device.type == "cpu")
        self.allocator = AllocatorCheck(self)  # idle until watch_allocator
        self.monitor = Monitor(self, on_violation, on_abort)
        self.launcher = ForwardLauncher(self)
        self.monitor.observer.graphs = self.launcher.graphs
        self.slots = SlotChecks(self)  # reserved-slot, non-finite KV and poison checks (runtime/slots.py)
        # written bytes vs computed KV, attention metadata vs the read index (docs/write_check.md)
        self.write_check, self.attention_check = WriteCheck(self), AttentionCheck(self)
        # Fault injection (a self-test, docs/fault_injection.md): None unless an inject_*_prob is above 0.
        self.injector = Injector(self) if cfg.injecting else None
        # True when the engine calls records_ready() before reading canary records after before_forward:
        # HEAD then runs beside the forward; False: the forward waits for HEAD (TAIL still overlaps).
        self.head_overlap = False
        self.host_times: dict[str, float] | None = None  # benchmarks: host s of the runtime part and launches
        # tokens of the open forward's padding requests (row 0, at the batch's end: nothing written or read),
        # set by an adapter that pads batches to a size bucket: left out of the tokens the stats count
        self.padding_tokens = 0

    # -- lifecycle -------------------------------------------------------------------------------
    def mark_ready(self) -> None:
        """End of warm-up / graph capture: arm the chain-position assert (if configured)."""
        self.chain_check.fill_(int(self.config.chain_position_check))

    def before_forward(self, batch: ForwardBatch, check_now: bool = True) -> None:
        """Host part, then device part, before the engine's forward writes KV. ``check_now=False``: an
        adapter that adds checks of its own calls ``check_reads_now`` after them (``check_before_forward``).

        Each forward is ``before_forward(batch)``, the engine's forward, ``after_forward(batch)``;
        calling either out of turn raises ``RuntimeError`` (nothing changes). A batch the canary
        cannot check exactly raises ``ValueError``/``TypeError`` before anything is written.
        """
        if not self.enabled:
            return
        t0 = time.perf_counter()
        self.host_before(batch)
        t1 = time.perf_counter()
        try:
            self.device_before(batch)
        except BaseException:
            # Its metadata checks run before its first write: a batch they reject leaves no forward open.
            self._open = None
            raise
        if self.host_times is not None:
            self._add_times(t1 - t0, time.perf_counter() - t1)
        if self.config.check_before_forward and check_now:
            self.check_reads_now()

    def check_reads_now(self) -> None:
        """Report what the open forward's HEAD found before the engine runs it (``check_before_forward``; an
        adapter whose own before work adds checks calls it after them): the ring so far is read at once as
        the forward's own observation (a device sync on CUDA), so in mode "raise" a bad read raises before
        the forward reads wrong KV, or fails on it. What TAIL finds stays in the step's close."""
        if not self.enabled or self._open is None:
            return
        self.launcher.join()  # the current stream after HEAD's launches (the snapshot copies the ring there)
        if self.device.type == "cuda":
            # and after every stream's: an adapter may replay its before work on a stream of its own, and
            # the snapshot resets the ring, which must not overtake a verify still appending to it
            torch.cuda.synchronize(self.device)
        try:
            self.monitor.drain_open(self._open, self.step + 1)
        except BaseException:
            # The caller will not run this forward (mode "raise" raised on what it would read): the forward
            # is abandoned, not left open, so the next before_forward starts a new one (docs/runtime.md).
            abandon(self, drain=False)
            raise

    def abandon_forward(self) -> None:
        """The engine's forward failed between ``before_forward`` and ``after_forward``: close the open forward
        without a step, so the canary stays usable (runtime/abandon.py). What HEAD found in its reads is
        drained as the forward's own (mode "raise" raises it, mode "abort" fails its readers); HEAD's records
        of its new tokens are taken back, so KV it never wrote is reported when read. No forward open: a no-op.
        """
        if self.enabled:
            abandon(self)

    def after_forward(self, batch: ForwardBatch) -> None:
        """Device part, then host part, after the engine's forward wrote KV."""
        if not self.enabled:
            return
        self._check_open("after_forward")
        # one hand-over to the side stream for TAIL and the step's close; the engine joins after both
        t0 = time.perf_counter()
        launcher = self.launcher
        with launcher.side():
            # TAIL replays with the snapshot (host_after) as one graph, where both use the same graphs
            launcher.defer_tail = self.monitor.observer.graphs is launcher.graphs
            try:
                self.device_after(batch)
                t1 = time.perf_counter()
                self.host_after(batch)
            finally:
                launcher.defer_tail = False
                launcher.flush_tail()  # (host_after raised before the snapshot took it)
        launcher.join()
        if self.host_times is not None:
            self._add_times(time.perf_counter() - t1, t1 - t0)

    def _add_times(self, runtime_s: float, launch_s: float) -> None:
        h = self.host_times
        h["runtime_s"], h["launch_s"] = h["runtime_s"] + runtime_s, h["launch_s"] + launch_s

    def host_before(self, batch: ForwardBatch, checked: bool = False) -> None:
        """Validate the batch and drain observations that have landed (never waits on CUDA unless
        ``value_check="always"``); opens the forward. ``checked``: the very batch object an earlier call
        validated, replayed with the same shapes (an adapter's captured step): only values are checked."""
        if self._open is not None:
            raise RuntimeError("kv-canary: before_forward must be followed by after_forward before the next "
                               f"forward, got a second before_forward at step {self.step}")
        if not checked:
            if not isinstance(batch, ForwardBatch):
                raise TypeError(f"kv-canary: forward batch must be a ForwardBatch, got {type(batch).__name__}")
            self._check_sizes(batch)
        if self._check_values:
            check_batch(batch, self.device)  # the values are read below: their metadata first
            self.check_replayed(batch)
            self.launcher.checked = batch  # device_before need not check the same batch's metadata again
        self.launcher.join()
        if self.injector is not None:
            self.injector.before_forward(batch)
        self.monitor.poll()
        self._open = batch

    def use_graphs(self, graphs=None, *, host_ops: bool = True) -> None:
        """For a caller that replays the canary's launches from graphs: ``graphs`` (a ``runtime.graphs.CudaGraphs``
        or a stand-in: what config ``launch_graphs`` makes on CUDA) serves the launcher's and the observer's
        captures, for an engine calling the hooks itself; ``host_ops=False`` keeps the CPU launcher's numpy
        shortcuts off (a stand-in graph replays tensor ops only: the step runner's recorded steps, which record
        their after work themselves, ``runtime/step/after.py``, and hand over no graphs)."""
        if graphs is not None:
            self.launcher.graphs = graphs
            self.monitor.observer.graphs = graphs
        self.launcher.host_ops = host_ops

    def watch_allocator(self, provider: AllocatorProvider, *, num_blocks: int, slots_per_block: int) -> AllocatorCheck:
        """Check the allocator invariants of ``provider()`` (an ``AllocatorSnapshot`` or None) at the close of
        every ``config.allocator_check_interval``-th step (docs/allocator.md); slot ``s`` is in block ``s //
        slots_per_block``. Returns the check: the engine calls its ``note_free(blocks)`` when it frees blocks."""
        return self.allocator.watch(provider, num_blocks, slots_per_block)

    def records_ready(self) -> None:
        """Order the current stream after the canary's launches so far (the HEAD write included): call it
        before reading canary records on the engine's stream inside a forward; an engine that does may set
        ``head_overlap = True`` so HEAD runs beside its forward. A no-op on CPU and when nothing is pending."""
        self.launcher.join()

    def device_before(self, batch: ForwardBatch) -> None:
        """Plan, HEAD verify and write, reserved slots: static buffers only, no sync (CUDA-graph capturable)."""
        self.launcher.before(batch)
        self.slots.before()

    def device_after(self, batch: ForwardBatch) -> None:
        """TAIL verify (with real-KV hash) and TAIL write, non-finite KV check; advances the device step."""
        self.launcher.after(batch)
        self.slots.after()
        self.write_check.after()  # the written slots' bytes vs the computed KV (runtime/write_check.py)

    def host_after(self, batch: ForwardBatch) -> None:
        """Periodic sweep, then close the step: snapshot for the one-step-late drain, health, stats. The
        step's device work runs on the launcher's side stream; at the end the engine's stream waits for
        it, so no later KV write (next forward, copies into reused slots) races TAIL's reads."""
        self._check_open("host_after")
        try:
            with self.launcher.side():
                self._close(batch, self._due_work)
        finally:
            self.launcher.join()

    def _due_work(self, batch: ForwardBatch) -> None:
        """The eager close's own work, after the step advanced and before its snapshot: fault injection, a
        periodic sweep, the allocator check (a recorded step's close never has any: ``plain_close``)."""
        sweep, check = self._sweep_due(self.step), self.allocator.due(self.step)
        if self.injector is not None or sweep or check:
            self.launcher.flush_tail()  # their work follows TAIL's
        if self.injector is not None:
            self.injector.after_forward(batch)
        if sweep:
            triples = self.sweep_provider()
            if triples is not None:
                self.sweep(*triples)
        if check:
            self.allocator.run(batch)
        if self.injector is not None:
            self.injector.end_step(batch)

    def after_replayed(self, batch: ForwardBatch) -> None:
        """``after_forward`` where the caller keeps side sections on the current stream (an adapter's
        replayed steps, ``ForwardLauncher.run_here``): the same TAIL and step close, with no stream
        hand-overs. A step whose close has work of its own (``plain_close``: fault injection, a sweep or
        allocator check due, side-stream work pending) takes ``after_forward`` (as does a disabled canary:
        nothing to do)."""
        launcher = self.launcher
        if not launcher.on_current or not self.enabled or not self.plain_close():
            self.after_forward(batch)
            return
        self._check_open("after_forward")
        t0 = time.perf_counter()
        launcher.defer_tail = self.monitor.observer.graphs is launcher.graphs  # (one graph with the snapshot)
        try:
            launcher.after(batch)
            self.slots.after()
            self.write_check.after()
        finally:
            launcher.defer_tail = False
        t1 = time.perf_counter()
        self._close(batch)
        if self.host_times is not None:
            self._add_times(time.perf_counter() - t1, t1 - t0)

    def plain_close(self, on_side: bool = False) -> bool:
        """Whether the next step's close has no work of its own, so a recorded step may close it with
        ``close_step``: no fault injection, no side-stream work pending, no sweep or allocator check due.
        ``on_side``: the caller closes the step on the side stream, behind any work pending there, and the
        engine stream joins it afterwards (the step runner's captured steps: ``runtime/step/after.py``), so
        pending side work needs no close of its own."""
        step = self.step + 1
        return (self.injector is None and (on_side or self.launcher.pending is None) and not self._sweep_due(step)
                and not self.allocator.due(step))

    @property
    def open_batch(self) -> ForwardBatch | None:
        """The open forward's batch (between its before and after work), None between forwards."""
        return self._open

    def fusable(self) -> bool:
        """Whether the next forward may be one sequence an adapter replays after it (``close_step`` with its
        snapshot slot): no forward open, and a close with no work of its own (``plain_close``)."""
        return self.enabled and self._open is None and self.plain_close()

    def check_replayed(self, batch: ForwardBatch) -> None:
        """``host_before``'s value checks for a batch an earlier call checked (its shapes), where configured."""
        if self._check_values:
            check_batch_values(batch, num_rows=self.num_rows, num_slots=self.pool.num_slots,
                               max_context=self.max_context)
            check_distinct_rows(batch)

    def open_recorded(self, batch: ForwardBatch, state: tuple) -> None:
        """Open the forward of ``batch`` whose before work a recorded plan ran, its checks included (the CPU's
        bound plan, ``runtime/step``): the launcher takes the state the recorded step's own before work left
        (``ForwardLauncher.state``), which its after work reads."""
        if self._open is not None:
            raise RuntimeError("kv-canary: before_forward must be followed by after_forward before the next "
                               f"forward, got a second before_forward at step {self.step}")
        self.launcher.restore(state)
        self._open = batch

    def close_step(self, batch: ForwardBatch, slot=None, done=(), launch_s: float = 0.0) -> None:
        """Close the step of ``batch`` whose device work (HEAD and TAIL) a recorded plan ran: the close every
        route shares (``_close``), where ``plain_close`` held. ``slot``: the step's snapshot was copied into it
        inside the recorded sequence (``HostObserver.take_slot``, whose observations ``done`` are drained here;
        the transformers adapter's fused steps); without it the snapshot is taken here. ``launch_s``: the host
        seconds the caller spent launching the sequence (benchmarks' ``host_times``)."""
        t0 = time.perf_counter()
        self._close(batch, slot=slot, done=done)
        if self.host_times is not None:
            self._add_times(time.perf_counter() - t0, launch_s)

    def _sweep_due(self, step: int) -> bool:
        return bool(every := self.config.sweep_interval) and self.sweep_provider is not None and step % every == 0

    def _close(self, batch: ForwardBatch, work=None, slot=None, done=()) -> None:
        """The one place a step ends, whichever route took it (eager ``host_after``, ``after_replayed``,
        ``close_step``): the forward closes, the step advances, the monitor notes the forward; then
        ``work(batch)`` (the eager close's sweep, allocator check, injection: ``_due_work``); then the step's
        observation for the one-step-late drain, health and stats (``Monitor.close_step``): snapshot here
        (with a deferred TAIL, as one sequence), or ``slot``, where the caller's sequence copied it."""
        self._open = None
        self.step += 1
        self.monitor.note_forward(batch)
        if work is not None:
            work(batch)
        self._sweeps_unsnapshotted = False
        if slot is None:
            self.launcher.streams.note("snapshot", reads=("ring", "counters", "plan"), writes=("ring",))
            self.monitor.close_step(before=self.launcher.take_tail())
        else:
            self.monitor.close_step(slot=slot, done=done)

    def perturb_next_tokens(self, request_ids, tokens, positions=None):
        """Pass the engine's sampled next tokens through fault injection (token oracle engines).
        ``request_ids``, ``tokens``: [bs]; ``positions``: optional [bs] positions they will be fed at (lists
        or 1-D tensors). Returns ``tokens`` itself unless ``inject_swap_prob`` fires: then a copy with two
        requests' tokens swapped (the write-input assert must report write_token for both)."""
        if self.injector is None:
            return tokens
        return self.injector.perturb_next_tokens(request_ids, tokens, positions)

    def poison_slots(self, slots) -> int:
        """``slots`` (list or 1-D int tensor) are freed, unread and not handed out again: with ``poison_on_free``
        their KV becomes a NaN pattern (docs/slots.md). Returns how many were poisoned."""
        return self.slots.poison(slots)

    # -- reporting -------------------------------------------------------------------------------
    @property
    def violations(self) -> list[Violation]:
        """Every violation reported so far (drained observations only; see ``flush``)."""
        return self.monitor.violations

    def flush(self) -> list[Violation]:
        """Wait for and drain every pending observation; returns all violations so far."""
        if self.enabled:
            if self._sweeps_unsnapshotted and self._open is None:
                self._sweeps_unsnapshotted = False
                with self.launcher.side():  # after the sweep's launches, on the same stream
                    self.monitor.close_step(health=False)
                self.launcher.join()
            self.monitor.flush()
        return self.monitor.violations

    def stats(self) -> dict:
        return self.monitor.stats()

    def memory(self) -> dict:
        """Bytes the canary holds on its device, by part (docs/runtime.md gives the formulas)."""
        return memory_bytes(self)

    def check_health(self) -> list[str]:
        """Problems found (an expected launch that stopped running); raises in mode "raise"."""
        return self.monitor.check_health(force=True)

    # -- internals -------------------------------------------------------------------------------
    def _mode(self, g: _Group, kv: str) -> int:
        return int(self.real_kv_mode) if g.sources[kv] else int(RealKvMode.NONE)

    def _group(self, name: str) -> _Group:
        for g in self.groups:
            if g.name == name:
                return g
        raise ValueError(f"kv-canary: group must be one of {[g.name for g in self.groups]}, got {name!r}")

    def _check_open(self, call: str) -> None:
        if self._open is None:
            raise RuntimeError(f"kv-canary: {call} must follow before_forward (one before, one after per forward), "
                               f"got {call} with no forward open at step {self.step}")

    def _check_sizes(self, batch: ForwardBatch) -> None:
        check_batch_sizes(batch, max_batch=self.max_batch, max_tokens=self.max_tokens, max_context=self.max_context)
