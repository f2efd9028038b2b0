"""The device work of one forward, launched with as little host time as possible.

The public ops validate every argument on every call; here the canary's own buffers
and real-KV sources are validated once, the engine's ``ForwardBatch`` once per
forward, and the chosen implementation module is called directly. Only static
buffers are touched and nothing syncs, so the sequence can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from kvcanary.format import ATTRIBUTION_STRIDE, RealKvMode
from kvcanary.ops import api
from kvcanary.ops import validate as v
from kvcanary.runtime.batch import TokenAppend

OP = "forward batch"


def check_batch(batch, device: torch.device) -> None:
    """The checks the public ops would make on the engine's tensors, from metadata only."""
    v.check_vector(OP, "req_pool_indices", batch.req_pool_indices, v.INDEX_DTYPES)
    bs = batch.req_pool_indices.shape[0]
    v.check_vector(OP, "prefix_lens", batch.prefix_lens, v.INDEX_DTYPES, length=bs)
    v.check_vector(OP, "extend_lens", batch.extend_lens, v.INDEX_DTYPES, length=bs)
    v.check_ndim(OP, "req_to_token", batch.req_to_token, 2)
    v.check_dtype(OP, "req_to_token", batch.req_to_token, v.INDEX_DTYPES)
    v.check_vector(OP, "out_cache_loc", batch.out_cache_loc, v.INDEX_DTYPES)
    n = batch.out_cache_loc.shape[0]
    for name in ("input_ids", "positions"):
        v.check_vector(OP, name, getattr(batch, name), v.INDEX_DTYPES, length=n)
    for name in ("expected_input_ids", "expected_positions"):
        if getattr(batch, name) is not None:
            v.check_vector(OP, name, getattr(batch, name), v.INDEX_DTYPES, length=n)
    if batch.request_ids is not None:
        v.check_vector(OP, "request_ids", batch.request_ids, (torch.int64,), min_length=bs)
    hist = batch.token_history
    if isinstance(hist, TokenAppend):
        v.check_vector(OP, "token_history.cell_rows", hist.cell_rows, v.INDEX_DTYPES)
        n = hist.cell_rows.shape[0]
        for name in ("cell_cols", "cell_tokens"):
            v.check_vector(OP, f"token_history.{name}", getattr(hist, name), v.INDEX_DTYPES, length=n)
        v.check_vector(OP, "token_history.valid_lens", hist.valid_lens, v.INDEX_DTYPES, length=bs)
        tensors = {f"token_history.{k}": getattr(hist, k) for k in ("cell_rows", "cell_cols", "cell_tokens",
                                                                    "valid_lens")}
    elif hist is not None:
        v.check_vector(OP, "token_history.flat", hist.flat, v.INDEX_DTYPES)
        v.check_vector(OP, "token_history.offsets", hist.offsets, v.INDEX_DTYPES, length=bs + 1)
        tensors = {"token_history.flat": hist.flat, "token_history.offsets": hist.offsets}
    else:
        tensors = {}
    if batch.token_offset not in (0, 1):
        raise v.fail_value(OP, "token_offset", "0 or 1", repr(batch.token_offset))
    v.check_device(OP, device, req_pool_indices=batch.req_pool_indices, prefix_lens=batch.prefix_lens,
                   extend_lens=batch.extend_lens, req_to_token=batch.req_to_token, out_cache_loc=batch.out_cache_loc,
                   input_ids=batch.input_ids, positions=batch.positions, request_ids=batch.request_ids,
                   expected_input_ids=batch.expected_input_ids, expected_positions=batch.expected_positions,
                   **tensors)


class ForwardLauncher:
    """HEAD and TAIL sequences of a ``Canary``: plan, verify and write per group and K/V buffer."""

    def __init__(self, canary):
        self.c = canary
        self.impl = api.impl_module(canary.config.backend, canary.device.type)
        self.attribution = canary.config.record_stride >= ATTRIBUTION_STRIDE
        if any(g.table is not None for g in canary.groups):
            self.swa_loc = torch.zeros(canary.max_tokens, dtype=torch.int64, device=canary.device)

    def before(self, batch) -> None:
        """Expected-token refill, plan per group, HEAD verify of the prefix, HEAD write of the new tokens."""
        c, impl = self.c, self.impl
        check_batch(batch, c.device)
        table, valid = self._refill_tokens(batch)
        for g in c.groups:
            impl.plan(req_pool_indices=batch.req_pool_indices, prefix_lens=batch.prefix_lens,
                      extend_lens=batch.extend_lens, req_to_token=batch.req_to_token, out=g.plan, window=g.window,
                      full_to_swa=g.table, token_table=table, token_valid_lens=valid,
                      token_offset=batch.token_offset)
            for kv in g.kvs:
                impl.verify(buf=g.bufs["head", kv], entries=g.plan.entries, ring=c.ring, counters=c.counters,
                            launch_tag=g.tag("head", kv), sources=(), real_kv_mode=0)
        self._write_all(batch, "head")

    def after(self, batch) -> None:
        """TAIL verify with real-KV hash, TAIL write, device step + 1."""
        c, impl = self.c, self.impl
        for g in c.groups:
            for kv in g.kvs:
                impl.verify(buf=g.bufs["tail", kv], entries=g.plan.entries, ring=c.ring, counters=c.counters,
                            launch_tag=g.tag("tail", kv), sources=g.sources[kv], real_kv_mode=c._mode(g, kv))
        self._write_all(batch, "tail")
        c.step_tensor.add_(1)

    def _refill_tokens(self, batch):
        c, hist = self.c, batch.token_history
        if not c.config.token_check or hist is None:
            return None, None
        if isinstance(hist, TokenAppend):
            if hist.cell_rows.shape[0]:
                c.token_table.index_put_((hist.cell_rows, hist.cell_cols), hist.cell_tokens.to(torch.int32))
            return c.token_table, hist.valid_lens
        flat, offsets = hist.flat.to(torch.int64), hist.offsets.to(torch.int64)
        if batch.batch_size and flat.shape[0]:
            self.impl.scatter_req_token_ids(flat, offsets, batch.req_pool_indices.to(torch.int64), c.token_table)
        valid = c._valid_lens[:batch.batch_size]
        torch.sub(offsets[1:], offsets[:-1], out=valid)
        return c.token_table, valid

    def _write_all(self, batch, phase: str) -> None:
        c, cfg, bs = self.c, self.c.config, batch.batch_size
        for g in c.groups:
            loc = batch.out_cache_loc if g.table is None else self._translate(batch.out_cache_loc, g.table)
            for kv in g.kvs:
                # The input and chain-position asserts run once per forward: on the HEAD K write of FULL.
                first = phase == "head" and kv == "k" and g.name == "full"
                tail = phase == "tail"
                self.impl.write(
                    buf=g.bufs[phase, kv], write_offsets=g.plan.write_offsets, seed_slot=g.plan.seed_slot,
                    num_requests=bs, out_cache_loc=loc, input_ids=batch.input_ids, positions=batch.positions,
                    ring=c.ring, counters=c.counters, launch_tag=g.tag(phase, kv),
                    sources=g.sources[kv] if tail else (),
                    real_kv_mode=c._mode(g, kv) if tail else int(RealKvMode.NONE),
                    expected_input_ids=batch.expected_input_ids if first and cfg.input_check else None,
                    expected_positions=batch.expected_positions if first and cfg.input_check else None,
                    chain_check=c.chain_check if first else None,
                    writer_ids=batch.request_ids if self.attribution else None, step=c.step_tensor)

    def _translate(self, loc: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Full-pool slots -> SWA slots through the live table (out of range passes through), in a static buffer."""
        out = self.swa_loc[:loc.shape[0]]
        idx = loc.to(torch.int64)
        inside = (idx >= 0) & (idx < table.shape[0])
        out.copy_(table.index_select(0, idx.clamp(0, table.shape[0] - 1)))
        torch.where(inside, out, idx, out=out)
        return out
