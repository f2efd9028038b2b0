"""The transformers adapter's per-request bookkeeping: each request's stable canary row, and the token
table cells its row still lacks (the token history the canary checks records against).

``TokenRows`` is a part of ``BatchBuilder`` (``batch.py``): rows are kept while a request lives
(least recently used among requests outside the batch when they run out), so only new tokens
cross to the device; a decode step takes C loops only (``_decode_cells``), and a decode step of
the same requests as the step before fills a kept array (``_steady``) with its positions and
tokens only.
"""

from __future__ import annotations

import collections
from array import array
from operator import add, attrgetter, getitem, sub

import numpy as np

from kvcanary.runtime.engine import HostStep
from kvcanary.runtime.report import MISSING_TOKEN

__all__ = ["TokenRows", "NAME", "QUERY", "STATE", "STATE_ID", "STATE_OFFSET"]

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

    def _token_cells(self, reqs, names, rows, prefix, extend, decode: bool = False) -> list:
        """valid lengths [bs], then the token table cells the rows lack: rows, columns, tokens.

        Each request's cells are packed with its own row and columns, as many as its positions need:
        a history shorter than the positions (an engine bug) fills the missing cells with
        ``MISSING_TOKEN``, so the gap is reported against that request alone and never shifts
        another request's cells. Returns parts for ``Staging.send``: lists, or arrays for long runs.
        """
        if decode:
            cells = self._decode_cells(reqs, names, rows, prefix)
            if cells is not None:
                return cells
        valid, cell_rows, cell_cols, cell_tokens, sent = [], [], [], [], self.sent
        runs = []  # (row, have, need, tokens) of requests with many new cells (prefill chunks)
        for fs, name, row, p, q in zip(reqs, names, rows, prefix, extend):
            need = p + q
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
            return [valid + cell_rows + cell_cols + cell_tokens]
        # long runs as arrays: a list of thousands of ints converts far slower than np.arange / np.full
        r = [np.asarray(cell_rows, dtype=np.int64)] + [np.full(n - h, row, dtype=np.int64) for row, h, n, _ in runs]
        c = [np.asarray(cell_cols, dtype=np.int64)] + [np.arange(h, n, dtype=np.int64) for _, h, n, _ in runs]
        t = [np.asarray(cell_tokens, dtype=np.int64)] + [np.asarray(tk, dtype=np.int64) for _, _, _, tk in runs]
        return [valid] + r + c + t

    def _decode_cells(self, reqs, names, rows, prefix) -> list | None:
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
        return [need + rows + prefix + tokens]

    def _steady(self, io, reqs, states: list, copy: bool, padded: bool = False) -> HostStep | None:
        """A decode step of the same requests as the step before, each one position past the tokens its
        row holds (so one query token each: the engine advances an offset by its request's query length):
        the step's values in the kept array (rows, ids and batch indices stay; positions and
        tokens change), staged as one part. None: the general path (a request's history too short, a
        position that did not advance by one, anything else).

        Per step the requests are read twice (their offsets, their newest tokens); everything else is
        derived from the step before: each offset must be the last one plus one, so this step's prefix is the
        last step's offsets, and the width and total grow by one and by the batch size. Plain lists for the
        checks: at these sizes a numpy call costs more than the whole list operation. ``padded``: the kept
        array holds the batch padded to its bucket (``host_part``); only the real requests' cells change."""
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
        words = st.words
        if self.want_history:
            at = st.at
            if at is None:  # (the run's first step: each request's newest token must be a generated one)
                at = list(map(sub, offsets, st.base))
                if bs and min(at) < 0:
                    return None
            try:
                tokens = list(map(getitem, map(_S_GENERATED, states), at))
            except IndexError:
                return None
            words[7 * bp:7 * bp + bs] = array("q", tokens)
            st.at = list(map(add, at, st.ones))
            self.unsynced = True
        # (``array`` converts Python ints faster than numpy, and a numpy call costs more than these inside the
        # engine's step: cold caches)
        ends = array("q", offsets)
        if st.prefix is None:  # the run's first step
            prefix = list(map(sub, offsets, st.ones))
            positions = array("q", prefix)
            st.width, st.total = (max(offsets) if bs else 0), sum(offsets)
        else:  # the offsets are the last ones plus one: the prefix is the last offsets, width and total follow
            prefix, positions = st.prefix, st.ends
            st.width += 1
            st.total += bs
        words[bp:bp + bs] = positions
        if self.want_history:
            words[4 * bp:4 * bp + bs] = ends
            words[6 * bp:6 * bp + bs] = positions
        # the next step's prefix (as a list and as converted): these offsets; the rows hold them (sync_sent)
        st.prefix = st.need = offsets
        st.ends = ends
        # (the batch indices, the last bp values: the last part, as in the general path)
        packed, small = self.stage.send([words], copy, last=bp)
        return HostStep(io, reqs, bp, bp, prefix, st.ones, self.last_rids, packed, 4 * bp, small, st.width, st.total,
                        bp - bs)

    def sync_sent(self) -> None:
        """``sent`` as the steady steps left the rows (they advance a kept array, not the dict)."""
        if self.unsynced:
            self.unsynced = False
            self.sent.update(zip(self.last_names, self.steady.need))

    def forget_finished(self) -> list[str]:
        """Release the rows of requests that finished this step; returns their names."""
        done = []
        reqs = self.s.bp.inputs_and_outputs.requests_in_batch
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
    """The kept values of a batch of the same requests, in ``host_part``'s layout: rows, positions,
    new tokens (1 each), ids, then (with a token history) valid lengths, cell rows, cell columns,
    cell tokens, then each new token's batch index; and what the next steady step checks. Each part holds
    ``bp`` values: the ``bs`` requests', then the padding requests' (row 0, position 0, one token, id 0, no
    history, a cell of token 0 at the padding row's column 0)."""

    __slots__ = ("values", "words", "need", "base", "at", "ones", "prefix", "ends", "width", "total", "bp",
                 "padded")

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
        self.ones = [1] * bs
        # each request's tokens in its row: this step's offsets must be these plus one (a row without the
        # request: -2, never one less than an offset)
        self.need = list(map(rows.sent.get, names, [-2] * bs))
        # where each request's newest token sits in its generated tokens: its offset less (prompt + 1)
        self.base = [n + 1 for n in map(len, map(_S_PROMPT, states))]
        self.at = self.prefix = self.ends = None  # (set by the run's first step: _steady)
        self.width = self.total = 0
