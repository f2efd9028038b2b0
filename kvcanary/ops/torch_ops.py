"""Vectorised torch implementation of every op: same keyword signatures as ``reference``, bit for bit.

One path serves CPU and CUDA. On an accelerator every shape is static (work sized by the
plan's capacity, the ring's capacity or the token count; counts stay on the device) so a
launch can be captured in a CUDA graph; on CPU, where reading a count is free, the same
code runs on the host-read count instead of the static bound.
"""

from __future__ import annotations

import torch

from kvcanary.format import ATTRIBUTION_STRIDE, MASK64, VIOLATION_COUNT_LIMIT, Counter, FailReason, to_signed
from kvcanary.format import mix3 as mix3_int
from kvcanary.ops.torch_hash import HEAD, INT64_MAX, count_le, fingerprint, gather_rows, mix3

__all__ = ["accept_rewrites", "fingerprint", "plan", "scatter_req_token_ids", "verify", "write"]


def _host_reads(device: torch.device) -> bool:
    return device.type == "cpu"


def _bound(count: torch.Tensor, static: int) -> int:
    """Work size: the static bound on an accelerator, min(count, bound) on CPU."""
    if not _host_reads(count.device):
        return static
    return max(0, min(int(count.reshape(-1)[0]), static))


def _push(ring, rows, flag: torch.Tensor, host_reads: bool | None = None) -> None:
    """Append ``rows[flag]`` in order at ``write_index++``, storing those that land below capacity.
    ``rows``: the candidate rows [n, 8], or a function of an index tensor giving those rows, so only the
    rows that can land in the ring are built (n may be a plan's whole entry capacity).
    ``host_reads=False`` keeps every value on the device on the CPU too (a recorded step replays tensor ops
    only): the ring's whole capacity of candidate rows is written, as on an accelerator."""
    n = flag.shape[0]
    cum = torch.cumsum(flag.long(), 0)
    total = cum[-1:] if cum.numel() else torch.zeros(1, dtype=torch.int64, device=flag.device)
    base = ring.write_index.long()
    lo, hi = 0, ring.capacity
    if _host_reads(flag.device) if host_reads is None else host_reads:
        lo, hi = min(int(base), hi), min(int(base + total), hi)
    if hi > lo and n:
        # Ring row k holds the (k - base)-th flagged row: the first whose inclusive cumsum passes it.
        k = torch.arange(lo, hi, device=flag.device)
        m = k - base
        take = (m >= 0) & (m < total)
        if flag.device.type == "cpu":
            src = count_le(cum, lo - base, hi - lo)
        else:  # (the count's bins collide on a GPU: atomics on one bin cost hundreds of microseconds there)
            src = torch.searchsorted(cum, m, right=True)
        src = src.clamp(max=n - 1)
        picked = rows(src) if callable(rows) else rows[src]
        ring.rows[lo:hi] = torch.where(take[:, None], picked, ring.rows[lo:hi])
    ring.write_index.copy_((base + total).clamp_(max=VIOLATION_COUNT_LIMIT))  # saturates (format.py)


def scatter_req_token_ids(flat_in, offsets, req_pool_indices, pool_out) -> None:
    num_rows, width = pool_out.shape
    bs, total = req_pool_indices.shape[0], flat_in.shape[0]
    if num_rows == 0 or width == 0 or bs == 0 or total == 0:
        return
    start = offsets[:-1]
    n = torch.minimum(offsets[1:] - start, torch.full_like(start, width))
    if _host_reads(pool_out.device):
        width = max(0, min(width, int(n.max())))
        if width == 0:
            return
    dev = pool_out.device
    o_r = torch.arange(bs, device=dev)
    o_j = torch.arange(width, device=dev)
    row_ok = (req_pool_indices >= 0) & (req_pool_indices < num_rows)
    row = torch.where(row_ok, req_pool_indices, 0)
    src = start[:, None] + o_j
    valid = row_ok[:, None] & (o_j < n[:, None]) & (src >= 0) & (src < total)  # [bs, width]
    # Requests sharing a row resolve through one representative: the last writer of a cell wins.
    canon = torch.where(row[:, None] == row[None, :], o_r, -1).amax(1)
    last = torch.full((bs, width), -1, dtype=torch.int64, device=dev)
    last.scatter_reduce_(0, canon[:, None].expand(bs, width), torch.where(valid, o_r[:, None], -1), "amax")
    last = last[canon]
    val = flat_in[(start[last.clamp(min=0)] + o_j).clamp(0, total - 1)].to(torch.int32)
    cell = (row[:, None].expand(bs, width), o_j.expand(bs, width))
    # Every duplicate of a cell stores the same final value, so write order cannot matter.
    pool_out[cell] = torch.where(last >= 0, val, pool_out[cell])


def _translate(x: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
    if table is None or table.shape[0] == 0:
        return x
    inside = (x >= 0) & (x < table.shape[0])
    return torch.where(inside, table[x.clamp(0, table.shape[0] - 1)].long(), x)


def plan(*, req_pool_indices, prefix_lens, extend_lens, req_to_token, out, window=0, full_to_swa=None,
         token_table=None, token_valid_lens=None, token_offset=0) -> None:
    rows, extend = req_pool_indices.long(), extend_lens.long()
    bs = rows.shape[0]
    num_rows, max_ctx = req_to_token.shape
    entries, dev = out.entries, req_to_token.device
    P = prefix_lens.long().clamp(max=max_ctx)
    real_row = (rows != 0) & (rows >= 0) & (rows < num_rows)
    writes = (rows != 0) & (extend > 0)
    write_len = torch.where(writes, extend, 0)
    out.write_offsets[:1] = 0
    out.write_offsets[1:bs + 1] = torch.cumsum(write_len, 0)
    out.write_offsets[bs + 1:] = 0
    seed = _translate(gather_rows(req_to_token, rows, P - 1), full_to_swa)
    out.seed_slot[:bs] = torch.where(real_row & writes & (P > 0), seed, -1)
    start = (P - window).clamp(min=0) if window > 0 else torch.zeros_like(P)
    count = torch.where(real_row, (P - start).clamp(min=0), 0)
    cum = torch.cumsum(count, 0)
    total = cum[-1:] if bs else torch.zeros(1, dtype=torch.int64, device=dev)
    fits = total <= entries.capacity
    entries.requested.copy_(total)
    entries.count.copy_(total.clamp(max=entries.capacity))
    entries.enable.copy_(fits.to(torch.int32))
    # An overflowing plan stores no entry: the static bound is then work for nothing, but CUDA-graph safe.
    n = _bound(torch.where(fits, total, 0), entries.capacity)
    if n == 0 or bs == 0:
        return
    # Entry e belongs to the request whose inclusive cumsum first passes e.
    o_e = torch.arange(n, device=dev)
    r = count_le(cum, 0, n).clamp(max=bs - 1)
    p = start[r] + o_e - (cum[r] - count[r])
    row = rows[r]
    slot = _translate(gather_rows(req_to_token, row, p), full_to_swa)
    prev = torch.where(p > 0, _translate(gather_rows(req_to_token, row, p - 1), full_to_swa), -1)
    expected = torch.full_like(p, -1)
    if token_table is not None:
        q = p + token_offset
        known = (q >= 0) & (q < token_valid_lens.long()[r]) & (q < token_table.shape[1]) & (row < token_table.shape[0])
        expected = torch.where(known, gather_rows(token_table, row, q), -1)
    keep = (o_e < total) & fits
    for dst, val in ((entries.slot, slot), (entries.position, p), (entries.prev, prev),
                     (entries.expected_token, expected)):
        dst[:n] = torch.where(keep, val, dst[:n])


def _chain_delays(dep, has_dep, req, begin, num_requests):
    """Launch step at which each request's chain starts.

    A request whose seed slot an earlier request of this launch wrote starts right after
    that entry (the reference runs requests in order); delays add up along such links.
    """
    o_r = torch.arange(num_requests, device=dep.device)
    parent = torch.where(has_dep, req[dep], o_r)
    delay = torch.where(has_dep, dep - begin[parent] + 1, 0)
    # Pointer jumping: sums the delays along each path to its root in log2(bs) rounds.
    for _ in range((num_requests - 1).bit_length()):
        delay = delay + delay[parent]
        parent = parent[parent]
    return delay


def _run_chains(running, tok, pos, live, begin, length, delay, dep, has_dep):
    """prev_hash each entry stores: the serial chains, stepped together across requests.

    An entry that is not ``live`` (a skipped slot) leaves the running hash as it is.
    """
    n_tok, dev = tok.shape[0], tok.device
    if _host_reads(dev) and length.numel() and int(length.max()) > SCALAR_CHAIN_MIN:
        return _run_chains_scalar(running, tok, pos, live, begin, length, delay, dep, has_dep)
    # Index n_tok is a scratch entry that idle requests write each step.
    tok_x, pos_x = torch.cat([tok, tok[:1]]), torch.cat([pos, pos[:1]])
    live_x = torch.cat([live, live.new_zeros(1)])
    run_before = torch.zeros(n_tok + 1, dtype=torch.int64, device=dev)
    run_after = torch.zeros_like(run_before)
    steps = int((delay + length).max()) if _host_reads(dev) else n_tok
    any_dep = bool(has_dep.any()) if _host_reads(dev) else True
    for t in range(steps):
        k = t - delay
        act = (k >= 0) & (k < length)
        if any_dep:
            running = torch.where(act & (k == 0) & has_dep, run_after[dep], running)
        i = torch.where(act, begin + k, n_tok)
        run_before[i] = running
        running = torch.where(live_x[i], mix3(running, tok_x[i], pos_x[i]), running)
        run_after[i] = running
    return run_before[:n_tok]


# On the CPU a long chain is cheaper in Python integers (a few us a token) than as one round of
# small torch ops per token; both give the same bits.
SCALAR_CHAIN_MIN = 16


def _run_chains_scalar(running, tok, pos, live, begin, length, delay, dep, has_dep):
    """``_run_chains`` for CPU tensors: requests in start order, each chain a Python-int loop."""
    tok_l, pos_l, live_l = tok.tolist(), pos.tolist(), live.tolist()
    run0, begin_l, length_l = running.tolist(), begin.tolist(), length.tolist()
    dep_l, has_dep_l, delay_l = dep.tolist(), has_dep.tolist(), delay.tolist()
    before = [0] * len(tok_l)
    after = [0] * len(tok_l)
    # A request that continues another's entry starts after it (larger delay): sorted order is safe.
    for r in sorted(range(len(run0)), key=lambda r: delay_l[r]):
        h = (after[dep_l[r]] if has_dep_l[r] and length_l[r] > 0 else run0[r]) & MASK64
        for i in range(begin_l[r], begin_l[r] + length_l[r]):
            before[i] = h
            if live_l[i]:
                h = mix3_int(h, tok_l[i], pos_l[i])
            after[i] = h
    return torch.tensor([to_signed(x) for x in before], dtype=torch.int64)


def _violation_rows(tag, slot, tok, pos, running, live, seeded, prev_pos, expected_input_ids, expected_positions,
                    chain_check):
    """Rows and flags of the write-time checks: per entry a write-input row, then a chain-position row."""
    reason = torch.zeros_like(tok)
    want_tok, want_pos = tok, pos
    if expected_input_ids is not None:
        want_tok = expected_input_ids.long()
        reason |= torch.where(tok != want_tok, int(FailReason.WRITE_TOKEN), 0)
    if expected_positions is not None:
        want_pos = expected_positions.long()
        reason |= torch.where(pos != want_pos, int(FailReason.WRITE_POSITION), 0)
    reason = torch.where(live, reason, 0)
    if chain_check is not None:
        # prev_pos + 1 wraps at INT64_MAX where the reference's Python ints do not.
        jump = (pos != prev_pos + 1) | (prev_pos == INT64_MAX)
        chain_bad = live & seeded & (chain_check[0] != 0) & jump
    else:
        chain_bad = torch.zeros_like(live)
    row_in = torch.stack([tag, slot, pos, tok, want_tok, running, want_pos, reason], 1)
    row_chain = torch.stack([tag, slot, pos, tok, tok, running, prev_pos + 1,
                             torch.full_like(tok, int(FailReason.WRITE_POSITION))], 1)
    rows = torch.stack([row_in, row_chain], 1).reshape(-1, row_in.shape[1])
    return rows, torch.stack([reason != 0, chain_bad], 1).reshape(-1)


def write(*, buf, write_offsets, seed_slot, num_requests, out_cache_loc, input_ids, positions, ring, counters,
          launch_tag, sources=(), real_kv_mode=0, expected_input_ids=None, expected_positions=None,
          chain_check=None, writer_ids=None, step=None, chain_hint=None) -> None:
    """Same as the reference for write_offsets as ``plan`` makes them (starting at 0, non-decreasing)."""
    nr, n_tok, num_slots = num_requests, out_cache_loc.shape[0], buf.shape[0]
    dev = buf.device
    counters[launch_tag, Counter.LAUNCHES] += 1
    if nr == 0 or n_tok == 0:
        return
    offs = write_offsets[:nr + 1].clamp(min=0)
    end = offs[nr:].clamp(max=n_tok)
    words = buf.view(torch.int64)
    o_i = torch.arange(n_tok, device=dev)
    slot, tok, pos = out_cache_loc.long(), input_ids.long(), positions.long()
    done = (o_i >= offs[0]) & (o_i < end)
    # A negative slot skips its entry altogether: no checks, no record, no chain step, not counted.
    live = done & (slot >= 0)
    counters[launch_tag, Counter.ENTRIES] += live.sum()
    req = count_le(offs[1:], 0, n_tok).clamp(max=nr - 1)
    begin = offs[:nr]
    length = (torch.minimum(offs[1:], end) - begin).clamp(min=0)

    # Stored entries sorted by (slot, index): a slot's last writer, and the last write before a request starts.
    stored = live & (slot < num_slots)
    slot_c = torch.where(stored, slot, 0)
    span = n_tok + 1
    keys = torch.sort(torch.where(stored, slot_c * span + o_i, -1)).values
    last = keys[(torch.searchsorted(keys, (slot_c + 1) * span) - 1).clamp(min=0)] % span
    seed = seed_slot[:nr]
    # Any slot of the buffer (slot 0 included) is a predecessor; anything else is the chain head.
    seeded = (seed >= 0) & (seed < num_slots)
    seed_c = torch.where(seeded, seed, 0)
    at = torch.searchsorted(keys, seed_c * span + begin.clamp(0, n_tok)) - 1
    hit = keys[at.clamp(min=0)]
    has_dep = seeded & (at >= 0) & (hit >= 0) & (torch.div(hit, span, rounding_mode="floor") == seed_c)
    dep = torch.where(has_dep, hit % span, 0)

    s_tok, s_pos, s_prev = gather_rows(words, torch.where(seeded, seed, -1), slice(0, 3)).unbind(-1)
    head = torch.where(seeded, mix3(s_prev, s_tok, s_pos), HEAD)
    delay = _chain_delays(dep, has_dep, req, begin, nr)
    running = _run_chains(head, tok, pos, live, begin, length, delay, dep, has_dep)

    # Position each live entry follows: the request's previous live entry, or the seed record's.
    last_live = torch.cummax(torch.where(live, o_i, -1), 0).values
    prev_i = torch.cat([last_live.new_full((1,), -1), last_live[:-1]])
    seed_pos = torch.where(has_dep, pos[dep], s_pos)
    prev_pos = torch.where(prev_i < begin[req], seed_pos[req], pos[prev_i.clamp(min=0)])
    tag = torch.full_like(slot, launch_tag)
    rows, flags = _violation_rows(tag, slot, tok, pos, running, live, seeded[req], prev_pos, expected_input_ids,
                                  expected_positions, chain_check)
    _push(ring, rows, flags)

    if num_slots == 0:
        return
    fields = [tok, pos, running, fingerprint(slots=slot_c, sources=sources, real_kv_mode=real_kv_mode)]
    if buf.shape[1] >= ATTRIBUTION_STRIDE:
        fields.append(torch.full_like(slot, -1) if writer_ids is None else writer_ids[req])
        fields.append(torch.full_like(slot, -1) if step is None else step.expand(n_tok))
    fields = torch.stack(fields, 1)
    # Every entry stores its slot's final record (the last writer's); entries that store nothing
    # repeat the launch's greatest stored key, or rewrite slot 0 unchanged when nothing is stored.
    any_stored = keys[-1] >= 0
    src = torch.where(stored, last, torch.where(any_stored, keys[-1] % span, 0))
    target = torch.where(any_stored, slot_c[src], 0)
    width = fields.shape[1]
    words[target, :width] = torch.where(any_stored, fields[src], words[target, :width])


def verify(*, buf, entries, ring, counters, launch_tag, sources=(), real_kv_mode=0, check_token=True) -> None:
    enable = entries.enable[0] != 0
    counters[launch_tag, Counter.LAUNCHES] += 1  # a disabled launch still ran
    if _host_reads(buf.device) and not bool(enable):
        return
    count = entries.count.clamp(min=0, max=entries.capacity)
    counters[launch_tag, Counter.ENTRIES] += torch.where(enable, count[0], 0)
    n = _bound(count, entries.capacity)
    if n == 0:
        return
    slot, prev = entries.slot[:n], entries.prev[:n]
    position = entries.position[:n]
    expected_tok = entries.expected_token[:n] if check_token else torch.full_like(position, -1)
    words = buf.view(torch.int64)
    tok, pos, prev_hash, real = gather_rows(words, slot, slice(0, 4)).unbind(-1)
    p_tok, p_pos, p_prev, _ = gather_rows(words, prev, slice(0, 4)).unbind(-1)
    expected = torch.where(prev < 0, HEAD, mix3(p_prev, p_tok, p_pos))
    chain_bad = (prev != 0) & (prev_hash != expected)
    aux = torch.where(chain_bad, expected, prev_hash)
    reason = (torch.where(chain_bad, int(FailReason.VERIFY_CHAIN_HASH), 0)
              | torch.where(pos != position, int(FailReason.VERIFY_POSITION), 0)
              | torch.where((expected_tok != -1) & (tok != expected_tok), int(FailReason.VERIFY_TOKEN), 0)
              | torch.where(real != fingerprint(slots=slot, sources=sources, real_kv_mode=real_kv_mode),
                            int(FailReason.VERIFY_REAL_KV_HASH), 0))
    live = enable & (torch.arange(n, device=slot.device) < count) & (slot != 0)
    reason = torch.where(live, reason, 0)
    tag = torch.full_like(slot, launch_tag)
    _push(ring, torch.stack([tag, slot, pos, tok, expected_tok, prev_hash, aux, reason], 1), reason != 0)


def accept_rewrites(*, head_buf, tail_buf, write_offsets, num_requests, out_cache_loc, sources=(), real_kv_mode=0,
                    rewrites=None) -> None:
    n_tok, num_slots = out_cache_loc.shape[0], tail_buf.shape[0]
    if num_requests == 0 or n_tok == 0 or num_slots == 0:
        return
    o_i = torch.arange(n_tok, device=tail_buf.device)
    offs = write_offsets[:num_requests + 1]
    slot = out_cache_loc.long()
    live = (o_i >= offs[0]) & (o_i < offs[num_requests]) & (slot >= 1) & (slot < num_slots)
    # entries that are not live all address slot 0 and store back what it holds
    slot_c = torch.where(live, slot, 0)
    head, tail = head_buf.view(torch.int64), tail_buf.view(torch.int64)
    same = live & (head[slot_c, :3] == tail[slot_c, :3]).all(1)
    fp = fingerprint(slots=slot_c, sources=sources, real_kv_mode=real_kv_mode)
    # duplicates of a slot agree on ``same`` and on the fingerprint: write order cannot matter
    tail[slot_c, 3] = torch.where(same, fp, tail[slot_c, 3])
    if rewrites is not None:
        rewrites += same.sum()
