"""Compiled CPU implementation of every op (``backend="numba"``): same keyword signatures as ``reference``.

The vectorised torch path spends its time in hundreds of small tensor ops per forward (64-bit
hashing emulated on int64 tensors, chains stepped one token at a time); here each op is one
compiled loop over zero-copy numpy views of the CPU tensors (``numba_kernels.py``), so a
forward's launches cost a few microseconds each plus the work itself.

Compile cost: the kernels are compiled on first use and cached on disk (numba's ``cache=True``,
next to this file or in the user's cache directory), so only a fresh install pays it, once.
Arguments are normalised before the call (index vectors to contiguous int64, absent optionals to
empty arrays) so each kernel has one or two type specialisations rather than one per dtype mix.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcanary.format import ATTRIBUTION_STRIDE, PARTIAL_READ_BYTES, Counter, RealKvMode
from kvcanary.ops import numba_kernels as k
from kvcanary.ops import torch_ops

__all__ = ["fingerprint", "plan", "scatter_req_token_ids", "verify", "write"]

_EMPTY64 = np.zeros(0, dtype=np.int64)
_EMPTY_TABLE = np.zeros((0, 0), dtype=np.int32)


def _i64(t: torch.Tensor) -> np.ndarray:
    """A contiguous int64 numpy array of t: the tensor's own memory when it already is one (read-only use)."""
    a = t.detach().numpy()
    if a.dtype != np.int64 or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, dtype=np.int64)
    return a


def _table(t: torch.Tensor) -> np.ndarray:
    """A 2-D index table in its own dtype (int32 or int64): converting a whole table per call would copy it."""
    a = t.detach().numpy()
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _writable(*tensors: torch.Tensor) -> bool:
    """Outputs are written in place through numpy views: they must be contiguous (always so when allocated here)."""
    return all(t.is_contiguous() for t in tensors)


def _storage_bytes(t: torch.Tensor) -> tuple[np.ndarray, int, int]:
    """(whole storage as uint8, byte offset of t, row stride in bytes): any dtype, bf16 included, no copy."""
    flat = torch.empty(0, dtype=torch.uint8)
    flat.set_(t.untyped_storage())
    return flat.numpy(), t.storage_offset() * t.element_size(), t.stride(0) * t.element_size()


def _fingerprints(slots: np.ndarray, sources, real_kv_mode: int) -> np.ndarray:
    """int64 real-KV hash of each slot (SPEC 3.4), source by source like the reference."""
    acc = np.zeros(slots.shape[0], dtype=np.int64)
    if real_kv_mode == RealKvMode.NONE or not sources or not slots.shape[0]:
        return acc
    for src in sources:
        num_bytes = PARTIAL_READ_BYTES if real_kv_mode == RealKvMode.PARTIAL else src.read_bytes
        data, base, row_stride = _storage_bytes(src.tensor)
        k.mix_source(acc, slots, data, base, row_stride, src.page_size, src.num_bytes_per_token,
                     src.tensor.shape[0], num_bytes)
    return acc


def fingerprint(*, slots, sources, real_kv_mode) -> torch.Tensor:
    return torch.from_numpy(_fingerprints(_i64(slots), sources, int(real_kv_mode)))


def scatter_req_token_ids(flat_in, offsets, req_pool_indices, pool_out) -> None:
    if not _writable(pool_out):
        torch_ops.scatter_req_token_ids(flat_in, offsets, req_pool_indices, pool_out)
        return
    k.scatter(_i64(flat_in), _i64(offsets), _i64(req_pool_indices), pool_out.numpy())


def plan(*, req_pool_indices, prefix_lens, extend_lens, req_to_token, out, window=0, full_to_swa=None,
         token_table=None, token_valid_lens=None, token_offset=0) -> None:
    e = out.entries
    outs = (e.slot, e.position, e.prev, e.expected_token, e.count, e.requested, out.write_offsets, out.seed_slot)
    if not _writable(*outs, e.enable) or any(t.dtype != torch.int64 for t in outs) or e.enable.dtype != torch.int32:
        # Hand-built plan buffers that numpy cannot write in place: the torch path gives the same bits.
        torch_ops.plan(req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_lens=extend_lens,
                       req_to_token=req_to_token, out=out, window=window, full_to_swa=full_to_swa,
                       token_table=token_table, token_valid_lens=token_valid_lens, token_offset=token_offset)
        return
    rtt = _table(req_to_token)
    # An absent translation table is an empty one of the table's dtype: no extra specialisation for it.
    table = np.zeros(0, dtype=rtt.dtype) if full_to_swa is None else _table(full_to_swa)
    has_tokens = token_table is not None
    k.plan(_i64(req_pool_indices), _i64(prefix_lens), _i64(extend_lens), rtt, table, full_to_swa is not None,
           _table(token_table) if has_tokens else _EMPTY_TABLE, _i64(token_valid_lens) if has_tokens else _EMPTY64,
           has_tokens, int(token_offset), int(window), e.slot.numpy(), e.position.numpy(), e.prev.numpy(),
           e.expected_token.numpy(), e.count.numpy(), e.enable.numpy(), e.requested.numpy(),
           out.write_offsets.numpy(), out.seed_slot.numpy())


def verify(*, buf, entries, ring, counters, launch_tag, sources=(), real_kv_mode=0, check_token=True) -> None:
    cnt = counters.numpy()
    cnt[launch_tag, Counter.LAUNCHES] += 1  # a disabled launch still ran
    # numpy reads of the two device counts: far cheaper than torch indexing on the CPU
    if int(entries.enable.numpy()[0]) == 0:
        return
    n = max(0, min(int(entries.count.numpy()[0]), entries.capacity))
    slot = _i64(entries.slot[:n])
    k.verify(buf.numpy().view(np.int64), slot, _i64(entries.position[:n]), _i64(entries.prev[:n]),
             _i64(entries.expected_token[:n]), bool(check_token), _fingerprints(slot, sources, int(real_kv_mode)),
             ring.rows.numpy(), ring.write_index.numpy(), cnt, int(launch_tag), n)


def write(*, buf, write_offsets, seed_slot, num_requests, out_cache_loc, input_ids, positions, ring, counters,
          launch_tag, sources=(), real_kv_mode=0, expected_input_ids=None, expected_positions=None,
          chain_check=None, writer_ids=None, step=None) -> None:
    locs = _i64(out_cache_loc)
    # Real-KV hashes of every entry's slot up front (one compiled pass per source); unused for skipped entries.
    fp = _fingerprints(locs, sources, int(real_kv_mode))
    k.write(buf.numpy().view(np.int64), _i64(write_offsets), _i64(seed_slot), int(num_requests), locs,
            _i64(input_ids), _i64(positions),
            _EMPTY64 if expected_input_ids is None else _i64(expected_input_ids), expected_input_ids is not None,
            _EMPTY64 if expected_positions is None else _i64(expected_positions), expected_positions is not None,
            chain_check is not None and int(chain_check.numpy()[0]) != 0, buf.shape[1] >= ATTRIBUTION_STRIDE,
            _EMPTY64 if writer_ids is None else _i64(writer_ids), writer_ids is not None,
            -1 if step is None else int(step.numpy()[0]), fp, ring.rows.numpy(), ring.write_index.numpy(),
            counters.numpy(), int(launch_tag))
