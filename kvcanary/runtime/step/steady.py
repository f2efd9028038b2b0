"""The CPU's steady step: a decode step shaped like one the runner already took runs from a bound plan.

The CPU analogue of the accelerator's fused step (``fused.py``). An eager step on the CPU with the compiled
backend (numba) passes the builder, the canary's host checks, the launcher, the slot checks, the monitor and
the observer, each resolving again what the step before resolved: views, argument lists, validation of
tensors it validated then. Once such a step has run, ``SteadyStep.bind`` keeps its reused batch
(``StepTables._cpu_batch``) with the compiled calls bound to it (``ops.numba_steady.SteadyCalls``); a later
step with the same key (the same shape, read-table width bucket and storages) runs:

- before the forward: the source's host part (staged into the batch's buffer: ``SteadyStaging``), then one
  compiled pass for the checks ``host_before`` makes (values, distinct rows), the read table, the token cells,
  HEAD (plan, verify, write) and the slot and new-read tests (``SteadyCalls.before``);
- after it: TAIL (``SteadyCalls.after``), the non-finite KV test, and the step's close: ``Canary.close_step``,
  the one close every route shares (the step opened with ``Canary.open_recorded``).

Whatever differs from the bound step goes the full way: a step whose key differs, or whose canary state is not
the bound one (a forward open, work pending, observations queued); a check that fails (the full path then
reports or raises it, from the start); a finding of the slot or new-read tests (their full paths run, and
report it); a sweep or allocator check due at the step's close (``Canary.plain_close``). So every report,
record and stat is the full path's (tests/test_steady_step.py).
"""

from __future__ import annotations

from kvcanary.ops.slot_ops import EXPONENT
from kvcanary.runtime.batch import TokenAppend
from kvcanary.runtime.slots import _NP_INT
from kvcanary.runtime.step.staging import Staging
from kvcanary.runtime.step.tables import CPU_WIDTH_STEP, table_width
from kvcanary.runtime.streams import InlineStreams

__all__ = ["SteadyStaging", "SteadyStep"]


class SteadyStaging(Staging):
    """The CPU's staging (one turn): a steady step's kept values (one memoryview) copied into the buffer view
    kept for their size, with no call of ``Staging.send``; anything else is ``Staging.send``."""

    def send(self, parts: list, copy: bool = True, last: int | None = None):
        words = parts[0]
        if len(parts) == 1 and type(words) is memoryview and last is not None:
            views = self.views.get((0, len(words)))
            if views is not None:
                views[4][:] = words
                self.last_ptr = views[3]
                return views[0], len(words) - last
        return Staging.send(self, parts, copy, last)


class _Bound:
    """The CPU recorder's recording of a plan (``plans.Plan.bound``): the key it was bound under, the width it was
    bound at (a later step's may grow up to the key's bucket), the compiled calls and what the close reads."""

    __slots__ = ("key", "lo", "calls", "loc", "offs", "finite")


class SteadyStep:
    """The runner's steady steps on the CPU (``StepRunner.steady``); ``taken`` / ``closed``: steps whose before /
    after work ran bound."""

    def __init__(self, runner):
        self.runner, self.canary, self.tables, self.source = runner, runner.canary, runner.tables, runner.source
        self.group = runner.group
        self.bound = None  # the plan (``plans.Plan``, of ``tables.plans``) bound last: its steps run from its recording
        self.open = None  # the batch of a step whose before work ran bound (its after work may too)
        self.taken = self.closed = 0

    @staticmethod
    def applies(runner) -> bool:
        """The CPU, eager steps, the compiled backend with its fused HEAD and TAIL calls, one group."""
        c = runner.canary
        return (c.device.type == "cpu" and runner.graphs is None and runner.options.steady_steps
                and runner.tables.host_table is not None and len(c.groups) == 1)

    # -- binding ---------------------------------------------------------------------------------
    def bind(self, h, key, batch) -> None:
        """After an eager step's before work: record the plan of ``key`` (its batch ``batch``, built from host part
        ``h``) as compiled calls bound to that batch, if every condition of a bound step holds for it (else keep
        what was bound). One plan is bound at a time."""
        c, io, launcher = self.canary, h.io, self.canary.launcher
        plan = self.bound
        if plan is not None and plan.batch is batch:
            return
        plan = self.tables.plans.get(key)
        if plan is None or plan.batch is not batch:
            return
        width = batch.req_to_token.shape[1]
        if (not c.enabled or not c._check_values or c.injector is not None or c.config.check_before_forward
                or c.host_times is not None or type(launcher.streams) is not InlineStreams or not launcher.host_ops
                or not c.monitor.observer.eager_read
                or self.source.oracle or self.source.windowed or h.pad or not h.T or io.use_block_table
                or not io.max_kv_read or io.true_read_sizes[self.group] != h.total or batch.token_offset
                or batch.expected_input_ids is not None or getattr(batch, "host_views", None) is None
                or table_width(h.width, c.max_context, CPU_WIDTH_STEP) != width
                or not isinstance(batch.token_history, (TokenAppend, type(None)))):
            return
        g = c.groups[0]
        hist = batch.token_history
        head, tail = self._phase_kw(batch)
        if head is None or tail is None:
            return
        from kvcanary.ops.numba_steady import SteadyCalls  # (imports numba)

        read = io.read_index_storage[self.group]
        calls = SteadyCalls.bind(batch=batch, read=read, clamp_max=read.shape[0] - 1, tokens=c.token_table,
                                 has_cells=bool(c.config.token_check and hist is not None), reserved=c.slots.reserved,
                                 num_rows=c.num_rows, num_slots=c.pool.num_slots, max_context=c.max_context,
                                 head_kw=head, tail_kw=tail, sources=g.sources[g.kvs[0]],
                                 real_kv_mode=c._mode(g, g.kvs[0]))
        if calls is None:
            return
        b = _Bound()
        b.key, b.lo, b.calls = key, h.width, calls
        b.loc, b.offs = batch.out_cache_loc.numpy(), g.plan.write_offsets.numpy()
        # the non-finite KV test's sources as the slot checks read them (``slots._finite_np``)
        b.finite = [(src.num_slots, src.page_size, EXPONENT[src.tensor.dtype],
                     src.byte_rows().numpy().view(_NP_INT[src.tensor.dtype.itemsize]).reshape(
                         src.tensor.shape[0], src.page_size, -1)) for _, _, src in c.slots.float_sources]
        if self.bound is not None:
            self.bound.bound = None  # (its recording goes: its steps take the eager path again)
        plan.bound, plan.state = b, launcher.state()  # (the state: what the after work reads, restored at each open)
        self.bound = plan

    def _phase_kw(self, batch):
        """The launcher's fused HEAD and TAIL keyword dicts for ``batch`` (its inputs are the bound ones)."""
        launcher, c, g = self.canary.launcher, self.canary, self.canary.groups[0]
        hist = batch.token_history
        table, valid = (c.token_table, hist.valid_lens) if c.config.token_check and hist is not None else (None, None)
        plan = dict(req_pool_indices=batch.req_pool_indices, prefix_lens=batch.prefix_lens,
                    extend_lens=batch.extend_lens, req_to_token=batch.req_to_token, out=g.plan, window=g.window,
                    full_to_swa=g.table, token_table=table, token_valid_lens=valid, token_offset=batch.token_offset)
        return launcher.fused_kw("head", plan), launcher.fused_kw("tail")

    # -- per step --------------------------------------------------------------------------------
    def before(self, h, key):
        """The step's before work from the bound plan, where step ``h``'s key ``key`` is the plan's (and its width
        not below the one bound); its batch, or None (nothing done: the full path)."""
        plan, c, io = self.bound, self.canary, h.io
        if plan is None:
            return None
        b = plan.bound
        if (key != b.key or c.open_batch is not None or h.width < b.lo or h.pad
                or io.true_read_sizes[self.group] != h.total  # (the key says >=: a longer read index is reported)
                or c.monitor.observer.order or c.launcher.pending is not None):
            return None
        code = b.calls.before()
        if code < 0:
            return None
        batch = plan.batch
        c.open_recorded(batch, plan.state)
        # (a finding: the full paths of the checks that found it report it; the shortcut off, the new reads'
        # verify runs as on the full path, so that both routes count the same entries checked)
        if code or not self.tables.new_reads_shortcut:
            if code == 1:
                c.slots.before()
            self.tables.verify_new_reads(batch)
        self.open = batch
        self.taken += 1
        return batch

    def after(self, batch) -> bool:
        """The step's after work from the bound plan, then the step's close (``Canary.close_step``, the close
        every route shares); False (nothing done) where the full path takes it."""
        plan, c = self.bound, self.canary
        if self.open is not batch or plan is None or plan.batch is not batch or c.open_batch is not batch:
            self.open = None
            return False
        self.open = None
        b = plan.bound
        if not c.plain_close() or not b.calls.after():  # (a sweep or allocator check due: the full path)
            return False
        if b.finite:
            live = b.loc[:b.offs[plan.state[1][0]]]  # (the launcher's key: the batch size first)
            for num_slots, ps, exp, rows in b.finite:
                s = live[(live >= 1) & (live < num_slots)]
                if s.shape[0] and ((rows[s // ps, s % ps] & exp) == exp).any():
                    c.slots.after()  # (reports the first such token and source)
                    break
        c.write_check.after()  # (a no-op with nothing noted; a finding is read by the close)
        c.close_step(batch)
        self.closed += 1
        return True
