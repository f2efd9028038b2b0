"""One owner for the canary around one forward: ``StepRunner`` takes a source's step (``runtime/engine.py``)
eager, captured or fused.

A step is one of:

- **eager**: the batch is built (``tables.StepTables.build``), ``Canary.before_forward`` and the new tokens'
  read check run on the engine's compute stream, ``Canary.after_forward`` after the forward;
- **captured** (``graphs.StepGraphs``): the before work's device calls per batch shape replayed from a
  graph (a CUDA graph; the CPU stand-in ``runtime.graphs.DispatchGraph`` in tests), and the after work's
  TAIL, its checks and the snapshot copy likewise, from the runner's after plans (``after.AfterPlans``), closed
  with ``Canary.close_step``;
- **fused** (``fused.FusedSteps``): a steady decode step's whole canary work as one graph replayed after
  the forward;
- **steady** (``steady.SteadyStep``, the CPU's eager steps with numba): a step shaped like one taken before
  runs from the plan bound to it then (the full eager path wherever anything differs).

Each step's key is computed once, here (``key_of``: ``plans.StepKey``), and every route keys its plans by it
(``plans.py``, the design note of the recorded step).

The engine calls ``late_step`` when it starts a step (whether the canary work may wait until the forward is
enqueued), ``before`` and ``after`` around (or after) the forward, ``engine_stream`` around canary work of
its own between steps (record copies, saves), and ``join`` before it next writes KV or its inputs. The
runner keeps no engine object: it reads what the source gives (its host part, its inputs) and calls the
``Canary``'s public methods, which keep before/after, records, flush and stats, and end every step
(``Canary._close``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from kvcanary.runtime.engine import StepOptions
from kvcanary.runtime.step.carry import Carry
from kvcanary.runtime.step.graphs import WIDTH_STEP, StepGraphs
from kvcanary.runtime.step.plans import StepKey, Storages, table_width
from kvcanary.runtime.step.staging import Staging
from kvcanary.runtime.step.steady import SteadyStaging, SteadyStep
from kvcanary.runtime.step.tables import CPU_WIDTH_STEP, StepTables
from kvcanary.runtime.streams import event_wait, record_event, stream_cache

__all__ = ["StepRunner"]

_NO_CONTEXT = nullcontext()  # (reentrant: one serves every call)


class StepRunner:
    """The canary's work for each forward of one engine source, on the path each step allows.

    ``graph_type``: the graph class of captured steps (tests pass the CPU stand-in
    ``runtime.graphs.DispatchGraph`` to take the captured and fused paths on the CPU; default: CUDA graphs
    on CUDA with the launcher's side stream, no captured steps elsewhere).
    """

    def __init__(self, canary, source, options: StepOptions | None = None, graph_type=None):
        self.canary, self.source = canary, source
        self.options = options = options or StepOptions()
        self.device = canary.device
        self.group = source.group
        self.tables = StepTables(canary, source)
        # one staging buffer on the CPU: there a step's observation is read when the step closes, so no report
        # reads a batch after the next step refilled its buffer, and a reused batch (StepTables._cpu_batch)
        # serves every step of its shape, not one step in each of the turns (StepGraphs restores the turns:
        # its CPU stand-in replays as CUDA does)
        source.stage = SteadyStaging(self.device, 1) if self.device.type == "cpu" else Staging(self.device)
        self.late = False  # this step's canary work waits for the forward's enqueue (late_step)
        self.ready = self._ready_event = None  # CUDA, late: the compute stream before the forward (late_step)
        self._compute = None  # (the engine's compute stream, its raw handle, its stream cache): engine_stream
        self.engine_calls = 0  # engine_stream calls so far
        self.batch = None  # the step's ForwardBatch (before -> after)
        # the forward rewrites some input ids on the device (async batching): every step late (carry.py)
        self.carries = bool(getattr(source, "carries", False))
        self.storages = Storages()  # the engine's input storages' addresses (a step key's part)
        self.graphs = self._step_graphs(graph_type)  # (it may stage through turns of its own: graphs.py)
        # the read table's width bucket in a step's key: the graphs' where they run, else the CPU's reused batches'
        self.width_step = CPU_WIDTH_STEP if self.graphs is None else WIDTH_STEP
        self.stage.on_alloc = canary.launcher.hand_over  # (the side stream reads the staging buffers)
        self.stage.sized_for(canary.max_batch, canary.max_tokens)
        self.fused = None if self.graphs is None else self.graphs.fused
        # the attention-metadata check in the captured and fused steps' recorded work (``record_attention``), where
        # it is on and the source hands its metadata over (``EngineSource.attention_inputs``); eager steps leave
        # it to the engine's own call
        self.attention = (self.graphs is not None and canary.attention_check.on
                          and callable(getattr(source, "attention_inputs", None)))
        self.attention_now = None  # this step's (AttentionInputs, mask columns: StepKey.mask), for its recording
        self.attention_recorded = False  # this step's attention check is in its recorded work (the graphs route)
        self.carry = Carry(self) if self.carries else None
        # the CPU's steady decode steps from a bound plan (steady.py; None: every step takes the eager path)
        self.steady = SteadyStep(self) if SteadyStep.applies(self) else None

    @property
    def stage(self) -> Staging:
        """The staging buffers the source sends its host part through."""
        return self.source.stage

    def _step_graphs(self, graph_type) -> StepGraphs | None:
        """On CUDA (option ``step_graphs``): the before work's device calls replayed from a CUDA graph per batch
        shape, the after work's TAIL, checks and snapshot likewise (the runner's own plans: the launcher records
        nothing); ``graph_type`` takes the same path on the CPU."""
        if not self.options.step_graphs:
            return None
        if graph_type is not None:
            return StepGraphs(self, graph_type)
        if self.device.type != "cuda":
            return None
        if not self.canary.launcher.streams.overlap:
            return None  # the whole-step graph runs on the side stream: overlap off keeps every launch eager
        return StepGraphs(self)

    # -- per step --------------------------------------------------------------------------------
    def late_step(self) -> bool:
        """Whether this step's canary work may wait until its forward is enqueued: HEAD reads canary records
        and the engine's inputs only (never KV), so it precedes nothing in the forward. Not with the token
        oracle (the sampler reads what the before work computes), fault injection or ``late_hooks=False``;
        on CUDA only with step graphs on a usable step (their HEAD runs off the forward's stream, after the
        compute stream's position before the forward: ``ready``)."""
        if self.carry is not None:
            return self.carry.late_step()
        c = self.canary
        self.ready = None
        if (not self.options.late_hooks or not c.enabled or self.source.oracle or c.injector is not None
                or c.config.check_before_forward):  # (that check must precede the forward)
            return False
        io = self.source.inputs
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

    def before(self, late: bool = False):
        """The step's before-forward work; returns its ``ForwardBatch``. ``late``: ``late_step`` said so and the
        forward is enqueued (the step is usable for graphs)."""
        self.late = late
        c, graphs = self.canary, self.graphs
        # (late implies usable, except under carries, where every step is late: carry.py)
        if graphs is not None and c.enabled and ((late and not self.carries) or graphs.usable(self.source.inputs)):
            h = self.source.host_part(copy=False, padded=True)
            c.padding_tokens = h.pad
            self.tables.check_read_length(h)
            key = self.key_of(h, recorded=True)
            self.attention_recorded = self.attention
            self.batch = graphs.before(h, key, self.engine_stream)
            if self.attention_now is not None:  # (its recorded work compared the step's metadata)
                c.attention_check.note_recorded()
        else:
            c.padding_tokens = 0
            self.attention_recorded = False
            steady = self.steady
            with self.engine_stream():
                h = self.source.host_part()
                key = self.key_of(h)
                batch = None if steady is None else steady.before(h, key)
                if batch is None:
                    batch = self.tables.build(h, key)
                    c.before_forward(batch, check_now=False)  # (checked below, new reads included)
                    if c.enabled:
                        self.tables.verify_new_reads(batch)
                        if steady is not None:
                            steady.bind(h, key, batch)
                self.batch = batch
        if c.config.check_before_forward:  # (the new tokens' read check included)
            with self.engine_stream():
                c.check_reads_now()
        return self.batch

    def key_of(self, h, recorded: bool = False) -> StepKey:
        """The step's key (``plans.StepKey``), computed once per step: every cache of the runner is keyed by it.
        ``recorded``: the step takes the graphs route, whose recorded work checks the attention metadata (the key
        holds the mask columns it compares: ``mask_cols``)."""
        mask = self.mask_cols(h) if recorded and self.attention else 0
        return StepKey.of(h, self.storages.of(h.io), self.stage.last_ptr, self.group, self.width_step,
                          self.canary.max_context, mask)

    def mask_cols(self, h) -> int:
        """The mask columns the recorded attention check of step ``h`` compares (``StepKey.mask``), its metadata
        kept for ``record_attention`` (``attention_now``; None: nothing to compare). Where the engine hands
        attention exactly the step's keys (no padding of its own), the width grows with every decode step: the
        key holds its bucket instead (``-n``: a slice of ``n`` columns, those past the batch's keys not compared,
        a bound the recording computes from the staged values), so the recording serves many steps; a padded
        width (the engine's own CUDA graphs pad to intervals) recurs as it is (``n``)."""
        a = self.source.attention_inputs(h.io)
        if a is None or (a.mask is None and a.cu_seqlens_k is None):
            self.attention_now = None
            return 0
        cols = 0
        if a.mask is not None:
            have = a.mask.shape[-1]
            width = min(a.width, have)
            cols = -table_width(width, have, self.width_step) if width == h.total and width else width
        self.attention_now = (a, cols)
        return cols

    def record_attention(self, batch, h) -> bool:
        """The attention-metadata check of step ``h`` (its batch ``batch``) as part of its recorded work
        (``graphs.StepGraphs._body``): tensor ops over the engine's static buffers, so each replay compares
        that step's key lengths and mask. Returns whether the recording holds it."""
        now = self.attention_now
        if now is None:
            return False
        a, cols = now
        mask = slots = None
        if cols:
            n = abs(cols)
            mask = a.mask[..., :min(batch.num_tokens, a.mask.shape[-2]), :n]
            slots = h.io.read_index_storage[self.group, :n]
        return self.canary.attention_check.recorded(batch, cu_seqlens_k=a.cu_seqlens_k, mask=mask, key_slots=slots,
                                                    batch_keys_only=cols < 0)

    def after(self) -> None:
        """The step's after-forward work (TAIL, the step's close), on the path its before work took."""
        self.late = False
        graphs = self.graphs
        if graphs is not None and (graphs.inline or graphs.general):
            graphs.after(self.batch)
        elif graphs is not None and graphs.afters.takes_eager():
            # an eager step of a captured runner (a step its graphs cannot take: the block-table path, a
            # sliding-window group, the token oracle): its after work from the same after plans
            graphs.after_on_side(self.batch)
        elif self.steady is None or not self.steady.after(self.batch):
            with self.engine_stream():
                self.canary.after_forward(self.batch)

    def abandon(self) -> None:
        """The engine's forward raised after ``late_step`` (``before`` may have run, ``after`` will not): the step's
        canary forward is abandoned (``Canary.abandon_forward``: nothing open, as on the late and fused paths,
        whose canary work waits for the forward: nothing to do) and the runner's per-step state dropped, so the
        next step starts as any other."""
        self.late, self.batch, self.ready = False, None, None
        self.attention_recorded = False
        if self.graphs is not None:
            self.graphs.inline = self.graphs.general = self.graphs.fused_now = False
        if self.steady is not None:
            self.steady.open = None
        self.canary.abandon_forward()

    def forward_enqueued(self) -> None:
        """The engine enqueued the step's forward (under ``carries``: a late captured step starts after it)."""
        if self.carry is not None:
            self.carry.forward_enqueued()

    def done_event(self):
        """Under ``carries``, on CUDA: an event after this step's canary work (one per input storage set), which
        the engine's next rewrite of the step's input storages waits for; else None."""
        return None if self.carry is None else self.carry.done_event()

    # -- streams ---------------------------------------------------------------------------------
    def engine_stream(self):
        """On CUDA the engine runs its forward, fork copies and offload copies on its compute stream: the
        canary's kernels go there too (after the current stream's batch preparation), so they are ordered
        with every KV write and read."""
        self.engine_calls += 1  # (a steady decode step's inline replay waits for the compute stream after any)
        self.join()
        stream = self.source.inputs.compute_stream
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

    def join(self) -> None:
        """The engine's streams wait for the last fused step's canary work (``FusedSteps.join``), if any."""
        if self.fused is not None and self.fused.pending is not None:
            self.fused.join()

    def joined(self):
        """The last fused step's position the compute stream waits for since the last ``join`` (None if none):
        an engine whose step ends in a synchronize of that stream calls ``complete()`` on it afterwards, so
        reading that slot asks CUDA nothing."""
        return None if self.fused is None else self.fused.joined
