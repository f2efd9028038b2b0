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
from kvcanary.runtime.batch import verified_cells
from kvcanary.runtime.observer import HostObserver, Observation
from kvcanary.runtime.report import KvCanaryHealthError, KvCanaryViolationError, Violation

log = logging.getLogger("kvcanary")
KEEP_BATCHES = 6  # batches remembered for reader attribution of late observations


class Monitor:
    def __init__(self, canary, on_violation=None):
        self.canary = canary
        self.on_violation = on_violation
        watched = {"counters": canary.counters}
        for g in canary.groups:
            watched[f"plan_count_{g.name}"] = g.plan.entries.requested
        self.observer = HostObserver(canary.ring, watched)
        self.violations: list[Violation] = []
        self.total_violations = 0
        self.forwards = 0
        self.tokens = 0
        self.sweeps = {g.name: 0 for g in canary.groups}
        self.batches: dict[int, object] = {}
        self.counters: list[list[int]] | None = None
        self.counters_meta: dict | None = None  # host facts (forwards, sweeps) at the counters' snapshot
        self.last_health: tuple[dict, list[list[int]]] | None = None
        self.overflowing = {g.name: False for g in canary.groups}
        self.health_problems: list[str] = []

    # -- step bookkeeping ------------------------------------------------------------------------
    def note_forward(self, batch) -> None:
        self.forwards += 1
        self.tokens += batch.num_tokens
        self.batches[self.canary.step] = batch
        self.batches.pop(self.canary.step - KEEP_BATCHES, None)

    def note_sweep(self, group: str) -> None:
        self.sweeps[group] += 1

    def close_step(self, health: bool = True) -> None:
        """Snapshot the step for the one-step-late drain; ``health=False`` only takes the ring (a flush
        after sweeps outside a forward)."""
        meta = {"forwards": self.forwards, "sweeps": dict(self.sweeps)}
        self._process(self.observer.snapshot(self.canary.step, meta))
        if not health:
            return
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
        total = 0
        for obs in observations:
            self.counters, self.counters_meta = obs.values["counters"], obs.host_meta
            self._note_overflow(obs)
            if not obs.count:
                continue
            total += obs.count
            if obs.count > len(obs.rows):
                at_least = "at least " if obs.count >= VIOLATION_COUNT_LIMIT else ""  # the count saturates
                log.warning("kv_canary ring overflow at step %d: %s%d violations, %d rows kept "
                            "(raise KV_CANARY_RING_CAPACITY)", obs.step, at_least, obs.count, len(obs.rows))
            fresh.extend(self._decode(row, obs.step) for row in obs.rows)
        if not total:
            return
        self.total_violations += total
        self.violations.extend(fresh)
        for i, v in enumerate(fresh):
            log.warning(v.log_line())
            if i < self.canary.config.report_blocks:
                log.warning(v.block())
            if self.on_violation is not None:
                self.on_violation(v)
        if self.canary.config.mode == "raise":
            raise KvCanaryViolationError(fresh, total)

    def _note_overflow(self, obs: Observation) -> None:
        for g in self.canary.groups:
            count = obs.values[f"plan_count_{g.name}"][0]
            over = count > g.plan.entries.capacity
            if over and not self.overflowing[g.name]:
                log.warning("kv_canary plan overflow (%s group) at step %d: %d verify entries > capacity %d; "
                            "verify skipped until it fits (raise KV_CANARY_PLAN_CAPACITY)", g.name, obs.step,
                            count, g.plan.entries.capacity)
            self.overflowing[g.name] = over

    def _decode(self, row: list[int], step: int) -> Violation:
        try:
            tag = LaunchTag(row[0])
        except ValueError:
            return Violation.from_row(row, step)
        phase, kv, group = tag.name.lower().split("_")
        try:
            attribution = self._writer(row, phase, kv, group)
            if phase != "sweep" and not (row[7] & 24):
                attribution.update(self._reader(row, step, group, kv, phase))
        except Exception as e:  # attribution is a courtesy: the violation itself must never be lost
            log.error("kv_canary: attribution of a violation at step %d failed (%s: %s); reported without it",
                      step, type(e).__name__, e)
            attribution = {}
        return Violation.from_row(row, step, **attribution)

    def _writer(self, row, phase, kv, group) -> dict:
        g = self.canary._group(group)
        buf = g.bufs["tail" if phase == "sweep" else phase, kv]
        slot = row[1]
        if buf.shape[1] < ATTRIBUTION_STRIDE or not 0 <= slot < buf.shape[0]:
            return {}
        rec = buf[slot].view(torch.int64).tolist()
        # The record may have been rewritten since the row was taken; attribute only if it still matches.
        if rec[R.TOKEN] != row[3] or rec[R.POSITION] != row[2] or rec[R.WRITER_ID] == -1:
            return {}
        return {"writer_request": rec[R.WRITER_ID], "writer_step": rec[R.WRITER_STEP]}

    def _reader(self, row: list[int], step: int, group: str, kv: str, phase: str) -> dict:
        """The request whose table reads the slot; for chain failures, the one whose predecessor
        gives the expected hash (two requests may map the same slot)."""
        batch = self.batches.get(step)
        if batch is None:
            return {}
        slot = row[1]
        g = self.canary._group(group)
        buf = g.bufs[phase, kv]
        candidates = [(rid, p, prev) for rid, p, s, prev in verified_cells(batch, g.window, g.table) if s == slot]
        if row[7] & FailReason.VERIFY_CHAIN_HASH:
            matching = [c for c in candidates if _expected_prev_hash(buf, c[2]) == to_unsigned(row[6])]
            candidates = matching or candidates
        if not candidates:
            return {}
        return {"reader_request": candidates[0][0], "reader_position": candidates[0][1]}

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
        self.health_problems.extend(problems)
        for p in problems:
            log.error("kv_canary health: %s", p)
        if problems and self.canary.config.mode == "raise":
            raise KvCanaryHealthError("kv-canary: health check failed: " + "; ".join(problems))
        return problems

    def stats(self) -> dict:
        counters = self.counters or [[0, 0]] * len(LaunchTag)
        return {
            "step": self.canary.step,
            "forwards": self.forwards,
            "tokens_protected": self.tokens,
            "entries_checked": sum(c[1] for c in counters),
            "launches": {LaunchTag(i).name: c[0] for i, c in enumerate(counters) if c[0]},
            "sweeps": sum(self.sweeps.values()),
            "violations": self.total_violations,
        }

    def stats_line(self) -> str:
        s = self.stats()
        return (f"kv_canary stats: step={s['step']} tokens_protected={s['tokens_protected']} "
                f"entries_checked={s['entries_checked']} sweeps={s['sweeps']} violations={s['violations']}")


def _expected_prev_hash(buf: torch.Tensor, prev: int) -> int | None:
    if prev == -1:
        return CHAIN_HEAD
    if not 0 < prev < buf.shape[0]:
        return None
    tok, pos, prev_hash = (to_unsigned(x) for x in buf[prev].view(torch.int64)[:3].tolist())
    return link(prev_hash, tok, pos)
