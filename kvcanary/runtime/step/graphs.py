"""The device work of a step's before hook, captured once per batch shape and replayed (CUDA).

Eagerly, a forward's before hook issues some forty device calls (read-table gather, staging,
token-table append, plan, HEAD verify and write, the new tokens' read check), each costing the
host 10-40 us on the H200's host. All of them read only buffers whose addresses do not change
from one step to the next of the same shape: the engine's input storage, the source's staged
values (per staging turn, or a static copy), a read table per key, and the canary's own
buffers. So the sequence is captured into a CUDA graph once a shape has run eagerly
``EAGER_SIGHTINGS`` times (the first run compiles Triton kernels and warms the allocator) and
replayed afterwards: one host call.

The staged values arrive in one of ``Staging``'s turn buffers. For a steady decode step (one new
token per request, a shape seen more than ``STEADY_SIGHTINGS`` times) the turn is part of the key:
each turn has its own batch and graph, which read that turn's buffer and fill that batch's read
table. That batch is also the one the monitor remembers for
reports (up to ``KEEP_BATCHES`` steps late), and the same turn comes back only after
``STAGING_TURNS`` steps, so no copy of the staged values or the read table is made per step, and
the graph itself holds the copy of the staged values from the turn's pinned buffer: a
steady decode batch costs ``STAGING_TURNS`` captures, once. With late hooks such a step's before and
after work run as one graph per (turn, snapshot slot) instead (``fused.py``). Other steps — prefill chunks, decode
shapes that come and go as requests arrive and finish — recur too rarely for a graph per turn (the
prefill chunks' many shapes times the turns overflowed the kept graphs and were captured again and
again in the H200 prefill benchmark): their graph, one per shape, reads a static copy of the staged
values, and the monitor gets the turn's values and a copy of the read table.

The key is everything the captured calls depend on: batch size, new tokens, token cells, the read
table's width rounded up (cells past a request's length are never read), the attention mask's columns the
attention-metadata check compares (``StepRunner.mask_cols``: the check is recorded with the step and
replayed against the engine's static mask and key-length buffers), and the data pointers of
the staged buffer (the turn's, or the static copy) and the engine's tensors. Anything else — a
read index shorter than the batch (an engine bug), the flash block-table path, a sliding-window
group, the token oracle, fault injection — runs eagerly.

The after work of these steps (TAIL, its checks, the snapshot copy) is recorded too, in the runner's after
plans (``after.py``: keyed by the part of the key it reads, the launcher's staged layout, and the snapshot slot),
and the step closes with ``Canary.close_step``: on the hook's own stream after an inline steady step
(``_inline``), on the side stream behind the before work after any other (``_general``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from kvcanary.runtime.graphs import capture, replay_of
from kvcanary.runtime.step.after import AfterPlans
from kvcanary.runtime.step.fused import FusedSteps, Run
from kvcanary.runtime.step.plans import Plan, Plans, table_width
from kvcanary.runtime.step.staging import STAGING_TURNS, Staging
from kvcanary.runtime.streams import capturing

WIDTH_STEP = 512  # read-table columns: at least this, rounded up to a power of two (few shapes, little waste)
MAX_ENTRIES = 40  # captured (shape, turn) entries kept: a few shapes, each in every staging turn
# A shape is captured after this many eager runs (the first compiles Triton kernels and warms the
# allocator; a capture costs about one eager run more, each replay saves one).
EAGER_SIGHTINGS = 1
# A decode shape gets a graph per staging turn once it has been seen this often: before that (and for
# shapes that come and go with a changing batch) one graph per shape plus two copies per step is cheaper
# than five captures.
STEADY_SIGHTINGS = 10


class _Report:
    """A step's batch as the monitor keeps it for reports (``StepGraphs._report``), with the read table the
    step copies into every time; the rest (a score of tensor views into the turn's staged buffer and the
    engine's inputs, about a millisecond of host time inside the engine's step) is assembled when a report
    first reads it. Its views read the same memory then as they would have when the step ran: the key
    holds the buffers' addresses, and a turn's buffer is not refilled while the monitor may still read
    the batch (``staging.STAGING_TURNS``)."""

    def __init__(self, tables, h, width: int, rtt: torch.Tensor):
        # (the step without its request objects: a kept report holds no finished request alive)
        self._make = (tables, h._replace(reqs=None, prefix=None, extend=None, rids=None), width)
        self._batch = None
        self.req_to_token = rtt
        self.num_tokens, self.batch_size = h.T, h.bs  # (as the assembled batch's: padding included)

    def __getattr__(self, name: str):
        if name.startswith("__") or "_make" not in self.__dict__:  # (copy and pickle probes: no batch to make)
            raise AttributeError(name)
        batch = self.__dict__.get("_batch")
        if batch is None:
            tables, h, width = self.__dict__["_make"]
            batch = self._batch = tables.assemble(h, width)
            batch.req_to_token = self.req_to_token
        return getattr(batch, name)


class StepGraphs:
    """Whole before-hook device work per batch shape: eager, then captured, then replayed.

    ``graph_type`` makes the graphs: ``torch.cuda.CUDAGraph`` on CUDA; tests pass the CPU stand-in
    ``kvcanary.runtime.graphs.DispatchGraph``.
    """

    def __init__(self, runner, graph_type=None):
        self.s = runner
        self.graph_type = graph_type or torch.cuda.CUDAGraph
        # One memory pool for every captured step: their temporaries (index grids, gathered slots) are
        # dead when a replay ends and replays run one after another on one stream, so captures may
        # reuse each other's memory; a pool per graph would hold 32 copies of the largest of them.
        self.pool = self.new_pool()
        # a stand-in graph on the CPU replays tensor ops only: the launcher's numpy shortcuts stay off
        runner.canary.use_graphs(host_ops=graph_type is None)
        # the plans by key (shape and staged buffer: a staging turn's, or the static copy's), and the steps seen
        # per shape, any turn (EAGER_SIGHTINGS, STEADY_SIGHTINGS)
        self.plans = Plans(MAX_ENTRIES)
        self.reports = Plans(MAX_ENTRIES)  # multi-token steps' batches for the monitor (_report), by key
        self.captures = self.replays = 0
        self.inline = False  # this step's before work was replayed by _inline: its after hook is ``after``
        self.general = False  # this step's before work ran on the side stream (_general): its after hook is ``after``
        # the after work of both (TAIL, its checks, the snapshot copy) recorded per key and replayed (after.py)
        self.afters = AfterPlans(self)
        self.quiet = None  # (stream, runner.engine_calls) of the last inline close (_inline, after)
        # steady decode steps as one replay after the forward (fused.py; attach option fused_steps)
        self.fused = FusedSteps(self) if runner.options.fused_steps else None
        self.fused_now = False  # this step ran fused: its after hook has nothing left to do
        self.last_fused = False  # the last step ran fused (the next one likely will: Session._late_step)
        if runner.stage.depth != STAGING_TURNS:  # (the CPU's one turn: a graph per turn reads its own)
            runner.source.stage = Staging(runner.device)
        # decode steps padded to their size bucket (tables.bucket): a changing batch keeps its graphs
        if runner.options.bucket_batches:
            runner.source.pad_cap = min(runner.canary.max_batch, runner.canary.max_tokens)

    def new_pool(self):
        """A CUDA-graph memory pool (None for the CPU stand-in)."""
        return torch.cuda.graph_pool_handle() if self.graph_type is torch.cuda.CUDAGraph else None

    def usable(self, io) -> bool:
        c = self.s.canary
        return (not io.use_block_table and not self.s.source.windowed and not self.s.source.oracle
                and c.injector is None
                and not (c.device.type == "cuda" and capturing()))

    def before(self, h, key, engine_stream) -> object:
        """Build, check and launch the step's before-forward work; returns its ForwardBatch. ``key``: the step's
        key (``plans.StepKey``); ``engine_stream``: a context that puts the caller on the engine's compute stream
        (the general path runs there; a steady decode step's replay does not need it, ``_inline``)."""
        s = self.s
        self.inline = self.general = False
        fused = self.fused
        if fused is not None and fused.other is not None:
            fused.select(key.storages)  # (two storage sets: each keeps its steady run)
        if fused is not None and fused.run is not None and s.late and fused.run.matches(h, key) \
                and fused.usable():
            # a repeat of the steady run's shape: its pair's graph without keys (FusedSteps.repeat)
            self.inline = self.fused_now = self.last_fused = True  # (set first, as for step: a raise keeps them)
            batch = fused.repeat(h)
            if batch is not None:
                return batch
            self.inline = self.fused_now = self.last_fused = False
        # a steady decode shape: a graph per turn (see the module's docstring); anything else reads a
        # static copy of the staged values, and the monitor keeps the turn's values and a copy of the
        # read table (such shapes recur too rarely to fill a graph per turn)
        sightings = self.plans.seen(key.shape)
        per_turn = h.T == h.bs and sightings > STEADY_SIGHTINGS
        self.last_fused = False
        if per_turn:
            e = self.plans.get(key)  # (the key holds the staged buffer's address: the turn's)
            if self.fused is not None and s.late and self.fused.usable():
                if e is None:
                    e = self._entry(key, h)
                self.inline = self.fused_now = self.last_fused = True
                return self.fused.step(e, key, h, self._run_for(h, key))
            if e is not None and e.graph is not None:
                return self._inline(e)
        if s.ready is not None:
            # late hooks: the forward is enqueued on the compute stream already; the staged values' copies
            # go on the inputs' stream instead, and the side stream follows both (_general)
            return self._general(h, key, sightings, per_turn, late=True)
        with engine_stream():
            return self._general(h, key, sightings, per_turn)

    def _run_for(self, h, key) -> Run | None:
        """The steady run a fused step of ``key`` belongs to, for repeats (``FusedSteps.repeat``): the current
        one where the step matches it, else a new one of the widths that round alike; None for a short read
        index (an engine bug, left to the keyed path)."""
        if not key.full_read:
            return None
        run = self.fused.run
        if run is not None and run.matches(h, key):
            return run
        # the widths that round to this one: (the power of two below, width], or (0, WIDTH_STEP]
        cap, width = self.s.canary.max_context, key.width
        lo = 0 if width <= WIDTH_STEP else 1 << ((width - 1).bit_length() - 1)
        if not (table_width(lo + 1, cap, WIDTH_STEP) == width == table_width(h.width, cap, WIDTH_STEP)):
            lo = h.width - 1  # (past the cap, or anything unusual: this width alone)
        return Run(h, lo, width, key.no_read, key.storages, key.mask)

    def _inline(self, e: Plan):
        """A captured steady decode step replayed on the hook's own stream, which the engine prepared the
        step's inputs on: no stream switch. The previous step's close (compute stream) comes first; the
        forward need not wait for it (HEAD beside the forward), and ``after`` orders the step's close."""
        c = self.s.canary
        launcher = c.launcher
        c.host_before(e.batch, checked=True)  # (the captured batch: shapes checked then) drains, opens the forward
        if self.quiet != (launcher.streams.current(), self.s.engine_calls) or self.s.carries:
            # the last close was not an inline one on this stream, or canary work ran on the compute stream
            # since (copies, saves of records): wait for all of it (with late hooks: all of it before the
            # forward, which is enqueued there already; under carries, the forward too: HEAD reads the ids
            # it carried over)
            if self.s.ready is not None:
                launcher.streams.wait(launcher.streams.current(), self.s.ready)
            else:
                launcher.follow(self.s.source.inputs.compute_stream)
        e.replay()
        launcher.restore(e.state)
        self.replays += 1
        self.s.stage.copied()
        self.inline = True
        return e.batch

    def after_on_side(self, batch) -> None:
        """A step's after work from the after plans on the side stream, behind its before work and the forward,
        as ``after_forward`` runs it: a general captured step's, and an eager step's of a captured runner."""
        with self.s.engine_stream():
            self.afters.on_side(batch)

    def after(self, batch) -> None:
        """The after hook of a captured step (``_inline`` or ``_general`` launched it): its after work from the
        runner's after plans (``after.py``), then its close. An inline step's runs on the same stream after the
        forward, and the engine's compute stream then waits for it (its next forward and every later KV write
        come after TAIL's reads); a general step's on the side stream after its before work and the forward,
        joined by the compute stream."""
        general, self.inline, self.general = self.general, False, False
        if self.fused_now:  # (its close ran with it: FusedSteps.step)
            self.fused_now = False
            return
        s = self.s
        if general:
            self.after_on_side(batch)
            return
        c = s.canary
        if c.launcher.run_here(self.afters.here, batch, s.source.inputs.compute_stream):
            # until the engine stream is used for canary work again, the next inline step needs no wait:
            # everything the canary did since is on this stream
            self.quiet = (c.launcher.streams.current(), self.s.engine_calls)

    def _general(self, h, key, sightings: int, per_turn: bool, late: bool = False):
        """Eager, capture, or replay on the canary's side stream (on the engine's compute stream)."""
        s = self.s
        c = s.canary
        if not per_turn:
            # the one static buffer is refilled on a stream that follows the earlier steps' side work: the
            # last step's replay may still be reading it there. (The engine's own join of that work orders
            # its compute stream, not the hook's; without this wait an async engine's host, which never
            # waits for a step, overwrote the buffer under that replay: an illegal address on the H200 at
            # 1B serving.)
            c.launcher.follow(c.launcher.streams.side())
            # (the recording fake's record: the copy reads this step's staging buffer)
            c.launcher.streams.note("stage_static", reads=(h.packed,), writes=("staged_static",))
        work = h if per_turn else h._replace(packed=s.stage.to_static(h.packed))
        # (the plan of the step's shape that reads the static copy: the key with its address for the turn's)
        plan_key = key if per_turn else key._replace(packed=work.packed.data_ptr())
        e = self.plans.get(plan_key)
        if e is None:
            e = self._entry(plan_key, work)
        report = e.batch if per_turn else self._report(h, key, e.batch.req_to_token)
        c.host_before(e.batch)  # checks, drains, opens the forward; joins the side stream's earlier work
        launcher = c.launcher
        streams = launcher.streams
        side = streams.side()
        on_side = nullcontext()
        if side is not None:
            # the side stream starts after the engine prepared this step's inputs (they are read below); with
            # late hooks, also after the compute stream's position before the forward (the canary's work there)
            streams.wait(side, streams.record(streams.current()))
            if late:
                streams.wait(side, s.ready)
            on_side = streams.use(side)
        with on_side:
            # (the recording fake's record: the staged copy and the input storage set, by its ids' address)
            streams.note("step_reads", reads=("staged_static", ("inputs", key.storages[0])) if not per_turn
                         else (("inputs", key.storages[0]),))
            self._run(e, sightings, work)
            s.stage.copied()  # (a per-turn graph holds the staged values' copy: issued by its replay)
            if not per_turn:
                report.req_to_token.copy_(e.batch.req_to_token)
        if side is not None:
            # HEAD runs beside the forward; the step's close makes the engine stream wait for it
            launcher.note_side_work(side)
        self.general = True
        return report

    def _entry(self, key, h) -> Plan:
        """A new plan for ``key`` (eager until its shape was seen ``EAGER_SIGHTINGS`` times: ``_run``)."""
        e = Plan(self.s.tables.assemble(h, key.width))
        self.plans.add(key, e)  # (a dropped plan's graph goes; a remembered batch keeps its tensors)
        # made here, filled and read by the side stream's replays: once dropped, its memory must not serve a
        # new tensor before the side stream's queued work is done with it (the side stream may lag steps behind)
        self.s.canary.launcher.hand_over(e.batch.req_to_token)
        return e

    def _report(self, h, key, table: torch.Tensor):
        """A multi-token step's batch for the monitor: views into this turn's staged buffer (``key`` holds its
        address) and its own read table (a copy of the captured batch's), assembled only when a report reads it
        (``_Report``)."""
        batch = self.reports.get(key)
        if batch is None:
            batch = _Report(self.s.tables, h, key.width, torch.empty_like(table))
            self.reports.add(key, batch)
            self.s.canary.launcher.hand_over(batch.req_to_token)  # (the side stream copies into it: _entry)
        return batch

    def _run(self, e: Plan, sightings: int, h) -> None:
        """Replay the entry's graph, or capture it, or run its work eagerly (a shape's first sightings)."""
        launcher = self.s.canary.launcher
        if e.graph is not None:
            e.replay()
            launcher.restore(e.state)
            self.replays += 1
        elif sightings > EAGER_SIGHTINGS:
            graph = self.graph_type()
            capture(graph, lambda: self._body(e, h), pool=self.pool)
            e.graph, e.replay, e.state = graph, replay_of(graph), launcher.state()
            graph.replay()  # a capture records the calls without running them
            self.captures += 1
        else:
            self._body(e, h)

    def _body(self, e: Plan, h) -> None:
        s, batch = self.s, e.batch
        # A graph keeps no tensor alive: the entry holds what the body reads that the runner may replace
        # (the staged values' pinned buffer too: a graph copies from its address on every replay).
        stage = s.stage
        e.keep = (s.tables.iota, stage.pending)
        stage.copy()  # the staged values' copy, unless issued already (to_static)
        s.tables.fill_read_table(batch, h, captured=True)
        s.canary.device_before(batch)
        s.tables.verify_new_reads(batch, shortcut=False)
        # the attention metadata against the batch, from the engine's static buffers (after the new tokens' read
        # check, as an eager step's hook runs it)
        s.record_attention(batch, h)
