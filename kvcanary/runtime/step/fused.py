"""Fused steady decode steps: a step's whole canary work captured as one graph, replayed once after the forward.

With late hooks (``runner.py``) a step's before and after work run back to back, once transformers
has enqueued the forward. For a steady decode step (``graphs.py``: the same requests as the step
before, one new token each, a shape seen often) the two replays of the unfused path (HEAD beside the
forward, then TAIL and the step's snapshot after it), their stream hand-overs and the runtime's
per-step bookkeeping around each become one replay behind the forward, on the canary's side stream: the
staged values' copy, the read table, HEAD verify and write, the reserved-slot checks, the new tokens' read
check, the attention-metadata check (against the engine's static mask and key-length buffers), TAIL verify and
write, the non-finite KV check, and the snapshot copy into its slot. HEAD then runs
after the forward instead of beside it (a few small kernels at decode); TAIL reads what the forward wrote, as
before. The engine's streams wait for it
only where they next touch KV or the inputs (``join``: the next step, fork copies, offloads, restores,
the end of ``update_batch``), so the replay overlaps the engine's host work between steps instead of
lengthening the wait for the sampled tokens.

A graph reads one staging turn and copies into one snapshot slot, so its key is (shape, turn, slot).
The turns are a multiple of the slots (``staging.STAGING_TURNS``): steady steps cycle through that
many pairs, one capture each per shape. A run of steps of one shape (``Run``) remembers each pair's graph
by the turn buffer's address and the slot's index, so a repeat (``repeat``) builds no keys. A step's
observation is drained when its slot comes round again (``NUM_SLOTS`` steps later at most; the unfused
path also polls before each forward).

On CUDA each graph's first nodes wait for two events of its own (``_capture_waiting``: external events),
which the host records on the inputs' stream and on the compute stream right before the replay: the
ordering of two host-side waits on the side stream, with two CUDA calls fewer per step (attach option
``in_graph_waits``).

Not fused (the unfused path runs the step): hooks that are not late (``late_hooks=False``, the token
oracle, fault injection, CUDA without the engine's compute stream), a sweep due at the step's close,
side-stream work pending, or the attach option ``fused_steps=False``.
"""

from __future__ import annotations

import logging
import time

import torch

from kvcanary.runtime.graphs import capture, eager, replay_of
from kvcanary.runtime.observer import SlotFence
from kvcanary.runtime.step.plans import Plans
from kvcanary.runtime.streams import event_wait, record_event, stream_cache

log = logging.getLogger("kvcanary")

MAX_FUSED = 48  # fused graphs kept: a few shapes, each in every (turn, slot) pair


class _Fused:
    __slots__ = ("entry", "graph", "replay", "state", "waits")

    def __init__(self, entry, graph, state, waits=None):
        # the StepGraphs entry: its batch's tensors and the buffers its capture read (the graph keeps none)
        self.entry, self.graph, self.replay, self.state = entry, graph, replay_of(graph), state
        # CUDA: (inputs, forward), events of this graph alone that its first nodes wait for (in_graph_waits)
        self.waits = waits


class FusedSteps:
    """The fused graphs of one runner's ``StepGraphs`` and their replay (``step``)."""

    def __init__(self, graphs):
        self.g, self.s = graphs, graphs.s
        self.plans = Plans(MAX_FUSED)  # the fused graphs by step key and snapshot slot
        # their own memory pool: fused replays run one after another on one stream, which the unfused
        # step graphs (sharing theirs) do not
        self.pool = graphs.new_pool()
        self.captures = self.replays = 0
        self.pending = None  # CUDA: the side stream's event after the last fused step, not yet joined (join)
        self.fence = None  # the last step's snapshot slot position after its replay (_replay), if recorded
        self.joined = None  # that position of the last join (StepRunner.joined: complete once the engine synced after it)
        cuda = self.s.device.type == "cuda"
        self.cache = stream_cache(self.s.device) if cuda else None
        # after the inputs, after the forward (each recorded once per step), after the fused step (recorded
        # only where the step's snapshot slot has no event to stand for it: _replay)
        self.events = tuple(torch.cuda.Event() for _ in range(3)) if cuda else ()
        # the graphs' first nodes wait for the inputs and the forward (_capture_waiting); off: eager waits
        self.in_graph_waits = cuda and self.s.options.in_graph_waits
        self.run: Run | None = None  # the steady run of one shape: its pairs' entries and graphs (repeat)
        # the run of the other input storage set, where the engine alternates two (async batching: select)
        self.other: Run | None = None
        self.repeats = 0  # steps ``repeat`` ran (a run's repeats, of either storage set)

    def usable(self) -> bool:
        """This step may run fused (its hooks late): the runtime has nothing to run between HEAD and TAIL."""
        s = self.s  # (the caller checked that the hooks are late this step)
        return s.canary.fusable() and (self.cache is None or s.source.inputs.compute_stream is not None)

    def step(self, e, key: tuple, h, run: "Run | None" = None):
        """Run steady step ``h`` fused (``e``: its StepGraphs entry under ``key``); returns its batch. ``run``:
        the steady run of the step's shape (``StepGraphs._run_for``), which keeps the step's (turn, slot) pair
        for repeats; None: a shape repeats do not take."""
        obs = self.s.canary.monitor.observer
        index = None if obs.eager_read else obs.next  # the slot this step's snapshot copies into
        slot = None if index is None else obs.slots[index]
        fkey = key + (None if slot is None else slot.key[1],)  # (the step's key and its snapshot slot)
        f = self.plans.get(fkey)
        if f is None:
            f = self._capture(e, h, slot)
            if self.plans.add(fkey, f):
                run = self.other = None  # (a dropped graph may be one of the run's: the run starts again)
        if run is not None and self.run is not None and run.ptrs is not self.run.ptrs:
            self.other = self.run  # (the other storage set's run stays for its next step: select)
        self.run = run
        if run is not None:
            run.pairs[self.s.stage.last_ptr, index] = (e, f)
        return self._launch(e, f, slot, obs)

    def select(self, ptrs: tuple) -> None:
        """Make the kept run of the input storage set ``ptrs`` (``plans.Storages``) the current one, where
        the engine alternates two sets (async batching) and the run kept aside is that set's."""
        run, other = self.run, self.other
        if run is not None and run.ptrs is not ptrs and other.ptrs is ptrs:
            self.run, self.other = other, run

    def repeat(self, h):
        """Run steady step ``h`` fused with the entry and graph the run found for its (turn, slot) pair, if
        any (``StepGraphs.before`` checked that its shape is the run's); None: ``step`` it."""
        obs = self.s.canary.monitor.observer
        index = None if obs.eager_read else obs.next
        pair = self.run.pairs.get((self.s.stage.last_ptr, index))
        if pair is None:
            return None
        self.repeats += 1
        return self._launch(pair[0], pair[1], None if index is None else obs.slots[index], obs)

    def _launch(self, e, f: "_Fused", slot, obs):
        s = self.s
        c, launcher = s.canary, s.canary.launcher
        # the observation the slot holds is read before the replay's copy overwrites it
        done = () if slot is None else obs.take_slot()[1]
        c.check_replayed(e.batch)
        compute = s.source.inputs.compute_stream
        side = launcher.streams.side() if compute is not None else None
        if side is None:  # (the CPU: nothing runs beside anything)
            self._replay(f, e, slot, done)
            return e.batch
        # on the side stream, after the engine's inputs (HEAD reads them) and the forward (TAIL reads the KV
        # it wrote); the engine's streams wait for it only before they next touch KV or inputs (join). Its
        # own events and the raw stream switch: a few C calls (this is every steady step's host path)
        cache, done_ev = self.cache, self.events[2]
        here = cache.current()
        waits = f.waits
        if waits is None:
            inputs, forward = self.events[0], self.events[1]
            record_event(inputs, here)
            event_wait(inputs, side)
            record_event(forward, compute)
            event_wait(forward, side)
        else:  # (the graph's first nodes wait for its own two events: two CUDA calls fewer)
            record_event(waits[0], here)
            record_event(waits[1], compute)
        cache.set(side)
        try:
            self._replay(f, e, slot, done)
        finally:  # (a violation raised in mode "raise" too: the engine's streams still join what was issued)
            cache.set(here)
            if self.fence is not None:
                # the slot's event, recorded on the side stream after the replay, is the step's end: the
                # engine's streams join it (no event of its own: one CUDA call fewer per step)
                self.pending = self.fence.slot.event
            else:
                record_event(done_ev, side)
                self.pending = done_ev
        self.g.quiet = None  # a later unfused step waits for the compute stream (which will follow this one)
        return e.batch

    def _replay(self, f: _Fused, e, slot, done) -> None:
        """Replay the step's graph and close the step; ``fence``: the slot's event the close recorded after
        the replay (None where it recorded none: the CPU's eager read, or a close that failed first)."""
        c, stage = self.s.canary, self.s.stage
        self.fence = None
        t0 = time.perf_counter()
        f.replay()
        launch_s = time.perf_counter() - t0  # (the runtime adds it to its launch time where benchmarks ask)
        self.replays += 1
        c.launcher.restore(f.state)
        if slot is None:
            stage.copied()  # (the staged values' copy is in the graph: its turn's event, this stream)
            c.close_step(e.batch, slot, done, launch_s)
            return
        records = slot.records
        try:
            c.close_step(e.batch, slot, done, launch_s)  # (records the slot's event after the replay)
        finally:
            # the staged values' copy precedes that event: it stands for the turn's (SlotFence), so the turn's
            # next refill needs no CUDA call once the slot's observation has been read
            if slot.records != records:
                self.fence = SlotFence(slot)
            stage.copied(self.fence)

    def join(self) -> None:
        """The engine's compute stream and the current stream wait for the last fused step: called before
        the engine next writes KV (its next forward, fork copies, restores) or its inputs (the next batch's
        preparation, after ``update_batch``), and before canary work on the engine's streams. Until then the
        step's canary work runs beside the engine's host work between steps (reading the sampled tokens
        waits for the compute stream only)."""
        event, self.pending = self.pending, None
        if event is not None:
            self.joined = self.fence
            event_wait(event, self.s.source.inputs.compute_stream)
            event_wait(event, self.cache.current())

    def _capture(self, e, h, slot) -> _Fused:
        """Record the step's whole canary work into a graph (on the canary's side stream on CUDA: the
        hook's own may be the legacy default stream, which cannot capture; a capture runs nothing)."""
        g, launcher = self.g, self.s.canary.launcher
        obs = self.s.canary.monitor.observer
        graph = g.graph_type()

        def body():
            with launcher.kept_here():  # the runtime's side sections stay on the capturing stream
                g._body(e, h)  # staged values' copy, read table, HEAD, the new tokens' read and attention checks
                # TAIL verify and write, the device step, the non-finite KV check (as every unfused step runs them)
                self.s.canary.device_after(e.batch)
                if slot is not None:
                    obs.copy_into(slot, eager)

        side = launcher.streams.side() if self.cache is not None else None  # (CUDA)
        waits = None
        if side is None:
            capture(graph, body, pool=self.pool)
        else:
            with launcher.streams.use(side):
                if self.in_graph_waits:
                    waits = self._capture_waiting(graph, body, side)
                if waits is None:
                    graph = g.graph_type()
                    capture(graph, body, pool=self.pool)
        self.captures += 1
        return _Fused(e, graph, launcher.state(), waits)

    def _capture_waiting(self, graph, body, side):
        """Capture ``body`` behind wait nodes for two events of the graph's own (external events: recorded
        by the host before each replay, on the inputs' stream and on the compute stream, they order the
        replay as the side stream's waits did, with two CUDA calls instead of four). Events of its own: an
        event is recorded again only for the graph's next replay, six steps or more later, when this replay
        has long finished, so whether a wait node reads its event at the launch or when it runs, it waits
        for this step's record (the compute stream joins each fused step before its next forward, and the
        engine reads a step's sampled tokens, which follow that forward, before it prepares the step after
        the next one). None where torch cannot capture such waits (then the caller captures the plain body
        and the step waits eagerly)."""
        try:
            waits = (torch.cuda.Event(external=True), torch.cuda.Event(external=True))
            for ev in waits:
                record_event(ev, side)  # (torch creates an event at its first record; a wait needs one)

            def waiting():
                for ev in waits:
                    event_wait(ev, side)
                body()

            capture(graph, waiting, pool=self.pool)
            return waits
        except (TypeError, RuntimeError) as err:
            self.in_graph_waits = False
            log.info("kv-canary: fused steps wait for their events eagerly (%s: %s)", type(err).__name__, err)
            return None


class Run:
    """A run of steady steps of one shape (``StepGraphs.before``): what a repeat must match (batch size, token
    cells, a read-table width that rounds to the run's, the read index's flavour, the attention mask's columns, the
    engine's input storages)
    and each (staging turn, snapshot slot) pair's plan and graph, found by the turn buffer's address and the
    slot's index: a repeat builds no keys and looks nothing up in the kept graphs."""

    __slots__ = ("bs", "cells", "lo", "hi", "no_read", "ptrs", "mask", "pairs")

    def __init__(self, h, lo: int, hi: int, no_read: bool, ptrs: tuple, mask: int = 0):
        self.bs, self.cells, self.lo, self.hi = h.bs, h.cells, lo, hi
        self.no_read, self.ptrs, self.mask = no_read, ptrs, mask
        self.pairs: dict = {}

    def matches(self, h, key) -> bool:
        """Step ``h`` of key ``key`` (``plans.StepKey``) has the run's shape (its width in (lo, hi]; the read
        index lists every slot it reads; its attention check compares the run's mask columns)."""
        return (h.T == h.bs == self.bs and h.cells == self.cells and self.lo < h.width <= self.hi
                and key.storages is self.ptrs and key.no_read == self.no_read and key.full_read
                and key.mask == self.mask)
