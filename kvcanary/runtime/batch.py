"""Engine-neutral descriptions of a KV pool and of one forward (SPEC sections 2 and 6).

An engine adapter fills these from its own bookkeeping; the canary knows no engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kvcanary.ops.types import RealKvSource


class ForwardMode(enum.Enum):
    """What the engine reports per mode (SPEC 2): prefix_len / extend_len."""

    EXTEND = "extend"  # cached prefix / new tokens (prefill and prefill chunks)
    DECODE = "decode"  # seq_len - 1 / 1
    TARGET_VERIFY = "target_verify"  # seq_len / draft_token_num
    DRAFT_EXTEND = "draft_extend"  # seq_len - extend_len / extend_len


@dataclass(frozen=True)
class SwaSpec:
    """The sliding-window address space.

    Attributes:
        num_slots: slots of the SWA pool.
        window: W; an SWA layer reads positions [max(0, P - W), P).
        full_to_swa: int32/int64 [full num_slots] live engine table (0 = evicted).
        k_sources, v_sources: real-KV sources of the SWA pool (up to 4 each).
    """

    num_slots: int
    window: int
    full_to_swa: torch.Tensor
    k_sources: tuple[RealKvSource, ...] = ()
    v_sources: tuple[RealKvSource, ...] = ()

    def __post_init__(self) -> None:
        _check_int("SwaSpec", "num_slots", self.num_slots, 2)
        _check_int("SwaSpec", "window", self.window, 1)
        if not isinstance(self.full_to_swa, torch.Tensor) or self.full_to_swa.dim() != 1:
            raise ValueError("kv-canary: SwaSpec full_to_swa must be a 1-D tensor, got "
                             f"{getattr(self.full_to_swa, 'shape', type(self.full_to_swa).__name__)}")


@dataclass(frozen=True)
class PoolSpec:
    """The engine's KV pool as the canary sees it.

    Attributes:
        num_slots: slots of the full pool, slot 0 included (reserved for padding writes).
        k_sources, v_sources: where slots' K / V bytes live (``RealKvSource``, up to 4 each),
            e.g. layer 0's K cache; empty = no real-KV hash for that buffer.
        swa: the optional sliding-window group.
        reserved_slots: slots besides slot 0 that no live token may map to (the engine's write-trash or
            padding slots): a live read or write there is reported (``CanaryConfig.reserved_check``).
    """

    num_slots: int
    k_sources: tuple[RealKvSource, ...] = ()
    v_sources: tuple[RealKvSource, ...] = ()
    swa: SwaSpec | None = None
    reserved_slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_int("PoolSpec", "num_slots", self.num_slots, 2)
        for name in ("k_sources", "v_sources"):
            value = getattr(self, name)
            if isinstance(value, RealKvSource) or not isinstance(value, (tuple, list)):
                raise TypeError(f"kv-canary: PoolSpec {name} must be a tuple of RealKvSource, got "
                                f"{type(value).__name__}")
            object.__setattr__(self, name, tuple(value))
        reserved = self.reserved_slots
        if not isinstance(reserved, (tuple, list)) or not all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < self.num_slots for x in reserved):
            raise ValueError(f"kv-canary: PoolSpec reserved_slots must be a tuple of ints in [0, num_slots = "
                             f"{self.num_slots}), got {reserved!r}")
        object.__setattr__(self, "reserved_slots", tuple(reserved))
        if self.swa is not None and not isinstance(self.swa, SwaSpec):
            raise TypeError(f"kv-canary: PoolSpec swa must be a SwaSpec or None, got {type(self.swa).__name__}")


def layer_sources(keys, values, check_v: bool) -> tuple[tuple[RealKvSource, ...], tuple[RealKvSource, ...]]:
    """(K buffer sources, V buffer sources) of a pool's real-KV hash, from its per-layer K and V tensors
    (``keys[j]``: layer j's rows, one per slot): more than one layer, K and V.

    Without V buffers the K record hashes the first layer's K and the last layer's V (2 sources:
    each source is a few more tensor ops per launch on the CPU), so a copy that skips V, skips K,
    or moves only the first or only the last layer changes the hash. With V buffers, K records
    hash the K of up to 4 layers (first, last and evenly spaced between) and V records the V of
    the same layers.
    """
    n = len(keys)
    if check_v:
        layers = sorted({round(i * (n - 1) / 3) for i in range(4)}) if n > 1 else [0]
        return (tuple(s for j in layers for s in row_sources(keys[j])),
                tuple(s for j in layers for s in row_sources(values[j])))
    return row_sources(keys[0]) + row_sources(values[n - 1]), ()


def row_sources(tensor: torch.Tensor | None) -> tuple[RealKvSource, ...]:
    """One real-KV source over a cache tensor (one slot per row), or none when its rows are not 16-byte multiples."""
    if tensor is None:
        return ()
    rows = tensor.view(tensor.shape[0], -1)
    nbpt = rows.shape[1] * rows.element_size()
    if nbpt % 16:
        return ()
    return (RealKvSource(rows, page_size=1, num_bytes_per_token=nbpt, read_bytes=nbpt),)


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; a float or a string would only fail later, deep inside an allocation.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"kv-canary: {owner} {name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"kv-canary: {owner} {name} must be an int >= {minimum}, got {value!r}")


@dataclass
class TokenHistory:
    """Per request, the tokens of positions [0, n): prompt + outputs, CSR-packed.

    flat: int64 [total]; offsets: int64 [bs + 1].
    """

    flat: torch.Tensor
    offsets: torch.Tensor


@dataclass
class TokenAppend:
    """The token history as an update, for engines whose request rows stay put across forwards.

    The canary's token table keeps each row between forwards; an engine that gives every request a
    stable ``req_pool_indices`` row sends only the cells the table lacks (a decode step: one token per
    request) instead of every request's whole history each forward.

    cell_rows, cell_cols, cell_tokens: int32/int64 [n] token table cells to set (rows < the canary's
        num_rows, columns < its max_context; ``before_forward`` rejects others before writing any).
    valid_lens: int32/int64 [bs] per request of the batch, the positions [0, valid) its row holds.
    """

    cell_rows: torch.Tensor
    cell_cols: torch.Tensor
    cell_tokens: torch.Tensor
    valid_lens: torch.Tensor


@dataclass
class ForwardBatch:
    """One forward as the engine runs it.

    Attributes:
        req_pool_indices: int32/int64 [bs] request rows of req_to_token (row 0 = padding).
        prefix_lens: int32/int64 [bs] tokens whose KV exists before the forward.
        extend_lens: int32/int64 [bs] tokens this forward writes.
        input_ids: int32/int64 [num_tokens] tokens the model consumes, request-major.
        positions: int32/int64 [num_tokens] their positions.
        out_cache_loc: int32/int64 [num_tokens] full-pool slots the forward writes (< 0 = none).
        req_to_token: int32/int64 [num_rows, max_context] the engine's table (or one built from
            block tables), already holding this forward's slots.
        request_ids: optional int64 [bs] stable request ids (attribution, token oracle).
        token_history: optional per-request prompt + outputs (token-history check): a whole
            ``TokenHistory`` per forward, or a ``TokenAppend`` update when rows are stable.
        expected_input_ids, expected_positions: optional [num_tokens] (write-input assert).
        mode: the forward mode (SPEC 2 table); informational.
        token_offset: 1 for a draft model whose slot p holds the token of position p + 1.
    """

    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_to_token: torch.Tensor
    request_ids: torch.Tensor | None = None
    token_history: TokenHistory | TokenAppend | None = None
    expected_input_ids: torch.Tensor | None = None
    expected_positions: torch.Tensor | None = None
    mode: ForwardMode = ForwardMode.EXTEND
    token_offset: int = 0

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.shape[0])


class SharedRowError(ValueError):
    """Two real requests of one forward in one request row: ``row``, and the batch ``indices`` holding it.

    An engine that frees a request row twice (or hands a row out while its owner still runs) builds
    such a batch; so does an adapter that maps two requests to one row. The canary cannot tell the two
    apart, and checking the forward would report what follows from it, never-written reads, instead of
    its cause; so ``before_forward`` refuses it with this error before any state changes."""

    def __init__(self, row: int, indices: tuple[int, int]):
        self.row, self.indices = row, indices
        super().__init__(f"kv-canary: forward batch req_pool_indices must be distinct rows for real requests "
                         f"(only the padding row 0 may repeat), got row {row} at batch indices {indices[0]} "
                         f"and {indices[1]}")


def check_distinct_rows(batch: ForwardBatch) -> None:
    """``SharedRowError`` when two real requests of one forward share a request row (row 0, the padding
    row, may repeat). Both would plan their reads and writes from the same table row: the first one's
    new tokens are never written where the second reads them. Reads the rows' values: a sync on CUDA,
    so it runs with the value checks (``CanaryConfig.value_check``)."""
    t = batch.req_pool_indices
    rows = (t if t.is_cpu else t.cpu()).tolist()  # (batches are short: a list and a set beat tensor ops)
    real = len(rows) - rows.count(0)
    if real < 2 or len(set(rows)) - (0 in rows) == real:
        return
    seen: dict[int, int] = {}
    for i, row in enumerate(rows):
        if row != 0 and row in seen:
            raise SharedRowError(row, (seen[row], i))
        seen[row] = i


def translate_slot(x: int, table: list[int] | None) -> int:
    """A full-pool slot through a full->SWA table as a list (out of range passes through, as in the ops)."""
    return table[x] if table is not None and 0 <= x < len(table) else x


def batch_lists(batch: ForwardBatch) -> tuple[list[int], list[int], list[int]]:
    """(rows, prefix_lens, request ids) of a batch as host lists; ids default to the rows."""
    rows, prefix = batch.req_pool_indices.tolist(), batch.prefix_lens.tolist()
    ids = batch.request_ids.tolist() if batch.request_ids is not None else rows
    return rows, prefix, ids


def verified_cells(batch: ForwardBatch, window: int, table: torch.Tensor | None) -> list[tuple[int, int, int, int]]:
    """(request id, position, slot, prev slot) of every cell a forward verifies in one group.

    Host-side and syncing: for reports and self-tests, never the hot path.
    """
    rows, prefix, ids = batch_lists(batch)
    table_l = None if table is None else table.tolist()
    num_rows = batch.req_to_token.shape[0]
    out = []
    for r, row in enumerate(rows):
        # Rows outside the table read nothing the canary can name (before_forward rejects them).
        if not 0 < row < num_rows or prefix[r] <= 0:
            continue
        start = max(0, prefix[r] - window) if window else 0
        cells = [translate_slot(c, table_l) for c in batch.req_to_token[row, :prefix[r]].tolist()]
        start = min(start, len(cells))
        out.extend((ids[r], p, cells[p], cells[p - 1] if p > 0 else -1) for p in range(start, len(cells)))
    return out
