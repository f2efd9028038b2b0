"""Build the canary's ``ForwardBatch`` from the batch transformers just prepared (sync IO).

Per request i of ``io.requests_in_batch`` (a ``FutureRequestState``): ``extend = query_length``,
``prefix = state.position_offset - query_length`` (prepare_batch_tensors advanced the offset),
input ids and positions are ``io.input_ids`` / ``io.position_ids`` slices, the written slots are
``io.write_index_storage[full_group]`` (or, on the flash decode fast path, the io block table's).
Each request keeps one canary row while it lives; that row of req_to_token is rebuilt every step
from the indices attention reads through (``io.read_index_storage``, or the io block table on the
flash decode fast path), not from the Python block tables, so the canary checks the addresses the
forward really reads. Its token table row receives only the tokens it has not seen.
"""

from __future__ import annotations

import logging
from operator import add, sub
from types import SimpleNamespace

import numpy as np
import torch

from kvcanary import ops
from kvcanary.ops.read_table_ops import numpy_read_table, torch_read_table
from kvcanary.ops.types import NO_LIMIT
from kvcanary.runtime import ForwardBatch, ForwardMode, TokenAppend
from kvcanary.integrations.transformers.layout import fill_swa_table
from kvcanary.integrations.transformers.staging import HostStep, Staging
from kvcanary.integrations.transformers.tokens import QUERY, STATE, STATE_ID, STATE_OFFSET, TokenRows

log = logging.getLogger("kvcanary")


CPU_WIDTH_STEP = 64  # the CPU's reused batches: read-table columns rounded up to a power of two from this


def bucket(bs: int, cap: int) -> int:
    """The size a decode batch of ``bs`` requests is padded to: the next power of two, at most ``cap`` (and never
    below ``bs``). A batch that shrinks or grows inside its bucket keeps the shape its step graphs were captured
    with (``graphs.py``)."""
    return bs if bs >= cap or bs < 1 else min(1 << (bs - 1).bit_length(), cap)


def table_width(width: int, max_context: int, floor: int) -> int:
    """``width`` rounded up to a power of two of at least ``floor``, never past ``max_context`` (a wider
    batch fails the canary's size check as it is)."""
    return max(width, min(max(floor, 1 << (max(1, width) - 1).bit_length()), max_context))


class BatchBuilder(TokenRows):
    glue = None  # where the canary runs Triton (__init__): glue.py's kernels for the read table and entries
    host_table = None  # where it runs numba: the host read table as one compiled loop (ops.read_table_ops)
    new_reads_match = None  # and the new tokens' read-check shortcut as another

    def __init__(self, session):
        self.s = session
        self.device = session.device
        self.num_rows = session.canary.num_rows
        # Stable canary row per engine request (LRU among requests not in the batch when rows run out):
        # the canary's token table keeps a row's tokens, so only new ones cross to the device.
        self.init_rows(self.num_rows)
        self.next_tokens: torch.Tensor | None = None  # token oracle: tokens _sample must emit this step
        self.want_history = session.handle.options.get("token_history", True) and session.config.token_check
        self.oracle = bool(session.handle.options.get("token_oracle"))
        # one staging buffer on the CPU: there a step's observation is read when the step closes, so no report
        # reads a batch after the next step refilled its buffer, and a reused batch (_cpu_batch) serves every
        # step of its shape, not one step in each of the turns (graphs.py restores the turns: its CPU stand-in
        # replays as CUDA does)
        self.stage = Staging(self.device, 1) if self.device.type == "cpu" else Staging(self.device)
        self.in_block = torch.arange(session.layout.block_size, dtype=torch.int64, device=self.device)
        self.warned_read_size = False
        # decode steps padded to their size bucket (``bucket``; graphs.py sets it where step graphs run): at most
        # this many requests, 0 = no padding
        self.pad_cap = 0
        self.new_reads = ops.Entries.allocate(session.canary.max_tokens, self.device)
        self.iota = torch.arange(1024, dtype=torch.int64, device=self.device)
        self.cpu_batches: dict = {}  # CPU: a reused ForwardBatch per shape (_cpu_batch)
        self.iota_np = np.arange(256, dtype=np.int64)
        # the read table and the new tokens' read entries as one Triton kernel each where the canary runs
        # Triton (glue.py); the torch backend keeps the tensor ops
        backend = ops.resolve_backend(session.config.backend, self.device)
        if backend == "triton":
            from kvcanary.integrations.transformers import glue as hf_glue  # (imports Triton)

            self.glue = hf_glue.IndexKernels()
        elif backend == "numba":
            from kvcanary.integrations.transformers import glue_cpu as hf_glue_cpu  # (imports numba)

            self.host_table, self.new_reads_match = hf_glue_cpu.read_table, hf_glue_cpu.new_reads_match

    def build(self) -> ForwardBatch:
        """This step's batch, its device work issued eagerly."""
        h = self.host_part()
        batch = self._cpu_batch(h) if self.device.type == "cpu" else self.assemble(h)
        self.fill_read_table(batch, h)
        if self.oracle:
            self._oracle(batch, h.reqs, h.prefix, h.extend, h.rids)
        if self.s.layout.swa_group is not None:
            fill_swa_table(self.s.layout, self.s.swa_table, h.io, batch.prefix_lens, batch.extend_lens,
                           max(min(p, self.s.layout.window) for p in h.prefix), h.T, batch.out_cache_loc, self._arange)
        return batch

    def _cpu_batch(self, h: HostStep) -> ForwardBatch:
        """On the CPU a step's observation is read when the step closes, so no report reads a batch
        after the next one is built: a batch object (views and read table) is reused for every step
        of the same shape instead of being assembled anew (a score of tensor views per step)."""
        io = h.io
        # the read table's width rounded up: decode steps grow it by one column each, and cells past a
        # request's length are never read, so one batch serves many steps
        width = table_width(h.width, self.s.canary.max_context, CPU_WIDTH_STEP)
        key = (h.bs, h.T, h.small, width, h.packed.data_ptr(), io.input_ids.data_ptr(), io.position_ids.data_ptr(),
               io.write_index_storage.data_ptr(), io.read_index_storage.data_ptr(), io.use_block_table)
        batch = self.cpu_batches.get(key)
        if batch is None:
            batch = self.cpu_batches[key] = self.assemble(h, width)
            # numpy views of its tensors, made once: a tensor call costs tens of microseconds inside the
            # engine's step (cold caches after the forward), a numpy read of a view far less
            batch.host_views = self._views(batch, io)
            if len(self.cpu_batches) > 64:
                self.cpu_batches.pop(next(iter(self.cpu_batches)))
        return batch

    def _views(self, batch: ForwardBatch, io) -> SimpleNamespace:
        return SimpleNamespace(rows=batch.req_pool_indices.numpy(), prefix=batch.prefix_lens.numpy(),
                               extend=batch.extend_lens.numpy(), token_req=batch.token_req.numpy(),
                               positions=batch.positions.numpy(), loc=batch.out_cache_loc.numpy(),
                               rtt=batch.req_to_token.numpy(),
                               read=io.read_index_storage[self.s.layout.full_group].numpy())

    def host_part(self, copy: bool = True, padded: bool = False) -> HostStep:
        """The host half of a step: per-request facts and token cells, staged to the device in one copy
        (``copy=False``: left to the caller, ``Staging.copy``). ``padded``: a decode step's batch is padded to
        its size bucket (``pad_cap``) with padding requests (SPEC: row 0, prefix 0, one token each, after
        every real request; no token cell of their own but a write of token 0 into the token table's padding
        row), which the plan, the writes, the read table and the new tokens' read check all skip.

        Per-request attributes are read with ``map`` over ``attrgetter`` (C loops, no Python frame per
        request), and a batch of the same requests as the last step reuses its rows and ids.
        """
        s = self.s
        io = s.bp.inputs_and_outputs
        reqs = io.requests_in_batch
        bs = len(reqs)
        states = list(map(STATE, reqs))
        # the same request states as the last step (compared by identity first: one C loop), each one position
        # further (``_steady`` checks the offsets, which the engine advanced by each request's query length)
        if states == self.last_states:
            h = self._steady(io, reqs, states, copy, padded)
            if h is not None:
                return h
        extend = list(map(QUERY, reqs))
        one_each = extend.count(1) == bs  # a decode step: one new token per request
        names = list(map(STATE_ID, states))
        offsets = list(map(STATE_OFFSET, states))
        T = sum(extend)
        self.sync_sent()
        self.steady = None  # rows, ids or token cells may change below: the steady path starts again
        prefix = list(map(sub, offsets, extend))
        if names == self.last_names:
            rows, rids = self.last_rows, self.last_rids
        else:
            rows = self._rows(names)
            ids = s.ids
            rids = [ids.get(n) or s.request_id(n) for n in names]
            self.last_names, self.last_rows, self.last_rids = names, rows, rids
        self.last_states = states
        cells = self._token_cells(reqs, names, rows, prefix, extend, one_each) if self.want_history else []
        pad = self.padding(io, bs) if padded and one_each and len(cells) < 2 else 0  # (long runs: never decode)
        if pad:
            z = [0] * pad
            parts = [rows + z + prefix + z + extend + [1] * pad + rids + z]
            if cells:
                c, k = cells[0], (len(cells[0]) - bs) // 3  # valid lengths, then k cell rows, columns, tokens
                cells = [c[:bs] + z + c[bs:bs + k] + z + c[bs + k:bs + 2 * k] + z + c[bs + 2 * k:] + z]
        else:
            parts = [rows + prefix + extend + rids]
        parts += cells
        # Each new token's batch index, made on the host (CPU repeat_interleave is slow at small sizes).
        parts.append(self._iota_np(bs + pad) if one_each else np.repeat(self._iota_np(bs), extend))
        packed, small = self.stage.send(parts, copy)
        width = max(map(add, prefix, extend), default=0)
        return HostStep(io, reqs, bs + pad, T + pad, prefix, extend, rids, packed, 4 * (bs + pad), small, width,
                        sum(prefix) + T, pad)

    def padding(self, io, bs: int) -> int:
        """Padding requests that take a decode step of ``bs`` requests to its bucket: within the canary's sizes
        and the engine's input storages (their cells past the real tokens are read, never written)."""
        if not self.pad_cap:
            return 0
        cap = min(self.pad_cap, io.input_ids.shape[0], io.position_ids.shape[0], io.write_index_storage.shape[1])
        return bucket(bs, cap) - bs

    def _iota_np(self, n: int) -> np.ndarray:
        if self.iota_np.shape[0] < n:
            self.iota_np = np.arange(max(n, 2 * self.iota_np.shape[0]), dtype=np.int64)
        return self.iota_np[:n]

    def assemble(self, h: HostStep, width: int | None = None) -> ForwardBatch:
        """The ForwardBatch of views into the staged buffer, the engine's inputs and a read table of
        ``width`` columns (not yet filled: ``fill_read_table``)."""
        lay, io, bs, T, packed = self.s.layout, h.io, h.bs, h.T, h.packed
        rows_t, prefix_t, extend_t, rids_t = (packed[i * bs:(i + 1) * bs] for i in range(4))
        token_req = packed[h.small:]
        input_ids, positions = io.input_ids[:T], io.position_ids[:T]
        width = max(1, h.width if width is None else width)
        if io.use_block_table:
            nb = min(-(-width // lay.block_size), io.block_table.shape[2])
            rtt = torch.empty(self.num_rows, nb * lay.block_size, dtype=torch.int64, device=self.device)
            # Flash decode fast path: write_index is not filled; the kernel writes through the block table.
            out_cache_loc = torch.empty(T, dtype=torch.int64, device=self.device)
        else:
            rtt = torch.empty(self.num_rows, width, dtype=torch.int64, device=self.device)
            out_cache_loc = io.write_index_storage[lay.full_group, :T]
        batch = ForwardBatch(req_pool_indices=rows_t, prefix_lens=prefix_t, extend_lens=extend_t,
                             input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                             req_to_token=rtt, request_ids=rids_t,
                             mode=ForwardMode.DECODE if T == bs else ForwardMode.EXTEND)
        batch.token_req = token_req  # each new token's batch index (verify_new_reads, the block-table path)
        if self.want_history:
            k = (h.small - h.n - bs) // 3
            c0 = h.n + bs
            batch.token_history = TokenAppend(packed[c0:c0 + k], packed[c0 + k:c0 + 2 * k],
                                              packed[c0 + 2 * k:c0 + 3 * k], packed[h.n:h.n + bs])
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
        g, B = self.s.layout.full_group, self.s.layout.block_size
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
        if self.glue is not None and self.glue.ok:  # one kernel (glue.py) for the tensor ops
            glue, limits = self.glue, self._read_limits(have, total, read.shape[0])
            glue.run("read table", lambda: glue.read_table(rtt, rows_t, prefix_t, extend_t, read, *limits),
                     lambda: self._read_table_ops(read, rows_t, prefix_t, extend_t, rtt, have, total), (rtt,))
            return rtt
        return self._read_table_ops(read, rows_t, prefix_t, extend_t, rtt, have, total)

    def _have(self, io, total: int) -> int:
        """The slots of the ``total`` prefix + new positions the engine's read index lists (a warning, once,
        when it lists fewer)."""
        listed = io.true_read_sizes[self.s.layout.full_group]
        if listed < total and not self.warned_read_size:
            self.warned_read_size = True
            log.warning("kv-canary: the engine's read index lists %d slots for %d prefix + new positions",
                        listed, total)
        return min(total, listed)

    def _read_limits(self, have: int, total: int, n_read: int) -> tuple[int, int, int]:
        """The read-table loops' (clamp_max, limit, fill): a read index listing all ``total`` slots is read up
        to its end; one listing only ``have`` gives cells past them an out-of-range slot (``_read_table_ops``)."""
        if have == total:
            return n_read - 1, NO_LIMIT, 0
        return max(0, have - 1), have, self.s.layout.num_slots

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

    def verify_new_reads(self, batch: ForwardBatch, shortcut: bool = True) -> None:
        """HEAD-verify the slots the forward reads for its own new tokens, after the HEAD write.

        Full attention writes the new tokens, then reads positions [0, prefix + extend) through the
        read index: the plan verifies the prefix, and this checks that the read index's new cells
        hold the records just written at the write index (a read index that disagrees with the
        write index for a new token is reported before the forward reads it).
        """
        io, T = self.s.bp.inputs_and_outputs, batch.num_tokens
        if io.use_block_table or io.max_kv_read == 0 or not T:
            return  # the fast path reads through the table the writes used; no read of the cache at all
        c = self.s.canary
        g = c.groups[0]
        rtt = batch.req_to_token
        # Where every read cell is the write cell the check holds by construction (the HEAD write just
        # stored those records); on the CPU that comparison costs no sync and saves the verify (not
        # inside a captured step: its outcome would be baked into the capture).
        if shortcut and self.device.type == "cpu":
            v = getattr(batch, "host_views", None) or self._views(batch, io)
            match = self.new_reads_match
            same = -1 if match is None else match(v.rtt, v.rows, v.token_req, v.positions, v.loc)
            if same == 1 or (same == -1 and np.array_equal(v.rtt[v.rows[v.token_req], v.positions], v.loc)):
                return
        e = self.new_reads
        rows, extend, token_req = batch.req_pool_indices, batch.extend_lens, batch.token_req
        if self.glue is not None and self.glue.ok:  # one kernel (glue.py) for the tensor ops
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

    def _oracle(self, batch, reqs, prefix, extend, rids) -> None:
        """Expected inputs (prompt, then oracle tokens) and the tokens the sampler will be forced to emit."""
        s = self.s
        exp_ids, exp_pos, forced = [], [], []
        for fs, p, q, rid in zip(reqs, prefix, extend, rids):
            st = fs.state
            n0 = st._true_initial_tokens or len(st.initial_tokens)
            for pos in range(p, p + q):
                exp_ids.append(st.initial_tokens[pos] if pos < n0 else s.oracle(rid, pos))
                exp_pos.append(pos)
            if fs.has_new_token:
                forced.append(s.oracle(rid, p + q))
        packed = torch.tensor(exp_ids + exp_pos, dtype=torch.int64).to(self.device)
        batch.expected_input_ids, batch.expected_positions = packed[:len(exp_ids)], packed[len(exp_ids):]
        self.next_tokens = torch.tensor(forced, dtype=torch.int64)


def new_read_ops(e, rtt, rows, extend, token_req, positions, input_ids) -> None:
    """The new tokens' read entries as tensor ops (``glue.new_read_entries``'s twin, cell for cell): the
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
