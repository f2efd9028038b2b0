"""The simulated engine as a source of the step runner's protocol (``runtime/engine.py``), so the runner's
eager, captured and fused paths run without transformers (``SimEngine(..., steps=...)``).

The plain sim hands the canary a ``ForwardBatch`` of its own (its ``req_to_token`` table, whole token
histories). As a source it describes each forward as a serving engine's inputs instead: static device
buffers of input ids, positions, the write index (the slots the forward writes) and the read index (per
request, the slots of positions [0, prefix + extend), read from the engine's request table, so a stale
table entry is read as the forward reads it), and a host part staged through the runner's ``Staging``:
rows, prefix and extend lengths, request ids, the token-table cells each row still lacks and each new
token's batch index. The runner builds the read table from the read index, as it does for transformers.

Not described (``SimEngine`` refuses them in this mode): speculative verify forwards (their drafts have no
history yet), the sliding-window pool, and the decode padding of the engine's CUDA graphs (the runner's own
bucket padding is off: ``pad_cap`` is ignored).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvcanary.runtime.engine import HostStep, TokenCells
from kvcanary.runtime.report import MISSING_TOKEN
from kvcanary.runtime.step.carry import history_need

__all__ = ["SimSource"]


class SimSource:
    """The step runner's view of a ``SimEngine`` (an ``EngineSource``); ``set_step`` describes the next forward."""

    windowed = False
    carries = False  # (carry_source.CarrySource: the forward carries ids over)
    oracle = False  # (the write-input expectations are the plain sim's: the runner's steps carry none)
    stage = None  # the runner's Staging (set by the runner)
    pad_cap = 0  # (set by the runner; the sim does not pad its batches for the runner)

    def __init__(self, engine):
        cfg, canary = engine.cfg, engine.canary
        self.engine = engine
        self.group, self.block_size, self.num_slots = 0, cfg.page_size, cfg.num_slots
        self.want_history = canary.config.token_check
        self.inputs = self.new_inputs()
        self.sent: dict[int, tuple[int, int]] = {}  # row -> (its request id, tokens its token-table row holds)
        self.works: list = []
        self.carried: set = set()  # request ids whose newest input id the forward carries over (carry_source.py)

    def new_inputs(self) -> SimpleNamespace:
        """A set of static input buffers, as an engine that captures its forward keeps them: a captured step
        reads their addresses."""
        canary = self.engine.canary
        tokens, reads = canary.max_tokens, canary.max_batch * self.engine.cfg.max_context
        return SimpleNamespace(
            input_ids=torch.zeros(tokens, dtype=torch.int64), position_ids=torch.zeros(tokens, dtype=torch.int64),
            write_index_storage=torch.zeros(1, tokens, dtype=torch.int64),
            read_index_storage=torch.zeros(1, reads, dtype=torch.int64), true_read_sizes=[0], max_kv_read=0,
            use_block_table=False, block_table=None, compute_stream=None)

    def set_step(self, works: list) -> None:
        """The engine's next forward: its inputs written into the static buffers."""
        io, table = self.inputs, self.engine.pool.table
        self.works = works
        ids = [i for w in works for i in w.input_ids]
        pos = [p for w in works for p in w.positions]
        loc = [s for w in works for s in w.slots]
        reads = [table[w.row, :w.start + w.n] for w in works]
        read = torch.cat(reads) if reads else torch.zeros(0, dtype=torch.int32)
        n, total = len(ids), read.shape[0]
        if n > io.input_ids.shape[0] or total > io.read_index_storage.shape[1]:
            raise ValueError(f"kv-canary: the sim's forward of {n} tokens reading {total} slots must fit the step "
                             f"source's buffers ({io.input_ids.shape[0]} tokens, {io.read_index_storage.shape[1]} "
                             "slots)")
        io.input_ids[:n] = torch.tensor(ids, dtype=torch.int64)
        io.position_ids[:n] = torch.tensor(pos, dtype=torch.int64)
        io.write_index_storage[0, :n] = torch.tensor(loc, dtype=torch.int64)
        io.read_index_storage[0, :total] = read.to(torch.int64)
        io.true_read_sizes[0] = total
        io.max_kv_read = sum(w.start for w in works)

    def forward_inputs(self, n: int) -> SimpleNamespace:
        """What the model's forward reads for the step's ``n`` new tokens (views of the static buffers)."""
        io = self.inputs
        return SimpleNamespace(out_cache_loc=io.write_index_storage[0, :n], input_ids=io.input_ids[:n],
                               positions=io.position_ids[:n])

    def host_part(self, copy: bool = True, padded: bool = False) -> HostStep:
        """The forward's host part (``runtime.engine.HostStep``), staged through the runner's ``Staging``."""
        works = self.works
        extend = [w.n for w in works]
        cells = self._cells(works) if self.want_history else None
        return HostStep.pack(self.stage, self.inputs, works, [w.row for w in works], [w.start for w in works],
                             extend, [w.req.rid for w in works], cells, copy=copy)

    def _cells(self, works: list) -> TokenCells:
        """Valid lengths, then the token-table cells the rows lack (rows, columns, tokens): a row handed to
        another request starts again from position 0."""
        valid, cell_rows, cell_cols, cell_tokens = [], [], [], []
        for w in works:
            carried = w.req.rid in self.carried
            need = history_need(w.start + w.n, carried)
            valid.append(need)
            rid, have = self.sent.get(w.row, (None, 0))
            if rid != w.req.rid:
                have = 0
            if have < need:
                tokens = w.req.tokens
                known = w.start if carried else len(tokens)  # (a carried token is on the device only)
                cell_rows += [w.row] * (need - have)
                cell_cols += range(have, need)
                cell_tokens += [tokens[p] if p < known else MISSING_TOKEN for p in range(have, need)]
                have = need
            self.sent[w.row] = (w.req.rid, have)
        return TokenCells(valid, cell_rows, cell_cols, cell_tokens)

    def finish(self, batch, h: HostStep, arange) -> None:
        """Nothing beyond the runner's batch (no sliding-window table, no token oracle)."""
