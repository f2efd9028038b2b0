"""The attention-metadata check's pass (runtime/attention_check.py, docs/write_check.md): the keys each query may
attend by the metadata its kernel gets, against the read index the canary verified.

Keys are laid out as varlen attention lays them out: request after request, request ``r``'s keys in the columns
``[K_r, K_r + L_r)`` with ``L_r = kept_r + extend_r`` (``kept_r``: its prefix, or the last ``window`` positions of
it for a sliding-window group) and ``K_r`` their running sum, in position order from ``prefix_r - kept_r``; query
rows likewise (``extend_r`` each, from ``Q_r``). Query ``i`` of request ``r`` (position ``prefix_r + i``) may
attend column ``K_r + j`` exactly when ``j <= i + kept_r`` (causal) and, with a sliding window, ``j > i + kept_r -
(window + 1)``. Padding requests (row 0) have no keys and no queries checked.

- key lengths (``cu_seqlens_k``, cumulative, at least one entry per request plus one): a real request whose
  length or start differs pushes ``[tag, -1, prefix_r, engine length, L_r, request, engine start, KEY_LENGTH]``;
- mask (``[queries, keys]``: a float additive mask, where a key is hidden when its value is the dtype's lowest
  or -inf, or a bool mask, True = attend): over the batch's live query rows and the mask's columns, a real request
  whose rows differ anywhere pushes one row for its first such query (then column):
  ``[tag, key slot (-1 without key_slots or past them), query position, mask allows (1/0), read index allows
  (1/0), request, column, ATTENTION_MASK]``. ``batch_keys_only``: only the columns before the batch's last key
  (the sum of its real requests' key lengths) are compared, for a caller whose mask slice is wider than the keys
  the engine hands attention (a recorded step's slice, whose width is a bucket: the columns past the keys may hold
  stale values attention never reads).

Four implementations agree on the ring's rows: ``reference_check_attention`` (scalar loops, the oracle),
``torch_check_attention`` (tensor ops, any device, no host read off the CPU: capturable),
``kvcanary.ops.triton_attention.check_attention`` (three capturable launches, the CUDA path: as tensor ops the pass
is some 60-80 small launches, each a node of a recorded step's work that the engine's next forward waits for) and
``kvcanary.ops.numba_attention.check_attention`` (one compiled loop, the CPU's default: as tensor ops the pass is
some 35 host calls a forward). ``attention_impl`` picks one for a backend name, ``recordable_impl`` the one a
recorded step takes.
"""

from __future__ import annotations

import importlib

import torch

from kvcanary.format import FailReason
from kvcanary.ops.reference import _push_violation
from kvcanary.ops.torch_ops import _host_reads, _push

MASK_BAD, LENGTH_BAD = int(FailReason.ATTENTION_MASK), int(FailReason.KEY_LENGTH)


def attention_impl(backend: str):
    """The pass of a resolved backend name: the Triton kernels' for "triton", the compiled CPU loop's for "numba",
    the scalar reference's for "reference", tensor ops otherwise."""
    if backend in ("triton", "numba"):
        return importlib.import_module(f"kvcanary.ops.{backend}_attention").check_attention
    return reference_check_attention if backend == "reference" else torch_check_attention


def recordable_impl(backend: str):
    """The pass a recorded step's work takes (``runtime/step``: replayed from a graph, or on the CPU from a stand-in
    that replays tensor ops only): the Triton kernels' for "triton", else the tensor ops (the reference's and the
    numba loop's host work cannot be recorded; the tensor ops give the same rows)."""
    return attention_impl("triton") if backend == "triton" else torch_check_attention


def allowed_of(mask: torch.Tensor) -> torch.Tensor:
    """bool of the same shape: which cells let attention see the key."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min


def _layout(rows, prefix, extend, window: int):
    """Per request (real?, kept, key length) as host lists."""
    out = []
    for row, p, q in zip(rows, prefix, extend):
        real = row != 0
        kept = (min(p, window) if window else p) if real else 0
        out.append((real, kept, kept + q if real else 0, q if real else 0))
    return out


def reference_check_attention(*, req_pool_indices, prefix_lens, extend_lens, positions, request_ids, window,
                              cu_seqlens_k, mask, key_slots, launch_tag, ring, host_reads=None,
                              batch_keys_only: bool = False) -> None:
    rows, prefix, extend = req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist()
    ids = request_ids.tolist() if request_ids is not None else rows
    lay = _layout(rows, prefix, extend, window)
    if cu_seqlens_k is not None:
        cu = cu_seqlens_k.tolist()
        k0 = 0
        for r, (real, kept, length, _) in enumerate(lay):
            start = cu[min(r, len(cu) - 1)]
            got = cu[min(r + 1, len(cu) - 1)] - start
            if real and (got != length or start != k0):
                _push_violation(ring, [launch_tag, -1, prefix[r], got, length, ids[r], start, LENGTH_BAD])
            k0 += length
    if mask is None:
        return
    allowed = allowed_of(mask).tolist()
    slots = key_slots.tolist() if key_slots is not None else []
    pos = positions.tolist()
    cols = sum(length for _, _, length, _ in lay) if batch_keys_only else None
    k0 = q0 = 0
    for r, (real, kept, length, nq) in enumerate(lay):
        found = None
        for i in range(nq if real else 0):
            t = q0 + i
            if t >= len(allowed):
                break
            for c in range(len(allowed[t]) if cols is None else min(cols, len(allowed[t]))):
                j = c - k0
                want = 0 <= j < length and j <= i + kept and (not window or j > i + kept - (window + 1))
                if allowed[t][c] != want:
                    found = (t, c, want)
                    break
            if found:
                break
        if found:
            t, c, want = found
            _push_violation(ring, [launch_tag, slots[c] if c < len(slots) else -1, pos[t], int(not want),
                                   int(want), ids[r], c, MASK_BAD])
        k0, q0 = k0 + length, q0 + nq


def torch_check_attention(*, req_pool_indices, prefix_lens, extend_lens, positions, request_ids, window,
                          cu_seqlens_k, mask, key_slots, launch_tag, ring, host_reads=None,
                          batch_keys_only: bool = False) -> None:
    dev = req_pool_indices.device
    host = _host_reads(dev) if host_reads is None else host_reads
    bs = req_pool_indices.shape[0]
    if not bs:
        return
    real = req_pool_indices != 0
    prefix, extend = prefix_lens.long(), extend_lens.long()
    kept = torch.where(real, torch.clamp(prefix, max=window) if window else prefix, 0)
    length = torch.where(real, kept + extend, 0)
    nq = torch.where(real, extend, 0)
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    k_start = torch.cat([zero, torch.cumsum(length, 0)])  # [bs + 1]
    q_start = torch.cat([zero, torch.cumsum(nq, 0)])
    ids = (request_ids if request_ids is not None else req_pool_indices).long()
    tag = torch.full((bs,), launch_tag, dtype=torch.int64, device=dev)
    if cu_seqlens_k is not None:
        cu = cu_seqlens_k.long().reshape(-1)
        if cu.shape[0] < bs + 1:  # (an engine that lists fewer sequences: its last offset repeats)
            cu = torch.cat([cu, cu[-1:].expand(bs + 1 - cu.shape[0])])
        start, got = cu[:bs], cu[1:bs + 1] - cu[:bs]
        bad = real & ((got != length) | (start != k_start[:bs]))
        rows = torch.stack([tag, torch.full_like(tag, -1), prefix, got, length, ids, start,
                            torch.where(bad, LENGTH_BAD, 0)], 1)
        _push(ring, rows, bad, host_reads=host)
    if mask is None or not mask.shape[0] or not mask.shape[1]:
        return
    T, K = mask.shape
    t = torch.arange(T, device=dev)
    r = torch.searchsorted(q_start[1:].contiguous(), t, right=True).clamp(max=bs - 1)  # each query row's request
    live = t < q_start[bs]
    i = t - q_start[r]
    col = torch.arange(K, device=dev)
    j = col[None, :] - k_start[r][:, None]  # [T, K]
    lim = (i + kept[r])[:, None]
    want = (j >= 0) & (j < length[r][:, None]) & (j <= lim)
    if window:
        want &= j > lim - (window + 1)
    allowed = allowed_of(mask)
    mism = (allowed != want) & live[:, None]
    if batch_keys_only:  # (the bound on the device: a recorded step replays it for each step's batch)
        mism &= col[None, :] < k_start[bs]
    tok_bad = mism.any(1)
    first_c = mism.to(torch.int8).argmax(1)  # each query row's first differing column
    none = T
    first_t = torch.full((bs,), none, dtype=torch.int64, device=dev)
    first_t.scatter_reduce_(0, r, torch.where(tok_bad, t, none), "amin")
    hit = first_t < none
    tt = first_t.clamp(max=T - 1)
    cc = first_c[tt]
    seen = allowed[tt, cc].long()
    if key_slots is not None and key_slots.shape[0]:
        ks = key_slots.long().reshape(-1)
        slot = torch.where(cc < ks.shape[0], ks[cc.clamp(max=ks.shape[0] - 1)], -1)
    else:
        slot = torch.full_like(cc, -1)
    pos = positions.long()[tt.clamp(max=positions.shape[0] - 1)]
    rows = torch.stack([tag, slot, pos, seen, 1 - seen, ids, cc, torch.where(hit, MASK_BAD, 0)], 1)
    _push(ring, rows, hit, host_reads=host)
