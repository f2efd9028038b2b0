"""Value checks at the canary's public entry points, before anything is written.

The ops check metadata only (shape, dtype, device). A forward whose values are wrong — a row
past the table, a prefix wider than it, tokens that do not add up to ``out_cache_loc`` — would
otherwise be planned and written half-way and then reported as false violations, or fail deep
in the report path. Values live on the device, so reading them costs a sync on CUDA:
``CanaryConfig.value_check`` says when they are read (docs/configuration.md).
"""

from __future__ import annotations

import torch

from kvcanary.ops import validate as v
from kvcanary.runtime.batch import ForwardBatch, TokenAppend

OP = "forward batch"


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def check_batch_values(batch: ForwardBatch, *, num_rows: int, num_slots: int, max_context: int) -> None:
    """ValueError for a forward the canary cannot plan exactly (metadata is already checked)."""
    rows, pre, ext = (t.to(torch.int64) for t in (batch.req_pool_indices, batch.prefix_lens, batch.extend_lens))
    n, bs = batch.num_tokens, batch.batch_size
    table_rows, cols = batch.req_to_token.shape
    row_limit = min(table_rows, num_rows)
    zero = torch.zeros((), dtype=torch.int64, device=rows.device)
    pad = rows == 0
    # Row 0 is the padding row: the plan skips it, so a real request there is never verified, and
    # padding tokens before a real request would shift that request's write offsets.
    bad_pad = (pad & (pre > 0)) | ((pad & (ext > 0)).cumsum(0) > 0) & ~pad
    loc = batch.out_cache_loc.to(torch.int64)
    flags = torch.stack([
        ((rows < 0) | (rows >= row_limit)).any(), (pre < 0).any(), (ext < 0).any(), ((pre + ext) > cols).any(),
        ext.sum() if bs else zero, bad_pad.any(), (loc >= num_slots).any() if n else zero,
    ]).tolist()
    bad_rows, neg_pre, neg_ext, too_wide, total, bad_row0, bad_loc = flags
    if bad_rows:
        i = _first((rows < 0) | (rows >= row_limit))
        what = f"req_to_token rows ({table_rows})" if table_rows <= num_rows else f"Canary num_rows ({num_rows})"
        raise v.fail_value(OP, "req_pool_indices", f"rows in [0, {row_limit}) ({what})",
                           f"{int(rows[i])} at batch index {i}")
    if neg_pre or neg_ext:
        name, t = ("prefix_lens", pre) if neg_pre else ("extend_lens", ext)
        i = _first(t < 0)
        raise v.fail_value(OP, name, ">= 0", f"{int(t[i])} at batch index {i}")
    if too_wide:
        i = _first((pre + ext) > cols)
        raise v.fail_value(OP, "prefix_lens + extend_lens", f"<= req_to_token columns ({cols})",
                           f"{int(pre[i])} + {int(ext[i])} at batch index {i}")
    if bad_row0:
        i = _first(bad_pad)
        raise v.fail_value(OP, "req_pool_indices",
                           "free of row 0 for real requests (row 0 is the padding row: prefix_lens 0, after every "
                           "real request)", f"row {int(rows[i])} with prefix_lens {int(pre[i])} at batch index {i}")
    if total != n:
        raise v.fail_value(OP, "out_cache_loc", f"of length sum(extend_lens) = {total}", f"length {n}")
    if bad_loc:
        i = _first(loc >= num_slots)
        raise v.fail_value(OP, "out_cache_loc", f"slots < num_slots ({num_slots}) (< 0 = no write)",
                           f"{int(loc[i])} at token {i}")
    hist = batch.token_history
    if isinstance(hist, TokenAppend):
        _check_append(hist, num_rows, max_context)
    elif hist is not None:
        offsets = hist.offsets.to(torch.int64)
        lens = offsets[1:] - offsets[:-1]
        first, last, neg, wide = torch.stack([offsets[0], offsets[-1], (lens < 0).any(),
                                              (lens > max_context).any() if bs else zero]).tolist()
        if first != 0 or last != hist.flat.shape[0] or neg:
            raise v.fail_value(OP, "token_history.offsets", f"non-decreasing from 0 to len(flat) = "
                               f"{hist.flat.shape[0]}", f"{hist.offsets.tolist()}")
        if wide:
            raise v.fail_value(OP, "token_history", f"histories of at most max_context ({max_context}) tokens",
                               f"{int(lens.max())} tokens")


def _check_append(hist: TokenAppend, num_rows: int, max_context: int) -> None:
    for name, t, hi in (("cell_rows", hist.cell_rows, num_rows), ("cell_cols", hist.cell_cols, max_context),
                        ("valid_lens", hist.valid_lens, max_context + 1)):
        if not t.shape[0]:
            continue
        lo_got, hi_got = torch.stack([t.min(), t.max()]).tolist()
        if lo_got < 0 or hi_got >= hi:
            raise v.fail_value(OP, f"token_history.{name}", f"values in [0, {hi})", f"[{lo_got}, {hi_got}]")


def slots_tensor(op: str, name: str, slots: object, num_slots: int, device: torch.device,
                 length: int | None = None) -> torch.Tensor:
    """A 1-D int32/int64 tensor of slots in [0, num_slots) as int64 on ``device`` (syncs on CUDA)."""
    v.check_vector(op, name, v.check_tensor(op, name, slots), v.INDEX_DTYPES, length=length)
    if slots.shape[0]:
        lo, hi = torch.stack([slots.min(), slots.max()]).to(torch.int64).tolist()
        if lo < 0 or hi >= num_slots:
            raise v.fail_value(op, name, f"slots in [0, {num_slots})", f"[{lo}, {hi}]")
    return slots.to(device=device, dtype=torch.int64)
