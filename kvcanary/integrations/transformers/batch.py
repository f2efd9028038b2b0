"""The transformers adapter's source of the step runner's protocol (``runtime/engine.py``): the host part of
the batch transformers just prepared (sync IO), and its device inputs.

Per request i of ``io.requests_in_batch`` (a ``FutureRequestState``): ``extend = query_length``,
``prefix = state.position_offset - query_length`` (prepare_batch_tensors advanced the offset),
input ids and positions are ``io.input_ids`` / ``io.position_ids`` slices, the written slots are
``io.write_index_storage[full_group]`` (or, on the flash decode fast path, the io block table's); the
runner (``runtime/step/tables.py``) assembles the canary's ``ForwardBatch`` from them and fills its read
table from the read index. Each request keeps one canary row while it lives; its token table row receives
only the tokens it has not seen (``tokens.py``).
"""

from __future__ import annotations

from operator import add, sub

import numpy as np
import torch

from kvcanary.integrations.transformers.layout import fill_swa_table
from kvcanary.integrations.transformers.tokens import QUERY, STATE, STATE_ID, STATE_OFFSET, TokenRows
from kvcanary.runtime.engine import HostStep
from kvcanary.runtime.step.tables import bucket


class BatchBuilder(TokenRows):
    """The adapter's ``EngineSource``: each step's host part and inputs, and an eager step's extras."""

    stage = None  # the runner's Staging (set by the runner)

    def __init__(self, session):
        self.s = session
        lay = session.layout
        self.device = session.device
        self.group, self.block_size, self.num_slots = lay.full_group, lay.block_size, lay.num_slots
        self.windowed = lay.swa_group is not None
        # Stable canary row per engine request (LRU among requests not in the batch when rows run out):
        # the canary's token table keeps a row's tokens, so only new ones cross to the device.
        self.init_rows(session.canary.num_rows)
        self.next_tokens: torch.Tensor | None = None  # token oracle: tokens _sample must emit this step
        self.want_history = session.handle.options.get("token_history", True) and session.config.token_check
        self.oracle = bool(session.handle.options.get("token_oracle"))
        # decode steps padded to their size bucket (``bucket``; the runner sets it where step graphs run): at
        # most this many requests, 0 = no padding
        self.pad_cap = 0
        self.iota_np = np.arange(256, dtype=np.int64)

    @property
    def inputs(self):
        """The engine's inputs and outputs of the step (``runtime.engine.StepInputs``)."""
        return self.s.bp.inputs_and_outputs

    def finish(self, batch, h: HostStep, arange) -> None:
        """An eager step's extras: the token oracle's expectations, the sliding-window group's table."""
        if self.oracle:
            self._oracle(batch, h.reqs, h.prefix, h.extend, h.rids)
        lay = self.s.layout
        if lay.swa_group is not None:
            fill_swa_table(lay, self.s.swa_table, h.io, batch.prefix_lens, batch.extend_lens,
                           max(min(p, lay.window) for p in h.prefix), h.T, batch.out_cache_loc, arange)

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
