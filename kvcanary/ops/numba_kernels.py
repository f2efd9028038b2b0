"""Compiled CPU loops of the ``numba`` backend: the scalar reference, statement for statement, in machine code.

Every loop walks its inputs in the reference's order, so records, ring rows (their order too) and
counters come out bit for bit as the reference writes them. Hashing runs on uint64 scalars; an int64
<-> uint64 cast between numba integers of one width keeps the bits, so stored words round-trip.

The constants below are literals rather than reads of ``kvcanary.format``: numba's on-disk cache is
keyed on this file, so a value read from another module could go stale in a cached build. The
import-time check makes a change to the format fail loudly here instead.
"""

from __future__ import annotations

import numba
import numpy as np

from kvcanary import format as fmt
from kvcanary.ops import numba_cache

MUL1 = np.uint64(0xBF58476D1CE4E5B9)
MUL2 = np.uint64(0x94D049BB133111EB)
HEAD = np.int64(0xDE7FAE23A9A1B716 - (1 << 64))  # CHAIN_HEAD as the stored int64
INT64_MAX = (1 << 63) - 1
COUNT_LIMIT = 1 << 30  # VIOLATION_COUNT_LIMIT: the ring's write index saturates here
LAUNCHES, ENTRIES = 0, 1
TOKEN, POSITION, PREV_HASH, REAL_KV_HASH, WRITER_ID, WRITER_STEP = 0, 1, 2, 3, 4, 5
CHAIN_BAD, POS_BAD, REAL_BAD, WRITE_TOKEN_BAD, WRITE_POS_BAD, TOKEN_BAD = 1, 2, 4, 8, 16, 32

_EXPECTED = (
    (int(MUL1), fmt.SPLITMIX_MUL1), (int(MUL2), fmt.SPLITMIX_MUL2), (int(HEAD), fmt.to_signed(fmt.CHAIN_HEAD)),
    (COUNT_LIMIT, fmt.VIOLATION_COUNT_LIMIT), (LAUNCHES, fmt.Counter.LAUNCHES), (ENTRIES, fmt.Counter.ENTRIES),
    (TOKEN, fmt.RecordField.TOKEN), (POSITION, fmt.RecordField.POSITION), (PREV_HASH, fmt.RecordField.PREV_HASH),
    (REAL_KV_HASH, fmt.RecordField.REAL_KV_HASH), (WRITER_ID, fmt.RecordField.WRITER_ID),
    (WRITER_STEP, fmt.RecordField.WRITER_STEP), (CHAIN_BAD, fmt.FailReason.VERIFY_CHAIN_HASH),
    (POS_BAD, fmt.FailReason.VERIFY_POSITION), (REAL_BAD, fmt.FailReason.VERIFY_REAL_KV_HASH),
    (WRITE_TOKEN_BAD, fmt.FailReason.WRITE_TOKEN), (WRITE_POS_BAD, fmt.FailReason.WRITE_POSITION),
    (TOKEN_BAD, fmt.FailReason.VERIFY_TOKEN),
)
if any(int(a) != int(b) for a, b in _EXPECTED):
    raise ImportError("kv-canary: numba_kernels constants must match kvcanary.format, got a mismatch")

jit = numba.njit(cache=True, nogil=True)
_NO_INPUTS = np.zeros(0, dtype=np.int64)  # TAIL writes assert no inputs (tail below)


@jit
def splitmix(x):
    x ^= x >> np.uint64(30)
    x *= MUL1
    x ^= x >> np.uint64(27)
    x *= MUL2
    return x ^ (x >> np.uint64(31))


@jit
def link(prev_hash, tok, pos):
    """mix3 of three stored int64 words, as the int64 a successor stores."""
    h = splitmix(np.uint64(prev_hash))
    h = splitmix(h ^ np.uint64(tok))
    return np.int64(splitmix(h ^ np.uint64(pos)))


@jit
def push(rows, widx, a, b, c, d, e, f, g, h):
    """One violation row at write_index++ (the count saturates; rows past capacity are dropped)."""
    i = np.int64(widx[0])
    widx[0] = min(i + 1, COUNT_LIMIT)
    if i < rows.shape[0]:
        rows[i, 0], rows[i, 1], rows[i, 2], rows[i, 3] = a, b, c, d
        rows[i, 4], rows[i, 5], rows[i, 6], rows[i, 7] = e, f, g, h


@jit
def _token_offset(s, page_size, page_shift, nbpt, row_stride, base, num_rows):
    """Offset of slot s's first unit in its source's storage, or -1 for a slot outside the source.

    A power-of-two page size takes a shift and a mask: a 64-bit division per slot cost more than the
    hashing itself (dev CPU).
    """
    if s < 0:
        return -1
    if page_shift >= 0:
        row, col = s >> page_shift, s & (page_size - 1)
    else:
        row = s // page_size
        col = s - row * page_size
    if row >= num_rows:
        return -1
    return base + row * row_stride + col * nbpt


@jit
def mix_source(acc, slots, data, base, row_stride, page_size, page_shift, nbpt, num_rows, num_bytes):
    """acc[i] = splitmix(acc[i] ^ hash of one source's bytes of slots[i]) (SPEC 3.4).

    ``data`` is the source's whole storage as bytes; a slot outside the source hashes as empty (0).
    Words are assembled little-endian from single bytes: this is the path for a source whose first
    row starts off an 8-byte boundary (``mix_source_words`` is the aligned one).
    """
    for i in range(slots.shape[0]):
        off = _token_offset(slots[i], page_size, page_shift, nbpt, row_stride, base, num_rows)
        h = np.uint64(0)
        if off >= 0:
            for k in range(0, num_bytes, 8):
                w = np.uint64(0)
                for b in range(8):
                    w |= np.uint64(data[off + k + b]) << np.uint64(8 * b)
                h = splitmix(h ^ w)
        acc[i] = np.int64(splitmix(np.uint64(acc[i]) ^ h))


@jit
def mix_source_words(acc, slots, words, base, row_stride, page_size, page_shift, nbpt, num_rows, num_words):
    """``mix_source`` on the storage as little-endian uint64 words, every offset counted in words."""
    for i in range(slots.shape[0]):
        off = _token_offset(slots[i], page_size, page_shift, nbpt, row_stride, base, num_rows)
        h = np.uint64(0)
        if off >= 0:
            for k in range(num_words):
                h = splitmix(h ^ words[off + k])
        acc[i] = np.int64(splitmix(np.uint64(acc[i]) ^ h))


@jit
def scatter(flat, offs, req_rows, pool):
    num_rows, width, total = pool.shape[0], pool.shape[1], flat.shape[0]
    for r in range(req_rows.shape[0]):
        row = req_rows[r]
        if row < 0 or row >= num_rows:
            continue
        start = offs[r]
        n = min(offs[r + 1] - start, width)
        for j in range(max(n, 0)):
            if 0 <= start + j < total:
                pool[row, j] = np.int32(flat[start + j])  # truncates like torch's int64 -> int32


@jit
def _translate(x, table, has_table):
    if has_table and 0 <= x < table.shape[0]:
        return np.int64(table[x])
    return np.int64(x)


@jit
def plan(rows, prefix, extend, rtt, table, has_table, tokens, valid, has_tokens, token_offset, window,
         e_slot, e_pos, e_prev, e_exp, e_count, e_enable, e_requested, write_offsets, seed_slot):
    bs = rows.shape[0]
    num_rows, max_ctx = rtt.shape[0], rtt.shape[1]
    write_offsets[0] = 0
    total = 0
    for r in range(bs):
        row = np.int64(rows[r])
        P = min(np.int64(prefix[r]), max_ctx)
        real_row = row != 0 and 0 <= row < num_rows
        writes = row != 0 and extend[r] > 0
        write_offsets[r + 1] = write_offsets[r] + (np.int64(extend[r]) if writes else 0)
        # A request that writes nothing has no chain to continue.
        seed_slot[r] = _translate(rtt[row, P - 1], table, has_table) if (real_row and writes and P > 0) else -1
        if real_row:
            start = max(0, P - window) if window > 0 else 0
            total += max(P - start, 0)
    write_offsets[bs + 1:] = 0
    cap = e_slot.shape[0]
    e_requested[0] = total
    e_count[0] = min(total, cap)
    e_enable[0] = 1 if total <= cap else 0
    if total > cap:
        return  # an overflowing plan stores no entry (the verify is skipped anyway)
    e = 0
    for r in range(bs):
        row = np.int64(rows[r])
        if row == 0 or row < 0 or row >= num_rows:
            continue
        P = min(np.int64(prefix[r]), max_ctx)
        start = max(0, P - window) if window > 0 else 0
        for p in range(start, P):
            # The translation written out rather than called: as a call it kept LLVM from optimising
            # this loop (3x slower on 4K entries, dev CPU).
            s = np.int64(rtt[row, p])
            if has_table and 0 <= s < table.shape[0]:
                s = np.int64(table[s])
            e_slot[e] = s
            pv = np.int64(-1)
            if p > 0:
                pv = np.int64(rtt[row, p - 1])
                if has_table and 0 <= pv < table.shape[0]:
                    pv = np.int64(table[pv])
            e_prev[e] = pv
            e_pos[e] = p
            exp = -1
            q = p + token_offset
            if has_tokens and row < tokens.shape[0] and 0 <= q < valid[r] and q < tokens.shape[1]:
                exp = np.int64(tokens[row, q])
            e_exp[e] = exp
            e += 1


@jit
def verify(words, slot, position, prev, expected, enable, count, check_token, fp, rows, widx, counters, tag):
    num_slots = words.shape[0]
    counters[tag, LAUNCHES] += 1  # a disabled launch still ran
    if enable[0] == 0:
        return
    n = max(0, min(np.int64(count[0]), slot.shape[0]))
    counters[tag, ENTRIES] += n
    for e in range(n):
        s = slot[e]
        if s == 0:
            continue
        tok = pos = prev_hash = real = np.int64(0)  # a slot past the buffer reads as a zero record
        if 0 <= s < num_slots:
            tok, pos, prev_hash, real = words[s, TOKEN], words[s, POSITION], words[s, PREV_HASH], words[s, REAL_KV_HASH]
        exp_tok = expected[e] if check_token else np.int64(-1)
        reason, aux = 0, prev_hash
        p = prev[e]
        if p != 0:
            want = HEAD
            if p > 0:
                p_tok = p_pos = p_prev = np.int64(0)
                if p < num_slots:
                    p_tok, p_pos, p_prev = words[p, TOKEN], words[p, POSITION], words[p, PREV_HASH]
                want = link(p_prev, p_tok, p_pos)
            if prev_hash != want:
                reason |= CHAIN_BAD
                aux = want
        if pos != position[e]:
            reason |= POS_BAD
        if exp_tok != -1 and tok != exp_tok:
            reason |= TOKEN_BAD
        if real != fp[e]:
            reason |= REAL_BAD
        if reason:
            push(rows, widx, tag, s, pos, tok, exp_tok, prev_hash, aux, reason)


@jit
def write(words, offs, seeds, nr, locs, ids, poss, exp_ids, has_exp_ids, exp_pos, has_exp_pos, check_chain,
          attribution, writer_ids, has_writer, step_value, fp, rows, widx, counters, tag):
    num_tokens, num_slots = locs.shape[0], words.shape[0]
    counters[tag, LAUNCHES] += 1
    processed = 0
    for r in range(nr):
        seed = seeds[r]
        # Any slot of the buffer (slot 0 included) is a predecessor; anything else is the chain head.
        seeded = 0 <= seed < num_slots
        running, prev_pos = HEAD, np.int64(0)
        if seeded:
            running = link(words[seed, PREV_HASH], words[seed, TOKEN], words[seed, POSITION])
            prev_pos = words[seed, POSITION]
        for i in range(max(offs[r], 0), min(offs[r + 1], num_tokens)):
            s, tok, pos = locs[i], ids[i], poss[i]
            if s < 0:
                continue  # a skipped entry: no checks, no record, the chain does not move
            processed += 1
            want_tok = exp_ids[i] if has_exp_ids else tok
            want_pos = exp_pos[i] if has_exp_pos else pos
            reason = (WRITE_TOKEN_BAD if tok != want_tok else 0) | (WRITE_POS_BAD if pos != want_pos else 0)
            if reason:
                push(rows, widx, tag, s, pos, tok, want_tok, running, want_pos, reason)
            if check_chain and seeded:
                # prev_pos + 1 in uint64 wraps at INT64_MAX, where the reference's unbounded ints
                # never equal any int64: that case always jumps.
                nxt = np.int64(np.uint64(prev_pos) + np.uint64(1))
                if pos != nxt or prev_pos == INT64_MAX:
                    push(rows, widx, tag, s, pos, tok, tok, running, nxt, WRITE_POS_BAD)
                prev_pos = pos
            if s < num_slots:
                words[s, TOKEN], words[s, POSITION], words[s, PREV_HASH], words[s, REAL_KV_HASH] = (
                    tok, pos, running, fp[i])
                if attribution:
                    words[s, WRITER_ID] = writer_ids[r] if has_writer else -1
                    words[s, WRITER_STEP] = step_value
            running = link(running, tok, pos)
    counters[tag, ENTRIES] += processed


@jit
def accept(head, words, offs, nr, locs, fp, rewrites, has_rewrites):
    """accept_rewrites: a slot rewritten with the record it holds takes its real-KV hash from fp."""
    if nr <= 0:
        return
    num_slots, accepted = words.shape[0], 0
    for i in range(max(offs[0], 0), min(offs[nr], locs.shape[0])):
        s = locs[i]
        if 1 <= s < num_slots and head[s, TOKEN] == words[s, TOKEN] and head[s, POSITION] == words[s, POSITION] \
                and head[s, PREV_HASH] == words[s, PREV_HASH]:
            words[s, REAL_KV_HASH] = fp[i]
            accepted += 1
    if has_rewrites:
        rewrites[0] += accepted


@jit
def head(rows_, prefix, extend, rtt, table, has_table, tokens, valid, has_tokens, token_offset, window,
         slot, position, prev, expected, count, enable, requested, offs, seeds, words, check_token, rows, widx,
         counters, verify_tag, nr, locs, ids, poss, exp_ids, has_exp_ids, exp_pos, has_exp_pos, check_chain,
         attribution, writer_ids, has_writer, step_value, write_tag):
    """plan, then HEAD verify of its entries, then HEAD write of the new tokens: the three kernels above in
    one call (no real-KV hash at HEAD: zero fingerprints, as the separate calls pass)."""
    plan(rows_, prefix, extend, rtt, table, has_table, tokens, valid, has_tokens, token_offset, window,
         slot, position, prev, expected, count, enable, requested, offs, seeds)
    n = max(0, min(np.int64(count[0]), slot.shape[0])) if enable[0] else 0  # the entries verify reads
    verify(words, slot, position, prev, expected, enable, count, check_token, np.zeros(n, np.int64),
           rows, widx, counters, verify_tag)
    write(words, offs, seeds, nr, locs, ids, poss, exp_ids, has_exp_ids, exp_pos, has_exp_pos, check_chain,
          attribution, writer_ids, has_writer, step_value, np.zeros(locs.shape[0], np.int64), rows, widx,
          counters, write_tag)


@jit
def tail(words, slot, position, prev, expected, enable, count, check_token, verify_fp, rows, widx, counters,
         verify_tag, offs, seeds, nr, locs, ids, poss, attribution, writer_ids, has_writer, step_value, write_fp,
         write_tag, step, head_words, has_accept, rewrites, has_rewrites):
    """accept_rewrites (``has_accept``; the write's fingerprints serve it), TAIL verify, TAIL write, then
    the device step + 1: the kernels above in one call (the real-KV fingerprints come computed, as the
    separate calls take them)."""
    if has_accept:
        accept(head_words, words, offs, nr, locs, write_fp, rewrites, has_rewrites)
    verify(words, slot, position, prev, expected, enable, count, check_token, verify_fp, rows, widx, counters,
           verify_tag)
    write(words, offs, seeds, nr, locs, ids, poss, _NO_INPUTS, False, _NO_INPUTS, False, False, attribution,
          writer_ids, has_writer, step_value, write_fp, rows, widx, counters, write_tag)
    step[0] += 1


# a kernel above compiles at its first call unless numba's disk cache holds it: say so once (numba_cache.py)
numba_cache.announce(globals())
