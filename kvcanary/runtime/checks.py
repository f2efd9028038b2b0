"""Value checks at the canary's public entry points, before anything is written.

The ops check metadata only (shape, dtype, device). A forward whose values are wrong — a row
past the table, a prefix wider than it, tokens that do not add up to ``out_cache_loc`` — would
otherwise be planned and written half-way and then reported as false violations, or fail deep
in the report path. Values live on the device, so reading them costs a sync on CUDA:
``CanaryConfig.value_check`` says when they are read (docs/configuration.md).

On the CPU the per-forward value checks run first as one compiled pass (numba), where numba imports:
``check_batch_values`` reads a dozen small tensors and walks the requests in Python, about 75 us of a
tiny-model decode step on the dev CPU (batch 4, context 256, host timers, 12ca468), inside a step whose
canary work the goals cap at 15%. ``batch_ok`` answers only "would every check pass?" in one compiled loop
over zero-copy views; where it says no (or cannot say: a flat token history, an accelerator, no numba) the
Python checks run as before and raise their exact error. So it can skip checks that pass, never one that
fails: it is held to the Python checks on the same batches (tests/test_checks_fast.py).
"""

from __future__ import annotations

import torch

from kvcanary.ops import validate as v
from kvcanary.runtime.batch import ForwardBatch, PoolSpec, TokenAppend
from kvcanary.runtime.config import CanaryConfig
from kvcanary.runtime.report import MISSING_TOKEN

OP = "forward batch"


def check_batch_values(batch: ForwardBatch, *, num_rows: int, num_slots: int, max_context: int) -> None:
    """ValueError for a forward the canary cannot plan exactly (metadata is already checked)."""
    if batch_ok(batch, num_rows, num_slots, max_context):  # (the CPU with numba: every check at once)
        return
    # Per-request vectors are short: host lists and one loop cost less than a dozen tensor ops.
    rows, pre, ext = batch.req_pool_indices.tolist(), batch.prefix_lens.tolist(), batch.extend_lens.tolist()
    table_rows, cols = batch.req_to_token.shape
    row_limit = min(table_rows, num_rows)
    padding, written = False, 0  # (written: the real requests' tokens, ahead of any padding's)
    for i, (row, p, e) in enumerate(zip(rows, pre, ext)):
        if not 0 <= row < row_limit:
            what = f"req_to_token rows ({table_rows})" if table_rows <= num_rows else f"Canary num_rows ({num_rows})"
            raise v.fail_value(OP, "req_pool_indices", f"rows in [0, {row_limit}) ({what})",
                               f"{row} at batch index {i}")
        if p < 0 or e < 0:
            name, x = ("prefix_lens", p) if p < 0 else ("extend_lens", e)
            raise v.fail_value(OP, name, ">= 0", f"{x} at batch index {i}")
        if p + e > cols:
            raise v.fail_value(OP, "prefix_lens + extend_lens", f"<= req_to_token columns ({cols})",
                               f"{p} + {e} at batch index {i}")
        # Row 0 is the padding row: the plan skips it, so a real request there is never verified, and
        # padding tokens before a real request would shift that request's write offsets.
        if (row == 0 and p > 0) or (row != 0 and padding):
            raise v.fail_value(OP, "req_pool_indices",
                               "free of row 0 for real requests (row 0 is the padding row: prefix_lens 0, after "
                               "every real request)", f"row {row} with prefix_lens {p} at batch index {i}")
        padding = padding or (row == 0 and e > 0)
        written += e if row != 0 else 0
    n, total = batch.num_tokens, sum(ext)
    if total != n:
        raise v.fail_value(OP, "out_cache_loc", f"of length sum(extend_lens) = {total}", f"length {n}")
    if written:  # (the padding requests' input ids, last, are never written nor read)
        _check_tokens("input_ids", batch.input_ids[:written], "token ids")
    # the padding requests' tokens come last and are never written: their slots are not checked
    if written and int(_host(batch.out_cache_loc[:written]).max()) >= num_slots:
        loc = batch.out_cache_loc[:written]
        i = int((loc >= num_slots).nonzero()[0, 0])
        raise v.fail_value(OP, "out_cache_loc", f"slots < num_slots ({num_slots}) (< 0 = no write)",
                           f"{int(loc[i])} at token {i}")
    hist = batch.token_history
    if isinstance(hist, TokenAppend):
        _check_append(hist, num_rows, max_context)
        _check_tokens("token_history.cell_tokens", hist.cell_tokens, HISTORY_TOKENS)
    elif hist is not None:
        _check_tokens("token_history.flat", hist.flat, HISTORY_TOKENS)
        offsets = hist.offsets.tolist()
        lens = [b - a for a, b in zip(offsets, offsets[1:])]
        if offsets[0] != 0 or offsets[-1] != hist.flat.shape[0] or min(lens, default=0) < 0:
            raise v.fail_value(OP, "token_history.offsets", f"non-decreasing from 0 to len(flat) = "
                               f"{hist.flat.shape[0]}", f"{offsets}")
        if max(lens, default=0) > max_context:
            raise v.fail_value(OP, "token_history", f"histories of at most max_context ({max_context}) tokens",
                               f"{max(lens)} tokens")


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


def _check_append(hist: TokenAppend, num_rows: int, max_context: int) -> None:
    for name, t, hi in (("cell_rows", hist.cell_rows, num_rows), ("cell_cols", hist.cell_cols, max_context),
                        ("valid_lens", hist.valid_lens, max_context + 1)):
        if not t.shape[0]:
            continue
        values = _host(t)
        lo_got, hi_got = int(values.min()), int(values.max())
        if lo_got < 0 or hi_got >= hi:
            raise v.fail_value(OP, f"token_history.{name}", f"values in [0, {hi})", f"[{lo_got}, {hi_got}]")


TOKEN_MAX = 2**31 - 1  # the canary's token table is int32 (SPEC 4.1): a larger id would wrap there
HISTORY_TOKENS = f"token ids or MISSING_TOKEN ({MISSING_TOKEN}: a position the history lacks)"


def _check_tokens(name: str, tokens: torch.Tensor, what: str) -> None:
    """Token ids in [0, 2^31): the token table holds them as int32, and an id it cannot hold would be stored
    wrapped and compared with the record's int64 token (a false ``verify_token``); a negative id would read
    as "not checked" (-1) or as a missing history (``MISSING_TOKEN``, which a history may hold)."""
    if not tokens.shape[0]:
        return
    values = _host(tokens)
    history = name.startswith("token_history")
    bad = (values < 0) | (values > TOKEN_MAX)
    if history:
        bad &= values != MISSING_TOKEN
    if bad.any():
        i = int(bad.nonzero()[0][0])
        raise v.fail_value(OP, name, f"{what} in [0, 2^31 - 1 = {TOKEN_MAX}] (the canary's token table is int32)",
                           f"{int(values[i])} at index {i}")


def _host(t: torch.Tensor):
    """The values as a numpy array: a view on the CPU (a tensor reduction there costs several times
    more host time at these sizes), a copy (a sync) on an accelerator."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def slots_tensor(op: str, name: str, slots: object, num_slots: int, device: torch.device,
                 length: int | None = None) -> torch.Tensor:
    """A 1-D int32/int64 tensor of slots in [0, num_slots) as int64 on ``device`` (syncs on CUDA)."""
    v.check_vector(op, name, v.check_tensor(op, name, slots), v.INDEX_DTYPES, length=length)
    if slots.shape[0]:
        lo, hi = (int(x) for x in torch.aminmax(slots))
        if lo < 0 or hi >= num_slots:
            raise v.fail_value(op, name, f"slots in [0, {num_slots})", f"[{lo}, {hi}]")
    return slots.to(device=device, dtype=torch.int64)


def check_batch_sizes(batch: ForwardBatch, *, max_batch: int, max_tokens: int, max_context: int) -> None:
    """ValueError for a forward larger than the Canary's static buffers (metadata only, no sync)."""
    v.check_ndim(OP, "req_to_token", batch.req_to_token, 2)
    if batch.batch_size > max_batch:
        raise ValueError(f"kv-canary: forward batch size must be <= max_batch ({max_batch}), got "
                         f"{batch.batch_size}; raise Canary(max_batch=...)")
    if batch.num_tokens > max_tokens:
        raise ValueError(f"kv-canary: forward tokens must be <= max_tokens ({max_tokens}), got "
                         f"{batch.num_tokens}; raise Canary(max_tokens=...)")
    if batch.req_to_token.shape[1] > max_context:
        raise ValueError(f"kv-canary: req_to_token columns must be <= max_context ({max_context}), got "
                         f"{batch.req_to_token.shape[1]}; raise Canary(max_context=...)")


def check_canary_args(pool, config, on_violation, **sizes: int) -> None:
    """``Canary``'s arguments, before anything is built: a ``PoolSpec``, a ``CanaryConfig`` or None, sizes that
    are ints >= 1, a callable or None ``on_violation`` (TypeError / ValueError naming the argument)."""
    if not isinstance(pool, PoolSpec):
        raise TypeError(f"kv-canary: Canary pool must be a PoolSpec, got {type(pool).__name__}")
    if config is not None and not isinstance(config, CanaryConfig):
        raise TypeError(f"kv-canary: Canary config must be a CanaryConfig or None, got {type(config).__name__}"
                        " (CanaryConfig(**options) builds one)")
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise (ValueError if isinstance(value, int) and not isinstance(value, bool) else TypeError)(
                f"kv-canary: Canary {name} must be an int >= 1, got {value!r}")
    if on_violation is not None and not callable(on_violation):
        raise TypeError(f"kv-canary: Canary on_violation must be a callable or None, got {on_violation!r}")


def canary_device(device: object) -> torch.device:
    """The Canary's device argument as a torch.device that exists here, else ValueError."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"kv-canary: Canary device must be a torch device such as 'cpu' or 'cuda:0', "
                         f"got {device!r}") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            raise ValueError(f"kv-canary: Canary device must be an available device, got {device!r} with "
                             f"{count} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"kv-canary: Canary device must be 'cpu' or a CUDA device, got {device!r}")
    return dev


def check_injection(cfg, canary) -> None:
    """ValueError for a fault-injection setting the canary cannot honour (before any state changes)."""
    if cfg.mode == "none":
        raise ValueError("kv-canary: fault injection needs mode 'log' or 'raise', got mode 'none'")
    groups = [g.name for g in canary.groups]
    flips = [n for n in ("inject_kv_prob", "inject_cached_prob", "inject_after_prob") if getattr(cfg, n) > 0]
    if flips and cfg.inject_group not in groups:
        raise ValueError(f"kv-canary: {flips[0]} targets inject_group={cfg.inject_group!r}, got a pool with "
                         f"groups {groups} (give PoolSpec(swa=...) or set inject_group='full')")
    for name in flips:
        group = "full" if name == "inject_cached_prob" else cfg.inject_group
        if cfg.real_kv == "none":
            raise ValueError(f"kv-canary: {name} needs real-KV hashing, got real_kv='none' "
                             "(set KV_CANARY_REAL_KV=partial or all)")
        g = canary._group(group)
        if not any(g.sources[kv] for kv in g.kvs):
            raise ValueError(f"kv-canary: {name} needs real-KV sources in the {group} group, got none "
                             "(give PoolSpec k_sources / SwaSpec k_sources)")
    if cfg.inject_cached_prob and not cfg.sweep_interval:
        raise ValueError("kv-canary: inject_cached_prob needs the periodic sweep, got sweep_interval=0 "
                         "(set KV_CANARY_SWEEP_INTERVAL and a sweep provider)")
    if cfg.inject_swap_prob and not cfg.input_check:
        raise ValueError("kv-canary: inject_swap_prob needs the write-input assert, got input_check=False")


_kernel = None  # the compiled pass once imported; False where numba does not import


def _compiled():
    global _kernel
    if _kernel is None:
        try:
            from kvcanary.ops.numba_steady import batch_values_ok
        except Exception:  # (numba absent, or built for another numpy)
            _kernel = False
        else:
            _kernel = batch_values_ok
    return _kernel


def batch_ok(batch: ForwardBatch, num_rows: int, num_slots: int, max_context: int) -> bool:
    """True only if every check of ``check_batch_values`` passes for ``batch``; False: run them."""
    kernel = _kernel if _kernel is not None else _compiled()
    hist = batch.token_history
    if not kernel or batch.out_cache_loc.device.type != "cpu" or not isinstance(hist, TokenAppend):
        return False
    parts = (batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.out_cache_loc,
             hist.cell_rows, hist.cell_cols, hist.valid_lens)
    tokens = (batch.input_ids, hist.cell_tokens)  # (int32 too: an engine's input ids often are)
    if any(t.dtype != torch.int64 or t.dim() != 1 for t in parts) or any(
            t.dtype not in (torch.int32, torch.int64) or t.dim() != 1 for t in tokens):
        return False  # (other dtypes: the Python checks, rather than one compiled variant per dtype)
    rows, pre, ext, loc, cell_rows, cell_cols, valid_lens, ids, cell_tokens = (t.numpy() for t in parts + tokens)
    table_rows, cols = batch.req_to_token.shape
    return bool(kernel(rows, pre, ext, min(table_rows, num_rows), cols, batch.num_tokens, loc,
                       num_slots, cell_rows, cell_cols, valid_lens, num_rows, max_context, ids, cell_tokens,
                       MISSING_TOKEN))
