"""The device work of one forward, launched with as little host time as possible.

The public ops validate every argument on every call; here the canary's own buffers
and real-KV sources are validated once, the engine's ``ForwardBatch`` once per
forward, and the chosen implementation module is called directly. Only static
buffers are touched and nothing syncs, so the sequence can be captured in a CUDA graph.

On CUDA the verify and write launches run on a side stream (``streams.py``): the plan is
built on the engine's stream, then HEAD runs beside the forward and TAIL after it, off the
host's critical path. What they read from the engine's batch is first staged into the
canary's own buffer, since the engine refills its input buffers for the next forward
while TAIL may still be reading.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from kvcanary.format import ATTRIBUTION_STRIDE, RealKvMode
from kvcanary.ops import api
from kvcanary.runtime.batch import TokenAppend
from kvcanary.runtime.checks import check_batch
from kvcanary.runtime.graphs import EagerGraphs, eager, graphs_for
from kvcanary.runtime.streams import streams_for


class _Inputs:
    """What the verify and write launches read from the batch: the engine's tensors, or staged copies."""

    __slots__ = ("input_ids", "positions", "loc", "writer_ids", "exp_ids", "exp_pos")


_STAY = nullcontext()  # (reentrant) a side section that stays where it is


class _Side:
    """``ForwardLauncher.side``: a plain class, since a generator-based context costs the host several
    times more, and a forward enters a few of them."""

    __slots__ = ("launcher", "switch")

    def __init__(self, launcher: "ForwardLauncher"):
        self.launcher, self.switch = launcher, None

    def __enter__(self) -> None:
        launcher = self.launcher  # (not inside another section nor kept on the current stream: side())
        s = launcher.streams
        side = s.side()
        if side is None or not s.overlap:
            return
        current = s.current()
        if current == side:
            return
        s.wait(side, s.record(current))
        self.switch = s.use(side)
        self.switch.__enter__()
        launcher.in_side = True

    def __exit__(self, *exc) -> bool:
        if self.switch is not None:
            launcher = self.launcher
            launcher.in_side = False
            try:
                self.switch.__exit__(*exc)
            finally:
                launcher.note_side_work(launcher.streams.side())
        return False


class ForwardLauncher:
    """HEAD and TAIL sequences of a ``Canary``: plan, verify and write per group and K/V buffer.

    ``streams`` is the stream layer (``streams.py``); tests swap in ``RecordingStreams``.
    """

    def __init__(self, canary):
        self.c = canary
        self.checked = None  # the batch host_before already checked (its metadata), None when none
        self.impl = api.impl_module(canary.config.backend, canary.device.type)
        self.attribution = canary.config.record_stride >= ATTRIBUTION_STRIDE
        self.streams = streams_for(canary.device, getattr(canary.config, "overlap", True))
        # captured HEAD / TAIL sequences per shape (graphs.py); tests swap in FakeGraphs
        self.graphs = graphs_for(canary.device, getattr(canary.config, "launch_graphs", False))
        self.pending = None  # side-stream work the engine stream has not waited for yet
        self.in_side = False  # inside a side section that switched streams (_Side)
        # True while a caller that orders the current stream after the forward itself (events) wants side
        # sections to run where they are: the transformers adapter's steady decode steps (graphs.py)
        self.on_current = False
        # set by after_forward / after_replayed: TAIL's captured sequence waits (deferred) for the step's
        # snapshot and both replay as one graph (one host call fewer per step)
        self.defer_tail, self.deferred = False, None
        self.token_np = None  # CPU: numpy view of the canary's token table (_refill_tokens)
        # CPU: numpy in place of small tensor ops; off while the work is recorded for replay (the tests'
        # CPU stand-in of a CUDA graph records tensor ops only)
        self.host_ops = True
        n, groups = canary.max_tokens, len(canary.groups)
        # staged inputs: ids, positions, expected ids, expected positions, one slot list per group; writer ids
        self.staged = torch.zeros((4 + groups) * n + canary.max_batch, dtype=torch.int64, device=canary.device)
        if any(g.table is not None for g in canary.groups):
            self.swa_loc = torch.zeros(n, dtype=torch.int64, device=canary.device)

    # -- stream ordering -------------------------------------------------------------------------
    def side(self):
        """A context running its body on the side stream, after everything issued so far on the current
        stream (a no-op inside another side section, and without a side stream)."""
        if self.in_side or self.on_current:
            return _STAY
        return _Side(self)

    def note_side_work(self, stream) -> None:
        """Work an adapter issued on ``stream`` (the side stream) outside a ``side()`` section: the next
        ``join`` makes the engine stream wait for it."""
        self.pending = self.streams.record(stream)

    def join(self) -> None:
        """The current (engine) stream waits for the side stream's work so far; a no-op when none is pending."""
        s = self.streams
        if self.pending is not None and s.current() != s.side():  # (in a side section: its owner joins later)
            s.wait(s.current(), self.pending)
            self.pending = None

    def follow(self, other) -> None:
        """The current stream waits for everything issued so far on ``other`` (None or itself: no-op)."""
        s = self.streams
        here = s.current()
        if other is not None and here is not None and not s.same(here, other):
            s.wait(here, s.record(other))

    def run_here(self, fn, arg, compute) -> bool:
        """``fn(arg)`` (a forward's after-work: ``Canary.after_replayed(batch)``) on the current stream
        instead of the side stream: first the current stream waits for ``compute`` (the stream the forward
        ran on: TAIL hashes the KV it wrote), then ``compute`` waits for the current stream (its next
        forward and every later KV write come after TAIL's reads). Returns whether the two streams differ."""
        s = self.streams
        here = s.current()
        other = compute is not None and here is not None and not s.same(here, compute)
        if other:
            s.wait(here, s.record(compute))
        self.on_current = True
        try:
            fn(arg)
        finally:
            self.on_current = False
        if other:
            s.wait(compute, s.record(here))
        return other

    @contextmanager
    def kept_here(self):
        """Side sections inside stay on the current stream (``on_current``), for a caller that orders that stream
        after the forward itself: ``run_here``, and the capture of a whole step (``runtime/step/fused.py``)."""
        self.on_current = True
        try:
            yield
        finally:
            self.on_current = False

    def hand_over(self, *tensors) -> None:
        """Tensors made on the engine stream and read on the side stream stay allocated until it read them."""
        side = self.streams.side()
        if side is None or not self.streams.overlap:
            return
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(side)

    def state(self) -> tuple:
        """What ``before`` leaves for ``after``: saved with a captured ``before`` and restored on its replays."""
        return self.inputs, self.key, self.staged_now

    def restore(self, state: tuple) -> None:
        self.inputs, self.key, self.staged_now = state
        self.checked = None

    # -- the forward -----------------------------------------------------------------------------
    def before(self, batch) -> None:
        """Expected-token refill, plan per group, HEAD verify of the prefix, HEAD write of the new tokens."""
        c, impl, note = self.c, self.impl, self.streams.note
        if self.checked is not batch:
            check_batch(batch, c.device)
        self.checked = None
        self.join()
        self.staged_now = self.streams.overlap and self.streams.side() is not None
        self.inputs = self._stage(batch) if self.staged_now else self._direct(batch)
        x = self.inputs
        self.key = (batch.batch_size, batch.num_tokens, x.exp_ids is not None, x.exp_pos is not None,
                    x.writer_ids is not None)
        # at most this many prefix entries in the step's plan (a row's prefix fits its table row): what a device
        # pass over them needs to look at, not the plan's whole capacity (runtime/slots.py)
        self.entry_bound = batch.batch_size * batch.req_to_token.shape[1]
        table, valid = self._refill_tokens(batch)
        plans = [dict(req_pool_indices=batch.req_pool_indices, prefix_lens=batch.prefix_lens,
                      extend_lens=batch.extend_lens, req_to_token=batch.req_to_token, out=g.plan, window=g.window,
                      full_to_swa=g.table, token_table=table, token_valid_lens=valid,
                      token_offset=batch.token_offset) for g in c.groups]
        if not self._fused("head", plans[0]):
            for g, kw in zip(c.groups, plans):
                # (the batch's host part, by its first tensor: the staging buffer the recording fake tells apart)
                note("plan", reads=("engine_inputs", "token_table", batch.req_pool_indices), writes=("plan",))
                impl.plan(**kw)
            with self.side():
                self._phase("head")
        if not c.head_overlap:
            # the engine may read canary records on its stream right after before_forward (an adapter's own
            # verify of what HEAD wrote): unless it says it calls Canary.records_ready() first, wait here
            self.join()

    def _fusable(self):
        """(group, buffer) where the backend's fused HEAD and TAIL calls apply: everything inline (no side
        stream, no capture) over one group and one buffer; None: run the ops one by one."""
        c = self.c
        if self.staged_now or self.streams.side() is not None or len(c.groups) != 1 or len(c.groups[0].kvs) != 1:
            return None
        return c.groups[0], c.groups[0].kvs[0]

    def _fused(self, phase: str, *lead) -> bool:
        """The compiled CPU backend's whole phase in one call: plan + HEAD verify + HEAD write (``numba_ops.head``),
        or accept_rewrites + TAIL verify + write + step (``numba_ops.tail``); False: one by one."""
        kw = self.fused_kw(phase, *lead)
        return kw is not None and getattr(self.impl, phase)(*kw)

    def fused_kw(self, phase: str, *lead) -> tuple | None:
        """The keyword dicts of ``phase``'s fused call (``lead``: HEAD's plan dict) for the current inputs, or
        None where the phase runs op by op (a CPU steady step binds them: ``runtime/step/steady.py``)."""
        at = None if getattr(self.impl, phase, None) is None else self._fusable()  # (Triton, torch: none)
        if at is None:
            return None
        (g, kv), c, tail = at, self.c, phase == "tail"
        verify = dict(buf=g.bufs[phase, kv], entries=g.plan.entries, ring=c.ring, counters=c.counters,
                      launch_tag=g.tag(phase, kv), sources=g.sources[kv] if tail else (),
                      real_kv_mode=c._mode(g, kv) if tail else 0)
        loc = self.inputs.loc[0]
        accept = (self._accept_kw(g, loc, kv),) if tail else ()
        return (*lead, verify, self._write_kw(phase, g, loc, kv), *accept)

    def after(self, batch) -> None:
        """TAIL verify with real-KV hash, TAIL write, device step + 1 (on the side stream, after the forward)."""
        if not self.staged_now and self._fused("tail"):  # (staged: never fused, _fusable)
            return
        if self.in_side or self.on_current:  # (side() would stay where it is: no context to enter)
            return self._phase("tail")
        with self.side():
            self._phase("tail")

    def _phase(self, phase: str) -> None:
        head = phase == "head"
        body = self._head if head else self._tail
        self.streams.note(phase, reads=("plan", "staged", "step", f"{phase}_bufs") + (() if head else ("kv",)),
                          writes=(f"{phase}_bufs",) + (() if head else ("step",)), atomic=("ring", "counters"))
        if self.staged_now:
            # only static buffers are read: the sequence can be captured and replayed
            if not head and self.defer_tail and type(self.graphs) is not EagerGraphs:
                self.deferred = ((phase,) + self.key, body)
                return
            self.graphs.run((phase,) + self.key, body)
        else:
            body(eager)

    def take_tail(self):
        """The deferred TAIL sequence as (key, body) for a combined replay, or None; it is no longer pending."""
        deferred, self.deferred = self.deferred, None
        return deferred

    def extend_tail(self, tag: str, fn) -> bool:
        """Append ``fn()`` to the deferred TAIL sequence, to be captured and replayed with it (and the step's
        snapshot) under TAIL's key plus ``tag``: ``fn`` must read static buffers only, as TAIL does. False when
        no TAIL is deferred (the caller runs ``fn`` itself)."""
        if self.deferred is None:
            return False
        key, body = self.deferred

        def extended(call):
            body(call)
            call(fn)
        self.deferred = (key + (tag,), extended)
        return True

    def flush_tail(self) -> None:
        """Run a deferred TAIL sequence now (before other side-stream work that must follow it)."""
        deferred = self.take_tail()
        if deferred is not None:
            self.graphs.run(*deferred)

    def _head(self, call) -> None:
        self._verify_all("head", call)
        self._write_all("head", call)

    def _tail(self, call) -> None:
        self._verify_all("tail", call)
        self._write_all("tail", call)
        call(self.c.step_tensor.add_, 1)

    def _verify_all(self, phase: str, call) -> None:
        c, impl, tail = self.c, self.impl, phase == "tail"
        for g, loc in zip(c.groups, self.inputs.loc):
            for kv in g.kvs:
                if tail:  # first: a slot this forward rewrote with the record it holds reads as its new bytes
                    call(impl.accept_rewrites, **self._accept_kw(g, loc, kv))
                call(impl.verify, buf=g.bufs[phase, kv], entries=g.plan.entries, ring=c.ring, counters=c.counters,
                     launch_tag=g.tag(phase, kv), sources=g.sources[kv] if tail else (),
                     real_kv_mode=c._mode(g, kv) if tail else 0)

    def _direct(self, batch) -> _Inputs:
        x = _Inputs()
        x.input_ids, x.positions = batch.input_ids, batch.positions
        x.loc = [batch.out_cache_loc if g.table is None else self._translate(batch.out_cache_loc, g.table)
                 for g in self.c.groups]
        x.writer_ids = batch.request_ids
        x.exp_ids, x.exp_pos = batch.expected_input_ids, batch.expected_positions
        return x

    def _stage(self, batch) -> _Inputs:
        """Every batch tensor the side stream reads, copied into the canary's static buffer in one launch."""
        # (the engine's input storage set, by its ids' tensor: the recording fake tells two sets apart)
        self.streams.note("stage", reads=("engine_inputs", batch.input_ids, batch.req_pool_indices), writes=("staged",))
        n, bs, check = batch.num_tokens, batch.batch_size, self.c.config.input_check
        fields = {"input_ids": batch.input_ids, "positions": batch.positions, "loc": batch.out_cache_loc,
                  "exp_ids": batch.expected_input_ids if check else None,
                  "exp_pos": batch.expected_positions if check else None,
                  "writer_ids": batch.request_ids[:bs] if self.attribution and batch.request_ids is not None
                  else None}
        parts, views, at = [], {}, 0
        for name, t in fields.items():
            if t is None:
                views[name] = None
                continue
            views[name] = self.staged[at:at + t.shape[0]]
            parts.append(t)
            at += t.shape[0]
        torch.cat(parts, out=self.staged[:at])
        x = _Inputs()
        x.input_ids, x.positions, x.exp_ids, x.exp_pos, x.writer_ids = (
            views["input_ids"], views["positions"], views["exp_ids"], views["exp_pos"], views["writer_ids"])
        x.loc = []
        for g in self.c.groups:
            if g.table is None:
                x.loc.append(views["loc"])
            else:
                # SWA slots land in their own part of the buffer (the translation reads the live table)
                out = self.staged[at:at + n]
                out.copy_(self._translate(views["loc"], g.table))
                at += n
                x.loc.append(out)
        return x

    def _refill_tokens(self, batch):
        c, hist = self.c, batch.token_history
        if not c.config.token_check or hist is None:
            return None, None
        self.streams.note("tokens", reads=("engine_inputs", batch.req_pool_indices), writes=("token_table",))
        if isinstance(hist, TokenAppend):
            if hist.cell_rows.shape[0]:
                if c.device.type == "cpu" and self.host_ops:
                    # numpy: inside the engine's step each tensor call costs tens of microseconds
                    if self.token_np is None:
                        self.token_np = c.token_table.numpy()
                    self.token_np[hist.cell_rows.numpy(), hist.cell_cols.numpy()] = hist.cell_tokens.numpy()
                else:
                    c.token_table.index_put_((hist.cell_rows, hist.cell_cols), hist.cell_tokens.to(torch.int32))
            return c.token_table, hist.valid_lens
        flat, offsets = hist.flat.to(torch.int64), hist.offsets.to(torch.int64)
        if batch.batch_size and flat.shape[0]:
            self.impl.scatter_req_token_ids(flat, offsets, batch.req_pool_indices.to(torch.int64), c.token_table)
        valid = c._valid_lens[:batch.batch_size]
        torch.sub(offsets[1:], offsets[:-1], out=valid)
        return c.token_table, valid

    def _write_all(self, phase: str, call) -> None:
        for g, loc in zip(self.c.groups, self.inputs.loc):
            for kv in g.kvs:
                call(self.impl.write, **self._write_kw(phase, g, loc, kv))

    def _write_kw(self, phase: str, g, loc, kv: str) -> dict:
        c, cfg, x = self.c, self.c.config, self.inputs
        tail = phase == "tail"
        # The input and chain-position asserts run once per forward: on the HEAD K write of FULL.
        first = phase == "head" and kv == "k" and g.name == "full"
        return dict(buf=g.bufs[phase, kv], write_offsets=g.plan.write_offsets, seed_slot=g.plan.seed_slot,
                    num_requests=self.key[0], out_cache_loc=loc, input_ids=x.input_ids, positions=x.positions,
                    ring=c.ring, counters=c.counters, launch_tag=g.tag(phase, kv),
                    sources=g.sources[kv] if tail else (),
                    real_kv_mode=c._mode(g, kv) if tail else int(RealKvMode.NONE),
                    expected_input_ids=x.exp_ids if first and cfg.input_check else None,
                    expected_positions=x.exp_pos if first and cfg.input_check else None,
                    chain_check=c.chain_check if first else None,
                    writer_ids=x.writer_ids if self.attribution else None, step=c.step_tensor,
                    chain_hint=g.bufs["head", kv] if tail else None)  # (HEAD wrote the same entries' chain)

    def _accept_kw(self, g, loc, kv: str) -> dict:
        c = self.c  # (rewrites counted once per forward: on the first group's first buffer)
        return dict(head_buf=g.bufs["head", kv], tail_buf=g.bufs["tail", kv], write_offsets=g.plan.write_offsets,
                    num_requests=self.key[0], out_cache_loc=loc, sources=g.sources[kv], real_kv_mode=c._mode(g, kv),
                    rewrites=c.rewrites if g is c.groups[0] and kv == g.kvs[0] else None)

    def _translate(self, loc: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Full-pool slots -> SWA slots through the live table (out of range passes through), in a static buffer."""
        out = self.swa_loc[:loc.shape[0]]
        idx = loc.to(torch.int64)
        inside = (idx >= 0) & (idx < table.shape[0])
        out.copy_(table.index_select(0, idx.clamp(0, table.shape[0] - 1)))
        torch.where(inside, out, idx, out=out)
        return out
