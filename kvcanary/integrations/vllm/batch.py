"""One vLLM forward as the runtime's host step (``runtime.engine.HostStep``): what attention reads and writes,
taken where attention takes it.

Inside ``_model_forward`` vLLM's forward context holds the attention metadata every layer of the KV-cache group
reads (``query_start_loc``, ``seq_lens``, ``block_table``) and the slot mapping its KV write uses.
``BatchBuilder.read`` takes exactly those (a ``Forward``), so the canary checks what the kernels are given, not what
the scheduler meant:

  extend        query_start_loc[r + 1] - query_start_loc[r]   (tokens the forward writes for request r)
  prefix        seq_lens[r] - extend[r]                         (tokens attention reads from the cache)
  write index   the group's slot mapping, first num_actual_tokens entries
  read index    per request, block_table[r, p // block_size] * block_size + p % block_size for p < seq_lens[r]
  input ids, positions   the model's own inputs of the forward

Each canary forward is one ``HostStep``, packed by ``HostStep.pack`` as the transformers adapter and the simulated
engine pack theirs: request r of the forward in canary row r + 1 (rows are rebuilt each forward), its prefix and
extend lengths, its request number (``report.RequestNames``) and its whole token history as token cells (the
input batch's ``token_ids_cpu`` row up to its known tokens: prompt and sampled outputs), with the forward's inputs
as ``StepInputs`` (``BatchBuilder.inputs``). The runtime's ``StepTables.build`` makes the ``ForwardBatch`` the canary
checks from it, its read table filled from the read index (``runtime/step/tables.py``); ``finish`` adds the
write-input assert's expectations: the tokens the request's row holds at the positions the attention metadata
says are written. A forward that feeds the model other tokens or positions than the request holds is a
``write_token`` / ``write_position`` row.

A request may read, in the same forward, blocks another request of the batch writes: vLLM caches a block's hash
when it schedules the block's computation, so a request scheduled later in the same step hits it, and every
layer writes the whole batch's KV before its attention reads. The canary verifies reads before a forward's writes,
so ``waves`` splits such a batch: the requests that read nothing written in the forward go around the forward
(HEAD before, TAIL after), each later wave right after it, once its writers' records are written. Each wave is
a host step of its own: its requests' lists and cells, and its tokens' inputs, slots and reads (``Forward.wave``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch

from kvcanary.runtime.engine import HostStep, TokenCells


class Forward(NamedTuple):
    """One vLLM forward as read from its attention metadata and input batch (``BatchBuilder.read``): host arrays
    (int64 numpy unless said), in the forward's request and token order."""

    req_ids: list  # the requests' vLLM ids
    rids: list[int]  # their request numbers (``report.RequestNames``)
    prefix: list[int]  # per request: tokens attention reads from the cache
    extend: list[int]  # per request: tokens the forward writes
    starts: np.ndarray  # [n] each request's first token among the forward's
    input_ids: np.ndarray  # [T] the model's input ids (LoRA requests' namespaced: ``lora_namespace``)
    positions: np.ndarray  # [T] the model's positions
    slots: np.ndarray  # [T] the slot mapping: where each token's KV is written
    expected_ids: np.ndarray | None  # [T] the tokens the rows hold at the written positions (None: some unknown)
    expected_positions: np.ndarray  # [T] prefix[r] + 0 .. extend[r] - 1: the positions the metadata says are written
    reads: np.ndarray  # [sum seq_lens] the read index: per request, the slots of positions [0, seq_len)
    read_at: np.ndarray  # [n + 1] where each request's reads start in ``reads``
    blocks: np.ndarray  # [n, nb] the block table's ids (nb: the longest request's blocks)
    known: np.ndarray  # [n] tokens of each request's history (prompt + sampled, at most its seq_len)
    history: np.ndarray  # [sum known] the histories, request-major
    history_at: np.ndarray  # [n + 1] where each request's history starts

    @property
    def batch_size(self) -> int:
        return len(self.prefix)

    @property
    def num_tokens(self) -> int:
        return int(self.slots.shape[0])

    def tokens(self, idx: list[int]) -> np.ndarray:
        """The forward's token indices of the requests ``idx``, in their wave's token order."""
        return _segments(self.starts, self.starts + np.asarray(self.extend, dtype=np.int64), idx)


class BatchBuilder:
    """vLLM's side of the runtime's host step: each forward read once (``read``), each of its waves described as
    a ``HostStep`` (``set_wave``, then ``host_part``: the ``runtime.engine.EngineSource`` calls), and the batch
    built from it by the runtime's ``StepTables`` (``Session``)."""

    group = 0  # the one full-attention KV-cache group (layout.check_engine refuses others)
    windowed = oracle = carries = False
    pad_cap = 0  # (vLLM pads its own CUDA graphs' batches; the canary pads none)

    def __init__(self, *, max_batch: int, max_tokens: int, max_context: int, block_size: int, num_slots: int,
                 layer_name: str, names, history: bool = True, lora: bool = False):
        from kvcanary.runtime.step.staging import Staging

        self.block_size, self.num_slots, self.layer_name, self.names = block_size, num_slots, layer_name, names
        self.want_history = history  # the token-history check is on: each step sends the requests' histories
        self.lora = lora  # LoRA adapters change a token's KV: records carry the adapter (lora_namespace)
        self.max_context = max_context
        self._offsets = np.arange(max_context, dtype=np.int64) % block_size
        self._cols = np.arange(max_context, dtype=np.int64)
        # one staging turn: the CPU canary reads each forward's observation when it closes, before the next wave's
        # (or forward's) host step refills the buffer
        self.stage = Staging(torch.device("cpu"), depth=1)
        self.stage.sized_for(max_batch, max_tokens)
        self.inputs = None  # the wave's StepInputs (set_wave)
        self._wave: tuple | None = None  # (forward, request indices or None: all) of the next host_part

    # -- reading a forward -------------------------------------------------------------------------
    def read(self, runner, input_ids: torch.Tensor, positions: torch.Tensor) -> Forward:
        """The forward about to run, from vLLM's forward context and ``runner``'s input batch."""
        from vllm.forward_context import get_forward_context

        ctx = get_forward_context()
        metadata = ctx.attn_metadata
        if not isinstance(metadata, dict):
            raise RuntimeError("kv-canary: vLLM's forward context must hold one attention metadata per layer, got "
                               f"{type(metadata).__name__} (micro-batching is not supported)")
        md = metadata[self.layer_name]
        ntok = int(md.num_actual_tokens)
        slots = ctx.slot_mapping[self.layer_name][:ntok] if ctx.slot_mapping else md.slot_mapping[:ntok]
        return self.forward_of(md, slots, runner.input_batch, input_ids, positions)

    def forward_of(self, md, slots: torch.Tensor, ib, input_ids: torch.Tensor, positions: torch.Tensor) -> Forward:
        """The ``Forward`` of attention metadata ``md`` (``query_start_loc``, ``seq_lens``, ``block_table``,
        ``num_actual_tokens``), the written ``slots``, input batch ``ib`` and the model's inputs."""
        n, ntok, B = ib.num_reqs, int(md.num_actual_tokens), self.block_size
        req_ids = list(ib.req_ids[:n])
        qsl = md.query_start_loc[:n + 1].numpy().astype(np.int64)
        seq = md.seq_lens[:n].numpy().astype(np.int64)
        extend = np.diff(qsl)
        prefix = seq - extend
        longest = int(seq.max()) if n else 0
        if longest > self.max_context:
            raise ValueError(f"kv-canary: a vLLM request must fit the canary's table of {self.max_context} positions "
                             f"(max_model_len), got one of {longest}")
        nb = -(-longest // B)
        blocks = md.block_table[:n, :nb].numpy().astype(np.int64)
        read_at = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(seq, out=read_at[1:])
        cols = nb * B
        # every block id of the row, once per position of the block, plus the position's offset in it
        table = np.repeat(blocks, B, axis=1) * B + self._offsets[:cols]
        reads = table[self._cols[:cols] < seq[:, None]]
        expected_pos = _expected_positions(prefix, extend)
        known, history, history_at, expected = self._tokens(ib, n, seq, expected_pos, qsl)
        ids = input_ids[:ntok].numpy()
        if self.lora:
            ids, history, expected = _namespaced(ib.request_lora_mapping[:n], extend, known, ids, history, expected)
        return Forward(req_ids, [self.names.number(r) for r in req_ids], prefix.tolist(), extend.tolist(), qsl[:-1],
                       ids, positions[:ntok].numpy(), slots.numpy().astype(np.int64, copy=False), expected,
                       expected_pos, reads, read_at, blocks, known, history, history_at)

    def _tokens(self, ib, n: int, seq: np.ndarray, positions: np.ndarray, qsl: np.ndarray):
        """(each request's known tokens: how many, the tokens request-major, where each starts; the tokens its rows
        hold at the positions the attention metadata says are written: independent of the positions and ids vLLM
        gave the model)."""
        # the tokens the input batch knows per request (prompt + sampled); a position past them is left unchecked
        known = np.minimum(seq, ib.num_tokens_no_spec[:n]).astype(np.int64)
        width = int(known.max()) if n else 0
        rows = ib.token_ids_cpu[:n, :width]
        history = rows[self._cols[:width] < known[:, None]].astype(np.int64)
        at = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(known, out=at[1:])
        # each written token's request, then the token its row holds there
        req = np.repeat(np.arange(n), np.diff(qsl))
        inside = (positions >= 0) & (positions < ib.token_ids_cpu.shape[1])
        expected = np.full(positions.shape[0], -1, dtype=np.int64)
        expected[inside] = ib.token_ids_cpu[req[inside], positions[inside]]
        # positions the batch does not know yet (async scheduling's placeholders) are not asserted
        expected[~inside | (positions >= known[req])] = -1
        return known, history, at, None if (expected < 0).any() else expected

    # -- the runtime's host step -------------------------------------------------------------------
    def set_wave(self, fwd: Forward, idx: list[int] | None = None) -> None:
        """The next ``host_part`` describes the requests ``idx`` of ``fwd`` (None: all of them)."""
        self._wave = (fwd, idx)

    def host_part(self, copy: bool = True, padded: bool = False) -> HostStep:
        """The wave's ``HostStep``: its requests' rows (batch index + 1), prefix and extend lengths, request numbers
        and histories (token cells) staged by ``HostStep.pack``, its tokens' inputs, write slots and reads as
        ``StepInputs`` (``inputs``)."""
        fwd, idx = self._wave
        n = fwd.batch_size
        if idx is None or len(idx) == n:
            rows, prefix, extend, rids = list(range(1, n + 1)), fwd.prefix, fwd.extend, fwd.rids
            tok = hist = cells = None
        else:
            rows = [i + 1 for i in idx]
            prefix, extend = [fwd.prefix[i] for i in idx], [fwd.extend[i] for i in idx]
            rids = [fwd.rids[i] for i in idx]
            tok = fwd.tokens(idx)
            hist = _segments(fwd.history_at[:-1], fwd.history_at[1:], idx)
            cells = _segments(fwd.read_at[:-1], fwd.read_at[1:], idx)
        self.inputs = io = _inputs(fwd, tok, cells, prefix)
        history = None
        if self.want_history:
            known = fwd.known if idx is None else fwd.known[idx]
            width = int(known.max()) if known.shape[0] else 0
            inside = self._cols[:width] < known[:, None]
            cell_rows = np.broadcast_to(np.asarray(rows, dtype=np.int64)[:, None], inside.shape)[inside]
            cell_cols = np.broadcast_to(self._cols[:width], inside.shape)[inside]
            tokens = fwd.history if hist is None else fwd.history[hist]
            history = TokenCells(known.tolist(), cell_rows, cell_cols, tokens)
        return HostStep.pack(self.stage, io, fwd.req_ids, rows, prefix, extend, rids, history, copy=copy)

    def finish(self, batch, h: HostStep, arange) -> None:
        """The write-input assert's expectations (``StepTables.build`` calls it on the batch it built)."""
        batch.expected_input_ids = h.io.expected_input_ids
        batch.expected_positions = h.io.expected_positions


def _inputs(fwd: Forward, tok: np.ndarray | None, cells: np.ndarray | None, prefix: list[int]) -> SimpleNamespace:
    """The ``runtime.engine.StepInputs`` of the forward's tokens ``tok`` and read index cells ``cells`` (indices
    into ``fwd.reads``; None, None: all of them) for requests of prefix lengths ``prefix``."""
    pick = (lambda a: a) if tok is None else (lambda a: a[tok])  # noqa: E731
    read = fwd.reads if cells is None else fwd.reads[cells]
    exp = fwd.expected_ids
    return SimpleNamespace(
        input_ids=torch.from_numpy(pick(fwd.input_ids)), position_ids=torch.from_numpy(pick(fwd.positions)),
        write_index_storage=torch.from_numpy(pick(fwd.slots)).view(1, -1),
        read_index_storage=torch.from_numpy(read).view(1, -1), true_read_sizes=[int(read.shape[0])],
        max_kv_read=sum(prefix), use_block_table=False, block_table=None, compute_stream=None,
        expected_input_ids=None if exp is None else torch.from_numpy(pick(exp)),
        expected_positions=torch.from_numpy(pick(fwd.expected_positions)))


def _segments(starts: np.ndarray, ends: np.ndarray, idx: list[int]) -> np.ndarray:
    """The indices [starts[i], ends[i]) of each ``i`` of ``idx``, in that order (int64)."""
    if not idx:
        return np.zeros(0, dtype=np.int64)
    s, e = starts[idx], ends[idx]
    lens = e - s
    first = np.repeat(s - (np.cumsum(lens) - lens), lens)
    return first + np.arange(int(lens.sum()), dtype=np.int64)


# A LoRA request's tokens enter the canary as token + (namespace << LORA_SHIFT): the same token computed with
# another adapter (or none) has other KV, so its record must differ; a prefix-cache hit across adapters then reads
# another token (verify_token). The expected-token table is int32: tokens below 2**20, namespaces 1..2047.
LORA_SHIFT = 20
LORA_NAMESPACES = 2047


def lora_namespace(lora_ids: np.ndarray) -> np.ndarray:
    """The namespace of each request's adapter id (0: no adapter), in 1..2047 for an adapter (ids past 2047 share)."""
    ids = np.asarray(lora_ids, dtype=np.int64)
    return np.where(ids > 0, (ids - 1) % LORA_NAMESPACES + 1, 0)


def _namespaced(lora_ids, extend: np.ndarray, known: np.ndarray, input_ids: np.ndarray, history: np.ndarray,
                expected: np.ndarray | None):
    """The canary's view of the forward's tokens with each request's LoRA namespace added (the model's are
    untouched): its input ids, histories and expected ids."""
    shift = lora_namespace(lora_ids) << LORA_SHIFT
    if not shift.any():
        return input_ids, history, expected
    per_token = np.repeat(shift, extend)
    return (input_ids.astype(np.int64) + per_token, history + np.repeat(shift, known),
            None if expected is None else expected + per_token)


def waves(fwd: Forward, block_size: int) -> list[list[int]]:
    """The forward's requests (indices) in waves: wave 0 reads no block that another request of the forward writes
    in it; wave k reads blocks that waves < k write. One wave (``[[0 .. n-1]]``) when nothing depends."""
    n = fwd.batch_size
    slots = fwd.slots
    owner = np.repeat(np.arange(n), fwd.extend)
    blocks = slots // block_size
    written = np.unique(blocks[slots >= 0])
    nb = -(-np.asarray(fwd.prefix, dtype=np.int64) // block_size)
    width = int(nb.max()) if n else 0
    if not width or not written.size:
        return [list(range(n))]
    # each request's prefix blocks (the block table's ids)
    table = fwd.blocks[:, :width]
    in_prefix = np.arange(width)[None, :] < nb[:, None]
    hit = in_prefix & np.isin(table, written)
    if not hit.any():
        return [list(range(n))]
    # a hit is a dependency when another request writes the block: it has several writers, or one that is not r
    valid = slots >= 0
    pairs = np.unique(blocks[valid] * n + owner[valid])
    pair_block, pair_req = pairs // n, pairs % n
    uniq, first, counts = np.unique(pair_block, return_index=True, return_counts=True)
    rows, cols = np.nonzero(hit)
    at = np.searchsorted(uniq, table[rows, cols])
    dep = (counts[at] > 1) | (pair_req[first][at] != rows)
    if not dep.any():
        return [list(range(n))]
    writers: dict[int, set[int]] = {}
    for b, r in zip(pair_block.tolist(), pair_req.tolist()):
        writers.setdefault(b, set()).add(r)
    deps = {r: set() for r in range(n)}
    for r, b in zip(rows[dep].tolist(), table[rows[dep], cols[dep]].tolist()):
        deps[r] |= writers[b] - {r}
    wave = [0] * n
    for _ in range(n):  # longest dependency chain; a cycle (two requests writing each other's read blocks) stops
        changed = False
        for r in range(n):
            w = max((wave[d] + 1 for d in deps[r]), default=0)
            if w != wave[r] and w < n:
                wave[r], changed = w, True
        if not changed:
            break
    return [[r for r in range(n) if wave[r] == k] for k in range(max(wave) + 1) if k in wave]


def _expected_positions(prefix: np.ndarray, extend: np.ndarray) -> np.ndarray:
    """prefix[r] + 0 .. extend[r] - 1 for every request: the positions attention's metadata says are written."""
    first = np.repeat(np.cumsum(extend) - extend, extend)
    return np.repeat(prefix, extend) + np.arange(int(extend.sum()), dtype=np.int64) - first
