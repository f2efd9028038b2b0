"""Scalar reference of every op: Python integers and loops, written to be read.

This is the oracle the torch and Triton paths must match bit for bit. It takes
the same keyword arguments as the public functions in ``kvcanary.ops`` (after
validation) and is only meant for tests and small inputs.
"""

from __future__ import annotations

import torch

from kvcanary.format import (
    ATTRIBUTION_STRIDE,
    CHAIN_HEAD,
    MASK64,
    PARTIAL_READ_BYTES,
    VIOLATION_COUNT_LIMIT,
    Counter,
    FailReason,
    RealKvMode,
    RecordField,
    link,
    splitmix64,
    to_signed,
)


def _words(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(torch.int64)


def _record(buf: torch.Tensor, slot: int) -> tuple[int, int, int, int]:
    """(token, position, prev_hash, real_kv_hash) as uint64 ints; an out-of-range slot reads as zeros."""
    if not 0 <= slot < buf.shape[0]:
        return (0, 0, 0, 0)
    w = _words(buf)[slot, :4].tolist()
    return tuple(x & MASK64 for x in w)


def _store(buf: torch.Tensor, slot: int, field: int, value: int) -> None:
    _words(buf)[slot, field] = to_signed(value)


def _push_violation(ring, row: list[int]) -> None:
    i = int(ring.write_index[0])
    ring.write_index[0] = min(i + 1, VIOLATION_COUNT_LIMIT)  # the count saturates (format.py)
    if i < ring.capacity:
        ring.rows[i] = torch.tensor([to_signed(v) for v in row], dtype=torch.int64)


def _slot_words(src, slot: int, num_bytes: int) -> list[int]:
    """The first ``num_bytes`` bytes of a slot (inside the source) as little-endian words (the last one short
    where ``num_bytes`` is not a multiple of 8), read on the host."""
    row, col = divmod(slot, src.page_size)
    start = col * src.num_bytes_per_token
    data = bytes(src.byte_rows()[row, start:start + num_bytes].cpu().tolist())
    return [int.from_bytes(data[k:k + 8], "little") for k in range(0, num_bytes, 8)]


def _source_hash(src, slot: int, num_bytes: int) -> int:
    acc = 0
    if slot < 0 or slot // src.page_size >= src.tensor.shape[0]:
        return acc
    for word in _slot_words(src, slot, num_bytes):
        acc = splitmix64(acc ^ word)
    return acc


def slot_fingerprint(slot: int, sources, real_kv_mode: int) -> int:
    """uint64 real-KV hash of one slot (SPEC 3.4)."""
    if real_kv_mode == RealKvMode.NONE or not sources:
        return 0
    acc = 0
    for src in sources:
        n = PARTIAL_READ_BYTES if real_kv_mode == RealKvMode.PARTIAL else src.read_bytes
        acc = splitmix64(acc ^ _source_hash(src, slot, n))
    return acc


def fingerprint(*, slots, sources, real_kv_mode) -> torch.Tensor:
    out = [to_signed(slot_fingerprint(s, sources, real_kv_mode)) for s in slots.tolist()]
    return torch.tensor(out, dtype=torch.int64, device=slots.device)


def scatter_req_token_ids(flat_in, offsets, req_pool_indices, pool_out) -> None:
    flat, offs = flat_in.tolist(), offsets.tolist()
    for r, row in enumerate(req_pool_indices.tolist()):
        if not 0 <= row < pool_out.shape[0]:
            continue
        start, end = offs[r], offs[r + 1]
        n = min(end - start, pool_out.shape[1])
        for j in range(max(n, 0)):
            if 0 <= start + j < len(flat):
                pool_out[row, j] = torch.tensor(flat[start + j], dtype=torch.int64).to(torch.int32)


def _translate(x: int, table: list[int] | None) -> int:
    if table is None or not 0 <= x < len(table):
        return x
    return table[x]


def plan(*, req_pool_indices, prefix_lens, extend_lens, req_to_token, out, window=0, full_to_swa=None,
         token_table=None, token_valid_lens=None, token_offset=0) -> None:
    rows, prefix, extend = req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist()
    rtt = req_to_token.tolist()
    max_ctx = req_to_token.shape[1]
    table = None if full_to_swa is None else full_to_swa.tolist()
    tokens = None if token_table is None else token_table.tolist()
    valid = None if token_valid_lens is None else token_valid_lens.tolist()
    entries = []
    bs = len(rows)
    out.write_offsets[0] = 0
    for r, row in enumerate(rows):
        P = min(prefix[r], max_ctx)
        real_row = row != 0 and 0 <= row < len(rtt)
        writes = row != 0 and extend[r] > 0
        out.write_offsets[r + 1] = int(out.write_offsets[r]) + (extend[r] if writes else 0)
        # A request that writes nothing has no chain to continue.
        out.seed_slot[r] = _translate(rtt[row][P - 1], table) if (real_row and writes and P > 0) else -1
        if not real_row:
            continue
        start = max(0, P - window) if window > 0 else 0
        for p in range(start, P):
            slot = _translate(rtt[row][p], table)
            prev = _translate(rtt[row][p - 1], table) if p > 0 else -1
            exp = -1
            q = p + token_offset
            if tokens is not None and row < len(tokens) and 0 <= q < valid[r] and q < len(tokens[row]):
                exp = tokens[row][q]
            entries.append((slot, p, prev, exp))
    out.write_offsets[bs + 1:] = 0
    e = out.entries
    fits = len(entries) <= e.capacity
    e.requested[0] = len(entries)
    e.count[0] = min(len(entries), e.capacity)
    e.enable[0] = int(fits)
    # An overflowing plan stores no entry (the verify is skipped anyway).
    for i, (slot, p, prev, exp) in enumerate(entries if fits else []):
        e.slot[i], e.position[i], e.prev[i], e.expected_token[i] = slot, p, prev, exp


def write(*, buf, write_offsets, seed_slot, num_requests, out_cache_loc, input_ids, positions, ring, counters,
          launch_tag, sources=(), real_kv_mode=0, expected_input_ids=None, expected_positions=None,
          chain_check=None, writer_ids=None, step=None, chain_hint=None) -> None:
    offs, seeds = write_offsets.tolist(), seed_slot.tolist()
    locs, ids, poss = out_cache_loc.tolist(), input_ids.tolist(), positions.tolist()
    exp_ids = None if expected_input_ids is None else expected_input_ids.tolist()
    exp_pos = None if expected_positions is None else expected_positions.tolist()
    check_chain = chain_check is not None and int(chain_check[0]) != 0
    attribution = buf.shape[1] >= ATTRIBUTION_STRIDE
    step_value = -1 if step is None else int(step[0])
    num_tokens, num_slots = len(locs), buf.shape[0]
    counters[launch_tag, Counter.LAUNCHES] += 1
    processed = 0
    for r in range(num_requests):
        seed = seeds[r]
        # Any slot of the buffer (slot 0 included) is a predecessor; anything else is the chain head.
        seeded = 0 <= seed < num_slots
        if seeded:
            tok, pos, prev_hash, _ = _record(buf, seed)
            running, prev_pos = link(prev_hash, tok, pos), to_signed(pos)
        else:
            running, prev_pos = CHAIN_HEAD, None
        for i in range(max(offs[r], 0), min(offs[r + 1], num_tokens)):
            slot, tok, pos = locs[i], ids[i], poss[i]
            if slot < 0:
                continue  # a skipped entry: no checks, no record, the chain does not move
            processed += 1
            reason = 0
            if exp_ids is not None and tok != exp_ids[i]:
                reason |= FailReason.WRITE_TOKEN
            if exp_pos is not None and pos != exp_pos[i]:
                reason |= FailReason.WRITE_POSITION
            if reason:
                want_tok = tok if exp_ids is None else exp_ids[i]
                want_pos = pos if exp_pos is None else exp_pos[i]
                _push_violation(ring, [launch_tag, slot, pos, tok, want_tok, running, want_pos, int(reason)])
            if check_chain and seeded:
                if pos != prev_pos + 1:
                    _push_violation(ring, [launch_tag, slot, pos, tok, tok, running, prev_pos + 1,
                                           int(FailReason.WRITE_POSITION)])
                prev_pos = pos
            if slot < num_slots:
                _store(buf, slot, RecordField.TOKEN, tok)
                _store(buf, slot, RecordField.POSITION, pos)
                _store(buf, slot, RecordField.PREV_HASH, running)
                _store(buf, slot, RecordField.REAL_KV_HASH, slot_fingerprint(slot, sources, real_kv_mode))
                if attribution:
                    _store(buf, slot, RecordField.WRITER_ID, -1 if writer_ids is None else int(writer_ids[r]))
                    _store(buf, slot, RecordField.WRITER_STEP, step_value)
            running = link(running, tok, pos)
    counters[launch_tag, Counter.ENTRIES] += processed


def verify(*, buf, entries, ring, counters, launch_tag, sources=(), real_kv_mode=0, check_token=True) -> None:
    counters[launch_tag, Counter.LAUNCHES] += 1  # a disabled launch still ran
    if int(entries.enable[0]) == 0:
        return
    n = max(0, min(int(entries.count[0]), entries.capacity))
    counters[launch_tag, Counter.ENTRIES] += n
    for e in range(n):
        slot = int(entries.slot[e])
        if slot == 0:
            continue
        prev, position = int(entries.prev[e]), int(entries.position[e])
        exp_tok = int(entries.expected_token[e]) if check_token else -1
        tok, pos, prev_hash, real = _record(buf, slot)
        reason, aux = 0, prev_hash
        if prev != 0:
            if prev < 0:
                expected = CHAIN_HEAD
            else:
                p_tok, p_pos, p_prev, _ = _record(buf, prev)
                expected = link(p_prev, p_tok, p_pos)
            if prev_hash != expected:
                reason |= FailReason.VERIFY_CHAIN_HASH
                aux = expected
        if pos != (position & MASK64):
            reason |= FailReason.VERIFY_POSITION
        if exp_tok != -1 and tok != (exp_tok & MASK64):
            reason |= FailReason.VERIFY_TOKEN
        if real != slot_fingerprint(slot, sources, real_kv_mode):
            reason |= FailReason.VERIFY_REAL_KV_HASH
        if reason:
            _push_violation(ring, [launch_tag, slot, pos, tok, exp_tok, prev_hash, aux, int(reason)])


def accept_rewrites(*, head_buf, tail_buf, write_offsets, num_requests, out_cache_loc, sources=(), real_kv_mode=0,
                    rewrites=None) -> None:
    offs, locs = write_offsets.tolist(), out_cache_loc.tolist()
    if num_requests == 0:
        return
    accepted = 0
    # The requests' write ranges back to back (offsets are non-decreasing): every entry the write walks.
    for i in range(max(offs[0], 0), min(offs[num_requests], len(locs))):
        slot = locs[i]
        if not 1 <= slot < tail_buf.shape[0]:
            continue  # skipped, padding or outside the buffer: the write stores no record there either
        if _record(head_buf, slot)[:3] == _record(tail_buf, slot)[:3]:
            _store(tail_buf, slot, RecordField.REAL_KV_HASH, slot_fingerprint(slot, sources, real_kv_mode))
            accepted += 1
    if rewrites is not None:
        rewrites[0] += accepted
