"""Fault injection (SPEC 5): seeded perturbations that prove the canary is live, with ground truth.

Five kinds, each off by default and fired per step with its ``inject_*_prob`` after
``inject_warmup`` forwards (docs/fault_injection.md):

| kind   | perturbation                                                | expected violation     |
|--------|-------------------------------------------------------------|------------------------|
| table  | a req_to_token cell this forward reads -> another live slot | verify_chain_hash, HEAD |
| kv     | flip a KV byte of a slot this forward reads                 | verify_real_kv_hash, TAIL |
| cached | flip a KV byte of a slot only the prefix cache holds        | verify_real_kv_hash, SWEEP |
| after  | flip a KV byte of a slot just written, after the forward    | verify_real_kv_hash, next TAIL |
| swap   | swap two requests' next tokens at the sampler               | write_token only, HEAD |

Every perturbation is transient, so the engine's own bookkeeping stays sound: a table
cell is put back at the end of its step, a flipped byte is flipped back at the end of
the step whose check first read it (or dropped when the engine rewrites the slot).
Each injection is an ``Injection`` in ``Injector.records`` and one log line;
``kvcanary.runtime.recall.match`` pairs them with violations.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch

from kvcanary.format import RealKvMode, RecordField as R

log = logging.getLogger("kvcanary")
KINDS = ("table", "kv", "cached", "after", "swap")
FLIP_MASK = 0xFF  # a flip inverts every bit of one byte


@dataclass
class Injection:
    """Ground truth of one perturbation.

    Attributes:
        kind: one of ``KINDS``.
        step: the ``Violation.step`` a violation found in the perturbed forward carries.
        slot: slot perturbed (table: the cell's new value; swap: the slot the token went to, -1 until known).
        position: sequence position of the cell / slot (-1 when unknown).
        request: request id reading or writing it (the row without request ids; -1 for a cached slot).
        byte: byte offset flipped inside the slot's KV (-1 for table and swap).
        group: address space of ``slot`` ("full" or "swa").
        watch: (group, slot) pairs its violations land on.
        read_step: step of the first check that read the perturbed state (None: never read).
        end_step: last step the perturbation was visible (None: still in place).
        detail: what changed, e.g. "cell 7->12", "token 5->9", "k source 0 xor 0xff".
    """

    kind: str
    step: int
    slot: int
    position: int
    request: int
    byte: int = -1
    group: str = "full"
    watch: tuple[tuple[str, int], ...] = ()
    read_step: int | None = None
    end_step: int | None = None
    detail: str = ""

    def log_line(self) -> str:
        return (f"kv_canary injection: kind={self.kind} step={self.step} slot={self.slot} position={self.position} "
                f"request={self.request} byte={self.byte} group={self.group} detail={self.detail}")


@dataclass
class _Flip:
    record: Injection
    view: torch.Tensor  # uint8 [] element of the source's byte rows
    first_tail: int  # first step whose TAIL verify sees the flipped byte


class Injector:
    """Applies the configured perturbations to the engine a ``Canary`` guards (host side, syncs allowed)."""

    def __init__(self, canary):
        self.canary = canary
        self.cfg = cfg = canary.config
        self.rng = random.Random(cfg.inject_seed)
        self.records: list[Injection] = []
        self._cells: list[tuple[Injection, torch.Tensor, int, int, int, int]] = []  # rec, table, row, pos, old, new
        self._flips: list[_Flip] = []
        self._swaps: dict[int, tuple[Injection, int]] = {}  # request id -> (record, token fed)
        self._sweeps_seen = dict(canary.monitor.sweeps)
        self._check_config()

    # -- hooks (called by the Canary) ------------------------------------------------------------
    def before_forward(self, batch) -> None:
        """Host part before the forward: settle earlier injections, then table / kv / cached."""
        cfg, step = self.cfg, self.canary.step + 1
        self._note_sweeps(step)
        self._settle_swaps(batch, step)
        self._drop_rewritten(batch, step)
        if self.canary.step < cfg.inject_warmup:
            return
        if cfg.inject_table_prob and self.rng.random() < cfg.inject_table_prob:
            self._inject_table(batch, step)
        if cfg.inject_kv_prob and self.rng.random() < cfg.inject_kv_prob:
            reads = [r for r in self._reads(batch, cfg.inject_group) if not self._flipped(cfg.inject_group, r[0])]
            if reads:
                self._flip("kv", cfg.inject_group, *self.rng.choice(reads), step=step, first_tail=step)
        if cfg.inject_cached_prob and step % cfg.sweep_interval == 0:
            if self.canary.sweep_provider is None:
                raise ValueError("kv-canary: inject_cached_prob needs a sweep provider, got "
                                 "canary.sweep_provider=None at a sweep step (set it after creating the Canary)")
            if self.rng.random() < cfg.inject_cached_prob:
                self._inject_cached(batch, step)

    def after_forward(self, batch) -> None:
        """Host part after the forward (before the sweep): flip a byte of a slot just written."""
        cfg, step = self.cfg, self.canary.step
        if step - 1 < cfg.inject_warmup or not cfg.inject_after_prob or self.rng.random() >= cfg.inject_after_prob:
            return
        writes = [w for w in self._writes(batch, cfg.inject_group) if not self._flipped(cfg.inject_group, w[0])]
        if writes:
            self._flip("after", cfg.inject_group, *self.rng.choice(writes), step=step, first_tail=step + 1)

    def end_step(self, batch) -> None:
        """After the sweep, before the drain: note what the step's checks read and undo those perturbations."""
        step = self.canary.step
        full = self.canary._group("full")
        read = bool(full.plan.entries.enable.item())
        for rec, table, row, pos, old, new in self._cells:
            if int(table[row, pos]) == new:
                table[row, pos] = old
            rec.read_step = step if read else None
            rec.end_step = step
        self._cells.clear()
        self._note_sweeps(step)
        if self._flips:
            tails = {g.name: set(_entry_slots(g.plan.entries)) for g in self.canary.groups}
            for flip in [f for f in self._flips if f.first_tail <= step and f.record.slot in tails[f.record.group]]:
                self._settle_flip(flip, step)

    def perturb_next_tokens(self, request_ids, tokens):
        """With probability inject_swap_prob, swap two requests' sampled next tokens (list or 1-D tensor)."""
        cfg = self.cfg
        if not cfg.inject_swap_prob or self.canary.step < cfg.inject_warmup:
            return tokens
        if self.rng.random() >= cfg.inject_swap_prob:
            return tokens
        ids = _as_list(request_ids)
        toks = _as_list(tokens)
        if len(ids) != len(toks):
            raise ValueError(f"kv-canary: perturb_next_tokens request_ids and tokens must have one length, got "
                             f"{len(ids)} and {len(toks)}")
        free = [i for i in range(len(ids)) if ids[i] not in self._swaps]
        pairs = [(i, j) for i in free for j in free if i < j and toks[i] != toks[j]]
        if not pairs:
            return tokens
        i, j = self.rng.choice(pairs)
        out = tokens.clone() if isinstance(tokens, torch.Tensor) else list(tokens)
        out[i], out[j] = toks[j], toks[i]
        step = self.canary.step + 1
        for a, b in ((i, j), (j, i)):
            rec = self._record(Injection("swap", step, -1, -1, ids[a], detail=f"token {toks[a]}->{toks[b]}"))
            self._swaps[ids[a]] = (rec, toks[b])
        return out

    # -- the perturbations -----------------------------------------------------------------------
    def _inject_table(self, batch, step: int) -> None:
        table = batch.req_to_token
        rows, prefix, ids = _batch_lists(batch)
        cells = [(r, p) for r in range(len(rows)) if rows[r] != 0 for p in range(max(0, prefix[r] - 1))]
        reads = sorted({s for s, _, _ in self._reads(batch, "full")})
        if not cells or len(reads) < 2:
            return
        r, p = self.rng.choice(cells)
        row = rows[r]
        old, succ = int(table[row, p]), int(table[row, p + 1])
        buf = self.canary._group("full").bufs["tail", "k"].view(torch.int64)
        index = torch.tensor(reads + [old], dtype=torch.int64, device=buf.device)
        chains = buf.index_select(0, index)[:, :R.REAL_KV_HASH].tolist()
        # A slot whose record equals the cell's own (an identical unshared prefix) would not be a fault.
        news = [s for s, c in zip(reads, chains) if s != old and c != chains[-1]]
        if not news:
            return
        new = self.rng.choice(news)
        watch = [("full", new), ("full", succ)]
        swa = self.canary.groups[1] if len(self.canary.groups) > 1 else None
        if swa is not None:
            watch += [("swa", int(swa.table[s])) for s in (new, succ) if int(swa.table[s]) > 0]
        rec = self._record(Injection("table", step, new, p, ids[r], watch=tuple(watch), detail=f"cell {old}->{new}"))
        table[row, p] = new
        self._cells.append((rec, table, row, p, old, new))

    def _inject_cached(self, batch, step: int) -> None:
        triples = self.canary.sweep_provider()
        if triples is None:
            return
        busy = {s for s, _, _ in self._reads(batch, "full")} | {s for s, _, _ in self._writes(batch, "full")}
        slots, positions = _as_list(triples[0]), _as_list(triples[1])
        idle = [(s, -1, p) for s, p in zip(slots, positions) if s > 0 and s not in busy and not self._flipped("full", s)]
        if idle:
            self._flip("cached", "full", *self.rng.choice(idle), step=step, first_tail=step + 1)

    def _flip(self, kind: str, group: str, slot: int, request: int, position: int, *, step: int,
              first_tail: int) -> None:
        g = self.canary._group(group)
        kv = self.rng.choice([kv for kv in g.kvs if g.sources[kv]])
        src = g.sources[kv][0]
        limit = src.read_bytes if self.canary.real_kv_mode == RealKvMode.ALL else 16
        byte = self.rng.randrange(limit)
        if slot >= src.num_slots:
            return
        view = src.byte_rows()[slot // src.page_size, (slot % src.page_size) * src.num_bytes_per_token + byte]
        view.bitwise_xor_(FLIP_MASK)
        rec = self._record(Injection(kind, step, slot, position, request, byte, group, ((group, slot),),
                                     detail=f"{kv} source 0 xor 0x{FLIP_MASK:02x}"))
        self._flips.append(_Flip(rec, view, first_tail))

    # -- settling --------------------------------------------------------------------------------
    def _settle_flip(self, flip: _Flip, step: int) -> None:
        flip.view.bitwise_xor_(FLIP_MASK)
        flip.record.read_step = flip.record.end_step = step
        self._flips.remove(flip)

    def _note_sweeps(self, step: int) -> None:
        """A sweep that ran since the last look read the slots in its entries."""
        now = self.canary.monitor.sweeps
        for g in self.canary.groups:
            if now[g.name] != self._sweeps_seen.get(g.name, 0):
                swept = set(_entry_slots(g.sweep_entries))
                for flip in [f for f in self._flips if f.record.group == g.name and f.record.slot in swept]:
                    self._settle_flip(flip, step)
        self._sweeps_seen = dict(now)

    def _drop_rewritten(self, batch, step: int) -> None:
        """A flipped slot the engine writes again before any check read it: the flip is gone unread."""
        if not self._flips:
            return
        written = {g.name: {s for s, _, _ in self._writes(batch, g.name)} for g in self.canary.groups}
        for flip in [f for f in self._flips if f.record.slot in written[f.record.group]]:
            flip.record.end_step = step - 1
            self._flips.remove(flip)

    def _settle_swaps(self, batch, step: int) -> None:
        if not self._swaps:
            return
        if batch.request_ids is None:
            raise ValueError("kv-canary: inject_swap_prob needs ForwardBatch.request_ids, got None")
        ids = batch.request_ids.tolist()
        hit = [rid for rid in ids if rid in self._swaps]
        if not hit:
            return
        if batch.expected_input_ids is None:
            raise ValueError("kv-canary: inject_swap_prob needs the token oracle (ForwardBatch.expected_input_ids), "
                             "got None")
        extend = batch.extend_lens.tolist()
        offsets = [0]
        for r, row in enumerate(batch.req_pool_indices.tolist()):
            offsets.append(offsets[-1] + (extend[r] if row != 0 and extend[r] > 0 else 0))
        for rid in hit:
            r = ids.index(rid)
            rec, token = self._swaps.pop(rid)
            if extend[r] <= 0:
                continue
            i = offsets[r]
            rec.slot, rec.position = int(batch.out_cache_loc[i]), int(batch.positions[i])
            rec.watch = (("full", rec.slot),)
            rec.end_step = step
            if int(batch.input_ids[i]) == token:
                rec.read_step = step

    # -- helpers ---------------------------------------------------------------------------------
    def _record(self, rec: Injection) -> Injection:
        self.records.append(rec)
        log.warning(rec.log_line())
        return rec

    def _flipped(self, group: str, slot: int) -> bool:
        return any(f.record.group == group and f.record.slot == slot for f in self._flips)

    def _reads(self, batch, group: str) -> list[tuple[int, int, int]]:
        """(slot, request, position) of every cell this forward verifies in ``group``."""
        g = self.canary._group(group)
        rows, prefix, ids = _batch_lists(batch)
        table = None if g.table is None else g.table.tolist()
        out = []
        for r, row in enumerate(rows):
            if row == 0 or prefix[r] <= 0:
                continue
            start = max(0, prefix[r] - g.window) if g.window else 0
            for p, cell in enumerate(batch.req_to_token[row, start:prefix[r]].tolist(), start):
                slot = _translate(cell, table)
                if slot > 0:
                    out.append((slot, ids[r], p))
        return out

    def _writes(self, batch, group: str) -> list[tuple[int, int, int]]:
        """(slot, request, position) of every token this forward writes in ``group``."""
        g = self.canary._group(group)
        table = None if g.table is None else g.table.tolist()
        rows, _, ids = _batch_lists(batch)
        extend = batch.extend_lens.tolist()
        owner = [ids[r] for r in range(len(rows)) if rows[r] != 0 for _ in range(max(0, extend[r]))]
        locs, positions = batch.out_cache_loc.tolist(), batch.positions.tolist()
        out = []
        for i, loc in enumerate(locs):
            slot = _translate(loc, table) if loc >= 0 else -1
            if slot > 0:
                out.append((slot, owner[i] if i < len(owner) else -1, positions[i]))
        return out

    def _check_config(self) -> None:
        cfg, canary = self.cfg, self.canary
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


def _entry_slots(entries) -> list[int]:
    if not int(entries.enable.item()):
        return []
    n = min(int(entries.count.item()), entries.capacity)
    return entries.slot[:n].tolist()


def _batch_lists(batch):
    rows, prefix = batch.req_pool_indices.tolist(), batch.prefix_lens.tolist()
    ids = batch.request_ids.tolist() if batch.request_ids is not None else rows
    return rows, prefix, ids


def _translate(x: int, table: list[int] | None) -> int:
    return table[x] if table is not None and 0 <= x < len(table) else x


def _as_list(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x]
