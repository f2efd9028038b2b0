"""Public ops: docstring, validation and defaults, then dispatch to one implementation.

Every op has four implementations with one keyword signature: ``reference``
(scalar oracle), ``torch`` (vectorised, any device), ``numba`` (compiled loops,
CPU tensors only; the CPU default when numba imports) and ``triton`` (the CUDA
default; on CPU only under ``TRITON_INTERPRET=1``). ``backend="auto"`` picks
Triton on CUDA when it imports, numba on the CPU when it imports, torch otherwise.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from kvcanary.format import ATTRIBUTION_STRIDE, RealKvMode
from kvcanary.ops import validate as v
from kvcanary.ops.types import NO_LIMIT, Entries, Plan, ViolationRing

BACKENDS = ("auto", "reference", "torch", "numba", "triton")
_MODULES = {"reference": "kvcanary.ops.reference", "torch": "kvcanary.ops.torch_ops",
            "numba": "kvcanary.ops.numba_ops", "triton": "kvcanary.ops.triton_ops"}
# (the read table's bodies sit in modules of their own, kvcanary/ops/read_table_ops.py: module, function)
_READ_TABLES = {"reference": ("kvcanary.ops.read_table_ops", "reference"),
                "torch": ("kvcanary.ops.read_table_ops", "torch_read_table"),
                "numba": ("kvcanary.ops.read_table_ops", "numba_read_table"),
                "triton": ("kvcanary.ops.triton_read_table", "read_table")}


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def numba_available() -> bool:
    """numba imports (``pip install 'kv-canary[cpu]'``); the import, not just the package, since a
    numba built for another numpy fails only when imported."""
    try:
        importlib.import_module("numba")
    except Exception:  # noqa: BLE001 - any failure to import means the backend is unusable
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete implementation name ``backend`` selects for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"kv-canary: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        return "numba" if device.type == "cpu" and numba_available() else "torch"
    if backend == "numba":
        if not numba_available():
            raise ValueError("kv-canary: backend must be importable, got 'numba' without the numba package "
                             "(pip install 'kv-canary[cpu]')")
        if device.type != "cpu":
            raise ValueError(f"kv-canary: backend 'numba' must run on cpu tensors, got {device.type}")
    if backend == "triton":
        if not triton_available():
            raise ValueError("kv-canary: backend must be importable, got 'triton' without the triton package "
                             "(pip install 'kv-canary[triton]')")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kv-canary: backend 'triton' on cpu tensors needs TRITON_INTERPRET=1, got it unset")
    return backend


def _impl(backend: str, device: torch.device):
    return impl_module(backend, device.type)


@functools.lru_cache(maxsize=None)
def _module(name: str):
    return importlib.import_module(_MODULES[name])


def impl_module(backend: str, device_type: str):
    """The implementation module ``backend`` selects on ``device_type`` (the import is cached)."""
    return _module(resolve_backend(backend, torch.device(device_type)))


def read_table_impl(backend: str, device_type: str):
    """The unvalidated read-table body ``backend`` selects on ``device_type`` (``read_table``'s arguments)."""
    module, name = _READ_TABLES[resolve_backend(backend, torch.device(device_type))]
    return getattr(importlib.import_module(module), name)


def read_table(out: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor, extend: torch.Tensor,
               read: torch.Tensor, clamp_max: int, limit: int = NO_LIMIT, fill: int = 0, *,
               backend: str = "auto") -> None:
    """Fill rows of a req_to_token table from a flat read index, in place (``kvcanary/ops/read_table_ops.py``).

    Args:
        out: int32/int64 [num_rows, width] table; row 0 (padding) and rows no request names keep their cells.
        rows, prefix, extend: int32/int64 [bs] each request's row of ``out`` and its two lengths.
        read: int32/int64 [n] the slots all requests read, back to back (int32 when ``out`` is).
        clamp_max: the last index of ``read`` a cell may take; limit, fill: cells at ``limit`` or past it
            take ``fill`` (``NO_LIMIT``: none).

    Row ``rows[i]`` gets ``out[rows[i], c] = read[min(start_i + c, clamp_max)]``, ``start_i`` the sum of
    ``prefix + extend`` over the requests before ``i``.
    """
    v.check_read_table("read_table", out, rows, prefix, extend, read, clamp_max, limit, fill)
    read_table_impl(backend, out.device.type)(out, rows, prefix, extend, read, clamp_max, limit, fill)


def scatter_req_token_ids(flat_in: torch.Tensor, offsets: torch.Tensor, req_pool_indices: torch.Tensor,
                          pool_out: torch.Tensor, *, backend: str = "auto") -> None:
    """Fill the expected-token table from a flat, CSR-delimited token list (SPEC 4.1).

    Args:
        flat_in: int64 [total] tokens of all requests back to back.
        offsets: int64 [bs + 1] CSR offsets into flat_in.
        req_pool_indices: int64 [bs] the row of pool_out each request fills.
        pool_out: int32 [num_rows, max_context] table; rows not addressed stay untouched.

    Request r writes ``pool_out[req_pool_indices[r], :n] = flat_in[start:start + n]``
    with ``n = min(offsets[r+1] - offsets[r], pool_out.shape[1])``.

    Example:
        >>> table = torch.zeros(4, 8, dtype=torch.int32)
        >>> scatter_req_token_ids(torch.tensor([5, 6, 7]), torch.tensor([0, 2, 3]),
        ...                       torch.tensor([1, 3]), table)
    """
    op = "scatter_req_token_ids"
    for name, t, nd in (("flat_in", flat_in, 1), ("offsets", offsets, 1), ("req_pool_indices", req_pool_indices, 1),
                        ("pool_out", pool_out, 2)):
        v.check_tensor(op, name, t)
        if t.dim() != nd:
            raise ValueError(f"kv-canary: {op} {name} must be {nd}-D, got shape {tuple(t.shape)}")
    for name, t, dt in (("flat_in", flat_in, torch.int64), ("offsets", offsets, torch.int64),
                        ("req_pool_indices", req_pool_indices, torch.int64), ("pool_out", pool_out, torch.int32)):
        if t.dtype != dt:
            raise TypeError(f"kv-canary: {op} {name} must be {str(dt).replace('torch.', '')}, got {t.dtype}")
    bs = int(req_pool_indices.shape[0])
    if int(offsets.shape[0]) != bs + 1:
        raise ValueError(f"kv-canary: {op} offsets length {offsets.shape[0]} != bs+1 ({bs + 1})")
    v.check_device(op, pool_out.device, flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices)
    if bs == 0 or flat_in.shape[0] == 0:
        return
    _impl(backend, pool_out.device).scatter_req_token_ids(flat_in, offsets, req_pool_indices, pool_out)


launch_scatter_req_token_ids_kernel = scatter_req_token_ids


def fingerprint(slots: torch.Tensor, sources=(), real_kv_mode: int = RealKvMode.PARTIAL, *,
                backend: str = "auto") -> torch.Tensor:
    """Real-KV hash of each slot (SPEC 3.4) as int64 [n]; 0 in mode NONE or without sources.

    Args:
        slots: int64 [n] slot indices (a slot outside a source hashes that source as empty).
        sources: up to 4 ``RealKvSource``, hashed in order.
        real_kv_mode: ``RealKvMode.NONE | PARTIAL | ALL``.
    """
    op = "fingerprint"
    v.check_vector(op, "slots", slots, (torch.int64,))
    sources = v.check_sources(op, sources, real_kv_mode, slots.device)
    return _impl(backend, slots.device).fingerprint(slots=slots, sources=sources, real_kv_mode=int(real_kv_mode))


def plan(*, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
         req_to_token: torch.Tensor, out: Plan, window: int = 0, full_to_swa: torch.Tensor | None = None,
         token_table: torch.Tensor | None = None, token_valid_lens: torch.Tensor | None = None,
         token_offset: int = 0, backend: str = "auto") -> None:
    """Build the verify entries and write metadata of one forward into ``out`` (SPEC 4.2).

    Args:
        req_pool_indices: int32/int64 [bs] request rows (row 0 = padding: no entries, no writes).
        prefix_lens: int32/int64 [bs] tokens whose KV exists before the forward (P).
        extend_lens: int32/int64 [bs] tokens this forward writes.
        req_to_token: int32/int64 [num_rows, max_context] slot of each (row, position).
        out: a ``Plan`` with capacity for the worst case; ``out.entries.enable`` is set to 0
            when the entries do not fit (the verify is then skipped, nothing is truncated).
        window: sliding window W (0 = FULL group: positions [0, P); else [max(0, P-W), P)).
        full_to_swa: int32/int64 [num_full_slots] translation table of the SWA group.
        token_table: int32 [num_rows, max_context] expected tokens (see ``scatter_req_token_ids``).
        token_valid_lens: int32/int64 [bs] valid prefix of each request's token_table row.
        token_offset: 0, or 1 for a draft model whose slot p holds the token of position p+1.
    """
    op = "plan"
    v.check_vector(op, "req_pool_indices", req_pool_indices, v.INDEX_DTYPES)
    bs = req_pool_indices.shape[0]
    v.check_vector(op, "prefix_lens", prefix_lens, v.INDEX_DTYPES, length=bs)
    v.check_vector(op, "extend_lens", extend_lens, v.INDEX_DTYPES, length=bs)
    v.check_ndim(op, "req_to_token", req_to_token, 2)
    v.check_dtype(op, "req_to_token", req_to_token, v.INDEX_DTYPES)
    v.check_plan(op, out, req_to_token.device, "out")  # (the compiled kernels trust its shapes)
    if bs > out.max_batch:
        raise v.fail_value(op, "req_pool_indices", f"at most the plan's max_batch ({out.max_batch}) long", bs)
    if not v.is_int(window) or window < 0:
        raise v.fail_value(op, "window", "an int >= 0", repr(window))
    if full_to_swa is not None:
        v.check_vector(op, "full_to_swa", full_to_swa, v.INDEX_DTYPES)
    if (token_table is None) != (token_valid_lens is None):
        raise v.fail_value(op, "token_valid_lens", "given exactly when token_table is given",
                           "one without the other")
    if token_table is not None:
        v.check_ndim(op, "token_table", token_table, 2)
        v.check_dtype(op, "token_table", token_table, (torch.int32,))
        v.check_vector(op, "token_valid_lens", token_valid_lens, v.INDEX_DTYPES, length=bs)
    if not v.is_int(token_offset) or token_offset not in (0, 1):
        raise v.fail_value(op, "token_offset", "0 or 1", repr(token_offset))
    device = req_to_token.device
    v.check_device(op, device, req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_lens=extend_lens,
                   full_to_swa=full_to_swa, token_table=token_table, token_valid_lens=token_valid_lens)
    _impl(backend, device).plan(req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_lens=extend_lens,
                                req_to_token=req_to_token, out=out, window=window, full_to_swa=full_to_swa,
                                token_table=token_table, token_valid_lens=token_valid_lens,
                                token_offset=token_offset)


def write(*, buf: torch.Tensor, plan: Plan, num_requests: int, out_cache_loc: torch.Tensor,
          input_ids: torch.Tensor, positions: torch.Tensor, ring: ViolationRing, counters: torch.Tensor,
          launch_tag: int, sources=(), real_kv_mode: int = RealKvMode.NONE,
          expected_input_ids: torch.Tensor | None = None, expected_positions: torch.Tensor | None = None,
          chain_check: torch.Tensor | None = None, writer_ids: torch.Tensor | None = None,
          step: torch.Tensor | None = None, chain_hint: torch.Tensor | None = None,
          backend: str = "auto") -> None:
    """Write the canary records of the tokens a forward writes (SPEC 4.3).

    Request r owns write entries ``[plan.write_offsets[r], plan.write_offsets[r+1])``; its
    chain starts from ``link(buf[plan.seed_slot[r]])`` for a seed inside the buffer (slot 0
    included), else from the chain head. Edge rules follow SGLang 0.5.23 (SPEC 4.3).

    Args:
        buf: uint8 [num_slots, stride] canary buffer of this group and K/V.
        plan: the forward's ``Plan`` (write_offsets, seed_slot); offsets must be non-negative and
            non-decreasing (checked when they are on the CPU).
        num_requests: bs of the forward (host int, <= plan.max_batch).
        out_cache_loc: int32/int64 [num_tokens] slot each token's KV goes to; < 0 skips the entry
            (no checks, no record, no chain step, not counted).
        input_ids, positions: int32/int64 [num_tokens] actual token and position of each entry.
        ring, counters: violation ring and counter table; launch_tag: a ``LaunchTag``.
        sources, real_kv_mode: real-KV fingerprint stored with each record (NONE stores 0).
        expected_input_ids, expected_positions: optional [num_tokens] write-input assert.
        chain_check: optional int32 [1] device flag arming the chain-position assert (requests
            with a seed only; a failing entry gets its own row after the write-input row).
        writer_ids: optional int64 [bs] request ids stored in WRITER_ID (stride >= 48).
        step: optional int64 [1] forward step stored in WRITER_STEP (stride >= 48).
        chain_hint: optional canary buffer of ``buf``'s shape that may already hold this write's chain
            fields (the HEAD buffer, for the TAIL write of the same entries). The stored bytes never
            depend on it: Triton checks, per request and in parallel, that the hint holds at every
            entry's slot exactly the token, position and chain hash the serial walk would store, and
            then copies them instead of walking (a prefill chunk's thousands of serial steps); any
            other request walks. Used only without the HEAD-only asserts (expected inputs, chain
            positions), whose rows come in chain order; the other backends always walk.
    """
    op = "write"
    v.check_canary_buffer(op, buf)
    v.check_plan(op, plan, buf.device)
    if not v.is_int(num_requests) or not 0 <= num_requests <= plan.max_batch:
        raise v.fail_value(op, "num_requests", f"an int in [0, {plan.max_batch}]", repr(num_requests))
    v.check_vector(op, "out_cache_loc", out_cache_loc, v.INDEX_DTYPES)
    n = out_cache_loc.shape[0]
    v.check_vector(op, "input_ids", input_ids, v.INDEX_DTYPES, length=n)
    v.check_vector(op, "positions", positions, v.INDEX_DTYPES, length=n)
    if expected_input_ids is not None:
        v.check_vector(op, "expected_input_ids", expected_input_ids, v.INDEX_DTYPES, length=n)
    if expected_positions is not None:
        v.check_vector(op, "expected_positions", expected_positions, v.INDEX_DTYPES, length=n)
    if chain_check is not None:
        v.check_vector(op, "chain_check", chain_check, (torch.int32,), length=1)
    if writer_ids is not None:
        v.check_vector(op, "writer_ids", writer_ids, (torch.int64,), min_length=num_requests)
    if step is not None:
        v.check_vector(op, "step", step, (torch.int64,), length=1)
    if chain_hint is not None:
        v.check_canary_buffer(op, chain_hint, "chain_hint")
        if chain_hint.shape != buf.shape:
            raise v.fail_value(op, "chain_hint", f"a canary buffer of buf's shape {tuple(buf.shape)}",
                               f"shape {tuple(chain_hint.shape)}")
    v.check_ring(op, ring, counters, buf.device)
    v.check_launch_tag(op, launch_tag, counters)
    sources = v.check_sources(op, sources, real_kv_mode, buf.device)
    v.check_device(op, buf.device, out_cache_loc=out_cache_loc, input_ids=input_ids, positions=positions,
                   expected_input_ids=expected_input_ids, expected_positions=expected_positions,
                   chain_check=chain_check, writer_ids=writer_ids, step=step, chain_hint=chain_hint)
    v.check_write_offsets(op, plan.write_offsets, num_requests)
    _impl(backend, buf.device).write(
        buf=buf, write_offsets=plan.write_offsets, seed_slot=plan.seed_slot, num_requests=num_requests,
        out_cache_loc=out_cache_loc, input_ids=input_ids, positions=positions, ring=ring, counters=counters,
        launch_tag=int(launch_tag), sources=sources, real_kv_mode=int(real_kv_mode),
        expected_input_ids=expected_input_ids, expected_positions=expected_positions, chain_check=chain_check,
        writer_ids=writer_ids if buf.shape[1] >= ATTRIBUTION_STRIDE else None, step=step, chain_hint=chain_hint)


def verify(*, buf: torch.Tensor, entries: Entries, ring: ViolationRing, counters: torch.Tensor, launch_tag: int,
           sources=(), real_kv_mode: int = RealKvMode.NONE, check_token: bool = True,
           backend: str = "auto") -> None:
    """Verify the records of every entry (SPEC 4.4); each failing entry adds one violation row.

    Checks per entry (slot 0 skipped but counted): chain (stored prev_hash == link(buf[prev]),
    the chain head for any negative prev, skipped for prev == 0), position, token (with
    ``check_token``, unless expected is -1) and real-KV hash (0 == 0 in mode NONE). A slot past
    the buffer reads as a zero record. While ``entries.enable`` is 0 nothing is checked; the
    launch is still counted (LAUNCHES + 1, ENTRIES + 0).

    Args:
        check_token: SGLang's ``check_verify_expected_token``. False skips the token check and
            reports EXPECTED_TOKEN as -1; True (the default) checks every entry whose expected
            token is not -1.
    """
    op = "verify"
    v.check_canary_buffer(op, buf)
    v.check_entries(op, entries, buf.device)
    v.check_ring(op, ring, counters, buf.device)
    v.check_launch_tag(op, launch_tag, counters)
    sources = v.check_sources(op, sources, real_kv_mode, buf.device)
    if not isinstance(check_token, bool):
        raise v.fail_type(op, "check_token", "a bool", type(check_token).__name__)
    _impl(backend, buf.device).verify(buf=buf, entries=entries, ring=ring, counters=counters,
                                      launch_tag=int(launch_tag), sources=sources, real_kv_mode=int(real_kv_mode),
                                      check_token=check_token)


def accept_rewrites(*, head_buf: torch.Tensor, tail_buf: torch.Tensor, plan: Plan, num_requests: int,
                    out_cache_loc: torch.Tensor, sources=(), real_kv_mode: int = RealKvMode.NONE,
                    rewrites: torch.Tensor | None = None, backend: str = "auto") -> None:
    """Take the real-KV hash of slots this forward rewrote with the record they hold from their new bytes.

    An engine may write a slot's KV again with the same token, position and chain (transformers
    recomputes the last token of an exact cached prefix into the shared block), while another request
    reads the slot in the same forward: the new bytes differ from the stored hash only by rounding.
    For each write entry ``i`` in ``[write_offsets[0], write_offsets[num_requests])`` whose slot
    ``s = out_cache_loc[i]`` is in ``[1, num_slots)``: when ``head_buf[s]`` (this forward's HEAD write)
    equals ``tail_buf[s]`` in TOKEN, POSITION and PREV_HASH, ``tail_buf[s]``'s REAL_KV_HASH becomes the
    fingerprint of the slot's current bytes and ``rewrites`` grows by one. Nothing else changes: the
    TAIL verify that follows keeps its token, position and chain checks, and a rewrite with another
    record keeps the stored hash, so its byte change is still reported.

    Args:
        head_buf, tail_buf: uint8 [num_slots, stride] HEAD and TAIL canary buffers of one group and K/V.
        plan, num_requests: the forward's plan (write_offsets) and bs, as for ``write``.
        out_cache_loc: int32/int64 [num_tokens] slots written (SWA groups: translated).
        sources, real_kv_mode: the real-KV fingerprint, as the TAIL write takes it.
        rewrites: optional int64 [1] counter of accepted entries (a slot twice in the list counts twice).
    """
    op = "accept_rewrites"
    v.check_canary_buffer(op, head_buf, "head_buf")
    v.check_canary_buffer(op, tail_buf, "tail_buf")
    if head_buf.shape != tail_buf.shape:
        raise v.fail_value(op, "head_buf", f"of tail_buf's shape {tuple(tail_buf.shape)}",
                           f"shape {tuple(head_buf.shape)}")
    v.check_plan(op, plan, tail_buf.device)
    if not v.is_int(num_requests) or not 0 <= num_requests <= plan.max_batch:
        raise v.fail_value(op, "num_requests", f"an int in [0, {plan.max_batch}]", repr(num_requests))
    v.check_vector(op, "out_cache_loc", out_cache_loc, v.INDEX_DTYPES)
    if rewrites is not None:
        v.check_vector(op, "rewrites", rewrites, (torch.int64,), length=1)
    sources = v.check_sources(op, sources, real_kv_mode, tail_buf.device)
    v.check_device(op, tail_buf.device, head_buf=head_buf, out_cache_loc=out_cache_loc, rewrites=rewrites)
    v.check_write_offsets(op, plan.write_offsets, num_requests)
    _impl(backend, tail_buf.device).accept_rewrites(
        head_buf=head_buf, tail_buf=tail_buf, write_offsets=plan.write_offsets, num_requests=num_requests,
        out_cache_loc=out_cache_loc, sources=sources, real_kv_mode=int(real_kv_mode), rewrites=rewrites)


def fill_entries(entries: Entries, slots: torch.Tensor, positions: torch.Tensor, prevs: torch.Tensor,
                 expected_tokens: torch.Tensor | None = None) -> None:
    """Load engine-supplied (slot, position, prev_slot) triples into ``entries`` (for sweeps).

    Args: slots, positions, prevs: int32/int64 [n]; expected_tokens optional [n] (default -1).
    More than ``entries.capacity`` triples set ``enable`` to 0 and ``count`` to the capacity, like an
    overflowing plan (the first ``capacity`` triples are still loaded).
    """
    op = "fill_entries"
    # (the triples may live elsewhere: they are copied in; the entries' own parts share one device)
    v.check_entries(op, entries, getattr(getattr(entries, "slot", None), "device", torch.device("cpu")))
    v.check_vector(op, "slots", slots, v.INDEX_DTYPES)
    n = slots.shape[0]
    v.check_vector(op, "positions", positions, v.INDEX_DTYPES, length=n)
    v.check_vector(op, "prevs", prevs, v.INDEX_DTYPES, length=n)
    if expected_tokens is not None:
        v.check_vector(op, "expected_tokens", expected_tokens, v.INDEX_DTYPES, length=n)
    k = min(n, entries.capacity)
    entries.slot[:k].copy_(slots[:k])
    entries.position[:k].copy_(positions[:k])
    entries.prev[:k].copy_(prevs[:k])
    if expected_tokens is None:
        entries.expected_token[:k].fill_(-1)
    else:
        entries.expected_token[:k].copy_(expected_tokens[:k])
    entries.requested.fill_(n)
    entries.count.fill_(k)
    entries.enable.fill_(int(n <= entries.capacity))
