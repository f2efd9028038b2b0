"""Build the canary's ``ForwardBatch`` from the batch transformers just prepared (sync IO).

Per request i of ``io.requests_in_batch`` (a ``FutureRequestState``): ``extend = query_length``,
``prefix = state.position_offset - query_length`` (prepare_batch_tensors advanced the offset),
input ids and positions are ``io.input_ids`` / ``io.position_ids`` slices, the written slots are
``io.write_index_storage[full_group]`` (or, on the flash decode fast path, the table's), and the
canary's row ``i + 1`` of req_to_token is rebuilt from the request's block table every step.
"""

from __future__ import annotations

import torch

from kvcanary.runtime import ForwardBatch, ForwardMode, TokenHistory

_STATUS_FINISHED = 3  # transformers RequestStatus.FINISHED


class BatchBuilder:
    def __init__(self, session):
        self.s = session
        self.device = session.device
        self.rows = torch.arange(1, session.canary.max_batch + 1, dtype=torch.int64, device=self.device)
        self.history: dict[str, tuple[torch.Tensor, int]] = {}  # engine request id -> (host int64 tokens, n)
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
        flat_tables = [b for t in tables for b in t + [0] * (maxb - len(t))]
        small = prefix + extend + rids + flat_tables
        hist = self._history_parts(reqs, prefix, extend) if self.want_history else None
        packed = self.stage.send(small, hist)
        prefix_t, extend_t, rids_t = packed[:bs], packed[bs:2 * bs], packed[2 * bs:3 * bs]
        block_table = packed[3 * bs:len(small)].view(bs, maxb)
        # Row i + 1 = request i's slots, block by block: three kernels into a table as wide as its blocks
        # (columns past a request's length are never read).
        rtt = torch.empty(bs + 1, maxb * B, dtype=torch.int64, device=self.device)
        rtt[0].zero_()
        torch.add(block_table.mul(B).unsqueeze(2), self.in_block[:B], out=rtt[1:].view(bs, maxb, B))
        input_ids, positions = io.input_ids[:T], io.position_ids[:T]
        if io.use_block_table:
            # Flash decode fast path: write_index is not filled; the kernel writes through the table.
            rows = self.rows[:bs].repeat_interleave(extend_t, output_size=T)  # host-known size: no sync
            out_cache_loc = rtt[rows, positions.to(torch.int64)]
        else:
            out_cache_loc = io.write_index_storage[lay.full_group, :T]
        batch = ForwardBatch(req_pool_indices=self.rows[:bs], prefix_lens=prefix_t, extend_lens=extend_t,
                             input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                             req_to_token=rtt, request_ids=rids_t,
                             mode=ForwardMode.DECODE if all(q == 1 for q in extend) else ForwardMode.EXTEND)
        if hist is not None:
            n = len(small)
            batch.token_history = TokenHistory(packed[n + bs + 1:], packed[n:n + bs + 1])
        if self.oracle:
            self._oracle(batch, reqs, prefix, extend, rids)
        if lay.swa_group is not None:
            self._fill_swa_table(io, cms, reqs, prefix, extend, tables, cu, out_cache_loc)
        return batch

    def _history_parts(self, reqs, prefix, extend) -> tuple[list[int], list[torch.Tensor]]:
        """Offsets and per-request host tensors of the tokens of positions [0, prefix + extend), cached
        across steps (only tokens not seen before are converted)."""
        parts, offsets = [], [0]
        for fs, p, q in zip(reqs, prefix, extend):
            st, need = fs.state, p + q
            toks, n = self.history.get(st.request_id, (None, 0))
            if toks is None or n < need:
                init, gen = st.initial_tokens, st.generated_tokens
                new = [init[i] if i < len(init) else gen[i - len(init)] for i in range(n, need)]
                if toks is None or need > toks.shape[0]:
                    grown = torch.empty(max(need, 2 * n, 64), dtype=torch.int64)
                    if n:
                        grown[:n] = toks[:n]
                    toks = grown
                toks[n:need] = torch.tensor(new, dtype=torch.int64)
                n = need
                self.history[st.request_id] = (toks, n)
            parts.append(toks[:need])
            offsets.append(offsets[-1] + need)
        return offsets, parts

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

    def forget_finished(self) -> None:
        for fs in self.s.bp.inputs_and_outputs.requests_in_batch:
            if fs.state.status == _STATUS_FINISHED:
                self.history.pop(fs.state.request_id, None)


class Staging:
    """The step's small host arrays in one pinned buffer and one asynchronous copy into a device buffer
    reused across steps (pageable copies would block the host on every step)."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.host = self.dev = None
        self.event = torch.cuda.Event() if self.cuda else None

    def send(self, small: list[int], hist: tuple[list[int], list[torch.Tensor]] | None) -> torch.Tensor:
        n_small = len(small) + (len(hist[0]) if hist else 0)
        n = n_small + (hist[0][-1] if hist else 0)
        if self.host is None or self.host.shape[0] < n:
            size = max(n, 2 * (0 if self.host is None else self.host.shape[0]), 1024)
            if self.event is not None:
                self.event.synchronize()
            self.host = torch.empty(size, dtype=torch.int64, pin_memory=self.cuda)
            self.dev = torch.empty(size, dtype=torch.int64, device=self.device)
        elif self.event is not None:
            self.event.synchronize()  # the last step's copy has long finished; never overwrite it in flight
        head = small + hist[0] if hist else small
        self.host[:n_small] = torch.tensor(head, dtype=torch.int64)
        if hist and hist[1]:
            torch.cat(hist[1], out=self.host[n_small:n])
        if not self.cuda:
            return self.host[:n]
        out = self.dev[:n]
        out.copy_(self.host[:n], non_blocking=True)
        self.event.record()
        return out


def _put(mapping: dict[int, int], full_slot: int, swa_slot: int) -> None:
    # Two requests never share a full slot with block sharing off; if they did, skip the slot rather than guess.
    old = mapping.get(full_slot)
    mapping[full_slot] = swa_slot if old is None or old == swa_slot else 0
