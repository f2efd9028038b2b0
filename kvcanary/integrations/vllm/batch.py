"""One vLLM forward as a ``ForwardBatch``: what attention reads and writes, taken where attention takes it.

Inside ``_model_forward`` vLLM's forward context holds the attention metadata every layer of the KV-cache group
reads (``query_start_loc``, ``seq_lens``, ``block_table``) and the slot mapping its KV write uses. The batch is
built from exactly those tensors, so the canary checks what the kernels are given, not what the scheduler meant:

  extend_lens    query_start_loc[r + 1] - query_start_loc[r]   (tokens the forward writes for request r)
  prefix_lens    seq_lens[r] - extend_lens[r]                   (tokens attention reads from the cache)
  out_cache_loc  the group's slot mapping, first num_actual_tokens entries
  req_to_token   row r + 1: block_table[r, p // block_size] * block_size + p % block_size
  input_ids, positions   the model's own inputs of the forward

A request may read, in the same forward, blocks another request of the batch writes: vLLM caches a block's hash
when it schedules the block's computation, so a request scheduled later in the same step hits it, and every
layer writes the whole batch's KV before its attention reads. The canary verifies reads before a forward's writes,
so ``waves`` splits such a batch: the requests that read nothing written in the forward go around the forward
(HEAD before, TAIL after), each later wave right after it, once its writers' records are written.

The token history of request r is the input batch's ``token_ids_cpu`` row up to its known tokens (prompt and
sampled outputs), the expected inputs of the write-input assert are the same row at the written positions: a
forward that feeds the model other tokens or positions than the request holds is a ``write_token`` /
``write_position`` row.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcanary.runtime import ForwardBatch, ForwardMode, TokenHistory


class BatchBuilder:
    """Builds each forward's batch into buffers sized once for the engine's limits."""

    def __init__(self, *, max_batch: int, max_context: int, block_size: int, layer_name: str, names,
                 lora: bool = False):
        self.block_size, self.layer_name, self.names = block_size, layer_name, names
        self.lora = lora  # LoRA adapters change a token's KV: records carry the adapter (_namespaced)
        self.max_context = max_context
        # row 0 is the canary's padding row; request r of a forward takes row r + 1 (rows are rebuilt each forward)
        self.req_to_token = torch.zeros(max_batch + 1, max_context, dtype=torch.int64)
        self._offsets = torch.arange(max_context, dtype=torch.int64) % block_size
        self._rows = torch.arange(1, max_batch + 1, dtype=torch.int64)

    def build(self, runner, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[ForwardBatch, list[str]]:
        """The forward's batch and its requests' vLLM ids, in batch order."""
        from vllm.forward_context import get_forward_context

        ctx = get_forward_context()
        metadata = ctx.attn_metadata
        if not isinstance(metadata, dict):
            raise RuntimeError("kv-canary: vLLM's forward context must hold one attention metadata per layer, got "
                               f"{type(metadata).__name__} (micro-batching is not supported)")
        md = metadata[self.layer_name]
        ib = runner.input_batch
        n, ntok = ib.num_reqs, int(md.num_actual_tokens)
        req_ids = list(ib.req_ids[:n])
        qsl = md.query_start_loc[:n + 1].to(torch.int64)
        seq = md.seq_lens[:n].to(torch.int64)
        extend = qsl[1:] - qsl[:-1]
        prefix = seq - extend
        slots = ctx.slot_mapping[self.layer_name][:ntok] if ctx.slot_mapping else md.slot_mapping[:ntok]
        longest = int(seq.max()) if n else 0
        if longest > self.max_context:
            raise ValueError(f"kv-canary: a vLLM request must fit the canary's table of {self.max_context} positions "
                             f"(max_model_len), got one of {longest}")
        nb = -(-longest // self.block_size)
        cols = nb * self.block_size
        table = md.block_table[:n, :nb].to(torch.int64)
        # every block id of the row, once per position of the block, plus the position's offset in it
        self.req_to_token[1:n + 1, :cols] = (table.repeat_interleave(self.block_size, dim=1) * self.block_size
                                             + self._offsets[:cols])
        expected_pos = _expected_positions(prefix, extend)
        history, expected = self._tokens(ib, n, seq.numpy(), expected_pos, qsl.numpy())
        input_ids = input_ids[:ntok]
        if self.lora:
            input_ids, history, expected = _namespaced(ib.request_lora_mapping[:n], extend.numpy(), input_ids,
                                                       history, expected)
        batch = ForwardBatch(
            req_pool_indices=self._rows[:n], prefix_lens=prefix, extend_lens=extend,
            input_ids=input_ids, positions=positions[:ntok], out_cache_loc=slots.to(torch.int64),
            req_to_token=self.req_to_token,
            request_ids=torch.tensor([self.names.number(r) for r in req_ids], dtype=torch.int64),
            token_history=history, expected_input_ids=expected,
            expected_positions=expected_pos,
            mode=ForwardMode.DECODE if ntok == n else ForwardMode.EXTEND)
        return batch, req_ids

    def _tokens(self, ib, n: int, seq: np.ndarray, positions: torch.Tensor, qsl: np.ndarray):
        """(TokenHistory of each request's known tokens, the tokens its rows hold at the positions the attention
        metadata says are written: independent of the positions and ids vLLM gave the model)."""
        # the tokens the input batch knows per request (prompt + sampled); a position past them is left unchecked
        known = np.minimum(seq, ib.num_tokens_no_spec[:n]).astype(np.int64)
        width = int(known.max()) if n else 0
        rows = ib.token_ids_cpu[:n, :width]
        flat = torch.from_numpy(rows[np.arange(width)[None, :] < known[:, None]].astype(np.int64))
        offsets = torch.zeros(n + 1, dtype=torch.int64)
        offsets[1:] = torch.from_numpy(np.cumsum(known))
        # each written token's request, then the token its row holds there
        req = np.repeat(np.arange(n), np.diff(qsl))
        pos = positions.numpy().astype(np.int64)
        inside = (pos >= 0) & (pos < ib.token_ids_cpu.shape[1])
        expected = np.full(pos.shape[0], -1, dtype=np.int64)
        expected[inside] = ib.token_ids_cpu[req[inside], pos[inside]]
        # positions the batch does not know yet (async scheduling's placeholders) are not asserted
        expected[~inside | (pos >= known[req])] = -1
        return TokenHistory(flat, offsets), None if (expected < 0).any() else torch.from_numpy(expected)


# A LoRA request's tokens enter the canary as token + (namespace << LORA_SHIFT): the same token computed with
# another adapter (or none) has other KV, so its record must differ; a prefix-cache hit across adapters then reads
# another token (verify_token). The expected-token table is int32: tokens below 2**20, namespaces 1..2047.
LORA_SHIFT = 20
LORA_NAMESPACES = 2047


def lora_namespace(lora_ids: np.ndarray) -> np.ndarray:
    """The namespace of each request's adapter id (0: no adapter), in 1..2047 for an adapter (ids past 2047 share)."""
    ids = np.asarray(lora_ids, dtype=np.int64)
    return np.where(ids > 0, (ids - 1) % LORA_NAMESPACES + 1, 0)


def _namespaced(lora_ids, extend: np.ndarray, input_ids, history: TokenHistory, expected):
    """The canary's view of the batch's tokens with each request's LoRA namespace added (the model's are untouched)."""
    shift = torch.from_numpy(lora_namespace(lora_ids) << LORA_SHIFT)
    if not bool(shift.any()):
        return input_ids, history, expected
    per_token = torch.repeat_interleave(shift, torch.from_numpy(extend.astype(np.int64)))
    lens = history.offsets[1:] - history.offsets[:-1]
    flat = history.flat + torch.repeat_interleave(shift, lens)
    return (input_ids.to(torch.int64) + per_token, TokenHistory(flat, history.offsets),
            None if expected is None else expected + per_token)


def waves(batch: ForwardBatch, block_size: int) -> list[list[int]]:
    """The batch's requests (indices) in waves: wave 0 reads no block that another request of the batch writes in
    this forward; wave k reads blocks that waves < k write. One wave (``[[0 .. n-1]]``) when nothing depends."""
    n = batch.batch_size
    extend = batch.extend_lens.numpy()
    slots = batch.out_cache_loc.numpy()
    owner = np.repeat(np.arange(n), extend)
    blocks = slots // block_size
    written = np.unique(blocks[slots >= 0])
    prefix = batch.prefix_lens.numpy()
    nb = -(-prefix // block_size)
    width = int(nb.max()) if n else 0
    if not width or not written.size:
        return [list(range(n))]
    # the first slot of each prefix block, per request: its block id
    table = batch.req_to_token[1:n + 1, :width * block_size:block_size].numpy() // block_size
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


def subset(batch: ForwardBatch, idx: list[int], tok: torch.Tensor | None = None) -> ForwardBatch:
    """The forward batch of the requests ``idx`` only (their rows, lengths, tokens, slots and histories); ``tok``:
    their tokens' indices if known (``subset_tokens``)."""
    t = torch.tensor(idx, dtype=torch.int64)
    tok = subset_tokens(batch, idx) if tok is None else tok
    h = batch.token_history
    hist = torch.cat([h.flat[int(h.offsets[i]):int(h.offsets[i + 1])] for i in idx])
    lens = (h.offsets[1:] - h.offsets[:-1])[t]
    offsets = torch.zeros(len(idx) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lens, 0)
    pick = lambda x: None if x is None else x[tok]  # noqa: E731
    return ForwardBatch(batch.req_pool_indices[t], batch.prefix_lens[t], batch.extend_lens[t], batch.input_ids[tok],
                        batch.positions[tok], batch.out_cache_loc[tok], batch.req_to_token,
                        request_ids=batch.request_ids[t], token_history=TokenHistory(hist, offsets),
                        expected_input_ids=pick(batch.expected_input_ids),
                        expected_positions=pick(batch.expected_positions), mode=batch.mode)


def subset_tokens(batch: ForwardBatch, idx: list[int]) -> torch.Tensor:
    """The forward's token indices of the requests ``idx``, in ``subset(batch, idx)``'s token order."""
    starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
    return torch.cat([torch.arange(int(starts[i]), int(starts[i] + batch.extend_lens[i])) for i in idx])


def _expected_positions(prefix: torch.Tensor, extend: torch.Tensor) -> torch.Tensor:
    """prefix[r] + 0 .. extend[r] - 1 for every request: the positions attention's metadata says are written."""
    # (numpy: torch.repeat_interleave takes milliseconds per call inside vLLM's thread-bound worker)
    p, e = prefix.numpy(), extend.numpy()
    first = np.repeat(np.cumsum(e) - e, e)
    return torch.from_numpy(np.repeat(p, e) + np.arange(int(e.sum()), dtype=np.int64) - first)
