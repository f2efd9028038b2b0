"""The runner's per-step batch work: the canary's ``ForwardBatch`` from a source's host part and device inputs
(``runtime/engine.py``), its read table from the engine's read index, and the new tokens' read check.

The batch's tensors are views into the staged buffer (rows, prefix and extend lengths, request ids, token
cells, each new token's batch index) and into the engine's input storages (input ids, positions, write
slots). Each request keeps one canary row; that row of req_to_token is rebuilt every step from the indices
attention reads through (the read index storage, or the block table on the decode fast path), so the canary
checks the addresses the forward really reads.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import torch

from kvcanary import ops
from kvcanary.ops.read_table_ops import compiled_loop, compiled_new_reads_match, numpy_read_table, torch_read_table
from kvcanary.ops.types import NO_LIMIT
from kvcanary.runtime.batch import ForwardBatch, ForwardMode, TokenAppend
from kvcanary.runtime.engine import HostStep
from kvcanary.runtime.step.plans import Plan, Plans, StepKey, table_width

__all__ = ["StepTables", "bucket", "new_read_ops", "table_width"]

log = logging.getLogger("kvcanary")

CPU_WIDTH_STEP = 64  # the CPU's reused batches: read-table columns rounded up to a power of two from this


def bucket(bs: int, cap: int) -> int:
    """The size a decode batch of ``bs`` requests is padded to: the next power of two, at most ``cap`` (and never
    below ``bs``). A batch that shrinks or grows inside its bucket keeps the shape its step graphs were captured
    with (``graphs.py``)."""
    return bs if bs >= cap or bs < 1 else min(1 << (bs - 1).bit_length(), cap)


class StepTables:
    """A source's steps as ``ForwardBatch``es: assembled, their read tables filled, the new tokens' reads checked."""

    glue = None  # where the canary runs Triton (__init__): kernels.py's kernels for the read table and entries
    host_table = None  # where it runs numba: the host read table as one compiled loop (ops.read_table_ops)
    new_reads_match = None  # and the new tokens' read-check shortcut as another
    # The CPU's shortcut of the new tokens' read check (verify_new_reads): where every read cell is its write
    # cell the check holds by construction and its verify is skipped, so ``entries_checked`` counts fewer entries
    # than a run that verifies them (a captured step, CUDA). Every CPU route (the full path and the numba steady
    # step alike) honours this switch; tests comparing a captured route with an eager run turn it off.
    new_reads_shortcut = True

    def __init__(self, canary, source):
        self.canary, self.source = canary, source
        self.device = canary.device
        self.num_rows = canary.num_rows
        self.group, self.block_size, self.num_slots = source.group, source.block_size, source.num_slots
        self.want_history = bool(getattr(source, "want_history", False))
        self.in_block = torch.arange(self.block_size, dtype=torch.int64, device=self.device)
        self.warned_read_size = False
        self.new_reads = ops.Entries.allocate(canary.max_tokens, self.device)
        self.iota = torch.arange(1024, dtype=torch.int64, device=self.device)
        self.plans = Plans(64)  # CPU: a reused ForwardBatch per step key (_cpu_batch); the bound plan's (steady.py)
        # the read table and the new tokens' read entries as one Triton kernel each where the canary runs
        # Triton (kernels.py); the torch backend keeps the tensor ops
        backend = ops.resolve_backend(canary.config.backend, self.device)
        if backend == "triton":
            from kvcanary.runtime.step import kernels  # (imports Triton)

            self.glue = kernels.IndexKernels(self.device)
        elif backend == "numba":  # (compiled on first use: numba imports then)
            self.host_table, self.new_reads_match = compiled_loop(), compiled_new_reads_match()

    def build(self, h: HostStep, key: StepKey | None) -> ForwardBatch:
        """This step's batch (from host part ``h``, whose key is ``key``), its device work issued eagerly. ``key``
        None: a source whose steps seldom share a key (vLLM's, which sends every request's whole token history:
        the cell count changes each step) has its batch assembled anew, not kept per key (``_cpu_batch``)."""
        src = self.source
        self.check_read_length(h)
        batch = self._cpu_batch(h, key) if self.device.type == "cpu" and key is not None else self.assemble(h)
        self.fill_read_table(batch, h)
        src.finish(batch, h, self._arange)
        return batch

    def _cpu_batch(self, h: HostStep, key: StepKey) -> ForwardBatch:
        """On the CPU a step's observation is read when the step closes, so no report reads a batch
        after the next one is built: a batch object (views and read table) is reused for every step
        with the same key (``plans``: the eager stage of its plan) instead of being assembled anew (a score
        of tensor views per step). Its read table has the key's width: decode steps grow it by one column each,
        and cells past a request's length are never read, so one batch serves many steps."""
        plan = self.plans.get(key)
        if plan is None:
            batch = self.assemble(h, key.width)
            # numpy views of its tensors, made once: a tensor call costs tens of microseconds inside the
            # engine's step (cold caches after the forward), a numpy read of a view far less
            batch.host_views = self._views(batch, h.io)
            self.plans.add(key, plan := Plan(batch))
        return plan.batch

    def _views(self, batch: ForwardBatch, io) -> SimpleNamespace:
        return SimpleNamespace(rows=batch.req_pool_indices.numpy(), prefix=batch.prefix_lens.numpy(),
                               extend=batch.extend_lens.numpy(), token_req=batch.token_req.numpy(),
                               positions=batch.positions.numpy(), loc=batch.out_cache_loc.numpy(),
                               rtt=batch.req_to_token.numpy(),
                               read=io.read_index_storage[self.group].numpy())

    def assemble(self, h: HostStep, width: int | None = None) -> ForwardBatch:
        """The ForwardBatch of views into the staged buffer, the engine's inputs and a read table of
        ``width`` columns (not yet filled: ``fill_read_table``)."""
        io, bs, T, B = h.io, h.bs, h.T, self.block_size
        p = h.unpack()
        rows_t, prefix_t, extend_t, rids_t, token_req = p.rows, p.prefix, p.extend, p.rids, p.token_req
        input_ids, positions = io.input_ids[:T], io.position_ids[:T]
        width = max(1, h.width if width is None else width)
        if io.use_block_table:
            nb = min(-(-width // B), io.block_table.shape[2])
            rtt = torch.empty(self.num_rows, nb * B, dtype=torch.int64, device=self.device)
            # Flash decode fast path: write_index is not filled; the kernel writes through the block table.
            out_cache_loc = torch.empty(T, dtype=torch.int64, device=self.device)
        else:
            rtt = torch.empty(self.num_rows, width, dtype=torch.int64, device=self.device)
            out_cache_loc = io.write_index_storage[self.group, :T]
        batch = ForwardBatch(req_pool_indices=rows_t, prefix_lens=prefix_t, extend_lens=extend_t,
                             input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                             req_to_token=rtt, request_ids=rids_t,
                             mode=ForwardMode.DECODE if T == bs else ForwardMode.EXTEND)
        batch.token_req = token_req  # each new token's batch index (verify_new_reads, the block-table path)
        if self.want_history:
            batch.token_history = TokenAppend(p.cell_rows, p.cell_cols, p.cell_tokens, p.valid)
        return batch

    def fill_read_table(self, batch: ForwardBatch, h: HostStep, captured: bool = False) -> None:
        """Fill the batch's read table (and on the flash path its write slots) for this step; ``captured``:
        tensor ops only (a captured step replays device work, not host code)."""
        rtt = batch.req_to_token
        self._read_table(h.io, batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, rtt.shape[1], h.total,
                         out=rtt, host=not captured, views=getattr(batch, "host_views", None))
        if h.io.use_block_table:
            # Flash decode fast path: write_index is not filled; the kernel writes through the block table.
            batch.out_cache_loc.copy_(rtt[batch.req_pool_indices[batch.token_req], batch.positions.to(torch.int64)])

    def _read_table(self, io, rows_t, prefix_t, extend_t, width: int, total: int, out=None,
                    host: bool = True, views: SimpleNamespace | None = None) -> torch.Tensor:
        """req_to_token from the indices the forward's attention consumes, not from the block tables.

        Full-attention layers read ``read_index[g]`` (sdpa / eager: per request, the slots of
        positions [0, prefix + extend), after the forward's writes), or on the flash decode fast
        path the io's block table (slot = block * B + offset). Row r of the batch's rows gets its
        request's slots; other rows and columns past a request's length are never read.
        """
        g, B = self.group, self.block_size
        if io.use_block_table:
            nb = min(-(-width // B), io.block_table.shape[2])
            blocks = io.block_table[g, :rows_t.shape[0], :nb].to(torch.int64)
            rtt = torch.empty(self.num_rows, nb * B, dtype=torch.int64, device=self.device) if out is None else out
            rtt.view(self.num_rows, -1, B)[rows_t, :nb] = torch.add(self.in_block[:B], blocks.unsqueeze(2), alpha=B)
            return rtt
        rtt = torch.empty(self.num_rows, max(1, width), dtype=torch.int64, device=self.device) if out is None else out
        if io.max_kv_read == 0:
            return rtt  # nothing is read from the cache (fresh prefills only): no prefix to verify
        if host and rtt.device.type == "cpu":
            # numpy: the same cells, without a dozen tensor ops (each costs the host microseconds here)
            if views is None:
                views = SimpleNamespace(rows=rows_t.numpy(), prefix=prefix_t.numpy(), extend=extend_t.numpy(),
                                        rtt=rtt.numpy(), read=io.read_index_storage[g].numpy())
            self._fill_host(views, io, total)
            return rtt
        have = self._have(io, total)
        read = io.read_index_storage[g]
        if self.glue is not None and self.glue.ok:  # one kernel (kernels.py) for the tensor ops
            glue, limits = self.glue, self._read_limits(have, total, read.shape[0])
            glue.run("read table", lambda: glue.read_table(rtt, rows_t, prefix_t, extend_t, read, *limits),
                     lambda: self._read_table_ops(read, rows_t, prefix_t, extend_t, rtt, have, total), (rtt,))
            return rtt
        return self._read_table_ops(read, rows_t, prefix_t, extend_t, rtt, have, total)

    def _have(self, io, total: int) -> int:
        """The slots of the ``total`` prefix + new positions the engine's read index lists (a warning, once,
        when it lists fewer)."""
        listed = io.true_read_sizes[self.group]
        if listed < total and not self.warned_read_size:
            self.warned_read_size = True
            log.warning("kv-canary: the engine's read index lists %d slots for %d prefix + new positions",
                        listed, total)
        return min(total, listed)

    def check_read_length(self, h: HostStep) -> None:
        """Report a read index that lists more cells than the batch has live positions (``read_past_length``):
        attention reads as many keys as the index lists, so the extra cells are read as live although they lie
        past the requests' lengths (a partial block's unused tail). Host numbers only (the listed count and
        ``h.total``); the first extra cell's slot goes into the row on the device. A total over the batch: an
        extra cell in one request and a missing one in another cancel here (the missing one is still reported,
        as a never-written cell: ``_have``). Every path calls it (eager ``build``, the runner's captured and
        fused steps), before the step's checks."""
        io = h.io
        if io.use_block_table or io.max_kv_read == 0:
            return  # the fast path reads through the block table; no cache read at all
        listed = io.true_read_sizes[self.group]
        if listed > h.total:
            extra = io.read_index_storage[self.group, h.total:h.total + 1]
            self.canary.slots.read_past_length(h.total, listed, extra if extra.shape[0] else None)

    def _read_limits(self, have: int, total: int, n_read: int) -> tuple[int, int, int]:
        """The read-table loops' (clamp_max, limit, fill): a read index listing all ``total`` slots is read up
        to its end; one listing only ``have`` gives cells past them an out-of-range slot (``_read_table_ops``)."""
        if have == total:
            return n_read - 1, NO_LIMIT, 0
        return max(0, have - 1), have, self.num_slots

    def _read_table_ops(self, read, rows_t, prefix_t, extend_t, rtt, have: int, total: int) -> torch.Tensor:
        """``_read_table``'s device path as tensor ops (``ops.read_table``'s torch body, unvalidated: it runs
        every step). Cells the read index lacks get an out-of-range slot, which verifies as a never-written
        record: a short read index is reported against the request that misses slots."""
        torch_read_table(rtt, rows_t, prefix_t, extend_t, read, *self._read_limits(have, total, read.shape[0]),
                         cols=self._arange(rtt.shape[1]))
        return rtt

    def _fill_host(self, v, io, total: int) -> None:
        """The numpy read table from numpy views (``_cpu_batch`` keeps a reused batch's views)."""
        read, out, rows = v.read, v.rtt, v.rows
        limits = self._read_limits(self._have(io, total), total, read.shape[0])
        # (numba: one compiled pass; else numpy: the same cells, ops.read_table's host bodies, unvalidated)
        (self.host_table or numpy_read_table)(out, rows, v.prefix, v.extend, read, *limits)

    def verify_new_reads(self, batch: ForwardBatch, shortcut: bool | None = None) -> None:
        """HEAD-verify the slots the forward reads for its own new tokens, after the HEAD write.

        Full attention writes the new tokens, then reads positions [0, prefix + extend) through the
        read index: the plan verifies the prefix, and this checks that the read index's new cells
        hold the records just written at the write index (a read index that disagrees with the
        write index for a new token is reported before the forward reads it).
        """
        io, T = self.source.inputs, batch.num_tokens
        if io.use_block_table or io.max_kv_read == 0 or not T:
            return  # the fast path reads through the table the writes used; no read of the cache at all
        c = self.canary
        g = c.groups[0]
        rtt = batch.req_to_token
        # Where every read cell is the write cell the check holds by construction (the HEAD write just
        # stored those records); on the CPU that comparison costs no sync and saves the verify (not
        # inside a captured step: its outcome would be baked into the capture). None: ``new_reads_shortcut``.
        if shortcut is None:
            shortcut = self.new_reads_shortcut
        if shortcut and self.device.type == "cpu":
            v = getattr(batch, "host_views", None) or self._views(batch, io)
            match = self.new_reads_match
            same = -1 if match is None else match(v.rtt, v.rows, v.token_req, v.positions, v.loc)
            if (same == 1 or (same == -1 and np.array_equal(v.rtt[v.rows[v.token_req], v.positions], v.loc))) \
                    and not c.slots.names_reserved(v.loc):  # (a reserved cell is reported as the full path does)
                return
        e = self.new_reads
        rows, extend, token_req = batch.req_pool_indices, batch.extend_lens, batch.token_req
        if self.glue is not None and self.glue.ok:  # one kernel (kernels.py) for the tensor ops
            glue = self.glue
            glue.run("new tokens' read entries", lambda: glue.new_read_entries(
                e, rtt, rows, extend, token_req, batch.positions, batch.input_ids),
                lambda: new_read_ops(e, rtt, rows, extend, token_req, batch.positions, batch.input_ids),
                (e.slot, e.position, e.prev, e.expected_token, e.count, e.requested, e.enable))
        else:
            new_read_ops(e, rtt, rows, extend, token_req, batch.positions, batch.input_ids)
        # On the side stream, ordered after HEAD's write and after the entries filled here; the step's
        # close joins it, so the next step's fill cannot overwrite entries still being read.
        with c.launcher.side():
            for kv in g.kvs:
                ops.verify(buf=g.bufs["head", kv], entries=self.new_reads, ring=c.ring, counters=c.counters,
                           launch_tag=g.tag("head", kv), backend=c.config.backend)
            c.slots.check_entries(self.new_reads, g.tag("head", "k"))  # (the verify skips slot 0: runtime/slots.py)

    def _arange(self, n: int) -> torch.Tensor:
        if self.iota.shape[0] < n:
            self.iota = torch.arange(max(n, 2 * self.iota.shape[0]), dtype=torch.int64, device=self.device)
        return self.iota[:n]


def new_read_ops(e, rtt, rows, extend, token_req, positions, input_ids) -> None:
    """The new tokens' read entries as tensor ops (``kernels.new_read_entries``'s twin, cell for cell): the
    counts are those of the real tokens, and a padding token (its request in row 0) reads no cell."""
    per = rows[token_req]
    real = per != 0
    pos = torch.where(real, positions.to(torch.int64), 0)
    slots = torch.where(real, rtt[per, pos], 0)
    prev = torch.where(real & (pos > 0), rtt[per, (pos - 1).clamp(min=0)], -1)
    ops.fill_entries(e, slots, pos, prev, input_ids)
    n = torch.where(rows != 0, extend.to(torch.int64), 0).sum()
    e.requested.copy_(n.view(1))
    e.count.copy_(n.clamp(max=e.capacity).view(1))
    e.enable.copy_((n <= e.capacity).view(1))
