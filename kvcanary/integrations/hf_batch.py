"""Build the canary's ``ForwardBatch`` from the batch transformers just prepared (sync IO).

Per request i of ``io.requests_in_batch`` (a ``FutureRequestState``): ``extend = query_length``,
``prefix = state.position_offset - query_length`` (prepare_batch_tensors advanced the offset),
input ids and positions are ``io.input_ids`` / ``io.position_ids`` slices, the written slots are
``io.write_index_storage[full_group]`` (or, on the flash decode fast path, the table's). Each request
keeps one canary row while it lives; that row of req_to_token is rebuilt from the request's block
table every step, and its token table row receives only the tokens it has not seen.
"""

from __future__ import annotations

import collections

import torch

from kvcanary.runtime import ForwardBatch, ForwardMode, TokenAppend
from kvcanary.runtime.monitor import KEEP_BATCHES

_STATUS_FINISHED = 3  # transformers RequestStatus.FINISHED


class BatchBuilder:
    def __init__(self, session):
        self.s = session
        self.device = session.device
        self.num_rows = session.canary.num_rows
        # Stable canary row per engine request (LRU among requests not in the batch when rows run out):
        # the canary's token table keeps a row's tokens, so only new ones cross to the device.
        self.row_of: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.sent: dict[str, int] = {}  # tokens of the request already in its token table row
        self.free = list(range(self.num_rows - 1, 0, -1))
        self.next_tokens: torch.Tensor | None = None  # token oracle: tokens _sample must emit this step
        self.want_history = session.handle.options.get("token_history", True) and session.config.token_check
        self.oracle = bool(session.handle.options.get("token_oracle"))
        self.stage = Staging(self.device)
        self.in_block = torch.arange(session.layout.block_size, dtype=torch.int64, device=self.device)

    def build(self) -> ForwardBatch:
        s, lay = self.s, self.s.layout
        bp = s.bp
        io = bp.inputs_and_outputs
        reqs = io.requests_in_batch
        bs, B = len(reqs), lay.block_size
        cms = bp.cache.group_cache_managers
        full_tables = cms[lay.full_group].block_table
        names = [fs.state.request_id for fs in reqs]
        rows = self._rows(names)
        prefix, extend, rids, tables = [], [], [], []
        for fs in reqs:
            st, q = fs.state, fs.query_length
            prefix.append(st.position_offset - q)
            extend.append(q)
            rids.append(s.request_id(st.request_id))
            tables.append(full_tables.get(st.request_id, []))
        cu = [0]
        for q in extend:
            cu.append(cu[-1] + q)
        T = cu[-1]
        maxb = max(1, max(len(t) for t in tables))
        small = rows + prefix + extend + rids
        pad = [0] * maxb
        for t in tables:
            small += t
            small += pad[:maxb - len(t)]
        if self.want_history:
            small += self._token_cells(reqs, rows, prefix, extend)
        packed = self.stage.send(small)
        rows_t, prefix_t, extend_t, rids_t = (packed[i * bs:(i + 1) * bs] for i in range(4))
        n = 4 * bs + bs * maxb
        block_table = packed[4 * bs:n].view(bs, maxb)
        # Each batch row of the table = the request's slots, block by block; other rows are never read,
        # and columns past a request's length neither.
        rtt = torch.empty(self.num_rows, maxb * B, dtype=torch.int64, device=self.device)
        rtt.view(self.num_rows, maxb, B)[rows_t] = torch.add(self.in_block[:B], block_table.unsqueeze(2), alpha=B)
        input_ids, positions = io.input_ids[:T], io.position_ids[:T]
        if io.use_block_table:
            # Flash decode fast path: write_index is not filled; the kernel writes through the table.
            per_token = rows_t.repeat_interleave(extend_t, output_size=T)  # host-known size: no sync
            out_cache_loc = rtt[per_token, positions.to(torch.int64)]
        else:
            out_cache_loc = io.write_index_storage[lay.full_group, :T]
        batch = ForwardBatch(req_pool_indices=rows_t, prefix_lens=prefix_t, extend_lens=extend_t,
                             input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                             req_to_token=rtt, request_ids=rids_t,
                             mode=ForwardMode.DECODE if all(q == 1 for q in extend) else ForwardMode.EXTEND)
        if self.want_history:
            k = (len(small) - n - bs) // 3
            c0 = n + bs
            batch.token_history = TokenAppend(packed[c0:c0 + k], packed[c0 + k:c0 + 2 * k],
                                              packed[c0 + 2 * k:c0 + 3 * k], packed[n:n + bs])
        if self.oracle:
            self._oracle(batch, reqs, prefix, extend, rids)
        if lay.swa_group is not None:
            self._fill_swa_table(io, cms, reqs, prefix, extend, tables, cu, out_cache_loc)
        return batch

    def _rows(self, names: list[str]) -> list[int]:
        """The stable row of each request of the batch, assigning rows to new ones."""
        in_batch, rows = set(names), []
        for name in names:
            row = self.row_of.get(name)
            if row is None:
                if not self.free:
                    # rows >= 2 x max batch: some request outside this batch always holds one
                    old = next(r for r in self.row_of if r not in in_batch)
                    self.free.append(self.row_of.pop(old))
                    self.sent.pop(old, None)
                row = self.row_of[name] = self.free.pop()
                self.sent[name] = 0
            else:
                self.row_of.move_to_end(name)
            rows.append(row)
        return rows

    def _token_cells(self, reqs, rows, prefix, extend) -> list[int]:
        """valid lengths [bs], then the token table cells the rows lack: rows, columns, tokens."""
        valid, cell_rows, cell_cols, cell_tokens = [], [], [], []
        for fs, row, p, q in zip(reqs, rows, prefix, extend):
            st, need = fs.state, p + q
            name = st.request_id
            have = self.sent[name]
            if have < need:
                init, gen = st.initial_tokens, st.generated_tokens
                n0 = len(init)
                toks = init[have:min(need, n0)] + (gen[max(0, have - n0):need - n0] if need > n0 else [])
                cell_rows += [row] * (need - have)
                cell_cols += range(have, need)
                cell_tokens += toks
                self.sent[name] = need
            valid.append(need)
        return valid + cell_rows + cell_cols + cell_tokens

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

    def _fill_swa_table(self, io, cms, reqs, prefix, extend, tables, cu, out_cache_loc) -> None:
        """Synthetic full->SWA table of this step: full slot -> the sliding group's physical slot.

        In window (the last W-1 past positions, plus the new ones) a position maps to its rolling-buffer
        slot ``table[(p % W) // B] * B + (p % W) % B``; a position this forward overwrites (or writes
        to the trash) maps to 0 = evicted. Everything else is 0.
        """
        lay = self.s.layout
        B, W, trash = lay.block_size, lay.window + 1, lay.write_trash
        swa_tables = cms[lay.swa_group].block_table
        full_w = out_cache_loc.tolist()
        swa_w = io.write_index_storage[lay.swa_group, :cu[-1]].tolist()
        mapping: dict[int, int] = {}
        for i, (fs, P, q, table) in enumerate(zip(reqs, prefix, extend, tables)):
            stbl = swa_tables.get(fs.state.request_id, [])
            keep_from = P + q - W
            for p in range(max(0, P - lay.window), P):
                r = p % W
                v = stbl[r // B] * B + r % B if p >= keep_from and r // B < len(stbl) else 0
                _put(mapping, table[p // B] * B + p % B, v)
            for k in range(cu[i], cu[i + 1]):
                _put(mapping, full_w[k], 0 if swa_w[k] == trash else swa_w[k])
        table = self.s.swa_table
        table.zero_()
        if mapping:
            idx = torch.tensor(list(mapping.keys()), dtype=torch.int64).to(self.device)
            table[idx] = torch.tensor(list(mapping.values()), dtype=torch.int64).to(self.device)

    def forget_finished(self) -> list[str]:
        """Release the rows of requests that finished this step; returns their names."""
        done = []
        for fs in self.s.bp.inputs_and_outputs.requests_in_batch:
            if fs.state.status == _STATUS_FINISHED:
                name = fs.state.request_id
                row = self.row_of.pop(name, None)
                if row is not None:
                    self.free.append(row)
                self.sent.pop(name, None)
                done.append(name)
        return done


class Staging:
    """The step's small host arrays in one pinned buffer and one asynchronous copy into a device buffer
    (pageable copies would block the host on every step).

    Device buffers take turns over ``depth`` steps: a batch's tensors are views into one of them, and
    the monitor reads a remembered batch when its violations arrive steps later (reader attribution),
    so a buffer must not be refilled while that batch may still be read.
    """

    def __init__(self, device: torch.device, depth: int = KEEP_BATCHES + 2):
        self.device, self.cuda, self.depth = device, device.type == "cuda", depth
        self.host = None
        self.ring: list[torch.Tensor] = []
        self.turn = 0
        self.event = torch.cuda.Event() if self.cuda else None

    def send(self, small: list[int]) -> torch.Tensor:
        n = len(small)
        if self.event is not None:
            self.event.synchronize()  # the last step's copy has long finished; never overwrite it in flight
        if self.host is None or self.host.shape[0] < n:
            size = max(n, 2 * (0 if self.host is None else self.host.shape[0]), 1024)
            self.host = torch.empty(size, dtype=torch.int64, pin_memory=self.cuda)
            self.host_np = self.host.numpy()
            # (remembered batches keep their old buffers alive)
            self.ring = [torch.empty(size, dtype=torch.int64, device=self.device) for _ in range(self.depth)]
        self.host_np[:n] = small  # numpy converts a list of ints several times faster than torch
        out = self.ring[self.turn][:n]
        self.turn = (self.turn + 1) % self.depth
        out.copy_(self.host[:n], non_blocking=self.cuda)
        if self.event is not None:
            self.event.record()
        return out


def _put(mapping: dict[int, int], full_slot: int, swa_slot: int) -> None:
    # Two requests never share a full slot with block sharing off; if they did, skip the slot rather than guess.
    old = mapping.get(full_slot)
    mapping[full_slot] = swa_slot if old is None or old == swa_slot else 0
