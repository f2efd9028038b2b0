"""The host side of a ``Canary``: drain violations, attribute them, health checks and stats."""

from __future__ import annotations

import logging

import torch

from kvcanary.format import (
    ATTRIBUTION_STRIDE,
    CHAIN_HEAD,
    VIOLATION_COUNT_LIMIT,
    FailReason,
    LaunchTag,
    RecordField as R,
    link,
    to_unsigned,
)
from kvcanary.ops.api import resolve_backend
from kvcanary.runtime import readers
from kvcanary.runtime.abort import Aborts
from kvcanary.runtime.allocator import is_allocator_row
from kvcanary.runtime.batch import batch_lists, verified_cells
from kvcanary.runtime.observer import NUM_SLOTS, HostObserver, Observation
from kvcanary.runtime.report import (CHECK_REASONS, SLOT_REASONS, KvCanaryHealthError, KvCanaryViolationError,
                                     Violation)
from kvcanary.runtime.write_check import check_attribution

log = logging.getLogger("kvcanary")
# Batches remembered for reader attribution of late observations: a step's observation is drained at
# the latest when its snapshot slot comes round again, NUM_SLOTS snapshots later.
KEEP_BATCHES = NUM_SLOTS + 1
# writes the write check found wrong, remembered to tell their later readers' rows apart (``written_wrong``): the
# newest this many (an engine that stores wrong bytes at every step would otherwise grow the set for as long as it
# serves; a reader of an older one is still reported, without the flag)
KEEP_WRONG_WRITES = 1 << 16


class Monitor:
    def __init__(self, canary, on_violation=None, on_abort=None):
        self.canary = canary
        self.on_violation = on_violation
        self.aborts = Aborts(on_abort)
        watched = {"counters": canary.counters, "rewrites": canary.rewrites}
        for g in canary.groups:
            watched[f"plan_count_{g.name}"] = g.plan.entries.requested
        # the buffers whose records name a row's writer: a late drain reads them as the step's close left them
        attributable = {(g.name, phase, kv): buf for g in canary.groups for (phase, kv), buf in g.bufs.items()
                        if buf.shape[1] >= ATTRIBUTION_STRIDE}
        # (and the sliding group's full->SWA table, refilled every step: a late drain finds a row's reader in the
        # table of the row's step)
        tables = {g.name: g.table for g in canary.groups if g.table is not None}
        self.observer = HostObserver(canary.ring, watched, records=attributable, tables=tables,
                                     backend=resolve_backend(canary.config.backend, canary.device))
        self._count_keys = [(g, f"plan_count_{g.name}") for g in canary.groups]
        self.violations: list[Violation] = []
        self.total_violations = 0
        self.forwards = 0
        self.tokens = 0
        self.sweeps = {g.name: 0 for g in canary.groups}
        self.batches: dict[int, object] = {}
        self.last_observation = None  # the newest drained one: its counters (counters, counters_meta)
        self.last_health: tuple[dict, list[list[int]]] | None = None
        self.overflowing = {g.name: False for g in canary.groups}
        self.written_wrong: dict[tuple, None] = {}  # the writes a write_kv row found wrong (_write_key), in order
        self.health_problems: list[str] = []
        self._taken: dict = {}  # rows of the observation being decoded -> cells named so far (readers.assign)

    @property
    def counters(self) -> list[list[int]] | None:
        """Device launch counters at the newest drained snapshot (per launch tag: launches, entries)."""
        obs = self.last_observation
        return None if obs is None else obs.values["counters"]

    @property
    def counters_meta(self) -> dict | None:
        """Host facts (forwards, sweeps) at the counters' snapshot."""
        obs = self.last_observation
        return None if obs is None else obs.host_meta

    # -- step bookkeeping ------------------------------------------------------------------------
    def note_forward(self, batch) -> None:
        self.forwards += 1
        self.tokens += batch.num_tokens - self.canary.padding_tokens
        self.batches[self.canary.step] = batch
        self.batches.pop(self.canary.step - KEEP_BATCHES, None)

    def note_sweep(self, group: str) -> None:
        self.sweeps[group] += 1

    def close_step(self, health: bool = True, before=None, slot=None, done=()) -> None:
        """Snapshot the step for the one-step-late drain (``Canary._close``); ``health=False`` only takes the
        ring (a flush after sweeps outside a forward); ``before``: a deferred launch sequence (key, body) that
        runs first, in the same captured graph (``HostObserver.snapshot``). ``slot``: the snapshot's copy into
        it (``HostObserver.take_slot``, which also gave ``done``) ran inside the caller's own captured sequence
        (the transformers adapter's fused steady steps): it is recorded on the current stream instead."""
        if slot is None:
            self._process(self.observer.snapshot(self.canary.step, self._meta(), before))
        else:
            self._process(list(done) + self.observer.taken(slot, self.canary.step, self._meta()))
        if health:
            self._periodic()

    def drain_open(self, batch, step: int) -> None:
        """The ring so far as the open forward's (``step``, reading ``batch``) own observation, drained with
        every pending one (``Canary.check_reads_now``); the ring starts again for the step's close."""
        self.batches[step] = batch  # reader attribution before the forward closes (note_forward sets it again)
        self._process(self.observer.snapshot(step, self._meta()))
        self.flush()

    def _meta(self) -> dict:
        return {"forwards": self.forwards, "sweeps": dict(self.sweeps)}

    def _periodic(self) -> None:
        cfg, step = self.canary.config, self.canary.step
        if cfg.health_interval and step >= cfg.warmup_steps and step % cfg.health_interval == 0:
            self.check_health()
        if cfg.stats_interval and step % cfg.stats_interval == 0:
            log.info(self.stats_line())

    def poll(self) -> None:
        self._process(self.observer.collect(block=False))

    def flush(self) -> None:
        self._process(self.observer.collect(block=True))

    # -- draining --------------------------------------------------------------------------------
    def _process(self, observations: list[Observation]) -> None:
        fresh: list[Violation] = []
        leads: list[bool] = []  # per violation: the first of its identical rows (readers.group)
        total = 0
        for obs in observations:
            self.last_observation = obs
            self._note_overflow(obs)
            if not obs.count:
                continue
            total += obs.count
            if obs.count > len(obs.rows):
                at_least = "at least " if obs.count >= VIOLATION_COUNT_LIMIT else ""  # the count saturates
                log.warning("kv_canary ring overflow at step %d: %s%d violations, %d rows kept "
                            "(raise KV_CANARY_RING_CAPACITY)", obs.step, at_least, obs.count, len(obs.rows))
            self._taken = {}  # (this observation's reader assignment: _reader)
            decoded, lead = readers.group(obs.rows, [self._decode(row, obs.step, (obs, i))
                                                     for i, row in enumerate(obs.rows)])
            fresh.extend(decoded)
            leads.extend(lead)
        if not total:
            return
        self.total_violations += total
        self.violations.extend(fresh)
        blocks = 0
        for v, lead in zip(fresh, leads):
            log.warning(v.log_line())
            # one readable block per group of identical rows (every reader of one bad slot: readers.py)
            if lead and blocks < self.canary.config.report_blocks:
                blocks += 1
                log.warning(v.block())
            if self.on_violation is not None:
                self.on_violation(v)
        if self.canary.config.mode == "abort":
            self.aborts.dispatch(fresh)
        if self.canary.config.mode == "raise":
            raise KvCanaryViolationError(fresh, total)

    def _note_overflow(self, obs: Observation) -> None:
        small, layout = obs.small, obs.layout
        for g, key in self._count_keys:
            count = small[layout[key][0]]  # (Observation.first without its call: once per step)
            over = count > g.plan.entries.capacity
            if over and not self.overflowing[g.name]:
                log.warning("kv_canary plan overflow (%s group) at step %d: %d verify entries > capacity %d; "
                            "verify skipped until it fits (raise KV_CANARY_PLAN_CAPACITY)", g.name, obs.step,
                            count, g.plan.entries.capacity)
            self.overflowing[g.name] = over

    def _decode(self, row: list[int], step: int, closed: tuple | None = None) -> Violation:
        """``closed``: (the observation, the row's index in it): the records and tables as the row's step closed
        them, where the observation kept them (a late drain); else the buffers are read as they are now."""
        if is_allocator_row(row):
            return self.canary.allocator.decode(row, step)
        try:
            tag = LaunchTag(row[0])
        except ValueError:
            return Violation.from_row(row, step)
        phase, kv, group = tag.name.lower().split("_")
        try:
            if row[7] & CHECK_REASONS:  # the write and attention checks' rows (docs/write_check.md)
                if row[7] & FailReason.WRITE_KV:  # (the check marked the slot's record: its later reads fail)
                    self._wrong_write(_write_key(group, row[1], row[5], step, row[2]))
                return Violation.from_row(row, step, **check_attribution(self.canary, row, step))
            if row[7] & SLOT_REASONS:  # the slot checks' rows (runtime/slots.py) have layouts of their own
                return Violation.from_row(row, step, **self.canary.slots.attribution(row, step, self))
            rec = self._record(row[1], phase, kv, group, closed)
            attribution = self._writer(row, phase, rec)
            if row[7] & FailReason.VERIFY_REAL_KV_HASH and group == "full" and self.canary.slots.is_poisoned(row[1]):
                attribution["poisoned"] = True
            if row[7] & FailReason.VERIFY_REAL_KV_HASH and self.written_wrong:
                # a record the write check marked, or a copy of it (a fork's block copy carries the record): the
                # record's writer, step and position name the write (a write since then stored another record)
                attribution["written_wrong"] = self._record_key(row[1], group, rec) in self.written_wrong
            if phase != "sweep" and not (row[7] & 24):
                attribution.update(self._reader(row, step, group, kv, phase, closed))
            elif phase != "sweep":
                attribution.update(self._slot_position(row, step, group))
                if "writer_request" not in attribution:  # (a record another write replaced, or slot 0's)
                    attribution.update(self._batch_writer(row, step))
        except Exception as e:  # attribution is a courtesy: the violation itself must never be lost
            log.error("kv_canary: attribution of a violation at step %d failed (%s: %s); reported without it",
                      step, type(e).__name__, e)
            attribution = {}
        return Violation.from_row(row, step, **attribution)

    def _wrong_write(self, key: tuple) -> None:
        wrong = self.written_wrong
        wrong[key] = None
        if len(wrong) > KEEP_WRONG_WRITES:  # (the oldest goes first: dicts keep insertion order)
            del wrong[next(iter(wrong))]

    def _record(self, slot: int, phase: str, kv: str, group: str, closed=None) -> list[int] | None:
        """The slot's record words as the row's step closed it (None where records keep no writer, or the slot
        is outside the buffer)."""
        key = (group, "tail" if phase == "sweep" else phase, kv)
        buf = self.canary._group(group).bufs[key[1:]]
        if buf.shape[1] < ATTRIBUTION_STRIDE or not 0 <= slot < buf.shape[0]:
            return None
        rec = None if closed is None else _closed_record(*closed, key)
        return buf[slot].view(torch.int64).tolist() if rec is None else rec

    @staticmethod
    def _record_key(slot: int, group: str, rec: list[int] | None) -> tuple | None:
        """The slot's record as the write that stored it (``_write_key``), None where records keep no writer."""
        if rec is None:
            return None
        return _write_key(group, slot, rec[R.WRITER_ID], rec[R.WRITER_STEP] + 1, rec[R.POSITION])

    @staticmethod
    def _writer(row, phase, rec: list[int] | None) -> dict:
        """Who last wrote the slot's record, and at which forward (counted from 1, as violation steps)."""
        if rec is None or rec[R.WRITER_ID] == -1 or not any(rec):  # unattributed, or never written (an empty record)
            return {}
        out = {"writer_request": rec[R.WRITER_ID], "writer_step": rec[R.WRITER_STEP] + 1}
        if rec[R.TOKEN] != row[3] or rec[R.POSITION] != row[2]:
            if phase != "tail" or row[7] & 24:
                return {}
            # A TAIL verify runs before the step's TAIL write: the record was rewritten by the write that
            # changed the slot's KV in this same forward. Its writer is the one to name.
            out.update(writer_token=rec[R.TOKEN], writer_position=rec[R.POSITION])
        return out

    def _reader(self, row: list[int], step: int, group: str, kv: str, phase: str, closed=None) -> dict:
        """The request whose table reads the slot in a way that fails the row's checks: two requests may
        map one slot (the legitimate owner and the reader of the wrong KV), and only the latter's
        position, expected token and predecessor give the row's failures."""
        batch = self.batches.get(step)
        if batch is None:
            return {}
        slot, bits = row[1], row[7]
        g = self.canary._group(group)
        buf = g.bufs[phase, kv]
        rows = batch.req_pool_indices.tolist()
        tables = None if closed is None else closed[0].tables
        table = g.table if tables is None or group not in tables else tables[group]
        cells = verified_cells(batch, g.window, table)
        if g.table is None:
            cells += _new_cells(batch)  # after the prefix: an adapter may also verify the new tokens' reads
        candidates = [c for c in cells if c[2] == slot]
        if not candidates:
            return {}
        row_of = dict(zip(batch_lists(batch)[2], rows))
        tokens = self.canary.token_table

        def expected_token(c):
            r = row_of.get(c[0])
            return int(tokens[r, c[1]]) if r is not None and 0 <= c[1] < tokens.shape[1] else None

        position_failed = bool(bits & FailReason.VERIFY_POSITION)
        tests = [lambda c: (c[1] != row[2]) == position_failed]
        if bits & FailReason.VERIFY_TOKEN:
            tests.append(lambda c: expected_token(c) == row[4])
        if bits & FailReason.VERIFY_CHAIN_HASH:
            tests.append(lambda c: _expected_prev_hash(buf, c[3]) == to_unsigned(row[6]))
        matched = candidates
        for test in tests:  # each narrows the candidates, unless it would leave none
            kept = [c for c in matched if test(c)]
            matched = kept or matched
        # Each failing verify entry wrote a row of its own: rows identical in content (several requests
        # reading one bad slot alike, e.g. forks of one parent) name the matching cells one each, in batch
        # order (readers.py).
        cell = readers.assign(self._taken, step, row, matched + [c for c in candidates if c not in matched])
        return {"reader_request": cell[0], "reader_position": cell[1]}

    def _slot_position(self, row: list[int], step: int, group: str) -> dict:
        """For a write-time row: the position whose slot the writing request's table says this is."""
        batch = self.batches.get(step)
        if batch is None or group != "full":
            return {}
        slot, position = row[1], row[2]
        rows, prefix, _ = batch_lists(batch)
        extend = batch.extend_lens.tolist()
        loc, pos = batch.out_cache_loc.tolist(), batch.positions.tolist()
        start = 0
        for r, q in enumerate(extend):
            hits = [k for k in range(start, start + q) if loc[k] == slot and pos[k] == position]
            start += q
            if not hits or rows[r] == 0:  # (padding writes nothing)
                continue
            width = min(prefix[r] + q, batch.req_to_token.shape[1])
            cells = batch.req_to_token[rows[r], :width].tolist()
            where = [p for p, c in enumerate(cells) if c == slot]
            if where:
                return {"slot_position": position if position in where else where[0]}
        return {}

    def _batch_writer(self, row: list[int], step: int) -> dict:
        """For a write-time row whose record names no writer: the step's request that wrote the row's token
        and position into its slot (mode "abort" fails it)."""
        batch = self.batches.get(step)
        if batch is None:
            return {}
        rows, _, ids = batch_lists(batch)
        hit = (batch.out_cache_loc == row[1]) & (batch.positions == row[2]) & (batch.input_ids == row[3])
        starts = batch.extend_lens.cumsum(0).tolist()
        for k in hit.nonzero().flatten().tolist():
            r = sum(1 for s in starts if s <= k)  # the request whose write entries hold entry k
            if r < len(rows) and rows[r] != 0:
                return {"writer_request": ids[r], "writer_step": step}
        return {}

    # -- health and stats ------------------------------------------------------------------------
    def expected_tags(self) -> list[str]:
        return [LaunchTag(g.tag(phase, kv)).name for g in self.canary.groups for kv in g.kvs
                for phase in ("head", "tail")]

    def check_health(self, force: bool = False) -> list[str]:
        """Compare device launch counters with the forwards and sweeps the host asked for."""
        if force:
            self.flush()
        if self.counters is None:
            return []
        # Counters arrive one step late on CUDA: compare them with the host facts of the same snapshot.
        meta, now = self.counters_meta, (self.counters_meta, self.counters)
        problems = []
        if self.last_health is not None:
            meta0, counters0 = self.last_health
            forwards = meta["forwards"] - meta0["forwards"]
            for name in self.expected_tags():
                ran = self.counters[LaunchTag[name]][0] - counters0[LaunchTag[name]][0]
                if forwards > 0 and ran == 0:
                    problems.append(f"{name} ran 0 launches over {forwards} forwards")
            for g in self.canary.groups:
                asked = meta["sweeps"][g.name] - meta0["sweeps"][g.name]
                for kv in g.kvs:
                    tag = g.tag("sweep", kv)
                    ran = self.counters[tag][0] - counters0[tag][0]
                    if asked > 0 and ran == 0:
                        problems.append(f"{LaunchTag(tag).name} ran 0 launches over {asked} sweeps")
        self.last_health = now
        aborted, failures = self.aborts.take_health()
        problems += failures
        if aborted:
            log.warning("kv_canary health: %d request(s) aborted since the last check (%d in all)", aborted,
                        len(self.aborts.aborted))
        self.health_problems.extend(problems)
        for p in problems:
            log.error("kv_canary health: %s", p)
        if problems and self.canary.config.mode == "raise":
            raise KvCanaryHealthError("kv-canary: health check failed: " + "; ".join(problems))
        return problems

    def stats(self) -> dict:
        counters = self.counters or [[0, 0]] * len(LaunchTag)
        obs = self.last_observation
        return {
            "step": self.canary.step,
            "forwards": self.forwards,
            "tokens_protected": self.tokens,
            "entries_checked": sum(c[1] for c in counters),
            "launches": {LaunchTag(i).name: c[0] for i, c in enumerate(counters) if c[0]},
            "sweeps": sum(self.sweeps.values()),
            "violations": self.total_violations,
            # write entries whose slot already held the same record (ops.accept_rewrites), one step late
            "idempotent_rewrites": 0 if obs is None else obs.values["rewrites"][0],
            **self.aborts.stats(),
            **self.canary.slots.stats(),
            **self.canary.write_check.stats(), **self.canary.attention_check.stats(),
            **self.canary.allocator.stats(),  # allocator checks run and their violations (docs/allocator.md)
        }

    def stats_line(self) -> str:
        s = self.stats()
        return (f"kv_canary stats: step={s['step']} tokens_protected={s['tokens_protected']} "
                f"entries_checked={s['entries_checked']} sweeps={s['sweeps']} violations={s['violations']} "
                f"aborted_requests={s['aborted_requests']}")


def _new_cells(batch) -> list[tuple[int, int, int, int]]:
    """(request id, position, slot, prev slot) of the new tokens' cells of req_to_token (host-side, reports only)."""
    rows, prefix, ids = batch_lists(batch)
    out = []
    for r, (row, q) in enumerate(zip(rows, batch.extend_lens.tolist())):
        if row == 0:  # (padding: its tokens read nothing)
            continue
        p0 = prefix[r]
        width = min(p0 + q, batch.req_to_token.shape[1])
        cells = batch.req_to_token[row, :width].tolist()
        out.extend((ids[r], p, cells[p], cells[p - 1] if p > 0 else -1) for p in range(p0, width))
    return out


def _expected_prev_hash(buf: torch.Tensor, prev: int) -> int | None:
    if prev == -1:
        return CHAIN_HEAD
    if not 0 < prev < buf.shape[0]:
        return None
    tok, pos, prev_hash = (to_unsigned(x) for x in buf[prev].view(torch.int64)[:3].tolist())
    return link(prev_hash, tok, pos)


def _closed_record(obs: Observation, i: int, key: tuple) -> list[int] | None:
    """Row ``i``'s record in buffer ``key`` as ``obs`` kept it, or None."""
    records = obs.records
    if records is None or key not in records or i >= len(records[key]):
        return None
    return records[key][i]


def _write_key(group: str, slot: int, writer: int, step: int, position: int) -> tuple:
    """One KV write: its writer request, forward and position (a copied record names the same write), or with no
    writer ids its slot."""
    return (group, writer, step, position) if writer >= 0 else (group, -1, step, position, slot)
