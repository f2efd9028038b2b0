"""The transformers adapter's source of the step runner's protocol (``runtime/engine.py``): the host part of
the batch transformers just prepared, its device inputs (async: its storage set's), each request's row and
token history. Per request of ``io.requests_in_batch``: ``extend = query_length``, ``prefix =
state.position_offset - query_length``; input ids, positions and written slots are the io's storages (the
runner, ``runtime/step/tables.py``, assembles the ``ForwardBatch`` and fills its read table from the read
index). A request keeps one canary row while it lives (least recently used outside the batch when they run
out), so only the tokens its row lacks cross to the device (``TokenRows``): a decode step takes C loops
(``_decode_cells``), and one of the same requests as the step before fills a kept array (``_steady``).
"""

from __future__ import annotations

import collections
from array import array
from operator import add, attrgetter, getitem, sub

import numpy as np
import torch

from kvcanary.integrations.transformers.written_kv import attention_inputs
from kvcanary.runtime.engine import HostLayout, HostStep, TokenCells
from kvcanary.runtime.report import MISSING_TOKEN
from kvcanary.runtime.step.carry import PairInputs, history_need
from kvcanary.runtime.step.window import fill_swa_table
from kvcanary.runtime.step.tables import bucket

__all__ = ["BatchBuilder", "NAME", "TokenRows"]

_STATUS_FINISHED = 3  # transformers RequestStatus.FINISHED
# attributes of a FutureRequestState read per request, in C loops
NAME, QUERY = attrgetter("state.request_id"), attrgetter("query_length")
_PROMPT, _GENERATED = attrgetter("state.initial_tokens"), attrgetter("state.generated_tokens")
_STATUS = attrgetter("state.status")
# read from the request states themselves (host_part reads the batch's states once; a steady decode step
# compares them with the last step's)
STATE = attrgetter("state")
STATE_ID, STATE_OFFSET = attrgetter("request_id"), attrgetter("position_offset")
_S_GENERATED, _S_PROMPT = attrgetter("generated_tokens"), attrgetter("initial_tokens")
_STATUS_FIELD = attrgetter("state._status")  # the field behind the status property: no Python frame per request


class TokenRows:
    """Rows and token cells of the requests of a batch (state set up by ``init_rows``)."""

    def init_rows(self, num_rows: int) -> None:
        self.row_of: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.sent: dict[str, int] = {}  # tokens of the request already in its token table row
        self.free = list(range(num_rows - 1, 0, -1))
        self.last_names: list | None = None  # the last batch's requests, rows and ids (host_part)
        self.last_states: list | None = None  # its request states (the steady check compares them)
        self.last_rows: list[int] = []
        self.last_rids: list[int] = []
        self.steady: _Steady | None = None  # the kept array of a batch of the same requests (_steady)
        self.unsynced = False  # steady steps advanced the rows past ``sent`` (sync_sent)

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

    def _token_cells(self, reqs, names, rows, prefix, extend, decode: bool = False) -> TokenCells:
        """valid lengths [bs], then the token table cells the rows lack: rows, columns, tokens.

        Each request's cells are packed with its own row and columns, as many as its positions need:
        a history shorter than the positions (an engine bug) fills the missing cells with
        ``MISSING_TOKEN``, so the gap is reported against that request alone and never shifts
        another request's cells. Lists, or arrays where a request has a long run of cells (a prefill chunk).
        """
        if decode:
            cells = self._decode_cells(reqs, names, rows, prefix)
            if cells is not None:
                return cells
        valid, cell_rows, cell_cols, cell_tokens, sent = [], [], [], [], self.sent
        runs = []  # (row, have, need, tokens) of requests with many new cells (prefill chunks)
        # async: the requests whose newest token the last forward sampled (carried over: on the device only)
        carried = self._carried() if self.carries else {}
        for fs, name, row, p, q in zip(reqs, names, rows, prefix, extend):
            need = history_need(p + q, name in carried)
            valid.append(need)
            have = sent[name]
            if have >= need:
                continue
            sent[name] = need
            st = fs.state
            n0 = len(st.initial_tokens)
            if need - have == 1 and have >= n0:  # a decode step: one generated token
                gen = st.generated_tokens
                cell_rows.append(row)
                cell_cols.append(have)
                cell_tokens.append(gen[have - n0] if have - n0 < len(gen) else MISSING_TOKEN)
                continue
            init, gen = st.initial_tokens, st.generated_tokens
            toks = init[have:need] + (gen[max(0, have - n0):need - n0] if need > n0 else [])
            if len(toks) < need - have:
                toks += [MISSING_TOKEN] * (need - have - len(toks))
            if need - have < 64:
                cell_rows += [row] * (need - have)
                cell_cols += range(have, need)
                cell_tokens += toks
            else:
                runs.append((row, have, need, toks))
        if not runs:
            return TokenCells(valid, cell_rows, cell_cols, cell_tokens)
        # long runs as arrays: a list of thousands of ints converts far slower than np.arange / np.full
        r = [np.asarray(cell_rows, dtype=np.int64)] + [np.full(n - h, row, dtype=np.int64) for row, h, n, _ in runs]
        c = [np.asarray(cell_cols, dtype=np.int64)] + [np.arange(h, n, dtype=np.int64) for _, h, n, _ in runs]
        t = [np.asarray(cell_tokens, dtype=np.int64)] + [np.asarray(tk, dtype=np.int64) for _, _, _, tk in runs]
        return TokenCells(valid, np.concatenate(r), np.concatenate(c), np.concatenate(t))

    def _decode_cells(self, reqs, names, rows, prefix) -> TokenCells | None:
        """The common decode step in C loops: every request one new position, its row holding all
        before it, past its prompt, its history long enough. None: take the general path (which
        handles every exception to this, a short history included)."""
        sent = self.sent
        if list(map(sent.__getitem__, names)) != prefix:
            return None
        at = list(map(sub, prefix, map(len, map(_PROMPT, reqs))))  # index into the generated tokens
        if min(at, default=0) < 0:
            return None
        try:
            tokens = list(map(getitem, map(_GENERATED, reqs), at))
        except IndexError:
            return None
        need = [p + 1 for p in prefix]
        sent.update(zip(names, need))
        return TokenCells(need, rows, prefix, tokens)

    def _steady(self, io, reqs, states: list, copy: bool, padded: bool = False) -> HostStep | None:
        """A decode step of the same requests as the step before, each one position past its row's tokens:
        the kept array's positions and tokens change, staged as one part; None: the general path (a short
        history, an offset that did not advance by one...). The requests are read twice (offsets, newest
        tokens); the prefix is the last offsets, width and total grow by one and by the batch size. Plain
        lists: at these sizes a numpy call costs more. ``padded``: the kept array holds the batch padded to
        its bucket (``host_part``); only the real requests' cells change."""
        bs = len(states)
        st = self.steady
        if st is None or st.padded != padded:
            if st is not None:
                self.sync_sent()  # (the rows as the kept array left them: the new one starts from ``sent``)
            st = self.steady = _Steady(self, states, self.padding(io, bs) if padded else 0, padded)
        bp = st.bp
        offsets = list(map(STATE_OFFSET, states))
        # each row holds every position before this step's: the offsets are the last ones (or, at the run's
        # first step, the rows' lengths) plus one (a difference of one is a cached int: no int is made)
        if list(map(sub, offsets, st.need)) != st.ones:
            return None
        words, lay = st.words, st.layout
        if self.want_history:
            at = st.at
            if at is None:  # (the run's first step: each request's newest token must be a generated one)
                at = list(map(sub, offsets, st.base))
                if bs and min(at) < 0 or st.lag and not all(map(self._carried().__contains__, self.last_names)):
                    return None
            try:
                tokens = list(map(getitem, map(_S_GENERATED, states), at))
            except IndexError:
                return None
            words[lay.cell_tokens:lay.cell_tokens + bs] = array("q", tokens)
            st.at = list(map(add, at, st.ones))
            self.unsynced = True
        ends = array("q", offsets)  # (``array`` converts ints faster than numpy, and costs less per call)
        if st.prefix is None:  # the run's first step
            prefix = list(map(sub, offsets, st.ones))
            positions = array("q", prefix)
            st.width, st.total = (max(offsets) if bs else 0), sum(offsets)
        else:  # the offsets are the last ones plus one: the prefix is the last offsets, width and total follow
            prefix, positions = st.prefix, st.ends
            st.width += 1
            st.total += bs
        words[lay.prefix:lay.prefix + bs] = positions
        if self.want_history and st.lag:
            # async: each newest token is carried over (device only): each row gains the cell one position back,
            # valid lengths one short (history_need): this step's positions, and the last step's as columns
            words[lay.valid:lay.valid + bs] = positions
            words[lay.cell_cols:lay.cell_cols + bs] = array("q", map(sub, prefix, st.ones)) if st.cols is None else st.cols
            st.cols = positions
        elif self.want_history:
            words[lay.valid:lay.valid + bs] = ends
            words[lay.cell_cols:lay.cell_cols + bs] = positions
        st.prefix, st.need, st.ends = offsets, offsets, ends  # the next step's prefix; the rows hold them (sync_sent)
        return HostStep.pack_kept(self.stage, words, io, reqs, prefix, st.ones, self.last_rids,
                                  bp if self.want_history else -1, st.width, st.total, bp - bs, copy)

    def sync_sent(self) -> None:
        """``sent`` as the steady steps left the rows (they advance a kept array, not the dict)."""
        if self.unsynced:
            self.unsynced = False
            st = self.steady
            self.sent.update(zip(self.last_names, map(sub, st.need, st.ones) if st.lag else st.need))

    def forget_finished(self) -> list[str]:
        """Release the rows of requests that finished this step; returns their names."""
        done = []
        reqs = self.inputs.requests_in_batch  # (async: the pair being updated, the engine swapped to it)
        try:
            statuses = list(map(_STATUS_FIELD, reqs))
        except AttributeError:  # (a request state without the field: its property)
            statuses = list(map(_STATUS, reqs))
        if _STATUS_FINISHED not in statuses:  # most steps: C loops only
            return done
        self.sync_sent()
        self.steady = None
        for fs in reqs:
            if fs.state.status == _STATUS_FINISHED:
                name = fs.state.request_id
                row = self.row_of.pop(name, None)
                if row is not None:
                    self.free.append(row)
                self.sent.pop(name, None)
                done.append(name)
        if done:
            self.last_names = self.last_states = None  # a freed row may go to another request
        return done


class _Steady:
    """The kept values of a batch of the same requests, laid out as ``runtime.engine.HostLayout`` says (sent by
    ``HostStep.pack_kept``): rows, positions, new tokens (1 each), ids, then (with a token history) valid
    lengths, cell rows, cell columns, cell tokens, then each new token's batch index; and what the next steady
    step checks. Each part holds
    ``bp`` values: the ``bs`` requests', then the padding requests' (row 0, position 0, one token, id 0, no
    history, a cell of token 0 at the padding row's column 0)."""

    __slots__ = ("values", "words", "layout", "need", "base", "at", "ones", "prefix", "ends", "width", "total", "bp",
                 "padded", "lag", "cols")

    def __init__(self, rows: TokenRows, states: list, pad: int = 0, padded: bool = False):
        bs, names = len(states), rows.last_names
        self.bp, self.padded = bs + pad, padded
        z = np.zeros(pad, dtype=np.int64)
        ones = np.ones(bs, dtype=np.int64)
        real_rows = np.concatenate([np.asarray(rows.last_rows, dtype=np.int64), z])
        padded_ones = np.concatenate([ones, z])
        parts = [real_rows, padded_ones, np.ones(bs + pad, dtype=np.int64),
                 np.concatenate([np.asarray(rows.last_rids, dtype=np.int64), z])]
        if rows.want_history:
            parts += [padded_ones, real_rows, padded_ones, padded_ones]
        parts.append(np.arange(bs + pad, dtype=np.int64))
        self.values = np.concatenate(parts)  # (int64 arrays, every one)
        self.words = memoryview(self.values).cast("B").cast("q")  # the same memory, written from ``array``s
        self.layout = HostLayout.of(self.bp, self.bp if rows.want_history else -1)
        self.ones = [1] * bs
        # async (``rows.carries``): each row lags its request's newest token by one (``history_need``)
        self.lag = lag = int(rows.carries)
        # each request's tokens in its row, plus the lag: this step's offsets must be these plus one (a row
        # without the request: -2, never one less than an offset)
        self.need = [n + lag for n in map(rows.sent.get, names, [-2] * bs)]
        # where each request's newest token the row gains sits in its generated tokens: its offset less
        # (prompt + 1 + lag)
        self.base = [n + 1 + lag for n in map(len, map(_S_PROMPT, states))]
        self.at = self.prefix = self.ends = self.cols = None  # (set by the run's first step: _steady)
        self.width = self.total = 0


class BatchBuilder(TokenRows):
    """The adapter's ``EngineSource``: each step's host part and inputs, and an eager step's extras."""

    stage = None  # the runner's Staging (set by the runner)
    carries, pairs = False, None  # async batching's two IO pairs (__init__)

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
        # async batching (docs/notes/async_batching.md): the forward carries the last one's tokens over into its
        # input ids; two storage sets in turn, one view each (their requests: the host half's)
        aio = session.bp.inputs_and_outputs
        self.carries = hasattr(aio, "io_pairs")
        self.pairs = [PairInputs(p.device_io, p.host_io, aio.compute_stream) for p in aio.io_pairs] \
            if self.carries else None

    def _carried(self) -> dict:
        """The requests whose newest token the last forward sampled (carried over: on the device only)."""
        aio = self.s.bp.inputs_and_outputs
        return aio.io_pairs[1 - aio.current_pair].host_io.req_id_to_new_token_position

    @property
    def inputs(self):
        """The engine's inputs and outputs of the step (``runtime.engine.StepInputs``; async: its pair's view)."""
        io = self.s.bp.inputs_and_outputs
        return io if self.pairs is None else self.pairs[io.current_pair]

    def attention_inputs(self, io):
        """The full-attention group's key lengths and mask as ``io`` hands them to attention
        (``runtime.engine.AttentionInputs``; None on the block-table path): checked inside the captured and fused
        steps' recorded work."""
        return attention_inputs(io)

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
        io = self.inputs
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
        cells = self._token_cells(reqs, names, rows, prefix, extend, one_each) if self.want_history else None
        # (long runs, arrays: never a decode step)
        pad = self.padding(io, bs) if padded and one_each and (cells is None or type(cells.rows) is list) else 0
        return HostStep.pack(self.stage, io, reqs, rows, prefix, extend, rids, cells, pad, copy)

    def padding(self, io, bs: int) -> int:
        """Padding requests that take a decode step of ``bs`` requests to its bucket: within the canary's sizes
        and the engine's input storages (their cells past the real tokens are read, never written)."""
        if not self.pad_cap:
            return 0
        cap = min(self.pad_cap, io.input_ids.shape[0], io.position_ids.shape[0], io.write_index_storage.shape[1])
        return bucket(bs, cap) - bs

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
