"""Fault injection (SPEC 5): seeded perturbations that prove the canary is live, with ground truth.

Five kinds, each off by default and fired per step with its ``inject_*_prob`` after
``inject_warmup`` forwards (docs/fault_injection.md):

| kind   | perturbation                                                | expected violation         |
|--------|-------------------------------------------------------------|----------------------------|
| table  | a req_to_token cell this forward reads -> another live slot | verify_chain_hash, HEAD    |
| kv     | flip a KV byte of a slot this forward reads                 | verify_real_kv_hash, TAIL  |
| cached | flip a KV byte of a slot only the prefix cache holds        | verify_real_kv_hash, SWEEP |
| after  | flip a KV byte of a slot just written, after the forward    | verify_real_kv_hash, next TAIL/SWEEP |
| swap   | swap two requests' next tokens at the sampler               | write_token only, HEAD     |

Every perturbation is transient, so the engine's own bookkeeping stays sound: a table
cell is put back at the end of its step; a flipped byte is flipped back at the end of
the step whose check first read it, is dropped when the engine rewrites the slot, and
travels with the KV when the engine copies it (``copy_records``, ``restore_records``).
Each injection is an ``Injection`` in ``Injector.records`` and one log line;
``kvcanary.sim.recall.match`` pairs them with violations.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch

from kvcanary.format import RealKvMode, RecordField as R
from kvcanary.runtime.batch import batch_lists, translate_slot, verified_cells
from kvcanary.runtime.checks import check_injection

__all__ = ["KINDS", "Injection", "Injector"]
log = logging.getLogger("kvcanary")
FLIP_MASK = 0xFF  # a flip inverts every bit of one byte
KINDS = ("table", "kv", "cached", "after", "swap")


@dataclass
class Injection:
    """Ground truth of one perturbation (what ``Injector`` records; ``kvcanary.sim.recall`` scores them).

    Attributes:
        kind: one of ``KINDS``.
        step: the ``Violation.step`` a violation found in the perturbed forward carries.
        slot: slot perturbed (table: the cell's new value; swap: the slot the token went to, -1 until known).
        position: sequence position of the cell / slot (-1 when unknown).
        request: request id reading or writing it (the row without request ids; -1 for a cached slot).
        byte: byte offset flipped inside the slot's KV (-1 for table and swap).
        group: address space of ``slot`` ("full" or "swa").
        watch: (group, slot) pairs its violations land on (a flipped byte the engine copied adds its copies).
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
    group: str
    slot: int
    kv: str
    view: torch.Tensor  # uint8 [] the flipped byte inside the source's byte rows
    flipped: int  # its value while flipped
    first_tail: int  # first step whose TAIL verify sees it
    canary_record: list[int]  # the slot's TAIL record when flipped (to follow it through save/restore)


class Injector:
    """Applies the configured perturbations to the engine a ``Canary`` guards (host side, syncs allowed)."""

    def __init__(self, canary):
        self.canary = canary
        self.cfg = cfg = canary.config
        self.rng = random.Random(cfg.inject_seed)
        self.records: list[Injection] = []
        self._cells: list[tuple[Injection, torch.Tensor, int, int, int, int]] = []  # rec, table, row, pos, old, new
        self._flips: list[_Flip] = []
        self._history: list[_Flip] = []  # every flip made: offloaded KV may bring its byte back later
        self._swaps: dict[int, tuple[Injection, int]] = {}  # request id -> (record, token fed)
        self._sampler_calls = 0
        self._sweeps_seen = dict(canary.monitor.sweeps)
        check_injection(self.cfg, self.canary)

    # -- hooks (called by the Canary) ------------------------------------------------------------
    def before_forward(self, batch) -> None:
        """Host part before the forward: settle earlier injections, then table / kv / cached."""
        cfg, step = self.cfg, self.canary.step + 1
        self._note_sweeps(step)
        self._settle_swaps(batch, step)
        if self._flips:
            for g in self.canary.groups:
                self._drop(g.name, {s for s, _, _ in self._writes(batch, g.name)}, step - 1)
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
        read = bool(self.canary._group("full").plan.entries.enable.item())
        for rec, table, row, pos, old, new in self._cells:
            if int(table[row, pos]) == new:
                table[row, pos] = old
            rec.read_step = step if read else None
            rec.end_step = step
        self._cells.clear()
        self._note_sweeps(step)
        if self.cfg.inject_swap_prob and not self._sampler_calls and step == self.cfg.inject_warmup + 32:
            log.warning("kv_canary injection: inject_swap_prob is set but the engine has not called "
                        "Canary.perturb_next_tokens in %d steps: no token swap can happen", step)
        if self._flips:
            tails = {g.name: set(_entry_slots(g.plan.entries)) for g in self.canary.groups}
            for flip in [f for f in self._flips if f.first_tail <= step and f.slot in tails[f.group]]:
                self._settle(flip, step)

    def follow_copy(self, src: torch.Tensor, dst: torch.Tensor, group: str) -> None:
        """The engine copied KV (and records) from src to dst slots: a flipped byte goes along."""
        if not self._flips:
            return
        moved = [(f, d) for f in self._flips if f.group == group for s, d in zip(src.tolist(), dst.tolist())
                 if s == f.slot]
        self._drop(group, set(dst.tolist()), self.canary.step)
        for flip, d in moved:
            self._follow(flip, d)

    def follow_restore(self, saved: dict, slots: torch.Tensor, group: str) -> None:
        """Offloaded KV came back into ``slots``: a byte flipped when it was saved comes back too.

        The saved records identify the write (token, position, chain, hash, writer); whether the
        saved bytes held the flip is settled when a check reads the slot (``_settle``).
        """
        if not self._history:
            return
        dst = slots.tolist()
        self._drop(group, set(dst), self.canary.step)
        where: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        for kv in {f.kv for f in self._history if f.group == group}:
            for i, row in enumerate(saved[("tail", kv)].view(torch.int64).tolist()):
                where.setdefault((kv, tuple(row)), []).append(i)
        for flip in [f for f in self._history if f.group == group]:
            for i in where.get((flip.kv, tuple(flip.canary_record)), []):
                self._follow(flip, dst[i])

    def perturb_next_tokens(self, request_ids, tokens, positions=None):
        """With probability inject_swap_prob, swap two requests' sampled next tokens (lists or 1-D tensors).

        ``positions`` (optional) are the positions the tokens will be fed at; without them a
        swapped token is taken to be the first token its request feeds next.
        """
        cfg = self.cfg
        self._sampler_calls += 1
        if not cfg.inject_swap_prob or self.canary.step < cfg.inject_warmup:
            return tokens
        if self.rng.random() >= cfg.inject_swap_prob:
            return tokens
        ids, toks = _as_list(request_ids), _as_list(tokens)
        pos = _as_list(positions) if positions is not None else [-1] * len(ids)
        if not len(ids) == len(toks) == len(pos):
            raise ValueError(f"kv-canary: perturb_next_tokens request_ids, tokens and positions must have one "
                             f"length, got {len(ids)}, {len(toks)} and {len(pos)}")
        free = [i for i in range(len(ids)) if ids[i] not in self._swaps]
        pairs = [(i, j) for i in free for j in free if i < j and toks[i] != toks[j]]
        if not pairs:
            return tokens
        i, j = self.rng.choice(pairs)
        out = tokens.clone() if isinstance(tokens, torch.Tensor) else list(tokens)
        out[i], out[j] = toks[j], toks[i]
        step = self.canary.step + 1
        for a, b in ((i, j), (j, i)):
            rec = self._record(Injection("swap", step, -1, pos[a], ids[a], detail=f"token {toks[a]}->{toks[b]}"))
            self._swaps[ids[a]] = (rec, toks[b])
        return out

    # -- the perturbations -----------------------------------------------------------------------
    def _inject_table(self, batch, step: int) -> None:
        table = batch.req_to_token
        rows, prefix, ids = batch_lists(batch)
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
        idle = [(s, -1, p) for s, p in zip(slots, positions)
                if s > 0 and s not in busy and not self._flipped("full", s)]
        if idle:
            self._flip("cached", "full", *self.rng.choice(idle), step=step, first_tail=step + 1)

    def _flip(self, kind: str, group: str, slot: int, request: int, position: int, *, step: int,
              first_tail: int) -> None:
        g = self.canary._group(group)
        kv = self.rng.choice([kv for kv in g.kvs if g.sources[kv]])
        src = g.sources[kv][0]
        byte = self.rng.randrange(src.read_bytes if self.canary.real_kv_mode == RealKvMode.ALL else 16)
        view = self._byte(group, kv, slot, byte)
        if view is None:
            return
        view.bitwise_xor_(FLIP_MASK)
        rec = self._record(Injection(kind, step, slot, position, request, byte, group, ((group, slot),),
                                     detail=f"{kv} source 0 xor 0x{FLIP_MASK:02x}"))
        canary_record = g.bufs["tail", kv][slot].view(torch.int64).tolist()
        flip = _Flip(rec, group, slot, kv, view, int(view), first_tail, canary_record)
        self._flips.append(flip)
        self._history.append(flip)

    def _follow(self, flip: _Flip, slot: int) -> None:
        view = self._byte(flip.group, flip.kv, slot, flip.record.byte)
        if view is None or self._flipped(flip.group, slot):
            return
        flip.record.watch += ((flip.group, slot),)
        flip.record.end_step = None
        self._flips.append(_Flip(flip.record, flip.group, slot, flip.kv, view, flip.flipped, self.canary.step + 1,
                                 flip.canary_record))

    # -- settling --------------------------------------------------------------------------------
    def _settle(self, flip: _Flip, step: int) -> None:
        """A check read the slot: undo the flip (if the byte still is the flipped one, the check saw it)."""
        if int(flip.view) == flip.flipped:
            flip.view.bitwise_xor_(FLIP_MASK)
            if flip.record.read_step is None:
                flip.record.read_step = step
        self._remove(flip, step)

    def _drop(self, group: str, slots: set[int], last_step: int) -> None:
        """The engine rewrites ``slots``: flips there are gone, unread."""
        for flip in [f for f in self._flips if f.group == group and f.slot in slots]:
            self._remove(flip, last_step)

    def _remove(self, flip: _Flip, step: int) -> None:
        self._flips.remove(flip)
        if not any(f.record is flip.record for f in self._flips):
            flip.record.end_step = max(step, flip.record.end_step or step)

    def _note_sweeps(self, step: int) -> None:
        """A sweep that ran since the last look read the slots in its entries."""
        now = self.canary.monitor.sweeps
        for g in self.canary.groups:
            if now[g.name] != self._sweeps_seen.get(g.name, 0):
                swept = set(_entry_slots(g.sweep_entries))
                for flip in [f for f in self._flips if f.group == g.name and f.slot in swept]:
                    self._settle(flip, step)
        self._sweeps_seen = dict(now)

    def _settle_swaps(self, batch, step: int) -> None:
        """A swapped token reaches the forward that feeds it: note its slot (and position)."""
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
        extend, positions = batch.extend_lens.tolist(), batch.positions.tolist()
        offsets = [0]
        for r, row in enumerate(batch.req_pool_indices.tolist()):
            offsets.append(offsets[-1] + (extend[r] if row != 0 and extend[r] > 0 else 0))
        for rid in hit:
            r = ids.index(rid)
            rec, token = self._swaps[rid]
            fed = range(offsets[r], offsets[r + 1])
            at = [i for i in fed if positions[i] == rec.position] if rec.position >= 0 else list(fed)[:1]
            if not at:
                continue  # an earlier chunk of the request (its swapped token comes later)
            i = at[0]
            del self._swaps[rid]
            rec.slot, rec.position = int(batch.out_cache_loc[i]), positions[i]
            rec.watch = (("full", rec.slot),)
            rec.end_step = step
            if int(batch.input_ids[i]) == token:
                rec.read_step = step

    # -- helpers ---------------------------------------------------------------------------------
    def _record(self, rec: Injection) -> Injection:
        self.records.append(rec)
        log.warning(rec.log_line())
        return rec

    def _byte(self, group: str, kv: str, slot: int, byte: int) -> torch.Tensor | None:
        """The uint8 element holding ``byte`` of ``slot``'s KV in the group's first ``kv`` source."""
        src = self.canary._group(group).sources[kv][0]
        if not 0 < slot < src.num_slots:
            return None
        return src.byte_rows()[slot // src.page_size, (slot % src.page_size) * src.num_bytes_per_token + byte]

    def _flipped(self, group: str, slot: int) -> bool:
        return any(f.group == group and f.slot == slot for f in self._flips)

    def _reads(self, batch, group: str) -> list[tuple[int, int, int]]:
        """(slot, request, position) of every cell this forward verifies in ``group``."""
        g = self.canary._group(group)
        return [(slot, rid, p) for rid, p, slot, _ in verified_cells(batch, g.window, g.table) if slot > 0]

    def _writes(self, batch, group: str) -> list[tuple[int, int, int]]:
        """(slot, request, position) of every token this forward writes in ``group``."""
        g = self.canary._group(group)
        table = None if g.table is None else g.table.tolist()
        rows, _, ids = batch_lists(batch)
        extend = batch.extend_lens.tolist()
        owner = [ids[r] for r in range(len(rows)) if rows[r] != 0 for _ in range(max(0, extend[r]))]
        out = []
        for i, (loc, pos) in enumerate(zip(batch.out_cache_loc.tolist(), batch.positions.tolist())):
            slot = translate_slot(loc, table) if loc >= 0 else -1
            if slot > 0:
                out.append((slot, owner[i] if i < len(owner) else -1, pos))
        return out


def _entry_slots(entries) -> list[int]:
    if not int(entries.enable.item()):
        return []
    n = min(int(entries.count.item()), entries.capacity)
    return entries.slot[:n].tolist()


def _as_list(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x]
